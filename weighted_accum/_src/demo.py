"""The demo behind ``python -m weighted_accum``: ``optax.MultiSteps`` and
``WeightedMultiSteps`` against the full-batch gradient of a bigram language
model (pure JAX) on synthetic sequences of 1 to 48 tokens, split into K
microbatches of equal row counts (so of very unequal token counts).
``examples/demo_training.py`` trains with both around Adam."""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import weighted_accum as wa

VOCAB, DIM, MAX_LEN, ROWS = 48, 16, 48, 64
MICROBATCH_COUNTS = (2, 4, 8, 16)  # K for the gradient table
NEXT_STEPS = (
  "docs/migration.md: from optax.MultiSteps in two lines (mode=, weight=)",
  "docs/microbatching.md: microbatches inside one jitted step",
  "docs/planning.md: variable-length rows planned into a few static shapes",
  "docs/choosing.md: which API for which training loop",
)


def make_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Token ids ``[ROWS, MAX_LEN]`` (``t' = (5 t + 3) mod VOCAB``, 15% noise,
  geometric lengths) and the mask of the predicted positions."""
  rng = np.random.default_rng(seed)
  lengths = np.minimum(MAX_LEN, rng.geometric(1.0 / 10, ROWS))
  tokens = np.zeros((ROWS, MAX_LEN), np.int32)
  for r, n in enumerate(lengths):
    t = rng.integers(VOCAB)
    for i in range(n):
      tokens[r, i] = t
      t = (5 * t + 3) % VOCAB if rng.random() > 0.15 else rng.integers(VOCAB)
  # Position i predicts token i + 1: a sequence of n tokens has n - 1 targets.
  targets = np.arange(MAX_LEN - 1)[None, :] < (lengths[:, None] - 1)
  return tokens, targets.astype(np.float32)


def init_params(seed: int) -> dict[str, jax.Array]:
  key_e, key_w = jax.random.split(jax.random.key(seed))
  return {
    "embed": jax.random.normal(key_e, (VOCAB, DIM)) / np.sqrt(DIM),
    "out": jax.random.normal(key_w, (DIM, VOCAB)) / np.sqrt(DIM),
  }


def token_losses(params: Any, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy at every position, ``[rows, MAX_LEN - 1]``."""
  logits = params["embed"][tokens[:, :-1]] @ params["out"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


@jax.jit
def mean_loss_and_grad(params, tokens, mask):
  """A microbatch's per-token MEAN loss, its gradient and its token count."""

  def loss(p):
    return jnp.sum(mask * token_losses(p, tokens)) / jnp.maximum(mask.sum(), 1)

  value, grads = jax.value_and_grad(loss)(params)
  return value, grads, mask.sum()


def rel_err(tree: Any, ref: Any) -> float:
  """Relative L2 error over all leaves, in float64 NumPy."""
  a = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  b = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref)]
  num = sum(np.sum((x - y) ** 2) for x, y in zip(a, b))
  return float(np.sqrt(num / sum(np.sum(y**2) for y in b)))


def split(tokens, mask, k: int):
  """The K microbatches, each the whole batch with the other rows masked
  out (one shape, so one compilation, for every K)."""
  rows = ROWS // k
  parts = []
  for i in range(0, ROWS, rows):
    own = np.zeros_like(mask)
    own[i : i + rows] = mask[i : i + rows]
    parts.append((tokens, own))
  return parts


WRAPPERS = ("optax.MultiSteps", "WeightedMultiSteps")


@functools.cache
def identity_wrapper(name: str, k: int) -> tuple[Any, Any]:
  """One of ``WRAPPERS`` around ``optax.identity()`` (it emits the window's
  gradient), and its jitted update; only ``WeightedMultiSteps`` gets each
  microbatch's weight."""
  if name == WRAPPERS[0]:
    tx = optax.MultiSteps(optax.identity(), every_k_schedule=k)
    return tx, jax.jit(lambda g, s, n: tx.update(g, s))
  tx = wa.WeightedMultiSteps(optax.identity(), k, mode="mean")
  return tx, jax.jit(lambda g, s, n: tx.update(g, s, weight=n))


def accumulated_gradient(name: str, params, tokens, mask, k: int):
  """The gradient one window of ``k`` microbatches hands its optimizer."""
  tx, update = identity_wrapper(name, k)
  state = tx.init(params)
  for t, m in split(tokens, mask, k):
    _, g, n = mean_loss_and_grad(params, t, m)
    updates, state = update(g, state, n)
  return updates


def gradient_table(params, tokens, mask) -> dict[int, dict[str, float]]:
  """Prints and returns each wrapper's gradient error, for each K."""
  full = mean_loss_and_grad(params, tokens, mask)[1]
  print(
    f"weighted_accum demo: a bigram LM, one batch of {ROWS} sequences of 1 "
    f"to {MAX_LEN} tokens ({int(mask.sum())} predicted tokens), split into K "
    "microbatches of equal row counts\n\ngradient of the batch's per-token "
    "mean loss, relative L2 error vs\nthe full-batch gradient (both wrappers "
    "fed the same microbatch grads)"
  )
  head = f"{'K':>3s}  {'tokens per microbatch':>22s}"
  print(f"{head}  {WRAPPERS[0]:>16s}  {WRAPPERS[1]:>18s}\n{'-' * 65}")
  errors = {}
  for k in MICROBATCH_COUNTS:
    counts = [int(m.sum()) for _, m in split(tokens, mask, k)]
    errors[k] = {
      name: rel_err(accumulated_gradient(name, params, tokens, mask, k), full)
      for name in WRAPPERS
    }
    span = f"{min(counts)} to {max(counts)}"
    print(
      f"{k:3d}  {span:>22s}  {errors[k][WRAPPERS[0]]:16.2e}  "
      f"{errors[k][WRAPPERS[1]]:18.2e}"
    )
  print(
    f"\noptax.MultiSteps averages the K microbatch means with equal weight: "
    f"at K = {k} a token\nof the smallest microbatch ({min(counts)} tokens) "
    f"counts {max(counts) / max(min(counts), 1):.1f}x as much as one of the "
    f"largest ({max(counts)}).\nWeightedMultiSteps weights each microbatch "
    "by its tokens: the full-batch gradient.\n"
  )
  return errors


def main(argv: list[str] | None = None) -> int:
  """Runs the demo: the gradient table."""
  parser = argparse.ArgumentParser(
    prog="python -m weighted_accum",
    description="Exact gradient accumulation over unequal microbatches: "
    "optax.MultiSteps and WeightedMultiSteps against the full batch. "
    "Training with both: examples/demo_training.py in the repository.",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  t0 = time.perf_counter()
  gradient_table(init_params(args.seed), *make_batch(args.seed))
  print("Next, in the repository's docs/ (or the built site):")
  for line in NEXT_STEPS:
    print(f"  {line}")
  print(
    f"\ndone in {time.perf_counter() - t0:.1f} s on {jax.default_backend()}"
  )
  return 0
