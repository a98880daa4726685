"""An eager call computes what eager JAX computes, every time: a callback
built for a call is that call's, a closure committed to one device works as
under ``jax.jit``, and an identical repeat call compiles at most the one
program it runs (nothing is kept between calls). References: float64 NumPy
on the full batch, and the same call under ``jax.jit``."""

from __future__ import annotations

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest
from test_implicit_paths import _data  # the same rows and weights

from _helpers import Compiles
import weighted_accum as wa

N, D, ROWS, K = 8, 3, 32, 2
MESHES = {
  "auto": lambda: jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,)),
  "explicit": lambda: jax.make_mesh((N,), ("data",)),  # Explicit by default
}


def _ref(w, b, c):
  """d/dw of sum(m * (c x.w - y)**2) / sum(m), float64."""
  x, y, m = (np.asarray(b[k], np.float64) for k in "xym")
  r = c * (x @ np.float64(w)) - y
  return 2.0 * c * x.T @ (m * r) / m.sum()


def _scaled_loss(w, b, c):
  return jnp.sum(b["m"] * (c * (b["x"] @ w) - b["y"]) ** 2), jnp.sum(b["m"])


def _placed(mesh, w, b):
  return (
    jax.device_put(w, NamedSharding(mesh, P())),
    jax.device_put(b, NamedSharding(mesh, P("data"))),
  )


#: What ``loss_fn`` calls back into; set afresh before each call.
NOW = {}


def _callback_loss(w, b):
  """The scale read by a callback: the function object ``NOW`` holds."""
  c = jax.pure_callback(NOW["read"], jax.ShapeDtypeStruct((), jnp.float32))
  return _scaled_loss(w, b, c)


def _reader(c):
  """A callback built for one call (its repr hides the value it reads)."""

  def read():
    return np.float32(c)

  return read


def _grads(f, entry, w, b):
  """``f``'s mean gradient eagerly: ``f`` itself, or ``f.accumulate`` into
  a fresh stacked window closed by ``finish_mean``."""
  if entry == "f":
    return f(w, b)[1].grads
  _, state = f.accumulate(wa.init(w, axis_name="data"), w, b)
  return wa.finish_mean(state)[0].grads


@pytest.mark.parametrize("entry", ["f", "accumulate"])
@pytest.mark.parametrize("mesh", ["auto", "explicit"])
def test_a_callback_built_for_each_call_is_that_calls(mesh, entry):
  mesh = MESHES[mesh]()
  f = wa.microbatched_value_and_grad(
    _callback_loss, K, mode="sum", axis_name="data"
  )
  w, b = _data()
  with jax.set_mesh(mesh):
    wp, bp = _placed(mesh, w, b)
    for c in (1.0, 3.0):
      NOW["read"] = _reader(c)
      got = _grads(f, entry, wp, bp)
      np.testing.assert_allclose(got, _ref(w, b, c), rtol=1e-5, atol=1e-6)


def _logging_loss(w, b):
  io_callback(NOW["io"], None, ordered=False)
  jax.debug.callback(NOW["debug"])
  return _scaled_loss(w, b, 1.0)


@pytest.mark.parametrize("mesh", ["auto", "explicit"])
def test_io_and_debug_callbacks_log_every_call(mesh):
  """Each call's own loggers run (each once per replica and microbatch at
  least): the log holds every call's entries."""
  mesh = MESHES[mesh]()
  f = wa.microbatched_value_and_grad(
    _logging_loss, K, mode="sum", axis_name="data"
  )
  log = []
  w, b = _data(1)
  with jax.set_mesh(mesh):
    wp, bp = _placed(mesh, w, b)
    for call in range(3):
      NOW["io"] = lambda call=call: log.append(("io", call))
      NOW["debug"] = lambda call=call: log.append(("debug", call))
      jax.block_until_ready(f(wp, bp))
      jax.effects_barrier()
  for kind in ("io", "debug"):
    calls = [c for k, c in log if k == kind]
    assert sorted(set(calls)) == [0, 1, 2]
    assert all(calls.count(c) >= N * K for c in range(3))


@pytest.mark.parametrize("mesh", ["auto", "explicit"])
def test_a_closure_committed_to_one_device_works_as_under_jit(mesh):
  mesh = MESHES[mesh]()
  scale = jax.device_put(jnp.float32(3.0), jax.devices()[3])
  f = wa.microbatched_value_and_grad(
    lambda w, b: _scaled_loss(w, b, scale), K, mode="sum", axis_name="data"
  )
  w, b = _data(2)
  with jax.set_mesh(mesh):
    wp, bp = _placed(mesh, w, b)
    _, eager = f(wp, bp)
    _, jitted = jax.jit(f)(wp, bp)
  np.testing.assert_allclose(eager.grads, jitted.grads, rtol=1e-6)
  np.testing.assert_allclose(eager.grads, _ref(w, b, 3.0), rtol=1e-5)


@pytest.mark.parametrize("entry", ["f", "accumulate"])
def test_an_identical_repeat_call_compiles_one_program_at_most(entry):
  """Nothing is kept between eager calls, and nothing runs op by op: each
  call compiles the one program it runs."""
  mesh = MESHES["auto"]()
  f = wa.microbatched_value_and_grad(
    lambda w, b: _scaled_loss(w, b, 1.0), K, mode="sum", axis_name="data"
  )
  w, b = _data(3)
  with jax.set_mesh(mesh):
    wp, bp = _placed(mesh, w, b)
    jax.block_until_ready(_grads(f, entry, wp, bp))
    with Compiles() as n:
      got = jax.block_until_ready(_grads(f, entry, wp, bp))
  assert n.n <= 1
  np.testing.assert_allclose(got, _ref(w, b, 1.0), rtol=1e-5, atol=1e-6)
