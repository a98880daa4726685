"""Data parallelism: exact global weighting across replicas.

Every equivalence is against an independent reference: the single-device
full-batch gradient of the window's mean loss over the concatenated data
(``_dp_common.reference_grad``), float32, rtol 1e-5. Replicas get unequal
local item counts (fractional importance weights), and one replica has no
item in the whole window.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import socket
import subprocess
import sys

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import _dp_common as common
import weighted_accum as wa
from weighted_accum import distributed as dist
from weighted_accum._src.core import tree_utils as _tree

R = 8  # replicas on the 8-device CPU mesh
K = 3  # microbatches per window
B = 4  # items per replica per microbatch
RTOL = 1e-5

ERRORS: dict[str, float] = {}


def _record(label: str, got, ref) -> float:
  err = common.max_rel_err(got, ref)
  ERRORS[label] = max(err, ERRORS.get(label, 0.0))
  assert err <= RTOL, f"{label}: max relative error {err:.3g} > {RTOL}"
  return err


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
  yield
  if ERRORS:
    print("\nmax relative error (leaf-scaled) vs the reference:")
    for k, v in sorted(ERRORS.items()):
      print(f"  {k}: {v:.3g}")


def _mesh1d():
  return jax.sharding.Mesh(np.array(jax.devices()[:R]), ("data",))


@pytest.fixture(scope="module")
def params():
  return jax.tree.map(jnp.asarray, common.make_params(0))


# ------------------------------------------------------------ explicit style


@functools.cache
def _explicit_step(grads_way: str, kind: str, reduce: str):
  """A jitted shard_map step: scan over K microbatches, finish, return the
  global result. ``grads_way``: 'local' (local_grad), 'reduced' (plain
  jax.grad of unvarying params: autodiff sums them), 'core' (local_grad, the
  core accumulate and finish_sums, then reduce_sums), 'novma' (check_vma off:
  jax.grad gives local grads)."""
  mesh = _mesh1d()
  f = common.loss_sum if kind == "sum" else common.loss_mean

  def body(params, x, y, m):
    if grads_way == "core" and reduce == "microbatch":
      state = wa.init(params)  # a global window of local sums: reduce_sums
    else:
      state = wa.init(params, axis_name="data", reduce=reduce)

    def microbatch(state, inp):
      xi, yi, mi = inp
      n = jnp.sum(mi)
      if grads_way in ("local", "core"):
        g = dist.local_grad(f, "data")(params, xi, yi, mi)
      else:
        g = jax.grad(f)(params, xi, yi, mi)
      acc = wa.accumulate_sum if kind == "sum" else wa.accumulate_mean
      return acc(state, g, n), None

    state, _ = jax.lax.scan(microbatch, state, (x, y, m))
    if grads_way == "core":
      local, _ = wa.finish_sums(state)
      out = dist.reduce_sums(local, "data")
    else:
      out, _ = wa.finish_mean(state)
    # Flags are returned per replica to check they agree everywhere.
    flags = jnp.stack([out.valid, out.finite])[None]
    if grads_way != "novma":
      flags = jax.lax.pcast(flags, "data", to="varying")
    return out.grads, out.weight, out.issued, flags

  spec = P(None, "data")
  return jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), spec, spec, spec),
      out_specs=(P(), P(), P(), P("data")),
      check_vma=grads_way != "novma",
    )
  )


CONFIGS = [
  ("local", "sum", "window"),
  ("local", "mean", "window"),
  ("local", "sum", "microbatch"),
  ("local", "mean", "microbatch"),
  ("reduced", "sum", "window"),
  ("reduced", "sum", "microbatch"),
  ("core", "sum", "window"),
  ("core", "mean", "window"),
  ("novma", "sum", "window"),
  ("novma", "mean", "window"),
]


@pytest.mark.parametrize(
  "grads_way,kind,reduce", CONFIGS, ids=["-".join(c) for c in CONFIGS]
)
@hypothesis.given(
  seed=st.integers(0, 2**31 - 1),
  zero_replica=st.integers(0, R - 1),
  zero_prob=st.sampled_from([0.0, 0.3, 0.6]),
)
def test_shard_map_equals_full_batch(
  params, grads_way, kind, reduce, seed, zero_replica, zero_prob
):
  x, y, m = common.make_data(seed, K, R, B, zero_replica, zero_prob)
  grads, weight, issued, flags = _explicit_step(grads_way, kind, reduce)(
    params, x, y, m
  )
  ref = common.reference_grad(params, x, y, m)
  _record(f"shard_map {grads_way} grads, {kind}, reduce={reduce}", grads, ref)
  assert float(weight) == pytest.approx(float(m.sum()), rel=1e-6)
  assert int(issued) == K * R
  assert np.asarray(flags).all()  # valid and finite on every replica


def test_reduced_mean_with_equal_counts(params):
  """Autodiff-reduced gradients of per-replica MEANS are right when every
  replica divides by the same count (an unvarying weight)."""
  x, y, m = common.make_data(1, K, R, B, zero_prob=0.0)
  m = np.ones_like(m)
  mesh = _mesh1d()
  for reduce in ("window", "microbatch"):

    def body(params, x, y, m, reduce=reduce):
      state = wa.init(params, axis_name="data", reduce=reduce)
      for k in range(K):
        g = jax.grad(common.loss_mean)(params, x[k], y[k], m[k])
        assert dist.is_reduced(g, "data")
        state = wa.accumulate_mean(state, g, B)
      return wa.finish_mean(state)[0].grads

    spec = P(None, "data")
    got = jax.jit(
      jax.shard_map(
        body, mesh=mesh, in_specs=(P(), spec, spec, spec), out_specs=P()
      )
    )(params, x, y, m)
    _record(
      f"shard_map reduced grads, mean (equal counts), reduce={reduce}",
      got,
      common.reference_grad(params, x, y, m),
    )


def test_reduced_mean_with_unequal_counts_raises(params):
  x, y, m = common.make_data(2, 1, R, B)
  mesh = _mesh1d()

  def body(params, x, y, m):
    g = jax.grad(common.loss_mean)(params, x[0], y[0], m[0])
    state = wa.accumulate_mean(
      wa.init(params, axis_name="data"), g, jnp.sum(m[0])
    )
    return wa.finish_mean(state)[0].grads

  spec = P(None, "data")
  with pytest.raises(wa.WeightedAccumulationError, match="local_grad"):
    jax.eval_shape(
      jax.shard_map(
        body, mesh=mesh, in_specs=(P(), spec, spec, spec), out_specs=P()
      ),
      params,
      x,
      y,
      m,
    )


def test_the_autodiff_trap_is_real(params):
  """Canary for the jax behaviour the helpers are designed around: inside
  shard_map the grad of an unvarying param is already summed over the axis,
  so an explicit psum multiplies it by the replica count; local_grad's is
  not, and psum of it is the true sum."""
  x, y, m = common.make_data(3, 1, R, B, zero_prob=0.0)
  mesh = _mesh1d()

  def body(params, x, y, m):
    auto = jax.grad(common.loss_sum)(params, x[0], y[0], m[0])
    local = dist.local_grad(common.loss_sum, "data")(params, x[0], y[0], m[0])
    return jax.lax.psum(auto, "data"), jax.lax.psum(local, "data"), auto

  spec = P(None, "data")
  twice, right, auto = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P(), spec, spec, spec), out_specs=P()
    )
  )(params, x, y, m)
  ref = jax.tree.map(
    lambda g: g * m.sum(), common.reference_grad(params, x, y, m)
  )
  assert common.max_rel_err(right, ref) < RTOL
  assert common.max_rel_err(auto, ref) < RTOL
  assert common.max_rel_err(twice, jax.tree.map(lambda g: R * g, ref)) < RTOL


def test_per_replica_mean_is_the_bug(params):
  """The equal-weight average of per-replica means is measurably wrong on
  the same data the tests above get exactly right (the tests can fail)."""
  x, y, m = common.make_data(4, 1, R, B, zero_replica=None, zero_prob=0.0)
  ref = common.reference_grad(params, x, y, m)
  per_replica = [
    common.reference_grad(
      params,
      x[:, r * B : (r + 1) * B],
      y[:, r * B : (r + 1) * B],
      m[:, r * B : (r + 1) * B],
    )
    for r in range(R)
  ]
  naive = jax.tree.map(lambda *g: np.mean(g, axis=0), *per_replica)
  assert common.max_rel_err(naive, ref) > 1e-2


def test_one_collective_round_per_window(params):
  """Window mode with local gradients: the compiled step has exactly one
  all-reduce (sums, weights and count together); microbatch mode has one per
  microbatch inside the loop instead."""
  x, y, m = common.make_data(5, K, R, B)
  hlo = (
    _explicit_step("local", "sum", "window")
    .lower(params, x, y, m)
    .compile()
    .as_text()
  )
  assert hlo.count(" all-reduce(") == 1, hlo
  hlo_mb = (
    _explicit_step("local", "sum", "microbatch")
    .lower(params, x, y, m)
    .compile()
    .as_text()
  )
  assert " all-reduce(" in hlo_mb and "while" in hlo_mb


# ------------------------------------------------- flags, rejection, errors


def _per_replica(x):
  """``x[None]`` typed as varying over 'data' (for out_specs=P('data'))."""
  x = jnp.asarray(x)[None]
  return (
    x
    if "data" in _tree.varying_axes(x)
    else jax.lax.pcast(x, "data", to="varying")
  )


def _run_flags(body, *args, mesh=None):
  mesh = mesh or _mesh1d()
  spec = P("data")
  return jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(),) + (spec,) * (len(args) - 1),
      out_specs=(P(), P("data")),
    )
  )(*args)


def test_non_finite_on_one_replica_is_reported_on_every_replica():
  params = {"w": jnp.zeros(3)}
  g = np.ones((R, 3), np.float32)
  g[5, 1] = np.inf

  def body(params, g):
    s = wa.accumulate_sum(wa.init(params, axis_name="data"), {"w": g[0]}, 2.0)
    out, _ = wa.finish_mean(s)
    return out.weight, _per_replica(jnp.stack([out.finite, out.valid]))

  weight, flags = _run_flags(body, params, g)
  assert float(weight) == 2.0 * R
  assert not np.asarray(flags).any()


def test_zero_global_weight_gives_zeros_invalid_and_keeps_counters():
  params = {"w": jnp.zeros(3)}
  g = np.full((R, 3), np.nan, np.float32)  # 0/0 means, all weight 0

  def body(params, g):
    s = wa.init(params, axis_name="data")
    s = wa.accumulate_mean(s, {"w": g[0]}, 0.0)
    out, new = wa.finish_mean(s)
    row = jnp.stack(
      [
        out.valid.astype(jnp.float32),
        out.weight,
        jnp.sum(out.grads["w"]),
        new.issued.astype(jnp.float32),
        new.windows.astype(jnp.float32),
      ]
    )
    return out.issued, _per_replica(row)

  issued, rows = _run_flags(body, params, g)
  np.testing.assert_array_equal(rows, np.tile([0, 0, 0, 1, 0], (R, 1)))
  assert int(issued) == R


@pytest.mark.parametrize("reduce", ("window", "microbatch"))
def test_invalid_weight_is_rejected(reduce):
  """A NaN weight on one replica: reduced now (microbatch mode) it rejects
  the microbatch everywhere; in window mode only on its replica."""
  params = {"w": jnp.zeros(2)}
  w = np.full((R,), 2.0, np.float32)
  w[3] = np.nan

  def body(params, w):
    s = wa.init(params, axis_name="data", reduce=reduce)
    g = {"w": jnp.full((2,), 3.0) + 0.0 * w[0]}  # local; NaN on replica 3
    s = wa.accumulate_sum(s, g, w[0])
    s = wa.accumulate_sum(s, jax.tree.map(jnp.ones_like, g), 1.0)
    out, _ = wa.finish_mean(s)
    return out.grads["w"], _per_replica(s.rejected)

  grads, rejected = _run_flags(body, params, w)
  if reduce == "microbatch":
    np.testing.assert_array_equal(rejected, np.ones(R))
    np.testing.assert_allclose(grads, [1.0, 1.0], rtol=RTOL)
  else:
    np.testing.assert_array_equal(rejected, np.eye(R)[3])
    # 7 replicas added 3 with weight 2, all 8 added 1 with weight 1.
    np.testing.assert_allclose(
      grads, [(7 * 3 + 8) / (7 * 2 + 8)] * 2, rtol=RTOL
    )


@pytest.mark.parametrize("reduce", ("window", "microbatch"))
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_nan_grads_of_an_empty_replica_add_nothing(reduce, kind):
  """Replica 2's microbatch is empty: its mean-loss gradient is 0/0 = NaN
  with weight 0. Nothing of it may leak into any replica's result (a 0 * NaN
  or a psum before masking would)."""
  params = {"w": jnp.zeros(2)}
  g = np.tile(np.arange(1.0, R + 1, dtype=np.float32)[:, None], (1, 2))
  w = np.arange(1.0, R + 1, dtype=np.float32)
  g[2], w[2] = np.nan, 0.0

  def body(params, g, w):
    s = wa.init(params, axis_name="data", reduce=reduce)
    acc = wa.accumulate_sum if kind == "sum" else wa.accumulate_mean
    s = acc(s, {"w": g[0]}, w[0])
    out, _ = wa.finish_mean(s)
    return out.grads["w"], _per_replica(jnp.stack([out.valid, out.finite]))

  grads, flags = _run_flags(body, params, g, w)
  keep = w > 0
  num = (g[keep, 0] * (w[keep] if kind == "mean" else 1)).sum()
  np.testing.assert_allclose(grads, [num / w.sum()] * 2, rtol=RTOL)
  assert np.asarray(flags).all()


def test_window_state_is_a_scan_carry_across_windows(params):
  """finish_mean returns a state typed like its input, so windows can run
  in a lax.scan; each window's result equals its own full-batch gradient."""
  windows = 2
  x, y, m = common.make_data(41, windows * K, R, B, zero_replica=4)
  mesh = _mesh1d()

  def body(params, x, y, m):
    def window(state, xyz):
      def microbatch(state, inp):
        g = dist.local_grad(common.loss_sum, "data")(params, *inp)
        return wa.accumulate_sum(state, g, jnp.sum(inp[2])), None

      state, _ = jax.lax.scan(microbatch, state, xyz)
      out, state = wa.finish_mean(state)
      return state, out.grads

    shape = lambda a: a.reshape(windows, K, *a.shape[1:])
    state, grads = jax.lax.scan(
      window, wa.init(params, axis_name="data"), (shape(x), shape(y), shape(m))
    )
    return grads, state.windows

  spec = P(None, "data")
  grads, n_windows = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P(), spec, spec, spec), out_specs=(P(), P())
    )
  )(params, x, y, m)
  assert int(n_windows) == windows
  for w in range(windows):
    sl = slice(w * K, (w + 1) * K)
    _record(
      "shard_map, lax.scan over windows",
      jax.tree.map(lambda a, w=w: a[w], grads),
      common.reference_grad(params, x[sl], y[sl], m[sl]),
    )


def test_errors_name_what_is_wrong():
  mesh = _mesh1d()
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  loss = lambda p, x: jnp.sum(p["a"] * x) + jnp.sum(p["b"] * x)

  def call(body):  # trace only: the errors are raised at trace time
    return jax.eval_shape(
      jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()),
      params,
      jnp.ones((R, 2)),
    )

  def mixed(p, x):
    pv = {"a": jax.lax.pcast(p["a"], "data", to="varying"), "b": p["b"]}
    g = jax.grad(loss)(pv, x[0])
    wa.accumulate_sum(wa.init(p, axis_name="data"), g, 1.0)
    return p["a"]

  with pytest.raises(wa.WeightedAccumulationError, match=r"\['b'\]"):
    call(mixed)

  def bad_reduce(p, x):
    wa.init(p, axis_name="data", reduce="step")
    return p["a"]

  with pytest.raises(wa.WeightedAccumulationError, match="reduce='step'"):
    call(bad_reduce)

  def varying_scale(p, x):
    s = wa.init(p, loss_scale=2.0, axis_name="data")
    s = s.replace(loss_scale=jax.lax.pcast(s.loss_scale, "data", to="varying"))
    wa.finish_mean(s)
    return p["a"]

  with pytest.raises(wa.WeightedAccumulationError, match="loss scale"):
    call(varying_scale)

  with pytest.raises(wa.WeightedAccumulationError, match="not bound"):
    dist.local_grad(loss, "data")(params, jnp.ones(2))
  with pytest.raises(wa.WeightedAccumulationError, match="data"):
    wa.init(params, axis_name="data")  # outside shard_map: on no such mesh


# ------------------------------------------------------------ implicit style


def _model_sharded_specs():
  """FSDP/tensor-style: the hidden dimension of every param over 'model'."""
  return {"w1": P(None, "model"), "b1": P("model"), "w2": P("model")}


def _shardings_of(tree):
  return jax.tree.map(lambda a: a.sharding, tree)


def _assert_same_shardings(tree, like, what):
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(like)
  ):
    assert a.sharding.is_equivalent_to(b, a.ndim), (
      f"{what}{jax.tree_util.keystr(path)}: {a.sharding} != {b}"
    )


@functools.cache
def _global_grad_fn(kind: str):
  f = common.loss_sum if kind == "sum" else common.loss_mean
  return jax.jit(lambda p, x, y, m: (jax.grad(f)(p, x, y, m), jnp.sum(m)))


MESHES = {
  "data8-replicated": ((8,), ("data",), None),
  "data4xmodel2-sharded": ((4, 2), ("data", "model"), _model_sharded_specs()),
  # ZeRO-3 style: the params (hence buffers) sharded over the data axis.
  "data8-fsdp-over-data": (
    (8,),
    ("data",),
    {"w1": P(None, "data"), "b1": P("data"), "w2": P("data")},
  ),
}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_implicit_global_arrays_equal_full_batch(
  params, variant, mesh_name, kind
):
  """jit over global arrays: grads of the GLOBAL microbatch loss and its
  GLOBAL item count go straight into the core functions; buffers keep the
  params' (replicated or model-sharded) sharding through every call."""
  shape, names, specs = MESHES[mesh_name]
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), names)
  p_sh = jax.tree.map(
    lambda s: NamedSharding(mesh, s),
    specs or jax.tree.map(lambda _: P(), params),
  )
  params = jax.device_put(params, p_sh)
  x, y, m = common.make_data(11, K, R, B, zero_replica=2)
  data_sh = NamedSharding(mesh, P(None, "data"))
  xs, ys, ms = jax.device_put((x, y, m), data_sh)

  acc = variant(
    wa.accumulate_sum if kind == "sum" else wa.accumulate_mean, donate_argnums=0
  )
  finish = variant(wa.finish_mean, donate_argnums=0)
  state = wa.init(params)
  _assert_same_shardings(state.grads, p_sh, "init")
  for k in range(K):
    g, n = _global_grad_fn(kind)(params, xs[k], ys[k], ms[k])
    state = acc(state, g, n)
    _assert_same_shardings(state.grads, p_sh, f"accumulate #{k}")
  out, state = finish(state)
  _assert_same_shardings(out.grads, p_sh, "finish_mean out")
  _assert_same_shardings(state.grads, p_sh, "finish_mean new state")
  if specs is not None:
    # Sharded, not replicated: each device holds its share of hidden units.
    assert state.grads["w1"].addressable_shards[0].data.shape == (
      common.D,
      common.H // mesh.shape[specs["w1"][1]],
    )
  _record(
    f"implicit jit {mesh_name}, {kind}, {variant.name}",
    out.grads,
    common.reference_grad(params, x, y, m),
  )
  assert float(out.weight) == pytest.approx(float(m.sum()), rel=1e-6)


def test_implicit_fsdp_compiled_calls_gather_no_buffer(params):
  """On the 2D (data x model) mesh the compiled accumulate and finish
  contain no all-gather (and no other collective): each device updates its
  own shard of every buffer in place."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), _model_sharded_specs())
  params = jax.device_put(params, p_sh)
  state = wa.init(params)
  grads = jax.device_put(jax.tree.map(jnp.ones_like, params), p_sh)
  texts = {
    "accumulate_sum": jax.jit(wa.accumulate_sum, donate_argnums=0)
    .lower(state, grads, 3.0)
    .compile()
    .as_text(),
    "accumulate_mean": jax.jit(wa.accumulate_mean, donate_argnums=0)
    .lower(state, grads, 3.0)
    .compile()
    .as_text(),
    "finish_mean": jax.jit(wa.finish_mean, donate_argnums=0)
    .lower(state)
    .compile()
    .as_text(),
    "finish_sums": jax.jit(wa.finish_sums, donate_argnums=0)
    .lower(state)
    .compile()
    .as_text(),
  }
  for name, hlo in texts.items():
    for op in ("all-gather", "all-to-all", "collective-permute"):
      assert op not in hlo, f"{name} compiled with {op}"
    # The per-device buffers are the shards, not the full params.
    assert f"f32[{common.D},{common.H // 2}]" in hlo, name
    assert f"f32[{common.D},{common.H}]" not in hlo, name


def test_explicit_fsdp_2d_mesh_equals_full_batch(params):
  """shard_map over ('data', 'model') with model-sharded params: local
  gradients of each shard, reduced over 'data' only; the result keeps the
  params' sharding and the compiled step has no all-gather."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  specs = _model_sharded_specs()
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  params = jax.device_put(params, p_sh)
  x, y, m = common.make_data(12, K, 4, 2 * B, zero_replica=1)

  def local_loss_sum(p, x, y, m):  # hidden units split over 'model'
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    pred = jax.lax.psum(h @ p["w2"], "model")
    return jnp.sum(m * (pred - y) ** 2)

  def body(params, x, y, m):
    state = wa.init(params, axis_name="data")
    for k in range(K):
      g = dist.local_grad(local_loss_sum, "data")(params, x[k], y[k], m[k])
      state = wa.accumulate_sum(state, g, jnp.sum(m[k]))
    out, _ = wa.finish_mean(state)
    return out.grads, out.weight

  spec = P(None, "data")
  step = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(specs, spec, spec, spec),
      out_specs=(specs, P()),
    )
  )
  hlo = step.lower(params, x, y, m).compile().as_text()
  assert "all-gather" not in hlo
  grads, weight = step(params, x, y, m)
  _assert_same_shardings(grads, p_sh, "shard_map result")
  _record(
    "shard_map data4 x model2, local grads, sum, reduce=window",
    grads,
    common.reference_grad(params, x, y, m),
  )
  assert float(weight) == pytest.approx(float(m.sum()), rel=1e-6)


# ------------------------------------------------------------ two processes

WORKER = pathlib.Path(__file__).parents[1] / "_dp_worker.py"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_single_process_reference(tmp_path):
  """Two real processes (jax.distributed on 127.0.0.1, gloo, 4 CPU devices
  each) with unequal local weights: the explicit and the implicit (FSDP over
  both processes) results equal this process's single-device reference, and
  an Orbax CheckpointManager save/restore of the sharded accumulator in the
  middle of the window resumes bit for bit."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=(
      f"--xla_force_host_platform_device_count={common.MP_LOCAL_DEVICES}"
    ),
  )
  port = _free_port()
  ckpt = tmp_path / "ckpt"
  outs = [tmp_path / f"process{i}.npz" for i in range(common.MP_PROCESSES)]
  procs = [
    subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, str(WORKER), str(i), str(port), str(ckpt), str(outs[i])],
      env=env,
      cwd=WORKER.parent.parent,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(common.MP_PROCESSES)
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=150)[0])
  except subprocess.TimeoutExpired:
    pytest.fail("the two-process run did not finish within 150 s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  for i, p in enumerate(procs):
    log = "\n".join(l for l in logs[i].splitlines() if "[Gloo]" not in l)
    assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"

  x, y, m = common.multiprocess_data()
  ref = common.reference_grad(common.make_params(0), x, y, m)
  one_process = _data_axes_bytes(x, y, m)
  local_weights = []
  for i, path in enumerate(outs):
    r = np.load(path)
    assert str(r["package"]).startswith(str(WORKER.parent.parent))
    got = {k: r[f"data_axes/{k}"] for k in ref}
    _record(f"2 processes x 4 devices, data_axes (process {i})", got, ref)
    assert float(r["data_axes_weight"]) == pytest.approx(float(m.sum()))
    # The per-process compiled step reduces once, the bytes of one process.
    assert int(r["data_axes_reductions"]) == 1
    assert int(r["data_axes_bytes"]) == one_process
    for style in ("explicit", "implicit"):
      got = {k: r[f"{style}/{k}"] for k in ref}
      _record(f"2 processes x 4 devices, {style} (process {i})", got, ref)
      assert float(r[f"{style}_weight"]) == pytest.approx(float(m.sum()))
    assert r["explicit_valid"]
    assert r["restored_bitwise"], "restored accumulator differs from saved"
    assert r["restored_sharding"], "restored buffers not on params' sharding"
    assert r["resume_bitwise"], "resumed window differs from uninterrupted"
    local_weights.append(float(r["local_weight"]))
  assert local_weights[0] > 3 * local_weights[1] > 0  # really unequal


def _data_axes_bytes(x, y, m) -> int:
  """The data-axis bytes one process's 8-device compiled data_axes step
  reduces: one all-reduce of the gradient tree plus 8 float32 scalars (the
  weight pair's 5 limbs, issued, the loss sum, the rejected count)."""
  from benchmarks import hlo  # pylint: disable=g-import-not-at-top

  mesh = _mesh1d()
  params = jax.device_put(common.make_params(0), NamedSharding(mesh, P()))
  batch = jax.device_put(
    common.data_axes_batch(x, y, m), NamedSharding(mesh, P("data"))
  )
  f = jax.jit(
    wa.microbatched_value_and_grad(
      common.loss_of_batch,
      common.MP_K,
      mode="sum",
      axis_name="data",
    )
  )
  compiled = f.lower(params, batch).compile()
  got = hlo.all_reduced_bytes(compiled, hlo.mesh_groups(mesh, "data"))
  assert got == hlo.tree_bytes(params) + 4 * 8
  return got


# ------------------------------------------------------------- optax wrapper


def _sgd():
  import optax  # pylint: disable=g-import-not-at-top

  return optax.sgd(0.05, momentum=0.9)


def _reference_params_after_windows(params, x, y, m, windows):
  """Single device: the inner optimizer applied to each window's full-batch
  gradient (no wrapper, no accumulation)."""
  import optax  # pylint: disable=g-import-not-at-top

  tx = _sgd()
  p = jax.tree.map(np.asarray, params)
  s = tx.init(p)
  for w in range(windows):
    sl = slice(w * K, (w + 1) * K)
    g = common.reference_grad(p, x[sl], y[sl], m[sl])
    u, s = tx.update(g, s, p)
    p = jax.tree.map(np.asarray, optax.apply_updates(p, u))
  return p


@pytest.mark.parametrize("style", ["implicit", "shard_map"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_optax_wrapper_multi_device_equals_single_device(style, mode):
  """weighted_multi_steps on the 8-device setup (jit over global arrays with
  model-sharded params, or shard_map with local gradients and axis_name)
  gives the single-device reference's params after two windows."""
  import optax  # pylint: disable=g-import-not-at-top

  windows = 2
  params = common.make_params(0)  # host copies: the steps donate params
  x, y, m = common.make_data(31, windows * K, R, B, zero_replica=6)
  ref = _reference_params_after_windows(params, x, y, m, windows)
  f = common.loss_sum if mode == "sum" else common.loss_mean
  spec = P(None, "data")

  if style == "implicit":
    mesh = jax.sharding.Mesh(
      np.array(jax.devices()).reshape(4, 2), ("data", "model")
    )
    p_sh = jax.tree.map(
      lambda s: NamedSharding(mesh, s), _model_sharded_specs()
    )
    p = jax.device_put(params, p_sh)
    tx = wa.WeightedMultiSteps(_sgd(), every_k_schedule=K, mode=mode)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, opt_state, x, y, m):
      g = jax.grad(f)(p, x, y, m)
      u, opt_state = tx.update(g, opt_state, p, weight=jnp.sum(m))
      return optax.apply_updates(p, u), opt_state

    x_d, y_d, m_d = jax.device_put((x, y, m), NamedSharding(mesh, spec))
  else:
    mesh = _mesh1d()
    p = jax.device_put(params, NamedSharding(mesh, P()))
    tx = wa.WeightedMultiSteps(
      _sgd(), every_k_schedule=K, mode=mode, axis_name="data"
    )

    def body(p, opt_state, x, y, m):
      g = dist.local_grad(f, "data")(p, x[0], y[0], m[0])
      u, opt_state = tx.update(g, opt_state, p, weight=jnp.sum(m[0]))
      return optax.apply_updates(p, u), opt_state

    step = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), spec, spec, spec),
        out_specs=(P(), P()),
      ),
      donate_argnums=(0, 1),
    )
    x_d, y_d, m_d = x[:, None], y[:, None], m[:, None]

  opt_state = tx.init(p)
  for k in range(windows * K):
    p, opt_state = step(p, opt_state, x_d[k], y_d[k], m_d[k])
  assert int(opt_state.gradient_step) == windows
  if style == "implicit":
    _assert_same_shardings(p, p_sh, "params after two windows")
    _assert_same_shardings(opt_state.accum.grads, p_sh, "wrapper buffers")
  # On the parameter CHANGE, which is much smaller than the params.
  delta = jax.tree.map(lambda a, b: np.asarray(a) - b, p, params)
  ref_delta = jax.tree.map(lambda a, b: a - b, ref, params)
  _record(
    f"optax wrapper, 2 windows, {style}, {mode} (param change)",
    delta,
    ref_delta,
  )


def test_readme_scaling_section_runs():
  """The README's "Scaling out" examples run as written (and the explicit
  result equals the implicit one: the example asserts it)."""
  readme = (
    pathlib.Path(__file__).parents[2] / "docs" / "scaling.md"
  ).read_text()
  section = readme.split("<!-- BEGIN scaling -->")[1].split(
    "<!-- END scaling -->"
  )[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 2
  scope = {}
  code = compile("\n".join(blocks), "README scaling", "exec")
  exec(code, scope)  # pylint: disable=exec-used
  _record(
    "README example, explicit vs implicit",
    scope["explicit"],
    scope["implicit"].grads,
  )


def test_core_accumulate_refuses_autodiff_reduced_grads_with_local_weight():
  """The silent x R: grads of a replicated param come out of autodiff already
  summed over 'data'; adding them to a per-replica window with this replica's
  own count and reducing would count them once per replica. The core refuses
  at trace time and points to the distributed helpers, which get it right."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  loss = lambda p, x: jnp.sum(x * p["w"])

  def core_step(p, x):
    g = jax.grad(loss)(p, x)  # unvarying: already summed
    s = wa.accumulate_sum(wa.init(p), g, jnp.sum(x >= 0).astype(jnp.float32))
    return dist.reduce_sums(wa.finish_sums(s)[0], "data").grads

  def dist_step(p, x):
    g = jax.grad(loss)(p, x)
    s = wa.accumulate_sum(
      wa.init(p, axis_name="data"), g, jnp.sum(x >= 0).astype(jnp.float32)
    )
    return wa.finish_mean(s)[0].grads

  run = lambda f: jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  )({"w": jnp.ones(())}, jnp.arange(16.0))
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=r"\['w'\] does not vary over mesh axis \('data',\)",
  ):
    run(core_step)
  # Reference: d/dw sum(x * w) / N = mean(x) over all 16 items, in NumPy.
  np.testing.assert_allclose(
    float(run(dist_step)["w"]), np.mean(np.arange(16.0)), rtol=1e-6
  )
