"""Private arithmetic shared by accumulation and finishing: the precision
scaling runs in, and a mean-loss microbatch's weighted contribution."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def compute_dtype(dtype: Any) -> jnp.dtype:
  """Precision for scaling: at least float32 (no float16 overflow)."""
  return jnp.promote_types(dtype, jnp.float32)


def mean_contribution(g: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
  """``cast(g, dtype) * weight``: converted first, multiplied in >= float32."""
  return (g.astype(dtype).astype(compute_dtype(dtype)) * weight).astype(dtype)
