"""The error model (docs/design.md, "Errors"): a clear error naming what and
where, and nothing lost."""

from __future__ import annotations

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import weighted_accum as wa

PARAMS = {
  "enc": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)},
  "head": jnp.zeros(2),
}


def _grads(value=1.0):
  return jax.tree.map(lambda p: jnp.full_like(p, value), PARAMS)


def _snapshot(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_same(a, b):
  jax.tree.map(np.testing.assert_array_equal, _snapshot(a), _snapshot(b))


@pytest.fixture
def state():
  return wa.accumulate_sum(wa.init(PARAMS), _grads(), 3)


def test_error_is_a_value_error():
  assert issubclass(wa.WeightedAccumulationError, ValueError)


@pytest.mark.parametrize("fn", [wa.accumulate_sum, wa.accumulate_mean])
def test_missing_leaf_is_named(variant, state, fn):
  grads = _grads()
  del grads["enc"]["bias"]
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"\['enc'\]\['bias'\].*missing"
  ):
    variant(fn)(state, grads, 1.0)


def test_extra_leaf_is_named(variant, state):
  grads = _grads()
  grads["enc"]["extra"] = jnp.ones(4)
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"unexpected leaf \['enc'\]\['extra'\]"
  ):
    variant(wa.accumulate_mean)(state, grads, 1.0)


def test_wrong_shape_is_named(variant, state):
  grads = _grads()
  grads["enc"]["kernel"] = jnp.ones((4, 3))
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=r"\['enc'\]\['kernel'\] has shape \(4, 3\), expected \(3, 4\)",
  ):
    variant(wa.accumulate_sum)(state, grads, 1.0)


def test_non_float_grads_are_named(variant, state):
  grads = _grads()
  grads["head"] = jnp.ones(2, jnp.int32)
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"\['head'\] has dtype int32"
  ):
    variant(wa.accumulate_sum)(state, grads, 1.0)


@pytest.mark.parametrize(
  "dtype", [jnp.int32, jnp.bool_, "not-a-dtype", jnp.float64]
)
def test_bad_work_dtype(dtype):
  with pytest.raises(wa.WeightedAccumulationError, match=r"init\(dtype=...\)"):
    wa.init(PARAMS, dtype=dtype)


def test_integer_param_is_named():
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"\['step'\] has dtype int32"
  ):
    wa.init({"w": jnp.zeros(2), "step": jnp.zeros((), jnp.int32)})


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_loss_scale(scale):
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"loss_scale.*finite positive"
  ):
    wa.init(PARAMS, loss_scale=scale)
  st = wa.init(PARAMS)
  with pytest.raises(wa.WeightedAccumulationError, match="next_loss_scale"):
    wa.finish_sums(st, next_loss_scale=scale)


@pytest.mark.parametrize(
  "weight", [-1.0, float("nan"), float("inf"), -float("inf")]
)
@pytest.mark.parametrize("fn", [wa.accumulate_sum, wa.accumulate_mean])
def test_bad_weight_eager_raises_and_state_untouched(state, fn, weight):
  before = _snapshot(state)
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"weight.*not a finite non-negative"
  ):
    fn(state, _grads(5.0), weight)
  with pytest.raises(wa.WeightedAccumulationError):
    fn(state, _grads(5.0), jnp.float32(weight))  # a concrete array too
  _assert_same(state, before)


def test_non_scalar_weight(state):
  with pytest.raises(wa.WeightedAccumulationError, match="expected a scalar"):
    wa.accumulate_sum(state, _grads(), jnp.ones(2))


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("fn", [wa.accumulate_sum, wa.accumulate_mean])
def test_bad_weight_under_jit_rejects_whole_microbatch(state, fn, weight):
  before = _snapshot(state)
  new = jax.jit(fn)(state, _grads(5.0), weight)
  jax.tree.map(
    np.testing.assert_array_equal, _snapshot(new.grads), before.grads
  )
  assert new.total_weight == state.total_weight
  assert int(new.issued) == int(state.issued) + 1
  assert int(new.rejected) == int(state.rejected) + 1
  # A later good microbatch still counts normally.
  new = jax.jit(fn)(new, _grads(1.0), 1.0)
  assert new.total_weight == state.total_weight + 1


def test_finish_mean_zero_weight_eager_raises_and_nothing_cleared():
  st = wa.init(PARAMS)
  st = wa.accumulate_mean(st, _grads(float("nan")), 0.0)
  before = _snapshot(st)
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=r"total weight is 0.0 after 1 microbatch.*nothing cleared",
  ):
    wa.finish_mean(st)
  _assert_same(st, before)
  with pytest.raises(wa.WeightedAccumulationError, match="total weight"):
    wa.finish_mean(wa.init(PARAMS))


def test_finish_mean_zero_weight_under_jit_returns_invalid_and_unchanged():
  st = wa.accumulate_sum(wa.init(PARAMS), _grads(float("nan")), 0.0)
  st = jax.jit(wa.accumulate_sum)(st, _grads(), -2.0)  # rejected
  out, new = jax.jit(wa.finish_mean)(st)
  assert not bool(out.valid)
  for leaf in jax.tree.leaves(out.grads):
    np.testing.assert_array_equal(np.asarray(leaf), 0)
  _assert_same(new, st)
  # The window goes on: a positive microbatch makes it finishable.
  new = wa.accumulate_sum(new, _grads(4.0), 2.0)
  out, _ = jax.jit(wa.finish_mean)(new)
  assert bool(out.valid)
  np.testing.assert_array_equal(np.asarray(out.grads["head"]), [2.0, 2.0])


def test_checkify_turns_traced_faults_into_errors(state):
  @jax.jit
  @checkify.checkify
  def step(state, grads, weight):
    return wa.accumulate_mean(state, grads, weight, checked=True)

  err, new = step(state, _grads(), -3.0)
  with pytest.raises(
    checkify.JaxRuntimeError, match="weight -3.0 is not a finite"
  ):
    err.throw()
  assert int(new.rejected) == 1
  err, new = step(state, _grads(), 2.0)
  err.throw()  # no error
  assert new.total_weight == 5.0

  @jax.jit
  @checkify.checkify
  def fin(state):
    return wa.finish_mean(state, checked=True)

  err, (out, _) = fin(wa.init(PARAMS))
  with pytest.raises(checkify.JaxRuntimeError, match="total weight is 0"):
    err.throw()
  assert not bool(out.valid)
  err, (out, _) = fin(state)
  err.throw()
  assert bool(out.valid)


def test_traced_invalid_next_loss_scale_marks_next_window_unusable(state):
  """Keeping the current scale would divide grads scaled by -1 by +1 (a sign
  flip reported valid); the invalid scale is stored as NaN instead, the next
  window's microbatches are rejected and counted, its finish is invalid, and
  a valid next_loss_scale recovers."""
  _, new = jax.jit(wa.finish_mean)(state, next_loss_scale=jnp.float32(-1.0))
  assert np.isnan(float(new.loss_scale))
  new = jax.jit(wa.accumulate_sum)(new, _grads(-1.0), 2.0)
  assert int(new.rejected) == 1 and new.total_weight == 0.0
  out, new = jax.jit(wa.finish_mean)(new, next_loss_scale=jnp.float32(4.0))
  assert not bool(out.valid)
  assert float(new.loss_scale) == 4.0
  with pytest.raises(wa.WeightedAccumulationError, match="loss scale is nan"):
    wa.accumulate_sum(
      new.replace(loss_scale=jnp.float32(jnp.nan)), _grads(), 1.0
    )


@pytest.mark.parametrize("fn", [wa.accumulate_sum, wa.accumulate_mean])
def test_weight_beyond_float32_range_raises_eagerly(state, fn):
  """1e39 is finite as a Python float but infinite as the float32 weight the
  tally keeps: eagerly it must raise, not be silently rejected."""
  before = _snapshot(state)
  with pytest.raises(wa.WeightedAccumulationError, match=r"weight.*1e\+39"):
    fn(state, _grads(), 1e39)
  _assert_same(state, before)
