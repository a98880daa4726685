"""The optax wrapper: ``WeightedMultiSteps``, a weighted ``optax.MultiSteps``.

:class:`WeightedMultiSteps` (and its functional form
:func:`weighted_multi_steps`) accumulates each microbatch's gradients with
its weight and, when the window closes, hands the exact window gradient
``sum grad(S) / sum n`` to the inner optimizer once. Also here: its state
(:class:`WeightedMultiStepsState`) and the readers :func:`has_updated` and
:func:`window_counters`. How a step is laid out in memory, and why (the
updates travel in the window's buffers; two selects after one conditional),
is in ``docs/design.md``; migrating from ``optax.MultiSteps`` is in
``docs/migration.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import operator
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np
import optax

from weighted_accum import _counters
from weighted_accum import _finish
from weighted_accum import _inputs
from weighted_accum import _placement
from weighted_accum import _tree
from weighted_accum import core
from weighted_accum import distributed
from weighted_accum import errors
from weighted_accum import state as state_lib
from weighted_accum import window
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.loss_scale import DynamicLossScale

__all__ = [
  "WeightedMultiSteps",
  "WeightedMultiStepsState",
  "has_updated",
  "weighted_multi_steps",
  "window_counters",
]

_MODES = ("mean", "sum")
_INT32_MAX = 2**31 - 1


class WeightedMultiStepsState(NamedTuple):
  """State of :class:`WeightedMultiSteps`: ``optax.MultiStepsState``'s
  fields, then this library's.

  Attributes:
    mini_step: int32, microbatches accumulated since the window opened (0
      right after a close; a microbatch skipped by ``should_skip_update_fn``
      does not count).
    gradient_step: int32, windows applied to the inner optimizer since
      ``init`` (the argument of a callable ``every_k_schedule``).
    inner_opt_state: the wrapped optimizer's state; changes only when a
      window's gradient is applied.
    acc_grads: the open window's pending gradient sums, a tree like the
      params in the accumulator dtype. Unlike ``optax.MultiSteps``' running
      mean these are weighted SUMS, still multiplied by the loss scale; the
      window's gradient is ``acc_grads / loss_scale / total_weight``.
    skip_state: what ``should_skip_update_fn`` returned last (``()``
      without one), as in optax.
    window: the open window's counters, an
      :class:`~weighted_accum.AccumState` without buffers (``grads`` is
      ``None``): issued/zero-weight/rejected counts, exact total weight,
      loss scale. :attr:`accum` joins it with ``acc_grads``.
    updated: bool, the last call closed a window and applied the inner
      update (see :func:`has_updated`).
    nonfinite: bool, the last call closed a window whose pending gradients,
      or whose inner updates, held NaN/Inf: nothing was applied and the next
      window starts clean. For NaN/Inf gradients the inner optimizer was not
      advanced; for NaN/Inf updates its state has taken the step (keeping
      the previous one would copy it on every call).
    nonfinite_windows: int32, windows discarded as non-finite since ``init``.
    empty_windows: int32, closes of a window with zero total weight since
      ``init``. Such a window applies nothing and is not lost: its counters
      carry into the next window.
    skipped: int32, microbatches skipped by ``should_skip_update_fn`` since
      ``init``.
    loss_scaler: the :class:`~weighted_accum.DynamicLossScale` adjusted at
      each close, or ``None`` for a fixed loss scale.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any
  skip_state: Any
  window: state_lib.AccumState
  updated: jax.Array
  nonfinite: jax.Array
  nonfinite_windows: jax.Array
  empty_windows: jax.Array
  skipped: jax.Array
  loss_scaler: DynamicLossScale | None

  @property
  def accum(self) -> state_lib.AccumState:
    """The open window as one :class:`~weighted_accum.AccumState`."""
    return self.window.replace(grads=self.acc_grads)

  @property
  def inner_state(self) -> Any:
    """Alias of :attr:`inner_opt_state`."""
    return self.inner_opt_state


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
  window = jax.tree.map(_value, state.window)
  return dict(
    mini_step=_value(state.mini_step),
    issued=window.issued,
    zero_weight=window.zero_weight,
    rejected=window.rejected,
    total_weight=window.total_weight,
    loss_scale=window.loss_scale,
  )


def _check_every_k(every_k: Any, what: str) -> int | Callable[..., Any] | None:
  """An int in [1, 2**31), a callable of ``gradient_step``, or ``None``."""
  if every_k is None or (
    callable(every_k) and not isinstance(every_k, (np.generic, np.ndarray))
  ):
    return every_k
  if isinstance(every_k, (bool, np.bool_)) or not isinstance(
    every_k, (int, np.integer)
  ):
    raise WeightedAccumulationError(
      f"{what}: {every_k!r} is not an int or a callable. Pass the number "
      "of microbatches per window (a Python int), a function of the "
      "gradient step returning it (as optax.MultiSteps' "
      "every_k_schedule), or None to close windows only with "
      "update(..., finish=True)."
    )
  k = operator.index(every_k)
  if not 1 <= k <= _INT32_MAX:
    raise WeightedAccumulationError(
      f"{what}: {k} is outside [1, 2**31 - 1]; the window's microbatch "
      "counter is int32. Pass the number of microbatches per window, or "
      "None to close windows only with update(..., finish=True)."
    )
  return k


def _check_mode(mode: Any, what: str) -> str:
  if not isinstance(mode, str) or mode not in _MODES:
    raise WeightedAccumulationError(
      f"{what}: {mode!r} is not one of {_MODES}. Pass 'mean' when the "
      "grads are of each microbatch's mean loss, 'sum' when they are of "
      "its summed loss."
    )
  return mode


def _check_axis_name(axis_name: Any, what: str) -> Any:
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if axis_name is not None and not (
    names and all(isinstance(n, str) and n for n in names)
  ):
    raise WeightedAccumulationError(
      f"{what}: {axis_name!r} is not a mesh axis name. Pass the data "
      "axis' name (a str, or a tuple of them) inside jax.shard_map, or "
      "None."
    )
  return tuple(axis_name) if isinstance(axis_name, list) else axis_name


def _check_finish(finish: Any) -> jax.Array:
  if finish is None:
    return jnp.bool_(False)
  if isinstance(finish, (bool, np.bool_)):
    return jnp.bool_(finish)
  if (
    not hasattr(finish, "dtype")
    or np.ndim(finish) != 0
    or jnp.result_type(finish) != jnp.bool_
  ):
    raise WeightedAccumulationError(
      f"update(finish=...): expected a bool scalar, got {finish!r}. Pass "
      "True to close the window after this microbatch (e.g. at the end of "
      "an epoch), False or None otherwise; a traced bool is fine."
    )
  return jnp.asarray(finish)


class _Config(NamedTuple):
  """The static choices of one :class:`WeightedMultiSteps`."""

  inner: optax.GradientTransformationExtraArgs
  every_k: int | Callable[..., Any] | None
  use_grad_mean: bool
  should_skip: Callable[..., Any] | None
  dtype: jnp.dtype
  mode: str
  loss_scale: Any
  axis_name: str | Sequence[str] | None


def _config(
  who: str,
  k_arg: str,
  opt: Any,
  every_k: Any,
  use_grad_mean: Any,
  should_skip_update_fn: Any,
  accumulator_dtype: Any,
  dtype_arg: str,
  mode: Any,
  loss_scale: Any,
  axis_name: Any,
) -> _Config:
  """Validates the constructor's arguments, naming each as ``who`` does."""
  if not (hasattr(opt, "init") and hasattr(opt, "update")):
    raise WeightedAccumulationError(
      f"{who}: the inner optimizer {opt!r} is not an optax "
      "GradientTransformation (it needs init and update)."
    )
  if should_skip_update_fn is not None and not callable(should_skip_update_fn):
    raise WeightedAccumulationError(
      f"{who}(should_skip_update_fn=...): {should_skip_update_fn!r} is not "
      "callable. Pass a function (updates, gradient_step, params) -> "
      "(should_skip, skip_state), e.g. optax.skip_not_finite, or None."
    )
  if not isinstance(loss_scale, DynamicLossScale):
    errors.check_loss_scale(loss_scale, what=f"{who}(loss_scale=...)")
  return _Config(
    inner=optax.with_extra_args_support(opt),
    every_k=_check_every_k(every_k, f"{who}({k_arg}=...)"),
    use_grad_mean=_inputs.static_flag(
      use_grad_mean, what=f"{who}(use_grad_mean=...)"
    ),
    should_skip=should_skip_update_fn,
    dtype=errors.check_floating_dtype(
      accumulator_dtype, what=f"{who}({dtype_arg}=...)"
    ),
    mode=_check_mode(mode, f"{who}(mode=...)"),
    loss_scale=loss_scale,
    axis_name=_check_axis_name(axis_name, f"{who}(axis_name=...)"),
  )


class _Closed(NamedTuple):
  """What :func:`_close` and :func:`_stay_open` return.

  Attributes:
    carrier: the applied window's updates written over its buffers (when
      ``carry``), else the updates themselves; mid-window and for a skipped
      window: the buffers (``carry``) or zero updates.
    inner_state: the inner optimizer's state, advanced only if ``applied``.
    counters: the next window's counters (an ``AccumState`` without grads).
    applied: the inner update was applied.
    nonfinite: the window was discarded for NaN/Inf pending gradients or
      inner updates.
    consumed: the window is over (its buffers are zeroed for the next one).
    empty: a close of a window with zero total weight (kept open).
    scaler: the dynamic loss scale after this call (``None`` without one).
  """

  carrier: Any
  inner_state: Any
  counters: state_lib.AccumState
  applied: jax.Array
  nonfinite: jax.Array
  consumed: jax.Array
  empty: jax.Array
  scaler: DynamicLossScale | None


class _Inner(NamedTuple):
  """The inner update as the window sees it (static for one trace).

  Attributes:
    update: ``(g, inner_state, params) -> (updates, inner_state)``.
    shapes: the updates' shapes and dtypes, as ``optax.MultiSteps`` returns
      them for these grads and params.
    carry: whether the updates fit in the window's buffers exactly.
  """

  update: Callable[..., Any]
  shapes: Any
  carry: bool


def _should_skip(
  cfg: _Config, grads: Any, state: WeightedMultiStepsState, params: Any
) -> tuple[jax.Array | None, Any]:
  """``should_skip_update_fn``'s verdict on this microbatch, optax's way."""
  if cfg.should_skip is None:
    return None, state.skip_state
  skip, skip_state = cfg.should_skip(grads, state.gradient_step, params)
  if (jnp.result_type(skip), np.shape(skip)) != (jnp.bool_, ()):
    raise WeightedAccumulationError(
      "WeightedMultiSteps(should_skip_update_fn=...): it returned "
      f"{jnp.result_type(skip)} of shape {np.shape(skip)} as should_skip; "
      "it must return a bool scalar (and the skip state)."
    )
  if cfg.axis_name is not None:
    # Every replica must skip together, or their windows would drift apart.
    skip = lax.pmax(jnp.asarray(skip, jnp.int32), cfg.axis_name) > 0
  return jnp.asarray(skip), skip_state


def _accumulate(
  cfg: _Config,
  accum: state_lib.AccumState,
  grads: Any,
  weight: Any,
  skip: jax.Array | None,
) -> state_lib.AccumState:
  """Adds one microbatch, summed over ``cfg.axis_name`` when given. A
  skipped microbatch adds weight 0 (a select: NaN grads stay out) and leaves
  the counters as they were."""
  mean = cfg.mode == "mean"
  if skip is not None:
    weight = jnp.where(skip, jnp.zeros((), jnp.result_type(weight)), weight)
  if cfg.axis_name is None:
    fn = core.accumulate_mean if mean else core.accumulate_sum
    new = fn(accum, grads, weight)
  else:
    fn = distributed.accumulate_mean if mean else distributed.accumulate_sum
    new = fn(accum, grads, weight, cfg.axis_name, reduce="microbatch")
  if skip is None:
    return new
  old = _counters.of(accum)
  return new.replace(
    **{k: jnp.where(skip, old[k], v) for k, v in _counters.of(new).items()}
  )


def _closes(
  cfg: _Config,
  closing: jax.Array,
  mini_step: jax.Array,
  gradient_step: jax.Array,
) -> jax.Array:
  """Whether this microbatch closes the window: ``finish`` or ``every_k``."""
  if cfg.every_k is None:
    return closing
  k = cfg.every_k(gradient_step) if callable(cfg.every_k) else cfg.every_k
  return closing | (mini_step >= k)


def _cast_like(tree: Any, dtypes: Any) -> Any:
  return jax.tree.map(
    lambda x, d: jnp.asarray(x).astype(jnp.result_type(d)), tree, dtypes
  )


def _inner_update(
  cfg: _Config,
  dtypes: list[Any],
  extra_args: dict[str, Any],
  g: Any,
  inner_state: Any,
  params: Any,
) -> tuple[Any, Any]:
  """The inner update of the window gradient ``g`` cast leaf by leaf to
  ``dtypes``."""
  leaves, treedef = jax.tree.flatten(g)
  g = jax.tree.unflatten(treedef, [a.astype(d) for a, d in zip(leaves, dtypes)])
  return cfg.inner.update(g, inner_state, params, **extra_args)


def _plan_inner(
  cfg: _Config,
  state: WeightedMultiStepsState,
  grads: Any,
  params: Any,
  extra_args: dict[str, Any],
) -> _Inner:
  """How the window reaches the inner optimizer, in which dtypes.

  ``optax.MultiSteps`` hands the inner optimizer the grads' dtype, and its
  updates' dtypes are the contract. The window's gradient goes in at least
  that wide and at least as wide as the params (float16 params with float32
  grads get float32, never a float16 mean that overflows); the updates come
  back in MultiSteps' dtypes and the inner state in its own.
  """
  ms_dtypes = [jnp.result_type(g) for g in jax.tree.leaves(grads)]
  dtypes = ms_dtypes
  if params is not None:
    p_leaves = _tree.match_tree(state.acc_grads, params, what="update(params)")
    dtypes = [
      jnp.promote_types(d, jnp.result_type(p))
      for d, p in zip(ms_dtypes, p_leaves)
    ]
  ms_update = functools.partial(_inner_update, cfg, ms_dtypes, extra_args)
  shapes = jax.eval_shape(
    ms_update, state.acc_grads, state.inner_opt_state, params
  )[0]
  wide = functools.partial(_inner_update, cfg, dtypes, extra_args)

  def update(g, inner_state, params):
    upd, new_inner = wide(g, inner_state, params)
    return _cast_like(upd, shapes), _cast_like(new_inner, inner_state)

  return _Inner(update, shapes, _can_carry(shapes, state.acc_grads))


def _can_carry(shapes: Any, buffers: Any) -> bool:
  """Whether the updates fit in the window's buffers exactly: same tree and
  shapes, and a dtype the work dtype holds losslessly."""
  buf_leaves, buf_def = jax.tree.flatten(buffers)
  upd_leaves, upd_def = jax.tree.flatten(shapes)
  return upd_def == buf_def and all(
    u.shape == b.shape
    and jnp.promote_types(u.dtype, b.dtype) == jnp.dtype(b.dtype)
    for u, b in zip(upd_leaves, buf_leaves)
  )


def _zero_updates(shapes: Any) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _apply_window(
  inner: _Inner, buffers: Any, g: Any, operands: Any
) -> tuple[Any, Any, jax.Array]:
  """The window's gradient ``g`` (divided by ``window.close`` inside this
  branch, so XLA fuses the division into the inner update's loops) through
  the inner optimizer; returns its updates (over the buffers when they carry
  them: ``buffers`` gives their dtypes), the inner state and whether the
  updates are finite."""
  inner_state, params = operands
  upd, new_inner = inner.update(g, inner_state, params)
  if inner.carry:
    upd = jax.tree.map(lambda u, b: u.astype(b.dtype), upd, buffers)
  # Updates that come out non-finite (an optimizer overflowing in float16)
  # are not applied; checked where they were written, so without a copy.
  # The inner state has taken that step: keeping its previous value beside
  # the new one would copy it on every call. ``nonfinite`` reports it.
  return upd, new_inner, _tree.all_finite(upd)


def _skip_window(
  inner: _Inner, sums: Any, operands: Any
) -> tuple[Any, Any, jax.Array]:
  inner_state, _ = operands
  return (
    sums if inner.carry else _zero_updates(inner.shapes),
    inner_state,
    jnp.bool_(False),
  )


def _close(
  inner: _Inner,
  use_grad_mean: bool,
  next_loss_scale: Any,
  accum: state_lib.AccumState,
  inner_state: Any,
  params: Any,
  scaler: DynamicLossScale | None,
) -> _Closed:
  """Closes the window with ``apply_window``'s kernel (``window.close``):
  applies it if valid, and starts the next one.

  An invalid window (non-finite or empty) does not reach the inner
  optimizer at all: a conditional, not a 0/1 product (0 * NaN = NaN) nor a
  select (which would make XLA copy the inner state). The window's validity
  comes from its sums, read in place.
  """
  (upd, new_inner, upd_ok), _, new, out = window.close(
    accum,
    (inner_state, params),
    functools.partial(_apply_window, inner, accum.grads),
    functools.partial(_skip_window, inner),
    next_loss_scale=next_loss_scale,
    mean=use_grad_mean,
  )
  nonempty = out.weight > 0
  if scaler is not None:
    # GradScaler's rule once per consumed window (an empty one stays open
    # and is not a step); the next window starts at the new scale.
    adjusted = scaler.adjust(out.finite)
    scaler = jax.tree.map(
      lambda a, b: jnp.where(nonempty, a, b), adjusted, scaler
    )
    next_loss_scale = scaler.scale
  # As finish_mean, an empty window keeps its counters, but it takes the
  # next loss scale: its buffers are zero, so that is exact, and the
  # caller's next microbatches are scaled by it.
  counters = new.replace(
    grads=None, loss_scale=_finish.next_scale(accum, next_loss_scale)
  )
  return _Closed(
    carrier=upd,
    inner_state=new_inner,
    counters=counters,
    applied=upd_ok,
    nonfinite=nonempty & ~upd_ok,
    consumed=nonempty,
    empty=~nonempty,
    scaler=scaler,
  )


def _stay_open(
  inner: _Inner,
  accum: state_lib.AccumState,
  inner_state: Any,
  params: Any,
  scaler: DynamicLossScale | None,
) -> _Closed:
  del params
  f = jnp.bool_(False)
  carrier = accum.grads if inner.carry else _zero_updates(inner.shapes)
  return _Closed(
    carrier=carrier,
    inner_state=inner_state,
    counters=accum.replace(grads=None),
    applied=f,
    nonfinite=f,
    consumed=f,
    empty=f,
    scaler=scaler,
  )


def _outputs(closed: _Closed, inner: _Inner, buffers: Any) -> tuple[Any, Any]:
  """The returned updates and the next window's buffers."""
  if inner.carry:
    # ``closed.carrier`` holds the applied window's updates, or the buffers.
    # Selects, not conditionals: XLA schedules them after the caller's read
    # of the updates and writes the buffers in place (a conditional here
    # would make it copy the buffers first).
    updates = jax.tree.map(
      lambda c, s: jnp.where(closed.applied, c, jnp.zeros((), c.dtype)).astype(
        s.dtype
      ),
      closed.carrier,
      inner.shapes,
    )
    buffers = jax.tree.map(
      lambda c: jnp.where(closed.consumed, jnp.zeros((), c.dtype), c),
      closed.carrier,
    )
    return updates, buffers
  # Zeroing the consumed window's buffers in a conditional of its own (its
  # predicate comes out of the one above, so it runs after the buffers were
  # read) lets XLA update them in place.
  buffers = lax.cond(
    closed.consumed,
    lambda b: jax.tree.map(jnp.zeros_like, b),
    lambda b: b,
    buffers,
  )
  updates = jax.tree.map(
    lambda u: jnp.where(closed.applied, u, jnp.zeros((), u.dtype)),
    closed.carrier,
  )
  return updates, buffers


def _next_state(
  state: WeightedMultiStepsState,
  closed: _Closed,
  buffers: Any,
  closing: jax.Array,
  mini_step: jax.Array,
  skip: jax.Array | None,
  skip_state: Any,
) -> WeightedMultiStepsState:
  one = jnp.int32(1)
  count = lambda flag: jnp.where(flag, one, 0)
  skipped = state.skipped if skip is None else state.skipped + count(skip)
  return WeightedMultiStepsState(
    mini_step=jnp.where(closing, 0, mini_step).astype(jnp.int32),
    gradient_step=state.gradient_step + count(closed.applied),
    inner_opt_state=closed.inner_state,
    acc_grads=buffers,
    skip_state=skip_state,
    window=closed.counters,
    updated=closed.applied,
    nonfinite=closed.nonfinite,
    nonfinite_windows=state.nonfinite_windows + count(closed.nonfinite),
    empty_windows=state.empty_windows + count(closed.empty),
    skipped=skipped,
    loss_scaler=closed.scaler,
  )


def _init(cfg: _Config, params: Any) -> WeightedMultiStepsState:
  scaler = (
    cfg.loss_scale if isinstance(cfg.loss_scale, DynamicLossScale) else None
  )
  if scaler is not None:
    # Fresh arrays: a donated state must not hold one buffer twice.
    scaler = jax.tree.map(lambda x: jnp.array(x, copy=True), scaler)
  accum = state_lib.init(
    params,
    dtype=cfg.dtype,
    loss_scale=(
      cfg.loss_scale if scaler is None else jnp.array(scaler.scale, copy=True)
    ),
  )
  # A distinct array per field: a donated state must not hold one buffer
  # twice.
  count = lambda: jnp.zeros((), jnp.int32)
  skip_state = ()
  if cfg.should_skip is not None:
    _, skip_state = cfg.should_skip(
      optax.tree.zeros_like(params), count(), params
    )
  # Scalars committed like the params (the inner state's too), as a jitted
  # step returns them: else its second call compiles again (_placement).
  return _placement.commit_like(
    WeightedMultiStepsState(
      mini_step=count(),
      gradient_step=count(),
      inner_opt_state=cfg.inner.init(params),
      acc_grads=accum.grads,
      skip_state=skip_state,
      window=accum.replace(grads=None),
      updated=jnp.zeros((), jnp.bool_),
      nonfinite=jnp.zeros((), jnp.bool_),
      nonfinite_windows=count(),
      empty_windows=count(),
      skipped=count(),
      loss_scaler=scaler,
    ),
    params,
  )


def _update(
  cfg: _Config,
  grads: Any,
  state: WeightedMultiStepsState,
  params: Any = None,
  *,
  weight: Any,
  finish: Any = None,
  next_loss_scale: Any = None,
  **extra_args: Any,
) -> tuple[Any, WeightedMultiStepsState]:
  """One microbatch: accumulate, then close the window or keep it open."""
  finish = _check_finish(finish)
  if next_loss_scale is not None:
    if state.loss_scaler is not None:
      raise WeightedAccumulationError(
        "update(next_loss_scale=...): this transformation's loss scale is "
        "a DynamicLossScale, which sets each window's scale itself. Drop "
        "next_loss_scale, or construct it with a fixed loss_scale."
      )
    # The converted host value: a scale committed to another device must not
    # meet the buffers inside the kernel.
    next_loss_scale = errors.check_loss_scale(
      next_loss_scale, what="update(next_loss_scale=...)"
    )
  skip, skip_state = _should_skip(cfg, grads, state, params)
  accum = _accumulate(cfg, state.accum, grads, weight, skip)
  mini_step = state.mini_step + (1 if skip is None else _count_unless(skip))
  closing = _closes(cfg, finish, mini_step, state.gradient_step)
  inner = _plan_inner(cfg, state, grads, params, extra_args)
  # Mid-window the inner update is not computed: both branches of this
  # conditional pass the buffers and the inner state through untouched.
  closed = lax.cond(
    closing,
    functools.partial(_close, inner, cfg.use_grad_mean, next_loss_scale),
    functools.partial(_stay_open, inner),
    accum,
    state.inner_opt_state,
    params,
    state.loss_scaler,
  )
  updates, buffers = _outputs(closed, inner, accum.grads)
  return updates, _next_state(
    state, closed, buffers, closing, mini_step, skip, skip_state
  )


def _count_unless(flag: jax.Array) -> jax.Array:
  return jnp.where(flag, jnp.int32(0), jnp.int32(1))


class WeightedMultiSteps:
  """Weighted gradient accumulation in front of an optax optimizer.

  A drop-in for ``optax.MultiSteps`` (same constructor arguments, same state
  fields, same methods) whose ``update`` also takes each microbatch's weight
  (its effective item count: tokens, samples)::

      updates, state = tx.update(grads, state, params, weight=n_tokens)

  A window closes after ``every_k_schedule`` microbatches, or earlier when
  the call passes ``finish=True`` (a short last window of an epoch is
  normalised by its own weight). At a close the window's gradient
  ``sum grad(S) / sum n`` (:func:`weighted_accum.finish_mean`; with
  ``use_grad_mean=False`` the sum ``sum grad(S)``) goes through the inner
  optimizer once and its updates are returned. Mid-window the updates are
  zeros, the inner state is untouched and the inner update is not computed
  (``lax.cond``). With weight 1 on every microbatch it computes what
  ``optax.MultiSteps`` computes.

  A close with zero total weight (every microbatch fully masked) applies
  nothing, does not advance the inner optimizer and is not lost: the window
  stays open and its counters carry into the next one. A close whose pending
  gradients hold NaN/Inf (a float16 loss-scale overflow) applies nothing,
  does not advance the inner optimizer, sets ``state.nonfinite`` and
  discards the window, so the next window starts clean. A close whose inner
  updates come out NaN/Inf applies nothing and is flagged the same way (the
  inner state has taken that step). ``state.gradient_step`` counts applied
  windows.

  Args:
    opt: the optimizer to apply once per window (any optax transform; extra
      keyword arguments of ``update`` are forwarded to it at a close).
    every_k_schedule: microbatches per window: a Python int in [1, 2**31),
      a function of ``state.gradient_step`` returning it (traced: a
      schedule never recompiles; a value below 1 closes every microbatch),
      or ``None`` to close windows only with ``finish=True``.
    use_grad_mean: ``True`` hands the inner optimizer the window's weighted
      mean gradient; ``False`` its weighted SUM (divided by the loss scale,
      not by the total weight), like optax's sum.
    should_skip_update_fn: optax's ``(updates, gradient_step, params) ->
      (should_skip, skip_state)`` (e.g. ``optax.skip_not_finite``): a
      microbatch it skips adds nothing and does not count towards the
      window (``state.skipped`` counts it); the rest of the window is kept.
      Its ``skip_state`` is stored in ``state.skip_state``.
    accumulator_dtype: the work dtype of the accumulation buffers.
    mode: ``"mean"`` when the grads are of each microbatch's loss MEAN
      (``sum(w * l) / weight``), ``"sum"`` when they are of its loss SUM.
    loss_scale: the factor every loss of a window is multiplied by (for
      float16 training); divided out once at the close. A number (change it
      per window with ``update(..., next_loss_scale=...)``) or a
      :class:`~weighted_accum.DynamicLossScale`: then at each close of a
      non-empty window it adjusts once by GradScaler's rule on the window's
      finiteness (a non-finite window is skipped), and the next window
      starts at its new scale; ``window_counters(state)['loss_scale']`` is
      the scale to multiply the loss by.
    axis_name: inside ``jax.shard_map`` over a data axis, its name(s): then
      ``weight`` is this replica's own item count and each microbatch's sums
      and weights are summed over the axis before they are added, so the
      state stays identical on every replica (see
      :func:`weighted_multi_steps`). Leave it ``None`` under ``jax.jit``
      over sharded global arrays.

  Raises:
    WeightedAccumulationError: for an invalid argument, naming it.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> tx = wa.WeightedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    >>> state = tx.init(params)
    >>> for g, n in [({'w': jnp.array([1., 1.])}, 3),
    ...              ({'w': jnp.array([5., 1.])}, 1)]:
    ...   updates, state = tx.update(g, state, params, weight=n)
    ...   params = optax.apply_updates(params, updates)
    >>> params['w'].tolist(), bool(tx.has_updated(state))
    ([-1.0, -2.0], True)
  """

  def __init__(
    self,
    opt: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], Any] | None,
    use_grad_mean: bool = True,
    should_skip_update_fn: Callable[..., Any] | None = None,
    accumulator_dtype: Any = jnp.float32,
    *,
    mode: str = "mean",
    loss_scale: float | jax.Array = 1.0,
    axis_name: str | Sequence[str] | None = None,
  ):
    self._cfg = _config(
      "WeightedMultiSteps",
      "every_k_schedule",
      opt,
      every_k_schedule,
      use_grad_mean,
      should_skip_update_fn,
      accumulator_dtype,
      "accumulator_dtype",
      mode,
      loss_scale,
      axis_name,
    )

  @classmethod
  def _from_config(cls, cfg: _Config) -> WeightedMultiSteps:
    self = cls.__new__(cls)
    self._cfg = cfg
    return self

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer (with extra-args support), as in optax."""
    return self._cfg.inner

  def init(self, params: Any) -> WeightedMultiStepsState:
    """An empty window and the inner optimizer's initial state.

    Args:
      params: the params (any pytree of floating arrays).

    Returns:
      A :class:`WeightedMultiStepsState`.
    """
    return _init(self._cfg, params)

  def update(
    self,
    updates: Any,
    state: WeightedMultiStepsState,
    params: Any = None,
    *,
    weight: Any,
    finish: Any = None,
    next_loss_scale: Any = None,
    **extra_args: Any,
  ) -> tuple[Any, WeightedMultiStepsState]:
    """Accumulates one microbatch; applies the window when it closes.

    Args:
      updates: the microbatch's gradients (of its loss mean or sum, per
        ``mode``), a tree like the params in any floating dtype.
      state: the state from ``init`` or the previous call.
      params: the params (needed by some inner optimizers).
      weight: the microbatch's effective item count (a scalar; traced
        values never recompile).
      finish: a bool scalar (may be traced): close the window after this
        microbatch.
      next_loss_scale: the loss scale of the window after a close.
      **extra_args: forwarded to the inner optimizer at a close.

    Returns:
      ``(updates, new_state)``: the inner optimizer's updates at a close
      that applied a window, zeros otherwise, in the dtypes
      ``optax.MultiSteps`` returns.

    Raises:
      WeightedAccumulationError: for a grads tree that does not match the
        params (naming the leaf), a concrete invalid weight, or an invalid
        ``finish`` or ``next_loss_scale``.
    """
    return _update(
      self._cfg,
      updates,
      state,
      params,
      weight=weight,
      finish=finish,
      next_loss_scale=next_loss_scale,
      **extra_args,
    )

  def has_updated(self, state: WeightedMultiStepsState) -> jax.Array:
    """Whether the last ``update`` applied a window (see
    :func:`has_updated`)."""
    return has_updated(state)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This wrapper as an ``optax.GradientTransformationExtraArgs``."""
    return optax.GradientTransformationExtraArgs(self.init, self.update)


def weighted_multi_steps(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any] | None = None,
  *,
  mode: str = "mean",
  dtype: DTypeLike = jnp.float32,
  loss_scale: ArrayLike = 1.0,
  axis_name: str | Sequence[str] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Weighted gradient accumulation in front of an optax optimizer.

  The functional form of :class:`WeightedMultiSteps`: the same
  transformation as ``WeightedMultiSteps(inner, every_k, mode=mode,
  accumulator_dtype=dtype, loss_scale=loss_scale,
  axis_name=axis_name).gradient_transformation()``; see there for the
  window semantics.

      updates, state = tx.update(grads, state, params, weight=n_tokens)

  Args:
    inner: the optimizer to apply once per window (any optax transform; extra
      keyword arguments of ``update`` are forwarded to it at a close).
    every_k: microbatches per window (a Python int, or a function of
      ``state.gradient_step`` as optax's ``every_k_schedule``), or ``None``
      to close windows only with ``finish=True``.
    mode: ``"mean"`` when the grads are of each microbatch's loss MEAN
      (``sum(w * l) / weight``), ``"sum"`` when they are of its loss SUM.
    dtype: the work dtype of the accumulation buffers.
    loss_scale: the factor every loss of a window is multiplied by (for
      float16 training); divided out once at the close. A number (change it
      per window with ``update(..., next_loss_scale=...)``) or a
      :class:`~weighted_accum.DynamicLossScale`: then at each close of a
      non-empty window it adjusts once by GradScaler's rule on the window's
      finiteness (a non-finite window is skipped), and the next window
      starts at its new scale; ``window_counters(state)['loss_scale']`` is
      the scale to multiply the loss by.
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
    WeightedAccumulationError: for an invalid ``every_k``, ``mode``,
      ``dtype``, ``loss_scale`` or ``axis_name`` (naming it), and at
      ``update`` everything :func:`weighted_accum.accumulate_mean` raises
      (mismatched grads tree, concrete invalid weight) and an invalid
      ``finish``.

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
  cfg = _config(
    "weighted_multi_steps",
    "every_k",
    inner,
    every_k,
    True,
    None,
    dtype,
    "dtype",
    mode,
    loss_scale,
    axis_name,
  )
  return WeightedMultiSteps._from_config(cfg).gradient_transformation()  # pylint: disable=protected-access
