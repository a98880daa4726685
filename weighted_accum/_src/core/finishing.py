"""The closers' checks and kernels (the public closers are in
``parallel.functional``), on the one close path of ``core.window``."""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax

from weighted_accum._src import validation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError

_STATE_HINT = "Pass the window (an AccumState from wa.init or a finish)."


def _window(state: Any, what: str) -> AccumState:
  state = validation.instance(
    state, AccumState, what=f"{what}(state)", hint=_STATE_HINT
  )
  validation.one_device_set([("state.grads", state.grads)], what=what)
  return state


def one_window(state: AccumState, what: str) -> AccumState:
  """``state``, refused if it is a stacked per-replica window (its close
  needs the reduction over the replicas)."""
  if state.placement.kind == base.STACKED:
    raise WeightedAccumulationError(
      f"{what}(state): this window is stacked per replica over "
      f"{state.placement.axes} (wa.init(..., axis_name=...) outside "
      "shard_map), so its sums are per replica. Close it with "
      "wa.finish_mean(state) or wa.apply_window(...): one reduction of the "
      "replicas' sums."
    )
  return state


def _next_scale(state: AccumState, value: Any, what: str) -> Any:
  ls = validation.optional_loss_scale(
    value, what=f"{what}(next_loss_scale=...)", dtype=state.loss_scale.dtype
  )
  return shared_over_window(state, ls, f"{what}(next_loss_scale=...)")


def shared_over_window(state: AccumState, value: Any, what: str) -> Any:
  """``value``, refused if it varies over the data axes of a per-replica
  window (inside the ``shard_map`` of its axes)."""
  axes = state.placement.axes
  if state.placement.kind != base.GLOBAL and tree_utils.bound(axes):
    validation.shared(value, axes, what=what)
  return value


@functools.partial(jax.jit, static_argnames=("mean",))
def _finish_kernel(
  state: AccumState, next_loss_scale: jax.Array | None, mean: bool
) -> tuple[AccumulatedGradients, AccumState]:
  return window.finish(state, mean=mean, next_loss_scale=next_loss_scale)


def finish_global(state: AccumState, ls: Any, checked: bool):
  """``finish_mean`` of a window closed as a global one (no reduction)."""
  if checked and tree_utils.is_traced(state.weight_hi):
    weight = numerics.join(state.weight_hi, state.weight_lo)
    checkify.check(
      weight > 0,
      "finish_mean: the window's total weight is {w}, so there is no mean "
      "to take; the state was left unchanged and zero grads returned.",
      w=weight,
    )
  return _finish_kernel(state, ls, mean=True)


# ---------------------------------------------------------- apply_window --


def _mean_dtype(work: Any, param: Any) -> Any:
  """The mean's dtype: at least float32 and the param's."""
  return jnp.promote_types(numerics.compute_dtype(work), jnp.result_type(param))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _apply_window_kernel(
  tx: optax.GradientTransformation,
  state: AccumState,
  params: Any,
  opt_state: Any,
  next_loss_scale: jax.Array | None,
  axes: tuple[str, ...],
):
  def apply(grads, operands):
    params, opt_state = operands
    updates, new_opt_state = tx.update(grads, opt_state, params)
    # The optimizer's state keeps its dtypes (a wider mean must not widen
    # it: the donated state would no longer fit its buffers).
    new_opt_state = tree_utils.cast_like(new_opt_state, opt_state)
    return optax.apply_updates(params, updates), new_opt_state

  (params, opt_state), zero, state, out = window.close(
    state,
    (params, opt_state),
    apply,
    lambda sums, operands: operands,
    next_loss_scale=next_loss_scale,
    axes=axes,
    dtypes=[_mean_dtype(state.dtype, p) for p in jax.tree.leaves(params)],
  )
  return params, opt_state, window.refill(state, zero), out


def _check_result(out, params, next_loss_scale) -> None:
  """An in-step result checked as ``apply_window``'s window."""
  what = "apply_window(state)"
  for name, value in (("next_loss_scale", next_loss_scale),):
    if value is not None:
      raise WeightedAccumulationError(
        f"apply_window({name}=...): state is an in-step result "
        "(AccumulatedGradients), whose window is closed and reduced "
        "already; drop the argument (set an in-step call's loss scale with "
        "its loss_scale=)."
      )
  if out.kind != "mean":
    raise WeightedAccumulationError(
      f"{what}: this is finish_sums' result (still loss-scaled sums, not "
      "a mean). Pass the window itself, or finish_mean's out."
    )
  if out.grads is None:
    raise WeightedAccumulationError(
      f"{what}: this AccumulatedGradients has no gradients (apply_window's "
      "own result: its mean went to tx). Pass the out of "
      "microbatched_value_and_grad, or the window (an AccumState)."
    )
  _result_grads(out, params)
  if jnp.shape(out.valid) != () or jnp.result_type(out.valid) != jnp.bool_:
    raise WeightedAccumulationError(
      f"{what}: out.valid must be a bool scalar (got "
      f"{jnp.result_type(out.valid)}{list(jnp.shape(out.valid))}); pass the "
      "out of microbatched_value_and_grad unchanged."
    )


def _trained(params: Any) -> Any:
  """``params`` with ``None`` where an in-step call holds a leaf fixed."""

  def arr(x):
    ok = isinstance(x, (jax.Array, np.ndarray, np.generic))
    return ok and jnp.issubdtype(x.dtype, jnp.floating)

  if any(map(arr, jax.tree.leaves(params))):
    return jax.tree.map(lambda x: x if arr(x) else None, params)
  return jax.tree.map(lambda x: x if isinstance(x, float) else None, params)


def _result_grads(out: AccumulatedGradients, params: Any) -> Any:
  """``out.grads`` checked against ``params``, in their structure and dtype."""
  leaves = tree_utils.match_tree(  # nnx.Param-held or pure, either side
    tree_utils.unwrap_variables(params),
    tree_utils.unwrap_variables(out.grads),
    what="apply_window(state.grads)",
    ref_name="params",
  )
  like = jax.tree.leaves(params)
  return jax.tree.unflatten(
    jax.tree.structure(params),
    [g.astype(_mean_dtype(g.dtype, p)) for g, p in zip(leaves, like)],
  )


@functools.partial(jax.jit, static_argnums=0)
def _apply_result_kernel(tx, out, params, opt_state):
  """``tx`` applied to a valid in-step result (one ``lax.cond``)."""
  grads = _result_grads(out, params)

  def apply(operands):
    params, opt_state = operands
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_opt_state = tree_utils.cast_like(new_opt_state, opt_state)
    return optax.apply_updates(params, updates), new_opt_state

  return jax.lax.cond(
    jnp.asarray(out.valid), apply, lambda ops: ops, (params, opt_state)
  )


def _check_replicas(state: AccumState, params: Any, axes: tuple) -> None:
  """Refuses a per-replica window closed as if it were global."""
  for (path, b), p in zip(
    tree_utils.flat(state.grads), jax.tree.leaves(params)
  ):
    extra = tree_utils.varying_axes(b) - tree_utils.varying_axes(p) - set(axes)
    if extra:
      raise WeightedAccumulationError(
        f"apply_window(state): buffer {path} varies over mesh axes "
        f"{tuple(sorted(extra))} while its param does not: the window holds "
        "per-replica sums, but it was made as a global window. Make it "
        "with wa.init(params, axis_name=...) inside the shard_map, so that "
        "its close reduces the replicas' sums once."
      )


def apply_result(tx, out, params, opt_state, next_loss_scale):
  """``apply_window`` of a finished result (``AccumulatedGradients``)."""
  trained = _trained(params)  # an Equinox module's static half held
  _check_result(out, trained, next_loss_scale)
  p, o = _apply_result_kernel(tx, out, trained, opt_state)
  held = lambda new, old: old if new is None else new
  p = jax.tree.map(held, p, params, is_leaf=lambda x: x is None)
  return p, o, None, out


def apply_global(tx, state, params, opt_state, ls, axes):
  """``apply_window`` of a global or per-replica window (reduced over
  ``axes``) on the one close path."""
  tree_utils.match_tree(
    state.grads,
    params,
    what="apply_window(params)",
    ref_name="the accumulator's buffers",
  )
  _check_replicas(state, params, axes)
  return _apply_window_kernel(tx, state, params, opt_state, ls, axes)
