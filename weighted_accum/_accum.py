"""Private accumulation step: the checks of a microbatch and the in-place
kernel that adds it, shared by :mod:`weighted_accum.core` and
:mod:`weighted_accum.distributed` (which validates once, then adds).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from weighted_accum import _arith
from weighted_accum import _inputs
from weighted_accum import _tally
from weighted_accum import _tree
from weighted_accum import errors
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.state import AccumState


def check_microbatch(
  state: AccumState,
  grads: Any,
  weight: Any,
  name: str,
  *,
  allow_reduced: bool = False,
) -> list[Any]:
  """The structural checks of one microbatch (and of a concrete weight);
  returns the grads' leaves in the buffers' order.

  ``allow_reduced``: the caller handles grads autodiff already summed over
  a data axis (:mod:`weighted_accum.distributed`); else they are refused.
  """
  leaves = _tree.match_tree(state.grads, grads, what=f"{name}(grads)")
  named = list(zip(_tree.leaf_paths(state.grads), leaves))
  _tree.check_leaves_floating(named, what=f"{name}(grads)")
  check_room(state, convert_weight(state, weight, name), name)
  if not allow_reduced:
    _tree.check_not_reduced_against_weight(named, weight, what=f"{name}(grads)")
  return leaves


def convert_weight(state: AccumState, weight: Any, name: str) -> _inputs.Weight:
  """The weight converted to the state's tally dtype (raises for a concrete
  one it cannot hold; see ``docs/inputs.md``)."""
  return errors.check_weight(
    weight, what=f"{name}(weight)", tally=state.weight_hi.dtype
  )


def check_room(state: AccumState, w: _inputs.Weight, name: str) -> None:
  """Eagerly refuses a microbatch the state cannot record (the kernel
  rejects it under ``jit``): a window whose loss scale is unusable, a full
  ``issued`` counter, a total weight beyond the tally's range."""
  values = (
    state.loss_scale,
    state.issued,
    state.weight_hi,
    state.weight_lo,
    w.hi,
    w.lo,
  )
  if any(_tree.is_traced(v) for v in values):
    return
  ls = float(np.asarray(state.loss_scale))
  if not (math.isfinite(ls) and ls > 0):
    raise WeightedAccumulationError(
      f"{name}(state): the window's loss scale is {ls!r} (an invalid traced "
      "loss scale was given to init or as next_loss_scale), so its "
      "microbatches cannot be used. Start a window with a valid "
      "next_loss_scale (finish_sums(state, next_loss_scale=...))."
    )
  if int(state.issued) >= _inputs.INT32_MAX:
    raise WeightedAccumulationError(
      f"{name}(state): 'issued' is {int(state.issued)}, the most an int32 "
      "counter holds. Finish the window first."
    )
  total = state.total_weight + float(w.hi) + float(w.lo)
  if total > float(np.finfo(state.weight_hi.dtype).max):
    raise WeightedAccumulationError(
      f"{name}(weight): the window's total weight would become {total!r}, "
      f"beyond the {state.weight_hi.dtype} tally's range. Finish the window "
      "first, or scale all weights down by a common factor."
    )


@functools.partial(jax.jit, static_argnames=("mean",))
def _kernel(
  state: AccumState, leaves: list[Any], weight: _inputs.Weight, mean: bool
) -> AccumState:
  hi, lo = _tally.two_sum_add(state.weight_hi, state.weight_lo, weight.hi)
  hi, lo = _tally.two_sum_add(hi, lo, weight.lo)
  # Rejected whole (and counted): an invalid weight, a window whose loss scale
  # is unusable, a total the tally cannot hold, a full counter.
  room = state.issued < _inputs.INT32_MAX
  valid = (
    weight.ok & _inputs.scale_ok(state.loss_scale) & jnp.isfinite(hi) & room
  )
  # weight.hi is zero or a normal number (subnormals were refused): the
  # comparison reads the same in every fusion.
  take = valid & (weight.hi > 0)
  dt = state.dtype
  ct = _arith.compute_dtype(dt)
  w = weight.hi.astype(ct) + weight.lo.astype(ct)

  def update(buf, g):
    # Convert first, then scale (docs/design.md, "The math").
    contrib = _arith.mean_contribution(g, w, dt) if mean else g.astype(dt)
    # A select, not a multiplication: a zero-weight or rejected microbatch
    # adds nothing even when its grads are NaN/Inf (0 * NaN would leak). Fuses
    # into one read-read-write loop per leaf.
    return buf + jnp.where(take, contrib, jnp.zeros((), dt))

  buf_leaves, treedef = jax.tree.flatten(state.grads)
  new_buffers = jax.tree.unflatten(
    treedef, [update(b, g) for b, g in zip(buf_leaves, leaves)]
  )
  one = jnp.int32(1)
  return state.replace(
    grads=new_buffers,
    issued=state.issued + jnp.where(room, one, 0),
    zero_weight=state.zero_weight + jnp.where(valid & ~take, one, 0),
    rejected=state.rejected + jnp.where(valid | ~room, 0, one),
    weight_hi=jnp.where(take, hi, state.weight_hi),
    weight_lo=jnp.where(take, lo, state.weight_lo),
  )


def add(
  state: AccumState,
  leaves: list[Any],
  weight: Any,
  *,
  mean: bool,
  checked: bool,
  name: str,
  placed: bool = False,
) -> AccumState:
  """Adds one microbatch whose ``leaves`` passed :func:`check_microbatch`.

  Under ``jit`` an invalid weight rejects the microbatch whole (counted in
  ``rejected``); with ``checked`` a ``checkify`` check reports it too.
  """
  checked = _inputs.static_flag(checked, what=f"{name}(checked=...)")
  w = convert_weight(state, weight, name)
  if checked and _tree.is_traced(weight):
    checkify.check(
      w.ok,
      name + ": weight {w} is not a finite non-negative item count the "
      "weight tally holds; the microbatch was rejected (state.rejected "
      "counts it).",
      w=jnp.asarray(weight).astype(jnp.float32),
    )
  if not placed:  # else known to be on the buffers' shardings already
    leaves = _on_buffer_shardings(state, leaves)
  return _kernel(state, leaves, w, mean=mean)


def _on_buffer_shardings(state: AccumState, leaves: list[Any]) -> list[Any]:
  """Eagerly, moves grads sharded unlike their buffers onto the buffers'
  shardings, so the result keeps the params' placement (under ``jit`` the
  partitioner decides; params and grads normally agree there)."""
  out = []
  for g, b in zip(leaves, jax.tree.leaves(state.grads)):
    if (
      isinstance(g, jax.Array)
      and isinstance(b, jax.Array)
      and not _tree.is_traced(g)
      and not _tree.is_traced(b)
      and not g.sharding.is_equivalent_to(b.sharding, b.ndim)
    ):
      g = jax.device_put(g, b.sharding)
    out.append(g)
  return out
