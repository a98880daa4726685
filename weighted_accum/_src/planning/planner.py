"""Planning a batch on the host (NumPy): rows packed into bucket-length rows
when the spec packs (first-fit decreasing), rows to replicas (balanced by
Karmarkar-Karp), each replica's rows to microbatches and each microbatch to
a shape of the spec (a dynamic program, optimal for the cost model)."""

from __future__ import annotations

import functools
import heapq
import itertools
from typing import Any, NamedTuple

import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError

# spec.py imports this module (``PlanSpec.from_lengths`` plans a sample):
# the spec is annotated by name only.
PlanSpec = Any

# Columns of ``Plan.pieces``: a piece is a row, or a part of a split row.
ROW, START, LENGTH, REPLICA, SHAPE, SLOT, POS, OFFSET = range(8)


class Plan(NamedTuple):
  """Where each piece of each row goes: ``pieces[:, ROW..OFFSET]`` (row,
  first token, tokens, replica, shape, microbatch slot, row in the
  microbatch, first token in that row: 0 unless the spec packs);
  ``counts[r, s]`` microbatches of shape ``s`` on replica ``r``; ``costs[r]``
  replica ``r``'s cost by the model."""

  pieces: np.ndarray
  counts: np.ndarray
  costs: np.ndarray


def _pieces(spec: PlanSpec, lengths: np.ndarray) -> np.ndarray:
  """``(row, start, length)`` per piece; over-long rows as ``overlong``
  says. Rows of length 0 have no piece."""
  top = spec.buckets[-1]
  rows = np.flatnonzero(lengths > 0)
  n = lengths[rows]
  over = rows[n > top]
  if over.size and spec.overlong == "refuse":
    r = int(over[0])
    raise WeightedAccumulationError(
      f"plan_batch: row {r} has {int(lengths[r])} tokens, more than the "
      f"largest bucket ({top}). Add a bucket, or build the PlanSpec with "
      "overlong='truncate' or 'split'."
    )
  if spec.overlong != "split":
    return np.stack([rows, np.zeros_like(rows), np.minimum(n, top)], 1)
  parts = -(-n // top)
  row = np.repeat(rows, parts)
  first = np.repeat(np.cumsum(parts) - parts, parts)
  start = (np.arange(row.size) - first) * top
  return np.stack([row, start, np.minimum(lengths[row] - start, top)], 1)


def _karmarkar_karp(costs: list[float], k: int) -> list[list[int]]:
  """Items (by index) into ``k`` parts of near-equal cost sums: the
  largest differencing method (Karmarkar-Karp, multiway)."""
  heap = []
  for i, c in enumerate(costs):
    parts = [(c, [i])] + [(0.0, []) for _ in range(k - 1)]
    heapq.heappush(heap, (-c, i, parts))
  while len(heap) > 1:
    _, i, a = heapq.heappop(heap)
    _, _, b = heapq.heappop(heap)
    merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, reversed(b))]
    merged.sort(key=lambda p: -p[0])
    heapq.heappush(heap, (merged[-1][0] - merged[0][0], i, merged))
  return [p[1] for p in heap[0][2]] if heap else [[] for _ in range(k)]


@functools.lru_cache(maxsize=64)
def _options(spec: PlanSpec) -> list[list[tuple[int, int, float]]]:
  """Per bucket: the shapes a run led by a row of that bucket may take,
  ``(rows, shape index, cost)``, without those another takes more rows of
  at no more cost (the cost of a suffix of rows never grows as it
  shrinks)."""
  out = []
  for bucket in spec.buckets:
    fits = sorted(
      (-r, spec.shape_cost(r, n), s)
      for s, (r, n) in enumerate(spec.shapes)
      if n >= bucket
    )
    kept, cheapest = [], float("inf")
    for r, cost, s in fits:  # most rows first
      if cost < cheapest:
        kept.append((-r, s, cost))
        cheapest = cost
    out.append(kept)
  return out


def _runs(buckets: list[int], options) -> tuple[float, list[tuple[int, int]]]:
  """Rows sorted longest first (their bucket indices) cut into contiguous
  runs, each a shape: the cheapest cut (a dynamic program). Returns the
  cost and ``(first row, shape)`` per run."""
  n = len(buckets)
  best, choice = [0.0] * (2 * n + 1), [(0, 0)] * n  # best[j >= n] = 0
  for i in range(n - 1, -1, -1):
    top, pick = float("inf"), (0, 0)
    for rows, s, cost in options[buckets[i]]:
      c = cost + best[i + rows if rows <= n else n]
      if c < top:
        top, pick = c, (i + rows, s)
    best[i], choice[i] = top, pick
  runs, i = [], 0
  while i < n:
    runs.append((i, choice[i][1]))
    i = choice[i][0]
  return best[0], runs


@functools.lru_cache(maxsize=1 << 16)
def _load(spec: PlanSpec, counts: tuple[int, ...]) -> float:
  """The cheapest cut's cost of rows of ``counts[b]`` per bucket ``b``."""
  rows = [b for b in range(len(counts) - 1, -1, -1) for _ in range(counts[b])]
  return _runs(rows, _options(spec))[0]


def _rebalance(spec: PlanSpec, counts: list[list[int]]) -> list[list[int]]:
  """Replicas' rows per bucket: first at most ``batch_rows`` each (rows of
  the shortest bucket moved from the replica with the most rows to the
  cheapest with room), then a row moved (to a replica with room) or two
  swapped between the costliest replica and another while that lowers the
  replicas' costs (sorted, costliest first, compared lexicographically)."""
  load = lambda c: _load(spec, tuple(c))
  loads = [load(c) for c in counts]
  nb, room = len(spec.buckets), lambda r: spec.batch_rows - sum(counts[r])
  while room(h := min(range(len(counts)), key=room)) < 0:
    o = min(
      (r for r in range(len(counts)) if room(r) > 0), key=loads.__getitem__
    )
    b = next(b for b in range(nb) if counts[h][b])
    counts[h][b], counts[o][b] = counts[h][b] - 1, counts[o][b] + 1
    loads[h], loads[o] = load(counts[h]), load(counts[o])
  for _ in range(4 * sum(map(sum, counts))):
    best, key = None, sorted(loads, reverse=True)
    h = loads.index(key[0])
    for o in (o for o in range(len(counts)) if o != h):
      for b, c in itertools.product(range(nb), range(-1, nb)):
        if not counts[h][b] or b == c or (c >= 0 and not counts[o][c]):
          continue
        if c < 0 and not room(o):  # a move: the other replica takes a row
          continue
        a, z = list(counts[h]), list(counts[o])
        a[b], z[b] = a[b] - 1, z[b] + 1
        if c >= 0:  # a swap: a row of bucket c comes back
          a[c], z[c] = a[c] + 1, z[c] - 1
        new = list(loads)
        new[h], new[o] = load(a), load(z)
        got = sorted(new, reverse=True)
        if got < key and not all(abs(x - y) < 1e-9 for x, y in zip(got, key)):
          best, key = (h, o, a, z, new), got
    if best is None:
      return counts
    h, o, counts[h], counts[o], loads = best
  return counts


def _first_fit(spec: PlanSpec, n: np.ndarray) -> tuple[np.ndarray, ...]:
  """Pieces of ``n`` tokens (longest first) packed first-fit decreasing:
  each into the first open row with room, else into a new row of the
  piece's bucket length. Returns each piece's row and first token, and the
  rows' tokens (longest bucket first, as the pieces)."""
  room, fill = np.zeros((2, len(n)), np.int64)  # the open rows'
  used, row, first = 0, np.zeros_like(n), np.zeros_like(n)
  for i, k in enumerate(n.tolist()):
    j = int(np.argmax(room[:used] >= k)) if used else 0
    if not used or room[j] < k:
      j, used = used, used + 1
      room[j] = spec.buckets[np.searchsorted(spec.buckets, k)]
    row[i], first[i] = j, fill[j]
    room[j], fill[j] = room[j] - k, fill[j] + k
  return row, first, fill[:used]


def plan(spec: PlanSpec, lengths: np.ndarray, seed: int = 0) -> Plan:
  """The plan of one batch of rows of ``lengths`` tokens (see module)."""
  pieces = _pieces(spec, lengths)
  k = spec.replicas
  rows = len(pieces) + int(np.sum(lengths == 0))  # an empty row counts
  if rows > k * spec.batch_rows:
    raise WeightedAccumulationError(
      f"plan_batch: the batch has {rows} rows (after overlong='split'), "
      f"more than PlanSpec(replicas={k}, batch_rows={spec.batch_rows}) "
      f"allows: build it with batch_rows={-(-rows // k)}, or pass fewer rows."
    )
  order = np.random.default_rng(seed).permutation(len(pieces))
  order = order[np.argsort(-pieces[order, LENGTH], kind="stable")]
  pieces = pieces[order]
  unit, offset = np.arange(len(pieces)), np.zeros(len(pieces), np.int64)
  units = pieces[:, LENGTH]
  if spec.pack:  # the packed rows are planned as rows
    unit, offset, units = _first_fit(spec, units)
  n = len(units)
  bucket = np.searchsorted(spec.buckets, units).tolist()
  per_row = [spec.shape_cost(1, spec.buckets[b]) - spec.cost[2] for b in bucket]
  options, shapes = _options(spec), spec.shapes
  parts = [list(range(n))]
  if k > 1:
    nb = len(spec.buckets)
    counts = [np.bincount([bucket[i] for i in p], minlength=nb).tolist()
              for p in _karmarkar_karp(per_row, k)]  # fmt: skip
    counts = np.asarray(_rebalance(spec, counts))
    # The rows (longest first, so by bucket, descending) to the replicas.
    replica = np.concatenate(
      [np.repeat(np.arange(k), c) for c in counts.T[::-1]]
    )
    parts = [np.flatnonzero(replica == r).tolist() for r in range(k)]
  where = [None] * n  # (replica, shape, slot, row in the microbatch)
  counts = [[0] * len(shapes) for _ in range(k)]
  costs = np.zeros(k)
  for r, part in enumerate(parts):
    part = sorted(part)  # longest first, as ``pieces``
    costs[r], runs = _runs([bucket[i] for i in part], options)
    ends = [first for first, _ in runs[1:]] + [len(part)]
    for (first, s), end in zip(runs, ends):
      for pos, i in enumerate(part[first:end]):
        where[i] = (r, s, counts[r][s], pos)
      counts[r][s] += 1
  where = np.asarray(where, np.int64).reshape(n, 4)[unit]
  out = np.concatenate([pieces, where, offset[:, None]], 1)
  counts = np.asarray(counts, np.int32)
  full = counts > np.asarray(spec.capacities)[None]
  if full.any():
    r, s = np.argwhere(full)[0]
    raise WeightedAccumulationError(
      f"plan_batch: replica {r} needs {counts[r, s]} microbatches of shape "
      f"{shapes[s]}, more than its capacity {spec.capacities[s]}: the "
      "planner's own fault; report it with the lengths."
    )
  return Plan(out, counts, costs)
