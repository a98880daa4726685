"""Scalars a caller hands in (host numbers, work dtypes, weights, loss
scales), each converted to the value to store and validated after the
conversion; and what a value is to JAX (traced, varying, normal on its
bits), which the core reads too."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError

#: Largest count a counter (int32) holds.
INT32_MAX = 2**31 - 1
#: Integer weights are exact in the float32 (hi, lo) tally below this.
EXACT_INT_LIMIT = 2**48
#: What ``mode`` may be: the kind of loss each microbatch's grads are of.
MODES = ("mean", "sum")
WEIGHT_NOUN = "the microbatch's item count (tokens, samples)"
SCALE_NOUN = "the factor every loss of the window is multiplied by"


def is_traced(x: Any) -> bool:
  """True when ``x`` is an abstract value inside a JAX transformation."""
  return isinstance(x, jax.core.Tracer)


def varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` mesh axes ``x`` varies over (empty outside one)."""
  aval = jax.typeof(x)
  v = getattr(aval, "vma", None)
  if v is None:
    v = getattr(getattr(aval, "mat", None), "varying", frozenset())
  return frozenset(v)


def int_view(x: jax.Array) -> tuple[jax.Array, Any]:
  """``x``'s bits as a signed int array of its width, and that int dtype."""
  ibits = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[np.dtype(x.dtype).itemsize]
  return lax.bitcast_convert_type(x, ibits), ibits


def is_normal_or_zero(x: jax.Array) -> jax.Array:
  """False for subnormal values, decided on the bits: XLA:CPU flushes
  subnormals to zero in some fusions and not in others, so a comparison such
  as ``x > 0`` cannot be trusted to classify them."""
  fi = jnp.finfo(x.dtype)
  bits, ibits = int_view(x)
  magnitude = bits & np.array((1 << (8 * fi.dtype.itemsize - 1)) - 1, ibits)
  exp_mask = np.array(((1 << fi.nexp) - 1) << fi.nmant, ibits)
  return ((magnitude & exp_mask) != 0) | (magnitude == 0)


class ScaleSource:
  """Base of objects standing for their ``scale`` wherever a loss scale is
  accepted (:class:`~weighted_accum.DynamicLossScale`)."""

  __slots__ = ()
  scale: Any


def _real(dt: np.dtype) -> bool:
  kinds = (jnp.bool_, jnp.integer, jnp.floating)
  return any(jnp.issubdtype(dt, k) for k in kinds)


def host_number(x: Any, *, what: str, noun: str) -> int | float:
  """A concrete real scalar as an exact Python ``int`` or ``float``."""
  if isinstance(x, bool):
    return int(x)
  if isinstance(x, (int, float)):
    return x
  try:
    a = None if x is None or isinstance(x, (str, bytes)) else np.asarray(x)
  except (TypeError, ValueError):
    a = None
  if a is None or a.dtype == object or not _real(a.dtype):
    raise WeightedAccumulationError(
      f"{what}: expected a real number, {noun}; got {x!r} ({type(x).__name__})."
    )
  if a.ndim != 0:
    raise WeightedAccumulationError(
      f"{what} has shape {a.shape}; expected a scalar, {noun} (pass "
      "x.reshape(()) of a 1-element array)."
    )
  if jnp.issubdtype(a.dtype, jnp.floating):
    return float(a.astype(np.float64))
  return int(a.item())


def traced_scalar(x: Any, what: str, noun: str) -> np.dtype:
  """Checks a traced value is a real 0-d scalar; returns its dtype."""
  if x.ndim != 0 or not _real(np.dtype(x.dtype)):
    raise WeightedAccumulationError(
      f"{what} is {jax.typeof(x)}; expected a real scalar, {noun}."
    )
  return np.dtype(x.dtype)


def work_dtype(dtype: Any, *, what: str) -> np.dtype:
  """The canonical floating work dtype (not 8-bit, float64 only with x64)."""
  try:
    dt = jnp.dtype(dtype)
  except (TypeError, ValueError) as e:
    raise WeightedAccumulationError(
      f"{what}: {dtype!r} is not a dtype. Pass jnp.float32, jnp.bfloat16 "
      "or jnp.float16."
    ) from e
  ok = jnp.issubdtype(dt, jnp.floating) and dt.itemsize >= 2
  if not ok or (dt.itemsize == 8 and not jax.config.jax_enable_x64):
    why = "needs jax_enable_x64, which is off" if ok else "cannot hold sums"
    raise WeightedAccumulationError(
      f"{what}: expected a floating work dtype, got {dt} ({why}). Pass "
      "jnp.float32 (recommended), jnp.bfloat16 or jnp.float16."
    )
  return dt


class Weight(NamedTuple):
  """A converted weight: ``hi + lo`` in the tally dtype, ``ok`` its validity
  (an invalid traced weight has ``hi == lo == 0``)."""

  hi: Any
  lo: Any
  ok: Any


def weight(x: Any, *, what: str, tally: Any = np.float32) -> Weight:
  """A weight in the tally dtype: concrete, refused unless stored exactly
  (``docs/inputs.md``); traced, its validity in ``ok``."""
  tally = np.dtype(tally)
  if isinstance(x, Weight):
    return x
  if is_traced(x):
    return _traced_weight(x, what, tally)
  v = host_number(x, what=what, noun=WEIGHT_NOUN)
  fi = np.finfo(tally)
  if not (math.isfinite(v) and v >= 0):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is not a finite non-negative number, {WEIGHT_NOUN}. "
      "Use 0 for a fully masked microbatch; the state is unchanged."
    )
  if v > float(fi.max) or (isinstance(v, int) and v >= EXACT_INT_LIMIT):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is beyond the {tally} weight tally (integers below "
      "2**48). Scale all weights down by a common factor."
    )
  if 0 < v < float(fi.tiny):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is subnormal in {tally}; the tally would flush it to "
      "zero. Pass 0 to skip the microbatch, or scale all weights up."
    )
  hi = tally.type(v)
  lo = tally.type(v - (int(hi) if isinstance(v, int) else float(hi)))
  if abs(float(lo)) < float(fi.tiny):
    lo = tally.type(0)
  return Weight(hi, lo, np.bool_(True))


def _traced_weight(x: jax.Array, what: str, tally: np.dtype) -> Weight:
  """:func:`weight` of a traced value."""
  dt = traced_scalar(x, what, WEIGHT_NOUN)
  if dt == np.bool_ or jnp.issubdtype(dt, jnp.integer):
    xi = x.astype(jnp.int32) if dt.itemsize < 4 or dt == np.bool_ else x
    ok = jnp.asarray(
      (xi >= 0) if jnp.issubdtype(xi.dtype, jnp.signedinteger) else True
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
    lo = jnp.zeros((), tally)
    if dt.itemsize > tally.itemsize:
      lo = (x - hi.astype(dt)).astype(tally)
    fi = jnp.finfo(tally)
    ok = jnp.isfinite(hi) & (hi >= 0) & (hi <= fi.max) & is_normal_or_zero(hi)
    lo = jnp.where(is_normal_or_zero(lo) & jnp.isfinite(lo), lo, 0)
  zero = jnp.zeros((), tally)
  return Weight(jnp.where(ok, hi, zero), jnp.where(ok, lo, zero), ok)


def loss_scale(
  x: Any, *, what: str, dtype: Any = np.float32, noun: str = SCALE_NOUN
) -> Any:
  """A loss scale (or a :class:`ScaleSource`'s) in its stored dtype: a
  concrete invalid one refused, a traced one NaN (the window unusable)."""
  dtype = np.dtype(dtype)
  if isinstance(x, ScaleSource):
    x = x.scale
  if is_traced(x):
    traced_scalar(x, what, noun)
    v = x.astype(dtype)
    return jnp.where(scale_ok(v), v, jnp.asarray(np.nan, dtype))
  v = host_number(x, what=what, noun=noun)
  fi = np.finfo(dtype)
  stored = math.inf if v > float(fi.max) else float(dtype.type(v))
  if not (math.isfinite(stored) and stored >= float(fi.tiny)):
    raise WeightedAccumulationError(
      f"{what} is {v!r}; expected a finite positive normal {dtype} number "
      f"in [{float(fi.tiny):.4g}, {float(fi.max):.4g}], {noun}."
    )
  return dtype.type(v)


def optional_loss_scale(x: Any, *, what: str, dtype: Any = np.float32) -> Any:
  """:func:`loss_scale`, or ``None`` (keep the current scale)."""
  return None if x is None else loss_scale(x, what=what, dtype=dtype)


def scale_ok(ls: jax.Array) -> jax.Array:
  """A stored loss scale is usable: finite, positive and normal."""
  ls = jnp.asarray(ls)
  return jnp.isfinite(ls) & (ls > 0) & is_normal_or_zero(ls)


def nonempty_window(state: Any, *, what: str) -> None:
  """Eagerly refuses a concrete window of zero total weight."""
  total = state.total_weight
  if not total > 0:
    count = lambda name: int(np.sum(getattr(state, name)))
    raise WeightedAccumulationError(
      f"{what}: the window's total weight is {total!r} after "
      f"{count('issued')} microbatch(es) ({count('zero_weight')} of weight "
      f"0, {count('rejected')} rejected): no mean to take, nothing cleared. "
      "Accumulate more, or use finish_sums for a cross-replica reduction."
    )
