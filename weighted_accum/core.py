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
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp

from weighted_accum import _counters
from weighted_accum import _tree
from weighted_accum import errors
from weighted_accum import tally
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.state import AccumState
from weighted_accum.state import AccumulatedGradients


def compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """Arithmetic precision for scaling: at least float32 (no float16 overflow)."""
  return jnp.promote_types(dtype, jnp.float32)


def mean_contribution(g: jax.Array, weight: jax.Array,
                      dtype: jnp.dtype) -> jax.Array:
  """``cast(g, dtype) * weight``: converted first, multiplied in >= float32."""
  return (g.astype(dtype).astype(compute_dtype(dtype)) * weight).astype(dtype)


def normalise(sums: Any, loss_scale: jax.Array,
              weight: jax.Array) -> tuple[Any, jax.Array]:
  """``(sums / loss_scale) / weight`` per leaf, and whether all are finite.

  Sequential division in at least float32, never by ``loss_scale * weight``
  (which can overflow float16); the result is in each leaf's dtype. Where
  ``weight`` is not positive the grads are zeros; ``finite`` only says
  whether every result value is finite (callers add ``weight > 0`` to
  ``valid``).
  Shared by :func:`finish_mean` and :mod:`weighted_accum.distributed`.
  """
  ok = weight > 0

  def divide(b):
    ct = compute_dtype(b.dtype)
    g = (b.astype(ct) / loss_scale.astype(ct)) / weight.astype(ct)
    return jnp.where(ok, g, jnp.zeros((), ct)).astype(b.dtype)

  grads = jax.tree.map(divide, sums)
  # Checked on the result (read after it is written in place): checking a
  # donated input instead would force XLA to copy it first.
  return grads, all_finite(grads)


def _check_inputs(state: AccumState, grads: Any, weight: Any,
                  name: str) -> list[Any]:
  """Structural checks of one microbatch; returns the grads' leaves."""
  leaves = _tree.match_tree(state.grads, grads, what=f"{name}(grads)")
  named = list(zip(_tree.leaf_paths(state.grads), leaves))
  _tree.check_leaves_floating(named, what=f"{name}(grads)")
  errors.check_weight(weight, what=f"{name}(weight)")
  _tree.check_not_reduced_against_weight(named, weight,
                                          what=f"{name}(grads)")
  return leaves


@functools.partial(jax.jit, static_argnames=("mean",))
def _accumulate_kernel(state: AccumState, leaves: list[Any], weight: jax.Array,
                       mean: bool) -> AccumState:
  w = jnp.asarray(weight, jnp.float32)
  valid = jnp.isfinite(w) & (w >= 0)
  take = valid & (w > 0)
  dt = state.dtype

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
  hi, lo = tally.two_sum_add(state.weight_hi, state.weight_lo,
                             jnp.where(take, w, 0.0))
  one = jnp.int32(1)
  return state.replace(
      grads=new_buffers,
      issued=state.issued + one,
      zero_weight=state.zero_weight + jnp.where(valid & (w == 0), one, 0),
      rejected=state.rejected + jnp.where(valid, 0, one),
      weight_hi=hi,
      weight_lo=lo,
  )


def _accumulate(state: AccumState, grads: Any, weight: Any, *, mean: bool,
                checked: bool, name: str) -> AccumState:
  leaves = _check_inputs(state, grads, weight, name)
  if checked and _tree.is_traced(weight):
    w = jnp.asarray(weight, jnp.float32)
    checkify.check(
        jnp.isfinite(w) & (w >= 0),
        name + ": weight {w} is not a finite non-negative item count; the "
        "microbatch was rejected (state.rejected counts it).", w=w)
  return _accumulate_kernel(state, _on_buffer_shardings(state, leaves),
                            weight, mean=mean)


def _on_buffer_shardings(state: AccumState, leaves: list[Any]) -> list[Any]:
  """Eagerly, moves grads sharded unlike their buffers onto the buffers'
  shardings, so the result keeps the params' placement (under ``jit`` the
  partitioner decides; params and grads normally agree there)."""
  out = []
  for g, b in zip(leaves, jax.tree.leaves(state.grads)):
    if (isinstance(g, jax.Array) and isinstance(b, jax.Array)
        and not _tree.is_traced(g) and not _tree.is_traced(b)
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

  ``isfinite(sum(x))`` instead of ``all(isfinite(x))``: XLA:CPU fuses a plain
  sum into one read of ``x``, while the boolean form materialises a
  parameter-sized temporary. NaN and Inf propagate into the sum, so it is
  exact, but for a sum of finite values that overflows float32 (far beyond
  any real gradient), which reads as "not finite", the safe side.
  """
  sums = [jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))
          for x in jax.tree.leaves(tree)]
  if not sums:
    return jnp.bool_(True)
  return jnp.all(jnp.isfinite(jnp.stack(sums)))


def _reset(state: AccumState, next_loss_scale: jax.Array) -> AccumState:
  return state.replace(grads=jax.tree.map(_tree.zeros_like, state.grads),
                       **_counters.at_finish(state, next_loss_scale))


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
  return counters.replace(grads=reset.grads)


def _next_scale(state: AccumState, next_loss_scale: Any) -> jax.Array:
  if next_loss_scale is None:
    return state.loss_scale
  ls = jnp.asarray(next_loss_scale, jnp.float32)
  # A traced invalid scale cannot raise: keep the current one instead.
  return jnp.where(jnp.isfinite(ls) & (ls > 0), ls, state.loss_scale)


@jax.jit
def _finish_sums_kernel(state: AccumState, next_loss_scale: jax.Array | None):
  finite = all_finite(state.grads)
  out = AccumulatedGradients(
      grads=state.grads,
      weight=tally.join_traced(state.weight_hi, state.weight_lo),
      loss_scale=state.loss_scale, issued=state.issued, finite=finite,
      valid=finite)
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
  if next_loss_scale is not None:
    errors.check_loss_scale(next_loss_scale,
                            what="finish_sums(next_loss_scale=...)")
  return _finish_sums_kernel(state, next_loss_scale)


@jax.jit
def _finish_mean_kernel(state: AccumState, next_loss_scale: jax.Array | None):
  weight = tally.join_traced(state.weight_hi, state.weight_lo)
  ok = weight > 0
  grads, finite = normalise(state.grads, state.loss_scale, weight)
  out = AccumulatedGradients(grads=grads, weight=weight,
                             loss_scale=state.loss_scale, issued=state.issued,
                             finite=finite, valid=finite & ok)
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
  if next_loss_scale is not None:
    errors.check_loss_scale(next_loss_scale,
                            what="finish_mean(next_loss_scale=...)")
  issued = _tree.concrete_float(state.issued)
  if issued is not None and _tree.concrete_float(state.weight_hi) is not None:
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
