"""init / from_buffers: shapes, dtypes, shardings, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import weighted_accum as wa


def _mesh():
  assert len(jax.devices()) == 8, "conftest must force 8 CPU devices"
  return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _sharded_params(mesh):
  specs = {
    "w": P("data", "model"),
    "b": P("model"),
    "r": P(),
    "v": P(None, "data"),
  }
  shapes = {"w": (8, 6), "b": (4,), "r": (3,), "v": (2, 4)}
  return {
    k: jax.device_put(
      jnp.arange(np.prod(shapes[k]), dtype=jnp.float32).reshape(shapes[k]),
      NamedSharding(mesh, specs[k]),
    )
    for k in specs
  }


def _assert_shardings(tree, params):
  for (path, b), p in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(params)
  ):
    assert b.sharding.is_equivalent_to(p.sharding, b.ndim), (
      jax.tree_util.keystr(path),
      b.sharding,
      p.sharding,
    )


def test_init_zero_buffers_in_work_dtype():
  params = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": [jnp.ones(4)]}
  state = wa.init(params, dtype=jnp.float32, loss_scale=128.0)
  assert state.grads["a"].dtype == jnp.float32
  assert state.grads["a"].shape == (2, 3) and state.grads["b"][0].shape == (4,)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(state.grads))
  assert float(state.loss_scale) == 128.0
  assert state.dtype == jnp.float32
  assert int(state.issued) == 0 and state.total_weight == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shardings_kept_through_every_call(variant, dtype):
  mesh = _mesh()
  params = _sharded_params(mesh)
  state = variant(wa.init, static_argnames="dtype")(params, dtype=dtype)
  _assert_shardings(state.grads, params)
  grads = jax.tree.map(lambda p: (p * 0.5).astype(jnp.bfloat16), params)
  state = variant(wa.accumulate_sum)(state, grads, 2.0)
  _assert_shardings(state.grads, params)
  state = variant(wa.accumulate_mean)(state, grads, 3.0)
  _assert_shardings(state.grads, params)
  out, new = variant(wa.finish_sums)(state)
  _assert_shardings(out.grads, params)
  _assert_shardings(new.grads, params)
  out, new = variant(wa.finish_mean)(state)
  _assert_shardings(out.grads, params)
  _assert_shardings(new.grads, params)
  # Values: (0.5 p * 1 + 0.5 p * 3) / 5, checked in float64.
  for k, p in params.items():
    ref = (
      np.asarray(jnp.asarray(np.asarray(p) * 0.5, jnp.bfloat16), np.float64)
      * 4
      / 5
    )
    np.testing.assert_allclose(
      np.asarray(out.grads[k], np.float64),
      ref,
      rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6,
    )


def test_init_under_eval_shape_is_abstract():
  params = {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32)}
  abstract = jax.eval_shape(wa.init, params)
  assert abstract.grads["w"].shape == (3, 2)
  assert abstract.issued.shape == () and abstract.issued.dtype == jnp.int32


def _state_with(params, weights=(3.0, 4.5)):
  state = wa.init(params)
  for w in weights:
    state = wa.accumulate_sum(state, jax.tree.map(jnp.ones_like, params), w)
  return state


def test_from_buffers_roundtrip_continues_window():
  params = {"a": jnp.zeros((2, 2)), "b": jnp.zeros(3)}
  state = _state_with(params)
  host = jax.tree.map(np.asarray, state.grads)
  counters = {k: np.asarray(v) for k, v in state.counters.items()}
  restored = wa.from_buffers(params, host, counters)
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.tree.map(np.asarray, restored),
    jax.tree.map(np.asarray, state),
  )
  # total_weight may replace the exact pair.
  r2 = wa.from_buffers(params, host, {"issued": 2, "total_weight": 7.5})
  assert r2.total_weight == 7.5 and int(r2.issued) == 2
  out1, _ = wa.finish_mean(
    wa.accumulate_sum(restored, jax.tree.map(jnp.ones_like, params), 1)
  )
  out2, _ = wa.finish_mean(
    wa.accumulate_sum(state, jax.tree.map(jnp.ones_like, params), 1)
  )
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.tree.map(np.asarray, out1.grads),
    jax.tree.map(np.asarray, out2.grads),
  )


def test_from_buffers_puts_host_buffers_on_param_sharding():
  mesh = _mesh()
  params = _sharded_params(mesh)
  state = _state_with(params)
  host = jax.tree.map(np.asarray, state.grads)
  restored = wa.from_buffers(params, host, state.counters)
  _assert_shardings(restored.grads, params)


def test_from_buffers_refuses_wrong_placement():
  mesh = _mesh()
  params = _sharded_params(mesh)
  state = _state_with(params)
  bufs = dict(state.grads)
  bufs["w"] = jax.device_put(bufs["w"], NamedSharding(mesh, P()))
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"\['w'\] is placed on"
  ):
    wa.from_buffers(params, bufs, state.counters)


@pytest.mark.parametrize(
  "mutate,match",
  [
    (lambda b: b.pop("b"), r"\['b'\] is missing"),
    (lambda b: b.update(c=np.zeros(1, np.float32)), r"unexpected leaf \['c'\]"),
    (lambda b: b.update(a=np.zeros((3, 2), np.float32)), r"\['a'\] has shape"),
    (
      lambda b: b.update(a=np.zeros((2, 2), np.int32)),
      r"\['a'\] has dtype int32",
    ),
    (lambda b: b.update(a=np.zeros((2, 2), jnp.bfloat16)), r"mix dtypes"),
  ],
)
def test_from_buffers_structural_faults(mutate, match):
  params = {"a": jnp.zeros((2, 2)), "b": jnp.zeros(3)}
  state = _state_with(params)
  bufs = jax.tree.map(np.asarray, state.grads)
  mutate(bufs)
  with pytest.raises(wa.WeightedAccumulationError, match=match):
    wa.from_buffers(params, bufs, state.counters)


@pytest.mark.parametrize(
  "change,match",
  [
    ({"issued": -1}, "'issued' is -1"),
    ({"issued": 1.5}, "'issued' is 1.5"),
    ({"rejected": 5}, "<= 'issued'"),
    ({"weight_hi": float("nan")}, "'total_weight' is nan"),
    ({"weight_hi": -3.0, "weight_lo": 0.0}, "'total_weight' is -3.0"),
    ({"loss_scale": 0.0}, "'loss_scale' is 0.0"),
    ({"loss_scale": float("inf")}, "'loss_scale' is inf"),
    ({"bogus": 1}, "unknown counter 'bogus'"),
    ({"issued": 0}, r"'issued': 0.*disagree"),
    ({"weight_hi": 0.0, "weight_lo": 0.0}, r"\['a'\] is non-zero"),
    ({"issued": np.zeros(2)}, "'issued' has shape"),
  ],
)
def test_from_buffers_counter_faults(change, match):
  params = {"a": jnp.zeros((2, 2)), "b": jnp.zeros(3)}
  state = _state_with(params)
  counters = {**{k: np.asarray(v) for k, v in state.counters.items()}, **change}
  with pytest.raises(wa.WeightedAccumulationError, match=match):
    wa.from_buffers(params, state.grads, counters)


def test_grads_sharded_unlike_params_keep_buffer_shardings():
  mesh = _mesh()
  params = _sharded_params(mesh)
  grads = {
    k: jax.device_put(jnp.ones_like(p), NamedSharding(mesh, P()))
    for k, p in params.items()
  }
  grads["w"] = jax.device_put(
    jnp.ones((8, 6)), NamedSharding(mesh, P("model", None))
  )
  state = wa.accumulate_sum(wa.init(params), grads, 2.0)
  _assert_shardings(state.grads, params)
  state = wa.accumulate_mean(state, grads, 1.0)
  _assert_shardings(state.grads, params)
  np.testing.assert_array_equal(
    np.asarray(state.grads["w"]), np.full((8, 6), 2.0)
  )


def test_counter_table_defines_state_counters_and_checkpoint_dtypes():
  """A counter is declared once: AccumState's fields, init's values and
  ``state.counters`` all follow the table."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from weighted_accum._src.core import base  # pylint: disable=g-import-not-at-top

  names = [name for name, _ in base.COUNTERS]
  fields = [f.name for f in dataclasses.fields(wa.AccumState)]
  assert fields == ["grads", *names, "dtype", "placement"]
  state = wa.init({"w": jnp.zeros(2)}, loss_scale=4.0)
  assert list(state.counters) == names
  for name, c in base.COUNTERS:
    value = state.counters[name]
    want_dtype = "int32" if c.kind == "count" else "float32"
    assert value.dtype == want_dtype and value.shape == ()
    want = 4.0 if name == "loss_scale" else c.initial
    assert float(value) == want
  out, nxt = wa.finish_sums(
    wa.accumulate_sum(state, {"w": jnp.ones(2)}, 3.0), next_loss_scale=2.0
  )
  assert int(nxt.windows) == 1 and float(nxt.loss_scale) == 2.0
  assert int(nxt.issued) == 0 and nxt.total_weight == 0.0
  assert out.weight.item() == 3.0 and int(out.issued) == 1
