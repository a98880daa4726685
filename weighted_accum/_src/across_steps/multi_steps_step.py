"""The optax wrapper's step: its configuration, ``init`` and the
per-microbatch ``update`` (its state is in ``wrapper_state``).

One microbatch, in one straight path: validate, accumulate (optionally
skipped by ``should_skip_update_fn``), plan the inner updates' shapes
(``jax.eval_shape``), then close the window on the one close path
(``window.close``, one conditional: the inner update runs in its close branch
only) or keep it open, and select the returned updates and the next buffers.
How a step is laid out in memory, and why (the updates travel in the
window's buffers; selects after the conditional), is in ``docs/design.md``
("The optax wrapper's step layout").
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from weighted_accum._src import validation
from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState,
)
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.loss_scale import DynamicLossScale
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import distributed


class Config(NamedTuple):
  """The validated static choices of one wrapper."""

  inner: optax.GradientTransformationExtraArgs
  every_k: int | Callable[..., Any] | None
  use_grad_mean: bool
  should_skip: Callable[..., Any] | None
  dtype: np.dtype | None  # None: the params' (resolved by init)
  mode: str
  loss_scale: Any  # a stored scalar, or a DynamicLossScale
  axis_name: tuple[str, ...] | None
  skip_nonfinite_updates: bool


def configure(who: str, **kw: Any) -> Config:
  """Validates the constructor's arguments (optax's names), naming each."""
  validation.transformation(kw["opt"], what=f"{who}(opt)")
  dt = kw["accumulator_dtype"]
  if dt is not None:
    dt = validation.work_dtype(dt, what=f"{who}(accumulator_dtype=...)")
  ls = kw["loss_scale"]
  if not isinstance(ls, DynamicLossScale):
    ls = validation.loss_scale(
      ls, what=f"{who}(loss_scale=...)", dtype=numerics.tally_dtype(dt)
    )
  return Config(
    inner=optax.with_extra_args_support(kw["opt"]),
    every_k=validation.every_k(
      kw["every_k_schedule"], what=f"{who}(every_k_schedule=...)"
    ),
    use_grad_mean=validation.static_flag(
      kw["use_grad_mean"], what=f"{who}(use_grad_mean=...)"
    ),
    should_skip=validation.callable_or_none(
      kw["should_skip_update_fn"],
      what=f"{who}(should_skip_update_fn=...)",
      hint="Pass a function (updates, gradient_step, params) -> "
      "(should_skip, skip_state), e.g. optax.skip_not_finite, or None.",
    ),
    dtype=dt,
    mode=validation.mode(kw["mode"], what=f"{who}(mode=...)"),
    loss_scale=ls,
    axis_name=validation.optional_axis_names(
      kw["axis_name"], what=f"{who}(axis_name=...)"
    ),
    skip_nonfinite_updates=validation.static_flag(
      kw["skip_nonfinite_updates"], what=f"{who}(skip_nonfinite_updates=...)"
    ),
  )


# ------------------------------------------------------------------- init --


def init(cfg: Config, params: Any) -> WeightedMultiStepsState:
  """An empty window and the inner optimizer's initial state."""
  scaler = (
    cfg.loss_scale if isinstance(cfg.loss_scale, DynamicLossScale) else None
  )
  if scaler is not None:
    # Fresh host-born arrays: a donated state must not hold one buffer twice,
    # and a scale committed to another device must not meet the params
    # (commit_like below places them as the params). A scaler built under
    # jax.jit / jax.eval_shape (the create-train-state idiom) holds traced
    # fields, already checked by the scaler's own rules: they are new values
    # of this trace, kept as they are.
    scaler = jax.tree.map(
      lambda x: x if tree_utils.is_traced(x) else jnp.asarray(np.asarray(x)),
      scaler,
    )
  scale = cfg.loss_scale if scaler is None else jnp.array(scaler.scale)
  accum = accumulation.init(params, dtype=cfg.dtype, loss_scale=scale)
  if cfg.axis_name is not None:  # every microbatch is reduced as it comes
    placement = base.Placement(base.REPLICA, tuple(cfg.axis_name), "microbatch")
    accum = accum.replace(placement=placement)
  # A distinct array per field: a donated state must not hold one buffer
  # twice.
  count = lambda: jnp.zeros((), jnp.int32)
  skip_state = ()
  if cfg.should_skip is not None:
    _, skip_state = cfg.should_skip(
      optax.tree.zeros_like(params), count(), params
    )
  # Scalars committed like the params (the inner state's too), as a jitted
  # step returns them: else its second call compiles again.
  return tree_utils.commit_like(
    WeightedMultiStepsState(
      mini_step=count(),
      gradient_step=count(),
      inner_opt_state=cfg.inner.init(params),
      acc_grads=accum.grads,
      skip_state=skip_state,
      window=accum.replace(grads=None),
      updated=jnp.zeros((), jnp.bool_),
      nonfinite=jnp.zeros((), jnp.bool_),
      nonfinite_windows=count(),
      empty_windows=count(),
      skipped=count(),
      rejected=count(),
      loss_scaler=scaler,
    ),
    params,
  )


# ------------------------------------------------------------- accumulate --


def _skip_verdict(cfg: Config, grads: Any, state, params) -> tuple[Any, Any]:
  """``should_skip_update_fn``'s verdict on the microbatch's (global)
  gradient, optax's way."""
  if cfg.should_skip is None:
    return None, state.skip_state
  skip, skip_state = cfg.should_skip(grads, state.gradient_step, params)
  if (jnp.result_type(skip), np.shape(skip)) != (jnp.bool_, ()):
    raise WeightedAccumulationError(
      "WeightedMultiSteps(should_skip_update_fn=...): it returned "
      f"{jnp.result_type(skip)} of shape {np.shape(skip)} as should_skip; "
      "it must return a bool scalar (and the skip state)."
    )
  return jnp.asarray(skip), skip_state


def _global_grads(contrib: Any, weight: jax.Array, mean: bool) -> Any:
  """The microbatch's gradient over all replicas, as ``should_skip`` sees
  it: the weighted mean of mean-loss grads, the sum of sum-loss grads."""
  if not mean:
    return contrib
  inv = jnp.where(weight > 0, 1.0 / jnp.where(weight > 0, weight, 1.0), 0.0)
  return jax.tree.map(lambda c: (c * inv).astype(c.dtype), contrib)


def _accumulate(cfg: Config, state, grads: Any, weight: Any, params: Any):
  """Validates and adds one microbatch, summed over ``cfg.axis_name`` when
  given. A skipped microbatch adds weight 0 (a select: NaN grads stay out)
  and leaves the window's counters as they were. Returns ``(accum, skip,
  skip_state)``."""
  accum = state.accum
  mean = cfg.mode == "mean"
  name = "WeightedMultiSteps.update"
  w = accumulation.convert_weight(accum, weight, name)
  if cfg.axis_name is None:
    skip, skip_state = _skip_verdict(cfg, grads, state, params)
  else:
    axes = validation.bound_axes(cfg.axis_name, what=f"{name}(axis_name)")
    grads, total = distributed.reduce_microbatch(
      accum, grads, w, axes, mean=mean, what=name
    )
    w = accumulation.convert_weight(accum, total, name)
    skip, skip_state = _skip_verdict(
      cfg, _global_grads(grads, total.hi + total.lo, mean), state, params
    )
    mean = False  # the global contribution is a sum already
  if skip is not None:
    w = validation.Weight(
      jnp.where(skip, 0, w.hi), jnp.where(skip, 0, w.lo), w.ok | skip
    )
  new = accumulation.add(
    accum,
    grads,
    w,
    mean=mean,
    name=name,
    allow_reduced=cfg.axis_name is not None,
  )
  if skip is not None:
    old = base.of(accum)
    new = new.replace(
      **{k: jnp.where(skip, old[k], v) for k, v in base.of(new).items()}
    )
  return new, skip, skip_state


# -------------------------------------------------------------- the close --


class _Plan(NamedTuple):
  """How the window's gradient reaches the inner optimizer (static for one
  trace)."""

  update: Callable[..., Any]
  shapes: Any
  carry: bool
  dtypes: list


def _inner_update(cfg, dtypes, extra_args, g, inner_state, params):
  """The inner update of ``g`` cast leaf by leaf to ``dtypes``."""
  leaves, treedef = jax.tree.flatten(g)
  g = jax.tree.unflatten(treedef, [a.astype(d) for a, d in zip(leaves, dtypes)])
  return cfg.inner.update(g, inner_state, params, **extra_args)


def _plan(cfg: Config, state, grads, params, extra_args) -> _Plan:
  """The inner update as the close branch runs it, and its updates' shapes."""
  ms_dtypes = [jnp.result_type(g) for g in jax.tree.leaves(grads)]
  dtypes = ms_dtypes
  if params is not None:
    p_leaves = tree_utils.match_tree(
      state.acc_grads, params, what="WeightedMultiSteps.update(params)"
    )
    dtypes = [
      jnp.promote_types(d, jnp.result_type(p))
      for d, p in zip(ms_dtypes, p_leaves)
    ]
  shapes = jax.eval_shape(
    functools.partial(_inner_update, cfg, ms_dtypes, extra_args),
    state.acc_grads,
    state.inner_opt_state,
    params,
  )[0]
  wide = functools.partial(_inner_update, cfg, dtypes, extra_args)

  def update(g, inner_state, params):
    upd, new_inner = wide(g, inner_state, params)
    return (
      tree_utils.cast_like(upd, shapes),
      tree_utils.cast_like(new_inner, inner_state),
    )

  buf_leaves, buf_def = jax.tree.flatten(state.acc_grads)
  upd_leaves, upd_def = jax.tree.flatten(shapes)
  carry = upd_def == buf_def and all(
    u.shape == b.shape
    and jnp.promote_types(u.dtype, b.dtype) == jnp.dtype(b.dtype)
    for u, b in zip(upd_leaves, buf_leaves)
  )
  return _Plan(update, shapes, carry, dtypes)


class _Closed(NamedTuple):
  """What :func:`_close` returns."""

  carrier: Any
  inner_state: Any
  counters: AccumState
  applied: jax.Array
  nonfinite: jax.Array
  empty: jax.Array
  scaler: DynamicLossScale | None


def _adjusted(scaler: DynamicLossScale, out) -> DynamicLossScale:
  """GradScaler's rule after the closed window ``out``; an empty window
  stays open and is not a step, so it leaves the scaler as it was."""
  new = scaler.adjust(out.finite)
  return jax.tree.map(lambda a, b: jnp.where(out.weight > 0, a, b), new, scaler)


def _close(cfg, plan, next_ls, closing, accum, state, params) -> _Closed:
  """Closes the window where ``closing``, on the one close path
  (``window.close(when=closing)``: the pending sums' finiteness read in
  place, then one conditional). Its close branch divides the window's sums,
  runs the inner update and writes the updates over the buffers (carry), so
  XLA fuses the division into the inner update's loops; its other branch
  (mid-window, or an invalid window) passes the buffers and the inner state
  through untouched: no write, no copy. The counters' selects are scalars.
  """
  buffers, scaler = accum.grads, state.loss_scaler

  def apply(g, operands):
    upd, new_inner = plan.update(g, *operands)
    if plan.carry:
      upd = tree_utils.cast_like(upd, buffers)
    if not cfg.skip_nonfinite_updates:
      return upd, new_inner, jnp.bool_(True)
    # The updates' finiteness, decided on every shard alike.
    (mark,) = window.global_marks((numerics.tree_mark(upd),))
    return upd, new_inner, ~jnp.isnan(mark)

  def skip(sums, operands):
    if plan.carry:
      return sums, operands[0], jnp.bool_(False)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), plan.shapes)
    return zeros, operands[0], jnp.bool_(False)

  if scaler is not None:  # the next window's scale, from this window's result
    next_ls = lambda out: _adjusted(scaler, out).scale
  (carrier, new_inner, applied), _, new, out = window.close(
    accum,
    (state.inner_opt_state, params),
    apply,
    skip,
    next_loss_scale=next_ls,
    mean=cfg.use_grad_mean,
    when=closing,
    dtypes=plan.dtypes,
  )
  pick = lambda a, b: jnp.where(closing, a, b)
  if scaler is not None:
    scaler = jax.tree.map(pick, _adjusted(scaler, out), scaler)
  nonempty = closing & (out.weight > 0)
  new_counters, old = base.of(new), base.of(accum)
  return _Closed(
    carrier=carrier,
    inner_state=new_inner,
    counters=accum.replace(
      grads=None, **{k: pick(v, old[k]) for k, v in new_counters.items()}
    ),
    applied=applied,
    nonfinite=nonempty & ~applied,
    empty=closing & ~(out.weight > 0),
    scaler=scaler,
  )


def _outputs(closed: _Closed, plan: _Plan, buffers: Any) -> tuple[Any, Any]:
  """The returned updates and the next window's buffers (the closed window's
  are left as they are: ``mini_step`` 0 makes the next accumulate overwrite
  them, with no loop of their own)."""
  updates = jax.tree.map(
    lambda c, s: jnp.where(closed.applied, c, jnp.zeros((), c.dtype)).astype(
      s.dtype
    ),
    closed.carrier,
    plan.shapes,
  )
  return updates, closed.carrier if plan.carry else buffers


# ---------------------------------------------------------------- update --


def _count(flag: jax.Array) -> jax.Array:
  return jnp.where(flag, jnp.int32(1), jnp.int32(0))


def _next_state(state, closed, buffers, closing, mini_step, accum, skip_state):
  newly_rejected = accum.rejected - state.window.rejected
  return WeightedMultiStepsState(
    mini_step=jnp.where(closing, 0, mini_step).astype(jnp.int32),
    gradient_step=state.gradient_step + _count(closed.applied),
    inner_opt_state=closed.inner_state,
    acc_grads=buffers,
    skip_state=skip_state,
    window=closed.counters,
    updated=closed.applied,
    nonfinite=closed.nonfinite,
    nonfinite_windows=state.nonfinite_windows + _count(closed.nonfinite),
    empty_windows=state.empty_windows + _count(closed.empty),
    skipped=state.skipped,
    rejected=state.rejected + newly_rejected.astype(jnp.int32),
    loss_scaler=closed.scaler,
  )


def _closes(cfg: Config, finish, mini_step, gradient_step) -> jax.Array:
  """Whether this microbatch closes the window: ``finish`` or ``every_k``."""
  if cfg.every_k is None:
    return finish
  k = cfg.every_k(gradient_step) if callable(cfg.every_k) else cfg.every_k
  return finish | (mini_step >= k)


def _check_call(cfg: Config, state: Any, weight: Any, next_ls: Any) -> Any:
  """The call's own arguments (the grads and weight are checked where they
  are added); returns the validated next loss scale."""
  if isinstance(state, optax.MultiStepsState):
    raise WeightedAccumulationError(
      "WeightedMultiSteps.update(state): got an optax.MultiStepsState; "
      "initialise the state with this transformation's own init "
      "(tx.init(params)), not optax.MultiSteps'."
    )
  validation.instance(
    state,
    WeightedMultiStepsState,
    what="WeightedMultiSteps.update(state)",
    hint="Pass the state from tx.init(params) or the previous update.",
  )
  if weight is None:
    raise WeightedAccumulationError(
      "WeightedMultiSteps.update: weight= is required (the microbatch's "
      "item count: tokens, samples). With flax's TrainState, whose "
      "apply_gradients does not forward it to tx.update, use "
      "weighted_accum.TrainState; inside optax.chain, put "
      "WeightedMultiSteps(...).gradient_transformation() in the chain (the "
      "chain forwards weight= only to that form) and pass "
      "update(..., weight=n)."
    )
  if next_ls is None:
    return None
  if state.loss_scaler is not None:
    raise WeightedAccumulationError(
      "WeightedMultiSteps.update(next_loss_scale=...): this transformation's "
      "loss scale is a DynamicLossScale, which sets each window's scale "
      "itself. Drop next_loss_scale, or construct it with a fixed "
      "loss_scale."
    )
  return validation.loss_scale(
    next_ls,
    what="WeightedMultiSteps.update(next_loss_scale=...)",
    dtype=state.window.loss_scale.dtype,
  )


def _check_shared(cfg: Config, **values: Any) -> None:
  """With ``axis_name``, the window's decisions are shared: a ``finish``
  or ``next_loss_scale`` that varies over the data axes would close (or
  rescale) the window on some replicas only, and their states diverge."""
  axes = set(cfg.axis_name or ())
  for name, v in values.items():
    if v is not None and axes & tree_utils.varying_axes(v):
      raise WeightedAccumulationError(
        f"WeightedMultiSteps.update({name}=...): it varies over "
        f"{sorted(axes & tree_utils.varying_axes(v))}; with axis_name every "
        "replica must take the same value, or the replicas' states diverge. "
        "Pass it into shard_map with P() (the same on every replica), or "
        "agree on it first (e.g. jax.lax.psum of the flag > 0)."
      )


def update(
  cfg: Config,
  grads: Any,
  state: WeightedMultiStepsState,
  params: Any = None,
  *,
  weight: Any = None,
  finish: Any = None,
  next_loss_scale: Any = None,
  **extra_args: Any,
) -> tuple[Any, WeightedMultiStepsState]:
  """One microbatch: accumulate, then close the window or keep it open."""
  next_ls = _check_call(cfg, state, weight, next_loss_scale)
  finish = validation.traced_flag(
    finish, what="WeightedMultiSteps.update(finish=...)"
  )
  _check_shared(cfg, finish=finish, next_loss_scale=next_ls)
  accum, skip, skip_state = _accumulate(cfg, state, grads, weight, params)
  mini_step = state.mini_step + (1 if skip is None else 1 - _count(skip))
  closing = _closes(cfg, finish, mini_step, state.gradient_step)
  plan = _plan(cfg, state, grads, params, extra_args)
  # Mid-window the inner update is not computed: the one conditional's
  # skipping branch passes the buffers and the inner state through.
  closed = _close(cfg, plan, next_ls, closing, accum, state, params)
  updates, buffers = _outputs(closed, plan, accum.grads)
  new = _next_state(
    state, closed, buffers, closing, mini_step, accum, skip_state
  )
  if skip is not None:
    new = new._replace(skipped=state.skipped + _count(skip))
  return updates, new
