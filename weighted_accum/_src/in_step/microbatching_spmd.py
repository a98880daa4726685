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
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.in_step import microbatch_args as margs
from weighted_accum._src.parallel import replicas
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


# --------------------------------------------------------- options --


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


# ----------------------------------------- data axes read from the types --


def typed_data_axes(
  cfg: Any, args: tuple, kwargs: dict
) -> tuple[Axes, int] | None:
  """The data axes a call's batch is typed with on an ``Explicit`` mesh,
  where ``data_axes`` reproduces the result without them exactly (no aux,
  threaded state or keys; the strided split; K given; the params not
  sharded over those axes), so the call reduces once instead of once per
  microbatch; with the number of replicas over them. ``None``: the call
  runs as written."""
  roles = cfg.roles
  if (
    cfg.data_axes is not None
    or cfg.axis_name is not None
    or cfg.has_aux
    or roles.state_argnums
    or roles.key_argnums
    or roles.split != "strided"
    or roles.num_microbatches is None
  ):
    return None
  try:
    batch = margs.batch_leaves(_WHAT, roles, args, kwargs)
  except WeightedAccumulationError:
    return None  # the call as written reports it
  typed = (
    {layout_.typed_axes(x, a) for _, x, a, _ in batch} if batch else {None}
  )
  if len(typed) != 1 or None in typed:
    return None
  mesh, axes = typed.pop()
  n, k = layout_.size(mesh, axes), roles.num_microbatches
  if batch[0][3] % (n * k) or set(axes) & set(tree_utils.manual_axes()):
    return None
  params = [x for n_ in roles.argnums for x in jax.tree.leaves(args[n_])]
  for x in params:
    if not margs.differentiable(x):
      continue
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    on = {a for e in (spec or ()) for a in layout_.names(e)}
    if on & set(axes):
      return None
  return (axes, n) if any(map(margs.differentiable, params)) else None


# ----------------------------------------------------------- one call --


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
    "each replica would thread its own copy through its rows (as with "
    "state_argnums). Call f inside jax.shard_map with axis_name=... "
    "instead, or pass nnx.state(model, nnx.Param) at argnums and keep the "
    "rest out of the loss (e.g. random keys at key_argnums).",
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


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _Split(NamedTuple):
  """A call's arguments cut in two: the array leaves (into ``shard_map``,
  with their specs) and the rest (closed over: strings, functions, an
  Equinox module's static half)."""

  treedef: Any
  leaves: list
  dynamic: list  # positions of the array leaves
  specs: list


def _batch_axis(cfg: Any, path: tuple, x: Any) -> int | None:
  """The batch axis of the leaf at ``path`` of ``(args, kwargs, ...)``, or
  ``None`` for a leaf that is not split."""
  roles = cfg.roles
  part = path[0].idx
  if part not in (0, 1):
    return None
  where = path[1].idx if part == 0 else path[1].key
  if part == 0 and where in roles.batch_argnums:
    ax = roles.in_axes[roles.batch_argnums.index(where)]
  elif part == 1 and where in roles.batch_argnames:
    i = len(roles.batch_argnums) + roles.batch_argnames.index(where)
    ax = roles.in_axes[i]
  else:
    return None
  return ax + jnp.ndim(x) if ax < 0 else ax


def _split(cfg: Any, call: tuple, pl: _Plan) -> _Split:
  entry = layout_.entry(pl.lay.axes)
  flat, treedef = jax.tree.flatten_with_path(call)
  leaves = [x for _, x in flat]
  dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
  specs = []
  for i in dynamic:
    a = _batch_axis(cfg, *flat[i]) if len(flat[i][0]) > 1 else None
    specs.append(P() if a is None else P(*([None] * a), entry))
  return _Split(treedef, leaves, dynamic, specs)


def _joined(sp: _Split, values: list) -> Any:
  leaves = list(sp.leaves)
  for i, v in zip(sp.dynamic, values):
    leaves[i] = v
  return jax.tree.unflatten(sp.treedef, leaves)


def _replica_keys(cfg: Any, args: list, axes: Axes) -> list:
  """Each random key folded with this replica's index: replicas draw
  different masks for their different rows."""
  if not cfg.roles.key_argnums:
    return args
  r = lax.axis_index(axes)
  for n in cfg.roles.key_argnums:
    args[n] = jax.tree.map(lambda key: jax.random.fold_in(key, r), args[n])
  return args


def grads_specs(cfg: Any, args: tuple, lay: Layout) -> Any:
  """The gradients' ``shard_map`` out specs, a tree like the gradients."""
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


def _placed(res: Any, pl: _Plan) -> Any:
  value, out = res
  leaves, treedef = jax.tree.flatten(out.grads)
  grads = [
    _constrain(g, pl.mesh, leaf.spec, pl.is_explicit)
    for g, leaf in zip(leaves, pl.lay.leaves)
  ]
  return value, out.replace(grads=jax.tree.unflatten(treedef, grads))


def aux_per_replica(aux: Any, axes: Axes) -> Any:
  """This replica's ``[K, ...]`` aux as its ``[K, 1, ...]`` block of the
  global ``[K, N, ...]``."""
  return jax.tree.map(lambda a: a[:, None], tree_utils.to_varying(aux, axes))


_EAGER_ENTRIES = 16  # compiled eager calls kept per function


def _eager_key(sp: _Split, dyn: list, pl: _Plan) -> Any:
  """What an eager call's compiled program depends on beyond its array
  values: the call's structure, its other leaves (static), each array's
  shape, dtype and sharding, and the layout. ``None`` when a static leaf
  is not hashable (that call is not cached)."""
  dynamic = set(sp.dynamic)
  static = tuple(
    (type(x), x) for i, x in enumerate(sp.leaves) if i not in dynamic
  )
  avals = tuple(
    (
      np.shape(x),
      str(getattr(x, "dtype", type(x))),
      getattr(x, "sharding", None),
    )
    for x in dyn
  )
  key = (sp.treedef, static, avals, tuple(sp.specs), pl.mesh, pl.is_explicit)
  key += (pl.lay, pl.inner.roles, pl.inner.data_axes, pl.inner.axis_name)
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _concrete(tree: Any) -> bool:
  return not any(tree_utils.is_traced(x) for x in jax.tree.leaves(tree))


def value_and_grad(
  cfg: Any, step: Callable[..., Any], call: tuple, cache: dict | None = None
) -> Any:
  """``f(*args, **kwargs)`` with ``data_axes``: ``step`` (the ``axis_name``
  path) inside a partial-manual ``shard_map`` over the data axes. ``call``
  is ``(args, kwargs, num_real, loss_scale, normalizers)``, the loss scale
  already validated. An eager call runs one ``jax.jit`` program, kept in
  ``cache`` (the function's own) so the next eager call with the same
  structure, shapes and shardings compiles nothing (an eager ``shard_map``
  would compile each of its operations, every call)."""
  args, kwargs, num_real, scale, normalizers = call
  pl = plan_call(cfg, args, kwargs)
  k = pl.inner.roles.num_microbatches
  n_real = validation.num_real(num_real, k, what=_WHAT)
  ls = jnp.asarray(scale)  # validated by the caller (microbatching)
  norms = jax.tree.map(  # each checked here: inside, they are traced
    lambda v: validation.normalizer(v, what=f"{_WHAT}(...)(normalizers=)"),
    normalizers,
  )
  axes = pl.lay.axes
  sp = _split(cfg, (_gathered(cfg, args, pl), kwargs, norms), pl)

  def body(values, n_real, ls):
    a, kw, norms = _joined(sp, values)
    a = _replica_keys(cfg, list(a), axes)
    res = step(pl.inner, tuple(a), kw, n_real, ls, norms)
    if cfg.has_aux:
      (loss, aux), out = res
      return (loss, aux_per_replica(aux, axes)), out
    return res

  def run(dyn, n_real, ls):
    res = jax.shard_map(
      body,
      mesh=pl.mesh,
      in_specs=(sp.specs, P(), P()),
      out_specs=_out_specs(cfg, args, pl.lay),
      axis_names=set(axes),
    )(dyn, n_real, ls)
    return _placed(res, pl)

  dyn = [sp.leaves[i] for i in sp.dynamic]
  return _run_cached(cache, run, sp, pl, dyn, n_real, ls)


def _run_cached(cache, run, sp, pl, dyn, *rest):
  """``run(dyn, *rest)``: eagerly, through the ``jax.jit`` program kept in
  ``cache`` for this call's key (compiled on first use); under a trace,
  or without a key, as it is. ``rest``'s arrays (a window, the scale) key
  the program by their structure, shapes, dtypes and shardings."""
  key = None
  if cache is not None and _concrete((dyn, rest)):
    key = _eager_key(sp, dyn + jax.tree.leaves(rest), pl)
  if key is None:
    return run(dyn, *rest)
  key += (jax.tree.structure(rest),)
  if key not in cache:
    if len(cache) >= _EAGER_ENTRIES:
      cache.pop(next(iter(cache)))
    cache[key] = jax.jit(run)
  return cache[key](dyn, *rest)


def _check_window(state: Any, lay: Layout, what: str) -> None:
  """The window ``f.accumulate`` adds to with ``data_axes``: stacked per
  replica, for these replicas, FSDP gradients kept full-size."""
  if lay.fsdp == "scatter_each" and any(e.scatter for e in lay.leaves):
    raise WeightedAccumulationError(
      f"{what}: fsdp='scatter_each' reduces every microbatch, so a window "
      "across calls would not be per replica; use fsdp='gather_once' "
      "(full-size per-replica sums, one reduce-scatter at the close)."
    )
  if not replicas.is_stacked(state):
    raise WeightedAccumulationError(
      f"{what}: under plain jit the window is per replica, stacked over "
      f"the {lay.replicas} replicas: start it with "
      f"wa.init(params, axis_name={lay.axes!r}) outside "
      "shard_map (a global wa.init window would need a reduction per call)."
    )
  replicas.check_block(state, lay.replicas, what.removesuffix("(state)"))


def accumulate(
  cfg: Any,
  step: Callable[..., Any],
  state: Any,
  call: tuple,
  cache: dict | None = None,
) -> Any:
  """``f.accumulate(state, *args, **kwargs)`` with ``data_axes``: ``step``
  on each replica's block of a stacked per-replica window inside a
  partial-manual ``shard_map``; no collective. The loss sum and the weight
  come back per replica, ``[N]``. ``call`` is ``(args, kwargs, num_real)``;
  an eager call is compiled once per key in ``cache`` (as
  :func:`value_and_grad`)."""
  args, kwargs, num_real = call
  what = f"{_WHAT}(...).accumulate(state)"
  state = validation.instance(
    state,
    AccumState,
    what=what,
    hint="Pass a stacked per-replica window (wa.init(..., axis_name=...) "
    "outside shard_map).",
  )
  pl = plan_call(cfg, args, kwargs)
  lay = pl.lay
  _check_window(state, lay, what)
  n_real = validation.num_real(
    num_real, pl.inner.roles.num_microbatches, what=_WHAT
  )
  one = P(layout_.entry(lay.axes))
  sp = _split(cfg, (_gathered(cfg, args, pl), kwargs), pl)

  def body(block, values, n_real):
    a, kw = _joined(sp, values)
    a = _replica_keys(cfg, list(a), lay.axes)
    value, st = step(pl.inner, block, tuple(a), kw, n_real)
    if cfg.has_aux:
      value, aux = value
    value = tuple(tree_utils.to_varying(v, lay.axes)[None] for v in value)
    if cfg.has_aux:
      value = (value, aux_per_replica(aux, lay.axes))
    return value, st

  specs = replicas.specs(state, lay.axes)
  value_specs = ((one, one), P(None, one[0])) if cfg.has_aux else (one, one)

  def run(dyn, state, n_real):
    return jax.shard_map(
      body,
      mesh=pl.mesh,
      in_specs=(specs, sp.specs, P()),
      out_specs=(value_specs, specs),
      axis_names=set(lay.axes),
    )(state, dyn, n_real)

  dyn = [sp.leaves[i] for i in sp.dynamic]
  return _run_cached(cache, run, sp, pl, dyn, state, n_real)
