"""Every check of a value a caller hands in: one function per kind of input,
each returning the value to store (one package: ``values``, ``options``,
``calls`` (how an in-step microbatched function is configured and called),
``restored`` counters, the ``scaler``'s configuration and the
``placement`` of the caller's arrays on devices; import it as
``validation`` and call ``validation.weight(...)``).

Every public entry point calls these before any kernel sees the value. The
rule is that the value that will be STORED is validated, after the
conversion: a NumPy ``int64`` weight is not wrapped to int32, a loss scale of
``1e39`` (``inf`` in float32) or ``1e-46`` (``0``) is refused, a weight the
float32 tally would flush to zero is refused. Concrete values are checked on
the host and come back as host NumPy scalars (so a value committed to another
device never meets the buffers inside a kernel); traced values are converted
by the same rules and come back with a validity flag (a weight) or as NaN (a
loss scale), because under ``jax.jit`` a Python exception cannot depend on
them. The rules are tabulated in ``docs/inputs.md``.
"""

from weighted_accum._src.validation.calls import (
  NORMALIZER_NOUN as NORMALIZER_NOUN,
)
from weighted_accum._src.validation.calls import SPLITS as SPLITS
from weighted_accum._src.validation.calls import argnames as argnames
from weighted_accum._src.validation.calls import grads_dtype as grads_dtype
from weighted_accum._src.validation.calls import in_axes as in_axes
from weighted_accum._src.validation.calls import normalizer as normalizer
from weighted_accum._src.validation.calls import normalizers as normalizers
from weighted_accum._src.validation.calls import (
  optional_argnums as optional_argnums,
)
from weighted_accum._src.validation.calls import random_key as random_key
from weighted_accum._src.validation.calls import split as split
from weighted_accum._src.validation.calls import unsplit_batch as unsplit_batch
from weighted_accum._src.validation.devices import (
  one_device_set as one_device_set,
)
from weighted_accum._src.validation.options import argnums as argnums
from weighted_accum._src.validation.options import axis_names as axis_names
from weighted_accum._src.validation.options import bool_scalar as bool_scalar
from weighted_accum._src.validation.options import bound_axes as bound_axes
from weighted_accum._src.validation.options import (
  callable_or_none as callable_or_none,
)
from weighted_accum._src.validation.options import choice as choice
from weighted_accum._src.validation.options import count as count
from weighted_accum._src.validation.options import every_k as every_k
from weighted_accum._src.validation.options import instance as instance
from weighted_accum._src.validation.options import mode as mode
from weighted_accum._src.validation.options import num_real as num_real
from weighted_accum._src.validation.options import (
  optional_axis_names as optional_axis_names,
)
from weighted_accum._src.validation.options import (
  partition_specs as partition_specs,
)
from weighted_accum._src.validation.options import shared as shared
from weighted_accum._src.validation.options import spec_on_mesh as spec_on_mesh
from weighted_accum._src.validation.options import static_flag as static_flag
from weighted_accum._src.validation.options import static_int as static_int
from weighted_accum._src.validation.options import traced_flag as traced_flag
from weighted_accum._src.validation.options import (
  transformation as transformation,
)
from weighted_accum._src.validation.removed import (
  refuse_removed as refuse_removed,
)
from weighted_accum._src.validation.removed import (
  removed_attribute as removed_attribute,
)
from weighted_accum._src.validation.restored import (
  saved_counters as saved_counters,
)
from weighted_accum._src.validation.scaler import (
  float32_number as float32_number,
)
from weighted_accum._src.validation.scaler import (
  growth_tracker as growth_tracker,
)
from weighted_accum._src.validation.scaler import scaler_factor as scaler_factor
from weighted_accum._src.validation.scaler import (
  scaler_min_scale as scaler_min_scale,
)
from weighted_accum._src.validation.scaler import scaler_scale as scaler_scale
from weighted_accum._src.validation.values import (
  EXACT_INT_LIMIT as EXACT_INT_LIMIT,
)
from weighted_accum._src.validation.values import INT32_MAX as INT32_MAX
from weighted_accum._src.validation.values import MODES as MODES
from weighted_accum._src.validation.values import SCALE_NOUN as SCALE_NOUN
from weighted_accum._src.validation.values import WEIGHT_NOUN as WEIGHT_NOUN
from weighted_accum._src.validation.values import ScaleSource as ScaleSource
from weighted_accum._src.validation.values import Weight as Weight
from weighted_accum._src.validation.values import host_number as host_number
from weighted_accum._src.validation.values import loss_scale as loss_scale
from weighted_accum._src.validation.values import (
  nonempty_window as nonempty_window,
)
from weighted_accum._src.validation.values import (
  optional_loss_scale as optional_loss_scale,
)
from weighted_accum._src.validation.values import scale_ok as scale_ok
from weighted_accum._src.validation.values import traced_scalar as traced_scalar
from weighted_accum._src.validation.values import weight as weight
from weighted_accum._src.validation.values import work_dtype as work_dtype
