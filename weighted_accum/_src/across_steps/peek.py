"""An open window read or dropped without closing it: ``peek_mean`` and
``discard``, of an :class:`~weighted_accum.AccumState` or the wrapper's state."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike

from weighted_accum._src import validation
from weighted_accum._src.across_steps import wrapper_state
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
  state = wrapper_state.view(state)
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

  What :func:`~weighted_accum.finish_mean` would return now, but the window
  stays open. A per-replica or stacked window gives the global mean,
  identical on every replica.

  Args:
    state: an :class:`~weighted_accum.AccumState`, or a
      :class:`~weighted_accum.WeightedMultiStepsState` (also
      ``nnx.Optimizer(...).opt_state``).

  Returns:
    An :class:`~weighted_accum.AccumulatedGradients`, as ``finish_mean``'s
    (under ``jit``, ``valid=False`` for a window of zero total weight).

  Raises:
    WeightedAccumulationError: for another state, a window outside its
      ``shard_map``, or (eagerly) a window of zero total weight.

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
  st = _window(state, "peek_mean")
  return placed.finish_mean(st, None, False, "peek_mean")[0]


def discard(
  state: AccumState | WeightedMultiStepsState,
  *,
  next_loss_scale: ArrayLike | None = None,
) -> AccumState | WeightedMultiStepsState:
  """Drops the open window: its microbatches are thrown away, unapplied.

  Returns the empty window a finish would open (``windows`` counts it); the
  optax wrapper's state also gets ``mini_step`` 0, its inner optimizer and
  other counters untouched.

  Args:
    state: an :class:`~weighted_accum.AccumState` or a
      :class:`~weighted_accum.WeightedMultiStepsState`.
    next_loss_scale: the new window's loss scale (default: unchanged; not
      with a ``DynamicLossScale``).

  Returns:
    The state, of the same type, with an empty window.

  Raises:
    WeightedAccumulationError: for another state or an invalid
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
  what, wrapper = "discard(next_loss_scale=...)", wrapper_state.view(state)
  st = _window(wrapper, "discard")
  ls = validation.optional_loss_scale(
    next_loss_scale, what=what, dtype=st.loss_scale.dtype
  )
  st = placed.where(st, "discard")[1]  # checked against this context
  finishing.shared_over_window(st, ls, what)
  new = _discard_kernel(st, ls)
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
  if isinstance(state, AccumState):  # its placement may have moved
    return new
  return wrapper_state.rewrap(state, new)
