"""Shared test helpers: the regression model with per-item weights, its
losses, the relative errors the tests compare with, and a hypothesis
strategy of microbatch splits.

A one-hidden-layer regression: item i of a microbatch has weight ``m[i]`` (0
for padding, fractional allowed); the loss SUM is ``sum(m * l)`` and the loss
MEAN is that divided by ``sum(m)`` (NaN for an all-zero microbatch: 0/0).
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np


def rel_err(tree, ref) -> float:
  """Relative L2 error of ``tree`` against ``ref`` over all leaves, in
  float64 NumPy."""
  a = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  b = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref)]
  num = sum(np.sum((x - y) ** 2) for x, y in zip(a, b))
  return float(np.sqrt(num / sum(np.sum(y**2) for y in b)))


def make_params(seed: int = 0, d: int = 5, h: int = 8) -> dict[str, np.ndarray]:
  """Host params of the model: ``d`` inputs, ``h`` hidden units."""
  rng = np.random.default_rng(seed)
  return {
    "w1": (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
    "b1": (0.1 * rng.standard_normal(h)).astype(np.float32),
    "w2": (rng.standard_normal(h) / np.sqrt(h)).astype(np.float32),
  }


def per_item_loss(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return (h @ p["w2"] - y) ** 2


def loss_sum(p, x, y, m):
  return jnp.sum(m * per_item_loss(p, x, y))


def loss_mean(p, x, y, m):
  return loss_sum(p, x, y, m) / jnp.sum(m)  # NaN for an empty microbatch


def max_rel_err(got, ref) -> float:
  """The largest error relative to its leaf's scale: max over leaves of
  ``max|got - ref| / max|ref|``.

  Leaf-scaled, because a single gradient component can be a near-zero
  difference of large terms; there float32 summation order alone moves it
  by 1e-5 of its own size while the error against the leaf is ~1e-7.
  """
  errs = []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    errs.append(np.max(np.abs(a - b)) / np.max(np.abs(b)))
  return float(max(errs))


@st.composite
def row_splits(draw, n: int, max_cuts: int):
  """Cut points of an ``n``-row batch into 1..``max_cuts + 1`` consecutive
  microbatches, each with a loss kind: ``([(start, stop), ...], kinds)``."""
  cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=max_cuts)))
  bounds = [0, *cuts, n]
  kinds = draw(
    st.lists(
      st.sampled_from(["sum", "mean"]),
      min_size=len(bounds) - 1,
      max_size=len(bounds) - 1,
    )
  )
  return list(itertools.pairwise(bounds)), kinds


class Compiles:
  """Counts XLA backend compilations (jax.monitoring's compile event)."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __enter__(self):
    self.n = 0
    jax.monitoring.register_event_duration_secs_listener(self._heard)
    return self

  def _heard(self, event, duration, **_):
    del duration
    self.n += event == self.EVENT

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._heard)
