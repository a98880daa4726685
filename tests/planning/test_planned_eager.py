"""The planned step called eagerly with ``axis_name`` compiles the one
program it runs on every call (its ``shard_map`` whole, not op by op;
nothing kept between calls), and its gradient is the full batch's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from test_planned_conformance import _batch
from test_planned_conformance import _loss_fn
from test_planned_conformance import _params
from test_planned_conformance import _reference
from test_planned_conformance import _rel

from _helpers import Compiles
from weighted_accum import planning


def test_an_identical_repeat_call_compiles_one_program_at_most():
  spec = planning.PlanSpec(buckets=(8,), budget=8, batch_rows=4, replicas=2)
  lengths = [8, 3, 2, 1, 5, 7, 4, 6]
  batch = _batch(lengths, 5)
  packed = planning.plan_batch(spec, batch, lengths, seed=1)
  f = planning.planned_value_and_grad(
    _loss_fn, spec, mode="sum", axis_name="data"
  )
  params = _params(jnp.float32)
  mesh = jax.make_mesh(
    (2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2]
  )
  with jax.set_mesh(mesh):
    jax.block_until_ready(f(params, packed))
    with Compiles() as n:
      loss, out = jax.block_until_ready(f(params, packed))
  assert n.n <= 1  # op by op, it was hundreds on every call
  ref_loss, ref = _reference(params, batch, packed)
  assert _rel(out.grads, ref) <= 2e-6
  assert abs(float(loss) - ref_loss) <= 2e-6 * abs(ref_loss)
  assert float(out.weight) == sum(lengths)
