"""``wa.WeightedMultiSteps``: optax's interface, mixed precision, dynamic loss
scaling, checkpoints, and the linen ``wa.TrainState``.

References: ``optax.MultiSteps`` itself, the inner optimizer applied directly
to a full-batch gradient, float64 NumPy arithmetic.
"""

from __future__ import annotations

import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import weighted_accum as wa

RTOL, ATOL = 1e-5, 1e-6


def _assert_close(tree, ref, rtol=RTOL, atol=ATOL):
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    np.testing.assert_allclose(
      np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol
    )


def _data(seed, k=3, rows=4, sizes=None):
  r = np.random.default_rng(seed)
  sizes = r.integers(1, rows + 1, size=k) if sizes is None else sizes
  x = jnp.asarray(r.normal(size=(k, rows, 2)), jnp.float32)
  y = jnp.asarray(r.normal(size=(k, rows)), jnp.float32)
  mask = jnp.asarray(
    np.arange(rows)[None] < np.asarray(sizes)[:, None], jnp.float32
  )
  return x, y, mask


def _loss(params, x, y, mask):
  pred = x @ params["w"] + params["b"]
  return jnp.sum(mask * (pred - y) ** 2) / jnp.sum(mask)


def _params():
  return {"w": jnp.array([0.5, -1.0]), "b": jnp.array(0.25)}


def _reference(inner, params, windows):
  state = inner.init(params)
  for x, y, mask in windows:
    flat = lambda a: a.reshape((-1,) + a.shape[2:])
    g = jax.grad(_loss)(params, flat(x), flat(y), flat(mask))
    u, state = inner.update(g, state, params)
    params = optax.apply_updates(params, u)
  return params


# -- interface ------------------------------------------------------------------


def test_state_has_multisteps_fields_and_methods():
  tx = wa.WeightedMultiSteps(optax.adam(0.1), 2, mode="mean")
  state = tx.init(_params())
  assert state._fields[:5] == optax.MultiStepsState._fields
  assert tx.inner_opt.init is not None
  assert isinstance(
    tx.gradient_transformation(), optax.GradientTransformationExtraArgs
  )
  assert not bool(tx.has_updated(state))
  g = jax.tree.map(jnp.ones_like, _params())
  for _ in range(2):
    _, state = tx.update(g, state, _params(), weight=2)
  assert bool(tx.has_updated(state)) and bool(wa.has_updated(state))
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 0
  assert int(state.inner_opt_state[0].count) == 1


def test_functional_form_builds_the_same_transformation():
  windows = [_data(1), _data(2)]
  results = []
  for tx in (
    wa.WeightedMultiSteps(optax.adamw(0.05), every_k_schedule=3, mode="mean"),
    wa.WeightedMultiSteps(
      optax.adamw(0.05), 3, mode="mean"
    ).gradient_transformation(),
    wa.WeightedMultiSteps(optax.adamw(0.05), lambda s: 3, mode="mean"),
  ):
    params, state = _params(), None
    state = tx.init(params)
    for x, y, mask in windows:
      for i in range(3):
        g = jax.grad(_loss)(params, x[i], y[i], mask[i])
        u, state = tx.update(g, state, params, weight=jnp.sum(mask[i]))
        params = optax.apply_updates(params, u)
    results.append((params, state))
  for params, state in results[1:]:
    _assert_close(params, results[0][0], rtol=0, atol=0)
    assert jax.tree.structure(state) == jax.tree.structure(results[0][1])
  _assert_close(
    results[0][0], _reference(optax.adamw(0.05), _params(), windows)
  )


def test_callable_schedule_is_traced_and_never_recompiles():
  traces = []
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0), lambda step: jnp.where(step < 2, 1, 3), mode="mean"
  )

  def step(params, state, g, w):
    traces.append(1)
    u, state = tx.update(g, state, params, weight=w)
    return optax.apply_updates(params, u), state

  jstep = jax.jit(step)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  closes = []
  for i in range(8):
    params, state = jstep(
      params, state, {"w": jnp.full(2, float(i))}, float(i + 1)
    )
    closes.append(bool(wa.has_updated(state)))
  assert len(traces) == 1
  assert closes == [True, True, False, False, True, False, False, True]
  # Windows: [0], [1], [2, 3, 4], [5, 6, 7]; weighted means of mean grads.
  mean = lambda idx: sum(i * (i + 1) for i in idx) / sum(i + 1 for i in idx)
  want = -(mean([0]) + mean([1]) + mean([2, 3, 4]) + mean([5, 6, 7]))
  np.testing.assert_allclose(np.asarray(params["w"]), [want] * 2, rtol=1e-6)


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_use_grad_mean_false_hands_over_the_weighted_sum(mode):
  scale = 8.0
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0), 2, use_grad_mean=False, mode=mode, loss_scale=scale
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  gs = [np.array([1.0, -2.0]), np.array([3.0, 0.5])]
  ws = [3.0, 5.0]
  for g, w in zip(gs, ws):
    u, state = tx.update(
      {"w": jnp.asarray(scale * g, jnp.float32)}, state, params, weight=w
    )
  # mean: sum_i w_i g_i; sum: sum_i g_i; never divided by the weight, and
  # unscaled by the loss scale.
  want = sum(w * g for g, w in zip(gs, ws)) if mode == "mean" else sum(gs)
  np.testing.assert_allclose(np.asarray(u["w"]), -want, rtol=1e-6)


def test_should_skip_update_fn_skips_one_microbatch_and_counts_it():
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite, mode="mean"
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  assert set(state.skip_state) == {"should_skip", "num_not_finite"}
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.array([1.0, 2.0])}, state, params, weight=3.0)
  _, state = update({"w": jnp.array([jnp.nan, 2.0])}, state, params, weight=5.0)
  assert int(state.mini_step) == 1 and int(state.skipped) == 1
  assert bool(state.skip_state["should_skip"])
  assert int(wa.window_counters(state)["issued"]) == 1
  u, state = update({"w": jnp.array([5.0, -2.0])}, state, params, weight=1.0)
  assert bool(wa.has_updated(state)) and not bool(state.nonfinite)
  np.testing.assert_allclose(
    np.asarray(u["w"]), [-(3 * 1 + 5) / 4, -(3 * 2 - 2) / 4]
  )


def test_should_skip_that_is_not_a_bool_scalar_is_refused_by_name():
  """A verdict per element is refused naming the option and what it gave."""
  per_leaf = lambda g, step, p: (jnp.isnan(g["w"]), ())
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0), 2, should_skip_update_fn=per_leaf, mode="mean"
  )
  params = {"w": jnp.zeros(2)}
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=r"should_skip_update_fn=\.\.\.\): should_skip is bool \(2,\)",
  ):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params, weight=1.0)


def test_inject_hyperparams_learning_rate_read_and_changed_under_jit():
  tx = wa.WeightedMultiSteps(
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), 2, mode="mean"
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, g, lr):
    lr_before = state.inner_opt_state.hyperparams["learning_rate"]
    state.inner_opt_state.hyperparams["learning_rate"] = lr
    u, state = tx.update(g, state, params, weight=1.0)
    return optax.apply_updates(params, u), state, lr_before

  g = {"w": jnp.ones(2)}
  params, state, before = step(params, state, g, 0.5)
  assert float(before) == pytest.approx(0.1)
  params, state, before = step(params, state, g, 0.5)
  assert float(before) == pytest.approx(0.5)
  np.testing.assert_allclose(np.asarray(params["w"]), [-0.5, -0.5])
  assert float(state.inner_opt_state.hyperparams["learning_rate"]) == 0.5


# -- mixed precision -----------------------------------------------------------

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=lambda d: d.__name__)
def test_mixed_precision_dtype_and_finiteness_as_multisteps(
  param_dtype, grad_dtype
):
  """Adam over two windows: the updates have MultiSteps' dtypes, are finite
  where its are, and (weight 1) agree with its to the grads' precision."""
  params = {"w": jnp.array([1.0, -2.0, 3.0], param_dtype)}
  grads = [
    {"w": jnp.array(g, grad_dtype)}
    for g in ([0.5, -1.0, 2.0], [1.5, 0.25, -3.0])
  ] * 2
  ours = wa.WeightedMultiSteps(optax.adam(0.1), 2, mode="mean")
  theirs = optax.MultiSteps(optax.adam(0.1), 2)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  for g in grads:
    u_ours, s_ours = jax.jit(ours.update)(g, s_ours, params, weight=1)
    u_theirs, s_theirs = jax.jit(theirs.update)(g, s_theirs, params)
    assert u_ours["w"].dtype == u_theirs["w"].dtype
    finite = np.isfinite(np.asarray(u_theirs["w"], np.float32))
    assert np.all(np.isfinite(np.asarray(u_ours["w"], np.float32))[finite])
    tol = 1e-6 if jnp.dtype(grad_dtype) == jnp.float32 else 1e-2
    np.testing.assert_allclose(
      np.asarray(u_ours["w"], np.float32),
      np.asarray(u_theirs["w"], np.float32),
      rtol=tol,
      atol=tol,
    )


@pytest.mark.parametrize("pdtype", [jnp.float32, jnp.bfloat16])
def test_dtype_none_means_the_params_dtype_as_in_optax(pdtype):
  """``accumulator_dtype=None`` is optax's "as the params": the buffers take
  the params' dtype in WeightedMultiSteps (as optax.MultiSteps' buffers;
  sgd on float64 NumPy's mean), wa.init, the in-step function and
  optax_accumulator; params of two dtypes are refused naming both."""
  params = {"w": jnp.array([1.0, -2.0], pdtype)}
  grads = [{"w": jnp.array(g, pdtype)} for g in ([0.5, 1.5], [-1.0, 2.0])]
  ours = wa.WeightedMultiSteps(
    optax.sgd(0.5), 2, accumulator_dtype=None, mode="mean"
  )
  theirs = optax.MultiSteps(optax.sgd(0.5), 2, accumulator_dtype=None)
  state = ours.init(params)
  assert state.acc_grads["w"].dtype == theirs.init(params).acc_grads["w"].dtype
  assert state.acc_grads["w"].dtype == pdtype
  for g in grads:
    upd, state = jax.jit(ours.update)(g, state, params, weight=1.0)
  _assert_close(upd, {"w": -0.5 * np.array([-0.25, 1.75])})
  assert wa.init(params, dtype=None).grads["w"].dtype == pdtype

  def loss(p, x):
    return jnp.sum(p["w"] * x), jnp.float32(x.shape[0])

  f = wa.microbatched_value_and_grad(loss, 2, mode="sum", dtype=None)
  x = jnp.arange(8.0, dtype=pdtype).reshape(4, 2)
  _, out = f(params, x)
  assert out.grads["w"].dtype == pdtype
  _assert_close(out.grads, {"w": np.asarray(x, np.float64).mean(0)})
  acc = wa.optax_accumulator("sum", dtype=None)
  g = optax.microbatching.microbatch(
    jax.value_and_grad(loss, has_aux=True), (1,), 2, accumulator=acc
  )(params, x)[1]
  assert g["w"].dtype == pdtype
  with pytest.raises(wa.WeightedAccumulationError, match="bfloat16.*float32"):
    wa.init({"a": jnp.ones(1), "b": jnp.ones(1, jnp.bfloat16)}, dtype=None)


def test_float16_params_float32_grads_get_float32_window():
  """The window reaches Adam in float32 (as MultiSteps hands it), never as a
  float16 mean that overflows: the updates are finite and exact."""
  params = {"w": jnp.array([1.0, -1.0], jnp.float16)}
  g = {"w": jnp.array([1e5, -3e5], jnp.float32)}  # beyond float16's range
  tx = wa.WeightedMultiSteps(optax.adam(0.1), 1, mode="mean")
  u, state = jax.jit(tx.update)(g, tx.init(params), params, weight=1)
  assert bool(wa.has_updated(state)) and not bool(state.nonfinite)
  ref, _ = optax.MultiSteps(optax.adam(0.1), 1).update(
    g, optax.MultiSteps(optax.adam(0.1), 1).init(params), params
  )
  assert u["w"].dtype == ref["w"].dtype
  np.testing.assert_allclose(
    np.asarray(u["w"], np.float32), np.asarray(ref["w"], np.float32), rtol=1e-3
  )
  assert np.all(np.isfinite(np.asarray(u["w"], np.float32)))


def test_close_is_built_once_whether_or_not_buffers_carry_updates():
  """The inner update runs in Python as often per trace of a step with
  float32 buffers (the updates travel in them) as with bfloat16 ones (they
  do not), at most twice: once abstractly (``jax.eval_shape``, planning the
  updates' shapes) and once in the close branch; the close is never traced
  again. The window is right in both: sgd(1) on the weighted mean, against
  float64 NumPy."""
  counts = []
  for dtype in (jnp.float32, jnp.bfloat16):
    calls = []

    def update_fn(updates, state, params=None, calls=calls):
      calls.append(1)
      return jax.tree.map(lambda x: -x, updates), state

    inner = optax.GradientTransformation(
      lambda p: optax.EmptyState(), update_fn
    )
    tx = wa.WeightedMultiSteps(inner, 2, accumulator_dtype=dtype, mode="mean")
    params = {"w": jnp.zeros(3)}
    step = jax.jit(tx.update)  # one trace, reused by the second call
    state = tx.init(params)
    grads = [np.array([1.0, 2.0, 4.0]), np.array([3.0, 0.0, 8.0])]
    for g, w in zip(grads, (3.0, 1.0)):
      u, state = step(
        {"w": jnp.asarray(g, jnp.float32)}, state, params, weight=w
      )
    counts.append(len(calls))
    want = -(3 * grads[0] + grads[1]) / 4
    np.testing.assert_allclose(np.asarray(u["w"], np.float64), want, rtol=1e-2)
    assert bool(wa.has_updated(state)) and u["w"].dtype == jnp.float32
  assert counts[0] == counts[1] <= 2, counts


def test_nonfinite_updates_are_returned_by_default_as_multisteps_does():
  """By default only the window's gradients are checked: an inner update
  that overflows is returned as optax.MultiSteps returns it."""
  params = {"w": jnp.ones(2, jnp.float16)}
  square = optax.stateless(
    lambda u, p: jax.tree.map(lambda x: x * x * jnp.float16(1e3), u)
  )
  g = {"w": jnp.full(2, 10.0, jnp.float16)}
  ours = wa.WeightedMultiSteps(square, 1, mode="mean")
  u, state = jax.jit(ours.update)(g, ours.init(params), params, weight=1)
  ms = optax.MultiSteps(square, 1)
  u_ms, _ = ms.update(g, ms.init(params), params)
  np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(u_ms["w"]))
  assert bool(wa.has_updated(state)) and not bool(state.nonfinite)


def test_window_with_nonfinite_updates_is_not_applied():
  """With skip_nonfinite_updates=True, finite grads whose inner updates
  overflow (an optimizer computing in float16): nothing applied, flagged and
  counted; the next window with finite updates applies."""
  params = {"w": jnp.ones(2, jnp.float16)}
  square = optax.stateless(
    lambda u, p: jax.tree.map(lambda x: x * x * jnp.float16(1e3), u)
  )
  tx = wa.WeightedMultiSteps(
    square, 1, mode="mean", skip_nonfinite_updates=True
  )
  update = jax.jit(tx.update)
  state = tx.init(params)
  u, state = update(
    {"w": jnp.full(2, 10.0, jnp.float16)}, state, params, weight=1
  )  # 1e5 > float16's max
  np.testing.assert_array_equal(np.asarray(u["w"]), [0, 0])
  assert bool(state.nonfinite) and int(state.nonfinite_windows) == 1
  assert not bool(wa.has_updated(state)) and int(state.gradient_step) == 0
  u, state = update(
    {"w": jnp.full(2, 2.0, jnp.float16)}, state, params, weight=1
  )
  assert bool(wa.has_updated(state)) and not bool(state.nonfinite)
  np.testing.assert_array_equal(np.asarray(u["w"], np.float32), [4e3, 4e3])


# -- the wrapper's defects from the reliability review --------------------------


@pytest.mark.parametrize(
  "bad,needle",
  [
    (2**31, "every_k"),
    (-1, "every_k"),
    (0, "every_k"),
    (2.0, "every_k"),
    (True, "every_k"),
    ("3", "every_k"),
    (np.int64(2**40), "every_k"),
  ],
)
def test_bad_every_k_raises_naming_it(bad, needle):
  with pytest.raises(wa.WeightedAccumulationError, match=needle):
    wa.WeightedMultiSteps(optax.sgd(0.1), bad, mode="mean")
  with pytest.raises(wa.WeightedAccumulationError, match="every_k_schedule"):
    wa.WeightedMultiSteps(optax.sgd(0.1), bad, mode="mean")


def test_every_k_at_the_int32_limit_is_accepted():
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2**31 - 1, mode="mean")
  _, state = tx.update(
    {"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}), weight=1
  )
  assert int(state.mini_step) == 1


@pytest.mark.parametrize(
  "kwargs,needle",
  [
    (dict(use_grad_mean=1), "use_grad_mean"),
    (dict(use_grad_mean="yes"), "use_grad_mean"),
    (dict(should_skip_update_fn=3), "should_skip_update_fn"),
    (dict(accumulator_dtype=jnp.int8), "accumulator_dtype"),
    (dict(accumulator_dtype="nope"), "accumulator_dtype"),
    (dict(mode="avg"), "mode"),
    (dict(mode=None), "mode"),
    (dict(loss_scale=-1.0), "loss_scale"),
    (dict(axis_name=3), "axis_name"),
    (dict(axis_name=""), "axis_name"),
  ],
)
def test_bad_constructor_arguments_raise_naming_them(kwargs, needle):
  with pytest.raises(wa.WeightedAccumulationError, match=needle):
    wa.WeightedMultiSteps(optax.sgd(0.1), 2, **{"mode": "mean", **kwargs})


def test_bad_inner_optimizer_and_finish_raise():
  with pytest.raises(wa.WeightedAccumulationError, match=r"\(opt\)"):
    wa.WeightedMultiSteps(lambda x: x, 2, mode="mean")
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="mean")
  params = {"w": jnp.ones(1)}
  for finish in ("yes", 1, jnp.ones(2, bool)):
    with pytest.raises(wa.WeightedAccumulationError, match="finish"):
      tx.update(params, tx.init(params), params, weight=1, finish=finish)


def test_zero_weight_close_keeps_next_loss_scale():
  """An all-zero window closes with next_loss_scale=4: it stays open, and
  the next microbatches (scaled by 4) are unscaled by 4."""
  tx = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="sum")
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  nan = {"w": jnp.full(2, jnp.nan)}
  _, state = tx.update(nan, state, params, weight=0)
  _, state = tx.update(nan, state, params, weight=0, next_loss_scale=4.0)
  assert int(state.empty_windows) == 1
  assert float(wa.window_counters(state)["loss_scale"]) == 4.0
  _, state = tx.update({"w": jnp.array([4.0, 8.0])}, state, params, weight=1)
  u, state = tx.update({"w": jnp.array([4.0, 0.0])}, state, params, weight=1)
  assert bool(wa.has_updated(state))
  np.testing.assert_allclose(np.asarray(u["w"]), [-1.0, -1.0])


# -- dynamic loss scaling --------------------------------------------------------


def test_dynamic_loss_scale_skips_backs_off_grows_and_unscales():
  """Scripted windows of float16 grads of a loss times the open window's
  scale: an overflowing window is skipped (inner state untouched) and the
  scale halves; after growth_interval clean windows it doubles; the params
  equal a float32 SGD reference over the applied windows."""
  lr, interval = 0.5, 2
  scaler = wa.DynamicLossScale(2.0**14, growth_interval=interval)
  tx = wa.WeightedMultiSteps(optax.adam(lr), 2, mode="sum", loss_scale=scaler)
  ref_tx = optax.adam(lr)
  params = {"w": jnp.array([1.0, -2.0], jnp.float32)}
  ref_params, ref_state = params, ref_tx.init(params)
  state = tx.init(params)

  @jax.jit
  def step(params, state, g, w):
    scale = state.window.loss_scale
    scaled = {"w": (scale * g).astype(jnp.float16)}
    u, state = tx.update(scaled, state, params, weight=w)
    return optax.apply_updates(params, u), state

  rng = np.random.default_rng(3)
  # Window 0 overflows (8 * 2**14 > 65504); then clean windows.
  script = [8.0, 1.0, 1.0, 1.0, 1.0]
  scales = []
  for i, amp in enumerate(script):
    scales.append(float(wa.window_counters(state)["loss_scale"]))
    inner_before = jax.tree.map(np.asarray, state.inner_opt_state)
    gs = [amp * rng.uniform(-1, 1, 2).astype(np.float32) for _ in range(2)]
    ws = [2.0, 3.0]
    for g, w in zip(gs, ws):
      params, state = step(params, state, jnp.asarray(g), w)
    if i == 0:
      assert bool(state.nonfinite) and not bool(wa.has_updated(state))
      for a, b in zip(
        jax.tree.leaves(state.inner_opt_state), jax.tree.leaves(inner_before)
      ):
        np.testing.assert_array_equal(np.asarray(a), b)
      continue
    assert bool(wa.has_updated(state))
    # The window's gradient, as the float16 grads held it, unscaled by the
    # scale it was accumulated with.
    s = scales[-1]
    g16 = sum(np.float64(np.float16(s * g)) for g in gs) / s / sum(ws)
    u, ref_state = ref_tx.update(
      {"w": jnp.asarray(g16, jnp.float32)}, ref_state, ref_params
    )
    ref_params = optax.apply_updates(ref_params, u)
  assert scales == [2.0**14, 2.0**13, 2.0**13, 2.0**14, 2.0**14]
  assert float(state.loss_scaler.scale) == 2.0**15
  assert int(state.nonfinite_windows) == 1 and int(state.gradient_step) == 4
  _assert_close(params, ref_params, rtol=1e-5, atol=1e-6)


def test_dynamic_loss_scale_refuses_next_loss_scale():
  tx = wa.WeightedMultiSteps(
    optax.sgd(0.1), 2, loss_scale=wa.DynamicLossScale(4.0), mode="mean"
  )
  params = {"w": jnp.ones(1)}
  with pytest.raises(wa.WeightedAccumulationError, match="next_loss_scale"):
    tx.update(params, tx.init(params), params, weight=1, next_loss_scale=2.0)


# -- checkpoints -------------------------------------------------------------------


def test_checkpoint_round_trip_continues_bit_for_bit(tmp_path):
  """Mid-window state with a dynamic loss scale and a skip state, saved with
  AccumSave and restored into a fresh template, continues exactly as the
  uninterrupted run."""

  def make():
    return wa.WeightedMultiSteps(
      optax.adamw(0.05),
      3,
      should_skip_update_fn=optax.skip_not_finite,
      loss_scale=wa.DynamicLossScale(8.0, growth_interval=1),
      mode="mean",
    )

  tx = make()
  step = jax.jit(
    lambda p, s, g, w: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p, weight=w)
    )
  )
  gs = [
    {"w": jnp.array([float(i), 1.0 - i]), "b": jnp.array(0.5 * i)}
    for i in range(8)
  ]
  run = lambda p, s, lo, hi: functools.reduce(
    lambda c, i: step(c[0], c[1], gs[i], float(i + 1)), range(lo, hi), (p, s)
  )
  want_p, want_s = run(_params(), tx.init(_params()), 0, 8)
  params, state = run(_params(), tx.init(_params()), 0, 4)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(
      4,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt=wa.checkpoint.AccumSave(state)
      ),
    )
  tx2 = make()
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    got = mngr.restore(
      4,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params),
        opt=wa.checkpoint.AccumRestore(tx2.init(_params())),
      ),
    )
  assert int(got.opt.mini_step) == 1 and int(got.opt.gradient_step) == 1
  assert float(got.opt.loss_scaler.scale) == float(state.loss_scaler.scale)
  params, state = run(got.params, got.opt, 4, 8)
  for a, b in zip(
    jax.tree.leaves((params, state)), jax.tree.leaves((want_p, want_s))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- Flax linen TrainState -------------------------------------------------------


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(jnp.tanh(nn.Dense(3)(x)))[..., 0]


def _linen_loss(apply_fn, params, x, y, mask):
  return jnp.sum(mask * (apply_fn({"params": params}, x) - y) ** 2) / (
    jnp.sum(mask)
  )


def _linen_setup():
  model = _Linen()
  params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
  return model, params


@jax.jit
def _linen_step(state, x, y, mask):
  grads = jax.grad(functools.partial(_linen_loss, state.apply_fn))(
    state.params, x, y, mask
  )
  return state.apply_gradients(grads=grads, weight=jnp.sum(mask))


def test_linen_train_state_matches_full_batch_reference():
  model, params = _linen_setup()
  state = wa.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=wa.WeightedMultiSteps(optax.adamw(0.05), 3, mode="mean"),
  )
  windows = [_data(10), _data(11, sizes=[4, 1, 2]), _data(12)]
  for x, y, mask in windows:
    for i in range(3):
      state = _linen_step(state, x[i], y[i], mask[i])
  assert int(state.step) == 9 and int(state.opt_state.gradient_step) == 3

  inner = optax.adamw(0.05)
  ref, ref_state = params, inner.init(params)
  for x, y, mask in windows:
    flat = lambda a: a.reshape((-1,) + a.shape[2:])
    g = jax.grad(functools.partial(_linen_loss, model.apply))(
      ref, flat(x), flat(y), flat(mask)
    )
    u, ref_state = inner.update(g, ref_state, ref)
    ref = optax.apply_updates(ref, u)
  _assert_close(state.params, ref)


def test_linen_train_state_finish_closes_a_short_window():
  model, params = _linen_setup()
  state = wa.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=wa.WeightedMultiSteps(optax.sgd(0.1), None, mode="mean"),
  )
  x, y, mask = _data(20, k=2)
  grads = jax.grad(functools.partial(_linen_loss, model.apply))(
    params, x[0], y[0], mask[0]
  )
  state = state.apply_gradients(
    grads=grads, weight=jnp.sum(mask[0]), finish=True
  )
  assert bool(wa.has_updated(state.opt_state))
  _assert_close(
    state.params, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  )


def test_linen_train_state_orbax_round_trip(tmp_path):
  model, params = _linen_setup()
  tx = wa.WeightedMultiSteps(optax.adam(0.05), 3, mode="mean")
  state = wa.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  data = [_data(30), _data(31)]
  micro = [(x[i], y[i], m[i]) for x, y, m in data for i in range(3)]
  full = state
  for mb in micro:
    full = _linen_step(full, *mb)
  for mb in micro[:4]:  # mid-window 2
    state = _linen_step(state, *mb)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(4, args=ocp.args.Composite(state=wa.checkpoint.AccumSave(state)))
  fresh = wa.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(
      4, args=ocp.args.Composite(state=wa.checkpoint.AccumRestore(fresh))
    ).state
  assert isinstance(restored, wa.TrainState) and int(restored.step) == 4
  assert int(wa.window_counters(restored.opt_state)["mini_step"]) == 1
  for mb in micro[4:]:
    restored = _linen_step(restored, *mb)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(full)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- the docs pages' examples -------------------------------------------------------

_DOCS = pathlib.Path(__file__).parents[2] / "docs"
_REGION = re.compile(r"<!-- BEGIN (\S+) -->\n(.*?)<!-- END \1 -->", re.S)
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_EXPECTED = re.compile(r"^[ \t]*print\(.*\)\s+#\s?(.*?)\s*$", re.M)
_PAGES = ("optax.md", "migration.md")


def _regions():
  for page in _PAGES:
    text = (_DOCS / page).read_text()
    assert text.count("```python") == sum(
      len(_BLOCK.findall(m.group(2))) for m in _REGION.finditer(text)
    ), f"docs/{page}: a python block outside a BEGIN/END region"
    for m in _REGION.finditer(text):
      yield pytest.param(page, m.group(2), id=f"{page}::{m.group(1)}")


@pytest.mark.parametrize("page,region", list(_regions()))
def test_docs_examples_run_and_print_what_they_claim(
  page, region, capsys, tmp_path, monkeypatch
):
  """Each BEGIN/END region of docs/optax.md and docs/migration.md runs in a
  fresh namespace; a ``print(...)  # expected`` line states its output."""
  monkeypatch.chdir(tmp_path)
  blocks = _BLOCK.findall(region)
  namespace = {}
  for block in blocks:
    exec(compile(block, f"docs/{page}", "exec"), namespace)  # pylint: disable=exec-used
  want = [e for b in blocks for e in _EXPECTED.findall(b)]
  assert want and capsys.readouterr().out.splitlines() == want


@pytest.mark.parametrize("reader", ["has_updated", "window_counters"])
def test_readers_refuse_optax_multi_steps_state_by_name(reader):
  """``optax.MultiSteps``' state has no window: the readers name what was
  passed, what they expect, and how to read optax's own state."""
  params = {"w": jnp.zeros(2)}
  state = optax.MultiSteps(optax.sgd(0.1), 2).init(params)
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=rf"{reader}\(state\): expected WeightedMultiStepsState, got "
    r"MultiStepsState.*optax\.MultiSteps\(\.\.\.\)\.has_updated",
  ):
    getattr(wa, reader)(state)
  with pytest.raises(wa.WeightedAccumulationError, match="got tuple"):
    getattr(wa, reader)((state,))


def _scaled_tx(scale):
  return wa.WeightedMultiSteps(
    optax.sgd(0.5),
    2,
    mode="sum",
    loss_scale=wa.DynamicLossScale(scale, growth_interval=1),
  )


@pytest.mark.parametrize("build", ["jit", "eval_shape", "jit_traced_scale"])
def test_dynamic_loss_scale_built_under_a_transformation(build):
  """The create-train-state idiom: the scaler (its fields traced) is built
  inside jax.jit / jax.eval_shape with the wrapper and its state. The state
  is the one built eagerly, and two windows then run identically; a traced
  invalid scale makes the window unusable, never a silent scale."""
  params = {"w": jnp.arange(3.0)}
  eager_tx = _scaled_tx(2.0**4)
  want = eager_tx.init(params)
  if build == "eval_shape":
    got = jax.eval_shape(lambda p: _scaled_tx(2.0**4).init(p), params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert (a.shape, a.dtype) == (b.shape, b.dtype)
    return
  if build == "jit":
    got = jax.jit(lambda p: _scaled_tx(2.0**4).init(p))(params)
  else:
    got = jax.jit(lambda p, s: _scaled_tx(s).init(p))(params, 2.0**4)
  _assert_close(got, want, rtol=0, atol=0)
  g = {"w": jnp.asarray([2.0**4, -(2.0**5), 2.0**3])}  # scaled grads
  for weight in (1.0, 3.0, 2.0, 2.0):
    _, got = eager_tx.update(g, got, params, weight=weight)
    _, want = eager_tx.update(g, want, params, weight=weight)
  _assert_close(got, want, rtol=0, atol=0)
  assert float(wa.window_counters(got)["loss_scale"]) == 2.0**6
  bad = jax.jit(lambda p, s: _scaled_tx(s).init(p))(params, -1.0)
  assert not np.isfinite(float(wa.window_counters(bad)["loss_scale"]))


def test_the_wrapper_with_axis_name_counts_issued_as_a_microbatch_window():
  """The wrapper built with ``axis_name`` holds a microbatch-mode window:
  its ``issued`` counts each microbatch once per replica, as
  ``wa.init(..., reduce="microbatch")`` + ``wa.accumulate_sum`` does."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  params = {"w": jnp.zeros(3)}
  tx = wa.WeightedMultiSteps(optax.sgd(1.0), 4, axis_name="data", mode="sum")

  def wrapper(state, g, w):
    for _ in range(2):
      state = tx.update({"w": g[0]}, state, params, weight=w[0])[1]
    return wa.window_counters(state)["issued"]

  def functional(g, w):
    s = wa.init(params, axis_name="data", reduce="microbatch")
    for _ in range(2):
      s = wa.accumulate_sum(s, {"w": g[0]}, w[0])
    return s.issued

  g, w = jnp.ones((2, 3)), jnp.array([1.0, 3.0])
  specs = dict(mesh=mesh, out_specs=P())
  got = jax.jit(
    jax.shard_map(wrapper, in_specs=(P(), P("data"), P("data")), **specs)
  )(tx.init(params), g, w)
  want = jax.jit(
    jax.shard_map(functional, in_specs=(P("data"), P("data")), **specs)
  )(g, w)
  assert int(want) == 4 and int(got) == int(want)
