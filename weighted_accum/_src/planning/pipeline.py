"""The input pipeline's stage: each batch planned and packed where it is
made (a Grain pipeline's workers, or any loop over NumPy batches)."""

from __future__ import annotations

from typing import Any

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.planning import spec as spec_
from weighted_accum._src.planning.packing import Packed
from weighted_accum._src.planning.packing import plan_batch
from weighted_accum._src.planning.spec import PlanSpec


class PlanBatches:
  """A pipeline stage: ``batch -> plan_batch(spec, batch, lengths)``.

  A plain callable, so it runs in any loader (``map(stage, batches)``) and
  as a Grain map (``grain.MapDataset.map(stage)``; with
  ``.to_iter_dataset().mp_prefetch(...)`` the plans are made in Grain's
  worker processes). The plan is a function of the batch alone (and
  ``seed``): a pipeline replays the same plans after a restore from Grain's
  iterator checkpoint (``get_state``/``set_state``).

  Args:
    spec: the :class:`PlanSpec`.
    lengths: the key of the batch's int ``[rows]`` lengths; the other keys
      are the rows (each ``[rows, tokens, ...]``).
    seed: breaks ties between rows of equal length.

  Example:
    >>> import numpy as np
    >>> from weighted_accum.planning import PlanBatches, PlanSpec
    >>> stage = PlanBatches(PlanSpec(buckets=(4, 8), budget=8, batch_rows=4))
    >>> batch = {"tokens": np.ones((4, 8), np.int32), "lengths": [8, 3, 2, 0]}
    >>> stage(batch).counts.tolist()
    [[1, 0, 1]]
  """

  def __init__(self, spec: PlanSpec, lengths: str = "lengths", seed: int = 0):
    if not isinstance(spec, PlanSpec):
      raise WeightedAccumulationError(
        f"PlanBatches(spec={spec!r}): pass a PlanSpec."
      )
    self.spec, self.lengths = spec, lengths
    self.seed = spec_.seed(seed, f"PlanBatches(seed={seed!r})")

  def __call__(self, batch: Any) -> Packed:
    if not isinstance(batch, dict) or self.lengths not in batch:
      got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
      raise WeightedAccumulationError(
        f"PlanBatches: a batch is a dict with the lengths under "
        f"{self.lengths!r}; got {got}."
      )
    rows = {k: v for k, v in batch.items() if k != self.lengths}
    return plan_batch(self.spec, rows, batch[self.lengths], seed=self.seed)
