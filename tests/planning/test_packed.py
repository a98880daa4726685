"""Plans that pack: the packed rows are Grain's first-fit packing, a model
masked by segment gets each row's own gradient, the transfer is compact,
and bad input is refused."""

from __future__ import annotations

from flax import nnx
import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_planned_conformance import _batch
from test_planned_conformance import _loss_fn
from test_planned_conformance import _params
import toy_lm

import weighted_accum as wa
from weighted_accum import planning
from weighted_accum._src.planning import planner as pl


def _bins(pieces):
  """Each packed row's rows, in segment order, as a set of tuples."""
  rows = {}
  for q in sorted(pieces.tolist(), key=lambda q: q[pl.OFFSET]):
    rows.setdefault(tuple(q[pl.REPLICA : pl.OFFSET]), []).append(q[pl.ROW])
  return {tuple(r) for r in rows.values()}


@pytest.mark.parametrize("seed", range(4))
def test_one_bucket_packs_as_grains_first_fit_packer(seed):
  """With one bucket at the longest length, a packing plan's rows are
  Grain's first-fit packing of the rows sorted longest first (FFD)."""
  rng = np.random.default_rng(seed)
  lengths = np.clip(rng.lognormal(np.log(12), 1.0, 40), 1, 64).astype(int)
  spec = planning.PlanSpec(buckets=(64,), budget=256, batch_rows=40, pack=True)
  tokens = np.repeat(1 + np.arange(40)[:, None], 64, 1).astype(np.int32)
  packed = planning.plan_batch(spec, {"t": tokens}, lengths, seed=seed)
  order = packed.plan.pieces[:, pl.ROW]  # longest first; ties as planned
  assert np.all(np.diff(lengths[order]) <= 0)
  source = [{"t": tokens[r, : lengths[r]]} for r in order]
  grain_rows = grain.experimental.FirstFitPackIterDataset(
    grain.MapDataset.source(source).to_iter_dataset(),
    length_struct={"t": 64},
    num_packing_bins=len(source),
    shuffle_bins=False,
  )
  want = set()
  for row in grain_rows:
    segments = row["t_segment_ids"]
    ids = [int(row["t"][segments == s][0]) - 1 for s in np.unique(segments)]
    want.add(tuple(i for i, s in zip(ids, np.unique(segments)) if s))
  want.discard(())
  assert _bins(packed.plan.pieces) == want


def _nll(model, tokens, targets, segment_ids=None, positions=None):
  logits = model(tokens, segment_ids, positions)
  picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return jax.nn.logsumexp(logits, -1) - picked


def test_a_segment_masked_model_gets_each_rows_own_gradient():
  """The recipe model (causal AND same-segment attention, positions from
  each segment's start) packed: its gradient is the sum of the rows'
  gradients, each row run alone and unpadded, over all their tokens
  (float32: ``nnx`` attention takes its softmax in float32)."""
  rng = np.random.default_rng(0)
  n = rng.integers(2, 17, 12)  # row lengths; each predicts n - 1 tokens
  rows = rng.integers(0, toy_lm.VOCAB, (12, 16)).astype(np.int32)
  batch = {"tokens": rows[:, :-1], "targets": rows[:, 1:]}
  spec = planning.PlanSpec(
    buckets=(4, 8, 15), budget=30, batch_rows=12, row_divisors=(1,), pack=True
  )

  def loss_fn(model, mb):
    nll = _nll(model, mb.rows["tokens"], mb.rows["targets"],
               mb.segment_ids, mb.positions)  # fmt: skip
    return jnp.sum(nll * mb.mask), mb.mask.sum()

  with jax.enable_x64(False):  # the model computes softmax in float32
    model = toy_lm.TinyLM(dim=16, heads=2, max_len=16, rngs=nnx.Rngs(0))
    packed = planning.plan_batch(spec, batch, n - 1)
    assert (packed.plan.pieces[:, pl.OFFSET] > 0).any()  # rows share rows
    f = planning.planned_value_and_grad(loss_fn, spec, mode="sum")
    _, out = jax.jit(f)(model, packed)

    def alone(m):  # every row on its own, no padding, no segments
      return (
        sum(
          jnp.sum(_nll(m, rows[None, i, : k - 1], rows[None, i, 1:k]))
          for i, k in enumerate(n)
        )
        / (n - 1).sum()
      )

    ref = nnx.jit(nnx.grad(alone))(model)
    got = [np.asarray(x) for x in jax.tree.leaves(out.grads)]
    want = [np.asarray(x) for x in jax.tree.leaves(ref)]
  err = sum(np.sum((np.asarray(a) - b) ** 2) for a, b in zip(got, want))
  assert np.sqrt(err / sum(np.sum(np.square(b)) for b in want)) <= 2e-6


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("pack", [False, True])
def test_transfer_is_at_most_twice_a_padded_batch(replicas, pack):
  """The packed batch's bytes (what crosses to the device) against a batch
  of ``batch_rows x`` the longest bucket per replica, padded."""
  spec = planning.PlanSpec(
    buckets=(32, 64, 128, 256, 512), budget=4096, batch_rows=64,
    replicas=replicas, pack=pack,
  )  # fmt: skip
  rng = np.random.default_rng(0)
  n = replicas * 64
  lengths = np.clip(rng.lognormal(np.log(60), 1.0, n), 8, 512).astype(int)
  batch = {
    "tokens": rng.integers(0, 9, (n, 512)).astype(np.int32),
    "targets": rng.integers(0, 9, (n, 512)).astype(np.int32),
  }
  packed = planning.plan_batch(spec, batch, lengths)
  got = sum(np.asarray(x).nbytes for x in jax.tree.leaves(packed))
  padded = replicas * 64 * 512 * (4 + 4)
  assert got <= 2 * padded, got / padded


def test_bad_input_to_a_packing_plan_is_refused():
  spec = planning.PlanSpec(buckets=(8, 16), budget=32, batch_rows=6, pack=True)
  batch = _batch([3, 20, 5])
  with pytest.raises(wa.WeightedAccumulationError, match="row 1 has 20"):
    planning.plan_batch(spec, batch, [3, 20, 5])
  with pytest.raises(wa.WeightedAccumulationError, match=r"batch\['targets'\]"):
    planning.plan_batch(spec, batch, [3, 5])
  with pytest.raises(wa.WeightedAccumulationError, match=r"PlanSpec\(pack"):
    planning.PlanSpec(buckets=(8,), budget=8, batch_rows=2, pack=1)


def test_a_loss_asking_for_segments_of_a_spec_that_does_not_pack():
  spec = planning.PlanSpec(buckets=(8, 16), budget=16, batch_rows=4)
  packed = planning.plan_batch(spec, _batch([3, 9]), [3, 9])

  def loss_fn(p, mb):
    return _loss_fn(p, mb) if mb.segment_ids is None else None

  f = planning.planned_value_and_grad(loss_fn, spec, mode="sum")
  with pytest.raises(wa.WeightedAccumulationError, match="pack=True"):
    f(_params(jnp.float32), packed)


@pytest.mark.parametrize("pack", [False, True])
def test_a_spec_from_lengths_is_no_dearer_than_simpler_specs(pack):
  """``from_lengths`` keeps within ``max_shapes`` and its plans of the
  sample cost no more (by the model) than hand-picked specs of as few
  shapes: one bucket, or the top and one power of two below it."""
  rng = np.random.default_rng(0)
  n = np.clip(rng.lognormal(np.log(60), 1.0, 256), 8, 512).astype(int)
  kw = dict(budget=4096, batch_rows=64, pack=pack)
  spec = planning.PlanSpec.from_lengths(n, **kw)
  assert len(spec.shapes) <= 3 and spec.buckets[-1] == n.max()

  def cost(s):
    return sum(pl.plan(s, n[i : i + 64]).costs.max() for i in (0, 64, 128, 192))

  hand_picked = [((n.max(),), (1,)), ((n.max(),), (1, 2, 4)),
                 ((128, n.max()), (1,)), ((64, n.max()), (1,)),
                 # sub-shapes without the full shape: microbatches of 1/8
                 # and 1/4 of the budget
                 ((128, 256, n.max()), (8,)), ((256, n.max()), (4,))]  # fmt: skip
  for buckets, divisors in hand_picked:
    other = planning.PlanSpec(buckets, row_divisors=divisors, **kw)
    assert cost(spec) <= cost(other) + 1e-6, other
  with pytest.raises(wa.WeightedAccumulationError, match="sample_lengths"):
    planning.PlanSpec.from_lengths([0, 3], **kw)
