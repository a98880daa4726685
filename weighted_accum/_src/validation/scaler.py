"""A dynamic loss scale's configuration: its factors, floor, scale and
growth tracker.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.core.tree_utils import is_traced
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation.values import SCALE_NOUN
from weighted_accum._src.validation.values import ScaleSource
from weighted_accum._src.validation.values import host_number
from weighted_accum._src.validation.values import traced_scalar

# ------------------------------------------------ dynamic loss scale config --

_F32 = np.finfo(np.float32)


def _config_number(x: Any, *, what: str, noun: str) -> float:
  """A static real number (not traced, not bool)."""
  if is_traced(x):
    raise WeightedAccumulationError(
      f"{what} is a traced value; it is static configuration. Pass a "
      "Python number."
    )
  if isinstance(x, (bool, np.bool_)):
    raise WeightedAccumulationError(
      f"{what}: got {x!r}; expected a real number, {noun}."
    )
  return float(host_number(x, what=what, noun=noun))


def float32_number(x: float, *, what: str, hint: str) -> float:
  """``x`` rounded to float32, refused unless that is a finite, positive,
  normal float32 number."""
  with np.errstate(over="ignore"):
    rounded = float(np.float32(x)) if math.isfinite(x) else x
  if not (math.isfinite(rounded) and rounded >= float(_F32.tiny)):
    raise WeightedAccumulationError(
      f"{what} is {x!r}, which is not a finite positive float32 number "
      f"(range [{float(_F32.tiny):.3g}, {float(_F32.max):.3g}]). {hint}"
    )
  return rounded


def scaler_factor(
  x: Any, *, what: str, low: float, high: float, rule: str
) -> float:
  """A growth or back-off factor: a static number, as float32 in
  ``(low, high)``."""
  v = _config_number(x, what=what, noun=rule)
  v32 = float32_number(v, what=what, hint=f"It must be {rule}.")
  if not low < v32 < high:
    raise WeightedAccumulationError(
      f"{what} is {v!r} (as float32: {v32!r}); it must be {rule} (as in "
      "PyTorch's GradScaler)."
    )
  return v32


def scaler_min_scale(x: Any, *, what: str) -> float:
  """The floor of a back-off: a static finite positive float32 number."""
  v = _config_number(x, what=what, noun="the lowest loss scale")
  return float32_number(v, what=what, hint="Pass e.g. 1.0.")


def scaler_scale(x: Any, *, what: str, min_scale: float) -> jax.Array:
  """A dynamic loss scale's current scale, as a float32 array: a concrete
  one must be a finite positive float32 number >= ``min_scale``; a traced
  one is checked for shape and type (the window validates it when used)."""
  if isinstance(x, ScaleSource):
    x = x.scale
  if is_traced(x):
    traced_scalar(x, what, SCALE_NOUN)
    return x.astype(jnp.float32)
  v = float(host_number(x, what=what, noun=SCALE_NOUN))
  v32 = float32_number(
    v,
    what=what,
    hint="A loss scale is a finite positive float32 number, e.g. 2.0**16 "
    "(GradScaler's default) for float16 training.",
  )
  if v32 < min_scale:
    raise WeightedAccumulationError(
      f"{what} is {v!r}, below min_scale={min_scale!r}; the scale never "
      "backs off below min_scale. Pass a scale >= min_scale, or a smaller "
      "min_scale."
    )
  return jnp.asarray(np.float32(v32))


def growth_tracker(x: Any, *, what: str, interval: int) -> jax.Array:
  """Consecutive finite windows counted: an int32 in ``[0, interval)``."""
  hint = (
    "It counts the consecutive finite windows since the scale last changed; "
    "pass 0 to start counting afresh."
  )
  if is_traced(x):
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim:
      raise WeightedAccumulationError(
        f"{what} must be an int scalar, got {jax.typeof(x)}. {hint}"
      )
    return x.astype(jnp.int32)
  is_bool = (
    isinstance(x, (bool, np.bool_))
    or np.dtype(getattr(x, "dtype", np.int32)) == np.bool_
  )
  v = None if is_bool else host_number(x, what=what, noun="a count")
  if not isinstance(v, int) or not 0 <= v < interval:
    raise WeightedAccumulationError(
      f"{what} is {x!r}; it must be an int in [0, growth_interval="
      f"{interval}). {hint}"
    )
  return jnp.asarray(np.int32(v))
