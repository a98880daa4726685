"""The optax wrapper's state, also as Flax NNX holds it (``nnx.Variable``
leaves, or an ``nnx.State``): read plain by :func:`view`, a changed one given
back in the caller's types by :func:`rewrap`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.loss_scale import DynamicLossScale


class WeightedMultiStepsState(NamedTuple):
  """State of :class:`~weighted_accum.WeightedMultiSteps`:
  ``optax.MultiStepsState``'s fields, then this library's.

  Attributes:
    mini_step: int32, microbatches accumulated since the window opened
      (skipped ones not counted).
    gradient_step: int32, windows applied since ``init``.
    inner_opt_state: the wrapped optimizer's state.
    acc_grads: the open window's weighted gradient SUMS (times the loss
      scale). Not zeroed at a close (while ``mini_step`` is 0 it holds stale
      values): read the open window through :attr:`accum`.
    skip_state: what ``should_skip_update_fn`` returned last (``()``).
    window: the open window's counters, an
      :class:`~weighted_accum.AccumState` with ``grads=None``.
    updated: bool, the last call applied a window.
    nonfinite: bool, the last call discarded a window: NaN/Inf sums (or
      updates, with ``skip_nonfinite_updates``), an unusable loss scale, or
      a mean that does not fit the inner optimizer's dtype.
    nonfinite_windows: int32, windows discarded so since ``init``.
    empty_windows: int32, closes of a zero-weight window (kept open).
    skipped: int32, microbatches skipped by ``should_skip_update_fn``.
    rejected: int32, microbatches refused under ``jit`` for an invalid
      weight since ``init`` (the window's own: ``window.rejected``).
    loss_scaler: the :class:`~weighted_accum.DynamicLossScale`, or ``None``.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any
  skip_state: Any
  window: AccumState
  updated: jax.Array
  nonfinite: jax.Array
  nonfinite_windows: jax.Array
  empty_windows: jax.Array
  skipped: jax.Array
  rejected: jax.Array
  loss_scaler: DynamicLossScale | None

  @property
  def accum(self) -> AccumState:
    """The open window as one :class:`~weighted_accum.AccumState`."""
    fresh = self.mini_step == 0  # buffers left by the close: unread
    return self.window.replace(
      grads=jax.tree.map(
        lambda b: jnp.where(fresh, jnp.zeros((), b.dtype), b), self.acc_grads
      )
    )

  @property
  def inner_state(self) -> Any:
    """Alias of :attr:`inner_opt_state`."""
    return self.inner_opt_state


def checked(state: Any, what: str) -> WeightedMultiStepsState:
  """``state`` if it is the wrapper's state; refused by name (optax's too)."""
  hint = "Pass wa.WeightedMultiSteps' state (or nnx.Optimizer(...).opt_state)."
  if isinstance(state, optax.MultiStepsState):
    hint += " For optax.MultiSteps' use optax.MultiSteps(...).has_updated."
  return validation.instance(
    state, WeightedMultiStepsState, what=f"{what}(state)", hint=hint
  )


# Fields a nnx.State drops: it keeps no empty subtree and no None.
_ABSENT = {"skip_state": (), "loss_scaler": None}


def view(state: Any) -> Any:
  """``state`` unwrapped; a wrapper state held as an ``nnx.State`` rebuilt."""
  plain = tree_utils.unwrap_variables(state)
  if not (isinstance(plain, Mapping) and {"acc_grads", "window"} <= set(plain)):
    return plain
  buffers = jax.tree.leaves(plain["acc_grads"])
  dtype = buffers[0].dtype if buffers else jnp.float32
  window = AccumState(grads=None, dtype=dtype, **dict(plain["window"]))
  fields = {
    f: plain[f] if f in plain else _ABSENT.get(f)
    for f in WeightedMultiStepsState._fields
  }
  return WeightedMultiStepsState(**{**fields, "window": window})


def _children(tree: Any) -> list:
  """``tree``'s children, one level down (``None`` kept as a child)."""
  return jax.tree.leaves(tree, is_leaf=lambda x: x is not tree or x is None)


def rewrap(like: Any, new: Any) -> Any:
  """``new`` (shaped like ``view(like)``) in ``like``'s Variables and maps."""
  if tree_utils.is_variable(like):
    return like.replace(rewrap(like.get_value(), new))
  if isinstance(like, Mapping):
    get = new.__getitem__ if isinstance(new, Mapping) else new.__getattribute__
    return type(like)({k: rewrap(v, get(k)) for k, v in like.items()})
  if like is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(like)):
    return new
  parts = [rewrap(a, b) for a, b in zip(_children(like), _children(new))]
  return jax.tree.unflatten(
    jax.tree.structure(like, is_leaf=lambda x: x is not like), parts
  )
