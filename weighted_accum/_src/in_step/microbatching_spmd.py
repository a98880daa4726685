"""``microbatched_value_and_grad(..., axis_name=...)`` under plain ``jax.jit``:
the call's plan (mesh, the params' layout, FSDP included) and the same step
in a partial-manual ``jax.shard_map`` over the data axes, one collective
round per call; eagerly, ``jax.jit`` of that call's closure (nothing kept).
FSDP and the mesh: ``docs/scaling.md``."""

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
from weighted_accum._src.in_step import microbatch_terms as terms
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel import spmd_layout as layout_

_WHAT = "microbatched_value_and_grad"
Axes = tuple[str, ...]


def _param_specs(cfg: Any, params: Any, is_explicit: bool) -> list[Any]:
  leaves, treedef = jax.tree.flatten(params)
  if is_explicit:
    return [jax.typeof(x).sharding.spec for x in leaves]
  if cfg.dp.param_specs is None:
    return [None] * len(leaves)
  try:
    specs = treedef.flatten_up_to(cfg.dp.param_specs)
  except (ValueError, TypeError) as e:
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name=DataParallel(param_specs=...)): the specs do not "
      f"match the params' tree {treedef}: {e}. Pass one spec per param leaf."
    ) from e
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

  def buffers(self, params: Any) -> Any:
    """The params, or with ``scatter_each`` each FSDP param's shard."""
    if self.fsdp != "scatter_each":
      return params
    leaves, treedef = jax.tree.flatten(params)
    out = [_shard_like(x, leaf) for x, leaf in zip(leaves, self.leaves)]
    return jax.tree.unflatten(treedef, out)

  def add(self, state: Any, grads: Any, weight: Any, *, mean: bool, name: str):
    """Adds one microbatch; ``scatter_each`` FSDP leaves reduce-scattered."""
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
  typed = jax.typeof(x).sharding  # its Explicit axes kept on the shard
  return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x), sharding=typed)


def _scattered(lay: Layout, state: Any, grads: Any, weight: Any, mean: bool):
  """Each leaf's weighted contribution, FSDP leaves reduce-scattered."""
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
      c = tree_utils.reduce_scatter(c, leaf.scatter, leaf.dim)
    out.append(c)
  return jax.tree.unflatten(treedef, out)


def _check_batch(cfg, batch: list, k: int, n: int, is_explicit: bool):
  """Every batch leaf splits into the replicas' rows, then into K."""
  axes = cfg.axes
  for b in batch:
    if b.rows % (n * k) or b.rows != batch[0].rows:
      raise WeightedAccumulationError(
        f"{_WHAT}(axis_name={axes}): {b.name} has {b.rows} rows; {n} "
        f"replicas x K={k} need the same size in every leaf, divisible by "
        f"{n * k}. Pad the batch (with zero weight)."
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
  batch: list  # the batch leaves (margs.Leaf)
  grads: Any  # the params' (and so the gradients') treedef


def plan_call(cfg: Any, args: tuple, kwargs: dict) -> _Plan:
  """The mesh, its axis type, the params' layout and the inner config."""
  axes, roles = cfg.axes, cfg.roles
  if roles.state_argnums:
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes}, state_argnums={roles.state_argnums}): "
      "each replica would thread its own state; call f inside jax.shard_map "
      "and combine the replicas' states yourself."
    )
  if roles.split == "contiguous":
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes}, split='contiguous'): a replica's k-th "
      "block is not the batch's; use split='strided'."
    )
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
  batch = margs.batch_leaves(_WHAT, cfg.roles, args, kwargs)
  mesh = layout_.find_mesh(
    [b.x for b in batch], axes, what=f"{_WHAT}(axis_name={axes})"
  )
  is_explicit = layout_.explicit(mesh, axes, what=f"{_WHAT}(axis_name=...)")
  n = layout_.size(mesh, axes)
  k = roles.num_microbatches or margs.num_microbatches(_WHAT, roles, batch)
  _check_batch(cfg, batch, k, n, is_explicit)
  params = margs.params(_WHAT, roles, args)  # None: held fixed
  specs = _param_specs(cfg, params, is_explicit)
  leaves = tuple(
    _leaf(spec, mesh, is_explicit, path, x, axes)
    for spec, (path, x) in zip(specs, tree_utils.flat(params))
  )
  lay = Layout(axes, n, cfg.dp.fsdp, leaves)
  roles = roles._replace(num_microbatches=k, microbatch_size=None)
  inner = cfg._replace(spmd=lay, roles=roles)
  return _Plan(mesh, is_explicit, lay, inner, batch, jax.tree.structure(params))


def _leaf(spec, mesh, is_explicit, path, x, axes) -> layout_.Leaf:
  """One param's layout, its spec checked against the mesh."""
  where = "its type" if is_explicit else "DataParallel(param_specs=...)"
  if spec is not None:
    validation.spec_on_mesh(
      spec,
      mesh,
      jnp.shape(x),
      what=f"{_WHAT}(axis_name={axes}): param {path}",
      hint=f"The spec is from {where}.",
    )
  return layout_.leaf(spec, axes, jnp.ndim(x), path, what=_WHAT)


def _gathered(cfg: Any, args: tuple, pl: _Plan) -> tuple:
  """The args for the ``shard_map``: Explicit FSDP params gathered."""
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


# The leaves traced into the shard_map (a Python float too, as jit takes it).
_ARRAYS = (jax.Array, np.ndarray, np.generic, float)


def _split(cfg: Any, call: tuple, pl: _Plan) -> tuple[list, list, Callable]:
  """The call's array leaves, their specs (the batch's split over the data
  axes) and the function joining them to the others."""
  args, kwargs, *rest = call
  it, entry = iter(pl.batch), layout_.entry(pl.lay.axes)
  spec = lambda t, f: jax.tree.map(lambda _: f(), t)
  split = lambda: P(*[None] * next(it).axis, entry)
  batch = {n: spec(args[n], split) for n in cfg.roles.batch_argnums}
  batch |= {k: spec(kwargs[k], split) for k in cfg.roles.batch_argnames}
  whole = lambda k, t: batch[k] if k in batch else spec(t, P)
  tree = (
    tuple(whole(n, a) for n, a in enumerate(args)),
    {k: whole(k, v) for k, v in kwargs.items()},
    *(spec(t, P) for t in rest),
  )
  leaves, treedef = jax.tree.flatten(call)
  specs = treedef.flatten_up_to(tree)
  dynamic = [i for i, x in enumerate(leaves) if isinstance(x, _ARRAYS)]

  def join(values: list) -> Any:
    out = list(leaves)
    for i, v in zip(dynamic, values):
      out[i] = v
    return jax.tree.unflatten(treedef, out)

  return [leaves[i] for i in dynamic], [specs[i] for i in dynamic], join


def _out_specs(cfg: Any, pl: _Plan) -> Any:
  """``f``'s ``shard_map`` out specs, the gradients' on their layout."""
  specs = [layout_.grad_spec(e) for e in pl.lay.leaves]
  grads = jax.tree.unflatten(pl.grads, specs)
  out = AccumulatedGradients(grads, *[P()] * 5, kind="mean")
  if cfg.has_aux:
    return (P(), P(None, layout_.entry(pl.lay.axes))), out
  return P(), out


def _placed(res: Any, pl: _Plan) -> Any:
  """``f``'s result, each gradient on its param's sharding (known specs)."""

  def one(g: Any, spec: Any) -> Any:
    if spec is None:
      return g
    if pl.is_explicit:
      return g if jax.typeof(g).sharding.spec == spec else jax.reshard(g, spec)
    return lax.with_sharding_constraint(g, NamedSharding(pl.mesh, spec))

  value, out = res
  leaves, treedef = jax.tree.flatten(out.grads)
  grads = [one(g, e.spec) for g, e in zip(leaves, pl.lay.leaves)]
  return value, out.replace(grads=jax.tree.unflatten(treedef, grads))


def _per_replica(aux: Any, axes: Axes) -> Any:
  """This replica's ``[K, ...]`` aux as its ``[K, 1, ...]`` block."""
  return jax.tree.map(lambda a: a[:, None], tree_utils.to_varying(aux, axes))


def _sharded(cfg, pl: _Plan, split, fn, specs, args, *rest, post):
  """``fn(args, kwargs, ..., *rest)`` per replica in a ``shard_map``."""
  dyn, dyn_specs, join = split

  def body(values, *rest):
    a, kw, *extra = join(values)
    return fn(a, kw, *extra, *rest), margs.rng_states(cfg.roles, a)

  def run(dyn, *rest):
    res, rngs = jax.shard_map(
      body,
      mesh=pl.mesh,
      in_specs=(dyn_specs, *specs[0]),
      out_specs=(specs[1], P()),
      axis_names=set(pl.lay.axes),
    )(dyn, *rest)
    return post(res), rngs

  # Eagerly, this call's program, compiled whole (an eager shard_map runs op
  # by op); under jit, inlined. A fresh closure: no program is reused.
  res, rngs = jax.jit(run)(dyn, *rest)
  margs.update_rngs(cfg.roles, args, rngs)
  return res


def _setup(cfg: Any, args: tuple, kwargs: dict, num_real: Any, *rest):
  """The call's plan, its count checked, its leaves split for the map."""
  pl = plan_call(cfg, args, kwargs)
  k = pl.inner.roles.num_microbatches
  n_real = validation.num_real(num_real, k, what=_WHAT)
  sp = _split(cfg, (_gathered(cfg, args, pl), kwargs, *rest), pl)
  return pl, n_real, sp


def value_and_grad(cfg: Any, step: Callable[..., Any], call: tuple) -> Any:
  """``f`` with ``axis_name`` on the global batch: ``step`` per replica."""
  args, kwargs, num_real, scale, normalizers = call
  norms = jax.tree.map(  # each checked here: inside, they are traced
    lambda v: validation.normalizer(v, what=f"{_WHAT}(...)(normalizers=)"),
    normalizers,
  )
  pl, n_real, sp = _setup(cfg, args, kwargs, num_real, norms)

  def fn(a, kw, norms, n_real, ls):
    res = step(pl.inner, a, kw, n_real, ls, norms)
    if not cfg.has_aux:
      return res
    (loss, aux), out = res
    return (loss, _per_replica(aux, pl.lay.axes)), out

  specs = ((P(), P()), _out_specs(cfg, pl))
  ls = jnp.asarray(scale)  # validated by the caller
  post = lambda res: _placed(res, pl)
  res = _sharded(cfg, pl, sp, fn, specs, args, n_real, ls, post=post)
  _refuse_empty(cfg, res[1].weight, norms)
  return res


def _refuse_empty(cfg: Any, weight: Any, normalizers: Any) -> None:
  """Eagerly refuses a window of total weight 0, as a call without ``axis_name``."""
  if tree_utils.is_traced(jax.tree.leaves(weight)[0]):
    return
  weight = weight if isinstance(weight, dict) else {None: weight}
  norms = validation.normalizers(normalizers, list(weight), what=_WHAT)
  for g in terms.groups(list(weight), norms, cfg.mode):
    if not any(weight[t] > 0 for t in g.terms):
      raise WeightedAccumulationError(
        f"{_WHAT}(axis_name={cfg.axes}): the call's total weight is 0 "
        f"(terms {list(g.terms)}): no mean to take. Pass rows of positive weight."
      )


def _check_window(state: Any, pl: Any, what: str, args: tuple) -> Any:
  """The window on the call's mesh, refused if not stacked for it."""
  lay = pl.lay
  if lay.fsdp == "scatter_each" and any(e.scatter for e in lay.leaves):
    raise WeightedAccumulationError(
      f"{what}: fsdp='scatter_each' reduces every microbatch, so a window "
      "across calls would not be per replica; use fsdp='gather_once'."
    )
  if not replicas.is_stacked(state):
    raise WeightedAccumulationError(
      f"{what}: under plain jit the window is stacked over the "
      f"{lay.replicas} replicas: wa.init(params, axis_name={lay.axes!r})."
    )
  state = replicas.home(
    state, replicas.caller_mesh(args), what.removesuffix("(state)"), lay.axes
  )
  replicas.check_block(state, lay.replicas, what.removesuffix("(state)"))
  return state


def accumulate(cfg: Any, step: Callable[..., Any], state: Any, call: tuple):
  """``f.accumulate`` on the global batch: a stacked window, no collective."""
  args, kwargs, num_real = call
  what = f"{_WHAT}(...).accumulate(state)"
  hint = (
    "Pass a stacked window: wa.init(params, axis_name=...) outside shard_map."
  )
  state = validation.instance(state, AccumState, what=what, hint=hint)
  pl, n_real, sp = _setup(cfg, args, kwargs, num_real)
  lay = pl.lay
  state = _check_window(state, pl, what, args)
  one = P(layout_.entry(lay.axes))

  def fn(a, kw, block, n_real):
    value, st = step(pl.inner, block, a, kw, n_real)
    if cfg.has_aux:
      value, aux = value
    value = tuple(tree_utils.to_varying(v, lay.axes)[None] for v in value)
    if cfg.has_aux:
      value = (value, _per_replica(aux, lay.axes))
    return value, st

  st_specs = replicas.specs(state, lay.axes)
  value_specs = ((one, one), P(None, one[0])) if cfg.has_aux else (one, one)
  specs = ((st_specs, P()), (value_specs, st_specs))
  return _sharded(cfg, pl, sp, fn, specs, args, state, n_real, post=lambda r: r)
