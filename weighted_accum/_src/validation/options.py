"""Static and traced options: counts, window lengths, argument indices,
flags, modes, axis names, and objects by role (an optax transformation, a
state of a given type, a callable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.core.tree_utils import is_traced
from weighted_accum._src.core.tree_utils import varying_axes
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation.values import INT32_MAX
from weighted_accum._src.validation.values import MODES
from weighted_accum._src.validation.values import host_number

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


def shared(x: Any, axes: Sequence[str], *, what: str) -> Any:
  """``x``, refused if it varies over any of the data ``axes`` (inside
  ``shard_map``): a value every replica must take alike (a loss scale, a
  next loss scale, a normaliser, a finish decision). The one check of
  sharedness at every entry point that takes such a value."""
  if x is None or not axes:
    return x
  varying = sorted(set(axes) & _varying(x))
  if varying:
    raise WeightedAccumulationError(
      f"{what}: the value varies over {varying}, but every replica must "
      "take the same one (or the replicas divide or close differently). "
      "Pass it into shard_map with P() (the same on every replica), or "
      "agree on it first: jax.lax.psum of a count, jax.lax.pmax of a flag."
    )
  return x


def _varying(x: Any) -> set[str]:
  out: set[str] = set()
  for leaf in jax.tree.leaves(x):
    if is_traced(leaf):
      out |= set(varying_axes(leaf))
  return out


def spec_on_mesh(
  spec: Any, mesh: Any, shape: tuple[int, ...], *, what: str, hint: str
) -> Any:
  """A param's ``PartitionSpec`` checked against the mesh it will be laid
  on: every axis it names is one of the mesh's, and each dimension divides
  evenly over the axes sharding it (a reduce-scatter over the data axes
  needs it). ``what`` names the param (its leaf path); ``hint`` says where
  the spec came from."""
  for dim, entry in enumerate(spec):
    on = () if entry is None else (entry,) if isinstance(entry, str) else entry
    for a in on:
      if a not in mesh.axis_names:
        raise WeightedAccumulationError(
          f"{what}: its spec {spec} names the axis {a!r}, which the mesh "
          f"(axes {tuple(mesh.axis_names)}) lacks. {hint}"
        )
    n = math.prod(mesh.shape[a] for a in on)
    if dim < len(shape) and shape[dim] % n:
      raise WeightedAccumulationError(
        f"{what}: its spec {spec} shards dimension {dim} (size "
        f"{shape[dim]}) over {on}, {n} shards, which do not divide it. "
        f"Pad that dimension to a multiple of {n}, or shard another one. "
        f"{hint}"
      )
  return spec


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
