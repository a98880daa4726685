"""A dynamic loss scale's configuration: its factors, floor, scale and
growth tracker."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation.values import SCALE_NOUN
from weighted_accum._src.validation.values import ScaleSource
from weighted_accum._src.validation.values import host_number
from weighted_accum._src.validation.values import is_traced
from weighted_accum._src.validation.values import traced_scalar


def float32_option(
  x: Any, *, what: str, rule: str, low: float = 0.0, high: float = math.inf
) -> float:
  """A static number (``DynamicLossScale``'s factors, floor) rounded to
  float32: normal and in ``(low, high)``."""
  v = None
  if not is_traced(x) and not isinstance(x, (bool, np.bool_)):
    v = float(host_number(x, what=what, noun=rule))
  with np.errstate(over="ignore"):
    v32 = float(np.float32(v)) if v is not None and math.isfinite(v) else v
  ok = v32 is not None and math.isfinite(v32)
  if not (ok and v32 >= np.finfo(np.float32).tiny and low < v32 < high):
    raise WeightedAccumulationError(
      f"{what}: expected {rule} (a static finite positive float32 number), "
      f"got {x!r}."
    )
  return v32


def scaler_scale(x: Any, *, what: str, min_scale: float) -> jax.Array:
  """The current scale as float32: concrete, >= ``min_scale``; traced,
  checked for shape and type (the window validates its value)."""
  if isinstance(x, ScaleSource):
    x = x.scale
  if is_traced(x):
    traced_scalar(x, what, SCALE_NOUN)
    return x.astype(jnp.float32)
  rule = f"a loss scale >= min_scale={min_scale!r}, e.g. 2.0**16"
  v = float(host_number(x, what=what, noun=SCALE_NOUN))
  v32 = float32_option(v, what=what, rule=rule)
  if v32 < min_scale:
    raise WeightedAccumulationError(
      f"{what}: expected {rule}, got {x!r}. Pass a larger scale or a "
      "smaller min_scale."
    )
  return jnp.asarray(np.float32(v32))


def growth_tracker(x: Any, *, what: str, interval: int) -> jax.Array:
  """Consecutive finite windows counted: an int32 in ``[0, interval)``."""
  if is_traced(x):
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim:
      raise WeightedAccumulationError(
        f"{what}: expected an int scalar, got {jax.typeof(x)}."
      )
    return x.astype(jnp.int32)
  is_bool = (
    isinstance(x, (bool, np.bool_)) or getattr(x, "dtype", 0) == np.bool_
  )
  v = None if is_bool else host_number(x, what=what, noun="a count")
  if not isinstance(v, int) or not 0 <= v < interval:
    raise WeightedAccumulationError(
      f"{what}: expected an int in [0, growth_interval={interval}), the "
      f"finite windows since the scale last changed; got {x!r}."
    )
  return jnp.asarray(np.int32(v))
