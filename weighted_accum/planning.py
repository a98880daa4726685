"""Microbatch plans (``docs/planning.md``); see ``_src/planning``."""

from weighted_accum._src.planning.packing import plan_batch as plan_batch
from weighted_accum._src.planning.pipeline import PlanBatches as PlanBatches
from weighted_accum._src.planning.spec import PlanSpec as PlanSpec
from weighted_accum._src.planning.step import (
  planned_value_and_grad as planned_value_and_grad,
)

__all__ = ["PlanBatches", "PlanSpec", "plan_batch", "planned_value_and_grad"]
