"""An open window read or dropped without closing it: ``peek_mean`` and
``discard``, of an :class:`~weighted_accum.AccumState` or the wrapper's state."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike

from weighted_accum._src import validation
from weighted_accum._src.across_steps import held_state
from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState,
)
from weighted_accum._src.core import finishing
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.core.open_window import _discard_kernel
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import placed


def _window(state: Any, what: str) -> AccumState:
  """The open window of ``state`` (an AccumState or the wrapper's state)."""
  state = held_state.view(state)
  if isinstance(state, WeightedMultiStepsState):
    return state.accum
  hint = "Pass an AccumState (wa.init) or WeightedMultiSteps' state."
  return validation.instance(
    state, AccumState, what=f"{what}(state)", hint=hint
  )


@validation.refuse_removed("axis_name")
def peek_mean(
  state: AccumState | WeightedMultiStepsState,
) -> AccumulatedGradients:
  """The open window's mean gradient, read without closing the window.

  What :func:`~weighted_accum.finish_mean` would return now (the sums
  divided by the loss scale, then by the total weight), but the window stays
  open: keep accumulating into ``state`` and close it as usual. For the
  optax wrapper's state it is the mean gradient, what the inner optimizer
  would get at a close now with ``use_grad_mean=True`` (the default; with
  ``False`` it gets the sum, i.e. this mean times the window's weight).

  Args:
    state: an :class:`~weighted_accum.AccumState`, or a
      :class:`~weighted_accum.WeightedMultiStepsState` (also
      ``nnx.Optimizer(...).opt_state``).

  A per-replica window (``wa.init(..., axis_name=...)``, or a wrapper built
  with ``axis_name``) gives the global mean, reduced in one collective
  round, identical on every replica; a stacked window under plain ``jit``
  is reduced once too.

  Returns:
    An :class:`~weighted_accum.AccumulatedGradients`, as ``finish_mean``'s
    (under ``jit``, zero grads and ``valid=False`` for a window of zero
    total weight).

  Raises:
    WeightedAccumulationError: for a state that is neither, a per-replica
      window outside the ``shard_map`` of its axes, or (eagerly) a window of
      zero total weight.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.accumulate_mean(wa.init({'w': jnp.zeros(1)}),
    ...                            {'w': jnp.array([1.0])}, 3)
    >>> wa.peek_mean(state).grads['w'].item(), int(state.issued)
    (1.0, 1)
    >>> state = wa.accumulate_mean(state, {'w': jnp.array([5.0])}, 1)
    >>> wa.peek_mean(state).grads['w'].item()   # (3*1 + 1*5) / 4
    2.0
  """
  return placed.peek_mean(_window(state, "peek_mean"))


def discard(
  state: AccumState | WeightedMultiStepsState,
  *,
  next_loss_scale: ArrayLike | None = None,
) -> AccumState | WeightedMultiStepsState:
  """Drops the open window: its microbatches are thrown away, unapplied.

  Returns the empty window a finish would open (zero buffers on the params'
  shardings, the window's counters reset, ``windows`` counting it as
  closed); the optax wrapper's state also gets ``mini_step`` 0, and its inner
  optimizer, ``gradient_step`` and other counters are untouched. Use it to
  drop a window known to be bad (a data error found mid-window, a
  preemption's partial window) without applying it.

  Args:
    state: an :class:`~weighted_accum.AccumState` or a
      :class:`~weighted_accum.WeightedMultiStepsState`.
    next_loss_scale: the new window's loss scale (default: unchanged); not
      with a wrapper whose loss scale is a ``DynamicLossScale`` (the scaler
      sets it).

  Returns:
    The state, of the same type, with an empty window.

  Raises:
    WeightedAccumulationError: for a state that is neither, or an invalid
      ``next_loss_scale``.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.accumulate_sum(wa.init({'w': jnp.zeros(2)}),
    ...                           {'w': jnp.ones(2)}, 5)
    >>> state = wa.discard(state)
    >>> state.total_weight, int(state.issued), state.grads['w'].tolist()
    (0.0, 0, [0.0, 0.0])
  """
  st = _window(state, "discard")
  ls = validation.optional_loss_scale(
    next_loss_scale,
    what="discard(next_loss_scale=...)",
    dtype=st.loss_scale.dtype,
  )
  finishing.shared_over_window(st, ls, "discard(next_loss_scale=...)")
  new, wrapper = _discard_kernel(st, ls), held_state.view(state)
  if isinstance(wrapper, WeightedMultiStepsState):
    if ls is not None and wrapper.loss_scaler is not None:
      raise WeightedAccumulationError(
        "discard(next_loss_scale=...): a DynamicLossScale sets each window's "
        "scale; drop the argument."
      )
    new = wrapper._replace(
      acc_grads=new.grads,
      window=new.replace(grads=None),
      mini_step=jnp.zeros_like(wrapper.mini_step),
    )
  return held_state.rewrap(state, new)
