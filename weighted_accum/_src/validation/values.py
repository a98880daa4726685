"""Scalars a caller hands in: host numbers, work dtypes, weights and loss
scales, each converted to the value to store and validated after the
conversion.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.core import numerics
from weighted_accum._src.core.tree_utils import is_traced
from weighted_accum._src.errors import WeightedAccumulationError

#: Largest count a counter (int32) holds.
INT32_MAX = 2**31 - 1
#: Integer weights are exact in the float32 (hi, lo) tally below this.
EXACT_INT_LIMIT = 2**48
#: What ``mode`` may be: the kind of loss each microbatch's grads are of.
MODES = ("mean", "sum")


class ScaleSource:
  """Base of objects that carry a loss scale in their ``scale`` attribute
  (:class:`~weighted_accum.DynamicLossScale`): wherever a loss scale is
  accepted, such an object stands for its current ``scale``."""

  __slots__ = ()
  scale: Any


# ----------------------------------------------------------- host scalars --


def host_number(x: Any, *, what: str, noun: str) -> int | float:
  """A concrete real scalar as an exact Python ``int`` or ``float``.

  Integers (Python, NumPy of any width, bool) stay exact Python ints, so
  nothing wraps; floats of every width become Python floats (exact).

  Raises:
    WeightedAccumulationError: for ``None``, strings, complex numbers,
      non-numeric objects and arrays that are not 0-d.
  """
  if isinstance(x, bool):
    return int(x)
  if isinstance(x, (int, float)):
    return x
  if x is None or isinstance(x, (str, bytes)):
    raise WeightedAccumulationError(
      f"{what}: got {x!r} ({type(x).__name__}); expected a real number, {noun}."
    )
  try:
    a = np.asarray(x)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise WeightedAccumulationError(
      f"{what}: cannot read {type(x).__name__} {x!r} as a number; expected "
      f"a real scalar, {noun}."
    ) from e
  if a.ndim != 0:
    raise WeightedAccumulationError(
      f"{what} has shape {a.shape}, expected a scalar. Pass one number, "
      f"{noun} (e.g. x.item() or x.reshape(()) of a 1-element array)."
    )
  if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
    return int(a.item())
  if jnp.issubdtype(a.dtype, jnp.floating):
    return float(a.astype(np.float64))
  raise WeightedAccumulationError(
    f"{what}: dtype {a.dtype} is not a real number; expected {noun}."
  )


def traced_scalar(x: Any, what: str, noun: str) -> np.dtype:
  """Checks a traced value is a real 0-d scalar; returns its dtype."""
  if x.ndim != 0:
    raise WeightedAccumulationError(
      f"{what} has shape {x.shape}, expected a scalar. Pass one number, "
      f"{noun} (e.g. x.reshape(()) of a 1-element array)."
    )
  dt = np.dtype(x.dtype)
  if not (
    dt == np.bool_
    or jnp.issubdtype(dt, jnp.integer)
    or jnp.issubdtype(dt, jnp.floating)
  ):
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} is not a real number; expected {noun}."
    )
  return dt


# ----------------------------------------------------------------- dtypes --


def work_dtype(dtype: Any, *, what: str) -> np.dtype:
  """The canonical floating work dtype, or a named error.

  Refuses what is not a dtype (any exception of ``jnp.dtype``: strings from a
  corrupt file, objects), non-floating dtypes, 8-bit floats (too narrow to
  hold a sum and, for most, without an infinity), and float64 while
  ``jax_enable_x64`` is off (JAX would silently use float32).
  """
  try:
    dt = jnp.dtype(dtype)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise WeightedAccumulationError(
      f"{what}: {dtype!r} is not a dtype. Pass a floating dtype such as "
      "jnp.float32, jnp.bfloat16 or jnp.float16."
    ) from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} is not floating point; gradient sums need a "
      "floating work dtype. Pass jnp.float32 (recommended), jnp.bfloat16 or "
      "jnp.float16."
    )
  if dt.itemsize < 2:
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} is too narrow to accumulate gradient sums. Pass "
      "jnp.float32 (recommended), jnp.bfloat16 or jnp.float16."
    )
  if dt.itemsize == 8 and not jax.config.jax_enable_x64:
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} needs jax_enable_x64, which is off, so JAX would "
      "silently use float32. Enable it with "
      "jax.config.update('jax_enable_x64', True) or pass jnp.float32."
    )
  return dt


# ----------------------------------------------------------------- weight --


class Weight(NamedTuple):
  """A converted weight: ``hi + lo`` is the value, both in the tally dtype,
  ``lo`` a rounding residual (0 unless the value needs more bits than one
  number of the tally dtype); ``ok`` says it is a valid weight. Invalid
  (traced) weights have ``hi == lo == 0``."""

  hi: Any
  lo: Any
  ok: Any


WEIGHT_NOUN = "the microbatch's effective item count (tokens, samples)"


def weight(x: Any, *, what: str, tally: Any = np.float32) -> Weight:
  """Converts a weight to the tally dtype, refusing what cannot be stored.

  Concrete: raises for anything but a finite, non-negative real scalar whose
  value the tally holds (no overflow, no flush to zero, integers exact), and
  returns host NumPy scalars. Traced: the same rules decide ``ok``; the
  shape and dtype are checked.
  """
  tally = np.dtype(tally)
  if isinstance(x, Weight):
    return x  # already converted by this function
  if is_traced(x):
    return _traced_weight(x, what, tally)
  v = host_number(x, what=what, noun=WEIGHT_NOUN)
  return _host_weight(v, what, tally)


def _host_weight(v: int | float, what: str, tally: np.dtype) -> Weight:
  fi = np.finfo(tally)
  if not (math.isfinite(v) and v >= 0):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is not a finite non-negative number. The weight is "
      f"{WEIGHT_NOUN}; use 0 for a fully masked microbatch. The state was "
      "left unchanged."
    )
  if v > float(fi.max) or (isinstance(v, int) and v >= EXACT_INT_LIMIT):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is beyond what the accumulator's {tally} weight tally "
      f"holds (at most {float(fi.max):.4g}, integers exactly below 2**48). "
      "The weight is an item count: pass the microbatch's count, or scale "
      "all weights down by a common factor."
    )
  if 0 < v < float(fi.tiny):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is below the smallest normal {tally} "
      f"({float(fi.tiny):.4g}); the tally would flush it to zero while its "
      "gradients were added. Pass 0 to skip the microbatch, or scale all "
      "weights up by a common factor."
    )
  hi = tally.type(v)
  lo = tally.type(v - (int(hi) if isinstance(v, int) else float(hi)))
  if abs(float(lo)) < float(fi.tiny):
    lo = tally.type(0)
  return Weight(hi, lo, np.bool_(True))


def _traced_weight(x: jax.Array, what: str, tally: np.dtype) -> Weight:
  dt = traced_scalar(x, what, WEIGHT_NOUN)
  if dt == np.bool_ or jnp.issubdtype(dt, jnp.integer):
    hi, lo, ok = _traced_int_weight(x, dt, tally)
  else:
    fi = jnp.finfo(tally)
    hi = x.astype(tally)
    if dt.itemsize > tally.itemsize:
      lo = (x - hi.astype(dt)).astype(tally)
    else:
      lo = jnp.zeros((), tally)
    ok = (
      jnp.isfinite(hi)
      & (hi >= 0)
      & (hi <= fi.max)
      & numerics.is_normal_or_zero(hi)
    )
    lo = jnp.where(numerics.is_normal_or_zero(lo) & jnp.isfinite(lo), lo, 0)
  zero = jnp.zeros((), tally)
  return Weight(jnp.where(ok, hi, zero), jnp.where(ok, lo, zero), ok)


def _traced_int_weight(x: jax.Array, dt: np.dtype, tally: np.dtype):
  xi = x.astype(jnp.int32) if dt.itemsize < 4 or dt == np.bool_ else x
  ok = (xi >= 0) if jnp.issubdtype(xi.dtype, jnp.signedinteger) else True
  ok = jnp.asarray(ok)
  if xi.dtype.itemsize == 8:
    ok = ok & (xi < EXACT_INT_LIMIT)
  # Two parts exactly representable in float32 (< 2**24 significant bits).
  top = (xi >> 24).astype(tally) * np.asarray(2.0**24, tally)
  bottom = (xi & 0xFFFFFF).astype(tally)
  hi = top + bottom
  return hi, bottom - (hi - top), ok


# ------------------------------------------------------------- loss scale --

SCALE_NOUN = (
  "the factor every loss of the window is multiplied by (e.g. "
  "1.0, or 2.0**15 for float16 training)"
)


def loss_scale(x: Any, *, what: str, dtype: Any = np.float32) -> Any:
  """Converts a loss scale (or a :class:`ScaleSource`'s ``scale``) to its
  stored dtype (float32, or float64 for a float64 work dtype), refusing
  what cannot be stored.

  Concrete: raises unless the stored value is a finite, positive, normal
  number; returns a host NumPy scalar. Traced: an invalid value comes back
  as NaN, which marks the window as unusable (see ``docs/inputs.md``): its
  microbatches are rejected and its finish reports ``valid=False``; nothing
  is ever divided by it.
  """
  dtype = np.dtype(dtype)
  if isinstance(x, ScaleSource):
    x = x.scale
  if is_traced(x):
    traced_scalar(x, what, SCALE_NOUN)
    v = x.astype(dtype)
    return jnp.where(scale_ok(v), v, jnp.asarray(np.nan, dtype))
  v = host_number(x, what=what, noun=SCALE_NOUN)
  fi = np.finfo(dtype)
  stored = math.nan
  if math.isfinite(v) and v > 0:
    stored = math.inf if v > float(fi.max) else float(dtype.type(v))
  if not (math.isfinite(stored) and stored >= float(fi.tiny)):
    raise WeightedAccumulationError(
      f"{what} is {v!r}, not a finite positive {dtype} number (stored as "
      f"{dtype}, the scale must lie in [{float(fi.tiny):.4g}, "
      f"{float(fi.max):.4g}]). It is {SCALE_NOUN}, divided out once at "
      "finish."
    )
  return dtype.type(v)


def optional_loss_scale(x: Any, *, what: str, dtype: Any = np.float32) -> Any:
  """:func:`loss_scale`, or ``None`` (keep the current scale) for ``None``."""
  return None if x is None else loss_scale(x, what=what, dtype=dtype)


def scale_ok(ls: jax.Array) -> jax.Array:
  """A stored loss scale is usable: finite, positive and normal."""
  ls = jnp.asarray(ls)
  return jnp.isfinite(ls) & (ls > 0) & numerics.is_normal_or_zero(ls)


def nonempty_window(state: Any, *, what: str) -> None:
  """Eagerly refuses a concrete window of zero total weight (there is no
  mean to take; nothing is cleared). A stacked window's counts are summed
  over its replicas."""
  total = state.total_weight
  if not total > 0:
    count = lambda name: int(np.sum(getattr(state, name)))
    raise WeightedAccumulationError(
      f"{what}: the window's total weight is {total!r} after "
      f"{count('issued')} microbatch(es) ({count('zero_weight')} of weight "
      f"0, {count('rejected')} rejected), so there is no mean to take. "
      "Nothing was cleared: accumulate more microbatches, or use "
      "finish_sums to hand zero sums to a cross-replica reduction."
    )
