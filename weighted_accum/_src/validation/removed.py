"""Spellings removed in version 1.0, each refused naming the new one."""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

from weighted_accum._src.errors import WeightedAccumulationError

#: Every removed spelling and its new one, as CHANGELOG.md's migration table.
MOVED = {
  "wa.AccumSave": "wa.checkpoint.AccumSave",
  "wa.AccumRestore": "wa.checkpoint.AccumRestore",
  "wa.abstract_state": "wa.checkpoint.abstract_state",
  "wa.local_grad": "wa.distributed.local_grad",
  "wa.local_value_and_grad": "wa.distributed.local_value_and_grad",
  "wa.reduce_sums": "wa.distributed.reduce_sums",
  "wa.weighted_multi_steps": "wa.WeightedMultiSteps(...) (the same parameters)",
  "wa.distributed.init": "wa.init(params, axis_name=..., reduce=...)",
  "wa.distributed.accumulate_sum": "wa.accumulate_sum(state, grads, weight)",
  "wa.distributed.accumulate_mean": "wa.accumulate_mean(state, grads, weight)",
  "wa.distributed.finish_mean": "wa.finish_mean(state)",
  "wa.distributed.REDUCE_MODES": "wa.init(..., reduce='window' | 'microbatch')",
  "apply_window(axis_name=)": "wa.init(params, axis_name=...); apply_window(tx, state, ...)",
  "peek_mean(axis_name=)": "wa.init(params, axis_name=...); peek_mean(state)",
  "window_specs(axis_name=)": "wa.init(params, axis_name=...); window_specs(state)",
  "microbatched_value_and_grad(batch_argnames=)": "batch_argnums=('x', 'mask')",
  "microbatched_value_and_grad(in_axes=)": "batch_argnums={1: 0, 'mask': 1} (arg: axis)",
  "microbatched_value_and_grad(data_axes=)": "axis_name=... (under jit: the global batch)",
  "microbatched_value_and_grad(param_specs=)": "axis_name=DataParallel(axes, param_specs=...)",
  "microbatched_value_and_grad(fsdp=)": "axis_name=DataParallel(axes, fsdp=...)",
}


def _message(old: str) -> str:
  return f"{old} was removed in version 1.0: use {MOVED[old]} (CHANGELOG.md)."


def refuse_removed(*names: str, arity: int | None = None) -> Callable:
  """Decorates a public function: its removed keywords ``names`` (or,
  past ``arity`` positional arguments, those in order) are refused."""

  def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def refusing(*args: Any, **kwargs: Any) -> Any:
      extra = names[: max(0, len(args) - arity)] if arity else ()
      for name in [k for k in kwargs if k in names] + list(extra):
        raise WeightedAccumulationError(_message(f"{fn.__name__}({name}=)"))
      return fn(*args, **kwargs)

    return refusing

  return wrap


def removed_attribute(module: str) -> Callable[[str], Any]:
  """A module ``__getattr__`` refusing the module's removed names."""

  def getattr_(name: str) -> Any:
    old = f"{module.replace('weighted_accum', 'wa', 1)}.{name}"
    if old in MOVED:
      raise AttributeError(_message(old))
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return getattr_
