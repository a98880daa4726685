"""Exact running totals of microbatch weights in a pair of float32 numbers
(Knuth's TwoSum); see ``docs/design.md`` ("Exact weight totals").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def two_sum_add(
  hi: jax.Array, lo: jax.Array, x: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Adds ``x`` to the pair ``(hi, lo)`` and renormalises it.

  Args:
    hi: float32 scalar, the leading part of the running total.
    lo: float32 scalar, the rounding error carried beside ``hi``.
    x: float32 scalar to add.

  Returns:
    The new ``(hi, lo)`` with ``|lo| <= ulp(hi) / 2``.
  """
  s = hi + x
  bb = s - hi
  err = (hi - (s - bb)) + (x - bb)
  lo = lo + err
  # Fast two-sum renormalisation (|s| >= |lo| holds after the step above).
  new_hi = s + lo
  new_lo = lo - (new_hi - s)
  return new_hi, new_lo


def split(value: Any) -> tuple[np.float32, np.float32]:
  """Splits a concrete number into float32 ``(hi, lo)`` with ``hi + lo`` exact.

  Exact for integers below 2**48 and for any value representable in
  float32's 48-bit double-float range.
  """
  v = float(value)
  hi = np.float32(v)
  lo = np.float32(v - float(hi))
  return hi, lo


def join(hi: Any, lo: Any) -> float:
  """The value of a concrete pair as a Python float (float64): exact for a
  float32 pair, rounded to float64 for a float64 one."""
  return float(np.float64(np.asarray(hi)) + np.float64(np.asarray(lo)))


def join_traced(hi: jax.Array, lo: jax.Array) -> jax.Array:
  """The pair rounded to its own dtype (float32, or float64 for a float64
  work dtype; usable under ``jit``)."""
  return jnp.asarray(hi) + jnp.asarray(lo)
