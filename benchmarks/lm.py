"""The Flax NNX causal LM and the unequal-length token data of the
end-to-end and in-step families."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def make_lm(cfg: dict) -> tuple[Any, Callable[..., Any]]:
  """A pre-norm transformer LM (learned positions, causal + padding mask).

  Args:
    cfg: ``vocab``, ``dim``, ``layers``, ``heads``, ``seq``.

  Returns:
    ``(params, losses)``: the ``nnx.Param`` state and ``losses(p, tokens,
    lengths) -> (loss SUM over valid next-token targets, their count)``.
  """
  from flax import nnx

  dim, seq, vocab = cfg["dim"], cfg["seq"], cfg["vocab"]

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(
        num_heads=cfg["heads"], in_features=dim, decode=False, rngs=rngs
      )
      self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
      self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
      self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.attn(self.ln1(x), mask=mask)
      return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, dim, rngs=rngs)
      self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, dim)) * 0.02)
      self.blocks = nnx.List([Block(rngs) for _ in range(cfg["layers"])])
      self.ln_f = nnx.LayerNorm(dim, rngs=rngs)
      self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens, lengths):
      valid = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
      mask = nnx.combine_masks(
        nnx.make_attention_mask(valid, valid), nnx.make_causal_mask(tokens)
      )
      x = self.embed(tokens) + self.pos[: tokens.shape[1]]
      for block in self.blocks:
        x = block(x, mask)
      return self.head(self.ln_f(x))

  # One jitted init (eagerly, every initializer would compile on its own).
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: LM(nnx.Rngs(0))), nnx.Param)
  params = jax.jit(lambda: nnx.split(LM(nnx.Rngs(0)), nnx.Param)[1])()

  def losses(p, tokens, lengths):
    logits = nnx.merge(graphdef, p)(tokens, lengths)[:, :-1]
    mask = jnp.arange(seq - 1)[None] < (lengths[:, None] - 1)
    nll = -jnp.take_along_axis(
      jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1
    )[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask.astype(jnp.float32))

  return params, losses


def n_params(params: Any) -> int:
  """Parameters of a tree of arrays."""
  return sum(int(x.size) for x in jax.tree.leaves(params))


def token_batch(cfg: dict, rows: int, max_len: int, seed: int):
  """``rows`` token rows of length ``seq`` with valid lengths in
  ``[1, max_len]``; returns ``(tokens, lengths, valid next-token targets)``.
  """
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, max_len + 1, rows).astype(np.int32)
  tokens = rng.integers(0, cfg["vocab"], (rows, cfg["seq"])).astype(np.int32)
  n = int(np.sum(np.maximum(lengths - 1, 0)))
  return jnp.asarray(tokens), jnp.asarray(lengths), n
