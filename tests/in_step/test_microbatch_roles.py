"""In-step microbatching's argument roles and split against independent
references: the full-batch gradient, ``optax.microbatching.microbatch``'s own
split of the same batch, and hand-written ``jax.grad`` loops over the same
microbatches where random keys or threaded state make the split matter (over
several Adam windows).

Covers: arguments neither differentiated nor split holding any value;
keyword batch arguments, a batch axis other than 0, ``microbatch_size``;
the contiguous split and ragged batches (a loader's padded batch, real rows
first, with ``num_real_microbatches``); ``grads_dtype``; a random key folded
per microbatch; state threaded through the loop."""

from __future__ import annotations

import functools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa

D, H = 3, 6
Error = wa.WeightedAccumulationError


def _params(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.standard_normal((D, H)) * 0.5, dtype),
    "v": jnp.asarray(rng.standard_normal(H) * 0.5, dtype),
  }


def _batch(n, seed=1, real=None):
  """``n`` rows; the first ``real`` have a random number of valid tokens
  (1..4 of 4), the rest are padding (all-zero mask), as a loader pads a
  short last batch."""
  rng = np.random.default_rng(seed)
  real = n if real is None else real
  tokens = np.zeros(n, np.int64)
  tokens[:real] = rng.integers(1, 5, real)
  mask = (np.arange(4)[None] < tokens[:, None]).astype(np.float32)
  return {
    "x": jnp.asarray(rng.standard_normal((n, 4, D)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal((n, 4)), jnp.float32),
    "mask": jnp.asarray(mask),
  }


def _per_token(p, b):
  return (jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2


def sum_loss(p, b):
  return jnp.sum(b["mask"] * _per_token(p, b)), jnp.sum(b["mask"])


def _full(p, b):
  """The reference: the gradient of the whole batch's mean token loss."""
  return jax.grad(lambda p: sum_loss(p, b)[0] / jnp.sum(b["mask"]))(p)


def rel_err(got, want):
  return max(
    float(jnp.max(jnp.abs(jnp.asarray(g, jnp.float32) - r)))
    / float(jnp.max(jnp.abs(r)))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )


# -------------------------- arguments neither differentiated nor split --


def test_arguments_passed_unchanged_may_hold_any_value():
  """A string flag, a function, an int and None, as jax.grad takes them
  (eagerly, under jit as static arguments, and inside shard_map)."""
  p, b = _params(), _batch(16)

  def loss(p, b, flag, act, power, nothing):
    assert flag == "tokens" and nothing is None
    pred = act(b["x"] @ p["w"]) @ p["v"]
    return jnp.sum(b["mask"] * (pred - b["y"]) ** power), jnp.sum(b["mask"])

  f = wa.microbatched_value_and_grad(loss, 4, mode="sum")
  ref = _full(p, b)
  extra = ("tokens", jnp.tanh, 2, None)
  assert rel_err(f(p, b, *extra)[1].grads, ref) < 1e-5
  jitted = jax.jit(f, static_argnums=(2, 3, 4, 5))
  assert rel_err(jitted(p, b, *extra)[1].grads, ref) < 1e-5

  fd = wa.microbatched_value_and_grad(loss, 2, mode="sum", axis_name="data")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  dp = jax.jit(
    jax.shard_map(
      lambda p, b: fd(p, b, *extra),
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
    )
  )
  assert rel_err(dp(p, b)[1].grads, ref) < 1e-5


# ---------------------- optax.microbatching's calling conventions --


def test_keyword_batches_axis_and_microbatch_size_match_optax():
  """Keyword batch arguments (``batch_argnames``), batch axes other than 0
  (``in_axes``), a keyword argument passed through and ``microbatch_size``:
  the same result as optax.microbatching.microbatch given the same
  conventions (its own split), and as the full batch."""
  p, b = _params(), _batch(16)

  def loss(p, x, *, y, mask, power=2):
    pred = jnp.tanh(jnp.moveaxis(x, 2, 0) @ p["w"]) @ p["v"]
    return jnp.sum(mask.T * (pred - y.T) ** power), jnp.sum(mask)

  x = jnp.moveaxis(b["x"], 0, 2)  # (4, D, B): batch axis 2
  y, mask = b["y"].T, b["mask"].T  # (4, B): batch axis 1
  common = dict(in_axes=(2, 1, 1))  # optax's: one per batch argument
  f = wa.microbatched_value_and_grad(
    loss,
    mode="sum",
    microbatch_size=4,
    batch_argnums={1: 2, "y": 1, "mask": 1},  # argument -> batch axis
  )
  (loss_value, out) = jax.jit(f)(p, x, y=y, mask=mask, power=2)
  ref = _full(p, b)
  assert rel_err(out.grads, ref) < 1e-5 and int(out.issued) == 4
  theirs = optax.microbatching.microbatch(
    jax.value_and_grad(loss, has_aux=True),
    argnums=1,
    argnames=("y", "mask"),
    microbatch_size=4,
    accumulator=wa.optax_accumulator("sum"),
    **common,
  )
  (o_loss, o_weight), o_grads = jax.jit(theirs)(p, x, y=y, mask=mask, power=2)
  assert rel_err(out.grads, o_grads) < 1e-5
  assert float(out.weight) == float(o_weight) == float(b["mask"].sum())
  np.testing.assert_allclose(loss_value, o_loss, rtol=1e-6)


def test_keyword_batch_only_needs_no_batch_argnums():
  p, b = _params(), _batch(8)
  f = wa.microbatched_value_and_grad(
    lambda p, *, batch: sum_loss(p, batch),
    2,
    mode="sum",
    batch_argnums="batch",
  )
  assert rel_err(f(p, batch=b)[1].grads, _full(p, b)) < 1e-5


@given(
  st.sampled_from([0, 1, 2, -1]),
  st.sampled_from([0, 1, -1]),
  st.sampled_from([1, 2, 4, 8]),
  st.sampled_from(["strided", "contiguous"]),
  st.integers(0, 99),
)
@settings(max_examples=10)  # eager: each example builds and runs a new f
def test_any_batch_axis_and_split_equals_the_full_batch(ax, ay, k, split, seed):
  """The inputs' batch axis at ``ax`` (x, 3-D) and ``ay`` (targets and
  mask, 2-D; negative: from the end), any split: the full batch's result."""
  p, b = _params(seed % 3), _batch(8, seed)
  ax_pos = ax % 3 if ax < 0 else ax
  ay_pos = ay % 2 if ay < 0 else ay

  def loss(p, x, ym):
    y, m = (jnp.moveaxis(v, ay_pos, 0) for v in ym)
    return sum_loss(p, {"x": jnp.moveaxis(x, ax_pos, 0), "y": y, "mask": m})

  x = jnp.moveaxis(b["x"], 0, ax_pos)
  ym = tuple(jnp.moveaxis(b[key], 0, ay_pos) for key in ("y", "mask"))
  f = wa.microbatched_value_and_grad(
    loss, k, mode="sum", batch_argnums={1: ax, 2: ay}, split=split
  )
  _, out = f(p, x, ym)
  assert rel_err(out.grads, _full(p, b)) < 1e-5


# ----------------------------------------------------------- ragged batches --


@functools.cache
def _contiguous_step(k):
  """One compilation per K: the number of real microbatches is traced."""
  f = wa.microbatched_value_and_grad(
    sum_loss, k, mode="sum", split="contiguous"
  )
  return jax.jit(lambda p, b, n: f(p, b, num_real_microbatches=n))


@given(st.integers(1, 16), st.sampled_from([1, 2, 4, 8]), st.integers(0, 99))
def test_a_loaders_padded_batch_keeps_every_real_row(real, k, seed):
  """Real rows first, padding after (a loader's short last batch): with the
  contiguous split and ``num_real_microbatches = ceil(real / (B/K))`` every
  real row is computed and the result is the full batch's."""
  p, b = _params(), _batch(16, seed, real=real)
  rows = 16 // k
  n_real = -(-real // rows)
  _, out = _contiguous_step(k)(p, b, jnp.int32(n_real))
  assert float(out.weight) == float(b["mask"].sum())
  assert int(out.issued) == n_real
  assert rel_err(out.grads, _full(p, b)) < 1e-5


def test_ragged_batch_of_the_report_and_strided_needs_a_named_split():
  """10 real rows of 16, K = 4, 3 real microbatches: all real tokens kept
  contiguously; without split= the call is refused; a named strided split
  computes rows k::K (k < 3), as it says."""
  p, b = _params(), _batch(16, 3, real=10)
  tokens = float(b["mask"].sum())
  contiguous = wa.microbatched_value_and_grad(
    sum_loss, 4, mode="sum", split="contiguous"
  )
  _, out = contiguous(p, b, num_real_microbatches=3)
  assert float(out.weight) == tokens
  default = wa.microbatched_value_and_grad(sum_loss, 4, mode="sum")
  with pytest.raises(Error, match="split='contiguous'"):
    default(p, b, num_real_microbatches=3)
  strided = wa.microbatched_value_and_grad(
    sum_loss, 4, mode="sum", split="strided"
  )
  _, out = strided(p, b, num_real_microbatches=3)
  kept = dict(b, mask=b["mask"] * (np.arange(16) % 4 < 3)[:, None])
  assert float(out.weight) == float(kept["mask"].sum()) < tokens
  assert rel_err(out.grads, _full(p, kept)) < 1e-5


def test_contiguous_split_inside_shard_map_per_replica_ragged():
  """Each replica splits its own rows contiguously and runs its own number
  of real microbatches (a traced, per-replica value)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  p = _params()
  real = [8, 3, 0, 6]  # real rows per replica (of 8), first
  parts = [_batch(8, 10 + r, real=n) for r, n in enumerate(real)]
  b = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
  n_real = jnp.asarray([-(-n // 2) for n in real], jnp.int32)  # K=4, 2 rows
  f = wa.microbatched_value_and_grad(
    sum_loss, 4, mode="sum", split="contiguous", axis_name="data"
  )
  dp = jax.jit(
    jax.shard_map(
      lambda p, b, n: f(p, b, num_real_microbatches=n[0]),
      mesh=mesh,
      in_specs=(P(), P("data"), P("data")),
      out_specs=P(),
    )
  )
  _, out = dp(p, b, n_real)
  assert float(out.weight) == float(b["mask"].sum())
  assert rel_err(out.grads, _full(p, b)) < 1e-5


# ------------------------------------------------------------- grads dtype --


@pytest.mark.parametrize("pdtype", [jnp.bfloat16, jnp.float16])
def test_grads_dtype_params_returns_each_params_dtype(pdtype):
  p32, b = _params(), _batch(16)
  p = {"w": p32["w"].astype(pdtype), "v": p32["v"]}  # mixed dtypes
  ref = _full(jax.tree.map(lambda x: x.astype(jnp.float32), p), b)
  f = wa.microbatched_value_and_grad(sum_loss, 4, mode="sum")
  assert f(p, b)[1].grads["w"].dtype == jnp.float32  # the work dtype
  g = wa.microbatched_value_and_grad(
    sum_loss, 4, mode="sum", grads_dtype="params"
  )
  out = g(p, b)[1]
  assert out.grads["w"].dtype == pdtype and out.grads["v"].dtype == jnp.float32
  assert rel_err(out.grads, ref) < 2e-2  # the half-precision forward
  h = wa.microbatched_value_and_grad(
    sum_loss, 4, mode="sum", grads_dtype=jnp.bfloat16
  )
  assert {x.dtype for x in jax.tree.leaves(h(p, b)[1].grads)} == {
    jnp.dtype(jnp.bfloat16)
  }


@pytest.mark.parametrize(
  "pdtype,grads_dtype,terms",
  [
    (jnp.float16, "params", False),
    (jnp.float32, jnp.float16, False),
    (jnp.float32, jnp.float16, True),
  ],
)
def test_a_mean_the_grads_dtype_cannot_hold_is_not_valid(
  pdtype, grads_dtype, terms
):
  """Validity is decided on the gradient as returned: a float16 mean of
  120000 (microbatch gradients of 30000 over weight 0.25 each; with two loss
  terms, two means of 60000) is Inf, valid=False, and apply_window leaves
  the params; 8000 is valid and equals float64 NumPy's mean."""

  def loss_fn(w, x):
    s = jnp.sum(w.astype(jnp.float32) * x)
    return ({"a": s / 2, "b": s / 2} if terms else s), jnp.float32(0.25)

  f = jax.jit(
    wa.microbatched_value_and_grad(
      loss_fn, 2, mode="sum", grads_dtype=grads_dtype
    )
  )
  tx = optax.sgd(2.0**-10)
  for row, ok in ((15000.0, False), (1000.0, True)):
    w = jnp.ones((), pdtype)
    _, out = f(w, jnp.full(4, row))
    assert out.grads.dtype == jnp.float16 and bool(out.valid) is ok
    assert bool(out.finite)
    if ok:
      assert float(out.grads) == np.float64(row) * 4 / 0.5
    p, _, _, _ = wa.apply_window(tx, out, w, tx.init(w))
    assert float(p) == (1.0 - 2.0**-10 * 8000 if ok else 1.0)


def test_complex_params_are_refused_as_wa_init_refuses_them():
  """One rule: a complex param is refused, naming its leaf, by the in-step
  function, wa.init and WeightedMultiSteps (it was silently held fixed, so
  never trained, where eqx.filter_grad trains it)."""
  p = {"r": jnp.ones(2), "c": jnp.ones(2, jnp.complex64)}

  def loss(p, x):
    return jnp.sum(jnp.abs(p["c"] * x) ** 2 + p["r"] * x), jnp.float32(2)

  f = wa.microbatched_value_and_grad(loss, 2, mode="sum")
  ms = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="sum")
  for call in (
    lambda: f(p, jnp.ones(4)),
    lambda: wa.init(p),
    lambda: ms.init(p),
  ):
    with pytest.raises(Error, match=r"\['c'\].*complex"):
      call()


# ------------------------------------------------ a random key per microbatch --


def _dropout_loss(p, b, key, rate=0.5):
  keep = jax.random.bernoulli(key, 1 - rate, b["mask"].shape)
  h = jnp.tanh(b["x"] @ p["w"])
  pred = h @ p["v"]
  m = b["mask"] * keep
  return (jnp.sum(m * (pred - b["y"]) ** 2), jnp.sum(b["mask"])), keep


def _grad(loss, p, *args):
  """``jax.grad`` of a loss returning ``((sum, weight), aux)``: the grads
  of the sum, the weight and the aux."""

  def f(p):
    (total, w), aux = loss(p, *args)
    return total, (w, aux)

  g, (w, aux) = jax.grad(f, has_aux=True)(p)
  return g, w, aux


def _rows(n, k, split):
  if split == "strided":
    return [np.arange(i, n, k) for i in range(k)]
  return [np.arange(i * n // k, (i + 1) * n // k) for i in range(k)]


def _hand_loop(loss, p, b, key, k, split):
  """The reference: jax.grad per microbatch, the key folded with its index,
  grads of the loss sums added and divided once."""
  g_sum, w_sum, keeps = None, 0.0, []
  for i, r in enumerate(_rows(b["mask"].shape[0], k, split)):
    mb = jax.tree.map(lambda x, r=r: x[r], b)
    g, w, keep = _grad(loss, p, mb, jax.random.fold_in(key, i))
    g_sum = g if g_sum is None else jax.tree.map(jnp.add, g_sum, g)
    w_sum += float(w)
    keeps.append(keep)
  return jax.tree.map(lambda x: x / w_sum, g_sum), keeps


@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("raw", [False, True])
def test_key_per_microbatch_matches_a_hand_loop(split, raw):
  p, b = _params(), _batch(16)
  key = jax.random.PRNGKey(3) if raw else jax.random.key(3)
  f = jax.jit(
    wa.microbatched_value_and_grad(
      _dropout_loss, 4, mode="sum", has_aux=True, key_argnums=2, split=split
    )
  )
  (_, keeps), out = f(p, b, key)
  ref, ref_keeps = _hand_loop(_dropout_loss, p, b, key, 4, split)
  assert rel_err(out.grads, ref) < 1e-5
  np.testing.assert_array_equal(keeps, np.stack(ref_keeps))
  # Dropout differs across microbatches (the same key for all would not).
  assert len({np.asarray(k).tobytes() for k in keeps}) == 4


def test_a_pytree_of_keys_and_bad_keys():
  p, b = _params(), _batch(8)

  def loss(p, b, keys):
    (s, n), _ = _dropout_loss(p, b, keys["dropout"])
    noise = jax.random.normal(keys["noise"], ())
    return s * (1 + 0 * noise), n

  f = wa.microbatched_value_and_grad(loss, 2, mode="sum", key_argnums=2)
  keys = {"dropout": jax.random.key(0), "noise": jax.random.key(1)}
  assert bool(f(p, b, keys)[1].valid)
  with pytest.raises(Error, match="one PRNG key"):
    f(p, b, {"dropout": jax.random.split(jax.random.key(0), 2), "noise": 1})


def test_dropout_training_over_adam_windows_matches_a_hand_loop():
  """Three Adam steps, each a window of K microbatches with dropout: the
  same params as a hand-written loop that folds the step's key per
  microbatch (a weighting or key error cannot hide behind Adam's first
  step)."""
  tx = optax.adam(0.05)
  f = wa.microbatched_value_and_grad(
    _dropout_loss, 4, mode="sum", has_aux=True, key_argnums=2
  )

  @jax.jit
  def step(p, opt, b, key):
    (_, _), out = f(p, b, key)
    updates, opt = tx.update(out.grads, opt, p)
    return optax.apply_updates(p, updates), opt

  p = ref = _params()
  opt = ref_opt = tx.init(p)
  for s in range(3):
    b, key = _batch(16, seed=20 + s), jax.random.key(100 + s)
    p, opt = step(p, opt, b, key)
    g, _ = _hand_loop(_dropout_loss, ref, b, key, 4, "strided")
    updates, ref_opt = tx.update(g, ref_opt, ref)
    ref = optax.apply_updates(ref, updates)
  assert rel_err(p, ref) < 1e-5


# ----------------------------------------------- state through the loop --


def _bn_loss(p, b, stats):
  """A batch-norm-like layer: normalises by this microbatch's statistics
  and returns running statistics advanced by them (momentum 0.9) and a
  step count."""
  h = b["x"] @ p["w"]
  m = b["mask"][..., None]
  n = jnp.maximum(m.sum(), 1.0)
  mu = jnp.sum(m * h, axis=(0, 1)) / n
  var = jnp.sum(m * (h - mu) ** 2, axis=(0, 1)) / n
  pred = jnp.tanh((h - mu) / jnp.sqrt(var + 1e-3)) @ p["v"]
  loss = jnp.sum(b["mask"] * (pred - b["y"]) ** 2)
  new = {
    "mean": 0.9 * stats["mean"] + 0.1 * jax.lax.stop_gradient(mu),
    "var": 0.9 * stats["var"] + 0.1 * jax.lax.stop_gradient(var),
    "count": stats["count"] + 1,
  }
  return (loss, jnp.sum(b["mask"])), new


def _stats():
  return {
    "mean": jnp.zeros(H),
    "var": jnp.ones(H),
    "count": jnp.zeros((), jnp.int32),
  }


def _state_sums(p, b, stats, k, n_real=None):
  """The reference: jax.grad per strided microbatch, the state threaded by
  hand; returns the grads' sum, the weight and the last state."""
  g_sum, w_sum = None, 0.0
  for i in range(k if n_real is None else n_real):
    mb = jax.tree.map(lambda x, i=i: x[i::k], b)
    g, w, stats = _grad(_bn_loss, p, mb, stats)
    g_sum = g if g_sum is None else jax.tree.map(jnp.add, g_sum, g)
    w_sum += float(w)
  return g_sum, w_sum, stats


def _hand_state_loop(p, b, stats, k, n_real=None):
  g_sum, w_sum, stats = _state_sums(p, b, stats, k, n_real)
  return jax.tree.map(lambda x: x / w_sum, g_sum), stats


def test_state_advances_from_microbatch_to_microbatch():
  p, b = _params(), _batch(16)
  f = jax.jit(
    wa.microbatched_value_and_grad(
      _bn_loss, 4, mode="sum", state_argnums=2, split="strided"
    )
  )
  (loss, out), stats = f(p, b, _stats())
  ref, ref_stats = _hand_state_loop(p, b, _stats(), 4)
  assert rel_err(out.grads, ref) < 1e-5
  assert int(stats["count"]) == 4
  np.testing.assert_allclose(stats["mean"], ref_stats["mean"], rtol=1e-5)
  np.testing.assert_allclose(stats["var"], ref_stats["var"], rtol=1e-5)
  # Microbatches not run do not advance it.
  (_, out), stats = f(p, b, _stats(), num_real_microbatches=2)
  ref, ref_stats = _hand_state_loop(p, b, _stats(), 4, n_real=2)
  assert int(stats["count"]) == 2 and rel_err(out.grads, ref) < 1e-5
  np.testing.assert_allclose(stats["mean"], ref_stats["mean"], rtol=1e-5)


def test_state_over_adam_windows_and_through_accumulate():
  tx = optax.adam(0.05)
  f = wa.microbatched_value_and_grad(_bn_loss, 4, mode="sum", state_argnums=2)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(p, opt, stats, b):
    (_, out), stats = f(p, b, stats)
    updates, opt = tx.update(out.grads, opt, p)
    return optax.apply_updates(p, updates), opt, stats

  p, stats = _params(), _stats()
  opt = tx.init(p)
  ref, ref_stats, ref_opt = _params(), _stats(), tx.init(_params())
  for s in range(3):
    b = _batch(16, seed=30 + s)
    p, opt, stats = step(p, opt, stats, b)
    g, ref_stats = _hand_state_loop(ref, b, ref_stats, 4)
    updates, ref_opt = tx.update(g, ref_opt, ref)
    ref = optax.apply_updates(ref, updates)
  assert rel_err(p, ref) < 1e-5 and int(stats["count"]) == 12
  np.testing.assert_allclose(stats["var"], ref_stats["var"], rtol=1e-5)

  # .accumulate threads it too: two calls, one window.
  b1, b2 = _batch(16, seed=40), _batch(16, seed=41)
  acc = jax.jit(f.accumulate)
  ((_, _), window), stats = acc(wa.init(ref), ref, b1, _stats())
  ((_, _), window), stats = acc(window, ref, b2, stats)
  out, _ = wa.finish_mean(window)
  g1, w1, s1 = _state_sums(ref, b1, _stats(), 4)  # the first call's state
  g2, w2, s2 = _state_sums(ref, b2, s1, 4)  # carries into the second call
  g = jax.tree.map(lambda x, y: (x + y) / (w1 + w2), g1, g2)
  assert rel_err(out.grads, g) < 1e-5 and int(stats["count"]) == 8
  np.testing.assert_allclose(stats["mean"], s2["mean"], rtol=1e-5)


def test_state_must_keep_its_shape():
  p, b = _params(), _batch(8)

  def grows(p, b, s):
    return sum_loss(p, b), jnp.concatenate([s, s])

  f = wa.microbatched_value_and_grad(grows, 2, mode="sum", state_argnums=2)
  with pytest.raises(Error, match="not shaped"):
    f(p, b, jnp.zeros(2))
  g = wa.microbatched_value_and_grad(
    lambda p, b, s: sum_loss(p, b), 2, mode="sum", state_argnums=2
  )
  with pytest.raises(Error, match="new_state"):
    g(p, b, jnp.zeros(2))


def test_state_inside_shard_map_is_per_replica():
  """Each replica threads its own state through its microbatches; the
  gradient is the global one: the sum over replicas and microbatches of
  the hand loop's grads over the total weight."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  p, b = _params(), _batch(16)
  f = wa.microbatched_value_and_grad(
    _bn_loss, 2, mode="sum", state_argnums=2, axis_name="data"
  )

  def per_replica(p, b, stats):
    (_, out), stats = f(p, b, stats)
    return out.grads, jax.tree.map(lambda s: s[None], stats)

  grads, stats = jax.jit(
    jax.shard_map(
      per_replica,
      mesh=mesh,
      in_specs=(P(), P("data"), P()),
      out_specs=(P(), P("data")),
    )
  )(p, b, _stats())
  g_sum, w_sum = None, 0.0
  for r in range(2):  # replica r holds rows [8r, 8r + 8), split i::2
    local = jax.tree.map(lambda x, r=r: x[8 * r : 8 * r + 8], b)
    g, w, s = _state_sums(p, local, _stats(), 2)
    g_sum = g if g_sum is None else jax.tree.map(jnp.add, g_sum, g)
    w_sum += w
    np.testing.assert_allclose(stats["mean"][r], s["mean"], rtol=1e-5)
    assert int(stats["count"][r]) == 2
  assert rel_err(grads, jax.tree.map(lambda x: x / w_sum, g_sum)) < 1e-5


# --------------------------------------------------------------------- errors --


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(num_microbatches=None), "exactly one"),
    (dict(microbatch_size=4), "exactly one"),
    (dict(state_argnums=0), "both argnums and state_argnums"),
    (dict(key_argnums=1), "both batch_argnums and key_argnums"),
    (dict(batch_argnums={1: 0.5}), r"batch_argnums' axes \(0.5,\)"),
    (dict(batch_argnums=[1, 2.5]), "batch_argnums"),
    (dict(in_axes=(0, 1)), r"batch_argnums=\{1: 0, 'mask': 1\}"),
    (dict(batch_argnames="x"), r"batch_argnames=\) .* batch_argnums=\("),
    (dict(split="rows"), "split"),
    (dict(grads_dtype=jnp.int8), "grads_dtype='params'"),
    (dict(argnums=()), "nothing to differentiate"),
  ],
)
def test_configuration_errors_name_the_argument(kwargs, match):
  args = dict(num_microbatches=4, mode="sum")
  args.update(kwargs)
  with pytest.raises(Error, match=match):
    wa.microbatched_value_and_grad(
      sum_loss, args.pop("num_microbatches"), **args
    )


def test_call_errors_name_the_argument():
  p, b = _params(), _batch(16)
  kw = wa.microbatched_value_and_grad(
    sum_loss, 4, mode="sum", batch_argnums="b"
  )
  with pytest.raises(Error, match="no such keyword"):
    kw(p, b)
  ax = wa.microbatched_value_and_grad(
    sum_loss, 4, mode="sum", batch_argnums={1: 3}
  )
  with pytest.raises(Error, match="no batch axis 3"):
    ax(p, b)
  size = wa.microbatched_value_and_grad(sum_loss, mode="sum", microbatch_size=5)
  with pytest.raises(Error, match="microbatch_size=5"):
    size(p, b)
  f = wa.microbatched_value_and_grad(sum_loss, 4, mode="sum")
  with pytest.raises(Error, match="no floating leaf.*got int"):
    f(1, b)  # as jax.grad(f)(1): an int is not differentiable


def _scalar_loss(w, x, m):
  return jnp.sum(m * (x * w) ** 2), jnp.sum(m)


@pytest.mark.parametrize("k", [1, 4])
def test_a_python_float_param_is_differentiated_as_jax_grad_does(k):
  """``f(1.5, ...)``: jax.grad and optax.microbatching take a Python float
  as the differentiated argument; so does this function (a float32
  scalar). References: jax.grad of the full batch's weighted mean, and
  optax's microbatch of the same split with the library's accumulator."""
  x = jnp.arange(8.0)
  m = jnp.asarray([1.0, 1, 1, 0, 1, 1, 0, 1])
  ref = jax.grad(lambda w: _scalar_loss(w, x, m)[0] / m.sum())(1.5)
  f = wa.microbatched_value_and_grad(
    _scalar_loss, k, mode="sum", batch_argnums=(1, 2)
  )
  for g in (f, jax.jit(f)):
    _, out = g(1.5, x, m)
    assert out.grads.dtype == jnp.float32 and out.grads.shape == ()
    np.testing.assert_allclose(float(out.grads), float(ref), rtol=1e-6)
  (_, _), ograds = optax.microbatching.microbatch(
    jax.value_and_grad(_scalar_loss, has_aux=True),
    argnums=(1, 2),
    microbatch_size=8 // k,
    accumulator=wa.optax_accumulator("sum"),
  )(1.5, x, m)
  np.testing.assert_allclose(float(ograds), float(ref), rtol=1e-6)


def test_python_floats_beside_arrays_stay_fixed():
  """Where an argument has floating arrays, its Python floats are held
  fixed (as eqx.filter_value_and_grad holds an Equinox module's ``p:
  float``): no gradient leaf for them."""
  x = jnp.arange(8.0)
  m = jnp.ones(8)
  f = wa.microbatched_value_and_grad(
    lambda p, x, m: _scalar_loss(p["w"] * p["c"], x, m),
    4,
    mode="sum",
    batch_argnums=(1, 2),
  )
  _, out = f({"w": jnp.asarray(1.5), "c": 2.0}, x, m)
  assert out.grads["c"] is None
  ref = jax.grad(lambda w: _scalar_loss(w * 2.0, x, m)[0] / 8)(1.5)
  np.testing.assert_allclose(float(out.grads["w"]), float(ref), rtol=1e-6)


def _two_batch_args(p, x, y):
  return jnp.sum(x * p["w"] * y), jnp.float32(x.shape[0])


@pytest.mark.parametrize("jit", [False, True])
def test_a_forgotten_batch_argument_is_named_with_batch_argnums(jit):
  """``y`` is part of the batch but batch_argnums names ``x`` only: loss_fn
  meets 8 rows of ``x`` and 16 of ``y``. The error names the argument and
  the batch_argnums that splits it; with it the result is the full-batch
  gradient."""
  p = {"w": jnp.ones(4)}
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), "f4")
  y = jnp.asarray(np.random.default_rng(1).standard_normal((16, 4)), "f4")
  f = wa.microbatched_value_and_grad(_two_batch_args, 2, mode="sum")
  f = jax.jit(f) if jit else f
  with pytest.raises(
    Error,
    match=r"argument 2 is passed unchanged.*16 rows.*batch_argnums=\(1, 2\)",
  ) as info:
    f(p, x, y)
  assert isinstance(info.value.__cause__, TypeError)  # loss_fn's own error
  good = wa.microbatched_value_and_grad(
    _two_batch_args, 2, mode="sum", batch_argnums=(1, 2)
  )
  _, out = good(p, x, y)
  ref = jax.grad(lambda p: _two_batch_args(p, x, y)[0] / 16)(p)
  np.testing.assert_allclose(out.grads["w"], ref["w"], rtol=1e-5)


def test_a_failing_loss_fn_without_a_batch_sized_argument_keeps_its_error():
  def bad(p, x, table):
    return jnp.sum(x @ table * p["w"]), jnp.float32(1.0)  # (8,4)@(3,4)

  f = wa.microbatched_value_and_grad(bad, 2, mode="sum")
  with pytest.raises(TypeError, match="dot_general"):
    f({"w": jnp.ones(4)}, jnp.ones((16, 4)), jnp.ones((3, 4)))
