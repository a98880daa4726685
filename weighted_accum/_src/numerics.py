"""Numerics shared by every path: the exact two-float weight tally, the
precision scaling runs in, bit-level classification of values, and the one
finiteness reduction.

The finiteness reduction is a SUM of ``x * 0`` (0 for a finite value, NaN for
NaN and Inf), not a max: a cross-device max on XLA:CPU drops NaN, a sum
cannot, and XLA fuses it into one read of ``x`` with no temporary (a boolean
``all(isfinite(x))`` materialises one). See ``docs/design.md``
("Finiteness").
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

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
  work dtype, else float32."""
  return np.dtype(np.float64 if np.dtype(work) == np.float64 else np.float32)


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


# ------------------------------------------------------------------ bits --


def _int_view(x: jax.Array) -> tuple[jax.Array, Any]:
  dt = np.dtype(x.dtype)
  ibits = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[dt.itemsize]
  return lax.bitcast_convert_type(x, ibits), ibits


def is_normal_or_zero(x: jax.Array) -> jax.Array:
  """False for subnormal values, decided on the bits: XLA:CPU flushes
  subnormals to zero in some fusions and not in others, so a comparison such
  as ``x > 0`` cannot be trusted to classify them."""
  fi = jnp.finfo(x.dtype)
  bits, ibits = _int_view(x)
  magnitude = bits & np.array((1 << (8 * fi.dtype.itemsize - 1)) - 1, ibits)
  exp_mask = np.array(((1 << fi.nexp) - 1) << fi.nmant, ibits)
  return ((magnitude & exp_mask) != 0) | (magnitude == 0)


def nonzero(x: Any) -> jax.Array:
  """``x != 0`` decided on the bits (a subnormal is non-zero even where
  XLA:CPU flushes it in comparisons; NaN is non-zero)."""
  x = jnp.asarray(x)
  bits, ibits = _int_view(x)
  sign_off = np.array((1 << (8 * np.dtype(x.dtype).itemsize - 1)) - 1, ibits)
  return (bits & sign_off) != 0


# ------------------------------------------------------------ finiteness --


def nonfinite_mark(x: jax.Array) -> jax.Array:
  """A float32 scalar: 0 when every value of ``x`` is finite, NaN when one is
  NaN or Inf (0 for an empty array).

  Marks add (``+``), survive any ``psum`` (0 times the replica count is 0,
  NaN stays NaN) and are read with ``jnp.isnan``: a NaN-safe reduction where
  a max is not.
  """
  x = jnp.asarray(x)
  if x.size == 0:
    return jnp.zeros((), jnp.float32)
  return jnp.sum(x * jnp.zeros((), x.dtype)).astype(jnp.float32)


def nan_mark(x: jax.Array) -> jax.Array:
  """A float32 scalar: NaN when a value of ``x`` is NaN, else 0 (Inf does
  not count: ``min(|x|, max)`` is finite for it). Composes as
  :func:`nonfinite_mark`."""
  x = jnp.asarray(x)
  if x.size == 0:
    return jnp.zeros((), jnp.float32)
  top = jnp.asarray(jnp.finfo(x.dtype).max, x.dtype)
  clipped = jnp.minimum(jnp.abs(x), top)
  return jnp.sum(clipped * jnp.zeros((), x.dtype)).astype(jnp.float32)


def tree_mark(tree: Any, mark=nonfinite_mark) -> jax.Array:
  """The sum of ``mark`` over the leaves of ``tree`` (0 for no leaves)."""
  marks = [mark(x) for x in jax.tree.leaves(tree)]
  return sum(marks[1:], marks[0]) if marks else jnp.zeros((), jnp.float32)


def all_finite(tree: Any) -> jax.Array:
  """True when every value of ``tree`` is finite (one fused read per leaf;
  see :func:`nonfinite_mark`). Local to this device's values inside
  ``shard_map``: a global decision reduces the mark instead
  (``window.global_mark``)."""
  return ~jnp.isnan(tree_mark(tree))
