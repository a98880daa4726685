"""What a window is, read from the window: every entry point takes each
kind (global, per replica inside ``shard_map`` in either reduce mode,
stacked per replica across jitted steps) and keeps the promises where the
kinds meet, against float64 NumPy references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa

R = 4  # replicas
Error = wa.WeightedAccumulationError


@functools.cache
def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:R]), ("data",))


def _data(seed=0):
  rng = np.random.default_rng(seed)
  g = rng.normal(size=(R, 3)).astype(np.float32)
  w = rng.integers(1, 9, size=R).astype(np.float32)
  return g, w


def _reference(g, w, mean):
  """The float64 global mean of per-replica SUM (or MEAN) gradients."""
  g64, w64 = g.astype(np.float64), w.astype(np.float64)
  sums = (g64 * w64[:, None]).sum(0) if mean else g64.sum(0)
  return sums / w64.sum(), w64.sum()


def _shard_map(body, n_out):
  return jax.jit(
    jax.shard_map(
      body,
      mesh=_mesh(),
      in_specs=(P(), P("data"), P("data")),
      out_specs=(P(),) * n_out,
    )
  )


@pytest.mark.parametrize("reduce", ["window", "microbatch"])
def test_placement_is_set_by_init_and_read_by_every_close(reduce):
  """A per-replica window in either mode: finish_mean, peek_mean and
  apply_window read its placement, so a microbatch-mode window (already
  global) is never summed again, and a window-mode one is summed once."""
  g, w = _data()
  params = {"w": jnp.zeros(3)}
  tx = optax.sgd(1.0)

  def body(p, g, w):
    s = wa.init(p, axis_name="data", reduce=reduce)
    assert s.placement == ("replica", ("data",), reduce)
    s = wa.accumulate_sum(s, {"w": g[0]}, w[0])
    peek = wa.peek_mean(s)
    new_p, _, _, applied = wa.apply_window(tx, s, p, tx.init(p))
    out, after = wa.finish_mean(s)
    assert after.placement == s.placement
    return out.grads["w"], out.weight, peek.weight, applied.weight, new_p["w"]

  grads, weight, peek_w, applied_w, new_p = _shard_map(body, 5)(params, g, w)
  ref, ref_w = _reference(g, w, mean=False)
  np.testing.assert_allclose(grads, ref, rtol=1e-6)
  assert float(weight) == float(peek_w) == float(applied_w) == ref_w
  np.testing.assert_allclose(new_p, -ref, rtol=1e-6)


def test_global_window_inside_shard_map_is_not_reduced_by_a_close():
  """A global window is the same on every replica: no entry point takes an
  axis name to reduce it again (the 1/N update of a double-summed weight
  cannot be expressed)."""
  params = {"w": jnp.zeros(3)}
  with pytest.raises(Error, match="removed in version 1.0"):
    wa.apply_window(
      optax.sgd(1.0), wa.init(params), params, (), axis_name="data"
    )
  with pytest.raises(Error, match="removed in version 1.0"):
    wa.peek_mean(wa.init(params), axis_name="data")


def test_a_per_replica_next_loss_scale_is_refused_by_name():
  g, w = _data()
  params = {"w": jnp.zeros(3)}
  tx = optax.sgd(1.0)

  def body(p, g, w):
    s = wa.accumulate_sum(wa.init(p, axis_name="data"), {"w": g[0]}, w[0])
    ls = 2.0 + w[0]  # this replica's: varies over 'data'
    return wa.apply_window(tx, s, p, tx.init(p), next_loss_scale=ls)[3].weight

  with pytest.raises(Error, match=r"next_loss_scale.*varies over \['data'\]"):
    _shard_map(body, 1)(params, g, w)

  def finish(p, g, w):
    s = wa.accumulate_sum(wa.init(p, axis_name="data"), {"w": g[0]}, w[0])
    return wa.finish_mean(s, next_loss_scale=1.0 + w[0])[0].weight

  with pytest.raises(Error, match=r"finish_mean\(next_loss_scale"):
    _shard_map(finish, 1)(params, g, w)


def test_set_loss_scale_on_an_empty_per_replica_window_stays_shared():
  """Emptiness is decided for the whole window: one replica holding weight
  makes the window non-empty everywhere (the scale is NaN on every
  replica, not on some), and an empty window takes the shared scale."""
  g, w = _data()
  params = {"w": jnp.zeros(3)}

  def body(p, g, w):
    empty = wa.set_loss_scale(wa.init(p, axis_name="data"), 4.0)
    s = wa.accumulate_sum(empty, {"w": 4.0 * g[0]}, w[0])
    out, _ = wa.finish_mean(s)
    one = jnp.where(jax.lax.axis_index("data") == 0, 1.0, 0.0)
    held = wa.accumulate_sum(wa.init(p, axis_name="data"), {"w": g[0]}, one)
    late = wa.set_loss_scale(held, 8.0)
    return out.grads["w"], out.valid, late.loss_scale

  grads, valid, late = _shard_map(body, 3)(params, g, w)
  np.testing.assert_allclose(grads, _reference(g, w, mean=False)[0], rtol=1e-6)
  assert bool(valid) and np.isnan(float(late))


def test_per_replica_normalizers_are_refused():
  """A normaliser is one divisor for every replica: this replica's
  mask.sum() (3.4x too large a gradient before) is refused by name."""
  params = {"w": jnp.ones(3)}
  x = jnp.arange(R * 4 * 3, dtype=jnp.float32).reshape(R * 4, 3)
  mask = jnp.asarray(np.arange(R * 4) % 3 == 0, jnp.float32)

  def loss(p, batch):
    x, m = batch
    return jnp.sum(m * (x @ p["w"])), jnp.sum(m)

  f = wa.microbatched_value_and_grad(loss, 2, mode="sum", axis_name="data")

  def body(p, x, m):
    _, out = f(p, (x, m), normalizers=jnp.sum(m))
    return out.weight

  with pytest.raises(Error, match=r"normalizers.*varies over \['data'\]"):
    _shard_map(body, 1)(params, x, mask)


# --------------------------------------------------------------- stacked --


def _stacked(seed=0):
  """A stacked window holding each replica's weighted sum, the params."""
  g, w = _data(seed)
  mesh = _mesh()
  params = jax.device_put({"w": jnp.zeros(3)}, NamedSharding(mesh, P()))
  state = wa.init(params, axis_name="data")
  specs = wa.distributed.window_specs(state)

  def add(block, g, w):
    return wa.accumulate_sum(block, {"w": g[0]}, w[0])

  step = jax.jit(
    jax.shard_map(
      add, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=specs
    )
  )
  return step(state, g, w), params, g, w


def test_stacked_window_is_taken_by_every_entry_point():
  state, params, g, w = _stacked()
  ref, ref_w = _reference(g, w, mean=False)
  assert state.placement.kind == "stacked"
  assert state.total_weight == ref_w  # eager: exact, over the replicas
  for finish in (wa.finish_mean, jax.jit(wa.finish_mean)):
    out, nxt = finish(state)
    np.testing.assert_allclose(out.grads["w"], ref, rtol=1e-6)
    assert float(out.weight) == ref_w and nxt.placement == state.placement
  np.testing.assert_allclose(wa.peek_mean(state).grads["w"], ref, rtol=1e-6)
  tx = optax.sgd(1.0)
  new_p, _, nxt, out = wa.apply_window(tx, state, params, tx.init(params))
  np.testing.assert_allclose(new_p["w"], -ref, rtol=1e-6)
  assert nxt.total_weight == 0 and nxt.grads["w"].shape == (R, 3)
  dropped = wa.discard(state)
  assert dropped.total_weight == 0 and dropped.placement == state.placement


def test_set_loss_scale_of_a_stacked_window_keeps_one_scalar_scale():
  state, params, _, _ = _stacked()
  with pytest.raises(Error, match="already holds total weight"):
    wa.set_loss_scale(state, 2.0)  # eager: the exact total over replicas
  empty = wa.discard(state)
  for set_scale in (wa.set_loss_scale, jax.jit(wa.set_loss_scale)):
    s = set_scale(empty, 2.0)
    assert s.loss_scale.shape == () and float(s.loss_scale) == 2.0
  held = jax.jit(wa.set_loss_scale)(state, 2.0)
  assert held.loss_scale.shape == () and np.isnan(float(held.loss_scale))


def test_a_stacked_window_made_under_jit_is_laid_over_the_replicas():
  """Under jax.jit on Auto axes a stacked window is laid over the replicas
  when the mesh is known (jax.set_mesh): each device holds one replica's
  block; without it, refused with what to do (its N partial sums all
  landed on one device)."""
  mesh = _mesh()
  params = jax.device_put({"w": jnp.zeros((2, 3))}, NamedSharding(mesh, P()))
  make = jax.jit(lambda p: wa.init(p, axis_name="data"))
  with pytest.raises(Error, match="jax.set_mesh"):
    make(params)
  with jax.set_mesh(mesh):
    state = make(params)
  shards = state.grads["w"].addressable_shards
  assert len(shards) == R and all(s.data.shape == (1, 2, 3) for s in shards)
  assert state.placement.kind == "stacked"
