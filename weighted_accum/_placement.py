"""Where the leaves of a newly born state live: committed like the params.

``jax.jit`` keys its cache on whether each argument is committed to a device
and on its sharding, and a jitted step's outputs are committed as soon as one
input is. A state whose buffers are committed but whose scalars are not (as
``jnp.asarray(0)`` makes them) therefore enters a user's step in one form and
leaves it in another, and the second call compiles again. Every way a state
is born (``init``, ``from_buffers``, a checkpoint restore, the optax
wrapper's ``init``) places its leaves as a step would return them: committed
when the params are, scalars replicated over the params' devices.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import SingleDeviceSharding

from weighted_accum._tree import is_traced


def _committed_arrays(tree: Any) -> list[jax.Array]:
  return [
    x
    for x in jax.tree.leaves(tree)
    if isinstance(x, jax.Array) and not is_traced(x) and x.committed
  ]


def replicated_sharding(tree: Any) -> jax.sharding.Sharding | None:
  """The sharding ``jit`` gives a scalar computed from ``tree``'s arrays.

  Replicated over the devices of ``tree``'s first committed array (its mesh
  for a ``NamedSharding``); ``None`` when no array of ``tree`` is committed
  (``jit`` then leaves its outputs uncommitted as well).
  """
  committed = _committed_arrays(tree)
  if not committed:
    return None
  s = committed[0].sharding
  if isinstance(s, NamedSharding):
    return NamedSharding(s.mesh, PartitionSpec(), memory_kind=s.memory_kind)
  if isinstance(s, SingleDeviceSharding):
    return s
  devices = sorted(s.device_set, key=lambda d: d.id)
  if len(devices) == 1:
    return SingleDeviceSharding(devices[0], memory_kind=s.memory_kind)
  mesh = jax.sharding.Mesh(devices, ("_replicas",))
  return NamedSharding(mesh, PartitionSpec(), memory_kind=s.memory_kind)


def commit_like(tree: Any, params: Any) -> Any:
  """``tree`` with its concrete uncommitted scalars committed like ``params``.

  Other leaves are returned as they are (arrays shaped like a param follow
  that param's placement already: ``jnp.zeros_like`` keeps it); nothing
  changes when no leaf of ``params`` is committed.
  """
  sharding = replicated_sharding(params)
  if sharding is None:
    return tree

  def place(x):
    if (
      isinstance(x, jax.Array)
      and not is_traced(x)
      and x.ndim == 0
      and not x.committed
    ):
      return jax.device_put(x, sharding)
    return x

  return jax.tree.map(place, tree)
