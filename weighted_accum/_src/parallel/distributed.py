"""Data parallelism inside ``jax.shard_map``: ``init``,
``accumulate_sum``/``accumulate_mean`` per replica, ``finish_mean`` and
``reduce_sums`` (one collective round per window). Local gradients
(``local_grad``, ``is_reduced``) are in ``local_grads``.

Under plain ``jax.jit`` over global arrays none of this is needed. The two
styles, the autodiff trap and when to reduce: ``docs/design.md`` ("Data
parallelism").
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils as _tree
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import local_grads
from weighted_accum._src.parallel import replicas

AxisName = str | Sequence[str]

REDUCE_MODES = ("window", "microbatch")

__all__ = [
  "REDUCE_MODES",
  "accumulate_mean",
  "accumulate_sum",
  "finish_mean",
  "init",
  "reduce_sums",
]


# ----------------------------------------------------------------- helpers --


def _axes(axis_name: Any, what: str) -> tuple[str, ...]:
  return validation.bound_axes(axis_name, what=what)


def _axes_size(axes: tuple[str, ...]) -> int:
  return math.prod(jax.lax.axis_size(a) for a in axes)


def _check_reduce(reduce: Any, what: str) -> str:
  return validation.choice(
    reduce,
    REDUCE_MODES,
    what=what,
    name="reduce",
    hint="Use 'window' (one all-reduce per window, the default) or "
    "'microbatch'.",
  )


# ------------------------------------------------------------ accumulation --


def init(
  params: Any,
  axis_name: AxisName,
  dtype: DTypeLike = jnp.float32,
  loss_scale: ArrayLike = 1.0,
) -> AccumState:
  """An empty per-replica window for ``reduce="window"``.

  Inside ``shard_map``: like :func:`weighted_accum.init`, then every
  per-replica leaf (buffers, counts, weight) is cast to varying over
  ``axis_name``, so the state can be the carry of a ``lax.scan`` over
  microbatches (whose carry type may not change). ``windows`` and
  ``loss_scale`` stay unvarying. For ``reduce="microbatch"`` use plain
  :func:`weighted_accum.init`: its state stays identical on every replica.

  Outside ``shard_map`` (params on a mesh with ``axis_name``): a STACKED
  window to carry between jitted steps, each per-replica field with a
  leading replica axis sharded over ``axis_name`` (buffers ``[N,
  *param.shape]``: full-size partial sums); see :func:`window_specs`.

  Args:
    params: the (local) params, as for :func:`weighted_accum.init`.
    axis_name: the data axis name, or a tuple of names.
    dtype: the work dtype.
    loss_scale: the window's loss scale, the same on every replica.

  Returns:
    An empty :class:`~weighted_accum.AccumState` typed per replica, or
    stacked outside ``shard_map``.

  Raises:
    WeightedAccumulationError: as :func:`weighted_accum.init`, for an axis
      not bound by the enclosing ``shard_map``, or (outside one) params on
      no mesh with ``axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from weighted_accum import distributed as dist
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> def f(p):
    ...   s = dist.init(p, 'data')
    ...   print(dist.is_reduced(s.grads, 'data'))
    ...   return p
    >>> _ = jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=P(),
    ...                                  out_specs=P()), jnp.zeros(3))
    False
  """
  if not _tree.manual_axes():  # outside shard_map: a stacked window
    names = validation.axis_names(axis_name, what="distributed.init")
    s = accumulation.init(params, dtype=dtype, loss_scale=loss_scale)
    return replicas.init(s, params, names, "distributed.init")
  axes = _axes(axis_name, "distributed.init")
  s = accumulation.init(params, dtype=dtype, loss_scale=loss_scale)
  per_replica = ("grads",) + base.named(base.SUMMED) + base.named(base.LOCAL)
  return s.replace(
    **{k: _tree.to_varying(getattr(s, k), axes) for k in per_replica}
  )


def _check_microbatch_mode(
  state: AccumState, axes: tuple[str, ...], what: str
) -> None:
  varying = [
    p for p, b in _tree.flat(state.grads) if _tree.varying_axes(b) & set(axes)
  ]
  if varying:
    raise WeightedAccumulationError(
      f"{what}(state): buffer {varying[0]} varies over {axes}: this "
      "window holds per-replica sums (reduce='window'). Keep one mode per "
      "window: pass reduce='window', or start the window with "
      "weighted_accum.init for reduce='microbatch'."
    )


def _accumulate(
  state: AccumState,
  grads: Any,
  weight: Any,
  axis_name: AxisName,
  *,
  mean: bool,
  reduce: str,
  checked: bool,
  name: str,
) -> AccumState:
  """Validates, then adds the microbatch (see ``docs/design.md``, "Data
  parallelism", for the cases)."""
  what = f"distributed.{name}"
  axes = _axes(axis_name, what)
  reduce = _check_reduce(reduce, what)
  validation.instance(
    state,
    AccumState,
    what=f"{what}(state)",
    hint="Pass the window from distributed.init (reduce='window') or "
    "weighted_accum.init (reduce='microbatch').",
  )
  if replicas.is_stacked(state):  # this replica's block of a stacked window
    kw = dict(mean=mean, reduce=reduce, checked=checked, name=name)
    state = replicas.unstack(state, axes, what)
    return replicas.stack(_accumulate(state, grads, weight, axes, **kw), axes)
  add = functools.partial(
    accumulation.add, checked=checked, name=what, allow_reduced=True
  )
  if reduce == "microbatch":
    if _tree.vma_checked(axes):
      _check_microbatch_mode(state, axes, what)
    contrib, gweight = reduce_microbatch(
      state, grads, weight, axes, mean=mean, what=what
    )
    return add(state, contrib, gweight, mean=False)
  leaves = accumulation.check_structure(state, grads, what)
  reduced = local_grads.leaf_status(
    leaves, _tree.leaf_paths(state.grads), axes, f"{what}(grads)"
  )
  if not reduced:
    return add(state, grads, weight, mean=mean)
  contrib, gweight = global_contribution(
    state, leaves, weight, axes, mean=mean, reduced=True, what=what
  )
  # Reduced grads in a per-replica window: one replica owns the global
  # contribution, the others add nothing; finish_mean's psum restores it
  # exactly (no division by the replica count, no rounding).
  owner = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in axes]))
  gweight = validation.Weight(
    jnp.where(owner, gweight.hi, 0.0),
    jnp.where(owner, gweight.lo, 0.0),
    gweight.ok,
  )
  # The window's buffers are per replica from here on (typed varying).
  contrib = _tree.to_varying(contrib, axes)
  treedef = jax.tree.structure(state.grads)
  return add(state, jax.tree.unflatten(treedef, contrib), gweight, mean=False)


def reduce_microbatch(
  state: AccumState,
  grads: Any,
  weight: Any,
  axes: tuple[str, ...],
  *,
  mean: bool,
  what: str,
) -> tuple[Any, validation.Weight]:
  """One microbatch's global contribution (a tree like the buffers, the sum
  over the replicas, each leaf summed once) and its global weight (an exact
  pair, see :func:`global_contribution`): one collective round, inside
  ``shard_map``. For a window that is the same on every replica."""
  leaves = accumulation.check_structure(state, grads, what)
  reduced = local_grads.leaf_status(
    leaves, _tree.leaf_paths(state.grads), axes, f"{what}(grads)"
  )
  contrib, gweight = global_contribution(
    state, leaves, weight, axes, mean=mean, reduced=reduced, what=what
  )
  return jax.tree.unflatten(jax.tree.structure(state.grads), contrib), gweight


def global_contribution(
  state: AccumState,
  leaves: list[Any],
  weight: Any,
  axes: tuple[str, ...],
  *,
  mean: bool,
  reduced: bool,
  what: str,
) -> tuple[list[Any], validation.Weight]:
  """The microbatch's global contribution to the sums and its global weight.

  The weight is a :class:`validation.Weight` whose ``(hi, lo)`` is the exact
  sum of the replicas' converted weights, summed in the same collective
  round as the sums (``window.psum_window``'s limbs); it is not ``ok``
  (zero parts, which rejects the microbatch) when any replica's weight is
  invalid."""
  dt = state.dtype
  # The converted weight, zero where invalid (subnormal or out-of-range
  # weights follow the core's rules).
  wt = accumulation.convert_weight(state, weight, what)
  bad = ~jnp.asarray(wt.ok)
  w_ok = jnp.asarray(wt.hi) + jnp.asarray(wt.lo)
  if reduced and mean:
    if set(axes) & _tree.varying_axes(wt.hi):
      raise WeightedAccumulationError(
        f"{what}(grads): these gradients of per-replica MEAN losses were "
        f"already summed over {axes} by autodiff (the params are unvarying "
        "there), which weights every replica equally whatever its item "
        "count, and the weights differ per replica: this cannot be undone. "
        "Differentiate with weighted_accum.distributed.local_grad (or "
        f"jax.lax.pcast(params, {axes!r}, to='varying')), or differentiate "
        "the loss SUM and use accumulate_sum."
      )
    # Every replica divided by the same count n: n * grads is the sum of the
    # replicas' loss-sum gradients, and the global weight is n * replicas.
    contrib = [numerics.mean_contribution(g, w_ok, dt) for g in leaves]
    total = validation.weight(
      w_ok * _axes_size(axes), what=what, tally=w_ok.dtype
    )
    return contrib, validation.Weight(total.hi, total.lo, total.ok & ~bad)
  if reduced:
    return leaves, _global_weight([], wt, axes)[1]
  # Local gradients, reduce="microbatch": one psum of sums and weight.
  take = ~bad & (w_ok > 0)
  zero = jnp.zeros((), dt)
  contrib = [
    jnp.where(
      take,
      numerics.mean_contribution(g, w_ok, dt) if mean else g.astype(dt),
      zero,
    )
    for g in leaves
  ]
  return _global_weight(contrib, wt, axes)


def _global_weight(
  sums: list[Any], wt: validation.Weight, axes: tuple[str, ...]
) -> tuple[list[Any], validation.Weight]:
  """``sums`` and the weight pair summed in one collective round; any
  replica's invalid weight rejects the microbatch on every replica."""
  scalars = {
    "weight_hi": jnp.asarray(wt.hi),
    "weight_lo": jnp.asarray(wt.lo),
    "bad": ~jnp.asarray(wt.ok),
  }
  sums, total = window.psum_window(
    sums, scalars, axes, vma_on=_tree.vma_checked(axes)
  )
  ok = total["bad"] == 0
  zero = jnp.zeros((), total["weight_hi"].dtype)
  hi, lo = (jnp.where(ok, total[k], zero) for k in window.PAIR)
  return sums, validation.Weight(hi, lo, ok)


def accumulate_sum(
  state: AccumState,
  grads: Any,
  weight: ArrayLike,
  axis_name: AxisName,
  *,
  reduce: str = "window",
  checked: bool = False,
) -> AccumState:
  """Adds a replica's gradients of its microbatch's loss SUM, inside shard_map.

  Accepts local gradients (from
  :func:`~weighted_accum.distributed.local_grad`) and gradients already
  summed over ``axis_name`` by autodiff (``jax.grad`` of unvarying params)
  alike, telling them apart by type, and gives the same exact result.

  Args:
    state: the window (from :func:`init` for ``reduce="window"``, from
      :func:`weighted_accum.init` for ``reduce="microbatch"``).
    grads: gradients of THIS replica's loss sum (local), or their sum over
      the replicas (already reduced by autodiff).
    weight: THIS replica's item count for the microbatch (0 allowed).
    axis_name: the data axis name, or a tuple of names.
    reduce: ``"window"`` (default): local gradients are added as they are and
      :func:`finish_mean` reduces once; already-reduced ones are added by one
      replica (the others add zero) after a scalar ``psum`` of the weights.
      ``"microbatch"``: sums and weights are all-reduced now (one collective
      per microbatch) and every replica adds the global values.
    checked: as for :func:`weighted_accum.accumulate_sum`.

  Returns:
    The new state. An invalid weight on any replica rejects the microbatch
    on every replica when the weights are reduced now; in window mode with
    local gradients it is rejected on its own replica only.

  Raises:
    WeightedAccumulationError: for an unbound axis, an unknown ``reduce``, a
      grads tree not matching the buffers or mixing local and reduced leaves,
      or (microbatch mode) a state that holds per-replica sums.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from weighted_accum import distributed as dist
    >>> n = jax.device_count()
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> loss_sum = lambda p, x: jnp.sum(x * p)
    >>> def step(p, x):   # x: this replica's items; every item's grad is x
    ...   s = dist.init(p, 'data')
    ...   g = jax.grad(loss_sum)(p, x)          # already reduced: also fine
    ...   s = dist.accumulate_sum(s, g, x.size, 'data')
    ...   return dist.finish_mean(s, 'data')[0].grads
    >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P('data')),
    ...                           out_specs=P()))
    >>> x = jnp.tile(jnp.arange(4.), n)   # items 0, 1, 2, 3 on each replica
    >>> float(f(jnp.ones(()), x))          # their mean, with any device count
    1.5
  """
  return _accumulate(
    state,
    grads,
    weight,
    axis_name,
    mean=False,
    reduce=reduce,
    checked=checked,
    name="accumulate_sum",
  )


def accumulate_mean(
  state: AccumState,
  grads: Any,
  weight: ArrayLike,
  axis_name: AxisName,
  *,
  reduce: str = "window",
  checked: bool = False,
) -> AccumState:
  """Adds a replica's gradients of its microbatch's loss MEAN, inside shard_map.

  ``weight`` is THIS replica's count the mean divided by; the contribution
  is ``cast(grads) * weight`` as in :func:`weighted_accum.accumulate_mean`.
  Gradients already reduced by autodiff are accepted when every replica used
  the same count (an unvarying ``weight``); with per-replica counts they are
  the equal-weight average of unequal means, which cannot be undone, and
  this raises.

  Args:
    state: the window; see :func:`accumulate_sum`.
    grads: gradients of THIS replica's mean loss (local), or already reduced.
    weight: THIS replica's item count the mean divided by.
    axis_name: the data axis name, or a tuple of names.
    reduce: ``"window"`` or ``"microbatch"``; see :func:`accumulate_sum`.
    checked: as for :func:`weighted_accum.accumulate_mean`.

  Returns:
    The new state; see :func:`accumulate_sum`.

  Raises:
    WeightedAccumulationError: as :func:`accumulate_sum`, and for
      already-reduced mean gradients with a per-replica (varying) weight.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from weighted_accum import distributed as dist
    >>> n = jax.device_count()
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> loss_mean = lambda p, x: jnp.mean(x * p)
    >>> def step(p, x):
    ...   s = dist.init(p, 'data')
    ...   g = dist.local_grad(loss_mean, 'data')(p, x)
    ...   s = dist.accumulate_mean(s, g, x.size, 'data')
    ...   return dist.finish_mean(s, 'data')[0].grads
    >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P('data')),
    ...                           out_specs=P()))
    >>> float(f(jnp.ones(()), jnp.tile(jnp.arange(4.), n)))
    1.5
  """
  return _accumulate(
    state,
    grads,
    weight,
    axis_name,
    mean=True,
    reduce=reduce,
    checked=checked,
    name="accumulate_mean",
  )


# --------------------------------------------------------------- reduction --


def reduce_sums(
  out: AccumulatedGradients, axis_name: AxisName
) -> AccumulatedGradients:
  """The global mean from a replica's :func:`weighted_accum.finish_sums`.

  One collective round (one ``psum`` of the sums together with the weight and
  the microbatch count over ``axis_name``), then the division by the loss
  scale and then by the global weight, in at least float32, result in the
  work dtype. Sums that are unvarying over the axis are taken as already
  global (summed by autodiff) and not summed again; weights are always
  summed (each replica's own count).

  Args:
    out: this replica's ``finish_sums`` result.
    axis_name: the data axis name, or a tuple of names.

  Returns:
    An :class:`~weighted_accum.AccumulatedGradients` with the global mean
    gradient, global weight and ``issued``, and ``finite``/``valid`` equal
    on every replica (``valid`` is false for a zero global weight, with zero
    grads).

  Raises:
    WeightedAccumulationError: for an unbound axis or a loss scale that
      varies over the axis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import weighted_accum as wa
    >>> from weighted_accum import distributed as dist
    >>> n = jax.device_count()
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> def step(p, x):
    ...   s = wa.accumulate_sum(wa.init(p), {'w': jnp.sum(x)}, x.size)
    ...   out, s = wa.finish_sums(s)
    ...   return dist.reduce_sums(out, 'data').grads
    >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P('data')),
    ...                           out_specs=P()))
    >>> float(f({'w': jnp.zeros(())}, jnp.tile(jnp.arange(4.), n))['w'])
    1.5
  """
  axes = _axes(axis_name, "reduce_sums")
  validation.instance(
    out,
    AccumulatedGradients,
    what="reduce_sums(out)",
    hint="Pass this replica's result of weighted_accum.finish_sums.",
  )
  return window.reduce_finished(out, axes, what="reduce_sums")


def _check_global_window(
  state: AccumState, axes: tuple[str, ...], what: str
) -> None:
  named = [("weight", state.weight_hi)] + _tree.flat(state.grads)
  for path, x in named:
    if _tree.varying_axes(x) & set(axes):
      raise WeightedAccumulationError(
        f"{what}(state): {path} varies over {axes}, so the window holds "
        "per-replica values, not the global sums reduce='microbatch' "
        "keeps. Finish it with reduce='window'."
      )


def finish_mean(
  state: AccumState,
  axis_name: AxisName,
  *,
  reduce: str = "window",
  next_loss_scale: ArrayLike | None = None,
) -> tuple[AccumulatedGradients, AccumState]:
  """Finishes a data-parallel window: the exact global mean gradient.

  ``reduce="window"``: :func:`weighted_accum.finish_sums` then
  :func:`reduce_sums`, summing the weight's (hi, lo) parts (each in
  float32, so exact while every part sum is); one
  collective round. ``reduce="microbatch"``: the buffers already hold the
  global sums, so this is :func:`weighted_accum.finish_mean` with no
  communication. Pass the mode the window was accumulated in: a
  ``"microbatch"`` window finished with ``reduce="window"`` would sum its
  already-global weight once more (the types cannot tell the two apart).

  Args:
    state: the window.
    axis_name: the data axis name, or a tuple of names.
    reduce: the mode the window was accumulated in.
    next_loss_scale: the next window's loss scale (default: unchanged).

  Returns:
    ``(out, new_state)``: ``out`` as :func:`reduce_sums` (identical on every
    replica; ``out.issued`` counts microbatches summed over the replicas, K
    per replica in either mode). ``new_state`` is an empty window typed
    like ``state`` (a ``lax.scan`` carry stays valid); for a zero global
    weight its counters are unchanged, as in
    :func:`weighted_accum.finish_mean` under ``jit``.

  Raises:
    WeightedAccumulationError: for an unbound axis, an unknown ``reduce``, a
      loss scale varying over the axis, or ``reduce="microbatch"`` on a state
      holding per-replica sums.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import weighted_accum as wa
    >>> from weighted_accum import distributed as dist
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> n = mesh.size   # replicas
    >>> def step(p, x):   # a window of one microbatch, reduced at once
    ...   s = wa.init(p)
    ...   g = dist.local_grad(lambda p: jnp.sum(x * p), 'data')(p)
    ...   s = dist.accumulate_sum(s, g, x.size, 'data', reduce='microbatch')
    ...   return dist.finish_mean(s, 'data', reduce='microbatch')[0].grads
    >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P('data')),
    ...                           out_specs=P()))
    >>> float(f(jnp.ones(()), jnp.tile(jnp.arange(4.), n)))
    1.5
  """
  what = "distributed.finish_mean"
  reduce = _check_reduce(reduce, what)
  validation.instance(
    state,
    AccumState,
    what=f"{what}(state)",
    hint="Pass the data-parallel window.",
  )
  next_loss_scale = validation.optional_loss_scale(
    next_loss_scale,
    what=f"{what}(next_loss_scale=...)",
    dtype=state.loss_scale.dtype,
  )
  if replicas.is_stacked(state) and reduce == "window":
    return _finish_stacked(state, axis_name, next_loss_scale)
  axes = _axes(axis_name, what)
  if reduce == "microbatch":
    if _tree.vma_checked(axes):
      _check_global_window(state, axes, what)
    out, new_state, _ = window.finish(
      state, mean=True, next_loss_scale=next_loss_scale, what=what
    )
    # Each accumulate call covered one microbatch on every replica.
    return out.replace(issued=out.issued * _axes_size(axes)), new_state
  out, new_state, _ = window.finish(
    state, mean=True, next_loss_scale=next_loss_scale, axes=axes, what=what
  )
  return out, new_state


def _finish_stacked(
  state: AccumState, axis_name: AxisName, next_loss_scale: Any
) -> tuple[AccumulatedGradients, AccumState]:
  """``finish_mean`` of a stacked per-replica window: of this replica's
  block inside ``shard_map``, or of the whole under plain ``jit``."""
  what = "distributed.finish_mean"
  axes = validation.axis_names(axis_name, what=what)
  if not replicas.bound(axes):
    return replicas.finish_mean(state, axes, next_loss_scale)
  out, new = finish_mean(
    replicas.unstack(state, axes, what), axes, next_loss_scale=next_loss_scale
  )
  return out, replicas.stack(new, axes)
