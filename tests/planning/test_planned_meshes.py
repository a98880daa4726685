"""The planned step with ``axis_name`` under every mesh a user has: an
Explicit mesh as ``jax.make_mesh`` makes it by default and an Auto one,
given the packed batch as ``plan_batch`` returns it (the docs' usage),
eagerly and under ``jax.jit``; a plan for another replica count, or a
packed batch not split by replica, refused by the library (not by JAX,
and never run silently)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import pytest
from test_planned_conformance import _batch
from test_planned_conformance import _loss_fn
from test_planned_conformance import _params
from test_planned_conformance import _reference
from test_planned_conformance import _rel

import weighted_accum as wa
from weighted_accum import planning

SPEC = planning.PlanSpec(
  buckets=(8, 16), budget=16, row_divisors=(1,), batch_rows=8, replicas=2
)
LENGTHS = [13, 1, 7, 16, 3, 0, 9, 4, 11, 2, 5, 8]


def _mesh(n, kind):
  if kind == "explicit":  # as jax.make_mesh makes it by default
    mesh = jax.make_mesh((n,), ("data",))
    assert mesh.axis_types == (AxisType.Explicit,)
    return mesh
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))


def _step():
  return planning.planned_value_and_grad(
    _loss_fn, SPEC, mode="sum", axis_name="data"
  )


@pytest.mark.parametrize(  # eager op by op: the dearest, on Explicit only
  "style,kind", [("jit", "explicit"), ("jit", "auto"), ("eager", "explicit")]
)
def test_the_packed_batch_as_plan_batch_returns_it(style, kind):
  batch = _batch(LENGTHS, 1)
  packed = planning.plan_batch(SPEC, batch, LENGTHS)
  f = jax.jit(_step()) if style == "jit" else _step()
  params = _params(jnp.float32)
  with jax.set_mesh(_mesh(2, kind)):
    loss, out = f(params, packed)
  ref_loss, ref = _reference(params, batch, packed)
  assert _rel(out.grads, ref) <= 2e-6 and bool(out.valid)
  assert abs(float(loss) - ref_loss) <= 2e-6 * abs(ref_loss)
  assert float(out.weight) == sum(LENGTHS)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_plan_for_other_replicas_is_refused_by_the_library(kind):
  packed = planning.plan_batch(SPEC, _batch(LENGTHS), LENGTHS)
  params = _params(jnp.float32)
  mesh = _mesh(4, kind)
  with jax.set_mesh(mesh):
    with pytest.raises(wa.WeightedAccumulationError, match="replicas=4"):
      jax.jit(_step())(params, packed)
  whole = jax.jit(
    jax.shard_map(_step(), mesh=mesh, in_specs=P(), out_specs=P())
  )
  with pytest.raises(wa.WeightedAccumulationError, match="replicas=4"):
    whole(params, packed)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_packed_batch_not_split_by_replica_is_refused(kind):
  """With ``P()`` each replica would run every replica's slots (it returned
  weight 3,458 for a 2,570-token batch)."""
  packed = planning.plan_batch(SPEC, _batch(LENGTHS), LENGTHS)
  mesh = _mesh(2, kind)
  whole = jax.jit(
    jax.shard_map(_step(), mesh=mesh, in_specs=(P(), P()), out_specs=P())
  )
  with pytest.raises(wa.WeightedAccumulationError, match="split by replica"):
    whole(_params(jnp.float32), packed)
  if kind == "auto":  # the counts split, the shapes not (Auto: NumPy in)
    specs = jax.tree.map(lambda _: P(), packed)
    specs.counts = P("data")
    part = jax.jit(
      jax.shard_map(_step(), mesh=mesh, in_specs=(P(), specs), out_specs=P())
    )
    with pytest.raises(wa.WeightedAccumulationError, match="split by"):
      part(_params(jnp.float32), packed)
