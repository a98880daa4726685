"""Conformance: replicas and loss scales inside ``jax.shard_map``.

Rules (``docs/design.md``, "Data parallelism"; ``docs/inputs.md``): the loss
scale is *shared*, identical on every replica, so a per-replica scale is
refused (``distributed.finish_mean`` does it; every entry point with
``axis_name`` must too); the wrapper with ``axis_name`` keeps a state that
is identical on every replica (``out_specs=P()``), ``should_skip_update_fn``
included; and it works with params sharded over a ``model`` axis. Results
are judged against the full batch's gradient (float64 NumPy), over two
windows with unequal per-replica weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from _conformance import Error
from _conformance import assert_close
from _conformance import host_params
from _conformance import mesh_of
import weighted_accum as wa
from weighted_accum import distributed as dist

N = 4  # data replicas (on the 2-D mesh too)
ROWS = 4  # rows per replica per microbatch
MESH = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))


def _loss(p, x, y, m):
  pred = x @ p["b"] + jnp.sum(x @ p["w"], axis=-1)
  return jnp.sum(m * (pred - y) ** 2)


def _batch(seed):
  """One microbatch for all replicas (rows split over 'data'), with unequal
  per-replica item counts (replica 0: 4 items, replica 3: 1)."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-2, 3, size=(N * ROWS, 8)).astype(np.float32) / 2
  y = rng.integers(-2, 3, size=N * ROWS).astype(np.float32)
  m = np.zeros(N * ROWS, np.float32)
  for r, n in enumerate([4, 2, 3, 1]):
    m[r * ROWS : r * ROWS + n] = 1.0
  return x, y, m


def _mean_grad(hp, batches):
  """The full batch's mean-loss gradient, in float64."""
  x, y, m = (
    np.concatenate([np.asarray(b[i], np.float64) for b in batches])
    for i in range(3)
  )
  p = {k: np.asarray(v, np.float64) for k, v in hp.items()}
  r = x @ (p["b"] + p["w"].sum(axis=1)) - y
  gb = 2.0 * (m * r) @ x / m.sum()
  return {"b": gb, "w": np.repeat(gb[:, None], 4, axis=1)}


# ------------------------------- in-step: a per-replica loss scale refused --


def _mvg_step(per_replica):
  f = wa.microbatched_value_and_grad(
    lambda p, b: (_loss(p, *b), b[2].sum()), 2, mode="sum", axis_name="data"
  )

  def step(p, x, y, m, scale):
    s = scale[0] if per_replica else jnp.float32(4.0)
    _, out = f(p, (x, y, m), loss_scale=s)
    return out.grads, out.valid

  return jax.jit(
    jax.shard_map(
      step,
      mesh=MESH,
      in_specs=(P(), P("data"), P("data"), P("data"), P("data")),
      out_specs=(P(), P()),
    )
  )


def test_microbatched_axis_name_shared_scale_is_exact():
  hp = host_params()
  x, y, m = _batch(0)
  grads, valid = _mvg_step(False)(hp, x, y, m, jnp.ones(N))
  assert bool(valid)
  assert_close(grads, _mean_grad(hp, [(x, y, m)]), rtol=1e-5, atol=1e-6)


def test_microbatched_axis_name_refuses_a_per_replica_scale():
  """Replica r scales its loss by 2**r: dividing the summed sums by one
  replica's scale is wrong; refused, as distributed.finish_mean does."""
  x, y, m = _batch(0)
  scales = 2.0 ** jnp.arange(N, dtype=jnp.float32)
  with pytest.raises(Error, match="loss_scale|loss scale"):
    _mvg_step(True)(host_params(), x, y, m, scales)


def test_distributed_finish_mean_refuses_a_per_replica_scale():
  def step(p, scale):
    s = wa.init(p, loss_scale=1.0, axis_name="data")
    s = s.replace(loss_scale=scale[0])  # a varying loss scale
    return wa.finish_mean(s)[0].valid

  f = jax.shard_map(step, mesh=MESH, in_specs=(P(), P("data")), out_specs=P())
  with pytest.raises(Error, match="loss scale|loss_scale"):
    jax.jit(f)(host_params(), jnp.arange(1.0, N + 1.0))


# ------------------------------------------------- the wrapper, axis_name --


def _wrapper_step(tx, mesh, pspec):
  specs = {"b": pspec, "w": pspec}

  def step(p, s, x, y, m):
    g = dist.local_grad(_loss, "data")(p, x, y, m)
    return tx.update(g, s, p, weight=m.sum())

  def run(p, s, x, y, m):
    state_specs = jax.tree.map(lambda _: P(), s)
    return jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, state_specs, P("data"), P("data"), P("data")),
      out_specs=(specs, state_specs),
    )(p, s, x, y, m)

  return jax.jit(run)


def _two_windows(tx, mesh, pspec):
  hp = host_params()
  p = {k: jnp.asarray(v) for k, v in hp.items()}
  s = tx.init(p)
  step = _wrapper_step(tx, mesh, pspec)
  batches = [_batch(i) for i in range(4)]
  ref = {k: np.asarray(v, np.float64) for k, v in hp.items()}
  for w in range(2):
    window = batches[2 * w : 2 * w + 2]
    for b in window:
      upd, s = step(p, s, *b)
      p = optax.apply_updates(p, upd)
    assert bool(wa.has_updated(s))
    mean = _mean_grad({k: np.asarray(v) for k, v in ref.items()}, window)
    ref = {k: ref[k] - 0.1 * mean[k] for k in ref}
  assert int(s.gradient_step) == 2
  assert_close(p, ref, rtol=1e-5, atol=1e-6)
  return s


def test_wrapper_axis_name_is_exact():
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="sum", axis_name="data")
  _two_windows(tx, MESH, P())


def test_wrapper_axis_name_with_should_skip_update_fn():
  """optax.skip_not_finite's skip state must be identical on every replica
  (the state leaves shard_map with ``out_specs=P()``)."""
  tx = wa.WeightedMultiSteps(
    optax.sgd(0.1),
    2,
    should_skip_update_fn=optax.skip_not_finite,
    mode="sum",
    axis_name="data",
  )
  s = _two_windows(tx, MESH, P())
  assert int(s.skipped) == 0


def test_wrapper_axis_name_params_sharded_over_model():
  """A 4 data x 2 model mesh; params (and their buffers) sharded over
  'model': the close must not mix per-model-shard validity."""
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="sum", axis_name="data")
  _two_windows_model(tx)


def _two_windows_model(tx):
  mesh = mesh_of("mesh2d")
  specs = {"b": P("model"), "w": P("model")}
  hp = host_params()
  p = {k: jnp.asarray(v) for k, v in hp.items()}
  s = tx.init(p)

  def loss(p, x, y, m):  # the model shards' partial predictions, summed
    lo = jax.lax.axis_index("model") * 4
    xs = jax.lax.dynamic_slice_in_dim(x, lo, 4, axis=1)
    part = xs @ p["b"] + jnp.sum(xs @ p["w"], axis=-1)
    pred = jax.lax.psum(part, "model")
    return jnp.sum(m * (pred - y) ** 2)

  def step(p, s, x, y, m):
    g = dist.local_grad(loss, "data")(p, x, y, m)
    return tx.update(g, s, p, weight=m.sum())

  state_specs = jax.tree.map(lambda _: P(), s)
  state_specs = state_specs._replace(
    acc_grads=specs,
    inner_opt_state=jax.tree.map(lambda _: P(), s.inner_opt_state),
  )
  f = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, state_specs, P("data"), P("data"), P("data")),
      out_specs=(specs, state_specs),
    )
  )
  batches = [_batch(i) for i in range(4)]
  ref = {k: np.asarray(v, np.float64) for k, v in hp.items()}
  for w in range(2):
    window = batches[2 * w : 2 * w + 2]
    for b in window:
      upd, s = f(p, s, *b)
      p = optax.apply_updates(p, upd)
    assert bool(wa.has_updated(s))
    mean = _mean_grad({k: np.asarray(v) for k, v in ref.items()}, window)
    ref = {k: ref[k] - 0.1 * mean[k] for k in ref}
  assert_close(p, ref, rtol=1e-5, atol=1e-6)


# ------------------------ across steps: a stacked window through shard_map --


def _on_mesh(tree):
  return jax.device_put(tree, jax.sharding.NamedSharding(MESH, P()))


def test_window_specs_carry_a_stacked_window_through_shard_map():
  """A window from distributed.init outside shard_map goes in and out of
  two jitted shard_map steps with dist.window_specs (each replica adds its
  own unequal weight) and is closed by distributed.finish_mean: the mean of
  the two microbatches' rows, in float64."""
  hp = host_params()
  state = wa.init(_on_mesh(hp), axis_name="data")
  sp = dist.window_specs(state)

  def mid(s, p, x, y, m):
    g = jax.grad(_loss)(p, x, y, m)
    return wa.accumulate_sum(s, g, jnp.sum(m))

  def close(s):
    out, _ = wa.finish_mean(s)
    return out.grads, out.valid

  rows = (P("data"),) * 3
  step = jax.jit(
    jax.shard_map(mid, mesh=MESH, in_specs=(sp, P(), *rows), out_specs=sp)
  )
  fin = jax.jit(
    jax.shard_map(close, mesh=MESH, in_specs=(sp,), out_specs=(P(), P()))
  )
  batches = [_batch(1), _batch(2)]
  for b in batches:
    state = step(state, hp, *b)
  grads, valid = fin(state)
  assert bool(valid)
  assert_close(grads, _mean_grad(hp, batches), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_name", [3, "", None, ("data", 3)])
def test_window_specs_reads_the_axes_from_the_window(axis_name):
  """The window knows its axes: a second argument is the removed 0.x
  spelling, refused naming the new one."""
  state = wa.init(_on_mesh(host_params()), axis_name="data")
  assert dist.window_specs(state).weight_hi == P("data")
  with pytest.raises(Error, match=r"; window_specs\(state\)"):
    dist.window_specs(state, axis_name)


@pytest.mark.parametrize("kind", ["params", "unstacked"])
def test_window_specs_refuses_what_is_not_a_stacked_window(kind):
  hp = host_params()
  state = hp if kind == "params" else wa.init(hp)
  with pytest.raises(Error, match=r"window_specs\(state\)"):
    dist.window_specs(state)


@pytest.mark.parametrize("what", ["finish", "next_loss_scale"])
def test_wrapper_axis_name_refuses_a_per_replica_decision(what):
  """A finish flag or next loss scale that differs across replicas would
  close or rescale the window on some replicas only: refused."""
  tx = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="sum", axis_name="data")
  hp = host_params()
  st = tx.init(hp)

  def step(p, s, x):
    g = jax.tree.map(lambda v: v * x[0], p)
    r = jax.lax.axis_index("data")
    kw = (
      {"finish": r == 0}
      if what == "finish"
      else {"next_loss_scale": 1.0 + r.astype(jnp.float32)}
    )
    return tx.update(g, s, p, weight=1.0, **kw)

  f = jax.jit(
    jax.shard_map(
      step, mesh=MESH, in_specs=(P(), P(), P("data")), out_specs=(P(), P())
    )
  )
  with pytest.raises(Error, match=rf"{what}=.*varies over"):
    f(hp, st, jnp.ones(N))
