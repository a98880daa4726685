"""In-step microbatching: the loop over one call's K microbatches, each
added on the one accumulate path into its window(s), non-parameter state
threaded from one to the next, closed on the one close path. Rationale:
``docs/microbatching.md``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.in_step import microbatch_args as margs
from weighted_accum._src.in_step import microbatch_terms as terms
from weighted_accum._src.parallel import distributed as dist
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel.spmd_layout import DataParallel

_F32 = jnp.float32
_WHAT = "microbatched_value_and_grad"


class _Config(NamedTuple):
  """The static choices of one ``microbatched_value_and_grad``."""

  loss_fn: Callable[..., Any]
  mode: str
  has_aux: bool
  roles: margs.Roles
  dtype: np.dtype | None
  grads_dtype: Any  # None (the work dtype), "params" or a dtype
  loss_scale: Any
  dp: DataParallel | None  # the data axes and the params' FSDP layout
  spmd: Any = None  # under plain jit, inside the shard_map: a spmd.Layout

  @property
  def axes(self) -> tuple[str, ...]:
    """The data axes (empty without ``axis_name``)."""
    return () if self.dp is None else self.dp.axes


# -------------------------------------------------------- one microbatch --


def _objective(cfg, call, group, norms, i, threaded, scale):
  """One window's scaled scalar of microbatch ``i`` and the evaluation."""

  def fn(values):
    ev = _evaluate(cfg, call, i, values, threaded)
    # At least float32; float64 stays float64 (under x64).
    ct = numerics.compute_dtype(
      jnp.result_type(*(ev.terms[t] for t in group.terms))
    )
    if group.known:
      s = sum(
        terms.part(cfg, ev, t, ct) / norms[t].astype(ct) for t in group.terms
      )
    else:
      s = ev.terms[group.terms[0]].astype(ct)
    return s * scale.astype(ct), ev

  return fn


def _evaluate(cfg, call, i, values, threaded) -> terms.Eval:
  """``loss_fn`` on microbatch ``i``, with the threaded states it leaves."""
  args, kwargs = margs.microbatch(call, cfg.roles, i, values, threaded)
  ev = terms.evaluate(cfg, args, kwargs)
  return ev._replace(
    states=ev.states + margs.node_states(call, cfg.roles, args)
  )


# --------------------------------------------------------------- the loop --


class _Carry(NamedTuple):
  states: tuple  # one AccumState per window (group)
  sums: dict  # term -> (loss sum, weight sum), float32
  aux: Any
  threaded: tuple


def _shapes(cfg: _Config, call: margs.Call, threaded: tuple) -> terms.Eval:
  """Microbatch 0's evaluation shapes; the threaded states checked."""
  first = lambda: _evaluate(cfg, call, 0, margs.diff_values(call), threaded)
  try:
    ev = jax.eval_shape(first)
  except (TypeError, ValueError) as e:
    if isinstance(e, WeightedAccumulationError):
      raise
    err = validation.unsplit_batch(
      margs.unchanged(call, cfg.roles), call.rows, what=_WHAT
    )
    if err is None:
      raise
    raise err from e
  like = lambda t: [
    (np.shape(x), str(getattr(x, "dtype", type(x)))) for x in jax.tree.leaves(t)
  ]
  k = len(cfg.roles.state_argnums)  # then the NNX objects' non-Param state
  nodes, old = ev.states[k:], threaded[k:]
  if jax.tree.structure(nodes) != jax.tree.structure(old):
    paths = tree_utils.leaf_paths(nodes)
    added = tree_utils.diff_paths(tree_utils.leaf_paths(old), paths)[1]
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): it adds state to the NNX module it is given "
      f"(e.g. by sow: {added or paths}), which the microbatch loop cannot "
      "carry. Take it out in loss_fn (nnx.pop(model, nnx.Intermediate)) "
      "and return it as aux with has_aux=True (stacked per microbatch)."
    )
  got, want = jax.tree.structure(ev.states), jax.tree.structure(threaded)
  if got != want or like(ev.states) != like(threaded):
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): the new state ({got}) is not shaped like state "
      f"argument(s) {cfg.roles.state_argnums} ({want}); keep its structure, "
      "shapes and dtypes."
    )
  return ev


def _add(cfg, g, st, grads, ev) -> AccumState:
  w = terms.presence(ev, g.terms) if g.known else ev.weights[g.terms[0]]
  mean = cfg.mode == "mean" and not g.known
  add = (
    accumulation.add if cfg.spmd is None else cfg.spmd.add
  )  # FSDP: scattered
  return add(st, grads, w, mean=mean, name=_WHAT)


def _tally(cfg, g, old, new, ev, sums) -> dict:
  """``g``'s loss sums and weights where its window took the microbatch."""
  took = new.rejected == old.rejected
  sums = dict(sums)
  for t in g.terms:
    wf, (loss_sum, w_sum) = ev.weights[t].astype(_F32), sums[t]
    part = jnp.where(took & (wf > 0), terms.part(cfg, ev, t), 0.0)
    sums[t] = (loss_sum + part, w_sum + jnp.where(took, wf, 0.0))
  return sums


def _check_rows(loss, axes) -> None:
  """Refuses a loss varying over ``shard_map`` axes not in ``axis_name``."""
  extra = tuple(sorted(set(tree_utils.varying_axes(loss)) - set(axes)))
  if extra:
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes or None}): the loss varies over {extra} "
      "(a shard_map's rows): pass axis_name over them (one reduction), or "
      "call f outside shard_map on the global batch."
    )


def _body(cfg, call, groups, norms, scale, axes):
  def body(i, carry: _Carry) -> _Carry:
    values = tree_utils.to_varying(margs.diff_values(call), axes)
    states, sums, ev = [], carry.sums, None
    for g, st in zip(groups, carry.states):
      fn = _objective(cfg, call, g, norms, i, carry.threaded, scale)
      out, pull, got = jax.vjp(fn, values, has_aux=True)
      _check_rows(out, axes)
      ev = ev or got  # one evaluation: the others' forward is the same
      one = jnp.ones((), out.dtype)
      ct = tree_utils.vary_like(one, out, axes) if axes else one
      grads = margs.as_params(call, pull(ct)[0], cfg.roles)
      new = _add(cfg, g, st, grads, ev)
      sums = _tally(cfg, g, st, new, ev, sums)
      states.append(new)
    aux = jax.tree.map(lambda b, a: b.at[i].set(a), carry.aux, ev.aux)
    threaded = margs.vary(ev.states, axes)
    return _Carry(tuple(states), sums, aux, threaded)

  return body


def _loop(cfg, call, groups, norms, states, n_real, ev, threaded) -> _Carry:
  """Runs the microbatches into the windows ``states`` (over their axes)."""
  axes = states[0].placement.axes
  scale = states[0].loss_scale
  aux = jax.tree.map(lambda s: jnp.zeros((call.k,) + s.shape, s.dtype), ev.aux)
  zero = jnp.zeros((), _F32)
  sums = tree_utils.to_varying({t: (zero, zero) for t in ev.terms}, axes)
  aux = tree_utils.to_varying(aux, axes)
  carry = _Carry(tuple(states), sums, aux, threaded)
  body = _body(cfg, call, groups, norms, scale, axes)
  if n_real is None:
    return jax.lax.fori_loop(0, call.k, body, carry)
  # A cond on the count: XLA hoists an index-free body (K = 1) out of loops.
  loop = lambda c: jax.lax.fori_loop(0, n_real, body, c)
  return jax.lax.cond(n_real > 0, loop, lambda c: c, carry)


# ------------------------------------------------------------ the public --


def _to_window(state: Any, axes: tuple[str, ...]):
  """The window to add to, and whether it was a block of a stacked one."""
  what = f"{_WHAT}(...).accumulate(state)"
  state = validation.instance(
    state, AccumState, what=what, hint="Pass the open window (from wa.init)."
  )
  if not axes:
    if state.placement.kind != base.GLOBAL:
      raise WeightedAccumulationError(
        f"{what}: the window is per replica over {state.placement.axes}; "
        "build f with that axis_name, or use a global wa.init(params) window."
      )
    return state, False
  block = replicas.is_stacked(state)
  if block:
    state = replicas.unstack(state, axes, what)
  pl = state.placement
  if pl.kind != base.REPLICA or pl.reduce != "window" or pl.axes != axes:
    raise WeightedAccumulationError(
      f"{what}: expected a per-replica window over {axes} (reduce='window'), "
      f"got {pl.kind} over {pl.axes} (reduce={pl.reduce!r}). Make it with "
      f"wa.init(params, axis_name={axes!r}) inside the shard_map."
    )
  return replicas.as_varying(state, axes), block


def _data_parallel(axis_name: Any) -> DataParallel | None:
  if axis_name is None or isinstance(axis_name, DataParallel):
    return axis_name
  what = f"{_WHAT}(axis_name=...)"
  return DataParallel(validation.axis_names(axis_name, what=what))


def _configure(loss_fn, num_microbatches, **kw) -> _Config:
  if not callable(loss_fn):
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): {loss_fn!r} is not callable."
    )
  what = lambda name: f"{_WHAT}({name}=...)"
  dt = kw.pop("dtype")  # None: the params' (read by init)
  if dt is not None:
    dt = validation.work_dtype(dt, what=what("dtype"))
  return _Config(
    loss_fn=loss_fn,
    mode=validation.mode(kw.pop("mode"), what=what("mode")),
    has_aux=validation.static_flag(kw.pop("has_aux"), what=what("has_aux")),
    dtype=dt,
    grads_dtype=validation.grads_dtype(
      kw.pop("grads_dtype"), what=what("grads_dtype")
    ),
    loss_scale=validation.loss_scale(
      kw.pop("loss_scale"),
      what=what("loss_scale"),
      dtype=numerics.tally_dtype(dt),
    ),
    dp=_data_parallel(kw.pop("axis_name")),
    roles=margs.configure(_WHAT, num_microbatches=num_microbatches, **kw),
  )


class _Prepared(NamedTuple):
  call: margs.Call
  n_real: Any
  ev: terms.Eval
  threaded: tuple


def _prepare(cfg: _Config, args: tuple, kwargs: dict, n_real: Any):
  """One call's arguments checked and split, the evaluation's shapes."""
  axes = cfg.axes
  if axes:
    validation.bound_axes(axes, what=f"{_WHAT}(axis_name=...)")
  call = margs.prepare(_WHAT, cfg.roles, args, kwargs)
  if n_real is not None and not cfg.roles.split_named:
    raise WeightedAccumulationError(
      f"{_WHAT}: num_real_microbatches=n runs microbatches 0..n-1 only: name "
      "the split (split='contiguous': a padded batch, real rows first; "
      "'strided': real row r needs r % K < n)."
    )
  n_real = validation.num_real(n_real, call.k, what=_WHAT)
  threaded = margs.states(call, cfg.roles)
  if axes:  # each replica its own keys and NNX RNG streams
    r = jax.lax.axis_index(axes)
    call = call._replace(args=tuple(margs.fold_keys(cfg.roles, call.args, r)))
    k = len(cfg.roles.state_argnums)  # a module's streams; restored after
    threaded = threaded[:k] + margs.fold_rng_keys(threaded[k:], r)
    threaded = margs.vary(threaded, axes)
  return _Prepared(call, n_real, _shapes(cfg, call, threaded), threaded)


def _with_state(cfg: _Config, call, result: Any, threaded: tuple) -> Any:
  threaded = margs.write_back(call, cfg.roles, threaded)
  if not cfg.roles.state_argnums:
    return result
  return result, threaded[0] if cfg.roles.single_state else threaded


def call_scale(cfg: _Config, loss_scale: Any) -> Any:
  """The call's loss scale (``f``'s, else the configured one), validated."""
  if loss_scale is None:
    return cfg.loss_scale
  return validation.loss_scale(
    loss_scale,
    what=f"{_WHAT}(...)(loss_scale=)",
    dtype=numerics.tally_dtype(cfg.dtype),
  )


def _step(cfg: _Config, args, kwargs, n_real, loss_scale, normalizers):
  """``f``: one call's microbatches into fresh windows, closed."""
  p = _prepare(cfg, args, kwargs, n_real)
  names = list(p.ev.terms)
  what = f"{_WHAT}(...)(normalizers=...)"
  norms = validation.normalizers(normalizers, names, what=what)
  for t, v in norms.items():  # one divisor for every replica
    validation.shared(
      v, cfg.axes, what=what + ("" if t is None else f"[{t!r}]")
    )
  groups = terms.groups(names, norms, cfg.mode)
  ls = call_scale(cfg, loss_scale)
  params = margs.as_params(p.call, margs.diff_values(p.call), cfg.roles)
  if cfg.spmd is not None:  # scatter_each: a carry of each FSDP shard
    params = cfg.spmd.buffers(params)
  new = lambda: (
    dist.make(params, cfg.axes, "window", cfg.dtype, ls)
    if cfg.axes
    else accumulation.init(params, cfg.dtype, ls)
  )
  states = [new() for _ in groups]
  carry = _loop(cfg, p.call, groups, norms, states, p.n_real, p.ev, p.threaded)
  for st in carry.states:
    if not tree_utils.is_traced(st.weight_hi):
      validation.nonempty_window(st, what=_WHAT)
  loss, out = terms.conclude(cfg, p.call, groups, norms, carry)
  result = ((loss, carry.aux), out) if cfg.has_aux else (loss, out)
  return _with_state(cfg, p.call, result, carry.threaded)


def _accumulate(cfg: _Config, state, args, kwargs, n_real):
  """``f.accumulate``: one call's microbatches into an open window."""
  p = _prepare(cfg, args, kwargs, n_real)
  if list(p.ev.terms) != [None]:
    raise WeightedAccumulationError(
      f"{_WHAT}(...).accumulate: loss_fn returns loss terms "
      f"{sorted(map(str, p.ev.terms))}; a window across calls has one normaliser: return one loss."
    )
  st, block = _to_window(state, cfg.axes)
  groups = (terms.Group((None,), False),)
  carry = _loop(cfg, p.call, groups, {}, [st], p.n_real, p.ev, p.threaded)
  value, st = carry.sums[None], carry.states[0]
  if block:
    st = replicas.stack(st, cfg.axes)
  result = ((value, carry.aux) if cfg.has_aux else value), st
  return _with_state(cfg, p.call, result, carry.threaded)
