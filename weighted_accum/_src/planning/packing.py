"""Packing a planned batch into the spec's per-shape arrays (NumPy), padding
and masks explicit; and ``plan_batch``, which plans and packs."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.planning import planner
from weighted_accum._src.planning import spec as spec_
from weighted_accum._src.planning.planner import LENGTH
from weighted_accum._src.planning.planner import POS
from weighted_accum._src.planning.planner import REPLICA
from weighted_accum._src.planning.planner import ROW
from weighted_accum._src.planning.planner import SHAPE
from weighted_accum._src.planning.planner import SLOT
from weighted_accum._src.planning.planner import START
from weighted_accum._src.planning.spec import PlanSpec


@jax.tree_util.register_pytree_node_class
class Packed:
  """A batch planned and packed for one spec (a pytree; the spec is static).

  Attributes:
    spec: the :class:`PlanSpec` it was planned for.
    shapes: per shape of ``spec.shapes``, ``(rows, mask)``: the batch's
      tree with leaves ``[replicas * capacity * rows, length, ...]``
      (replica-major, then slot, then row; padding zeros) and the float32
      mask of real tokens.
    counts: int32 ``[replicas, len(spec.shapes)]``: the slots that hold a
      microbatch (the only values that vary from batch to batch besides
      the data).
    plan: the host-side plan (``None`` once it has passed through a
      transformation): ``plan.pieces`` says where each row went.
  """

  def __init__(self, spec, shapes, counts, plan=None):
    self.spec, self.shapes, self.counts, self.plan = spec, shapes, counts, plan

  def tree_flatten(self):
    return (self.shapes, self.counts), self.spec

  @classmethod
  def tree_unflatten(cls, spec, children):
    return cls(spec, *children)

  def __repr__(self) -> str:
    return f"Packed(spec={self.spec!r}, counts={self.counts!r})"


def _leaves(batch: Any, n: int, longest: int) -> tuple[list, Any]:
  """The batch's leaves as arrays ``[n, T >= longest, ...]``, or an error."""
  leaves, treedef = jax.tree.flatten(batch)
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    x = np.asarray(x)
    if x.ndim < 2 or x.shape[0] != n or x.shape[1] < longest:
      raise WeightedAccumulationError(
        f"plan_batch(batch{jax.tree_util.keystr(path)}): shape {x.shape}; "
        f"every leaf must be [rows={n}, tokens>={longest}, ...] to match "
        "lengths (one per row)."
      )
    out.append(x)
  if not leaves:
    raise WeightedAccumulationError("plan_batch(batch): the batch is empty.")
  return out, treedef


def _lengths(spec: PlanSpec, lengths: Any) -> np.ndarray:
  lengths = np.asarray(lengths)
  if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
    raise WeightedAccumulationError(
      f"plan_batch(lengths): got {lengths.dtype} {lengths.shape}; pass one "
      "int token count per row of the batch."
    )
  if lengths.size and lengths.min() < 0:
    r = int(np.argmin(lengths))
    raise WeightedAccumulationError(
      f"plan_batch(lengths[{r}]={lengths[r]}): a row's length is >= 0."
    )
  return lengths.astype(np.int64)


@functools.lru_cache(maxsize=64)
def _layout(spec: PlanSpec) -> tuple[np.ndarray, int]:
  """Each shape's first token in one flat buffer of all shapes, and its
  size."""
  sizes = [spec.replicas * c * r * n for (r, n), c in
           zip(spec.shapes, spec.capacities)]  # fmt: skip
  return np.cumsum([0] + sizes[:-1]), sum(sizes)


def pack(spec: PlanSpec, batch: Any, lengths: np.ndarray, plan) -> Packed:
  """The batch's rows copied where ``plan`` puts them: every shape a view
  of one zeroed buffer per leaf, every real token written by one
  scatter."""
  leaves, treedef = _leaves(batch, len(lengths), int(lengths.max(initial=0)))
  p, (first, size) = plan.pieces, _layout(spec)
  caps, shapes = np.asarray(spec.capacities), np.asarray(spec.shapes)
  rows, length = shapes[p[:, SHAPE], 0], shapes[p[:, SHAPE], 1]
  slot = (p[:, REPLICA] * caps[p[:, SHAPE]] + p[:, SLOT]) * rows + p[:, POS]
  n = p[:, LENGTH]
  token = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
  dest = np.repeat(first[p[:, SHAPE]] + slot * length, n) + token
  mask = np.zeros(size, np.float32)
  mask[dest] = 1.0
  arrays = []
  for x in leaves:
    src = np.repeat(p[:, ROW] * x.shape[1] + p[:, START], n) + token
    flat = x.reshape((-1,) + x.shape[2:])
    buf = np.zeros((size,) + x.shape[2:], x.dtype)
    buf[dest] = flat[src]
    arrays.append(buf)
  out = []
  for s, (_, n) in enumerate(spec.shapes):
    end = first[s + 1] if s + 1 < len(first) else size
    views = [a[first[s] : end].reshape((-1, n) + a.shape[1:]) for a in arrays]
    view = mask[first[s] : end].reshape(-1, n)
    out.append((jax.tree.unflatten(treedef, views), view))
  return Packed(spec, tuple(out), plan.counts, plan)


def plan_batch(
  spec: PlanSpec, batch: Any, lengths: Any, *, seed: int = 0
) -> Packed:
  """Plans a batch of variable-length rows and packs it for ``spec``.

  On the host, in NumPy: each row (or piece, with ``overlong="split"``)
  goes to one replica (work balanced by the cost model, Karmarkar-Karp),
  each replica's rows to microbatches and each microbatch to a shape of the
  spec, at the least cost by the model (a dynamic program over the rows
  sorted longest first). Ties between equal lengths are broken by
  ``seed``: the plan is a function of ``(spec, lengths, seed)``.

  Args:
    spec: the :class:`PlanSpec`.
    batch: a pytree of arrays ``[rows, tokens, ...]``, each row's real
      tokens first (tokens ids, targets, a loss mask...).
    lengths: int ``[rows]``: each row's real tokens (0: an empty row).
    seed: breaks ties between rows of equal length.

  Returns:
    A ``Packed`` batch, for a function of
    :func:`planned_value_and_grad` built with the same spec.

  Raises:
    WeightedAccumulationError: lengths not one int per row of every leaf, a
      row longer than the largest bucket (``overlong="refuse"``), more rows
      than the spec's ``batch_rows``.

  Example:
    >>> import numpy as np
    >>> from weighted_accum.planning import PlanSpec, plan_batch
    >>> spec = PlanSpec(buckets=(4, 8), budget=8, batch_rows=4)
    >>> tokens = np.arange(32).reshape(4, 8)
    >>> packed = plan_batch(spec, {"tokens": tokens}, [8, 3, 2, 0])
    >>> spec.shapes, packed.counts.tolist()
    (((2, 4), (1, 4), (1, 8)), [[1, 0, 1]])
    >>> packed.shapes[0][0]["tokens"][:2].tolist()  # rows 1 and 2, padded
    [[8, 9, 10, 0], [16, 17, 0, 0]]
  """
  seed = spec_.seed(seed, f"plan_batch(seed={seed!r})")
  lengths = _lengths(spec, lengths)
  return pack(spec, batch, lengths, planner.plan(spec, lengths, seed))
