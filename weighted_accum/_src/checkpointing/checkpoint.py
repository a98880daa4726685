"""Orbax checkpointing of accumulator state: ``AccumSave``, ``AccumRestore``,
their ``AccumCheckpointHandler`` and ``abstract_state``.

Usage, what is written and what restoring validates: ``docs/design.md``
("Checkpoints").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from typing import Any

from etils import epath
import jax
import jax.numpy as jnp
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

__all__ = [
  "AccumCheckpointHandler",
  "AccumRestore",
  "AccumSave",
  "abstract_state",
]

#: Key of this library's options in the item's Orbax custom metadata.
OPTIONS_KEY = "weighted_accum"
#: The format version written (the counters are those of ``AccumState``'s
#: counter fields, ``base.COUNTERS``; a change to what is written bumps it).
FORMAT_VERSION = 1
#: Format versions this module can read.
SUPPORTED_FORMAT_VERSIONS = (FORMAT_VERSION,)

_GRADS = "grads"
_COUNTERS = "counters"


def abstract_state(params: Any, dtype: DTypeLike = jnp.float32) -> AccumState:
  """An abstract ``AccumState`` for ``params``, each buffer on its sharding.

  ``jax.eval_shape(wa.init, params)`` gives the same shapes but drops the
  shardings; this keeps them, so :class:`AccumRestore` places every buffer
  where ``wa.init(params, dtype)`` would.

  Args:
    params: concrete arrays or ``jax.ShapeDtypeStruct``s (with or without a
      ``sharding``), e.g. the params of the new run, on any mesh.
    dtype: the work dtype the checkpoint was saved in.

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

  def with_sharding(sds, p):
    sharding = getattr(p, "sharding", None)
    return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sharding)

  return shapes.replace(grads=jax.tree.map(with_sharding, shapes.grads, params))


def _is_accum(x: Any) -> bool:
  return isinstance(x, AccumState)


def _key(path: tuple[str, ...]) -> str:
  """The key of a node in the saved options (``''`` for the root).

  Path entries are joined with ``/`` after JSON-pointer escaping (``~`` as
  ``~0``, ``/`` as ``~1``), so the dict keys ``'a/b'`` and ``'a', 'b'`` get
  distinct keys; keys without either character are written as before.
  """
  return "/".join(str(k).replace("~", "~0").replace("/", "~1") for k in path)


def _unkey(key: str) -> tuple[str, ...]:
  """The path of a :func:`_key`."""
  if not key:
    return ()
  return tuple(k.replace("~1", "/").replace("~0", "~") for k in key.split("/"))


def _unwrap(x: Any) -> Any:
  """The value of an ``nnx.Variable`` (as in ``nnx.Optimizer.opt_state``)."""
  get = getattr(x, "get_value", None)
  return get() if callable(get) else x


def _rewrap(like: Any, value: Any) -> Any:
  """``value`` in ``like``'s ``nnx.Variable`` wrapper, if it has one."""
  if callable(getattr(like, "get_value", None)) and hasattr(like, "replace"):
    return like.replace(value)
  return value


def _plain_counters(s: AccumState) -> dict[str, Any]:
  """The counters as arrays, unwrapped from ``nnx.Variable``s (they are
  saved unwrapped, so an ``nnx.Optimizer``'s state restores into another's)."""
  return {k: _unwrap(v) for k, v in s.counters.items()}


def _accum_nodes(tree: Any) -> dict[tuple[str, ...], tuple[str, AccumState]]:
  """``{Orbax path: (readable path, state)}`` for each AccumState in tree."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_accum)
  keys = ocp.tree.to_flat_dict(tree, is_leaf=_is_accum)
  return {
    k: (_tree.path_str(p), node)
    for (p, node), k in zip(flat, keys)
    if _is_accum(node)
  }


def _split(tree: Any, counters: Any) -> Any:
  """Replaces each AccumState by ``{'grads': ..., 'counters': {...}}``."""

  def split(x):
    if _is_accum(x):
      return {_GRADS: x.grads, _COUNTERS: counters(x)}
    return x

  return jax.tree.map(split, tree, is_leaf=_is_accum)


def _host_counters(s: AccumState) -> dict[str, np.ndarray]:
  """The counters as NumPy scalars of their stored dtype (for saving)."""
  s = jax.tree.map(_unwrap, s)
  return {
    name: np.array(getattr(s, name), base.dtype_of(name, s.dtype))
    for name in base.NAMES
  }


def _check_restorable(s: AccumState, shown: str) -> None:
  """Refuses to save a window that :class:`AccumRestore` would refuse (the
  same checks of its counters and buffers), so what is saved restores.

  Under ``jit`` a traced invalid loss scale (``set_loss_scale``,
  ``next_loss_scale``) leaves the window's scale NaN: the window is unusable
  until a close with a valid ``next_loss_scale`` (``docs/inputs.md``). Such
  a window is not saved: restoring it could only refuse it."""
  counters = _host_counters(s)
  try:
    valid = validation.saved_counters(
      counters,
      base.COUNTERS,
      lambda name: base.dtype_of(name, s.dtype),
      what="counters",
    )
    grads = jax.tree.map(_unwrap, s.grads)
    accumulation.from_buffers(grads, grads, valid)
  except WeightedAccumulationError as e:
    hint = ""
    if not np.isfinite(counters["loss_scale"]):
      hint = (
        " Its loss scale is NaN: an invalid traced loss scale (set_loss_scale "
        "or next_loss_scale under jit) made the window unusable. Close it "
        "with a valid next_loss_scale (finish_mean, apply_window, the "
        "wrapper's update) or set_loss_scale on an empty window, then save."
      )
    raise WeightedAccumulationError(
      f"AccumSave: the AccumState at {shown} cannot be restored ({e}), so it "
      f"is not saved; nothing was written.{hint}"
    ) from e


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
      when the current devices allow it; an uncommitted array (the scalars
      of a fresh ``wa.init`` or ``tx.init``) comes back uncommitted. Dtypes
      must match exactly. Only read, never modified.

  Example:
    See :class:`AccumSave`.
  """

  template: Any = None


def _show(path: tuple[str, ...]) -> str:
  return "".join(f"[{k!r}]" for k in path) or "<root>"


class AccumCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Orbax handler for :class:`AccumSave` / :class:`AccumRestore`.

  Built on ``ocp.PyTreeCheckpointHandler`` (OCDBT storage, asynchronous
  commit); adds the accumulator's options to the item metadata and strict
  validation on restore. ``CheckpointManager`` and ``ocp.args.Composite``
  construct it from the args; direct use is rarely needed.

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
    """Creates the handler.

    Args:
      use_ocdbt: store arrays with TensorStore's OCDBT driver (Orbax's
        default).
    """
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
      WeightedAccumulationError: for a traced state, one whose buffers are
        not all in its work dtype, or one whose counters a restore would
        refuse (e.g. the NaN loss scale of a window made unusable under
        ``jit``); nothing is written.
    """
    if not isinstance(args, AccumSave):
      raise WeightedAccumulationError(
        f"AccumCheckpointHandler.async_save: expected AccumSave(state), got "
        f"{type(args).__name__}. Pass args=AccumSave(state)."
      )
    tree = args.state
    states = {}
    for key, (shown, s) in _accum_nodes(tree).items():
      for path, leaf in zip(
        _tree.leaf_paths(s.grads), jax.tree.leaves(s.grads)
      ):
        if jnp.result_type(leaf) != s.dtype:
          raise WeightedAccumulationError(
            f"AccumSave: buffer {shown}.grads{path} has dtype "
            f"{jnp.result_type(leaf)}, but the state's work dtype is "
            f"{s.dtype}. Save states made by this library's functions."
          )
      states[_key(key)] = {"dtype": jnp.dtype(s.dtype).name}
    if any(_tree.is_traced(x) for x in jax.tree.leaves(tree)):
      raise WeightedAccumulationError(
        "AccumSave: the state holds traced values; save a concrete state "
        "outside jit."
      )
    for shown, s in _accum_nodes(tree).values():
      _check_restorable(s, shown)
    saveable = _split(tree, _host_counters)
    options = {
      OPTIONS_KEY: {"format_version": FORMAT_VERSION, "states": states}
    }
    return await self._impl.async_save(
      directory, args=ocp.args.PyTreeSave(saveable, custom_metadata=options)
    )

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
    """The saved tree's Orbax metadata (accumulators as ``{'grads',
    'counters'}`` dicts; options under ``custom_metadata['weighted_accum']``).
    """
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
      WeightedAccumulationError: naming the item directory and the first
        offending leaf path or field.
    """
    where = f"AccumRestore({directory})"
    template = None if args is None else args.template
    if template is None:
      raise WeightedAccumulationError(
        f"{where}: a template is required (AccumRestore(template)); pass "
        "the current state or abstract_state(params, dtype)."
      )
    directory = epath.Path(directory)
    if not directory.is_dir():
      raise WeightedAccumulationError(
        f"{where}: the item directory does not exist. The step was not "
        "saved with this item, or its files were removed."
      )
    meta = self._read_metadata(directory, where)
    saved_states = self._check_options(meta.custom_metadata, where)
    want = _accum_nodes(template)
    self._check_states(want, saved_states, where)
    target = _split(template, _plain_counters)
    flat_target = ocp.tree.to_flat_dict(target)
    shown = dict(zip(flat_target, _tree.leaf_paths(target)))
    flat_meta = ocp.tree.to_flat_dict(meta.tree)
    self._check_structure(flat_target, flat_meta, shown, where)
    flat_args = {}
    for key, leaf in flat_target.items():
      m = flat_meta[key]
      role, expect = _role(key, leaf, want)
      _check_leaf(leaf, m, role, expect, shown[key], where)
      flat_args[key] = self._restore_arg(role, leaf, m, shown[key], where)
    restore_args = ocp.tree.from_flat_dict(flat_args, target=target)
    try:
      restored = self._impl.restore(
        directory,
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
      )
    except WeightedAccumulationError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._restore_failure(directory, e, where) from e
    out = self._rebuild(template, restored, where)
    loss_scale.check_restored(out, what=where)  # scale and tracker
    return out

  def _restore_failure(
    self, directory: epath.Path, e: Exception, where: str
  ) -> WeightedAccumulationError:
    """Why a restore into the template failed: when the files read back in
    their saved structure, the template differs from what was saved (e.g.
    another optimizer's state); else the files are damaged."""
    try:
      self._impl.restore(directory)
    except Exception:  # pylint: disable=broad-exception-caught
      return WeightedAccumulationError(
        f"{where}: could not read the checkpoint's arrays "
        f"({type(e).__name__}: {e}). Its files are missing, truncated or "
        "corrupt (an interrupted copy?); restore another step."
      )
    return WeightedAccumulationError(
      f"{where}: the checkpoint's files are intact, but they do not fit the "
      f"template ({type(e).__name__}: {e}). The template's tree differs "
      "from the one that was saved (e.g. the state of another optimizer, "
      "such as adam's for adamw's, or other container types). Restore with "
      "a template built like the saving run's state."
    )

  def _read_metadata(self, directory: epath.Path, where: str) -> Any:
    try:
      return self._impl.metadata(directory)
    except FileNotFoundError as e:
      raise WeightedAccumulationError(
        f"{where}: the metadata file is missing ({e}). The item is "
        "incomplete; restore another step."
      ) from e
    except Exception as e:  # pylint: disable=broad-exception-caught
      # Orbax reads _METADATA, then every array's TensorStore metadata.
      raise WeightedAccumulationError(
        f"{where}: could not read the item's metadata ({type(e).__name__}: "
        f"{e}). Its files are missing, truncated or corrupt (an "
        "interrupted copy?); restore another step."
      ) from e

  def _check_options(self, custom: Any, where: str) -> dict[str, Any]:
    options = custom.get(OPTIONS_KEY) if isinstance(custom, dict) else None
    if not isinstance(options, dict):
      raise WeightedAccumulationError(
        f"{where}: the item holds no '{OPTIONS_KEY}' options, so it was "
        "not written by AccumSave. Restore it with the args it was saved "
        "with (e.g. ocp.args.StandardRestore)."
      )
    version = options.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
      raise WeightedAccumulationError(
        f"{where}: option 'format_version' is {version!r}; this version of "
        f"weighted_accum reads {list(SUPPORTED_FORMAT_VERSIONS)}. Upgrade "
        "weighted_accum to restore it."
      )
    states = options.get("states")
    if not isinstance(states, dict) or not all(
      isinstance(v, dict) and isinstance(v.get("dtype"), str)
      for v in states.values()
    ):
      raise WeightedAccumulationError(
        f"{where}: option 'states' is malformed ({states!r}); the metadata "
        "is corrupt."
      )
    return states

  def _check_states(
    self,
    want: dict[str, tuple[str, AccumState]],
    saved: dict[str, Any],
    where: str,
  ) -> None:
    for path, (shown, s) in want.items():
      key = _key(path)
      if key not in saved:
        raise WeightedAccumulationError(
          f"{where}: the template has an AccumState at {shown}, but the "
          "checkpoint has none there. Restore with a template of the "
          "structure that was saved."
        )
      saved_dtype = validation.work_dtype(
        saved[key]["dtype"],
        what=f"{where}: option 'dtype' of the AccumState at {shown} (the "
        "checkpoint's metadata is corrupt, or needs jax_enable_x64)",
      )
      if saved_dtype != jnp.dtype(s.dtype):
        raise WeightedAccumulationError(
          f"{where}: option 'dtype' of the AccumState at {shown} is "
          f"{saved_dtype}, but the template's work dtype is "
          f"{jnp.dtype(s.dtype)}. Orbax would cast the buffers silently; "
          "this library refuses. Restore with abstract_state(params, "
          f"dtype=jnp.{saved_dtype}) and convert explicitly if you must."
        )
    extra = sorted(set(saved) - {_key(p) for p in want})
    if extra:
      raise WeightedAccumulationError(
        f"{where}: the checkpoint has an AccumState at "
        f"{_show(_unkey(extra[0]))}, but the "
        "template has none there. Restore with a template of the "
        "structure that was saved."
      )

  def _check_structure(
    self, flat_target: dict, flat_meta: dict, shown: dict, where: str
  ) -> None:
    missing, extra = _tree.diff_paths(list(flat_target), list(flat_meta))
    if missing:
      raise WeightedAccumulationError(
        f"{where}: leaf {shown[missing[0]]} of the template is missing from "
        f"the checkpoint ({len(missing)} missing in all). Restore with a "
        "template built from the params that were saved."
      )
    if extra:
      raise WeightedAccumulationError(
        f"{where}: the checkpoint has leaf {_show(extra[0])}, which the "
        f"template lacks ({len(extra)} extra in all). Restore with a "
        "template built from the params that were saved."
      )

  def _restore_arg(
    self, role: str, leaf: Any, meta: Any, shown: str, where: str
  ) -> Any:
    if isinstance(leaf, (bool, int, float, complex)):
      return ocp.RestoreArgs(restore_type=type(leaf))
    if (
      role == "counter"
      or not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
      or _uncommitted(leaf)
    ):
      # Placed afterwards (see _rebuild and _like).
      return ocp.RestoreArgs(restore_type=np.ndarray)
    sharding = leaf.sharding
    if sharding is None:
      saved = getattr(meta, "sharding", None)
      try:
        sharding = saved.to_jax_sharding() if saved is not None else None
      except ValueError as e:
        raise WeightedAccumulationError(
          f"{where}: template leaf {shown} has no sharding and the saved "
          f"one ({saved}) does not fit the current devices. Pass a "
          "template with shardings, e.g. abstract_state(params)."
        ) from e
    if sharding is None:
      return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(
      restore_type=jax.Array,
      sharding=sharding,
      global_shape=tuple(leaf.shape),
      strict=True,
    )

  def _rebuild(self, template: Any, restored: Any, where: str) -> Any:
    flat_t, treedef = jax.tree_util.tree_flatten_with_path(
      template, is_leaf=_is_accum
    )
    flat_r = treedef.flatten_up_to(restored)
    out = []
    for (path, t), r in zip(flat_t, flat_r):
      if not _is_accum(t):
        out.append(_like(t, r))
        continue
      here = f"{where}: AccumState at {_tree.path_str(path)}"
      counters = validation.saved_counters(
        r[_COUNTERS],
        base.COUNTERS,
        lambda name, dt=t.dtype: base.dtype_of(name, dt),
        what=f"{here}, counters",
      )
      try:
        s = accumulation.from_buffers(r[_GRADS], r[_GRADS], counters)
      except WeightedAccumulationError as e:
        raise WeightedAccumulationError(f"{here}: {e}") from e
      # The saved work dtype (checked against t's): from_buffers can only
      # infer it from the buffers, and a state without any gets float32.
      s = s.replace(dtype=jnp.dtype(t.dtype))
      placed = {}
      for name in base.NAMES:
        like = _unwrap(getattr(t, name))
        # An uncommitted template scalar (as from wa.init) stays uncommitted,
        # so that it may meet buffers on any mesh under jit.
        sharding = (
          None if _uncommitted(like) else getattr(like, "sharding", None)
        )
        value = getattr(s, name)
        placed[name] = _rewrap(
          getattr(t, name),
          (value if sharding is None else jax.device_put(value, sharding)),
        )
      out.append(s.replace(**placed))
    return treedef.unflatten(out)


def _check_leaf(
  leaf: Any, m: Any, role: str, expect: np.dtype | None, shown: str, where: str
) -> None:
  """Refuses a template leaf whose dtype or shape differs from the saved one
  (Orbax would cast or reshape silently)."""
  if role == "buffer" and np.dtype(jnp.result_type(leaf)) != expect:
    raise WeightedAccumulationError(
      f"{where}: template leaf {shown} has dtype "
      f"{jnp.result_type(leaf)}, but its AccumState's work dtype is "
      f"{expect}. Build the template with abstract_state(params, "
      "dtype)."
    )
  if np.shape(leaf) != tuple(m.shape):
    raise WeightedAccumulationError(
      f"{where}: leaf {shown} has shape {tuple(m.shape)} in the "
      f"checkpoint, but {np.shape(leaf)} in the template. Restore with "
      "a template built from the params that were saved."
    )
  if expect is not None and np.dtype(m.dtype) != expect:
    raise WeightedAccumulationError(
      f"{where}: leaf {shown} was saved as {np.dtype(m.dtype)}, "
      f"but the template expects {expect}. Orbax would cast it "
      "silently; this library refuses. Restore with a template of the "
      "saved dtype (e.g. abstract_state(params, dtype=...)) and "
      "convert explicitly."
    )


def _role(
  key: tuple[str, ...],
  leaf: Any,
  states: dict[tuple[str, ...], tuple[str, AccumState]],
) -> tuple[str, np.dtype | None]:
  """What a saved leaf is ('buffer', 'counter', 'other') and its dtype."""
  for path, (_, s) in states.items():
    n = len(path)
    if key[:n] == path and len(key) > n:
      if key[n] == _GRADS:
        return "buffer", np.dtype(s.dtype)
      return "counter", base.dtype_of(key[n + 1], s.dtype)
  if isinstance(leaf, (bool, int, float, complex)):
    # Python scalars: Orbax stores int as int64, float as float64.
    return "other", np.dtype(type(leaf))
  return "other", np.dtype(jnp.result_type(leaf))


def _uncommitted(x: Any) -> bool:
  """An array on the default device, free to join any computation (as the
  scalars of a fresh ``wa.init`` or ``tx.init``): restored the same way."""
  return isinstance(x, jax.Array) and not x.committed


def _like(template_leaf: Any, value: Any) -> Any:
  """Gives a restored leaf the template leaf's type (and placement)."""
  if _uncommitted(template_leaf):
    return jnp.asarray(value)
  if isinstance(template_leaf, (bool, int, float, complex)) and not isinstance(
    value, type(template_leaf)
  ):
    return type(template_leaf)(np.asarray(value).item())
  if isinstance(template_leaf, np.generic):
    return np.asarray(value, template_leaf.dtype)[()]
  return value


ocp.args.register_with_handler(AccumCheckpointHandler, for_save=True)(AccumSave)
ocp.args.register_with_handler(AccumCheckpointHandler, for_restore=True)(
  AccumRestore
)
