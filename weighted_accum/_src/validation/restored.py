"""Values restored from a checkpoint or handed to ``from_buffers``: the
counters, each converted to its stored dtype and validated, then checked
against each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import math
from typing import Any

import numpy as np

from weighted_accum._src.core.tree_utils import is_traced
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation.options import count
from weighted_accum._src.validation.values import ScaleSource
from weighted_accum._src.validation.values import host_number
from weighted_accum._src.validation.values import loss_scale
from weighted_accum._src.validation.values import weight

# ---------------------------------------------------------- saved counters --


def _saved_weight_part(what: str, name: str, v: Any, dtype: np.dtype) -> Any:
  """A part of the weight pair: exactly a finite value of its dtype (the
  pair is checked as a whole in :func:`_check_consistent`)."""
  v = host_number(
    v, what=f"{what}: counter {name!r}", noun="a part of the total weight"
  )
  if not math.isfinite(v):
    return v  # reported as the total's fault
  with np.errstate(over="ignore"):
    stored = dtype.type(v)  # inf when beyond the dtype: refused below
  tiny = float(np.finfo(dtype).tiny)
  if not np.isfinite(stored) or float(stored) != v or 0 < abs(v) < tiny:
    raise WeightedAccumulationError(
      f"{what}: counter {name!r} is {v!r}, which is not a finite {dtype} "
      "value outside the subnormal range (the tally stores it as one, and "
      "arithmetic flushes subnormals). The checkpoint is corrupt."
    )
  return stored


def _saved_value(kind: str, what: str, name: str, v: Any, dt: np.dtype) -> Any:
  if kind == "count":
    return count(v, what=what, name=name)
  if kind == "weight":
    return _saved_weight_part(what, name, v, dt)
  if isinstance(v, ScaleSource):  # a DynamicLossScale stands for its scale
    v = v.scale
  v = host_number(v, what=f"{what}: counter {name!r}", noun="a loss scale")
  if math.isnan(v):
    # The library's mark of an unusable window (docs/inputs.md): restored
    # as it was saved; the window is usable again after a valid
    # next_loss_scale at its close.
    return dt.type(math.nan)
  return loss_scale(v, what=f"{what}: counter {name!r}", dtype=dt)


def _check_consistent(out: Mapping[str, Any], what: str) -> None:
  hi, lo = float(out["weight_hi"]), float(out["weight_lo"])
  total = hi + lo
  if not (
    math.isfinite(total) and total >= 0 and hi >= 0 and abs(lo) <= abs(hi)
  ):
    raise WeightedAccumulationError(
      f"{what}: counter 'total_weight' is {total!r}; a window's weight is a "
      "finite non-negative sum of item counts. The checkpoint is corrupt."
    )
  if out["zero_weight"] + out["rejected"] > out["issued"]:
    raise WeightedAccumulationError(
      f"{what}: counters 'zero_weight' ({out['zero_weight']}) + 'rejected' "
      f"({out['rejected']}) exceed 'issued' ({out['issued']}). The "
      "checkpoint is corrupt."
    )
  if out["issued"] == 0 and total != 0:
    raise WeightedAccumulationError(
      f"{what}: counter 'total_weight' is {total!r} but 'issued' is 0. The "
      "checkpoint is corrupt."
    )


def saved_counters(
  counters: Any,
  table: Sequence[tuple[str, Any]],
  dtype_of: Callable[[str], np.dtype],
  *,
  what: str,
) -> dict[str, Any]:
  """Checks saved counters (``state.counters``) and returns the values to
  store, each converted to its stored dtype then validated.

  ``table`` is the counter table (``base.COUNTERS``: name, metadata with
  ``kind`` and ``initial``), ``dtype_of(name)`` each counter's stored dtype.
  ``total_weight`` may stand in for ``weight_hi``/``weight_lo``; a missing
  counter takes its initial value.

  Raises:
    WeightedAccumulationError: naming the first invalid or unknown counter.
  """
  if not isinstance(counters, Mapping):
    raise WeightedAccumulationError(
      f"{what}: expected a mapping of counters (state.counters), got "
      f"{type(counters).__name__}."
    )
  known = {name for name, _ in table} | {"total_weight"}
  unknown = sorted(map(str, set(counters) - known))
  if unknown:
    raise WeightedAccumulationError(
      f"{what}: unknown counter {unknown[0]!r}; expected keys among "
      f"{sorted(known)}."
    )
  for name, value in counters.items():
    if is_traced(value):
      raise WeightedAccumulationError(
        f"{what}: counter {name!r} is a traced value; restored counters are "
        "validated as concrete values, so call this outside jit."
      )
  values = dict(counters)
  if "total_weight" in values:
    if "weight_hi" in values or "weight_lo" in values:
      raise WeightedAccumulationError(
        f"{what}: give either 'total_weight' or 'weight_hi'/'weight_lo', "
        "not both."
      )
    w = weight(
      values.pop("total_weight"),
      what=f"{what}: counter 'total_weight'",
      tally=dtype_of("weight_hi"),
    )
    values.update(weight_hi=w.hi, weight_lo=w.lo)
  out = {
    name: _saved_value(
      c.kind, what, name, values.get(name, c.initial), dtype_of(name)
    )
    for name, c in table
  }
  _check_consistent(out, what)
  return out
