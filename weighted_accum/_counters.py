"""The one table of an accumulator's counters, and what reads it.

Every counter is declared once in :data:`COUNTERS`: its name, dtype, value at
``init``, what a finish does to it, how it behaves across data-parallel
replicas, and how a saved value is validated. ``AccumState``'s fields,
``init``, the reset at finish, ``distributed.init``, the cross-replica
reduction, ``from_buffers`` and the checkpoint format all read it, so a new
counter is one row. See ``docs/design.md`` ("Counters").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum import _inputs
from weighted_accum import _tree
from weighted_accum.errors import WeightedAccumulationError

# What a finish does to a counter: (current value, next loss scale) -> value.
Finish = Callable[[jax.Array, jax.Array], jax.Array]
# How a saved value is checked: (what, name, value, stored dtype) -> the value
# to store.
Check = Callable[[str, str, Any, np.dtype], Any]

# Across replicas (``Counter.replicas``):
SUMMED = "summed"  # per replica; the cross-replica reduction sums it
LOCAL = "local"  # per replica; a diagnostic, never reduced
SHARED = "shared"  # identical on every replica


def _dtype(c: Counter, work_dtype: Any) -> np.dtype:
  """A counter's dtype for a work dtype: int32 counts; the weight pair and
  the loss scale float32, or float64 for a float64 work dtype (so float64
  weights stay float64)."""
  if c.dtype == _I32:
    return c.dtype
  return _inputs.tally_dtype(work_dtype)


class Counter(NamedTuple):
  """One counter of :class:`~weighted_accum.AccumState`.

  Attributes:
    name: the ``AccumState`` field (and checkpoint key).
    dtype: its dtype (int32 or float32 scalars).
    initial: its value in a fresh window (and a missing saved value).
    at_finish: its value in the next window, from its current value and the
      next window's loss scale.
    replicas: ``SUMMED``, ``LOCAL`` or ``SHARED`` (see above).
    check: validates and normalises a concrete saved value.
  """

  name: str
  dtype: Any
  initial: float
  at_finish: Finish
  replicas: str
  check: Check


def _zero(value: jax.Array, next_loss_scale: jax.Array) -> jax.Array:
  del next_loss_scale
  return jnp.zeros_like(value)


def _plus_one(value: jax.Array, next_loss_scale: jax.Array) -> jax.Array:
  del next_loss_scale
  return value + jnp.ones((), value.dtype)


def _next_scale(value: jax.Array, next_loss_scale: jax.Array) -> jax.Array:
  del value
  return next_loss_scale


# The checks convert a saved value to the dtype it will be stored in, then
# validate that (``_inputs``: one path per kind of input).
def _count(what: str, name: str, v: Any, dtype: np.dtype) -> int:
  del dtype  # int32
  return _inputs.count(v, what=what, name=name)


def _real(what: str, name: str, v: Any, dtype: np.dtype) -> Any:
  """A part of the weight pair: exactly a finite value of its dtype (the
  pair is checked as a whole in :func:`_check_consistent`)."""
  v = _inputs.host_number(
    v,
    what=f"{what}: counter {name!r}",
    noun="a part of the window's total weight",
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


def _positive(what: str, name: str, v: Any, dtype: np.dtype) -> Any:
  return _inputs.loss_scale(v, what=f"{what}: counter {name!r}", dtype=dtype)


_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)

#: The counters, in ``AccumState`` field order (also the checkpoint's keys).
COUNTERS: tuple[Counter, ...] = (
  #       name           dtype initial at_finish    replicas check
  Counter("issued", _I32, 0, _zero, SUMMED, _count),
  Counter("zero_weight", _I32, 0, _zero, LOCAL, _count),
  Counter("rejected", _I32, 0, _zero, LOCAL, _count),
  Counter("windows", _I32, 0, _plus_one, SHARED, _count),
  Counter("weight_hi", _F32, 0.0, _zero, SUMMED, _real),
  Counter("weight_lo", _F32, 0.0, _zero, SUMMED, _real),
  Counter("loss_scale", _F32, 1.0, _next_scale, SHARED, _positive),
)
NAMES: tuple[str, ...] = tuple(c.name for c in COUNTERS)
BY_NAME: dict[str, Counter] = {c.name: c for c in COUNTERS}
#: ``from_buffers`` also accepts the exact total in place of the pair.
TOTAL_WEIGHT = "total_weight"


def field_annotations() -> dict[str, str]:
  """``AccumState``'s counter fields, in table order."""
  return {c.name: "jax.Array" for c in COUNTERS}


def initial(
  *, work_dtype: Any = np.float32, **values: Any
) -> dict[str, jax.Array]:
  """Every counter as a scalar array: ``values`` where given, else initial
  (float counters in the work dtype's tally dtype, see :func:`dtype_of`)."""
  unknown = set(values) - set(NAMES)
  if unknown:
    raise TypeError(f"unknown counters {sorted(unknown)}")
  return {
    c.name: jnp.asarray(values.get(c.name, c.initial), _dtype(c, work_dtype))
    for c in COUNTERS
  }


def dtype_of(name: str, work_dtype: Any) -> np.dtype:
  """The stored dtype of counter ``name`` in a state of ``work_dtype``."""
  return _dtype(BY_NAME[name], work_dtype)


def at_finish(state: Any, next_loss_scale: jax.Array) -> dict[str, jax.Array]:
  """The next window's counters after ``state``'s window is finished."""
  return {
    c.name: c.at_finish(getattr(state, c.name), next_loss_scale)
    for c in COUNTERS
  }


def of(state: Any) -> dict[str, jax.Array]:
  """``state``'s counters by name."""
  return {c.name: getattr(state, c.name) for c in COUNTERS}


def named(replicas: str) -> tuple[str, ...]:
  """The names of the counters with the given ``replicas`` behaviour."""
  return tuple(c.name for c in COUNTERS if c.replicas == replicas)


def host(state: Any, *, what: str) -> dict[str, np.ndarray]:
  """The counters as NumPy scalars of their table dtype (for saving)."""
  out = {}
  for c in COUNTERS:
    value = getattr(state, c.name)
    if _tree.is_traced(value):
      raise WeightedAccumulationError(
        f"{what}: counter {c.name!r} is a traced value; save concrete "
        "state outside jit."
      )
    out[c.name] = np.array(value, _dtype(c, state.dtype))
  return out


def _concrete(
  counters: Mapping[str, Any], name: str, default: Any, what: str
) -> Any:
  value = counters.get(name, default)
  if _tree.is_traced(value):
    raise WeightedAccumulationError(
      f"{what}: counter {name!r} is a traced value; from_buffers validates "
      "concrete restored values, so call it outside jit."
    )
  return value


def _weight_pair(
  counters: Mapping[str, Any],
  values: dict[str, Any],
  what: str,
  tally: np.dtype,
) -> None:
  """Fills ``weight_hi``/``weight_lo`` from ``total_weight`` if given."""
  if TOTAL_WEIGHT not in counters:
    return
  if "weight_hi" in counters or "weight_lo" in counters:
    raise WeightedAccumulationError(
      f"{what}: give either 'total_weight' or 'weight_hi'/'weight_lo', "
      "not both."
    )
  w = _inputs.weight(
    _concrete(counters, TOTAL_WEIGHT, 0, what),
    what=f"{what}: counter 'total_weight'",
    tally=tally,
  )
  values.update(weight_hi=w.hi, weight_lo=w.lo)


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


def validate(
  counters: Mapping[str, Any],
  *,
  what: str = "from_buffers(counters)",
  work_dtype: Any = np.float32,
) -> dict[str, Any]:
  """Checks saved counters and returns the values to store.

  Accepts the table's names; ``total_weight`` may stand in for
  ``weight_hi``/``weight_lo``. A missing counter takes its initial value.
  Each value is converted to its stored dtype (:func:`dtype_of`) and
  validated after the conversion (``docs/inputs.md``).

  Raises:
    WeightedAccumulationError: naming the first invalid or unknown counter.
  """
  if not isinstance(counters, Mapping):
    raise WeightedAccumulationError(
      f"{what}: expected a mapping of counters (state.counters), got "
      f"{type(counters).__name__}."
    )
  known = set(NAMES) | {TOTAL_WEIGHT}
  unknown = sorted(map(str, set(counters) - known))
  if unknown:
    raise WeightedAccumulationError(
      f"{what}: unknown counter {unknown[0]!r}; expected keys among "
      f"{sorted(known)}."
    )
  values = {
    c.name: _concrete(counters, c.name, c.initial, what)
    for c in COUNTERS
    if c.name in counters
  }
  _weight_pair(counters, values, what, _inputs.tally_dtype(work_dtype))
  out = {
    c.name: c.check(
      what, c.name, values.get(c.name, c.initial), _dtype(c, work_dtype)
    )
    for c in COUNTERS
  }
  _check_consistent(out, what)
  return out
