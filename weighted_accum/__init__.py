"""weighted_accum: exact gradient accumulation over unequal microbatches.

Callers hand in gradients of a per-microbatch loss SUM or MEAN together with
that microbatch's effective weight (tokens, samples); the library keeps
weighted sums in a chosen work dtype and divides once, so the result equals
the full-batch gradient whatever the split.
"""

from importlib import metadata as _metadata

from weighted_accum import checkpoint
from weighted_accum import distributed
from weighted_accum.checkpoint import AccumRestore
from weighted_accum.checkpoint import AccumSave
from weighted_accum.checkpoint import abstract_state
from weighted_accum.core import accumulate_mean
from weighted_accum.core import accumulate_sum
from weighted_accum.core import finish_mean
from weighted_accum.core import finish_sums
from weighted_accum.distributed import local_grad
from weighted_accum.distributed import local_value_and_grad
from weighted_accum.distributed import reduce_sums
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.loss_scale import DynamicLossScale
from weighted_accum.loss_scale import set_loss_scale
from weighted_accum.microbatch import microbatched_value_and_grad
from weighted_accum.microbatch import optax_accumulator
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients
from weighted_accum.state import from_buffers
from weighted_accum.state import init
from weighted_accum.train_state import TrainState
from weighted_accum.transform import WeightedMultiSteps
from weighted_accum.transform import WeightedMultiStepsState
from weighted_accum.transform import has_updated
from weighted_accum.transform import weighted_multi_steps
from weighted_accum.transform import window_counters
from weighted_accum.window import apply_window

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
  "reduce_sums",
  "set_loss_scale",
  "weighted_multi_steps",
  "window_counters",
)
