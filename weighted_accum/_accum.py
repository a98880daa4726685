"""Private accumulation step: the checks of a microbatch and the in-place
kernel that adds it, shared by :mod:`weighted_accum.core` and
:mod:`weighted_accum.distributed` (which validates once, then adds).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp

from weighted_accum import _arith
from weighted_accum import _tree
from weighted_accum import errors
from weighted_accum import _tally
from weighted_accum.state import AccumState


def check_microbatch(state: AccumState, grads: Any, weight: Any, name: str,
                     *, allow_reduced: bool = False) -> list[Any]:
  """The structural checks of one microbatch (and of a concrete weight);
  returns the grads' leaves in the buffers' order.

  ``allow_reduced``: the caller handles grads autodiff already summed over
  a data axis (:mod:`weighted_accum.distributed`); else they are refused.
  """
  leaves = _tree.match_tree(state.grads, grads, what=f"{name}(grads)")
  named = list(zip(_tree.leaf_paths(state.grads), leaves))
  _tree.check_leaves_floating(named, what=f"{name}(grads)")
  errors.check_weight(weight, what=f"{name}(weight)")
  if not allow_reduced:
    _tree.check_not_reduced_against_weight(named, weight,
                                           what=f"{name}(grads)")
  return leaves


@functools.partial(jax.jit, static_argnames=("mean",))
def _kernel(state: AccumState, leaves: list[Any], weight: jax.Array,
            mean: bool) -> AccumState:
  w = jnp.asarray(weight, jnp.float32)
  valid = jnp.isfinite(w) & (w >= 0)
  take = valid & (w > 0)
  dt = state.dtype

  def update(buf, g):
    # Convert first, then scale (docs/design.md, "The math").
    contrib = _arith.mean_contribution(g, w, dt) if mean else g.astype(dt)
    # A select, not a multiplication: a zero-weight or rejected microbatch
    # adds nothing even when its grads are NaN/Inf (0 * NaN would leak). Fuses
    # into one read-read-write loop per leaf.
    return buf + jnp.where(take, contrib, jnp.zeros((), dt))

  buf_leaves, treedef = jax.tree.flatten(state.grads)
  new_buffers = jax.tree.unflatten(
      treedef, [update(b, g) for b, g in zip(buf_leaves, leaves)])
  hi, lo = _tally.two_sum_add(state.weight_hi, state.weight_lo,
                             jnp.where(take, w, 0.0))
  one = jnp.int32(1)
  return state.replace(
      grads=new_buffers,
      issued=state.issued + one,
      zero_weight=state.zero_weight + jnp.where(valid & (w == 0), one, 0),
      rejected=state.rejected + jnp.where(valid, 0, one),
      weight_hi=hi,
      weight_lo=lo,
  )


def add(state: AccumState, leaves: list[Any], weight: Any, *, mean: bool,
        checked: bool, name: str) -> AccumState:
  """Adds one microbatch whose ``leaves`` passed :func:`check_microbatch`.

  Under ``jit`` an invalid weight rejects the microbatch whole (counted in
  ``rejected``); with ``checked`` a ``checkify`` check reports it too.
  """
  if checked and _tree.is_traced(weight):
    w = jnp.asarray(weight, jnp.float32)
    checkify.check(
        jnp.isfinite(w) & (w >= 0),
        name + ": weight {w} is not a finite non-negative item count; the "
        "microbatch was rejected (state.rejected counts it).", w=w)
  return _kernel(state, _on_buffer_shardings(state, leaves), weight,
                 mean=mean)


def _on_buffer_shardings(state: AccumState, leaves: list[Any]) -> list[Any]:
  """Eagerly, moves grads sharded unlike their buffers onto the buffers'
  shardings, so the result keeps the params' placement (under ``jit`` the
  partitioner decides; params and grads normally agree there)."""
  out = []
  for g, b in zip(leaves, jax.tree.leaves(state.grads)):
    if (isinstance(g, jax.Array) and isinstance(b, jax.Array)
        and not _tree.is_traced(g) and not _tree.is_traced(b)
        and not g.sharding.is_equivalent_to(b.sharding, b.ndim)):
      g = jax.device_put(g, b.sharding)
    out.append(g)
  return out
