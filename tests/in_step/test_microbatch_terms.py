"""Loss terms normalised differently in in-step microbatching (MaxText's
cross-entropy by tokens plus a load-balancing term by microbatch count),
against a hand-written ``jax.grad`` of the whole objective over the same
microbatches, over Adam windows; and the compiled memory that shows a term
whose normaliser is known before the loop needs no second buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa

D, H, B, K = 3, 8, 16, 4
Error = wa.WeightedAccumulationError


def _params(seed=0, h=H):
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.standard_normal((D, h)) * 0.5, jnp.float32),
    "v": jnp.asarray(rng.standard_normal(h) * 0.5, jnp.float32),
  }


def _batch(seed=1, empty=None):
  rng = np.random.default_rng(seed)
  mask = (rng.random(B) < 0.7).astype(np.float32)
  mask[0] = 1.0
  if empty is not None:
    mask[empty::K] = 0.0  # microbatch `empty` (strided) is fully masked
  return {
    "x": jnp.asarray(rng.standard_normal((B, D)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal(B), jnp.float32),
    "mask": jnp.asarray(mask),
  }


def _pieces(p, b):
  """One microbatch: its token-loss SUM, token count and a load-balancing
  term (a function of the params and the microbatch, as a router's)."""
  h = jnp.tanh(b["x"] @ p["w"])
  xent = jnp.sum(b["mask"] * (h @ p["v"] - b["y"]) ** 2)
  probs = jax.nn.softmax(h, axis=-1)
  lb = H * jnp.sum(jnp.mean(probs, 0) ** 2)
  return xent, jnp.sum(b["mask"]), lb


def terms_sum(p, b):
  xent, n, lb = _pieces(p, b)
  return {"xent": xent, "lb": lb}, {"xent": n, "lb": 1.0}


def terms_mean(p, b):
  xent, n, lb = _pieces(p, b)
  return {"xent": xent / n, "lb": lb}, {"xent": n, "lb": 1.0}  # 0/0: NaN


def terms_mean_safe(p, b):
  xent, n, lb = _pieces(p, b)
  return {"xent": xent / jnp.maximum(n, 1), "lb": lb}, {"xent": n, "lb": 1.0}


def _objective(p, b, k=K, n_real=None):
  """The reference: cross-entropy over all tokens of the microbatches run,
  plus the load-balancing term averaged over them, by hand."""
  run = range(k if n_real is None else n_real)
  parts = [_pieces(p, jax.tree.map(lambda x, i=i: x[i::k], b)) for i in run]
  xent = sum(x for x, _, _ in parts) / sum(n for _, n, _ in parts)
  lb = sum(lb for _, _, lb in parts) / len(parts)
  return xent + lb, (xent, lb)


def rel_err(got, want):
  return max(
    float(jnp.max(jnp.abs(g - r))) / float(jnp.max(jnp.abs(r)))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )


@pytest.mark.parametrize("known", ["none", "lb", "both"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_terms_with_their_own_normalisers_equal_the_objective(mode, known):
  p, b = _params(), _batch(empty=2)
  # A fully masked microbatch's 0/0 is dropped when its term has a window
  # of its own; in the shared window of known normalisers it would poison
  # the others' gradients (tested below), so that case divides safely.
  mean_fn = terms_mean_safe if known == "both" else terms_mean
  loss_fn = terms_sum if mode == "sum" else mean_fn
  norms = {
    "none": None,
    "lb": {"lb": K},
    "both": {"xent": b["mask"].sum(), "lb": jnp.float32(K)},
  }[known]
  f = jax.jit(wa.microbatched_value_and_grad(loss_fn, K, mode=mode))
  loss, out = f(p, b, normalizers=norms)
  (_, (xent, lb)), ref = jax.value_and_grad(_objective, has_aux=True)(p, b)
  assert rel_err(out.grads, ref) < 1e-5 and bool(out.valid)
  np.testing.assert_allclose(loss["xent"], xent, rtol=1e-5)
  np.testing.assert_allclose(loss["lb"], lb, rtol=1e-5)
  assert float(out.weight["xent"]) == float(b["mask"].sum())
  assert float(out.weight["lb"]) == K
  assert int(out.issued) == K


def test_a_fully_masked_mean_term_with_a_known_normaliser_adds_nothing():
  """mode='mean', both normalisers given, a fully masked microbatch whose
  mean is 0/0 while its load-balancing term has weight: each known term
  keeps a window of its own in mean mode, so the 0/0 adds nothing and the
  result is the one without normalisers (they equal the terms' totals)."""
  p, b = _params(), _batch(empty=2)
  f = jax.jit(wa.microbatched_value_and_grad(terms_mean, K, mode="mean"))
  loss, out = f(p, b, normalizers={"xent": b["mask"].sum(), "lb": float(K)})
  ref_loss, ref = f(p, b)
  assert bool(out.finite) and bool(out.valid)
  assert rel_err(out.grads, ref.grads) < 1e-5
  np.testing.assert_allclose(
    float(loss["xent"]), float(ref_loss["xent"]), rtol=1e-5
  )


def test_a_term_normalised_by_the_microbatches_run():
  """With num_real_microbatches, a weight-1 term is averaged over the
  microbatches run (its total weight), or over a given count."""
  p, b = _params(), _batch()
  f = jax.jit(
    wa.microbatched_value_and_grad(terms_sum, K, mode="sum", split="strided")
  )
  ref = jax.grad(lambda p: _objective(p, b, n_real=3)[0])(p)
  _, out = f(p, b, num_real_microbatches=3)
  assert rel_err(out.grads, ref) < 1e-5
  _, out = f(p, b, num_real_microbatches=3, normalizers={"lb": 3})
  assert rel_err(out.grads, ref) < 1e-5


def test_a_single_loss_with_a_known_normaliser():
  """Hugging Face's num_items_in_batch: one loss whose normaliser is known
  before the loop divides by it (here twice the token count)."""
  p, b = _params(), _batch()

  def loss(p, b):
    xent, n, _ = _pieces(p, b)
    return xent, n

  f = wa.microbatched_value_and_grad(loss, K, mode="sum")
  n = b["mask"].sum()
  value, out = f(p, b, normalizers=2 * n)
  ref_value, ref = jax.value_and_grad(lambda p: _pieces(p, b)[0] / (2 * n))(p)
  assert rel_err(out.grads, ref) < 1e-5
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  _, bad = jax.jit(f)(p, b, normalizers=jnp.float32(0))
  assert not bool(bad.valid)


def test_terms_over_adam_windows_match_the_hand_objective():
  tx = optax.adam(0.05)
  f = wa.microbatched_value_and_grad(terms_sum, K, mode="sum")

  @jax.jit
  def step(p, opt, b):
    _, out = f(p, b, normalizers={"lb": K})
    updates, opt = tx.update(out.grads, opt, p)
    return optax.apply_updates(p, updates), opt

  p = ref = _params()
  opt = ref_opt = tx.init(p)
  for s in range(3):
    b = _batch(seed=10 + s)
    p, opt = step(p, opt, b)
    g = jax.grad(lambda q, b=b: _objective(q, b)[0])(ref)
    updates, ref_opt = tx.update(g, ref_opt, ref)
    ref = optax.apply_updates(ref, updates)
  assert rel_err(p, ref) < 1e-5


def _temp_bytes(f, *args, **kwargs):
  return (
    jax.jit(lambda *a: f(*a, **kwargs))
    .lower(*args)
    .compile()
    .memory_analysis()
    .temp_size_in_bytes
  )


def test_known_normalisers_share_one_buffer():
  """Compiled temporaries, params of 87 kB: terms whose normalisers are
  given cost what one loss costs (one buffer, one backward pass); a term
  normalised by its own total weight takes a second buffer (measured with
  jaxlib 0.10.2; an XLA-release figure, as the other memory assertions:
  +88 bytes for the shared window, +241 kB, 2.8x the params, for two)."""
  p, b = _params(h=4096 * 4 // D), _batch()
  p = {"w": p["w"], "v": p["v"]}
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(p))

  def one(p, b):
    xent, n, lb = _pieces(p, b)
    return xent + lb * n, n  # one loss: what MaxText writes by hand

  single = _temp_bytes(wa.microbatched_value_and_grad(one, K, mode="sum"), p, b)
  f = wa.microbatched_value_and_grad(terms_sum, K, mode="sum")
  n = b["mask"].sum()
  known = _temp_bytes(f, p, b, normalizers={"xent": n, "lb": K})
  own = _temp_bytes(f, p, b)
  assert known - single < 0.25 * param_bytes, (known, single, param_bytes)
  assert own - single >= 0.9 * param_bytes, (own, single, param_bytes)


def test_term_errors():
  p, b = _params(), _batch()
  f = wa.microbatched_value_and_grad(terms_sum, K, mode="sum")
  with pytest.raises(Error, match=r"mapping from its terms.*got 'moe'"):
    f(p, b, normalizers={"moe": 4})
  with pytest.raises(Error, match="mapping from its terms"):
    f(p, b, normalizers=4)
  with pytest.raises(Error, match="finite positive"):
    f(p, b, normalizers={"lb": -1})
  with pytest.raises(Error, match="one normaliser"):
    f.accumulate(wa.init(p), p, b)

  def missing(p, b):
    (terms, weights) = terms_sum(p, b)
    return terms, {"xent": weights["xent"]}

  g = wa.microbatched_value_and_grad(missing, K, mode="sum")
  with pytest.raises(Error, match="weights' keys"):
    g(p, b)
  single = wa.microbatched_value_and_grad(
    lambda p, b: _pieces(p, b)[:2], K, mode="sum"
  )
  with pytest.raises(Error, match="one loss"):
    single(p, b, normalizers={"xent": 3})


@pytest.mark.parametrize("known", [False, True])
def test_terms_inside_shard_map_are_global(known):
  """Two replicas, each splitting its own rows: the terms' totals are
  summed over the replicas in the close (a weight-1 term is averaged over
  all 2K microbatches); a known normaliser is the global one."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  p, b = _params(), _batch(empty=1)
  f = wa.microbatched_value_and_grad(terms_sum, K, mode="sum", axis_name="data")
  norms = {"lb": 2 * K} if known else None
  dp = jax.jit(
    jax.shard_map(
      lambda p, b: f(p, b, normalizers=norms),
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
    )
  )
  loss, out = dp(p, b)

  def objective(p):
    parts = []
    for r in range(2):  # replica r's rows, split k::K
      local = jax.tree.map(lambda x, r=r: x[8 * r : 8 * r + 8], b)
      parts += [
        _pieces(p, jax.tree.map(lambda x, k=k: x[k::K], local))
        for k in range(K)
      ]
    xent = sum(x for x, _, _ in parts) / sum(n for _, n, _ in parts)
    return xent + sum(lb for _, _, lb in parts) / len(parts), xent

  (_, xent), ref = jax.value_and_grad(objective, has_aux=True)(p)
  assert rel_err(out.grads, ref) < 1e-5 and bool(out.valid)
  np.testing.assert_allclose(loss["xent"], xent, rtol=1e-5)
  assert float(out.weight["lb"]) == 2 * K
