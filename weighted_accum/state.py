"""The accumulator's state: ``AccumState``, ``AccumulatedGradients``, ``init``
and ``from_buffers``.

Invariant: only microbatches of positive weight add to the buffers, and
finishing zeroes them, so a window whose total weight is 0 has all-zero
buffers. This is what lets ``finish_mean`` of such a window under ``jit``
return "the unchanged state" without keeping a second copy of the buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum import _placement
from weighted_accum import errors
from weighted_accum import tally
from weighted_accum.errors import WeightedAccumulationError

FORMAT_VERSION = 1

COUNTER_FIELDS = ("issued", "zero_weight", "rejected", "windows", "weight_hi",
                  "weight_lo", "loss_scale")
_INT_COUNTERS = ("issued", "zero_weight", "rejected", "windows")


class AccumState(struct.PyTreeNode):
  """An immutable accumulation window: gradient buffers plus counters.

  A pytree (``flax.struct``), so it passes through ``jax.jit``, donation,
  ``jax.tree.map`` and Orbax. Update it only through this library's functions;
  ``.replace`` returns a modified copy.

  Attributes:
    grads: the pending (still loss-scaled) weighted sums, a tree like the
      params in the work dtype and on the params' shardings.
    issued: int32, microbatches issued in this window, zero-weight and
      rejected ones included.
    zero_weight: int32, microbatches of weight exactly 0 in this window.
    rejected: int32, microbatches refused under ``jit`` (negative, NaN or
      infinite weight) in this window; they changed nothing else.
    windows: int32, windows finished since ``init`` (never reset).
    weight_hi: float32, the window's total weight rounded to float32.
    weight_lo: float32, the rounding error of ``weight_hi`` (exact tally).
    loss_scale: float32, the loss scale of this window.
    dtype: the work dtype (static).

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros(2)})
    >>> state = wa.accumulate_sum(state, {'w': jnp.array([1., 2.])}, 3)
    >>> int(state.issued), state.total_weight
    (1, 3.0)
  """

  grads: Any
  issued: jax.Array
  zero_weight: jax.Array
  rejected: jax.Array
  windows: jax.Array
  weight_hi: jax.Array
  weight_lo: jax.Array
  loss_scale: jax.Array
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)

  @property
  def total_weight(self) -> float | jax.Array:
    """The window's total weight.

    A concrete state gives the exact Python number (``weight_hi +
    weight_lo`` in float64: integer totals are exact to 2**48). Under a
    transformation it is the float32 array ``weight_hi + weight_lo``.
    """
    if errors.is_traced(self.weight_hi) or errors.is_traced(self.weight_lo):
      return tally.join_traced(self.weight_hi, self.weight_lo)
    return tally.join(self.weight_hi, self.weight_lo)

  @property
  def counters(self) -> dict[str, jax.Array]:
    """The counter leaves by name, as saved in checkpoints and taken by
    :func:`from_buffers`."""
    return {k: getattr(self, k) for k in COUNTER_FIELDS}


class AccumulatedGradients(struct.PyTreeNode):
  """What ``finish_sums`` / ``finish_mean`` return.

  Attributes:
    grads: for ``finish_sums`` the still-scaled sums; for ``finish_mean`` the
      sums divided by the loss scale then by the total weight. Work dtype.
    weight: float32, the window's (local) total weight.
    loss_scale: float32, the window's loss scale.
    issued: int32, microbatches issued in the window.
    finite: bool, every pending value was finite (one reduction per window).
      A dynamic loss scaler skips the window when it is false.
    valid: bool, the result may be applied: ``finite`` and, for
      ``finish_mean``, a positive total weight.
  """

  grads: Any
  weight: jax.Array
  loss_scale: jax.Array
  issued: jax.Array
  finite: jax.Array
  valid: jax.Array


def zeros_like(x: Any, dtype: Any = None) -> jax.Array:
  """Zeros shaped like ``x`` on ``x``'s sharding, eagerly and under ``jit``.

  Under ``jit`` a constant has no data dependence on ``x``, so the partitioner
  would replicate it (``jnp.zeros_like`` does, on an auto mesh). Selecting
  from ``x`` with an all-false mask makes the zeros inherit ``x``'s sharding
  on auto and explicit meshes alike, and stays zero where ``x`` is NaN/Inf.
  """
  dtype = x.dtype if dtype is None else dtype
  if isinstance(x, jax.Array) and not errors.is_traced(x):
    # Keeps x's sharding and whether it is committed (see _placement).
    return jnp.zeros_like(x, dtype=dtype)
  if errors.is_traced(x):
    return jnp.where(jnp.zeros_like(x, dtype=bool), x, 0).astype(dtype)
  return jnp.zeros(np.shape(x), dtype)


def _counters(issued=0, zero_weight=0, rejected=0, windows=0, weight_hi=0.0,
              weight_lo=0.0, loss_scale=1.0) -> dict[str, jax.Array]:
  return dict(
      issued=jnp.asarray(issued, jnp.int32),
      zero_weight=jnp.asarray(zero_weight, jnp.int32),
      rejected=jnp.asarray(rejected, jnp.int32),
      windows=jnp.asarray(windows, jnp.int32),
      weight_hi=jnp.asarray(weight_hi, jnp.float32),
      weight_lo=jnp.asarray(weight_lo, jnp.float32),
      loss_scale=jnp.asarray(loss_scale, jnp.float32),
  )


def init(params: Any, dtype: Any = jnp.float32,
         loss_scale: float | jax.Array = 1.0) -> AccumState:
  """Starts an empty window with zero buffers shaped like ``params``.

  Args:
    params: any pytree of floating arrays (dict, nested containers,
      ``flax.nnx.State``, trees with ``None`` leaves, or abstract values under
      ``jax.eval_shape``). Only shapes, dtypes and shardings are read.
    dtype: the work dtype of the buffers (float32 recommended; bfloat16 and
      float16 halve the memory at a precision cost).
    loss_scale: the factor the caller multiplies every loss of the window by
      (e.g. 2**15 for float16). Divided out once at finish. Never inferred.

  Returns:
    An empty :class:`AccumState`; each buffer is on its param's sharding.

  Raises:
    WeightedAccumulationError: for a non-floating work dtype or param, or a
      non-finite or non-positive concrete loss scale.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> state = wa.init({'w': jnp.zeros((2, 3)), 'b': jnp.zeros(3)},
    ...                 dtype=jnp.float32, loss_scale=1.0)
    >>> state.grads['w'].shape, int(state.issued)
    ((2, 3), 0)
  """
  dt = errors.check_floating_dtype(dtype, what="init(dtype=...)")
  errors.check_loss_scale(loss_scale, what="init(loss_scale=...)")
  errors.check_leaves_floating(
      list(zip(errors.leaf_paths(params), jax.tree.leaves(params))),
      what="init(params)",
      hint="Only floating params have gradients: pass just the trainable "
      "leaves, e.g. nnx.state(model, nnx.Param).")
  buffers = jax.tree.map(lambda p: zeros_like(p, dt), params)
  return AccumState(grads=buffers, dtype=dt, **_placement.commit_like(
      _counters(loss_scale=loss_scale), buffers))


def _concrete_counter(counters: Mapping[str, Any], name: str,
                      default: Any) -> Any:
  value = counters.get(name, default)
  if np.ndim(value) != 0:
    raise WeightedAccumulationError(
        f"from_buffers(counters): counter {name!r} has shape "
        f"{np.shape(value)}, expected a scalar. Pass the values of "
        "state.counters.")
  if errors.is_traced(value):
    raise WeightedAccumulationError(
        f"from_buffers(counters): counter {name!r} is a traced value; "
        "from_buffers validates concrete restored values, so call it outside "
        "jit.")
  return np.asarray(value).item()


def validate_counters(counters: Mapping[str, Any], *,
                      what: str = "from_buffers(counters)") -> dict[str, Any]:
  """Checks saved counters and returns them as Python numbers.

  Accepts the keys of :attr:`AccumState.counters`; ``total_weight`` may stand
  in for ``weight_hi``/``weight_lo``. Missing counts default to 0 and a
  missing loss scale to 1.

  Raises:
    WeightedAccumulationError: naming the first invalid or unknown counter.
  """
  known = set(COUNTER_FIELDS) | {"total_weight"}
  unknown = sorted(set(counters) - known)
  if unknown:
    raise WeightedAccumulationError(
        f"{what}: unknown counter {unknown[0]!r}; expected keys among "
        f"{sorted(known)}.")
  out: dict[str, Any] = {}
  for name in _INT_COUNTERS:
    v = _concrete_counter(counters, name, 0)
    if isinstance(v, float):
      if not (math.isfinite(v) and v == int(v)):
        raise WeightedAccumulationError(
            f"{what}: counter {name!r} is {v!r}, not a whole number.")
      v = int(v)
    if not isinstance(v, int) or v < 0 or v >= 2**31:
      raise WeightedAccumulationError(
          f"{what}: counter {name!r} is {v!r}; it must be a whole number in "
          "[0, 2**31). The checkpoint is corrupt or not an accumulator's.")
    out[name] = v
  if "total_weight" in counters:
    if "weight_hi" in counters or "weight_lo" in counters:
      raise WeightedAccumulationError(
          f"{what}: give either 'total_weight' or 'weight_hi'/'weight_lo', "
          "not both.")
    tw = float(_concrete_counter(counters, "total_weight", 0.0))
    hi, lo = tally.split(tw) if math.isfinite(tw) else (tw, 0.0)
  else:
    hi = float(_concrete_counter(counters, "weight_hi", 0.0))
    lo = float(_concrete_counter(counters, "weight_lo", 0.0))
  total = float(hi) + float(lo)
  if not (math.isfinite(total) and total >= 0):
    raise WeightedAccumulationError(
        f"{what}: counter 'total_weight' is {total!r}; a window's weight is a "
        "finite non-negative sum of item counts. The checkpoint is corrupt.")
  ls = float(_concrete_counter(counters, "loss_scale", 1.0))
  if not (math.isfinite(ls) and ls > 0):
    raise WeightedAccumulationError(
        f"{what}: counter 'loss_scale' is {ls!r}; it must be finite and "
        "positive. The checkpoint is corrupt.")
  if out["zero_weight"] + out["rejected"] > out["issued"]:
    raise WeightedAccumulationError(
        f"{what}: counters 'zero_weight' ({out['zero_weight']}) + 'rejected' "
        f"({out['rejected']}) exceed 'issued' ({out['issued']}). The "
        "checkpoint is corrupt.")
  if out["issued"] == 0 and total != 0:
    raise WeightedAccumulationError(
        f"{what}: counter 'total_weight' is {total!r} but 'issued' is 0. The "
        "checkpoint is corrupt.")
  out.update(weight_hi=hi, weight_lo=lo, loss_scale=ls)
  return out


def _place(buf: Any, param: Any, path: str, dtype: jnp.dtype) -> jax.Array:
  if isinstance(param, jax.Array) and not errors.is_traced(param):
    target = param.sharding
    if isinstance(buf, jax.Array):
      if not buf.sharding.is_equivalent_to(target, buf.ndim):
        raise WeightedAccumulationError(
            f"from_buffers(buffers): leaf {path} is placed on {buf.sharding}, "
            f"but its param is on {target}. Restore it onto the param's "
            "sharding (e.g. jax.device_put(buf, param.sharding)).")
      return buf
    if not param.committed:  # as the param: on the default device, free
      return jnp.asarray(np.asarray(buf, dtype))
    return jax.device_put(np.asarray(buf, dtype), target)
  return jnp.asarray(buf, dtype)


def from_buffers(params: Any, buffers: Any,
                 counters: Mapping[str, Any]) -> AccumState:
  """Reattaches restored buffers and counters to ``params``, validated.

  Use it when the buffers were restored by other means than
  :mod:`weighted_accum.checkpoint` (a custom store, ``np.load``...).

  Args:
    params: the params the buffers belong to (defines paths, shapes and
      placement).
    buffers: a tree with exactly ``params``' leaf paths and shapes, all in
      one floating work dtype. Host (NumPy) leaves are put on the param's
      sharding; device arrays must already be on it.
    counters: the saved :attr:`AccumState.counters` (``total_weight`` may
      replace ``weight_hi``/``weight_lo``).

  Returns:
    An :class:`AccumState` that continues the saved window exactly.

  Raises:
    WeightedAccumulationError: naming the first offending leaf path or
      counter.

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> params = {'w': jnp.zeros(2)}
    >>> s = wa.accumulate_sum(wa.init(params), {'w': jnp.ones(2)}, 5)
    >>> r = wa.from_buffers(params, s.grads, s.counters)
    >>> r.total_weight, int(r.issued)
    (5.0, 1)
  """
  leaves = errors.match_tree(params, buffers, what="from_buffers(buffers)",
                             ref_name="params")
  paths = errors.leaf_paths(params)
  dtypes = {jnp.result_type(b) for b in leaves}
  errors.check_leaves_floating(list(zip(paths, leaves)),
                               what="from_buffers(buffers)")
  if len(dtypes) > 1:
    first = paths[[jnp.result_type(b) for b in leaves].index(
        sorted(dtypes, key=str)[-1])]
    raise WeightedAccumulationError(
        f"from_buffers(buffers): buffers mix dtypes {sorted(map(str, dtypes))}"
        f" (e.g. leaf {first}); an accumulator has one work dtype. Restore "
        "every buffer in the dtype it was saved in.")
  dtype = errors.check_floating_dtype(
      dtypes.pop() if dtypes else jnp.float32, what="from_buffers(buffers)")
  c = validate_counters(counters)
  p_leaves, treedef = jax.tree.flatten(params)
  placed = [_place(b, p, path, dtype)
            for b, p, path in zip(leaves, p_leaves, paths)]
  if c["weight_hi"] + c["weight_lo"] == 0:
    for path, b in zip(paths, placed):
      if bool(jnp.any(b != 0)):
        raise WeightedAccumulationError(
            f"from_buffers(buffers): leaf {path} is non-zero, but the counters "
            "say the window's total weight is 0 (only positive-weight "
            "microbatches add to the buffers). Buffers and counters come from "
            "different saves: restore them together.")
  return AccumState(grads=jax.tree.unflatten(treedef, placed), dtype=dtype,
                    **_placement.commit_like(_counters(**c), placed))
