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


def _token_losses(p, tokens, targets):
  """Per-token losses of rows ``[r, L]``: a causal running mean mixes each
  token with those before it (what a row's padding must not change)."""
  h = p["emb"][tokens]
  h = jnp.cumsum(h, axis=1) / jnp.arange(1, tokens.shape[1] + 1)[:, None]
  logits = jnp.tanh(h @ p["w"]) @ p["out"]
  picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return jax.nn.logsumexp(logits, -1) - picked


def _loss_fn(p, mb):
  rows, mask = mb
  tl = _token_losses(p, rows["tokens"], rows["targets"])
  return jnp.sum(tl * mask.astype(tl.dtype)), mask.sum()


def _batch(lengths, seed=0):
  rng = np.random.default_rng(seed)
  t = max(max(lengths), 1)
  tokens = rng.integers(0, V, (len(lengths), t)).astype(np.int32)
  targets = rng.integers(0, V, (len(lengths), t)).astype(np.int32)
  return {"tokens": tokens, "targets": targets}


def _reference(params, batch, packed):
  """Float64 mean loss and gradient of the planned pieces, row by row."""
  pieces = packed.plan.pieces

  def total(p):
    s = 0.0
    for row, start, n in pieces[:, :3]:
      sl = slice(start, start + n)
      tl = _token_losses(
        p,
        batch["tokens"][row : row + 1, sl],
        batch["targets"][row : row + 1, sl],
      )
      s = s + tl.sum()
    return s / pieces[:, 2].sum()

  with jax.enable_x64(True):
    p64 = jax.tree.map(
      lambda x: jnp.asarray(np.asarray(x), jnp.float64), params
    )
    loss, grads = jax.value_and_grad(total)(p64)
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
}
LENGTHS = [13, 1, 7, 16, 3, 0, 9, 4, 11, 2, 5, 8]


def _run(style, spec_kw, dtype):
  replicas = 2 if style in ("shard_map", "jit_axis_name") else 1
  spec = planning.PlanSpec(batch_rows=32, replicas=replicas, **spec_kw)
  batch = _batch(LENGTHS)
  packed = planning.plan_batch(spec, batch, LENGTHS, seed=3)
  params = _params(dtype)
  axis = "data" if replicas > 1 else None
  f = planning.planned_value_and_grad(
    _loss_fn, spec, mode="sum", dtype=dtype, axis_name=axis
  )
  if style == "eager":
    loss, out = f(params, packed)
  elif style == "jit":
    loss, out = jax.jit(f)(params, packed)
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    if style == "shard_map":
      specs = (P(), jax.tree.map(lambda _: P("data"), packed))
      run = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P())
      loss, out = jax.jit(run)(params, packed)
    else:
      with jax.set_mesh(mesh):
        loss, out = jax.jit(f)(params, packed)
  return (loss, out), _reference(params, batch, packed)


STYLES = ["eager", "jit", "shard_map", "jit_axis_name"]


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("style", STYLES)
def test_float32_gradient_is_the_full_batch_gradient(plan, style):
  (loss, out), (ref_loss, ref) = _run(style, PLANS[plan], jnp.float32)
  assert _rel(out.grads, ref) <= 2e-6
  assert abs(float(loss) - ref_loss) <= 2e-6 * abs(ref_loss)
  assert (
    float(out.weight) == sum(min(n, 16) for n in LENGTHS) or plan == "split"
  )
  assert bool(out.valid)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("style", STYLES)
def test_float64_gradient_is_the_full_batch_gradient(plan, style):
  with jax.enable_x64(True):
    (loss, out), (ref_loss, ref) = _run(style, PLANS[plan], jnp.float64)
    assert out.grads["w"].dtype == jnp.float64
    assert _rel(out.grads, ref) <= 1e-12
    assert abs(float(loss) - ref_loss) <= 1e-6 * abs(ref_loss)  # float32 loss
