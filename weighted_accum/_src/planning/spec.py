"""A plan's static part: the microbatch shapes, their capacities, the cost
model. The spec alone fixes every compiled shape."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from typing import Any

import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.planning import planner

OVERLONG = ("refuse", "truncate", "split")
OVERHEAD = 64.0  # a microbatch's fixed cost, in tokens (the default model)


def _ints(value, what: str) -> tuple[int, ...]:
  """A sorted tuple of distinct positive ints, or an error naming ``what``."""
  try:
    got = tuple(sorted({int(v) for v in value}))
  except (TypeError, ValueError):
    got = ()
  if not got or got[0] < 1 or any(int(v) != v for v in value):
    raise WeightedAccumulationError(
      f"PlanSpec({what}={value!r}): give a non-empty sequence of positive ints."
    )
  return got


def seed(value, what: str) -> int:
  """A plan's seed: an int >= 0, or an error naming ``what``."""
  if not isinstance(value, numbers.Integral) or isinstance(value, bool):
    value = None
  if value is None or value < 0:
    raise WeightedAccumulationError(
      f"{what}: the seed breaks ties between rows of equal length: an int >= 0."
    )
  return int(value)


@dataclasses.dataclass(frozen=True)
class PlanSpec:
  """The static part of a microbatch plan: every shape one step compiles.

  Each bucket length ``L`` gets a full shape of ``budget // L`` rows and a
  sub-shape per further divisor (``rows // d``), so a batch's short tail
  need not fill a whole microbatch. A shape holds ``capacity`` microbatch
  slots per replica, enough for any batch of ``batch_rows`` rows; only the
  slots a plan fills run. Equal specs compile the same program.

  Args:
    buckets: the padded lengths a row may take (each row goes to a bucket
      at least its length).
    budget: the most tokens (rows x length) of one microbatch; at least the
      largest bucket.
    batch_rows: the most rows (after ``overlong="split"``) of one batch
      per replica: a batch of up to ``replicas * batch_rows`` rows always
      fits (no replica gets more than ``batch_rows``); more is refused.
    row_divisors: the sub-shapes: for each ``d``, a shape of
      ``(budget // L) // d`` rows per bucket (``1`` is the full shape).
    replicas: data-parallel replicas the batch's work is balanced over.
    overlong: a row longer than the largest bucket: ``"refuse"`` it,
      ``"truncate"`` it to that bucket, or ``"split"`` it into rows of at
      most that length (each piece loses the context before it).
    cost: the cost model, ``(per token, per (token, token) pair of a row,
      per microbatch)``, in units of one token's FLOPs; the default is a
      decoder of width 128 (pairs cost ``1 / (6 d)`` of a token) with a
      microbatch's fixed cost (a loop step, the kernels' launches) worth
      ``OVERHEAD`` tokens. A pair ``(per token, per pair)`` takes that
      overhead. ``python -m benchmarks planning --calibrate`` fits all three
      on your machine.
    pack: pack rows first-fit decreasing into rows of a bucket's length
      (several segments per row) before planning; the microbatch then
      carries ``segment_ids`` and ``positions`` (see :func:`plan_batch`).

  Example:
    >>> from weighted_accum.planning import PlanSpec
    >>> spec = PlanSpec(buckets=(32, 64), budget=128, batch_rows=8)
    >>> spec.shapes
    ((4, 32), (2, 32), (1, 32), (2, 64), (1, 64))
  """

  buckets: tuple[int, ...]
  budget: int
  batch_rows: int
  row_divisors: tuple[int, ...] = (1, 2, 4, 8)
  replicas: int = 1
  overlong: str = "refuse"
  cost: tuple[float, ...] = (1.0, 1.0 / 768, OVERHEAD)
  pack: bool = False

  def __post_init__(self):
    put = lambda k, v: object.__setattr__(self, k, v)
    put("buckets", _ints(self.buckets, "buckets"))
    put("row_divisors", _ints(self.row_divisors, "row_divisors"))
    for name in ("budget", "batch_rows", "replicas"):
      put(name, _ints((getattr(self, name),), name)[0])
    if self.budget < self.buckets[-1]:
      raise WeightedAccumulationError(
        f"PlanSpec(budget={self.budget}): one row of bucket "
        f"{self.buckets[-1]} does not fit; the smallest budget that works "
        f"is {self.buckets[-1]}."
      )
    if self.overlong not in OVERLONG:
      raise WeightedAccumulationError(
        f"PlanSpec(overlong={self.overlong!r}): one of {OVERLONG}."
      )
    cost = tuple(float(c) for c in self.cost)
    cost += (OVERHEAD,) * (len(cost) == 2)
    if len(cost) != 3 or not all(math.isfinite(c) and c >= 0 for c in cost):
      raise WeightedAccumulationError(
        f"PlanSpec(cost={self.cost!r}): (per token, per token pair[, per "
        "microbatch]), finite non-negative numbers."
      )
    put("cost", cost)
    if not isinstance(self.pack, bool):
      raise WeightedAccumulationError(
        f"PlanSpec(pack={self.pack!r}): True or False."
      )

  @functools.cached_property
  def shapes(self) -> tuple[tuple[int, int], ...]:
    """The compiled ``(rows, length)`` shapes, by length then rows, largest
    first."""
    out = []
    for length in self.buckets:
      full = self.budget // length
      rows = sorted(
        {max(1, full // d) for d in self.row_divisors}, reverse=True
      )
      out += [(r, length) for r in rows]
    return tuple(out)

  @functools.cached_property
  def capacities(self) -> tuple[int, ...]:
    """The microbatch slots per shape and replica (enough for any plan)."""
    return tuple(-(-self.batch_rows // r) for r, _ in self.shapes)

  def shape_cost(self, rows: int, length: int) -> float:
    """The cost model's cost of one microbatch of ``rows`` x ``length``."""
    a, b, c = self.cost
    return rows * (a * length + b * length * length) + c

  @classmethod
  def from_lengths(
    cls,
    sample_lengths: Any,
    *,
    budget: int,
    batch_rows: int,
    max_shapes: int = 3,
    longest: int | None = None,
    **options: Any,
  ) -> PlanSpec:
    """The spec of at most ``max_shapes`` shapes whose plans of a sample of
    row lengths cost least by the cost model.

    The candidates: buckets ``longest`` (default: the sample's longest row)
    and up to ``max_shapes - 1`` powers of two from 8 below it, row
    divisors a run of powers of two (``(1,)``, ``(1, 2)``, ``(2, 4)``,
    ``(8,)``...: shapes of ``budget // L``, or ``1/2``, ``1/8``... of it)
    while the shapes number at most ``max_shapes`` (each shape is one more
    compiled loop). Each is scored
    by planning the sample cut into batches of ``batch_rows x replicas``
    rows (up to 16) and summing each batch's slowest replica; the cheapest
    wins, fewer shapes on a tie.

    Args:
      sample_lengths: row lengths like those to come (ints >= 1).
      budget, batch_rows: as the constructor's.
      max_shapes: the most compiled shapes.
      longest: the largest bucket (with ``overlong=`` for longer rows).
      **options: the constructor's other arguments (``replicas``,
        ``pack``, ``overlong``, ``cost``), kept as given.

    Returns:
      The chosen :class:`PlanSpec`.

    Example:
      >>> import numpy as np
      >>> from weighted_accum.planning import PlanSpec
      >>> lengths = np.r_[np.full(60, 20), np.full(4, 500)]
      >>> PlanSpec.from_lengths(lengths, budget=1024, batch_rows=64).shapes
      ((32, 32), (2, 500))
    """
    n = np.asarray(sample_lengths)
    if n.ndim != 1 or not n.size or n.dtype.kind not in "iu" or n.min() < 1:
      raise WeightedAccumulationError(
        f"PlanSpec.from_lengths(sample_lengths): got {n.dtype} {n.shape}; "
        "pass a non-empty sequence of ints >= 1 (the rows' lengths)."
      )
    top = int(longest or n.max())
    lows = [2**k for k in range(3, top.bit_length()) if 2**k < top]
    step = batch_rows * options.get("replicas", 1)
    batches = [n[i : i + step] for i in range(0, n.size, step)][:16]
    divisors = [  # runs of powers of two: 1, 2, 4 ... or 2, 4, 8 ...
      tuple(2**i for i in range(first, first + size))
      for first in range((budget // 8).bit_length())
      for size in range(1, max_shapes + 1)
    ]
    best, seen = None, set()
    for k, divs in itertools.product(range(max_shapes), divisors):
      for low in itertools.combinations(lows, k):
        spec = cls(low + (top,), budget, batch_rows, divs, **options)
        if len(spec.shapes) > max_shapes or spec.shapes in seen:
          continue
        seen.add(spec.shapes)
        cost = sum(planner.plan(spec, b).costs.max() for b in batches)
        key = (cost, len(spec.shapes))
        best = min(best or (key, spec), (key, spec), key=lambda x: x[0])
    return best[1]
