"""The public closers: ``finish_sums``, ``finish_mean`` and ``apply_window``.

Each validates its inputs here, then closes the window on the one close path
(:mod:`weighted_accum._src.core.window`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
from jax.typing import ArrayLike
import optax

from weighted_accum._src import validation
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel import spmd_layout

_STATE_HINT = "Pass the window (an AccumState from wa.init or a finish)."


def _window(state: Any, what: str, stacked_ok: bool = False) -> AccumState:
  state = validation.instance(
    state, AccumState, what=f"{what}(state)", hint=_STATE_HINT
  )
  return state if stacked_ok else one_window(state, what)


def one_window(state: AccumState, what: str) -> AccumState:
  """``state``, refused if it is a stacked per-replica window (its close
  needs the reduction over the replicas)."""
  if replicas.is_stacked(state):
    raise WeightedAccumulationError(
      f"{what}(state): this window is per replica, stacked over "
      f"{jnp.shape(state.weight_hi)[0]} replicas (distributed.init outside "
      "shard_map). Close it with apply_window(..., axis_name=...) or "
      "weighted_accum.distributed.finish_mean(state, axis_name): one "
      "reduction of the replicas' sums."
    )
  return state


def _next_scale(state: AccumState, value: Any, what: str) -> Any:
  return validation.optional_loss_scale(
    value, what=f"{what}(next_loss_scale=...)", dtype=state.loss_scale.dtype
  )


@functools.partial(jax.jit, static_argnames=("mean",))
def _finish_kernel(
  state: AccumState, next_loss_scale: jax.Array | None, mean: bool
) -> tuple[AccumulatedGradients, AccumState]:
  out, new_state, _ = window.finish(
    state, mean=mean, next_loss_scale=next_loss_scale
  )
  return out, new_state


def finish_sums(
  state: AccumState, *, next_loss_scale: ArrayLike | None = None
) -> tuple[AccumulatedGradients, AccumState]:
  """Returns the window's still-scaled sums and local weight, then resets.

  For data parallelism: reduce ``out.grads`` and ``out.weight`` across
  replicas (or use :mod:`weighted_accum.distributed`), then divide by
  ``out.loss_scale`` once and by the global weight. No communication of the
  sums happens here. An empty window gives zero sums and weight 0.

  Args:
    state: the window to finish.
    next_loss_scale: the next window's loss scale (default: unchanged), a
      scalar or a :class:`~weighted_accum.DynamicLossScale`.

  Returns:
    ``(out, new_state)``: the sums in ``out.grads`` (the buffers themselves,
    no copy), ``out.weight``, ``out.loss_scale``, ``out.finite``;
    ``new_state`` is an empty window on fresh zero buffers.

  Raises:
    WeightedAccumulationError: for a concrete invalid ``next_loss_scale``.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.accumulate_sum(wa.init({'w': jnp.zeros(1)}, loss_scale=4.0),
    ...                           {'w': jnp.array([8.0])}, 2)
    >>> out, state = wa.finish_sums(state)
    >>> (out.grads['w'] / out.loss_scale / out.weight).item(), int(state.issued)
    (1.0, 0)
  """
  state = _window(state, "finish_sums")
  ls = _next_scale(state, next_loss_scale, "finish_sums")
  return _finish_kernel(state, ls, mean=False)


def refuse_empty(state: AccumState, what: str = "finish_mean") -> None:
  """Eagerly refuses a concrete window of zero total weight (there is no
  mean to take; nothing is cleared)."""
  total = state.total_weight
  if not total > 0:
    raise WeightedAccumulationError(
      f"{what}: the window's total weight is {total!r} after "
      f"{int(state.issued)} microbatch(es) ({int(state.zero_weight)} of "
      f"weight 0, {int(state.rejected)} rejected), so there is no mean to "
      "take. Nothing was cleared: accumulate more microbatches, or use "
      "finish_sums to hand zero sums to a cross-replica reduction."
    )


def finish_mean(
  state: AccumState,
  *,
  next_loss_scale: ArrayLike | None = None,
  checked: bool = False,
) -> tuple[AccumulatedGradients, AccumState]:
  """Divides the window's sums by the loss scale, then by its total weight.

  The result equals the gradient of the full batch's mean loss whatever the
  split into microbatches. Then the window resets.

  Args:
    state: the window to finish.
    next_loss_scale: the next window's loss scale (default: unchanged), a
      scalar or a :class:`~weighted_accum.DynamicLossScale`. A traced invalid
      one marks the next window unusable (``docs/inputs.md``).
    checked: under ``jax.jit``, also emit a ``checkify`` check that the
      window's total weight is positive.

  Returns:
    ``(out, new_state)``. ``out.grads`` in the work dtype (NaN where a
    pending value was NaN/Inf); ``out.finite`` is false if any pending value
    was NaN/Inf (skip the step, a loss scaler backs off); ``out.valid`` is
    ``finite``, a positive weight and a mean that fits the work dtype (with
    float16 buffers it can overflow when ``weight * loss_scale < 1``, with
    ``finite`` true). Under ``jit``, a window of zero total weight returns
    zero grads, ``valid == False`` and the state unchanged (but for the loss
    scale, which becomes ``next_loss_scale`` when one is given).

  Raises:
    WeightedAccumulationError: when a concrete window has zero total weight
      (nothing is cleared), or for a concrete invalid ``next_loss_scale``.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(1)}, dtype=jnp.float16,
    ...                 loss_scale=2.0**15)
    >>> g = {'w': jnp.array([2.0**15 * 1e-3], jnp.float16)}  # scaled mean grad
    >>> state = wa.accumulate_mean(state, g, 1000)           # 2**15 * 1000 > f16 max
    >>> out, state = wa.finish_mean(state)
    >>> round(out.grads['w'].item(), 5), bool(out.valid)
    (0.001, True)
  """
  state = _window(state, "finish_mean")
  ls = _next_scale(state, next_loss_scale, "finish_mean")
  checked = validation.static_flag(checked, what="finish_mean(checked=...)")
  if not tree_utils.is_traced(state.weight_hi):
    refuse_empty(state)
  elif checked:
    weight = numerics.join(state.weight_hi, state.weight_lo)
    checkify.check(
      weight > 0,
      "finish_mean: the window's total weight is {w}, so there is no mean "
      "to take; the state was left unchanged and zero grads returned.",
      w=weight,
    )
  return _finish_kernel(state, ls, mean=True)


# ---------------------------------------------------------- apply_window --


def _mean_dtype(work: Any, param: Any) -> Any:
  """The dtype the optimizer gets the mean in: at least float32 and at least
  the param's (a float16 mean could overflow before the optimizer)."""
  return jnp.promote_types(numerics.compute_dtype(work), jnp.result_type(param))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _apply_window_kernel(
  tx: optax.GradientTransformation,
  state: AccumState,
  params: Any,
  opt_state: Any,
  next_loss_scale: jax.Array | None,
  axes: tuple[str, ...],
):
  like = jax.tree.leaves(params)

  def apply(grads, operands):
    params, opt_state = operands
    leaves, treedef = jax.tree.flatten(grads)
    grads = jax.tree.unflatten(
      treedef,
      [m.astype(_mean_dtype(state.dtype, p)) for m, p in zip(leaves, like)],
    )
    updates, new_opt_state = tx.update(grads, opt_state, params)
    # The optimizer's state keeps its dtypes (a wider mean must not widen
    # it: the donated state would no longer fit its buffers).
    new_opt_state = tree_utils.cast_like(new_opt_state, opt_state)
    return optax.apply_updates(params, updates), new_opt_state

  (params, opt_state), zero, state, out = window.close(
    state,
    (params, opt_state),
    apply,
    lambda sums, operands: operands,
    next_loss_scale=next_loss_scale,
    axes=axes,
  )
  return params, opt_state, window.refill(state, zero), out


def _check_replicas(state: AccumState, params: Any, axes: tuple) -> None:
  """Refuses a per-replica window closed as if it were global: buffers that
  vary over mesh axes their params do not vary over (and are not reduced
  over with ``axis_name``)."""
  for (path, b), p in zip(
    tree_utils.flat(state.grads), jax.tree.leaves(params)
  ):
    extra = tree_utils.varying_axes(b) - tree_utils.varying_axes(p) - set(axes)
    if extra:
      raise WeightedAccumulationError(
        f"apply_window(state): buffer {path} varies over mesh axes "
        f"{tuple(sorted(extra))} while its param does not: the window holds "
        "per-replica sums. Pass axis_name=... to reduce it once in the "
        "close, or finish it with weighted_accum.distributed.finish_mean."
      )


def apply_window(
  tx: optax.GradientTransformation,
  state: AccumState,
  params: Any,
  opt_state: Any,
  *,
  next_loss_scale: Any = None,
  axis_name: str | tuple[str, ...] | None = None,
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
  ``out.valid`` is exactly what :func:`finish_mean` would say: a mean
  beyond the work dtype is not applied either, although the optimizer
  would get it in a wider dtype (one decision for every close).

  Args:
    tx: the optimizer (any ``optax.GradientTransformation``); it gets the
      window's mean gradient in at least float32 and at least the params'
      dtype (never a narrower mean that could overflow), and its state keeps
      its dtypes.
    state: the window to close.
    params: the params the window's gradients belong to (same leaf paths and
      shapes as the buffers).
    opt_state: ``tx``'s state.
    next_loss_scale: the next window's loss scale (default: unchanged), a
      scalar or a :class:`~weighted_accum.DynamicLossScale` (its ``scale``).
      To adjust a scaler by this window's finiteness, do it after the call
      and set the new window's scale: ``scaler = scaler.adjust(out.finite)``,
      then ``state = wa.set_loss_scale(state, scaler)``.
    axis_name: inside ``jax.shard_map``, the data axis (or axes) over which
      ``state`` holds per-replica sums (``weighted_accum.distributed.init``
      and local gradients): the close sums them and the weights once, in one
      collective round, and every replica applies the same mean. ``None``
      for a global window (plain ``jit`` over sharded arrays, or a state
      that is the same on every replica).

  Returns:
    ``(params, opt_state, state, out)``: the updated params and optimizer
    state (unchanged when ``out.valid`` is false), the next window and an
    :class:`~weighted_accum.AccumulatedGradients` whose ``grads`` is
    ``None`` (the mean went to ``tx``; call :func:`finish_mean` when you need
    it) and whose ``weight``, ``loss_scale``, ``issued``, ``finite`` and
    ``valid`` describe the window just closed (identical on every shard).

  Raises:
    WeightedAccumulationError: when ``tx`` is not an optax transformation or
      ``state`` not an ``AccumState`` (e.g. arguments swapped), when
      ``params`` does not match the buffers (naming the leaf path), for a
      per-replica window without ``axis_name``, or for a concrete invalid
      ``next_loss_scale``.

  Example:
    >>> import functools, jax, jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> tx = optax.sgd(1.0)
    >>> opt_state = tx.init(params)
    >>> state = wa.accumulate_mean(wa.init(params), {'w': jnp.ones(2)}, 3)
    >>> state = wa.accumulate_mean(state, {'w': jnp.array([5.0, 1.0])}, 1)
    >>> @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    ... def apply_step(params, opt_state, state):
    ...   return wa.apply_window(tx, state, params, opt_state)
    >>> params, opt_state, state, out = apply_step(params, opt_state, state)
    >>> params['w'].tolist(), bool(out.valid), int(state.issued)
    ([-1.0, -2.0], True, 0)
  """
  validation.transformation(tx, what="apply_window(tx)")
  state = _window(state, "apply_window", stacked_ok=True)
  if replicas.is_stacked(state):
    return _apply_stacked(
      tx, state, params, opt_state, next_loss_scale, axis_name
    )
  tree_utils.match_tree(
    state.grads,
    params,
    what="apply_window(params)",
    ref_name="the accumulator's buffers",
  )
  axes = ()
  if axis_name is not None:
    axes = validation.bound_axes(axis_name, what="apply_window(axis_name=...)")
  _check_replicas(state, params, axes)
  ls = _next_scale(state, next_loss_scale, "apply_window")
  return _apply_window_kernel(tx, state, params, opt_state, ls, axes)


def _apply_stacked(tx, state, params, opt_state, next_loss_scale, axis_name):
  """``apply_window`` of a stacked per-replica window: of this replica's
  block inside ``shard_map``, or of the whole under plain ``jit`` (its one
  reduction, then the one close path on the global window)."""
  what = "apply_window"
  if axis_name is None:
    raise WeightedAccumulationError(
      f"{what}(state): this window is per replica, stacked over "
      f"{jnp.shape(state.weight_hi)[0]} replicas; pass axis_name=... (its "
      "data axes) to reduce it once in the close."
    )
  axes = validation.axis_names(axis_name, what=f"{what}(axis_name=...)")
  ls = _next_scale(state, next_loss_scale, what)
  if replicas.bound(axes):
    p, o, new, out = apply_window(
      tx,
      replicas.unstack(state, axes, what),
      params,
      opt_state,
      next_loss_scale=ls,
      axis_name=axes,
    )
    return p, o, replicas.stack(new, axes), out
  tree_utils.match_tree(
    jax.tree.map(
      lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype), state.grads
    ),
    params,
    what=f"{what}(params)",
    ref_name="the accumulator's buffers",
  )
  return _apply_stacked_kernel(tx, state, params, opt_state, ls, axes)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _apply_stacked_kernel(tx, state, params, opt_state, next_loss_scale, axes):
  what = "apply_window"
  mesh = replicas.mesh_of(state, axes, what)
  leaves = None
  if spmd_layout.explicit(mesh, axes, what=what):  # FSDP: from the types
    leaves = tuple(
      spmd_layout.leaf(
        jax.typeof(p).sharding.spec, axes, p.ndim, path, what=what
      )
      for path, p in tree_utils.flat(params)
    )
  glob = replicas.to_global(state, axes, mesh, leaves)
  params, opt_state, closed, out = _apply_window_kernel(
    tx, glob, params, opt_state, next_loss_scale, ()
  )
  return params, opt_state, replicas.next_window(state, closed), out
