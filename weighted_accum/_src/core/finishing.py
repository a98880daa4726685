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
import numpy as np
import optax

from weighted_accum._src import validation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError

_STATE_HINT = "Pass the window (an AccumState from wa.init or a finish)."


def _window(state: Any, what: str, stacked_ok: bool = False) -> AccumState:
  state = validation.instance(
    state, AccumState, what=f"{what}(state)", hint=_STATE_HINT
  )
  validation.one_device_set([("state.grads", state.grads)], what=what)
  return state if stacked_ok else one_window(state, what)


def one_window(state: AccumState, what: str) -> AccumState:
  """``state``, refused if it is a stacked per-replica window (its close
  needs the reduction over the replicas)."""
  if state.placement.kind == base.STACKED:
    raise WeightedAccumulationError(
      f"{what}(state): this window is stacked per replica over "
      f"{state.placement.axes} (wa.init(..., axis_name=...) outside "
      "shard_map), so its sums are per replica. Close it with "
      "wa.finish_mean(state) or wa.apply_window(...): one reduction of the "
      "replicas' sums."
    )
  return state


def _next_scale(state: AccumState, value: Any, what: str) -> Any:
  ls = validation.optional_loss_scale(
    value, what=f"{what}(next_loss_scale=...)", dtype=state.loss_scale.dtype
  )
  return shared_over_window(state, ls, f"{what}(next_loss_scale=...)")


def shared_over_window(state: AccumState, value: Any, what: str) -> Any:
  """``value``, refused if it varies over the data axes of a per-replica
  window (inside the ``shard_map`` of its axes)."""
  axes = state.placement.axes
  if state.placement.kind != base.GLOBAL and tree_utils.bound(axes):
    validation.shared(value, axes, what=what)
  return value


@functools.partial(jax.jit, static_argnames=("mean",))
def _finish_kernel(
  state: AccumState, next_loss_scale: jax.Array | None, mean: bool
) -> tuple[AccumulatedGradients, AccumState]:
  return window.finish(state, mean=mean, next_loss_scale=next_loss_scale)


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
  state = _window(state, "finish_sums", stacked_ok=True)
  ls = _next_scale(state, next_loss_scale, "finish_sums")
  if not base.plain(state):
    return base.PLACED["finish_sums"](state, ls)
  return _finish_kernel(state, ls, mean=False)


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
  state = _window(state, "finish_mean", stacked_ok=True)
  ls = _next_scale(state, next_loss_scale, "finish_mean")
  checked = validation.static_flag(checked, what="finish_mean(checked=...)")
  if not base.plain(state):  # as placed
    return base.PLACED["finish_mean"](state, ls, checked)
  if not tree_utils.is_traced(state.weight_hi):
    validation.nonempty_window(state, what="finish_mean")
  return finish_global(state, ls, checked)


def finish_global(state: AccumState, ls: Any, checked: bool):
  """``finish_mean`` of a window closed as a global one (no reduction)."""
  if checked and tree_utils.is_traced(state.weight_hi):
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
  """The mean's dtype: at least float32 and the param's."""
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
  def apply(grads, operands):
    params, opt_state = operands
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
    dtypes=[_mean_dtype(state.dtype, p) for p in jax.tree.leaves(params)],
  )
  return params, opt_state, window.refill(state, zero), out


def _check_result(out, params, next_loss_scale) -> None:
  """An in-step result checked as ``apply_window``'s window."""
  what = "apply_window(state)"
  for name, value in (("next_loss_scale", next_loss_scale),):
    if value is not None:
      raise WeightedAccumulationError(
        f"apply_window({name}=...): state is an in-step result "
        "(AccumulatedGradients), whose window is closed and reduced "
        "already; drop the argument (set an in-step call's loss scale with "
        "its loss_scale=)."
      )
  if out.kind != "mean":
    raise WeightedAccumulationError(
      f"{what}: this is finish_sums' result (still loss-scaled sums, not "
      "a mean). Pass the window itself, or finish_mean's out."
    )
  if out.grads is None:
    raise WeightedAccumulationError(
      f"{what}: this AccumulatedGradients has no gradients (apply_window's "
      "own result: its mean went to tx). Pass the out of "
      "microbatched_value_and_grad, or the window (an AccumState)."
    )
  _result_grads(out, params)
  if jnp.shape(out.valid) != () or jnp.result_type(out.valid) != jnp.bool_:
    raise WeightedAccumulationError(
      f"{what}: out.valid must be a bool scalar (got "
      f"{jnp.result_type(out.valid)}{list(jnp.shape(out.valid))}); pass the "
      "out of microbatched_value_and_grad unchanged."
    )


def _trained(params: Any) -> Any:
  """``params`` with ``None`` where an in-step call holds a leaf fixed."""

  def arr(x):
    ok = isinstance(x, (jax.Array, np.ndarray, np.generic))
    return ok and jnp.issubdtype(x.dtype, jnp.floating)

  if any(map(arr, jax.tree.leaves(params))):
    return jax.tree.map(lambda x: x if arr(x) else None, params)
  return jax.tree.map(lambda x: x if isinstance(x, float) else None, params)


def _result_grads(out: AccumulatedGradients, params: Any) -> Any:
  """``out.grads`` checked against ``params``, in their structure and dtype."""
  leaves = tree_utils.match_tree(  # nnx.Param-held or pure, either side
    tree_utils.unwrap_variables(params),
    tree_utils.unwrap_variables(out.grads),
    what="apply_window(state.grads)",
    ref_name="params",
  )
  like = jax.tree.leaves(params)
  return jax.tree.unflatten(
    jax.tree.structure(params),
    [g.astype(_mean_dtype(g.dtype, p)) for g, p in zip(leaves, like)],
  )


@functools.partial(jax.jit, static_argnums=0)
def _apply_result_kernel(tx, out, params, opt_state):
  """``tx`` applied to a valid in-step result (one ``lax.cond``)."""
  grads = _result_grads(out, params)

  def apply(operands):
    params, opt_state = operands
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_opt_state = tree_utils.cast_like(new_opt_state, opt_state)
    return optax.apply_updates(params, updates), new_opt_state

  return jax.lax.cond(
    jnp.asarray(out.valid), apply, lambda ops: ops, (params, opt_state)
  )


def _check_replicas(state: AccumState, params: Any, axes: tuple) -> None:
  """Refuses a per-replica window closed as if it were global."""
  for (path, b), p in zip(
    tree_utils.flat(state.grads), jax.tree.leaves(params)
  ):
    extra = tree_utils.varying_axes(b) - tree_utils.varying_axes(p) - set(axes)
    if extra:
      raise WeightedAccumulationError(
        f"apply_window(state): buffer {path} varies over mesh axes "
        f"{tuple(sorted(extra))} while its param does not: the window holds "
        "per-replica sums, but it was made as a global window. Make it "
        "with wa.init(params, axis_name=...) inside the shard_map, so that "
        "its close reduces the replicas' sums once."
      )


@validation.refuse_removed("axis_name")
def apply_window(
  tx: optax.GradientTransformation,
  state: AccumState | AccumulatedGradients,
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
  ``out.valid`` is exactly what :func:`finish_mean` would say: a mean
  beyond the work dtype is not applied either, although the optimizer
  would get it in a wider dtype (one decision for every close).

  It also takes, in place of ``state``, the ``out`` of
  :func:`~weighted_accum.microbatched_value_and_grad` (a window closed in
  one step): ``tx`` is then applied to ``out.grads`` only when ``out.valid``
  (an all-padding batch gives zero gradients and ``valid=False``; without
  this ``tx`` would still move the params through its momentum and weight
  decay, and advance its step count). ``params`` may then be a whole
  Equinox module: the leaves the call held fixed (ints, Python floats,
  functions) come back as they are, and ``tx``'s state is that of its
  floating leaves (``tx.init(eqx.filter(model, eqx.is_inexact_array))``).

  Args:
    tx: the optimizer (any ``optax.GradientTransformation``); it gets the
      window's mean gradient in at least float32 and at least the params'
      dtype (never a narrower mean that could overflow), and its state keeps
      its dtypes.
    state: the window to close; or the
      :class:`~weighted_accum.AccumulatedGradients` of an in-step call,
      whose mean ``grads`` are applied when ``valid``.
    params: the params the window's gradients belong to (same leaf paths and
      shapes as the buffers).
    opt_state: ``tx``'s state.
    next_loss_scale: the next window's loss scale (default: unchanged), a
      scalar or a :class:`~weighted_accum.DynamicLossScale` (its ``scale``).
      To adjust a scaler by this window's finiteness, do it after the call
      and set the new window's scale: ``scaler = scaler.adjust(out.finite)``,
      then ``state = wa.set_loss_scale(state, scaler)``.

  Returns:
    ``(params, opt_state, state, out)``: the updated params and optimizer
    state (unchanged when ``out.valid`` is false), the next window and an
    :class:`~weighted_accum.AccumulatedGradients` whose ``grads`` is
    ``None`` (the mean went to ``tx``; call :func:`finish_mean` when you need
    it) and whose ``weight``, ``loss_scale``, ``issued``, ``finite`` and
    ``valid`` describe the window just closed (identical on every shard).
    Given an in-step result: ``(params, opt_state, None, out)``, ``out``
    as given (no window to reopen).

  Raises:
    WeightedAccumulationError: when ``tx`` is not an optax transformation or
      ``state`` not an ``AccumState`` (e.g. arguments swapped), when
      ``params`` does not match the buffers (naming the leaf path), for a
      per-replica window made as a global one, or for a concrete invalid
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
  if isinstance(state, AccumulatedGradients):
    trained = _trained(params)  # an Equinox module's static half held
    _check_result(state, trained, next_loss_scale)
    p, o = _apply_result_kernel(tx, state, trained, opt_state)
    held = lambda new, old: old if new is None else new
    p = jax.tree.map(held, p, params, is_leaf=lambda x: x is None)
    return p, o, None, state
  state = _window(state, "apply_window", stacked_ok=True)
  validation.one_device_set(
    [
      ("state.grads", state.grads),
      ("params", params),
      ("opt_state", opt_state),
    ],
    what="apply_window",
  )
  ls = _next_scale(state, next_loss_scale, "apply_window")
  if not base.plain(state):  # as placed
    return base.PLACED["apply_window"](tx, state, params, opt_state, ls)
  return apply_global(tx, state, params, opt_state, ls, ())


def apply_global(tx, state, params, opt_state, ls, axes):
  """``apply_window`` of a global or per-replica window (reduced over
  ``axes``) on the one close path."""
  tree_utils.match_tree(
    state.grads,
    params,
    what="apply_window(params)",
    ref_name="the accumulator's buffers",
  )
  _check_replicas(state, params, axes)
  return _apply_window_kernel(tx, state, params, opt_state, ls, axes)
