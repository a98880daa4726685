"""weighted_accum: exact gradient accumulation over unequal microbatches.

Callers hand in gradients of a per-microbatch loss SUM or MEAN together with
that microbatch's effective weight (tokens, samples); the library keeps
weighted sums in a chosen work dtype and divides once, so the result equals
the full-batch gradient whatever the split.

The public surface (version 1.0, frozen: later changes go through
deprecation): this namespace, :mod:`weighted_accum.distributed` (data
parallelism), :mod:`weighted_accum.checkpoint` (Orbax, imported on first
use: ``import weighted_accum`` loads no Orbax), :mod:`.planning`.
"""

import importlib as _importlib
from importlib import metadata as _metadata

from weighted_accum import distributed
from weighted_accum import planning
from weighted_accum._src import validation as _validation

# Across jitted steps: the optax wrapper and flax's TrainState.
from weighted_accum._src.across_steps.multi_steps import (
  WeightedMultiSteps as WeightedMultiSteps,
)
from weighted_accum._src.across_steps.multi_steps import (
  has_updated as has_updated,
)
from weighted_accum._src.across_steps.multi_steps import (
  window_counters as window_counters,
)
from weighted_accum._src.across_steps.peek import discard as discard
from weighted_accum._src.across_steps.peek import peek_mean as peek_mean
from weighted_accum._src.across_steps.train_state import (
  TrainState as TrainState,
)
from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState as WeightedMultiStepsState,
)

# The state and the error.
from weighted_accum._src.core.accumulation import from_buffers as from_buffers

# Mixed precision.
from weighted_accum._src.core.base import AccumState as AccumState
from weighted_accum._src.core.base import (
  AccumulatedGradients as AccumulatedGradients,
)
from weighted_accum._src.core.loss_scale import (
  DynamicLossScale as DynamicLossScale,
)

# Read the open window's mean, or drop the window.
from weighted_accum._src.errors import (
  WeightedAccumulationError as WeightedAccumulationError,
)

# In-step microbatching through optax.microbatching.
from weighted_accum._src.in_step.optax_microbatching import (
  optax_accumulator as optax_accumulator,
)

# Inside one jitted step: a loop over the microbatches of a global batch.
from weighted_accum._src.in_step.value_and_grad import (
  microbatched_value_and_grad as microbatched_value_and_grad,
)

# Open and fill a window (global, or per replica with axis_name); close it:
# its sums, its mean, or its mean through an optimizer.
from weighted_accum._src.parallel.functional import (
  accumulate_mean as accumulate_mean,
)
from weighted_accum._src.parallel.functional import (
  accumulate_sum as accumulate_sum,
)
from weighted_accum._src.parallel.functional import apply_window as apply_window
from weighted_accum._src.parallel.functional import finish_mean as finish_mean
from weighted_accum._src.parallel.functional import finish_sums as finish_sums
from weighted_accum._src.parallel.functional import init as init
from weighted_accum._src.parallel.functional import (
  set_loss_scale as set_loss_scale,
)

# The one version string is pyproject.toml's; installed metadata carries it.
try:
  __version__ = _metadata.version("weighted_accum")
except _metadata.PackageNotFoundError:  # a source tree that is not installed
  __version__ = "0+unknown"

__all__ = (
  "AccumState",
  "AccumulatedGradients",
  "DynamicLossScale",
  "TrainState",
  "WeightedAccumulationError",
  "WeightedMultiSteps",
  "WeightedMultiStepsState",
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
  "microbatched_value_and_grad",
  "optax_accumulator",
  "peek_mean",
  "planning",
  "set_loss_scale",
  "window_counters",
)


def __getattr__(name: str):
  """Loads the Orbax namespace ``checkpoint`` on first use."""
  if name == "checkpoint":
    return _importlib.import_module(f"{__name__}.checkpoint")
  return _validation.removed_attribute(__name__)(name)
