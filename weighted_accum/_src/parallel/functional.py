"""The public functional API. Each function checks its arguments, then
``parallel.placed`` reads the window's placement (set by ``init``) against
the caller's context: the one dispatch, with no registry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import optax

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import finishing
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import distributed
from weighted_accum._src.parallel import placed


def init(
  params: Any,
  dtype: DTypeLike = jnp.float32,
  loss_scale: ArrayLike = 1.0,
  *,
  axis_name: str | Sequence[str] | None = None,
  reduce: str = "window",
) -> AccumState:
  """Starts an empty window with zero buffers shaped like ``params``.

  Args:
    params: any pytree of floating arrays (dict, nested containers,
      ``flax.nnx.State``, trees with ``None`` leaves, or abstract values under
      ``jax.eval_shape``). Only shapes, dtypes and shardings are read.
    dtype: the work dtype of the buffers (float32 recommended; bfloat16 and
      float16 halve the memory at a precision cost; float64 with x64), or
      ``None`` for the params' dtype (which they must share).
    loss_scale: the factor the caller multiplies every loss of the window by
      (e.g. 2**15 for float16), or a :class:`~weighted_accum.DynamicLossScale`
      (its ``scale``). Divided out once at finish. Never inferred.
    axis_name: ``None`` (the default) for a global window: plain ``jit``
      over global, possibly sharded arrays. A data axis name (or a tuple of
      names) for a per-replica window: inside ``jax.shard_map`` over those
      axes, this replica's window; outside ``shard_map`` (params on a mesh
      with those axes), a stacked window of every replica's, carried
      between jitted steps and reduced once at its close (pass it into
      ``shard_map`` with :func:`weighted_accum.distributed.window_specs`).
      The window keeps this placement: every later call reads it.
    reduce: for a per-replica window, ``"window"`` (the default: local
      sums, one all-reduce at the close) or ``"microbatch"`` (inside
      ``shard_map`` only: every accumulate all-reduces, and the window
      holds the global sums).

  Returns:
    An empty :class:`~weighted_accum.AccumState`; each buffer is on its
    param's sharding; ``state.placement`` says what the window is.

  Raises:
    WeightedAccumulationError: for a non-floating work dtype or param,
      params committed to different devices, or a non-finite or
      non-positive concrete loss scale, an axis not on the params' mesh or
      not bound by the enclosing ``shard_map``, or an unknown ``reduce``.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros((2, 3)), 'b': jnp.zeros(3)},
    ...                 dtype=jnp.float32, loss_scale=1.0)
    >>> state.grads['w'].shape, int(state.issued)
    ((2, 3), 0)
  """
  if axis_name is None:
    if reduce != "window":
      raise WeightedAccumulationError(
        f"init(reduce={reduce!r}): reduce is how a per-replica window "
        "reduces; it needs axis_name (the data axes). Pass axis_name=..., "
        "or leave reduce out for a global window."
      )
    return accumulation.init(params, dtype, loss_scale)
  return distributed.make(params, axis_name, reduce, dtype, loss_scale)


def _accumulate(state, grads, weight, *, mean, checked, name):
  # accumulation.add checks the window's type; placed.accumulate places it.
  add = placed.accumulate if isinstance(state, AccumState) else accumulation.add
  return add(state, grads, weight, mean=mean, checked=checked, name=name)


def accumulate_sum(
  state: AccumState, grads: Any, weight: ArrayLike, *, checked: bool = False
) -> AccumState:
  """Adds the gradients of a microbatch's loss SUM.

  ``buffer += cast(grads, work dtype)``; the window's weight grows by
  ``weight``. Use it when the loss was ``sum(w * l)`` over the microbatch
  (times the window's loss scale).

  What is added where follows the window's placement (``wa.init``'s
  ``axis_name``): a global window adds the grads as they are; inside
  ``shard_map`` a per-replica window adds this replica's local gradients
  (or, for gradients autodiff already summed over the axes, their global
  contribution once), and a ``reduce="microbatch"`` window all-reduces
  sums and weights now; a stacked window's block is added to per replica.

  Args:
    state: the window so far.
    grads: gradients of the summed loss: a tree with the params' leaf paths
      and shapes, in any floating dtype (float32, bfloat16, float16).
    weight: the microbatch's effective item count (tokens, samples; inside
      ``shard_map``, this replica's), a
      scalar; may be fractional and traced (no recompilation per value). A
      weight of exactly 0 counts as issued and adds nothing, even if ``grads``
      holds NaN/Inf.
    checked: under ``jax.jit``, also emit a ``checkify`` check for an invalid
      weight, so that a ``checkify.checkify``-wrapped step reports it.

  Returns:
    The new state. Under ``jit`` a weight that cannot be stored (negative,
    NaN, infinite, subnormal, beyond the tally's range; see
    ``docs/inputs.md``) rejects the microbatch whole: buffers and weight
    unchanged, ``issued`` and ``rejected`` incremented.

  Raises:
    WeightedAccumulationError: for a grads tree that does not match the
      buffers (naming the leaf path), or a concrete invalid weight.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> loss_sum = lambda p, x: jnp.sum((x @ p['w']) ** 2)
    >>> x1, x2 = jnp.ones((3, 2)), 2 * jnp.ones((1, 2))
    >>> state = wa.init(params)
    >>> state = wa.accumulate_sum(state, jax.grad(loss_sum)(params, x1), 3)
    >>> state = wa.accumulate_sum(state, jax.grad(loss_sum)(params, x2), 1)
    >>> out, state = wa.finish_mean(state)
    >>> out.weight.item()
    4.0
  """
  return _accumulate(
    state, grads, weight, mean=False, checked=checked, name="accumulate_sum"
  )


def accumulate_mean(
  state: AccumState, grads: Any, weight: ArrayLike, *, checked: bool = False
) -> AccumState:
  """Adds the gradients of a microbatch's loss MEAN, weighted by its size.

  ``buffer += cast(grads, work dtype) * weight`` (multiplied after the
  conversion, in at least float32), so microbatches of unequal size are not
  averaged equally. Use it when the loss was ``sum(w * l) / weight``.

  Args:
    state: the window so far.
    grads: gradients of the mean loss (times the window's loss scale).
    weight: the effective item count the mean divided by; see
      :func:`accumulate_sum`.
    checked: see :func:`accumulate_sum`.

  Returns:
    The new state; see :func:`accumulate_sum`.

  Raises:
    WeightedAccumulationError: see :func:`accumulate_sum`.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(1)})
    >>> state = wa.accumulate_mean(state, {'w': jnp.array([1.0])}, 3)
    >>> state = wa.accumulate_mean(state, {'w': jnp.array([5.0])}, 1)
    >>> out, _ = wa.finish_mean(state)   # (3*1 + 1*5) / 4, not (1 + 5) / 2
    >>> out.grads['w'].item()
    2.0
  """
  return _accumulate(
    state, grads, weight, mean=True, checked=checked, name="accumulate_mean"
  )


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
  state = finishing._window(state, "finish_sums")
  ls = finishing._next_scale(state, next_loss_scale, "finish_sums")
  return placed.finish_sums(state, ls)


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
  state = finishing._window(state, "finish_mean")
  ls = finishing._next_scale(state, next_loss_scale, "finish_mean")
  checked = validation.static_flag(checked, what="finish_mean(checked=...)")
  return placed.finish_mean(state, ls, checked)


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
    return finishing.apply_result(tx, state, params, opt_state, next_loss_scale)
  state = finishing._window(state, "apply_window")
  ls = finishing._next_scale(state, next_loss_scale, "apply_window")
  return placed.apply_window(tx, state, params, opt_state, ls)


def set_loss_scale(
  state: AccumState, loss_scale: Any, *, checked: bool = False
) -> AccumState:
  """Sets the loss scale of a window to which nothing was added yet.

  The scale is constant within a window, so only a window of total weight
  0 may change it: one just started by a finish, or one holding only
  zero-weight or rejected microbatches (they added nothing to the buffers).
  The rest of the state is unchanged.

  Args:
    state: the open window.
    loss_scale: the new scale, a finite positive scalar, or a
      :class:`~weighted_accum.DynamicLossScale` (its ``scale``). Stored in
      the state's loss-scale dtype (float32; float64 for a float64 work
      dtype).
    checked: under ``jax.jit``, also emit ``checkify`` checks for the two
      conditions below.

  Returns:
    ``state`` with ``loss_scale`` replaced. Under ``jit``, where it cannot
    raise, a traced invalid scale (non-finite, non-positive, flushed to
    zero) or a window that already holds weight makes the window's scale
    NaN: the window is unusable (its microbatches are rejected and counted,
    its finish reports ``valid=False``) until a finish starts the next one
    with a valid ``next_loss_scale``. Keeping the old scale instead would
    divide grads scaled by the new factor by the old one, reported valid.

  Raises:
    WeightedAccumulationError: for a concrete invalid scale, or a concrete
      window that already holds weight (finish it first).

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> scaler = wa.DynamicLossScale(2.0**16)
    >>> state = wa.init({'w': jnp.zeros(2)}, loss_scale=scaler)
    >>> state = wa.accumulate_mean(state, {'w': jnp.full(2, 2.0**16)}, 3)
    >>> out, state = wa.finish_mean(state)
    >>> scaler = scaler.adjust(out.finite)
    >>> state = wa.set_loss_scale(state, scaler)
    >>> float(state.loss_scale), out.grads['w'].tolist()
    (65536.0, [1.0, 1.0])
  """
  hint = "Pass the window from wa.init or a finish, then the scale."
  validation.instance(
    state, AccumState, what="set_loss_scale(state)", hint=hint
  )
  checked = validation.static_flag(checked, what="set_loss_scale(checked=...)")
  state = placed.where(state, "set_loss_scale")[1]
  what, dtype = "set_loss_scale(loss_scale)", state.loss_scale.dtype
  ls = validation.loss_scale(loss_scale, what=what, dtype=dtype)
  if not tree_utils.is_traced(state.weight_hi):
    total = state.total_weight  # a stacked window's: over the replicas
    if total != 0:
      raise WeightedAccumulationError(
        f"set_loss_scale: the open window already holds total weight {total!r}"
        f" (scale {float(state.loss_scale)!r}, constant within a window): "
        "finish it, or pass finish_mean/finish_sums(next_loss_scale=...)."
      )
  return accumulation._set_scale(state, ls, checked)
