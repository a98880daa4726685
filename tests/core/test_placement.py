"""Params, buffers and optimizer states committed to different devices:
every entry point either works (uncommitted arrays follow the committed
ones, as ``jax.jit`` moves them) or refuses with an error naming both
leaves and what to do, before any kernel sees them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import weighted_accum as wa

D = jax.devices()
Error = wa.WeightedAccumulationError


def _host():
  return {"a": np.arange(3.0, dtype=np.float32), "b": np.ones(2, np.float32)}


def _on(a, b):
  """``a`` and ``b`` put on the given devices (None: uncommitted)."""
  put = lambda x, d: jnp.asarray(x) if d is None else jax.device_put(x, d)
  h = _host()
  return {"a": put(h["a"], a), "b": put(h["b"], b)}


def test_uncommitted_and_committed_params_make_one_window():
  """``a`` uncommitted, ``b`` committed to device 1: the window's buffers
  all live on device 1, so grads committed to device 0 are moved onto them
  and the mean is exact (grads 2 * params over weight 2)."""
  params = _on(None, D[1])
  state = wa.init(params)
  assert {d.id for b in jax.tree.leaves(state.grads) for d in b.devices()} == {
    1
  }
  grads = jax.tree.map(lambda x: 2 * x, _on(D[0], D[0]))
  out, _ = wa.finish_mean(wa.accumulate_sum(state, grads, 2.0))
  for k, v in _host().items():
    np.testing.assert_array_equal(np.asarray(out.grads[k]), v)


@pytest.mark.parametrize(
  "entry", ["finish_sums", "finish_mean", "apply_window"]
)
def test_buffers_on_two_devices_are_refused_naming_the_leaves(entry):
  state = wa.init(_on(D[0], D[0]))
  state = state.replace(grads=_on(D[0], D[1]))  # as a hand-built state
  tx = optax.sgd(1.0)
  with pytest.raises(
    Error,
    match=r"state\.grads\['b'\].*devices \[1\].*"
    r"state\.grads\['a'\] to \[0\].*one device",
  ):
    if entry == "apply_window":
      wa.apply_window(tx, state, _on(D[0], D[0]), tx.init(_on(D[0], D[0])))
    else:
      getattr(wa, entry)(state)


def test_apply_window_refuses_params_on_another_device_than_the_window():
  params = _on(D[0], D[0])
  tx = optax.sgd(1.0)
  state = wa.accumulate_sum(wa.init(params), params, 1.0)
  with pytest.raises(Error, match=r"apply_window: leaf params\['b'\].*\[1\]"):
    wa.apply_window(tx, state, _on(D[0], D[1]), tx.init(params))
  # Nothing was consumed: the same window still applies on the right params.
  new, _, _, out = wa.apply_window(tx, state, params, tx.init(params))
  assert bool(out.valid)
  np.testing.assert_array_equal(np.asarray(new["a"]), 0.0)


def test_from_buffers_refuses_params_on_two_devices():
  params = _on(D[0], D[1])
  with pytest.raises(Error, match=r"from_buffers\(params\): leaf \['b'\]"):
    wa.from_buffers(
      params,
      _host(),
      {"issued": 1, "total_weight": 1.0, "loss_scale": 1.0},
    )


def test_from_buffers_takes_a_dynamic_loss_scale_as_its_scale():
  """A ``DynamicLossScale`` as the saved ``loss_scale`` counter is read as
  its ``scale`` (as ``init`` reads it), stored exactly."""
  params = _on(None, None)
  state = wa.from_buffers(
    params,
    jax.tree.map(lambda x: 4 * x, _host()),
    {"issued": 1, "total_weight": 2.0, "loss_scale": wa.DynamicLossScale(4.0)},
  )
  assert float(state.loss_scale) == 4.0
  out, _ = wa.finish_mean(state)  # 4 * params / 4 / 2
  for k, v in _host().items():
    np.testing.assert_array_equal(np.asarray(out.grads[k]), v / 2)
