"""The data axes of a mesh: where the mesh is, the axis types, and how a
param's ``PartitionSpec`` lays it over the data axes (FSDP).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils
from weighted_accum._src.errors import WeightedAccumulationError

Axes = tuple[str, ...]


class Leaf(NamedTuple):
  """One param leaf's layout over the data axes."""

  spec: Any
  dim: int | None = None
  scatter: Axes = ()


def names(entry: Any) -> Axes:
  """The mesh axes of one ``PartitionSpec`` entry."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def entry(axes: Axes) -> Any:
  """Axes as one ``PartitionSpec`` entry."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def without(spec: Any, axes: Axes) -> P:
  """``spec`` with the ``axes`` removed (what is left once gathered)."""
  out = []
  for e in spec:
    rest = tuple(a for a in names(e) if a not in axes)
    out.append(rest[0] if len(rest) == 1 else (rest or None))
  return P(*out)


def leaf(spec: Any, axes: Axes, ndim: int, path: str, *, what: str) -> Leaf:
  """A param's layout from its spec (data axes on one dimension, leading)."""
  if spec is None:
    return Leaf(None)
  if len(spec) > ndim:
    raise WeightedAccumulationError(
      f"{what}: param {path} has {ndim} dimension(s) but its spec {spec} "
      f"names {len(spec)}."
    )
  hits = [
    (i, names(e)) for i, e in enumerate(spec) if set(names(e)) & set(axes)
  ]
  if not hits:
    return Leaf(spec)
  dim, on = hits[0]
  lead = on[: next((j for j, a in enumerate(on) if a not in axes), len(on))]
  if len(hits) > 1 or set(on[len(lead) :]) & set(axes):
    raise WeightedAccumulationError(
      f"{what}: param {path} has spec {spec}; shard it over the data axes "
      f"{axes} on one dimension, before any other axis there."
    )
  return Leaf(spec, dim, lead)


def find_mesh(arrays: list[Any], axes: Axes, *, what: str) -> Any:
  """The arrays' (types') mesh, else the context mesh, that has ``axes``."""
  found = []
  for x in arrays:
    try:
      found.append(jax.typeof(x).sharding.mesh)
    except (AttributeError, TypeError):
      continue
  for m in found + [jax.sharding.get_abstract_mesh()]:
    if m is not None and all(a in m.axis_names for a in axes):
      return m
  raise WeightedAccumulationError(
    f"{what}: the arrays are not on a mesh with the axes {axes}: "
    "jax.device_put them on one, or call under jax.set_mesh(mesh)."
  )


def size(mesh: Any, axes: Axes) -> int:
  """The number of replicas over ``axes``."""
  return math.prod(mesh.shape[a] for a in axes)


def explicit(mesh: Any, axes: Axes, *, what: str) -> bool:
  """Whether the data axes are ``Explicit`` (all of them) or not (none)."""
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  flags = {kinds[a] == AxisType.Explicit for a in axes}
  if len(flags) > 1:
    raise WeightedAccumulationError(
      f"{what}: the data axes {axes} mix Explicit and Auto types; use one."
    )
  return flags.pop()


def plan(leaves: tuple[Leaf, ...], axes: Axes, *, scattered: bool) -> tuple:
  """How a window's close reduces each buffer (``window.psum_window``)."""
  out = []
  for e in leaves:
    if not e.scatter:
      out.append(None)
      continue
    rest = tuple(a for a in axes if a not in e.scatter)
    out.append(
      tree_utils.LeafReduce(rest, () if scattered else e.scatter, e.dim)
    )
  return tuple(out)


def grad_spec(e: Leaf) -> P:
  """A gradient's ``shard_map`` out spec (the manual data axes only)."""
  if not e.scatter:
    return P()
  return P(*([None] * e.dim), entry(e.scatter))


FSDP_MODES = ("gather_once", "scatter_each")


class DataParallel:
  """The data-parallel part of an in-step window: its axes and FSDP layout.

  Pass it as ``microbatched_value_and_grad(..., axis_name=DataParallel(...))``
  where an axis name is not enough: the params' specs under plain ``jit`` on
  ``Auto`` axes, or how FSDP gradients are reduced. Frozen and hashable.

  Args:
    axis_name: the data axis name, or a tuple of names.
    param_specs: the params' ``PartitionSpec`` tree (``None`` leaves:
      replicated), or ``None`` (every param replicated over the data axes,
      or, on an ``Explicit`` mesh, read from the params' types).
    fsdp: ``"gather_once"`` (the default: a full-size per-replica carry,
      one reduce-scatter per call) or ``"scatter_each"`` (one reduce-scatter
      per microbatch into a carry of the param's shard).

  Raises:
    WeightedAccumulationError: for an invalid axis name, a ``param_specs``
      leaf that is not a ``PartitionSpec``, or an unknown ``fsdp``.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> from weighted_accum.distributed import DataParallel
    >>> dp = DataParallel('data', param_specs={'w': P('data')})
    >>> dp.axes, dp.fsdp
    (('data',), 'gather_once')
  """

  __slots__ = ("axes", "param_specs", "fsdp", "_key")

  def __init__(
    self,
    axis_name: str | Axes,
    *,
    param_specs: Any = None,
    fsdp: str = "gather_once",
  ) -> None:
    what = "DataParallel"
    axes = validation.axis_names(axis_name, what=f"{what}(axis_name)")
    specs = validation.partition_specs(param_specs, what=f"{what}(param_specs)")
    fsdp = validation.choice(
      fsdp,
      FSDP_MODES,
      what=what,
      name="fsdp",
      hint="Use 'gather_once' or 'scatter_each'.",
    )
    leaves, treedef = jax.tree.flatten(
      specs, is_leaf=lambda v: v is None or isinstance(v, P)
    )
    key = (axes, fsdp, treedef, tuple(leaves))
    for name, value in zip(self.__slots__, (axes, specs, fsdp, key)):
      object.__setattr__(self, name, value)

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(f"DataParallel is frozen; cannot set {name!r}")

  def __eq__(self, other: object) -> bool:
    return isinstance(other, DataParallel) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  def __repr__(self) -> str:
    return (
      f"DataParallel({self.axes!r}, param_specs={self.param_specs!r}, "
      f"fsdp={self.fsdp!r})"
    )
