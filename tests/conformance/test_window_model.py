"""Model-based test of the window: random sequences of the public operations
against a float64 NumPy model, every observable checked after each step.

A ``hypothesis`` state machine drives ``init``, ``accumulate_sum``/``_mean``
(weights 0, fractional, large and hostile: negative, NaN, Inf, subnormal;
grads with NaN/Inf at weight 0 and above), ``set_loss_scale``,
``finish_sums``, ``finish_mean``, ``peek_mean``, ``discard``,
``apply_window`` (``optax.sgd(1.0)``: the params' change is minus the mean)
and an Orbax save/restore round trip (``AccumSave``/``AccumRestore``), each
eagerly or under ``jax.jit`` (a drawn flag), in every work dtype ``init``
accepts. The model (:class:`Model`) keeps, per replica, the float64 sums,
the counts and the exact weight, and predicts each documented outcome
(``docs/inputs.md``): a concrete invalid value raises
``WeightedAccumulationError`` and leaves the state as it was; under ``jit``
an invalid microbatch is rejected whole and counted, an empty
``finish_mean`` returns ``valid=False`` and the unchanged window.

Two window kinds: the global window (``wa.init``), and the per-replica
window over a 2-device data mesh, stacked between jitted steps and used
inside ``jax.shard_map`` (the model sums the replicas' sums and weights
before the one division). One more property runs a whole per-replica window
inside one ``shard_map``. Every call to the data-parallel API is in the
``dp_*`` helpers below, so a change of its spelling is a change there.
"""

from __future__ import annotations

import functools
import math
import tempfile
import types
from typing import Any

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import weighted_accum as wa
from weighted_accum import distributed as dist

Error = wa.WeightedAccumulationError
SHAPES = {"a": (3,), "b": (2, 2)}
TX = optax.sgd(1.0)
AXIS = "data"
REPLICAS = 2
MESH = jax.sharding.Mesh(np.array(jax.devices()[:REPLICAS]), (AXIS,))
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16] + (
  [jnp.float64] if jax.config.jax_enable_x64 else []
)
F32 = np.finfo(np.float32)
COUNTER_NAMES = tuple(wa.init({"a": jnp.zeros(1)}).counters)

# Weights: zero, fractional (0.1 is not a float32), integers, large (2**24 +
# 1 is exact only eagerly: jit's float32 rounds it), and hostile ones.
WEIGHTS = [0.0, 0.5, 0.375, 0.1, 1, 3, 7.0, 1000.0, 1e6, 2**24 + 1, 2.0**30]
HOSTILE_WEIGHTS = [-1.0, -0.5, math.nan, math.inf, -math.inf, 1e-40]
SCALES = [1.0, 0.5, 4.0, 1024.0]
HOSTILE_SCALES = [0.0, -1.0, math.nan, math.inf, 1e-40]
BAD_GRADS = [None, None, None, None, math.nan, math.inf, -math.inf]

weights = st.sampled_from(WEIGHTS + WEIGHTS + HOSTILE_WEIGHTS)
next_scales = st.sampled_from([None, None, None] + SCALES + HOSTILE_SCALES)
grads_seeds = st.integers(0, 2**16)
bad_values = st.sampled_from(BAD_GRADS)
# One microbatch's grads: a seed, and a NaN/Inf (or None) at one place.
MICROBATCH = dict(seed=grads_seeds, bad=bad_values, bad_at=st.integers(0, 7))

# Examples from the loaded profile (conftest.py: 25 in CI), 12 steps each.
MACHINE_SETTINGS = settings(stateful_step_count=12, deadline=None)


# ------------------------------------------------ the data-parallel API --
# Every call to weighted_accum.distributed is here (the API may move to
# options of the core functions).


def dp_init(params, dtype, loss_scale):
  """A per-replica window stacked over the data axis (outside shard_map)."""
  return wa.init(params, dtype, loss_scale, axis_name=AXIS)


def dp_init_local(params, dtype, loss_scale):
  """A per-replica window made inside shard_map."""
  return wa.init(params, dtype, loss_scale, axis_name=AXIS)


def dp_specs(state):
  """The shard_map specs of a stacked window."""
  return dist.window_specs(state)


def dp_accumulate(state, grads, weight, mean):
  """Adds this replica's local grads with its own weight (in shard_map)."""
  f = wa.accumulate_mean if mean else wa.accumulate_sum
  return f(state, grads, weight)


def dp_finish_mean(state, next_loss_scale):
  """The global mean of a per-replica window (in shard_map or not)."""
  return wa.finish_mean(state, next_loss_scale=next_loss_scale)


def dp_apply_window(state, params, opt_state, next_loss_scale):
  return wa.apply_window(
    TX, state, params, opt_state, next_loss_scale=next_loss_scale
  )


def dp_peek_mean(state):
  return wa.peek_mean(state)


# ------------------------------------------------------------ jitted ops --
# Built once at module level: one compilation per dtype (and None/array
# next scale), the drawn values are data.

_J = {
  "sum": jax.jit(wa.accumulate_sum),
  "mean": jax.jit(wa.accumulate_mean),
  "set_loss_scale": jax.jit(wa.set_loss_scale),
  "finish_sums": jax.jit(lambda s, ls: wa.finish_sums(s, next_loss_scale=ls)),
  "finish_mean": jax.jit(lambda s, ls: wa.finish_mean(s, next_loss_scale=ls)),
  "peek_mean": jax.jit(wa.peek_mean),
  "discard": jax.jit(lambda s, ls: wa.discard(s, next_loss_scale=ls)),
  "apply_window": jax.jit(
    lambda s, p, o, ls: wa.apply_window(TX, s, p, o, next_loss_scale=ls)
  ),
  "dp_finish_mean": jax.jit(dp_finish_mean),
  "dp_apply_window": jax.jit(dp_apply_window),
}


_init_jit = jax.jit(
  lambda p, ls, dtype: wa.init(p, dtype=dtype, loss_scale=ls),
  static_argnames="dtype",
)


def _in_shard_map(body, state, args, arg_specs, out_specs):
  """``body(state_block, *args)`` inside shard_map over the data axis."""
  specs = dp_specs(state)
  return jax.shard_map(
    body,
    mesh=MESH,
    in_specs=(specs, *arg_specs),
    out_specs=out_specs(specs),
  )(state, *args)


@functools.partial(jax.jit, static_argnames="mean")
def _sm_accumulate(state, grads, weights, mean):
  def body(s, g, w):
    return dp_accumulate(s, jax.tree.map(lambda x: x[0], g), w[0], mean)

  return _in_shard_map(
    body, state, (grads, weights), (P(AXIS), P(AXIS)), lambda s: s
  )


@jax.jit
def _sm_finish_mean(state, next_loss_scale):
  return _in_shard_map(
    lambda s, ls: dp_finish_mean(s, ls),
    state,
    (next_loss_scale,),
    (P(),),
    lambda s: (P(), s),
  )


@jax.jit
def _sm_peek_mean(state):
  return _in_shard_map(dp_peek_mean, state, (), (), lambda s: P())


@jax.jit
def _sm_apply_window(state, params, opt_state, next_loss_scale):
  return _in_shard_map(
    lambda s, p, o, ls: dp_apply_window(s, p, o, ls),
    state,
    (params, opt_state, next_loss_scale),
    (P(), P(), P()),
    lambda s: (P(), P(), s, P()),
  )


# ----------------------------------------------------------------- model --


def _f32(x: float) -> float:
  return float(np.float32(x))


def weight_ok(w: float) -> bool:
  """A weight the float32 tally stores (``docs/inputs.md``)."""
  return math.isfinite(w) and w >= 0 and not 0 < abs(w) < F32.tiny


def scale_ok(s: float) -> bool:
  return math.isfinite(s) and s > 0 and not s < F32.tiny


def _dyadic(w: float) -> bool:
  return float(w) * 8 == int(float(w) * 8) if math.isfinite(w) else True


class Model:
  """The window in float64: per replica the scaled sums, the sum of
  absolute contributions (for tolerances), the counts and the exact weight;
  the shared ``windows`` and loss scale."""

  def __init__(self, replicas: int, dtype, loss_scale: float):
    self.replicas = replicas
    self.dtype = jnp.dtype(dtype)
    self.loss_scale = _f32(loss_scale)
    self.windows = 0
    self.reset()

  def reset(self):
    r = self.replicas
    self.sums = {k: np.zeros((r, *s)) for k, s in SHAPES.items()}
    self.abs = {k: np.zeros((r, *s)) for k, s in SHAPES.items()}
    self.adds = np.zeros(r, int)
    self.issued = np.zeros(r, int)
    self.zero_weight = np.zeros(r, int)
    self.rejected = np.zeros(r, int)
    self.weight = np.zeros(r)
    self.exact = True  # the total weight is exact (dyadic weights)

  @property
  def total(self) -> float:
    return float(self.weight.sum())

  def add(self, r: int, grads: dict, w: float, mean: bool) -> None:
    self.issued[r] += 1
    if not (weight_ok(w) and scale_ok(self.loss_scale)):
      self.rejected[r] += 1
      return
    if w == 0:
      self.zero_weight[r] += 1
      return
    with np.errstate(invalid="ignore"):  # Inf + -Inf is NaN, as in JAX
      for k, g in grads.items():
        c = g * w if mean else g
        self.sums[k][r] += c
        self.abs[k][r] += np.abs(c)
    self.adds[r] += 1
    self.weight[r] += w
    self.exact &= _dyadic(w)

  def close(self, next_scale, *, keep_empty: bool) -> None:
    """A finish: reset (``windows`` + 1), or with ``keep_empty`` and zero
    weight keep the counters; the next loss scale either way."""
    if not (keep_empty and self.total == 0):
      self.reset()
      self.windows += 1
    if next_scale is not None:
      self.loss_scale = next_scale

  # -- what a finish returns --
  def global_sums(self):
    return {k: s.sum(axis=0) for k, s in self.sums.items()}

  def finite(self) -> bool:
    return all(np.isfinite(s).all() for s in self.global_sums().values())

  def usable(self) -> bool:
    return scale_ok(self.loss_scale) and self.total > 0

  def mean(self):
    """``(mean, tolerance)`` per leaf: NaN where a sum is not finite, 0
    where the divisors are not usable."""
    eps = float(jnp.finfo(self.dtype).eps)
    tiny = float(jnp.finfo(self.dtype).tiny)
    n = int(self.adds.sum()) + self.replicas + 4
    out, tol = {}, {}
    for k, s in self.global_sums().items():
      a = self.abs[k].sum(axis=0)
      if self.usable():
        m = s / self.loss_scale / self.total
        t = eps * n * a / self.loss_scale / self.total + tiny
      else:
        m, t = np.zeros_like(s), np.zeros_like(s)
      out[k] = np.where(np.isfinite(s), m, np.nan)
      tol[k] = np.where(np.isfinite(s), t, 0)
    return out, tol

  def mean_fits(self) -> bool:
    big = float(jnp.finfo(self.dtype).max)
    m, _ = self.mean()
    return all(np.all(np.abs(x[np.isfinite(x)]) <= big) for x in m.values())


# ----------------------------------------------------------- comparisons --


def assert_tree_close(actual: dict, expected: dict, tol: dict, what: str):
  """Non-finite exactly where expected (the same value), finite elsewhere
  within ``tol``."""
  for k, e in expected.items():
    a = np.asarray(actual[k], np.float64).reshape(e.shape)
    bad = ~np.isfinite(e)
    np.testing.assert_array_equal(
      np.isnan(a), np.isnan(e), err_msg=f"{what}[{k}]: NaN pattern"
    )
    np.testing.assert_array_equal(
      a[bad & ~np.isnan(e)], e[bad & ~np.isnan(e)], err_msg=f"{what}[{k}]"
    )
    ok = ~bad
    err = np.abs(a[ok] - e[ok])
    assert np.all(err <= np.asarray(tol[k])[ok]), (
      f"{what}[{k}]: got {a[ok]}, expected {e[ok]} (error {err.max()}, "
      f"tolerance {np.asarray(tol[k])[ok]})"
    )


def assert_state(state: wa.AccumState, m: Model) -> None:
  """Every observable of ``state`` against the model."""
  r = m.replicas
  assert jnp.dtype(state.dtype) == m.dtype
  lead = () if r == 1 else (r,)
  for name in ("issued", "zero_weight", "rejected"):
    v = np.asarray(getattr(state, name))
    assert v.shape == lead, (name, v.shape)
    np.testing.assert_array_equal(v.reshape(r), getattr(m, name), name)
  assert np.asarray(state.windows).shape == ()
  assert int(state.windows) == m.windows
  ls = np.asarray(state.loss_scale)
  assert ls.shape == (), f"loss_scale has shape {ls.shape}"
  np.testing.assert_array_equal(ls, np.float32(m.loss_scale), "loss_scale")
  hi = np.asarray(state.weight_hi, np.float64).reshape(r)
  lo = np.asarray(state.weight_lo, np.float64).reshape(r)
  if m.exact:
    np.testing.assert_array_equal(hi + lo, m.weight, "weight (exact)")
  else:
    np.testing.assert_allclose(hi + lo, m.weight, rtol=2.0**-44)
  counters = state.counters
  assert tuple(counters) == COUNTER_NAMES
  for name, v in counters.items():
    assert v is getattr(state, name), name
  if hasattr(state, "total_weight"):  # a stacked window's: over replicas
    total = state.total_weight
    assert isinstance(total, float)
    if m.exact:
      assert total == m.total, (total, m.total)
    else:
      np.testing.assert_allclose(total, m.total, rtol=2.0**-44)
  eps = float(jnp.finfo(m.dtype).eps)
  for k in m.sums:
    b = state.grads[k]
    assert jnp.dtype(b.dtype) == m.dtype, (k, b.dtype)
    assert b.shape == lead + SHAPES[k], (k, b.shape)
  tol = {
    k: eps
    * (m.adds[:, None, None] + 2).reshape((r,) + (1,) * len(SHAPES[k]))
    * a
    for k, a in m.abs.items()
  }
  buffers = {
    k: np.asarray(v, np.float64).reshape(m.sums[k].shape)
    for k, v in state.grads.items()
  }
  assert_tree_close(buffers, m.sums, tol, "buffers")


def assert_out(out, m: Model, *, mean: bool, apply: bool = False) -> None:
  """A finish's result against the model (before the model closes)."""
  r_issued = int(m.issued.sum())
  assert int(out.issued) == r_issued, (int(out.issued), r_issued)
  np.testing.assert_allclose(float(out.weight), m.total, rtol=2.0**-23)
  np.testing.assert_array_equal(
    np.asarray(out.loss_scale), np.float32(m.loss_scale)
  )
  finite = m.finite()
  assert bool(out.finite) == finite, "finite"
  if apply:
    valid = finite and m.usable()
  elif mean:
    valid = finite and m.usable() and m.mean_fits()
  else:
    valid = finite and scale_ok(m.loss_scale)
  assert bool(out.valid) == valid, f"valid: {bool(out.valid)} != {valid}"
  if apply:
    assert out.grads is None
    return
  if mean:
    expected, tol = m.mean()
    assert_tree_close(out.grads, expected, tol, "finish_mean grads")
    for g in out.grads.values():
      assert jnp.dtype(g.dtype) == m.dtype
  else:
    eps = float(jnp.finfo(m.dtype).eps)
    tol = {
      k: eps * (m.adds.sum() + 2) * a.sum(axis=0) for k, a in m.abs.items()
    }
    assert_tree_close(out.grads, m.global_sums(), tol, "finish_sums grads")


def assert_same_bits(a, b):
  """The same tree, dtypes, shapes and bits (and work dtype)."""
  assert jnp.dtype(a.dtype) == jnp.dtype(b.dtype)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(
      np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8)
    )


# ------------------------------------------------------------- the driver --


def host_grads(seed: int, bad, bad_at: int, replicas: int) -> dict:
  """Per replica, small multiples of 1/8 (exact in every work dtype), with
  ``bad`` at one element of one replica's leaf."""
  rng = np.random.default_rng(seed)
  g = {
    k: rng.integers(-32, 33, size=(replicas, *s)) / 8.0
    for k, s in SHAPES.items()
  }
  if bad is not None:
    k = "a" if bad_at % 2 else "b"
    g[k][(bad_at // 2) % replicas].flat[bad_at % g[k][0].size] = bad
  return g


def _scale_arg(value, eager: bool):
  if value is None or eager:
    return value
  return jnp.float32(value)


def _stored_scale(value, eager: bool):
  """The loss scale a call stores: NaN for a traced invalid one."""
  if value is None:
    return None
  return _f32(value) if scale_ok(_f32(value)) else math.nan


class WindowMachine(RuleBasedStateMachine):
  """The global window (``wa.init``), eager or jitted per call."""

  replicas = 1

  def __init__(self):
    super().__init__()
    self.saves = 0

  def make_params(self, values):
    return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}

  def make_state(self, dtype, loss_scale):
    return wa.init(self.params, dtype=dtype, loss_scale=loss_scale)

  @initialize(
    dtype=st.sampled_from(DTYPES),
    loss_scale=st.sampled_from(SCALES),
    seed=grads_seeds,
  )
  def start(self, dtype, loss_scale, seed):
    p = host_grads(seed, None, 0, 1)
    self.params = self.make_params({k: v[0] for k, v in p.items()})
    self.opt_state = TX.init(self.params)
    self.state = self.make_state(dtype, loss_scale)
    self.model = Model(self.replicas, dtype, loss_scale)

  @rule(
    eager=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from(SCALES + HOSTILE_SCALES),
  )
  def init(self, eager, dtype, scale):
    """A new window (the old one is dropped): a concrete invalid scale
    raises, a traced one makes the window unusable (NaN scale)."""
    eager = eager or self.replicas > 1  # dp_init outside jit only
    if eager and not scale_ok(_f32(scale)):
      with pytest.raises(Error):
        self.make_state(dtype, scale)
      return
    if eager:
      self.state = self.make_state(dtype, scale)
    else:
      self.state = _init_jit(self.params, jnp.float32(scale), dtype=dtype)
    self.model = Model(self.replicas, dtype, _stored_scale(scale, eager))

  @invariant()
  def state_matches_model(self):
    if hasattr(self, "state"):
      assert_state(self.state, self.model)

  def weight_of(self, w, eager: bool) -> float:
    """What the library receives: a Python number eagerly, a float32 under
    jit; a float16 window cannot hold very large mean contributions."""
    if not eager:
      w = _f32(w)
    return float(w)

  def cap(self, w, mean: bool):
    if self.model.dtype == jnp.float16 and mean and w > 1000:
      return 1000.0
    return w

  # -- accumulate --

  @rule(eager=st.booleans(), weight=weights, **MICROBATCH)
  def accumulate_sum(self, eager, weight, seed, bad, bad_at):
    self.accumulate(False, eager, weight, seed, bad, bad_at)

  @rule(eager=st.booleans(), weight=weights, **MICROBATCH)
  def accumulate_mean(self, eager, weight, seed, bad, bad_at):
    self.accumulate(True, eager, weight, seed, bad, bad_at)

  def accumulate(self, mean, eager, weight, seed, bad, bad_at):
    weight = self.cap(weight, mean)
    g = host_grads(seed, bad, bad_at, 1)
    grads = {k: jnp.asarray(v[0], jnp.float32) for k, v in g.items()}
    m = self.model
    name = "mean" if mean else "sum"
    if eager:
      ok = weight_ok(weight) and scale_ok(m.loss_scale)
      f = wa.accumulate_mean if mean else wa.accumulate_sum
      if not ok:
        with pytest.raises(Error):
          f(self.state, grads, weight)
        return
      self.state = f(self.state, grads, weight)
    else:
      self.state = _J[name](self.state, grads, jnp.float32(weight))
    m.add(
      0, {k: v[0] for k, v in g.items()}, self.weight_of(weight, eager), mean
    )

  # -- the loss scale --

  @rule(eager=st.booleans(), scale=st.sampled_from(SCALES + HOSTILE_SCALES))
  def set_loss_scale(self, eager, scale):
    m = self.model
    ok = scale_ok(_f32(scale)) and m.total == 0
    if eager:
      if not ok:
        with pytest.raises(Error):
          wa.set_loss_scale(self.state, scale)
        return
      self.state = wa.set_loss_scale(self.state, scale)
    else:
      self.state = _J["set_loss_scale"](self.state, jnp.float32(scale))
    m.loss_scale = _f32(scale) if ok else math.nan

  # -- closes --

  def _next(self, eager, next_scale):
    """``(ok, argument, stored)``: eagerly an invalid next scale raises."""
    ok = next_scale is None or not eager or scale_ok(_f32(next_scale))
    return ok, _scale_arg(next_scale, eager), _stored_scale(next_scale, eager)

  @rule(eager=st.booleans(), next_scale=next_scales)
  def finish_sums(self, eager, next_scale):
    ok, arg, stored = self._next(eager, next_scale)
    if not ok:
      with pytest.raises(Error):
        wa.finish_sums(self.state, next_loss_scale=arg)
      return
    f = (
      (lambda s, ls: wa.finish_sums(s, next_loss_scale=ls))
      if eager
      else (_J["finish_sums"])
    )
    out, self.state = f(self.state, arg)
    assert_out(out, self.model, mean=False)
    self.model.close(stored, keep_empty=False)

  @rule(eager=st.booleans(), next_scale=next_scales)
  def finish_mean(self, eager, next_scale):
    ok, arg, stored = self._next(eager, next_scale)
    m = self.model
    if not ok or (eager and m.total == 0):
      with pytest.raises(Error):
        wa.finish_mean(self.state, next_loss_scale=arg)
      return
    f = (
      (lambda s, ls: wa.finish_mean(s, next_loss_scale=ls))
      if eager
      else (_J["finish_mean"])
    )
    out, self.state = f(self.state, arg)
    assert_out(out, m, mean=True)
    m.close(stored, keep_empty=True)

  @rule(eager=st.booleans())
  def peek_mean(self, eager):
    if eager and self.model.total == 0:
      with pytest.raises(Error):
        wa.peek_mean(self.state)
      return
    out = (wa.peek_mean if eager else _J["peek_mean"])(self.state)
    assert_out(out, self.model, mean=True)

  @rule(eager=st.booleans(), next_scale=next_scales)
  def discard(self, eager, next_scale):
    ok, arg, stored = self._next(eager, next_scale)
    if not ok:
      with pytest.raises(Error):
        wa.discard(self.state, next_loss_scale=arg)
      return
    f = (
      (lambda s, ls: wa.discard(s, next_loss_scale=ls))
      if eager
      else (_J["discard"])
    )
    self.state = f(self.state, arg)
    self.model.close(stored, keep_empty=False)

  def call_apply(self, eager, arg):
    if eager:
      return wa.apply_window(
        TX, self.state, self.params, self.opt_state, next_loss_scale=arg
      )
    return _J["apply_window"](self.state, self.params, self.opt_state, arg)

  @rule(eager=st.booleans(), next_scale=next_scales)
  def apply_window(self, eager, next_scale):
    self.check_apply(
      eager, next_scale, functools.partial(self.call_apply, eager)
    )

  def check_apply(self, eager, next_scale, call):
    """``call(next_scale_argument)`` applies the window with ``TX``: the
    params move by minus the model's mean, or not at all."""
    ok, arg, stored = self._next(eager, next_scale)
    m = self.model
    if not ok:
      with pytest.raises(Error):
        call(arg)
      return
    old = {k: np.asarray(v, np.float64) for k, v in self.params.items()}
    params, self.opt_state, self.state, out = call(arg)
    assert_out(out, m, mean=True, apply=True)
    new = {k: np.asarray(v, np.float64) for k, v in params.items()}
    if bool(out.valid):
      mean, tol = m.mean()
      for k in new:
        step_tol = tol[k] + 4 * F32.eps * (np.abs(old[k]) + np.abs(mean[k]))
        assert np.all(np.abs((new[k] - old[k]) + mean[k]) <= step_tol), (
          f"params[{k}] changed by {new[k] - old[k]}, expected {-mean[k]}"
        )
    else:
      for k in new:
        np.testing.assert_array_equal(new[k], old[k], f"params[{k}] moved")
    for v in params.values():
      assert v.dtype == jnp.float32
    self.params = params
    m.close(stored, keep_empty=True)

  @precondition(lambda self: self.replicas == 1)
  @rule(host=st.booleans())
  def from_buffers(self, host):
    """The buffers and counters reattached (as device or NumPy arrays)
    continue the window exactly; a zero-weight window's must be zero."""
    bufs, counters = self.state.grads, self.state.counters
    if host:
      bufs = jax.tree.map(np.asarray, bufs)
      counters = {k: np.asarray(v) for k, v in counters.items()}
    restored = wa.from_buffers(self.params, bufs, counters)
    assert_same_bits(restored, self.state)
    self.state = restored

  # -- Orbax --

  def template(self):
    return wa.checkpoint.abstract_state(self.params, self.model.dtype)

  # Any window the library makes restores (an unusable one, with a NaN
  # loss scale, included).
  @precondition(lambda self: self.saves < 1)
  @rule(concrete_template=st.booleans())
  def save_and_restore(self, concrete_template):
    self.saves += 1
    template = self.state if concrete_template else self.template()
    handler = wa.checkpoint.AccumCheckpointHandler()
    with tempfile.TemporaryDirectory() as d:
      path = f"{d}/accum"
      with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(path, args=wa.checkpoint.AccumSave(self.state))
      with ocp.Checkpointer(wa.checkpoint.AccumCheckpointHandler()) as ckptr:
        restored = ckptr.restore(
          path, args=wa.checkpoint.AccumRestore(template)
        )
    assert_same_bits(restored, self.state)
    self.state = restored


class ReplicaWindowMachine(WindowMachine):
  """A per-replica window over a 2-device data mesh, stacked between jitted
  steps: accumulated inside ``shard_map`` (each replica its own grads and
  weight), closed inside ``shard_map`` or under plain ``jit``."""

  replicas = REPLICAS

  def make_params(self, values):
    return jax.device_put(
      {k: jnp.asarray(v, jnp.float32) for k, v in values.items()},
      NamedSharding(MESH, P()),
    )

  def make_state(self, dtype, loss_scale):
    return dp_init(self.params, dtype, loss_scale)

  def template(self):
    return self.state

  @rule(w0=weights, w1=weights, **MICROBATCH)
  def accumulate_sum(self, w0, w1, seed, bad, bad_at):
    self.accumulate(False, w0, w1, seed, bad, bad_at)

  @rule(w0=weights, w1=weights, **MICROBATCH)
  def accumulate_mean(self, w0, w1, seed, bad, bad_at):
    self.accumulate(True, w0, w1, seed, bad, bad_at)

  def accumulate(self, mean, w0, w1, seed, bad, bad_at):
    ws = [_f32(self.cap(w, mean)) for w in (w0, w1)]
    g = host_grads(seed, bad, bad_at, REPLICAS)
    grads = {k: jnp.asarray(v, jnp.float32) for k, v in g.items()}
    self.state = _sm_accumulate(
      self.state, grads, jnp.asarray(ws, jnp.float32), mean=mean
    )
    for r, w in enumerate(ws):
      self.model.add(r, {k: v[r] for k, v in g.items()}, w, mean)

  @rule(eager=st.booleans(), inside=st.booleans(), next_scale=next_scales)
  def finish_mean(self, eager, inside, next_scale):
    ok, arg, stored = self._next(eager and not inside, next_scale)
    empty = eager and not inside and self.model.total == 0
    if not ok or empty:  # an empty window has no mean: refused, as global
      with pytest.raises(Error):
        dp_finish_mean(self.state, arg)
      return
    if inside:
      out, self.state = _sm_finish_mean(self.state, _scale_arg(next_scale, 0))
    elif eager:
      out, self.state = dp_finish_mean(self.state, arg)
    else:
      out, self.state = _J["dp_finish_mean"](self.state, arg)
    assert_out(out, self.model, mean=True)
    self.model.close(stored, keep_empty=True)

  @rule()
  def finish_sums(self):
    # A per-replica window is closed with its one reduction: refused.
    with pytest.raises(Error):
      wa.finish_sums(self.state)

  @rule()
  def peek_mean(self):
    out = _sm_peek_mean(self.state)
    assert_out(out, self.model, mean=True)

  @rule(eager=st.booleans(), inside=st.booleans(), next_scale=next_scales)
  def apply_window(self, eager, inside, next_scale):
    eager = eager and not inside

    def call(arg):
      args = (self.state, self.params, self.opt_state, arg)
      if inside:
        return _sm_apply_window(*args)
      return (dp_apply_window if eager else _J["dp_apply_window"])(*args)

    self.check_apply(eager, next_scale, call)


TestGlobalWindowModel = WindowMachine.TestCase
TestGlobalWindowModel.settings = MACHINE_SETTINGS
TestReplicaWindowModel = ReplicaWindowMachine.TestCase
TestReplicaWindowModel.settings = MACHINE_SETTINGS


# ------------------------------- one per-replica window inside shard_map --

K = 3  # microbatches per replica


SHARED = ("windows", "loss_scale")  # identical on every replica


@functools.partial(jax.jit, static_argnames=("dtype", "mean"))
def _one_window(params, grads, weights, loss_scale, dtype, mean):
  """A window made, filled (``lax.scan``) and closed inside one
  ``shard_map``; returns the close's result and the observables of the
  window before and after it (each replica's values stacked)."""

  def observed(s):
    leaves = {"grads": s.grads, **s.counters}
    for name in SHARED:  # unvarying: made per replica to be stacked
      leaves[name] = jax.lax.pcast(leaves[name], AXIS, to="varying")
    return jax.tree.map(lambda x: x[None], leaves)

  def body(p, g, w, ls):
    s = dp_init_local(p, dtype, ls)

    def step(s, gw):
      g, w = gw
      return dp_accumulate(s, jax.tree.map(lambda x: x[0], g), w[0], mean), None

    s, _ = jax.lax.scan(step, s, (g, w))
    out, new = dp_finish_mean(s, None)
    return out, observed(s), observed(new)

  return jax.shard_map(
    body,
    mesh=MESH,
    in_specs=(P(), P(None, AXIS), P(None, AXIS), P()),
    out_specs=(P(), P(AXIS), P(AXIS)),
  )(params, grads, weights, loss_scale)


def _as_stacked_window(observed: dict, dtype) -> Any:
  """The observables of a per-replica window as a stacked window's (the
  shared counters checked equal on every replica)."""
  fields = dict(observed)
  for name in SHARED:
    v = np.asarray(fields[name])
    np.testing.assert_array_equal(v, v[:1].repeat(REPLICAS), name)
    fields[name] = fields[name][0]
  counters = {k: fields[k] for k in COUNTER_NAMES}
  return types.SimpleNamespace(dtype=dtype, counters=counters, **fields)


@settings(max_examples=10, deadline=None)
@given(
  dtype=st.sampled_from(DTYPES[:2]),
  mean=st.booleans(),
  ws=st.lists(weights, min_size=K * REPLICAS, max_size=K * REPLICAS),
  loss_scale=st.sampled_from(SCALES),
  **MICROBATCH,
)
def test_replica_window_inside_shard_map(
  dtype, mean, ws, loss_scale, seed, bad, bad_at
):
  """A per-replica window inside ``shard_map`` (each replica its own grads
  and weights, hostile ones rejected on their replica) equals the model:
  the replicas' sums and weights summed before the one division."""
  rng = np.random.default_rng(seed)
  hg = [
    host_grads(int(rng.integers(2**16)), None, 0, REPLICAS) for _ in range(K)
  ]
  if bad is not None:
    hg[bad_at % K] = host_grads(seed, bad, bad_at, REPLICAS)
  w = np.asarray(ws, np.float64).reshape(K, REPLICAS).astype(np.float32)
  params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
  grads = {
    k: jnp.asarray(np.stack([g[k] for g in hg]), jnp.float32) for k in SHAPES
  }
  out, before, after = _one_window(
    params, grads, jnp.asarray(w), jnp.float32(loss_scale), dtype, mean
  )
  m = Model(REPLICAS, dtype, loss_scale)
  for k in range(K):
    for r in range(REPLICAS):
      m.add(r, {n: g[r] for n, g in hg[k].items()}, float(w[k, r]), mean)
  assert_state(_as_stacked_window(before, dtype), m)
  assert_out(out, m, mean=True)
  m.close(None, keep_empty=True)
  assert_state(_as_stacked_window(after, dtype), m)


# ------------------------------------------- defects found by the model --


def _roundtrip(state, template, *, refusal_ok=False):
  """``state`` saved and restored into ``template``; ``None`` where
  ``refusal_ok`` and the save refused it."""
  with tempfile.TemporaryDirectory() as d:
    path = f"{d}/accum"
    with ocp.Checkpointer(wa.checkpoint.AccumCheckpointHandler()) as ckptr:
      try:
        ckptr.save(path, args=wa.checkpoint.AccumSave(state))
      except Error:
        if refusal_ok:
          return None
        raise
    with ocp.Checkpointer(wa.checkpoint.AccumCheckpointHandler()) as ckptr:
      return ckptr.restore(path, args=wa.checkpoint.AccumRestore(template))


def test_stacked_window_restores():
  params = jax.device_put({"a": jnp.zeros(3)}, NamedSharding(MESH, P()))
  state = dp_init(params, jnp.float32, 1.0)
  grads = {"a": jnp.ones((REPLICAS, 3))}
  state = _sm_accumulate(state, grads, jnp.asarray([2.0, 0.0]), mean=False)
  assert_same_bits(_roundtrip(state, state), state)


def test_unusable_window_saves_and_restores_or_refuses_to_save():
  state = wa.init({"a": jnp.zeros(3)})
  state = _J["set_loss_scale"](state, jnp.float32(-1.0))  # documented: NaN
  assert np.isnan(state.loss_scale)
  restored = _roundtrip(state, state, refusal_ok=True)
  if restored is not None:  # refusing to save it would be consistent too
    assert_same_bits(restored, state)


def test_set_loss_scale_of_a_stacked_window_keeps_one_shared_scale():
  """The scale is shared by the replicas: set while every replica's weight
  is 0, refused (eager) or made unusable (jit) once any replica holds
  weight; a scalar either way."""
  params = jax.device_put({"a": jnp.zeros(3)}, NamedSharding(MESH, P()))
  state = dp_init(params, jnp.float32, 1.0)
  for f in (wa.set_loss_scale, _J["set_loss_scale"]):
    ls = f(state, jnp.float32(4.0)).loss_scale
    assert ls.shape == () and float(ls) == 4.0
  grads = {"a": jnp.ones((REPLICAS, 3))}
  state = _sm_accumulate(state, grads, jnp.asarray([0.0, 2.0]), mean=False)
  with pytest.raises(Error, match="already holds total weight 2.0"):
    wa.set_loss_scale(state, 4.0)
  ls = _J["set_loss_scale"](state, jnp.float32(4.0)).loss_scale
  assert ls.shape == () and np.isnan(ls)
