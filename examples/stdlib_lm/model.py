"""A small decoder-only transformer over bytes, in Flax NNX.

Pre-norm blocks of causal self-attention and a GELU MLP, learned positions,
an untied output head over the 257 byte tokens. Rows are right-padded, so
the causal mask alone keeps real tokens from attending to padding; padded
positions are left out of the loss by the row mask.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

from . import data


@dataclasses.dataclass(frozen=True)
class Config:
  """The model's shape.

  Attributes:
    seq_len: targets per row (the model sees ``seq_len`` inputs).
    dim: the residual width.
    layers: transformer blocks.
    heads: attention heads (``dim`` must be divisible by it).
    mlp_ratio: the MLP's hidden width over ``dim``.
  """

  seq_len: int = 512
  dim: int = 128
  layers: int = 4
  heads: int = 4
  mlp_ratio: int = 4


class Block(nnx.Module):
  """One pre-norm transformer block."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.heads = cfg.heads
    self.ln1 = nnx.LayerNorm(cfg.dim, rngs=rngs)
    # No bias: a key bias cannot change the softmax, so its gradient is
    # rounding noise that Adam would blow up to full-size updates.
    self.qkv = nnx.Linear(cfg.dim, 3 * cfg.dim, use_bias=False, rngs=rngs)
    self.proj = nnx.Linear(cfg.dim, cfg.dim, rngs=rngs)
    self.ln2 = nnx.LayerNorm(cfg.dim, rngs=rngs)
    self.up = nnx.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim, rngs=rngs)
    self.down = nnx.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads)
    q, k, v = (qkv[:, :, i] for i in range(3))
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(att.reshape(b, t, d))
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class ByteLM(nnx.Module):
  """The language model: ``tokens[B, T] -> logits[B, T, 257]``."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.embed = nnx.Embed(data.VOCAB, cfg.dim, rngs=rngs)
    init = nnx.initializers.normal(0.02)
    self.pos = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.dim)))
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.ln_f = nnx.LayerNorm(cfg.dim, rngs=rngs)
    self.head = nnx.Linear(cfg.dim, data.VOCAB, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


def init(cfg: Config, seed: int = 0):
  """A fresh model split into its graph and its params.

  The params are created in one compiled call (eager initialisation would
  compile every initialiser separately).

  Returns:
    ``(graphdef, params)``: ``params`` is an ``nnx.State`` of the
    ``nnx.Param`` leaves, the pytree every optimizer here works on.
  """
  make = lambda: ByteLM(cfg, nnx.Rngs(seed))
  graphdef, _ = nnx.split(nnx.eval_shape(make), nnx.Param)
  params = jax.jit(lambda: nnx.split(make(), nnx.Param)[1])()
  return graphdef, params


def num_params(params) -> int:
  """The number of scalars in a params tree."""
  return sum(int(x.size) for x in jax.tree.leaves(params))


def make_losses(graphdef):
  """The loss functions of a model, over a batch ``{"tokens", "mask"}``.

  Returns:
    ``(loss_sum, loss_mean)``: each ``f(params, batch) -> (loss, n)`` with
    ``n`` the batch's target-token count; ``loss_sum`` is the sum of the
    real targets' cross-entropies, ``loss_mean`` that sum over ``n`` (0 for
    a batch without targets).
  """

  def loss_sum(params, batch):
    logits = nnx.merge(graphdef, params)(batch["tokens"][:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    targets = batch["tokens"][:, 1:, None]
    nll = -jnp.take_along_axis(logp, targets, axis=-1)[..., 0]
    mask = batch["mask"]
    return jnp.sum(nll * mask), jnp.sum(mask)

  def loss_mean(params, batch):
    total, n = loss_sum(params, batch)
    return total / jnp.maximum(n, 1.0), n

  return loss_sum, loss_mean
