"""The saved format on disk: an item written by an earlier release restores.

``data/format_2_item`` was written by :func:`write_item` at commit fdd85a6
(``checkpointing/checkpoint`` and ``saved_form``, before they were merged).
References are literals: the sums of the fed gradients, worked by hand.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
from test_checkpoint import _bits
from test_checkpoint import _restore
from test_checkpoint import _save

import weighted_accum as wa

ITEM = pathlib.Path(__file__).parent / "data" / "format_2_item"
BF16 = jnp.dtype(jnp.bfloat16)


def _params():
  return {"b": jnp.zeros(2), "w": jnp.zeros(3)}


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))


def _replica(mesh, params, grads=None):
  def body(p, g):
    s = wa.init(p, BF16, axis_name="data", reduce="microbatch")
    if grads is not None:
      s = wa.accumulate_sum(s, jax.tree.map(lambda x: x[0], g), 2.0)
    return s

  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  g = (
    grads
    if grads is not None
    else jax.tree.map(lambda x: jnp.zeros((2, *x.shape)), params)
  )
  return jax.jit(f)(params, g)


def write_item(path) -> None:
  """The tree of the fixture: a global, a stacked and a per-replica window,
  a ``DynamicLossScale`` and a Python int, saved by ``AccumSave``."""
  params = _params()
  s = wa.init(params, BF16, 4.0)
  s = wa.accumulate_sum(
    s, {"b": jnp.array([0.5, -1.0]), "w": jnp.arange(1.0, 4)}, 3.0
  )
  s = wa.accumulate_mean(
    s, {"b": jnp.array([0.25, 2.0]), "w": jnp.array([4.0, 0, -8])}, 2.0
  )
  s = wa.accumulate_sum(
    s, {"b": jnp.array([np.nan, 1.0]), "w": jnp.ones(3)}, 0.0
  )
  mesh = _mesh()
  on_mesh = jax.device_put(params, jax.NamedSharding(mesh, P()))
  stacked = wa.init(on_mesh, BF16, axis_name="data")

  def add(block, g, w):
    return wa.accumulate_sum(block, jax.tree.map(lambda x: x[0], g), w[0])

  specs = wa.distributed.window_specs(stacked)
  step = jax.shard_map(
    add, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=specs
  )
  grads = {"b": jnp.array([[1.0, 2], [3, 4]]), "w": jnp.zeros((2, 3))}
  stacked = jax.jit(step)(stacked, grads, jnp.array([1.5, 0.0]))
  replica = _replica(
    mesh, on_mesh, {"b": jnp.array([[1.0, -2], [5, 6]]), "w": jnp.ones((2, 3))}
  )
  scaler = wa.DynamicLossScale(8.0, growth_tracker=3)
  tree = {"global": s, "stacked": stacked, "replica": replica}
  _save(path, dict(tree, scaler=scaler, step=7))


def _template():
  params, mesh = _params(), _mesh()
  on_mesh = jax.device_put(params, jax.NamedSharding(mesh, P()))
  return {
    "global": wa.init(params, BF16),
    "stacked": wa.checkpoint.abstract_state(on_mesh, BF16, axis_name="data"),
    "replica": _replica(mesh, on_mesh),
    "scaler": wa.DynamicLossScale(1.0),
    "step": 0,
  }


def _np(x):
  return np.asarray(x, np.float64).tolist()


def test_a_format_2_item_of_an_earlier_release_restores():
  got = _restore(ITEM, _template())
  g = got["global"]
  assert g.dtype == BF16 and g.placement.kind == "global"
  assert _np(g.grads["b"]) == [1.0, 3.0]  # 0.5 + 2 * 0.25, -1 + 2 * 2
  assert _np(g.grads["w"]) == [9.0, 2.0, -13.0]
  assert {k: float(v) for k, v in g.counters.items()} == {
    "issued": 3,
    "zero_weight": 1,
    "rejected": 0,
    "windows": 0,
    "weight_hi": 5.0,
    "weight_lo": 0.0,
    "loss_scale": 4.0,
  }
  s = got["stacked"]
  assert s.placement.kind == "stacked" and s.placement.axes == ("data",)
  assert _np(s.grads["b"]) == [[1.0, 2.0], [0.0, 0.0]]  # replica 1: weight 0
  assert _np(s.weight_hi) == [1.5, 0.0] and _np(s.issued) == [1, 1]
  assert _np(s.zero_weight) == [0, 1]
  r = got["replica"]
  assert r.placement.kind == "replica" and r.placement.reduce == "microbatch"
  assert _np(r.grads["b"]) == [6.0, 4.0]  # reduced over both replicas
  assert _np(r.grads["w"]) == [2.0, 2.0, 2.0]
  assert float(r.total_weight) == 4.0 and int(r.issued) == 2  # one a replica
  assert float(got["scaler"].scale) == 8.0
  assert int(got["scaler"].growth_tracker) == 3
  assert got["step"] == 7 and type(got["step"]) is int


def test_a_save_today_writes_the_format_2_layout(tmp_path):
  write_item(tmp_path / "item")
  meta = [
    json.loads((p / "_METADATA").read_text()) for p in (ITEM, tmp_path / "item")
  ]
  assert meta[1]["custom_metadata"] == meta[0]["custom_metadata"]
  assert meta[1]["tree_metadata"] == meta[0]["tree_metadata"]
  template = _template()
  assert _bits(_restore(tmp_path / "item", template)) == _bits(
    _restore(ITEM, template)
  )
