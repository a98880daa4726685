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

The usual loop hands each call the state the previous call returned: those
buffers are the kernel's outputs for buffers validated with grads of the same
signature, so :func:`last_output` recognises that state (by identity, held
weakly) and the buffers' signature is not read again.
"""

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


# entry point -> (weakref to the state it last returned, the grads'
# signature of that call, what the validation returned).
_LAST: dict[str, tuple[Any, Any, Any]] = {}


def last_output(name: str, state: Any, grads_sig: Any) -> Any:
  """What the validation returned for the call of ``name`` that returned
  ``state`` (the very object), when ``grads_sig`` is that call's grads
  signature; else ``None``."""
  entry = _LAST.get(name)
  if entry is None or grads_sig is None:
    return None
  ref, sig, value = entry
  return value if ref() is state and sig == grads_sig else None


def remember_output(name: str, state: Any, grads_sig: Any, value: Any) -> None:
  """Records that the call of ``name`` with grads of ``grads_sig`` returned
  ``state`` (its buffers are the kernel's outputs: same structure, shapes,
  dtypes and placement as the validated buffers)."""
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
