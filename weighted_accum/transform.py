"""The optax wrapper: ``weighted_multi_steps``, a weighted ``optax.MultiSteps``.

:func:`weighted_multi_steps` accumulates each microbatch's gradients with its
weight and, when the window closes, hands the exact window gradient
``sum grad(S) / sum n`` to the inner optimizer once. Also here: its state
(:class:`WeightedMultiStepsState`) and the readers :func:`has_updated` and
:func:`window_counters`. How a step is laid out in memory, and why (the
updates travel in the window's buffers; two selects after one conditional),
is in ``docs/design.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np
import optax

from weighted_accum import _finish
from weighted_accum import _tree
from weighted_accum import core
from weighted_accum import distributed
from weighted_accum import errors
from weighted_accum import state as state_lib
from weighted_accum.errors import WeightedAccumulationError

__all__ = ["WeightedMultiStepsState", "has_updated", "weighted_multi_steps",
           "window_counters"]

_MODES = ("mean", "sum")


class WeightedMultiStepsState(NamedTuple):
  """State of :func:`weighted_multi_steps` (like ``optax.MultiStepsState``).

  Attributes:
    inner_state: the wrapped optimizer's state; changes only when a window's
      gradient is applied.
    accum: the current window, an :class:`~weighted_accum.AccumState`
      (buffers, issued/zero-weight/rejected counts, exact total weight, loss
      scale).
    mini_step: int32, microbatches issued since the window opened (0 right
      after a close).
    gradient_step: int32, inner updates applied since ``init``.
    updated: bool, the last call closed a window and applied the inner
      update (see :func:`has_updated`).
    nonfinite: bool, the last call closed a window whose pending gradients
      held NaN/Inf (e.g. a float16 loss-scale overflow): it was discarded,
      the inner optimizer was not advanced, and the next window starts clean.
      A dynamic loss scaler lowers its scale when it sees this.
    nonfinite_windows: int32, windows discarded as non-finite since ``init``.
    empty_windows: int32, closes of a window with zero total weight since
      ``init``. Such a window applies nothing and is not lost: its counters
      carry into the next window.
  """

  inner_state: Any
  accum: state_lib.AccumState
  mini_step: jax.Array
  gradient_step: jax.Array
  updated: jax.Array
  nonfinite: jax.Array
  nonfinite_windows: jax.Array
  empty_windows: jax.Array


def _value(x: Any) -> Any:
  """Unwraps an ``nnx.Variable`` (as in ``nnx.Optimizer.opt_state``)."""
  get = getattr(x, "get_value", None)
  return get() if callable(get) else x


def has_updated(state: WeightedMultiStepsState) -> jax.Array:
  """Whether the last ``update`` closed a window and applied the inner update.

  Works on the state itself and on ``nnx.Optimizer(...).opt_state``.

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A bool scalar array (traceable).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> tx = wa.weighted_multi_steps(optax.sgd(0.1), every_k=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> g = {'w': jnp.ones(2)}
    >>> _, state = tx.update(g, state, params, weight=3)
    >>> bool(wa.has_updated(state))
    False
    >>> _, state = tx.update(g, state, params, weight=1)
    >>> bool(wa.has_updated(state))
    True
  """
  return jnp.asarray(_value(state.updated))


def window_counters(state: WeightedMultiStepsState) -> dict[str, Any]:
  """The current window's counters; reading them changes nothing.

  Works on the state itself and on ``nnx.Optimizer(...).opt_state``.

  Args:
    state: a :class:`WeightedMultiStepsState`.

  Returns:
    A dict with ``mini_step`` (microbatches since the window opened),
    ``issued``, ``zero_weight`` and ``rejected`` (the window's microbatch
    counts; they include those of an empty window carried over),
    ``total_weight`` (an exact Python float when concrete, a float32 array
    under a transformation) and ``loss_scale``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> tx = wa.weighted_multi_steps(optax.sgd(0.1), every_k=4)
    >>> params = {'w': jnp.zeros(2)}
    >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params,
    ...                      weight=7)
    >>> c = wa.window_counters(state)
    >>> int(c['mini_step']), int(c['issued']), c['total_weight']
    (1, 1, 7.0)
  """
  accum = jax.tree.map(_value, state.accum)
  return dict(mini_step=_value(state.mini_step), issued=accum.issued,
              zero_weight=accum.zero_weight, rejected=accum.rejected,
              total_weight=accum.total_weight, loss_scale=accum.loss_scale)


def _check_every_k(every_k: Any) -> int | None:
  if every_k is None:
    return None
  if isinstance(every_k, bool) or not isinstance(every_k, (int, np.integer)):
    raise WeightedAccumulationError(
        f"weighted_multi_steps(every_k=...): {every_k!r} is not an int. Pass "
        "the number of microbatches per window (a Python int), or None to "
        "close windows only with update(..., finish=True).")
  if every_k < 1:
    raise WeightedAccumulationError(
        f"weighted_multi_steps(every_k=...): {every_k} is not positive. Pass "
        "the number of microbatches per window (>= 1), or None.")
  return int(every_k)


def _check_finish(finish: Any) -> jax.Array:
  if finish is None:
    return jnp.bool_(False)
  if np.ndim(finish) != 0 or jnp.result_type(finish) != jnp.bool_:
    raise WeightedAccumulationError(
        f"update(finish=...): expected a bool scalar, got "
        f"{jnp.result_type(finish)} of shape {np.shape(finish)}. Pass True to "
        "close the window after this microbatch (e.g. at the end of an "
        "epoch), False or None otherwise; a traced bool is fine.")
  return jnp.asarray(finish)


class _Config(NamedTuple):
  """The static choices of one :func:`weighted_multi_steps` transformation."""
  inner: optax.GradientTransformationExtraArgs
  every_k: int | None
  mode: str
  dtype: jnp.dtype
  loss_scale: Any
  axis_name: str | Sequence[str] | None


class _Closed(NamedTuple):
  """What :func:`_close` and :func:`_stay_open` return.

  Attributes:
    carrier: the applied window's updates written over its buffers (when
      ``carry``), else the updates themselves; mid-window and for a skipped
      window: the buffers (``carry``) or zero updates.
    inner_state: the inner optimizer's state, advanced only if ``applied``.
    counters: the next window's counters (an ``AccumState`` without grads).
    applied: the inner update was applied.
    nonfinite: the window was discarded for NaN/Inf pending gradients.
    consumed: the window is over (its buffers are zeroed for the next one).
    empty: a close of a window with zero total weight (kept open).
  """
  carrier: Any
  inner_state: Any
  counters: state_lib.AccumState
  applied: jax.Array
  nonfinite: jax.Array
  consumed: jax.Array
  empty: jax.Array


def _accumulate(cfg: _Config, accum: state_lib.AccumState, grads: Any,
                weight: Any) -> state_lib.AccumState:
  """Adds one microbatch, summed over ``cfg.axis_name`` when given."""
  mean = cfg.mode == "mean"
  if cfg.axis_name is None:
    fn = core.accumulate_mean if mean else core.accumulate_sum
    return fn(accum, grads, weight)
  fn = distributed.accumulate_mean if mean else distributed.accumulate_sum
  return fn(accum, grads, weight, cfg.axis_name, reduce="microbatch")


def _inner_update(cfg: _Config, like: list[Any], extra_args: dict[str, Any],
                  g: Any, inner_state: Any, params: Any) -> tuple[Any, Any]:
  """The inner update of the window gradient ``g``, cast leaf by leaf to the
  dtypes of ``like`` (the params', or the grads' without params)."""
  leaves, treedef = jax.tree.flatten(g)
  g = jax.tree.unflatten(treedef, [
      a.astype(jnp.result_type(b)) for a, b in zip(leaves, like)])
  return cfg.inner.update(g, inner_state, params, **extra_args)


def _can_carry(shapes: Any, buffers: Any) -> bool:
  """Whether the updates fit in the window's buffers exactly: same tree and
  shapes, and a dtype the work dtype holds losslessly."""
  buf_leaves, buf_def = jax.tree.flatten(buffers)
  upd_leaves, upd_def = jax.tree.flatten(shapes)
  return upd_def == buf_def and all(
      u.shape == b.shape and
      jnp.promote_types(u.dtype, b.dtype) == jnp.dtype(b.dtype)
      for u, b in zip(upd_leaves, buf_leaves))


def _zero_updates(shapes: Any) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _apply_window(update: Any, carry: bool, loss_scale: jax.Array,
                  weight: jax.Array, buffers: Any, inner_state: Any,
                  params: Any) -> tuple[Any, Any]:
  """``finish_mean``'s division fused into the inner update.

  Divided inside this branch so that XLA fuses it into the inner update's
  loops instead of materialising the normalised gradient as an operand of
  the conditional; in at least float32 (when total weight * loss scale < 1
  the mean can exceed float16's range although the sums do not).
  """
  g = _finish.divide(buffers, loss_scale, weight, wide=True)
  upd, new_inner = update(g, inner_state, params)
  if carry:
    upd = jax.tree.map(lambda u, b: u.astype(b.dtype), upd, buffers)
  return upd, new_inner


def _skip_window(shapes: Any, carry: bool, buffers: Any, inner_state: Any,
                 params: Any) -> tuple[Any, Any]:
  del params
  return (buffers if carry else _zero_updates(shapes)), inner_state


def _close(update: Any, shapes: Any, carry: bool, next_loss_scale: Any,
           accum: state_lib.AccumState, inner_state: Any,
           params: Any) -> _Closed:
  """Closes the window: applies it if valid, and starts the next one."""
  # The window's validity from its sums, read in place: finish_mean's
  # normalised copy would be a parameter-sized temporary (XLA:CPU does not
  # fuse the division into the finiteness reduction).
  # As finish_mean: an empty window keeps its counters (keep_empty).
  out, new_accum = _finish.finish(accum, mean=False, keep_empty=True,
                                  next_loss_scale=next_loss_scale)
  nonempty = out.weight > 0
  valid = out.finite & nonempty
  counters = new_accum.replace(grads=None)
  # An invalid window (non-finite or empty) does not reach the inner
  # optimizer at all: a conditional, not a 0/1 product (0 * NaN = NaN) nor
  # a select (which would make XLA copy the inner state).
  upd, new_inner = lax.cond(
      valid,
      functools.partial(_apply_window, update, carry, accum.loss_scale,
                        out.weight),
      functools.partial(_skip_window, shapes, carry),
      accum.grads, inner_state, params)
  return _Closed(carrier=upd, inner_state=new_inner, counters=counters,
                 applied=valid, nonfinite=nonempty & ~out.finite,
                 consumed=nonempty, empty=~nonempty)


def _stay_open(shapes: Any, carry: bool, accum: state_lib.AccumState,
               inner_state: Any, params: Any) -> _Closed:
  del params
  f = jnp.bool_(False)
  return _Closed(carrier=accum.grads if carry else _zero_updates(shapes),
                 inner_state=inner_state,
                 counters=accum.replace(grads=None), applied=f, nonfinite=f,
                 consumed=f, empty=f)


def _outputs(closed: _Closed, shapes: Any, carry: bool,
             buffers: Any) -> tuple[Any, Any]:
  """The returned updates and the next window's buffers."""
  if carry:
    # ``closed.carrier`` holds the applied window's updates, or the buffers.
    # Selects, not conditionals: XLA schedules them after the caller's read
    # of the updates and writes the buffers in place (a conditional here
    # would make it copy the buffers first).
    updates = jax.tree.map(
        lambda c, s: jnp.where(closed.applied, c,
                               jnp.zeros((), c.dtype)).astype(s.dtype),
        closed.carrier, shapes)
    buffers = jax.tree.map(
        lambda c: jnp.where(closed.consumed, jnp.zeros((), c.dtype), c),
        closed.carrier)
    return updates, buffers
  # Zeroing the consumed window's buffers in a conditional of its own (its
  # predicate comes out of the one above, so it runs after the buffers were
  # read) lets XLA update them in place.
  buffers = lax.cond(closed.consumed,
                     lambda b: jax.tree.map(jnp.zeros_like, b),
                     lambda b: b, buffers)
  return closed.carrier, buffers


def _next_state(state: WeightedMultiStepsState, closed: _Closed,
                buffers: Any, closing: jax.Array,
                mini_step: jax.Array) -> WeightedMultiStepsState:
  one = jnp.int32(1)
  count = lambda flag: jnp.where(flag, one, 0)
  return WeightedMultiStepsState(
      inner_state=closed.inner_state,
      accum=closed.counters.replace(grads=buffers),
      mini_step=jnp.where(closing, 0, mini_step).astype(jnp.int32),
      gradient_step=state.gradient_step + count(closed.applied),
      updated=closed.applied,
      nonfinite=closed.nonfinite,
      nonfinite_windows=state.nonfinite_windows + count(closed.nonfinite),
      empty_windows=state.empty_windows + count(closed.empty))


def _init(cfg: _Config, params: Any) -> WeightedMultiStepsState:
  # A distinct array per field: a donated state must not hold one buffer
  # twice.
  count = lambda: jnp.zeros((), jnp.int32)
  flag = lambda: jnp.zeros((), jnp.bool_)
  return WeightedMultiStepsState(
      inner_state=cfg.inner.init(params),
      accum=state_lib.init(params, dtype=cfg.dtype,
                           loss_scale=cfg.loss_scale),
      mini_step=count(), gradient_step=count(), updated=flag(),
      nonfinite=flag(), nonfinite_windows=count(), empty_windows=count())


def _update(cfg: _Config, grads: Any, state: WeightedMultiStepsState,
            params: Any = None, *, weight: Any, finish: Any = None,
            next_loss_scale: Any = None, **extra_args: Any
            ) -> tuple[Any, WeightedMultiStepsState]:
  """One microbatch: accumulate, then close the window or keep it open."""
  closing = _check_finish(finish)
  if next_loss_scale is not None:
    errors.check_loss_scale(next_loss_scale,
                            what="update(next_loss_scale=...)")
  accum = _accumulate(cfg, state.accum, grads, weight)
  mini_step = state.mini_step + 1
  if cfg.every_k is not None:
    closing = closing | (mini_step >= cfg.every_k)
  # The inner optimizer gets the window's gradient in the params' dtypes
  # (float32 master weights get float32 gradients even when the
  # microbatches' grads were float16), or the grads' without params.
  like = (jax.tree.leaves(grads) if params is None else
          _tree.match_tree(state.accum.grads, params, what="update(params)"))
  update = functools.partial(_inner_update, cfg, like, extra_args)
  shapes = jax.eval_shape(update, accum.grads, state.inner_state, params)[0]
  carry = _can_carry(shapes, accum.grads)
  # Mid-window the inner update is not even traced into the executed
  # branch: both branches pass the buffers and the inner state through.
  closed = lax.cond(
      closing,
      functools.partial(_close, update, shapes, carry, next_loss_scale),
      functools.partial(_stay_open, shapes, carry),
      accum, state.inner_state, params)
  updates, buffers = _outputs(closed, shapes, carry, accum.grads)
  return updates, _next_state(state, closed, buffers, closing, mini_step)


def weighted_multi_steps(
    inner: optax.GradientTransformation,
    every_k: int | None = None,
    *,
    mode: str = "mean",
    dtype: DTypeLike = jnp.float32,
    loss_scale: ArrayLike = 1.0,
    axis_name: str | Sequence[str] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Weighted gradient accumulation in front of an optax optimizer.

  A drop-in for ``optax.MultiSteps(inner, every_k)`` whose ``update`` takes
  each microbatch's weight (its effective item count: tokens, samples):

      updates, state = tx.update(grads, state, params, weight=n_tokens)

  A window closes after ``every_k`` microbatches, or earlier when the call
  passes ``finish=True`` (a short last window of an epoch is normalised by
  its own weight). At a close the window's gradient ``sum grad(S) / sum n``
  (:func:`weighted_accum.finish_mean`) goes through ``inner`` once and its
  updates are returned. Mid-window the updates are zeros, the inner state is
  untouched and the inner update is not computed (``lax.cond``).

  A close with zero total weight (every microbatch fully masked) applies
  nothing, does not advance ``inner`` and is not lost: the window stays open
  and its counters carry into the next one (``state.empty_windows``
  counts these). A close with NaN/Inf pending gradients (a float16 loss-scale
  overflow) applies nothing, does not advance ``inner``, sets
  ``state.nonfinite`` and discards the window, so the next window starts
  clean. ``state.gradient_step`` counts applied windows.

  Args:
    inner: the optimizer to apply once per window (any optax transform; extra
      keyword arguments of ``update`` are forwarded to it at a close).
    every_k: microbatches per window (a Python int), or ``None`` to close
      windows only with ``finish=True``.
    mode: ``"mean"`` when the grads are of each microbatch's loss MEAN
      (``sum(w * l) / weight``), ``"sum"`` when they are of its loss SUM.
    dtype: the work dtype of the accumulation buffers.
    loss_scale: the factor every loss of a window is multiplied by (for
      float16 training); divided out once at the close. Change it per window
      with ``update(..., next_loss_scale=...)``.
    axis_name: inside ``jax.shard_map`` over a data axis, its name(s).
      Then ``weight`` is this replica's own item count and each microbatch's
      gradient sums and weights are summed over the axis before they are
      added (:mod:`weighted_accum.distributed`, ``reduce="microbatch"``:
      one all-reduce per microbatch, like the ``pmean`` of a usual
      data-parallel step), so the state stays identical on every replica
      (``out_specs=P()``). ``grads`` may be local (see
      :func:`weighted_accum.distributed.local_grad`) or already summed by
      autodiff (params passed unvarying); the latter cannot be reweighted
      for ``mode="mean"`` with per-replica counts, which raises. Leave it
      ``None`` under ``jax.jit`` over sharded global arrays. For one
      all-reduce per window, use :mod:`weighted_accum.distributed` directly.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``init(params)`` gives a
    :class:`WeightedMultiStepsState`. ``update(grads, state, params=None, *,
    weight, finish=None, next_loss_scale=None, **extra_args)`` returns
    ``(updates, new_state)``; ``weight`` is a scalar (traced values never
    recompile); ``finish`` a bool scalar (may be traced);
    ``next_loss_scale`` the loss scale of the window after a close.

  Raises:
    WeightedAccumulationError: for an invalid ``every_k``, ``mode`` or
      ``finish``, and everything :func:`weighted_accum.init` and
      :func:`weighted_accum.accumulate_mean` raise (mismatched grads tree,
      concrete invalid weight, bad dtype or loss scale).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> tx = wa.weighted_multi_steps(optax.sgd(1.0), every_k=2)
    >>> state = tx.init(params)
    >>> # Two microbatches of mean grads, with 3 and 1 tokens:
    >>> for g, n in [({'w': jnp.array([1., 1.])}, 3),
    ...              ({'w': jnp.array([5., 1.])}, 1)]:
    ...   updates, state = tx.update(g, state, params, weight=n)
    ...   params = optax.apply_updates(params, updates)
    >>> params['w'].tolist()   # 1 - (3*1 + 1*5)/4, -1 - 1
    [-1.0, -2.0]
  """
  k = _check_every_k(every_k)
  if mode not in _MODES:
    raise WeightedAccumulationError(
        f"weighted_multi_steps(mode=...): {mode!r} is not one of {_MODES}. "
        "Pass 'mean' when the grads are of each microbatch's mean loss, "
        "'sum' when they are of its summed loss.")
  work_dtype = errors.check_floating_dtype(
      dtype, what="weighted_multi_steps(dtype=...)")
  errors.check_loss_scale(loss_scale,
                          what="weighted_multi_steps(loss_scale=...)")
  cfg = _Config(inner=optax.with_extra_args_support(inner), every_k=k,
                mode=mode, dtype=work_dtype, loss_scale=loss_scale,
                axis_name=axis_name)
  return optax.GradientTransformationExtraArgs(
      functools.partial(_init, cfg), functools.partial(_update, cfg))
