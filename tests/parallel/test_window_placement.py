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
    assert s.placement[:3] == ("replica", ("data",), reduce)
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


# ------------------------------------------- placement against context --


def _local_body(closer):
  """A global window fed local gradients inside shard_map, closed by
  ``closer``."""
  tx = optax.sgd(1.0)

  def body(p, g, w):
    s = wa.init(p)
    grads = wa.distributed.local_grad(lambda q: jnp.sum(q["w"] * g[0]), "data")
    s = wa.accumulate_sum(s, grads(p), 1.0)  # a shared weight: no hint
    if closer == "finish_sums":
      return (wa.distributed.reduce_sums(wa.finish_sums(s)[0], "data").grads,)
    if closer == "apply_window":
      return (wa.apply_window(tx, s, p, tx.init(p))[0],)
    if closer == "finish_mean":
      return (wa.finish_mean(s)[0].grads,)
    return (wa.peek_mean(s).grads,)

  return body


@pytest.mark.parametrize("closer", ["finish_mean", "peek_mean", "apply_window"])
def test_a_global_window_of_local_sums_is_refused_by_every_mean(closer):
  """Each replica would get its own mean, valid=True (0.x's literal
  migration): every close that computes a mean refuses it alike."""
  g, w = _data()
  with pytest.raises(Error, match=r"global window holds per-replica sums"):
    _shard_map(_local_body(closer), 1)({"w": jnp.zeros(3)}, g, w)


def test_a_global_window_of_local_sums_reduces_through_finish_sums():
  g, w = _data()
  (got,) = _shard_map(_local_body("finish_sums"), 1)({"w": jnp.zeros(3)}, g, w)
  np.testing.assert_allclose(
    got["w"], g.astype(np.float64).sum(0) / R, rtol=1e-6
  )


@functools.cache
def _microbatch_window():
  g, w = _data()
  tx = optax.sgd(1.0)

  def body(p, g, w):
    s = wa.init(p, axis_name="data", reduce="microbatch")
    s = wa.accumulate_sum(s, {"w": g[0]}, w[0])
    s = wa.accumulate_sum(s, {"w": 2 * g[0]}, w[0])
    inside = (
      wa.finish_mean(s)[0],
      wa.peek_mean(s),
      wa.apply_window(tx, s, p, tx.init(p))[3],
    )
    return s, [(o.issued, o.weight) for o in inside]

  out = jax.jit(
    jax.shard_map(
      body, mesh=_mesh(), in_specs=(P(), P("data"), P("data")), out_specs=P()
    )
  )({"w": jnp.zeros(3)}, g, w)
  return out, g, w


def test_a_microbatch_window_is_read_alike_inside_and_outside_shard_map():
  """It holds the global sums and counts: finish_mean, peek_mean,
  apply_window and finish_sums take it anywhere, with one result."""
  (state, inside), g, w = _microbatch_window()
  ref, ref_w = _reference(g, w, mean=False)
  ref, ref_w = 1.5 * ref, 2 * ref_w  # sums g then 2g, weights w twice
  params, tx = {"w": jnp.zeros(3)}, optax.sgd(1.0)
  out, _ = wa.finish_mean(state)
  np.testing.assert_allclose(out.grads["w"], ref, rtol=1e-6)
  np.testing.assert_allclose(wa.peek_mean(state).grads["w"], ref, rtol=1e-6)
  new_p, _, _, applied = wa.apply_window(tx, state, params, tx.init(params))
  np.testing.assert_allclose(new_p["w"], -ref, rtol=1e-6)
  sums, _ = wa.finish_sums(state)
  np.testing.assert_allclose(
    sums.grads["w"] / float(sums.weight), ref, rtol=1e-6
  )
  for issued, weight in inside + [
    (out.issued, out.weight),
    (applied.issued, applied.weight),
  ]:
    assert int(issued) == 2 * R and float(weight) == ref_w


@functools.cache
def _mesh2(names=("a", "b"), explicit=False):
  kind = (
    jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  )
  return jax.make_mesh(
    (2, 2), names, axis_types=(kind, kind), devices=jax.devices()[:R]
  )


@pytest.mark.parametrize("closer", ["finish_mean", "apply_window"])
def test_a_next_scale_varying_over_the_second_data_axis_is_refused(closer):
  """Every data axis is checked, not the first: the replicas' windows
  would diverge."""
  tx = optax.sgd(1.0)

  def body(p, b):
    local = jax.lax.pcast(jnp.zeros(3), ("a", "b"), to="varying")
    s = wa.accumulate_sum(wa.init(p, axis_name=("a", "b")), {"w": local}, 1.0)
    ls = 2.0 + b[0, 0, 0]  # varies over 'b' only
    if closer == "finish_mean":
      return wa.finish_mean(s, next_loss_scale=ls)[0].weight
    return wa.apply_window(tx, s, p, tx.init(p), next_loss_scale=ls)[3].weight

  b = jnp.broadcast_to(jnp.arange(2.0)[None, :, None], (2, 2, 3))
  f = jax.shard_map(
    body, mesh=_mesh2(), in_specs=(P(), P(None, "b")), out_specs=P()
  )
  with pytest.raises(Error, match=r"next_loss_scale.*varies over \['b'\]"):
    jax.jit(f)({"w": jnp.zeros(3)}, b)


def test_a_stacked_window_moved_or_remeshed_is_named_or_exact():
  """Moved to one device (jax.device_put): refused by name at every close;
  laid over the same devices in another order: the same result."""
  state, params, g, w = _stacked()
  ref, _ = _reference(g, w, mean=False)
  moved, one = jax.device_put((state, params), jax.devices()[0])
  tx = optax.sgd(1.0)
  for close in (
    wa.finish_mean,
    wa.peek_mean,
    lambda s: wa.apply_window(tx, s, one, tx.init(one)),
  ):
    with pytest.raises(Error, match=r"its arrays on devices \[0\]"):
      close(moved)
  flipped = jax.sharding.Mesh(np.array(jax.devices()[:R][::-1]), ("data",))
  again = jax.device_put(
    state,
    jax.tree.map(lambda x: NamedSharding(flipped, x.sharding.spec), state),
  )
  np.testing.assert_allclose(
    wa.finish_mean(again)[0].grads["w"], ref, rtol=1e-6
  )


def test_a_stacked_window_given_other_axes_is_named():
  mesh = _mesh2(("data", "other"))
  params = jax.device_put({"w": jnp.zeros(3)}, NamedSharding(mesh, P()))
  state = wa.init(params, axis_name="data")  # 2 replicas
  loss = lambda p, x: (jnp.sum(x @ p["w"]), x.shape[0])
  f = wa.microbatched_value_and_grad(
    loss, 2, mode="sum", axis_name=("data", "other")
  )
  x = jax.device_put(
    jnp.ones((8, 3)), NamedSharding(mesh, P(("data", "other")))
  )
  with pytest.raises(Error, match=r"called over the axes \('data', 'other'\)"):
    f.accumulate(state, params, x)


def test_an_ensemble_of_windows_is_read_under_vmap_or_named():
  """jax.vmap over windows: read under vmap it is each member's window;
  read eagerly as one window it is refused by name."""
  p = {"w": jnp.arange(12.0).reshape(4, 3)}
  ens = jax.vmap(lambda q: wa.accumulate_sum(wa.init(q), q, 2.0))(p)
  for read in (
    lambda s: s.total_weight,
    wa.finish_mean,
    wa.peek_mean,
    lambda s: wa.set_loss_scale(s, 2.0),
  ):
    with pytest.raises(Error, match=r"scalar counters, this one \(4,\)"):
      read(ens)
  got = jax.vmap(lambda s: wa.finish_mean(s)[0].grads["w"])(ens)
  np.testing.assert_allclose(got, np.arange(12.0).reshape(4, 3) / 2)


def test_a_stacked_window_restored_from_flax_bytes_as_global_is_refused():
  from flax import serialization

  state, params, _, _ = _stacked()
  restored = serialization.from_bytes(
    wa.init(params), serialization.to_bytes(state)
  )
  with pytest.raises(Error, match=r"scalar counters, this one \(4,\)"):
    jax.jit(lambda s: wa.finish_mean(s)[0].grads)(restored)


@pytest.mark.parametrize("close", ["finish_mean", "apply_window"])
def test_a_param_sharded_over_data_and_model_on_explicit_axes_closes(close):
  """P('data', 'model') on an Explicit mesh: a stacked window's close (one
  reduction, the mean laid out like the param) matches float64 NumPy."""
  mesh = _mesh2(("data", "model"), explicit=True)
  g = np.random.default_rng(3).normal(size=(2, 4, 2)).astype(np.float32)
  with jax.set_mesh(mesh):
    params = jax.device_put(
      {"w": jnp.ones((4, 2))}, NamedSharding(mesh, P("data", "model"))
    )
    state = wa.init(params, axis_name="data")
    specs = wa.distributed.window_specs(state)
    add = jax.shard_map(
      lambda s, g: wa.accumulate_sum(s, {"w": g[0]}, 1.0),
      in_specs=(specs, P("data")),
      out_specs=specs,
      axis_names={"data"},
    )
    state = jax.jit(add)(state, jnp.asarray(g))
    ref = g.astype(np.float64).sum(0) / 2
    if close == "finish_mean":
      np.testing.assert_allclose(
        wa.finish_mean(state)[0].grads["w"], ref, rtol=1e-6
      )
    else:
      tx = optax.sgd(1.0)
      new_p = wa.apply_window(tx, state, params, tx.init(params))[0]
      np.testing.assert_allclose(new_p["w"], 1 - ref, rtol=1e-6)
      assert new_p["w"].sharding.spec == P("data", "model")
