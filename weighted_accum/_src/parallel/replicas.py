"""Stacked per-replica windows: an ``AccumState`` whose per-replica fields
carry a leading replica axis sharded over the data axes (ordinary global
arrays, carried between jitted steps). Inside ``shard_map`` each replica
holds a block ``[1, ...]`` (:func:`unstack`, :func:`stack`); under plain
``jit`` :func:`to_global` reduces it once for the one close path.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax._src import mesh as _jax_mesh  # set_mesh's mesh under jit
import jax.numpy as jnp
from jax.sharding import Mesh
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
  """``state`` with its per-replica fields varying over ``axes``."""
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
  """Refuses a stacked window whose leaves are not ``n`` rows long."""
  leaves = [("weight_hi", state.weight_hi)] + tree_utils.flat(state.grads)
  for path, x in leaves:
    if np.ndim(x) < 1 or np.shape(x)[0] != n:
      raise WeightedAccumulationError(
        f"{what}(state): leaf {path} has shape {np.shape(x)}, expected a "
        f"leading replica axis of {n} here over {state.placement.axes} "
        "(window_specs)."
      )


def unstack(block: AccumState, axes: Axes, what: str | None) -> AccumState:
  """This replica's window from its block (``what=None``: already checked)."""
  if what is not None:
    check_block(block, 1, what)
  return block.replace(
    placement=block.placement._replace(kind=base.REPLICA, axes=axes),
    **{k: jax.tree.map(lambda x: x[0], getattr(block, k)) for k in PER_REPLICA},
  )


def stack(state: AccumState, axes: Axes) -> AccumState:
  """The block ``[1, ...]`` of a per-replica window (inverse of unstack)."""
  one = lambda x: tree_utils.to_varying(x, axes)[None]
  return state.replace(
    placement=state.placement._replace(kind=base.STACKED, axes=axes),
    **{k: jax.tree.map(one, getattr(state, k)) for k in PER_REPLICA},
  )


def stacked_spec(x: Any, axes: Axes, is_explicit: bool = False) -> P:
  """The spec of ``x``'s stacked buffer: replica axis, then ``x``'s spec."""
  if tree_utils.is_traced(x) and not is_explicit:
    return P(layout_.entry(axes), *(P.UNCONSTRAINED,) * np.ndim(x))
  if tree_utils.is_traced(x):
    spec = tuple(jax.typeof(x).sharding.spec)
  else:
    s = getattr(x, "sharding", None)
    spec = tuple(s.spec) if isinstance(s, NamedSharding) else ()
  spec = spec + (None,) * (np.ndim(x) - len(spec))
  return P(layout_.entry(axes), *layout_.without(spec, axes))


def init(state: AccumState, params: Any, axes: Axes, what: str) -> AccumState:
  """The stacked window of the fresh window ``state`` of ``params``."""
  mesh = caller_mesh(params)  # a concrete param's, else set_mesh's
  if mesh is None or not set(axes) <= set(mesh.axis_names):
    mesh = layout_.find_mesh(jax.tree.leaves(params), axes, what=what)
  is_explicit = layout_.explicit(mesh, axes, what=what)
  placement = placement_on(mesh, axes)
  if not (isinstance(placement.mesh, Mesh) or is_explicit):
    raise WeightedAccumulationError(
      f"{what}(axis_name={axes!r}): under jax.jit on Auto data axes the "
      "params carry no devices: call it under jax.set_mesh(mesh) or outside jit."
    )
  n = layout_.size(mesh, axes)

  def zeros(x):
    spec = stacked_spec(x, axes, is_explicit)
    shape, dtype = (n,) + tuple(np.shape(x)), jnp.result_type(x)
    if not tree_utils.is_traced(x) and isinstance(mesh, Mesh):
      return jnp.zeros(shape, dtype, device=NamedSharding(mesh, spec))
    if is_explicit:  # built from x: under jit the devices are x's
      z = jnp.broadcast_to(tree_utils.zeros_like(x, dtype), shape)
      return jax.sharding.reshard(z, NamedSharding(mesh, spec))
    z = jnp.zeros(shape, dtype)
    return jax.lax.with_sharding_constraint(z, NamedSharding(mesh, spec))

  return state.replace(
    grads=jax.tree.map(zeros, state.grads),
    placement=placement,
    **{k: zeros(getattr(state, k)) for k in COUNTS},
  )


def context_mesh() -> Mesh | None:
  """``jax.set_mesh``'s mesh, also under ``jax.jit`` (whose key holds it)."""
  mesh = _jax_mesh.get_concrete_mesh()  # jax.sharding.get_mesh outside jit
  return None if mesh.empty else mesh


def caller_mesh(tree: Any) -> Mesh | None:
  """The mesh of ``tree``'s first leaf laid on one, else set_mesh's."""
  for x in jax.tree.leaves(tree):
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding) and not tree_utils.is_traced(x):
      return s.mesh
  return context_mesh()


def placement_on(mesh: Any, axes: Axes) -> base.Placement:
  """A stacked window's placement on ``mesh`` (set_mesh's if abstract)."""
  ctx = context_mesh()
  same = ctx is not None and ctx.abstract_mesh == mesh
  return base.Placement(base.STACKED, axes, "window", ctx if same else mesh)


def _show(mesh: Any) -> str:
  sizes = zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
  axes = ", ".join(f"{n!r}: {size} {t.name}" for n, size, t in sizes)
  ids = list(map(int, mesh.device_ids.flat)) if isinstance(mesh, Mesh) else "?"
  return f"mesh {{{axes}}} on devices {ids}"


def home(state: AccumState, caller: Any, what: str, axes=None) -> AccumState:
  """``state`` checked against the caller's mesh (else set_mesh's, else its
  own), moved there eagerly (rows in order: the same result), or refused."""
  pl, x = state.placement, state.weight_hi
  ctx = caller if caller is not None else context_mesh()
  traced, shape = tree_utils.is_traced(x), _abstract(pl.mesh)
  s = jax.typeof(x).sharding if traced else getattr(x, "sharding", None)
  at = s.mesh if isinstance(s, NamedSharding) else None
  if axes is not None and axes != pl.axes:
    raise _refused(pl, what, f"called over the axes {axes}")
  if ctx is not None and _abstract(ctx) != shape:
    raise _refused(pl, what, f"called on {_show(ctx)}")
  if at is None or _abstract(at) != shape:
    ids = None if at is not None else sorted(d.id for d in x.devices())
    on = _show(at) if ids is None else f"devices {ids}"
    raise _refused(pl, what, f"its arrays on {on}")
  to = ctx if isinstance(ctx, Mesh) else pl.mesh
  if traced and isinstance(pl.mesh, Mesh) and to != pl.mesh:
    raise _refused(pl, what, f"called under jax.jit on {_show(to)}")
  if traced or at == to or not isinstance(to, Mesh):
    return state
  spec = lambda a: getattr(a.sharding, "spec", P())  # scalars: replicated
  put = lambda a: jax.device_put(a, NamedSharding(to, spec(a)))
  return jax.tree.map(put, state).replace(placement=pl._replace(mesh=to))


def _abstract(mesh: Any) -> Any:
  return getattr(mesh, "abstract_mesh", mesh)


def _refused(pl: base.Placement, what: str, here: str) -> Exception:
  return WeightedAccumulationError(
    f"{what}(state): the window is stacked over {pl.axes} on "
    f"{_show(pl.mesh)}, {here}: call it under its mesh, or "
    "jax.device_put it onto this one first (outside jax.jit)."
  )


# ------------------------------------------------------ under plain jit --


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
    st = unstack(block, axes, None)
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
  """The stacked window after ``stacked`` closed as the global ``closed``."""
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
  glob = to_global(state, axes, _abstract(state.placement.mesh))
  out, closed = window.finish(glob, mean=True, next_loss_scale=next_loss_scale)
  return out, next_window(state, closed)


@validation.refuse_removed("axis_name", arity=1)
def window_specs(state: AccumState) -> AccumState:
  """The ``jax.shard_map`` specs of a stacked per-replica window.

  A window made by ``wa.init(params, axis_name=...)`` outside ``shard_map``
  carries its per-replica fields (buffers ``[N, *param.shape]``, weight pair
  and counts ``[N]``) on a leading replica axis sharded over its axes;
  ``windows`` and ``loss_scale`` stay shared scalars. Jitted steps return
  and take it (donated); it is reduced once, at its close. Inside
  ``shard_map`` each replica holds its block, which every entry point takes.

  Args:
    state: the stacked window (or its abstract shape).

  Returns:
    An :class:`~weighted_accum.AccumState` of ``PartitionSpec`` (a prefix
    tree for ``in_specs``/``out_specs``): ``P(axes)`` for the per-replica
    fields, ``P()`` for the shared ones.

  Raises:
    WeightedAccumulationError: for a state that is not a stacked window.

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
  what = "distributed.window_specs(state)"
  validation.instance(state, AccumState, what=what, hint="Pass the window.")
  if not is_stacked(state):
    raise WeightedAccumulationError(
      f"{what}: this window is {state.placement.kind}, not stacked per "
      "replica; pass a global window with P() (replicated)."
    )
  return specs(state, state.placement.axes)
