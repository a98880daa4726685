"""Eager accumulate calls check every call: a repeated call is exact, and
any change of structure, shape, dtype, weak type or placement after a good
call is refused (nothing changed) or moved onto the buffers' placement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import weighted_accum as wa

PARAMS = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}


def _grads(scale=1.0):
  return {"w": jnp.full((4, 3), scale), "b": jnp.full(3, scale)}


@pytest.mark.parametrize(
  "fn", [wa.accumulate_sum, wa.accumulate_mean], ids=["sum", "mean"]
)
def test_repeated_calls_are_exact(fn):
  state = wa.init(PARAMS)
  for k in range(5):
    state = fn(state, _grads(k + 1.0), 2.0)
  factor = 2.0 if fn is wa.accumulate_mean else 1.0
  np.testing.assert_array_equal(
    np.asarray(state.grads["w"]), np.full((4, 3), factor * 15.0)
  )
  assert state.total_weight == 10.0 and int(state.issued) == 5


@pytest.mark.parametrize(
  "bad,match",
  [
    ({"w": jnp.ones((4, 2)), "b": jnp.ones(3)}, r"\['w'\].*shape"),
    ({"w": jnp.ones((4, 3), jnp.int32), "b": jnp.ones(3)}, r"\['w'\].*int32"),
    ({"w": jnp.ones((4, 3))}, r"\['b'\].*missing"),
    ({"w": jnp.ones((4, 3)), "b": jnp.ones(3), "c": jnp.ones(1)}, r"\['c'\]"),
    ({"w": jnp.ones((4, 3)), "b": np.ones(3, np.int64)}, r"\['b'\]"),
  ],
  ids=["shape", "dtype", "missing", "extra", "numpy-int"],
)
def test_changed_input_after_a_good_call_is_refused(bad, match):
  state = wa.accumulate_sum(wa.init(PARAMS), _grads(), 1.0)
  state = wa.accumulate_sum(state, _grads(), 1.0)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
  with pytest.raises(wa.WeightedAccumulationError, match=match):
    wa.accumulate_sum(state, bad, 1.0)
  # Refusing changed nothing, and a good call still works afterwards.
  assert all(
    np.array_equal(a, np.asarray(b))
    for a, b in zip(before, jax.tree.leaves(state))
  )
  state = wa.accumulate_sum(state, _grads(), 1.0)
  assert int(state.issued) == 3


def test_weight_value_is_checked_on_every_call():
  state = wa.accumulate_mean(wa.init(PARAMS), _grads(), 1.0)
  for bad in (-1.0, float("nan"), float("inf")):
    with pytest.raises(wa.WeightedAccumulationError, match="weight"):
      wa.accumulate_mean(state, _grads(), bad)
  with pytest.raises(wa.WeightedAccumulationError, match="scalar"):
    wa.accumulate_mean(state, _grads(), jnp.ones(2))


def test_changed_placement_is_moved_onto_the_buffers():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharded = NamedSharding(mesh, P("d"))
  params = {"w": jax.device_put(jnp.zeros(8), sharded)}
  state = wa.init(params)
  g = {"w": jax.device_put(jnp.ones(8), sharded)}
  for _ in range(3):
    state = wa.accumulate_sum(state, g, 1.0)
  # The same grads on one device: moved onto the buffers' sharding.
  state = wa.accumulate_sum(state, {"w": jnp.ones(8)}, 1.0)
  assert state.grads["w"].sharding.is_equivalent_to(sharded, 1)
  np.testing.assert_array_equal(np.asarray(state.grads["w"]), 4.0)


@pytest.mark.parametrize(
  "leaf",
  [1.0, np.float32(1.0), np.ones((), np.float32), jnp.asarray(1.0)],
  ids=["python", "numpy-scalar", "numpy", "weak"],
)
def test_non_jax_and_weak_typed_leaves_then_an_int(leaf):
  """Each kind of float leaf adds exactly, again and again; an int leaf
  after them is refused."""
  state = wa.init({"w": jnp.zeros(())})
  for _ in range(6):
    state = wa.accumulate_sum(state, {"w": leaf}, 1.0)
  assert float(state.grads["w"]) == 6.0
  with pytest.raises(wa.WeightedAccumulationError, match="int"):
    wa.accumulate_sum(state, {"w": 1}, 1.0)


@pytest.mark.parametrize("first,second", [((1, 3), (3,)), ((3,), (1, 3))])
def test_grads_taken_by_one_window_are_checked_against_another(first, second):
  """Grads accepted by one window are refused by a window of another shape,
  which keeps its buffer as it was."""
  g = {"w": jnp.ones(first)}
  wa.accumulate_sum(wa.init({"w": jnp.zeros(first)}), g, 1.0)
  other = wa.init({"w": jnp.zeros(second)})
  with pytest.raises(wa.WeightedAccumulationError, match=r"\['w'\].*shape"):
    wa.accumulate_sum(other, g, 1.0)
  assert other.grads["w"].shape == second
