"""The accumulation functions: ``accumulate_sum``, ``accumulate_mean``,
``finish_sums`` and ``finish_mean``.

Each public function validates structure (and concrete values) in Python, then
runs a jitted kernel. Called inside the caller's ``jax.jit`` the kernel inlines,
so under ``donate_argnums`` every buffer is updated in place: accumulate reads
the buffer and the grads and writes the buffer, nothing more; finish writes
its result into the donated buffers and starts the next window on fresh zeros.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from weighted_accum import _inputs
from weighted_accum import errors
from weighted_accum import tally
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients
from weighted_accum.state import zeros_like


def compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """Arithmetic precision for scaling: at least float32 (no float16 overflow)."""
  return jnp.promote_types(dtype, jnp.float32)


def mean_contribution(g: jax.Array, weight: jax.Array,
                      dtype: jnp.dtype) -> jax.Array:
  """``cast(g, dtype) * weight``: converted first, multiplied in >= float32."""
  return (g.astype(dtype).astype(compute_dtype(dtype)) * weight).astype(dtype)


def normalise(sums: Any, loss_scale: jax.Array, weight: jax.Array
              ) -> tuple[Any, jax.Array, jax.Array]:
  """``(sums / loss_scale) / weight`` per leaf, and two flags.

  Sequential division in at least float32, never by ``loss_scale * weight``
  (which can overflow float16); the result is in each leaf's dtype. Where
  ``weight`` is not positive the grads are zeros.

  Returns:
    ``(grads, finite, usable)``: ``finite`` says every PENDING sum is finite
    (what a dynamic loss scaler reacts to: a mean that overflows float16
    because ``weight * loss_scale < 1`` is no reason to lower the scale);
    ``usable`` says the result is finite in its dtype, the weight positive
    and the loss scale a usable one, so ``valid = finite & usable``. Both
    come from one max-magnitude reduction of the sums: division by a
    positive number and rounding are monotone, so the largest result is the
    largest sum's.

  Shared by :func:`finish_mean` and :mod:`weighted_accum.distributed`.
  """
  # A global weight that overflowed (a psum of per-replica weights) must not
  # give the zero grads of a division by inf, reported valid.
  ok = (weight > 0) & jnp.isfinite(weight) & _inputs.scale_ok(loss_scale)
  leaves = jax.tree.leaves(sums)
  peaks = [_peak(b) for b in leaves]

  def divide(b):
    ct = compute_dtype(b.dtype)
    g = (b.astype(ct) / loss_scale.astype(ct)) / weight.astype(ct)
    return jnp.where(ok, g, jnp.zeros((), ct)).astype(b.dtype)

  grads = jax.tree.map(divide, sums)
  fits = [jnp.isfinite(divide(p.astype(b.dtype))) | ~jnp.isfinite(p)
          for p, b in zip(peaks, leaves)]
  finite = _all(jnp.isfinite(p) for p in peaks)
  return grads, finite, ok & _all(fits)


def _peak(x: jax.Array) -> jax.Array:
  """``max(|x|)`` in at least float32 (NaN if any is NaN; 0 if empty): one
  fused read of ``x``, which XLA:CPU orders before an in-place write."""
  ct = compute_dtype(x.dtype)
  return jnp.max(jnp.abs(x.astype(ct)), initial=jnp.zeros((), ct))


def _all(flags: Any) -> jax.Array:
  flags = list(flags)
  return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def _check_inputs(state: AccumState, grads: Any, weight: Any,
                  name: str) -> tuple[list[Any], _inputs.Weight]:
  """Structural checks of one microbatch; returns the grads' leaves and the
  weight converted to the state's tally dtype."""
  leaves = errors.match_tree(state.grads, grads, what=f"{name}(grads)")
  named = list(zip(errors.leaf_paths(state.grads), leaves))
  errors.check_leaves_floating(named, what=f"{name}(grads)")
  w = errors.check_weight(weight, what=f"{name}(weight)",
                          tally=state.weight_hi.dtype)
  errors.check_not_reduced_against_weight(named, weight,
                                          what=f"{name}(grads)")
  check_room(state, w, name)
  return leaves, w


def check_room(state: AccumState, w: _inputs.Weight, name: str) -> None:
  """Eagerly refuses a microbatch the state cannot record (the jitted kernel
  rejects it instead): a poisoned loss scale, a full ``issued`` counter, or a
  total weight that would overflow the tally."""
  values = (state.loss_scale, state.issued, state.weight_hi, state.weight_lo,
            w.hi, w.lo)
  if any(errors.is_traced(v) for v in values):
    return
  ls = float(np.asarray(state.loss_scale))
  if not (math.isfinite(ls) and ls > 0):
    raise WeightedAccumulationError(
        f"{name}(state): the window's loss scale is {ls!r} (an invalid traced "
        "loss scale was given to init or as next_loss_scale), so its "
        "microbatches cannot be used. Start a window with a valid "
        "next_loss_scale (finish_sums(state, next_loss_scale=...)).")
  if int(state.issued) >= _inputs.INT32_MAX:
    raise WeightedAccumulationError(
        f"{name}(state): 'issued' is {int(state.issued)}, the most an int32 "
        "counter holds. Finish the window first.")
  total = state.total_weight + float(w.hi) + float(w.lo)
  if total > float(np.finfo(state.weight_hi.dtype).max):
    raise WeightedAccumulationError(
        f"{name}(weight): the window's total weight would become {total!r}, "
        f"beyond the {state.weight_hi.dtype} tally's range. Finish the window "
        "first, or scale all weights down by a common factor.")


@functools.partial(jax.jit, static_argnames=("mean",))
def _accumulate_kernel(state: AccumState, leaves: list[Any],
                       weight: _inputs.Weight, mean: bool) -> AccumState:
  hi, lo = tally.two_sum_add(state.weight_hi, state.weight_lo, weight.hi)
  hi, lo = tally.two_sum_add(hi, lo, weight.lo)
  # Rejected whole (and counted): an invalid weight, a window whose loss scale
  # is unusable, a total the tally cannot hold, a full counter.
  room = state.issued < _inputs.INT32_MAX
  valid = (weight.ok & _inputs.scale_ok(state.loss_scale) & jnp.isfinite(hi)
           & room)
  # weight.hi is zero or a normal number (subnormals were refused): the
  # comparison is the same in every fusion.
  take = valid & (weight.hi > 0)
  dt = state.dtype
  w = (weight.hi.astype(compute_dtype(dt)) + weight.lo.astype(
      compute_dtype(dt)))

  def update(buf, g):
    # Convert first (DESIGN §2), then scale.
    contrib = mean_contribution(g, w, dt) if mean else g.astype(dt)
    # A select, not a multiplication: a zero-weight or rejected microbatch
    # adds nothing even when its grads are NaN/Inf (0 * NaN would leak). Fuses
    # into one read-read-write loop per leaf.
    return buf + jnp.where(take, contrib, jnp.zeros((), dt))

  buf_leaves, treedef = jax.tree.flatten(state.grads)
  new_buffers = jax.tree.unflatten(
      treedef, [update(b, g) for b, g in zip(buf_leaves, leaves)])
  one = jnp.int32(1)
  return state.replace(
      grads=new_buffers,
      issued=state.issued + jnp.where(room, one, 0),
      zero_weight=state.zero_weight + jnp.where(valid & ~take, one, 0),
      rejected=state.rejected + jnp.where(valid | ~room, 0, one),
      weight_hi=jnp.where(take, hi, state.weight_hi),
      weight_lo=jnp.where(take, lo, state.weight_lo),
  )


def _accumulate(state: AccumState, grads: Any, weight: Any, *, mean: bool,
                checked: bool, name: str) -> AccumState:
  checked = _inputs.static_flag(checked, what=f"{name}(checked=...)")
  leaves, w = _check_inputs(state, grads, weight, name)
  if checked and errors.is_traced(weight):
    checkify.check(
        w.ok,
        name + ": weight {w} is not a finite non-negative item count the "
        "weight tally holds; the microbatch was rejected (state.rejected "
        "counts it).", w=jnp.asarray(weight).astype(jnp.float32))
  return _accumulate_kernel(state, _on_buffer_shardings(state, leaves),
                            w, mean=mean)


def _on_buffer_shardings(state: AccumState, leaves: list[Any]) -> list[Any]:
  """Eagerly, moves grads sharded unlike their buffers onto the buffers'
  shardings, so the result keeps the params' placement (under ``jit`` the
  partitioner decides; params and grads normally agree there)."""
  out = []
  for g, b in zip(leaves, jax.tree.leaves(state.grads)):
    if (isinstance(g, jax.Array) and isinstance(b, jax.Array)
        and not errors.is_traced(g) and not errors.is_traced(b)
        and not g.sharding.is_equivalent_to(b.sharding, b.ndim)):
      g = jax.device_put(g, b.sharding)
    out.append(g)
  return out


def accumulate_sum(state: AccumState, grads: Any, weight: Any, *,
                   checked: bool = False) -> AccumState:
  """Adds the gradients of a microbatch's loss SUM.

  ``buffer += cast(grads, work dtype)``; the window's weight grows by
  ``weight``. Use it when the loss was ``sum(w * l)`` over the microbatch
  (times the window's loss scale).

  Args:
    state: the window so far.
    grads: gradients of the summed loss: a tree with the params' leaf paths
      and shapes, in any floating dtype (float32, bfloat16, float16).
    weight: the microbatch's effective item count (tokens, samples), a
      scalar; may be fractional and traced (no recompilation per value). A
      weight of exactly 0 counts as issued and adds nothing, even if ``grads``
      holds NaN/Inf.
    checked: under ``jax.jit``, also emit a ``checkify`` check for an invalid
      weight, so that a ``checkify.checkify``-wrapped step reports it.

  Returns:
    The new state. Under ``jit`` an invalid (negative, NaN, infinite) weight
    rejects the microbatch whole: buffers and weight unchanged, ``issued`` and
    ``rejected`` incremented.

  Raises:
    WeightedAccumulationError: for a grads tree that does not match the
      buffers (naming the leaf path), or a concrete invalid weight.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.array([1.0, -1.0])}
    >>> loss_sum = lambda p, x: jnp.sum((x @ p['w']) ** 2)
    >>> x1, x2 = jnp.ones((3, 2)), 2 * jnp.ones((1, 2))
    >>> state = wa.init(params)
    >>> state = wa.accumulate_sum(state, jax.grad(loss_sum)(params, x1), 3)
    >>> state = wa.accumulate_sum(state, jax.grad(loss_sum)(params, x2), 1)
    >>> out, state = wa.finish_mean(state)
    >>> out.weight.item()
    4.0
  """
  return _accumulate(state, grads, weight, mean=False, checked=checked,
                     name="accumulate_sum")


def accumulate_mean(state: AccumState, grads: Any, weight: Any, *,
                    checked: bool = False) -> AccumState:
  """Adds the gradients of a microbatch's loss MEAN, weighted by its size.

  ``buffer += cast(grads, work dtype) * weight`` (multiplied after the
  conversion, in at least float32), so microbatches of unequal size are not
  averaged equally. Use it when the loss was ``sum(w * l) / weight``.

  Args:
    state: the window so far.
    grads: gradients of the mean loss (times the window's loss scale).
    weight: the effective item count the mean divided by; see
      :func:`accumulate_sum`.
    checked: see :func:`accumulate_sum`.

  Returns:
    The new state; see :func:`accumulate_sum`.

  Raises:
    WeightedAccumulationError: see :func:`accumulate_sum`.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(1)})
    >>> state = wa.accumulate_mean(state, {'w': jnp.array([1.0])}, 3)
    >>> state = wa.accumulate_mean(state, {'w': jnp.array([5.0])}, 1)
    >>> out, _ = wa.finish_mean(state)   # (3*1 + 1*5) / 4, not (1 + 5) / 2
    >>> out.grads['w'].item()
    2.0
  """
  return _accumulate(state, grads, weight, mean=True, checked=checked,
                     name="accumulate_mean")


def all_finite(tree: Any) -> jax.Array:
  """True when every value of ``tree`` is finite: one reduction per leaf.

  ``isfinite(max(|x|))`` instead of ``all(isfinite(x))``: XLA:CPU fuses a
  plain reduction into one read of ``x``, while the boolean form
  materialises a parameter-sized temporary. NaN and Inf propagate into the
  maximum, and unlike a sum it cannot overflow, so it is exact.
  """
  return _all(jnp.isfinite(_peak(x)) for x in jax.tree.leaves(tree))


def _reset(state: AccumState, next_loss_scale: jax.Array) -> AccumState:
  zi, zf = jnp.int32(0), jnp.float32(0)
  return state.replace(grads=jax.tree.map(zeros_like, state.grads), issued=zi, zero_weight=zi,
                       rejected=zi, weight_hi=zf, weight_lo=zf,
                       windows=state.windows + 1, loss_scale=next_loss_scale)


def keep_unless(consumed: jax.Array, reset: AccumState,
                state: AccumState) -> AccumState:
  """``reset``'s counters where ``consumed``, else ``state``'s; ``reset``'s
  buffers either way.

  How a finish leaves a window of zero total weight unchanged: its buffers
  are all zero (see :mod:`weighted_accum.state`), so the fresh zeros are
  its own buffers, and only the counters need the select.
  """
  counters = jax.tree.map(lambda r, s: jnp.where(consumed, r, s),
                          reset.replace(grads=None), state.replace(grads=None))
  # The next loss scale applies either way: a kept window holds no scaled
  # value (its buffers are zero), and dropping the scale would leave the
  # caller's next microbatches divided by the wrong factor.
  return counters.replace(grads=reset.grads, loss_scale=reset.loss_scale)


def _next_scale(state: AccumState, next_loss_scale: Any) -> jax.Array:
  if next_loss_scale is None:
    return state.loss_scale
  # Converted by next_loss_scale_of(): a traced invalid scale is NaN, which
  # marks the next window unusable (its microbatches are rejected and its
  # finish is invalid). Keeping the current scale instead would divide the
  # next window's grads, scaled by the caller's (invalid) factor, by another
  # one: a sign flip for a negative scale, reported valid.
  return jnp.asarray(next_loss_scale, state.loss_scale.dtype)


def next_loss_scale_of(state: AccumState, value: Any, what: str) -> Any:
  """The converted ``next_loss_scale`` of a finish (``None`` stays None)."""
  if value is None:
    return None
  return _inputs.loss_scale(value, what=f"{what}(next_loss_scale=...)",
                            dtype=state.loss_scale.dtype)


@jax.jit
def _finish_sums_kernel(state: AccumState, next_loss_scale: jax.Array | None):
  finite = all_finite(state.grads)
  out = AccumulatedGradients(
      grads=state.grads,
      weight=tally.join_traced(state.weight_hi, state.weight_lo),
      loss_scale=state.loss_scale, issued=state.issued, finite=finite,
      valid=finite & _inputs.scale_ok(state.loss_scale))
  return out, _reset(state, _next_scale(state, next_loss_scale))


def finish_sums(state: AccumState, *, next_loss_scale: Any = None
                ) -> tuple[AccumulatedGradients, AccumState]:
  """Returns the window's still-scaled sums and local weight, then resets.

  For data parallelism: reduce ``out.grads`` and ``out.weight`` across
  replicas (or use :mod:`weighted_accum.distributed`), then divide by
  ``out.loss_scale`` once and by the global weight. No communication happens
  here. An empty window gives zero sums and weight 0.

  Args:
    state: the window to finish.
    next_loss_scale: the next window's loss scale (default: unchanged).

  Returns:
    ``(out, new_state)``: the sums in ``out.grads`` (the buffers themselves,
    no copy), ``out.weight``, ``out.loss_scale``, ``out.finite``;
    ``new_state`` is an empty window on fresh zero buffers.

  Raises:
    WeightedAccumulationError: for a concrete invalid ``next_loss_scale``.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.accumulate_sum(wa.init({'w': jnp.zeros(1)}, loss_scale=4.0),
    ...                           {'w': jnp.array([8.0])}, 2)
    >>> out, state = wa.finish_sums(state)
    >>> (out.grads['w'] / out.loss_scale / out.weight).item(), int(state.issued)
    (1.0, 0)
  """
  next_loss_scale = next_loss_scale_of(state, next_loss_scale, "finish_sums")
  return _finish_sums_kernel(state, next_loss_scale)


@jax.jit
def _finish_mean_kernel(state: AccumState, next_loss_scale: jax.Array | None):
  weight = tally.join_traced(state.weight_hi, state.weight_lo)
  ok = weight > 0
  grads, finite, usable = normalise(state.grads, state.loss_scale, weight)
  out = AccumulatedGradients(grads=grads, weight=weight,
                             loss_scale=state.loss_scale, issued=state.issued,
                             finite=finite, valid=finite & usable)
  reset = _reset(state, _next_scale(state, next_loss_scale))
  return out, keep_unless(ok, reset, state)


def finish_mean(state: AccumState, *, next_loss_scale: Any = None,
                checked: bool = False
                ) -> tuple[AccumulatedGradients, AccumState]:
  """Divides the window's sums by the loss scale, then by its total weight.

  The result equals the gradient of the full batch's mean loss whatever the
  split into microbatches. Then the window resets.

  Args:
    state: the window to finish.
    next_loss_scale: the next window's loss scale (default: unchanged).
    checked: under ``jax.jit``, also emit a ``checkify`` check that the
      window's total weight is positive.

  Returns:
    ``(out, new_state)``. ``out.grads`` in the work dtype; ``out.finite`` is
    false if any pending value was NaN/Inf (skip the step); ``out.valid`` is
    ``finite`` and a positive weight. Under ``jit``, a window of zero total
    weight returns zero grads, ``valid == False`` and the state unchanged.

  Raises:
    WeightedAccumulationError: when a concrete window has zero total weight
      (nothing is cleared), or for a concrete invalid ``next_loss_scale``.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(1)}, dtype=jnp.float16,
    ...                 loss_scale=2.0**15)
    >>> g = {'w': jnp.array([2.0**15 * 1e-3], jnp.float16)}  # scaled mean grad
    >>> state = wa.accumulate_mean(state, g, 1000)           # 2**15 * 1000 > f16 max
    >>> out, state = wa.finish_mean(state)
    >>> round(out.grads['w'].item(), 5), bool(out.valid)
    (0.001, True)
  """
  next_loss_scale = next_loss_scale_of(state, next_loss_scale, "finish_mean")
  checked = _inputs.static_flag(checked, what="finish_mean(checked=...)")
  issued = errors.concrete_float(state.issued)
  if issued is not None and errors.concrete_float(state.weight_hi) is not None:
    total = state.total_weight
    if not total > 0:
      raise WeightedAccumulationError(
          f"finish_mean: the window's total weight is {total!r} after "
          f"{int(issued)} microbatch(es) ({int(state.zero_weight)} of weight "
          f"0, {int(state.rejected)} rejected), so there is no mean to take. "
          "Nothing was cleared: accumulate more microbatches, or use "
          "finish_sums to hand zero sums to a cross-replica reduction.")
  elif checked:
    weight = tally.join_traced(state.weight_hi, state.weight_lo)
    checkify.check(weight > 0, "finish_mean: the window's total weight is "
                   "{w}, so there is no mean to take; the state was left "
                   "unchanged and zero grads returned.", w=weight)
  return _finish_mean_kernel(state, next_loss_scale)
