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

from collections.abc import Callable, Sequence
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
    args, kwargs = margs.microbatch(call, cfg.roles, i, values, threaded)
    ev = terms.evaluate(cfg, args, kwargs)
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
    return terms.evaluate(
      cfg, *margs.microbatch(call, cfg.roles, 0, values, threaded)
    )

  ev = jax.eval_shape(first)
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
    hint="Pass the open window (from wa.init or distributed.init).",
  )
  if axes is None:
    return state, False
  block = replicas.is_stacked(state)
  if block:
    state = replicas.unstack(state, axes, what)
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


def _with_state(cfg: _Config, result: Any, threaded: tuple) -> Any:
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
  groups = terms.groups(names, norms, cfg.mode)
  ls = call_scale(cfg, loss_scale)
  params = margs.as_params(p.call, margs.diff_values(p.call), cfg.roles)
  if cfg.spmd is not None:  # scatter_each: a carry of each FSDP shard
    params = cfg.spmd.buffers(params)
  new = lambda: (
    accumulation.init(params, cfg.dtype, ls)
    if cfg.axis_name is None
    else dist.init(params, cfg.axis_name, cfg.dtype, ls)
  )
  states = [new() for _ in groups]
  carry = _loop(cfg, p.call, groups, norms, states, p.n_real, p.ev, p.threaded)
  for st in carry.states:
    if not tree_utils.is_traced(st.weight_hi):
      finishing.refuse_empty(st, _WHAT)
  loss, out = terms.conclude(cfg, p.call, groups, norms, carry)
  result = ((loss, carry.aux), out) if cfg.has_aux else (loss, out)
  return _with_state(cfg, result, carry.threaded)


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
  return _with_state(cfg, result, carry.threaded)


def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int | None = None,
  *,
  mode: str,
  microbatch_size: int | None = None,
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  batch_argnums: int | Sequence[int] | None = None,
  batch_argnames: str | Sequence[str] = (),
  in_axes: int | Sequence[int] = 0,
  split: str | None = None,
  state_argnums: int | Sequence[int] = (),
  key_argnums: int | Sequence[int] = (),
  dtype: Any = jnp.float32,
  grads_dtype: Any = None,
  loss_scale: Any = 1.0,
  axis_name: str | Sequence[str] | None = None,
  data_axes: str | Sequence[str] | None = None,
  param_specs: Any = None,
  fsdp: str = "gather_once",
) -> Callable[..., Any]:
  """``jax.value_and_grad`` over K microbatches in one loop, exact.

  The batch arguments are split into K microbatches; one loop iteration
  computes one microbatch's loss and gradient and adds it to work-dtype
  buffers with :func:`weighted_accum.accumulate_sum` (or
  ``accumulate_mean``), so only one microbatch's activations are live at a
  time. The result is divided once: it equals the gradient of the full
  batch's mean loss ``sum(loss sums) / sum(weights)`` whatever the weights
  per microbatch. Each argument of ``loss_fn`` has one role: differentiated
  (``argnums``), split (``batch_argnums``, ``batch_argnames``), threaded
  state (``state_argnums``), a random key per microbatch (``key_argnums``),
  or passed unchanged (any value, strings and functions included).

  Args:
    loss_fn: called as ``loss_fn(*args, **kwargs)`` on one microbatch;
      returns ``(loss, weight)``, or ``((loss, weight), aux)`` with
      ``has_aux``; with ``state_argnums``, that paired with the new state:
      ``(..., new_state)``. ``weight`` is the microbatch's effective item
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
      ``eqx.filter_value_and_grad``.
    batch_argnums: the positional argument(s) to split (pytrees whose leaves
      share a batch axis); default 1, or none when ``batch_argnames`` is
      given.
    batch_argnames: keyword argument(s) to split (optax's ``argnames``).
    in_axes: the batch axis of each batch argument: an int, or one int per
      argument of ``batch_argnums`` then ``batch_argnames``.
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
    axis_name: call ``f`` inside ``jax.shard_map`` over this data axis (or
      axes) with this replica's rows: gradients are local and the call does
      ONE all-reduce of the sums and weights after the loop (per window of
      loss terms).
    data_axes: call ``f`` under plain ``jax.jit`` on the global batch, its
      batch axis sharded over these mesh axes (``Auto`` or ``Explicit``;
      the mesh is the batch's, or ``jax.set_mesh``'s): the loop then runs
      inside a partial-manual ``jax.shard_map`` over just these axes around
      the ``axis_name`` path, so a call reduces the gradient sums, the
      weights and the counters ONCE whatever K, and the returned grads keep
      the params' shardings. Each batch leaf's rows must be divisible by
      ``N * K`` (N: the replicas); microbatch ``k`` is then rows ``k::K`` as
      without ``data_axes`` (``split="strided"``; ``"contiguous"`` and
      ``state_argnums`` are refused: each replica's blocks and states would
      be its own). Random keys (``key_argnums``) are also folded with the
      replica's index, so replicas draw different masks. Arguments that are
      not arrays (strings, functions) reach ``loss_fn`` unchanged. Not with
      ``axis_name``.
    param_specs: under ``Auto`` axes with ``data_axes``, the params'
      ``PartitionSpec`` tree (``None`` leaves: replicated), which the types
      do not carry there: params sharded over a data axis (FSDP) get
      reduce-scattered gradients on their own sharding, and every gradient
      is constrained to its param's spec. Without it every param counts as
      replicated over the data axes (an FSDP param is then all-gathered at
      the boundary and its gradient returned replicated). On an
      ``Explicit`` mesh the specs are read from the params' types.
    fsdp: with ``data_axes``, how the gradients of params sharded over a
      data axis are reduced (the params are gathered once per call either
      way): ``"gather_once"`` keeps a full-size per-replica carry and
      reduce-scatters it once per call (bytes P per call, memory P);
      ``"scatter_each"`` reduce-scatters each microbatch's weighted
      gradient into a carry of the param's shard (bytes K * P, carry P/N).
      ``docs/scaling.md`` has the measured figures.

  Returns:
    ``f(*args, num_real_microbatches=None, loss_scale=None,
    normalizers=None, **kwargs)`` returning ``(loss, out)``, or ``((loss,
    aux), out)`` with ``has_aux`` (with ``state_argnums``: that paired with
    the last state). ``loss`` is the exact float32 mean loss (a dict of the
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
    without finishing and returns ``((loss_sum, weight), state)``
    (``(((loss_sum, weight), aux), state)`` with ``has_aux``; paired with
    the last threaded state with ``state_argnums``), the call's unscaled
    loss sum and weight; it uses the state's work dtype and loss scale.
    With ``data_axes``, ``aux`` leaves are ``[K, N, ...]`` (``aux[k, r]``
    replica ``r``'s value for its rows of microbatch ``k``, sharded over
    the data axes on dimension 1), and ``f.accumulate`` takes a per-replica
    window stacked over the replicas
    (:func:`weighted_accum.distributed.init` called outside ``shard_map``)
    and runs no collective: ``loss_sum`` and ``weight`` are per replica,
    ``[N]``; close the window with
    ``wa.apply_window(..., axis_name=data_axes)`` (one reduction). Inside
    ``shard_map`` with ``axis_name`` it also takes this replica's block of
    such a window (leading dimension 1) and returns one.

  Raises:
    WeightedAccumulationError: for an invalid configuration, arguments that
      do not fit the roles, batch leaves whose sizes differ or are not
      divisible by K, a ``loss_fn`` that does not return ``(loss, weight)``,
      a loss that is not a floating scalar, a returned state shaped unlike
      the state argument, ``num_real_microbatches`` without ``split``, an
      unbound ``axis_name``, ``data_axes`` that the batch's mesh does not
      have or whose replicas times K do not divide the batch, FSDP param
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
    batch_argnums=batch_argnums,
    batch_argnames=batch_argnames,
    in_axes=in_axes,
    split=split,
    state_argnums=state_argnums,
    key_argnums=key_argnums,
    dtype=dtype,
    grads_dtype=grads_dtype,
    loss_scale=loss_scale,
    axis_name=axis_name,
    data_axes=data_axes,
    param_specs=param_specs,
    fsdp=fsdp,
  )
  return _functions(cfg)


def _functions(cfg: _Config) -> Callable[..., Any]:
  """``f`` and its ``.accumulate`` for one configuration."""

  def f(
    *args, num_real_microbatches=None, loss_scale=None, normalizers=None, **kw
  ):
    if cfg.data_axes is not None:
      ls = call_scale(cfg, loss_scale)
      call = (args, kw, num_real_microbatches, ls, normalizers)
      return spmd.value_and_grad(cfg, _step, call)
    return _step(cfg, args, kw, num_real_microbatches, loss_scale, normalizers)

  def accumulate(state, *args, num_real_microbatches=None, **kw):
    if cfg.data_axes is not None:
      return spmd.accumulate(
        cfg, _accumulate, state, (args, kw, num_real_microbatches)
      )
    return _accumulate(cfg, state, args, kw, num_real_microbatches)

  f.accumulate = accumulate
  return f
