"""The optax wrapper ``WeightedMultiSteps`` and its readers ``has_updated``
and ``window_counters`` (its step: ``multi_steps_step``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import optax

from weighted_accum._src import validation
from weighted_accum._src.across_steps import held_state
from weighted_accum._src.across_steps import multi_steps_step as step
from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState,
)

__all__ = [
  "WeightedMultiSteps",
  "WeightedMultiStepsState",
  "has_updated",
  "window_counters",
]


def _wrapper_state(state: Any, what: str) -> WeightedMultiStepsState:
  """``state`` (nnx-held ones unwrapped) if it is this wrapper's state."""
  state = held_state.view(state)
  hint = "Pass wa.WeightedMultiSteps' state (or nnx.Optimizer(...).opt_state)."
  if isinstance(state, optax.MultiStepsState):
    hint += " For optax.MultiSteps' use optax.MultiSteps(...).has_updated."
  return validation.instance(
    state, WeightedMultiStepsState, what=f"{what}(state)", hint=hint
  )


def has_updated(state: WeightedMultiStepsState) -> jax.Array:
  """Whether the last ``update`` closed a window and applied the inner update.

  Works on the state itself, on ``nnx.Optimizer(...).opt_state`` (inside
  and outside ``nnx.jit``) and on its ``nnx.State`` (``nnx.state(optimizer)
  ["opt_state"]``, e.g. restored from a checkpoint).

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A bool scalar array (traceable).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode='mean')
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> g = {'w': jnp.ones(2)}
    >>> _, state = tx.update(g, state, params, weight=3)
    >>> bool(wa.has_updated(state))
    False
    >>> _, state = tx.update(g, state, params, weight=1)
    >>> bool(wa.has_updated(state))
    True
  """
  state = _wrapper_state(state, "has_updated")
  return jnp.asarray(state.updated)


def window_counters(state: WeightedMultiStepsState) -> dict[str, Any]:
  """The current window's counters; reading them changes nothing.

  Works on the state itself, on ``nnx.Optimizer(...).opt_state`` (inside
  and outside ``nnx.jit``; ``nnx.Variable`` values are unwrapped) and on its
  ``nnx.State`` (``nnx.state(optimizer)["opt_state"]``).

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A dict with ``mini_step`` (microbatches since the window opened),
    ``issued``, ``zero_weight`` and ``rejected`` (the window's microbatch
    counts; they include those of an empty window carried over),
    ``total_weight`` (an exact Python float when concrete, a float32 array
    under a transformation) and ``loss_scale`` (the scale to multiply this
    window's losses by).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> tx = wa.WeightedMultiSteps(optax.sgd(0.1), 4, mode='mean')
    >>> params = {'w': jnp.zeros(2)}
    >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params,
    ...                      weight=7)
    >>> c = wa.window_counters(state)
    >>> int(c['mini_step']), int(c['issued']), c['total_weight']
    (1, 1, 7.0)
  """
  state = _wrapper_state(state, "window_counters")
  win = state.window
  return dict(
    mini_step=state.mini_step,
    issued=win.issued,
    zero_weight=win.zero_weight,
    rejected=win.rejected,
    total_weight=win.total_weight,
    loss_scale=win.loss_scale,
  )


class WeightedMultiSteps:
  """Weighted gradient accumulation in front of an optax optimizer.

  A drop-in for ``optax.MultiSteps`` (the same constructor arguments, state
  fields and methods, plus a required ``mode``) whose ``update`` also takes
  each microbatch's weight (its effective item count: tokens, samples)::

      updates, state = tx.update(grads, state, params, weight=n_tokens)

  A window closes after ``every_k_schedule`` microbatches, or earlier when
  the call passes ``finish=True`` (a short last window of an epoch is
  normalised by its own weight). At a close the window's gradient
  ``sum grad(S) / sum n`` (with ``use_grad_mean=False`` the sum
  ``sum grad(S)``) goes through the inner optimizer once and its updates are
  returned. Mid-window the updates are zeros, the inner state is untouched
  and the inner update is not computed (``lax.cond``). With weight 1 on
  every microbatch it computes what ``optax.MultiSteps`` computes.

  A close with zero total weight (every microbatch fully masked) applies
  nothing, does not advance the inner optimizer and is not lost: the window
  stays open and its counters carry into the next one. A close whose pending
  gradients hold NaN/Inf (a float16 loss-scale overflow) applies nothing,
  does not advance the inner optimizer, sets ``state.nonfinite`` and
  discards the window, so the next window starts clean (the check is one
  NaN-safe read of the window's sums, identical on every shard). By default
  the inner optimizer's updates are then returned as ``optax.MultiSteps``
  returns them; with ``skip_nonfinite_updates=True`` a close whose updates
  come out NaN/Inf also applies nothing (the inner state has taken that
  step), at the cost of two more passes over the updates
  (``optax.apply_if_finite`` around the inner optimizer is the composable
  alternative). ``state.gradient_step`` counts applied windows.

  Args:
    opt: the optimizer to apply once per window (any optax transform; extra
      keyword arguments of ``update`` are forwarded to it at a close).
    every_k_schedule: microbatches per window: a Python int in [1, 2**31),
      a function of ``state.gradient_step`` returning it (traced: a
      schedule never recompiles; a value below 1 closes every microbatch),
      or ``None`` to close windows only with ``finish=True``.
    use_grad_mean: ``True`` hands the inner optimizer the window's weighted
      mean gradient; ``False`` its weighted SUM (divided by the loss scale,
      not by the total weight), like optax's sum.
    should_skip_update_fn: optax's ``(updates, gradient_step, params) ->
      (should_skip, skip_state)`` (e.g. ``optax.skip_not_finite``): a
      microbatch it skips adds nothing and does not count towards the
      window (``state.skipped`` counts it); the rest of the window is kept.
      Its ``skip_state`` is stored in ``state.skip_state``. With
      ``axis_name`` it sees the microbatch's gradient over all replicas, so
      every replica skips alike and keeps the same ``skip_state``.
    accumulator_dtype: the work dtype of the accumulation buffers; ``None``
      (optax's meaning): the params' dtype, which they must share.
    mode: required. ``"mean"`` when the grads are of each microbatch's loss
      MEAN (``sum(w * l) / weight``), ``"sum"`` when they are of its loss
      SUM. No default is safe: the wrong one weights every microbatch
      wrongly.
    loss_scale: the factor every loss of a window is multiplied by (for
      float16 training); divided out once at the close. A number (change it
      per window with ``update(..., next_loss_scale=...)``) or a
      :class:`~weighted_accum.DynamicLossScale`: then at each close of a
      non-empty window it adjusts once by GradScaler's rule on the window's
      finiteness (a non-finite window is skipped), and the next window
      starts at its new scale; ``window_counters(state)['loss_scale']`` is
      the scale to multiply the loss by.
    axis_name: inside ``jax.shard_map`` over a data axis, its name(s): then
      ``weight`` is this replica's own item count and each microbatch's sums
      and weights are summed over the axis before they are added (one
      all-reduce per microbatch, like the ``pmean`` of a usual data-parallel
      step), so the state stays identical on every replica
      (``out_specs=P()``). ``grads`` may be local
      (:func:`weighted_accum.distributed.local_grad`) or already summed by
      autodiff. Leave it ``None`` under ``jax.jit`` over sharded global
      arrays. For one all-reduce per window, make the window per replica
      with ``wa.init(params, axis_name=...)``, accumulate into it and close
      it with ``wa.apply_window``.
    skip_nonfinite_updates: also skip a window whose inner updates come out
      NaN/Inf (see above).

  Raises:
    WeightedAccumulationError: for an invalid argument, naming it.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> tx = wa.WeightedMultiSteps(optax.sgd(1.0), every_k_schedule=2,
    ...                            mode='mean')
    >>> state = tx.init(params)
    >>> for g, n in [({'w': jnp.array([1., 1.])}, 3),
    ...              ({'w': jnp.array([5., 1.])}, 1)]:
    ...   updates, state = tx.update(g, state, params, weight=n)
    ...   params = optax.apply_updates(params, updates)
    >>> params['w'].tolist(), bool(tx.has_updated(state))   # 1 - (3+5)/4
    ([-1.0, -2.0], True)
  """

  _who = "WeightedMultiSteps"  # how errors name the constructor

  def __init__(
    self,
    opt: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], Any] | None,
    use_grad_mean: bool = True,
    should_skip_update_fn: Callable[..., Any] | None = None,
    accumulator_dtype: DTypeLike = jnp.float32,
    *,
    mode: str,
    loss_scale: ArrayLike = 1.0,
    axis_name: str | Sequence[str] | None = None,
    skip_nonfinite_updates: bool = False,
  ):
    self._cfg = step.configure(
      self._who,
      opt=opt,
      every_k_schedule=every_k_schedule,
      use_grad_mean=use_grad_mean,
      should_skip_update_fn=should_skip_update_fn,
      accumulator_dtype=accumulator_dtype,
      mode=mode,
      loss_scale=loss_scale,
      axis_name=axis_name,
      skip_nonfinite_updates=skip_nonfinite_updates,
    )

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer (with extra-args support), as in optax."""
    return self._cfg.inner

  def init(self, params: Any) -> WeightedMultiStepsState:
    """An empty window and the inner optimizer's initial state.

    Args:
      params: the params (any pytree of floating arrays).

    Returns:
      A :class:`WeightedMultiStepsState`.
    """
    return step.init(self._cfg, params)

  def update(
    self,
    updates: Any,
    state: WeightedMultiStepsState,
    params: Any = None,
    *,
    weight: ArrayLike | None = None,
    finish: Any = None,
    next_loss_scale: Any = None,
    **extra_args: Any,
  ) -> tuple[Any, WeightedMultiStepsState]:
    """Accumulates one microbatch; applies the window when it closes.

    Args:
      updates: the microbatch's gradients (of its loss mean or sum, per
        ``mode``), a tree like the params in any floating dtype.
      state: the state from ``init`` or the previous call.
      params: the params (needed by some inner optimizers).
      weight: required: the microbatch's effective item count (a scalar;
        traced values never recompile).
      finish: a bool scalar (may be traced): close the window after this
        microbatch.
      next_loss_scale: the loss scale of the window after a close.
      **extra_args: forwarded to the inner optimizer at a close.

    Returns:
      ``(updates, new_state)``: the inner optimizer's updates at a close
      that applied a window, zeros otherwise, in the dtypes
      ``optax.MultiSteps`` returns.

    Raises:
      WeightedAccumulationError: for a missing ``weight``, a state that is
        not this wrapper's, a grads tree that does not match the params
        (naming the leaf), a concrete invalid weight, or an invalid
        ``finish`` or ``next_loss_scale``.
    """
    return step.update(
      self._cfg,
      updates,
      state,
      params,
      weight=weight,
      finish=finish,
      next_loss_scale=next_loss_scale,
      **extra_args,
    )

  def has_updated(self, state: WeightedMultiStepsState) -> jax.Array:
    """Whether the last ``update`` applied a window (:func:`has_updated`)."""
    return has_updated(state)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This wrapper as an ``optax.GradientTransformationExtraArgs``."""
    return optax.GradientTransformationExtraArgs(self.init, self.update)
