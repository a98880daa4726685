"""Local gradients inside ``jax.shard_map``: ``local_grad``,
``local_value_and_grad`` and ``is_reduced``.

Inside ``shard_map`` with varying types, autodiff SUMS the gradient of an
unvarying (replicated) param over the data axis. These functions tell the
two kinds of gradient apart and differentiate each replica's own loss, so a
per-replica window reduces once (``docs/scaling.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils as _tree
from weighted_accum._src.errors import WeightedAccumulationError

AxisName = str | Sequence[str]


def _axes(axis_name: Any, what: str) -> tuple[str, ...]:
  return validation.bound_axes(axis_name, what=what)


def leaf_status(
  leaves: list[Any], paths: list[str], axes: tuple[str, ...], what: str
) -> bool:
  """True when all leaves are already reduced over ``axes``, False when all are
  local; raises for a mixture."""
  if not _tree.vma_checked(axes):
    return False
  status = None
  for path, x in zip(paths, leaves):
    v = _tree.varying_axes(x) & set(axes)
    if v and v != set(axes):
      raise WeightedAccumulationError(
        f"{what}: leaf {path} varies over {sorted(v)} but not over "
        f"{sorted(set(axes) - v)}; gradients must be either all local "
        f"(varying over every axis of {axes}) or all already reduced. Get "
        "them with weighted_accum.distributed.local_grad."
      )
    reduced = not v
    if status is None:
      status = (path, reduced)
    elif status[1] != reduced:
      kind = lambda r: "already reduced (unvarying)" if r else "local (varying)"
      raise WeightedAccumulationError(
        f"{what}: leaf {path} is {kind(reduced)} over {axes} but leaf "
        f"{status[0]} is {kind(status[1])}. Differentiate with respect to "
        "all params in one way: weighted_accum.distributed.local_grad casts "
        "them all to varying."
      )
  return bool(status and status[1])


# ---------------------------------------------------------------- autodiff --


def is_reduced(grads: Any, axis_name: AxisName) -> bool:
  """Whether ``grads`` were already summed over ``axis_name`` by autodiff.

  Inside ``jax.shard_map`` (``check_vma=True``) the gradient with respect to
  a param that is unvarying over the axis (passed with ``P()``) comes out
  unvarying: autodiff summed it over the replicas. Local gradients (params
  cast to varying, see :func:`local_grad`) vary over the axis.

  Args:
    grads: a gradient tree computed inside ``shard_map``.
    axis_name: the data axis name, or a tuple of names.

  Returns:
    True for already-reduced gradients, False for local ones (and always
    False under ``check_vma=False``, where autodiff does not reduce).

  Raises:
    WeightedAccumulationError: for an unbound axis, or a tree mixing local
      and reduced leaves (naming the leaf).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from weighted_accum import distributed as dist
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> loss = lambda p, x: jnp.sum(x * p)
    >>> seen = []
    >>> def f(p, x):
    ...   seen.append(dist.is_reduced(jax.grad(loss)(p, x), 'data'))
    ...   seen.append(dist.is_reduced(dist.local_grad(loss, 'data')(p, x),
    ...                               'data'))
    ...   return p
    >>> _ = jax.eval_shape(jax.shard_map(
    ...     f, mesh=mesh, in_specs=(P(), P('data')), out_specs=P()),
    ...     jnp.ones(()), jnp.ones(len(mesh.devices)))
    >>> seen
    [True, False]
  """
  axes = _axes(axis_name, "is_reduced")
  leaves = jax.tree.leaves(grads)
  return leaf_status(leaves, _tree.leaf_paths(grads), axes, "is_reduced(grads)")


def _cast_args(
  args: tuple, argnums: int | Sequence[int], axes: tuple[str, ...]
) -> tuple:
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  args = list(args)
  for i in nums:
    args[i] = _tree.to_varying(args[i], axes)
  return tuple(args)


def _on_local_params(
  fn: Callable[..., Any], axis_name: AxisName, argnums: Any, what: str
) -> Callable[..., Any]:
  """``fn`` called with its differentiated arguments cast to varying."""

  def wrapped(*args, **kwargs):
    axes = _axes(axis_name, what)
    return fn(*_cast_args(args, argnums, axes), **kwargs)

  return wrapped


def local_grad(
  fun: Callable[..., Any],
  axis_name: AxisName,
  *,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.grad`` that returns this replica's own gradient inside shard_map.

  Casts the differentiated arguments to varying over ``axis_name`` first
  (``jax.lax.pcast(..., to='varying')``; leaves that already vary are left
  alone), so autodiff does NOT sum the gradient over the replicas. Feed the
  result to the core or distributed ``accumulate_*`` and reduce once per
  window with :func:`finish_mean`.

  Args:
    fun: the loss, as for ``jax.grad``.
    axis_name: the data axis name, or a tuple of names.
    argnums: which positional arguments to differentiate.
    has_aux: as for ``jax.grad``.

  Returns:
    A function with ``fun``'s signature returning the local gradient (and
    the aux value when ``has_aux``).

  Raises:
    WeightedAccumulationError: when called where ``axis_name`` is not bound.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from weighted_accum import distributed as dist
    >>> n = jax.device_count()
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> loss = lambda p, x: jnp.sum(x * p)
    >>> f = jax.jit(jax.shard_map(
    ...     lambda p, x: jax.lax.psum(dist.local_grad(loss, 'data')(p, x),
    ...                               'data'),
    ...     mesh=mesh, in_specs=(P(), P('data')), out_specs=P()))
    >>> float(f(jnp.ones(()), jnp.ones(n))) == n   # the sum of n local grads
    True
  """
  grad_fn = jax.grad(fun, argnums=argnums, has_aux=has_aux)
  return _on_local_params(grad_fn, axis_name, argnums, "local_grad")


def local_value_and_grad(
  fun: Callable[..., Any],
  axis_name: AxisName,
  *,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` with this replica's own gradient; see
  :func:`local_grad`.

  Args:
    fun: the loss, as for ``jax.value_and_grad``.
    axis_name: the data axis name, or a tuple of names.
    argnums: which positional arguments to differentiate.
    has_aux: as for ``jax.value_and_grad``.

  Returns:
    A function returning ``(value, local_grads)`` (value is ``(loss, aux)``
    when ``has_aux``); the value is this replica's local loss.

  Raises:
    WeightedAccumulationError: when called where ``axis_name`` is not bound.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from weighted_accum import distributed as dist
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> loss = lambda p, x: jnp.sum(x * p)
    >>> def f(p, x):
    ...   value, g = dist.local_value_and_grad(loss, 'data')(p, x)
    ...   return jax.lax.psum((value, g), 'data')  # local values, summed once
    >>> x = jnp.arange(len(mesh.devices), dtype=jnp.float32)
    >>> total, grad = jax.jit(jax.shard_map(
    ...     f, mesh=mesh, in_specs=(P(), P('data')), out_specs=P()))(
    ...         jnp.ones(()), x)
    >>> bool(total == x.sum()), bool(grad == x.sum())
    (True, True)
  """
  vg_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
  return _on_local_params(vg_fn, axis_name, argnums, "local_value_and_grad")
