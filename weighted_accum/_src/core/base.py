"""The state types: ``AccumState`` (a window: buffers and counters) and
``AccumulatedGradients`` (what a finish returns), with the counter table.

Each counter is a literal field of ``AccumState`` whose metadata (a
:class:`Counter`) says its dtype, its value in a fresh window, what a finish
does to it, how it behaves across data-parallel replicas and how a saved
value is checked. ``init``, the reset at a finish, ``init`` with ``axis_name``, the
cross-replica reduction, ``from_buffers`` and the checkpoint format all read
the table (:data:`COUNTERS`), so a new counter is one field. The invariants
are in ``docs/design.md`` ("State").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.core import numerics
from weighted_accum._src.errors import WeightedAccumulationError

# Across replicas (``Counter.replicas``):
SUMMED = "summed"  # per replica; the cross-replica reduction sums it
LOCAL = "local"  # per replica; a diagnostic, never reduced
SHARED = "shared"  # identical on every replica

# What a finish does to a counter (``Counter.at_finish``):
RESET = "reset"  # back to zero
COUNT = "count"  # plus one
NEXT_SCALE = "next_scale"  # the next window's loss scale


class Counter(NamedTuple):
  """One counter of :class:`AccumState` (the metadata of its field).

  Attributes:
    kind: ``"count"`` (int32), ``"weight"`` (a part of the weight pair) or
      ``"scale"`` (the loss scale); the latter two are float32, or float64
      for a float64 work dtype. A saved value is checked by its kind
      (``validation.saved_counters``).
    initial: its value in a fresh window (and for a missing saved value).
    at_finish: ``RESET``, ``COUNT`` or ``NEXT_SCALE``.
    replicas: ``SUMMED``, ``LOCAL`` or ``SHARED``.
  """

  kind: str
  initial: float
  at_finish: str
  replicas: str


#: What a window is (``Placement.kind``):
GLOBAL = "global"  # one window: plain ``jit`` over global (sharded) arrays
REPLICA = "replica"  # this replica's window, inside ``shard_map`` over axes
STACKED = "stacked"  # every replica's window, a leading replica axis
KINDS = (GLOBAL, REPLICA, STACKED)
#: How a per-replica window reduces (``Placement.reduce``):
REDUCE_MODES = ("window", "microbatch")


class Placement(NamedTuple):
  """Where a window lives and how it reduces: static data of the window.

  Set when the window is made (:func:`weighted_accum.init` with or without
  ``axis_name``) and read by every entry point; never inferred from the
  arrays' shapes or types.

  Attributes:
    kind: ``"global"`` (one window over global arrays), ``"replica"``
      (this replica's window inside ``shard_map`` over ``axes``) or
      ``"stacked"`` (every replica's window carried between jitted steps,
      each per-replica field with a leading replica axis over ``axes``).
    axes: the data axes (empty for a global window).
    reduce: for a per-replica window, ``"window"`` (local sums, one
      reduction at the close) or ``"microbatch"`` (every accumulate
      all-reduces; the window holds global sums).
    mesh: a stacked window's ``jax.sharding.Mesh`` (its devices in mesh
      order, axis names, sizes and types), or its ``AbstractMesh`` where
      made under ``jax.jit`` without ``jax.set_mesh``; ``None`` otherwise.
  """

  kind: str = GLOBAL
  axes: tuple[str, ...] = ()
  reduce: str = "window"
  mesh: Any = None

  @property
  def per_replica(self) -> bool:
    """Whether the window holds per-replica sums reduced at its close."""
    return self.kind == STACKED or (
      self.kind == REPLICA and self.reduce == "window"
    )


#: The placement of a window made without ``axis_name``.
GLOBAL_WINDOW = Placement()


def check_scalar(state: Any, what: str) -> None:
  """Refuses counters with a leading axis on a window that is not stacked."""
  lead = np.shape(state.weight_hi)
  if state.placement.kind != STACKED and lead:
    raise WeightedAccumulationError(
      f"{what}(state): a {state.placement.kind} window has scalar counters, "
      f"this one {lead}: read a jax.vmap batch under jax.vmap; restore into "
      "this kind's template."
    )


def _counter(kind: str, initial: float, at_finish: str, replicas: str) -> Any:
  return struct.field(
    metadata={"counter": Counter(kind, initial, at_finish, replicas)}
  )


class AccumState(struct.PyTreeNode):
  """An immutable accumulation window: gradient buffers plus counters.

  A pytree (``flax.struct``), so it passes through ``jax.jit``, donation,
  ``jax.tree.map`` and Orbax. Update it only through this library's functions;
  ``.replace`` returns a modified copy.

  Attributes:
    grads: the pending (still loss-scaled) weighted sums, a tree like the
      params in the work dtype and on the params' shardings.
    issued: int32, microbatches issued in this window, zero-weight and
      rejected ones included.
    zero_weight: int32, microbatches of weight exactly 0 in this window.
    rejected: int32, microbatches refused under ``jit`` (negative, NaN or
      infinite weight) in this window; they changed nothing else.
    windows: int32, windows finished since ``init`` (never reset).
    weight_hi: float32, the window's total weight rounded to float32.
    weight_lo: float32, the rounding error of ``weight_hi`` (exact tally).
    loss_scale: float32, the loss scale of this window.
    dtype: the work dtype (static).
    placement: what the window is and where it lives (static, a
      :class:`Placement`). Set by :func:`~weighted_accum.init`.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(2)})
    >>> state = wa.accumulate_sum(state, {'w': jnp.array([1., 2.])}, 3)
    >>> int(state.issued), state.total_weight
    (1, 3.0)
  """

  grads: Any
  issued: jax.Array = _counter("count", 0, RESET, SUMMED)
  zero_weight: jax.Array = _counter("count", 0, RESET, LOCAL)
  rejected: jax.Array = _counter("count", 0, RESET, LOCAL)
  windows: jax.Array = _counter("count", 0, COUNT, SHARED)
  weight_hi: jax.Array = _counter("weight", 0.0, RESET, SUMMED)
  weight_lo: jax.Array = _counter("weight", 0.0, RESET, SUMMED)
  loss_scale: jax.Array = _counter("scale", 1.0, NEXT_SCALE, SHARED)
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)
  placement: Placement = struct.field(pytree_node=False, default=GLOBAL_WINDOW)

  @property
  def total_weight(self) -> float | jax.Array:
    """The window's total weight.

    A concrete state gives the exact Python number (``weight_hi +
    weight_lo`` in float64: integer totals are exact to 2**48). Under a
    transformation it is the float32 array ``weight_hi + weight_lo``. A
    stacked window's total is over every replica (its per-replica
    weights summed); inside ``shard_map`` a per-replica window gives this
    replica's weight.
    """
    hi, lo = self.weight_hi, self.weight_lo
    check_scalar(self, "total_weight")
    if self.placement.kind == STACKED and np.ndim(hi) == 1:
      if isinstance(hi, jax.core.Tracer):
        return jnp.sum(hi) + jnp.sum(lo)
      parts = np.concatenate([np.asarray(hi), np.asarray(lo)]).astype(
        np.float64
      )
      return float(math.fsum(parts.tolist()))
    return numerics.join(hi, lo)

  @property
  def counters(self) -> dict[str, jax.Array]:
    """The counter leaves by name, as saved in checkpoints and taken by
    :func:`~weighted_accum.from_buffers`."""
    return of(self)


class AccumulatedGradients(struct.PyTreeNode):
  """What ``finish_sums`` / ``finish_mean`` (and the closes) return.

  Attributes:
    grads: for ``finish_sums`` the still-scaled sums; for ``finish_mean`` the
      sums divided by the loss scale then by the total weight. Work dtype.
      ``None`` where the mean went straight to an optimizer
      (``apply_window``).
    weight: float32, the window's total weight (global after a
      cross-replica reduction).
    loss_scale: float32, the window's loss scale.
    issued: int32, microbatches issued in the window.
    finite: bool, every pending value was finite (one NaN-safe reduction
      per window, identical on every replica and shard). A dynamic loss
      scaler skips the window when it is false.
    valid: bool, the result may be applied: ``finite``, a usable loss scale
      and, for a mean, a positive total weight and a mean that fits the
      work dtype.
    kind: what ``grads`` is (static, required: no default): ``"mean"``
      (applied by ``apply_window``) or ``"sums"`` (``finish_sums``: still
      loss-scaled, reduced by ``distributed.reduce_sums``).
  """

  grads: Any
  weight: jax.Array
  loss_scale: jax.Array
  issued: jax.Array
  finite: jax.Array
  valid: jax.Array
  kind: str = struct.field(pytree_node=False, default=None)

  def __post_init__(self):
    if self.kind not in ("mean", "sums"):
      raise WeightedAccumulationError(
        f"AccumulatedGradients(kind={self.kind!r}): say what grads is, "
        "kind='mean' or kind='sums' (still loss-scaled)."
      )


#: The counters, in ``AccumState`` field order (also the checkpoint's keys).
COUNTERS: tuple[tuple[str, Counter], ...] = tuple(
  (f.name, f.metadata["counter"])
  for f in dataclasses.fields(AccumState)
  if "counter" in f.metadata
)
NAMES: tuple[str, ...] = tuple(name for name, _ in COUNTERS)
BY_NAME: dict[str, Counter] = dict(COUNTERS)
_I32 = np.dtype(np.int32)


def dtype_of(name: str, work_dtype: Any) -> np.dtype:
  """The stored dtype of counter ``name`` in a state of ``work_dtype``."""
  if BY_NAME[name].kind == "count":
    return _I32
  return numerics.tally_dtype(work_dtype)


def initial(*, work_dtype: Any = np.float32, **values: Any) -> dict[str, Any]:
  """Every counter as a scalar array: ``values`` where given, else its
  initial value, in its stored dtype (:func:`dtype_of`)."""
  unknown = set(values) - set(NAMES)
  if unknown:
    raise TypeError(f"unknown counters {sorted(unknown)}")
  return {
    name: jnp.asarray(values.get(name, c.initial), dtype_of(name, work_dtype))
    for name, c in COUNTERS
  }


def of(state: Any) -> dict[str, Any]:
  """``state``'s counters by name."""
  return {name: getattr(state, name) for name in NAMES}


def named(replicas: str) -> tuple[str, ...]:
  """The names of the counters with the given ``replicas`` behaviour."""
  return tuple(name for name, c in COUNTERS if c.replicas == replicas)


#: The counters that are per replica in a per-replica window (summed by the
#: close, or local diagnostics): stacked on a leading replica axis.
PER_REPLICA = named(SUMMED) + named(LOCAL)


def at_finish(state: AccumState, next_loss_scale: Any) -> dict[str, Any]:
  """The next window's counters after ``state``'s window is finished."""
  out = {}
  for name, c in COUNTERS:
    value = getattr(state, name)
    if c.at_finish == RESET:
      out[name] = jnp.zeros_like(value)
    elif c.at_finish == COUNT:
      out[name] = value + jnp.ones((), value.dtype)
    else:
      out[name] = next_loss_scale
  return out
