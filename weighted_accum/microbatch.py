"""In-step microbatching: one call splits a batch into K microbatches, runs
them one after another in a loop and returns the exact weighted mean gradient.

``microbatched_value_and_grad`` builds the step function (its ``.accumulate``
adds one call into an open window instead); ``optax_accumulator`` plugs the
same exact weighting into ``optax.microbatching.microbatch``. Rationale,
memory and all-reduce figures: ``docs/microbatching.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum import _counters
from weighted_accum import _finish
from weighted_accum import _tree
from weighted_accum import core
from weighted_accum import distributed as dist
from weighted_accum import errors
from weighted_accum import state as state_lib
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.loss_scale import DynamicLossScale
from weighted_accum.state import AccumState

MODES = ("sum", "mean")

__all__ = ["MODES", "microbatched_value_and_grad", "optax_accumulator"]

_F32 = jnp.float32


# ------------------------------------------------------------ validation --


def _nums(value: Any, name: str) -> tuple[int, ...]:
  nums = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
  if not nums or not all(
    isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0
    for n in nums
  ):
    raise WeightedAccumulationError(
      f"microbatched_value_and_grad({name}={value!r}): expected a "
      "non-negative int or a non-empty tuple of them (positional argument "
      "indices of loss_fn)."
    )
  if len(set(nums)) != len(nums):
    raise WeightedAccumulationError(
      f"microbatched_value_and_grad({name}={value!r}): repeated index."
    )
  return tuple(int(n) for n in nums)


def _check_config(
  num_microbatches: Any,
  mode: Any,
  argnums: Any,
  batch_argnums: Any,
  dtype: Any,
  loss_scale: Any,
):
  what = "microbatched_value_and_grad"
  if (
    isinstance(num_microbatches, bool)
    or not isinstance(num_microbatches, (int, np.integer))
    or num_microbatches < 1
  ):
    raise WeightedAccumulationError(
      f"{what}(num_microbatches={num_microbatches!r}): expected a positive "
      "Python int (the loop length is static; pass num_real_microbatches "
      "to run fewer without recompiling)."
    )
  if mode not in MODES:
    raise WeightedAccumulationError(
      f"{what}(mode={mode!r}): expected one of {MODES}: 'sum' when loss_fn "
      "returns the microbatch's loss SUM, 'mean' when it returns the SUM "
      "divided by the weight."
    )
  diff, batch = _nums(argnums, "argnums"), _nums(batch_argnums, "batch_argnums")
  both = sorted(set(diff) & set(batch))
  if both:
    raise WeightedAccumulationError(
      f"{what}: argument {both[0]} is in both argnums and batch_argnums; "
      "the differentiated params and the split batch must be different "
      "arguments."
    )
  dt = errors.check_floating_dtype(dtype, what=f"{what}(dtype=...)")
  _scale_of(loss_scale, f"{what}(loss_scale=...)")
  return int(num_microbatches), diff, batch, dt


def _scale_of(loss_scale: Any, what: str) -> Any:
  """The loss scale value: a number or scalar array, or a
  :class:`~weighted_accum.DynamicLossScale`'s current ``scale``."""
  if isinstance(loss_scale, DynamicLossScale):
    return loss_scale.scale
  errors.check_loss_scale(loss_scale, what=what)
  return loss_scale


def _split(args: tuple, batch_nums: tuple[int, ...], k: int) -> dict:
  """Each batch argument reshaped to ``(B // K, K, ...)``: microbatch i is
  ``[:, i]``, i.e. rows ``i::K`` (a data-sharded batch stays evenly spread)."""
  what = "microbatched_value_and_grad"
  if max(batch_nums) >= len(args):
    raise WeightedAccumulationError(
      f"{what}: batch_argnums {batch_nums} but the function was called "
      f"with {len(args)} positional argument(s)."
    )
  sizes, out = [], {}
  for n in batch_nums:
    for path, x in zip(_tree.leaf_paths(args[n]), jax.tree.leaves(args[n])):
      if np.ndim(x) == 0:
        raise WeightedAccumulationError(
          f"{what}: batch argument {n} leaf {path} is a scalar; every batch "
          "leaf needs a leading batch axis (pass it as another argument)."
        )
      sizes.append((np.shape(x)[0], n, path))
  b = sizes[0][0] if sizes else 0
  for size, n, path in sizes:
    if size != b or size % k:
      raise WeightedAccumulationError(
        f"{what}: batch argument {n} leaf {path} has {size} rows; every "
        f"batch leaf needs the same leading size, divisible by "
        f"num_microbatches={k} (first leaf: {b} rows). Pad the batch (with "
        "zero weight) to a multiple of num_microbatches."
      )
  for n in batch_nums:
    out[n] = jax.tree.map(
      lambda x: jnp.reshape(x, (x.shape[0] // k, k) + x.shape[1:]), args[n]
    )
  return out


def _real_count(n: Any, k: int) -> Any:
  """``num_real_microbatches`` as a traced-friendly int32 in ``[0, K]``."""
  if n is None:
    return None
  if not errors.is_traced(n):
    v = np.asarray(n)
    if v.ndim or not np.issubdtype(v.dtype, np.integer) or not 0 <= v <= k:
      raise WeightedAccumulationError(
        f"microbatched_value_and_grad: num_real_microbatches={n!r} must be "
        f"an integer scalar in [0, {k}] (num_microbatches)."
      )
  elif not jnp.issubdtype(jnp.result_type(n), jnp.integer) or jnp.ndim(n):
    raise WeightedAccumulationError(
      "microbatched_value_and_grad: num_real_microbatches must be an "
      f"integer scalar, got {jax.typeof(n)}."
    )
  # A traced value out of range is clipped (it cannot raise under jit).
  return jnp.clip(jnp.asarray(n, jnp.int32), 0, k)


# --------------------------------------------------------------- the loop --


def _one_microbatch(loss_fn: Callable, has_aux: bool, mode: str):
  """``loss_fn`` as a differentiable function of the args and the scale:
  returns ``(loss * scale, (loss, weight, aux))``."""

  def scaled(scale, *args):
    res = loss_fn(*args)
    (loss, weight), aux = res if has_aux else (res, None)
    loss = jnp.asarray(loss)
    if loss.ndim or not jnp.issubdtype(loss.dtype, jnp.floating):
      raise WeightedAccumulationError(
        f"microbatched_value_and_grad(loss_fn): the loss is "
        f"{jax.typeof(loss)}, expected a floating scalar (the microbatch's "
        f"loss {mode.upper()})."
      )
    if jnp.ndim(weight):
      raise WeightedAccumulationError(
        "microbatched_value_and_grad(loss_fn): the weight has shape "
        f"{jnp.shape(weight)}, expected a scalar (the microbatch's item "
        "count, e.g. mask.sum())."
      )
    return (
      loss.astype(_F32) * scale.astype(_F32),
      (loss, jnp.asarray(weight, _F32), aux),
    )

  return scaled


def _take(args: tuple, split: dict, i: Any) -> list:
  out = list(args)
  for n, tree in split.items():
    out[n] = jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False), tree
    )
  return out


def _loop(cfg: dict, state: AccumState, args: tuple, split: dict, n_real: Any):
  """Runs the microbatches into ``state``. Returns ``(state, loss_sum,
  weight_sum, aux_stack)``: this call's loss sum and (with
  ``cfg["track_weight"]``, else None) weight; the state counts rejections."""
  k, diff, axes = cfg["k"], cfg["argnums"], cfg["axes"]
  scaled = _one_microbatch(cfg["loss_fn"], cfg["has_aux"], cfg["mode"])
  nums = tuple(n + 1 for n in diff)  # argument 0 of `scaled` is the scale
  vg = (
    jax.value_and_grad(scaled, argnums=nums, has_aux=True)
    if axes is None
    else dist.local_value_and_grad(scaled, axes, argnums=nums, has_aux=True)
  )
  single = isinstance(cfg["argnums_in"], (int, np.integer))
  acc = core.accumulate_mean if cfg["mode"] == "mean" else core.accumulate_sum
  scale = state.loss_scale
  aux_shape = jax.eval_shape(
    lambda *a: scaled(scale, *a)[1][2], *_take(args, split, 0)
  )
  aux_buf = jax.tree.map(
    lambda s: jnp.zeros((k,) + s.shape, s.dtype), aux_shape
  )
  zero = jnp.zeros((), _F32)
  sums = (zero, zero) if cfg.get("track_weight") else (zero,)
  if axes is not None:  # per-replica carry leaves (a loop carry keeps types)
    sums, aux_buf = dist._to_varying((sums, aux_buf), axes)  # pylint: disable=protected-access
  carry = (state, sums, aux_buf)

  def body(i, carry):
    st, sums, aux_buf = carry
    (_, (loss, w, aux)), grads = vg(scale, *_take(args, split, i))
    st = acc(st, grads[0] if single else grads, w)
    take = jnp.isfinite(w) & (w > 0)
    part = loss.astype(_F32) * w if cfg["mode"] == "mean" else loss
    new = (part.astype(_F32), w)[: len(sums)]
    sums = tuple(x + jnp.where(take, y, 0.0) for x, y in zip(sums, new))
    aux_buf = jax.tree.map(lambda b, a: b.at[i].set(a), aux_buf, aux)
    return st, sums, aux_buf

  upper = k if n_real is None else n_real
  st, sums, aux = jax.lax.fori_loop(0, upper, body, carry)
  return st, sums[0], (sums[1] if len(sums) > 1 else None), aux


def _conclude(
  st: AccumState,
  loss_sum: jax.Array,
  rejected: jax.Array,
  axes: tuple[str, ...] | None,
):
  """The exact mean loss and gradient; across ``axes`` one reduction of the
  gradient sums, the weights, the loss sum and the rejection count."""
  ok = jnp.isfinite(loss_sum) & (rejected == 0)
  if axes is None:
    out, _ = core.finish_mean(st)
    loss = jnp.where(out.weight > 0, loss_sum / out.weight, 0.0)
    return loss, out.replace(
      finite=out.finite & jnp.isfinite(loss_sum), valid=out.valid & ok
    )
  # The loss sum and the rejection count ride in the window's one psum.
  scalars = {k: getattr(st, k) for k in _counters.named(_counters.SUMMED)}
  scalars.update(loss_sum=loss_sum, bad=jnp.where(ok, 0.0, 1.0))
  sums, sc = _finish.psum_window(
    st.grads, scalars, axes, vma_on=_tree.vma_checked(axes)
  )
  weight = sc["weight_hi"] + sc["weight_lo"]
  out = _finish.result(
    sums, weight, st.loss_scale, sc["issued"], mean=True, require_weight=True
  )
  loss = jnp.where(weight > 0, sc["loss_sum"] / weight, 0.0)
  return loss, out.replace(
    finite=out.finite & jnp.isfinite(sc["loss_sum"]),
    valid=out.valid & (sc["bad"] == 0),
  )


def _to_window(state: Any, axes: tuple[str, ...] | None) -> AccumState:
  if not isinstance(state, AccumState):
    raise WeightedAccumulationError(
      "microbatched_value_and_grad(...).accumulate(state): expected an "
      f"AccumState (from wa.init), got {type(state).__name__}."
    )
  if axes is None:
    return state
  per_replica = (
    ("grads",)
    + _counters.named(_counters.SUMMED)
    + _counters.named(_counters.LOCAL)
  )
  return state.replace(
    **{
      f: dist._to_varying(getattr(state, f), axes)  # pylint: disable=protected-access
      for f in per_replica
    }
  )


def _prepare(args, n_real, *, axis_name, diff, single, batch, k):
  """The axes, the differentiated params, the split batch and the number of
  real microbatches of one call."""
  what = "microbatched_value_and_grad"
  axes = None if axis_name is None else dist._axes(axis_name, what)  # pylint: disable=protected-access
  if max(diff) >= len(args):
    raise WeightedAccumulationError(
      f"{what}: argnums {diff} but the function was called with "
      f"{len(args)} positional argument(s). Pass the params at argnums and "
      "the batch at batch_argnums."
    )
  params = args[diff[0]] if single else tuple(args[i] for i in diff)
  return axes, params, _split(args, batch, k), _real_count(n_real, k)


def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  mode: str = "sum",
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  batch_argnums: int | Sequence[int] = 1,
  dtype: Any = jnp.float32,
  loss_scale: float | jax.Array = 1.0,
  axis_name: str | Sequence[str] | None = None,
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
    mode: ``"sum"``: ``loss`` is the microbatch's loss SUM over its items;
      ``"mean"``: it is that sum divided by ``weight`` (a fully masked
      microbatch, 0/0, adds nothing).
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

  Returns:
    ``f(*args, num_real_microbatches=None)`` returning ``(loss, out)``, or
    ``((loss, aux), out)`` (``f(*args, num_real_microbatches=None,
    loss_scale=None)``): ``loss`` the exact float32 mean loss, ``aux``
    stacked on a leading K axis (microbatch order, zeros where skipped),
    ``out`` an :class:`~weighted_accum.AccumulatedGradients` (mean gradient
    in ``dtype``, total weight, ``issued``, ``finite``, ``valid``; ``valid``
    is also false when a microbatch's weight was negative or non-finite:
    such a microbatch is dropped). ``num_real_microbatches`` (an int, traced
    or not) runs only microbatches ``k < num_real_microbatches``; the others
    are not computed and no recompilation happens across values.
    ``f.accumulate(state, *args, num_real_microbatches=None)`` adds the
    call's microbatches to an open window ``state`` without finishing and
    returns ``((loss_sum, weight), state)`` (``(((loss_sum, weight), aux),
    state)`` with ``has_aux``), the call's unscaled loss sum and weight; it
    uses the state's work dtype and loss scale.

  Raises:
    WeightedAccumulationError: for an invalid configuration, batch leaves
      whose leading sizes differ or are not divisible by K, a loss that is
      not a floating scalar, an unbound ``axis_name``, or (eagerly) a call
      whose total weight is 0.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> def loss_fn(w, batch):            # batch: (x, mask)
    ...   x, mask = batch
    ...   return jnp.sum(mask * (x * w) ** 2), mask.sum()
    >>> x = jnp.arange(8.0)
    >>> mask = jnp.array([1., 1, 1, 0, 1, 0, 0, 0])
    >>> f = jax.jit(wa.microbatched_value_and_grad(loss_fn, 4))
    >>> loss, out = f(jnp.float32(1.0), (x, mask))
    >>> full = jax.grad(lambda w: loss_fn(w, (x, mask))[0] / 4)(1.0)
    >>> float(loss), float(out.grads), float(full), float(out.weight)
    (5.25, 10.5, 10.5, 4.0)
  """
  k, diff, batch, dt = _check_config(
    num_microbatches, mode, argnums, batch_argnums, dtype, loss_scale
  )
  single = isinstance(argnums, (int, np.integer))
  what = "microbatched_value_and_grad"
  default_scale = _scale_of(loss_scale, f"{what}(loss_scale=...)")
  cfg = dict(
    k=k,
    argnums=diff,
    argnums_in=argnums,
    loss_fn=loss_fn,
    has_aux=has_aux,
    mode=mode,
  )

  prepare = functools.partial(
    _prepare, axis_name=axis_name, diff=diff, single=single, batch=batch, k=k
  )

  def f(*args, num_real_microbatches=None, loss_scale=None):
    axes, params, split, n_real = prepare(args, num_real_microbatches)
    ls = (
      default_scale
      if loss_scale is None
      else _scale_of(loss_scale, f"{what}(...)(loss_scale=...)")
    )
    st = (
      state_lib.init(params, dt, ls)
      if axes is None
      else dist.init(params, axes, dt, ls)
    )
    st, loss_sum, _, aux = _loop(dict(cfg, axes=axes), st, args, split, n_real)
    loss, out = _conclude(st, loss_sum, st.rejected, axes)
    return ((loss, aux), out) if has_aux else (loss, out)

  def accumulate(state, *args, num_real_microbatches=None):
    axes, _, split, n_real = prepare(args, num_real_microbatches)
    st = _to_window(state, axes)
    st, loss_sum, w_sum, aux = _loop(
      dict(cfg, axes=axes, track_weight=True), st, args, split, n_real
    )
    value = (loss_sum, w_sum)
    return ((value, aux) if has_aux else value), st

  f.accumulate = accumulate
  return f


# ------------------------------------------------- optax.microbatching --


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


def _aggregate(values: Any, mean: bool) -> Any:
  """Per-example values (leading axis) folded into one microbatch value of
  the same mode: sums, or weighted means over the positive weights."""
  loss, weight, grads = _unpack_value(values)
  w = jnp.asarray(weight, _F32)
  if not mean:
    return (
      (jnp.sum(loss, 0), jnp.sum(w, 0)),
      jax.tree.map(lambda g: jnp.sum(g, 0), grads),
    )
  take = w > 0
  total = jnp.sum(jnp.where(take, w, 0.0))
  inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)

  def wmean(x):
    t = jnp.reshape(take, take.shape + (1,) * (x.ndim - 1))
    ww = jnp.reshape(w, t.shape)
    s = jnp.sum(jnp.where(t, x.astype(_F32) * ww, 0.0), 0)
    return (s * inv).astype(x.dtype)

  return (wmean(loss), total), jax.tree.map(wmean, grads)


def optax_accumulator(mode: str = "sum", dtype: Any = jnp.float32) -> Any:
  """An exact weighted ``optax.microbatching.Accumulator``.

  A drop-in for ``accumulator=AccumulationType.MEAN`` in
  ``optax.microbatching.microbatch`` (optax >= 0.2.7): the microbatched
  function returns ``((loss, weight), grads)`` (``jax.value_and_grad(loss_fn,
  has_aux=True)`` of a ``loss_fn`` returning ``(loss, weight)``), and the
  result is ``((mean_loss, total_weight), mean_grads)``, the exact
  full-batch values, where MEAN divides by the microbatch count (equal
  weights whatever each microbatch's item count). The carry is an
  :class:`~weighted_accum.AccumState`: ``accumulate_sum``/``accumulate_mean``
  add, ``finish_mean`` divides once.

  Args:
    mode: ``"sum"`` when ``loss`` is the microbatch's loss SUM, ``"mean"``
      when it is the SUM divided by ``weight`` (0/0 microbatches add
      nothing).
    dtype: the gradient buffers' work dtype.

  Returns:
    An ``optax.microbatching.Accumulator``.

  Raises:
    WeightedAccumulationError: for an unknown mode, a non-floating dtype, an
      optax without ``optax.microbatching``, or a value that is not
      ``((loss, weight), grads)``; eagerly, for a total weight of 0.

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
  try:
    from optax import microbatching  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # optax < 0.2.7
    raise WeightedAccumulationError(
      "optax_accumulator needs optax.microbatching (optax >= 0.2.7); "
      "upgrade optax or use microbatched_value_and_grad."
    ) from e
  if mode not in MODES:
    raise WeightedAccumulationError(
      f"optax_accumulator(mode={mode!r}): expected one of {MODES}."
    )
  dt = errors.check_floating_dtype(dtype, what="optax_accumulator(dtype=...)")
  mean = mode == "mean"
  acc = core.accumulate_mean if mean else core.accumulate_sum

  def init(value):
    _, _, grads = _unpack_value(value)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grads)
    return state_lib.init(zeros, dt), jnp.zeros((), _F32)

  def update(carry, value, _):
    st, loss_sum = carry
    loss, weight, grads = _unpack_value(value)
    w = jnp.asarray(weight, _F32)
    part = loss.astype(_F32) * w if mean else jnp.asarray(loss, _F32)
    take = jnp.isfinite(w) & (w > 0)
    return acc(st, grads, w), loss_sum + jnp.where(take, part, 0.0)

  def finalize(carry):
    st, loss_sum = carry
    out, _ = core.finish_mean(st)
    loss = jnp.where(out.weight > 0, loss_sum / out.weight, 0.0)
    return (loss, out.weight), out.grads

  return microbatching.Accumulator(
    init=init,
    update=update,
    finalize=finalize,
    aggregate=lambda values: _aggregate(values, mean),
  )
