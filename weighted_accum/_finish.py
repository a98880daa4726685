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
from weighted_accum._arith import compute_dtype
from weighted_accum import _tree
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients

Axes = tuple[str, ...]


def divide(sums: Any, loss_scale: jax.Array, weight: jax.Array, *,
           wide: bool = False) -> Any:
  """``(sums / loss_scale) / weight`` per leaf; zeros where ``weight <= 0``.

  Sequential division in at least float32, never by ``loss_scale * weight``
  (which can overflow float16). Each result leaf has its sum's dtype, or with
  ``wide`` the compute dtype (at least float32: when ``weight * loss_scale <
  1`` the mean can exceed float16's range although the sums do not).
  """
  ok = weight > 0

  def one(b):
    ct = compute_dtype(b.dtype)
    g = (b.astype(ct) / loss_scale.astype(ct)) / weight.astype(ct)
    g = jnp.where(ok, g, jnp.zeros((), ct))
    return g if wide else g.astype(b.dtype)

  return jax.tree.map(one, sums)


def next_scale(state: AccumState, next_loss_scale: Any) -> jax.Array:
  """The next window's loss scale: ``next_loss_scale``, or the current one
  when it is ``None`` or (traced, so it cannot raise) not finite positive."""
  if next_loss_scale is None:
    return state.loss_scale
  ls = jnp.asarray(next_loss_scale, jnp.float32)
  return jnp.where(jnp.isfinite(ls) & (ls > 0), ls, state.loss_scale)


def next_window(state: AccumState, next_loss_scale: Any = None, *,
                keep: jax.Array | None = None) -> AccumState:
  """An empty window after ``state`` on fresh zero buffers (each on its
  buffer's sharding), its counters as the table's ``at_finish`` says.

  Where ``keep`` is true the counters stay ``state``'s instead: a window of
  zero total weight is not consumed, and its buffers are all zero, so the
  fresh zeros are its own buffers (``docs/design.md``, "State").
  """
  counters = _counters.at_finish(state, next_scale(state, next_loss_scale))
  if keep is not None:
    old = _counters.of(state)
    counters = {k: jnp.where(keep, old[k], v) for k, v in counters.items()}
  return state.replace(grads=jax.tree.map(_tree.zeros_like, state.grads),
                       **counters)


def _check_scale_shared(loss_scale: jax.Array, axes: Axes, what: str) -> None:
  if set(axes) & _tree.varying_axes(loss_scale):
    raise WeightedAccumulationError(
        f"{what}: the loss scale varies over {axes}; every replica must use "
        "the same loss scale for a window. Pass it in with P() (unvarying).")


def _leaf_axes(x: Any, axes: Axes, vma_on: bool) -> Axes:
  """The axes to sum a leaf over: those it varies over (an unvarying leaf is
  identical on every replica, i.e. already global)."""
  if not vma_on:
    return axes
  return tuple(a for a in axes if a in _tree.varying_axes(x))


def psum_window(sums: Any, scalars: dict[str, Any], axes: Axes, *,
                vma_on: bool) -> tuple[Any, dict[str, jax.Array]]:
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
  values = [jnp.asarray(scalars[k], jnp.float32) for k in names]
  full = groups.pop(axes, [])
  red, values = jax.lax.psum(([leaves[i] for i in full], values), axes)
  out = list(leaves)
  for i, v in zip(full, red):
    out[i] = v
  for ax, idx in groups.items():
    for i, v in zip(idx, jax.lax.psum([leaves[i] for i in idx], ax)):
      out[i] = v
  return jax.tree.unflatten(treedef, out), dict(zip(names, values))


def result(sums: Any, weight: jax.Array, loss_scale: jax.Array,
           issued: jax.Array, *, mean: bool,
           require_weight: bool) -> AccumulatedGradients:
  """What a finish returns, from the (global) sums and weight.

  ``mean``: the grads are :func:`divide`'s, and ``finite`` is read on them
  (read after they are written in place: checking the donated sums instead
  would make XLA copy them first). Else the grads are the sums themselves,
  ``finite`` read on them in place. ``valid`` is ``finite``, and with
  ``require_weight`` a positive ``weight``.
  """
  grads = divide(sums, loss_scale, weight) if mean else sums
  finite = _tree.all_finite(grads)
  valid = finite & (weight > 0) if require_weight else finite
  return AccumulatedGradients(
      grads=grads, weight=weight, loss_scale=jnp.asarray(loss_scale),
      issued=jnp.asarray(issued).astype(jnp.int32), finite=finite,
      valid=valid)


def finish(state: AccumState, *, mean: bool, keep_empty: bool | None = None,
           next_loss_scale: Any = None, axes: Axes = (),
           vma_on: bool | None = None, what: str = "finish"
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
  unchanged; a traced invalid one keeps the current), and with
  ``keep_empty`` the counters kept when the total weight is 0.

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
  weight = (jnp.asarray(scalars["weight_hi"], jnp.float32)
            + jnp.asarray(scalars["weight_lo"], jnp.float32))
  out = result(sums, weight, state.loss_scale, scalars["issued"], mean=mean,
               require_weight=keep_empty)
  keep = ~(weight > 0) if keep_empty else None
  new_state = next_window(state, next_loss_scale, keep=keep)
  if axes:
    new_state = jax.tree.map(lambda r, s: _tree.vary_like(r, s, axes),
                             new_state, state)
  return out, new_state


def reduce_finished(out: AccumulatedGradients, axes: Axes, *,
                    vma_on: bool | None = None,
                    what: str = "reduce_sums") -> AccumulatedGradients:
  """The global mean from one replica's ``finish(state, mean=False)``
  result: the same collective round and division as ``finish`` with
  ``axes`` and ``mean=True`` (no state to reset)."""
  vma_on = _tree.vma_checked(axes) if vma_on is None else vma_on
  if vma_on:
    _check_scale_shared(out.loss_scale, axes, what)
  sums, scalars = psum_window(out.grads, {"weight": out.weight,
                                          "issued": out.issued}, axes,
                              vma_on=vma_on)
  return result(sums, scalars["weight"],
                jnp.asarray(out.loss_scale, jnp.float32), scalars["issued"],
                mean=True, require_weight=True)
