"""Window-level dynamic loss scaling: ``DynamicLossScale``.

PyTorch ``GradScaler``'s rule, applied once per accumulation window (never
per microbatch). A window's scale is set with ``init(loss_scale=...)``, a
finish's ``next_loss_scale=`` or ``set_loss_scale``; the rule, the functional
pattern and checkpointing are described in ``docs/mixed_precision.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils
from weighted_accum._src.errors import WeightedAccumulationError

_NAME = "DynamicLossScale"


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class DynamicLossScale(validation.ScaleSource):
  """A dynamic loss scale adjusted once per accumulation window.

  PyTorch ``GradScaler``'s rule, one step per window: after a window whose
  gradients held Inf/NaN (it is skipped), ``scale *= backoff_factor``
  (floored at ``min_scale``) and the tracker resets; after
  ``growth_interval`` consecutive finite windows, ``scale *= growth_factor``
  (only if the result is finite in float32) and the tracker resets.

  An immutable pytree: ``scale`` (float32) and ``growth_tracker`` (int32) are
  its leaves, so it passes through ``jax.jit``, donation and checkpoints
  (:class:`~weighted_accum.checkpoint.AccumSave`); the other fields are static. Every
  argument that takes a loss scale (``init``, ``next_loss_scale=``,
  ``set_loss_scale``, the wrapper, the in-step function) also takes a
  ``DynamicLossScale`` and uses its current ``scale``.

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
    gf = validation.float32_option(
      growth_factor, what=f"{_NAME}: growth_factor", rule="> 1", low=1.0
    )
    bf = validation.float32_option(
      backoff_factor, what=f"{_NAME}: backoff_factor", rule="in (0, 1)", high=1
    )
    interval = validation.static_int(
      growth_interval,
      what=f"{_NAME}: growth_interval",
      hint="It is the number of consecutive finite windows before the "
      "scale grows, e.g. 2000.",
    )
    ms = validation.float32_option(
      min_scale, what=f"{_NAME}: min_scale", rule="the lowest loss scale"
    )
    _set_fields(
      self,
      validation.scaler_scale(scale, what=f"{_NAME}: scale", min_scale=ms),
      validation.growth_tracker(
        growth_tracker, what=f"{_NAME}: growth_tracker", interval=interval
      ),
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
    finite = validation.bool_scalar(
      finite,
      what=f"{_NAME}.adjust(finite)",
      hint="Pass the window's flag, e.g. out.finite from finish_mean.",
    )
    return _adjust(self, finite)


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


def _aux(s: DynamicLossScale) -> tuple:
  return (s.growth_factor, s.backoff_factor, s.growth_interval, s.min_scale)


def _flatten_with_keys(s: DynamicLossScale):
  children = (
    (jax.tree_util.GetAttrKey("scale"), s.scale),
    (jax.tree_util.GetAttrKey("growth_tracker"), s.growth_tracker),
  )
  return children, _aux(s)


def _flatten(s: DynamicLossScale):
  return (s.scale, s.growth_tracker), _aux(s)


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
        f"{what}: DynamicLossScale at {tree_utils.path_str(path)}: {e} The "
        "checkpoint is corrupt, or was saved by a scaler configured "
        "differently from the template's (restore with the saving run's "
        "configuration)."
      ) from e
