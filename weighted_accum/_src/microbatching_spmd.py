"""``microbatched_value_and_grad(..., data_axes=...)`` under plain ``jax.jit``.

The loop runs inside a partial-manual ``jax.shard_map`` over just the data
axes (the other mesh axes stay as they are: model-sharded params and the
model's own collectives are untouched), around the ``axis_name`` path: each
replica differentiates its own rows, and one collective round after the loop
reduces the gradient sums, the weights and the counters, whatever K.

The mesh is read from the batch's type (``jax.typeof(leaf).sharding.mesh``)
or the context mesh (``jax.set_mesh``). Params sharded over a data axis
(FSDP) are gathered once at the ``shard_map`` boundary; their gradients are
reduce-scattered once per call from a full-size per-replica carry
(``fsdp="gather_once"``) or once per microbatch into a carry of the param's
shard (``"scatter_each"``). On an ``Explicit`` mesh the params' specs are
read from their types; under ``Auto`` axes they are the caller's
``param_specs`` (else every param counts as replicated over the data axes).
Figures and the trade-off: ``docs/scaling.md``.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from weighted_accum._src import accumulation
from weighted_accum._src import numerics
from weighted_accum._src import replicas
from weighted_accum._src import spmd_layout as layout_
from weighted_accum._src import tree_utils
from weighted_accum._src import validation
from weighted_accum._src import window
from weighted_accum._src.base import AccumState
from weighted_accum._src.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError

_WHAT = "microbatched_value_and_grad"
FSDP_MODES = ("gather_once", "scatter_each")
Axes = tuple[str, ...]


def _param_specs(cfg: Any, params: Any, is_explicit: bool) -> list[Any]:
  leaves, treedef = jax.tree.flatten(params)
  if is_explicit:
    return [jax.typeof(x).sharding.spec for x in leaves]
  if cfg.param_specs is None:
    return [None] * len(leaves)
  try:
    return treedef.flatten_up_to(cfg.param_specs)
  except (ValueError, TypeError) as e:
    raise WeightedAccumulationError(
      f"{_WHAT}(param_specs=...): the specs do not match the params' tree "
      f"{treedef}: {e}. Pass one PartitionSpec (or None) per param leaf."
    ) from None


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


# --------------------------------------------------------- options --


def options(kw: dict) -> dict:
  """``data_axes``, ``param_specs`` and ``fsdp``, validated."""
  data_axes = validation.optional_axis_names(
    kw["data_axes"], what=f"{_WHAT}(data_axes=...)", name="data_axes"
  )
  if data_axes is not None and kw["axis_name"] is not None:
    raise WeightedAccumulationError(
      f"{_WHAT}: pass axis_name (f is called inside jax.shard_map, on this "
      "replica's rows) or data_axes (f is called under plain jax.jit, on "
      "the global batch), not both."
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


# ----------------------------------------------------------- one call --


def _params(cfg: Any, args: tuple) -> Any:
  if max(cfg.argnums) >= len(args):
    raise WeightedAccumulationError(
      f"{_WHAT}: argnums {cfg.argnums} but the function was called with "
      f"{len(args)} positional argument(s)."
    )
  if cfg.single:
    return args[cfg.argnums[0]]
  return tuple(args[i] for i in cfg.argnums)


def _check_batch(cfg: Any, args: tuple, axes: Axes, n: int, is_explicit: bool):
  """Every batch leaf splits into the replicas' rows, then into K."""
  for b in cfg.batch_argnums:
    for path, x in tree_utils.flat(args[b] if b < len(args) else ()):
      rows = jnp.shape(x)[0] if jnp.ndim(x) else 0
      if rows % (n * cfg.k):
        raise WeightedAccumulationError(
          f"{_WHAT}(data_axes={axes}): batch argument {b} leaf {path} has "
          f"{rows} rows; each of the {n} replicas splits its rows into "
          f"num_microbatches={cfg.k}, so the rows must be divisible by "
          f"{n * cfg.k}. Pad the batch (with zero weight)."
        )
      if is_explicit:
        spec = jax.typeof(x).sharding.spec
        if layout_.names(spec[0] if len(spec) else None) != axes:
          raise WeightedAccumulationError(
            f"{_WHAT}(data_axes={axes}): batch argument {b} leaf {path} is "
            f"typed {jax.typeof(x)}; its leading dimension must be sharded "
            f"over exactly the data axes, P({layout_.entry(axes)!r}, ...)."
          )


def layout(cfg: Any, args: tuple) -> tuple[Any, bool, Layout]:
  """The mesh, whether its data axes are Explicit, and the params' layout
  of one call with ``data_axes``."""
  axes = cfg.data_axes
  if set(axes) & set(tree_utils.manual_axes()):
    raise WeightedAccumulationError(
      f"{_WHAT}(data_axes={axes}): called inside a shard_map over these "
      "axes. There, pass axis_name=... instead (this replica's rows)."
    )
  batch = [
    x
    for b in cfg.batch_argnums
    if b < len(args)
    for x in jax.tree.leaves(args[b])
  ]
  mesh = layout_.find_mesh(batch, axes, what=f"{_WHAT}(data_axes={axes})")
  is_explicit = layout_.explicit(mesh, axes, what=f"{_WHAT}(data_axes=...)")
  n = layout_.size(mesh, axes)
  _check_batch(cfg, args, axes, n, is_explicit)
  params = _params(cfg, args)
  specs = _param_specs(cfg, params, is_explicit)
  leaves = tuple(
    layout_.leaf(spec, axes, jnp.ndim(x), path, what=_WHAT)
    for spec, (path, x) in zip(specs, tree_utils.flat(params))
  )
  return mesh, is_explicit, Layout(axes, n, cfg.fsdp, leaves)


def _gathered(cfg: Any, args: tuple, lay: Layout, is_explicit: bool) -> tuple:
  """The args as the ``shard_map`` takes them: on an Explicit mesh, FSDP
  params resharded to their specs without the data axes (one all-gather;
  under Auto axes the partitioner inserts it for the ``P()`` in_spec)."""
  if not is_explicit or not any(leaf.scatter for leaf in lay.leaves):
    return args
  out, i = list(args), 0
  for n in cfg.argnums:
    leaves, treedef = jax.tree.flatten(args[n])
    mine = lay.leaves[i : i + len(leaves)]
    i += len(leaves)
    leaves = [
      jax.reshard(x, layout_.without(e.spec, lay.axes)) if e.scatter else x
      for x, e in zip(leaves, mine)
    ]
    out[n] = jax.tree.unflatten(treedef, leaves)
  return tuple(out)


def _in_specs(cfg: Any, args: tuple, axes: Axes) -> tuple:
  batch = P(layout_.entry(axes))
  return tuple(
    batch if n in cfg.batch_argnums else P() for n in range(len(args))
  )


def grads_specs(cfg: Any, args: tuple, lay: Layout) -> Any:
  """The gradients' ``shard_map`` out specs, a tree like the params."""
  treedef = jax.tree.structure(_params(cfg, args))
  return jax.tree.unflatten(treedef, lay.grad_specs())


def _out_specs(cfg: Any, args: tuple, lay: Layout) -> Any:
  out = AccumulatedGradients(
    grads=grads_specs(cfg, args, lay),
    weight=P(),
    loss_scale=P(),
    issued=P(),
    finite=P(),
    valid=P(),
  )
  if cfg.has_aux:
    return (P(), P(None, layout_.entry(lay.axes))), out
  return P(), out


def _constrain(g: Any, mesh: Any, spec: Any, is_explicit: bool) -> Any:
  """``g`` on its param's sharding (known specs only)."""
  if spec is None:
    return g
  if is_explicit:
    return g if jax.typeof(g).sharding.spec == spec else jax.reshard(g, spec)
  if tree_utils.is_traced(g):
    return lax.with_sharding_constraint(g, NamedSharding(mesh, spec))
  return jax.device_put(g, NamedSharding(g.sharding.mesh, spec))


def _placed(res: Any, lay: Layout, mesh: Any, is_explicit: bool) -> Any:
  value, out = res
  leaves, treedef = jax.tree.flatten(out.grads)
  grads = [
    _constrain(g, mesh, leaf.spec, is_explicit)
    for g, leaf in zip(leaves, lay.leaves)
  ]
  return value, out.replace(grads=jax.tree.unflatten(treedef, grads))


def aux_per_replica(aux: Any, axes: Axes) -> Any:
  """This replica's ``[K, ...]`` aux as its ``[K, 1, ...]`` block of the
  global ``[K, N, ...]``."""
  return jax.tree.map(lambda a: a[:, None], tree_utils.to_varying(aux, axes))


def value_and_grad(
  cfg: Any, step: Callable[..., Any], args: tuple, num_real: Any, scale: Any
) -> Any:
  """``f(*args)`` with ``data_axes``: ``step`` (the ``axis_name`` path)
  inside a partial-manual ``shard_map`` over the data axes."""
  mesh, is_explicit, lay = layout(cfg, args)
  n_real = validation.num_real(num_real, cfg.k, what=_WHAT)
  if scale is not None:
    scale = validation.loss_scale(scale, what=f"{_WHAT}(...)(loss_scale=)")
  ls = jnp.asarray(cfg.loss_scale if scale is None else scale)
  inner = cfg._replace(axis_name=lay.axes, data_axes=None, spmd=lay)

  def body(args, n_real, ls):
    res = step(inner, args, n_real, ls)
    if cfg.has_aux:
      (loss, aux), out = res
      return (loss, aux_per_replica(aux, lay.axes)), out
    return res

  res = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(_in_specs(cfg, args, lay.axes), P(), P()),
    out_specs=_out_specs(cfg, args, lay),
    axis_names=set(lay.axes),
  )(_gathered(cfg, args, lay, is_explicit), n_real, ls)
  return _placed(res, lay, mesh, is_explicit)


def accumulate(
  cfg: Any, step: Callable[..., Any], state: Any, args: tuple, num_real: Any
) -> Any:
  """``f.accumulate(state, *args)`` with ``data_axes``: ``step`` on each
  replica's block of a stacked per-replica window inside a partial-manual
  ``shard_map``; no collective. The loss sum and the weight come back per
  replica, ``[N]``."""
  what = f"{_WHAT}(...).accumulate(state)"
  state = validation.instance(
    state,
    AccumState,
    what=what,
    hint="Pass a stacked per-replica window (distributed.init outside "
    "shard_map).",
  )
  mesh, is_explicit, lay = layout(cfg, args)
  if lay.fsdp == "scatter_each" and any(e.scatter for e in lay.leaves):
    raise WeightedAccumulationError(
      f"{what}: fsdp='scatter_each' reduces every microbatch, so a window "
      "across calls would not be per replica; use fsdp='gather_once' "
      "(full-size per-replica sums, one reduce-scatter at the close)."
    )
  if not replicas.is_stacked(state):
    raise WeightedAccumulationError(
      f"{what}: with data_axes the window is per replica, stacked over "
      f"the {lay.replicas} replicas: start it with "
      f"weighted_accum.distributed.init(params, {lay.axes!r}) outside "
      "shard_map (a global wa.init window would need a reduction per call)."
    )
  n_real = validation.num_real(num_real, cfg.k, what=_WHAT)
  inner = cfg._replace(axis_name=lay.axes, data_axes=None, spmd=lay)
  one = P(layout_.entry(lay.axes))

  def body(block, args, n_real):
    value, st = step(inner, block, args, n_real)
    if cfg.has_aux:
      value, aux = value
    value = tuple(tree_utils.to_varying(v, lay.axes)[None] for v in value)
    if cfg.has_aux:
      value = (value, aux_per_replica(aux, lay.axes))
    return value, st

  specs = replicas.specs(state, lay.axes)
  value_specs = ((one, one), P(None, one[0])) if cfg.has_aux else (one, one)
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(specs, _in_specs(cfg, args, lay.axes), P()),
    out_specs=(value_specs, specs),
    axis_names=set(lay.axes),
  )(state, _gathered(cfg, args, lay, is_explicit), n_real)
