"""The optax wrapper ``WeightedMultiSteps`` and its readers ``has_updated``
and ``window_counters``. One ``update``: the call checked, the microbatch
accumulated (or skipped), then ``window.close`` (one conditional) or the
window kept open; why so: ``docs/design.md`` ("The optax wrapper's step
layout"). The state goes down once and its successor is built in ``update``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
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
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.loss_scale import DynamicLossScale
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import distributed

_UPDATE = "WeightedMultiSteps.update"


def has_updated(state: WeightedMultiStepsState) -> jax.Array:
  """Whether the last ``update`` closed a window and applied the inner update.

  Also reads ``nnx.Optimizer(...).opt_state`` and its ``nnx.State``.

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A bool scalar array (traceable).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode='mean')
    >>> p = {'w': jnp.zeros(2)}
    >>> _, s1 = tx.update(p, tx.init(p), p, weight=3)
    >>> _, s2 = tx.update(p, s1, p, weight=1)
    >>> bool(wa.has_updated(s1)), bool(wa.has_updated(s2))
    (False, True)
  """
  state = wrapper_state.checked(wrapper_state.view(state), "has_updated")
  return jnp.asarray(state.updated)


def window_counters(state: WeightedMultiStepsState) -> dict[str, Any]:
  """The current window's counters; reading them changes nothing.

  Also reads ``nnx.Optimizer(...).opt_state`` and its ``nnx.State``.

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A dict with ``mini_step``, ``issued``, ``zero_weight``, ``rejected`` (the
    window's microbatch counts), ``total_weight`` (a Python float when
    concrete) and ``loss_scale`` (to multiply this window's losses by).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> tx = wa.WeightedMultiSteps(optax.sgd(0.1), 4, mode='mean')
    >>> params = {'w': jnp.zeros(2)}
    >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params,
    ...                      weight=7)
    >>> c = wa.window_counters(state)
    >>> int(c['mini_step']), int(c['issued']), c['total_weight']
    (1, 1, 7.0)
  """
  state = wrapper_state.checked(wrapper_state.view(state), "window_counters")
  names = ("issued", "zero_weight", "rejected", "total_weight", "loss_scale")
  return dict(mini_step=state.mini_step) | {
    k: getattr(state.window, k) for k in names
  }


class _Close(NamedTuple):
  """The close's two branches and the updates' shapes (static)."""

  apply: Callable[..., Any]  # (mean, (inner state, params)) -> applied
  skip: Callable[..., Any]  # (sums, (inner state, params)) -> not applied
  shapes: Any  # the updates' shapes and dtypes (optax.MultiSteps')
  carry: bool  # the updates fit the buffers and travel in them
  dtypes: list  # the mean's dtypes, leaf by leaf


def _count(flag: jax.Array) -> jax.Array:
  return flag.astype(jnp.int32)


def _global_grads(contrib: Any, weight: jax.Array, mean: bool) -> Any:
  """The microbatch's global gradient as ``should_skip`` sees it."""
  if not mean:
    return contrib
  inv = jnp.where(weight > 0, 1.0 / jnp.where(weight > 0, weight, 1.0), 0.0)
  return jax.tree.map(lambda c: (c * inv).astype(c.dtype), contrib)


def _adjusted(scaler: DynamicLossScale, out) -> DynamicLossScale:
  """GradScaler's rule after ``out``; an empty window leaves it as it was."""
  new = scaler.adjust(out.finite)
  return jax.tree.map(lambda a, b: jnp.where(out.weight > 0, a, b), new, scaler)


class WeightedMultiSteps:
  """Weighted gradient accumulation in front of an optax optimizer.

  A drop-in for ``optax.MultiSteps`` (the same constructor arguments, state
  fields and methods, plus a required ``mode``) whose ``update`` also takes
  each microbatch's weight (its effective item count: tokens, samples)::

      updates, state = tx.update(grads, state, params, weight=n_tokens)

  A window closes after ``every_k_schedule`` microbatches, or earlier with
  ``finish=True``; its gradient ``sum grad(S) / sum n`` (the sum with
  ``use_grad_mean=False``) goes through the inner optimizer once. Mid-window
  the updates are zeros and the inner update is not computed. With weight 1
  it computes what ``optax.MultiSteps`` computes. A close of zero total
  weight applies nothing and the window stays open; a close whose gradients
  hold NaN/Inf applies nothing, sets ``state.nonfinite`` and discards the
  window. ``state.gradient_step`` counts applied windows.

  Args:
    opt: the optimizer to apply once per window (any optax transform; extra
      keyword arguments of ``update`` are forwarded to it at a close).
    every_k_schedule: microbatches per window: an int, a function of
      ``state.gradient_step`` (traced), or ``None`` (close with ``finish``).
    use_grad_mean: hand the inner optimizer the window's weighted mean
      (``True``) or its weighted sum (``False``).
    should_skip_update_fn: optax's ``(updates, gradient_step, params) ->
      (should_skip, skip_state)``: a skipped microbatch adds nothing and is
      counted in ``state.skipped``; with ``axis_name`` it sees the global
      gradient.
    accumulator_dtype: the buffers' work dtype; ``None``: the params'.
    mode: required. ``"mean"`` when the grads are of each microbatch's loss
      MEAN, ``"sum"`` when of its loss SUM (no default is safe).
    loss_scale: the factor every loss of a window is multiplied by (float16),
      divided out at the close: a number (change it with ``update(...,
      next_loss_scale=...)``) or a :class:`~weighted_accum.DynamicLossScale`
      adjusted at each close by GradScaler's rule.
    axis_name: inside ``jax.shard_map``, the data axis name(s): ``weight`` is
      this replica's count and each microbatch is summed over the axes as it
      is added, so the state stays identical on every replica. ``None``
      under ``jax.jit`` over global arrays.
    skip_nonfinite_updates: also skip a window whose inner updates come out
      NaN/Inf (two more passes over the updates).

  Raises:
    WeightedAccumulationError: for an invalid argument, naming it.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> tx = wa.WeightedMultiSteps(optax.sgd(1.0), every_k_schedule=2,
    ...                            mode='mean')
    >>> state = tx.init(params)
    >>> for g, n in [({'w': jnp.array([1., 1.])}, 3),
    ...              ({'w': jnp.array([5., 1.])}, 1)]:
    ...   updates, state = tx.update(g, state, params, weight=n)
    ...   params = optax.apply_updates(params, updates)
    >>> params['w'].tolist(), bool(tx.has_updated(state))   # 1 - (3+5)/4
    ([-1.0, -2.0], True)
  """

  def __init__(
    self,
    opt: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], Any] | None,
    use_grad_mean: bool = True,
    should_skip_update_fn: Callable[..., Any] | None = None,
    accumulator_dtype: DTypeLike = jnp.float32,
    *,
    mode: str,
    loss_scale: ArrayLike = 1.0,
    axis_name: str | Sequence[str] | None = None,
    skip_nonfinite_updates: bool = False,
  ):
    arg = lambda name: f"WeightedMultiSteps({name}=...)"
    flag = lambda x, name: validation.static_flag(x, what=arg(name))
    validation.transformation(opt, what="WeightedMultiSteps(opt)")
    self._opt = optax.with_extra_args_support(opt)
    dt = accumulator_dtype  # None: the params' (resolved by init)
    if dt is not None:
      dt = validation.work_dtype(dt, what=arg("accumulator_dtype"))
    self._dtype, self._loss_scale = dt, loss_scale
    if not isinstance(loss_scale, DynamicLossScale):
      self._loss_scale = validation.loss_scale(
        loss_scale, what=arg("loss_scale"), dtype=numerics.tally_dtype(dt)
      )
    k = validation.every_k(every_k_schedule, what=arg("every_k_schedule"))
    self._every_k, self._use_grad_mean = k, flag(use_grad_mean, "use_grad_mean")
    self._should_skip = validation.callable_or_none(
      should_skip_update_fn,
      what=arg("should_skip_update_fn"),
      hint="Pass (updates, gradient_step, params) -> (should_skip, skip_state),"
      " e.g. optax.skip_not_finite, or None.",
    )
    self._mode = validation.mode(mode, what=arg("mode"))
    axes = validation.optional_axis_names(axis_name, what=arg("axis_name"))
    self._placement = base.GLOBAL_WINDOW
    if axes is not None:  # each microbatch reduced as it is added
      self._placement = base.Placement(base.REPLICA, tuple(axes), "microbatch")
    self._skip_nonfinite = flag(
      skip_nonfinite_updates, "skip_nonfinite_updates"
    )

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer (with extra-args support), as in optax."""
    return self._opt

  def init(self, params: Any) -> WeightedMultiStepsState:
    """An empty window and the inner optimizer's initial state.

    Args:
      params: the params (any pytree of floating arrays).

    Returns:
      A :class:`WeightedMultiStepsState`.
    """
    scaler = self._loss_scale
    if isinstance(scaler, DynamicLossScale):  # fresh arrays (donation)
      fresh = lambda x: (
        x if tree_utils.is_traced(x) else jnp.asarray(np.asarray(x))
      )
      scaler = jax.tree.map(fresh, scaler)
      scale = jnp.array(scaler.scale)
    else:
      scaler, scale = None, scaler
    accum = accumulation.init(params, dtype=self._dtype, loss_scale=scale)
    accum = accum.replace(placement=self._placement)
    zero = lambda dtype=jnp.int32: jnp.zeros((), dtype)  # one array per field
    skip_state = ()
    if self._should_skip is not None:
      zeros = optax.tree.zeros_like(params)
      _, skip_state = self._should_skip(zeros, zero(), params)
    counts = ("mini_step", "gradient_step", "nonfinite_windows")
    counts += ("empty_windows", "skipped", "rejected")
    state = WeightedMultiStepsState(
      inner_opt_state=self._opt.init(params),
      acc_grads=accum.grads,
      skip_state=skip_state,
      window=accum.replace(grads=None),
      updated=zero(jnp.bool_),
      nonfinite=zero(jnp.bool_),
      loss_scaler=scaler,
      **{k: zero() for k in counts},
    )
    # Committed like the params, as a jitted step returns them (one compile).
    return tree_utils.commit_like(state, params)

  def update(
    self,
    updates: Any,
    state: WeightedMultiStepsState,
    params: Any = None,
    *,
    weight: ArrayLike | None = None,
    finish: Any = None,
    next_loss_scale: Any = None,
    **extra_args: Any,
  ) -> tuple[Any, WeightedMultiStepsState]:
    """Accumulates one microbatch; applies the window when it closes.

    Args:
      updates: the microbatch's gradients (of its loss mean or sum, per
        ``mode``), a tree like the params.
      state: the state from ``init`` or the previous call.
      params: the params (needed by some inner optimizers).
      weight: required: the microbatch's item count (a scalar, may be traced).
      finish: a bool scalar (may be traced): close the window after this one.
      next_loss_scale: the loss scale of the window after a close.
      **extra_args: forwarded to the inner optimizer at a close.

    Returns:
      ``(updates, new_state)``: the inner updates at a close that applied a
      window, zeros otherwise (in ``optax.MultiSteps``' dtypes).

    Raises:
      WeightedAccumulationError: for a missing or invalid ``weight``, another
        state, grads unlike the params, or an invalid ``finish`` /
        ``next_loss_scale``.
    """
    finish, next_ls = self._checked(state, weight, finish, next_loss_scale)
    accum, skip, skip_state = self._add(state, updates, weight, params)
    mini_step = state.mini_step + (1 if skip is None else 1 - _count(skip))
    every = self._every_k
    every = every(state.gradient_step) if callable(every) else every
    closing = finish if every is None else finish | (mini_step >= every)
    close = self._plan(
      state.acc_grads, state.inner_opt_state, updates, params, extra_args
    )
    scaler = state.loss_scaler
    if scaler is not None:  # the next window's scale, from this window's result
      next_ls = lambda out: _adjusted(scaler, out).scale
    (carrier, inner_state, applied), _, new, out = window.close(
      accum,
      (state.inner_opt_state, params),
      close.apply,
      close.skip,
      next_loss_scale=next_ls,
      mean=self._use_grad_mean,
      when=closing,
      dtypes=close.dtypes,
    )
    pick = lambda a, b: jnp.where(closing, a, b)
    old, nonempty = base.of(accum), out.weight > 0
    nonfinite = closing & nonempty & ~applied
    new_state = WeightedMultiStepsState(
      mini_step=pick(0, mini_step).astype(jnp.int32),
      gradient_step=state.gradient_step + _count(applied),
      inner_opt_state=inner_state,
      acc_grads=carrier if close.carry else accum.grads,  # stale ones: unread
      skip_state=skip_state,
      window=accum.replace(
        grads=None, **{k: pick(v, old[k]) for k, v in base.of(new).items()}
      ),
      updated=applied,
      nonfinite=nonfinite,
      nonfinite_windows=state.nonfinite_windows + _count(nonfinite),
      empty_windows=state.empty_windows + _count(closing & ~nonempty),
      skipped=state.skipped if skip is None else state.skipped + _count(skip),
      rejected=state.rejected
      + (accum.rejected - state.window.rejected).astype(jnp.int32),
      loss_scaler=None
      if scaler is None
      else jax.tree.map(pick, _adjusted(scaler, out), scaler),
    )
    mask = lambda c, s: jnp.where(applied, c, 0).astype(s.dtype)  # c's dtype
    return jax.tree.map(mask, carrier, close.shapes), new_state

  def _checked(self, state, weight, finish, next_ls) -> tuple[Any, Any]:
    """The call refused unless its state, weight, ``finish`` and
    ``next_loss_scale`` fit; returns the last two as stored."""
    wrapper_state.checked(state, _UPDATE)
    if weight is None:
      raise WeightedAccumulationError(
        f"{_UPDATE}: weight= is required (with flax use weighted_accum.TrainState)."
      )
    if next_ls is not None and state.loss_scaler is not None:
      raise WeightedAccumulationError(
        f"{_UPDATE}(next_loss_scale=...): the DynamicLossScale sets it; drop it."
      )
    next_ls = validation.optional_loss_scale(
      next_ls,
      what=f"{_UPDATE}(next_loss_scale=...)",
      dtype=state.window.loss_scale.dtype,
    )
    finish = validation.traced_flag(finish, what=f"{_UPDATE}(finish=...)")
    for name, v in (("finish", finish), ("next_loss_scale", next_ls)):
      validation.shared(
        v, state.window.placement.axes, what=f"{_UPDATE}({name}=...)"
      )
    return finish, next_ls

  def _add(self, state, grads, weight, params) -> tuple[AccumState, Any, Any]:
    """The microbatch added (with ``axis_name``: summed over the replicas
    first); returns ``(window, skip or None, skip_state)``."""
    accum, mean = state.accum, self._mode == "mean"
    w = accumulation.convert_weight(accum, weight, _UPDATE)
    reduced = accum.placement.kind == base.REPLICA
    if reduced:  # w: the global Weight; the contribution a sum already
      axes = accum.placement.axes
      axes = validation.bound_axes(axes, what=f"{_UPDATE}(state)")
      grads, w = distributed.reduce_microbatch(
        accum, grads, w, axes, mean=mean, what=_UPDATE
      )
    skip, skip_state = None, state.skip_state
    if self._should_skip is not None:
      seen = _global_grads(grads, w.hi + w.lo, mean) if reduced else grads
      skip, skip_state = self._should_skip(seen, state.gradient_step, params)
      got = f"{jnp.result_type(skip)} {np.shape(skip)}"
      if got != "bool ()":  # a bool scalar
        raise WeightedAccumulationError(
          f"WeightedMultiSteps(should_skip_update_fn=...): should_skip is {got}, not bool ()."
        )
      skip = jnp.asarray(skip)
      w = validation.Weight(
        jnp.where(skip, 0, w.hi), jnp.where(skip, 0, w.lo), w.ok | skip
      )
    if reduced:  # counted over the replicas, as distributed.accumulate does
      new = distributed.add_reduced(
        accum, grads, w, checked=False, name=_UPDATE
      )
    else:
      new = accumulation.add(accum, grads, w, mean=mean, name=_UPDATE)
    if skip is not None:
      old = base.of(accum)
      new = new.replace(
        **{k: jnp.where(skip, old[k], v) for k, v in base.of(new).items()}
      )
    return new, skip, skip_state

  def _plan(self, buffers, inner_state, grads, params, extra_args) -> _Close:
    """The close's branches, the inner update's shapes planned abstractly
    (``jax.eval_shape``): the conditional traces the inner update once."""
    inner = functools.partial(self._opt.update, **extra_args)
    dtypes = grad_dtypes = [jnp.result_type(g) for g in jax.tree.leaves(grads)]
    if params is not None:
      p_leaves = tree_utils.match_tree(
        buffers, params, what=f"{_UPDATE}(params)"
      )
      dtypes = [
        jnp.promote_types(d, jnp.result_type(p))
        for d, p in zip(grad_dtypes, p_leaves)
      ]
    as_grads = tree_utils.cast_to(buffers, grad_dtypes)
    shapes = jax.eval_shape(inner, as_grads, inner_state, params)[0]
    buf_leaves, buf_def = jax.tree.flatten(buffers)
    upd_leaves, upd_def = jax.tree.flatten(shapes)
    carry = upd_def == buf_def and all(
      u.shape == b.shape
      and jnp.promote_types(u.dtype, b.dtype) == jnp.dtype(b.dtype)
      for u, b in zip(upd_leaves, buf_leaves)
    )

    def apply(g, operands):  # g: the window's mean (or sum) in dtypes
      upd, new_inner = inner(g, *operands)
      upd = tree_utils.cast_like(upd, shapes)
      new_inner = tree_utils.cast_like(new_inner, operands[0])
      if carry:
        upd = tree_utils.cast_like(upd, buffers)
      if not self._skip_nonfinite:
        return upd, new_inner, jnp.bool_(True)
      (mark,) = window.global_marks((numerics.tree_mark(upd),))
      return upd, new_inner, ~jnp.isnan(mark)

    def skip(sums, operands):  # the buffers carried as they are, or zeros
      zeros = lambda s: jnp.zeros(s.shape, s.dtype)
      kept = sums if carry else jax.tree.map(zeros, shapes)
      return kept, operands[0], jnp.bool_(False)

    return _Close(apply, skip, shapes, carry, dtypes)

  def has_updated(self, state: WeightedMultiStepsState) -> jax.Array:
    """Whether the last ``update`` applied a window (:func:`has_updated`)."""
    return has_updated(state)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This wrapper as an ``optax.GradientTransformationExtraArgs``."""
    return optax.GradientTransformationExtraArgs(self.init, self.update)
