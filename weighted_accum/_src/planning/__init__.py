"""Microbatch plans (the top layer, public as ``weighted_accum.planning``):
``spec`` (the static shapes), ``planner`` (rows to replicas, microbatches
and shapes, on the host), ``packing`` (the per-shape arrays, ``plan_batch``),
``step`` (``planned_value_and_grad``) and ``pipeline`` (``PlanBatches``)."""
