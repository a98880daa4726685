"""The optax wrapper (``WeightedMultiSteps`` / ``weighted_multi_steps``)
against independent references.

The reference for a window is the gradient of the full window's mean loss
(one ``jax.grad`` over all its items, no accumulation), handed to the inner
optimizer directly; for float16 inputs, float64 NumPy arithmetic. Microbatches
are padded to one shape and masked, so each step compiles once.
"""

from __future__ import annotations

import functools
import pathlib
import re

from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import _helpers
import weighted_accum as wa

D = 3  # input features
H = 4  # hidden units
MAXB = 5  # rows per (padded) microbatch
RTOL, ATOL = 1e-5, 1e-6

INNERS = {
  "sgd": lambda: optax.sgd(0.1, momentum=0.9),
  "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
}


def _init_params(seed=0):
  return _helpers.make_params(seed, D, H)


def _fresh(tree):
  """New device arrays (the steps donate theirs)."""
  return jax.tree.map(lambda x: jnp.array(np.asarray(x)), tree)


_sum_loss = _helpers.loss_sum
_mean_loss = _helpers.loss_mean  # NaN for a fully masked microbatch


def _data(sizes, seed):
  """Microbatches of the given valid-row counts, padded to MAXB rows."""
  r = np.random.default_rng(seed)
  k = len(sizes)
  x = r.normal(size=(k, MAXB, D)).astype(np.float32)
  y = r.normal(size=(k, MAXB)).astype(np.float32)
  mask = (np.arange(MAXB)[None, :] < np.asarray(sizes)[:, None]).astype(
    np.float32
  )
  return x, y, mask


@jax.jit
def _window_grad(params, x, y, mask):
  """The full window's mean-loss gradient: one grad over all its items."""
  flat = lambda a: a.reshape((-1,) + a.shape[2:])
  return jax.grad(_mean_loss)(params, flat(x), flat(y), flat(mask))


def _reference(inner, params, windows):
  """Applies ``inner`` directly to each non-empty window's full gradient."""
  params = _fresh(params)
  state = inner.init(params)
  for x, y, mask in windows:
    if mask.sum() == 0:
      continue
    g = _window_grad(params, x, y, mask)
    updates, state = inner.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _make_step(tx, mode, donate=True):
  loss = _mean_loss if mode == "mean" else _sum_loss

  def step(params, state, x, y, mask, finish):
    g = jax.grad(loss)(params, x, y, mask)
    updates, state = tx.update(
      g, state, params, weight=jnp.sum(mask), finish=finish
    )
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def _run(step, tx, params, windows, finish_last=False):
  params = _fresh(params)
  state = tx.init(params)
  for x, y, mask in windows:
    for i in range(len(x)):
      finish = jnp.bool_(finish_last and i == len(x) - 1)
      params, state = step(params, state, x[i], y[i], mask[i], finish)
  return params, state


def _assert_close(tree, ref, rtol=RTOL, atol=ATOL):
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=rtol, atol=atol
    )


def _count(inner_state):
  return int(inner_state[0].count)


_STEPS = {}


def _cached_step(inner_name, mode, k):
  key = (inner_name, mode, k)
  if key not in _STEPS:
    tx = wa.WeightedMultiSteps(INNERS[inner_name](), k, mode=mode)
    _STEPS[key] = (tx, _make_step(tx, mode))
  return _STEPS[key]


# -- 1. correctness over several windows ------------------------------------


@pytest.mark.parametrize("mode", ["mean", "sum"])
@pytest.mark.parametrize("inner_name", ["sgd", "adamw"])
@given(
  sizes=st.lists(
    st.lists(st.integers(0, MAXB), min_size=3, max_size=3),
    min_size=1,
    max_size=3,
  ),
  seed=st.integers(0, 2**16),
)
def test_matches_full_batch_reference(inner_name, mode, sizes, seed):
  tx, step = _cached_step(inner_name, mode, 3)
  windows = [_data(s, seed + i) for i, s in enumerate(sizes)]
  params0 = _init_params(seed % 7)
  got, state = _run(step, tx, params0, windows)
  want, want_inner = _reference(INNERS[inner_name](), params0, windows)
  _assert_close(got, want)
  applied = sum(1 for s in sizes if sum(s) > 0)
  assert int(state.gradient_step) == applied
  if inner_name == "adamw":
    assert _count(state.inner_state) == _count(want_inner) == applied


def test_eager_update_matches_reference():
  """The same without jit: update called eagerly, microbatch by microbatch."""
  inner = INNERS["adamw"]()
  tx = wa.WeightedMultiSteps(inner, 2, mode="mean")
  windows = [_data([4, 1], 1), _data([2, 5], 2)]
  params = _fresh(_init_params())
  state = tx.init(params)
  for x, y, mask in windows:
    for i in range(2):
      g = jax.grad(_mean_loss)(params, x[i], y[i], mask[i])
      updates, state = tx.update(g, state, params, weight=float(mask[i].sum()))
      params = optax.apply_updates(params, updates)
  want, _ = _reference(INNERS["adamw"](), _init_params(), windows)
  _assert_close(params, want)


# -- 2. against optax.MultiSteps ----------------------------------------------


@pytest.mark.parametrize("inner_name", ["sgd", "adamw"])
def test_equal_weights_match_multisteps_unequal_do_not(inner_name):
  k = 3
  ms = optax.MultiSteps(INNERS[inner_name](), every_k_schedule=k)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def ms_step(params, state, x, y, mask):
    g = jax.grad(_mean_loss)(params, x, y, mask)
    updates, state = ms.update(g, state, params)
    return optax.apply_updates(params, updates), state

  def run_ms(windows):
    params = _fresh(_init_params())
    state = ms.init(params)
    for x, y, mask in windows:
      for i in range(k):
        params, state = ms_step(params, state, x[i], y[i], mask[i])
    return params

  tx, step = _cached_step(inner_name, "mean", k)
  equal = [_data([4, 4, 4], 10), _data([5, 5, 5], 11)]
  _assert_close(_run(step, tx, _init_params(), equal)[0], run_ms(equal))

  unequal = [_data([5, 1, 2], 10), _data([1, 5, 3], 11)]
  got = _run(step, tx, _init_params(), unequal)[0]
  _assert_close(
    got, _reference(INNERS[inner_name](), _init_params(), unequal)[0]
  )
  biased = run_ms(unequal)
  diff = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(biased))
  )
  assert diff > 1e-3


# -- 3. partial windows and empty windows ---------------------------------------


@pytest.mark.parametrize("every_k", [4, None])
def test_finish_closes_partial_windows(every_k):
  """finish=True (traced) closes short windows, each normalised by its own
  weight; with every_k=None only finish closes."""
  tx = wa.WeightedMultiSteps(INNERS["adamw"](), every_k, mode="mean")
  step = _make_step(tx, "mean")
  windows = [_data([3, 1], 20), _data([2, 5, 1], 21), _data([4], 22)]
  got, state = _run(step, tx, _init_params(), windows, finish_last=True)
  want, want_inner = _reference(INNERS["adamw"](), _init_params(), windows)
  _assert_close(got, want)
  assert int(state.gradient_step) == 3 == _count(want_inner)
  assert int(state.mini_step) == 0


def test_full_window_after_partial_one():
  """every_k still counts from the start of each window after a finish."""
  tx = wa.WeightedMultiSteps(INNERS["sgd"](), 2, mode="mean")
  step = _make_step(tx, "mean")
  params = _fresh(_init_params())
  state = tx.init(params)
  x, y, mask = _data([3, 2, 5], 30)
  params, state = step(params, state, x[0], y[0], mask[0], jnp.bool_(True))
  assert bool(wa.has_updated(state))
  params, state = step(params, state, x[1], y[1], mask[1], jnp.bool_(False))
  assert not bool(wa.has_updated(state))
  params, state = step(params, state, x[2], y[2], mask[2], jnp.bool_(False))
  assert bool(wa.has_updated(state))
  windows = [(x[:1], y[:1], mask[:1]), (x[1:], y[1:], mask[1:])]
  _assert_close(params, _reference(INNERS["sgd"](), _init_params(), windows)[0])


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_all_zero_window_does_not_advance_and_is_not_lost(mode):
  tx, step = _cached_step("adamw", mode, 3)
  params = _fresh(_init_params())
  state = tx.init(params)
  before = jax.tree.map(np.asarray, (params, state.inner_state))
  x, y, mask = _data([0, 0, 0], 40)  # mean grads are NaN: 0/0
  for i in range(3):
    params, state = step(params, state, x[i], y[i], mask[i], jnp.bool_(False))
  # Nothing applied, nothing advanced, no NaN leaked.
  after = jax.tree.map(np.asarray, (params, state.inner_state))
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  assert _count(state.inner_state) == 0
  assert int(state.gradient_step) == 0 and not bool(wa.has_updated(state))
  assert int(state.empty_windows) == 1 and not bool(state.nonfinite)
  # Not lost: the window stays open, its counts carry over; a fresh every_k.
  c = wa.window_counters(state)
  assert (
    int(c["issued"]),
    int(c["zero_weight"]),
    c["total_weight"],
    int(c["mini_step"]),
  ) == (3, 3, 0.0, 0)
  # The next window applies normally and matches the reference.
  nxt = _data([2, 4, 1], 41)
  for i in range(3):
    params, state = step(
      params, state, nxt[0][i], nxt[1][i], nxt[2][i], jnp.bool_(False)
    )
  assert bool(wa.has_updated(state)) and _count(state.inner_state) == 1
  assert int(wa.window_counters(state)["issued"]) == 0
  _assert_close(
    params,
    _reference(INNERS["adamw"](), _init_params(), [(x, y, mask), nxt])[0],
  )


# -- 4. non-finite windows ----------------------------------------------------------


def test_float16_overflow_window_is_skipped_and_next_starts_clean():
  """float16 grads of a loss scaled by 2**15 overflow: the window is dropped,
  the inner optimizer is not advanced, the state says so, the next window
  (with a lower loss scale) is exact."""
  lr = 0.1
  inner = optax.adam(lr)
  tx = wa.WeightedMultiSteps(inner, 2, mode="sum", loss_scale=2.0**15)
  params = {"w": jnp.array([1.0, -2.0, 3.0], jnp.float32)}

  def f16_grads(params, x, scale):
    # Grad of scale * sum(x * w) in float16: scale * x, overflowing above
    # 65504.
    p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    return jax.grad(lambda p: jnp.float16(scale) * jnp.sum(x * p["w"]))(p16)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, x, weight, scale, next_scale):
    g = f16_grads(params, x, scale)
    updates, state = tx.update(
      g, state, params, weight=weight, next_loss_scale=next_scale
    )
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  inner_before = jax.tree.map(np.asarray, state.inner_state)
  big = jnp.array([4.0, 1.0, 0.5], jnp.float16)  # 4 * 2**15 > 65504
  params, state = step(params, state, big, 3.0, 2.0**15, 2.0**15)
  params, state = step(params, state, big, 2.0, 2.0**15, 1.0)  # close
  assert bool(state.nonfinite) and int(state.nonfinite_windows) == 1
  assert not bool(wa.has_updated(state)) and int(state.gradient_step) == 0
  for a, b in zip(
    jax.tree.leaves(state.inner_state), jax.tree.leaves(inner_before)
  ):
    np.testing.assert_array_equal(np.asarray(a), b)
  np.testing.assert_array_equal(np.asarray(params["w"]), [1.0, -2.0, 3.0])
  # Next window clean: zero buffers, zero counts, the new loss scale.
  c = wa.window_counters(state)
  assert (int(c["issued"]), c["total_weight"], float(c["loss_scale"])) == (
    0,
    0.0,
    1.0,
  )
  assert not np.any(np.asarray(state.accum.grads["w"]))

  xs = [
    jnp.array([0.5, -1.0, 2.0], jnp.float16),
    jnp.array([1.5, 0.25, -3.0], jnp.float16),
  ]
  ws = [3.0, 5.0]
  for x, w in zip(xs, ws):
    params, state = step(params, state, x, w, 1.0, 1.0)
  assert bool(wa.has_updated(state)) and not bool(state.nonfinite)
  assert int(state.inner_state[0].count) == 1
  # float64 reference: the window gradient is sum(x) / sum(w); Adam's first
  # step is lr * g / (|g| + eps).
  g = (np.float64(xs[0]) + np.float64(xs[1])) / sum(ws)
  want = np.array([1.0, -2.0, 3.0]) - lr * g / (np.abs(g) + 1e-8)
  np.testing.assert_allclose(np.asarray(params["w"]), want, rtol=RTOL)


def test_nan_with_positive_weight_is_skipped():
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="mean")
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  _, state = tx.update(
    {"w": jnp.array([jnp.nan, 1.0])}, state, params, weight=2.0
  )
  upd, state = tx.update({"w": jnp.ones(2)}, state, params, weight=1.0)
  assert bool(state.nonfinite) and int(state.gradient_step) == 0
  np.testing.assert_array_equal(np.asarray(upd["w"]), [0.0, 0.0])
  upd, state = tx.update(
    {"w": jnp.ones(2)}, state, params, weight=1.0, finish=True
  )
  assert bool(wa.has_updated(state)) and not bool(state.nonfinite)
  np.testing.assert_allclose(np.asarray(upd["w"]), [-0.1, -0.1])


# -- the inner update is not computed mid-window --------------------------------


def test_inner_update_runs_only_at_a_close():
  calls = []
  sgd = optax.sgd(0.1)

  def counting_update(updates, state, params=None):
    jax.debug.callback(lambda: calls.append(1))
    return sgd.update(updates, state, params)

  tx = wa.WeightedMultiSteps(
    optax.GradientTransformation(sgd.init, counting_update), 3, mode="mean"
  )
  step = _make_step(tx, "mean")
  windows = [_data([2, 3, 1], 50), _data([1, 1, 4], 51), _data([5, 2], 52)]
  got, state = _run(step, tx, _init_params(), windows)
  jax.effects_barrier()
  assert len(calls) == 2  # 8 microbatches: two closed windows of 3
  assert int(wa.window_counters(state)["mini_step"]) == 2


# -- 5. nnx.Optimizer + nnx.jit -------------------------------------------------------


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(D, H, rngs=rngs)
    self.out = nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))[..., 0]


def _nnx_mean_loss(model, x, y, mask):
  return jnp.sum(mask * (model(x) - y) ** 2) / jnp.sum(mask)


def test_nnx_optimizer_matches_reference():
  model = _MLP(nnx.Rngs(0))
  graphdef, params0 = nnx.split(model, nnx.Param)
  params0 = jax.tree.map(np.asarray, params0)
  tx = wa.WeightedMultiSteps(
    optax.adamw(0.05, weight_decay=0.1), 3, mode="mean"
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y, mask):
    grads = nnx.grad(_nnx_mean_loss)(model, x, y, mask)
    optimizer.update(model, grads, weight=jnp.sum(mask))

  windows = [_data([5, 1, 2], 60), _data([0, 3, 4], 61)]
  flags = []
  for x, y, mask in windows:
    for i in range(3):
      train_step(model, optimizer, x[i], y[i], mask[i])
      flags.append(bool(wa.has_updated(optimizer.opt_state)))
  assert flags == [False, False, True] * 2
  assert int(wa.window_counters(optimizer.opt_state)["issued"]) == 0

  # Reference: adamw applied directly to each window's full-batch gradient.
  def window_loss(params, x, y, mask):
    m = nnx.merge(graphdef, params)
    flat = lambda a: a.reshape((-1,) + a.shape[2:])
    return _nnx_mean_loss(m, flat(x), flat(y), flat(mask))

  inner = optax.adamw(0.05, weight_decay=0.1)
  params = jax.tree.map(jnp.asarray, params0)
  state = inner.init(params)
  for x, y, mask in windows:
    g = jax.jit(jax.grad(window_loss))(params, x, y, mask)
    updates, state = inner.update(g, state, params)
    params = optax.apply_updates(params, updates)
  _assert_close(nnx.state(model, nnx.Param), params)


# -- 5. jax.jit with donation: one compilation, in place -------------------------


def test_donated_step_compiles_once_over_100_weights():
  traces = []
  tx = wa.WeightedMultiSteps(optax.adamw(1e-3), 4, mode="mean")

  def step(params, state, grads, weight):
    traces.append(1)
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  jstep = jax.jit(step, donate_argnums=(0, 1))
  params = {"a": jnp.ones((8, 4)), "b": jnp.ones(4)}
  grads = {"a": jnp.full((8, 4), 0.5), "b": jnp.full(4, -1.0)}
  state = tx.init(params)
  weights = np.random.default_rng(0).uniform(0.5, 300.0, 100)
  for w in weights:
    params, state = jstep(params, state, grads, float(w))
  assert len(traces) == 1
  assert int(state.gradient_step) == 25
  # Equal grads: every window's gradient is exactly the grads.
  want = _fresh({"a": np.ones((8, 4)), "b": np.ones(4)})
  inner = optax.adamw(1e-3)
  s = inner.init(want)
  for _ in range(25):
    u, s = inner.update(grads, s, want)
    want = optax.apply_updates(want, u)
  _assert_close(params, want)


def _nbytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("inner_name", ["sgd", "adamw"])
def test_mid_window_step_is_in_place(inner_name):
  """Compiled with params and state donated, the step aliases the params and
  every state buffer (the inner state is not copied) and its only
  parameter-sized temporary is the zero updates tree the optax contract
  returns (optax.MultiSteps also copies the inner state: 3x for adamw)."""
  n = 1 << 16
  params = {f"l{i}": jnp.ones((n,), jnp.float32) for i in range(4)}
  tx = wa.WeightedMultiSteps(INNERS[inner_name](), 4, mode="mean")
  state = tx.init(params)

  def step(params, state, grads, weight):
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  compiled = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, state, params, 3.0)
    .compile()
  )
  m = compiled.memory_analysis()
  p_bytes = _nbytes(params)
  big = [x for x in jax.tree.leaves(state) if x.size == n]
  assert len(big) == (2 if inner_name == "sgd" else 3) * 4  # buffers, inner
  assert m.alias_size_in_bytes >= p_bytes + _nbytes(big)
  assert m.temp_size_in_bytes <= 1.01 * p_bytes


# -- 5. shard_map over a data axis ------------------------------------------------------


@pytest.mark.parametrize(
  "mode,local", [("mean", True), ("sum", True), ("sum", False)]
)
def test_shard_map_data_parallel_matches_reference(mode, local):
  """Replicated params and state (P()), the batch sharded over 'data'.
  Local grads (params cast to varying) and, for loss sums, grads already
  summed by autodiff (unvarying params) both give the full-batch result."""
  devices = np.array(jax.devices())
  r = len(devices)
  mesh = jax.sharding.Mesh(devices, ("data",))
  inner = INNERS["adamw"]()
  tx = wa.WeightedMultiSteps(inner, 2, mode=mode, axis_name="data")
  loss = _mean_loss if mode == "mean" else _sum_loss

  def local_step(params, state, x, y, mask):
    p = jax.lax.pcast(params, "data", to="varying") if local else params
    g = jax.grad(loss)(p, x[0], y[0], mask[0])
    updates, state = tx.update(g, state, params, weight=jnp.sum(mask))
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data"), P("data")),
      out_specs=(P(), P()),
    )
  )
  # Two windows of 2 microbatches; every replica holds a different number
  # of valid rows, replica 3 none at all in the first microbatch.
  rng = np.random.default_rng(7)
  sizes = rng.integers(0, MAXB + 1, size=(2, 2, r))
  sizes[0, 0, 3] = 0
  replicated = jax.sharding.NamedSharding(mesh, P())
  params = jax.device_put(_fresh(_init_params()), replicated)
  state = jax.device_put(tx.init(params), replicated)
  windows = []
  for w in range(2):
    xs, ys, ms = [], [], []
    for m in range(2):
      x, y, mask = _data(list(sizes[w, m]), 100 + 10 * w + m)  # [r, MAXB]
      params, state = step(params, state, x, y, mask)
      xs.append(x), ys.append(y), ms.append(mask)
    windows.append((np.concatenate(xs), np.concatenate(ys), np.concatenate(ms)))
  assert int(state.gradient_step) == 2
  _assert_close(
    params, _reference(INNERS["adamw"](), _init_params(), windows)[0]
  )


def test_jit_sharded_params_keep_shardings():
  """Params sharded over 'model' on a 4x2 mesh, batch over 'data': buffers,
  inner state and params keep the params' shardings through update, and
  the compiled step gathers nothing."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  shardings = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model")}
  params = jax.device_put(
    _fresh(_init_params()),
    {k: jax.sharding.NamedSharding(mesh, v) for k, v in shardings.items()},
  )
  tx = wa.WeightedMultiSteps(INNERS["adamw"](), 2, mode="mean")
  step = _make_step(tx, "mean")
  state = tx.init(params)
  x, y, mask = (
    jax.device_put(a, jax.sharding.NamedSharding(mesh, P("data")))
    for a in _data([3] * 4, 0)[:3]
  )
  x, y, mask = x.reshape(-1, D), y.reshape(-1), mask.reshape(-1)
  hlo = (
    step.lower(params, state, x, y, mask, jnp.bool_(False)).compile().as_text()
  )
  assert "all-gather" not in hlo
  for _ in range(3):
    params, state = step(params, state, x, y, mask, jnp.bool_(False))
  for name, spec in shardings.items():
    for arr in (
      params[name],
      state.accum.grads[name],
      state.inner_state[0].mu[name],
      state.inner_state[0].nu[name],
    ):
      assert arr.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, spec), arr.ndim
      ), name


def test_shard_map_refuses_autodiff_reduced_grads():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, axis_name="data", mode="mean")

  def local_step(params, state, x, y, mask):
    g = jax.grad(_mean_loss)(params, x[0], y[0], mask[0])  # unvarying params
    return tx.update(g, state, params, weight=jnp.sum(mask))

  step = jax.shard_map(
    local_step,
    mesh=mesh,
    in_specs=(P(), P(), P("data"), P("data"), P("data")),
    out_specs=(P(), P()),
  )
  params = jax.device_put(
    _fresh(_init_params()), jax.sharding.NamedSharding(mesh, P())
  )
  x, y, mask = _data([2] * len(jax.devices()), 0)
  with pytest.raises(wa.WeightedAccumulationError, match="local_grad"):
    jax.jit(step)(params, tx.init(params), x, y, mask)


# -- errors ----------------------------------------------------------------------------------


def test_configuration_errors():
  with pytest.raises(wa.WeightedAccumulationError, match="every_k"):
    wa.WeightedMultiSteps(optax.sgd(0.1), 0, mode="mean")
  with pytest.raises(wa.WeightedAccumulationError, match="every_k"):
    wa.WeightedMultiSteps(optax.sgd(0.1), 2.5, mode="mean")
  with pytest.raises(wa.WeightedAccumulationError, match="mode"):
    wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="avg")
  with pytest.raises(wa.WeightedAccumulationError, match="dtype"):
    wa.WeightedMultiSteps(
      optax.sgd(0.1), 2, accumulator_dtype=jnp.int32, mode="mean"
    )
  with pytest.raises(wa.WeightedAccumulationError, match="loss_scale"):
    wa.WeightedMultiSteps(optax.sgd(0.1), 2, loss_scale=0.0, mode="mean")


def test_update_errors_leave_state_untouched():
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="mean")
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  state = tx.init(params)
  g = {"a": jnp.ones(2), "b": jnp.ones(3)}
  with pytest.raises(wa.WeightedAccumulationError, match=r"\['b'\]"):
    tx.update({"a": jnp.ones(2), "b": jnp.ones(4)}, state, params, weight=1)
  with pytest.raises(wa.WeightedAccumulationError, match="weight"):
    tx.update(g, state, params, weight=-1.0)
  with pytest.raises(wa.WeightedAccumulationError, match="finish"):
    tx.update(g, state, params, weight=1.0, finish=jnp.ones(2, bool))
  with pytest.raises(wa.WeightedAccumulationError, match=r"\['b'\]"):
    tx.update(g, state, {"a": jnp.ones(2)}, weight=1.0)
  with pytest.raises(wa.WeightedAccumulationError, match="weight= is required"):
    tx.update(g, state, params)
  assert int(state.mini_step) == 0 and int(state.accum.issued) == 0


def test_invalid_traced_weight_rejects_microbatch():
  tx = wa.WeightedMultiSteps(optax.sgd(1.0), 3, mode="mean")
  params = {"w": jnp.zeros(2)}
  upd_fn = jax.jit(functools.partial(tx.update, params=params))
  state = tx.init(params)
  _, state = upd_fn({"w": jnp.ones(2)}, state, weight=jnp.float32(jnp.nan))
  assert int(wa.window_counters(state)["rejected"]) == 1
  _, state = upd_fn({"w": jnp.ones(2)}, state, weight=jnp.float32(2.0))
  upd, state = upd_fn({"w": jnp.full(2, 4.0)}, state, weight=jnp.float32(2.0))
  assert bool(wa.has_updated(state))
  np.testing.assert_allclose(np.asarray(upd["w"]), [-2.5, -2.5])


# -- README ------------------------------------------------------------------------------------


def test_readme_optax_section_runs(capsys):
  """The README's optax and NNX examples run and print what they claim."""
  readme = (pathlib.Path(__file__).parents[2] / "docs" / "optax.md").read_text()
  section = readme.split("<!-- BEGIN optax -->")[1].split("<!-- END optax -->")[
    0
  ]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 2
  for block in blocks:
    exec(compile(block, "README optax section", "exec"), {})  # pylint: disable=exec-used
  assert capsys.readouterr().out.split() == ["3", "True", "8", "2"]


def test_float16_buffers_window_mean_beyond_float16_range_is_not_applied():
  """total weight * loss scale < 1: the window's sums fit float16 but its
  mean (1000 / 0.01 = 1e5) does not. One validity decision for every close:
  finish_mean calls this window invalid, so the wrapper does not apply it
  either (although it would hand the inner optimizer a float32 mean): no
  update, never a float16 Inf, the window counted as discarded."""
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0), 1, mode="sum", accumulator_dtype=jnp.float16
  )
  params = {"w": jnp.ones(2)}
  step = jax.jit(lambda g, s, p: tx.update(g, s, p, weight=0.01))
  upd, state = step({"w": jnp.full(2, 1000.0)}, tx.init(params), params)
  assert not bool(wa.has_updated(state)) and bool(state.nonfinite)
  np.testing.assert_array_equal(np.asarray(upd["w"]), [0.0, 0.0])
  window = wa.accumulate_sum(
    wa.init(params, dtype=jnp.float16), {"w": jnp.full(2, 1000.0)}, 0.01
  )
  out, _ = wa.finish_mean(window)
  assert bool(out.finite) and not bool(out.valid)


@pytest.mark.parametrize("how", ["update", "train_state_chain"])
def test_float16_grads_window_mean_beyond_float16_is_not_applied(how):
  """float16 params and grads, float32 buffers: the inner optimizer gets the
  mean in float16 (MultiSteps' dtype), so validity is decided in float16. A
  mean of 120000 (two microbatches' 30000 over weight 0.25 each) is not
  applied: no -inf update, the window counted as discarded. A mean of 8000
  is: sgd(1) on float64 NumPy's mean."""
  ms = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="sum")
  for g, ok in ((30000.0, False), (2000.0, True)):
    params = {"w": jnp.ones(2, jnp.float16)}
    grads = {"w": jnp.full(2, g, jnp.float16)}
    if how == "update":
      step = jax.jit(lambda g, s, p: ms.update(g, s, p, weight=0.25))
      state = ms.init(params)
      for _ in range(2):
        upd, state = step(grads, state, params)
        params = optax.apply_updates(params, upd)
    else:
      tx = optax.chain(ms.gradient_transformation())
      ts = wa.TrainState.create(apply_fn=None, params=params, tx=tx)
      step = jax.jit(lambda t, g: t.apply_gradients(grads=g, weight=0.25))
      for _ in range(2):
        ts = step(ts, grads)
      params, state = ts.params, ts.opt_state[0]
    assert bool(state.nonfinite) is not ok and bool(state.updated) is ok
    want = np.float16(1.0 - np.float64(g) * 2 / 0.5 if ok else 1.0)
    np.testing.assert_array_equal(np.asarray(params["w"]), [want, want])
    assert params["w"].dtype == jnp.float16
