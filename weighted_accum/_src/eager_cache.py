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

_MAX_ENTRIES = 256
# signature -> what the validation returned (here: whether every grads leaf
# is already on its buffer's sharding).
_VALIDATED: dict[Any, Any] = {}
# A jax.Array's abstract value (shape, dtype, weak type) and its sharding
# (compared by value), read in C: half the cost of reading each fact.
_FACTS = operator.attrgetter("aval", "sharding")


def _generic_facts(x: Any) -> Any:
  if isinstance(x, jax.Array):
    return _FACTS(x)
  return type(x), np.shape(x), np.result_type(x)


def signature(tree: Any) -> tuple[Any | None, list[Any]]:
  """``(signature, leaves)``: the treedef and, per leaf, its abstract value
  (shape, dtype, weak type) and sharding. ``None`` for a signature when a
  leaf is traced or has facts that cannot be hashed."""
  leaves, treedef = jax.tree.flatten(tree)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return None, leaves
  try:
    sig = tuple(map(_FACTS, leaves))
    hash(sig)
  except (AttributeError, TypeError):  # NumPy arrays, Python scalars
    try:
      sig = tuple(map(_generic_facts, leaves))
      hash(sig)
    except TypeError:
      return None, leaves
  return (treedef, sig), leaves


def lookup(key: Any) -> Any:
  """What :func:`remember` stored under ``key``, or ``None``."""
  return _VALIDATED.get(key)


def remember(key: Any, value: Any) -> None:
  """Stores ``value`` under ``key``, evicting the oldest entry when full."""
  if len(_VALIDATED) >= _MAX_ENTRIES:
    del _VALIDATED[next(iter(_VALIDATED))]
  _VALIDATED[key] = value


def clear() -> None:
  """Forgets every signature (tests use it)."""
  _VALIDATED.clear()
