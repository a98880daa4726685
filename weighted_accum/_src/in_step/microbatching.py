"""In-step microbatching: one call splits a batch into K microbatches, runs
them one after another in a loop and returns the exact weighted mean gradient.

``microbatched_value_and_grad`` builds the step function (its ``.accumulate``
adds one call into an open window instead). The arguments' roles and the
split are in :mod:`weighted_accum._src.in_step.microbatch_args`; this module runs
``loss_fn`` on each microbatch, adds its gradients on the one accumulate
path, threads non-parameter state from one microbatch to the next, and
closes on the one close path. Loss terms with different normalisers each
take a window of their own, except those whose normaliser is known before
the loop, which share one. Rationale, memory and all-reduce figures:
``docs/microbatching.md``.
"""

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
from weighted_accum._src.in_step import microbatching_spmd as spmd
from weighted_accum._src.parallel import distributed as dist
from weighted_accum._src.parallel import replicas

_F32 = jnp.float32
_WHAT = "microbatched_value_and_grad"


class _Config(NamedTuple):
  """The static choices of one ``microbatched_value_and_grad``."""

  loss_fn: Callable[..., Any]
  mode: str
  has_aux: bool
  roles: margs.Roles
  dtype: np.dtype
  grads_dtype: Any  # None (the work dtype), "params" or a dtype
  loss_scale: Any
  axis_name: tuple[str, ...] | None
  data_axes: tuple[str, ...] | None = None
  param_specs: Any = None
  fsdp: str = "gather_once"
  spmd: Any = None  # inside the data_axes shard_map: a spmd.Layout


# -------------------------------------------------------- one microbatch --


def _objective(cfg, call, group, norms, i, threaded, scale):
  """What one microbatch differentiates for one window: a function of the
  differentiated leaves returning the window's scaled scalar and the
  evaluation. One function per window: a term's backward pass never meets
  another window's terms (a fully masked term's 0/0 stays out of it)."""

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
  """``loss_fn`` on microbatch ``i``; the threaded states it leaves (those
  it returns, then the NNX objects' non-Param state it mutated)."""
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
  """The evaluation's shapes (microbatch 0: term names, aux), the threaded
  states checked to come back as they went in."""
  values = margs.diff_values(call)

  def first():
    return _evaluate(cfg, call, 0, values, threaded)

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
  got, want = jax.tree.structure(ev.states), jax.tree.structure(threaded)
  if got != want or like(ev.states) != like(threaded):
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): the new state it returns ({got}) is not shaped "
      f"like the state argument(s) {cfg.roles.state_argnums} ({want}); the "
      "state threaded through the microbatches must keep its structure, "
      "shapes and dtypes."
    )
  return ev


def _add(cfg, g, st, grads, ev) -> AccumState:
  w = terms.presence(ev, g.terms) if g.known else ev.weights[g.terms[0]]
  mean = cfg.mode == "mean" and not g.known
  if cfg.spmd is not None:  # data_axes: FSDP grads may be scattered each
    return cfg.spmd.add(st, grads, w, mean=mean, name=_WHAT)
  return accumulation.add(st, grads, w, mean=mean, name=_WHAT)


def _tally(cfg, g, old, new, ev, sums) -> dict:
  """Adds the microbatch's loss sums and weights of ``g``'s terms, where
  its window took it. A term of weight 0 adds nothing to its loss sum, not
  even NaN (a fully masked microbatch), whatever the mode and normaliser."""
  took = new.rejected == old.rejected
  sums = dict(sums)
  for t in g.terms:
    wf = ev.weights[t].astype(_F32)
    part = terms.part(cfg, ev, t)
    use = took & (wf > 0)
    loss_sum, w_sum = sums[t]
    sums[t] = (
      loss_sum + jnp.where(use, part, 0.0),
      w_sum + jnp.where(took, wf, 0.0),
    )
  return sums


def _body(cfg, call, groups, norms, scale):
  axes = cfg.axis_name or ()

  def body(i, carry: _Carry) -> _Carry:
    values = tree_utils.to_varying(margs.diff_values(call), axes)
    states, sums, ev = [], carry.sums, None
    for g, st in zip(groups, carry.states):
      fn = _objective(cfg, call, g, norms, i, carry.threaded, scale)
      out, pull, got = jax.vjp(fn, values, has_aux=True)
      ev = ev or got  # one evaluation: the others' forward is the same
      one = jnp.ones((), out.dtype)
      ct = tree_utils.vary_like(one, out, axes) if axes else one
      grads = margs.as_params(call, pull(ct)[0], cfg.roles)
      new = _add(cfg, g, st, grads, ev)
      sums = _tally(cfg, g, st, new, ev, sums)
      states.append(new)
    aux = jax.tree.map(lambda b, a: b.at[i].set(a), carry.aux, ev.aux)
    threaded = tree_utils.to_varying(ev.states, axes)
    return _Carry(tuple(states), sums, aux, threaded)

  return body


def _loop(cfg, call, groups, norms, states, n_real, ev, threaded) -> _Carry:
  """Runs the microbatches into the windows ``states``; returns the final
  carry (windows, per-term float32 loss sums and weights of the microbatches
  taken, stacked aux, threaded states)."""
  axes = cfg.axis_name or ()
  aux = jax.tree.map(lambda s: jnp.zeros((call.k,) + s.shape, s.dtype), ev.aux)
  zero = jnp.zeros((), _F32)
  sums = tree_utils.to_varying({t: (zero, zero) for t in ev.terms}, axes)
  aux = tree_utils.to_varying(aux, axes)
  carry = _Carry(tuple(states), sums, aux, threaded)
  body = _body(cfg, call, groups, norms, states[0].loss_scale)
  if n_real is None:
    return jax.lax.fori_loop(0, call.k, body, carry)
  # A cond on the count: XLA hoists an index-free body (K = 1) out of loops.
  loop = lambda c: jax.lax.fori_loop(0, n_real, body, c)
  return jax.lax.cond(n_real > 0, loop, lambda c: c, carry)


# ------------------------------------------------------------ the public --


def _to_window(state: Any, axes: tuple[str, ...] | None):
  """The window to add to, and whether it was this replica's block of a
  stacked window (returned as one)."""
  what = f"{_WHAT}(...).accumulate(state)"
  state = validation.instance(
    state,
    AccumState,
    what=what,
    hint="Pass the open window (from wa.init).",
  )
  if axes is None:
    if state.placement.kind != base.GLOBAL:
      raise WeightedAccumulationError(
        f"{what}: this window is per replica over {state.placement.axes} "
        "(wa.init(..., axis_name=...)), but this function has no axis_name: "
        "build it with the window's axis_name, or start a global window "
        "with wa.init(params)."
      )
    return state, False
  block = replicas.is_stacked(state)
  if block:
    state = replicas.unstack(state, axes, what)
  pl = state.placement
  if pl.kind != base.REPLICA or pl.reduce != "window" or pl.axes != axes:
    raise WeightedAccumulationError(
      f"{what}: this function adds each replica's sums over {axes} and "
      "reduces them once at the close, but the window is "
      f"{pl.kind} (axes {pl.axes}, reduce={pl.reduce!r}). Make it with "
      f"wa.init(params, axis_name={axes!r}) inside the shard_map."
    )
  return replicas.as_varying(state, axes), block


def _configure(loss_fn, num_microbatches, **kw) -> _Config:
  if not callable(loss_fn):
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): {loss_fn!r} is not callable."
    )
  roles = margs.configure(
    _WHAT,
    num_microbatches=num_microbatches,
    **{k: kw.pop(k) for k in _ROLE_KEYS},
  )
  dt = validation.work_dtype(kw["dtype"], what=f"{_WHAT}(dtype=...)")
  return _Config(
    loss_fn=loss_fn,
    mode=validation.mode(kw["mode"], what=f"{_WHAT}(mode=...)"),
    has_aux=validation.static_flag(kw["has_aux"], what=f"{_WHAT}(has_aux=)"),
    roles=roles,
    dtype=dt,
    grads_dtype=validation.grads_dtype(
      kw["grads_dtype"], what=f"{_WHAT}(grads_dtype=...)"
    ),
    loss_scale=validation.loss_scale(
      kw["loss_scale"],
      what=f"{_WHAT}(loss_scale=...)",
      dtype=numerics.tally_dtype(dt),
    ),
    axis_name=validation.optional_axis_names(
      kw["axis_name"], what=f"{_WHAT}(axis_name=...)"
    ),
    **spmd.options(kw),
  )


_ROLE_KEYS = (
  "microbatch_size",
  "argnums",
  "batch_argnums",
  "batch_argnames",
  "in_axes",
  "state_argnums",
  "key_argnums",
  "split",
)


class _Prepared(NamedTuple):
  call: margs.Call
  n_real: Any
  ev: terms.Eval
  threaded: tuple


def _prepare(cfg: _Config, args: tuple, kwargs: dict, n_real: Any):
  """One call's arguments checked and split, the evaluation's shapes."""
  if cfg.axis_name is not None:
    validation.bound_axes(cfg.axis_name, what=f"{_WHAT}(axis_name=...)")
  call = margs.prepare(_WHAT, cfg.roles, args, kwargs)
  if n_real is not None and not cfg.roles.split_named:
    raise WeightedAccumulationError(
      f"{_WHAT}: num_real_microbatches=n runs microbatches 0..n-1 only, so "
      "the real rows must lie in them: name the split. split='contiguous' "
      "(microbatch k = the k-th block of B/K rows) fits a loader's padded "
      "batch, real rows first; split='strided' (microbatch k = rows k::K) "
      "needs real row r to have r % K < n. Pass split= to "
      "microbatched_value_and_grad."
    )
  n_real = validation.num_real(n_real, call.k, what=_WHAT)
  axes = cfg.axis_name or ()
  threaded = tree_utils.to_varying(margs.states(call, cfg.roles), axes)
  return _Prepared(call, n_real, _shapes(cfg, call, threaded), threaded)


def _with_state(cfg: _Config, call, result: Any, threaded: tuple) -> Any:
  threaded = margs.write_back(call, cfg.roles, threaded)
  if not cfg.roles.state_argnums:
    return result
  return result, threaded[0] if cfg.roles.single_state else threaded


def call_scale(cfg: _Config, loss_scale: Any) -> Any:
  """The call's loss scale (``f``'s ``loss_scale=``, else the configured
  one), validated in the window's scale dtype (float64 stays float64)."""
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
  norms = validation.normalizers(
    normalizers, names, what=f"{_WHAT}(...)(normalizers=...)"
  )
  for term, v in norms.items():  # one divisor for every replica
    where = f"{_WHAT}(...)(normalizers=...)" + (
      "" if term is None else f"[{term!r}]"
    )
    validation.shared(v, cfg.axis_name or (), what=where)
  groups = terms.groups(names, norms, cfg.mode)
  ls = call_scale(cfg, loss_scale)
  params = margs.as_params(p.call, margs.diff_values(p.call), cfg.roles)
  if cfg.spmd is not None:  # scatter_each: a carry of each FSDP shard
    params = cfg.spmd.buffers(params)
  new = lambda: (
    accumulation.init(params, cfg.dtype, ls)
    if cfg.axis_name is None
    else dist.make(params, cfg.axis_name, "window", cfg.dtype, ls)
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
      f"{sorted(map(str, p.ev.terms))}; a window spanning calls has one "
      "normaliser. Return one loss, or call the function itself per batch."
    )
  st, block = _to_window(state, cfg.axis_name)
  groups = (terms.Group((None,), False),)
  carry = _loop(cfg, p.call, groups, {}, [st], p.n_real, p.ev, p.threaded)
  value, st = carry.sums[None], carry.states[0]
  if block:
    st = replicas.stack(st, cfg.axis_name)
  result = ((value, carry.aux) if cfg.has_aux else value), st
  return _with_state(cfg, p.call, result, carry.threaded)
