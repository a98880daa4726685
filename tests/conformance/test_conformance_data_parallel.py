"""``DataParallel``, the data-parallel part of an in-step window: every
hostile value refused where it is built, naming the argument; a frozen,
hashable value; and ``axis_name=DataParallel(...)`` giving the full-batch
gradient under plain ``jit`` and inside ``shard_map`` alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import weighted_accum as wa

dist = wa.distributed
DataParallel = dist.DataParallel
Error = wa.WeightedAccumulationError


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(axis_name=3), r"DataParallel\(axis_name\)"),
    (dict(axis_name=""), r"DataParallel\(axis_name\)"),
    (dict(axis_name=("data", "data")), r"DataParallel\(axis_name\)"),
    (dict(axis_name="data", fsdp="each"), "fsdp='each'"),
    (dict(axis_name="data", param_specs={"w": "data"}), "not a Partition"),
  ],
)
def test_hostile_values_are_refused_where_it_is_built(kwargs, match):
  with pytest.raises(Error, match=match):
    DataParallel(**kwargs)


def test_it_is_frozen_and_hashable():
  a = DataParallel("data", param_specs={"w": P("data")}, fsdp="scatter_each")
  b = DataParallel(("data",), param_specs={"w": P("data")}, fsdp="scatter_each")
  assert a == b and hash(a) == hash(b) and a != DataParallel("data")
  assert a.axes == ("data",) and a.fsdp == "scatter_each"
  with pytest.raises(AttributeError, match="frozen"):
    a.fsdp = "gather_once"


def _problem():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(16, 3)).astype(np.float32)
  y = rng.normal(size=16).astype(np.float32)
  m = (rng.random(16) < 0.6).astype(np.float32)
  w = rng.normal(size=3).astype(np.float32)
  xd, yd, md, wd = (a.astype(np.float64) for a in (x, y, m, w))
  ref = 2 * xd.T @ (md * (xd @ wd - yd)) / md.sum()  # float64 full batch
  return {"w": w}, {"x": x, "y": y, "m": m}, ref


def _loss(p, b):
  r = b["x"] @ p["w"] - b["y"]
  return jnp.sum(b["m"] * r**2), jnp.sum(b["m"])


@pytest.mark.parametrize(
  "axis_name", ["data", dist.DataParallel("data")], ids=["name", "DataParallel"]
)
def test_axis_name_or_data_parallel_give_the_full_batch_gradient(axis_name):
  params, batch, ref = _problem()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  f = wa.microbatched_value_and_grad(_loss, 2, mode="sum", axis_name=axis_name)
  rows = jax.device_put(batch, NamedSharding(mesh, P("data")))
  reps = jax.device_put(params, NamedSharding(mesh, P()))
  _, out = jax.jit(f)(reps, rows)  # plain jit: the global batch
  np.testing.assert_allclose(out.grads["w"], ref, rtol=1e-5)
  inside = jax.jit(
    jax.shard_map(
      lambda p, b: f(p, b)[1].grads,
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
    )
  )(params, batch)  # inside shard_map: this replica's rows
  np.testing.assert_allclose(inside["w"], ref, rtol=1e-5)
