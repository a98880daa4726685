"""The one path that finishes a window: ``finish`` (and its ``divide`` step).

``core.finish_sums``/``finish_mean``, ``distributed.finish_mean``/
``reduce_sums`` and the optax wrapper's close all call it; see
``docs/design.md`` ("Finishing a window") for why it is shaped so.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from weighted_accum import _counters
from weighted_accum import _inputs
from weighted_accum import _tree
from weighted_accum._arith import compute_dtype
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients

Axes = tuple[str, ...]


def divide(
  sums: Any,
  loss_scale: jax.Array,
  weight: jax.Array,
  *,
  wide: bool = False,
  mark_nonfinite: bool = False,
  usable: bool = False,
) -> Any:
  """``(sums / loss_scale) / weight`` per leaf; zeros where ``weight <= 0``.

  Sequential division in at least float32, never by ``loss_scale * weight``
  (which can overflow float16). Each result leaf has its sum's dtype, or with
  ``wide`` the compute dtype (at least float32: when ``weight * loss_scale <
  1`` the mean can exceed float16's range although the sums do not). Zeros
  too where the weight is not finite (a psum of weights that overflowed) or
  the loss scale is unusable (NaN marks a window given an invalid traced
  scale): nothing is divided by them. With ``mark_nonfinite`` the result is
  NaN where the sum was NaN or Inf, so that the result alone tells a
  non-finite pending value (NaN) from an overflow of the mean (Inf): see
  :func:`result`. ``usable=True`` skips that masking where the caller
  already knows the divisors are usable (inside a ``lax.cond`` on a valid
  window): XLA would otherwise copy the scalar check into every leaf's
  fused loop, tripling the instructions it compiles there.
  """
  ok = True if usable else usable_divisors(loss_scale, weight)

  def one(b):
    ct = compute_dtype(b.dtype)
    g = (b.astype(ct) / loss_scale.astype(ct)) / weight.astype(ct)
    if not usable:
      g = jnp.where(ok, g, jnp.zeros((), ct))
    if mark_nonfinite:
      g = jnp.where(jnp.isfinite(b), g, jnp.asarray(jnp.nan, ct))
    return g if wide else g.astype(b.dtype)

  return jax.tree.map(one, sums)


def usable_divisors(loss_scale: jax.Array, weight: jax.Array) -> jax.Array:
  """A positive finite weight and a usable (finite, positive, normal) loss
  scale: what a division needs to mean anything."""
  return (
    (weight > 0)
    & jnp.isfinite(weight)
    & _inputs.scale_ok(jnp.asarray(loss_scale))
  )


def next_scale(state: AccumState, next_loss_scale: Any) -> jax.Array:
  """The next window's loss scale: the current one when ``None``, else
  ``next_loss_scale`` converted by ``_inputs.loss_scale``. A traced invalid
  one (negative, zero, NaN, Inf, flushed to zero in float32) becomes NaN,
  which marks the next window unusable: its microbatches are rejected and
  counted, its finish is invalid, until a valid ``next_loss_scale`` is given
  (``docs/inputs.md``). Keeping the current scale instead would divide grads
  scaled by the caller's factor by another one: a sign flip, reported
  valid."""
  if next_loss_scale is None:
    return state.loss_scale
  return jnp.asarray(
    _inputs.loss_scale(
      next_loss_scale,
      what="finish(next_loss_scale=...)",
      dtype=state.loss_scale.dtype,
    )
  )


def next_window(
  state: AccumState,
  next_loss_scale: Any = None,
  *,
  keep: jax.Array | None = None,
) -> AccumState:
  """An empty window after ``state`` on fresh zero buffers (each on its
  buffer's sharding), its counters as the table's ``at_finish`` says.

  Where ``keep`` is true the counters stay ``state``'s instead: a window of
  zero total weight is not consumed, and its buffers are all zero, so the
  fresh zeros are its own buffers (``docs/design.md``, "State").
  """
  counters = _counters.at_finish(state, next_scale(state, next_loss_scale))
  if keep is not None:
    # The next loss scale applies to a kept window too: it holds no scaled
    # value (its buffers are zero), and dropping the scale would divide the
    # caller's next microbatches by the wrong factor.
    old = _counters.of(state)
    counters = {
      k: v if k == "loss_scale" else jnp.where(keep, old[k], v)
      for k, v in counters.items()
    }
  return state.replace(
    grads=jax.tree.map(_tree.zeros_like, state.grads), **counters
  )


def _check_scale_shared(loss_scale: jax.Array, axes: Axes, what: str) -> None:
  if set(axes) & _tree.varying_axes(loss_scale):
    raise WeightedAccumulationError(
      f"{what}: the loss scale varies over {axes}; every replica must use "
      "the same loss scale for a window. Pass it in with P() (unvarying)."
    )


def _leaf_axes(x: Any, axes: Axes, vma_on: bool) -> Axes:
  """The axes to sum a leaf over: those it varies over (an unvarying leaf is
  identical on every replica, i.e. already global)."""
  if not vma_on:
    return axes
  return tuple(a for a in axes if a in _tree.varying_axes(x))


def psum_window(
  sums: Any, scalars: dict[str, Any], axes: Axes, *, vma_on: bool
) -> tuple[Any, dict[str, jax.Array]]:
  """One collective round: the sums (each over the axes it varies over)
  together with the per-replica ``scalars`` (always summed, as float32,
  exact for integers below 2**24).

  Returns:
    The global sums and the summed scalars (float32), by name.
  """
  leaves, treedef = jax.tree.flatten(sums)
  groups: dict[Axes, list[int]] = {}
  for i, x in enumerate(leaves):
    ax = _leaf_axes(x, axes, vma_on)
    if ax:
      groups.setdefault(ax, []).append(i)
  names = list(scalars)
  # Counts as float32; a float64 weight pair (float64 work dtype) stays so.
  values = [
    jnp.asarray(scalars[k]).astype(
      jnp.promote_types(jnp.asarray(scalars[k]).dtype, jnp.float32)
    )
    for k in names
  ]
  full = groups.pop(axes, [])
  red, values = jax.lax.psum(([leaves[i] for i in full], values), axes)
  out = list(leaves)
  for i, v in zip(full, red):
    out[i] = v
  for ax, idx in groups.items():
    for i, v in zip(idx, jax.lax.psum([leaves[i] for i in idx], ax)):
      out[i] = v
  return jax.tree.unflatten(treedef, out), dict(zip(names, values))


def result(
  sums: Any,
  weight: jax.Array,
  loss_scale: jax.Array,
  issued: jax.Array,
  *,
  mean: bool,
  require_weight: bool,
) -> AccumulatedGradients:
  """What a finish returns, from the (global) sums and weight.

  ``finite`` says every PENDING sum is finite: what a dynamic loss scaler
  reacts to (a mean that overflows float16 because ``weight * loss_scale <
  1`` is no reason to lower the scale). ``valid`` is ``finite``, a usable
  loss scale, with ``require_weight`` a positive finite ``weight``, and with
  ``mean`` a result that is finite in the work dtype.

  Both flags come from one max-magnitude reduction read AFTER the result is
  written (reading the donated sums before would make XLA copy them): with
  ``mean`` the result is NaN exactly where a sum was non-finite
  (``divide(..., mark_nonfinite=True)``), so a NaN maximum is a non-finite
  pending value and an infinite one an overflow of the mean.
  """
  usable = _inputs.scale_ok(jnp.asarray(loss_scale))
  if require_weight:
    usable = usable & usable_divisors(loss_scale, weight)
  if mean:
    grads = divide(sums, loss_scale, weight, mark_nonfinite=True)
    peaks = [_tree.peak(g) for g in jax.tree.leaves(grads)]
    finite = _tree.all_of(~jnp.isnan(p) for p in peaks)
    usable = usable & _tree.all_of(jnp.isfinite(p) for p in peaks)
  else:
    grads = sums
    finite = _tree.all_finite(grads)
  valid = finite & usable
  return AccumulatedGradients(
    grads=grads,
    weight=weight,
    loss_scale=jnp.asarray(loss_scale),
    issued=jnp.asarray(issued).astype(jnp.int32),
    finite=finite,
    valid=valid,
  )


def finish(
  state: AccumState,
  *,
  mean: bool,
  keep_empty: bool | None = None,
  next_loss_scale: Any = None,
  axes: Axes = (),
  vma_on: bool | None = None,
  what: str = "finish",
) -> tuple[AccumulatedGradients, AccumState]:
  """Finishes ``state``'s window: the one finish path of the library.

  Pure and traceable (no Python value checks: callers validate concrete
  inputs first); call it under ``jit``, inside ``shard_map`` (with ``axes``),
  inside a ``lax.cond`` branch or a ``lax.scan`` body.

  Steps: (1) with ``axes``, one ``psum`` of the buffers together with the
  table's ``SUMMED`` counters (weight pair, ``issued``); (2) the result
  (:func:`result`): the sums, or with ``mean`` the sums divided by the loss
  scale then by the total weight; (3) the next window (:func:`next_window`):
  zero buffers, counters reset, loss scale ``next_loss_scale`` (default:
  unchanged; a traced invalid one is NaN, see :func:`next_scale`), and with
  ``keep_empty`` the counters but the loss scale kept when the total weight
  is 0.

  Args:
    state: the window (per replica when ``axes`` are given).
    mean: divide (``finish_mean``) or return the still-scaled sums
      (``finish_sums``). To divide later, e.g. fused into an optimizer
      update inside a ``lax.cond(out.valid, ...)`` (the wrapper's close,
      ``apply_window``), pass ``mean=False, keep_empty=True`` and call
      ``divide(out.grads, out.loss_scale, out.weight, wide=True)`` there.
    keep_empty: keep the counters of a zero-weight window and require a
      positive weight in ``out.valid`` (default: ``mean``).
    next_loss_scale: the next window's loss scale.
    axes: the mesh axes to reduce over (inside ``shard_map``), or ``()``.
    vma_on: whether ``shard_map`` tracks varying types (else every buffer
      is summed over every axis); default: read from the axes.
    what: how to name the caller in errors.

  Returns:
    ``(out, new_state)``: ``out.grads`` the sums or the mean (work dtype),
    ``out.weight`` the (global) total weight (float32), ``out.issued`` the
    (global) microbatch count, ``out.finite``, ``out.valid``; every leaf of
    ``new_state`` keeps ``state``'s varying type, so it may be a
    ``lax.scan`` carry.

  Raises:
    WeightedAccumulationError: with ``axes``, for a loss scale varying over
      them.
  """
  keep_empty = mean if keep_empty is None else keep_empty
  sums = state.grads
  scalars = {k: getattr(state, k) for k in _counters.named(_counters.SUMMED)}
  if axes:
    vma_on = _tree.vma_checked(axes) if vma_on is None else vma_on
    if vma_on:
      _check_scale_shared(state.loss_scale, axes, what)
    sums, scalars = psum_window(sums, scalars, axes, vma_on=vma_on)
  # In the tally's dtype: float32, or float64 for a float64 work dtype.
  weight = jnp.asarray(scalars["weight_hi"]) + jnp.asarray(scalars["weight_lo"])
  out = result(
    sums,
    weight,
    state.loss_scale,
    scalars["issued"],
    mean=mean,
    require_weight=keep_empty,
  )
  keep = ~(weight > 0) if keep_empty else None
  new_state = next_window(state, next_loss_scale, keep=keep)
  if axes:
    new_state = jax.tree.map(
      lambda r, s: _tree.vary_like(r, s, axes), new_state, state
    )
  return out, new_state


def reduce_finished(
  out: AccumulatedGradients,
  axes: Axes,
  *,
  vma_on: bool | None = None,
  what: str = "reduce_sums",
) -> AccumulatedGradients:
  """The global mean from one replica's ``finish(state, mean=False)``
  result: the same collective round and division as ``finish`` with
  ``axes`` and ``mean=True`` (no state to reset)."""
  vma_on = _tree.vma_checked(axes) if vma_on is None else vma_on
  if vma_on:
    _check_scale_shared(out.loss_scale, axes, what)
  sums, scalars = psum_window(
    out.grads, {"weight": out.weight, "issued": out.issued}, axes, vma_on=vma_on
  )
  return result(
    sums,
    scalars["weight"],
    jnp.asarray(out.loss_scale, jnp.float32),
    scalars["issued"],
    mean=True,
    require_weight=True,
  )
