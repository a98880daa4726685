"""Per-replica windows inside ``jax.shard_map``: ``make`` (``wa.init(...,
axis_name=...)``), ``accumulate`` (by the window's reduce mode) and
``reduce_sums`` (one collective round). The styles and when to reduce:
``docs/design.md`` ("Data parallelism").
"""

from __future__ import annotations

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
from weighted_accum._src.parallel.local_grads import AxisName


def add_reduced(
  state: AccumState, contrib: Any, gweight: Any, *, checked: bool, name: str
) -> AccumState:
  """Adds a microbatch reduced over the window's axes (its global sum and
  weight), counted once per replica in ``issued``."""
  new = accumulation.add(
    state, contrib, gweight, mean=False, checked=checked, name=name,
    allow_reduced=True,
  )  # fmt: skip
  size = _axes_size(state.placement.axes)
  return new.replace(issued=new.issued + (size - 1))


def _axes_size(axes: tuple[str, ...]) -> int:
  return math.prod(jax.lax.axis_size(a) for a in axes)


def make(
  params: Any,
  axis_name: Any,
  reduce: Any,
  dtype: DTypeLike,
  loss_scale: ArrayLike,
) -> AccumState:
  """The per-replica window of ``wa.init(params, axis_name=...)``."""
  reduce = validation.choice(
    reduce,
    base.REDUCE_MODES,
    what="init",
    name="reduce",
    hint="Use 'window' (one all-reduce per window) or 'microbatch'.",
  )
  s = accumulation.init(params, dtype=dtype, loss_scale=loss_scale)
  if not _tree.manual_axes():  # outside shard_map: a stacked window
    names = validation.axis_names(axis_name, what="init(axis_name=...)")
    if reduce != "window":
      raise WeightedAccumulationError(
        f"init(reduce={reduce!r}): a stacked window (axis_name outside "
        "shard_map) reduces at its close: use reduce='window'."
      )
    return replicas.init(s, params, names, "init")
  axes = validation.bound_axes(axis_name, what="init(axis_name=...)")
  placed = s.replace(placement=base.Placement(base.REPLICA, axes, reduce))
  if reduce == "microbatch":  # global sums: the same on every replica
    return placed
  return replicas.as_varying(placed, axes)


def _leaves(state: AccumState, grads: Any, axes: tuple[str, ...], what: str):
  """The grads' leaves and whether autodiff already reduced them."""
  leaves = accumulation.check_structure(state, grads, what)
  paths = _tree.leaf_paths(state.grads)
  return leaves, local_grads.leaf_status(leaves, paths, axes, f"{what}(grads)")


def accumulate(
  state: AccumState,
  grads: Any,
  weight: Any,
  *,
  mean: bool,
  checked: bool,
  name: str,
) -> AccumState:
  """Adds a microbatch to a per-replica window inside its ``shard_map``."""
  axes = state.placement.axes  # bound: placed.where checked
  add = functools.partial(
    accumulation.add, checked=checked, name=name, allow_reduced=True
  )
  if state.placement.reduce == "microbatch":
    contrib, gweight = reduce_microbatch(
      state, grads, weight, axes, mean=mean, what=name
    )
    return add_reduced(state, contrib, gweight, checked=checked, name=name)
  leaves, reduced = _leaves(state, grads, axes, name)
  if not reduced:
    return add(state, grads, weight, mean=mean)
  contrib, w = global_contribution(
    state, leaves, weight, axes, mean=mean, reduced=True, what=name
  )
  # One replica owns the global contribution, the others add nothing: the
  # close's psum restores it exactly. The buffers are varying from here on.
  owner = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in axes]))
  w = validation.Weight(
    jnp.where(owner, w.hi, 0.0), jnp.where(owner, w.lo, 0.0), w.ok
  )
  contrib = jax.tree.unflatten(
    jax.tree.structure(state.grads), _tree.to_varying(contrib, axes)
  )
  return add(state, contrib, w, mean=False)


def reduce_microbatch(
  state: AccumState,
  grads: Any,
  weight: Any,
  axes: tuple[str, ...],
  *,
  mean: bool,
  what: str,
) -> tuple[Any, validation.Weight]:
  """One microbatch's global contribution and weight (one collective round)."""
  leaves, reduced = _leaves(state, grads, axes, what)
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
  """The microbatch's global contribution to the sums and its global weight."""
  dt = state.dtype
  wt = accumulation.convert_weight(state, weight, what)
  bad = ~jnp.asarray(wt.ok)
  w_ok = jnp.asarray(wt.hi) + jnp.asarray(wt.lo)
  if reduced and mean:
    if set(axes) & _tree.varying_axes(wt.hi):
      raise WeightedAccumulationError(
        f"{what}(grads): autodiff summed these per-replica MEAN gradients "
        f"over {axes} though the weights differ per replica: differentiate "
        "with distributed.local_grad, or the loss SUM with accumulate_sum."
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
  take, zero = ~bad & (w_ok > 0), jnp.zeros((), dt)
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
  """``sums`` and the weight pair in one psum; one invalid weight rejects all."""
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


def reduce_sums(
  out: AccumulatedGradients, axis_name: AxisName
) -> AccumulatedGradients:
  """The global mean from a replica's :func:`weighted_accum.finish_sums`.

  One ``psum`` of the sums, weight and count over ``axis_name``, then the
  divisions by the loss scale and the global weight in at least float32.
  Sums unvarying over the axis (summed by autodiff) are not summed again.

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
  axes = validation.bound_axes(axis_name, what="reduce_sums")
  validation.instance(
    out,
    AccumulatedGradients,
    what="reduce_sums(out)",
    hint="Pass this replica's result of weighted_accum.finish_sums.",
  )
  return window.reduce_finished(out, axes, what="reduce_sums")
