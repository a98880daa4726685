"""One conversion and validation path per kind of input.

Every public entry point converts its scalar inputs here, and validates the
value that will be STORED, after the conversion: a NumPy ``int64`` weight is
not wrapped to int32, a loss scale of ``1e39`` (``inf`` in float32) or
``1e-46`` (``0`` in float32) is refused, a weight whose float32 tally would
flush it to zero is refused. Concrete values are checked on the host (and
come back as host NumPy scalars, so a value committed to another device never
meets the buffers inside a kernel); traced values are converted with the same
rules and come back with a validity flag, because under ``jax.jit`` a Python
exception cannot depend on them. The rules and the behaviour under ``jit`` are
tabulated in ``docs/inputs.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from weighted_accum.errors import WeightedAccumulationError

#: Largest count a counter (int32) holds.
INT32_MAX = 2**31 - 1
#: Integer weights are exact in the float32 (hi, lo) tally below this.
EXACT_INT_LIMIT = 2**48


def _is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


# ------------------------------------------------------------------ dtypes --


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


def tally_dtype(work: Any) -> np.dtype:
  """The dtype of the weight tally (``weight_hi``/``weight_lo``) and of the
  loss scale: float64 for a float64 work dtype, else float32."""
  return np.dtype(np.float64 if np.dtype(work) == np.float64 else np.float32)


# --------------------------------------------------------- host scalars --


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
  if a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.integer):
    return int(a.item())
  if jnp.issubdtype(a.dtype, jnp.floating):
    return float(a.astype(np.float64))
  raise WeightedAccumulationError(
    f"{what}: dtype {a.dtype} is not a real number; expected {noun}."
  )


def _static_shape(x: Any, what: str, noun: str) -> np.dtype:
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


def is_normal_or_zero(x: jax.Array) -> jax.Array:
  """False for subnormal values, decided on the bits: XLA:CPU flushes
  subnormals to zero in some fusions and not in others, so a comparison such
  as ``x > 0`` cannot be trusted to classify them."""
  dt = np.dtype(x.dtype)
  fi = jnp.finfo(dt)
  ibits = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[dt.itemsize]
  bits = lax.bitcast_convert_type(x, ibits)
  magnitude = bits & np.array((1 << (8 * dt.itemsize - 1)) - 1, ibits)
  exp_mask = np.array(((1 << fi.nexp) - 1) << fi.nmant, ibits)
  return ((magnitude & exp_mask) != 0) | (magnitude == 0)


# ------------------------------------------------------------------ weight --


class Weight(NamedTuple):
  """A converted weight: ``hi + lo`` is the value, both in the tally dtype,
  ``lo`` a rounding residual (0 unless the value needs more bits than one
  number of the tally dtype); ``ok`` says it is a valid weight. Invalid
  (traced) weights have ``hi == lo == 0``."""

  hi: Any
  lo: Any
  ok: Any


_WEIGHT_NOUN = "the microbatch's effective item count (tokens, samples)"


def weight(x: Any, *, what: str, tally: Any = np.float32) -> Weight:
  """Converts a weight to the tally dtype, refusing what cannot be stored.

  Concrete: raises for anything but a finite, non-negative real scalar whose
  value the tally holds (no overflow, no flush to zero, integers exact).
  Traced: the same rules decide ``ok``; the shape and dtype are checked.
  """
  tally = np.dtype(tally)
  if _is_traced(x):
    return _traced_weight(x, what, tally)
  v = host_number(x, what=what, noun=_WEIGHT_NOUN)
  return _host_weight(v, what, tally)


def _host_weight(v: int | float, what: str, tally: np.dtype) -> Weight:
  fi = np.finfo(tally)
  if not (math.isfinite(v) and v >= 0):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is not a finite non-negative number. The weight is "
      f"{_WEIGHT_NOUN}; use 0 for a fully masked microbatch. The state was "
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
  if isinstance(v, int):
    lo = tally.type(v - int(hi))
  else:
    lo = tally.type(v - float(hi))
  if abs(float(lo)) < float(fi.tiny):
    lo = tally.type(0)
  return Weight(hi, lo, np.bool_(True))


def _traced_weight(x: jax.Array, what: str, tally: np.dtype) -> Weight:
  dt = _static_shape(x, what, _WEIGHT_NOUN)
  fi = jnp.finfo(tally)
  if dt == np.bool_ or jnp.issubdtype(dt, jnp.integer):
    xi = x.astype(jnp.int32) if dt.itemsize < 4 or dt == np.bool_ else x
    ok = (
      (xi >= 0)
      if jnp.issubdtype(xi.dtype, jnp.signedinteger)
      else (jnp.bool_(True))
    )
    if xi.dtype.itemsize == 8:
      ok = ok & (xi < EXACT_INT_LIMIT)
    # Two parts exactly representable in float32 (< 2**24 significant bits).
    top = (xi >> 24).astype(tally) * np.asarray(2.0**24, tally)
    bottom = (xi & 0xFFFFFF).astype(tally)
    hi = top + bottom
    lo = bottom - (hi - top)
  else:
    hi = x.astype(tally)
    if dt.itemsize > tally.itemsize:
      lo = (x - hi.astype(dt)).astype(tally)
    else:
      lo = jnp.zeros((), tally)
    ok = jnp.isfinite(hi) & (hi >= 0) & (hi <= fi.max) & is_normal_or_zero(hi)
    lo = jnp.where(is_normal_or_zero(lo) & jnp.isfinite(lo), lo, 0)
  zero = jnp.zeros((), tally)
  return Weight(jnp.where(ok, hi, zero), jnp.where(ok, lo, zero), ok)


# -------------------------------------------------------------- loss scale --

_SCALE_NOUN = (
  "the factor every loss of the window is multiplied by (e.g. "
  "1.0, or 2.0**15 for float16 training)"
)


def loss_scale(x: Any, *, what: str, dtype: Any = np.float32) -> Any:
  """Converts a loss scale to its stored dtype (float32, or float64 for a
  float64 work dtype), refusing what cannot be stored.

  Concrete: raises unless the stored value is a finite, positive, normal
  number (``1e39`` would be ``inf`` in float32, ``1e-46`` would be ``0``).
  Traced: an invalid value comes back as NaN, which marks the window as
  unusable (see ``docs/inputs.md``): its microbatches are rejected and its
  finish reports ``valid=False``; nothing is ever divided by it.
  """
  dtype = np.dtype(dtype)
  if _is_traced(x):
    _static_shape(x, what, _SCALE_NOUN)
    v = x.astype(dtype)
    return jnp.where(scale_ok(v), v, jnp.asarray(np.nan, dtype))
  v = host_number(x, what=what, noun=_SCALE_NOUN)
  fi = np.finfo(dtype)
  ok = math.isfinite(v) and v > 0
  if ok:
    if abs(v) > float(fi.max):
      stored = math.inf
    else:
      stored = float(dtype.type(v))
    ok = math.isfinite(stored) and stored >= float(fi.tiny)
  if not ok:
    raise WeightedAccumulationError(
      f"{what} is {v!r}, not a finite positive {dtype} number (stored as "
      f"{dtype}, the scale must lie in [{float(fi.tiny):.4g}, "
      f"{float(fi.max):.4g}]). It is {_SCALE_NOUN}, divided out once at "
      "finish."
    )
  return dtype.type(v)


def scale_ok(ls: jax.Array) -> jax.Array:
  """A stored loss scale is usable: finite, positive and normal."""
  return jnp.isfinite(ls) & (ls > 0) & is_normal_or_zero(ls)


# ---------------------------------------------------------------- counters --


def count(x: Any, *, what: str, name: str) -> int:
  """A concrete counter (int32 in the state) as a Python int in
  ``[0, 2**31)``; whole floats are accepted, booleans are not."""
  if isinstance(x, (bool, np.bool_)) or (
    hasattr(x, "dtype") and np.dtype(x.dtype) == np.bool_
  ):
    raise WeightedAccumulationError(
      f"{what}: counter {name!r} is a bool ({x!r}); it must be a whole "
      "number. Pass the values of state.counters."
    )
  v = host_number(
    x, what=f"{what}: counter {name!r}", noun="a whole number of microbatches"
  )
  if isinstance(v, float):
    if not (math.isfinite(v) and v == int(v)):
      raise WeightedAccumulationError(
        f"{what}: counter {name!r} is {v!r}, not a whole number."
      )
    v = int(v)
  if not 0 <= v <= INT32_MAX:
    raise WeightedAccumulationError(
      f"{what}: counter {name!r} is {v!r}; it must be a whole number in "
      "[0, 2**31). The checkpoint is corrupt or not an accumulator's."
    )
  return v


def positive_int(x: Any, *, what: str, limit: int = INT32_MAX) -> int:
  """A static positive int (e.g. ``every_k``) at most ``limit``: Python or
  NumPy integers only (not bool, not float, not traced)."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
    raise WeightedAccumulationError(
      f"{what}: {x!r} is not an int. Pass a Python int."
    )
  v = int(x)
  if not 1 <= v <= limit:
    raise WeightedAccumulationError(
      f"{what}: {v} is outside [1, {limit}] (the step counters are int32). "
      "Pass a positive Python int."
    )
  return v


# ------------------------------------------------------------------- flags --


def static_flag(x: Any, *, what: str) -> bool:
  """A Python-level bool option (``checked=``): bool or a concrete bool
  scalar; never a traced value or another type."""
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if (
    isinstance(x, jax.Array)
    and not _is_traced(x)
    and x.ndim == 0
    and x.dtype == jnp.bool_
  ):
    return bool(x)
  raise WeightedAccumulationError(
    f"{what}: expected True or False, got {x!r} ({type(x).__name__}). "
    "This option is static: pass a Python bool."
  )


def traced_flag(x: Any, *, what: str) -> jax.Array:
  """A bool scalar that may be traced (``finish=``); ``None`` is False."""
  if x is None:
    return jnp.bool_(False)
  if isinstance(x, (bool, np.bool_)):
    return jnp.bool_(bool(x))
  is_array = isinstance(x, (jax.Array, np.ndarray))
  if not is_array or x.ndim != 0 or x.dtype != np.bool_:
    kind = (
      f"{x.dtype} of shape {x.shape}"
      if is_array
      else f"{x!r} ({type(x).__name__})"
    )
    raise WeightedAccumulationError(
      f"{what}: expected a bool scalar, got {kind}. Pass True, False, None "
      "or a (possibly traced) bool scalar array."
    )
  return x if _is_traced(x) else jnp.asarray(np.asarray(x))


# -------------------------------------------------------------- axis names --


def axis_names(x: Any, *, what: str) -> tuple[str, ...]:
  """A mesh axis name or a sequence of distinct ones, as a tuple."""
  if isinstance(x, str):
    names: tuple[Any, ...] = (x,)
  elif isinstance(x, Sequence):
    names = tuple(x)
  else:
    names = ()
  if (
    not names
    or not all(isinstance(a, str) and a for a in names)
    or len(set(names)) != len(names)
  ):
    raise WeightedAccumulationError(
      f"{what}: axis_name={x!r} is not a mesh axis name; pass the "
      "data-parallel axis, e.g. 'data', or a tuple of distinct names such "
      "as ('data', 'fsdp')."
    )
  return names


def nonzero(x: jax.Array) -> jax.Array:
  """``x != 0`` decided on the bits (a subnormal is non-zero even where
  XLA:CPU flushes it in comparisons; NaN is non-zero)."""
  x = jnp.asarray(x)
  dt = np.dtype(x.dtype)
  ibits = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[dt.itemsize]
  bits = lax.bitcast_convert_type(x, ibits)
  return (bits & np.array((1 << (8 * dt.itemsize - 1)) - 1, ibits)) != 0
