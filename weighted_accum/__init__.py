"""weighted_accum: exact gradient accumulation over unequal microbatches.

Callers hand in gradients of a per-microbatch loss SUM or MEAN together with
that microbatch's effective weight (tokens, samples); the library keeps
weighted sums in a chosen work dtype and divides once, so the result equals
the full-batch gradient whatever the split.
"""

from importlib import metadata as _metadata

from weighted_accum import checkpoint
from weighted_accum import distributed

# Across jitted steps: the optax wrapper and flax's TrainState.
from weighted_accum._src.across_steps.multi_steps import (
  WeightedMultiSteps as WeightedMultiSteps,
)
from weighted_accum._src.across_steps.multi_steps import (
  has_updated as has_updated,
)
from weighted_accum._src.across_steps.multi_steps import (
  weighted_multi_steps as weighted_multi_steps,
)
from weighted_accum._src.across_steps.multi_steps import (
  window_counters as window_counters,
)
from weighted_accum._src.across_steps.multi_steps_step import (
  WeightedMultiStepsState as WeightedMultiStepsState,
)

# Across jitted steps: flax's TrainState with a weight.
from weighted_accum._src.across_steps.train_state import (
  TrainState as TrainState,
)

# Checkpoints (more in weighted_accum.checkpoint).
from weighted_accum._src.checkpointing.checkpoint import (
  AccumRestore as AccumRestore,
)
from weighted_accum._src.checkpointing.checkpoint import AccumSave as AccumSave
from weighted_accum._src.checkpointing.checkpoint import (
  abstract_state as abstract_state,
)

# The functional API: open, fill and close a window.
from weighted_accum._src.core.accumulation import (
  accumulate_mean as accumulate_mean,
)
from weighted_accum._src.core.accumulation import (
  accumulate_sum as accumulate_sum,
)
from weighted_accum._src.core.accumulation import from_buffers as from_buffers
from weighted_accum._src.core.accumulation import init as init

# Mixed precision.
from weighted_accum._src.core.accumulation import (
  set_loss_scale as set_loss_scale,
)

# The state and the error.
from weighted_accum._src.core.base import AccumState as AccumState
from weighted_accum._src.core.base import (
  AccumulatedGradients as AccumulatedGradients,
)
from weighted_accum._src.core.finishing import apply_window as apply_window
from weighted_accum._src.core.finishing import finish_mean as finish_mean
from weighted_accum._src.core.finishing import finish_sums as finish_sums
from weighted_accum._src.core.loss_scale import (
  DynamicLossScale as DynamicLossScale,
)

# The functional API: read the open window's mean, or drop the window.
from weighted_accum._src.core.open_window import discard as discard
from weighted_accum._src.core.open_window import peek_mean as peek_mean
from weighted_accum._src.errors import (
  WeightedAccumulationError as WeightedAccumulationError,
)

# Inside one jitted step: a loop over the microbatches of a global batch.
from weighted_accum._src.in_step.microbatching import (
  microbatched_value_and_grad as microbatched_value_and_grad,
)

# In-step microbatching through optax.microbatching.
from weighted_accum._src.in_step.optax_microbatching import (
  optax_accumulator as optax_accumulator,
)
from weighted_accum._src.parallel.distributed import reduce_sums as reduce_sums

# Data parallelism (more in weighted_accum.distributed).
from weighted_accum._src.parallel.local_grads import local_grad as local_grad
from weighted_accum._src.parallel.local_grads import (
  local_value_and_grad as local_value_and_grad,
)

# The one version string is pyproject.toml's; installed metadata carries it.
try:
  __version__ = _metadata.version("weighted_accum")
except _metadata.PackageNotFoundError:  # a source tree that is not installed
  __version__ = "0+unknown"

__all__ = (
  "AccumRestore",
  "AccumSave",
  "AccumState",
  "AccumulatedGradients",
  "DynamicLossScale",
  "TrainState",
  "WeightedAccumulationError",
  "WeightedMultiSteps",
  "WeightedMultiStepsState",
  "abstract_state",
  "accumulate_mean",
  "accumulate_sum",
  "apply_window",
  "checkpoint",
  "discard",
  "distributed",
  "finish_mean",
  "finish_sums",
  "from_buffers",
  "has_updated",
  "init",
  "local_grad",
  "local_value_and_grad",
  "microbatched_value_and_grad",
  "optax_accumulator",
  "peek_mean",
  "reduce_sums",
  "set_loss_scale",
  "weighted_multi_steps",
  "window_counters",
)
