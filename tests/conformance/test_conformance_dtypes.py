"""Conformance: numerics at the optimizer boundary, every work dtype.

Rules (``docs/design.md`` and the contract): the optimizer never receives
a window mean narrower than the gradients' or the params' dtype (float16
params with float32 buffers get a float32 mean, so a mean above 65504
reaches the optimizer finite; bfloat16 buffers for float32 params give a
float32 mean); NaN is never applied and ``valid`` is only reported for what
was applied; with ``jax_enable_x64`` and a float64 work dtype every close
path (``finish_*``, ``apply_window``, the wrapper, ``TrainState``,
``microbatched_value_and_grad``, ``distributed.finish_mean``) works and
gives the float64 NumPy result, and ``set_loss_scale`` stores a float64
scale. References: float64 NumPy, and optax's own update fed the exact mean.
Optimizer results are judged over two windows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from _conformance import assert_close
from _conformance import assert_finite
from _conformance import host_params
import weighted_accum as wa

LR = 1e-6
BIG = {"b": np.full(8, 7e4, np.float32), "w": np.full((8, 4), -9e4, np.float32)}


def _by_sgd(hp, means, lr):
  """optax's SGD fed each window's mean, by hand: the mean rounded to the
  update's dtype (float32, float64 for float64 params), ``-lr * mean`` and
  ``params + update`` in it, cast to the params' dtype (``apply_updates``)."""
  p = {k: np.asarray(v) for k, v in hp.items()}
  for m in means:
    new = {}
    for k, v in p.items():
      wide = np.float64 if v.dtype == np.float64 else np.float32
      u = (wide(-lr) * np.asarray(m[k]).astype(wide)).astype(wide)
      new[k] = (v.astype(wide) + u).astype(v.dtype)
    p = new
  return p


# ------------------------ float16 params, float32 buffers, mean > 65504 --


def _apply_two_windows(apply, hp, grads, weight):
  tx = optax.sgd(LR)
  p = {k: jnp.asarray(v) for k, v in hp.items()}
  o = tx.init(p)
  outs = []
  for _ in range(2):
    s = wa.accumulate_sum(wa.init(p, dtype=jnp.float32), grads, weight)
    p, o, s, out = apply(tx, s, p, o)
    outs.append(out)
  return p, outs


@pytest.mark.parametrize("context", ["eager", "jit"])
def test_apply_window_float16_params_get_a_wide_mean(context):
  """Float32 sums of 3.5e4 / 0.5: a 7e4 mean (above float16's 65504)."""
  apply = wa.apply_window
  if context == "jit":
    apply = jax.jit(wa.apply_window, static_argnums=0)
  hp = host_params(np.float16)
  grads = {k: v * 0.5 for k, v in BIG.items()}
  p, outs = _apply_two_windows(apply, hp, grads, 0.5)
  assert all(bool(o.valid) for o in outs)
  assert_finite(p)
  assert_close(p, _by_sgd(hp, [BIG, BIG], LR), rtol=1e-3)


@pytest.mark.parametrize("entry", ["WeightedMultiSteps", "TrainState"])
def test_wrapper_float16_params_get_a_wide_mean(entry):
  hp = host_params(np.float16)
  p = {k: jnp.asarray(v) for k, v in hp.items()}
  tx = wa.WeightedMultiSteps(optax.sgd(LR), 2, mode="sum")
  half = {k: jnp.asarray(v * 0.5) for k, v in BIG.items()}  # float32 grads
  # Jitted (the eager calls are elsewhere): the boundary is the same.
  if entry == "TrainState":
    ts = wa.TrainState.create(apply_fn=None, params=p, tx=tx)
    step = jax.jit(lambda ts, g: ts.apply_gradients(grads=g, weight=0.25))
    for _ in range(4):  # two windows of two microbatches of weight 0.25
      ts = step(ts, half)
    p = ts.params
  else:
    s = tx.init(p)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, weight=0.25))
    for _ in range(4):
      upd, s = update(half, s, p)
      p = optax.apply_updates(p, upd)
  assert_finite(p)
  # Each window: sum 7e4 (+ 7e4 ... per leaf: 2 * half) / weight 0.5.
  mean = {k: v * 2.0 for k, v in BIG.items()}
  assert_close(p, _by_sgd(hp, [mean, mean], LR), rtol=1e-3)


@pytest.mark.parametrize("context", ["eager", "jit"])
def test_apply_window_float16_buffers_mean_overflow_never_applied_as_nan(
  context,
):
  """Float16 params and buffers, sums 6e4 of weight 0.5: the sums are
  finite, their mean (1.2e5) does not fit float16. Either the optimizer
  gets it wide and applies it, or the window is invalid and skipped: never
  NaN/Inf params, and ``valid`` exactly when the params moved."""
  apply = wa.apply_window
  if context == "jit":
    apply = jax.jit(wa.apply_window, static_argnums=0)
  tx = optax.sgd(LR)
  hp = host_params(np.float16)
  p = {k: jnp.asarray(v) for k, v in hp.items()}
  g = {k: jnp.full(v.shape, 6e4, jnp.float16) for k, v in hp.items()}
  s = wa.accumulate_sum(wa.init(p, dtype=jnp.float16), g, 0.5)
  new, _, _, out = apply(tx, s, p, tx.init(p))
  assert_finite(new)
  moved = any(np.any(np.asarray(new[k]) != np.asarray(p[k])) for k in hp)
  assert bool(out.valid) == moved, (bool(out.valid), moved)


# -------------------- bfloat16 buffers, float32 params: a float32 mean --


def _bf16_windows(entry):
  """Two windows, each a single microbatch of grads 1 (exact in bfloat16)
  and weight 3: the mean 1/3 must reach SGD(1) in float32."""
  hp = host_params(np.float32)
  p = {k: jnp.asarray(v) for k, v in hp.items()}
  ones = {k: jnp.ones(v.shape, jnp.float32) for k, v in hp.items()}
  if entry == "apply_window":
    tx = optax.sgd(1.0)
    o = tx.init(p)
    for _ in range(2):
      s = wa.accumulate_sum(wa.init(p, dtype=jnp.bfloat16), ones, 3)
      p, o, _, out = wa.apply_window(tx, s, p, o)
      assert bool(out.valid)
    return hp, p
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0), 1, accumulator_dtype=jnp.bfloat16, mode="sum"
  )
  if entry == "TrainState":
    ts = wa.TrainState.create(apply_fn=None, params=p, tx=tx)
    for _ in range(2):
      ts = ts.apply_gradients(grads=ones, weight=3)
    return hp, ts.params
  s = tx.init(p)
  for _ in range(2):
    upd, s = tx.update(ones, s, p, weight=3)
    p = optax.apply_updates(p, upd)
  return hp, p


@pytest.mark.parametrize(
  "entry", ["apply_window", "WeightedMultiSteps", "TrainState"]
)
def test_bfloat16_buffers_float32_params_get_a_float32_mean(entry):
  hp, p = _bf16_windows(entry)
  third = {k: np.full(v.shape, 1.0 / 3.0) for k, v in hp.items()}
  ref = _by_sgd(hp, [third, third], 1.0)
  assert_close(p, ref, rtol=2.0**-22)


# -------------------------------------------------- float64 under x64 --

WEIGHTS = [0.1, 1.0 / 3.0, 7.0]
LS = 0.1


def _g64(i):
  return {
    "b": (np.arange(8) % 3 - 1.0) * (i + 1) / 3.0,
    "w": (np.arange(32).reshape(8, 4) % 5 - 2.0) * (i + 1) / 7.0,
  }


def _mean64(idx):
  total = math.fsum(WEIGHTS[i] for i in idx)
  return {
    k: sum(_g64(i)[k] * WEIGHTS[i] for i in idx) / total for k in ("b", "w")
  }


def _window64(p, acc=None):
  s = wa.init(p, dtype=jnp.float64, loss_scale=LS)
  acc = acc or wa.accumulate_mean
  for i, w in enumerate(WEIGHTS):
    g = {k: jnp.asarray(v * LS) for k, v in _g64(i).items()}
    s = acc(s, g, jnp.float64(w))
  return s


def _p64():
  return {k: jnp.asarray(v, jnp.float64) for k, v in host_params().items()}


@pytest.mark.parametrize("context", ["eager", "jit"])
@pytest.mark.parametrize("kind", ["finish_mean", "finish_sums"])
def test_float64_finish(kind, context):
  with jax.enable_x64(True):
    fin = getattr(wa, kind)
    if context == "jit":
      fin = jax.jit(fin)
    out, new = fin(_window64(_p64()))
    assert bool(out.valid) and new.loss_scale.dtype == jnp.float64
    ref = _mean64(range(3))
    if kind == "finish_sums":
      ref = {k: v * LS * math.fsum(WEIGHTS) for k, v in ref.items()}
    for k in ref:
      assert out.grads[k].dtype == jnp.float64
    assert_close(out.grads, ref, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("context", ["eager", "jit"])
def test_float64_apply_window(context):
  with jax.enable_x64(True):
    tx = optax.sgd(1.0)
    apply = wa.apply_window
    if context == "jit":
      apply = jax.jit(wa.apply_window, static_argnums=0)
    p = _p64()
    o = tx.init(p)
    for _ in range(2):
      p, o, _, out = apply(tx, _window64(p), p, o)
      assert bool(out.valid)
    m = _mean64(range(3))
    assert_close(p, _by_sgd(_p64(), [m, m], 1.0), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize(
  "entry", ["WeightedMultiSteps-eager", "WeightedMultiSteps-jit", "TrainState"]
)
def test_float64_wrapper(entry):
  with jax.enable_x64(True):
    tx = wa.WeightedMultiSteps(
      optax.sgd(1.0),
      3,
      accumulator_dtype=jnp.float64,
      mode="mean",
      loss_scale=LS,
    )
    p = _p64()
    gs = [
      ({k: jnp.asarray(v * LS) for k, v in _g64(i).items()}, jnp.float64(w))
      for i, w in enumerate(WEIGHTS)
    ]
    if entry == "TrainState":
      ts = wa.TrainState.create(apply_fn=None, params=p, tx=tx)
      step = jax.jit(lambda ts, g, w: ts.apply_gradients(grads=g, weight=w))
      for _ in range(2):
        for g, w in gs:
          ts = step(ts, g, w)
      p = ts.params
    else:
      update = lambda g, s, p, w: tx.update(g, s, p, weight=w)  # noqa: E731
      if entry.endswith("jit"):
        update = jax.jit(update)
      s = tx.init(p)
      for _ in range(2):
        for g, w in gs:
          upd, s = update(g, s, p, w)
          p = optax.apply_updates(p, upd)
    m = _mean64(range(3))
    assert_close(p, _by_sgd(_p64(), [m, m], 1.0), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("context", ["eager", "jit"])
def test_float64_set_loss_scale_keeps_float64(context):
  with jax.enable_x64(True):
    set_scale = wa.set_loss_scale
    if context == "jit":
      set_scale = jax.jit(wa.set_loss_scale)
    s = set_scale(wa.init(_p64(), dtype=jnp.float64), jnp.float64(LS))
    assert s.loss_scale.dtype == jnp.float64
    assert float(s.loss_scale) == LS


def _loss64(p, batch):
  x, y, m = batch
  pred = x @ p["b"] + jnp.sum(x @ p["w"], axis=-1)
  return jnp.sum(m * (pred - y) ** 2), m.sum()


def test_float64_microbatched_value_and_grad():
  with jax.enable_x64(True):
    x = (np.arange(64).reshape(8, 8) % 3 - 1.0) / 3.0
    y = np.arange(8) / 7.0
    m = np.array([0.1, 1 / 3, 0.0, 7.0, 0.25, 1.0, 0.0, 2.5])
    f = jax.jit(
      wa.microbatched_value_and_grad(
        _loss64, 4, mode="sum", dtype=jnp.float64, loss_scale=LS
      )
    )
    _, out = f(_p64(), tuple(jnp.asarray(a) for a in (x, y, m)))
    assert bool(out.valid) and out.grads["b"].dtype == jnp.float64
    p = {k: np.asarray(v, np.float64) for k, v in host_params().items()}
    r = x @ (p["b"] + p["w"].sum(axis=1)) - y
    gb = 2.0 * (m * r) @ x / math.fsum(m)
    ref = {"b": gb, "w": np.repeat(gb[:, None], 4, axis=1)}
    assert_close(out.grads, ref, rtol=1e-13, atol=1e-15)


def test_float64_distributed_finish_mean():
  with jax.enable_x64(True):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("data",))

    def step(p, g, w):
      g = jax.tree.map(lambda x: x[0], g)
      s = wa.init(p, jnp.float64, LS, axis_name="data")
      s = wa.accumulate_mean(s, g, w[0])
      out, _ = wa.finish_mean(s)
      return out.grads, out.valid

    f = jax.jit(
      jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P()),
      )
    )
    g = {k: np.stack([_g64(i)[k] * LS for i in range(3)]) for k in ("b", "w")}
    grads, valid = f(_p64(), g, jnp.asarray(WEIGHTS, jnp.float64))
    assert bool(valid) and grads["b"].dtype == jnp.float64
    assert_close(grads, _mean64(range(3)), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("context", ["eager", "jit"])
@pytest.mark.parametrize("where", ["configured", "per_call"])
def test_float64_in_step_loss_scale_is_stored_in_float64(where, context):
  """A float64 work dtype stores the in-step loss scale as float64 (as
  wa.init does): 1.1 exactly, and 1e-40 (subnormal in float32) accepted."""
  with jax.enable_x64(True):
    w = jnp.asarray([1.0, -2.0], jnp.float64)
    x = jnp.asarray([[1.0, 2.0], [3.0, -1.0]], jnp.float64)

    def loss(w, x):
      return jnp.sum((x @ w) ** 2), jnp.float64(x.shape[0])

    for ls in (1.1, 1e-40):
      kw = dict(loss_scale=ls) if where == "configured" else {}
      f = wa.microbatched_value_and_grad(
        loss, 2, mode="sum", dtype=jnp.float64, **kw
      )
      call = (
        (lambda w, x, f=f: f(w, x))
        if where == "configured"
        else (lambda w, x, f=f, ls=ls: f(w, x, loss_scale=jnp.float64(ls)))
      )
      _, out = (jax.jit(call) if context == "jit" else call)(w, x)
      assert out.loss_scale.dtype == jnp.float64
      assert float(out.loss_scale) == ls and bool(out.valid)
      ref = 2 * x.T @ (x @ w) / 2
      np.testing.assert_allclose(out.grads, ref, rtol=1e-12)
