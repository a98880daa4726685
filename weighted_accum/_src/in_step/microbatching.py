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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import finishing
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.in_step import microbatch_args as margs
from weighted_accum._src.in_step import microbatch_terms as terms
from weighted_accum._src.in_step import microbatching_spmd as spmd
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
  its window took it."""
  took = new.rejected == old.rejected
  sums = dict(sums)
  for t in g.terms:
    wf = ev.weights[t].astype(_F32)
    part = terms.part(cfg, ev, t)
    use = took & (wf > 0) if not g.known else took
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
  scale = states[0].loss_scale
  aux = jax.tree.map(lambda s: jnp.zeros((call.k,) + s.shape, s.dtype), ev.aux)
  zero = jnp.zeros((), _F32)
  sums = {t: (zero, zero) for t in ev.terms}
  carry = _Carry(
    tuple(states),
    tree_utils.to_varying(sums, axes),
    tree_utils.to_varying(aux, axes),
    threaded,
  )
  upper = call.k if n_real is None else n_real
  body = _body(cfg, call, groups, norms, scale)
  return jax.lax.fori_loop(0, upper, body, carry)


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
  per_replica = ("grads",) + base.named(base.SUMMED) + base.named(base.LOCAL)
  return state.replace(
    **{f: tree_utils.to_varying(getattr(state, f), axes) for f in per_replica}
  ), block


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
      finishing.refuse_empty(st, _WHAT)
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


@validation.refuse_removed(
  batch_argnames="batch_argnums takes keyword names too: "
  "batch_argnums='mask', or ('x', 'mask').",
  in_axes="Give each batch argument's axis in a mapping: "
  "batch_argnums={1: 0, 'mask': 1} (argument -> batch axis).",
  data_axes="axis_name=... covers it: called under plain jax.jit, f takes "
  "the global batch sharded over those axes; inside shard_map, this "
  "replica's rows.",
  param_specs="Pass axis_name=wa.distributed.DataParallel(axes, "
  "param_specs=...).",
  fsdp="Pass axis_name=wa.distributed.DataParallel(axes, fsdp=...).",
)
def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int | None = None,
  *,
  mode: str,
  microbatch_size: int | None = None,
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  batch_argnums: int | str | Sequence[int | str] | Mapping | None = None,
  split: str | None = None,
  state_argnums: int | Sequence[int] = (),
  key_argnums: int | Sequence[int] = (),
  dtype: Any = jnp.float32,
  grads_dtype: Any = None,
  loss_scale: Any = 1.0,
  axis_name: str | Sequence[str] | DataParallel | None = None,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` over K microbatches in one loop, exact.

  The batch arguments are split into K microbatches; one loop iteration
  computes one microbatch's loss and gradient and adds it to work-dtype
  buffers with :func:`weighted_accum.accumulate_sum` (or
  ``accumulate_mean``), so only one microbatch's activations are live at a
  time. The result is divided once: it equals the gradient of the full
  batch's mean loss ``sum(loss sums) / sum(weights)`` whatever the weights
  per microbatch. Each argument of ``loss_fn`` has one role: differentiated
  (``argnums``), split (``batch_argnums``), threaded
  state (``state_argnums``), a random key per microbatch (``key_argnums``),
  or passed unchanged (any value, strings and functions included).

  What ``loss_fn`` returns for one microbatch, and what ``f`` returns:

  ==================  ======================================  ================================
  options             ``loss_fn`` returns                     ``f(...)`` returns
  ==================  ======================================  ================================
  neither             ``(loss, weight)``                      ``(loss, out)``
  ``has_aux``         ``((loss, weight), aux)``               ``((loss, aux), out)``
  ``state_argnums``   ``((loss, weight), new_state)``         ``((loss, out), state)``
  both                ``(((loss, weight), aux), new_state)``  ``(((loss, aux), out), state)``
  ==================  ======================================  ================================

  ``f.accumulate(window, ...)`` nests its result the same way, with
  ``(loss_sum, weight)`` in place of ``loss`` and the new window in place of
  ``out``. ``new_state`` and ``state`` are one state for an int
  ``state_argnums`` and a tuple of states, one per argument, for a
  sequence; ``state`` is the last microbatch's.

  Args:
    loss_fn: called as ``loss_fn(*args, **kwargs)`` on one microbatch;
      returns ``(loss, weight)``, nested with ``aux`` and the new state as
      the table above says. ``weight`` is the microbatch's effective item
      count (e.g. ``mask.sum()``), not differentiated. ``loss`` may be a
      dict of loss terms, each normalised by its own total weight (then
      ``weight`` is a dict with the same keys, or one weight for all; a
      weight of 1 per microbatch averages a term over the microbatches):
      the gradient is that of the sum of the terms' means.
    num_microbatches: K, a positive int dividing the batch size; or
      ``None`` with ``microbatch_size``.
    mode: required. ``"sum"``: ``loss`` is the microbatch's loss SUM over
      its items; ``"mean"``: it is that sum divided by ``weight`` (a fully
      masked microbatch, 0/0, adds nothing). No default is safe: the wrong
      one weights every microbatch wrongly.
    microbatch_size: the rows per microbatch instead of K (K = batch size /
      microbatch_size), as ``optax.microbatching``.
    has_aux: whether ``loss_fn`` returns an aux value.
    argnums: the positional argument(s) to differentiate (the params: any
      pytree, ``nnx.State`` or a whole ``eqx.Module`` included). Only their
      floating array leaves are differentiated; the others (ints, bools,
      Python numbers, functions: an Equinox module's static half) are held
      fixed and get ``None`` gradients, as with
      ``eqx.filter_value_and_grad``. A whole ``nnx.Module`` is taken as
      ``nnx.value_and_grad`` takes it: its ``nnx.Param`` state is
      differentiated (the grads are an ``nnx.State``), its other state (RNG
      streams, batch statistics) is threaded and written back.
    batch_argnums: the argument(s) to split (pytrees whose leaves share a
      batch axis): a position, a keyword name (optax's ``argnames``), a
      sequence of them (batch axis 0), or a mapping from each to its batch
      axis, e.g. ``{1: 0, "mask": 1}``. Default: argument 1.
    split: how rows are dealt: ``"strided"`` (the default: microbatch k
      holds rows ``k::K``, as ``optax.microbatching`` and MaxText; a
      data-sharded batch stays spread over the devices) or ``"contiguous"``
      (microbatch k holds rows ``[k*B/K, (k+1)*B/K)``: a loader's padded
      batch, real rows first). Required with ``num_real_microbatches``.
    state_argnums: positional argument(s) threaded through the loop
      (batch-norm statistics, NNX RNG streams and other non-parameter
      state, flax ``mutable`` collections): each microbatch gets the state
      the previous one returned; ``f`` returns the last.
    key_argnums: positional argument(s) holding one PRNG key each (or a
      pytree of keys): microbatch i gets ``jax.random.fold_in(key, i)``, so
      dropout differs across microbatches.
    dtype: the accumulation work dtype.
    grads_dtype: the dtype of the returned gradients: ``None`` (the work
      dtype), ``"params"`` (each param's own dtype), or a floating dtype.
    loss_scale: each microbatch's loss is multiplied by it before
      differentiating; divided out once at the end (float16: e.g. 2**12).
      A number, a scalar array, or a :class:`~weighted_accum.DynamicLossScale`
      (its ``scale``; adjust it with ``out.finite`` after the step). ``f``'s
      own ``loss_scale=`` keyword overrides it per call (a traced value
      does not recompile).
    axis_name: the data axis (or axes) the batch is split over, or a
      :class:`~weighted_accum.distributed.DataParallel` that also gives the
      params' FSDP layout. Called inside ``jax.shard_map`` over these axes,
      ``f`` takes this replica's rows; called under plain ``jax.jit``, the
      global batch sharded over them (the loop then runs in a
      partial-manual ``shard_map`` over just these axes; each batch leaf's
      rows divisible by ``N * K``; ``split="contiguous"`` and
      ``state_argnums`` refused there; keys also folded with the replica's
      index). Either way a call reduces the sums, the weights and the
      counters ONCE whatever K (``docs/scaling.md``).

  Returns:
    ``f(*args, num_real_microbatches=None, loss_scale=None,
    normalizers=None, **kwargs)`` returning ``(loss, out)``, nested with
    ``aux`` and the last state as the table above says. ``loss`` is the
    exact float32 mean loss (a dict of the
    terms' means for a dict of terms), ``aux`` is stacked on a leading K
    axis (microbatch order, zeros where skipped), ``out`` an
    :class:`~weighted_accum.AccumulatedGradients` (mean gradient, total
    weight (per term), ``issued``, ``finite``, ``valid``; ``valid`` is also
    false when a microbatch's weight was negative or non-finite: such a
    microbatch is dropped). ``num_real_microbatches`` (an int, traced or
    not) runs only microbatches ``k < num_real_microbatches``; the others
    are not computed and no recompilation happens across values.
    ``normalizers`` gives loss terms' normalisers known before the loop (a
    number for a single loss, else a dict by term, traced values welcome):
    such a term's sum is divided by it instead of by its total weight, and
    with ``mode="sum"`` all such terms share one window (one buffer, one
    backward pass; with ``"mean"`` each keeps its own, so a fully masked
    term's 0/0 mean adds nothing); every other term of a dict takes a window
    of its own. ``kwargs`` go to
    ``loss_fn``. ``f.accumulate(state, *args, num_real_microbatches=None,
    **kwargs)`` adds the call's microbatches to an open window ``state``
    without finishing and returns ``((loss_sum, weight), state)``, nested
    with ``aux`` and the last threaded state as ``f``'s result (the table
    above), the call's unscaled loss sum and weight; it uses the state's
    work dtype and loss scale.
    Under plain ``jit`` with ``axis_name``, ``aux`` leaves are ``[K, N, ...]`` (``aux[k, r]``
    replica ``r``'s value for its rows of microbatch ``k``, sharded over
    the data axes on dimension 1), and ``f.accumulate`` takes a per-replica
    window stacked over the replicas
    (:func:`weighted_accum.init` with ``axis_name``, outside ``shard_map``)
    and runs no collective: ``loss_sum`` and ``weight`` are per replica,
    ``[N]``; close the window with ``wa.apply_window`` or
    ``wa.finish_mean`` (one reduction). Inside ``shard_map`` it takes this
    replica's window (``wa.init(params, axis_name=...)`` there) or its
    block of a stacked one, and returns the same kind.

  Raises:
    WeightedAccumulationError: for an invalid configuration, arguments that
      do not fit the roles, batch leaves whose sizes differ or are not
      divisible by K, a ``loss_fn`` that does not return ``(loss, weight)``,
      a loss that is not a floating scalar, a returned state shaped unlike
      the state argument, ``num_real_microbatches`` without ``split``, an
      ``axis_name`` that the batch's mesh does not have or whose replicas
      times K do not divide the batch, FSDP param
      specs the reduce-scatter cannot produce, or (eagerly) a call whose
      total weight is 0.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> def loss_fn(w, batch):            # batch: (x, mask)
    ...   x, mask = batch
    ...   return jnp.sum(mask * (x * w) ** 2), mask.sum()
    >>> x = jnp.arange(8.0)
    >>> mask = jnp.array([1., 1, 1, 0, 1, 0, 0, 0])
    >>> f = jax.jit(wa.microbatched_value_and_grad(loss_fn, 4, mode='sum'))
    >>> loss, out = f(jnp.float32(1.0), (x, mask))
    >>> full = jax.grad(lambda w: loss_fn(w, (x, mask))[0] / 4)(1.0)
    >>> float(loss), float(out.grads), float(full), float(out.weight)
    (5.25, 10.5, 10.5, 4.0)
  """
  cfg = _configure(
    loss_fn,
    num_microbatches,
    mode=mode,
    microbatch_size=microbatch_size,
    has_aux=has_aux,
    argnums=argnums,
    **_batch_roles(batch_argnums),
    split=split,
    state_argnums=state_argnums,
    key_argnums=key_argnums,
    dtype=dtype,
    grads_dtype=grads_dtype,
    loss_scale=loss_scale,
    **_data_parallel(axis_name),
  )
  return _functions(cfg)


def _batch_roles(batch_argnums: Any) -> dict[str, Any]:
  """``batch_argnums`` as the loop's roles: positions, keyword names and
  each one's batch axis (positions first, then names)."""
  if batch_argnums is None:
    return dict(batch_argnums=None, batch_argnames=(), in_axes=0)
  if isinstance(batch_argnums, Mapping):
    keys, axes = list(batch_argnums), list(batch_argnums.values())
    for key, ax in zip(keys, axes):
      if isinstance(ax, bool) or not isinstance(ax, (int, np.integer)):
        raise WeightedAccumulationError(
          f"{_WHAT}(batch_argnums={batch_argnums!r}): the batch axis of "
          f"argument {key!r} is {ax!r}; map each batch argument (a position "
          "or a keyword name) to an int axis, e.g. {1: 0, 'mask': 1}."
        )
  elif isinstance(batch_argnums, (str, int, np.integer)):
    keys, axes = [batch_argnums], None
  else:
    keys, axes = list(batch_argnums), None
  names = [k for k in keys if isinstance(k, str)]
  nums = [k for k in keys if not isinstance(k, str)]
  if axes is not None:  # positions first, then names
    by_key = dict(zip(keys, axes))
    axes = [by_key[k] for k in nums + names]
  single = isinstance(batch_argnums, (int, np.integer))
  return dict(
    batch_argnums=batch_argnums if single else tuple(nums),
    batch_argnames=tuple(names),
    in_axes=0 if axes is None else tuple(axes),
  )


def _data_parallel(axis_name: Any) -> dict[str, Any]:
  """``axis_name`` as the loop's data-parallel options: the axes (inside
  ``shard_map``: this replica's rows; under plain ``jit``: the global
  batch over them) and the FSDP layout."""
  if axis_name is None:
    return dict(
      axis_name=None, data_axes=None, param_specs=None, fsdp="gather_once"
    )
  dp = axis_name
  if not isinstance(dp, DataParallel):
    axes = validation.axis_names(axis_name, what=f"{_WHAT}(axis_name=...)")
    dp = DataParallel(axes)
  return dict(
    axis_name=dp.axes,
    data_axes=dp.axes,
    param_specs=dp.param_specs,
    fsdp=dp.fsdp,
  )


def _functions(cfg: _Config) -> Callable[..., Any]:
  """``f`` and its ``.accumulate`` for one configuration."""
  eager: dict = {}  # data_axes: the compiled programs of eager calls

  inside = cfg._replace(data_axes=None)

  def global_batch() -> bool:
    """Called under plain ``jit`` on the global batch (the data axes not
    bound by an enclosing ``shard_map``)."""
    return cfg.data_axes is not None and not replicas.bound(cfg.data_axes)

  def f(
    *args, num_real_microbatches=None, loss_scale=None, normalizers=None, **kw
  ):
    args = margs.float_params(cfg.roles, args)
    n_real = num_real_microbatches
    if global_batch():
      ls = call_scale(cfg, loss_scale)
      call = (args, kw, n_real, ls, normalizers)
      return spmd.value_and_grad(cfg, _step, call, eager)
    typed = None
    if cfg.data_axes is None:  # an Explicit batch names its data axes
      typed = spmd.typed_data_axes(cfg, args, kw)
    if typed is not None:
      axes, n = typed  # reduce once, not K times
      call = (args, kw, n_real, call_scale(cfg, loss_scale), normalizers)
      try:
        typed_cfg = cfg._replace(data_axes=axes)
        loss, out = spmd.value_and_grad(typed_cfg, _step, call, eager)
      except Exception:  # pylint: disable=broad-except
        pass  # e.g. a loss_fn that names a data axis: run it as written
      else:  # issued counted as without data axes: K, not N x K
        return loss, out.replace(issued=out.issued // n)
    return _step(inside, args, kw, n_real, loss_scale, normalizers)

  def accumulate(state, *args, num_real_microbatches=None, **kw):
    args = margs.float_params(cfg.roles, args)
    if global_batch():
      return spmd.accumulate(
        cfg, _accumulate, state, (args, kw, num_real_microbatches), eager
      )
    return _accumulate(inside, state, args, kw, num_real_microbatches)

  f.accumulate = accumulate
  return f
