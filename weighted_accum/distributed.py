"""Data parallelism: what a per-replica window needs beyond the core API.

A window is made per replica by :func:`weighted_accum.init` with
``axis_name`` (inside ``jax.shard_map``: this replica's window; outside: a
window stacked over the replicas, carried between jitted steps), and every
core function reads that from the window. Here: the specs to pass a stacked
window into ``shard_map`` (``window_specs``), the reduction of a replica's
``finish_sums`` (``reduce_sums``), the data-parallel part of an in-step
window (``DataParallel``) and local gradients (``local_grad``,
``local_value_and_grad``, ``is_reduced``). Under plain ``jax.jit`` over
global arrays none of this is needed. ``docs/scaling.md`` tells the styles.
"""

from weighted_accum._src import validation as _validation
from weighted_accum._src.parallel.distributed import reduce_sums as reduce_sums
from weighted_accum._src.parallel.local_grads import is_reduced as is_reduced
from weighted_accum._src.parallel.local_grads import local_grad as local_grad
from weighted_accum._src.parallel.local_grads import (
  local_value_and_grad as local_value_and_grad,
)
from weighted_accum._src.parallel.replicas import window_specs as window_specs
from weighted_accum._src.parallel.spmd_layout import (
  DataParallel as DataParallel,
)

__all__ = [
  "DataParallel",
  "is_reduced",
  "local_grad",
  "local_value_and_grad",
  "reduce_sums",
  "window_specs",
]

__getattr__ = _validation.removed_attribute(__name__)
