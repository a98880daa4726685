"""``microbatched_value_and_grad``: its options checked once; one loop over
a call's K microbatches into its window(s), state threaded, closed once; with
``axis_name`` under plain ``jit`` the same step in a ``shard_map``
(``microbatching_spmd``). Rationale: ``docs/microbatching.md``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    ct = numerics.compute_dtype(  # at least float32
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
      f"{_WHAT}(loss_fn): it adds state to its NNX module (e.g. by sow: "
      f"{added or paths}), which the loop cannot carry. Pop it in loss_fn "
      "(nnx.pop(model, nnx.Intermediate)) and return it as aux (has_aux=True)."
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
  """``g``'s window plus the microbatch (FSDP ``scatter_each``: scattered)."""
  w = terms.presence(ev, g.terms) if g.known else ev.weights[g.terms[0]]
  mean = cfg.mode == "mean" and not g.known
  add = accumulation.add if cfg.spmd is None else cfg.spmd.add
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
  aux = jax.tree.map(lambda s: jnp.zeros((call.k,) + s.shape, s.dtype), ev.aux)
  zero = jnp.zeros((), _F32)
  sums = tree_utils.to_varying({t: (zero, zero) for t in ev.terms}, axes)
  carry = _Carry(
    tuple(states), sums, tree_utils.to_varying(aux, axes), threaded
  )
  body = _body(cfg, call, groups, norms, states[0].loss_scale, axes)
  if n_real is None:
    return jax.lax.fori_loop(0, call.k, body, carry)
  # A cond on the count: XLA hoists an index-free body (K = 1) out of loops.
  loop = lambda c: jax.lax.fori_loop(0, n_real, body, c)
  return jax.lax.cond(n_real > 0, loop, lambda c: c, carry)


# --------------------------------------------------------------- one call --


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


def _scale(cfg: _Config, loss_scale: Any) -> Any:
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
  ls = _scale(cfg, loss_scale)
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


# ------------------------------------------------------------- the public --


@validation.refuse_removed(
  "batch_argnames", "in_axes", "data_axes", "param_specs", "fsdp"
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

  One loop iteration adds one microbatch's gradient to work-dtype buffers
  (one microbatch's activations live at a time), divided once: the gradient
  of the full batch's mean loss ``sum(loss sums) / sum(weights)``. Each
  argument of ``loss_fn`` is differentiated (``argnums``), split
  (``batch_argnums``), threaded (``state_argnums``), a key per microbatch
  (``key_argnums``), or passed unchanged.

  What ``loss_fn`` returns for one microbatch, and what ``f`` returns:

  ==================  ======================================  ================================
  options             ``loss_fn`` returns                     ``f(...)`` returns
  ==================  ======================================  ================================
  neither             ``(loss, weight)``                      ``(loss, out)``
  ``has_aux``         ``((loss, weight), aux)``               ``((loss, aux), out)``
  ``state_argnums``   ``((loss, weight), new_state)``         ``((loss, out), state)``
  both                ``(((loss, weight), aux), new_state)``  ``(((loss, aux), out), state)``
  ==================  ======================================  ================================

  ``state`` is the last microbatch's (a tuple for a sequence
  ``state_argnums``).

  Args:
    loss_fn: ``loss_fn(*args, **kwargs)`` on one microbatch, returning as
      the table says; ``weight`` is its item count (e.g. ``mask.sum()``).
      ``loss`` may be a dict of terms, each normalised by its own total
      weight (``weight`` a dict with the same keys, or one for all).
    num_microbatches: K, a positive int dividing the batch size; or
      ``None`` with ``microbatch_size``.
    mode: required. ``"sum"``: ``loss`` is the microbatch's loss SUM;
      ``"mean"``: that sum divided by ``weight`` (0/0 adds nothing).
    microbatch_size: the rows per microbatch instead of K.
    has_aux: whether ``loss_fn`` returns an aux value.
    argnums: the argument(s) to differentiate: their floating leaves (the
      others get ``None``, as ``eqx.filter_value_and_grad``; complex leaves
      refused); an ``nnx.Module``'s ``nnx.Param`` state (its other state
      threaded and written back, as ``nnx.value_and_grad``).
    batch_argnums: the argument(s) to split (pytrees whose leaves share a
      batch axis): a position, a keyword name (optax's ``argnames``), a
      sequence of them (batch axis 0), or a mapping from each to its batch
      axis, e.g. ``{1: 0, "mask": 1}``. Default: argument 1.
    split: ``"strided"`` (default: microbatch k holds rows ``k::K``, as
      optax) or ``"contiguous"`` (rows ``[k*B/K, (k+1)*B/K)``, real rows
      first). Required with ``num_real_microbatches``.
    state_argnums: argument(s) threaded through the loop (batch statistics,
      RNG streams): each microbatch gets the state the previous returned.
    key_argnums: positional argument(s) holding one PRNG key each (or a
      pytree of keys): microbatch i gets ``jax.random.fold_in(key, i)``;
      with ``axis_name``, replica r's gets ``fold_in(fold_in(key, r), i)``.
    dtype: the accumulation work dtype; ``None`` (optax's meaning): the
      params' dtype, which they must share.
    grads_dtype: the dtype of the returned gradients: ``None`` (the work
      dtype), ``"params"`` (each param's own dtype), or a floating dtype.
    loss_scale: multiplies each loss before differentiating, divided out
      once (a number, array or :class:`~weighted_accum.DynamicLossScale`);
      ``f``'s ``loss_scale=`` overrides it per call.
    axis_name: the data axes (or a
      :class:`~weighted_accum.distributed.DataParallel` with the params' FSDP
      layout): inside ``jax.shard_map`` ``f`` takes this replica's rows;
      under plain ``jax.jit`` the global batch (rows divisible by ``N * K``,
      no ``split="contiguous"`` or ``state_argnums``). One reduction per
      call whatever K. Without it ``loss_fn`` sees the global batch's rows.

  Returns:
    ``f(*args, num_real_microbatches=None, loss_scale=None,
    normalizers=None, **kwargs)`` returning ``(loss, out)`` nested as the
    table says: ``loss`` the exact float32 mean loss (a dict of the terms'
    means for a dict of terms), ``aux`` stacked on a leading K axis (zeros
    where skipped), ``out`` an :class:`~weighted_accum.AccumulatedGradients`
    (``valid`` false also when a microbatch's weight was negative or
    non-finite: it is dropped). ``num_real_microbatches`` (an int, traced or
    not) runs microbatches ``k < n`` only, without recompiling.
    ``normalizers`` gives terms' normalisers known before the loop (a number
    for a single loss, else a dict by term, traced values welcome): such a
    term's sum is divided by it; with ``mode="sum"`` such terms share one
    window, otherwise every term has its own. ``kwargs`` go to ``loss_fn``.
    ``f.accumulate(state, *args, num_real_microbatches=None, **kwargs)`` adds
    the call's microbatches to the open window ``state`` (its dtype and loss
    scale) without finishing and returns ``((loss_sum, weight), state)``,
    nested as ``f``'s result. Under plain ``jit`` with ``axis_name``,
    ``aux`` leaves are ``[K, N, ...]`` (replica ``r``'s value at
    ``aux[k, r]``) and ``f.accumulate`` takes a window stacked over the
    replicas (``wa.init(params, axis_name=...)`` outside ``shard_map``),
    runs no collective and returns per-replica ``[N]`` sums; inside
    ``shard_map`` it takes this replica's window or its block of a stacked
    one.

  Raises:
    WeightedAccumulationError: for an invalid configuration, arguments or
      ``loss_fn`` results that do not fit the roles and the table, batches
      K (times the replicas) does not divide, or eagerly a total weight of 0.

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
  if not callable(loss_fn):
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): {loss_fn!r} is not callable."
    )
  what = lambda name: f"{_WHAT}({name}=...)"
  if dtype is not None:  # None: the params' (read by init)
    dtype = validation.work_dtype(dtype, what=what("dtype"))
  mode = validation.mode(mode, what=what("mode"))
  has_aux = validation.static_flag(has_aux, what=what("has_aux"))
  grads_dtype = validation.grads_dtype(grads_dtype, what=what("grads_dtype"))
  tally = numerics.tally_dtype(dtype)
  loss_scale = validation.loss_scale(
    loss_scale, what=what("loss_scale"), dtype=tally
  )
  if axis_name is not None and not isinstance(axis_name, DataParallel):
    axis_name = DataParallel(
      validation.axis_names(axis_name, what=what("axis_name"))
    )
  roles = margs.configure(
    _WHAT,
    num_microbatches=num_microbatches,
    microbatch_size=microbatch_size,
    argnums=argnums,
    batch_argnums=batch_argnums,
    split=split,
    state_argnums=state_argnums,
    key_argnums=key_argnums,
  )
  cfg = _Config(
    loss_fn, mode, has_aux, roles, dtype, grads_dtype, loss_scale, axis_name
  )
  return _functions(cfg)


def _functions(cfg: _Config) -> Callable[..., Any]:
  """``f`` and ``f.accumulate``; with ``axis_name`` unbound (plain ``jit``),
  the same step as a ``shard_map`` over it."""
  global_batch = lambda: cfg.dp is not None and not replicas.bound(cfg.axes)

  def f(
    *args, num_real_microbatches=None, loss_scale=None, normalizers=None, **kw
  ):
    args = margs.float_params(cfg.roles, args)
    n_real = num_real_microbatches
    if global_batch():
      call = (args, kw, n_real, _scale(cfg, loss_scale), normalizers)
      return spmd.value_and_grad(cfg, _step, call)
    return _step(cfg, args, kw, n_real, loss_scale, normalizers)

  def accumulate(state, *args, num_real_microbatches=None, **kw):
    args = margs.float_params(cfg.roles, args)
    call = (args, kw, num_real_microbatches)
    if global_batch():
      return spmd.accumulate(cfg, _accumulate, state, call)
    return _accumulate(cfg, state, *call)

  f.accumulate = accumulate
  return f
