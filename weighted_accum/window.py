"""Closing a window in the train step: ``apply_window``.

``apply_window`` finishes the window, runs the optimizer once and applies its
updates, in one conditional that an invalid window (non-finite or empty)
skips entirely. The layout, and why it is near the memory-bandwidth floor,
is in ``docs/performance.md``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp
import optax

from weighted_accum import core
from weighted_accum import errors
from weighted_accum import tally
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients

__all__ = ["apply_window", "close"]


def _mean_like(buffers: Any, loss_scale: jax.Array, weight: jax.Array,
               like: list[Any]) -> Any:
  """The window's mean gradient, in each ``like`` leaf's dtype.

  Divided in at least float32 (by the loss scale, then by the weight) and
  never rounded to a narrower work dtype on the way: the mean of float16
  sums can exceed float16's range when ``weight * loss_scale < 1``.
  """
  leaves, treedef = jax.tree.flatten(buffers)
  wide = [b.astype(core.compute_dtype(b.dtype)) for b in leaves]
  mean, _ = core.normalise(wide, loss_scale, weight)
  return jax.tree.unflatten(treedef, [
      m.astype(jnp.result_type(p)) for m, p in zip(mean, like)])


def _fill_like(x: jax.Array, value: jax.Array) -> jax.Array:
  """``value`` broadcast like ``x``, on ``x``'s sharding, without reading
  ``x`` (the select folds to a broadcast after sharding propagation)."""
  return jnp.where(jnp.zeros_like(x, dtype=bool), x, value.astype(x.dtype))


def close(state: AccumState, operands: Any,
          apply: Callable[[Any, Any], Any], skip: Callable[[Any], Any], *,
          like: list[Any], next_loss_scale: Any = None
          ) -> tuple[Any, AccumState, AccumulatedGradients]:
  """The close kernel shared by :func:`apply_window` and the optax wrapper.

  Reads the pending sums once for their finiteness, then, in one
  ``lax.cond`` on the window's validity, either ``apply(mean, operands)``
  (the optimizer's work, handed the window's mean gradient, computed inside
  the branch so that XLA fuses the division into the optimizer's loops) or
  ``skip(operands)`` (an invalid window: nothing advances). The buffers are
  reset after the conditional by a select on a flag the conditional
  returns: that data dependence orders the reset after every read of the
  buffers, so XLA writes the zeros in place instead of copying the donated
  buffers first (fresh zeros, with no such dependence, cost a
  parameter-sized copy).

  Args:
    state: the window to close.
    operands: what ``apply`` and ``skip`` transform (e.g. params and the
      optimizer state); passed through the conditional.
    apply: ``(mean_grads, operands) -> result`` for a valid window.
    skip: ``operands -> result`` (same structure) for an invalid one.
    like: one leaf per buffer whose dtype the mean gradient is given in.
    next_loss_scale: the next window's loss scale (``None``: unchanged; an
      invalid traced value keeps the current one).

  Returns:
    ``(result, new_state, out)``. ``out.grads`` is ``None``: the mean went to
    ``apply``. A window of zero total weight keeps its counters (its buffers
    are zero, see :mod:`weighted_accum.state`); any other window is reset.
  """
  weight = tally.join_traced(state.weight_hi, state.weight_lo)
  finite = core.all_finite(state.grads)
  nonempty = weight > 0
  valid = finite & nonempty

  def valid_branch(buffers, operands):
    mean = _mean_like(buffers, state.loss_scale, weight, like)
    return apply(mean, operands), jnp.zeros((), jnp.float32)

  def invalid_branch(buffers, operands):
    del buffers
    # 0 as well (the weight is finite and non-negative), but not a constant
    # XLA could forward out of the conditional.
    return skip(operands), jnp.minimum(weight, 0)

  result, zero = lax.cond(valid, valid_branch, invalid_branch, state.grads,
                          operands)
  buffers = jax.tree.map(lambda b: _fill_like(b, zero), state.grads)
  reset = core._reset(state, core._next_scale(state, next_loss_scale))  # pylint: disable=protected-access
  new_state = core.keep_unless(nonempty, reset.replace(grads=buffers), state)
  out = AccumulatedGradients(grads=None, weight=weight,
                             loss_scale=state.loss_scale, issued=state.issued,
                             finite=finite, valid=valid)
  return result, new_state, out


@functools.partial(jax.jit, static_argnums=0)
def _apply_window_kernel(tx: optax.GradientTransformation, state: AccumState,
                         params: Any, opt_state: Any,
                         next_loss_scale: jax.Array | None):
  like = jax.tree.leaves(params)

  def apply(mean, operands):
    params, opt_state = operands
    updates, opt_state = tx.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  (params, opt_state), state, out = close(
      state, (params, opt_state), apply, lambda operands: operands,
      like=like, next_loss_scale=next_loss_scale)
  return params, opt_state, state, out


def apply_window(tx: optax.GradientTransformation, state: AccumState,
                 params: Any, opt_state: Any, *, next_loss_scale: Any = None
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
    next_loss_scale: the next window's loss scale (default: unchanged).

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
  if not (callable(getattr(tx, "init", None)) and
          callable(getattr(tx, "update", None))):
    raise errors.WeightedAccumulationError(
        f"apply_window(tx): {type(tx).__name__} is not an optax "
        "GradientTransformation (an object with init and update). Pass the "
        "optimizer itself, e.g. optax.adamw(1e-3).")
  errors.match_tree(state.grads, params, what="apply_window(params)",
                    ref_name="the accumulator's buffers")
  if next_loss_scale is not None:
    errors.check_loss_scale(next_loss_scale,
                            what="apply_window(next_loss_scale=...)")
  return _apply_window_kernel(tx, state, params, opt_state, next_loss_scale)
