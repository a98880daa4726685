"""The library's error type, ``WeightedAccumulationError``, and the checks of
single input values (weight, loss scale, work dtype).

Structural faults always raise; value faults raise when the value is concrete
and are handled safely under ``jit``: see the error model in
``docs/design.md``.
"""

from __future__ import annotations

import math
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
  """Returns ``dtype`` canonicalised, or raises if it is not a usable float."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise WeightedAccumulationError(
        f"{what}: {dtype!r} is not a dtype. Pass a floating dtype such as "
        "jnp.float32, jnp.bfloat16 or jnp.float16.") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise WeightedAccumulationError(
        f"{what}: dtype {dt} is not floating point; gradient sums need a "
        "floating work dtype. Pass jnp.float32 (recommended), jnp.bfloat16 or "
        "jnp.float16.")
  if dt.itemsize == 8 and not jax.config.jax_enable_x64:
    raise WeightedAccumulationError(
        f"{what}: dtype {dt} needs jax_enable_x64, which is off, so JAX would "
        "silently use float32. Enable it with "
        "jax.config.update('jax_enable_x64', True) or pass jnp.float32.")
  return dt


def check_loss_scale(loss_scale: Any, *, what: str = "loss_scale") -> None:
  """Raises if a concrete loss scale is not a finite positive scalar."""
  if np.ndim(loss_scale) != 0:
    raise WeightedAccumulationError(
        f"{what}: expected a scalar, got shape {np.shape(loss_scale)}. Pass "
        "one number for the whole window.")
  value = concrete_float(loss_scale)
  if value is not None and not (math.isfinite(value) and value > 0):
    raise WeightedAccumulationError(
        f"{what}: {value!r} is not a finite positive number. The loss scale "
        "multiplies every loss of the window and is divided out once at "
        "finish; pass e.g. 1.0, or 2.0**15 for float16 training.")


def check_weight(weight: Any, *, what: str = "weight") -> None:
  """Raises for a non-scalar weight, and for a concrete invalid one."""
  if np.ndim(weight) != 0:
    raise WeightedAccumulationError(
        f"{what}: expected a scalar effective item count, got shape "
        f"{np.shape(weight)}. Pass e.g. mask.sum() for the microbatch.")
  dt = jnp.result_type(weight)
  if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)
          or jnp.issubdtype(dt, jnp.bool_)):
    raise WeightedAccumulationError(
        f"{what}: dtype {dt} is not a real number. Pass the microbatch's "
        "token or sample count.")
  value = concrete_float(weight)
  # The tally keeps weights in float32: a larger value would become Inf there.
  if value is not None and not (math.isfinite(value) and value >= 0 and
                                value <= float(np.finfo(np.float32).max)):
    raise WeightedAccumulationError(
        f"{what}: {value!r} is not a finite non-negative float32 number. The "
        "weight is the microbatch's effective item count (tokens, samples); "
        "use 0 for a fully masked microbatch. The state was left unchanged.")
