"""Numerics shared by every path: the exact two-float weight tally, the
precision scaling runs in, bit-level classification of values, and the one
finiteness reduction.

The finiteness reduction is a SUM of ``x - x`` (0 for a finite value, NaN for
NaN and Inf), not a max: a cross-device max on XLA:CPU drops NaN, a sum
cannot, and XLA fuses it into one read of ``x`` with no temporary (a boolean
``all(isfinite(x))`` materialises one, and so does ``x * 0`` for leaves of
one shape: XLA:CPU shares their zero broadcast and writes it out). See
``docs/design.md`` ("Finiteness").
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.validation.values import int_view as _int_view
from weighted_accum._src.validation.values import (
  is_normal_or_zero as is_normal_or_zero,
)

# ------------------------------------------------------------------ tally --


def two_sum_add(
  hi: jax.Array, lo: jax.Array, x: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Adds ``x`` to the unevaluated pair ``(hi, lo)`` (Knuth's TwoSum, then a
  fast renormalisation): the new pair has ``|lo| <= ulp(hi) / 2``."""
  s = hi + x
  bb = s - hi
  err = (hi - (s - bb)) + (x - bb)
  lo = lo + err
  new_hi = s + lo
  return new_hi, lo - (new_hi - s)


def join(hi: Any, lo: Any) -> float | jax.Array:
  """The value of a tally pair: an exact Python float (float64) when
  concrete, the pair rounded to its own dtype when traced."""
  if isinstance(hi, jax.core.Tracer) or isinstance(lo, jax.core.Tracer):
    return jnp.asarray(hi) + jnp.asarray(lo)
  return float(np.float64(np.asarray(hi)) + np.float64(np.asarray(lo)))


def tally_dtype(work: Any) -> np.dtype:
  """The dtype of the weight tally and the loss scale: float64 for a float64
  work dtype, else float32 (``None``, the params' dtype: float32 until
  ``init`` reads it)."""
  wide = work is not None and np.dtype(work) == np.float64
  return np.dtype(np.float64 if wide else np.float32)


# ------------------------------------------- exact sums across replicas --

#: Integer tallies below this are summed exactly across replicas.
LIMB_TOTAL_BITS = 48


def limb_width(replicas: int) -> int:
  """Bits per limb for a sum over ``replicas``: each replica's limb (the sum
  of two limbs of ``w`` bits) is below ``2**(w + 1)`` in magnitude, so the
  float32 sum of ``replicas`` of them is exact when ``replicas * 2**(w + 1)
  <= 2**24`` (12 bits up to 1024 replicas, 11 up to 2048...)."""
  w = 12
  while w > 1 and replicas * 2 ** (w + 1) > 2**24:
    w -= 1
  return w


def split_limbs(x: jax.Array, w: int) -> list[jax.Array]:
  """A float32 scalar as float32 pieces whose exact sum is ``x``: the
  integer part of ``|x|`` in limbs of ``w`` bits (most significant first;
  the top limb takes whatever lies above ``2**48``) and the fraction, each
  with ``x``'s sign. Every step (floor, power-of-two scaling, subtracting a
  multiple of a power of two no larger than the remainder) is exact."""
  n = -(-LIMB_TOTAL_BITS // w)
  sign = jnp.where(x < 0, -1.0, 1.0).astype(x.dtype)
  a = jnp.abs(x)
  rest = jnp.floor(a)
  fraction = (a - rest) * sign
  limbs = []
  for j in reversed(range(n)):
    unit = np.asarray(2.0 ** (w * j), x.dtype)
    q = jnp.floor(rest / unit)
    rest = rest - q * unit
    limbs.append(q * sign)
  return limbs + [fraction]


def join_limbs(parts: list[jax.Array], w: int) -> tuple[jax.Array, jax.Array]:
  """The renormalised pair ``(hi, lo)`` of summed :func:`split_limbs`
  pieces (limbs most significant first, then the fraction): exact for
  integer totals below ``2**48``, the fraction rounded once."""
  n = len(parts) - 1
  hi = lo = jnp.zeros((), parts[0].dtype)
  for j, q in enumerate(parts[:n]):
    unit = np.asarray(2.0 ** (w * (n - 1 - j)), q.dtype)
    hi, lo = two_sum_add(hi, lo, q * unit)
  return two_sum_add(hi, lo, parts[n])


# ------------------------------------------------------------ precision --


def compute_dtype(dtype: Any) -> jnp.dtype:
  """The precision scaling runs in: at least float32 (no float16 overflow)."""
  return jnp.promote_types(dtype, jnp.float32)


def mean_contribution(g: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
  """``cast(g, dtype) * weight``: converted first, multiplied in >= float32."""
  return (g.astype(dtype).astype(compute_dtype(dtype)) * weight).astype(dtype)


def exact_divisor(a: jax.Array, b: jax.Array) -> tuple[jax.Array, ...]:
  """``(exact, d, f1, f2)`` with ``x / (a * b) == ((x / d) * f1) * f2`` where
  ``exact``: ``a`` or ``b`` (positive, normal) is a power of two, so their
  product is ``d`` times a power of two, split into two normal factors.
  ``d`` (in ``[0.5, 1)`` before a growing factor, ``[1, 8)`` before a
  shrinking one) keeps ``x / d`` from over- or underflowing where the
  quotient does not."""
  fi, (ia, it), ib = jnp.finfo(a.dtype), _int_view(a), _int_view(b)[0]
  low, bias = np.array((1 << fi.nmant) - 1, it), fi.maxexp - 1
  unbiased = lambda i: (i >> fi.nmant) - bias  # positive: no sign bit
  e = unbiased(ia) + unbiased(ib)
  exact = ((ia & low) == 0) | ((ib & low) == 0)
  t = jnp.where(e < 0, -1, jnp.minimum(e, 2)).astype(it)
  pow2 = lambda n: lax.bitcast_convert_type(
    (n + bias).astype(it) << fi.nmant, a.dtype
  )
  d = lax.bitcast_convert_type(
    (ia & low) | (ib & low) | ((t + bias) << fi.nmant), a.dtype
  )
  s = t - e.astype(it)
  f1 = jnp.clip(s, fi.minexp, bias)
  return exact, d, pow2(f1), pow2(s - f1)


def computed_once(x: jax.Array) -> jax.Array:
  """``x`` (a scalar or a small vector), computed once for all the loops that
  read it."""
  return jnp.max(jnp.broadcast_to(x, (2, 2) + jnp.shape(x)), axis=0)[0]


# ------------------------------------------------------------------ bits --


def nonzero(x: Any) -> jax.Array:
  """``x != 0`` decided on the bits (a subnormal is non-zero even where
  XLA:CPU flushes it in comparisons; NaN is non-zero)."""
  x = jnp.asarray(x)
  bits, ibits = _int_view(x)
  sign_off = np.array((1 << (8 * np.dtype(x.dtype).itemsize - 1)) - 1, ibits)
  return (bits & sign_off) != 0


# ------------------------------------------------------------ finiteness --


def _zero_or_nan(x: jax.Array) -> jax.Array:
  """0 where ``x`` is finite, NaN where it is NaN or Inf (``inf - inf``)."""
  return x - x


def nonfinite_mark(x: jax.Array) -> jax.Array:
  """A float32 scalar: 0 when every value of ``x`` is finite, NaN when one is
  NaN or Inf (0 for an empty array)."""
  x = jnp.asarray(x)
  if x.size == 0:
    return jnp.zeros((), jnp.float32)
  return jnp.sum(_zero_or_nan(x), dtype=jnp.float32)


def _inf_or_nan(x: jax.Array) -> jax.Array:
  """0 where ``x`` is finite, +Inf where +-Inf, NaN where NaN (a fusable read)."""
  a = jnp.abs(x)
  return a - jnp.minimum(a, jnp.asarray(jnp.finfo(x.dtype).max, x.dtype))


def range_mark(x: jax.Array) -> jax.Array:
  """A float32 scalar: NaN when a value of ``x`` is NaN, else +Inf when one
  is +-Inf, else 0 (0 for an empty array). Composes as
  :func:`nonfinite_mark` (its terms are never negative, so NaN and Inf
  survive any sum): one read tells a NaN (a non-finite pending value, see
  ``window.divide``) from an Inf (a result out of its
  dtype's range)."""
  x = jnp.asarray(x)
  if x.size == 0:
    return jnp.zeros((), jnp.float32)
  return jnp.sum(_inf_or_nan(x), dtype=jnp.float32)


_ELEMENTWISE = {
  nonfinite_mark: _zero_or_nan,
  range_mark: _inf_or_nan,
}
# Leaves of at most this many elements are marked together (see tree_mark);
# larger ones are reduced on their own (XLA's reduction emitter).
_SMALL = 1 << 16
_GROUP = 32


def unpartitioned(x: jax.Array) -> bool:
  """Whether ``x`` is known not to be split over devices by XLA's SPMD
  partitioner: no mesh, only manual axes (inside ``shard_map``), or
  explicit axes its type does not shard it over. A variadic reduction of
  partitioned vectors is all-gathered (a gradient sharded over a model axis
  would be gathered to read its finiteness), so only these are grouped."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return True
  free = {
    a
    for a, t in zip(mesh.axis_names, mesh.axis_types)
    if t != jax.sharding.AxisType.Manual and mesh.shape[a] > 1
  }
  if not free:
    return True
  if any(
    t == jax.sharding.AxisType.Auto
    for a, t in zip(mesh.axis_names, mesh.axis_types)
    if a in free
  ):
    return False  # placed by the partitioner: unknown here
  used = set()
  for entry in sharding.spec:
    used.update(
      () if entry is None else (entry,) if isinstance(entry, str) else entry
    )
  return not used & free


def _group_key(x: jax.Array) -> Any:
  """Leaves that may share one reduction (small, unpartitioned, alike)."""
  if not 0 < x.size <= _SMALL or not unpartitioned(x):
    return None
  placement = None
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    placement = x.sharding
  return x.shape, x.dtype, placement


def _grouped_marks(xs: list[jax.Array], elementwise) -> list[jax.Array]:
  """Marks of same-shaped leaves, one variadic reduction per ``_GROUP``."""
  marks = []
  for i in range(0, len(xs), _GROUP):
    parts = tuple(
      elementwise(x).astype(jnp.float32) for x in xs[i : i + _GROUP]
    )
    marks.extend(
      lax.reduce(
        parts,
        tuple(jnp.zeros((), jnp.float32) for _ in parts),
        lambda a, b: tuple(u + v for u, v in zip(a, b)),
        tuple(range(parts[0].ndim)),
      )
    )
  return marks


def tree_mark(tree: Any, mark=nonfinite_mark) -> jax.Array:
  """The sum of ``mark`` over the leaves of ``tree`` (0 for no leaves)."""
  elementwise = _ELEMENTWISE.get(mark)
  marks, groups = [], {}
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    key = None if elementwise is None else _group_key(x)
    if key is None:
      marks.append(mark(x))
    else:
      groups.setdefault(key, []).append(x)
  for xs in groups.values():
    marks.extend(_grouped_marks(xs, elementwise))
  return sum(marks[1:], marks[0]) if marks else jnp.zeros((), jnp.float32)
