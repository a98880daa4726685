"""Options: window lengths, argument indices, flags, modes, axis names,
objects by role, where the caller's arrays live; and how an in-step
function is configured and called (roles, split, keys, normalisers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation import values
from weighted_accum._src.validation.values import INT32_MAX
from weighted_accum._src.validation.values import MODES
from weighted_accum._src.validation.values import is_traced
from weighted_accum._src.validation.values import varying_axes


def _is_bool(x: Any) -> bool:
  return isinstance(x, (bool, np.bool_)) or getattr(x, "dtype", 0) == np.bool_


def static_int(
  x: Any, *, what: str, low: int = 1, high: int = INT32_MAX, hint: str = ""
) -> int:
  """A static Python or NumPy int in ``[low, high]``."""
  ok = isinstance(x, (int, np.integer)) and not _is_bool(x)
  if not ok or not low <= operator.index(x) <= high:
    raise WeightedAccumulationError(
      f"{what}: expected a Python int in [{low}, {high}], got {x!r} "
      f"({type(x).__name__}). {hint}".rstrip()
    )
  return operator.index(x)


def every_k(x: Any, *, what: str) -> int | Callable[..., Any] | None:
  """A window length: an int, a callable of the step, or ``None``."""
  if x is None or (
    callable(x) and not isinstance(x, (np.generic, np.ndarray, jax.Array))
  ):
    return x
  hint = (
    "It is the number of microbatches per window, a function of the step "
    "returning it, or None (close with update(..., finish=True))."
  )
  return static_int(x, what=what, hint=hint)


def num_real(x: Any, k: int, *, what: str) -> jax.Array | None:
  """``num_real_microbatches`` as an int32 in ``[0, k]`` (a traced one is
  clipped)."""
  if x is None:
    return None
  v = jax.typeof(x) if is_traced(x) else np.asarray(x)
  bad = v.ndim or not jnp.issubdtype(v.dtype, jnp.integer)
  if bad or not (is_traced(x) or 0 <= v <= k):
    raise WeightedAccumulationError(
      f"{what}: num_real_microbatches={x!r} must be an integer scalar in "
      f"[0, {k}]."
    )
  return jnp.clip(jnp.asarray(x, jnp.int32), 0, k)


def argnums(x: Any, *, what: str, name: str) -> tuple[int, ...]:
  """A positional-argument index or a non-empty tuple of distinct ones."""
  nums = (x,) if isinstance(x, (int, np.integer)) else x
  try:
    nums = tuple(nums)
  except TypeError:
    nums = ()
  ok = all(isinstance(n, (int, np.integer)) and n >= 0 for n in nums)
  if (
    not nums or not ok or any(map(_is_bool, nums)) or len(set(nums)) < len(nums)
  ):
    raise WeightedAccumulationError(
      f"{what}({name}={x!r}): expected a non-negative int or a non-empty "
      "tuple of distinct ones (positional argument indices)."
    )
  return tuple(int(n) for n in nums)


def static_flag(x: Any, *, what: str) -> bool:
  """A Python-level bool option (``checked=``): never traced."""
  concrete = isinstance(x, jax.Array) and not is_traced(x) and x.shape == ()
  if isinstance(x, (bool, np.bool_)) or (concrete and x.dtype == jnp.bool_):
    return bool(x)
  raise WeightedAccumulationError(
    f"{what}: expected True or False (static), got {x!r} ({type(x).__name__})."
  )


def traced_flag(x: Any, *, what: str) -> jax.Array:
  """A bool scalar that may be traced (``finish=``); ``None`` is False."""
  x = False if x is None else x
  return bool_scalar(x, what=what, hint="Pass True, False or None.")


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


def mode(x: Any, *, what: str) -> str:
  """The kind of loss the grads are of: ``"mean"`` or ``"sum"``."""
  return choice(
    x,
    MODES,
    what=what,
    name="mode",
    hint="'mean': each microbatch's loss is its sum divided by its weight; "
    "'sum': the sum itself. There is no default.",
  )


def choice(
  x: Any, options: Sequence[str], *, what: str, name: str, hint: str
) -> str:
  """One of ``options`` (a static string option such as ``reduce=``)."""
  if not isinstance(x, str) or x not in options:
    raise WeightedAccumulationError(
      f"{what}: {name}={x!r} is not one of {tuple(options)}. {hint}"
    )
  return x


def axis_names(
  x: Any, *, what: str, name: str = "axis_name"
) -> tuple[str, ...]:
  """A mesh axis name or a sequence of distinct ones, as a tuple."""
  names = (
    (x,) if isinstance(x, str) else tuple(x) if isinstance(x, Sequence) else ()
  )
  if (
    not names
    or not all(isinstance(a, str) and a for a in names)
    or len(set(names)) < len(names)
  ):
    raise WeightedAccumulationError(
      f"{what}: {name}={x!r} is not a mesh axis name; pass the data axis, "
      "e.g. 'data', or distinct names such as ('data', 'fsdp')."
    )
  return names


def optional_axis_names(
  x: Any, *, what: str, name: str = "axis_name"
) -> tuple[str, ...] | None:
  """:func:`axis_names`, or ``None`` for ``None``."""
  return None if x is None else axis_names(x, what=what, name=name)


def bound_axes(x: Any, *, what: str) -> tuple[str, ...]:
  """:func:`axis_names`, each bound by an enclosing ``shard_map``."""
  axes = axis_names(x, what=what)
  for a in axes:
    try:
      jax.lax.axis_size(a)
    except NameError as e:
      raise WeightedAccumulationError(
        f"{what}: axis {a!r} is not bound here. Call this inside "
        f"jax.shard_map over a mesh with an axis {a!r}; under plain jax.jit "
        "use the core functions on global arrays."
      ) from e
  return axes


def shared(x: Any, axes: Sequence[str], *, what: str) -> Any:
  """``x``, refused if it varies over any of the data ``axes``: a value
  every replica must take alike."""
  if x is None or not axes:
    return x
  leaves = [v for v in jax.tree.leaves(x) if is_traced(v)]
  varying = sorted(
    set(axes).intersection(set().union(*map(varying_axes, leaves)))
  )
  if varying:
    raise WeightedAccumulationError(
      f"{what}: the value varies over {varying}; every replica must take "
      "the same one. Pass it into shard_map with P(), or agree on it first "
      "(jax.lax.psum of a count, jax.lax.pmax of a flag)."
    )
  return x


def partition_specs(x: Any, *, what: str) -> Any:
  """``None``, or a pytree of ``PartitionSpec`` (or ``None``) leaves."""
  is_spec = lambda v: v is None or isinstance(v, jax.sharding.PartitionSpec)
  bad = [v for v in jax.tree.leaves(x, is_leaf=is_spec) if not is_spec(v)]
  if bad:
    raise WeightedAccumulationError(
      f"{what}: {bad[0]!r} is not a PartitionSpec; pass a tree of "
      "jax.sharding.PartitionSpec like the params (None: replicated)."
    )
  return x


def spec_on_mesh(
  spec: Any, mesh: Any, shape: tuple[int, ...], *, what: str, hint: str
) -> Any:
  """A param's spec checked against its mesh: known axes, dimensions that
  divide evenly over the axes sharding them."""
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
        f"{shape[dim]}) over {on}, {n} shards, which do not divide it. Pad "
        f"it to a multiple of {n}, or shard another one. {hint}"
      )
  return spec


def instance(x: Any, cls: type, *, what: str, hint: str) -> Any:
  """``x`` when it is a ``cls``; else an error saying what was given."""
  if not isinstance(x, cls):
    raise WeightedAccumulationError(
      f"{what}: expected {cls.__name__}, got {type(x).__name__}. {hint}"
    )
  return x


def transformation(tx: Any, *, what: str) -> Any:
  """An optax ``GradientTransformation`` (callable ``init`` and
  ``update``)."""
  if not all(callable(getattr(tx, f, None)) for f in ("init", "update")):
    raise WeightedAccumulationError(
      f"{what}: expected an optax GradientTransformation, got "
      f"{type(tx).__name__}. Pass the optimizer, e.g. optax.adamw(1e-3)."
    )
  return tx


def callable_or_none(x: Any, *, what: str, hint: str) -> Any:
  """A callable option (``should_skip_update_fn``), or ``None``."""
  if x is not None and not callable(x):
    raise WeightedAccumulationError(f"{what}: {x!r} is not callable. {hint}")
  return x


def one_device_set(named_trees: Sequence[tuple[str, Any]], *, what: str):
  """Refuses concrete committed arrays on different sets of devices,
  naming the two leaves (uncommitted, traced and host values pass)."""
  first = None
  for name, tree in named_trees:
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if not isinstance(x, jax.Array) or is_traced(x) or not x.committed:
        continue
      here = (f"{name}{jax.tree_util.keystr(path)}", x.sharding.device_set)
      first = first or here
      if here[1] != first[1]:
        ids = lambda leaf: sorted(d.id for d in leaf[1])
        raise WeightedAccumulationError(
          f"{what}: leaf {here[0]} is committed to devices {ids(here)} but "
          f"leaf {first[0]} to {ids(first)}; one jitted computation cannot take "
          "both. Put the params on one device or mesh (jax.device_put), then "
          "make the window and the optimizer state from them."
        )


#: How rows are dealt to microbatches (``split=``).
SPLITS = ("strided", "contiguous")
NORMALIZER_NOUN = "a loss term's normaliser (e.g. the batch's token count)"


def _is_int(a: Any) -> bool:
  return isinstance(a, (int, np.integer)) and not _is_bool(a)


def optional_argnums(x: Any, *, what: str, name: str) -> tuple[int, ...]:
  """:func:`options.argnums`, or ``()`` for an empty tuple or list."""
  if isinstance(x, (tuple, list)) and not x:
    return ()
  return argnums(x, what=what, name=name)


def argnames(x: Any, *, what: str, name: str) -> tuple[str, ...]:
  """A keyword-argument name or a tuple of distinct ones (may be empty)."""
  names = (x,) if isinstance(x, str) else x
  try:
    names = tuple(names)
  except TypeError:
    names = (None,)
  if not all(isinstance(n, str) and n.isidentifier() for n in names) or len(
    set(names)
  ) < len(names):
    raise WeightedAccumulationError(
      f"{what}({name}={x!r}): expected a keyword-argument name or a tuple "
      "of distinct names."
    )
  return names


def in_axes(x: Any, n: int, *, what: str) -> tuple[int, ...]:
  """The batch axis of each of ``n`` batch arguments: one int for all, or
  ``n`` ints."""
  axes = (x,) * n if _is_int(x) else x
  try:
    axes = tuple(axes)
  except TypeError:
    axes = ()
  if len(axes) != n or not all(map(_is_int, axes)):
    raise WeightedAccumulationError(
      f"{what}(batch_argnums' axes {x!r}): expected an int or {n} ints, "
      "the batch axis of each batch argument ({argument: axis})."
    )
  return tuple(int(a) for a in axes)


def split(x: Any, *, what: str) -> str:
  """How rows are dealt to microbatches: ``"strided"`` or ``"contiguous"``."""
  return choice(
    x,
    SPLITS,
    what=what,
    name="split",
    hint="'strided': microbatch k holds rows k::K; 'contiguous': the k-th "
    "block of B/K rows (a padded batch, real rows first).",
  )


def grads_dtype(x: Any, *, what: str) -> np.dtype | str | None:
  """``None`` (the work dtype), ``"params"`` or a floating dtype."""
  if x is None or (isinstance(x, str) and x == "params"):
    return x
  try:
    return values.work_dtype(x, what=what)
  except WeightedAccumulationError as e:
    raise WeightedAccumulationError(f"{e} Or grads_dtype='params'.") from None


def random_key(x: Any, *, what: str) -> Any:
  """One PRNG key: typed (``jax.random.key``) or raw ``uint32[2]``."""
  dt = getattr(x, "dtype", None)
  typed = dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
  if np.shape(x) == (() if typed else (2,)) and (typed or dt == np.uint32):
    return x
  raise WeightedAccumulationError(
    f"{what}: expected one PRNG key (jax.random.key(0) or "
    f"jax.random.PRNGKey(0)), got {type(x).__name__} of dtype {dt} and "
    f"shape {np.shape(x)}. Keys per row belong in the batch."
  )


def normalizer(x: Any, *, what: str) -> Any:
  """A normaliser: as a float32 loss scale (a traced invalid one is NaN)."""
  return values.loss_scale(x, what=what, noun=NORMALIZER_NOUN)


def normalizers(x: Any, terms: Sequence[Any], *, what: str) -> dict:
  """Normalisers by term: ``None``, one number for a single unnamed loss,
  or a mapping from some of the terms' names to numbers."""
  if x is None:
    return {}
  if list(terms) == [None] and not isinstance(x, Mapping):
    return {None: normalizer(x, what=what)}
  shown = sorted(map(str, terms))
  unknown = (
    sorted(map(str, set(x) - set(terms)))
    if isinstance(x, Mapping)
    else ["(one number)"]
  )
  if unknown:
    raise WeightedAccumulationError(
      f"{what}: expected one number for loss_fn's one loss, or a mapping "
      f"from its terms {shown}; got {unknown[0]!r}."
    )
  return {t: normalizer(v, what=f"{what}[{t!r}]") for t, v in x.items()}


def unsplit_batch(
  unchanged: Sequence[tuple[str, Any, str]], batch_size: int, *, what: str
) -> WeightedAccumulationError | None:
  """The error for an argument passed unchanged (``(name, value, fix)``)
  whose leading axis has the batch's rows, when ``loss_fn`` failed."""
  for name, tree, fix in unchanged:
    for x in jax.tree.leaves(tree):
      shape = np.shape(x) if hasattr(x, "shape") else ()
      if shape and shape[0] == batch_size:
        return WeightedAccumulationError(
          f"{what}: loss_fn failed on a microbatch, and {name} is passed "
          f"unchanged but has the batch's {batch_size} rows (shape "
          f"{tuple(shape)}). If it is part of the batch, pass {fix}; "
          "loss_fn's own error is chained below."
        )
  return None
