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
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.in_step import microbatch_args as margs
from weighted_accum._src.in_step.spmd_plan import Layout as Layout
from weighted_accum._src.in_step.spmd_plan import _gathered as _gathered
from weighted_accum._src.in_step.spmd_plan import _params as _params
from weighted_accum._src.in_step.spmd_plan import _Plan as _Plan
from weighted_accum._src.in_step.spmd_plan import options as options
from weighted_accum._src.in_step.spmd_plan import plan_call as plan_call
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel import spmd_layout as layout_

_WHAT = "microbatched_value_and_grad"
FSDP_MODES = layout_.FSDP_MODES
Axes = tuple[str, ...]


# ----------------------------------------------------------- one call --


def _is_array(x: Any) -> bool:
  """An array, or a Python float (traced, as ``jax.jit`` takes it)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, float))


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


_EAGER_ENTRIES = 16  # compiled eager programs kept per function


def run_eagerly(cache: dict | None, run: Callable[..., Any], *args: Any):
  """``run(*args)``; eagerly, this call's trace run by the program compiled
  for an equal trace (same jaxpr and input types), its constants passed in."""
  flat, tree = jax.tree.flatten(args)
  if cache is None or any(map(tree_utils.is_traced, flat)):
    return run(*args)
  closed, shape = jax.make_jaxpr(
    lambda *xs: run(*jax.tree.unflatten(tree, xs)), return_shape=True
  )(*flat)
  ins = list(closed.consts) + flat
  key = (str(closed.jaxpr), *((jax.typeof(x), _sharding(x)) for x in ins))
  prog = cache.pop(key, None)
  if prog is None:
    if len(cache) >= _EAGER_ENTRIES:
      cache.pop(next(iter(cache)))
    prog = jax.jit(functools.partial(jax.core.eval_jaxpr, closed.jaxpr))
  cache[key] = prog  # the most recently used last
  out = prog(list(closed.consts), *flat)
  return jax.tree.unflatten(jax.tree.structure(shape), out)


def _sharding(x: Any) -> Any:
  return getattr(x, "sharding", None)


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
    res = step(pl.inner, a, kw, n_real, ls, norms)
    if cfg.has_aux:
      (loss, aux), out = res
      res = (loss, aux_per_replica(aux, axes)), out
    return res, margs.rng_states(cfg.roles, a)

  def run(dyn, n_real, ls):
    res, rngs = jax.shard_map(
      body,
      mesh=pl.mesh,
      in_specs=(sp.specs, P(), P()),
      out_specs=(_out_specs(cfg, args, pl.lay), P()),
      axis_names=set(axes),
    )(dyn, n_real, ls)
    return _placed(res, pl), rngs

  dyn = [sp.leaves[i] for i in sp.dynamic]
  res, rngs = run_eagerly(cache, run, dyn, n_real, ls)
  margs.update_rngs(cfg.roles, args, rngs)
  return res


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
    value, st = step(pl.inner, block, a, kw, n_real)
    if cfg.has_aux:
      value, aux = value
    value = tuple(tree_utils.to_varying(v, lay.axes)[None] for v in value)
    if cfg.has_aux:
      value = (value, aux_per_replica(aux, lay.axes))
    return (value, st), margs.rng_states(cfg.roles, a)

  specs = replicas.specs(state, lay.axes)
  value_specs = ((one, one), P(None, one[0])) if cfg.has_aux else (one, one)

  def run(dyn, state, n_real):
    return jax.shard_map(
      body,
      mesh=pl.mesh,
      in_specs=(specs, sp.specs, P()),
      out_specs=((value_specs, specs), P()),
      axis_names=set(lay.axes),
    )(state, dyn, n_real)

  dyn = [sp.leaves[i] for i in sp.dynamic]
  res, rngs = run_eagerly(cache, run, dyn, state, n_real)
  margs.update_rngs(cfg.roles, args, rngs)
  return res
