"""The one placement check (:func:`where`) and each entry point's path for
every kind of window. What each context computes: ``docs/scaling.md``."""

from __future__ import annotations

import functools
from typing import Any

import jax

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import finishing
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import distributed
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel import spmd_layout as layout_

#: What :func:`where` returns: a global window (or one holding global sums)
#: closed as one; a per-replica window inside its ``shard_map``; a stacked
#: window's block inside it; a stacked window under plain ``jit``.
GLOBAL, REPLICA, BLOCK, STACKED = "global", "replica", "block", "stacked"

#: The entry points that compute a mean (refuse a global window's local sums).
MEANS = ("finish_mean", "peek_mean", "apply_window")


def _err(what: str, msg: str) -> WeightedAccumulationError:
  return WeightedAccumulationError(f"{what}(state): {msg}")


def where(
  state: AccumState, what: str, *, adds: bool = False, caller: Any = None
) -> tuple[str, AccumState]:
  """How ``state`` is read here (placement and context), and the window as
  read there (a stacked one on the caller's mesh); names a mismatch."""
  pl = state.placement
  base.check_scalar(state, what)
  manual = set(tree_utils.manual_axes())
  if pl.kind == base.GLOBAL:
    local = manual & tree_utils.varying_axes(state.weight_hi)
    if local and what in MEANS:
      raise _err(
        what,
        f"this global window holds per-replica sums over {sorted(local)}: "
        "use wa.init(params, axis_name=...), or finish_sums + reduce_sums.",
      )
    return GLOBAL, state
  if pl.kind == base.REPLICA:
    if pl.reduce == "microbatch" and not adds:
      return GLOBAL, state  # it holds the global sums and counts
    validation.bound_axes(pl.axes, what=f"{what}(state)")
    return REPLICA, state
  inside = manual & set(pl.axes)
  if inside and not tree_utils.bound(pl.axes):
    raise _err(
      what,
      f"stacked over {pl.axes}, but only {sorted(inside)} are shard_map "
      "axes here: enter shard_map over all of them (window_specs).",
    )
  if tree_utils.bound(pl.axes):
    replicas.check_block(state, 1, what)
    return BLOCK, state
  if adds:
    raise _err(
      what,
      f"stacked per replica over {pl.axes}: add to it inside shard_map "
      "(window_specs) or by microbatched_value_and_grad(..., axis_name=...).",
    )
  state = replicas.home(state, caller, what)
  replicas.check_block(state, layout_.size(pl.mesh, pl.axes), what)
  return STACKED, state


def _on_block(fn, state: AccumState, *args, **kw):
  """``fn`` on this replica's window of a stacked block, re-stacked after."""
  axes = state.placement.axes
  out = fn(replicas.unstack(state, axes, None), *args, **kw)
  if isinstance(out, AccumState):
    return replicas.stack(out, axes)
  return tuple(
    replicas.stack(x, axes) if isinstance(x, AccumState) else x for x in out
  )


def accumulate(state, grads, weight, *, mean, checked, name) -> AccumState:
  """Adds a microbatch as the window's placement says."""
  kw = dict(mean=mean, checked=checked, name=name)
  at, state = where(state, name, adds=True)
  if at == BLOCK:
    return _on_block(accumulate, state, grads, weight, **kw)
  if at == REPLICA:
    return distributed.accumulate(state, grads, weight, **kw)
  new = accumulation.add(state, grads, weight, **kw)
  # Inside shard_map local grads mark the global window's weight local.
  local = set(tree_utils.manual_axes()) & set().union(
    *(
      tree_utils.varying_axes(g) - tree_utils.varying_axes(b)
      for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(state.grads))
    )
  )
  axes = tuple(sorted(local))
  pair = {k: tree_utils.to_varying(getattr(new, k), axes) for k in window.PAIR}
  return new.replace(**pair) if axes else new


def finish_mean(state, ls, checked, what: str = "finish_mean"):
  """``wa.finish_mean`` of a window as placed."""
  (at, state), axes = where(state, what), state.placement.axes
  if not tree_utils.is_traced(state.weight_hi):
    validation.nonempty_window(state, what=what)
  if at == BLOCK:
    return _on_block(finish_mean, state, ls, checked, what)
  if at == STACKED:
    return replicas.finish_mean(state, axes, ls)
  if at == GLOBAL:
    return finishing.finish_global(state, ls, checked)
  return window.finish(
    state, mean=True, next_loss_scale=ls, axes=axes, what=what
  )


def finish_sums(state, ls):
  """``wa.finish_sums``: unreduced sums, so not of a stacked window."""
  if where(state, "finish_sums")[0] in (BLOCK, STACKED):
    finishing.one_window(state, "finish_sums")
  return finishing._finish_kernel(state, ls, mean=False)


def apply_window(tx, state, params, opt_state, ls):
  """``wa.apply_window`` of a window as placed."""
  at, state = where(state, "apply_window", caller=replicas.caller_mesh(params))
  axes, held = state.placement.axes, [("state.grads", state.grads)]
  held += [("params", params), ("opt_state", opt_state)]
  validation.one_device_set(held, what="apply_window")
  if at == BLOCK:
    fn = functools.partial(apply_window, tx)
    return _on_block(fn, state, params, opt_state, ls)
  if at != STACKED:
    axes = axes if at == REPLICA else ()
    return finishing.apply_global(tx, state, params, opt_state, ls, axes)
  row = lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype)
  rows, buffers = jax.tree.map(row, state.grads), "the accumulator's buffers"
  what = "apply_window(params)"
  tree_utils.match_tree(rows, params, what=what, ref_name=buffers)
  return _apply_stacked(tx, state, params, opt_state, ls, axes)


def _explicit_leaves(params, axes: tuple[str, ...]) -> tuple:
  """Each param's layout over Explicit data axes (reduce-scattered there)."""
  return tuple(
    layout_.leaf(
      jax.typeof(p).sharding.spec, axes, p.ndim, path, what="apply_window"
    )
    for path, p in tree_utils.flat(params)
  )


@functools.partial(jax.jit, static_argnums=(0, 5))
def _apply_stacked(tx, state, params, opt_state, next_loss_scale, axes):
  """A stacked window applied under plain ``jit``."""
  mesh = layout_.find_mesh([state.weight_hi], axes, what="apply_window")
  if not layout_.explicit(mesh, axes, what="apply_window"):
    glob = replicas.to_global(state, axes, mesh)
  else:
    glob = replicas.to_global(state, axes, mesh, _explicit_leaves(params, axes))
    reshard = lambda g, p: jax.sharding.reshard(g, jax.typeof(p).sharding.spec)
    glob = glob.replace(grads=jax.tree.map(reshard, glob.grads, params))
  params, opt_state, closed, out = finishing._apply_window_kernel(
    tx, glob, params, opt_state, next_loss_scale, ()
  )
  return params, opt_state, replicas.next_window(state, closed), out
