"""Data parallelism inside ``jax.shard_map``: per-replica windows reduced
once, and local gradients.

Under plain ``jax.jit`` over global arrays none of this is needed: the core
functions work on sharded arrays as they are. The styles, the autodiff trap
and when to reduce: ``docs/scaling.md``.
"""

from weighted_accum._src.parallel.distributed import (
  REDUCE_MODES as REDUCE_MODES,
)
from weighted_accum._src.parallel.distributed import (
  accumulate_mean as accumulate_mean,
)
from weighted_accum._src.parallel.distributed import (
  accumulate_sum as accumulate_sum,
)
from weighted_accum._src.parallel.distributed import finish_mean as finish_mean
from weighted_accum._src.parallel.distributed import init as init
from weighted_accum._src.parallel.distributed import reduce_sums as reduce_sums
from weighted_accum._src.parallel.local_grads import is_reduced as is_reduced
from weighted_accum._src.parallel.local_grads import local_grad as local_grad
from weighted_accum._src.parallel.local_grads import (
  local_value_and_grad as local_value_and_grad,
)
from weighted_accum._src.parallel.replicas import window_specs as window_specs

__all__ = [
  "REDUCE_MODES",
  "accumulate_mean",
  "accumulate_sum",
  "finish_mean",
  "init",
  "is_reduced",
  "local_grad",
  "local_value_and_grad",
  "reduce_sums",
  "window_specs",
]
