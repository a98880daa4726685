"""Per-replica windows carried between jitted steps.

A stacked window is an :class:`AccumState` whose per-replica fields (the
buffers, the weight pair, the counts) carry a leading replica axis of size N
sharded over the data axes; ``windows`` and ``loss_scale`` stay shared
scalars. Its leaves are ordinary global arrays, so a jitted step returns it
and takes it back (donated, host-readable), while replica ``r``'s slice is
its own per-replica window, never reduced mid-window.

- :func:`init` builds one outside ``shard_map`` (``wa.init(..., axis_name=...)``);
- inside ``shard_map`` over the data axes each replica holds a block
  ``[1, ...]`` of it (:func:`specs` are the specs to pass it with):
  :func:`unstack` and :func:`stack` convert between the block and the
  per-replica window the ``axis_name`` paths take;
- under plain ``jit``, :func:`to_global` reduces it once (one collective
  round, the exact weight pair included) into a global window for the one
  close path, and :func:`next_window` is the stacked window after it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import base
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import spmd_layout as layout_

Axes = tuple[str, ...]

#: The per-replica fields, stacked on a leading replica axis.
COUNTS = base.PER_REPLICA
PER_REPLICA = ("grads",) + COUNTS


def is_stacked(state: AccumState) -> bool:
  """Whether ``state`` is a stacked window (or a block of one)."""
  return state.placement.kind == base.STACKED


bound = tree_utils.bound


def as_varying(state: AccumState, axes: Axes) -> AccumState:
  """``state`` with its per-replica fields typed varying over ``axes`` (inside
  ``shard_map``)."""
  return state.replace(
    **{k: tree_utils.to_varying(getattr(state, k), axes) for k in PER_REPLICA}
  )


def specs(state: AccumState, axes: Axes) -> AccumState:
  """The ``shard_map`` specs of a stacked window (a prefix tree)."""
  one = P(layout_.entry(axes))
  fields = {
    k: one if k in PER_REPLICA else P() for k in ("grads",) + base.NAMES
  }
  return AccumState(dtype=state.dtype, placement=state.placement, **fields)


def check_block(state: AccumState, n: int, what: str) -> None:
  """Refuses a stacked window whose replica axis is not ``n`` long or not laid
  over its axes (e.g."""
  axes, s = state.placement.axes, getattr(state.weight_hi, "sharding", None)
  if not tree_utils.is_traced(state.weight_hi) and not (
    isinstance(s, NamedSharding) and set(axes) <= set(s.mesh.axis_names)
  ):
    raise WeightedAccumulationError(
      f"{what}(state): this stacked window is not laid over a mesh with its "
      f"axes {axes} (jax.device_put?); put it back with window_specs' specs."
    )
  for path, x in [("weight_hi", state.weight_hi)] + tree_utils.flat(
    state.grads
  ):
    if np.ndim(x) < 1 or np.shape(x)[0] != n:
      raise WeightedAccumulationError(
        f"{what}(state): leaf {path} has shape {np.shape(x)}, but a stacked "
        f"window over {axes} has a leading replica axis of {n} here (made by "
        "wa.init(params, axis_name=...) on this mesh; window_specs in shard_map)."
      )


def unstack(block: AccumState, axes: Axes, what: str) -> AccumState:
  """This replica's per-replica window from its block ``[1, ...]`` of a stacked
  window (inside ``shard_map`` over ``axes``)."""
  check_block(block, 1, what)
  return block.replace(
    placement=base.Placement(base.REPLICA, axes, "window"),
    **{k: jax.tree.map(lambda x: x[0], getattr(block, k)) for k in PER_REPLICA},
  )


def stack(state: AccumState, axes: Axes) -> AccumState:
  """The block ``[1, ...]`` of a per-replica window (inverse of
  :func:`unstack`)."""

  def one(x):
    return tree_utils.to_varying(x, axes)[None]

  return state.replace(
    placement=base.Placement(base.STACKED, axes),
    **{k: jax.tree.map(one, getattr(state, k)) for k in PER_REPLICA},
  )


# ---------------------------------------------------------------- init --


def _params_mesh(params: Any, axes: Axes, what: str) -> Any:
  """A concrete mesh from a param's ``NamedSharding``, else the mesh of the
  params' types or the context mesh."""
  for x in jax.tree.leaves(params):
    s = getattr(x, "sharding", None)
    concrete = isinstance(s, NamedSharding) and not tree_utils.is_traced(x)
    if concrete and all(a in s.mesh.axis_names for a in axes):
      return s.mesh
  return layout_.find_mesh(jax.tree.leaves(params), axes, what=what)


def _rest(x: Any, axes: Axes, is_explicit: bool) -> tuple:
  """The spec of a stacked leaf beyond its replica axis."""
  ndim = np.ndim(x)
  s = getattr(x, "sharding", None)
  if tree_utils.is_traced(x):
    if is_explicit:
      spec = tuple(jax.typeof(x).sharding.spec)
    else:
      return (P.UNCONSTRAINED,) * ndim
  else:
    spec = tuple(s.spec) if isinstance(s, NamedSharding) else ()
  spec = spec + (None,) * (ndim - len(spec))
  return tuple(layout_.without(spec, axes))


def _stacked_zeros(x: Any, n: int, mesh: Any, axes: Axes, is_explicit: bool):
  spec = P(layout_.entry(axes), *_rest(x, axes, is_explicit))
  shape, dtype = (n,) + tuple(np.shape(x)), jnp.result_type(x)
  if isinstance(mesh, jax.sharding.Mesh) and not tree_utils.is_traced(x):
    return jnp.zeros(shape, dtype, device=NamedSharding(mesh, spec))
  if is_explicit:
    return jnp.zeros(shape, dtype, out_sharding=spec)
  z = jnp.zeros(shape, dtype)
  return jax.lax.with_sharding_constraint(z, NamedSharding(mesh, spec))


def _check_placeable(mesh: Any, axes: Axes, is_explicit: bool, what: str):
  """Under ``jax.jit`` on ``Auto`` axes the params' types name the mesh but not
  its devices."""
  if isinstance(mesh, jax.sharding.Mesh) or is_explicit:
    return
  ctx = jax.sharding.get_abstract_mesh()
  if not all(a in ctx.axis_names for a in axes):
    raise WeightedAccumulationError(
      f"{what}(axis_name={axes!r}): under jax.jit on a mesh whose data axes "
      "are Auto, the stacked window's N per-replica buffers cannot be laid "
      "over the replicas (the traced params carry no devices). Call it "
      "under jax.set_mesh(mesh), or outside jax.jit (then pass the window "
      "in, donated)."
    )


def init(state: AccumState, params: Any, axes: Axes, what: str) -> AccumState:
  """The stacked window of ``state`` (a fresh ``wa.init`` window of ``params``,
  its buffers on the params' shardings)."""
  mesh = _params_mesh(params, axes, what)
  is_explicit = layout_.explicit(mesh, axes, what=what)
  _check_placeable(mesh, axes, is_explicit, what)
  n = layout_.size(mesh, axes)

  def zeros(x):
    return _stacked_zeros(x, n, mesh, axes, is_explicit)

  return state.replace(
    grads=jax.tree.map(zeros, state.grads),
    placement=base.Placement(base.STACKED, axes),
    **{k: zeros(getattr(state, k)) for k in COUNTS},
  )


# ------------------------------------------------------ under plain jit --


def mesh_of(state: AccumState, axes: Axes, what: str) -> Any:
  """The mesh of a stacked window under plain ``jit`` (its types', or the
  context mesh), checked to have the window's replica count."""
  mesh = layout_.find_mesh([state.weight_hi], axes, what=what)
  check_block(state, layout_.size(mesh, axes), what)
  return mesh


def to_global(
  state: AccumState, axes: Axes, mesh: Any, leaves: tuple | None = None
) -> AccumState:
  """The global window of a stacked one, in one collective round."""
  n_leaves = len(jax.tree.leaves(state.grads))
  leaves = leaves or (layout_.Leaf(None),) * n_leaves
  plan = layout_.plan(leaves, axes, scattered=False)
  treedef = jax.tree.structure(state.grads)
  grad_specs = jax.tree.unflatten(
    treedef, [layout_.grad_spec(e) for e in leaves]
  )
  out_specs = AccumState(
    dtype=state.dtype, grads=grad_specs, **{k: P() for k in base.NAMES}
  )

  def body(block):
    st = unstack(block, axes, "to_global")
    scalars = {k: getattr(st, k) for k in COUNTS}
    sums, tot = window.psum_window(
      st.grads, scalars, axes, vma_on=True, plan=plan
    )
    counts = {k: tot[k].astype(scalars[k].dtype) for k in COUNTS}
    return st.replace(grads=sums, placement=base.GLOBAL_WINDOW, **counts)

  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(specs(state, axes),),
    out_specs=out_specs,
    axis_names=set(axes),
  )(state)


def next_window(stacked: AccumState, closed: AccumState) -> AccumState:
  """The stacked window after ``stacked`` was closed as ``closed`` (the global
  next window from the one close path)."""
  kept = closed.windows == stacked.windows
  counts = {
    k: jnp.where(kept, getattr(stacked, k), jnp.zeros_like(getattr(stacked, k)))
    for k in COUNTS
  }
  return stacked.replace(
    grads=jax.tree.map(tree_utils.zeros_like, stacked.grads),
    windows=closed.windows,
    loss_scale=closed.loss_scale,
    **counts,
  )


@functools.partial(jax.jit, static_argnums=1)
def finish_mean(state: AccumState, axes: Axes, next_loss_scale: Any):
  """``wa.finish_mean`` of a stacked window under plain ``jit``."""
  mesh = mesh_of(state, axes, "finish_mean")
  glob = to_global(state, axes, mesh)
  out, closed, _ = window.finish(
    glob, mean=True, next_loss_scale=next_loss_scale
  )
  return out, next_window(state, closed)


@validation.refuse_removed("axis_name", arity=1)
def window_specs(state: AccumState) -> AccumState:
  """The ``jax.shard_map`` specs of a stacked per-replica window.

  A window made by ``wa.init(params, axis_name=...)`` outside ``shard_map``
  carries each per-replica field on a leading replica axis of size N
  sharded over its axes: buffers ``[N, *param.shape]`` (each replica's
  full-size partial sum, laid out like its param without the data axes),
  weight pair and counts ``[N]``; ``windows`` and ``loss_scale`` stay
  shared scalars. Its leaves are ordinary global arrays, so jitted steps
  return it and take it back (donated), and no step reduces it before the
  close: under plain ``jit`` add to it with ``f.accumulate`` of
  ``microbatched_value_and_grad(..., axis_name=...)`` and close it with
  ``wa.apply_window`` or ``wa.finish_mean`` (one reduction per window, the
  exact weight included). Pass it into and out of ``shard_map`` with these
  specs (``P(axes)`` for the per-replica fields, ``P()`` for ``windows``
  and ``loss_scale``); inside, each replica holds its block, which every
  entry point takes and returns as such.

  Args:
    state: the stacked window (or its abstract shape).

  Returns:
    An :class:`~weighted_accum.AccumState` of ``PartitionSpec`` (a prefix
    tree for ``in_specs``/``out_specs``).

  Raises:
    WeightedAccumulationError: for a state that is not an ``AccumState``
      or not a stacked window.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import weighted_accum as wa
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> params = jax.device_put(jnp.zeros(3), jax.NamedSharding(mesh, P()))
    >>> state = wa.init(params, axis_name='data')
    >>> specs = wa.distributed.window_specs(state)
    >>> specs.grads == P('data'), specs.loss_scale == P()
    (True, True)
  """
  what = "distributed.window_specs"
  validation.instance(
    state, AccumState, what=f"{what}(state)", hint="Pass the stacked window."
  )
  if not is_stacked(state):
    raise WeightedAccumulationError(
      f"{what}(state): this window is {state.placement.kind}, not stacked "
      "per replica; make one with wa.init(params, axis_name=...) outside "
      "shard_map, or pass a global window with in_specs=P() (replicated)."
    )
  return specs(state, state.placement.axes)
