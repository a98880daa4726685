"""Where a window is read: the one placement check (:func:`where`) and the
entry points' paths for every window but a global one under plain ``jit``,
registered in ``base.PLACED`` for the core entry points (core does not
import this layer). The contexts and what each computes: ``docs/scaling.md``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import finishing
from weighted_accum._src.core import open_window
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


def where(state: AccumState, what: str, *, adds: bool = False) -> str:
  """How ``state`` is read here, from its placement and this context
  (``shard_map`` axes, the counters' shapes, the mesh); names a mismatch."""
  pl, lead = state.placement, np.shape(state.weight_hi)
  manual = set(tree_utils.manual_axes())
  if pl.kind != base.STACKED and lead:
    raise _err(
      what,
      f"a {pl.kind} window has scalar counters, this one "
      f"{lead}: a jax.vmap batch of windows (read it under jax.vmap) or one "
      "restored into a template of another kind (use its abstract_state).",
    )
  if pl.kind == base.GLOBAL:
    local = manual & tree_utils.varying_axes(state.weight_hi)
    if local and what in MEANS:
      raise _err(
        what,
        f"this global window holds per-replica sums over "
        f"{tuple(sorted(local))}: make it with wa.init(params, axis_name=...)"
        ", or close it with finish_sums and distributed.reduce_sums.",
      )
    return GLOBAL
  if pl.kind == base.REPLICA:
    if pl.reduce == "microbatch" and not adds:
      return GLOBAL  # it holds the global sums and counts
    validation.bound_axes(pl.axes, what=f"{what}(state)")
    return REPLICA
  if manual & set(pl.axes) and not tree_utils.bound(pl.axes):
    raise _err(
      what,
      f"this window is stacked over {pl.axes}, but only "
      f"{tuple(sorted(manual & set(pl.axes)))} are shard_map axes here; "
      "enter shard_map over all of them (distributed.window_specs).",
    )
  if tree_utils.bound(pl.axes):
    replicas.check_block(state, 1, what)
    return BLOCK
  if adds:
    raise _err(
      what,
      f"this window is stacked per replica over {pl.axes}: "
      "add to it inside shard_map over those axes (distributed.window_specs), "
      "or with f.accumulate of microbatched_value_and_grad(..., axis_name=...).",
    )
  replicas.mesh_of(state, pl.axes, what)
  return STACKED


def init(params, axis_name, reduce, dtype, loss_scale) -> AccumState:
  """``wa.init(params, axis_name=...)``: see ``distributed.make``."""
  return distributed.make(params, axis_name, reduce, dtype, loss_scale)


def accumulate(state, grads, weight, *, mean, checked, name) -> AccumState:
  """Adds a microbatch as the window's placement says."""
  at = where(state, name, adds=True)
  if at == GLOBAL:  # inside shard_map: local grads mark the weight local
    new = accumulation.add(
      state, grads, weight, mean=mean, checked=checked, name=name
    )
    local = set(tree_utils.manual_axes()) & set().union(
      *(
        tree_utils.varying_axes(g) - tree_utils.varying_axes(b)
        for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(state.grads))
      )
    )
    axes = tuple(sorted(local))
    return (
      new.replace(
        **{k: tree_utils.to_varying(getattr(new, k), axes) for k in window.PAIR}
      )
      if axes
      else new
    )
  kw = dict(mean=mean, checked=checked, name=name)
  if at == BLOCK:
    axes = state.placement.axes
    inner = accumulate(replicas.unstack(state, axes, name), grads, weight, **kw)
    return replicas.stack(inner, axes)
  return distributed.accumulate(state, grads, weight, **kw)


def finish_mean(state, ls, checked):
  """``wa.finish_mean`` of a window that is not plain."""
  at = where(state, "finish_mean")
  if not tree_utils.is_traced(state.weight_hi):
    validation.nonempty_window(state, what="finish_mean")
  if at == GLOBAL:
    return finishing.finish_global(state, ls, checked)
  if at == BLOCK:
    axes = state.placement.axes
    out, new = finish_mean(
      replicas.unstack(state, axes, "finish_mean"), ls, checked
    )
    return out, replicas.stack(new, axes)
  if at == STACKED:
    return replicas.finish_mean(state, state.placement.axes, ls)
  out, new, _ = window.finish(
    state,
    mean=True,
    next_loss_scale=ls,
    axes=state.placement.axes,
    what="finish_mean",
  )
  return out, new


def finish_sums(state, ls):
  """``wa.finish_sums``: unreduced sums, so not of a stacked window."""
  if where(state, "finish_sums") in (BLOCK, STACKED):
    finishing.one_window(state, "finish_sums")
  return finishing._finish_kernel(state, ls, mean=False)


def peek_mean(state):
  """``wa.peek_mean`` of a window that is not plain."""
  at = where(state, "peek_mean")
  if not tree_utils.is_traced(state.weight_hi):
    validation.nonempty_window(state, what="peek_mean")
  if at == BLOCK:
    state, at = (
      replicas.unstack(state, state.placement.axes, "peek_mean"),
      REPLICA,
    )
  if at == STACKED:
    return _peek_stacked(state, state.placement.axes)
  axes = state.placement.axes if at == REPLICA else ()
  return open_window._peek_kernel(state, axes)


@functools.partial(jax.jit, static_argnums=1)
def _peek_stacked(state: AccumState, axes: tuple[str, ...]):
  """A stacked window's mean under plain ``jit``: one reduction first."""
  glob = replicas.to_global(
    state, axes, replicas.mesh_of(state, axes, "peek_mean")
  )
  return open_window._peek_kernel(glob, ())


def apply_window(tx, state, params, opt_state, ls):
  """``wa.apply_window`` of a window that is not plain."""
  what = "apply_window"
  at = where(state, what)
  if at == BLOCK:
    axes = state.placement.axes
    p, o, new, out = apply_window(
      tx, replicas.unstack(state, axes, what), params, opt_state, ls
    )
    return p, o, replicas.stack(new, axes), out
  if at != STACKED:
    return finishing.apply_global(
      tx,
      state,
      params,
      opt_state,
      ls,
      state.placement.axes if at == REPLICA else (),
    )
  tree_utils.match_tree(
    jax.tree.map(
      lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype), state.grads
    ),
    params,
    what=f"{what}(params)",
    ref_name="the accumulator's buffers",
  )
  return _apply_stacked(tx, state, params, opt_state, ls, state.placement.axes)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _apply_stacked(tx, state, params, opt_state, next_loss_scale, axes):
  """A stacked window applied under plain ``jit``."""
  mesh = replicas.mesh_of(state, axes, "apply_window")
  leaves, explicit = None, layout_.explicit(mesh, axes, what="apply_window")
  if explicit:
    leaves = tuple(
      layout_.leaf(
        jax.typeof(p).sharding.spec, axes, p.ndim, path, what="apply_window"
      )
      for path, p in tree_utils.flat(params)
    )
    # A reduce-scatter cannot keep another Explicit axis: psum those.
    leaves = tuple(
      e
      if {a for en in e.spec for a in layout_.names(en)} <= set(axes)
      else layout_.Leaf(e.spec)
      for e in leaves
    )
  glob = replicas.to_global(state, axes, mesh, leaves)
  if explicit:
    glob = glob.replace(
      grads=jax.tree.map(
        lambda g, p: jax.sharding.reshard(g, jax.typeof(p).sharding.spec),
        glob.grads,
        params,
      )
    )
  params, opt_state, closed, out = finishing._apply_window_kernel(
    tx, glob, params, opt_state, next_loss_scale, ()
  )
  return params, opt_state, replicas.next_window(state, closed), out


def check(state: AccumState, what: str) -> AccumState:
  """``state``, refused where its placement does not fit this context."""
  where(state, what)
  return state


base.PLACED.update(
  init=init,
  accumulate=accumulate,
  finish_mean=finish_mean,
  finish_sums=finish_sums,
  peek_mean=peek_mean,
  apply_window=apply_window,
  check=check,
)
