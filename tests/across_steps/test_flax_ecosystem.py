"""Flax as its users write it: ``nnx.Optimizer`` read inside and outside
``nnx.jit`` (the float16 recipe with a dynamic loss scale), flax's stock
``TrainState`` and the library's, and in-step microbatching of NNX models
with batch norm, dropout and RNG streams (their state threaded through the
loop) and of linen models with ``mutable`` batch statistics and a dropout
key per microbatch, each against a hand-written ``jax.grad`` loop over the
same microbatches, over several Adam windows."""

from __future__ import annotations

from flax import nnx
import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import weighted_accum as wa

K = 4


def rel_err(got, want):
  """Largest absolute difference over all leaves, relative to the largest
  reference value (some leaves, e.g. fresh biases, are near zero)."""
  diff = max(
    float(jnp.max(jnp.abs(jnp.asarray(g, jnp.float32) - r)))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )
  return diff / max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(want))


def _data(seed, n=16, d=3):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)).astype(np.float32)
  y = x.sum(1).astype(np.float32)
  mask = (rng.random(n) < 0.75).astype(np.float32)
  mask[0] = 1.0
  return {"x": jnp.asarray(x), "y": jnp.asarray(y), "mask": jnp.asarray(mask)}


# ---------------------------------------- nnx.Optimizer's state, read --


def test_nnx_optimizer_counters_inside_and_outside_nnx_jit():
  """The float16 recipe: each window's loss multiplied by the scale read
  with window_counters inside nnx.jit; the first windows overflow float16
  and are skipped, the scale backs off, and the applied windows match Adam
  on the float32 full-batch gradients of those windows."""
  model = nnx.Linear(3, 1, dtype=jnp.float16, rngs=nnx.Rngs(0))
  graphdef, params0 = nnx.split(model, nnx.Param)
  params0 = jax.tree.map(jnp.array, params0)
  tx = wa.WeightedMultiSteps(
    optax.adam(0.05),
    2,
    mode="sum",
    loss_scale=wa.DynamicLossScale(2.0**12, growth_interval=100),
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def sum_loss(m, b):
    pred = m(b["x"].astype(jnp.float16))[:, 0].astype(jnp.float32)
    return jnp.sum(b["mask"] * (pred - b["y"]) ** 2)

  @nnx.jit
  def step(model, optimizer, b):
    c = wa.window_counters(optimizer.opt_state)
    scale = c["loss_scale"]
    grads = nnx.grad(lambda m: sum_loss(m, b) * scale.astype(jnp.float16))(
      model
    )
    optimizer.update(model, grads, weight=b["mask"].sum())
    return wa.has_updated(optimizer.opt_state), c["mini_step"], scale

  scales = []
  for w in range(8):
    for i in range(2):
      updated, mini, scale = step(model, optimizer, _data(10 * w + i))
      assert int(mini) == i and (i == 1 or not bool(updated))
    scales.append(float(scale))
  c = wa.window_counters(optimizer.opt_state)  # outside nnx.jit
  assert all(isinstance(v, (jax.Array, float)) for v in c.values()), c
  assert isinstance(wa.has_updated(optimizer.opt_state), jax.Array)
  skipped = int(optimizer.opt_state.nonfinite_windows[...])
  assert 1 <= skipped < 8 and scales[-1] < 2.0**12
  assert int(optimizer.opt_state.gradient_step[...]) == 8 - skipped
  # The skipped windows are the first ones (the scale only backs off).
  ref_tx = optax.adam(0.05)
  params, opt = params0, ref_tx.init(params0)

  def window_loss(p, w):
    bs = [_data(10 * w + i) for i in range(2)]
    m = nnx.merge(graphdef, p)
    total = sum(sum_loss(m, b) for b in bs)
    return total / sum(b["mask"].sum() for b in bs)

  for w in range(skipped, 8):
    g = jax.grad(window_loss)(params, w)
    updates, opt = ref_tx.update(g, opt, params)
    params = optax.apply_updates(params, updates)
  assert rel_err(nnx.state(model, nnx.Param), params) < 2e-2


# --------------------------------------------------------- TrainState --


@pytest.mark.parametrize("form", ["class", "function", "chain"])
def test_flax_stock_train_state_points_to_the_librarys(form):
  params = {"w": jnp.ones(2)}
  inner = optax.sgd(0.1)
  tx = {
    "class": wa.WeightedMultiSteps(inner, 2, mode="mean"),
    "function": wa.WeightedMultiSteps(
      inner, 2, mode="mean"
    ).gradient_transformation(),
    "chain": optax.chain(
      optax.clip_by_global_norm(1.0),
      # In a chain, the ExtraArgs form: the chain forwards weight= to it.
      wa.WeightedMultiSteps(inner, 2, mode="mean").gradient_transformation(),
    ),
  }[form]
  stock = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  with pytest.raises(
    wa.WeightedAccumulationError, match="use weighted_accum.TrainState"
  ):
    stock.apply_gradients(grads={"w": jnp.ones(2)}, weight=3)
  ours = wa.TrainState.create(apply_fn=None, params=params, tx=tx)
  ours = ours.apply_gradients(grads={"w": jnp.ones(2)}, weight=3)
  ours = ours.apply_gradients(grads={"w": jnp.array([5.0, 1.0])}, weight=1)
  # sgd(0.1) on (3*1 + 1*5)/4 = 2 and 1; in the chain each microbatch's
  # grads are first clipped to norm 1.
  g1, g2 = np.array([1.0, 1.0]), np.array([5.0, 1.0])
  if form == "chain":
    g1, g2 = g1 / np.linalg.norm(g1), g2 / np.linalg.norm(g2)
  g = (3 * g1 + g2) / 4
  np.testing.assert_allclose(ours.params["w"], 1 - 0.1 * g, rtol=1e-6)


def test_library_train_state_over_adam_windows():
  model = nn.Dense(1)
  params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  tx = wa.WeightedMultiSteps(optax.adam(0.05), 2, mode="mean")
  state = wa.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def mean_loss(p, b):
    pred = model.apply({"params": p}, b["x"])[:, 0]
    return jnp.sum(b["mask"] * (pred - b["y"]) ** 2) / b["mask"].sum()

  @jax.jit
  def step(state, b):
    g = jax.grad(mean_loss)(state.params, b)
    return state.apply_gradients(grads=g, weight=b["mask"].sum())

  ref_tx = optax.adam(0.05)
  ref, opt = params, ref_tx.init(params)
  for w in range(3):
    bs = [_data(50 + 2 * w + i) for i in range(2)]
    for b in bs:
      state = step(state, b)
    full = jax.tree.map(lambda *xs: jnp.concatenate(xs), *bs)
    updates, opt = ref_tx.update(jax.grad(mean_loss)(ref, full), opt, ref)
    ref = optax.apply_updates(ref, updates)
  assert rel_err(state.params, ref) < 1e-5


# ------------------------- NNX: batch norm, dropout and RNG streams --


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(3, 8, use_bias=False, rngs=rngs)  # before BN
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))[:, 0]


def _nnx_setup():
  model = _Net(nnx.Rngs(0, dropout=1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, b, rest):
    m = nnx.merge(graphdef, params, rest)
    pred = m(b["x"])
    loss = jnp.sum(b["mask"] * (pred - b["y"]) ** 2)
    _, _, new_rest = nnx.split(m, nnx.Param, ...)
    return (loss, b["mask"].sum()), new_rest

  return params, rest, loss_fn


def _hand(loss_fn, params, b, *state, k=K, key=None):
  """The reference: jax.grad per strided microbatch, state threaded by
  hand (and the key folded with the microbatch's index)."""
  g_sum, w_sum = None, 0.0
  for i in range(k):
    mb = jax.tree.map(lambda x, i=i: x[i::k], b)
    extra = () if key is None else (jax.random.fold_in(key, i),)

    def f(p, mb=mb, extra=extra, state=state):
      state = jax.tree.map(lambda x: x, state)  # NNX Variables of this trace
      (s, w), new = loss_fn(p, mb, *state, *extra)
      return s, (w, new)

    g, (w, new) = jax.grad(f, has_aux=True)(params)
    state = (new,)
    g_sum = g if g_sum is None else jax.tree.map(jnp.add, g_sum, g)
    w_sum += float(w)
  return jax.tree.map(lambda x: x / w_sum, g_sum), state[0]


def test_nnx_batch_norm_dropout_and_rng_streams_through_the_loop():
  params, rest, loss_fn = _nnx_setup()
  f = wa.microbatched_value_and_grad(loss_fn, K, mode="sum", state_argnums=2)
  tx = optax.adam(0.05)

  @jax.jit
  def step(params, opt, rest, b):
    (_, out), rest = f(params, b, rest)
    updates, opt = tx.update(out.grads, opt, params)
    return optax.apply_updates(params, updates), opt, rest, out.grads

  ref, ref_rest, ref_opt = params, rest, tx.init(params)
  opt = tx.init(params)
  counts = []
  for s in range(3):
    b = _data(70 + s)
    params, opt, rest, grads = step(params, opt, rest, b)
    g, ref_rest = _hand(loss_fn, ref, b, ref_rest)
    if s == 0:
      assert rel_err(grads, g) < 1e-5
    updates, ref_opt = tx.update(g, ref_opt, ref)
    ref = optax.apply_updates(ref, updates)
    counts.append(int(rest["drop"]["rngs"]["count"][...]))
  assert rel_err(params, ref) < 1e-5
  assert counts == [K, 2 * K, 3 * K]  # the stream advanced per microbatch
  np.testing.assert_allclose(
    rest["bn"]["mean"][...], ref_rest["bn"]["mean"][...], rtol=1e-5
  )
  np.testing.assert_allclose(
    rest["bn"]["var"][...], ref_rest["bn"]["var"][...], rtol=1e-5
  )


# ------------------- linen: mutable batch statistics, a dropout key --


class _LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(8, use_bias=False)(x)  # batch norm follows: no bias
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
    return nn.Dense(1)(x)[:, 0]


def test_linen_mutable_batch_stats_and_a_dropout_key_per_microbatch():
  model = _LinenNet()
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)), train=False)
  params, stats = variables["params"], variables["batch_stats"]

  def loss_fn(params, b, stats, key, *, train=True):
    pred, upd = model.apply(
      {"params": params, "batch_stats": stats},
      b["x"],
      train=train,
      mutable=["batch_stats"],
      rngs={"dropout": key},
    )
    return (jnp.sum(b["mask"] * (pred - b["y"]) ** 2), b["mask"].sum()), upd[
      "batch_stats"
    ]

  f = wa.microbatched_value_and_grad(
    loss_fn, K, mode="sum", state_argnums=2, key_argnums=3
  )
  tx = optax.adam(0.05)

  @jax.jit
  def step(params, opt, stats, b, key):
    (_, out), stats = f(params, b, stats, key, train=True)
    updates, opt = tx.update(out.grads, opt, params)
    return optax.apply_updates(params, updates), opt, stats

  ref, ref_stats, opt = params, stats, tx.init(params)
  ref_opt = tx.init(params)
  for s in range(3):
    b, key = _data(90 + s), jax.random.key(200 + s)
    params, opt, stats = step(params, opt, stats, b, key)
    g, ref_stats = _hand(loss_fn, ref, b, ref_stats, key=key)
    updates, ref_opt = tx.update(g, ref_opt, ref)
    ref = optax.apply_updates(ref, updates)
  assert rel_err(params, ref) < 1e-5
  assert rel_err(stats, ref_stats) < 1e-5
