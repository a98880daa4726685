"""``apply_window``: the window-closing step.

References are independent of the code under test: the gradient of the full
batch's mean loss (``jax.grad`` over the whole batch) handed to the optax
optimizer directly, and bit-for-bit identity for windows that must not be
applied.
"""

from __future__ import annotations

import math

from flax import nnx
from hypothesis import given
from hypothesis import settings
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest
import toy_lm as toy

from _helpers import row_splits
import weighted_accum as wa

BATCH = toy.make_dataset(num_sequences=12, max_len=16, seed=3)
MODEL = toy.TinyLM(dim=16, heads=2, max_len=16, rngs=nnx.Rngs(0))
GRAPHDEF, PARAMS = nnx.split(MODEL, nnx.Param)
PARAMS = jax.tree.map(jnp.asarray, nnx.to_pure_dict(PARAMS))


def _loss(params, batch, kind):
  model = nnx.merge(GRAPHDEF, nnx.State(params))
  return (
    toy.sum_loss(model, batch) if kind == "sum" else toy.mean_loss(model, batch)
  )


_grad = jax.jit(jax.grad(_loss), static_argnums=2)


def _rows(batch, start, stop):
  """Rows [start, stop) of the batch at its full shape (others masked)."""
  rows = jnp.arange(batch.lengths.shape[0])
  keep = (rows >= start) & (rows < stop)
  return toy.Batch(batch.tokens, jnp.where(keep, batch.lengths, 0))


def _rel_err(tree, ref):
  a = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  b = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref)]
  num = sum(np.sum((x - y) ** 2) for x, y in zip(a, b))
  return math.sqrt(num / max(sum(np.sum(y**2) for y in b), 1e-300))


def _copy(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _window(bounds, kinds, params=PARAMS, state=None):
  state = wa.init(params) if state is None else state
  for (a, b), kind in zip(bounds, kinds):
    mb = _rows(BATCH, a, b)
    fn = wa.accumulate_sum if kind == "sum" else wa.accumulate_mean
    state = fn(state, _grad(params, mb, kind), toy.weight(mb))
  return state


def _step(variant, tx, **kw):
  def step(state, params, opt_state):
    return wa.apply_window(tx, state, params, opt_state, **kw)

  return variant(step, donate_argnums=(0, 1, 2))


def _reference(tx, params, opt_state, batch=BATCH):
  """Full-batch gradient of the mean loss, handed to optax directly."""
  g = _grad(params, batch, "mean")
  updates, opt_state = tx.update(g, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def splits():
  return row_splits(BATCH.lengths.shape[0], 4)


# Optimizers linear in the gradient (Adam's first step is sign(g), which a
# relative comparison of rounding-level differences cannot check).
def _linear_tx():
  return optax.chain(
    optax.add_decayed_weights(1e-3), optax.sgd(0.5, momentum=0.9)
  )


# One optimizer and one step per variant for every hypothesis example: a new
# ``tx`` would be a new static argument, so a new compilation, each time.
_LINEAR_TX = _linear_tx()
_SPLIT_STEPS = {
  jitted: _step(
    (lambda f, **kw: jax.jit(f, **kw)) if jitted else (lambda f, **kw: f),
    _LINEAR_TX,
  )
  for jitted in (False, True)
}


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@settings(max_examples=8, deadline=None)
@given(split=splits())
def test_any_split_equals_full_batch_optimizer_step(jitted, split):
  tx = _LINEAR_TX
  opt_state = tx.init(PARAMS)
  ref_params, ref_opt = _reference(tx, PARAMS, opt_state)
  state = _window(*split)
  params, new_opt, state, out = _SPLIT_STEPS[jitted](
    state, _copy(PARAMS), _copy(opt_state)
  )
  assert bool(out.valid) and bool(out.finite)
  assert out.grads is None
  assert float(out.weight) == float(toy.weight(BATCH))
  delta = jax.tree.map(lambda a, b: a - b, params, PARAMS)
  ref_delta = jax.tree.map(lambda a, b: a - b, ref_params, PARAMS)
  assert _rel_err(delta, ref_delta) <= 1e-4
  assert _rel_err(new_opt, ref_opt) <= 1e-4
  assert int(state.issued) == 0 and int(state.windows) == 1
  assert state.total_weight == 0.0
  assert all(not np.any(np.asarray(b)) for b in jax.tree.leaves(state.grads))


def test_two_windows_match_two_full_batch_steps(variant):
  tx = _linear_tx()
  params, opt_state = PARAMS, tx.init(PARAMS)
  ref_params, ref_opt = params, opt_state
  step = _step(variant, tx)
  state = wa.init(params)
  for halves in ((0, 6, 12), (0, 2, 12)):
    ref_params, ref_opt = _reference(tx, ref_params, ref_opt)
    state = _window(
      [(halves[0], halves[1]), (halves[1], halves[2])],
      ["mean", "sum"],
      params=params,
      state=state,
    )
    params, opt_state, state, out = step(state, _copy(params), _copy(opt_state))
    assert bool(out.valid)
  delta = jax.tree.map(lambda a, b: a - b, params, PARAMS)
  ref_delta = jax.tree.map(lambda a, b: a - b, ref_params, PARAMS)
  assert _rel_err(delta, ref_delta) <= 1e-4
  assert _rel_err(opt_state, ref_opt) <= 1e-4
  assert int(state.windows) == 2


def test_zero_weight_window_changes_nothing_and_stays_open(variant):
  tx = optax.adamw(1e-2)
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  opt_state = tx.init(params)
  # Advance the optimizer once, so "unchanged" is not "initial".
  opt_state = tx.update({"w": jnp.ones(3)}, opt_state, params)[1]
  state = wa.init(params, loss_scale=8.0)
  # A fully masked microbatch: weight 0, mean-loss grads 0/0 = NaN.
  state = wa.accumulate_mean(state, {"w": jnp.full(3, jnp.nan)}, 0)
  before = _bits((params, opt_state))
  new_params, new_opt, new_state, out = _step(variant, tx, next_loss_scale=4.0)(
    state, _copy(params), _copy(opt_state)
  )
  assert not bool(out.valid) and bool(out.finite)
  assert _bits((new_params, new_opt)) == before
  assert int(new_opt[0].count) == 1  # the inner optimizer did not advance
  # The window stays open: counters kept, buffers zero; it holds no weight,
  # so it continues at the next loss scale the caller asked for (as
  # finish_mean and the optax wrapper do).
  assert int(new_state.issued) == 1 and int(new_state.zero_weight) == 1
  assert int(new_state.windows) == 0 and float(new_state.loss_scale) == 4.0
  np.testing.assert_array_equal(np.asarray(new_state.grads["w"]), 0.0)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_non_finite_window_changes_nothing_and_is_discarded(variant, bad):
  tx = optax.adam(1e-2)
  params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5])}
  opt_state = tx.update(
    jax.tree.map(jnp.ones_like, params), tx.init(params), params
  )[1]
  state = wa.init(params, dtype=jnp.float16, loss_scale=2.0**15)
  state = wa.accumulate_sum(
    state, {"w": jnp.array([1.0, bad]), "b": jnp.array([2.0])}, 5
  )
  before = _bits((params, opt_state))
  new_params, new_opt, new_state, out = _step(
    variant, tx, next_loss_scale=2.0**14
  )(state, _copy(params), _copy(opt_state))
  assert not bool(out.finite) and not bool(out.valid)
  assert float(out.weight) == 5.0 and float(out.loss_scale) == 2.0**15
  assert _bits((new_params, new_opt)) == before
  assert int(new_opt[0].count) == 1
  # Discarded: the next window starts clean with the new scale.
  assert int(new_state.issued) == 0 and int(new_state.windows) == 1
  assert new_state.total_weight == 0.0
  assert float(new_state.loss_scale) == 2.0**14
  assert new_state.dtype == jnp.float16
  for b in jax.tree.leaves(new_state.grads):
    assert b.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(b), 0.0)


def test_loss_scale_is_divided_out_and_next_one_set(variant):
  tx = optax.sgd(1.0)
  params = {"w": jnp.array([0.0, 0.0])}
  state = wa.init(params, dtype=jnp.float16, loss_scale=2.0**12)
  # Mean-loss grads of 1000 items, scaled: 2**12 * 1000 > float16's max.
  g = {"w": jnp.array([2.0**12 * 1e-3, -(2.0**12) * 2e-3], jnp.float16)}
  state = wa.accumulate_mean(state, g, 1000)
  new_params, _, new_state, out = _step(variant, tx, next_loss_scale=2.0**13)(
    state, _copy(params), tx.init(params)
  )
  assert bool(out.valid) and float(out.loss_scale) == 2.0**12
  np.testing.assert_allclose(
    np.asarray(new_params["w"]), [-1e-3, 2e-3], rtol=1e-3
  )
  assert new_params["w"].dtype == jnp.float32
  assert float(new_state.loss_scale) == 2.0**13


def test_traced_invalid_next_loss_scale_marks_the_next_window_unusable():
  # The closing window is applied; an unusable traced next scale cannot
  # raise, so the next window is marked (docs/inputs.md): its microbatches
  # are rejected and counted, and its close is not valid.
  tx = optax.sgd(1.0)
  params = {"w": jnp.ones(2)}
  state = wa.accumulate_sum(wa.init(params, loss_scale=4.0), params, 1)
  step = jax.jit(
    lambda s, p, o, ls: wa.apply_window(tx, s, p, o, next_loss_scale=ls)
  )
  for bad in (-1.0, 0.0, jnp.nan, jnp.inf):
    new_params, opt, new_state, out = step(state, params, tx.init(params), bad)
    assert bool(out.valid)
    np.testing.assert_array_equal(np.asarray(new_params["w"]), [0.75, 0.75])
    nxt = jax.jit(wa.accumulate_sum)(new_state, params, 2)
    assert int(nxt.rejected) == 1 and float(nxt.total_weight) == 0.0
    _, _, _, out2 = step(nxt, new_params, opt, 1.0)
    assert not bool(out2.valid)


def test_bfloat16_params_get_their_dtype_and_a_float32_mean():
  """The optimizer gets the mean in float32 (never narrower than the
  buffers or params); the params keep bfloat16. XLA divides by the weight
  as a reciprocal product, so the result is 0 to float32 rounding."""
  tx = optax.sgd(1.0)
  params = {"w": jnp.array([1.0, 2.0], jnp.bfloat16)}
  state = wa.init(params, dtype=jnp.float32)
  state = wa.accumulate_sum(
    state, {"w": jnp.array([3.0, 6.0], jnp.bfloat16)}, 3
  )
  new_params, _, _, out = wa.apply_window(tx, state, params, tx.init(params))
  assert bool(out.valid) and new_params["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(new_params["w"], np.float32), [0.0, 0.0], atol=2e-7
  )


def test_errors_name_the_leaf_and_change_nothing():
  tx = optax.sgd(1.0)
  params = {"w": jnp.ones(2), "b": jnp.ones(1)}
  state = wa.accumulate_sum(wa.init(params), params, 1)
  before = _bits(state)
  with pytest.raises(wa.WeightedAccumulationError, match=r"\['b'\]"):
    wa.apply_window(tx, state, {"w": jnp.ones(2)}, tx.init(params))
  with pytest.raises(wa.WeightedAccumulationError, match=r"\['w'\].*shape"):
    wa.apply_window(
      tx, state, {"w": jnp.ones(3), "b": jnp.ones(1)}, tx.init(params)
    )
  for bad in (0.0, -2.0, float("nan"), float("inf")):
    with pytest.raises(
      wa.WeightedAccumulationError, match="apply_window.next_loss_scale"
    ):
      wa.apply_window(tx, state, params, tx.init(params), next_loss_scale=bad)
  with pytest.raises(wa.WeightedAccumulationError, match="optax"):
    wa.apply_window(lambda g: g, state, params, None)
  assert _bits(state) == before


SHAPES = {"embed": (512, 64), "qkv": (64, 192), "bias": (192,), "ln": (64,)}


def _big_params():
  rng = np.random.default_rng(0)
  return {
    k: jnp.asarray(rng.standard_normal(s), jnp.float32)
    for k, s in SHAPES.items()
  }


def _ordered_step(tx):
  """The documented pattern: donated inputs in the order of the outputs
  (jax pairs a donated input with the first output of its shape)."""

  def step(params, opt_state, state):
    return wa.apply_window(tx, state, params, opt_state)

  return jax.jit(step, donate_argnums=(0, 1, 2))


@pytest.mark.parametrize(
  "inner", [optax.adamw(1e-3), optax.sgd(0.1)], ids=["adamw", "sgd"]
)
def test_donated_close_is_in_place_without_temporaries(inner):
  """Params, optimizer state and buffers aliased; no parameter-sized
  temporary (the reset is a broadcast ordered after every read of the
  buffers); the donated buffers are reused."""
  params = _big_params()
  pbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  acc = wa.accumulate_sum(wa.init(params), params, 3.0)
  opt_state = inner.init(params)
  compiled = _ordered_step(inner).lower(params, opt_state, acc).compile()
  ma = compiled.memory_analysis()
  donated = (params, opt_state, acc)
  big = [x for x in jax.tree.leaves(donated) if x.size > 1]
  assert ma.alias_size_in_bytes >= sum(x.nbytes for x in big)
  # Scalars and small reductions' partials only (the smallest leaf is 64
  # floats, 0.14% of the params; the largest 72%).
  assert ma.temp_size_in_bytes <= 0.02 * pbytes
  # Outputs beyond the aliased ones: scalars only (counters, out's flags).
  assert ma.output_size_in_bytes - ma.alias_size_in_bytes <= 1024

  addresses = [x.unsafe_buffer_pointer() for x in big]
  new = compiled(params, opt_state, acc)
  new_big = [x for x in jax.tree.leaves(new[:3]) if x.size > 1]
  assert [x.unsafe_buffer_pointer() for x in new_big] == addresses
  assert bool(new[3].valid)


def test_sharded_params_keep_shardings_and_stay_in_place():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  shard = NamedSharding(mesh, P("fsdp"))
  params = jax.device_put(_big_params(), shard)
  tx = optax.adam(1e-3)
  state = wa.accumulate_sum(wa.init(params), params, 2.0)
  opt_state = tx.init(params)
  ref = jax.device_get(_reference_plain(tx, params, opt_state))
  new_params, _, new_state, out = _ordered_step(tx)(params, opt_state, state)
  assert bool(out.valid)
  for tree in (new_params, new_state.grads):
    for x in jax.tree.leaves(tree):
      assert x.sharding.is_equivalent_to(shard, x.ndim)
  for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)


def _reference_plain(tx, params, opt_state):
  """What a window holding ``params`` once with weight 2 applies."""
  g = jax.tree.map(lambda p: np.asarray(p) / 2.0, params)
  updates, _ = tx.update(g, opt_state, params)
  return optax.apply_updates(params, updates)


def test_dynamic_loss_scale_sets_the_next_window_and_backs_off(variant):
  """A scaler as next_loss_scale means its scale; adjusting it by the closed
  window's finiteness afterwards (the documented pattern) backs off after an
  overflowing window and the next window uses the lowered scale."""
  tx = optax.sgd(1.0)
  params = {"w": jnp.array([1.0, 2.0])}
  scaler = wa.DynamicLossScale(2.0**10, growth_interval=100)
  state = wa.init(params, dtype=jnp.float16, loss_scale=scaler.scale)

  def step(params, opt_state, state, scaler, g, w):
    state = wa.accumulate_mean(state, g, w)
    params, opt_state, state, out = wa.apply_window(
      tx, state, params, opt_state, next_loss_scale=scaler
    )
    scaler = scaler.adjust(out.finite)
    return params, opt_state, wa.set_loss_scale(state, scaler), scaler, out

  step = variant(step)
  before = _bits(params)
  inf_grads = {"w": jnp.array([jnp.inf, 1.0], jnp.float16)}
  params, opt_state, state, scaler, out = step(
    params, tx.init(params), state, scaler, inf_grads, 4.0
  )
  assert not bool(out.finite) and _bits(params) == before
  assert float(scaler.scale) == 2.0**9
  assert float(state.loss_scale) == 2.0**9 and int(state.issued) == 0
  g = {"w": jnp.array([2.0**9 * 0.5, -(2.0**9)], jnp.float16)}
  params, _, state, scaler, out = step(params, opt_state, state, scaler, g, 2.0)
  assert bool(out.valid) and float(out.loss_scale) == 2.0**9
  np.testing.assert_allclose(np.asarray(params["w"]), [0.5, 3.0])
  assert float(state.loss_scale) == 2.0**9
  # The scaler itself as next_loss_scale: its scale becomes the next one's.
  state = wa.accumulate_sum(state, {"w": jnp.ones(2, jnp.float16)}, 1)
  _, _, state, _ = wa.apply_window(
    tx, state, params, tx.init(params), next_loss_scale=wa.DynamicLossScale(8.0)
  )
  assert float(state.loss_scale) == 8.0
