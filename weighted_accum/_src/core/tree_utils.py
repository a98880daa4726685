"""Tree, sharding and tracing helpers: leaf paths and structural matching
(errors name the leaf), ``shard_map`` varying types and manual axes, zeros
that keep a sharding, and where a newly born state's scalars live.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import SingleDeviceSharding
import numpy as np

from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation.values import is_traced as is_traced
from weighted_accum._src.validation.values import varying_axes as varying_axes


class LeafReduce(NamedTuple):
  """How a window's close (``window.psum_window``) reduces one buffer: a
  tiled ``psum_scatter`` over ``scatter`` along dimension ``dim`` (a buffer
  whose param is sharded there over those data axes), then a ``psum`` over
  ``psum``. A buffer already reduced over its sharded axes (autodiff of an
  ``all_gather``) has ``scatter=()``."""

  psum: tuple[str, ...]
  scatter: tuple[str, ...] = ()
  dim: int = 0


def reduce_scatter(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  """A tiled ``psum_scatter`` over ``axes`` on ``dim`` that keeps the
  Explicit axes of ``x``'s type (in a ``shard_map`` over them; those on
  ``dim`` too are then permuted into the order of ``P((*axes, *them))``)."""
  sharding = jax.typeof(x).sharding
  spec = PartitionSpec(*sharding.spec)
  names = lambda e: () if e is None else (e,) if isinstance(e, str) else e
  others = {a for e in spec for a in names(e)}
  inner = tuple(names(spec[dim])) if dim < len(spec) else ()

  def scatter(b):
    b = lax.psum_scatter(b, axes, scatter_dimension=dim, tiled=True)
    n, o = (math.prod(map(lax.axis_size, a)) for a in (axes, inner))
    # Device (s, i) holds block i * n + s; block c belongs to (c // o, c % o).
    perm = [((c % n) * o + c // n, c) for c in range(n * o)]
    return lax.ppermute(b, axes + inner, perm) if inner else b

  if not others:
    return scatter(x)
  kw = dict(in_specs=spec, out_specs=spec, axis_names=others)
  return jax.shard_map(scatter, mesh=sharding.mesh, **kw)(x)


# ----------------------------------------------------------------- paths --


def path_str(path: tuple) -> str:
  """A readable leaf path, e.g. ``['a']['b']`` (``<root>`` if empty)."""
  s = jax.tree_util.keystr(path)
  return s if s else "<root>"


def flat(tree: Any) -> list[tuple[str, Any]]:
  """``(readable path, leaf)`` for every leaf of ``tree``."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in leaves]


def is_variable(x: Any) -> bool:
  """An ``nnx.Variable`` (``nnx.Param``, ``nnx.Optimizer``'s ``OptArray``):
  a pytree node in flax 0.12 whose value ``get_value`` returns."""
  return callable(getattr(x, "get_value", None)) and callable(
    getattr(x, "replace", None)
  )


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with every ``nnx.Variable`` replaced by its value (the same
  leaves; paths without the Variable's ``.value``)."""
  return jax.tree.map(
    lambda x: x.get_value() if is_variable(x) else x,
    tree,
    is_leaf=is_variable,
  )


def leaf_paths(tree: Any) -> list[str]:
  """The readable path of every leaf of ``tree``, in flattening order."""
  return [p for p, _ in flat(tree)]


def diff_paths(expected: Any, got: Any) -> tuple[list[Any], list[Any]]:
  """The entries of ``expected`` missing from ``got``, and those of ``got``
  not in ``expected``, each in its own order."""
  got_set, expected_set = set(got), set(expected)
  return (
    [p for p in expected if p not in got_set],
    [p for p in got if p not in expected_set],
  )


def _check_paths(
  ref_paths: list[str], got_paths: list[str], what: str, ref_name: str
) -> None:
  if ref_paths == got_paths:
    return
  missing, extra = diff_paths(ref_paths, got_paths)
  if missing:
    raise WeightedAccumulationError(
      f"{what}: leaf {missing[0]} is missing ({len(missing)} missing in "
      f"all); it must have exactly the leaf paths of {ref_name}. Pass "
      "gradients with respect to the same params given to init."
    )
  if extra:
    raise WeightedAccumulationError(
      f"{what}: unexpected leaf {extra[0]} ({len(extra)} extra in all), "
      f"which {ref_name} do not have. Pass gradients with respect to the "
      "same params given to init (filter out non-trainable leaves)."
    )
  raise WeightedAccumulationError(
    f"{what}: leaves are in a different order than in {ref_name} "
    f"(first: {got_paths[0]} vs {ref_paths[0]}). Pass a tree of the same "
    "container types as the params given to init."
  )


def match_tree(
  reference: Any,
  tree: Any,
  *,
  what: str,
  ref_name: str = "the accumulator's buffers",
) -> list[Any]:
  """Checks that ``tree`` has ``reference``'s leaf paths and shapes."""
  ref, got = flat(reference), flat(tree)
  _check_paths([p for p, _ in ref], [p for p, _ in got], what, ref_name)
  for (path, r), (_, g) in zip(ref, got):
    if np.shape(g) != np.shape(r):
      raise WeightedAccumulationError(
        f"{what}: leaf {path} has shape {np.shape(g)}, expected "
        f"{np.shape(r)} as in {ref_name}. Pass gradients of the same params "
        "given to init."
      )
  return [g for _, g in got]


GRADS_HINT = (
  "Gradients must be floating point (float32, bfloat16, float16; float64 "
  "with x64); exclude integer and bool leaves (e.g. nnx.state(model, "
  "nnx.Param), or eqx.filter(model, eqx.is_inexact_array))."
)


def leaf_dtype(leaf: Any) -> np.dtype:
  """A leaf's dtype: arrays, ``jax.ShapeDtypeStruct``s, Python scalars."""
  return np.dtype(
    leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
  )


def check_leaves_floating(
  paths_and_leaves: list[tuple[str, Any]], *, what: str, hint: str = GRADS_HINT
) -> None:
  """Raises naming the first leaf whose dtype is not floating."""
  for path, leaf in paths_and_leaves:
    try:
      dt = leaf_dtype(leaf)
    except TypeError:
      dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
      shown = dt if dt is not None else type(leaf).__name__
      raise WeightedAccumulationError(
        f"{what}: leaf {path} has dtype {shown}, which is not floating "
        "point. " + hint
      )


# ------------------------------------------------------- shard_map types --


def bound(axes: tuple[str, ...]) -> bool:
  """Whether an enclosing ``shard_map`` made every one of ``axes`` manual."""
  return set(axes) <= set(manual_axes())


def manual_axes() -> tuple[str, ...]:
  """The mesh axes the enclosing ``shard_map`` has made manual (``()``
  outside one)."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(getattr(mesh, "manual_axes", ()) or ())


def vma_checked(axes: tuple[str, ...]) -> bool:
  """Whether the enclosing ``shard_map`` tracks varying types over ``axes[0]``
  (``check_vma=True``)."""
  return axes[0] in varying_axes(jax.lax.axis_index(axes[0]))


def to_varying(tree: Any, axes: tuple[str, ...]) -> Any:
  """Casts every leaf to vary over ``axes`` (no-op where it already does,
  and under ``check_vma=False``)."""
  if not axes or not vma_checked(axes):
    return tree

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def vary_like(x: Any, ref: Any, axes: tuple[str, ...]) -> Any:
  """Casts ``x`` to vary over the ``axes`` that ``ref`` varies over."""
  missing = tuple(
    a for a in axes if a in varying_axes(ref) and a not in varying_axes(x)
  )
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def check_not_reduced_against_weight(
  paths_and_leaves: list[tuple[str, Any]], weight: Any, *, what: str
) -> None:
  """Raises when grads were already summed over a data axis but the weight
  was not: inside ``shard_map``, autodiff sums the gradient of an unvarying
  (replicated) param over the axis, so adding it to a per-replica window and
  reducing that window would count it once per replica.
  """
  if not is_traced(weight):
    return
  w_axes = varying_axes(weight)
  if not w_axes:
    return
  for path, leaf in paths_and_leaves:
    summed = w_axes - varying_axes(leaf)
    if summed:
      axes = tuple(sorted(summed))
      raise WeightedAccumulationError(
        f"{what}: leaf {path} does not vary over mesh axis {axes} while "
        "the weight does: autodiff already summed this gradient over the "
        "replicas (its param is replicated), so a per-replica window would "
        "count it once per replica. Make the window with wa.init(params, "
        f"axis_name={axes!r}), whose accumulate handles such gradients, or "
        "differentiate local gradients with weighted_accum.distributed."
        f"local_grad (jax.lax.pcast(params, {axes!r}, to='varying'))."
      )


# ------------------------------------------------------------- placement --


def zeros_like(x: Any, dtype: Any = None) -> jax.Array:
  """Zeros shaped like ``x`` on ``x``'s sharding, eagerly and under ``jit``."""
  dtype = x.dtype if dtype is None else dtype
  if isinstance(x, jax.Array) and not is_traced(x):
    # Keeps x's sharding and whether it is committed: a state born from
    # uncommitted params stays uncommitted, as a jitted step returns it.
    return jnp.zeros_like(x, dtype=dtype)
  if is_traced(x):
    return jnp.where(jnp.zeros_like(x, dtype=bool), x, 0).astype(dtype)
  # A jax.ShapeDtypeStruct (the jax.eval_shape way to describe a large model)
  # may carry the sharding to build on.
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.Sharding):
    return jnp.zeros(np.shape(x), dtype, device=sharding)
  return jnp.zeros(np.shape(x), dtype)


def fill_like(x: jax.Array, value: jax.Array) -> jax.Array:
  """``value`` broadcast like ``x``, on ``x``'s sharding, without reading
  ``x`` (the select folds to a broadcast after sharding propagation)."""
  return jnp.where(jnp.zeros_like(x, dtype=bool), x, value.astype(x.dtype))


def _committed_arrays(tree: Any) -> list[jax.Array]:
  return [
    x
    for x in jax.tree.leaves(tree)
    if isinstance(x, jax.Array) and not is_traced(x) and x.committed
  ]


def replicated_sharding(tree: Any) -> jax.sharding.Sharding | None:
  """The sharding ``jit`` gives a scalar computed from ``tree``'s arrays."""
  committed = _committed_arrays(tree)
  if not committed:
    return None
  s = committed[0].sharding
  if isinstance(s, NamedSharding):
    return NamedSharding(s.mesh, PartitionSpec(), memory_kind=s.memory_kind)
  if isinstance(s, SingleDeviceSharding):
    return s
  devices = sorted(s.device_set, key=lambda d: d.id)
  if len(devices) == 1:
    return SingleDeviceSharding(devices[0], memory_kind=s.memory_kind)
  mesh = jax.sharding.Mesh(devices, ("_replicas",))
  return NamedSharding(mesh, PartitionSpec(), memory_kind=s.memory_kind)


def commit_like(tree: Any, params: Any) -> Any:
  """``tree`` with its concrete uncommitted scalars committed like
  ``params``."""
  sharding = replicated_sharding(params)
  if sharding is None:
    return tree

  def place(x):
    if (
      isinstance(x, jax.Array)
      and not is_traced(x)
      and x.ndim == 0
      and not x.committed
    ):
      return jax.device_put(x, sharding)
    return x

  return jax.tree.map(place, tree)


def cast_to(tree: Any, dtypes: Any) -> Any:
  """``tree``'s leaves cast to ``dtypes`` (flattening order; ``None``: as is)."""
  if dtypes is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([x.astype(d) for x, d in zip(leaves, dtypes)])


def cast_like(tree: Any, like: Any) -> Any:
  """``tree``'s leaves cast to the dtypes of ``like``'s leaves."""
  return jax.tree.map(
    lambda x, d: jnp.asarray(x).astype(jnp.result_type(d)), tree, like
  )
