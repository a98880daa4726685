"""In-step microbatching (weighted_accum.microbatch) against full-batch
references: ``jax.value_and_grad`` of the whole batch's mean loss, a float64
NumPy recomputation of the loss, optax.microbatching's own MEAN result (shown
biased), the compiled HLO and XLA's memory analysis."""

from __future__ import annotations

import pathlib
import re

from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa

D_IN, HIDDEN, B = 3, 8, 32


def _params(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.standard_normal((D_IN, HIDDEN)) * 0.5, dtype),
    "v": jnp.asarray(rng.standard_normal((HIDDEN,)) * 0.5, dtype),
  }


def _batch(mask, seed=1, n=B, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, D_IN)), dtype)
  y = jnp.asarray(rng.standard_normal((n,)), dtype)
  return {"x": x, "y": y, "mask": jnp.asarray(mask, dtype)}


def _per_item(p, batch):
  pred = jnp.tanh(batch["x"] @ p["w"]) @ p["v"]
  return (pred - batch["y"]) ** 2


def sum_loss(p, batch):
  m = batch["mask"]
  return jnp.sum(m * _per_item(p, batch)), jnp.sum(m)


def mean_loss(p, batch):
  s, n = sum_loss(p, batch)
  return s / n, n  # 0/0 = NaN for a fully masked microbatch, on purpose


LOSSES = {"sum": sum_loss, "mean": mean_loss}


def full_batch(p, batch):
  """The reference: value and gradient of the whole batch's mean loss."""
  return jax.value_and_grad(
    lambda p: sum_loss(p, batch)[0] / jnp.sum(batch["mask"])
  )(p)


def numpy_loss(p, batch):
  """The exact mean loss in float64 NumPy (independent of JAX)."""
  x, y, m = (np.asarray(batch[k], np.float64) for k in ("x", "y", "mask"))
  w, v = (np.asarray(p[k], np.float64) for k in ("w", "v"))
  return float(np.sum(m * (np.tanh(x @ w) @ v - y) ** 2) / np.sum(m))


def rel_err(got, want):
  return max(
    float(
      jnp.max(jnp.abs(jnp.asarray(g, jnp.float32) - r)) / jnp.max(jnp.abs(r))
    )
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )


def _mask_with_empty_microbatch(k, seed, empty=1):
  rng = np.random.default_rng(seed)
  mask = (rng.random(B) < 0.6).astype(np.float32)
  mask[0] = 1.0
  if k > 1:
    mask[empty::k] = 0.0  # microbatch `empty` is fully masked
  return mask


# ---------------------------------------------------------- 1. equivalence --


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_equals_full_batch(k, mode, variant):
  p, batch = _params(), _batch(_mask_with_empty_microbatch(k, seed=k))
  f = variant(wa.microbatched_value_and_grad(LOSSES[mode], k, mode=mode))
  loss, out = f(p, batch)
  ref_loss, ref_grads = full_batch(p, batch)
  assert rel_err(out.grads, ref_grads) <= 1e-5
  assert abs(float(loss) - numpy_loss(p, batch)) <= 1e-5 * abs(float(ref_loss))
  assert float(out.weight) == float(np.sum(batch["mask"]))
  assert int(out.issued) == k and bool(out.valid) and bool(out.finite)


@given(
  bits=st.lists(st.booleans(), min_size=B, max_size=B),
  mode=st.sampled_from(["sum", "mean"]),
)
def test_equals_full_batch_over_masks(bits, mode):
  bits[5] = True  # a positive total weight (zero total weight: see below)
  p, batch = _params(), _batch(np.array(bits, np.float32))
  loss, out = _JITTED[mode](p, batch)
  ref_loss, ref_grads = full_batch(p, batch)
  assert rel_err(out.grads, ref_grads) <= 1e-5
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
  assert bool(out.valid)


_JITTED = {
  m: jax.jit(wa.microbatched_value_and_grad(LOSSES[m], 4, mode=m))
  for m in LOSSES
}


def test_zero_total_weight_jit_invalid_eager_raises():
  p, batch = _params(), _batch(np.zeros(B, np.float32))
  _, out = _JITTED["mean"](p, batch)
  assert not bool(out.valid) and float(out.weight) == 0.0
  assert all(
    float(jnp.max(jnp.abs(g))) == 0 for g in jax.tree.leaves(out.grads)
  )
  with pytest.raises(wa.WeightedAccumulationError, match="total weight"):
    wa.microbatched_value_and_grad(mean_loss, 4, mode="mean")(p, batch)


def test_optax_mean_accumulator_is_biased_ours_is_exact():
  """The same batch of variable-length microbatches through
  optax.microbatching: MEAN weights every microbatch equally."""
  k, p = 4, _params()
  mask = np.zeros(B, np.float32)
  mask[0::k] = 1.0  # microbatch 0: 8 items
  mask[1] = 1.0  # microbatch 1: 1 item
  mask[2:16:k] = 1.0  # microbatch 2: 4 items; microbatch 3: none
  batch = _batch(mask)
  ref_loss, ref_grads = full_batch(p, batch)

  def safe_mean(p, batch):  # what an optax user writes: no 0/0
    s, n = sum_loss(p, batch)
    return s / jnp.maximum(n, 1.0), n

  vg = jax.value_and_grad(safe_mean, has_aux=True)
  split = dict(argnums=1, microbatch_size=B // k)
  biased = optax.microbatching.microbatch(
    vg, accumulator=optax.microbatching.AccumulationType.MEAN, **split
  )
  (b_loss, _), b_grads = biased(p, batch)
  exact = optax.microbatching.microbatch(
    vg, accumulator=wa.optax_accumulator("mean"), **split
  )
  (e_loss, e_weight), e_grads = exact(p, batch)
  assert rel_err(b_grads, ref_grads) > 0.05
  assert abs(float(b_loss) - float(ref_loss)) > 0.05 * float(ref_loss)
  assert rel_err(e_grads, ref_grads) <= 1e-5
  assert abs(float(e_loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
  assert float(e_weight) == mask.sum()
  _, out = wa.microbatched_value_and_grad(mean_loss, k, mode="mean")(p, batch)
  assert rel_err(out.grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_optax_accumulator_sum_mode_and_early_stop(mode):
  k, p = 4, _params()
  batch = _batch(_mask_with_empty_microbatch(k, seed=3))
  vg = jax.value_and_grad(LOSSES[mode], has_aux=True)
  f = jax.jit(
    optax.microbatching.microbatch(
      vg,
      argnums=1,
      microbatch_size=B // k,
      accumulator=wa.optax_accumulator(mode),
      num_real_microbatches=jnp.int32(3),
    )
  )
  (loss, weight), grads = f(p, batch)
  first3 = dict(batch, mask=batch["mask"] * (np.arange(B) % k < 3))
  ref_loss, ref_grads = full_batch(p, first3)
  assert rel_err(grads, ref_grads) <= 1e-5
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
  assert float(weight) == float(first3["mask"].sum())


def test_optax_accumulator_aggregate_per_example():
  """micro_vmap's per-example values fold into the same exact result."""
  p, batch = _params(), _batch(_mask_with_empty_microbatch(4, seed=5))
  acc = wa.optax_accumulator("mean")
  per_ex = jax.vmap(
    jax.value_and_grad(mean_loss, has_aux=True), in_axes=(None, 0)
  )(p, jax.tree.map(lambda x: x[:, None], batch))
  (loss, weight), grads = acc.aggregate(per_ex)
  ref_loss, ref_grads = full_batch(p, batch)
  assert rel_err(grads, ref_grads) <= 1e-5
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
  assert float(weight) == float(batch["mask"].sum())


@pytest.mark.parametrize("fn", ["microbatch", "micro_vmap"])
@pytest.mark.parametrize("size", [2, 4])
def test_optax_accumulator_rejection_never_reads_as_weight_0(fn, size):
  """With ``microbatch_size``, a microbatch (or an example) of negative
  weight is rejected, and the result says so (NaN loss and grads, which
  ``optax.apply_if_finite`` skips, and the weight minus the number
  rejected); the same microbatch of weight 0 adds nothing and the result
  is finite."""
  vg = jax.value_and_grad(
    lambda w, x, m: (jnp.sum(m * (x * w) ** 2), jnp.sum(m)), has_aux=True
  )
  kw = dict(microbatch_size=size, accumulator=wa.optax_accumulator("sum"))
  if fn == "microbatch":
    f = optax.microbatching.microbatch(vg, argnums=(1, 2), **kw)
  else:
    f = optax.microbatching.micro_vmap(vg, in_axes=(None, 0, 0), **kw)
  x = jnp.arange(8.0)
  # Column-major split: microbatch {2, 6} (size 2) or {0, 2, 4, 6} (size
  # 4) has weight -3 or -1 (rejected); with -1 at row 6 instead it has
  # weight 0 or 2. micro_vmap tallies each example: -4 is rejected there.
  bad = jnp.asarray([1.0, 1, 1, 1, 1, 1, -4, 0])
  if fn == "microbatch":
    zero = jnp.asarray([1.0, 1, 1, 1, 1, 1, -1, 0])
  else:
    zero = jnp.asarray([1.0, 1, 1, 1, 1, 1, 0, 0])
  (loss, weight), grads = jax.jit(f)(1.0, x, bad)
  assert float(weight) == -1.0 and np.isnan(float(loss))
  assert np.isnan(float(grads))
  (loss, weight), grads = jax.jit(f)(1.0, x, zero)
  assert np.isfinite([float(loss), float(weight), float(grads)]).all()


@pytest.mark.parametrize(
  "fn, size",
  [("microbatch", 1), ("microbatch", 2)]
  + [("micro_vmap", n) for n in (None, 1, 2, 4)],
)
def test_optax_accumulator_counts_the_rejected_in_the_weight(fn, size):
  """The weight of a result with rejections is minus their number (the
  microbatches, or for micro_vmap the examples, as the functional API's
  ``rejected`` counts its calls): two NaN and one negative weight read -3
  under jit, whatever the split."""
  vg = jax.value_and_grad(lambda w, x, m: (jnp.sum(x * w), m[0]), has_aux=True)
  kw = dict(microbatch_size=size, accumulator=wa.optax_accumulator("sum"))
  if fn == "microbatch":  # microbatch k holds rows k::(8 // size)
    f = optax.microbatching.microbatch(vg, argnums=(1, 2), **kw)
    bad = [np.nan, -1.0, np.nan] + [1.0] * (8 // size - 3)
    m = jnp.asarray(np.tile(bad, size), jnp.float32)
  else:
    f = optax.microbatching.micro_vmap(vg, in_axes=(None, 0, 0), **kw)
    m = jnp.asarray([1.0, np.nan, 1, -2, 1, 1, np.nan, 0])[:, None]
  (loss, weight), grads = jax.jit(f)(1.0, jnp.arange(8.0), m)
  assert float(weight) == -3.0, weight
  assert np.isnan(float(loss)) and np.isnan(float(grads))


def test_optax_accumulator_counts_the_rejected_with_x64_enabled():
  """The rejected count keeps its int32 carry when 64-bit types are on (an
  int64 count broke optax's loop carry)."""
  vg = jax.value_and_grad(lambda w, x, m: (jnp.sum(x * w), m[0]), has_aux=True)
  acc = wa.optax_accumulator("sum")
  with jax.enable_x64(True):
    f = optax.microbatching.microbatch(
      vg, argnums=(1, 2), microbatch_size=2, accumulator=acc
    )
    m = jnp.asarray(np.tile([np.nan, 1.0, 1.0, 1.0], 2), jnp.float32)
    (_, weight), _ = jax.jit(f)(1.0, jnp.arange(8.0, dtype=jnp.float32), m)
  assert float(weight) == -1.0, weight


# ------------------------------------------- 2. aux order, early stopping --


def test_aux_is_stacked_in_row_order(variant):
  k = 4

  def loss_fn(p, batch):
    (s, n) = sum_loss(p, batch)
    return (s, n), {"rows": batch["row"], "n": n}

  p = _params()
  batch = dict(_batch(np.ones(B)), row=jnp.arange(B))
  f = variant(
    wa.microbatched_value_and_grad(loss_fn, k, has_aux=True, mode="sum")
  )
  (loss, aux), out = f(p, batch)
  np.testing.assert_array_equal(
    aux["rows"], np.arange(B).reshape(B // k, k).T
  )  # aux[i] = rows i::K
  assert aux["n"].shape == (k,) and float(aux["n"].sum()) == B
  assert rel_err(out.grads, full_batch(p, batch)[1]) <= 1e-5


def test_num_real_microbatches_traced_skips_and_never_retraces():
  k, p = 4, _params()
  batch = _batch(_mask_with_empty_microbatch(k, seed=7, empty=2))
  traces, runs = [], []

  def loss_fn(p, batch):
    traces.append(1)
    jax.debug.callback(lambda: runs.append(1))  # one per executed microbatch
    return sum_loss(p, batch)

  f = jax.jit(
    wa.microbatched_value_and_grad(loss_fn, k, mode="sum", split="strided")
  )
  for n in range(1, k + 1):
    del runs[:]
    loss, out = f(p, batch, num_real_microbatches=jnp.int32(n))
    jax.block_until_ready(out)
    assert len(runs) == n
    real = dict(batch, mask=batch["mask"] * (np.arange(B) % k < n))
    ref_loss, ref_grads = full_batch(p, real)
    assert rel_err(out.grads, ref_grads) <= 1e-5
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
    assert int(out.issued) == n
  assert len(traces) == 2  # one trace (loss_fn is traced twice per trace)
  f(p, batch, num_real_microbatches=3)  # a Python int: weakly typed int32
  assert len(traces) == 4  # jit retraces once for the weak type, no more
  f(p, batch, num_real_microbatches=1)
  assert len(traces) == 4


def test_skipped_microbatches_never_touch_the_result():
  """NaN rows in microbatches >= num_real_microbatches change nothing."""
  k, p = 4, _params()
  batch = _batch(np.ones(B))
  x = np.array(batch["x"])
  x[np.arange(B) % k >= 2] = np.nan
  bad = dict(batch, x=jnp.asarray(x))
  f = jax.jit(
    wa.microbatched_value_and_grad(sum_loss, k, mode="sum", split="strided")
  )
  _, out = f(p, bad, num_real_microbatches=2)
  good = dict(batch, mask=batch["mask"] * (np.arange(B) % k < 2))
  assert bool(out.valid)
  assert rel_err(out.grads, full_batch(p, good)[1]) <= 1e-5


# ----------------------------------------------------- 3. float16 + scale --


def test_float16_work_dtype_with_loss_scale_close_to_float32():
  k = 8
  mask = _mask_with_empty_microbatch(k, seed=11)
  p32, b32 = _params(), _batch(mask)
  p16 = jax.tree.map(lambda x: x.astype(jnp.float16), p32)
  b16 = jax.tree.map(lambda x: x.astype(jnp.float16), b32)
  _, ref = jax.jit(wa.microbatched_value_and_grad(mean_loss, k, mode="mean"))(
    p32, b32
  )
  f16 = jax.jit(
    wa.microbatched_value_and_grad(
      mean_loss, k, mode="mean", dtype=jnp.float16, loss_scale=2.0**12
    )
  )
  loss, out = f16(p16, b16)
  assert all(g.dtype == jnp.float16 for g in jax.tree.leaves(out.grads))
  assert bool(out.finite) and bool(out.valid)
  assert rel_err(out.grads, ref.grads) <= 3e-3
  assert float(out.loss_scale) == 2.0**12


def test_dynamic_loss_scale_and_per_call_scale_without_recompiling():
  k, p = 4, _params()
  batch = _batch(_mask_with_empty_microbatch(k, seed=15))
  ref = full_batch(p, batch)[1]
  traces = []

  def loss_fn(p, b):
    traces.append(1)
    return sum_loss(p, b)

  scaler = wa.DynamicLossScale(2.0**10)
  f = jax.jit(
    wa.microbatched_value_and_grad(loss_fn, k, loss_scale=scaler, mode="sum")
  )
  _, out = f(p, batch)
  assert float(out.loss_scale) == 2.0**10 and rel_err(out.grads, ref) <= 1e-5
  scaler = scaler.adjust(out.finite)
  seen = []
  for scale in (
    scaler,
    wa.DynamicLossScale(8.0),
    jnp.float32(3.0),
    jnp.float32(5.0),
  ):
    _, out = f(p, batch, loss_scale=scale)
    assert rel_err(out.grads, ref) <= 1e-5
    assert float(out.loss_scale) == float(getattr(scale, "scale", scale))
    seen.append(len(traces))
  # One trace per kind of scale passed, none per value.
  assert seen[0] == seen[1] and seen[2] == seen[3]
  with pytest.raises(wa.WeightedAccumulationError, match="loss_scale"):
    wa.microbatched_value_and_grad(loss_fn, k, mode="sum")(
      p, batch, loss_scale=-1.0
    )


# ------------------------------------------------------------- 4. memory --


def _wide_mlp_loss(p, batch):
  h = jax.nn.relu(batch["x"] @ p["w1"])
  h = jax.nn.relu(h @ p["w2"])
  per = (h @ p["w3"] - batch["y"]) ** 2
  return jnp.sum(per * batch["mask"]), jnp.sum(batch["mask"])


def _wide_mlp(n=1024, d=16, h=256):
  rng = np.random.default_rng(0)
  p = {
    "w1": jnp.asarray(rng.standard_normal((d, h)) * 0.1, jnp.float32),
    "w2": jnp.asarray(rng.standard_normal((h, h)) * 0.05, jnp.float32),
    "w3": jnp.asarray(rng.standard_normal((h,)) * 0.1, jnp.float32),
  }
  batch = {
    "x": jnp.asarray(rng.standard_normal((n, d)), jnp.float32),
    "y": jnp.zeros((n,), jnp.float32),
    "mask": jnp.ones((n,)),
  }
  return p, batch


def _while_bodies(hlo: str) -> dict[str, str]:
  """Every computation reachable from a while body (name -> text)."""
  comps = dict(
    re.findall(
      r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}",
      hlo,
      re.DOTALL | re.MULTILINE,
    )
  )
  todo = re.findall(r"while\([^\n]*body=%?([\w.\-]+)", hlo)
  seen = {}
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen[name] = comps[name]
    todo += re.findall(
      r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?"
      r"([\w.\-]+)",
      comps[name],
    )
    todo += re.findall(r"branch_computations=\{([^}]*)\}", comps[name])
  return seen


def test_memory_k8_at_most_half_of_full_batch_and_carry_in_place():
  p, batch = _wide_mlp()
  full = (
    jax.jit(jax.grad(lambda p, b: _wide_mlp_loss(p, b)[0]))
    .lower(p, batch)
    .compile()
  )
  micro = (
    jax.jit(wa.microbatched_value_and_grad(_wide_mlp_loss, 8, mode="sum"))
    .lower(p, batch)
    .compile()
  )
  t_full = full.memory_analysis().temp_size_in_bytes
  t_micro = micro.memory_analysis().temp_size_in_bytes
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(p))
  assert t_full > 8 * param_bytes  # activations dominate
  assert t_micro <= 0.5 * t_full, (t_micro, t_full)
  # In place: no parameter-shaped copy inside the loop.
  bodies = _while_bodies(micro.as_text())
  assert bodies
  shapes = {f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(p)}
  for text in bodies.values():
    for line in text.splitlines():
      if re.search(r"= (\S+) copy\(", line):
        assert (
          re.search(r"= (\S+) copy\(", line).group(1).split("{")[0]
          not in shapes
        ), line


# ------------------------------------------------ 5. shard_map, one psum --


def _dp_batch(n_dev, rows_per_dev, seed):
  """Unequal valid rows per replica; replica 1 has none."""
  rng = np.random.default_rng(seed)
  mask = np.zeros(n_dev * rows_per_dev, np.float32)
  for r in range(n_dev):
    if r == 1:
      continue
    n = rng.integers(1, rows_per_dev + 1)
    mask[r * rows_per_dev + rng.permutation(rows_per_dev)[:n]] = 1.0
  return _batch(mask, seed=seed, n=n_dev * rows_per_dev)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_shard_map_exact_one_all_reduce_outside_the_loop(mode):
  n_dev, k = jax.device_count(), 4
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  p, batch = _params(), _dp_batch(n_dev, 8, seed=2)
  f = wa.microbatched_value_and_grad(
    LOSSES[mode], k, mode=mode, axis_name="data"
  )
  step = jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  )
  loss, out = step(p, batch)
  ref_loss, ref_grads = full_batch(p, batch)
  assert rel_err(out.grads, ref_grads) <= 1e-5
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
  assert float(out.weight) == float(batch["mask"].sum())
  assert int(out.issued) == k * n_dev and bool(out.valid)
  hlo = step.lower(p, batch).compile().as_text()
  bodies = _while_bodies(hlo)
  assert bodies
  for name, text in bodies.items():
    assert "all-reduce" not in text, name
  assert len(re.findall(r"all-reduce(?:-start)?\(", hlo)) == 1


def test_shard_map_per_replica_outputs_agree():
  """Every replica returns the same global result (out_specs P('data'))."""
  n_dev = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  p, batch = _params(), _dp_batch(n_dev, 4, seed=4)
  f = wa.microbatched_value_and_grad(
    mean_loss, 2, mode="mean", axis_name="data"
  )

  def per_replica(p, b):
    loss, out = f(p, b)
    return jax.tree.map(lambda x: x[None], (loss, out.grads))

  loss, grads = jax.jit(
    jax.shard_map(
      per_replica, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")
    )
  )(p, batch)
  assert np.ptp(np.asarray(loss)) == 0
  for g in jax.tree.leaves(grads):
    assert float(jnp.max(jnp.ptp(g, axis=0))) == 0


def test_shard_map_aux_per_replica_and_accumulate_into_a_replica_window():
  n_dev = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  p, batch = _params(), _dp_batch(n_dev, 4, seed=3)
  ref = full_batch(p, batch)[1]

  def loss_fn(p, b):
    s, n = sum_loss(p, b)
    return (s, n), n

  f = wa.microbatched_value_and_grad(
    loss_fn, 2, has_aux=True, axis_name="data", mode="sum"
  )
  (_, aux), out = jax.jit(
    jax.shard_map(
      f, mesh=mesh, in_specs=(P(), P("data")), out_specs=((P(), P("data")), P())
    )
  )(p, batch)
  np.testing.assert_array_equal(  # replica r's aux[i] = its rows i::2
    aux, np.asarray(batch["mask"]).reshape(n_dev, 2, 2).sum(1).ravel()
  )
  assert rel_err(out.grads, ref) <= 1e-5
  g = wa.microbatched_value_and_grad(sum_loss, 2, axis_name="data", mode="sum")

  def two_calls(p, b):  # this replica's window, reduced once at its close
    st = wa.init(p, axis_name="data")
    (_, n1), st = g.accumulate(st, p, b)
    (_, n2), st = g.accumulate(st, p, jax.tree.map(lambda x: x[::-1], b))
    out, _ = wa.finish_mean(st)
    return out.grads, out.weight, jax.lax.psum(n1 + n2, "data")

  grads, weight, n = jax.jit(
    jax.shard_map(
      two_calls, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )
  )(p, batch)
  assert float(weight) == float(n) == 2 * float(batch["mask"].sum())
  assert rel_err(grads, ref) <= 1e-5


# ----------------------------------------- 6. implicit jit, 4x2 mesh --


def test_implicit_jit_on_data_model_mesh_exact_and_shardings_kept():
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  p, batch = _params(), _batch(_mask_with_empty_microbatch(4, seed=9))
  specs = {"w": P(None, "model"), "v": P("model")}
  ps = {
    k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p.items()
  }
  bs = jax.device_put(batch, NamedSharding(mesh, P("data")))
  f = jax.jit(wa.microbatched_value_and_grad(mean_loss, 4, mode="mean"))
  loss, out = f(ps, bs)
  ref_loss, ref_grads = full_batch(p, batch)
  assert rel_err(out.grads, ref_grads) <= 1e-5
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
  for k, g in out.grads.items():
    assert g.sharding.is_equivalent_to(ps[k].sharding, g.ndim), (k, g.sharding)


# ------------------------------------- across calls, NNX, errors --


def test_accumulate_spans_several_jitted_calls_exactly():
  k, p = 4, _params()
  b1 = _batch(_mask_with_empty_microbatch(k, seed=12), seed=12)
  b2 = _batch(_mask_with_empty_microbatch(k, seed=13), seed=13)
  f = wa.microbatched_value_and_grad(mean_loss, k, mode="mean")
  acc = jax.jit(f.accumulate, donate_argnums=0)
  state = wa.init(p)
  (l1, w1), state = acc(state, p, b1)
  (l2, w2), state = acc(state, p, b2)
  assert int(state.issued) == 2 * k
  out, state = wa.finish_mean(state)
  both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), b1, b2)
  ref_loss, ref_grads = full_batch(p, both)
  assert rel_err(out.grads, ref_grads) <= 1e-5
  assert float(w1 + w2) == float(both["mask"].sum()) == float(out.weight)
  assert abs(float((l1 + l2) / (w1 + w2)) - float(ref_loss)) <= 1e-5 * float(
    ref_loss
  )


def test_nnx_state_params_and_tuple_argnums():
  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
      self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.lin(x)))[:, 0]

  graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, batch):
    pred = nnx.merge(graphdef, params)(batch["x"])
    m = batch["mask"]
    return jnp.sum(m * (pred - batch["y"]) ** 2), jnp.sum(m)

  batch = _batch(_mask_with_empty_microbatch(4, seed=14))
  _, out = jax.jit(wa.microbatched_value_and_grad(loss_fn, 4, mode="sum"))(
    params, batch
  )
  ref = jax.grad(lambda p: loss_fn(p, batch)[0] / batch["mask"].sum())(params)
  assert isinstance(out.grads, nnx.State)
  assert rel_err(out.grads, ref) <= 1e-5

  def two(pw, pv, batch):
    return sum_loss({"w": pw, "v": pv}, batch)

  p = _params()
  _, out = wa.microbatched_value_and_grad(
    two, 4, argnums=(0, 1), batch_argnums=2, mode="sum"
  )(p["w"], p["v"], batch)
  ref = full_batch(p, batch)[1]
  assert rel_err(out.grads, (ref["w"], ref["v"])) <= 1e-5


@pytest.mark.parametrize(
  "kwargs, call, match",
  [
    (dict(num_microbatches=0), None, "num_microbatches"),
    (dict(mode="avg"), None, "mode"),
    (dict(argnums=1), None, "both"),
    (dict(dtype=jnp.int32), None, "dtype"),
    (dict(loss_scale=0.0), None, "loss_scale"),
    (dict(num_microbatches=3), "batch", "divisible"),
    ({}, "ragged", "rows"),
    (dict(split="strided"), "n_real", r"num_real_microbatches=5 must be"),
    ({}, "n_real", "name the split"),
    (dict(axis_name="data"), "batch", "not on a mesh with the axes"),
  ],
)
def test_errors_say_what_and_where(kwargs, call, match):
  p, batch = _params(), _batch(np.ones(B))
  args = dict(loss_fn=sum_loss, num_microbatches=4)
  args.update(kwargs)
  with pytest.raises(wa.WeightedAccumulationError, match=match):
    f = wa.microbatched_value_and_grad(
      args.pop("loss_fn"),
      args.pop("num_microbatches"),
      **{"mode": "sum", **args},
    )
    if call == "ragged":
      batch = dict(batch, y=batch["y"][:-4])
    f(p, batch, num_real_microbatches=5 if call == "n_real" else None)


def test_non_scalar_loss_is_refused():
  p, batch = _params(), _batch(np.ones(B))
  f = wa.microbatched_value_and_grad(
    lambda p, b: (_per_item(p, b), b["mask"].sum()), 4, mode="sum"
  )
  with pytest.raises(wa.WeightedAccumulationError, match="floating scalar"):
    f(p, batch)


@pytest.mark.parametrize("keys", [("loss",), ("loss", "weight")])
@pytest.mark.parametrize("has_aux", [False, True])
def test_loss_fn_returning_a_dict_is_refused_saying_what_to_return(
  has_aux, keys
):
  """A dict is not the pair (one of two keys unpacked as its keys, the
  strings, and failed in JAX): refused naming what to return."""
  p, batch = _params(), _batch(np.ones(B))
  f = wa.microbatched_value_and_grad(
    lambda p, b: dict.fromkeys(keys, sum_loss(p, b)[0]),
    4,
    mode="sum",
    has_aux=has_aux,
  )
  want = r"\(\(loss, weight\), aux\)" if has_aux else r"\(loss, weight\)"
  with pytest.raises(
    wa.WeightedAccumulationError, match=rf"loss_fn\): it returned dict.*{want}"
  ):
    f(p, batch)


@pytest.mark.parametrize("masked_loss", [5.0, np.nan])
def test_sum_mode_fully_masked_microbatch_adds_nothing_to_the_loss(
  masked_loss,
):
  """mode="sum": a microbatch of weight 0 adds nothing to the reported loss,
  not even a constant or NaN its loss_fn returns: loss and gradient equal
  float64 NumPy's over the weighted rows, and the call is valid."""
  x = np.arange(1.0, 9.0)
  mask = np.ones(8, np.float32)
  mask[3::4] = 0.0  # microbatch 3 of the strided split: fully masked

  def loss(w, x, m):
    extra = jnp.where(m.sum() > 0, 0.0, masked_loss)
    return jnp.sum(m * w * x) + extra, m.sum()

  f = wa.microbatched_value_and_grad(loss, 4, mode="sum", batch_argnums=(1, 2))
  value, out = jax.jit(f)(jnp.float32(2.0), jnp.asarray(x), jnp.asarray(mask))
  x64, m64 = x.astype(np.float64), mask.astype(np.float64)
  np.testing.assert_allclose(float(value), 2 * (m64 @ x64) / m64.sum())
  np.testing.assert_allclose(float(out.grads), (m64 @ x64) / m64.sum())
  assert bool(out.valid) and float(out.weight) == 6.0


def test_invalid_weight_from_loss_fn_makes_the_call_invalid():
  p, batch = _params(), _batch(np.ones(B))
  f = jax.jit(
    wa.microbatched_value_and_grad(
      lambda p, b: (sum_loss(p, b)[0], -b["mask"].sum()), 4, mode="sum"
    )
  )
  _, out = f(p, batch)
  assert not bool(out.valid)


def test_docs_page_examples_run(capsys):
  """Every python block of docs/microbatching.md runs, in order, in one
  namespace (their asserts check the claims against references)."""
  page = pathlib.Path(__file__).parents[2] / "docs" / "microbatching.md"
  blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)
  assert len(blocks) >= 5
  ns = {}
  for i, code in enumerate(blocks):
    exec(compile(code, f"docs/microbatching.md block {i}", "exec"), ns)  # pylint: disable=exec-used
  out = capsys.readouterr().out
  assert "all-reduces in the compiled step: 1" in out
