"""The library's error type and the validation helpers behind it.

Two kinds of fault are told apart (DESIGN.md §3):

* *Structural* faults (a grads tree that does not match the buffers, a
  non-floating dtype, a bad loss scale) are known at call/trace time and always
  raise :class:`WeightedAccumulationError`, naming the first offending leaf path.
* *Value* faults (a negative, NaN or infinite weight; finishing an empty
  window) raise when the offending value is concrete (eager calls). Under
  ``jax.jit`` the value is a tracer, so the core functions fall back to a safe
  result instead (see :mod:`weighted_accum.core`) and, when asked with
  ``checked=True``, emit a :func:`jax.experimental.checkify.check`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["WeightedAccumulationError"]


class WeightedAccumulationError(ValueError):
  """Raised when weighted accumulation is given input it cannot use safely.

  Every message says what was wrong, where (the leaf path or the field), and
  what to do about it. Raising never modifies the caller's state: all functions
  of this library are pure.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(3)})
    >>> try:
    ...   wa.accumulate_sum(state, {'w': jnp.ones(3)}, weight=-1.0)
    ... except wa.WeightedAccumulationError as e:
    ...   print('refused')
    refused
  """


def is_traced(x: Any) -> bool:
  """True when ``x`` is an abstract value inside a JAX transformation."""
  return isinstance(x, jax.core.Tracer)


def concrete_float(x: Any) -> float | None:
  """Returns ``x`` as a Python float when it is concrete, else ``None``."""
  if is_traced(x):
    return None
  return float(np.asarray(x))


def varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` mesh axes ``x`` varies over (empty outside one).

  ``jax.typeof(x).vma`` in newer JAX, ``.mat.varying`` in jax 0.10.
  """
  aval = jax.typeof(x)
  v = getattr(aval, "vma", None)
  if v is None:
    v = getattr(getattr(aval, "mat", None), "varying", frozenset())
  return frozenset(v)


def check_not_reduced_against_weight(paths_and_leaves: list[tuple[str, Any]],
                                     weight: Any, *, what: str) -> None:
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
          f"local_grad (jax.lax.pcast(params, {axes!r}, to='varying')).")


def path_str(path: tuple) -> str:
  """A readable leaf path such as ``['layer']['kernel']`` (``<root>`` if empty)."""
  s = jax.tree_util.keystr(path)
  return s if s else "<root>"


def check_floating_dtype(dtype: Any, *, what: str) -> jnp.dtype:
  """Returns ``dtype`` canonicalised, or raises if it is not a usable float.

  The one dtype path (:func:`weighted_accum._inputs.work_dtype`).
  """
  from weighted_accum import _inputs  # pylint: disable=g-import-not-at-top
  return _inputs.work_dtype(dtype, what=what)


def check_loss_scale(loss_scale: Any, *, what: str = "loss_scale",
                     dtype: Any = np.float32) -> Any:
  """Converts a loss scale to its stored dtype, raising if a concrete one is
  not a finite positive normal number there (a traced invalid one becomes
  NaN: see :func:`weighted_accum._inputs.loss_scale`)."""
  from weighted_accum import _inputs  # pylint: disable=g-import-not-at-top
  return _inputs.loss_scale(loss_scale, what=what, dtype=dtype)


def check_weight(weight: Any, *, what: str = "weight",
                 tally: Any = np.float32) -> Any:
  """Converts a weight to the tally dtype (``_inputs.Weight``), raising for a
  non-scalar or non-real weight and for a concrete one the tally cannot hold
  exactly (see :func:`weighted_accum._inputs.weight`)."""
  from weighted_accum import _inputs  # pylint: disable=g-import-not-at-top
  return _inputs.weight(weight, what=what, tally=tally)


def _flat(tree: Any) -> list[tuple[str, Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in flat]


def diff_paths(expected: Any, got: Any) -> tuple[list[Any], list[Any]]:
  """The entries of ``expected`` missing from ``got``, and those of ``got``
  not in ``expected``, each in its own order."""
  got_set, expected_set = set(got), set(expected)
  return ([p for p in expected if p not in got_set],
          [p for p in got if p not in expected_set])


def match_tree(reference: Any, tree: Any, *, what: str,
               ref_name: str = "the accumulator's buffers") -> list[Any]:
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
  ref = _flat(reference)
  got = _flat(tree)
  ref_paths = [p for p, _ in ref]
  got_paths = [p for p, _ in got]
  if ref_paths != got_paths:
    missing, extra = diff_paths(ref_paths, got_paths)
    if missing:
      raise WeightedAccumulationError(
          f"{what}: leaf {missing[0]} is missing ({len(missing)} missing in "
          f"all); it must have exactly the leaf paths of {ref_name}. Pass "
          "gradients with respect to the same params given to init.")
    if extra:
      raise WeightedAccumulationError(
          f"{what}: unexpected leaf {extra[0]} ({len(extra)} extra in all), "
          f"which {ref_name} do not have. Pass gradients with respect to the "
          "same params given to init (filter out non-trainable leaves).")
    raise WeightedAccumulationError(
        f"{what}: leaves are in a different order than in {ref_name} "
        f"(first: {got_paths[0]} vs {ref_paths[0]}). Pass a tree of the same "
        "container types as the params given to init.")
  leaves = []
  for (path, r), (_, g) in zip(ref, got):
    if np.shape(g) != np.shape(r):
      raise WeightedAccumulationError(
          f"{what}: leaf {path} has shape {np.shape(g)}, expected "
          f"{np.shape(r)} as in {ref_name}. Pass gradients of the same params "
          "given to init.")
    leaves.append(g)
  return leaves


_GRADS_HINT = ("Gradients must be float32, bfloat16 or float16; exclude "
               "integer leaves (e.g. with nnx.state(model, nnx.Param)).")


def check_leaves_floating(paths_and_leaves: list[tuple[str, Any]], *,
                          what: str, hint: str = _GRADS_HINT) -> None:
  """Raises naming the first leaf whose dtype is not floating.

  Leaves may be arrays, Python/NumPy scalars or ``jax.ShapeDtypeStruct``s.
  """
  for path, leaf in paths_and_leaves:
    dt = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
    if not jnp.issubdtype(dt, jnp.floating):
      raise WeightedAccumulationError(
          f"{what}: leaf {path} has dtype {dt}, which is not floating point. "
          + hint)


def leaf_paths(tree: Any) -> list[str]:
  """The readable path of every leaf of ``tree``, in flattening order."""
  return [p for p, _ in _flat(tree)]
