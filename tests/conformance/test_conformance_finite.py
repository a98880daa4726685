"""Conformance: one NaN or Inf anywhere in a window is seen, once, everywhere.

The rule (``docs/design.md``, "Finishing a window", and the contract): a
window's finiteness and validity are decided by a reduction that no NaN can
slip through, once for the whole window, and are identical on every shard
of every mesh axis; an invalid window is never applied (params and
optimizer state bit for bit unchanged, and finite).

Every close path (``finish_mean``, ``finish_sums``, ``apply_window``, the
optax wrapper, ``microbatched_value_and_grad``, ``distributed.finish_mean``
in both modes, ``reduce_sums``, the wrapper with ``axis_name``) x params on
one device, sharded over 8 devices, and on a 2-D ``data x model``
mesh x float16/bfloat16/float32 work dtypes x a NaN or Inf on the first or
the last device. One jitted function per entry point (its compilations are
keyed on placement and dtype); the bad values are data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from _conformance import BAD_CASES
from _conformance import BAD_IDS
from _conformance import DTYPES
from _conformance import PLACED
from _conformance import PLACED_IDS
from _conformance import assert_close
from _conformance import assert_finite
from _conformance import assert_flag
from _conformance import assert_same
from _conformance import cast
from _conformance import every_shard
from _conformance import host_grads
from _conformance import host_params
from _conformance import mesh_of
from _conformance import place
from _conformance import rtol_of
from _conformance import snapshot
import weighted_accum as wa
from weighted_accum import distributed as dist

_ids = {"dtype": lambda d: jnp.dtype(d).name}
# Eager calls run the same kernels as jitted ones: eagerly, two sharded
# placements only (each eager call costs a dispatch per op).
COMBOS = [("jit", p, d) for p, d in PLACED] + [
  ("eager", "dev8", jnp.float32),
  ("eager", "mesh2d", jnp.float16),
]
COMBO_IDS = [f"{c}-{p}-{jnp.dtype(d).name}" for c, p, d in COMBOS]

# ------------------------------------------------- finish_* under jit/eager --


def _finish(s, g):
  """Both finishes of the same window (one compilation for the pair)."""
  s = wa.accumulate_sum(s, g, 2.0)
  return wa.finish_sums(s)[0], wa.finish_mean(s)[0]


_FINISH = jax.jit(_finish)


def _flag_problems(out, ok: bool, name: str) -> list[str]:
  return [
    f"{name}.{flag} is {seen} (expected {ok} on every shard)"
    for flag in ("finite", "valid")
    for seen in [every_shard(getattr(out, flag))]
    if any(bool(v) != ok for v in seen)
  ]


@pytest.mark.parametrize("case", BAD_CASES, ids=BAD_IDS)
@pytest.mark.parametrize("context,placement,dtype", COMBOS, ids=COMBO_IDS)
def test_finish_flags_every_shard(context, placement, dtype, case):
  """``finish_sums`` and ``finish_mean`` of the same window: both report
  the bad value on every shard (the message lists each that did not)."""
  _, bad, where = case
  params = place(cast(host_params(), dtype), placement)
  grads = place(cast(host_grads(bad=bad, where=where), dtype), placement)
  fn = _FINISH if context == "jit" else _finish
  sums, mean = fn(wa.init(params, dtype=dtype), grads)
  ok = bad is None
  problems = _flag_problems(sums, ok, "finish_sums")
  problems += _flag_problems(mean, ok, "finish_mean")
  assert not problems, problems
  if ok:
    assert_close(sums.grads, host_grads(), rtol=rtol_of(dtype))
    ref = {k: v / 2.0 for k, v in host_grads().items()}
    assert_close(mean.grads, ref, rtol=rtol_of(dtype))


# ---------------------------------------------------------- apply_window --

TX = optax.sgd(0.1, momentum=0.5)


def _apply(s, p, o):
  return wa.apply_window(TX, s, p, o)


_APPLY = jax.jit(_apply)


def _reference(params32, means):
  """optax.s own optimizer, in float32, fed the exact window means."""
  p, o = params32, TX.init(params32)
  for m in means:
    u, o = TX.update(m, o, p)
    p = optax.apply_updates(p, u)
  return p


@pytest.mark.parametrize("case", BAD_CASES, ids=BAD_IDS)
@pytest.mark.parametrize("context,placement,dtype", COMBOS, ids=COMBO_IDS)
def test_apply_window_never_applies_nan(context, placement, dtype, case):
  """Window 1 is clean and applied; window 2 holds the case's value: applied
  exactly, or (NaN/Inf) skipped with params and the optimizer's state unchanged."""
  _, bad, where = case
  apply = _APPLY if context == "jit" else _apply
  hp = cast(host_params(), dtype)
  params = place(hp, placement)
  opt = TX.init(params)
  g1, g2 = host_grads(), host_grads(2.0, bad=bad, where=where)
  s = wa.accumulate_mean(
    wa.init(params, dtype=dtype), place(cast(g1, dtype), placement), 3
  )
  params, opt, s, out = apply(s, params, opt)
  assert_flag(out.valid, True, "window 1 valid")
  before = snapshot((params, opt))
  s = wa.accumulate_mean(s, place(cast(g2, dtype), placement), 1)
  params, opt, s, out = apply(s, params, opt)
  ok = bad is None
  assert_flag(out.finite, ok, "finite")
  assert_flag(out.valid, ok, "valid")
  assert_finite(params)
  p32 = {k: np.asarray(v, np.float32) for k, v in hp.items()}
  if ok:
    ref = _reference(p32, [g1, g2])
    assert_close(params, ref, rtol=0, atol=4 * rtol_of(dtype))
  else:
    assert_same((params, opt), before)


# --------------------------------------------------------- optax wrapper --

WTX = wa.WeightedMultiSteps(TX, 2, mode="mean")


def _update(g, s, p, w):
  return WTX.update(g, s, p, weight=w)


_UPDATE = jax.jit(_update)


# Eagerly each update dispatches op by op (about 0.3 s a call on 8 CPU
# devices): the eager wrapper runs on one sharded placement and dtype.
WRAPPER_EAGER = [BAD_CASES[2]]  # NaN on the last device


@pytest.mark.parametrize("case", BAD_CASES, ids=BAD_IDS)
@pytest.mark.parametrize("placement,dtype", PLACED, ids=PLACED_IDS)
def test_wrapper_jit_never_applies_nan(placement, dtype, case):
  """Two windows of two microbatches (weights 2 and 1); the first window's
  last microbatch holds the case's value. A non-finite window is skipped
  (zero updates, ``nonfinite`` on every shard, params unchanged, the inner
  optimizer not advanced); the clean windows give optax's own optimizer on
  the exact means."""
  _wrapper_windows(_UPDATE, placement, dtype, case)


@pytest.mark.parametrize(
  "case", WRAPPER_EAGER, ids=[c[0] for c in WRAPPER_EAGER]
)
def test_wrapper_eager_never_applies_nan(case):
  _wrapper_windows(_update, "dev8", jnp.float32, case)


def _wrapper_windows(update, placement, dtype, case):
  _, bad, where = case
  hp = cast(host_params(), dtype)
  params = place(hp, placement)
  state = WTX.init(params)
  g = host_grads()
  clean = [(g, 2.0), (host_grads(4.0), 1.0)]  # mean: 2 g
  windows = [[(g, 2.0), (host_grads(4.0, bad, where), 1.0)], clean]
  means = []
  for i, window in enumerate(windows):
    before = snapshot(params)
    for grads, w in window:
      upd, state = update(
        place(cast(grads, dtype), placement), state, params, w
      )
      params = optax.apply_updates(params, upd)
    assert_finite(params)
    skipped = i == 0 and bad is not None
    assert_flag(state.nonfinite, skipped, f"window {i} nonfinite")
    assert_flag(wa.has_updated(state), not skipped, f"window {i} updated")
    if skipped:
      assert_same(params, before)
    else:
      means.append({k: 2.0 * v for k, v in g.items()})
  assert int(state.gradient_step) == len(means)
  p32 = {k: np.asarray(v, np.float32) for k, v in hp.items()}
  ref = _reference(p32, means)
  assert_close(params, ref, rtol=0, atol=8 * rtol_of(dtype))


# ------------------------------------------- microbatched_value_and_grad --

K, ROWS = 4, 8


def _loss(p, batch):
  """A loss SUM, computed in float32 whatever the params' dtype."""
  x, y, m = batch
  p = {k: v.astype(jnp.float32) for k, v in p.items()}
  pred = x @ p["b"] + jnp.sum(x @ p["w"], axis=-1)
  return jnp.sum(m * (pred - y) ** 2), m.sum()


def _batch(bad=None, row=0):
  x = (np.arange(ROWS * 8).reshape(ROWS, 8) % 3 - 1.0).astype(np.float32)
  if bad is not None:
    x[row, 0] = bad
  y = (np.arange(ROWS) % 2).astype(np.float32)
  m = np.array([1, 1, 0, 1, 1, 0, 1, 1], np.float32)
  return x, y, m


_MVG = {
  dt: jax.jit(wa.microbatched_value_and_grad(_loss, K, mode="sum", dtype=dt))
  for dt in DTYPES
}
MVG_CASES = [
  ("finite", None, 0),
  ("nan_mb0", np.nan, 0),
  ("inf_mb3", np.inf, 7),
]


# Its finiteness already passes on every placement: one dtype per placement
# but on 8 devices (a compilation of the whole loop each).
MVG_PLACED = [(p, d) for p, d in PLACED if p == "dev8" or d == jnp.float32]


@pytest.mark.parametrize("case", MVG_CASES, ids=[c[0] for c in MVG_CASES])
@pytest.mark.parametrize(
  "placement,dtype",
  MVG_PLACED,
  ids=[f"{p}-{jnp.dtype(d).name}" for p, d in MVG_PLACED],
)
def test_microbatched_flags_every_shard(placement, dtype, case):
  _, bad, row = case
  hp = cast(host_params(), dtype)
  params = place(hp, placement)
  batch = _batch(bad, row)
  _, out = _MVG[dtype](params, batch)
  ok = bad is None
  assert_flag(out.finite, ok, "finite")
  assert_flag(out.valid, ok, "valid")
  if ok:
    assert_close(out.grads, _full_grad(hp, batch), rtol=4 * rtol_of(dtype))


def _full_grad(hp, batch):
  """The full batch's mean-loss gradient, by hand in float64."""
  x, y, m = (np.asarray(a, np.float64) for a in batch)
  p = {k: np.asarray(v, np.float64) for k, v in hp.items()}
  r = x @ (p["b"] + p["w"].sum(axis=1)) - y
  gb = 2.0 * (m * r) @ x / m.sum()
  return {"b": gb, "w": np.repeat(gb[:, None], 4, axis=1)}


# ---------------------------------------------------- inside shard_map --

# 1-D: 8 data replicas, params replicated. 2-D: 4 data x 2 model, params
# sharded over 'model' (each model shard sees half of every leaf).
SM = {
  "data8": (jax.sharding.Mesh(np.array(jax.devices()), ("data",)), P()),
  "data4_model2": (mesh_of("mesh2d"), P("model")),
}
SM_CASES = [
  ("finite", None, 0, 0),
  ("nan_replica0_shard0", np.nan, 0, 0),
  ("nan_replica3_last", np.nan, 3, -1),
  ("inf_replica1_last", np.inf, 1, -1),
]


def _replica_grads(bad, replica, pos, dtype):
  """Per-replica local grads, stacked on a leading data axis (4 replicas
  on the 2-D mesh, 8 on the 1-D one: built for 8, sliced)."""
  g = host_grads()
  stack = {k: np.stack([v * (r + 1) for r in range(8)]) for k, v in g.items()}
  if bad is not None:
    stack["b"][replica].reshape(-1)[pos] = bad
  return cast(stack, dtype)


def _sm(kind, mesh_name):
  mesh, pspec = SM[mesh_name]
  flat = P(mesh.axis_names)
  specs = {"b": pspec, "w": pspec}
  gspec = {k: P("data", *pspec) for k in specs}

  def step(p, g):
    g = jax.tree.map(lambda x: x[0], g)
    if kind == "window":
      s = wa.accumulate_sum(wa.init(p, p["b"].dtype, axis_name="data"), g, 2.0)
      out, _ = wa.finish_mean(s)
    elif kind == "microbatch":
      s = wa.init(p, p["b"].dtype, axis_name="data", reduce="microbatch")
      s = wa.accumulate_sum(s, g, 2.0)
      out, _ = wa.finish_mean(s)
    else:  # finish_sums, then reduce_sums
      s = wa.accumulate_sum(wa.init(p, p["b"].dtype, axis_name="data"), g, 2.0)
      out = dist.reduce_sums(wa.finish_sums(s)[0], "data")
    return out.finite[None], out.valid[None], out.grads

  return jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, gspec),
      out_specs=(flat, flat, specs),
    )
  )


_SM = {}


def _sm_fn(kind, mesh_name):
  if (kind, mesh_name) not in _SM:
    _SM[kind, mesh_name] = _sm(kind, mesh_name)
  return _SM[kind, mesh_name]


# Every dtype on the 2-D mesh (where the per-shard decision can split),
# float32 on the 1-D one.
SM_DTYPES = [("data8", jnp.float32)] + [("data4_model2", d) for d in DTYPES]


@pytest.mark.parametrize("case", SM_CASES, ids=[c[0] for c in SM_CASES])
@pytest.mark.parametrize(
  "mesh_name,dtype",
  SM_DTYPES,
  ids=[f"{m}-{jnp.dtype(d).name}" for m, d in SM_DTYPES],
)
@pytest.mark.parametrize("kind", ["window", "microbatch", "reduce_sums"])
def test_distributed_flags_every_shard(kind, mesh_name, dtype, case):
  _, bad, replica, pos = case
  mesh, _ = SM[mesh_name]
  n = mesh.shape["data"]
  params = cast(host_params(), dtype)
  stack = _replica_grads(bad, replica, pos, dtype)
  stack = {k: v[:n] for k, v in stack.items()}
  finite, valid, grads = _sm_fn(kind, mesh_name)(params, stack)
  ok = bad is None
  assert finite.shape == (mesh.size,)
  assert_flag(finite, ok, "finite")
  assert all(bool(v) == ok for v in np.asarray(finite)), np.asarray(finite)
  assert all(bool(v) == ok for v in np.asarray(valid)), np.asarray(valid)
  if ok:  # the mean of r * g over replicas r = 1..n, weights equal
    ref = {k: v * (n + 1) / 4.0 for k, v in host_grads().items()}
    assert_close(grads, ref, rtol=2 * rtol_of(dtype))


def _sm_wrapper(mesh_name):
  mesh, pspec = SM[mesh_name]
  specs = {"b": pspec, "w": pspec}
  gspec = {k: P("data", *pspec) for k in specs}
  tx = wa.WeightedMultiSteps(optax.sgd(1.0), 1, mode="sum", axis_name="data")

  def step(p, g):
    g = jax.tree.map(lambda x: x[0], g)
    upd, s = tx.update(g, tx.init(p), p, weight=1.0)
    return s.nonfinite[None], upd

  return jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, gspec),
      out_specs=(P(mesh.axis_names), specs),
    )
  )


_SM_WRAPPER = {m: _sm_wrapper(m) for m in SM}


@pytest.mark.parametrize("case", SM_CASES, ids=[c[0] for c in SM_CASES])
@pytest.mark.parametrize("mesh_name", list(SM))
def test_wrapper_axis_name_skips_on_every_replica(mesh_name, case):
  _, bad, replica, pos = case
  mesh, _ = SM[mesh_name]
  n = mesh.shape["data"]
  stack = _replica_grads(bad, replica, pos, np.float32)
  stack = {k: v[:n] for k, v in stack.items()}
  nonfinite, upd = _SM_WRAPPER[mesh_name](host_params(), stack)
  ok = bad is None
  assert all(bool(v) == (not ok) for v in np.asarray(nonfinite))
  assert_finite(upd, "updates")
  # SGD(1) of the window's sum over replicas (weights 1 each, mode sum:
  # the mean is sum_r r * g / n).
  ref = {
    k: -v * (n + 1) / 2.0 if ok else 0 * v for k, v in host_grads().items()
  }
  assert_close(upd, ref, rtol=1e-6)
