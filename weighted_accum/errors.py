"""The library's error type, ``WeightedAccumulationError``, and the checks of
single input values (weight, loss scale, work dtype).

Structural faults always raise; value faults raise when the value is concrete
and are handled safely under ``jit``: see the error model in
``docs/design.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["WeightedAccumulationError"]


class WeightedAccumulationError(ValueError):
  """Raised when weighted accumulation is given input it cannot use safely.

  Every message says what was wrong, where (the leaf path or the field), and
  what to do about it. Raising never modifies the caller's state: all functions
  of this library are pure.

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


def is_traced(x: Any) -> bool:
  """True when ``x`` is an abstract value inside a JAX transformation."""
  return isinstance(x, jax.core.Tracer)


def concrete_float(x: Any) -> float | None:
  """Returns ``x`` as a Python float when it is concrete, else ``None``."""
  if is_traced(x):
    return None
  return float(np.asarray(x))


def check_floating_dtype(dtype: Any, *, what: str) -> jnp.dtype:
  """Returns ``dtype`` canonicalised, or raises if it is not a usable float.

  The one dtype path (``weighted_accum._inputs.work_dtype``).
  """
  from weighted_accum import _inputs  # pylint: disable=g-import-not-at-top

  return _inputs.work_dtype(dtype, what=what)


def check_loss_scale(
  loss_scale: Any, *, what: str = "loss_scale", dtype: Any = np.float32
) -> Any:
  """Converts a loss scale to its stored dtype, raising if a concrete one is
  not a finite positive normal number there (a traced invalid one becomes
  NaN: see ``weighted_accum._inputs.loss_scale``)."""
  from weighted_accum import _inputs  # pylint: disable=g-import-not-at-top

  return _inputs.loss_scale(loss_scale, what=what, dtype=dtype)


def check_weight(
  weight: Any, *, what: str = "weight", tally: Any = np.float32
) -> Any:
  """Converts a weight to the tally dtype (an ``_inputs.Weight``), raising
  for a non-scalar or non-real weight and for a concrete one the tally cannot
  hold (see ``weighted_accum._inputs.weight``)."""
  from weighted_accum import _inputs  # pylint: disable=g-import-not-at-top

  return _inputs.weight(weight, what=what, tally=tally)
