"""Private tree, sharding and tracing helpers shared by the modules.

Leaf paths and structural matching of trees (with errors naming the leaf),
``shard_map`` varying types, zeros that keep a sharding, and the one
finiteness reduction. Not API: import from :mod:`weighted_accum` instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.errors import concrete_float  # noqa: F401  (re-export)
from weighted_accum.errors import is_traced


def path_str(path: tuple) -> str:
  """A readable leaf path, e.g. ``['a']['b']`` (``<root>`` if empty)."""
  s = jax.tree_util.keystr(path)
  return s if s else "<root>"


def flat(tree: Any) -> list[tuple[str, Any]]:
  """``(readable path, leaf)`` for every leaf of ``tree``."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in leaves]


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
  """Checks that ``tree`` has ``reference``'s leaf paths and shapes.

  Args:
    reference: the tree whose structure is expected (buffers or params).
    tree: the caller's tree (grads, restored buffers).
    what: how to name ``tree`` in messages.
    ref_name: how to name ``reference`` in messages.

  Returns:
    The leaves of ``tree`` in ``reference``'s flattening order. Container
    types may differ (a ``dict`` against an ``nnx.State``) when every leaf
    path agrees.

  Raises:
    WeightedAccumulationError: naming the first missing, extra or misshapen
      leaf.
  """
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
  "Gradients must be float32, bfloat16 or float16; exclude "
  "integer leaves (e.g. with nnx.state(model, nnx.Param))."
)


def check_leaves_floating(
  paths_and_leaves: list[tuple[str, Any]], *, what: str, hint: str = GRADS_HINT
) -> None:
  """Raises naming the first leaf whose dtype is not floating.

  Leaves may be arrays, Python/NumPy scalars or ``jax.ShapeDtypeStruct``s.
  """
  for path, leaf in paths_and_leaves:
    dt = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
    if not jnp.issubdtype(dt, jnp.floating):
      raise WeightedAccumulationError(
        f"{what}: leaf {path} has dtype {dt}, which is not floating point. "
        + hint
      )


def varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` mesh axes ``x`` varies over (empty outside one).

  ``jax.typeof(x).vma`` in newer JAX, ``.mat.varying`` in jax 0.10.
  """
  aval = jax.typeof(x)
  v = getattr(aval, "vma", None)
  if v is None:
    v = getattr(getattr(aval, "mat", None), "varying", frozenset())
  return frozenset(v)


def vma_checked(axes: tuple[str, ...]) -> bool:
  """Whether the enclosing ``shard_map`` tracks varying types over
  ``axes[0]`` (``check_vma=True``).

  With ``check_vma=False`` every value reads as unvarying and autodiff does
  not sum gradients of replicated params: they are local.
  """
  return axes[0] in varying_axes(jax.lax.axis_index(axes[0]))


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
        "count it once per replica. Use weighted_accum.distributed."
        "accumulate_sum/accumulate_mean, which handle such gradients, or "
        "differentiate local gradients with weighted_accum.distributed."
        f"local_grad (jax.lax.pcast(params, {axes!r}, to='varying'))."
      )


def zeros_like(x: Any, dtype: Any = None) -> jax.Array:
  """Zeros shaped like ``x`` on ``x``'s sharding, eagerly and under ``jit``.

  Under ``jit`` a constant has no data dependence on ``x``, so the partitioner
  would replicate it (``jnp.zeros_like`` does, on an auto mesh). Selecting
  from ``x`` with an all-false mask makes the zeros inherit ``x``'s sharding
  on auto and explicit meshes alike, and stays zero where ``x`` is NaN/Inf.
  """
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


def peak(x: jax.Array) -> jax.Array:
  """``max(|x|)`` in at least float32: NaN if any value is NaN, 0 if empty.
  One fused read of ``x`` (XLA:CPU fuses a plain reduction; the boolean
  ``all(isfinite(x))`` would materialise a temporary)."""
  ct = jnp.promote_types(x.dtype, jnp.float32)
  return jnp.max(jnp.abs(jnp.asarray(x).astype(ct)), initial=jnp.zeros((), ct))


def all_of(flags: Any) -> jax.Array:
  """``True`` when every bool scalar of ``flags`` is (``True`` if none)."""
  flags = list(flags)
  return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def all_finite(tree: Any) -> jax.Array:
  """True when every value of ``tree`` is finite: one reduction per leaf
  (:func:`peak`; NaN and Inf propagate into the maximum, which unlike a sum
  cannot overflow, so it is exact)."""
  return all_of(jnp.isfinite(peak(x)) for x in jax.tree.leaves(tree))
