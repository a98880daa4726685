"""Opening and filling a global window: ``init``, ``from_buffers``, the one
accumulate path ``add`` and ``set_loss_scale``.

Each validates its inputs (``validation``; on every call, eager ones too),
then runs a jitted kernel that inlines into the caller's ``jit`` and
updates donated buffers in place (``docs/design.md``, "Performance rules").
Windows are closed in :mod:`weighted_accum._src.core.window`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import functools
import math
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError

# ------------------------------------------------------------------- init --


def init(
  params: Any, dtype: DTypeLike = jnp.float32, loss_scale: ArrayLike = 1.0
) -> AccumState:
  """An empty global window of ``params`` (``wa.init`` without
  ``axis_name``): validated dtype (``None``: the params'), scale and
  params, zero buffers on the params' shardings."""
  named = tree_utils.flat(params)
  tree_utils.check_leaves_floating(
    named,
    what="init(params)",
    hint="Only floating params have gradients (complex ones are not "
    "supported: hold their real and imaginary parts): pass just the "
    "trainable leaves, e.g. nnx.state(model, nnx.Param) or eqx.filter(model, "
    "eqx.is_inexact_array).",
  )
  if dtype is None:  # optax's accumulator_dtype=None: as the params
    dtype = _params_dtype(named)
  dt = validation.work_dtype(dtype, what="init(dtype=...)")
  ls = validation.loss_scale(
    loss_scale, what="init(loss_scale=...)", dtype=numerics.tally_dtype(dt)
  )
  validation.one_device_set([("", params)], what="init(params)")
  buffers = _follow_committed(
    jax.tree.map(lambda p: tree_utils.zeros_like(p, dt), params)
  )
  counters = base.initial(work_dtype=dt, loss_scale=ls)
  return AccumState(
    grads=buffers, dtype=dt, **tree_utils.commit_like(counters, buffers)
  )


def _params_dtype(named: list[tuple[str, Any]]) -> np.dtype:
  """The params' one dtype (what ``dtype=None`` means)."""
  dtypes = sorted({str(tree_utils.leaf_dtype(p)) for _, p in named})
  if len(dtypes) != 1:
    raise WeightedAccumulationError(
      f"init(dtype=None): None means the params' dtype, but they have "
      f"{dtypes or 'no leaves'}, and a window has one work dtype. Pass it, "
      "e.g. jnp.float32 (WeightedMultiSteps: accumulator_dtype=)."
    )
  return np.dtype(dtypes[0])


def _follow_committed(buffers: Any) -> Any:
  """Uncommitted params' buffers put where the committed ones are (as ``jit`` would)."""
  target = tree_utils.replicated_sharding(buffers)
  if target is None:
    return buffers

  def place(b):
    concrete = isinstance(b, jax.Array) and not tree_utils.is_traced(b)
    return jax.device_put(b, target) if concrete and not b.committed else b

  return jax.tree.map(place, buffers)


# ----------------------------------------------------------- from_buffers --


def _buffers_dtype(named: list[tuple[str, Any]]) -> np.dtype:
  """The one floating dtype of restored buffers (float32 if there are none)."""
  tree_utils.check_leaves_floating(named, what="from_buffers(buffers)")
  # A buffer's own dtype: a NumPy float64 buffer is float64, not the float32
  # JAX would silently make of it without x64.
  dtypes = [tree_utils.leaf_dtype(b) for _, b in named]
  if len(set(dtypes)) > 1:
    odd = sorted(set(dtypes), key=str)[-1]
    raise WeightedAccumulationError(
      "from_buffers(buffers): buffers mix dtypes "
      f"{sorted(map(str, set(dtypes)))} (e.g. leaf "
      f"{named[dtypes.index(odd)][0]}); an accumulator has one work dtype. "
      "Restore every buffer in the dtype it was saved in."
    )
  return validation.work_dtype(
    dtypes[0] if dtypes else jnp.float32, what="from_buffers(buffers)"
  )


def check_restored(
  counters: Any, named: Iterable[tuple[str, Any]], dtype: Any, *, what: str
) -> dict[str, Any]:
  """A saved window's counters as stored (``validation.saved_counters``),
  its ``named`` buffers zero if its weight is: ``from_buffers``' check and
  the restore's."""
  c = validation.saved_counters(
    counters,
    base.COUNTERS,
    lambda name: base.dtype_of(name, dtype),
    what=what,
  )
  if c["weight_hi"] + c["weight_lo"] == 0:
    for path, b in named:  # only positive-weight microbatches add
      if bool(jnp.any(numerics.nonzero(b))):  # on the bits: subnormals count
        raise WeightedAccumulationError(
          f"{what}: the total weight is 0, but buffer {path} is non-zero: "
          "restore the buffers and counters of one save."
        )
  return c


def _param_sharding(param: Any) -> jax.sharding.Sharding | None:
  """A param's sharding (None for tracers and host values)."""
  if tree_utils.is_traced(param):
    return None
  sharding = getattr(param, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _place(buf: Any, param: Any, path: str, dtype: np.dtype) -> jax.Array:
  target = _param_sharding(param)
  if target is None:
    return jnp.asarray(buf, dtype)
  if isinstance(buf, jax.Array):
    if not buf.sharding.is_equivalent_to(target, buf.ndim):
      raise WeightedAccumulationError(
        f"from_buffers(buffers): leaf {path} is placed on {buf.sharding}, "
        f"but its param is on {target}. Restore it onto the param's "
        "sharding (e.g. jax.device_put(buf, param.sharding))."
      )
    return buf
  if not getattr(param, "committed", True):  # as the param: uncommitted
    return jnp.asarray(np.asarray(buf, dtype))
  return jax.device_put(np.asarray(buf, dtype), target)


def from_buffers(
  params: Any, buffers: Any, counters: Mapping[str, Any]
) -> AccumState:
  """Reattaches restored buffers and counters to ``params``, validated.

  Use it when the buffers were restored by other means than
  :mod:`weighted_accum.checkpoint` (a custom store, ``np.load``...).

  Args:
    params: the params the buffers belong to (defines paths, shapes and
      placement).
    buffers: a tree with exactly ``params``' leaf paths and shapes, all in
      one floating work dtype. Host (NumPy) leaves are put on the param's
      sharding; device arrays must already be on it.
    counters: the saved :attr:`AccumState.counters` (``total_weight`` may
      replace ``weight_hi``/``weight_lo``).

  Returns:
    An :class:`~weighted_accum.AccumState` that continues the saved window
    exactly.

  Raises:
    WeightedAccumulationError: naming the first offending leaf path or
      counter.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.zeros(2)}
    >>> s = wa.accumulate_sum(wa.init(params), {'w': jnp.ones(2)}, 5)
    >>> r = wa.from_buffers(params, s.grads, s.counters)
    >>> r.total_weight, int(r.issued)
    (5.0, 1)
  """
  leaves = tree_utils.match_tree(
    params, buffers, what="from_buffers(buffers)", ref_name="params"
  )
  validation.one_device_set([("", params)], what="from_buffers(params)")
  paths = tree_utils.leaf_paths(params)
  dtype = _buffers_dtype(list(zip(paths, leaves)))
  p_leaves, treedef = jax.tree.flatten(params)
  placed = [
    _place(b, p, path, dtype) for b, p, path in zip(leaves, p_leaves, paths)
  ]
  c = check_restored(
    counters, zip(paths, placed), dtype, what="from_buffers(counters)"
  )
  return AccumState(
    grads=jax.tree.unflatten(treedef, placed),
    dtype=dtype,
    **tree_utils.commit_like(base.initial(work_dtype=dtype, **c), placed),
  )


# ------------------------------------------------------------- accumulate --


def check_structure(state: AccumState, grads: Any, name: str) -> list[Any]:
  """The structural checks of one microbatch's grads against the buffers;
  returns the grads' leaves in the buffers' order."""
  leaves = tree_utils.match_tree(state.grads, grads, what=f"{name}(grads)")
  named = list(zip(tree_utils.leaf_paths(state.grads), leaves))
  tree_utils.check_leaves_floating(named, what=f"{name}(grads)")
  return leaves


def convert_weight(
  state: AccumState, weight: Any, name: str
) -> validation.Weight:
  """The weight converted to the state's tally dtype (raises for a concrete
  one it cannot hold; see ``docs/inputs.md``)."""
  return validation.weight(
    weight, what=f"{name}(weight)", tally=state.weight_hi.dtype
  )


def check_room(state: AccumState, w: validation.Weight, name: str) -> None:
  """Eagerly refuses a microbatch the state cannot record (the kernel
  rejects it under ``jit``): a window whose loss scale is unusable, a full
  ``issued`` counter, a total weight beyond the tally's range."""
  values = (state.loss_scale, state.issued, state.weight_hi, w.hi, w.lo)
  if any(tree_utils.is_traced(v) for v in values):
    return
  ls = float(np.asarray(state.loss_scale))
  if not (math.isfinite(ls) and ls > 0):
    raise WeightedAccumulationError(
      f"{name}(state): the window's loss scale is {ls!r} (an invalid traced "
      "loss scale was given to init, set_loss_scale or as next_loss_scale), "
      "so its microbatches cannot be used. Start a window with a valid "
      "next_loss_scale (finish_sums(state, next_loss_scale=...))."
    )
  if int(state.issued) >= validation.INT32_MAX:
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


def _on_buffer_shardings(state: AccumState, leaves: list[Any]) -> list[Any]:
  """Eagerly, grads moved onto their buffers' shardings."""
  out = []
  for g, b in zip(leaves, jax.tree.leaves(state.grads)):
    if (
      isinstance(g, jax.Array)
      and isinstance(b, jax.Array)
      and not tree_utils.is_traced(g)
      and not tree_utils.is_traced(b)
      and not g.sharding.is_equivalent_to(b.sharding, b.ndim)
    ):
      g = jax.device_put(g, b.sharding)
    out.append(g)
  return out


@functools.partial(jax.jit, static_argnames=("mean",))
def _kernel(
  state: AccumState, leaves: list[Any], weight: validation.Weight, mean: bool
) -> AccumState:
  hi, lo = numerics.two_sum_add(state.weight_hi, state.weight_lo, weight.hi)
  hi, lo = numerics.two_sum_add(hi, lo, weight.lo)
  # Rejected whole (and counted): an invalid weight, a window whose loss scale
  # is unusable, a total the tally cannot hold, a full counter.
  room = state.issued < validation.INT32_MAX
  valid = (
    weight.ok & validation.scale_ok(state.loss_scale) & jnp.isfinite(hi) & room
  )
  # weight.hi is zero or a normal number (subnormals were refused): the
  # comparison reads the same in every fusion.
  take = valid & (weight.hi > 0)
  dt = state.dtype
  ct = numerics.compute_dtype(dt)
  # The microbatch's weight where it is taken, else 0; positive exactly
  # where it is taken (a taken weight is normal and positive). One scalar
  # that every leaf's loop reads (numerics.computed_once).
  w = jnp.where(take, weight.hi.astype(ct) + weight.lo.astype(ct), 0)
  w = numerics.computed_once(w)

  def update(buf, g):
    # Convert first, then scale (docs/design.md, "The math").
    contrib = numerics.mean_contribution(g, w, dt) if mean else g.astype(dt)
    # A select, not a multiplication: a zero-weight or rejected microbatch
    # adds nothing even when its grads are NaN/Inf (0 * NaN would leak). Fuses
    # into one read-read-write loop per leaf.
    return buf + jnp.where(w > 0, contrib, jnp.zeros((), dt))

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
  grads: Any,
  weight: Any,
  *,
  mean: bool,
  checked: bool = False,
  name: str,
  allow_reduced: bool = False,
) -> AccumState:
  """Validates one microbatch and adds it: the one accumulate path.

  The weight is converted once (``validation.weight``; an already converted
  ``validation.Weight`` passes through). Under ``jit`` an invalid weight
  rejects the microbatch whole (counted in ``rejected``); with ``checked`` a
  ``checkify`` check reports it too. ``allow_reduced``: the caller handles
  grads autodiff already summed over a data axis
  (:mod:`weighted_accum.distributed`); else they are refused.
  """
  validation.instance(
    state,
    AccumState,
    what=f"{name}(state)",
    hint="Pass the window from wa.init (or the previous call) first, then "
    "the grads and the weight.",
  )
  if state.placement.kind == base.STACKED:
    raise WeightedAccumulationError(
      f"{name}(state): this window is stacked per replica over "
      f"{state.placement.axes} (wa.init(..., axis_name=...) outside "
      "shard_map). Add to it inside shard_map over those axes (pass it in "
      "with weighted_accum.distributed.window_specs(state)), or with "
      "f.accumulate of microbatched_value_and_grad(..., axis_name=...) "
      "under jit."
    )
  checked = validation.static_flag(checked, what=f"{name}(checked=...)")
  leaves = check_structure(state, grads, name)
  w = convert_weight(state, weight, name)
  check_room(state, w, name)
  if not allow_reduced and tree_utils.is_traced(w.hi):
    # Only a traced weight can vary over mesh axes: the leaves' paths (for
    # the error) are not built on eager calls.
    tree_utils.check_not_reduced_against_weight(
      list(zip(tree_utils.leaf_paths(state.grads), leaves)),
      w.hi,
      what=f"{name}(grads)",
    )
  if checked and tree_utils.is_traced(w.ok):
    checkify.check(
      w.ok,
      name + ": weight {w} is not a finite non-negative item count the "
      "weight tally holds; the microbatch was rejected (state.rejected "
      "counts it).",
      w=jnp.asarray(weight).astype(jnp.float32),
    )
  return _kernel(state, _on_buffer_shardings(state, leaves), w, mean=mean)


# --------------------------------------------------------- set_loss_scale --


def _is_empty(state: AccumState, ls: Any) -> jax.Array:
  """Whether the whole window (every replica) holds no weight."""
  pl = state.placement
  empty = jnp.all((state.weight_hi == 0) & (state.weight_lo == 0))
  if pl.kind != base.GLOBAL and tree_utils.bound(pl.axes):
    validation.shared(ls, pl.axes, what="set_loss_scale(loss_scale)")
    if pl.per_replica:
      held = jax.lax.psum((~empty).astype(jnp.int32), pl.axes)
      empty = held == 0
  return empty


def _set_scale(state: AccumState, ls: Any, checked: bool) -> AccumState:
  ls = jnp.asarray(ls, state.loss_scale.dtype)
  empty = _is_empty(state, ls)
  ok = validation.scale_ok(ls)
  if checked and (tree_utils.is_traced(ls) or tree_utils.is_traced(empty)):
    checkify.check(
      ok,
      "set_loss_scale: loss scale {s} is not a finite positive normal "
      "number; the window is unusable (its scale is NaN).",
      s=ls,
    )
    checkify.check(
      empty,
      "set_loss_scale: the open window already holds weight; the scale is "
      "constant within a window, so the window is unusable (its scale is "
      "NaN).",
    )
  nan = jnp.asarray(np.nan, ls.dtype)
  return state.replace(loss_scale=jnp.where(empty & ok, ls, nan))
