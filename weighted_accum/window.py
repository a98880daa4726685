"""Closing a window in the train step: ``apply_window``.

``apply_window`` finishes the window, runs the optimizer once and applies its
updates, in one conditional that an invalid window (non-finite or empty)
skips entirely; its close kernel (``close``) is built to serve the optax
wrapper's close too. The
layout, and why, is in ``docs/design.md`` ("Closing a window in the train
step").
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import optax

from weighted_accum import _finish
from weighted_accum import _tree
from weighted_accum import errors
from weighted_accum.loss_scale import DynamicLossScale
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients

__all__ = ["apply_window", "close"]


def _fill_like(x: jax.Array, value: jax.Array) -> jax.Array:
  """``value`` broadcast like ``x``, on ``x``'s sharding, without reading
  ``x`` (the select folds to a broadcast after sharding propagation)."""
  return jnp.where(jnp.zeros_like(x, dtype=bool), x, value.astype(x.dtype))


def close(
  state: AccumState,
  operands: Any,
  apply: Callable[[Any, Any], Any],
  skip: Callable[[Any, Any], Any],
  *,
  next_loss_scale: Any = None,
  mean: bool = True,
) -> tuple[Any, jax.Array, AccumState, AccumulatedGradients]:
  """The close kernel of :func:`apply_window` and of the optax wrapper's
  close, generic in what it applies.

  The window's sums, weight and finiteness come from the one finish path
  (read in place, before anything else); then one ``lax.cond`` on the
  window's validity runs either ``apply(mean, operands)`` (the optimizer's
  work, handed the window's mean gradient in at least float32, divided
  inside the branch so that XLA fuses the division into the optimizer's
  loops; with ``mean=False`` the window's sum, divided by the loss scale
  only) or ``skip(sums, operands)`` (an invalid window: nothing advances).

  Args:
    state: the window to close.
    operands: what ``apply`` and ``skip`` transform (e.g. params and the
      optimizer state); passed through the conditional.
    apply: ``(mean_grads, operands) -> result`` for a valid window.
    skip: ``(sums, operands) -> result`` (same structure) for an invalid
      one; ``sums`` are the pending buffers.
    next_loss_scale: the next window's loss scale (``None``: unchanged; a
      traced invalid one marks the next window unusable, as in
      ``finish_mean``).
    mean: hand ``apply`` the weighted mean (``True``) or the weighted sum.

  Returns:
    ``(result, zero, new_state, out)``. ``zero`` is a float32 0 computed by
    the conditional: filling the next window's buffers from it orders that
    write after every read of the old buffers, so XLA reuses them in place
    (fresh zeros, with no such dependence, make it copy the donated buffers
    first). ``new_state`` is the next window (a window of zero total weight
    keeps its counters; its buffers are zero); ``out`` describes the closed
    window, with ``grads=None``.
  """
  out, new_state = _finish.finish(
    state, mean=False, keep_empty=True, next_loss_scale=next_loss_scale
  )

  def valid_branch(sums, operands):
    divisor = out.weight if mean else jnp.ones((), jnp.float32)
    # A valid window has a usable loss scale and a positive finite weight.
    grads = _finish.divide(
      sums, out.loss_scale, divisor, wide=True, usable=True
    )
    return apply(grads, operands), jnp.zeros((), jnp.float32)

  def invalid_branch(sums, operands):
    # 0 as well (the weight is finite and non-negative), but not a constant
    # that XLA could forward out of the conditional.
    return skip(sums, operands), jnp.minimum(out.weight, 0)

  result, zero = lax.cond(
    out.valid, valid_branch, invalid_branch, out.grads, operands
  )
  return result, zero, new_state, out.replace(grads=None)


@functools.partial(jax.jit, static_argnums=0)
def _apply_window_kernel(
  tx: optax.GradientTransformation,
  state: AccumState,
  params: Any,
  opt_state: Any,
  next_loss_scale: jax.Array | None,
):
  like = jax.tree.leaves(params)

  def apply(grads, operands):
    params, opt_state = operands
    leaves, treedef = jax.tree.flatten(grads)
    grads = jax.tree.unflatten(
      treedef, [m.astype(jnp.result_type(p)) for m, p in zip(leaves, like)]
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  (params, opt_state), zero, state, out = close(
    state,
    (params, opt_state),
    apply,
    lambda sums, operands: operands,
    next_loss_scale=next_loss_scale,
  )
  state = state.replace(
    grads=jax.tree.map(lambda b: _fill_like(b, zero), state.grads)
  )
  return params, opt_state, state, out


def apply_window(
  tx: optax.GradientTransformation,
  state: AccumState,
  params: Any,
  opt_state: Any,
  *,
  next_loss_scale: Any = None,
) -> tuple[Any, Any, AccumState, AccumulatedGradients]:
  """Finishes the window and applies its mean gradient with ``tx``, once.

  Equivalent to ``finish_mean``, ``tx.update``, ``optax.apply_updates`` and
  keeping the old params and optimizer state when ``out.valid`` is false,
  but laid out for a donated train step: the pending sums are read once for
  their finiteness, and the division, the optimizer, the update of the
  params and the buffers' reset run in one ``lax.cond`` that an invalid
  window skips. Under ``jax.jit(..., donate_argnums=...)`` params,
  optimizer state and buffers are updated in place, with no parameter-sized
  temporary.

  An invalid window leaves ``params`` and ``opt_state`` exactly as they were
  and does not advance ``tx`` (its step count, its moments): a window with
  NaN/Inf pending sums (e.g. a float16 loss-scale overflow) is discarded,
  so the next window starts clean; a window of zero total weight (every
  microbatch fully masked) stays open with its counters (it has nothing to
  apply and nothing to lose). Neither raises, eagerly or under ``jit``.

  Args:
    tx: the optimizer (any ``optax.GradientTransformation``); it gets the
      window's mean gradient in the params' dtypes.
    state: the window to close.
    params: the params the window's gradients belong to (same leaf paths and
      shapes as the buffers).
    opt_state: ``tx``'s state.
    next_loss_scale: the next window's loss scale (default: unchanged), a
      scalar or a :class:`~weighted_accum.DynamicLossScale` (its ``scale``,
      as :func:`~weighted_accum.set_loss_scale` takes it). To adjust a
      scaler by this window's finiteness, do it after the call and set the
      new window's scale: ``scaler = scaler.adjust(out.finite)``, then
      ``state = wa.set_loss_scale(state, scaler)`` (the new window is empty,
      so its scale may change).

  Returns:
    ``(params, opt_state, state, out)``: the updated params and optimizer
    state (unchanged when ``out.valid`` is false), the next window and an
    :class:`~weighted_accum.AccumulatedGradients` whose ``grads`` is
    ``None`` (the mean went to ``tx``; call :func:`finish_mean` when you need
    it) and whose ``weight``, ``loss_scale``, ``issued``, ``finite`` and
    ``valid`` describe the window just closed.

  Raises:
    WeightedAccumulationError: when ``tx`` is not an optax transformation,
      when ``params`` does not match the buffers
      (naming the leaf path), or for a concrete invalid ``next_loss_scale``.

  Example:
    >>> import functools, jax, jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> tx = optax.sgd(1.0)
    >>> opt_state = tx.init(params)
    >>> state = wa.accumulate_mean(wa.init(params), {'w': jnp.ones(2)}, 3)
    >>> state = wa.accumulate_mean(state, {'w': jnp.array([5.0, 1.0])}, 1)
    >>> @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    ... def apply_step(params, opt_state, state):  # same order in and out
    ...   return wa.apply_window(tx, state, params, opt_state)
    >>> params, opt_state, state, out = apply_step(params, opt_state, state)
    >>> params['w'].tolist(), bool(out.valid), int(state.issued)
    ([-1.0, -2.0], True, 0)
  """
  if not (
    callable(getattr(tx, "init", None))
    and callable(getattr(tx, "update", None))
  ):
    raise errors.WeightedAccumulationError(
      f"apply_window(tx): {type(tx).__name__} is not an optax "
      "GradientTransformation (an object with init and update). Pass the "
      "optimizer itself, e.g. optax.adamw(1e-3)."
    )
  _tree.match_tree(
    state.grads,
    params,
    what="apply_window(params)",
    ref_name="the accumulator's buffers",
  )
  if isinstance(next_loss_scale, DynamicLossScale):
    next_loss_scale = next_loss_scale.scale
  if next_loss_scale is not None:
    errors.check_loss_scale(
      next_loss_scale, what="apply_window(next_loss_scale=...)"
    )
  return _apply_window_kernel(tx, state, params, opt_state, next_loss_scale)
