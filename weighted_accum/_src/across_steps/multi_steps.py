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

from weighted_accum._src.across_steps import multi_steps_step as step
from weighted_accum._src.across_steps import wrapper_state
from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState,
)


def has_updated(state: WeightedMultiStepsState) -> jax.Array:
  """Whether the last ``update`` closed a window and applied the inner update.

  Also reads ``nnx.Optimizer(...).opt_state`` and its ``nnx.State``.

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A bool scalar array (traceable).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode='mean')
    >>> p = {'w': jnp.zeros(2)}
    >>> _, s1 = tx.update(p, tx.init(p), p, weight=3)
    >>> _, s2 = tx.update(p, s1, p, weight=1)
    >>> bool(wa.has_updated(s1)), bool(wa.has_updated(s2))
    (False, True)
  """
  return jnp.asarray(
    wrapper_state.checked(wrapper_state.view(state), "has_updated").updated
  )


def window_counters(state: WeightedMultiStepsState) -> dict[str, Any]:
  """The current window's counters; reading them changes nothing.

  Also reads ``nnx.Optimizer(...).opt_state`` and its ``nnx.State``.

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A dict with ``mini_step``, ``issued``, ``zero_weight``, ``rejected`` (the
    window's microbatch counts), ``total_weight`` (a Python float when
    concrete) and ``loss_scale`` (to multiply this window's losses by).

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
  state = wrapper_state.checked(wrapper_state.view(state), "window_counters")
  names = ("issued", "zero_weight", "rejected", "total_weight", "loss_scale")
  return dict(mini_step=state.mini_step) | {
    k: getattr(state.window, k) for k in names
  }


class WeightedMultiSteps:
  """Weighted gradient accumulation in front of an optax optimizer.

  A drop-in for ``optax.MultiSteps`` (the same constructor arguments, state
  fields and methods, plus a required ``mode``) whose ``update`` also takes
  each microbatch's weight (its effective item count: tokens, samples)::

      updates, state = tx.update(grads, state, params, weight=n_tokens)

  A window closes after ``every_k_schedule`` microbatches, or earlier with
  ``finish=True``; its gradient ``sum grad(S) / sum n`` (the sum with
  ``use_grad_mean=False``) goes through the inner optimizer once. Mid-window
  the updates are zeros and the inner update is not computed. With weight 1
  it computes what ``optax.MultiSteps`` computes. A close of zero total
  weight applies nothing and the window stays open; a close whose gradients
  hold NaN/Inf applies nothing, sets ``state.nonfinite`` and discards the
  window. ``state.gradient_step`` counts applied windows.

  Args:
    opt: the optimizer to apply once per window (any optax transform; extra
      keyword arguments of ``update`` are forwarded to it at a close).
    every_k_schedule: microbatches per window: an int, a function of
      ``state.gradient_step`` (traced), or ``None`` (close with ``finish``).
    use_grad_mean: hand the inner optimizer the window's weighted mean
      (``True``) or its weighted sum (``False``).
    should_skip_update_fn: optax's ``(updates, gradient_step, params) ->
      (should_skip, skip_state)``: a skipped microbatch adds nothing and is
      counted in ``state.skipped``; with ``axis_name`` it sees the global
      gradient.
    accumulator_dtype: the buffers' work dtype; ``None``: the params'.
    mode: required. ``"mean"`` when the grads are of each microbatch's loss
      MEAN, ``"sum"`` when of its loss SUM (no default is safe).
    loss_scale: the factor every loss of a window is multiplied by (float16),
      divided out at the close: a number (change it with ``update(...,
      next_loss_scale=...)``) or a :class:`~weighted_accum.DynamicLossScale`
      adjusted at each close by GradScaler's rule.
    axis_name: inside ``jax.shard_map``, the data axis name(s): ``weight`` is
      this replica's count and each microbatch is summed over the axes as it
      is added, so the state stays identical on every replica. ``None``
      under ``jax.jit`` over global arrays.
    skip_nonfinite_updates: also skip a window whose inner updates come out
      NaN/Inf (two more passes over the updates).

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
    args = dict(locals())  # the constructor's arguments, by name
    del args["self"]
    self._cfg = step.configure(**args)

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
        ``mode``), a tree like the params.
      state: the state from ``init`` or the previous call.
      params: the params (needed by some inner optimizers).
      weight: required: the microbatch's item count (a scalar, may be traced).
      finish: a bool scalar (may be traced): close the window after this one.
      next_loss_scale: the loss scale of the window after a close.
      **extra_args: forwarded to the inner optimizer at a close.

    Returns:
      ``(updates, new_state)``: the inner updates at a close that applied a
      window, zeros otherwise (in ``optax.MultiSteps``' dtypes).

    Raises:
      WeightedAccumulationError: for a missing or invalid ``weight``, another
        state, grads unlike the params, or an invalid ``finish`` /
        ``next_loss_scale``.
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
