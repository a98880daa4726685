"""The saved form of a tree of windows: each ``AccumState`` as ``{'grads',
'counters'}``, its work dtype and placement in the item's options; the
templates (:func:`abstract_state`) and the checks of restored windows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
import numpy as np
import orbax.checkpoint as ocp

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils as _tree
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel import spmd_layout

#: Key of this library's options in the item's Orbax custom metadata.
OPTIONS_KEY = "weighted_accum"
#: The format version written. Version 2 adds each state's placement (a
#: version-1 item holds global windows only); the counters are those of
#: ``AccumState``'s counter fields (``base.COUNTERS``).
FORMAT_VERSION = 2
#: Format versions this module can read.
SUPPORTED_FORMAT_VERSIONS = (1, FORMAT_VERSION)

GRADS = "grads"
COUNTERS = "counters"
#: The per-replica counters of a stacked window (shape ``(N,)``).
PER_REPLICA = base.PER_REPLICA


def abstract_state(
  params: Any,
  dtype: DTypeLike = jnp.float32,
  *,
  axis_name: str | tuple[str, ...] | None = None,
) -> AccumState:
  """An abstract ``AccumState`` for ``params``, each array on its sharding.

  Unlike ``jax.eval_shape(wa.init, params)`` it keeps the shardings, so
  :class:`AccumRestore` places every buffer where ``wa.init`` would.

  Args:
    params: arrays or ``jax.ShapeDtypeStruct``s (sharded or not), e.g. the
      new run's params, on any mesh.
    dtype: the work dtype the checkpoint was saved in.
    axis_name: ``None`` for a global window; the data axes of a stacked
      per-replica window (as given to ``wa.init`` outside ``shard_map``).

  Returns:
    An ``AccumState`` of ``jax.ShapeDtypeStruct`` leaves.

  Raises:
    WeightedAccumulationError: as :func:`weighted_accum.init`.

  Example:
    >>> import jax.numpy as jnp
    >>> from weighted_accum.checkpoint import abstract_state
    >>> t = abstract_state({'w': jnp.zeros((2, 3))}, jnp.bfloat16)
    >>> t.grads['w'].shape, t.grads['w'].dtype, t.dtype
    ((2, 3), dtype(bfloat16), dtype(bfloat16))
  """
  shapes = jax.eval_shape(
    functools.partial(accumulation.init, dtype=dtype), params
  )
  if axis_name is None:
    with_sharding = lambda sds, p: jax.ShapeDtypeStruct(
      sds.shape, sds.dtype, sharding=getattr(p, "sharding", None)
    )
    return shapes.replace(
      grads=jax.tree.map(with_sharding, shapes.grads, params)
    )
  what = "abstract_state(axis_name=...)"
  axes = validation.axis_names(axis_name, what=what)
  mesh = replicas.caller_mesh(params)  # a param's, else set_mesh's
  if mesh is None or not set(axes) <= set(mesh.axis_names):
    raise WeightedAccumulationError(
      f"{what}: no param is on a mesh with the axes {axes} and none is set "
      "(jax.set_mesh): pass params with their NamedShardings."
    )
  n = spmd_layout.size(mesh, axes)

  def sds(shape, dtype, spec):
    return jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, spec)
    )

  def stacked(x, p):
    spec = replicas.stacked_spec(p, axes)
    return sds((n,) + x.shape, x.dtype, spec)

  def counter(name):
    x = getattr(shapes, name)
    if name in PER_REPLICA:
      return sds((n,), x.dtype, P(spmd_layout.entry(axes)))
    return sds(x.shape, x.dtype, P())

  return shapes.replace(
    grads=jax.tree.map(stacked, shapes.grads, params),
    placement=replicas.placement_on(mesh, axes),
    **{name: counter(name) for name in base.NAMES},
  )


# ------------------------------------------------------------- the tree --


def is_accum(x: Any) -> bool:
  return isinstance(x, AccumState)


def key(path: tuple[str, ...]) -> str:
  """The key of a node in the saved options (``''`` for the root)."""
  return "/".join(str(k).replace("~", "~0").replace("/", "~1") for k in path)


def unkey(k: str) -> tuple[str, ...]:
  """The path of a :func:`key`."""
  if not k:
    return ()
  return tuple(p.replace("~1", "/").replace("~0", "~") for p in k.split("/"))


def show(path: tuple[str, ...]) -> str:
  return "".join(f"[{k!r}]" for k in path) or "<root>"


def unwrap(x: Any) -> Any:
  """The value of an ``nnx.Variable`` (as in ``nnx.Optimizer.opt_state``)."""
  get = getattr(x, "get_value", None)
  return get() if callable(get) else x


def rewrap(like: Any, value: Any) -> Any:
  """``value`` in ``like``'s ``nnx.Variable`` wrapper, if it has one."""
  if callable(getattr(like, "get_value", None)) and hasattr(like, "replace"):
    return like.replace(value)
  return value


def plain_counters(s: AccumState) -> dict[str, Any]:
  """The counters unwrapped from ``nnx.Variable``s, as they are saved."""
  return {k: unwrap(v) for k, v in s.counters.items()}


def accum_nodes(tree: Any) -> dict[tuple[str, ...], tuple[str, AccumState]]:
  """``{Orbax path: (readable path, state)}`` for each AccumState in tree."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_accum)
  keys = ocp.tree.to_flat_dict(tree, is_leaf=is_accum)
  return {
    k: (_tree.path_str(p), node)
    for (p, node), k in zip(flat, keys)
    if is_accum(node)
  }


def split(tree: Any, counters: Any) -> Any:
  """Replaces each AccumState by ``{'grads': ..., 'counters': {...}}``."""

  def one(x):
    if is_accum(x):
      return {GRADS: x.grads, COUNTERS: counters(x)}
    return x

  return jax.tree.map(one, tree, is_leaf=is_accum)


def host_counters(s: AccumState) -> dict[str, Any]:
  """The counters in their stored dtype, for saving."""
  s = jax.tree.map(unwrap, s)
  out = {}
  for name in base.NAMES:
    value, dt = getattr(s, name), base.dtype_of(name, s.dtype)
    if np.ndim(value) and isinstance(value, jax.Array):
      out[name] = value if value.dtype == dt else value.astype(dt)
    else:
      out[name] = np.array(value, dt)
  return out


# -------------------------------------------------------- the placement --


def placement_options(s: AccumState) -> dict[str, Any]:
  """What the metadata says of ``s``'s placement (JSON)."""
  pl = s.placement
  out = {"kind": pl.kind, "axes": list(pl.axes), "reduce": pl.reduce}
  if pl.kind == base.STACKED:
    out["replicas"] = int(np.shape(unwrap(s.weight_hi))[0])
  return out


def _describe(options: dict[str, Any]) -> str:
  kind, axes = options.get("kind"), tuple(options.get("axes", ()))
  if kind == base.STACKED:
    return f"a stacked window of {options.get('replicas')} replicas over {axes}"
  if kind == base.REPLICA:
    return (
      f"a per-replica window (reduce={options.get('reduce')!r}) over {axes}"
    )
  return "a global window"


def check_placement(saved: Any, t: AccumState, shown: str, where: str) -> None:
  """Refuses a template of another kind, replica count or reduce mode."""
  if saved is None:  # format version 1: global windows only
    saved = {"kind": base.GLOBAL, "axes": [], "reduce": "window"}
  if not isinstance(saved, dict) or saved.get("kind") not in base.KINDS:
    raise WeightedAccumulationError(
      f"{where}: option 'placement' of the AccumState at {shown} is "
      f"malformed ({saved!r})."
    )
  want = placement_options(jax.tree.map(unwrap, t))
  same = saved["kind"] == want["kind"] and (
    saved.get("replicas") == want.get("replicas")
    if want["kind"] == base.STACKED
    else want["kind"] == base.GLOBAL or saved.get("reduce") == want["reduce"]
  )
  if not same:
    raise WeightedAccumulationError(
      f"{where}: the checkpoint holds {_describe(saved)} at {shown}, the "
      f"template is {_describe(want)}: restore into a template of that kind "
      "(abstract_state(params, dtype, axis_name=...)), or close the window "
      "before saving."
    )


# ------------------------------------------------------------- leaves --


def check_leaf(
  leaf: Any, m: Any, role: str, expect: np.dtype | None, shown: str, where: str
) -> None:
  """Refuses a leaf whose dtype or shape differs (Orbax would convert it)."""
  got = np.dtype(jnp.result_type(leaf))
  if role == "buffer" and got != expect:
    raise WeightedAccumulationError(
      f"{where}: template leaf {shown} has dtype {got}, expected the work "
      f"dtype {expect}: use abstract_state(params, dtype)."
    )
  if np.shape(leaf) != tuple(m.shape):
    raise WeightedAccumulationError(
      f"{where}: leaf {shown} has shape {tuple(m.shape)} in the checkpoint, "
      f"{np.shape(leaf)} in the template."
    )
  if expect is not None and np.dtype(m.dtype) != expect:
    raise WeightedAccumulationError(
      f"{where}: leaf {shown} was saved as {np.dtype(m.dtype)}, the template "
      f"has {expect}: use a template of the saved dtype."
    )


def role(
  k: tuple[str, ...],
  leaf: Any,
  states: dict[tuple[str, ...], tuple[str, AccumState]],
) -> tuple[str, np.dtype | None]:
  """What a saved leaf is ('buffer', 'counter', 'other') and its dtype."""
  for path, (_, s) in states.items():
    n = len(path)
    if k[:n] == path and len(k) > n:
      if k[n] == GRADS:
        return "buffer", np.dtype(s.dtype)
      return "counter", base.dtype_of(k[n + 1], s.dtype)
  if isinstance(leaf, (bool, int, float, complex)):
    # Python scalars: Orbax stores int as int64, float as float64.
    return "other", np.dtype(type(leaf))
  return "other", np.dtype(jnp.result_type(leaf))


def uncommitted(x: Any) -> bool:
  """An uncommitted array (as the scalars of a fresh ``wa.init``)."""
  return isinstance(x, jax.Array) and not x.committed


def like(template_leaf: Any, value: Any) -> Any:
  """Gives a restored leaf the template leaf's type (and placement)."""
  if uncommitted(template_leaf):
    return jnp.asarray(value)
  if isinstance(template_leaf, (bool, int, float, complex)) and not isinstance(
    value, type(template_leaf)
  ):
    return type(template_leaf)(np.asarray(value).item())
  if isinstance(template_leaf, np.generic):
    return np.asarray(value, template_leaf.dtype)[()]
  return value


# ------------------------------------------------- a restored stacked window --


def stacked_counters(
  saved: dict[str, Any], work_dtype: Any, here: str
) -> dict[str, np.ndarray]:
  """A stacked window's saved counters, validated replica by replica."""
  n = int(np.shape(saved["weight_hi"])[0])
  rows = []
  for r in range(n):
    one = {
      k: (np.asarray(v)[r] if k in PER_REPLICA else v) for k, v in saved.items()
    }
    rows.append(
      validation.saved_counters(
        one,
        base.COUNTERS,
        lambda name: base.dtype_of(name, work_dtype),
        what=f"{here}, counters of replica {r}",
      )
    )
  return {
    name: (
      np.stack([row[name] for row in rows])
      if name in PER_REPLICA
      else rows[0][name]
    )
    for name in base.NAMES
  }


def check_stacked_buffers(grads: Any, weight: np.ndarray, here: str) -> None:
  """Only positive-weight microbatches add to a replica's buffers."""
  empty = np.asarray(weight) == 0
  if not empty.any():
    return
  for path, b in _tree.flat(grads):
    held = np.asarray(
      jnp.any(numerics.nonzero(b).reshape(b.shape[0], -1), axis=1)
    )
    bad = np.flatnonzero(held & empty)
    if bad.size:
      raise WeightedAccumulationError(
        f"{here}: leaf grads{path} is non-zero on replica {int(bad[0])}, "
        "whose weight is 0: the checkpoint is corrupt."
      )


def place_counter(like_leaf: Any, value: Any, grads: Any) -> Any:
  """A stacked window's counter on the template's or the buffers' mesh."""
  sharding = getattr(like_leaf, "sharding", None)
  if sharding is None:
    first = next(iter(jax.tree.leaves(grads)), None)
    s = getattr(first, "sharding", None)
    if isinstance(s, NamedSharding):
      spec = P(s.spec[0]) if np.ndim(value) else P()
      sharding = NamedSharding(s.mesh, spec)
  value = jnp.asarray(value)
  return value if sharding is None else jax.device_put(value, sharding)
