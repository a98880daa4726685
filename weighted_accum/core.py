"""The accumulation functions: ``accumulate_sum``, ``accumulate_mean``,
``finish_sums`` and ``finish_mean``.

Each validates structure (and concrete values) in Python, then runs a jitted
kernel that inlines into the caller's ``jit`` and updates donated buffers in
place (``docs/design.md``, "Performance rules").
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.experimental import checkify
from jax.typing import ArrayLike

from weighted_accum import _accum
from weighted_accum import _finish
from weighted_accum import _inputs
from weighted_accum import _tally
from weighted_accum import _tree
from weighted_accum import _validation_cache
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients


def _accumulate(
  state: AccumState,
  grads: Any,
  weight: Any,
  mean: bool,
  checked: bool,
  name: str,
) -> AccumState:
  """Validates one microbatch (cached when eager) and adds it."""
  leaves, placed = _validation_cache.check_microbatch(
    state, grads, weight, name
  )
  return _accum.add(
    state,
    leaves,
    weight,
    mean=mean,
    checked=checked,
    placed=placed,
    name=name,
  )


def accumulate_sum(
  state: AccumState, grads: Any, weight: ArrayLike, *, checked: bool = False
) -> AccumState:
  """Adds the gradients of a microbatch's loss SUM.

  ``buffer += cast(grads, work dtype)``; the window's weight grows by
  ``weight``. Use it when the loss was ``sum(w * l)`` over the microbatch
  (times the window's loss scale).

  Args:
    state: the window so far.
    grads: gradients of the summed loss: a tree with the params' leaf paths
      and shapes, in any floating dtype (float32, bfloat16, float16).
    weight: the microbatch's effective item count (tokens, samples), a
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
  return _accumulate(state, grads, weight, False, checked, "accumulate_sum")


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
  return _accumulate(state, grads, weight, True, checked, "accumulate_mean")


@functools.partial(jax.jit, static_argnames=("mean",))
def _finish_kernel(
  state: AccumState, next_loss_scale: jax.Array | None, mean: bool
) -> tuple[AccumulatedGradients, AccumState]:
  return _finish.finish(state, mean=mean, next_loss_scale=next_loss_scale)


def finish_sums(
  state: AccumState, *, next_loss_scale: ArrayLike | None = None
) -> tuple[AccumulatedGradients, AccumState]:
  """Returns the window's still-scaled sums and local weight, then resets.

  For data parallelism: reduce ``out.grads`` and ``out.weight`` across
  replicas (or use :mod:`weighted_accum.distributed`), then divide by
  ``out.loss_scale`` once and by the global weight. No communication happens
  here. An empty window gives zero sums and weight 0.

  Args:
    state: the window to finish.
    next_loss_scale: the next window's loss scale (default: unchanged).

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
  next_loss_scale = _next_loss_scale(state, next_loss_scale, "finish_sums")
  return _finish_kernel(state, next_loss_scale, mean=False)


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
    next_loss_scale: the next window's loss scale (default: unchanged). A
      traced invalid one marks the next window unusable (``docs/inputs.md``).
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
  next_loss_scale = _next_loss_scale(state, next_loss_scale, "finish_mean")
  checked = _inputs.static_flag(checked, what="finish_mean(checked=...)")
  issued = _tree.concrete_float(state.issued)
  if issued is not None and _tree.concrete_float(state.weight_hi) is not None:
    total = state.total_weight
    if not total > 0:
      raise WeightedAccumulationError(
        f"finish_mean: the window's total weight is {total!r} after "
        f"{int(issued)} microbatch(es) ({int(state.zero_weight)} of weight "
        f"0, {int(state.rejected)} rejected), so there is no mean to take. "
        "Nothing was cleared: accumulate more microbatches, or use "
        "finish_sums to hand zero sums to a cross-replica reduction."
      )
  elif checked:
    weight = _tally.join_traced(state.weight_hi, state.weight_lo)
    checkify.check(
      weight > 0,
      "finish_mean: the window's total weight is "
      "{w}, so there is no mean to take; the state was left "
      "unchanged and zero grads returned.",
      w=weight,
    )
  return _finish_kernel(state, next_loss_scale, mean=True)


def _next_loss_scale(state: AccumState, value: Any, what: str) -> Any:
  """A finish's ``next_loss_scale`` in its stored dtype: validated when
  concrete (raises), NaN when traced and invalid (``docs/inputs.md``)."""
  if value is None:
    return None
  return _inputs.loss_scale(
    value, what=f"{what}(next_loss_scale=...)", dtype=state.loss_scale.dtype
  )
