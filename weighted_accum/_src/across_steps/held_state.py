"""The optax wrapper's state as Flax NNX holds it: :func:`view` reads
``nnx.Optimizer(...).opt_state`` (``nnx.Variable`` leaves) or its
``nnx.State`` mapping as the plain state; :func:`rewrap` gives a changed
state back in the caller's Variables and mappings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from weighted_accum._src.across_steps.wrapper_state import (
  WeightedMultiStepsState,
)
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState

# Fields a nnx.State drops: it keeps no empty subtree and no None.
_ABSENT = {"skip_state": (), "loss_scaler": None}


def _is_wrapper_mapping(x: Any) -> bool:
  return isinstance(x, Mapping) and {"acc_grads", "window"} <= set(x.keys())


def view(state: Any) -> Any:
  """``state`` unwrapped; a wrapper state held as an ``nnx.State`` rebuilt."""
  plain = tree_utils.unwrap_variables(state)
  if not _is_wrapper_mapping(plain):
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
