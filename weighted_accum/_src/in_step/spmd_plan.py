"""The plan of one data-parallel in-step call under plain ``jax.jit``: the
params' layout over the data axes (FSDP included, checked against the mesh),
the batch's data axes (given, or read from an ``Explicit`` batch's type) and
the inner configuration the loop runs with on each replica's rows."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.in_step import microbatch_args as margs
from weighted_accum._src.parallel import spmd_layout as layout_

_WHAT = "microbatched_value_and_grad"
FSDP_MODES = layout_.FSDP_MODES
Axes = tuple[str, ...]


def _param_specs(cfg: Any, params: Any, is_explicit: bool) -> list[Any]:
  leaves, treedef = jax.tree.flatten(params)
  if is_explicit:
    return [jax.typeof(x).sharding.spec for x in leaves]
  if cfg.param_specs is None:
    return [None] * len(leaves)
  try:
    specs = treedef.flatten_up_to(cfg.param_specs)
  except (ValueError, TypeError) as e:
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name=DataParallel(param_specs=...)): the specs do not match the params' tree "
      f"{treedef}: {e}. Pass one PartitionSpec (or None) per param leaf."
    ) from None
  return [P() if spec is None else spec for spec in specs]  # None: replicated


class Layout(NamedTuple):
  """The data-parallel layout of one call (the inner config's ``spmd``)."""

  axes: Axes
  replicas: int
  fsdp: str
  leaves: tuple[layout_.Leaf, ...]

  @property
  def plan(self) -> tuple[window.LeafReduce | None, ...]:
    """How the close reduces each buffer (``window.psum_window``)."""
    each = self.fsdp == "scatter_each"
    return layout_.plan(self.leaves, self.axes, scattered=each)

  def grad_specs(self) -> list[Any]:
    """Each gradient's ``shard_map`` out spec (manual axes only)."""
    return [layout_.grad_spec(e) for e in self.leaves]

  def buffers(self, params: Any) -> Any:
    """What the window's buffers are shaped like: the params, or a shard
    of an FSDP param with ``scatter_each``."""
    if self.fsdp != "scatter_each":
      return params
    leaves, treedef = jax.tree.flatten(params)
    out = [_shard_like(x, leaf) for x, leaf in zip(leaves, self.leaves)]
    return jax.tree.unflatten(treedef, out)

  def add(self, state: Any, grads: Any, weight: Any, *, mean: bool, name: str):
    """Adds one microbatch (``accumulation.add``); with ``scatter_each``
    the FSDP leaves' contributions are reduce-scattered first and added on
    every replica, whatever its own weight (they are global sums)."""
    if self.fsdp != "scatter_each" or not any(e.scatter for e in self.leaves):
      return accumulation.add(state, grads, weight, mean=mean, name=name)
    contrib = _scattered(self, state, grads, weight, mean)
    new = accumulation.add(state, contrib, weight, mean=False, name=name)
    summed = [
      b + c if e.scatter else n
      for b, c, n, e in zip(
        jax.tree.leaves(state.grads),
        jax.tree.leaves(contrib),
        jax.tree.leaves(new.grads),
        self.leaves,
      )
    ]
    treedef = jax.tree.structure(state.grads)
    return new.replace(grads=jax.tree.unflatten(treedef, summed))


def _shard_like(x: Any, leaf: layout_.Leaf) -> Any:
  if not leaf.scatter:
    return x
  size = math.prod(lax.axis_size(a) for a in leaf.scatter)
  shape = list(jnp.shape(x))
  shape[leaf.dim] //= size
  return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x))


def _scattered(lay: Layout, state: Any, grads: Any, weight: Any, mean: bool):
  """Every leaf's weighted contribution (a select: a rejected or zero-weight
  microbatch adds nothing, NaN included, before anything is summed across
  replicas); FSDP leaves reduce-scattered over their data axes."""
  wt = validation.weight(
    weight, what=f"{_WHAT}(loss_fn) weight", tally=state.weight_hi.dtype
  )
  take = wt.ok & (wt.hi > 0)
  w = jnp.asarray(wt.hi) + jnp.asarray(wt.lo)
  dt = state.dtype
  leaves, treedef = jax.tree.flatten(grads)
  out = []
  for g, leaf in zip(leaves, lay.leaves):
    c = numerics.mean_contribution(g, w, dt) if mean else g.astype(dt)
    c = jnp.where(take, c, jnp.zeros((), dt))
    if leaf.scatter:
      c = lax.psum_scatter(
        c, leaf.scatter, scatter_dimension=leaf.dim, tiled=True
      )
    out.append(c)
  return jax.tree.unflatten(treedef, out)


def options(kw: dict) -> dict:
  """``data_axes``, ``param_specs`` and ``fsdp``, validated."""
  data_axes = validation.optional_axis_names(
    kw["data_axes"], what=f"{_WHAT}(axis_name=...)", name="data_axes"
  )
  return dict(
    data_axes=data_axes,
    param_specs=validation.partition_specs(
      kw["param_specs"], what=f"{_WHAT}(param_specs=...)"
    ),
    fsdp=validation.choice(
      kw["fsdp"],
      FSDP_MODES,
      what=_WHAT,
      name="fsdp",
      hint="'gather_once': one reduce-scatter per call from a full-size "
      "carry; 'scatter_each': one per microbatch into a sharded carry.",
    ),
  )


def _params(cfg: Any, args: tuple) -> Any:
  """The differentiated leaves in the params' structure (``None`` where a
  leaf is held fixed), shaped like the gradients."""
  trees = [margs.param_tree(_WHAT, n, args[n]) for n in cfg.roles.argnums]
  return trees[0] if cfg.roles.single else tuple(trees)


def _refuse_roles(cfg: Any) -> None:
  roles, axes = cfg.roles, cfg.data_axes
  if roles.state_argnums:
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes}, state_argnums={roles.state_argnums}): "
      "each replica would thread its own state through its rows, and one "
      "returned state cannot hold them. Call f inside jax.shard_map with "
      "axis_name=... and combine the replicas' states yourself."
    )
  if roles.split == "contiguous":
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes}, split='contiguous'): each replica would "
      "take the k-th block of its own rows, not the batch's k-th block. "
      "Use split='strided' (microbatch k = rows k::K, the same rows under "
      "plain jit or inside shard_map)."
    )


class _Batch(NamedTuple):
  """A batch leaf: where it is, its batch axis and its size there."""

  name: str
  x: Any
  axis: int
  rows: int


def _batch_leaves(cfg: Any, args: tuple, kwargs: dict) -> list[_Batch]:
  return [
    _Batch(*leaf) for leaf in margs.batch_leaves(_WHAT, cfg.roles, args, kwargs)
  ]


def _check_batch(cfg, batch: list[_Batch], k: int, n: int, is_explicit: bool):
  """Every batch leaf splits into the replicas' rows, then into K."""
  axes = cfg.data_axes
  for b in batch:
    if b.rows % (n * k) or b.rows != batch[0].rows:
      raise WeightedAccumulationError(
        f"{_WHAT}(axis_name={axes}): {b.name} has {b.rows} rows along its "
        f"batch axis; each of the {n} replicas splits its rows into "
        f"K={k} microbatches, so every batch leaf needs the same size, "
        f"divisible by {n * k}. Pad the batch (with zero weight)."
      )
    if is_explicit:
      spec = tuple(jax.typeof(b.x).sharding.spec)
      got = spec[b.axis] if b.axis < len(spec) else None
      if layout_.names(got) != axes:
        raise WeightedAccumulationError(
          f"{_WHAT}(axis_name={axes}): {b.name} is typed "
          f"{jax.typeof(b.x)}; its batch axis {b.axis} must be sharded "
          f"over exactly the data axes ({layout_.entry(axes)!r})."
        )


class _Plan(NamedTuple):
  """One call's mesh and layout, and the inner (``axis_name``) config."""

  mesh: Any
  is_explicit: bool
  lay: Layout
  inner: Any


def plan_call(cfg: Any, args: tuple, kwargs: dict) -> _Plan:
  """The mesh, its axis type and the params' layout of one call with
  ``data_axes``; the inner config runs on each replica's rows."""
  axes = cfg.data_axes
  _refuse_roles(cfg)
  margs.refuse_node_state(
    f"{_WHAT}(axis_name={axes})",
    cfg.roles,
    args,
    "call f inside jax.shard_map with axis_name=... and combine the "
    "replicas' state yourself.",
  )
  if set(axes) & set(tree_utils.manual_axes()):
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes}): called inside a shard_map over these "
      "axes. There, pass axis_name=... instead (this replica's rows)."
    )
  batch = _batch_leaves(cfg, args, kwargs)
  mesh = layout_.find_mesh(
    [b.x for b in batch], axes, what=f"{_WHAT}(axis_name={axes})"
  )
  is_explicit = layout_.explicit(mesh, axes, what=f"{_WHAT}(axis_name=...)")
  n = layout_.size(mesh, axes)
  if cfg.roles.num_microbatches is not None:  # the replicas' rule first
    _check_batch(cfg, batch, cfg.roles.num_microbatches, n, is_explicit)
  k = margs.num_microbatches(_WHAT, cfg.roles, batch)
  _check_batch(cfg, batch, k, n, is_explicit)
  for n_key in cfg.roles.key_argnums:  # validated before they are folded
    for path, key in tree_utils.flat(args[n_key]):
      validation.random_key(key, what=f"{_WHAT}: argument {n_key} {path}")
  params = _params(cfg, args)
  specs = _param_specs(cfg, params, is_explicit)
  leaves = tuple(
    _leaf(spec, mesh, is_explicit, path, x, axes)
    for spec, (path, x) in zip(specs, tree_utils.flat(params))
  )
  lay = Layout(axes, n, cfg.fsdp, leaves)
  roles = cfg.roles._replace(num_microbatches=k, microbatch_size=None)
  inner = cfg._replace(axis_name=axes, data_axes=None, spmd=lay, roles=roles)
  return _Plan(mesh, is_explicit, lay, inner)


def _leaf(spec, mesh, is_explicit, path, x, axes) -> layout_.Leaf:
  """One param's layout, its spec checked against the mesh (the axes it
  names, the dimensions they divide) where it was given."""
  where = "its type" if is_explicit else "DataParallel(param_specs=...)"
  if spec is not None:
    validation.spec_on_mesh(
      spec,
      mesh,
      jnp.shape(x),
      what=f"{_WHAT}(axis_name={axes}): param {path}",
      hint=f"The spec is from {where}.",
    )
  e = layout_.leaf(spec, axes, jnp.ndim(x), path, what=_WHAT)
  others = set().union(*map(layout_.names, spec)) - set(axes) if spec else ()
  if is_explicit and e.scatter and others:
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes}): param {path} is typed {spec} on an "
      f"Explicit mesh: sharded over the data axes (FSDP) and over "
      f"{tuple(sorted(others))} too. JAX's reduce-scatter over the data "
      "axes cannot keep another Explicit axis on the gradient. Use an Auto "
      "mesh for it (jax.make_mesh(..., axis_types=(AxisType.Auto, ...))) "
      "with DataParallel(param_specs=...), or shard this param over the data axes only."
    )
  return e


def _gathered(cfg: Any, args: tuple, pl: _Plan) -> tuple:
  """The args as the ``shard_map`` takes them: on an Explicit mesh, FSDP
  params resharded to their specs without the data axes (one all-gather;
  under Auto axes the partitioner inserts it for the ``P()`` in_spec)."""
  lay = pl.lay
  if not pl.is_explicit or not any(leaf.scatter for leaf in lay.leaves):
    return args
  it = iter(lay.leaves)

  def one(x):
    if not margs.differentiable(x):
      return x
    e = next(it)
    return jax.reshard(x, layout_.without(e.spec, lay.axes)) if e.scatter else x

  out = list(args)
  for n in cfg.roles.argnums:
    out[n] = jax.tree.map(one, args[n])
  return tuple(out)
