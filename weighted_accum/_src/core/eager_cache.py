"""The structural checks of an eager microbatch, remembered per signature of
the grads and the buffers (and the state an entry point last returned);
rationale: ``docs/design.md``, "The eager validation cache"."""

from __future__ import annotations

import operator
from typing import Any
import weakref

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
  """``(signature, leaves)``: the treedef and each leaf's aval and sharding
  (``None`` when a leaf is traced or unhashable)."""
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


# entry point -> (weakref to the state it last returned, the grads'
# signature of that call, what the validation returned).
_LAST: dict[str, tuple[Any, Any, Any]] = {}


def last_output(name: str, state: Any, grads_sig: Any) -> Any:
  """What the validation returned for the call of ``name`` that returned
  ``state`` (the very object) with grads of ``grads_sig``; else ``None``."""
  entry = _LAST.get(name)
  if entry is None or grads_sig is None:
    return None
  ref, sig, value = entry
  return value if ref() is state and sig == grads_sig else None


def remember_output(name: str, state: Any, grads_sig: Any, value: Any) -> None:
  """Records that the call of ``name`` with grads of ``grads_sig`` returned
  ``state`` (buffers shaped and placed as the validated ones)."""
  if grads_sig is None:
    return
  try:
    _LAST[name] = (weakref.ref(state), grads_sig, value)
  except TypeError:  # not weakly referenceable: no fast path
    _LAST.pop(name, None)


def clear() -> None:
  """Forgets every signature (tests use it)."""
  _VALIDATED.clear()
  _LAST.clear()
