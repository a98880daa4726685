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

from weighted_accum import _tree
from weighted_accum import _tally
from weighted_accum.errors import WeightedAccumulationError

# What a finish does to a counter: (current value, next loss scale) -> value.
Finish = Callable[[jax.Array, jax.Array], jax.Array]
# How a saved value is checked: (what, name, Python number) -> Python number.
Check = Callable[[str, str, Any], Any]

# Across replicas (``Counter.replicas``):
SUMMED = "summed"  # per replica; the cross-replica reduction sums it
LOCAL = "local"    # per replica; a diagnostic, never reduced
SHARED = "shared"  # identical on every replica


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


def _count(what: str, name: str, v: Any) -> int:
  if isinstance(v, float):
    if not (math.isfinite(v) and v == int(v)):
      raise WeightedAccumulationError(
          f"{what}: counter {name!r} is {v!r}, not a whole number.")
    v = int(v)
  if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= 2**31:
    raise WeightedAccumulationError(
        f"{what}: counter {name!r} is {v!r}; it must be a whole number in "
        "[0, 2**31). The checkpoint is corrupt or not an accumulator's.")
  return v


def _real(what: str, name: str, v: Any) -> float:
  del what, name  # the pair is checked as a whole, see validate
  return float(v)


def _positive(what: str, name: str, v: Any) -> float:
  v = float(v)
  if not (math.isfinite(v) and v > 0):
    raise WeightedAccumulationError(
        f"{what}: counter {name!r} is {v!r}; it must be finite and "
        "positive. The checkpoint is corrupt.")
  return v


_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)

#: The counters, in ``AccumState`` field order (also the checkpoint's keys).
COUNTERS: tuple[Counter, ...] = (
    #       name           dtype initial at_finish    replicas check
    Counter("issued",      _I32, 0,      _zero,       SUMMED,  _count),
    Counter("zero_weight", _I32, 0,      _zero,       LOCAL,   _count),
    Counter("rejected",    _I32, 0,      _zero,       LOCAL,   _count),
    Counter("windows",     _I32, 0,      _plus_one,   SHARED,  _count),
    Counter("weight_hi",   _F32, 0.0,    _zero,       SUMMED,  _real),
    Counter("weight_lo",   _F32, 0.0,    _zero,       SUMMED,  _real),
    Counter("loss_scale",  _F32, 1.0,    _next_scale, SHARED,  _positive),
)
NAMES: tuple[str, ...] = tuple(c.name for c in COUNTERS)
BY_NAME: dict[str, Counter] = {c.name: c for c in COUNTERS}
#: ``from_buffers`` also accepts the exact total in place of the pair.
TOTAL_WEIGHT = "total_weight"


def field_annotations() -> dict[str, str]:
  """``AccumState``'s counter fields, in table order."""
  return {c.name: "jax.Array" for c in COUNTERS}


def initial(**values: Any) -> dict[str, jax.Array]:
  """Every counter as a scalar array: ``values`` where given, else initial."""
  unknown = set(values) - set(NAMES)
  if unknown:
    raise TypeError(f"unknown counters {sorted(unknown)}")
  return {c.name: jnp.asarray(values.get(c.name, c.initial), c.dtype)
          for c in COUNTERS}


def at_finish(state: Any, next_loss_scale: jax.Array) -> dict[str, jax.Array]:
  """The next window's counters after ``state``'s window is finished."""
  return {c.name: c.at_finish(getattr(state, c.name), next_loss_scale)
          for c in COUNTERS}


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
          "state outside jit.")
    out[c.name] = np.array(value, c.dtype)
  return out


def _concrete(counters: Mapping[str, Any], name: str, default: Any,
              what: str) -> Any:
  value = counters.get(name, default)
  if np.ndim(value) != 0:
    raise WeightedAccumulationError(
        f"{what}: counter {name!r} has shape {np.shape(value)}, expected a "
        "scalar. Pass the values of state.counters.")
  if _tree.is_traced(value):
    raise WeightedAccumulationError(
        f"{what}: counter {name!r} is a traced value; from_buffers validates "
        "concrete restored values, so call it outside jit.")
  return np.asarray(value).item()


def _weight_pair(counters: Mapping[str, Any], values: dict[str, Any],
                 what: str) -> None:
  """Fills ``weight_hi``/``weight_lo`` from ``total_weight`` if given."""
  if TOTAL_WEIGHT not in counters:
    return
  if "weight_hi" in counters or "weight_lo" in counters:
    raise WeightedAccumulationError(
        f"{what}: give either 'total_weight' or 'weight_hi'/'weight_lo', "
        "not both.")
  tw = float(_concrete(counters, TOTAL_WEIGHT, 0.0, what))
  hi, lo = _tally.split(tw) if math.isfinite(tw) else (tw, 0.0)
  values.update(weight_hi=float(hi), weight_lo=float(lo))


def _check_consistent(out: Mapping[str, Any], what: str) -> None:
  total = out["weight_hi"] + out["weight_lo"]
  if not (math.isfinite(total) and total >= 0):
    raise WeightedAccumulationError(
        f"{what}: counter 'total_weight' is {total!r}; a window's weight is a "
        "finite non-negative sum of item counts. The checkpoint is corrupt.")
  if out["zero_weight"] + out["rejected"] > out["issued"]:
    raise WeightedAccumulationError(
        f"{what}: counters 'zero_weight' ({out['zero_weight']}) + 'rejected' "
        f"({out['rejected']}) exceed 'issued' ({out['issued']}). The "
        "checkpoint is corrupt.")
  if out["issued"] == 0 and total != 0:
    raise WeightedAccumulationError(
        f"{what}: counter 'total_weight' is {total!r} but 'issued' is 0. The "
        "checkpoint is corrupt.")


def validate(counters: Mapping[str, Any], *,
             what: str = "from_buffers(counters)") -> dict[str, Any]:
  """Checks saved counters and returns them as Python numbers.

  Accepts the table's names; ``total_weight`` may stand in for
  ``weight_hi``/``weight_lo``. A missing counter takes its initial value.

  Raises:
    WeightedAccumulationError: naming the first invalid or unknown counter.
  """
  known = set(NAMES) | {TOTAL_WEIGHT}
  unknown = sorted(set(counters) - known)
  if unknown:
    raise WeightedAccumulationError(
        f"{what}: unknown counter {unknown[0]!r}; expected keys among "
        f"{sorted(known)}.")
  values = {c.name: _concrete(counters, c.name, c.initial, what)
            for c in COUNTERS if c.name in counters}
  _weight_pair(counters, values, what)
  out = {c.name: c.check(what, c.name, values.get(c.name, c.initial))
         for c in COUNTERS}
  _check_consistent(out, what)
  return out
