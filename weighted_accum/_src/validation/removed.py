"""Spellings removed in version 1.0, refused with the new one.

``refuse_removed`` decorates a public function whose keyword (or trailing
positional argument) was removed; ``removed_attribute`` is a namespace's
``__getattr__`` for a removed name. Each error names the new spelling and
points to ``CHANGELOG.md``'s migration table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import functools
from typing import Any

from weighted_accum._src.errors import WeightedAccumulationError

_SEE = " (CHANGELOG.md, 'Migrating to 1.0', lists every change.)"


def refuse_removed(
  arity: int | None = None, **moved: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """A decorator: a call passing a removed keyword in ``moved`` (or, past
  ``arity`` positional arguments, the removed ones in ``moved``'s order)
  raises a ``WeightedAccumulationError`` naming the new spelling."""

  def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def refusing(*args: Any, **kwargs: Any) -> Any:
      extra = list(moved)[: max(0, len(args) - arity)] if arity else []
      for name in [k for k in kwargs if k in moved] + extra:
        raise WeightedAccumulationError(
          f"{fn.__name__}({name}=...): this argument was removed in "
          f"version 1.0. {moved[name]}{_SEE}"
        )
      return fn(*args, **kwargs)

    return refusing

  return wrap


def removed_attribute(
  namespace: str, moved: Mapping[str, str]
) -> Callable[[str], Any]:
  """A module ``__getattr__``: a removed name raises an ``AttributeError``
  naming its new spelling; any other unknown name the usual one."""

  def getattr_(name: str) -> Any:
    if name in moved:
      raise AttributeError(
        f"{namespace}.{name} was removed in version 1.0: {moved[name]}{_SEE}"
      )
    raise AttributeError(f"module {namespace!r} has no attribute {name!r}")

  return getattr_
