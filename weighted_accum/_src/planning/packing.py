"""Packing a planned batch into the spec's per-shape arrays (NumPy), padding
and masks explicit; and ``plan_batch``, which plans and packs."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.planning import planner
from weighted_accum._src.planning import spec as spec_
from weighted_accum._src.planning.planner import LENGTH
from weighted_accum._src.planning.planner import OFFSET
from weighted_accum._src.planning.planner import POS
from weighted_accum._src.planning.planner import REPLICA
from weighted_accum._src.planning.planner import ROW
from weighted_accum._src.planning.planner import SHAPE
from weighted_accum._src.planning.planner import SLOT
from weighted_accum._src.planning.planner import START
from weighted_accum._src.planning.spec import PlanSpec


class Rows(NamedTuple):
  """A microbatch as ``loss_fn`` gets it from a spec that does not pack:
  ``(rows, mask)``, the batch's tree at ``[rows, length, ...]`` (padding
  zeros) and the float32 mask of real tokens."""

  rows: Any
  mask: Any

  @property
  def segment_ids(self):
    raise _not_packed("segment_ids")

  @property
  def positions(self):
    raise _not_packed("positions")


def _not_packed(name: str) -> WeightedAccumulationError:
  return WeightedAccumulationError(
    f"microbatch.{name}: this spec does not pack (one row per row of the "
    "microbatch, positions from 0); build the PlanSpec with pack=True."
  )


class PackedRows(NamedTuple):
  """A microbatch as ``loss_fn`` gets it from a spec that packs: ``rows``
  and ``mask`` as ``Rows``'s, with int32 ``segment_ids`` ``[rows,
  length]`` (0 on padding, 1, 2, ... per segment of a row) and
  ``positions`` (each token's place in its segment, from 0)."""

  rows: Any
  mask: Any
  segment_ids: Any
  positions: Any


@jax.tree_util.register_pytree_node_class
class Packed:
  """A batch planned and packed for one spec (a pytree; the spec is static):
  what crosses to the device, each shape's microbatches sliced from it
  there (``shapes``).

  Attributes:
    spec: the :class:`PlanSpec` it was planned for.
    data: the batch's tree with leaves ``[replicas, batch_rows * longest
      bucket, ...]``: each replica's real tokens, packed row after packed
      row (the size of a batch padded to the longest bucket).
    index: int32 ``[replicas, 2, rows]``: each packed row's first token in
      ``data`` and its tokens, the rows of every shape's slots one after
      another.
    starts: int8 ``[replicas, batch_rows * longest bucket]``: 1 where a
      segment starts (``None`` unless the spec packs).
    counts: int32 ``[replicas, len(spec.shapes)]``: the slots that hold a
      microbatch.
    plan: the host-side plan (``None`` once it has passed through a
      transformation): ``plan.pieces`` says where each row went.
  """

  def __init__(self, spec, data, index, starts, counts, plan=None):
    self.spec, self.data, self.index = spec, data, index
    self.starts, self.counts, self.plan = starts, counts, plan

  def tree_flatten(self):
    return (self.data, self.index, self.starts, self.counts), self.spec

  @classmethod
  def tree_unflatten(cls, spec, children):
    return cls(spec, *children)

  def __repr__(self) -> str:
    return f"Packed(spec={self.spec!r}, counts={self.counts!r})"

  @functools.cached_property
  def shapes(self) -> tuple:
    """Per shape of ``spec.shapes``, the microbatches of its slots as one
    ``Rows`` (or ``PackedRows``) with leaves ``[replicas *
    capacity * rows, length, ...]`` (replica-major, then slot, then row),
    gathered from ``data`` (on the device, inside the step)."""
    return _unpack(self)


def _unpack(p: Packed) -> tuple:
  """``Packed.shapes``: each shape's rows gathered from the buffer (padding
  zeros), the mask, and with packing the segments and their positions."""
  spec, r, width = p.spec, p.counts.shape[0], _width(p.spec)
  base = width * jnp.arange(r)[:, None]
  data = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), p.data)
  if spec.pack:  # per token: segments so far, and tokens since its start
    marks, token = p.starts.reshape(-1), jnp.arange(r * width)
    segment = jnp.cumsum(marks.astype(jnp.int32))
    position = token - jax.lax.cummax(jnp.where(marks > 0, token, 0))
  out, first = [], 0
  for (rows, n), cap in zip(spec.shapes, spec.capacities):
    start = (p.index[:, 0, first : first + cap * rows] + base).reshape(-1)
    fill = p.index[:, 1, first : first + cap * rows].reshape(-1)
    first += cap * rows
    at = jnp.minimum(start[:, None] + jnp.arange(n), r * width - 1)
    real = jnp.arange(n) < fill[:, None]
    take = lambda x, real=real, at=at: jnp.where(
      real.reshape(real.shape + (1,) * (x.ndim - 1)), x[at], 0
    )
    mb = (jax.tree.map(take, data), real.astype(jnp.float32))
    if spec.pack:
      seg = segment[at] - segment[start][:, None] + 1
      mb += (jnp.where(real, seg, 0), jnp.where(real, position[at], 0))
    out.append((PackedRows if spec.pack else Rows)(*mb))
  return tuple(out)


def _width(spec: PlanSpec) -> int:
  """Each replica's tokens in ``Packed.data``."""
  return spec.batch_rows * spec.buckets[-1]


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


def pack(spec: PlanSpec, batch: Any, lengths: np.ndarray, plan) -> Packed:
  """The batch's rows copied where ``plan`` puts them: each replica's
  packed rows one after another in one buffer per leaf (one scatter of the
  real tokens), and the index of each shape's rows in it."""
  leaves, treedef = _leaves(batch, len(lengths), int(lengths.max(initial=0)))
  p, width, reps = plan.pieces, _width(spec), spec.replicas
  sizes = [c * r for c, (r, _) in zip(spec.capacities, spec.shapes)]
  rows = np.asarray(spec.shapes)[:, 0]
  at = (np.cumsum([0] + sizes[:-1])[p[:, SHAPE]] + p[:, SLOT]
        * rows[p[:, SHAPE]] + p[:, POS] + p[:, REPLICA] * sum(sizes))  # fmt: skip
  fill = np.bincount(at, p[:, LENGTH], reps * sum(sizes)).astype(np.int64)
  fill = fill.reshape(reps, -1)  # no replica has more than batch_rows rows:
  start = np.cumsum(fill, 1) - fill  # its tokens fit its part of the buffer
  n = p[:, LENGTH]
  first = p[:, REPLICA] * width + start.reshape(-1)[at] + p[:, OFFSET]
  token = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
  dest = np.repeat(first, n) + token
  arrays = []
  for x in leaves:
    src = np.repeat(p[:, ROW] * x.shape[1] + p[:, START], n) + token
    buf = np.zeros((reps * width,) + x.shape[2:], x.dtype)
    buf[dest] = x.reshape((-1,) + x.shape[2:])[src]
    arrays.append(buf.reshape((reps, width) + x.shape[2:]))
  starts = None
  if spec.pack:
    starts = np.zeros(reps * width, np.int8)
    starts[first] = 1
    starts = starts.reshape(reps, width)
  index = np.stack([start, fill], 1).astype(np.int32)
  data = jax.tree.unflatten(treedef, arrays)
  return Packed(spec, data, index, starts, plan.counts, plan)


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

  With ``spec.pack``, rows (longest first) are first packed first-fit into
  rows of a bucket's length (a row opens a new packed row of its own
  bucket's length when no open one has room; with one bucket, Grain's
  first-fit packing of the rows sorted longest first), and the packed rows
  are planned as rows. ``loss_fn`` then gets ``PackedRows``: beside
  ``rows`` and ``mask``, ``segment_ids`` (0 on padding, ``1, 2, ...`` per
  segment of a row) and ``positions`` (from 0 in each segment); mask
  attention by ``causal AND same segment``.

  The packed batch holds each replica's real tokens in one buffer of
  ``batch_rows x`` the longest bucket per leaf (the size of a padded batch)
  and a small index; the step slices the shapes from it on the device.

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
