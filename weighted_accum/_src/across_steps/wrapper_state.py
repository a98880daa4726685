"""The optax wrapper's state: ``WeightedMultiStepsState``, optax's
``MultiStepsState`` fields and this library's counters, a pytree that goes
through ``jax.jit``, donation and Orbax whole."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.loss_scale import DynamicLossScale


class WeightedMultiStepsState(NamedTuple):
  """State of :class:`~weighted_accum.WeightedMultiSteps`:
  ``optax.MultiStepsState``'s fields, then this library's.

  Attributes:
    mini_step: int32, microbatches accumulated since the window opened (0
      right after a close; a microbatch skipped by ``should_skip_update_fn``
      does not count).
    gradient_step: int32, windows applied to the inner optimizer since
      ``init`` (the argument of a callable ``every_k_schedule``).
    inner_opt_state: the wrapped optimizer's state; changes only when a
      window's gradient is applied.
    acc_grads: the open window's pending gradient sums, a tree like the
      params in the accumulator dtype. Unlike ``optax.MultiSteps``' running
      mean these are weighted SUMS, still multiplied by the loss scale; the
      window's gradient is ``acc_grads / loss_scale / total_weight``. While
      ``mini_step`` is 0 (right after a close) they are not read: the next
      microbatch overwrites them (read the window through :attr:`accum`).
    skip_state: what ``should_skip_update_fn`` returned last (``()``
      without one), as in optax.
    window: the open window's counters, an
      :class:`~weighted_accum.AccumState` without buffers (``grads`` is
      ``None``). :attr:`accum` joins it with ``acc_grads``.
    updated: bool, the last call closed a window and applied the inner
      update (see :func:`~weighted_accum.has_updated`).
    nonfinite: bool, the last call closed a window that was discarded: its
      pending gradients held NaN/Inf (or, with
      ``skip_nonfinite_updates=True``, its inner updates did), its loss
      scale was unusable, or its mean does not fit the dtype the inner
      optimizer gets it in (the grads' and params' wider dtype). Nothing
      was applied and the next window starts clean.
    nonfinite_windows: int32, windows discarded so since ``init``.
    empty_windows: int32, closes of a window with zero total weight since
      ``init``. Such a window applies nothing and is not lost: its counters
      carry into the next window.
    skipped: int32, microbatches skipped by ``should_skip_update_fn`` since
      ``init``.
    rejected: int32, microbatches refused under ``jit`` for an invalid
      weight since ``init`` (never reset by a close; the open window's own
      count is ``window.rejected``).
    loss_scaler: the :class:`~weighted_accum.DynamicLossScale` adjusted at
      each close, or ``None`` for a fixed loss scale.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any
  skip_state: Any
  window: AccumState
  updated: jax.Array
  nonfinite: jax.Array
  nonfinite_windows: jax.Array
  empty_windows: jax.Array
  skipped: jax.Array
  rejected: jax.Array
  loss_scaler: DynamicLossScale | None

  @property
  def accum(self) -> AccumState:
    """The open window as one :class:`~weighted_accum.AccumState`."""
    fresh = self.mini_step == 0  # the closed window's buffers, unread
    return self.window.replace(
      grads=jax.tree.map(
        lambda b: jnp.where(fresh, jnp.zeros((), b.dtype), b), self.acc_grads
      )
    )

  @property
  def inner_state(self) -> Any:
    """Alias of :attr:`inner_opt_state`."""
    return self.inner_opt_state
