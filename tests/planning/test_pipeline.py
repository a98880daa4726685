"""The pipeline stage: plans made where batches are made, by a plain loop or
in a Grain pipeline's workers, the same after a restore from Grain's
iterator checkpoint; the example's step gives the full batch's gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import weighted_accum as wa
from weighted_accum import planning

grain = pytest.importorskip("grain")
import planned_pipeline as example  # examples/, on the path (conftest.py)  # noqa: E402


def _same(a, b):
  assert a.spec == b.spec
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_numpy_path_is_plan_batch():
  stage = planning.PlanBatches(example.SPEC, seed=2)
  rows = [example.row(i) for i in range(example.ROWS)]
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  got = next(map(stage, [batch]))
  lengths = batch.pop("lengths")
  _same(got, planning.plan_batch(example.SPEC, batch, lengths, seed=2))
  with pytest.raises(wa.WeightedAccumulationError, match="'lengths'"):
    stage({"tokens": batch["tokens"]})


def test_a_restored_iterator_replays_the_same_plans():
  it = iter(example.pipeline())
  _take(it, 3)
  state = it.get_state()
  after = _take(it, 2)
  again = iter(example.pipeline())
  again.set_state(state)
  for a, b in zip(after, _take(again, 2)):
    _same(a, b)
  leaves = [jax.tree.leaves(p) for p in after]  # batches differ: can fail
  assert any(not np.array_equal(x, y) for x, y in zip(*leaves))


def test_workers_plan_as_the_main_process_does():
  main = _take(iter(example.pipeline()), 3)
  workers = _take(iter(example.pipeline(workers=2)), 3)
  for a, b in zip(main, workers):
    _same(a, b)


def test_the_example_step_is_the_full_batch_gradient():
  packed = next(iter(example.pipeline()))
  w = jnp.linspace(-1.0, 1.0, 100)
  f = planning.planned_value_and_grad(example.loss_fn, example.SPEC, mode="sum")
  _, out = jax.jit(f)(w, packed)
  tokens = np.concatenate([rows["tokens"][m > 0] for rows, m in packed.shapes])
  ref = jax.grad(lambda w: jnp.mean((w[tokens % 100] - 1.0) ** 2))(w)
  np.testing.assert_allclose(out.grads, ref, rtol=2e-6, atol=1e-7)
