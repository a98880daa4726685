"""Orbax checkpointing of windows of every kind: ``AccumSave``,
``AccumRestore`` and their ``AccumCheckpointHandler``; the saved form and
its checks are in ``saved_form`` (``docs/checkpointing.md``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any

from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from weighted_accum._src import validation
from weighted_accum._src.checkpointing import saved_form as sf
from weighted_accum._src.checkpointing.saved_form import FORMAT_VERSION
from weighted_accum._src.checkpointing.saved_form import abstract_state
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import base
from weighted_accum._src.core import loss_scale
from weighted_accum._src.core import tree_utils as _tree
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.errors import WeightedAccumulationError

__all__ = [
  "FORMAT_VERSION",
  "AccumCheckpointHandler",
  "AccumRestore",
  "AccumSave",
  "abstract_state",
]


def _check_restorable(s: AccumState, shown: str) -> None:
  """Refuses to save a window that :class:`AccumRestore` would refuse."""
  grads = jax.tree.map(sf.unwrap, s.grads)
  saved = {sf.GRADS: grads, sf.COUNTERS: sf.host_counters(s)}
  _restored(s, saved, f"AccumSave: the AccumState at {shown} (not saved)")


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
    if not isinstance(args, AccumSave):
      raise WeightedAccumulationError(
        f"AccumCheckpointHandler.async_save: expected AccumSave(state), got "
        f"{type(args).__name__}."
      )
    tree, states = args.state, {}
    if any(_tree.is_traced(x) for x in jax.tree.leaves(tree)):
      raise WeightedAccumulationError(
        "AccumSave: the state holds traced values; save it outside jit."
      )
    for key, (shown, s) in sf.accum_nodes(tree).items():
      for path, leaf in _tree.flat(s.grads):
        if jnp.result_type(leaf) != s.dtype:
          raise WeightedAccumulationError(
            f"AccumSave: buffer {shown}.grads{path} has dtype "
            f"{jnp.result_type(leaf)}, expected the work dtype {s.dtype}."
          )
      _check_restorable(s, shown)
      states[sf.key(key)] = {
        "dtype": jnp.dtype(s.dtype).name,
        "placement": sf.placement_options(s),
      }
    saveable = sf.split(tree, sf.host_counters)
    options = {
      sf.OPTIONS_KEY: {"format_version": sf.FORMAT_VERSION, "states": states}
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
    directory = epath.Path(directory)
    if not directory.is_dir():
      raise WeightedAccumulationError(
        f"{where}: the item directory does not exist."
      )
    meta = self._read_metadata(directory, where)
    saved_states = self._check_options(meta.custom_metadata, where)
    want = sf.accum_nodes(template)
    self._check_states(want, saved_states, where)
    target = sf.split(template, sf.plain_counters)
    flat_target = ocp.tree.to_flat_dict(target)
    shown = dict(zip(flat_target, _tree.leaf_paths(target)))
    flat_meta = ocp.tree.to_flat_dict(meta.tree)
    self._check_structure(flat_target, flat_meta, shown, where)
    flat_args = {}
    for key, leaf in flat_target.items():
      m = flat_meta[key]
      role, expect = sf.role(key, leaf, want)
      sf.check_leaf(leaf, m, role, expect, shown[key], where)
      flat_args[key] = self._restore_arg(role, leaf, m, shown[key], where)
    restore_args = ocp.tree.from_flat_dict(flat_args, target=target)
    try:
      restored = self._impl.restore(
        directory,
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
      )
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._restore_failure(directory, e, where) from e
    out = self._rebuild(template, restored, where)
    loss_scale.check_restored(out, what=where)  # scale and tracker
    return out

  def _restore_failure(
    self, directory: epath.Path, e: Exception, where: str
  ) -> WeightedAccumulationError:
    """Damaged files, or (they read back untemplated) another template."""
    try:
      self._impl.restore(directory)
    except Exception as untemplated:  # pylint: disable=broad-exception-caught
      raise _damaged(where, "arrays", e) from untemplated
    return WeightedAccumulationError(
      f"{where}: the files are intact but do not fit the template ({e!r}): "
      "build it like the saving run's state (same optimizer and containers)."
    )

  def _read_metadata(self, directory: epath.Path, where: str) -> Any:
    try:
      return self._impl.metadata(directory)
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise _damaged(where, "metadata", e) from e

  def _check_options(self, custom: Any, where: str) -> dict[str, Any]:
    options = custom.get(sf.OPTIONS_KEY) if isinstance(custom, dict) else None
    if not isinstance(options, dict):
      raise WeightedAccumulationError(
        f"{where}: no '{sf.OPTIONS_KEY}' options: not written by AccumSave; "
        "restore it with the args it was saved with."
      )
    version = options.get("format_version")
    if version not in sf.SUPPORTED_FORMAT_VERSIONS:
      raise WeightedAccumulationError(
        f"{where}: option 'format_version' is {version!r}, expected one of "
        f"{list(sf.SUPPORTED_FORMAT_VERSIONS)}: upgrade weighted_accum."
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

  def _check_states(
    self,
    want: dict[str, tuple[str, AccumState]],
    saved: dict[str, Any],
    where: str,
  ) -> None:
    keys = {sf.key(p): shown_s for p, shown_s in want.items()}
    extra = sorted(set(saved) - set(keys))
    for key in [k for k in keys if k not in saved] + extra:
      shown = keys[key][0] if key in keys else sf.show(sf.unkey(key))
      has = "template" if key in keys else "checkpoint"
      raise WeightedAccumulationError(
        f"{where}: only the {has} has an AccumState at {shown}; restore into "
        "a template of the saved structure."
      )
    for key, (shown, s) in keys.items():
      saved_dtype = validation.work_dtype(
        saved[key]["dtype"],
        what=f"{where}: option 'dtype' of the AccumState at {shown}",
      )
      if saved_dtype != jnp.dtype(s.dtype):
        raise WeightedAccumulationError(
          f"{where}: the AccumState at {shown} was saved in {saved_dtype}, "
          f"the template's work dtype is {jnp.dtype(s.dtype)}: use "
          f"abstract_state(params, dtype=jnp.{saved_dtype})."
        )
      sf.check_placement(saved[key].get("placement"), s, shown, where)

  def _check_structure(
    self, flat_target: dict, flat_meta: dict, shown: dict, where: str
  ) -> None:
    missing, extra = _tree.diff_paths(list(flat_target), list(flat_meta))
    if missing or extra:
      leaf = shown[missing[0]] if missing else sf.show(extra[0])
      raise WeightedAccumulationError(
        f"{where}: leaf {leaf} is {'missing from' if missing else 'extra in'} "
        f"the checkpoint ({len(missing)} missing, {len(extra)} extra): "
        "build the template from the params that were saved."
      )

  def _restore_arg(
    self, role: str, leaf: Any, meta: Any, shown: str, where: str
  ) -> Any:
    if isinstance(leaf, (bool, int, float, complex)):
      return ocp.RestoreArgs(restore_type=type(leaf))
    if (
      role == "counter"
      or not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
      or sf.uncommitted(leaf)
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
          f"{where}: template leaf {shown} has no sharding and the saved one "
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

  def _rebuild(self, template: Any, restored: Any, where: str) -> Any:
    flat_t, treedef = jax.tree_util.tree_flatten_with_path(
      template, is_leaf=sf.is_accum
    )
    flat_r = treedef.flatten_up_to(restored)
    out = []
    for (path, t), r in zip(flat_t, flat_r):
      if not sf.is_accum(t):
        out.append(sf.like(t, r))
        continue
      out.append(
        _restored(t, r, f"{where}: AccumState at {_tree.path_str(path)}")
      )
    return treedef.unflatten(out)


def _restored(t: AccumState, r: dict[str, Any], here: str) -> AccumState:
  """The window saved as ``r``, validated and placed like the template ``t``."""
  stacked = t.placement.kind == base.STACKED
  return (_stacked_window if stacked else _window)(t, r, here)


def _window(t: AccumState, r: dict[str, Any], here: str) -> AccumState:
  """A restored scalar-counter window, validated and placed like ``t``."""
  counters = validation.saved_counters(
    r[sf.COUNTERS],
    base.COUNTERS,
    lambda name, dt=t.dtype: base.dtype_of(name, dt),
    what=f"{here}, counters",
  )
  try:
    s = accumulation.from_buffers(r[sf.GRADS], r[sf.GRADS], counters)
  except WeightedAccumulationError as e:
    raise WeightedAccumulationError(f"{here}: {e}") from e
  # The saved work dtype: a state without buffers would get float32.
  s = s.replace(dtype=jnp.dtype(t.dtype), placement=t.placement)
  placed = {}
  for name in base.NAMES:
    like = sf.unwrap(getattr(t, name))
    # An uncommitted template scalar (wa.init's) stays uncommitted.
    sharding = None if sf.uncommitted(like) else getattr(like, "sharding", None)
    value = getattr(s, name)
    placed[name] = sf.rewrap(
      getattr(t, name),
      (value if sharding is None else jax.device_put(value, sharding)),
    )
  return s.replace(**placed)


def _stacked_window(t: AccumState, r: dict[str, Any], here: str) -> AccumState:
  """A restored stacked window."""
  grads = jax.tree.map(
    lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, r[sf.GRADS]
  )
  counters = sf.stacked_counters(r[sf.COUNTERS], t.dtype, here)
  weight = counters["weight_hi"].astype(np.float64) + counters["weight_lo"]
  sf.check_stacked_buffers(grads, weight, here)
  placed = {
    name: sf.rewrap(
      getattr(t, name),
      sf.place_counter(sf.unwrap(getattr(t, name)), value, grads),
    )
    for name, value in counters.items()
  }
  return AccumState(
    grads=grads, dtype=jnp.dtype(t.dtype), placement=t.placement, **placed
  )


def _damaged(where: str, what: str, e: Exception) -> WeightedAccumulationError:
  return WeightedAccumulationError(
    f"{where}: could not read the item's {what} ({e!r}): its files are "
    "missing, truncated or corrupt; restore another step."
  )


ocp.args.register_with_handler(AccumCheckpointHandler, for_save=True)(AccumSave)
ocp.args.register_with_handler(AccumCheckpointHandler, for_restore=True)(
  AccumRestore
)
