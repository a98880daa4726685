"""The demo behind ``python -m weighted_accum``: unequal microbatches, three
ways.

A bigram language model (one embedding and one output matrix, pure JAX) on a
deterministic synthetic corpus of sequences whose lengths vary from 1 to 48
tokens. One batch is split into microbatches of equal ROW counts, so they
hold very different numbers of predicted tokens. The table compares, against
the full-batch gradient, the weighted accumulation of this library and the
equal-weight mean of per-microbatch means (what ``optax.MultiSteps``
computes); then each way trains a few windows with Adam. Needs nothing beyond
the package's own dependencies.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from weighted_accum._src.core import accumulation
from weighted_accum._src.core import finishing

VOCAB, DIM, MAX_LEN, ROWS, MICROBATCHES = 48, 16, 48, 64, 8


def make_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Token ids ``[ROWS, MAX_LEN]`` and a mask of the predicted positions.

  Each sequence follows ``t' = (5 t + 3) mod VOCAB`` with 15% noise; lengths
  are geometric (many short rows, a few long ones), as after packing.
  """
  rng = np.random.default_rng(seed)
  lengths = np.minimum(MAX_LEN, rng.geometric(1.0 / 10, ROWS))
  tokens = np.zeros((ROWS, MAX_LEN), np.int32)
  for r, n in enumerate(lengths):
    t = rng.integers(VOCAB)
    for i in range(n):
      tokens[r, i] = t
      t = (5 * t + 3) % VOCAB if rng.random() > 0.15 else rng.integers(VOCAB)
  # Position i predicts token i + 1: a sequence of n tokens has n - 1 targets.
  mask = (np.arange(MAX_LEN - 1)[None, :] < (lengths[:, None] - 1)).astype(
    np.float32
  )
  return tokens, mask


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


def _parts(tokens, mask):
  """The batch's microbatches: equal row counts, unequal token counts."""
  rows = ROWS // MICROBATCHES
  return [
    (tokens[i : i + rows], mask[i : i + rows]) for i in range(0, ROWS, rows)
  ]


_accumulate = jax.jit(accumulation.accumulate_mean, donate_argnums=0)
_finish = jax.jit(finishing.finish_mean, donate_argnums=0)


def weighted(params, tokens, mask):
  """This library: each microbatch's mean gradient weighted by its tokens."""
  state = accumulation.init(params)
  for t, m in _parts(tokens, mask):
    _, g, n = mean_loss_and_grad(params, t, m)
    state = _accumulate(state, g, n)
  out, _ = _finish(state)
  return out.grads


def equal_weight(params, tokens, mask):
  """What ``optax.MultiSteps`` computes: the plain mean of the means."""
  grads = [mean_loss_and_grad(params, t, m)[1] for t, m in _parts(tokens, mask)]
  return jax.tree.map(lambda *g: sum(g) / len(g), *grads)


def full_batch(params, tokens, mask):
  return mean_loss_and_grad(params, tokens, mask)[1]


def gradient_table(params, tokens, mask) -> None:
  counts = [int(m.sum()) for _, m in _parts(tokens, mask)]
  print(
    f"weighted_accum demo: a bigram LM, one batch of {ROWS} sequences split "
    f"into {MICROBATCHES} microbatches of {ROWS // MICROBATCHES} rows"
  )
  print(f"tokens per microbatch: {counts} (total {sum(counts)})\n")
  full = full_batch(params, tokens, mask)
  rows = [
    ("full-batch gradient (reference)", full),
    ("weighted accumulation (weighted_accum)", weighted(params, tokens, mask)),
    (
      "equal-weight accumulation (optax.MultiSteps)",
      equal_weight(params, tokens, mask),
    ),
  ]
  print(f"{'gradient':46s} {'relative error vs full batch':>30s}")
  print("-" * 77)
  for name, g in rows:
    print(f"{name:46s} {rel_err(g, full):30.2e}")
  print()


def train(params0, batches) -> None:
  runs = {
    "full batch": full_batch,
    "weighted_accum": weighted,
    "equal-weight": equal_weight,
  }
  tx = optax.adam(3e-2)
  apply = jax.jit(
    lambda p, o, g: (lambda u, o: (optax.apply_updates(p, u), o))(
      *tx.update(g, o, p)
    )
  )
  params = {k: params0 for k in runs}
  opt = {k: tx.init(params0) for k in runs}
  history: dict[str, list[float]] = {k: [] for k in runs}
  for tokens, mask in batches:
    for k, grad in runs.items():
      history[k].append(float(mean_loss_and_grad(params[k], tokens, mask)[0]))
      params[k], opt[k] = apply(
        params[k], opt[k], grad(params[k], tokens, mask)
      )
  print("training loss (per-token mean) at the start of each window:")
  print(f"{'window':>6s} " + " ".join(f"{k:>16s}" for k in runs))
  for w in range(len(batches)):
    print(f"{w:6d} " + " ".join(f"{history[k][w]:16.5f}" for k in runs))
  drift = {
    k: max(abs(a - b) for a, b in zip(history[k], history["full batch"]))
    for k in runs
  }
  print(
    f"\nmax |loss - full batch loss|: weighted_accum "
    f"{drift['weighted_accum']:.2e}, equal-weight {drift['equal-weight']:.2e}"
  )


def main(argv: list[str] | None = None) -> int:
  """Runs the demo; ``--windows 0`` prints the gradient table only."""
  parser = argparse.ArgumentParser(
    prog="python -m weighted_accum",
    description="Exact gradient accumulation over unequal microbatches: "
    "the full-batch gradient, this library and equal-weight averaging.",
  )
  parser.add_argument(
    "--windows",
    type=int,
    default=8,
    help="optimizer steps (accumulation windows) to train; 0: the gradient "
    "table only",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  t0 = time.perf_counter()
  params = init_params(args.seed)
  batches = [make_batch(args.seed + i) for i in range(max(1, args.windows))]
  gradient_table(params, *batches[0])
  if args.windows > 0:
    train(params, batches[: args.windows])
  print(f"done in {time.perf_counter() - t0:.1f} s on {jax.default_backend()}")
  return 0
