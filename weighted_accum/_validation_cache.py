"""The structural checks of an eager microbatch, remembered per signature.

Outside ``jit``, validating a microbatch (leaf paths, shapes, dtypes, the
grads' placement against the buffers') walks every leaf in Python on every
call, which costs several times the accumulation itself for many small
leaves. The checks depend only on the two trees' structures and on each
leaf's shape, dtype, weak type and sharding, so a call whose signature
(``jax.tree.flatten``'s treedef and those per-leaf facts, for the grads and
the buffers) was validated before skips them. A new signature is always
validated; the weight's value is checked on every call. Under a
transformation nothing is cached (tracing validates once anyway).
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np

from weighted_accum import _accum
from weighted_accum._tree import is_traced
from weighted_accum.state import AccumState

Tracer = jax.core.Tracer

_MAX_ENTRIES = 256
# signature -> whether every grads leaf is already on its buffer's sharding.
_VALIDATED: dict[Any, bool] = {}
# A jax.Array's abstract value (shape, dtype, weak type) and its sharding
# (compared by value), read in C: half the cost of reading each fact.
_FACTS = operator.attrgetter("aval", "sharding")


def _generic_signature(x: Any) -> Any:
  if isinstance(x, jax.Array):
    return _FACTS(x)
  return type(x), np.shape(x), np.result_type(x)


def _signature(tree: Any) -> tuple[Any | None, list[Any]]:
  """``(signature, leaves)``: the treedef and, per leaf, its abstract value
  (shape, dtype, weak type) and sharding. ``None`` for a signature when a
  leaf is traced or has facts that cannot be hashed."""
  leaves, treedef = jax.tree.flatten(tree)
  if any(isinstance(x, Tracer) for x in leaves):
    return None, leaves
  try:
    sig = tuple(map(_FACTS, leaves))
    hash(sig)
  except (AttributeError, TypeError):  # NumPy arrays, Python scalars
    try:
      sig = tuple(map(_generic_signature, leaves))
      hash(sig)
    except TypeError:
      return None, leaves
  return (treedef, sig), leaves


def _on_buffer_shardings(state: AccumState, leaves: list[Any]) -> bool:
  return all(
    not (isinstance(g, jax.Array) and isinstance(b, jax.Array))
    or g.sharding.is_equivalent_to(b.sharding, b.ndim)
    for g, b in zip(leaves, jax.tree.leaves(state.grads))
  )


def check_microbatch(
  state: AccumState, grads: Any, weight: Any, name: str
) -> tuple[list[Any], bool]:
  """:func:`weighted_accum._accum.check_microbatch`, skipped for an eager
  call whose signature passed before.

  Returns:
    The grads' leaves in the buffers' order, and whether every one of them
    is known to sit on its buffer's sharding already.
  """
  if is_traced(weight):
    return _accum.check_microbatch(state, grads, weight, name), False
  grads_sig, leaves = _signature(grads)
  bufs_sig, _ = _signature(state.grads)
  if grads_sig is None or bufs_sig is None:
    return _accum.check_microbatch(state, grads, weight, name), False
  key = (name, grads_sig, bufs_sig)
  hit = _VALIDATED.get(key)
  if hit is not None:
    # Values are checked on every call: only the structure is cached.
    _accum.check_room(state, _accum.convert_weight(state, weight, name), name)
    return leaves, hit
  leaves = _accum.check_microbatch(state, grads, weight, name)
  placed = _on_buffer_shardings(state, leaves)
  if len(_VALIDATED) >= _MAX_ENTRIES:
    del _VALIDATED[next(iter(_VALIDATED))]  # the oldest
  _VALIDATED[key] = placed
  return leaves, placed
