"""Plans over random lengths, specs and replica counts (hypothesis): every
token of every row lands exactly once, in a shape that fits it and the
budget, within capacity; the work is balanced as the partition guarantees;
the same seed gives the same plan; the packed arrays hold the rows."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
import numpy as np

from weighted_accum import planning
from weighted_accum._src.planning import planner as pl


@st.composite
def cases(draw):
  buckets = draw(st.lists(st.sampled_from([2, 3, 4, 8, 16, 32]), min_size=1,
                          max_size=4, unique=True))  # fmt: skip
  top = max(buckets)
  overlong = draw(st.sampled_from(pl_overlong()))
  longest = top * (
    3 if overlong == "split" else 1 if overlong == "refuse" else 2
  )
  lengths = draw(st.lists(st.integers(0, longest), min_size=0, max_size=40))
  pieces = (  # rows after splitting (an empty row is one)
    sum(max(1, -(-n // top)) for n in lengths)
    if overlong == "split"
    else len(lengths)
  )
  replicas = draw(st.integers(1, 4))
  spec = planning.PlanSpec(
    buckets=buckets,
    budget=draw(st.integers(top, 4 * top)),
    batch_rows=max(1, -(-pieces // replicas)) + draw(st.integers(0, 2)),
    row_divisors=draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)),
    replicas=replicas,
    overlong=overlong,
    cost=(
      1.0,
      draw(st.sampled_from([0.0, 0.01, 1.0])),
      draw(st.sampled_from([0.0, 64.0])),
    ),
    pack=draw(st.booleans()),
  )
  return spec, np.asarray(lengths, np.int64), draw(st.integers(0, 3))


def pl_overlong():
  return ["refuse", "truncate", "split"]


def _bucket_cost(spec, n):
  return spec.shape_cost(1, spec.buckets[np.searchsorted(spec.buckets, n)])


@given(cases())
def test_every_token_lands_once_in_a_shape_that_fits(case):
  spec, lengths, seed = case
  plan = pl.plan(spec, lengths, seed)
  p, shapes, top = plan.pieces, spec.shapes, spec.buckets[-1]
  for row, n in enumerate(lengths):  # the tokens each row's pieces cover
    mine = p[p[:, pl.ROW] == row]
    covered = np.zeros(n, int)
    for start, k in mine[:, [pl.START, pl.LENGTH]]:
      covered[start : start + k] += 1
    want = min(n, top) if spec.overlong != "split" else n
    assert covered[:want].tolist() == [1] * want and covered[want:].sum() == 0
  slots, taken = set(), set()
  for _, _, k, r, s, slot, pos, off in p.tolist():
    rows, length = shapes[s]
    assert k >= 1 and off + k <= length and rows * length <= spec.budget
    assert pos < rows and slot < plan.counts[r, s] <= spec.capacities[s]
    assert spec.pack or off == 0
    slots.add((r, s, slot, pos))
    taken |= {(r, s, slot, pos, t) for t in range(off, off + k)}
  assert len(taken) == p[:, pl.LENGTH].sum()  # no two pieces share a token
  # Every slot counted holds a piece, and the costs are the slots'.
  for r in range(spec.replicas):
    used = {(s, slot) for (rr, s, slot, _) in slots if rr == r}
    assert len(used) == plan.counts[r].sum()
    cost = sum(
      spec.shape_cost(*shapes[s]) * c for s, c in enumerate(plan.counts[r])
    )
    assert np.isclose(plan.costs[r], cost)


@given(cases())
def test_work_is_balanced_and_the_plan_deterministic(case):
  spec, lengths, seed = case
  plan = pl.plan(spec, lengths, seed)
  p = plan.pieces
  per = np.array([_bucket_cost(spec, k) for k in p[:, pl.LENGTH]])
  # Karmarkar-Karp's partition: no replica above the mean by more than one
  # piece by the rows' padded costs; the exchange after it never makes the
  # slowest replica slower by the cuts' exact costs.
  parts = pl._karmarkar_karp(per.tolist(), spec.replicas)
  loads = np.array([per[q].sum() for q in parts])
  if len(p):
    assert loads.max() <= loads.mean() + per.max() + 1e-9
  bucket = np.searchsorted(spec.buckets, p[:, pl.LENGTH])
  nb = len(spec.buckets)
  counts = [tuple(np.bincount(bucket[q], minlength=nb)) for q in parts]
  assert plan.costs.max() <= max(pl._load(spec, c) for c in counts) + 1e-9
  again = pl.plan(spec, lengths, seed)
  assert np.array_equal(plan.pieces, again.pieces)
  assert np.array_equal(plan.counts, again.counts)


@given(cases())
def test_packed_arrays_hold_each_row_and_mask_its_tokens(case):
  spec, lengths, seed = case
  t = max(1, int(lengths.max(initial=0)))
  tokens = 1 + np.arange(len(lengths) * t).reshape(len(lengths), t)
  packed = planning.plan_batch(spec, {"t": tokens}, lengths, seed=seed)
  p = packed.plan.pieces
  fill = {}  # per packed row: its tokens (the segments fill it from 0)
  for row, start, k, r, s, slot, pos, off in p.tolist():
    rows, length = spec.shapes[s]
    at = (r * spec.capacities[s] + slot) * rows + pos
    mb = packed.shapes[s]
    got = np.asarray(mb.rows["t"][at])
    assert (
      got[off : off + k].tolist() == tokens[row, start : start + k].tolist()
    )
    assert np.asarray(mb.mask[at])[off : off + k].all()
    fill[s, at] = fill.get((s, at), 0) + k
    if spec.pack:  # the segment's id is its place in the row; positions
      seg = np.asarray(mb.segment_ids[at])[off : off + k]
      firsts = sorted(q[7] for q in p.tolist() if q[3:7] == [r, s, slot, pos])
      assert seg.tolist() == [firsts.index(off) + 1] * k
      assert np.asarray(mb.positions[at])[off : off + k].tolist() == list(
        range(k)
      )
  for (s, at), n in fill.items():  # padding after the segments: zeros
    mb = packed.shapes[s]
    assert np.asarray(mb.mask[at]).tolist() == [1] * n + [0] * (
      mb.mask.shape[1] - n
    )
    assert not np.asarray(mb.rows["t"][at])[n:].any()
    if spec.pack:
      assert not np.asarray(mb.segment_ids[at])[n:].any()
  real = sum(float(mb.mask.sum()) for mb in packed.shapes)
  assert real == p[:, pl.LENGTH].sum()  # nothing else is marked real


def test_lognormal_batches_are_balanced_and_lightly_padded():
  """The issue's workload, by the cost model: 64-row batches of lognormal
  lengths (median 60) clipped to [8, 512], budget 4,096, buckets 32..512.
  In every one of 50 batches the slowest replica is within 1.05 of the
  ideal (the plan's cost over the replicas, or the costliest row where
  that is more) at 2 replicas and 1.10 at 4 (with sub-shapes down to 1/16);
  padded / real tokens <= 1.6 on one replica with the default sub-shapes."""
  rng = np.random.default_rng(0)
  draws = [
    np.clip(np.round(rng.lognormal(np.log(60), 1.0, 64)), 8, 512).astype(int)
    for _ in range(50)
  ]
  for replicas, bound in ((2, 1.05), (4, 1.10)):
    spec = planning.PlanSpec(
      buckets=(32, 64, 128, 256, 512), budget=4096, batch_rows=64,
      replicas=replicas, row_divisors=(1, 2, 4, 8, 16),
    )  # fmt: skip
    for i, n in enumerate(draws):
      costs = pl.plan(spec, n, seed=i).costs
      ideal = max(costs.mean(), _bucket_cost(spec, n.max()))
      assert costs.max() <= bound * ideal, (replicas, i, costs)
  spec = planning.PlanSpec(
    buckets=(32, 64, 128, 256, 512), budget=4096, batch_rows=64
  )
  tokens = sum(
    r * n * c
    for d in draws
    for (r, n), c in zip(spec.shapes, pl.plan(spec, d).counts[0])
  )
  assert tokens / sum(d.sum() for d in draws) <= 1.6
