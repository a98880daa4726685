"""Window-level dynamic loss scaling: ``DynamicLossScale`` and
``set_loss_scale``.

``DynamicLossScale`` follows PyTorch ``GradScaler``'s rule, applied once per
accumulation window (never per microbatch). ``set_loss_scale`` starts a window
at a new scale. The rule, the functional pattern and checkpointing are
described in ``docs/mixed_precision.md``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from weighted_accum import _tree
from weighted_accum import errors
from weighted_accum.errors import WeightedAccumulationError
from weighted_accum.state import AccumState

__all__ = ["DynamicLossScale", "set_loss_scale"]

_F32 = np.finfo(np.float32)
_INT32_LIMIT = 2**31
_SCALE_HINT = (
  "A loss scale is a finite positive float32 number, e.g. 2.0**16 "
  "(GradScaler's default) for float16 training."
)


def _host_number(value: Any, name: str, *, integer: bool = False) -> Any:
  """``value`` as a Python number, or ``None`` when it is traced.

  Raises for a non-scalar, a bool, a non-real dtype, or (with ``integer``) a
  non-integer type.
  """
  if isinstance(value, jax.ShapeDtypeStruct) or np.ndim(value) != 0:
    raise WeightedAccumulationError(
      f"DynamicLossScale: {name} must be a scalar, got "
      f"{type(value).__name__} of shape {np.shape(value)}."
    )
  dt = _dtype(value)
  kind = jnp.integer if integer else jnp.number
  if (
    dt is None
    or isinstance(value, bool)
    or jnp.issubdtype(dt, jnp.bool_)
    or not jnp.issubdtype(dt, kind)
    or jnp.issubdtype(dt, jnp.complexfloating)
  ):
    want = "an int" if integer else "a real number"
    raise WeightedAccumulationError(
      f"DynamicLossScale: {name} must be {want}, got {value!r} (dtype {dt})."
    )
  if errors.is_traced(value):
    return None
  item = np.asarray(value).item()
  return int(item) if integer else float(item)


def _dtype(value: Any) -> np.dtype | None:
  """``value``'s dtype, or ``None`` when it is not a number or array."""
  if value is None or isinstance(value, (str, bytes)):
    return None
  try:
    return jnp.result_type(value)
  except TypeError:
    return None


def _float32_value(value: float, name: str, hint: str) -> float:
  """``value`` rounded to float32; raises when it is not a finite normal
  positive float32 number (0, subnormal, Inf, NaN, negative)."""
  with np.errstate(over="ignore"):
    rounded = float(np.float32(value)) if math.isfinite(value) else value
  if not (math.isfinite(rounded) and rounded >= float(_F32.tiny)):
    raise WeightedAccumulationError(
      f"DynamicLossScale: {name} is {value!r}, which is not a finite "
      f"positive float32 number (range [{float(_F32.tiny):.3g}, "
      f"{float(_F32.max):.3g}]). {hint}"
    )
  return rounded


def _factor(value: Any, name: str, low: float, high: float, rule: str) -> float:
  v = _host_number(value, name)
  if v is None:
    raise WeightedAccumulationError(
      f"DynamicLossScale: {name} is a traced value; the factors are static "
      "configuration. Pass a Python number."
    )
  v32 = _float32_value(v, name, f"{name} must be {rule}.")
  if not low < v32 < high:
    raise WeightedAccumulationError(
      f"DynamicLossScale: {name} is {v!r} (as float32: {v32!r}); it must be "
      f"{rule} (as in PyTorch's GradScaler)."
    )
  return v32


def _interval(value: Any) -> int:
  v = _host_number(value, "growth_interval", integer=True)
  if v is None:
    raise WeightedAccumulationError(
      "DynamicLossScale: growth_interval is a traced value; it is static "
      "configuration. Pass a Python int."
    )
  if not 1 <= v < _INT32_LIMIT:
    raise WeightedAccumulationError(
      f"DynamicLossScale: growth_interval is {v!r}; it must be a positive "
      "int below 2**31 (the number of consecutive finite windows before "
      "the scale grows, e.g. 2000)."
    )
  return v


def _check_scale(
  value: Any, min_scale: float, name: str = "scale"
) -> jax.Array:
  """The scale as a float32 array; validated when concrete."""
  v = _host_number(value, name)
  if v is not None:
    v32 = _float32_value(v, name, _SCALE_HINT)
    if v32 < min_scale:
      raise WeightedAccumulationError(
        f"DynamicLossScale: {name} is {v!r}, below min_scale={min_scale!r}"
        "; the scale never backs off below min_scale. Pass a scale >= "
        "min_scale, or a smaller min_scale."
      )
  return jnp.asarray(value, jnp.float32)


def _check_tracker(value: Any, interval: int) -> jax.Array:
  v = _host_number(value, "growth_tracker", integer=True)
  if v is not None and not 0 <= v < interval:
    raise WeightedAccumulationError(
      f"DynamicLossScale: growth_tracker is {v!r}; it counts the "
      f"consecutive finite windows since the last change, so it lies in "
      f"[0, growth_interval={interval}). Pass 0 to start counting afresh."
    )
  return jnp.asarray(value, jnp.int32)


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class DynamicLossScale:
  """A dynamic loss scale adjusted once per accumulation window.

  PyTorch ``GradScaler``'s rule, one step per window: after a window whose
  gradients held Inf/NaN (it is skipped), ``scale *= backoff_factor``
  (floored at ``min_scale``) and the tracker resets; after
  ``growth_interval`` consecutive finite windows, ``scale *= growth_factor``
  (only if the result is finite in float32) and the tracker resets.

  An immutable pytree: ``scale`` (float32) and ``growth_tracker`` (int32) are
  its leaves, so it passes through ``jax.jit``, donation and checkpoints
  (:class:`~weighted_accum.AccumSave`); the other fields are static.

  Attributes:
    scale: float32 scalar, the factor every loss of the window is multiplied
      by.
    growth_tracker: int32 scalar, consecutive finite windows since the scale
      last changed, in ``[0, growth_interval)``.
    growth_factor: float, > 1 (rounded to float32, as the scale's arithmetic
      uses it).
    backoff_factor: float, in (0, 1) (rounded to float32).
    growth_interval: int, >= 1.
    min_scale: float, the lowest scale a back-off reaches (rounded to
      float32).

  Example:
    >>> import weighted_accum as wa
    >>> scaler = wa.DynamicLossScale(2.0**16, growth_interval=2)
    >>> scaler = scaler.adjust(False)          # an overflowing window
    >>> float(scaler.scale), int(scaler.growth_tracker)
    (32768.0, 0)
    >>> scaler = scaler.adjust(True).adjust(True)   # two finite windows
    >>> float(scaler.scale), int(scaler.growth_tracker)
    (65536.0, 0)
  """

  scale: jax.Array
  growth_tracker: jax.Array
  growth_factor: float
  backoff_factor: float
  growth_interval: int
  min_scale: float

  def __init__(
    self,
    scale: ArrayLike,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    growth_tracker: ArrayLike = 0,
  ):
    """Creates a scaler, validating every argument.

    Args:
      scale: the initial loss scale (``2.0**16`` is GradScaler's default), a
        finite positive float32 number >= ``min_scale``. May be traced (then
        only its shape and type are checked).
      growth_factor: multiplies the scale after ``growth_interval``
        consecutive finite windows; > 1.
      backoff_factor: multiplies the scale after a non-finite window; in
        (0, 1).
      growth_interval: consecutive finite windows before the scale grows;
        a positive int.
      min_scale: the floor of a back-off; a finite positive float32 number
        <= ``scale``.
      growth_tracker: the consecutive finite windows already counted (to
        continue a run), in ``[0, growth_interval)``.

    Raises:
      WeightedAccumulationError: naming the first invalid argument.
    """
    gf = _factor(growth_factor, "growth_factor", 1.0, math.inf, "a number > 1")
    bf = _factor(
      backoff_factor, "backoff_factor", 0.0, 1.0, "a number in (0, 1)"
    )
    interval = _interval(growth_interval)
    ms = _host_number(min_scale, "min_scale")
    if ms is None:
      raise WeightedAccumulationError(
        "DynamicLossScale: min_scale is a traced value; it is static "
        "configuration. Pass a Python number."
      )
    ms = _float32_value(ms, "min_scale", "Pass e.g. 1.0.")
    _set_fields(
      self,
      _check_scale(scale, ms),
      _check_tracker(growth_tracker, interval),
      gf,
      bf,
      interval,
      ms,
    )

  def replace(self, **changes: Any) -> DynamicLossScale:
    """A copy with some fields changed, validated like the constructor.

    Example:
      >>> import weighted_accum as wa
      >>> s = wa.DynamicLossScale(2.0**16).replace(growth_interval=10)
      >>> s.growth_interval
      10
    """
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fields.update(changes)
    scale = fields.pop("scale")
    return DynamicLossScale(scale, **fields)

  def adjust(self, finite: bool | jax.Array) -> DynamicLossScale:
    """The scaler after one window, by GradScaler's rule.

    Call it once per window with the window's ``finite`` flag (e.g.
    ``AccumulatedGradients.finite`` from ``finish_mean``), never per
    microbatch: the scale must stay constant within a window.

    Args:
      finite: a bool scalar (Python, NumPy or JAX, traced or not): whether
        every gradient value of the window was finite.

    Returns:
      The new scaler. Non-finite: ``max(scale * backoff_factor,
      min_scale)``, tracker 0. Finite: the tracker counts the window; when
      it reaches ``growth_interval`` the scale grows by ``growth_factor``
      (kept unchanged if that overflows float32) and the tracker resets.

    Raises:
      WeightedAccumulationError: for a non-scalar or non-bool ``finite``.

    Example:
      >>> import weighted_accum as wa
      >>> s = wa.DynamicLossScale(4.0, min_scale=2.0)
      >>> once = s.adjust(False)
      >>> float(once.scale), float(once.adjust(False).scale)   # floored
      (2.0, 2.0)
    """
    dt = _dtype(finite)
    if dt is None or np.ndim(finite) != 0 or not jnp.issubdtype(dt, jnp.bool_):
      raise WeightedAccumulationError(
        f"DynamicLossScale.adjust: finite must be a bool scalar, got "
        f"{type(finite).__name__} of dtype {dt} and shape "
        f"{np.shape(finite)}. Pass the window's flag, e.g. out.finite from "
        "finish_mean."
      )
    return _adjust(self, jnp.asarray(finite))


def _set_fields(
  obj: DynamicLossScale,
  scale: Any,
  tracker: Any,
  gf: float,
  bf: float,
  interval: int,
  ms: float,
) -> DynamicLossScale:
  for name, value in (
    ("scale", scale),
    ("growth_tracker", tracker),
    ("growth_factor", gf),
    ("backoff_factor", bf),
    ("growth_interval", interval),
    ("min_scale", ms),
  ):
    object.__setattr__(obj, name, value)
  return obj


@jax.jit
def _adjust(s: DynamicLossScale, finite: jax.Array) -> DynamicLossScale:
  # The factors are float32 numbers (rounded at construction), so each
  # float32 product below is GradScaler's double product rounded to float32.
  grown = s.scale * jnp.float32(s.growth_factor)
  backed_off = jnp.maximum(
    s.scale * jnp.float32(s.backoff_factor), jnp.float32(s.min_scale)
  )
  counted = s.growth_tracker + 1
  # >= rather than ==: also safe for a tracker built under jit out of range.
  grow = counted >= s.growth_interval
  scale = jnp.where(
    finite, jnp.where(grow & jnp.isfinite(grown), grown, s.scale), backed_off
  )
  tracker = jnp.where(finite & ~grow, counted, jnp.int32(0))
  return _set_fields(
    object.__new__(DynamicLossScale),
    scale,
    tracker,
    s.growth_factor,
    s.backoff_factor,
    s.growth_interval,
    s.min_scale,
  )


def _flatten_with_keys(s: DynamicLossScale):
  children = (
    (jax.tree_util.GetAttrKey("scale"), s.scale),
    (jax.tree_util.GetAttrKey("growth_tracker"), s.growth_tracker),
  )
  return children, (
    s.growth_factor,
    s.backoff_factor,
    s.growth_interval,
    s.min_scale,
  )


def _flatten(s: DynamicLossScale):
  return (s.scale, s.growth_tracker), (
    s.growth_factor,
    s.backoff_factor,
    s.growth_interval,
    s.min_scale,
  )


def _unflatten(aux: tuple, children: Any) -> DynamicLossScale:
  # Bypasses the validating constructor: JAX rebuilds the node with tracers,
  # abstract values or placeholders, and must not wait for device values.
  return _set_fields(object.__new__(DynamicLossScale), *children, *aux)


jax.tree_util.register_pytree_with_keys(
  DynamicLossScale, _flatten_with_keys, _unflatten, _flatten
)


def check_restored(tree: Any, *, what: str) -> None:
  """Validates every ``DynamicLossScale`` in a restored (concrete) tree.

  Args:
    tree: a tree that may hold ``DynamicLossScale`` nodes.
    what: the prefix of error messages (e.g. the restore's item directory).

  Raises:
    WeightedAccumulationError: naming the node's path and the field ('scale'
      or 'growth_tracker') that does not satisfy the constructor's rules
      under the template's configuration.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> from weighted_accum.loss_scale import check_restored
    >>> good = wa.DynamicLossScale(8.0)
    >>> bad = jax.tree.map(lambda x: -x, good)   # as a corrupt file would be
    >>> check_restored({'scaler': good}, what='restore')
    >>> try:
    ...   check_restored({'scaler': bad}, what='restore')
    ... except wa.WeightedAccumulationError as e:
    ...   print(str(e)[:53])
    restore: DynamicLossScale at ['scaler']: DynamicLossS
  """
  is_scaler = lambda x: isinstance(x, DynamicLossScale)  # noqa: E731
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scaler)
  for path, node in flat:
    if not is_scaler(node):
      continue
    try:
      node.replace()
    except WeightedAccumulationError as e:
      raise WeightedAccumulationError(
        f"{what}: DynamicLossScale at {_tree.path_str(path)}: {e} The "
        "checkpoint is corrupt, or was saved by a scaler configured "
        "differently from the template's (restore with the saving run's "
        "configuration)."
      ) from e


def set_loss_scale(
  state: AccumState,
  loss_scale: ArrayLike | DynamicLossScale,
  *,
  checked: bool = False,
) -> AccumState:
  """Sets the loss scale of a window to which nothing was added yet.

  The scale is constant within a window, so only a window of total weight
  0 may change it: one just started by a finish, or one holding only
  zero-weight or rejected microbatches (they added nothing to the buffers).
  The rest of the state is unchanged.

  Args:
    state: the open window.
    loss_scale: the new scale, a finite positive scalar, or a
      :class:`DynamicLossScale` (its ``scale``).
    checked: under ``jax.jit``, also emit ``checkify`` checks for the two
      conditions below.

  Returns:
    ``state`` with ``loss_scale`` replaced. Under ``jit``, where it cannot
    raise, a window that already holds weight, or a non-finite or
    non-positive scale, keeps its current scale.

  Raises:
    WeightedAccumulationError: for a concrete invalid scale, or a concrete
      window that already holds weight (finish it first).

  Example:
    >>> import jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> scaler = wa.DynamicLossScale(2.0**16)
    >>> state = wa.init({'w': jnp.zeros(2)}, loss_scale=scaler.scale)
    >>> state = wa.accumulate_mean(state, {'w': jnp.full(2, 2.0**16)}, 3)
    >>> out, state = wa.finish_mean(state)
    >>> scaler = scaler.adjust(out.finite)
    >>> state = wa.set_loss_scale(state, scaler)
    >>> float(state.loss_scale), out.grads['w'].tolist()
    (65536.0, [1.0, 1.0])
  """
  if not isinstance(state, AccumState):
    raise WeightedAccumulationError(
      f"set_loss_scale: state must be an AccumState, got "
      f"{type(state).__name__}. Pass the window from wa.init or a finish."
    )
  if isinstance(loss_scale, DynamicLossScale):
    loss_scale = loss_scale.scale
  errors.check_loss_scale(loss_scale, what="set_loss_scale(loss_scale)")
  if not (
    errors.is_traced(state.weight_hi) or errors.is_traced(state.weight_lo)
  ):
    total = state.total_weight
    if total != 0:
      raise WeightedAccumulationError(
        f"set_loss_scale: the open window already holds total weight "
        f"{total!r} from {int(state.issued)} microbatch(es) accumulated at "
        f"loss scale {float(state.loss_scale)!r}; the scale is constant "
        "within a window. Finish the window first, or set the next "
        "window's scale with finish_mean/finish_sums(next_loss_scale=...)."
      )
  return _set_scale(state, jnp.asarray(loss_scale, jnp.float32), checked)


def _set_scale(state: AccumState, ls: jax.Array, checked: bool) -> AccumState:
  empty = (state.weight_hi == 0) & (state.weight_lo == 0)
  ok = jnp.isfinite(ls) & (ls > 0)
  if checked and (errors.is_traced(ls) or errors.is_traced(state.weight_hi)):
    checkify.check(
      ok,
      "set_loss_scale: loss scale {s} is not finite and "
      "positive; the window kept its scale.",
      s=ls,
    )
    checkify.check(
      empty,
      "set_loss_scale: the open window already holds "
      "weight; the scale is constant within a window, so it "
      "kept its scale.",
    )
  return state.replace(loss_scale=jnp.where(empty & ok, ls, state.loss_scale))
