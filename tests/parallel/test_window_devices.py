"""A stacked window knows its devices: used under a mesh of the same shape
on other devices (another order, another set) it is moved there row by row
and computes what it computes on its own mesh; under another axis name,
axis type or layout, or under jax.jit where it cannot move, it is refused
naming both meshes. Auto meshes and the Explicit meshes jax.make_mesh
builds by default; references in float64 NumPy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa

R = 4
Error = wa.WeightedAccumulationError
EXPLICIT = pytest.mark.parametrize("explicit", [False, True])


def _mesh(devices, explicit, names=("data",)):
  if explicit:  # as jax.make_mesh builds it by default: Explicit axes
    return jax.make_mesh((len(devices),), names, devices=devices)
  types = (AxisType.Auto,) * len(names)
  return jax.sharding.Mesh(np.array(devices), names, axis_types=types)


def _loss(p, x):
  return jnp.sum((x @ p["w"]) ** 2), x.shape[0]


def _f():
  return wa.microbatched_value_and_grad(_loss, 2, mode="sum", axis_name="data")


def _x():
  return np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)


def _on(mesh, tree, spec=None):
  return jax.device_put(tree, NamedSharding(mesh, spec or P()))


def _window(mesh):
  """A stacked window on ``mesh`` holding one call of f.accumulate."""
  params = _on(mesh, {"w": jnp.ones(3)})
  with jax.set_mesh(mesh):
    state = wa.init(params, axis_name="data")
    _, state = _f().accumulate(state, params, _on(mesh, _x(), P("data")))
  return state


def _reference():
  """The float64 mean gradient of the summed loss over the 8 rows."""
  x = _x().astype(np.float64)
  return 2 * x.T @ (x @ np.ones(3)) / 8


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@EXPLICIT
@pytest.mark.parametrize("other", ["disjoint", "reversed"])
def test_a_window_used_under_other_devices_is_moved_and_exact(explicit, other):
  """The rows stay in replica order, so each close is bit for bit the close
  on the window's own mesh, and the float64 mean."""
  devs = jax.devices()
  own = _mesh(devs[:R], explicit)
  there = devs[R : 2 * R] if other == "disjoint" else devs[:R][::-1]
  mesh = _mesh(there, explicit)
  state = _window(own)
  at_home = wa.finish_mean(state)[0]
  np.testing.assert_allclose(at_home.grads["w"], _reference(), rtol=1e-5)
  params = _on(mesh, {"w": jnp.ones(3)})
  tx = optax.sgd(1.0)
  with jax.set_mesh(mesh):
    out, nxt = wa.finish_mean(state)
    assert _bits(out) == _bits(at_home)
    assert nxt.placement.mesh == mesh
    assert {d.id for d in nxt.grads["w"].devices()} == {d.id for d in there}
    assert _bits(wa.peek_mean(state)) == _bits(at_home)
    new_p = wa.apply_window(tx, state, params, tx.init(params))[0]
    np.testing.assert_allclose(new_p["w"], 1 - _reference(), rtol=1e-5)
    dropped = wa.discard(state)
    assert dropped.total_weight == 0 and dropped.placement == nxt.placement
    _, again = _f().accumulate(state, params, _on(mesh, _x(), P("data")))
    assert again.total_weight == 2 * state.total_weight == 16
    np.testing.assert_allclose(
      wa.finish_mean(again)[0].grads["w"], _reference(), rtol=1e-5
    )


@EXPLICIT
def test_under_jit_a_window_on_other_devices_is_refused_naming_both(explicit):
  """jax.jit cannot move a window: refused, naming both device lists."""
  devs = jax.devices()
  state = _window(_mesh(devs[:R], explicit))
  for there in (devs[R : 2 * R], devs[:R][::-1]):
    shown = ", ".join(str(d.id) for d in there)
    with jax.set_mesh(_mesh(there, explicit)):
      with pytest.raises(
        Error, match=rf"devices \[0, 1, 2, 3\].*jax.jit.*devices \[{shown}\]"
      ):
        jax.jit(wa.finish_mean)(state)


@EXPLICIT
def test_a_window_moved_to_one_device_is_refused_naming_both(explicit):
  state = jax.device_put(_window(_mesh(jax.devices()[:R], explicit)), None)
  one = jax.device_put(state, jax.devices()[0])
  for use in (wa.finish_mean, wa.peek_mean, wa.discard):
    with pytest.raises(Error, match=r"devices \[0, 1, 2, 3\], its arrays on"):
      use(one)


@EXPLICIT
def test_a_window_used_under_another_axis_name_is_refused(explicit):
  devs = jax.devices()[:R]
  state = _window(_mesh(devs, explicit))
  mesh = _mesh(devs, explicit, ("batch",))
  params = _on(mesh, {"w": jnp.ones(3)})
  f = wa.microbatched_value_and_grad(_loss, 2, mode="sum", axis_name="batch")
  tx = optax.sgd(1.0)
  with jax.set_mesh(mesh):
    for use in (
      wa.finish_mean,
      wa.discard,
      lambda s: wa.apply_window(tx, s, params, tx.init(params)),
    ):
      with pytest.raises(Error, match=r"'data': 4.*called on mesh \{'batch'"):
        use(state)
    with pytest.raises(Error, match=r"called over the axes \('batch',\)"):
      f.accumulate(state, params, _on(mesh, _x(), P("batch")))


def test_an_auto_window_used_under_an_explicit_mesh_is_refused():
  devs = jax.devices()[:R]
  state = _window(_mesh(devs, False))
  mesh = _mesh(devs, True)
  params = _on(mesh, {"w": jnp.ones(3)})
  tx = optax.sgd(1.0)
  with jax.set_mesh(mesh):
    for use in (
      wa.finish_mean,
      lambda s: wa.apply_window(tx, s, params, tx.init(params)),
      lambda s: _f().accumulate(s, params, _on(mesh, _x(), P("data"))),
    ):
      with pytest.raises(Error, match=r"4 Auto.*called on mesh.*4 Explicit"):
        use(state)


@EXPLICIT
def test_jit_of_init_makes_the_stacked_window_of_eager_init(explicit):
  """On an Explicit mesh without jax.set_mesh too: the same shapes and
  layout as eager init, each device holding one replica's block."""
  mesh = _mesh(jax.devices()[:R], explicit)
  params = _on(mesh, {"w": jnp.ones((2, 3))})
  make = jax.jit(functools.partial(wa.init, axis_name="data"))
  with jax.set_mesh(mesh):
    inside = make(params)
  made = [inside] + ([make(params)] if explicit else [])
  eager = wa.init(params, axis_name="data")
  for state in made:
    assert state.placement.mesh in (mesh, mesh.abstract_mesh)
    shards = state.grads["w"].addressable_shards
    assert len(shards) == R and all(s.data.shape == (1, 2, 3) for s in shards)
  assert inside.placement == eager.placement


def test_discard_refuses_a_vmap_batch_of_windows():
  ens = jax.vmap(lambda q: wa.accumulate_sum(wa.init(q), q, 2.0))(
    {"w": jnp.ones((4, 3))}
  )
  with pytest.raises(Error, match=r"discard\(state\).*this one \(4,\)"):
    wa.discard(ens)


def test_discard_refuses_a_window_stacked_over_more_axes_than_shard_map():
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()[:R]).reshape(2, 2), ("a", "b")
  )
  params = _on(mesh, {"w": jnp.ones(3)})
  state = wa.init(params, axis_name=("a", "b"))
  specs = jax.tree.map(
    lambda s: P("a") if s != P() else s,
    wa.distributed.window_specs(state),
    is_leaf=lambda s: isinstance(s, P),
  )
  drop = jax.shard_map(
    wa.discard, mesh=mesh, in_specs=(specs,), out_specs=specs, axis_names={"a"}
  )
  with pytest.raises(Error, match=r"discard\(state\).*only \['a'\] are"):
    jax.jit(drop)(state)
