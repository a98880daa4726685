"""Counters restored from a checkpoint or handed to ``from_buffers``: each
converted to its stored dtype and validated, then checked together."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import math
from typing import Any

import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation.values import INT32_MAX
from weighted_accum._src.validation.values import ScaleSource
from weighted_accum._src.validation.values import host_number
from weighted_accum._src.validation.values import is_traced
from weighted_accum._src.validation.values import loss_scale
from weighted_accum._src.validation.values import weight

_CORRUPT = "The checkpoint is corrupt."


def _saved_value(kind: str, where: str, v: Any, dt: np.dtype) -> Any:
  """A count whole, a weight part exact, a scale a loss scale or NaN."""
  is_bool = (
    isinstance(v, (bool, np.bool_)) or getattr(v, "dtype", 0) == np.bool_
  )
  v = host_number(
    v.scale if isinstance(v, ScaleSource) else v, what=where, noun=f"a {kind}"
  )
  if kind == "count":
    if is_bool or not float(v).is_integer() or not 0 <= v <= INT32_MAX:
      raise WeightedAccumulationError(
        f"{where} is {v!r}; expected a whole number in [0, 2**31). {_CORRUPT}"
      )
    return int(v)
  if kind == "scale":
    return dt.type(v) if math.isnan(v) else loss_scale(v, what=where, dtype=dt)
  with np.errstate(over="ignore"):
    stored = dt.type(v)
  tiny = float(np.finfo(dt).tiny)
  if math.isfinite(v) and (float(stored) != v or 0 < abs(v) < tiny):
    raise WeightedAccumulationError(
      f"{where} is {v!r}; expected a normal {dt} value. {_CORRUPT}"
    )
  return stored


def _check_consistent(out: Mapping[str, Any], what: str) -> None:
  hi, lo = float(out["weight_hi"]), float(out["weight_lo"])
  total = hi + lo
  if not (math.isfinite(total) and hi >= 0 and abs(lo) <= abs(hi)):
    raise WeightedAccumulationError(
      f"{what}: counter 'total_weight' is {total!r}, expected a finite "
      f"non-negative sum of item counts. {_CORRUPT}"
    )
  if out["zero_weight"] + out["rejected"] > out["issued"] or (
    out["issued"] == 0 and total != 0
  ):
    shown = {k: out[k] for k in ("issued", "zero_weight", "rejected")}
    raise WeightedAccumulationError(
      f"{what}: counters {shown} and total_weight {total!r} disagree "
      f"('zero_weight' + 'rejected' <= 'issued'). {_CORRUPT}"
    )


def saved_counters(
  counters: Any,
  table: Sequence[tuple[str, Any]],
  dtype_of: Callable[[str], np.dtype],
  *,
  what: str,
) -> dict[str, Any]:
  """The counters to store, checked together; ``total_weight`` may stand
  for the weight pair, a missing counter takes its initial value."""
  known = {name for name, _ in table} | {"total_weight"}
  got = dict(counters) if isinstance(counters, Mapping) else {None: None}
  unknown = sorted(map(str, set(got) - known))
  both = "total_weight" in got and got.keys() & {"weight_hi", "weight_lo"}
  if unknown or both:
    bad = f"unknown counter {unknown[0]!r}" if unknown else "both weights"
    raise WeightedAccumulationError(
      f"{what}: {bad}; expected a mapping like state.counters, keys among "
      f"{sorted(known)} ('total_weight' or 'weight_hi'/'weight_lo')."
    )
  for name, value in got.items():
    if is_traced(value):
      raise WeightedAccumulationError(
        f"{what}: counter {name!r} is traced; counters are checked as "
        "concrete values, so call this outside jit."
      )
  if "total_weight" in got:
    w = weight(
      got.pop("total_weight"),
      what=f"{what}: counter 'total_weight'",
      tally=dtype_of("weight_hi"),
    )
    got.update(weight_hi=w.hi, weight_lo=w.lo)
  out = {
    name: _saved_value(
      c.kind,
      f"{what}: counter {name!r}",
      got.get(name, c.initial),
      dtype_of(name),
    )
    for name, c in table
  }
  _check_consistent(out, what)
  return out
