"""The accumulator's state: ``AccumState``, ``AccumulatedGradients``, ``init``
and ``from_buffers``.

The counters are declared in ``weighted_accum._counters``; the invariants the
state keeps are in ``docs/design.md`` ("State").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np

from weighted_accum import _counters
from weighted_accum import _inputs
from weighted_accum import _placement
from weighted_accum import _tally
from weighted_accum import _tree
from weighted_accum import errors
from weighted_accum.errors import WeightedAccumulationError


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
  # One field per row of the counter table, in its order.
  __annotations__.update(_counters.field_annotations())
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)

  @property
  def total_weight(self) -> float | jax.Array:
    """The window's total weight.

    A concrete state gives the exact Python number (``weight_hi +
    weight_lo`` in float64: integer totals are exact to 2**48). Under a
    transformation it is the float32 array ``weight_hi + weight_lo``.
    """
    if _tree.is_traced(self.weight_hi) or _tree.is_traced(self.weight_lo):
      return _tally.join_traced(self.weight_hi, self.weight_lo)
    return _tally.join(self.weight_hi, self.weight_lo)

  @property
  def counters(self) -> dict[str, jax.Array]:
    """The counter leaves by name, as saved in checkpoints and taken by
    :func:`from_buffers`."""
    return _counters.of(self)


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


def init(
  params: Any, dtype: DTypeLike = jnp.float32, loss_scale: ArrayLike = 1.0
) -> AccumState:
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
  ls = errors.check_loss_scale(
    loss_scale, what="init(loss_scale=...)", dtype=_inputs.tally_dtype(dt)
  )
  _tree.check_leaves_floating(
    _tree.flat(params),
    what="init(params)",
    hint="Only floating params have gradients: pass just the trainable "
    "leaves, e.g. nnx.state(model, nnx.Param).",
  )
  buffers = jax.tree.map(lambda p: _tree.zeros_like(p, dt), params)
  return AccumState(
    grads=buffers,
    dtype=dt,
    **_placement.commit_like(
      _counters.initial(work_dtype=dt, loss_scale=ls), buffers
    ),
  )


def _work_dtype(named: list[tuple[str, Any]]) -> jnp.dtype:
  """The one floating dtype of restored buffers (float32 if there are none)."""
  _tree.check_leaves_floating(named, what="from_buffers(buffers)")
  # A buffer's own dtype: a NumPy float64 buffer is float64, not the float32
  # JAX would silently make of it without x64.
  dtypes = [
    np.dtype(b.dtype) if hasattr(b, "dtype") else np.dtype(jnp.result_type(b))
    for _, b in named
  ]
  if len(set(dtypes)) > 1:
    odd = sorted(set(dtypes), key=str)[-1]
    raise WeightedAccumulationError(
      "from_buffers(buffers): buffers mix dtypes "
      f"{sorted(map(str, set(dtypes)))} (e.g. leaf "
      f"{named[dtypes.index(odd)][0]}); an accumulator has one work dtype. "
      "Restore every buffer in the dtype it was saved in."
    )
  return errors.check_floating_dtype(
    dtypes[0] if dtypes else jnp.float32, what="from_buffers(buffers)"
  )


def _check_empty_window_zero(named: list[tuple[str, Any]]) -> None:
  """Only positive-weight microbatches add to the buffers: a window of total
  weight 0 has zero buffers (see ``docs/design.md``, "State")."""
  for path, b in named:
    if bool(jnp.any(_inputs.nonzero(b))):  # on the bits: subnormals count
      raise WeightedAccumulationError(
        f"from_buffers(buffers): leaf {path} is non-zero, but the counters "
        "say the window's total weight is 0 (only positive-weight "
        "microbatches add to the buffers). Buffers and counters come from "
        "different saves: restore them together."
      )


def _param_sharding(param: Any) -> jax.sharding.Sharding | None:
  """Where a param lives: a concrete array's sharding, or the one a
  ``jax.ShapeDtypeStruct`` carries (None for tracers and host values)."""
  if _tree.is_traced(param):
    return None
  sharding = getattr(param, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _place(buf: Any, param: Any, path: str, dtype: jnp.dtype) -> jax.Array:
  target = _param_sharding(param)
  if target is not None:
    if isinstance(buf, jax.Array):
      if not buf.sharding.is_equivalent_to(target, buf.ndim):
        raise WeightedAccumulationError(
          f"from_buffers(buffers): leaf {path} is placed on {buf.sharding}, "
          f"but its param is on {target}. Restore it onto the param's "
          "sharding (e.g. jax.device_put(buf, param.sharding))."
        )
      return buf
    if not getattr(param, "committed", True):  # as the param: uncommitted
      return jnp.asarray(np.asarray(buf, dtype))
    return jax.device_put(np.asarray(buf, dtype), target)
  return jnp.asarray(buf, dtype)


def from_buffers(
  params: Any, buffers: Any, counters: Mapping[str, Any]
) -> AccumState:
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
  leaves = _tree.match_tree(
    params, buffers, what="from_buffers(buffers)", ref_name="params"
  )
  paths = _tree.leaf_paths(params)
  dtype = _work_dtype(list(zip(paths, leaves)))
  c = _counters.validate(counters, work_dtype=dtype)
  p_leaves, treedef = jax.tree.flatten(params)
  placed = [
    _place(b, p, path, dtype) for b, p, path in zip(leaves, p_leaves, paths)
  ]
  if c["weight_hi"] + c["weight_lo"] == 0:
    _check_empty_window_zero(list(zip(paths, placed)))
  return AccumState(
    grads=jax.tree.unflatten(treedef, placed),
    dtype=dtype,
    **_placement.commit_like(_counters.initial(work_dtype=dtype, **c), placed),
  )
