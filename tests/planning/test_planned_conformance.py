"""A planned step's gradient is the full batch's, for every plan and style.

Each case plans a batch of variable-length rows, runs the planned step
(eagerly, under ``jit``, inside ``shard_map``, under plain ``jit`` with
``axis_name``) and compares its mean loss and gradient with the full batch's,
computed without plans or windows in float64 on the rows themselves (a
split row's pieces as rows of their own, as documented).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from weighted_accum import planning

V, D = 11, 6


def _params(dtype):
  rng = np.random.default_rng(1)
  shapes = {"emb": (V, D), "w": (D, D), "out": (D, V)}
  return {
    k: jnp.asarray(rng.normal(size=s) / 2, dtype) for k, s in shapes.items()
  }


def _token_losses(p, tokens, targets, positions=None):
  """Per-token losses of rows ``[r, L]``: a causal running mean mixes each
  token with those before it in its segment (what a row's padding, or the
  other segments of a packed row, must not change)."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  h = jnp.cumsum(p["emb"][tokens], axis=1)
  before = jnp.arange(tokens.shape[1]) - positions - 1  # the segment's start
  h = h - jnp.where(
    before[..., None] >= 0,
    jnp.take_along_axis(h, jnp.maximum(before, 0)[..., None], 1),
    0.0,
  )
  h = h / (positions + 1)[..., None]
  logits = jnp.tanh(h @ p["w"]) @ p["out"]
  picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return jax.nn.logsumexp(logits, -1) - picked


def _loss_fn(p, mb):
  rows, mask = mb[:2]
  pos = mb.positions if len(mb) == 4 else None  # the spec packs
  tl = _token_losses(p, rows["tokens"], rows["targets"], pos)
  return jnp.sum(tl * mask.astype(tl.dtype)), mask.sum()


def _batch(lengths, seed=0):
  rng = np.random.default_rng(seed)
  t = max(max(lengths), 1)
  tokens = rng.integers(0, V, (len(lengths), t)).astype(np.int32)
  targets = rng.integers(0, V, (len(lengths), t)).astype(np.int32)
  return {"tokens": tokens, "targets": targets}


def _reference(params, batch, packed):
  """Float64 mean loss and gradient of the full batch without plans: the
  planned pieces as rows of one padded batch, masked."""
  pieces = packed.plan.pieces[:, :3]
  width = max(1, int(pieces[:, 2].max(initial=1)))
  at = pieces[:, 1:2] + np.arange(width)
  mask = np.arange(width) < pieces[:, 2:3]
  take = lambda x: np.where(
    mask, x[pieces[:, :1], np.minimum(at, x.shape[1] - 1)], 0
  )

  def mean(p):
    tl = _token_losses(p, take(batch["tokens"]), take(batch["targets"]))
    return jnp.sum(tl * mask) / mask.sum()

  with jax.enable_x64(True):
    p64 = jax.tree.map(
      lambda x: jnp.asarray(np.asarray(x), jnp.float64), params
    )
    loss, grads = jax.value_and_grad(mean)(p64)
    return float(loss), jax.tree.map(np.asarray, grads)


def _rel(got, ref):
  num = sum(
    np.sum((np.asarray(g, np.float64) - r) ** 2)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
  )
  den = sum(np.sum(r**2) for r in jax.tree.leaves(ref))
  return float(np.sqrt(num / den))


PLANS = {
  "buckets": dict(buckets=(4, 8, 16), budget=32, row_divisors=(1, 2)),
  "one_shape": dict(buckets=(16,), budget=16, row_divisors=(1,)),
  "split": dict(
    buckets=(4, 8), budget=16, row_divisors=(1, 4), overlong="split"
  ),
  "packed": dict(buckets=(4, 8, 16), budget=32, row_divisors=(1, 2), pack=True),
  "packed_split": dict(
    buckets=(8,), budget=16, row_divisors=(1,), overlong="split", pack=True
  ),
}
BATCHES = (  # two batches through one compiled step
  [13, 1, 7, 16, 3, 0, 9, 4, 11, 2, 5, 8],
  [2, 16, 5, 0, 8, 3, 12, 1, 7, 4, 6, 15, 10],
)
# Every plan, style and dtype at least once, each case different; the
# eager style (op by op: the dearest) on the smallest plan only.
CASES = [
  ("one_shape", "eager", "float32"),
  ("buckets", "jit", "float32"),
  ("split", "jit", "float32"),
  ("split", "jit", "float64"),
  ("buckets", "shard_map", "float32"),
  ("split", "jit_axis_name", "float32"),
  ("packed", "eager", "float32"),
  ("packed", "jit", "float64"),
  ("packed_split", "jit", "float32"),
  ("packed", "shard_map", "float32"),
  ("packed", "jit_axis_name", "float32"),
  ("packed_split", "jit_axis_name_explicit", "float64"),
]
TOL = {"float32": 2e-6, "float64": 1e-12}


def _step(style, spec, dtype):
  """The planned step of ``spec`` in ``style``: ``f(params, packed)``."""
  axis = "data" if spec.replicas > 1 else None
  f = planning.planned_value_and_grad(
    _loss_fn, spec, mode="sum", dtype=dtype, axis_name=axis
  )
  if style == "eager":
    return f
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  if style.endswith("explicit"):  # what jax.make_mesh builds by default
    mesh = jax.make_mesh((2,), ("data",))
  if style == "shard_map":
    specs = (P(), P("data"))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P()))
  if style.startswith("jit_axis_name"):
    jitted = jax.jit(f)

    def under_mesh(*args):
      with jax.set_mesh(mesh):
        return jitted(*args)

    under_mesh.jitted = jitted
    return under_mesh
  return jax.jit(f)


@pytest.mark.parametrize("plan,style,dtype", CASES)
def test_gradient_is_the_full_batch_gradient(plan, style, dtype):
  with jax.enable_x64(dtype == "float64"):
    replicas = 2 if style in ("shard_map",) or "axis" in style else 1
    spec = planning.PlanSpec(batch_rows=32, replicas=replicas, **PLANS[plan])
    f, params = _step(style, spec, jnp.dtype(dtype)), _params(dtype)
    for seed, lengths in enumerate(BATCHES[: 1 if style == "eager" else 2]):
      batch = _batch(lengths, seed)
      packed = planning.plan_batch(spec, batch, lengths, seed=3)
      loss, out = f(params, packed)
      ref_loss, ref = _reference(params, batch, packed)
      assert out.grads["w"].dtype == jnp.dtype(dtype)
      assert _rel(out.grads, ref) <= TOL[dtype]
      assert abs(float(loss) - ref_loss) <= 2e-6 * abs(ref_loss)  # f32 loss
      top = spec.buckets[-1] if "split" not in plan else max(lengths)
      assert float(out.weight) == sum(min(n, top) for n in lengths)
      assert bool(out.valid)
    jitted = getattr(f, "jitted", f)
    if hasattr(jitted, "_cache_size"):  # one compile served both batches
      assert jitted._cache_size() == 1  # pylint: disable=protected-access
