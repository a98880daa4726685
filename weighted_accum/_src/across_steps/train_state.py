"""Flax linen: ``TrainState``, whose ``apply_gradients`` forwards a weight to
``tx.update`` (flax's hands its keyword arguments to ``replace``)."""

from __future__ import annotations

from typing import Any

from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState,
)
from weighted_accum._src.errors import WeightedAccumulationError

_OWG = train_state.OVERWRITE_WITH_GRADIENT


class TrainState(train_state.TrainState):
  """A ``flax.training.train_state.TrainState`` for a weighted accumulator.

  Create it as flax's, with ``tx`` a :class:`~weighted_accum.WeightedMultiSteps`
  (or its ``gradient_transformation()``). ``step`` counts microbatches;
  ``opt_state.gradient_step`` counts the windows applied.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import flax.linen as nn
    >>> import weighted_accum as wa
    >>> model = nn.Dense(1)
    >>> x = jnp.ones((4, 2))
    >>> params = model.init(jax.random.key(0), x)['params']
    >>> state = wa.TrainState.create(
    ...     apply_fn=model.apply, params=params,
    ...     tx=wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode='mean'))
    >>> loss = lambda p, x: jnp.mean(state.apply_fn({'params': p}, x) ** 2)
    >>> for n in (4, 1):
    ...   grads = jax.grad(loss)(state.params, x[:n])
    ...   state = state.apply_gradients(grads=grads, weight=n)
    >>> int(state.step), int(state.opt_state.gradient_step)
    (2, 1)
  """

  @classmethod
  def create(
    cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any
  ) -> TrainState:
    """As flax's, ``step`` an int32 array (a restore template; one trace)."""
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    return state.replace(step=jnp.asarray(state.step, jnp.int32))

  def apply_gradients(
    self,
    *,
    grads: Any,
    weight: Any,
    finish: Any = None,
    next_loss_scale: Any = None,
    **kwargs: Any,
  ) -> TrainState:
    """Accumulates one microbatch; at a window's close applies its update.

    Args:
      grads: the microbatch's gradients, shaped like ``params``.
      weight: the microbatch's item count (tokens, samples).
      finish: close the window after this microbatch (a bool scalar).
      next_loss_scale: the loss scale of the window after a close.
      **kwargs: other fields to ``replace``, as in flax.

    Returns:
      The new state (``params`` unchanged mid-window).

    Raises:
      WeightedAccumulationError: when ``tx`` holds no weighted accumulator,
        and as ``WeightedMultiSteps.update``.
    """
    _check_weighted(self.opt_state)
    owg = not hasattr(grads, "shape") and _OWG in grads
    grads_opt = grads["params"] if owg else grads
    params_opt = self.params["params"] if owg else self.params
    kw = dict(weight=weight, finish=finish)
    if next_loss_scale is not None:
      kw["next_loss_scale"] = next_loss_scale
    updates, opt_state = self.tx.update(
      grads_opt, self.opt_state, params_opt, **kw
    )
    new_params = optax.apply_updates(params_opt, updates)
    if owg:
      new_params = {"params": new_params, _OWG: grads[_OWG]}
    return self.replace(
      step=self.step + 1, params=new_params, opt_state=opt_state, **kwargs
    )


def _check_weighted(opt_state: Any) -> None:
  """Refuses a ``tx`` whose state holds no ``WeightedMultiStepsState``."""
  is_ours = lambda x: isinstance(x, WeightedMultiStepsState)
  if not any(map(is_ours, jax.tree.leaves(opt_state, is_leaf=is_ours))):
    raise WeightedAccumulationError(
      "TrainState.apply_gradients(weight=...): tx is no wa.WeightedMultiSteps; weight unused."
    )
