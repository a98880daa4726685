"""The eager validation cache: a repeated microbatch signature skips the
structural walk, and any change of structure, shape, dtype, weak type or
placement after a cached call is validated (and refused) again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import weighted_accum as wa
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import eager_cache

PARAMS = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}


def _grads(scale=1.0):
  return {"w": jnp.full((4, 3), scale), "b": jnp.full(3, scale)}


@pytest.fixture
def walks(monkeypatch):
  """Counts the full structural checks the core runs."""
  calls = []
  real = accumulation.check_structure

  def counting(*args, **kwargs):
    calls.append(args[2])
    return real(*args, **kwargs)

  monkeypatch.setattr(accumulation, "check_structure", counting)
  monkeypatch.setattr(eager_cache, "_VALIDATED", {})
  return calls


@pytest.mark.parametrize(
  "fn", [wa.accumulate_sum, wa.accumulate_mean], ids=["sum", "mean"]
)
def test_repeated_signature_is_walked_once_and_results_are_exact(walks, fn):
  state = wa.init(PARAMS)
  for k in range(5):
    state = fn(state, _grads(k + 1.0), 2.0)
  # The first call only: later calls have the same structure, shapes, dtypes
  # and (equal) shardings.
  assert len(walks) == 1
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
def test_changed_input_after_a_cached_one_is_still_refused(walks, bad, match):
  state = wa.accumulate_sum(wa.init(PARAMS), _grads(), 1.0)
  state = wa.accumulate_sum(state, _grads(), 1.0)  # cached now
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


def test_weight_value_is_checked_on_every_cached_call(walks):
  state = wa.accumulate_mean(wa.init(PARAMS), _grads(), 1.0)
  for bad in (-1.0, float("nan"), float("inf")):
    with pytest.raises(wa.WeightedAccumulationError, match="weight"):
      wa.accumulate_mean(state, _grads(), bad)
  with pytest.raises(wa.WeightedAccumulationError, match="scalar"):
    wa.accumulate_mean(state, _grads(), jnp.ones(2))
  # Only the first call walked the trees: every refusal came from a cached
  # call.
  assert len(walks) == 1


def test_changed_placement_is_validated_and_moved(walks):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharded = NamedSharding(mesh, P("d"))
  params = {"w": jax.device_put(jnp.zeros(8), sharded)}
  state = wa.init(params)
  g = {"w": jax.device_put(jnp.ones(8), sharded)}
  for _ in range(3):
    state = wa.accumulate_sum(state, g, 1.0)
  n = len(walks)
  assert n <= 2
  # The same grads on one device: a new signature, moved onto the buffers'.
  state = wa.accumulate_sum(state, {"w": jnp.ones(8)}, 1.0)
  assert len(walks) == n + 1
  assert state.grads["w"].sharding.is_equivalent_to(sharded, 1)
  np.testing.assert_array_equal(np.asarray(state.grads["w"]), 4.0)


@pytest.mark.parametrize(
  "leaf",
  [1.0, np.float32(1.0), np.ones((), np.float32), jnp.asarray(1.0)],
  ids=["python", "numpy-scalar", "numpy", "weak"],
)
def test_non_jax_and_weak_typed_leaves_are_cached_too(walks, leaf):
  """Each kind of leaf has its own signature; a repeated one stops walking
  (after the buffers' placement objects settle, within two calls)."""
  state = wa.init({"w": jnp.zeros(())})
  for _ in range(3):
    state = wa.accumulate_sum(state, {"w": leaf}, 1.0)
  n = len(walks)
  for _ in range(3):
    state = wa.accumulate_sum(state, {"w": leaf}, 1.0)
  assert len(walks) == n and float(state.grads["w"]) == 6.0
  with pytest.raises(wa.WeightedAccumulationError, match="int"):
    wa.accumulate_sum(state, {"w": 1}, 1.0)


def test_under_jit_nothing_is_cached(walks):
  step = jax.jit(wa.accumulate_sum)
  state = step(wa.init(PARAMS), _grads(), 1.0)
  state = step(state, _grads(), 2.0)
  assert len(walks) == 1 and not eager_cache._VALIDATED  # pylint: disable=protected-access


@pytest.mark.parametrize("first,second", [((1, 3), (3,)), ((3,), (1, 3))])
def test_cached_grads_into_another_window_are_checked_against_its_buffers(
  walks, first, second
):
  """The cache is keyed by the buffers' signature too: grads validated
  against one window are refused by a window of another shape, which keeps
  its buffer as it was."""
  g = {"w": jnp.ones(first)}
  wa.accumulate_sum(wa.init({"w": jnp.zeros(first)}), g, 1.0)
  other = wa.init({"w": jnp.zeros(second)})
  with pytest.raises(wa.WeightedAccumulationError, match=r"\['w'\].*shape"):
    wa.accumulate_sum(other, g, 1.0)
  assert other.grads["w"].shape == second
