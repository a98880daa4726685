"""Planning a batch on the host (NumPy): rows to replicas (balanced by
Karmarkar-Karp), each replica's rows to microbatches and each microbatch to
a shape of the spec (a dynamic program, optimal for the cost model)."""

from __future__ import annotations

import functools
import heapq
from typing import NamedTuple

import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.planning.spec import PlanSpec

# Columns of ``Plan.pieces``: a piece is a row, or a part of a split row.
ROW, START, LENGTH, REPLICA, SHAPE, SLOT, POS = range(7)


class Plan(NamedTuple):
  """Where each piece of each row goes: ``pieces[:, ROW..POS]`` (row, first
  token, tokens, replica, shape, microbatch slot, row in the microbatch);
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


def _greedy(costs: list[float], k: int) -> list[list[int]]:
  """Longest processing time first: each item to the lightest part."""
  loads, parts = [0.0] * k, [[] for _ in range(k)]
  for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
    j = loads.index(min(loads))
    loads[j] += costs[i]
    parts[j].append(i)
  return parts


@functools.lru_cache(maxsize=64)
def _options(spec: PlanSpec) -> list[list[tuple[int, int, float]]]:
  """Per bucket: the shapes a run led by a row of that bucket may take,
  ``(rows, shape index, cost)``."""
  shapes = spec.shapes
  return [
    [
      (r, s, spec.shape_cost(r, length))
      for s, (r, length) in enumerate(shapes)
      if length >= bucket
    ]
    for bucket in spec.buckets
  ]


def _runs(buckets: list[int], options) -> tuple[float, list[tuple[int, int]]]:
  """Rows sorted longest first (their bucket indices) cut into contiguous
  runs, each a shape: the cheapest cut (a dynamic program). Returns the
  cost and ``(first row, shape)`` per run."""
  n = len(buckets)
  best, choice = [0.0] * (n + 1), [(0, 0)] * n
  for i in range(n - 1, -1, -1):
    top, pick = float("inf"), (0, 0)
    for rows, s, cost in options[buckets[i]]:
      j = i + rows
      c = cost + best[j if j < n else n]
      if c < top:
        top, pick = c, (j, s)
    best[i], choice[i] = top, pick
  runs, i = [], 0
  while i < n:
    runs.append((i, choice[i][1]))
    i = min(n, choice[i][0])
  return best[0], runs


def plan(spec: PlanSpec, lengths: np.ndarray, seed: int = 0) -> Plan:
  """The plan of one batch of rows of ``lengths`` tokens (see module)."""
  pieces = _pieces(spec, lengths)
  n = len(pieces)
  order = np.random.default_rng(seed).permutation(n)
  order = order[np.argsort(-pieces[order, LENGTH], kind="stable")]
  pieces = pieces[order]
  bucket = np.searchsorted(spec.buckets, pieces[:, LENGTH]).tolist()
  per_row = [spec.shape_cost(1, spec.buckets[b]) for b in bucket]
  k = spec.replicas
  parts = _karmarkar_karp(per_row, k) if k > 1 else [list(range(n))]
  if k > 1:
    other = _greedy(per_row, k)
    load = lambda ps: max(sum(per_row[i] for i in p) for p in ps)
    parts = parts if load(parts) <= load(other) else other
  options, shapes = _options(spec), spec.shapes
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
  out = np.concatenate([pieces, np.asarray(where, np.int64).reshape(n, 4)], 1)
  counts = np.asarray(counts, np.int32)
  full = counts > np.asarray(spec.capacities)[None]
  if full.any():
    r, s = np.argwhere(full)[0]
    raise WeightedAccumulationError(
      f"plan_batch: replica {r} needs {counts[r, s]} microbatches of shape "
      f"{shapes[s]}, more than its capacity {spec.capacities[s]}: the batch "
      f"has more rows than PlanSpec(batch_rows={spec.batch_rows}) allows."
    )
  return Plan(out, counts, costs)
