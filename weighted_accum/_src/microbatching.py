"""In-step microbatching: one call splits a batch into K microbatches, runs
them one after another in a loop and returns the exact weighted mean gradient.

``microbatched_value_and_grad`` builds the step function (its ``.accumulate``
adds one call into an open window instead); ``optax_accumulator`` plugs the
same exact weighting into ``optax.microbatching``. Rationale, memory and
all-reduce figures: ``docs/microbatching.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src import accumulation
from weighted_accum._src import base
from weighted_accum._src import distributed as dist
from weighted_accum._src import finishing
from weighted_accum._src import local_grads
from weighted_accum._src import microbatching_spmd as spmd
from weighted_accum._src import numerics
from weighted_accum._src import replicas
from weighted_accum._src import tree_utils
from weighted_accum._src import validation
from weighted_accum._src import window
from weighted_accum._src.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError

_F32 = jnp.float32
_WHAT = "microbatched_value_and_grad"


class _Config(NamedTuple):
  """The static choices of one ``microbatched_value_and_grad``."""

  loss_fn: Callable[..., Any]
  k: int
  mode: str
  has_aux: bool
  argnums: tuple[int, ...]
  single: bool
  batch_argnums: tuple[int, ...]
  dtype: np.dtype
  loss_scale: Any
  axis_name: tuple[str, ...] | None
  data_axes: tuple[str, ...] | None = None
  param_specs: Any = None
  fsdp: str = "gather_once"
  spmd: Any = None  # inside the data_axes shard_map: a spmd.Layout


# ------------------------------------------------------------- the split --


def _split(args: tuple, cfg: _Config) -> dict:
  """Each batch argument reshaped to ``(B // K, K, ...)``: microbatch i is
  ``[:, i]``, i.e. rows ``i::K`` (a data-sharded batch stays evenly spread)."""
  k = cfg.k
  if max(cfg.batch_argnums) >= len(args):
    raise WeightedAccumulationError(
      f"{_WHAT}: batch_argnums {cfg.batch_argnums} but the function was "
      f"called with {len(args)} positional argument(s)."
    )
  sizes = []
  for n in cfg.batch_argnums:
    for path, x in tree_utils.flat(args[n]):
      if np.ndim(x) == 0:
        raise WeightedAccumulationError(
          f"{_WHAT}: batch argument {n} leaf {path} is a scalar; every batch "
          "leaf needs a leading batch axis (pass it as another argument)."
        )
      sizes.append((np.shape(x)[0], n, path))
  b = sizes[0][0] if sizes else 0
  for size, n, path in sizes:
    if size != b or size % k:
      raise WeightedAccumulationError(
        f"{_WHAT}: batch argument {n} leaf {path} has {size} rows; every "
        f"batch leaf needs the same leading size, divisible by "
        f"num_microbatches={k} (first leaf: {b} rows). Pad the batch (with "
        "zero weight) to a multiple of num_microbatches."
      )
  return {
    n: jax.tree.map(
      lambda x: jnp.reshape(x, (x.shape[0] // k, k) + x.shape[1:]), args[n]
    )
    for n in cfg.batch_argnums
  }


def _take(args: tuple, split: dict, i: Any) -> list:
  out = list(args)
  for n, tree in split.items():
    out[n] = jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False), tree
    )
  return out


# -------------------------------------------------------- one microbatch --


def _unpack(res: Any, has_aux: bool) -> tuple[Any, Any, Any]:
  """``loss_fn``'s result as ``(loss, weight, aux)``, or a named error."""
  try:
    (loss, weight), aux = res if has_aux else (res, None)
  except (TypeError, ValueError):
    want = "((loss, weight), aux)" if has_aux else "(loss, weight)"
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): it returned {type(res).__name__} "
      f"{jax.tree.structure(res)}; with has_aux={has_aux} it must return "
      f"{want}, where weight is the microbatch's item count (e.g. "
      "mask.sum())."
    ) from None
  return loss, weight, aux


def _scaled_loss(cfg: _Config):
  """``loss_fn`` as a differentiable function of the args and the scale:
  returns ``(loss * scale, (loss, weight, aux))``."""

  def scaled(scale, *args):
    loss, weight, aux = _unpack(cfg.loss_fn(*args), cfg.has_aux)
    loss = jnp.asarray(loss)
    if loss.ndim or not jnp.issubdtype(loss.dtype, jnp.floating):
      raise WeightedAccumulationError(
        f"{_WHAT}(loss_fn): the loss is {jax.typeof(loss)}, expected a "
        f"floating scalar (the microbatch's loss {cfg.mode.upper()})."
      )
    if jnp.ndim(weight):
      raise WeightedAccumulationError(
        f"{_WHAT}(loss_fn): the weight has shape {jnp.shape(weight)}, "
        "expected a scalar (the microbatch's item count, e.g. mask.sum())."
      )
    weight = jax.lax.stop_gradient(jnp.asarray(weight))
    ct = numerics.compute_dtype(loss.dtype)  # float64 stays float64
    return loss.astype(ct) * scale.astype(ct), (loss, weight, aux)

  return scaled


# --------------------------------------------------------------- the loop --


def _loop(cfg: _Config, state: AccumState, args: tuple, split: dict, n_real):
  """Runs the microbatches into ``state``. Returns ``(state, loss_sum,
  weight_sum, aux_stack)``: this call's loss sum and weight (float32, over
  the microbatches the state took)."""
  axes = cfg.axis_name
  scaled = _scaled_loss(cfg)
  nums = tuple(n + 1 for n in cfg.argnums)  # argument 0 is the scale
  vg = (
    jax.value_and_grad(scaled, argnums=nums, has_aux=True)
    if axes is None
    else local_grads.local_value_and_grad(
      scaled, axes, argnums=nums, has_aux=True
    )
  )
  scale = state.loss_scale
  aux_shape = jax.eval_shape(
    lambda: scaled(scale, *_take(args, split, 0))[1][2]
  )
  aux_buf = jax.tree.map(
    lambda s: jnp.zeros((cfg.k,) + s.shape, s.dtype), aux_shape
  )
  zero = jnp.zeros((), _F32)
  sums = tree_utils.to_varying((zero, zero), axes or ())
  aux_buf = tree_utils.to_varying(aux_buf, axes or ())
  mean = cfg.mode == "mean"

  def body(i, carry):
    st, sums, aux_buf = carry
    (_, (loss, w, aux)), grads = vg(scale, *_take(args, split, i))
    g = grads[0] if cfg.single else grads
    if cfg.spmd is None:
      new = accumulation.add(st, g, w, mean=mean, name=_WHAT)
    else:  # data_axes: FSDP grads may be reduce-scattered per microbatch
      new = cfg.spmd.add(st, g, w, mean=mean, name=_WHAT)
    took = new.rejected == st.rejected  # not rejected (weight 0 adds 0)
    wf = jnp.asarray(w, _F32)
    part = loss.astype(_F32) * wf if mean else loss.astype(_F32)
    add = (jnp.where(took & (wf > 0), part, 0.0), jnp.where(took, wf, 0.0))
    sums = tuple(x + y for x, y in zip(sums, add))
    aux_buf = jax.tree.map(lambda b, a: b.at[i].set(a), aux_buf, aux)
    return new, sums, aux_buf

  upper = cfg.k if n_real is None else n_real
  st, (loss_sum, w_sum), aux = jax.lax.fori_loop(
    0, upper, body, (state, sums, aux_buf)
  )
  return st, loss_sum, w_sum, aux


def _conclude(cfg: _Config, st: AccumState, loss_sum: jax.Array):
  """The exact mean loss and gradient, on the one finish path; across
  ``axis_name`` one reduction of the sums, the weights, the loss sum and
  the rejection count."""
  out, _, extra = window.finish(
    st,
    mean=True,
    axes=cfg.axis_name or (),
    extra={"loss_sum": loss_sum, "rejected": st.rejected.astype(_F32)},
    plan=None if cfg.spmd is None else cfg.spmd.plan,
    what=_WHAT,
  )
  loss = jnp.where(out.weight > 0, extra["loss_sum"] / out.weight, 0.0)
  finite = out.finite & jnp.isfinite(extra["loss_sum"])
  valid = out.valid & finite & (extra["rejected"] == 0)
  return loss, out.replace(finite=finite, valid=valid)


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


def _prepare(cfg: _Config, args: tuple, n_real: Any):
  """The bound axes, the differentiated params, the split batch and the
  number of real microbatches of one call."""
  axes = cfg.axis_name
  if axes is not None:
    validation.bound_axes(axes, what=f"{_WHAT}(axis_name=...)")
  if max(cfg.argnums) >= len(args):
    raise WeightedAccumulationError(
      f"{_WHAT}: argnums {cfg.argnums} but the function was called with "
      f"{len(args)} positional argument(s). Pass the params at argnums and "
      "the batch at batch_argnums."
    )
  params = (
    args[cfg.argnums[0]] if cfg.single else tuple(args[i] for i in cfg.argnums)
  )
  n_real = validation.num_real(n_real, cfg.k, what=_WHAT)
  return params, _split(args, cfg), n_real


def _configure(loss_fn, num_microbatches, **kw) -> _Config:
  k = validation.static_int(
    num_microbatches,
    what=f"{_WHAT}(num_microbatches=...)",
    hint="The loop length is static; pass num_real_microbatches to run "
    "fewer without recompiling.",
  )
  if not callable(loss_fn):
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): {loss_fn!r} is not callable."
    )
  diff = validation.argnums(kw["argnums"], what=_WHAT, name="argnums")
  batch = validation.argnums(
    kw["batch_argnums"], what=_WHAT, name="batch_argnums"
  )
  both = sorted(set(diff) & set(batch))
  if both:
    raise WeightedAccumulationError(
      f"{_WHAT}: argument {both[0]} is in both argnums and batch_argnums; "
      "the differentiated params and the split batch must be different "
      "arguments."
    )
  dt = validation.work_dtype(kw["dtype"], what=f"{_WHAT}(dtype=...)")
  return _Config(
    loss_fn=loss_fn,
    k=k,
    mode=validation.mode(kw["mode"], what=f"{_WHAT}(mode=...)"),
    has_aux=validation.static_flag(kw["has_aux"], what=f"{_WHAT}(has_aux=)"),
    argnums=diff,
    single=isinstance(kw["argnums"], (int, np.integer)),
    batch_argnums=batch,
    dtype=dt,
    loss_scale=validation.loss_scale(
      kw["loss_scale"], what=f"{_WHAT}(loss_scale=...)"
    ),
    axis_name=validation.optional_axis_names(
      kw["axis_name"], what=f"{_WHAT}(axis_name=...)"
    ),
    **spmd.options(kw),
  )


def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  mode: str,
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  batch_argnums: int | Sequence[int] = 1,
  dtype: Any = jnp.float32,
  loss_scale: Any = 1.0,
  axis_name: str | Sequence[str] | None = None,
  data_axes: str | Sequence[str] | None = None,
  param_specs: Any = None,
  fsdp: str = "gather_once",
) -> Callable[..., Any]:
  """``jax.value_and_grad`` over K microbatches in one loop, exact.

  The batch arguments are split into ``num_microbatches`` microbatches,
  microbatch ``k`` holding rows ``k::K``; one loop iteration computes one
  microbatch's loss and gradient and adds it to work-dtype buffers with
  :func:`weighted_accum.accumulate_sum` (or ``accumulate_mean``), so only
  one microbatch's activations are live at a time. The result is divided
  once: it equals the gradient of the full batch's mean loss
  ``sum(loss sums) / sum(weights)`` whatever the weights per microbatch.

  Args:
    loss_fn: called as ``loss_fn(*args)`` on one microbatch; returns
      ``(loss, weight)``, or ``((loss, weight), aux)`` with ``has_aux``.
      ``weight`` is the microbatch's effective item count (e.g.
      ``mask.sum()``), not differentiated.
    num_microbatches: K, a positive int; the batch size must be divisible
      by it.
    mode: required. ``"sum"``: ``loss`` is the microbatch's loss SUM over
      its items; ``"mean"``: it is that sum divided by ``weight`` (a fully
      masked microbatch, 0/0, adds nothing). No default is safe: the wrong
      one weights every microbatch wrongly.
    has_aux: whether ``loss_fn`` returns an aux value.
    argnums: the positional argument(s) to differentiate (the params; any
      pytree, ``nnx.State`` included).
    batch_argnums: the positional argument(s) to split (any pytrees whose
      leaves share a leading batch axis).
    dtype: the accumulation work dtype.
    loss_scale: each microbatch's loss is multiplied by it before
      differentiating; divided out once at the end (float16: e.g. 2**12).
      A number, a scalar array, or a :class:`~weighted_accum.DynamicLossScale`
      (its ``scale``; adjust it with ``out.finite`` after the step). ``f``'s
      own ``loss_scale=`` keyword overrides it per call (a traced value
      does not recompile).
    axis_name: call ``f`` inside ``jax.shard_map`` over this data axis (or
      axes) with this replica's rows: gradients are local and the call does
      ONE all-reduce of the sums and weights after the loop.
    data_axes: call ``f`` under plain ``jax.jit`` on the global batch, its
      leading dimension sharded over these mesh axes (``Auto`` or
      ``Explicit``; the mesh is the batch's, or ``jax.set_mesh``'s): the
      loop then runs inside a partial-manual ``jax.shard_map`` over just
      these axes around the ``axis_name`` path, so a call reduces the
      gradient sums, the weights and the counters ONCE whatever K, and the
      returned grads keep the params' shardings. The batch's rows must be
      divisible by ``N * K`` (N: the replicas); microbatch ``k`` is then
      rows ``k::K`` as without ``data_axes``. Not with ``axis_name``.
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
    ``f(*args, num_real_microbatches=None, loss_scale=None)`` returning
    ``(loss, out)``, or ``((loss, aux), out)`` with ``has_aux``: ``loss``
    the exact float32 mean loss, ``aux`` stacked on a leading K axis
    (microbatch order, zeros where skipped; with ``data_axes`` each leaf is
    ``[K, N, ...]``, ``aux[k, r]`` replica ``r``'s value for its rows of
    microbatch ``k``, sharded over the data axes on dimension 1: per-row
    aux reshaped to ``[K, -1, ...]`` is the layout without ``data_axes``),
    ``out`` an
    :class:`~weighted_accum.AccumulatedGradients` (mean gradient in
    ``dtype``, total weight, ``issued``, ``finite``, ``valid``; ``valid`` is
    also false when a microbatch's weight was negative or non-finite: such a
    microbatch is dropped). ``num_real_microbatches`` (an int, traced or
    not) runs only microbatches ``k < num_real_microbatches``; the others
    are not computed and no recompilation happens across values.
    ``f.accumulate(state, *args, num_real_microbatches=None)`` adds the
    call's microbatches to an open window ``state`` without finishing and
    returns ``((loss_sum, weight), state)`` (``(((loss_sum, weight), aux),
    state)`` with ``has_aux``), the call's unscaled loss sum and weight; it
    uses the state's work dtype and loss scale. With ``data_axes`` it takes
    a per-replica window stacked over the replicas
    (:func:`weighted_accum.distributed.init` called outside ``shard_map``)
    and runs no collective: ``loss_sum`` and ``weight`` are per replica,
    ``[N]``; close the window with
    ``wa.apply_window(..., axis_name=data_axes)`` (one reduction). Inside
    ``shard_map`` with ``axis_name`` it also takes this replica's block of
    such a window (leading dimension 1) and returns one.

  Raises:
    WeightedAccumulationError: for an invalid configuration, batch leaves
      whose leading sizes differ or are not divisible by K, a ``loss_fn``
      that does not return ``(loss, weight)``, a loss that is not a
      floating scalar, an unbound ``axis_name``, ``data_axes`` that the
      batch's mesh does not have or whose replicas times K do not divide the
      batch, FSDP param specs the reduce-scatter cannot produce, or
      (eagerly) a call whose total weight is 0.

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
    has_aux=has_aux,
    argnums=argnums,
    batch_argnums=batch_argnums,
    dtype=dtype,
    loss_scale=loss_scale,
    axis_name=axis_name,
    data_axes=data_axes,
    param_specs=param_specs,
    fsdp=fsdp,
  )

  def f(*args, num_real_microbatches=None, loss_scale=None):
    if cfg.data_axes is not None:
      return spmd.value_and_grad(
        cfg, _value_and_grad, args, num_real_microbatches, loss_scale
      )
    return _value_and_grad(cfg, args, num_real_microbatches, loss_scale)

  def accumulate(state, *args, num_real_microbatches=None):
    if cfg.data_axes is not None:
      return spmd.accumulate(
        cfg, _accumulate, state, args, num_real_microbatches
      )
    return _accumulate(cfg, state, args, num_real_microbatches)

  f.accumulate = accumulate
  return f


def _value_and_grad(cfg: _Config, args: tuple, num_real: Any, scale: Any):
  """One call of ``f``: init, the loop, the finish."""
  params, split, n_real = _prepare(cfg, args, num_real)
  ls = cfg.loss_scale
  if scale is not None:
    ls = validation.loss_scale(scale, what=f"{_WHAT}(...)(loss_scale=)")
  like = params if cfg.spmd is None else cfg.spmd.buffers(params)
  st = (
    accumulation.init(like, cfg.dtype, ls)
    if cfg.axis_name is None
    else dist.init(like, cfg.axis_name, cfg.dtype, ls)
  )
  st, loss_sum, _, aux = _loop(cfg, st, args, split, n_real)
  if not tree_utils.is_traced(st.weight_hi):
    finishing.refuse_empty(st, _WHAT)
  loss, out = _conclude(cfg, st, loss_sum)
  return ((loss, aux), out) if cfg.has_aux else (loss, out)


def _accumulate(cfg: _Config, state: Any, args: tuple, num_real: Any):
  """One call of ``f.accumulate``: the loop into an open window."""
  _, split, n_real = _prepare(cfg, args, num_real)
  st, block = _to_window(state, cfg.axis_name)
  st, loss_sum, w_sum, aux = _loop(cfg, st, args, split, n_real)
  if block:
    st = replicas.stack(st, cfg.axis_name)
  value = (loss_sum, w_sum)
  return ((value, aux) if cfg.has_aux else value), st


# ------------------------------------------------- optax.microbatching --


class _Folded(NamedTuple):
  """``aggregate``'s output: per-example values folded into one value of the
  form ``((mean_loss, total_weight), mean_grads)`` (a pair, so it unpacks as
  the result does; ``update`` adds it as a mean-loss microbatch)."""

  value: Any
  grads: Any


def _unpack_value(value: Any) -> tuple[Any, Any, Any]:
  try:
    (loss, weight), grads = value
  except (TypeError, ValueError):
    raise WeightedAccumulationError(
      "optax_accumulator: each microbatch's value must be ((loss, weight), "
      "grads), as returned by jax.value_and_grad(loss_fn, has_aux=True) "
      f"with loss_fn returning (loss, weight); got {type(value).__name__}."
    ) from None
  return loss, weight, grads


def _fold(values: Any, mean: bool) -> _Folded:
  """Per-example values (leading axis) folded into their exact weighted
  mean, over the examples of valid positive weight (a select: a padded
  example's NaN stays out). An invalid weight makes the total NaN (the
  folded value is then refused by ``update`` and by the caller's checks)."""
  loss, weight, grads = _unpack_value(values)
  w = jnp.asarray(weight, _F32)
  valid = jnp.isfinite(w) & (w >= 0)
  take = valid & (w > 0)
  total = jnp.sum(jnp.where(take, w, 0.0))
  inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
  # An invalid weight: every output NaN (refused, not dropped).
  total = jnp.where(jnp.all(valid), total, jnp.nan)
  inv = jnp.where(jnp.all(valid), inv, jnp.nan)

  def wmean(x):
    x = jnp.asarray(x)
    t = jnp.reshape(take, take.shape + (1,) * (x.ndim - 1))
    xw = x.astype(_F32) * jnp.reshape(w, t.shape) if mean else x.astype(_F32)
    return (jnp.sum(jnp.where(t, xw, 0.0), 0) * inv).astype(x.dtype)

  return _Folded((wmean(loss), total), jax.tree.map(wmean, grads))


def optax_accumulator(mode: str, dtype: Any = jnp.float32) -> Any:
  """An exact weighted ``optax.microbatching.Accumulator``.

  A drop-in for ``accumulator=AccumulationType.MEAN`` in
  ``optax.microbatching.microbatch`` / ``micro_vmap`` / ``micro_grad``: the
  microbatched function returns ``((loss, weight), grads)``
  (``jax.value_and_grad(loss_fn, has_aux=True)`` of a ``loss_fn`` returning
  ``(loss, weight)``), and the result is ``((mean_loss, total_weight),
  mean_grads)``, the exact full-batch values, where MEAN divides by the
  microbatch count (equal weights whatever each microbatch's item count).
  The carry is an :class:`~weighted_accum.AccumState`:
  ``accumulate_sum``/``accumulate_mean`` add, one finish divides. Its
  ``aggregate`` (what ``micro_vmap`` calls on per-example values, alone when
  ``microbatch_size=None``) returns the same exact mean.

  Examples of weight 0 or microbatches of weight 0 add nothing (even NaN). A
  negative, NaN or infinite weight cannot raise inside optax's loop: it
  makes the result's loss, total weight and grads NaN (refused, never
  silently dropped), which a finiteness check such as
  ``optax.apply_if_finite`` catches.

  Args:
    mode: required. ``"sum"`` when ``loss`` is the microbatch's loss SUM,
      ``"mean"`` when it is the SUM divided by ``weight``.
    dtype: the gradient buffers' work dtype.

  Returns:
    An ``optax.microbatching.Accumulator``.

  Raises:
    WeightedAccumulationError: for an unknown mode, a non-floating dtype, or
      a value that is not ``((loss, weight), grads)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> def loss_fn(w, x, mask):          # a per-microbatch masked mean
    ...   n = mask.sum()
    ...   return jnp.sum(mask * (x * w) ** 2) / jnp.maximum(n, 1), n
    >>> x = jnp.arange(8.0)
    >>> mask = jnp.array([1., 1, 1, 1, 1, 1, 0, 0])
    >>> f = optax.microbatching.microbatch(
    ...     jax.value_and_grad(loss_fn, has_aux=True), argnums=(1, 2),
    ...     microbatch_size=2, accumulator=wa.optax_accumulator('mean'))
    >>> (loss, weight), grads = f(1.0, x, mask)
    >>> float(loss), float(weight), float(grads)   # (0+1+4+9+16+25) / 6
    (9.166666984558105, 6.0, 18.33333396911621)
  """
  from optax import microbatching  # pylint: disable=g-import-not-at-top

  what = "optax_accumulator"
  mean = validation.mode(mode, what=f"{what}(mode=...)") == "mean"
  dt = validation.work_dtype(dtype, what=f"{what}(dtype=...)")

  def init(value):
    _, _, grads = _unpack_value(value)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grads)
    return accumulation.init(zeros, dt), jnp.zeros((), _F32)

  def update(carry, value, _):
    st, loss_sum = carry
    folded = isinstance(value, _Folded)
    loss, weight, grads = _unpack_value(value)
    as_mean = mean or folded
    new = accumulation.add(st, grads, weight, mean=as_mean, name=what)
    w = jnp.asarray(weight, _F32)
    part = jnp.asarray(loss, _F32) * (w if as_mean else 1.0)
    took = (new.rejected == st.rejected) & (w > 0)
    return new, loss_sum + jnp.where(took, part, 0.0)

  def finalize(carry):
    st, loss_sum = carry
    out, _, _ = window.finish(st, mean=True, what=what)
    loss = jnp.where(out.weight > 0, loss_sum / out.weight, 0.0)
    bad = st.rejected > 0
    nan = lambda x: jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)
    grads = jax.tree.map(nan, out.grads)
    return (nan(loss), nan(out.weight)), grads

  return microbatching.Accumulator(
    init=init,
    update=update,
    finalize=finalize,
    aggregate=lambda values: _fold(values, mean),
  )
