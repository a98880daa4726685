"""A tiny causal language model and a synthetic variable-length dataset.

Used by the tests, the notebooks and ``examples/toy_lm_demo.py``. Everything is
generated in code and deterministic: no download. Import it with
``examples/`` on ``sys.path`` (``tests/conftest.py`` and the notebooks put it
there).

The loss is next-token cross-entropy over padded sequences; a sequence of
length ``n`` predicts ``n - 1`` tokens, so a microbatch's effective weight is
``sum(max(n - 1, 0))`` and differs from microbatch to microbatch.
"""

from __future__ import annotations

from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 32


class Batch(NamedTuple):
  """Padded token ids ``[B, L]`` and the true length of each row ``[B]``."""

  tokens: jax.Array
  lengths: jax.Array


def make_dataset(
  num_sequences: int = 64, max_len: int = 24, seed: int = 0, min_len: int = 0
) -> Batch:
  """Deterministic sequences of very unequal length from a noisy rule.

  Each sequence follows ``t[i+1] = (3 * t[i] + 1) mod VOCAB`` with 10% random
  tokens, so the model has something to learn. Lengths are drawn from
  ``[min_len, max_len]`` with many short rows, as after packing leftovers.
  """
  rng = np.random.default_rng(seed)
  lengths = np.minimum(
    max_len, min_len + rng.geometric(1.0 / (max_len / 3), num_sequences) - 1
  )
  tokens = np.zeros((num_sequences, max_len), np.int32)
  for b, n in enumerate(lengths):
    t = rng.integers(VOCAB)
    for i in range(n):
      tokens[b, i] = t
      t = (3 * t + 1) % VOCAB if rng.random() > 0.1 else rng.integers(VOCAB)
  return Batch(jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32))


def split(
  batch: Batch, sizes: list[int] | tuple[int, ...], pad_to: int | None = None
) -> list[Batch]:
  """Splits a batch into consecutive microbatches of the given row counts.

  With ``pad_to``, each microbatch is padded with empty rows (length 0, so
  no predicted tokens) to ``pad_to`` rows: every microbatch then has one
  shape, and a jitted gradient compiles once, as in a real input pipeline.
  """
  all_tokens, all_lengths = np.asarray(batch.tokens), np.asarray(batch.lengths)
  out, start = [], 0
  for s in sizes:
    tokens = all_tokens[start : start + s]
    lengths = all_lengths[start : start + s]
    if pad_to is not None:
      if s > pad_to:
        raise ValueError(f"a microbatch of {s} rows exceeds pad_to={pad_to}")
      tokens = np.pad(tokens, ((0, pad_to - s), (0, 0)))
      lengths = np.pad(lengths, (0, pad_to - s))
    out.append(Batch(jnp.asarray(tokens), jnp.asarray(lengths)))
    start += s
  if start != batch.tokens.shape[0]:
    raise ValueError(f"sizes {sizes} do not cover {batch.tokens.shape[0]} rows")
  return out


class TinyLM(nnx.Module):
  """Embedding, one causal self-attention block with an MLP, unembedding."""

  def __init__(
    self, *, dim: int = 32, heads: int = 2, max_len: int = 32, rngs: nnx.Rngs
  ):
    self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
    self.pos = nnx.Param(
      jax.random.normal(rngs.params(), (max_len, dim)) * 0.02
    )
    self.attn = nnx.MultiHeadAttention(
      num_heads=heads, in_features=dim, decode=False, rngs=rngs
    )
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)
    self.head = nnx.Linear(dim, VOCAB, rngs=rngs)

  def __call__(
    self,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """Logits ``[B, L, VOCAB]``. Packed rows (``segment_ids``, 0 on
    padding, and ``positions`` restarting at 0 per segment, as a packing
    plan gives them): attention is masked by causal AND same segment, so
    each segment computes what it would alone."""
    if positions is None:
      positions = jnp.arange(tokens.shape[1])
    x = self.embed(tokens) + self.pos[positions]
    mask = nnx.make_causal_mask(tokens)
    if segment_ids is not None:
      same = nnx.make_attention_mask(segment_ids, segment_ids, jnp.equal)
      mask = nnx.combine_masks(mask, same)
    x = x + self.attn(self.norm1(x), mask=mask)
    x = x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))
    return self.head(x)


def token_losses(model: TinyLM, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """Per-token next-token losses ``[B, L-1]`` and their 0/1 mask."""
  logits = model(batch.tokens)[:, :-1]
  targets = batch.tokens[:, 1:]
  pos = jnp.arange(targets.shape[1])[None, :]
  mask = (pos < (batch.lengths[:, None] - 1)).astype(jnp.float32)
  losses = -jnp.take_along_axis(
    jax.nn.log_softmax(logits), targets[..., None], axis=-1
  )[..., 0]
  return losses, mask


def weight(batch: Batch) -> jax.Array:
  """The effective item count of a microbatch: its predicted tokens."""
  return jnp.sum(jnp.maximum(batch.lengths - 1, 0)).astype(jnp.float32)


def sum_loss(model: TinyLM, batch: Batch) -> jax.Array:
  """The microbatch's loss SUM over its valid tokens."""
  losses, mask = token_losses(model, batch)
  return jnp.sum(losses * mask)


def mean_loss(model: TinyLM, batch: Batch) -> jax.Array:
  """The microbatch's loss MEAN over its valid tokens (0/0 = NaN if none)."""
  losses, mask = token_losses(model, batch)
  return jnp.sum(losses * mask) / jnp.sum(mask)


def rel_err(tree, ref) -> float:
  """Relative L2 error of ``tree`` against ``ref`` over all leaves, in
  float64 NumPy (the demo's table, the tests)."""
  a = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  b = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref)]
  num = sum(np.sum((x - y) ** 2) for x, y in zip(a, b))
  return float(np.sqrt(num / sum(np.sum(y**2) for y in b)))
