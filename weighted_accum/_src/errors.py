"""The library's one exception (the lowest layer; the checks that raise it
are in ``validation``, the error model in ``docs/inputs.md``)."""

from __future__ import annotations


class WeightedAccumulationError(ValueError):
  """Raised when weighted accumulation is given input it cannot use safely.

  Every message says what was wrong, where (the leaf path or the argument),
  and what to do about it. Raising never modifies the caller's state: all
  functions of this library are pure.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(3)})
    >>> try:
    ...   wa.accumulate_sum(state, {'w': jnp.ones(3)}, weight=-1.0)
    ... except wa.WeightedAccumulationError as e:
    ...   print('refused')
    refused
  """
