"""Local gradients inside ``jax.shard_map``: autodiff SUMS the gradient of a
param unvarying over the data axis; ``local_grad`` differentiates each
replica's own loss and ``is_reduced`` tells the two apart
(``docs/scaling.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils as _tree
from weighted_accum._src.errors import WeightedAccumulationError

AxisName = str | Sequence[str]


def leaf_status(
  leaves: list[Any], paths: list[str], axes: tuple[str, ...], what: str
) -> bool:
  """Whether all leaves are reduced over ``axes`` (False: all local)."""
  if not _tree.vma_checked(axes):
    return False
  status = None
  for path, x in zip(paths, leaves):
    v = _tree.varying_axes(x) & set(axes)
    if v and v != set(axes):
      raise WeightedAccumulationError(
        f"{what}: leaf {path} varies over {sorted(v)} but not over "
        f"{sorted(set(axes) - v)}: get all-local grads with local_grad."
      )
    if status is None:
      status = (path, not v)
    elif status[1] == bool(v):
      raise WeightedAccumulationError(
        f"{what}: leaf {path} is {'local' if v else 'reduced'} over {axes} "
        f"but leaf {status[0]} is not: differentiate with local_grad."
      )
  return bool(status and status[1])


def is_reduced(grads: Any, axis_name: AxisName) -> bool:
  """Whether ``grads`` were already summed over ``axis_name`` by autodiff.

  Inside ``jax.shard_map`` (``check_vma=True``) the gradient of a param
  unvarying over the axis (``P()``) comes out unvarying: summed over the
  replicas. Local gradients (:func:`local_grad`) vary over the axis.

  Args:
    grads: a gradient tree computed inside ``shard_map``.
    axis_name: the data axis name, or a tuple of names.

  Returns:
    True for already-reduced gradients, False for local ones (and always
    under ``check_vma=False``, where autodiff does not reduce).

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
  axes = validation.bound_axes(axis_name, what="is_reduced")
  paths = _tree.leaf_paths(grads)
  return leaf_status(jax.tree.leaves(grads), paths, axes, "is_reduced(grads)")


def _on_local_params(fn: Callable[..., Any], axis_name, argnums, what: str):
  """``fn`` called with its differentiated arguments cast to varying."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

  def wrapped(*args, **kwargs):
    axes = validation.bound_axes(axis_name, what=what)
    args = [
      _tree.to_varying(a, axes) if i in nums else a for i, a in enumerate(args)
    ]
    return fn(*args, **kwargs)

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
  (``jax.lax.pcast(..., to='varying')``), so autodiff does NOT sum the
  gradient over the replicas; the window reduces once at its close.

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
    >>> mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    >>> loss = lambda p, x: jnp.sum(x * p)
    >>> def f(p, x):  # local values and grads, summed once
    ...   g = dist.local_grad(loss, 'data')(p, x)
    ...   return jax.lax.psum(dist.local_value_and_grad(loss, 'data')(p, x)
    ...                       + (g,), 'data')
    >>> x = jnp.arange(len(mesh.devices), dtype=jnp.float32)
    >>> total, grad, grad2 = jax.jit(jax.shard_map(
    ...     f, mesh=mesh, in_specs=(P(), P('data')), out_specs=P()))(
    ...         jnp.ones(()), x)
    >>> bool(total == x.sum()), bool(grad == x.sum()), bool(grad2 == grad)
    (True, True, True)
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
  """``jax.value_and_grad`` with this replica's own gradient.

  See :func:`local_grad` (its example uses both).

  Args:
    fun: the loss, as for ``jax.value_and_grad``.
    axis_name: the data axis name, or a tuple of names.
    argnums: which positional arguments to differentiate.
    has_aux: as for ``jax.value_and_grad``.

  Returns:
    A function returning ``(value, local_grads)``, the value this replica's
    loss (``(loss, aux)`` when ``has_aux``).

  Raises:
    WeightedAccumulationError: when called where ``axis_name`` is not bound.

  Example:
    See :func:`local_grad`.
  """
  vg_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
  return _on_local_params(vg_fn, axis_name, argnums, "local_value_and_grad")
