"""Microbatch plans: variable-length rows packed into a few static shapes,
one compile for every batch, the exact full-batch gradient.

A :class:`PlanSpec` fixes every compiled shape; :func:`plan_batch` plans
and packs a batch on the host (NumPy); :func:`planned_value_and_grad`
builds the step; :class:`PlanBatches` plans in a Grain pipeline's workers.
``docs/planning.md`` tells when a plan pays and how to choose a spec.
"""

from weighted_accum._src.planning.packing import plan_batch as plan_batch
from weighted_accum._src.planning.pipeline import PlanBatches as PlanBatches
from weighted_accum._src.planning.spec import PlanSpec as PlanSpec
from weighted_accum._src.planning.step import (
  planned_value_and_grad as planned_value_and_grad,
)

__all__ = ["PlanBatches", "PlanSpec", "plan_batch", "planned_value_and_grad"]
