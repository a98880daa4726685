"""The functional API's open and fill: ``init``, ``accumulate_sum`` and
``accumulate_mean``.

Each reads what the window is from its placement (``AccumState.placement``,
set by ``init``) and hands it to the one path for it: the global window's
``accumulation.add``, or the per-replica paths of ``parallel.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError


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
  return base.PLACED["init"](params, axis_name, reduce, dtype, loss_scale)


def _accumulate(state, grads, weight, *, mean, checked, name):
  if not isinstance(state, AccumState) or base.plain(state):
    return accumulation.add(  # checks the window's type once
      state, grads, weight, mean=mean, checked=checked, name=name
    )
  return base.PLACED["accumulate"](
    state, grads, weight, mean=mean, checked=checked, name=name
  )


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
