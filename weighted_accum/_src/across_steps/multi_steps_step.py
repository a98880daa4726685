"""The optax wrapper's step: configuration, ``init`` and ``update``.

One microbatch: validate, accumulate (or skip), plan the inner update's
shapes, then ``window.close`` (one conditional) or keep the window open. The
layout and why: ``docs/design.md`` ("The optax wrapper's step layout").
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
from weighted_accum._src.across_steps import wrapper_state
from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState,
)
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
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
  placement: base.Placement  # of the windows init makes
  skip_nonfinite_updates: bool


def configure(**kw: Any) -> Config:
  """Validates the constructor's arguments (optax's names), naming each."""
  arg = lambda name: f"WeightedMultiSteps({name}=...)"
  flag = lambda name: validation.static_flag(kw[name], what=arg(name))
  validation.transformation(kw["opt"], what="WeightedMultiSteps(opt)")
  dt = kw["accumulator_dtype"]
  if dt is not None:
    dt = validation.work_dtype(dt, what=arg("accumulator_dtype"))
  ls = kw["loss_scale"]
  if not isinstance(ls, DynamicLossScale):
    ls = validation.loss_scale(
      ls, what=arg("loss_scale"), dtype=numerics.tally_dtype(dt)
    )
  every_k = validation.every_k(
    kw["every_k_schedule"], what=arg("every_k_schedule")
  )
  use_grad_mean = flag("use_grad_mean")
  should_skip = validation.callable_or_none(
    kw["should_skip_update_fn"],
    what=arg("should_skip_update_fn"),
    hint="Pass (updates, gradient_step, params) -> (should_skip, skip_state),"
    " e.g. optax.skip_not_finite, or None.",
  )
  mode = validation.mode(kw["mode"], what=arg("mode"))
  axes = validation.optional_axis_names(kw["axis_name"], what=arg("axis_name"))
  return Config(
    optax.with_extra_args_support(kw["opt"]),
    every_k,
    use_grad_mean,
    should_skip,
    dt,
    mode,
    ls,
    base.GLOBAL_WINDOW  # with axis_name every microbatch is reduced as it comes
    if axes is None
    else base.Placement(base.REPLICA, tuple(axes), "microbatch"),
    flag("skip_nonfinite_updates"),
  )


def init(cfg: Config, params: Any) -> WeightedMultiStepsState:
  """An empty window and the inner optimizer's initial state."""
  scaler = (
    cfg.loss_scale if isinstance(cfg.loss_scale, DynamicLossScale) else None
  )
  if scaler is not None:  # fresh arrays (donation); traced fields kept
    scaler = jax.tree.map(
      lambda x: x if tree_utils.is_traced(x) else jnp.asarray(np.asarray(x)),
      scaler,
    )
  scale = cfg.loss_scale if scaler is None else jnp.array(scaler.scale)
  accum = accumulation.init(params, dtype=cfg.dtype, loss_scale=scale)
  accum = accum.replace(placement=cfg.placement)
  zero = lambda dtype=jnp.int32: jnp.zeros((), dtype)  # one array per field
  skip_state = ()
  if cfg.should_skip is not None:
    _, skip_state = cfg.should_skip(
      optax.tree.zeros_like(params), zero(), params
    )
  counts = ("mini_step", "gradient_step", "nonfinite_windows", "empty_windows")
  state = WeightedMultiStepsState(
    inner_opt_state=cfg.inner.init(params),
    acc_grads=accum.grads,
    skip_state=skip_state,
    window=accum.replace(grads=None),
    updated=zero(jnp.bool_),
    nonfinite=zero(jnp.bool_),
    loss_scaler=scaler,
    **{k: zero() for k in counts + ("skipped", "rejected")},
  )
  # Committed like the params, as a jitted step returns them (one compile).
  return tree_utils.commit_like(state, params)


def _skip_verdict(cfg: Config, grads: Any, state, params) -> tuple[Any, Any]:
  """``should_skip_update_fn``'s verdict on the microbatch's gradient."""
  if cfg.should_skip is None:
    return None, state.skip_state
  skip, skip_state = cfg.should_skip(grads, state.gradient_step, params)
  if (jnp.result_type(skip), np.shape(skip)) != (jnp.bool_, ()):
    raise WeightedAccumulationError(
      "WeightedMultiSteps(should_skip_update_fn=...): should_skip must be a "
      f"bool scalar, got {jnp.result_type(skip)} {np.shape(skip)}."
    )
  return jnp.asarray(skip), skip_state


def _global_grads(contrib: Any, weight: jax.Array, mean: bool) -> Any:
  """The microbatch's global gradient as ``should_skip`` sees it."""
  if not mean:
    return contrib
  inv = jnp.where(weight > 0, 1.0 / jnp.where(weight > 0, weight, 1.0), 0.0)
  return jax.tree.map(lambda c: (c * inv).astype(c.dtype), contrib)


def _accumulate(cfg: Config, state, grads: Any, weight: Any, params: Any):
  """Adds one microbatch (reduced first on a per-replica window); returns
  ``(accum, skip, skip_state)``."""
  accum = state.accum
  mean = cfg.mode == "mean"
  name = "WeightedMultiSteps.update"
  w = accumulation.convert_weight(accum, weight, name)
  reduced = accum.placement.kind == base.REPLICA
  if not reduced:
    skip, skip_state = _skip_verdict(cfg, grads, state, params)
  else:
    axes = validation.bound_axes(accum.placement.axes, what=f"{name}(state)")
    grads, w = distributed.reduce_microbatch(  # w: the global Weight
      accum, grads, w, axes, mean=mean, what=name
    )
    skip, skip_state = _skip_verdict(
      cfg, _global_grads(grads, w.hi + w.lo, mean), state, params
    )
    mean = False  # the global contribution is a sum already
  if skip is not None:
    w = validation.Weight(
      jnp.where(skip, 0, w.hi), jnp.where(skip, 0, w.lo), w.ok | skip
    )
  if reduced:  # counted over the replicas, as distributed.accumulate does
    new = distributed.add_reduced(accum, grads, w, checked=False, name=name)
  else:
    new = accumulation.add(accum, grads, w, mean=mean, name=name)
  if skip is not None:
    old = base.of(accum)
    new = new.replace(
      **{k: jnp.where(skip, old[k], v) for k, v in base.of(new).items()}
    )
  return new, skip, skip_state


class _Plan(NamedTuple):
  """How the window's gradient reaches the inner optimizer (static)."""

  update: Callable[..., Any]
  shapes: Any
  carry: bool
  dtypes: list


def _plan(cfg: Config, state, grads, params, extra_args) -> _Plan:
  """The inner update as the close branch runs it, and its updates' shapes."""
  inner = functools.partial(cfg.inner.update, **extra_args)
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
    inner,
    tree_utils.cast_to(state.acc_grads, ms_dtypes),
    state.inner_opt_state,
    params,
  )[0]

  def update(g, inner_state, params):  # g: already in dtypes (window.close)
    upd, new_inner = inner(g, inner_state, params)
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


def _adjusted(scaler: DynamicLossScale, out) -> DynamicLossScale:
  """GradScaler's rule after ``out``; an empty window leaves it as it was."""
  new = scaler.adjust(out.finite)
  return jax.tree.map(lambda a, b: jnp.where(out.weight > 0, a, b), new, scaler)


def _count(flag: jax.Array) -> jax.Array:
  return flag.astype(jnp.int32)


def _close(cfg, plan, next_ls, closing, accum, state, params):
  """Closes the window where ``closing`` (one conditional: see the module);
  returns the updates and the next state (``mini_step``, skips: the caller's)."""
  buffers, scaler = accum.grads, state.loss_scaler

  def apply(g, operands):
    upd, new_inner = plan.update(g, *operands)
    if plan.carry:
      upd = tree_utils.cast_like(upd, buffers)
    if not cfg.skip_nonfinite_updates:
      return upd, new_inner, jnp.bool_(True)
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
  old, nonempty = base.of(accum), out.weight > 0
  nonfinite = closing & nonempty & ~applied
  updates = jax.tree.map(
    lambda c, s: jnp.where(applied, c, jnp.zeros((), c.dtype)).astype(s.dtype),
    carrier,
    plan.shapes,
  )
  return updates, state._replace(
    gradient_step=state.gradient_step + _count(applied),
    inner_opt_state=new_inner,
    acc_grads=carrier if plan.carry else buffers,  # stale ones: unread
    window=accum.replace(
      grads=None, **{k: pick(v, old[k]) for k, v in base.of(new).items()}
    ),
    updated=applied,
    nonfinite=nonfinite,
    nonfinite_windows=state.nonfinite_windows + _count(nonfinite),
    empty_windows=state.empty_windows + _count(closing & ~nonempty),
    rejected=state.rejected
    + (accum.rejected - state.window.rejected).astype(jnp.int32),
    loss_scaler=scaler,
  )


def _closes(cfg: Config, finish, mini_step, gradient_step) -> jax.Array:
  """Whether this microbatch closes the window: ``finish`` or ``every_k``."""
  if cfg.every_k is None:
    return finish
  k = cfg.every_k(gradient_step) if callable(cfg.every_k) else cfg.every_k
  return finish | (mini_step >= k)


def _check_call(cfg: Config, state: Any, weight: Any, next_ls: Any) -> Any:
  """Checks the call's state and weight; returns the next loss scale."""
  wrapper_state.checked(state, "WeightedMultiSteps.update")
  if weight is None:
    raise WeightedAccumulationError(
      "WeightedMultiSteps.update: weight= is required (the microbatch's item "
      "count). With flax use weighted_accum.TrainState; in optax.chain use "
      "WeightedMultiSteps(...).gradient_transformation(), update(weight=n)."
    )
  if next_ls is None:
    return None
  if state.loss_scaler is not None:
    raise WeightedAccumulationError(
      "WeightedMultiSteps.update(next_loss_scale=...): a DynamicLossScale "
      "sets each window's scale; drop it or use a fixed loss_scale."
    )
  return validation.loss_scale(
    next_ls,
    what="WeightedMultiSteps.update(next_loss_scale=...)",
    dtype=state.window.loss_scale.dtype,
  )


def _check_shared(state, **values: Any) -> None:
  """Refuses a ``finish``/``next_loss_scale`` varying over the window's axes."""
  axes = set(state.window.placement.axes)
  for name, v in values.items():
    if v is not None and axes & tree_utils.varying_axes(v):
      raise WeightedAccumulationError(
        f"WeightedMultiSteps.update({name}=...): it varies over "
        f"{sorted(axes & tree_utils.varying_axes(v))}; every replica must "
        "pass the same value (shard_map in_specs P(), or agree via psum)."
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
  _check_shared(state, finish=finish, next_loss_scale=next_ls)
  accum, skip, skip_state = _accumulate(cfg, state, grads, weight, params)
  mini_step = state.mini_step + (1 if skip is None else 1 - _count(skip))
  closing = _closes(cfg, finish, mini_step, state.gradient_step)
  plan = _plan(cfg, state, grads, params, extra_args)
  updates, new = _close(cfg, plan, next_ls, closing, accum, state, params)
  new = new._replace(
    mini_step=jnp.where(closing, 0, mini_step).astype(jnp.int32),
    skip_state=skip_state,
  )
  if skip is not None:
    new = new._replace(skipped=state.skipped + _count(skip))
  return updates, new
