"""Equivalence, loss scaling, exact tallies and jit behaviour of the core.

References are independent of the code under test: the full-batch gradient of
the model's mean loss, and float64 NumPy arithmetic.
"""

from __future__ import annotations

import functools
import math

import chex
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import toy_lm as toy

from _helpers import rel_err
from _helpers import row_splits
import weighted_accum as wa

BATCH = toy.make_dataset(num_sequences=12, max_len=16, seed=3)
MODEL = toy.TinyLM(dim=16, heads=2, max_len=16, rngs=nnx.Rngs(0))
GRAPHDEF, PARAMS = nnx.split(MODEL, nnx.Param)


def _loss(params, batch, kind):
  model = nnx.merge(GRAPHDEF, params)
  return (
    toy.sum_loss(model, batch) if kind == "sum" else toy.mean_loss(model, batch)
  )


_grad = jax.jit(jax.grad(_loss), static_argnums=2)


def _rows(batch, start, stop):
  """The microbatch of rows [start, stop), kept at the batch's shape.

  Rows outside it have length 0 (fully masked), so every microbatch has one
  shape and the gradient compiles once; its effective weight is its own.
  """
  rows = jnp.arange(batch.lengths.shape[0])
  keep = (rows >= start) & (rows < stop)
  return toy.Batch(batch.tokens, jnp.where(keep, batch.lengths, 0))


@functools.cache
def _full():
  """The full batch's mean-loss gradient (computed when first needed, not
  at collection)."""
  return _grad(PARAMS, BATCH, "mean")


_acc_sum = jax.jit(wa.accumulate_sum)
_acc_mean = jax.jit(wa.accumulate_mean)
_fin_mean = jax.jit(wa.finish_mean)


def splits():
  """Cut points of the 12-row batch into 1..6 consecutive microbatches, each
  with a loss kind (sum or mean)."""
  return row_splits(BATCH.lengths.shape[0], 5)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@given(split=splits())
def test_any_split_equals_full_batch_gradient(jitted, split):
  bounds, kinds = split
  acc = {
    "sum": _acc_sum if jitted else wa.accumulate_sum,
    "mean": _acc_mean if jitted else wa.accumulate_mean,
  }
  finish = _fin_mean if jitted else wa.finish_mean
  state = wa.init(PARAMS)
  for (a, b), kind in zip(bounds, kinds):
    mb = _rows(BATCH, a, b)
    # A mean-loss microbatch with no tokens has NaN grads (0/0): weight 0
    # must make it contribute nothing.
    state = acc[kind](state, _grad(PARAMS, mb, kind), toy.weight(mb))
  out, state = finish(state)
  assert bool(out.valid)
  assert float(out.weight) == float(toy.weight(BATCH))
  assert rel_err(out.grads, _full()) <= 1e-5
  assert int(state.issued) == 0 and int(state.windows) == 1


def test_equal_weight_mean_of_means_is_biased():
  """What optax.MultiSteps computes differs for an unequal split."""
  bounds = [(0, 3), (3, 10), (10, 12)]
  mbs = [_rows(BATCH, a, b) for a, b in bounds]
  weights = [float(toy.weight(mb)) for mb in mbs]
  assert len(set(weights)) == 3 and min(weights) > 0
  grads = [_grad(PARAMS, mb, "mean") for mb in mbs]
  naive = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
  assert rel_err(naive, _full()) > 1e-2
  state = wa.init(PARAMS)
  for g, mb in zip(grads, mbs):
    state = wa.accumulate_mean(state, g, toy.weight(mb))
  out, _ = wa.finish_mean(state)
  assert rel_err(out.grads, _full()) <= 1e-5


def test_nan_grads_of_zero_weight_microbatch_contribute_nothing(variant):
  params = {"w": jnp.ones(3)}
  acc = variant(wa.accumulate_mean)
  state = acc(wa.init(params), {"w": jnp.array([1.0, 2.0, 3.0])}, 2.0)
  state = acc(state, {"w": jnp.array([jnp.nan, jnp.inf, -jnp.inf])}, 0.0)
  np.testing.assert_array_equal(np.asarray(state.grads["w"]), [2.0, 4.0, 6.0])
  assert int(state.issued) == 2 and int(state.zero_weight) == 1
  out, _ = variant(wa.finish_mean)(state)
  assert bool(out.finite) and bool(out.valid)


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("work_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_conversion_then_weighting_matches_float64_reference(
  variant, grad_dtype, work_dtype
):
  rng = np.random.default_rng(0)
  gs = [rng.normal(size=(4, 5)).astype(np.float32) for _ in range(3)]
  ws = [3.0, 0.5, 7.25]
  kinds = ["mean", "sum", "mean"]
  state = wa.init({"w": jnp.zeros((4, 5))}, dtype=work_dtype)
  fns = {"sum": variant(wa.accumulate_sum), "mean": variant(wa.accumulate_mean)}
  for g, w, k in zip(gs, ws, kinds):
    state = fns[k](state, {"w": jnp.asarray(g, grad_dtype)}, w)
  assert state.grads["w"].dtype == jnp.dtype(work_dtype)

  # Reference: the grads as the caller handed them (rounded to grad_dtype),
  # then to the work dtype, in float64.
  def rounded(g):
    g = np.asarray(jnp.asarray(g, grad_dtype).astype(work_dtype), np.float64)
    return g

  ref = sum(
    rounded(g) * (w if k == "mean" else 1.0) for g, w, k in zip(gs, ws, kinds)
  )
  ref_mean = ref / sum(ws)
  out, _ = variant(wa.finish_mean)(state)
  eps = float(jnp.finfo(work_dtype).eps)
  np.testing.assert_allclose(
    np.asarray(out.grads["w"], np.float64), ref_mean, rtol=8 * eps, atol=8 * eps
  )


def test_float16_loss_scale_does_not_overflow(variant):
  """loss_scale * weight = 2**15 * 1000 > float16 max (65504)."""
  rng = np.random.default_rng(1)
  mean_grad = rng.uniform(-1e-3, 1e-3, size=(64,))  # true grad of the mean
  scale = 2.0**15
  state = wa.init({"w": jnp.zeros(64)}, dtype=jnp.float16, loss_scale=scale)
  scaled = jnp.asarray(mean_grad * scale, jnp.float16)  # what backward gives
  state = variant(wa.accumulate_mean)(state, {"w": scaled}, 1000.0)
  assert scale * 1000 > float(jnp.finfo(jnp.float16).max)
  out, _ = variant(wa.finish_mean)(state)
  got = np.asarray(out.grads["w"], np.float64)
  assert out.grads["w"].dtype == jnp.float16
  assert np.all(np.isfinite(got)) and bool(out.finite) and bool(out.valid)
  np.testing.assert_allclose(got, mean_grad, rtol=2e-3, atol=1e-7)


def test_finish_sums_returns_scaled_sums_and_resets(variant):
  state = wa.init({"w": jnp.zeros(2)}, loss_scale=8.0)
  state = wa.accumulate_sum(state, {"w": jnp.array([8.0, 16.0])}, 3)
  state = wa.accumulate_mean(state, {"w": jnp.array([8.0, 8.0])}, 1)
  out, new = variant(wa.finish_sums)(state)
  np.testing.assert_array_equal(np.asarray(out.grads["w"]), [16.0, 24.0])
  assert float(out.weight) == 4.0 and float(out.loss_scale) == 8.0
  assert int(out.issued) == 2 and bool(out.finite)
  np.testing.assert_array_equal(np.asarray(new.grads["w"]), [0.0, 0.0])
  assert new.total_weight == 0 and int(new.issued) == 0
  assert int(new.windows) == 1


def test_next_loss_scale_applies_to_the_next_window(variant):
  state = wa.init({"w": jnp.zeros(1)}, loss_scale=4.0)
  state = wa.accumulate_sum(state, {"w": jnp.array([8.0])}, 2)
  out, state = variant(wa.finish_mean)(state, next_loss_scale=2.0)
  assert float(out.grads["w"][0]) == 1.0
  assert float(state.loss_scale) == 2.0
  state = wa.accumulate_sum(state, {"w": jnp.array([8.0])}, 2)
  out, state = variant(wa.finish_sums)(state, next_loss_scale=16.0)
  assert float(out.loss_scale) == 2.0 and float(state.loss_scale) == 16.0


def test_non_finite_pending_values_reported_once_at_finish(variant):
  state = wa.init({"a": jnp.zeros(3), "b": jnp.zeros(2)}, dtype=jnp.float16)
  big = {"a": jnp.full(3, 60000.0, jnp.float16), "b": jnp.ones(2, jnp.float16)}
  state = wa.accumulate_sum(state, big, 1)
  state = wa.accumulate_sum(state, big, 1)  # 120000 overflows float16
  out, new = variant(wa.finish_mean)(state)
  assert not bool(out.finite) and not bool(out.valid)
  assert int(new.issued) == 0  # the window is consumed; the next starts clean
  np.testing.assert_array_equal(np.asarray(new.grads["a"]), [0, 0, 0])


def test_exact_tally_reads_back_exact_python_number():
  state = wa.init({"w": jnp.zeros(1)})
  acc = jax.jit(wa.accumulate_sum)
  g = {"w": jnp.zeros(1)}
  for _ in range(300):
    state = acc(state, g, 2**20 + 1)
  assert 300 * (2**20 + 1) == 314573100
  assert state.total_weight == 314573100
  assert isinstance(state.total_weight, float)


def test_exact_tally_beyond_2_to_40_without_x64():
  assert not jax.config.jax_enable_x64
  w, n = 2**24 - 3, 70_000
  loop = jax.jit(
    lambda s: jax.lax.fori_loop(
      0, n, lambda i, s: wa.accumulate_sum(s, {"w": jnp.zeros(1)}, w), s
    )
  )
  state = loop(wa.init({"w": jnp.zeros(1)}))
  assert n * w > 2**40
  assert state.total_weight == n * w
  assert int(state.issued) == n


@given(st.lists(st.floats(0, 1e4, width=32), min_size=1, max_size=60))
def test_fractional_weights_tally_matches_fsum(weights):
  state = wa.init({"w": jnp.zeros(1)})
  acc = jax.jit(wa.accumulate_sum)
  for w in weights:
    state = acc(state, {"w": jnp.zeros(1)}, np.float32(w))
  ref = math.fsum(float(np.float32(w)) for w in weights)
  assert state.total_weight == pytest.approx(ref, rel=1e-13, abs=1e-30)


def test_hundred_weights_compile_once():
  @functools.partial(jax.jit, donate_argnums=0)
  @chex.assert_max_traces(n=1)
  def step(state, grads, weight):
    return wa.accumulate_mean(state, grads, weight)

  state = wa.init({"w": jnp.zeros(8)})
  g = {"w": jnp.ones(8)}
  weights = np.linspace(0.5, 500.0, 100).astype(np.float32)
  for w in weights:
    state = step(state, g, w)
  np.testing.assert_allclose(
    np.asarray(state.grads["w"]),
    np.full(8, np.sum(weights.astype(np.float64))),
    rtol=1e-6,
  )

  @functools.partial(jax.jit, donate_argnums=0)
  @chex.assert_max_traces(n=1)  # raises on a second trace
  def fin(state):
    return wa.finish_mean(state)

  for w in weights[:5]:
    out, state = fin(step(state, g, w))


def test_trees_with_none_leaves_and_nnx_state(variant):
  params = {
    "dense": {"kernel": jnp.ones((2, 3)), "bias": None},
    "scale": (jnp.ones(1), None),
  }
  grads = {
    "dense": {"kernel": jnp.full((2, 3), 2.0), "bias": None},
    "scale": (jnp.full(1, 4.0), None),
  }
  state = variant(wa.accumulate_sum)(wa.init(params), grads, 2)
  out, _ = variant(wa.finish_mean)(state)
  assert out.grads["dense"]["bias"] is None and out.grads["scale"][1] is None
  np.testing.assert_array_equal(
    np.asarray(out.grads["dense"]["kernel"]), np.ones((2, 3))
  )
  # nnx.State in, nnx.State out.
  state = wa.init(PARAMS)
  assert isinstance(state.grads, nnx.State)
  g = jax.tree.map(jnp.ones_like, PARAMS)
  state = variant(wa.accumulate_sum)(state, g, 1)
  out, _ = variant(wa.finish_mean)(state)
  assert isinstance(out.grads, nnx.State)


def test_reading_counters_changes_nothing():
  state = wa.accumulate_sum(wa.init({"w": jnp.zeros(2)}), {"w": jnp.ones(2)}, 5)
  before = jax.tree.map(np.asarray, state)
  _ = (
    state.total_weight,
    state.issued,
    state.loss_scale,
    state.counters,
    state.rejected,
    state.zero_weight,
    state.windows,
  )
  jax.tree.map(
    np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state)
  )
  state = wa.accumulate_sum(state, {"w": jnp.ones(2)}, 5)
  assert state.total_weight == 10.0


def test_empty_window_under_jit_is_finite_but_invalid():
  """A zero-weight window has no non-finite pending value: ``finite`` must
  stay true (a dynamic loss scaler would otherwise lower its scale for
  nothing); only ``valid`` is false."""
  state = wa.init({"w": jnp.zeros(3)})
  state = wa.accumulate_mean(state, {"w": jnp.full(3, jnp.nan)}, 0.0)
  out, _ = jax.jit(wa.finish_mean)(state)
  assert bool(out.finite) and not bool(out.valid)
