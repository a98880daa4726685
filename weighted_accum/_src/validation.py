"""Every check of a value a caller hands in: one function per kind of input,
each returning the value to store.

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

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src import numerics
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.tree_utils import is_traced

#: Largest count a counter (int32) holds.
INT32_MAX = 2**31 - 1
#: Integer weights are exact in the float32 (hi, lo) tally below this.
EXACT_INT_LIMIT = 2**48
#: What ``mode`` may be: the kind of loss each microbatch's grads are of.
MODES = ("mean", "sum")


class ScaleSource:
  """Base of objects that carry a loss scale in their ``scale`` attribute
  (:class:`~weighted_accum.DynamicLossScale`): wherever a loss scale is
  accepted, such an object stands for its current ``scale``."""

  __slots__ = ()
  scale: Any


# ----------------------------------------------------------- host scalars --


def host_number(x: Any, *, what: str, noun: str) -> int | float:
  """A concrete real scalar as an exact Python ``int`` or ``float``.

  Integers (Python, NumPy of any width, bool) stay exact Python ints, so
  nothing wraps; floats of every width become Python floats (exact).

  Raises:
    WeightedAccumulationError: for ``None``, strings, complex numbers,
      non-numeric objects and arrays that are not 0-d.
  """
  if isinstance(x, bool):
    return int(x)
  if isinstance(x, (int, float)):
    return x
  if x is None or isinstance(x, (str, bytes)):
    raise WeightedAccumulationError(
      f"{what}: got {x!r} ({type(x).__name__}); expected a real number, {noun}."
    )
  try:
    a = np.asarray(x)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise WeightedAccumulationError(
      f"{what}: cannot read {type(x).__name__} {x!r} as a number; expected "
      f"a real scalar, {noun}."
    ) from e
  if a.ndim != 0:
    raise WeightedAccumulationError(
      f"{what} has shape {a.shape}, expected a scalar. Pass one number, "
      f"{noun} (e.g. x.item() or x.reshape(()) of a 1-element array)."
    )
  if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
    return int(a.item())
  if jnp.issubdtype(a.dtype, jnp.floating):
    return float(a.astype(np.float64))
  raise WeightedAccumulationError(
    f"{what}: dtype {a.dtype} is not a real number; expected {noun}."
  )


def traced_scalar(x: Any, what: str, noun: str) -> np.dtype:
  """Checks a traced value is a real 0-d scalar; returns its dtype."""
  if x.ndim != 0:
    raise WeightedAccumulationError(
      f"{what} has shape {x.shape}, expected a scalar. Pass one number, "
      f"{noun} (e.g. x.reshape(()) of a 1-element array)."
    )
  dt = np.dtype(x.dtype)
  if not (
    dt == np.bool_
    or jnp.issubdtype(dt, jnp.integer)
    or jnp.issubdtype(dt, jnp.floating)
  ):
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} is not a real number; expected {noun}."
    )
  return dt


# ----------------------------------------------------------------- dtypes --


def work_dtype(dtype: Any, *, what: str) -> np.dtype:
  """The canonical floating work dtype, or a named error.

  Refuses what is not a dtype (any exception of ``jnp.dtype``: strings from a
  corrupt file, objects), non-floating dtypes, 8-bit floats (too narrow to
  hold a sum and, for most, without an infinity), and float64 while
  ``jax_enable_x64`` is off (JAX would silently use float32).
  """
  try:
    dt = jnp.dtype(dtype)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise WeightedAccumulationError(
      f"{what}: {dtype!r} is not a dtype. Pass a floating dtype such as "
      "jnp.float32, jnp.bfloat16 or jnp.float16."
    ) from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} is not floating point; gradient sums need a "
      "floating work dtype. Pass jnp.float32 (recommended), jnp.bfloat16 or "
      "jnp.float16."
    )
  if dt.itemsize < 2:
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} is too narrow to accumulate gradient sums. Pass "
      "jnp.float32 (recommended), jnp.bfloat16 or jnp.float16."
    )
  if dt.itemsize == 8 and not jax.config.jax_enable_x64:
    raise WeightedAccumulationError(
      f"{what}: dtype {dt} needs jax_enable_x64, which is off, so JAX would "
      "silently use float32. Enable it with "
      "jax.config.update('jax_enable_x64', True) or pass jnp.float32."
    )
  return dt


# ----------------------------------------------------------------- weight --


class Weight(NamedTuple):
  """A converted weight: ``hi + lo`` is the value, both in the tally dtype,
  ``lo`` a rounding residual (0 unless the value needs more bits than one
  number of the tally dtype); ``ok`` says it is a valid weight. Invalid
  (traced) weights have ``hi == lo == 0``."""

  hi: Any
  lo: Any
  ok: Any


WEIGHT_NOUN = "the microbatch's effective item count (tokens, samples)"


def weight(x: Any, *, what: str, tally: Any = np.float32) -> Weight:
  """Converts a weight to the tally dtype, refusing what cannot be stored.

  Concrete: raises for anything but a finite, non-negative real scalar whose
  value the tally holds (no overflow, no flush to zero, integers exact), and
  returns host NumPy scalars. Traced: the same rules decide ``ok``; the
  shape and dtype are checked.
  """
  tally = np.dtype(tally)
  if isinstance(x, Weight):
    return x  # already converted by this function
  if is_traced(x):
    return _traced_weight(x, what, tally)
  v = host_number(x, what=what, noun=WEIGHT_NOUN)
  return _host_weight(v, what, tally)


def _host_weight(v: int | float, what: str, tally: np.dtype) -> Weight:
  fi = np.finfo(tally)
  if not (math.isfinite(v) and v >= 0):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is not a finite non-negative number. The weight is "
      f"{WEIGHT_NOUN}; use 0 for a fully masked microbatch. The state was "
      "left unchanged."
    )
  if v > float(fi.max) or (isinstance(v, int) and v >= EXACT_INT_LIMIT):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is beyond what the accumulator's {tally} weight tally "
      f"holds (at most {float(fi.max):.4g}, integers exactly below 2**48). "
      "The weight is an item count: pass the microbatch's count, or scale "
      "all weights down by a common factor."
    )
  if 0 < v < float(fi.tiny):
    raise WeightedAccumulationError(
      f"{what}: {v!r} is below the smallest normal {tally} "
      f"({float(fi.tiny):.4g}); the tally would flush it to zero while its "
      "gradients were added. Pass 0 to skip the microbatch, or scale all "
      "weights up by a common factor."
    )
  hi = tally.type(v)
  lo = tally.type(v - (int(hi) if isinstance(v, int) else float(hi)))
  if abs(float(lo)) < float(fi.tiny):
    lo = tally.type(0)
  return Weight(hi, lo, np.bool_(True))


def _traced_weight(x: jax.Array, what: str, tally: np.dtype) -> Weight:
  dt = traced_scalar(x, what, WEIGHT_NOUN)
  if dt == np.bool_ or jnp.issubdtype(dt, jnp.integer):
    hi, lo, ok = _traced_int_weight(x, dt, tally)
  else:
    fi = jnp.finfo(tally)
    hi = x.astype(tally)
    if dt.itemsize > tally.itemsize:
      lo = (x - hi.astype(dt)).astype(tally)
    else:
      lo = jnp.zeros((), tally)
    ok = (
      jnp.isfinite(hi)
      & (hi >= 0)
      & (hi <= fi.max)
      & numerics.is_normal_or_zero(hi)
    )
    lo = jnp.where(numerics.is_normal_or_zero(lo) & jnp.isfinite(lo), lo, 0)
  zero = jnp.zeros((), tally)
  return Weight(jnp.where(ok, hi, zero), jnp.where(ok, lo, zero), ok)


def _traced_int_weight(x: jax.Array, dt: np.dtype, tally: np.dtype):
  xi = x.astype(jnp.int32) if dt.itemsize < 4 or dt == np.bool_ else x
  ok = (xi >= 0) if jnp.issubdtype(xi.dtype, jnp.signedinteger) else True
  ok = jnp.asarray(ok)
  if xi.dtype.itemsize == 8:
    ok = ok & (xi < EXACT_INT_LIMIT)
  # Two parts exactly representable in float32 (< 2**24 significant bits).
  top = (xi >> 24).astype(tally) * np.asarray(2.0**24, tally)
  bottom = (xi & 0xFFFFFF).astype(tally)
  hi = top + bottom
  return hi, bottom - (hi - top), ok


# ------------------------------------------------------------- loss scale --

SCALE_NOUN = (
  "the factor every loss of the window is multiplied by (e.g. "
  "1.0, or 2.0**15 for float16 training)"
)


def loss_scale(x: Any, *, what: str, dtype: Any = np.float32) -> Any:
  """Converts a loss scale (or a :class:`ScaleSource`'s ``scale``) to its
  stored dtype (float32, or float64 for a float64 work dtype), refusing
  what cannot be stored.

  Concrete: raises unless the stored value is a finite, positive, normal
  number; returns a host NumPy scalar. Traced: an invalid value comes back
  as NaN, which marks the window as unusable (see ``docs/inputs.md``): its
  microbatches are rejected and its finish reports ``valid=False``; nothing
  is ever divided by it.
  """
  dtype = np.dtype(dtype)
  if isinstance(x, ScaleSource):
    x = x.scale
  if is_traced(x):
    traced_scalar(x, what, SCALE_NOUN)
    v = x.astype(dtype)
    return jnp.where(scale_ok(v), v, jnp.asarray(np.nan, dtype))
  v = host_number(x, what=what, noun=SCALE_NOUN)
  fi = np.finfo(dtype)
  stored = math.nan
  if math.isfinite(v) and v > 0:
    stored = math.inf if v > float(fi.max) else float(dtype.type(v))
  if not (math.isfinite(stored) and stored >= float(fi.tiny)):
    raise WeightedAccumulationError(
      f"{what} is {v!r}, not a finite positive {dtype} number (stored as "
      f"{dtype}, the scale must lie in [{float(fi.tiny):.4g}, "
      f"{float(fi.max):.4g}]). It is {SCALE_NOUN}, divided out once at "
      "finish."
    )
  return dtype.type(v)


def optional_loss_scale(x: Any, *, what: str, dtype: Any = np.float32) -> Any:
  """:func:`loss_scale`, or ``None`` (keep the current scale) for ``None``."""
  return None if x is None else loss_scale(x, what=what, dtype=dtype)


def scale_ok(ls: jax.Array) -> jax.Array:
  """A stored loss scale is usable: finite, positive and normal."""
  ls = jnp.asarray(ls)
  return jnp.isfinite(ls) & (ls > 0) & numerics.is_normal_or_zero(ls)


# --------------------------------------------------------------- counts --


def count(x: Any, *, what: str, name: str) -> int:
  """A concrete counter (int32 in the state) as a Python int in
  ``[0, 2**31)``; whole floats are accepted, booleans are not."""
  if isinstance(x, (bool, np.bool_)) or (
    hasattr(x, "dtype") and np.dtype(x.dtype) == np.bool_
  ):
    raise WeightedAccumulationError(
      f"{what}: counter {name!r} is a bool ({x!r}); it must be a whole "
      "number. Pass the values of state.counters."
    )
  v = host_number(
    x, what=f"{what}: counter {name!r}", noun="a whole number of microbatches"
  )
  if isinstance(v, float):
    if not (math.isfinite(v) and v == int(v)):
      raise WeightedAccumulationError(
        f"{what}: counter {name!r} is {v!r}, not a whole number."
      )
    v = int(v)
  if not 0 <= v <= INT32_MAX:
    raise WeightedAccumulationError(
      f"{what}: counter {name!r} is {v!r}; it must be a whole number in "
      "[0, 2**31). The checkpoint is corrupt or not an accumulator's."
    )
  return v


def static_int(
  x: Any, *, what: str, low: int = 1, high: int = INT32_MAX, hint: str = ""
) -> int:
  """A static Python or NumPy int in ``[low, high]`` (not bool, not float,
  not traced)."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
    raise WeightedAccumulationError(
      f"{what}: {x!r} ({type(x).__name__}) is not an int. Pass a Python "
      f"int in [{low}, {high}]. {hint}".rstrip()
    )
  v = operator.index(x)
  if not low <= v <= high:
    raise WeightedAccumulationError(
      f"{what}: {v} is outside [{low}, {high}]. {hint}".rstrip()
    )
  return v


def every_k(x: Any, *, what: str) -> int | Callable[..., Any] | None:
  """A window length: an int in [1, 2**31), a callable of the gradient step
  (optax's ``every_k_schedule``), or ``None``."""
  if x is None or (
    callable(x) and not isinstance(x, (np.generic, np.ndarray, jax.Array))
  ):
    return x
  return static_int(
    x,
    what=what,
    hint="It is the number of microbatches per window (a Python int), a "
    "function of the gradient step returning it (as optax.MultiSteps' "
    "every_k_schedule), or None to close windows only with "
    "update(..., finish=True).",
  )


def num_real(x: Any, k: int, *, what: str) -> jax.Array | None:
  """``num_real_microbatches`` as an int32 in ``[0, k]`` (a traced value out
  of range is clipped: it cannot raise under ``jit``)."""
  if x is None:
    return None
  if not is_traced(x):
    v = np.asarray(x)
    if (
      v.ndim
      or v.dtype == np.bool_
      or not np.issubdtype(v.dtype, np.integer)
      or not 0 <= v <= k
    ):
      raise WeightedAccumulationError(
        f"{what}: num_real_microbatches={x!r} must be an integer scalar in "
        f"[0, {k}] (num_microbatches)."
      )
  elif not jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.ndim(x):
    raise WeightedAccumulationError(
      f"{what}: num_real_microbatches must be an integer scalar, got "
      f"{jax.typeof(x)}."
    )
  return jnp.clip(jnp.asarray(x, jnp.int32), 0, k)


def argnums(x: Any, *, what: str, name: str) -> tuple[int, ...]:
  """A positional-argument index or a non-empty tuple of distinct ones."""
  nums = (x,) if isinstance(x, (int, np.integer)) else x
  try:
    nums = tuple(nums)
  except TypeError:
    nums = ()
  if not nums or not all(
    isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0
    for n in nums
  ):
    raise WeightedAccumulationError(
      f"{what}({name}={x!r}): expected a non-negative int or a non-empty "
      "tuple of them (positional argument indices)."
    )
  if len(set(nums)) != len(nums):
    raise WeightedAccumulationError(f"{what}({name}={x!r}): repeated index.")
  return tuple(int(n) for n in nums)


# ---------------------------------------------------------- flags, names --


def static_flag(x: Any, *, what: str) -> bool:
  """A Python-level bool option (``checked=``): bool or a concrete bool
  scalar; never a traced value or another type."""
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if (
    isinstance(x, jax.Array)
    and not is_traced(x)
    and x.ndim == 0
    and x.dtype == jnp.bool_
  ):
    return bool(x)
  raise WeightedAccumulationError(
    f"{what}: expected True or False, got {x!r} ({type(x).__name__}). "
    "This option is static: pass a Python bool."
  )


def traced_flag(x: Any, *, what: str) -> jax.Array:
  """A bool scalar that may be traced (``finish=``); ``None`` is False."""
  if x is None:
    return jnp.bool_(False)
  if isinstance(x, (bool, np.bool_)):
    return jnp.bool_(bool(x))
  is_array = isinstance(x, (jax.Array, np.ndarray))
  if not is_array or x.ndim != 0 or x.dtype != np.bool_:
    kind = (
      f"{x.dtype} of shape {x.shape}"
      if is_array
      else f"{x!r} ({type(x).__name__})"
    )
    raise WeightedAccumulationError(
      f"{what}: expected a bool scalar, got {kind}. Pass True, False, None "
      "or a (possibly traced) bool scalar array."
    )
  return x if is_traced(x) else jnp.asarray(np.asarray(x))


def mode(x: Any, *, what: str) -> str:
  """The kind of loss the grads are of: ``"mean"`` or ``"sum"``."""
  if not isinstance(x, str) or x not in MODES:
    raise WeightedAccumulationError(
      f"{what}: mode={x!r} is not one of {MODES}. Pass mode='mean' when "
      "the loss of each microbatch is its SUM divided by its weight (a "
      "mean over its items), mode='sum' when it is the SUM itself. There "
      "is no default: the wrong one weights every microbatch wrongly."
    )
  return x


def axis_names(
  x: Any, *, what: str, name: str = "axis_name"
) -> tuple[str, ...]:
  """A mesh axis name or a sequence of distinct ones, as a tuple."""
  if isinstance(x, str):
    names: tuple[Any, ...] = (x,)
  elif isinstance(x, Sequence):
    names = tuple(x)
  else:
    names = ()
  if (
    not names
    or not all(isinstance(a, str) and a for a in names)
    or len(set(names)) != len(names)
  ):
    raise WeightedAccumulationError(
      f"{what}: {name}={x!r} is not a mesh axis name; pass the "
      "data-parallel axis, e.g. 'data', or a tuple of distinct names such "
      "as ('data', 'fsdp')."
    )
  return names


def optional_axis_names(
  x: Any, *, what: str, name: str = "axis_name"
) -> tuple[str, ...] | None:
  """:func:`axis_names`, or ``None`` for ``None``."""
  return None if x is None else axis_names(x, what=what, name=name)


def partition_specs(x: Any, *, what: str) -> Any:
  """``None``, or a pytree of ``PartitionSpec`` (or ``None``) leaves."""
  is_spec = lambda v: v is None or isinstance(v, jax.sharding.PartitionSpec)
  bad = [v for v in jax.tree.leaves(x, is_leaf=is_spec) if not is_spec(v)]
  if bad:
    raise WeightedAccumulationError(
      f"{what}: {bad[0]!r} is not a PartitionSpec; pass a tree like the "
      "params of jax.sharding.PartitionSpec (None: replicated)."
    )
  return x


def bound_axes(x: Any, *, what: str) -> tuple[str, ...]:
  """:func:`axis_names`, each checked to be bound by an enclosing
  ``shard_map``."""
  axes = axis_names(x, what=what)
  for a in axes:
    try:
      jax.lax.axis_size(a)
    except NameError as e:
      raise WeightedAccumulationError(
        f"{what}: axis {a!r} is not bound here. Call this inside "
        f"jax.shard_map over a mesh with an axis named {a!r}; under plain "
        "jax.jit use the core functions on global arrays instead (see "
        "weighted_accum.distributed)."
      ) from e
  return axes


def choice(
  x: Any, options: Sequence[str], *, what: str, name: str, hint: str
) -> str:
  """One of ``options`` (a static string option such as ``reduce=``)."""
  if not isinstance(x, str) or x not in options:
    raise WeightedAccumulationError(
      f"{what}: {name}={x!r} is not one of {tuple(options)}. {hint}"
    )
  return x


# ------------------------------------------------------ objects by role --


def transformation(tx: Any, *, what: str) -> Any:
  """An optax ``GradientTransformation`` (anything with callable ``init``
  and ``update``)."""
  if not (
    callable(getattr(tx, "init", None))
    and callable(getattr(tx, "update", None))
  ):
    raise WeightedAccumulationError(
      f"{what}: {type(tx).__name__} is not an optax GradientTransformation "
      "(an object with init and update). Pass the optimizer itself, e.g. "
      "optax.adamw(1e-3)."
    )
  return tx


def instance(x: Any, cls: type, *, what: str, hint: str) -> Any:
  """``x`` when it is a ``cls``; else an error saying what was given."""
  if not isinstance(x, cls):
    raise WeightedAccumulationError(
      f"{what}: expected {cls.__name__}, got {type(x).__name__}. {hint}"
    )
  return x


def callable_or_none(x: Any, *, what: str, hint: str) -> Any:
  """A callable option (``should_skip_update_fn``), or ``None``."""
  if x is not None and not callable(x):
    raise WeightedAccumulationError(f"{what}: {x!r} is not callable. {hint}")
  return x


def bool_scalar(x: Any, *, what: str, hint: str) -> jax.Array:
  """A bool scalar (Python, NumPy or JAX, traced or not), as an array."""
  try:
    dt = jnp.result_type(x)
  except TypeError:
    dt = None
  if dt is None or np.ndim(x) != 0 or not jnp.issubdtype(dt, jnp.bool_):
    raise WeightedAccumulationError(
      f"{what}: expected a bool scalar, got {type(x).__name__} of dtype "
      f"{dt} and shape {np.shape(x)}. {hint}"
    )
  return jnp.asarray(x)


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


# ------------------------------------------------ dynamic loss scale config --

_F32 = np.finfo(np.float32)


def _config_number(x: Any, *, what: str, noun: str) -> float:
  """A static real number (not traced, not bool)."""
  if is_traced(x):
    raise WeightedAccumulationError(
      f"{what} is a traced value; it is static configuration. Pass a "
      "Python number."
    )
  if isinstance(x, (bool, np.bool_)):
    raise WeightedAccumulationError(
      f"{what}: got {x!r}; expected a real number, {noun}."
    )
  return float(host_number(x, what=what, noun=noun))


def float32_number(x: float, *, what: str, hint: str) -> float:
  """``x`` rounded to float32, refused unless that is a finite, positive,
  normal float32 number."""
  with np.errstate(over="ignore"):
    rounded = float(np.float32(x)) if math.isfinite(x) else x
  if not (math.isfinite(rounded) and rounded >= float(_F32.tiny)):
    raise WeightedAccumulationError(
      f"{what} is {x!r}, which is not a finite positive float32 number "
      f"(range [{float(_F32.tiny):.3g}, {float(_F32.max):.3g}]). {hint}"
    )
  return rounded


def scaler_factor(
  x: Any, *, what: str, low: float, high: float, rule: str
) -> float:
  """A growth or back-off factor: a static number, as float32 in
  ``(low, high)``."""
  v = _config_number(x, what=what, noun=rule)
  v32 = float32_number(v, what=what, hint=f"It must be {rule}.")
  if not low < v32 < high:
    raise WeightedAccumulationError(
      f"{what} is {v!r} (as float32: {v32!r}); it must be {rule} (as in "
      "PyTorch's GradScaler)."
    )
  return v32


def scaler_min_scale(x: Any, *, what: str) -> float:
  """The floor of a back-off: a static finite positive float32 number."""
  v = _config_number(x, what=what, noun="the lowest loss scale")
  return float32_number(v, what=what, hint="Pass e.g. 1.0.")


def scaler_scale(x: Any, *, what: str, min_scale: float) -> jax.Array:
  """A dynamic loss scale's current scale, as a float32 array: a concrete
  one must be a finite positive float32 number >= ``min_scale``; a traced
  one is checked for shape and type (the window validates it when used)."""
  if isinstance(x, ScaleSource):
    x = x.scale
  if is_traced(x):
    traced_scalar(x, what, SCALE_NOUN)
    return x.astype(jnp.float32)
  v = float(host_number(x, what=what, noun=SCALE_NOUN))
  if isinstance(x, (bool, np.bool_)):
    raise WeightedAccumulationError(
      f"{what}: got {x!r}; expected a real number, {SCALE_NOUN}."
    )
  v32 = float32_number(
    v,
    what=what,
    hint="A loss scale is a finite positive float32 number, e.g. 2.0**16 "
    "(GradScaler's default) for float16 training.",
  )
  if v32 < min_scale:
    raise WeightedAccumulationError(
      f"{what} is {v!r}, below min_scale={min_scale!r}; the scale never "
      "backs off below min_scale. Pass a scale >= min_scale, or a smaller "
      "min_scale."
    )
  return jnp.asarray(np.float32(v32))


def growth_tracker(x: Any, *, what: str, interval: int) -> jax.Array:
  """Consecutive finite windows counted: an int32 in ``[0, interval)``."""
  hint = (
    "It counts the consecutive finite windows since the scale last changed; "
    "pass 0 to start counting afresh."
  )
  if is_traced(x):
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim:
      raise WeightedAccumulationError(
        f"{what} must be an int scalar, got {jax.typeof(x)}. {hint}"
      )
    return x.astype(jnp.int32)
  is_bool = (
    isinstance(x, (bool, np.bool_))
    or np.dtype(getattr(x, "dtype", np.int32)) == np.bool_
  )
  v = None if is_bool else host_number(x, what=what, noun="a count")
  if not isinstance(v, int) or not 0 <= v < interval:
    raise WeightedAccumulationError(
      f"{what} is {x!r}; it must be an int in [0, growth_interval="
      f"{interval}). {hint}"
    )
  return jnp.asarray(np.int32(v))
