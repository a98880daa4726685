"""Orbax checkpointing of accumulator state: ``AccumSave``, ``AccumRestore``,
their ``AccumCheckpointHandler`` and ``abstract_state``.

Usage, what is written and what restoring validates: ``docs/checkpointing.md``.
"""

from weighted_accum._src.checkpointing.checkpoint import (
  FORMAT_VERSION as FORMAT_VERSION,
)
from weighted_accum._src.checkpointing.checkpoint import (
  AccumCheckpointHandler as AccumCheckpointHandler,
)
from weighted_accum._src.checkpointing.checkpoint import (
  AccumRestore as AccumRestore,
)
from weighted_accum._src.checkpointing.checkpoint import AccumSave as AccumSave
from weighted_accum._src.checkpointing.checkpoint import (
  abstract_state as abstract_state,
)

__all__ = [
  "FORMAT_VERSION",
  "AccumCheckpointHandler",
  "AccumRestore",
  "AccumSave",
  "abstract_state",
]
