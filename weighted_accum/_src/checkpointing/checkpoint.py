"""Orbax checkpointing of windows (``docs/checkpointing.md``): each
``AccumState`` saved as ``{'grads', 'counters'}``, its work dtype and
placement in the item's options; restored through ``from_buffers``' check."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from typing import Any

from etils import epath
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
from weighted_accum._src.core import loss_scale
from weighted_accum._src.core import tree_utils as _tree
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel import spmd_layout

#: Key of this library's options in the item's Orbax custom metadata.
OPTIONS_KEY = "weighted_accum"
#: The format written: version 2 adds each state's placement (version 1
#: holds global windows only); the counters are ``base.COUNTERS``.
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = (1, FORMAT_VERSION)
GRADS, COUNTERS = "grads", "counters"
SCALARS = (bool, int, float, complex)
_unwrap = _tree.unwrap_variables


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
    on = lambda x, p: x.update(sharding=getattr(p, "sharding", None))
    return shapes.replace(grads=jax.tree.map(on, shapes.grads, params))
  what = "abstract_state(axis_name=...)"
  axes = validation.axis_names(axis_name, what=what)
  mesh = replicas.caller_mesh(params)  # a param's, else set_mesh's
  if mesh is None or not set(axes) <= set(mesh.axis_names):
    raise WeightedAccumulationError(
      f"{what}: no param is on a mesh with the axes {axes} and none is set "
      "(jax.set_mesh): pass params with their NamedShardings."
    )
  n, row = spmd_layout.size(mesh, axes), P(spmd_layout.entry(axes))
  on = lambda x, shape, spec: x.update(
    shape=shape, sharding=NamedSharding(mesh, spec)
  )
  stacked = lambda x, p: on(x, (n, *x.shape), replicas.stacked_spec(p, axes))
  return shapes.replace(
    grads=jax.tree.map(stacked, shapes.grads, params),
    placement=replicas.placement_on(mesh, axes),
    **{
      k: on(x, (n,), row) if k in base.PER_REPLICA else on(x, (), P())
      for k, x in shapes.counters.items()
    },
  )


@dataclasses.dataclass
class AccumSave(ocp.args.CheckpointArgs):
  """Saves an ``AccumState`` (or a pytree holding some) as one Orbax item.

  Attributes:
    state: an :class:`~weighted_accum.AccumState`, mid-window or not, or any
      pytree whose ``AccumState`` nodes are saved with their work dtype (e.g.
      an optax wrapper's state). Concrete arrays only. Never modified.

  Example:
    >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
    >>> import weighted_accum as wa
    >>> from weighted_accum.checkpoint import AccumRestore, AccumSave
    >>> state = wa.accumulate_sum(wa.init({'w': jnp.zeros(2)}),
    ...                           {'w': jnp.ones(2)}, 3)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mngr:
    ...   _ = mngr.save(0, args=ocp.args.Composite(accum=AccumSave(state)))
    ...   mngr.wait_until_finished()
    ...   out = mngr.restore(0, args=ocp.args.Composite(
    ...       accum=AccumRestore(state)))
    >>> out.accum.total_weight, int(out.accum.issued)
    (3.0, 1)
  """

  state: Any


@dataclasses.dataclass
class AccumRestore(ocp.args.CheckpointArgs):
  """Restores what :class:`AccumSave` wrote, validated against a template.

  Attributes:
    template: the tree to restore into: a concrete ``AccumState`` (e.g. the
      current one) or an abstract one (:func:`abstract_state`, or
      ``jax.eval_shape(wa.init, params)``), or the same pytree of states that
      was saved. Each array is placed like its template leaf: on its
      sharding; a ``ShapeDtypeStruct`` without one gets the saved sharding
      when the current devices allow it; an uncommitted array comes back
      uncommitted. Dtypes, window kinds (``state.placement``) and replica
      counts must match the saved ones (a stacked window restores into
      ``abstract_state(params, dtype, axis_name=...)``). Never modified.

  Example:
    See :class:`AccumSave`.
  """

  template: Any = None


class AccumCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Orbax handler for :class:`AccumSave` / :class:`AccumRestore`.

  ``ocp.PyTreeCheckpointHandler`` (OCDBT, asynchronous commit) plus the
  windows' options in the item metadata and strict validation on restore;
  ``CheckpointManager`` builds it from the args.

  Example:
    >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
    >>> import weighted_accum as wa
    >>> from weighted_accum.checkpoint import (AccumCheckpointHandler,
    ...                                        AccumRestore, AccumSave)
    >>> path = tempfile.mkdtemp() + '/accum'
    >>> state = wa.init({'w': jnp.zeros(2)}, dtype=jnp.bfloat16)
    >>> with ocp.Checkpointer(AccumCheckpointHandler()) as ckptr:
    ...   ckptr.save(path, args=AccumSave(state))
    ...   out = ckptr.restore(path, args=AccumRestore(state))
    >>> out.dtype
    dtype(bfloat16)
  """

  def __init__(self, *, use_ocdbt: bool = True):
    """Creates the handler (``use_ocdbt``: TensorStore's OCDBT driver)."""
    self._impl = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)

  async def async_save(
    self, directory: epath.Path, args: AccumSave
  ) -> list[Any] | None:
    """Starts writing ``args.state``; arrays are on host when this returns.

    Args:
      directory: the item directory.
      args: :class:`AccumSave`.

    Returns:
      Commit futures that finish the write.

    Raises:
      WeightedAccumulationError: for a traced state, buffers not in the work
        dtype, or counters a restore would refuse; nothing is written.
    """
    return await self._impl.async_save(directory, args=_saveable(args))

  def save(self, directory: epath.Path, args: AccumSave) -> None:
    """Saves synchronously (see :meth:`async_save`)."""

    async def run():
      for f in await self.async_save(directory, args) or []:
        f.result()

    # A fresh thread has no running event loop (a notebook's main thread has).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      pool.submit(asyncio.run, run()).result()

  def finalize(self, directory: epath.Path) -> None:
    """Merges the per-process OCDBT files (called once all writes end)."""
    self._impl.finalize(directory)

  def metadata(self, directory: epath.Path) -> Any:
    """The saved tree's Orbax metadata (options under ``'weighted_accum'``)."""
    return self._impl.metadata(directory)

  def close(self) -> None:
    """Releases the underlying Orbax handler."""
    self._impl.close()

  def restore(
    self, directory: epath.Path, args: AccumRestore | None = None
  ) -> Any:
    """Restores into ``args.template``'s structure, placement and dtypes.

    Args:
      directory: the item directory.
      args: :class:`AccumRestore` with the template.

    Returns:
      A tree like the template: concrete ``AccumState`` values continuing the
      saved windows, other leaves as saved.

    Raises:
      WeightedAccumulationError: naming the item and the first bad leaf.
    """
    where = f"AccumRestore({directory})"
    template = None if args is None else args.template
    if template is None:
      raise WeightedAccumulationError(
        f"{where}: pass a template: the current state or abstract_state."
      )
    path = epath.Path(directory)
    if not path.is_dir():
      raise WeightedAccumulationError(
        f"{where}: the item directory does not exist."
      )
    try:
      meta = self._impl.metadata(path)
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise _damaged(where, "metadata", e) from e
    want = _accum_nodes(template)
    _check_states(want, _saved_states(meta.custom_metadata, where), where)
    target = _split(template, lambda s: _unwrap(s.counters))
    item = ocp.args.PyTreeRestore(
      item=target, restore_args=_restore_args(target, meta.tree, want, where)
    )
    try:
      restored = self._impl.restore(path, args=item)
    except Exception as e:  # pylint: disable=broad-exception-caught
      try:  # damaged files, or (they read back untemplated) another template
        self._impl.restore(path)
      except Exception as untemplated:  # pylint: disable=broad-exception-caught
        raise _damaged(where, "arrays", e) from untemplated
      raise WeightedAccumulationError(
        f"{where}: the files are intact but do not fit the template ({e!r}): "
        "build it like the saving run's state (same optimizer and containers)."
      ) from e
    out = jax.tree_util.tree_map_with_path(
      lambda p, t, r: (
        _restored(t, r, f"{where}: AccumState at {_tree.path_str(p)}")
        if _is_accum(t)
        else _like(t, r)
      ),
      template,
      restored,
      is_leaf=_is_accum,
    )
    loss_scale.check_restored(out, what=where)  # scale and tracker
    return out


ocp.args.register_with_handler(AccumCheckpointHandler, for_save=True)(AccumSave)
ocp.args.register_with_handler(AccumCheckpointHandler, for_restore=True)(
  AccumRestore
)


def _saveable(args: AccumSave) -> ocp.args.PyTreeSave:
  """What ``async_save`` writes, checked as a restore would check it."""
  if not isinstance(args, AccumSave):
    raise WeightedAccumulationError(
      f"AccumCheckpointHandler: got {type(args).__name__}, not AccumSave."
    )
  if any(_tree.is_traced(x) for x in jax.tree.leaves(args.state)):
    raise WeightedAccumulationError(
      "AccumSave: the state holds traced values; save it outside jit."
    )
  states = {}
  for key, (shown, s) in _accum_nodes(args.state).items():
    for path, leaf in _tree.flat(s.grads):
      if jnp.result_type(leaf) != s.dtype:
        raise WeightedAccumulationError(
          f"AccumSave: buffer {shown}.grads{path} has dtype "
          f"{jnp.result_type(leaf)}, expected the work dtype {s.dtype}."
        )
    _check_restorable(s, shown)
    dtype = jnp.dtype(s.dtype).name
    states[_key(key)] = {"dtype": dtype, "placement": _placement(s)}
  options = {"format_version": FORMAT_VERSION, "states": states}
  return ocp.args.PyTreeSave(
    _split(args.state, _host_counters), custom_metadata={OPTIONS_KEY: options}
  )


def _is_accum(x: Any) -> bool:
  return isinstance(x, AccumState)


def _key(path: tuple[str, ...]) -> str:
  """A node's key in the saved options (``''`` for the root)."""
  return "/".join(str(k).replace("~", "~0").replace("/", "~1") for k in path)


def _show(path: tuple[str, ...]) -> str:
  return "".join(f"[{k!r}]" for k in path) or "<root>"


def _accum_nodes(tree: Any) -> dict[tuple[str, ...], tuple[str, AccumState]]:
  """``{Orbax path: (readable path, state)}`` for each AccumState in tree."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_accum)
  keys = ocp.tree.to_flat_dict(tree, is_leaf=_is_accum)
  return {
    k: (_tree.path_str(p), x) for (p, x), k in zip(flat, keys) if _is_accum(x)
  }


def _split(tree: Any, counters: Any) -> Any:
  """Each AccumState as ``{'grads': ..., 'counters': counters(state)}``."""
  one = lambda x: {GRADS: x.grads, COUNTERS: counters(x)} if _is_accum(x) else x
  return jax.tree.map(one, tree, is_leaf=_is_accum)


def _host_counters(s: AccumState) -> dict[str, Any]:
  """The counters in their stored dtype, for saving."""
  s, out = _unwrap(s), {}
  for name, value in s.counters.items():
    dt = base.dtype_of(name, s.dtype)
    if np.ndim(value) and isinstance(value, jax.Array):
      out[name] = value if value.dtype == dt else value.astype(dt)
    else:
      out[name] = np.array(value, dt)
  return out


def _placement(s: AccumState) -> dict[str, Any]:
  """What the options say of ``s``'s placement (JSON)."""
  pl = s.placement
  out = {"kind": pl.kind, "axes": list(pl.axes), "reduce": pl.reduce}
  if pl.kind == base.STACKED:
    out["replicas"] = int(np.shape(_unwrap(s.weight_hi))[0])
  return out


def _describe(o: dict[str, Any]) -> str:
  axes = tuple(o.get("axes", ()))
  if o.get("kind") == base.STACKED:
    return f"a stacked window of {o.get('replicas')} replicas over {axes}"
  if o.get("kind") == base.REPLICA:
    return f"a per-replica window (reduce={o.get('reduce')!r}) over {axes}"
  return "a global window"


def _saved_states(custom: Any, where: str) -> dict[str, Any]:
  """The options' ``states``, their format version checked."""
  options = custom.get(OPTIONS_KEY) if isinstance(custom, dict) else None
  if not isinstance(options, dict):
    raise WeightedAccumulationError(
      f"{where}: no '{OPTIONS_KEY}' options: not written by AccumSave; "
      "restore it with the args it was saved with."
    )
  version = options.get("format_version")
  if version not in SUPPORTED_FORMAT_VERSIONS:
    raise WeightedAccumulationError(
      f"{where}: 'format_version' is {version!r}: upgrade weighted_accum."
    )
  states = options.get("states")
  if not isinstance(states, dict) or not all(
    isinstance(v, dict) and isinstance(v.get("dtype"), str)
    for v in states.values()
  ):
    raise WeightedAccumulationError(
      f"{where}: option 'states' is malformed ({states!r})."
    )
  return states


def _check_states(want: dict, saved: dict[str, Any], where: str) -> None:
  """The saved windows are the template's: paths, dtypes, placements."""
  keys = {_key(p): shown_s for p, shown_s in want.items()}
  only = [(keys[k][0], "template") for k in keys if k not in saved]
  for k in sorted(set(saved) - set(keys)):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in k.split("/")]
    only.append((_show(parts if k else []), "checkpoint"))
  for shown, has in only[:1]:
    raise WeightedAccumulationError(
      f"{where}: only the {has} has an AccumState at {shown}; restore into "
      "a template of the saved structure."
    )
  for key, (shown, s) in keys.items():
    here = f"{where}: the AccumState at {shown}"
    dtype = validation.work_dtype(
      saved[key]["dtype"], what=f"{here}, option 'dtype'"
    )
    if dtype != jnp.dtype(s.dtype):
      raise WeightedAccumulationError(
        f"{here} was saved in {dtype}, the template's work dtype is "
        f"{jnp.dtype(s.dtype)}: use abstract_state(params, dtype=jnp.{dtype})."
      )
    got = saved[key].get("placement")
    if got is None:  # format version 1: global windows only
      got = {"kind": base.GLOBAL, "axes": [], "reduce": "window"}
    if not isinstance(got, dict) or got.get("kind") not in base.KINDS:
      raise WeightedAccumulationError(
        f"{here}: option 'placement' is malformed ({got!r})."
      )
    t = _placement(s)
    if got["kind"] != t["kind"] or (
      got.get("replicas") != t.get("replicas")
      if t["kind"] == base.STACKED
      else t["kind"] != base.GLOBAL and got.get("reduce") != t["reduce"]
    ):
      raise WeightedAccumulationError(
        f"{where}: the checkpoint holds {_describe(got)} at {shown}, the "
        f"template is {_describe(t)}: restore into a template of that kind "
        "(abstract_state(..., axis_name=...)), or close the window first."
      )


def _restore_args(target: Any, saved: Any, want: dict, where: str) -> Any:
  """Orbax's restore args of every leaf, each checked against the saved one."""
  flat_target = ocp.tree.to_flat_dict(target)
  flat_meta = ocp.tree.to_flat_dict(saved)
  shown = dict(zip(flat_target, _tree.leaf_paths(target)))
  missing, extra = _tree.diff_paths(list(flat_target), list(flat_meta))
  if missing or extra:
    leaf = shown[missing[0]] if missing else _show(extra[0])
    raise WeightedAccumulationError(
      f"{where}: leaf {leaf} is {'missing from' if missing else 'extra in'} "
      f"the checkpoint ({len(missing)} missing, {len(extra)} extra): "
      "build the template from the params that were saved."
    )
  args = {
    k: _restore_arg(k, leaf, flat_meta[k], want, f"{where}: leaf {shown[k]}")
    for k, leaf in flat_target.items()
  }
  return ocp.tree.from_flat_dict(args, target=target)


def _role(k: tuple[str, ...], leaf: Any, want: dict) -> tuple[str, np.dtype]:
  """What a saved leaf is ('buffer', 'counter', 'other') and its dtype."""
  for path, (_, s) in want.items():
    n = len(path)
    if k[:n] == path and len(k) > n:
      if k[n] == GRADS:
        return "buffer", np.dtype(s.dtype)
      return "counter", base.dtype_of(k[n + 1], s.dtype)
  kind = type(leaf) if isinstance(leaf, SCALARS) else jnp.result_type(leaf)
  return "other", np.dtype(kind)  # Orbax: int as int64, float as float64


def _restore_arg(k: tuple, leaf: Any, m: Any, want: dict, here: str) -> Any:
  """A leaf's restore args, refused where Orbax would convert it."""
  role, expect = _role(k, leaf, want)
  got = np.dtype(jnp.result_type(leaf))
  if role == "buffer" and got != expect:
    raise WeightedAccumulationError(
      f"{here} has dtype {got} in the template, expected the work dtype "
      f"{expect}: use abstract_state(params, dtype)."
    )
  if np.shape(leaf) != tuple(m.shape):
    raise WeightedAccumulationError(
      f"{here} has shape {tuple(m.shape)} in the checkpoint, "
      f"{np.shape(leaf)} in the template."
    )
  if np.dtype(m.dtype) != expect:
    raise WeightedAccumulationError(
      f"{here} was saved as {np.dtype(m.dtype)}, the template has {expect}: "
      "use a template of the saved dtype."
    )
  if isinstance(leaf, SCALARS):
    return ocp.RestoreArgs(restore_type=type(leaf))
  array = isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
  if role == "counter" or not array or _uncommitted(leaf):  # placed later
    return ocp.RestoreArgs(restore_type=np.ndarray)
  sharding, saved = leaf.sharding, getattr(m, "sharding", None)
  if sharding is None and saved is not None:
    try:
      sharding = saved.to_jax_sharding()
    except ValueError as e:
      raise WeightedAccumulationError(
        f"{here} has no sharding in the template and the saved one "
        f"({saved}) does not fit these devices: use abstract_state(params)."
      ) from e
  if sharding is None:
    return ocp.RestoreArgs(restore_type=np.ndarray)
  return ocp.ArrayRestoreArgs(
    restore_type=jax.Array,
    sharding=sharding,
    global_shape=tuple(leaf.shape),
    strict=True,
  )


def _uncommitted(x: Any) -> bool:
  """An uncommitted array (as the scalars of a fresh ``wa.init``)."""
  return isinstance(x, jax.Array) and not x.committed


def _like(t: Any, value: Any) -> Any:
  """A restored leaf of the template leaf's type (and placement)."""
  if _uncommitted(t):
    return jnp.asarray(value)
  if isinstance(t, SCALARS) and not isinstance(value, type(t)):
    return type(t)(np.asarray(value).item())
  if isinstance(t, np.generic):
    return np.asarray(value, t.dtype)[()]
  return value


def _check_restorable(s: AccumState, shown: str) -> None:
  """Refuses to save a window that :class:`AccumRestore` would refuse."""
  saved = {GRADS: _unwrap(s.grads), COUNTERS: _host_counters(s)}
  _checked(s, saved, f"AccumSave: the AccumState at {shown} (not saved)")


def _checked(t: AccumState, r: dict[str, Any], here: str) -> dict[str, Any]:
  """The counters of a window saved like ``t``, checked by ``from_buffers``'
  check (a stacked window's replica by replica), as arrays."""
  named, saved, per = _tree.flat(r[GRADS]), r[COUNTERS], base.PER_REPLICA
  validation.work_dtype(t.dtype, what=here)
  validation.one_device_set([("grads", r[GRADS])], what=here)
  if t.placement.kind != base.STACKED:
    c = accumulation.check_restored(
      saved, named, t.dtype, what=f"{here}, counters"
    )
    return base.initial(work_dtype=t.dtype, **c)
  rows = [
    accumulation.check_restored(
      {k: np.asarray(v)[i] if k in per else v for k, v in saved.items()},
      ((f"grads{p}", b[i]) for p, b in named),  # sliced if weight 0
      t.dtype,
      what=f"{here}, counters of replica {i}",
    )
    for i in range(int(np.shape(saved["weight_hi"])[0]))
  ]
  return base.initial(
    work_dtype=t.dtype,
    **{k: np.stack([row[k] for row in rows]) for k in per},
    **{k: v for k, v in rows[0].items() if k not in per},
  )


def _restored(t: AccumState, r: dict[str, Any], here: str) -> AccumState:
  """The window saved as ``r``, checked, placed like the template ``t``."""
  asarray = lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x
  grads = jax.tree.map(asarray, r[GRADS])
  stacked = t.placement.kind == base.STACKED
  first = getattr(next(iter(jax.tree.leaves(grads)), None), "sharding", None)
  placed = {}
  for name, value in _checked(t, dict(r, grads=grads), here).items():
    like = _unwrap(getattr(t, name))
    sharding = getattr(like, "sharding", None)
    if not stacked and (sharding is None or _uncommitted(like)):
      sharding = _tree.replicated_sharding(grads)  # as from_buffers commits
    elif sharding is None and isinstance(first, NamedSharding):
      sharding = NamedSharding(
        first.mesh, P(first.spec[0]) if np.ndim(value) else P()
      )
    value = value if sharding is None else jax.device_put(value, sharding)
    held = getattr(t, name)  # an nnx.Variable in nnx.Optimizer.opt_state
    placed[name] = held.replace(value) if _tree.is_variable(held) else value
  return AccumState(
    grads=grads, dtype=jnp.dtype(t.dtype), placement=t.placement, **placed
  )


def _damaged(where: str, what: str, e: Exception) -> WeightedAccumulationError:
  return WeightedAccumulationError(
    f"{where}: could not read the item's {what} ({e!r}): its files are "
    "missing, truncated or corrupt; restore another step."
  )
