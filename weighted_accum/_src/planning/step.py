"""The planned step: every shape of a spec added into one window by the
in-step function (a loop per shape over its slots, the slots a plan fills
counted by a traced value), closed once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window as close
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.in_step import microbatch_args as margs
from weighted_accum._src.in_step.value_and_grad import (
  microbatched_value_and_grad,
)
from weighted_accum._src.parallel import functional
from weighted_accum._src.parallel import spmd_layout
from weighted_accum._src.parallel.spmd_layout import DataParallel
from weighted_accum._src.planning.packing import Packed
from weighted_accum._src.planning.spec import PlanSpec

_WHAT = "planned_value_and_grad"


def _packed(spec: PlanSpec, args: tuple, pos: int) -> Packed:
  got = args[pos] if pos < len(args) else None
  if not isinstance(got, Packed):
    raise WeightedAccumulationError(
      f"{_WHAT}(...): argument {pos} is {type(got).__name__}, not a batch "
      "from plan_batch(spec, ...)."
    )
  if got.spec != spec:
    raise WeightedAccumulationError(
      f"{_WHAT}(...): argument {pos} was planned for {got.spec}, but this "
      f"function was built for {spec}. Plan it with this function's spec."
    )
  return got


def _check_replicas(spec: PlanSpec, axes: tuple, n: int) -> None:
  if n != spec.replicas:
    raise WeightedAccumulationError(
      f"{_WHAT}: the batch was planned for {spec.replicas} replicas, "
      f"but {axes} has {n}: build the PlanSpec with replicas={n}."
    )


def _local_counts(spec: PlanSpec, packed: Packed, axes: Any) -> Any:
  """This replica's counts ``[1, shapes]``, or an error where the packed
  batch was not split by replica (each replica would run every replica's
  slots)."""
  rows = [c * r for (r, _), c in zip(spec.shapes, spec.capacities)]
  got = [{jnp.shape(x)[0] for x in jax.tree.leaves(s)} for s in packed.shapes]
  if jnp.shape(packed.counts) != (1, len(rows)) or got != [{n} for n in rows]:
    how = "split by replica (in_specs P(axes))" if axes else "whole"
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={axes!r}): this replica sees counts of shape "
      f"{jnp.shape(packed.counts)} and {sum(map(max, got))} rows, not "
      f"(1, {len(rows)}) and {sum(rows)}: pass the packed batch {how}."
    )
  return packed.counts


class _Planned:
  """``f`` and ``f.accumulate`` of one spec and configuration."""

  def __init__(self, loss_fn, spec, kw, axes, batch_argnum, state_argnums):
    self.spec, self.axes, self.pos = spec, axes, batch_argnum
    self.dtype, self.has_aux = kw["dtype"], kw["has_aux"]
    self.grads_dtype = kw.pop("grads_dtype")
    self.roles = margs.configure(
      _WHAT, num_microbatches=1, microbatch_size=None,
      argnums=kw["argnums"], batch_argnums=batch_argnum,
      state_argnums=state_argnums,
      key_argnums=kw["key_argnums"], split="contiguous",
    )  # fmt: skip
    self.state_argnums = self.roles.state_argnums
    self.inner = [
      microbatched_value_and_grad(
        loss_fn, cap, batch_argnums=batch_argnum, split="contiguous",
        state_argnums=state_argnums, axis_name=axes, **kw,
      )
      for cap in spec.capacities
    ]  # fmt: skip

  def params(self, args: tuple) -> Any:
    """The differentiated values, shaped as the window holds them."""
    a = list(args)
    a[self.pos] = self._shape_args(args, 0)[self.pos]
    call = margs.prepare(_WHAT, self.roles, tuple(a), {})
    return margs.as_params(call, margs.diff_values(call), self.roles)

  def _shape_args(self, args: tuple, s: int) -> list:
    a = list(args)
    a[self.pos] = args[self.pos].shapes[s]
    for n in self.roles.key_argnums:  # each shape's slots draw their own keys
      a[n] = jax.tree.map(lambda k: jax.random.fold_in(k, s), a[n])
    return a

  def add(self, state, args: tuple) -> tuple:
    """Every shape's filled slots into ``state``: ``(loss sum, weight,
    aux per shape, new state)``."""
    if self.axes is not None:
      _check_replicas(self.spec, self.axes, jax.lax.axis_size(self.axes))
    counts = _local_counts(self.spec, args[self.pos], self.axes)
    total, weight, aux, args = 0.0, 0.0, [], list(args)
    for s, inner in enumerate(self.inner):
      n = counts[0, s]
      out = inner.accumulate(
        state, *self._shape_args(tuple(args), s), num_real_microbatches=n
      )
      if self.state_argnums:
        out, new = out
        new = (new,) if self.roles.single_state else new
        for n_arg, v in zip(self.state_argnums, new):
          args[n_arg] = v
      value, state = out
      if self.has_aux:
        value, a = value
        aux.append(a)
      total, weight = total + value[0], weight + value[1]
    threaded = tuple(args[n] for n in self.state_argnums)
    return state, total, weight, tuple(aux), threaded

  def result(self, loss, out, aux, threaded):
    res = ((loss, aux), out) if self.has_aux else (loss, out)
    if not self.state_argnums:
      return res
    return res, threaded[0] if self.roles.single_state else threaded

  def dtypes(self, params: Any) -> list | None:
    """Each gradient leaf's returned dtype (``grads_dtype``)."""
    if self.grads_dtype is None:
      return None
    leaves = jax.tree.leaves(params)
    if self.grads_dtype == "params":
      return [jnp.result_type(p) for p in leaves]
    return [self.grads_dtype] * len(leaves)

  def step(self, args: tuple, loss_scale: Any) -> Any:
    """``f`` where the data axes (if any) are bound: one window, closed."""
    params = self.params(args)
    window = functional.init(
      params, self.dtype, loss_scale, axis_name=self.axes
    )
    window, total, _, aux, threaded = self.add(window, args)
    if not tree_utils.is_traced(window.weight_hi):
      validation.nonempty_window(window, what=_WHAT)
    # Closed on the one finish path, validity decided in the dtypes handed on.
    out, _ = close.finish(
      window,
      mean=True,
      axes=window.placement.axes,
      what=_WHAT,
      dtypes=self.dtypes(params),
    )
    if self.axes is not None:  # the loss's sum over the replicas
      total = jax.lax.psum(total, self.axes)
    loss = (total / jnp.maximum(out.weight, 1e-30)).astype(jnp.float32)
    return self.result(loss, out, aux, threaded)


def _sharded(planned: _Planned, fn: Callable, args: tuple, specs_out) -> Any:
  """``fn(*args)`` in a ``shard_map`` over the data axes of the context
  mesh: the packed batch split by replica, the rest replicated."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(planned.axes) <= set(mesh.axis_names):
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name={planned.axes!r}): called under plain jit, it "
      "needs the mesh: call it under jax.set_mesh(mesh), or inside "
      "jax.shard_map over those axes."
    )
  _check_replicas(
    planned.spec, planned.axes, math.prod(mesh.shape[a] for a in planned.axes)
  )
  data = P(planned.axes)
  specs = [P()] * len(args)
  specs[planned.pos] = jax.tree.map(lambda _: data, args[planned.pos])
  if spmd_layout.explicit(mesh, planned.axes, what=_WHAT):
    # Explicit axes: the packed batch (NumPy, as plan_batch returns it, or
    # placed otherwise) split by replica, as an Auto mesh splits it.
    args = list(args)
    args[planned.pos] = jax.tree.map(
      lambda x: jax.reshard(x, data), args[planned.pos]
    )
  # jit: eagerly this call's program compiled whole, not op by op.
  return jax.jit(
    jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=tuple(specs),
      out_specs=specs_out,
      axis_names=frozenset(planned.axes),
    )
  )(*args)


def _known_keywords(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` refusing keywords it does not take (0.x names included: the
  in-step function's ``batch_argnames``, ``in_axes``), naming those it
  takes."""
  names = list(inspect.signature(fn).parameters)

  @functools.wraps(fn)
  def checked(*args, **kwargs):
    _refuse_unknown(fn.__name__, kwargs, names)
    return fn(*args, **kwargs)

  return checked


def _refuse_unknown(what: str, kwargs: dict, names: list) -> None:
  unknown = sorted(set(kwargs) - set(names))
  if unknown:
    raise WeightedAccumulationError(
      f"{what}({unknown[0]}=...): no such argument; it takes "
      f"{', '.join(names) or 'no keywords'}."
    )


@_known_keywords
def planned_value_and_grad(
  loss_fn: Callable[..., Any],
  spec: PlanSpec,
  *,
  mode: str,
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  batch_argnum: int = 1,
  state_argnums: int | Sequence[int] = (),
  key_argnums: int | Sequence[int] = (),
  dtype: Any = jnp.float32,
  grads_dtype: Any = None,
  loss_scale: Any = 1.0,
  axis_name: str | Sequence[str] | None = None,
) -> Callable[..., Any]:
  """The exact full-batch gradient of a batch packed by :func:`plan_batch`.

  Built on :func:`weighted_accum.microbatched_value_and_grad`: one in-step
  loop per shape of ``spec`` (its capacity of slots, split
  ``"contiguous"``), all adding into one window closed once, so the result
  is the gradient of the whole batch's mean loss for every plan. The packed
  counts are the only per-batch traced values: a jitted ``f`` compiles once
  for every batch planned with ``spec``; empty slots run nothing.

  Args:
    loss_fn: called on one microbatch as ``loss_fn(*args)`` with argument
      ``batch_argnum`` set to ``(rows, mask)`` (the batch's tree at
      ``[rows, length, ...]`` and the float32 mask of real tokens; with
      ``spec.pack``, ``(rows, mask, segment_ids, positions)``, named
      fields, see :func:`plan_batch`); returns
      what :func:`~weighted_accum.microbatched_value_and_grad`'s
      ``loss_fn`` returns (``(loss, weight)``, with aux, new state).
    spec: the :class:`PlanSpec` the batches are planned with.
    mode: ``"sum"`` or ``"mean"``, as the in-step function's.
    has_aux, argnums, state_argnums, key_argnums, dtype, grads_dtype: as
      the in-step function's (keys are folded with the shape, then the
      slot).
    batch_argnum: the position of the packed batch.
    loss_scale: the window's loss scale (``f``'s ``loss_scale=`` overrides).
    axis_name: the data axes of ``spec.replicas`` replicas: ``f`` called
      inside ``jax.shard_map`` over them takes the whole packed batch split
      by replica, or under plain ``jit`` with ``jax.set_mesh`` (an Auto or
      Explicit mesh) runs its own ``shard_map`` on the packed batch as
      ``plan_batch`` returns it; the window is reduced once. The params are
      replicated: for FSDP layouts (``DataParallel``), use the in-step
      function.

  Returns:
    ``f(*args, loss_scale=None)`` returning ``(loss, out)`` as the in-step
    ``f`` (``aux`` a tuple per shape, each ``[capacity, ...]``), and
    ``f.accumulate(state, *args)`` adding into an open window, returning
    ``((loss_sum, weight), state)`` (nested as the in-step ``accumulate``).

  Raises:
    WeightedAccumulationError: a batch not packed for ``spec``, data axes
      of another size than ``spec.replicas``, a packed batch not split by
      replica, a keyword it does not take, or what the in-step function
      refuses.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from weighted_accum.planning import (
    ...     PlanSpec, plan_batch, planned_value_and_grad)
    >>> def loss_fn(w, mb):
    ...   (rows, mask) = mb
    ...   return jnp.sum(mask * (rows["x"] * w) ** 2), mask.sum()
    >>> spec = PlanSpec(buckets=(4, 8), budget=8, batch_rows=4)
    >>> x = np.ones((4, 8), np.float32)
    >>> packed = plan_batch(spec, {"x": x}, [8, 3, 2, 1])
    >>> f = jax.jit(planned_value_and_grad(loss_fn, spec, mode="sum"))
    >>> loss, out = f(jnp.float32(2.0), packed)
    >>> float(loss), float(out.grads), float(out.weight)
    (4.0, 4.0, 14.0)
  """
  if not isinstance(spec, PlanSpec):
    raise WeightedAccumulationError(f"{_WHAT}(spec={spec!r}): pass a PlanSpec.")
  if isinstance(axis_name, DataParallel):
    raise WeightedAccumulationError(
      f"{_WHAT}(axis_name=DataParallel(...)): plans run with replicated "
      "params; pass the data axes' names, or for FSDP layouts use "
      "wa.microbatched_value_and_grad(axis_name=DataParallel(...))."
    )
  axes = validation.optional_axis_names(axis_name, what=f"{_WHAT}(axis_name)")
  grads_dtype = validation.grads_dtype(
    grads_dtype, what=f"{_WHAT}(grads_dtype)"
  )
  kw = dict(mode=mode, has_aux=has_aux, argnums=argnums,
            key_argnums=key_argnums, dtype=dtype, grads_dtype=grads_dtype)  # fmt: skip
  if (axes is None) != (spec.replicas == 1):
    raise WeightedAccumulationError(
      f"{_WHAT}: spec.replicas={spec.replicas} with axis_name={axes!r}; "
      "plan for replicas > 1 exactly when the step runs over data axes."
    )
  planned = _Planned(loss_fn, spec, kw, axes, batch_argnum, state_argnums)
  return _functions(planned, loss_scale)


def _functions(planned: _Planned, loss_scale: Any) -> Callable[..., Any]:
  unbound = lambda: (
    planned.axes is not None and not tree_utils.bound(planned.axes)
  )

  default = loss_scale

  def f(*args, loss_scale=None, **kwargs):
    _refuse_unknown(f"{_WHAT}(...)", kwargs, ["loss_scale"])
    loss_scale = default if loss_scale is None else loss_scale
    _packed(planned.spec, args, planned.pos)
    if not unbound():
      return planned.step(args, loss_scale)
    if planned.state_argnums:
      raise WeightedAccumulationError(
        f"{_WHAT}(state_argnums=...): under plain jit with axis_name each "
        "replica threads its own state; call f inside jax.shard_map."
      )
    aux = P(planned.axes)
    out = ((P(), aux), P()) if planned.has_aux else (P(), P())
    return _sharded(planned, lambda *a: planned.step(a, loss_scale), args, out)

  def accumulate(state, *args, **kwargs):
    _refuse_unknown(f"{_WHAT}(...).accumulate", kwargs, [])
    _packed(planned.spec, args, planned.pos)
    if unbound():
      raise WeightedAccumulationError(
        f"{_WHAT}(...).accumulate: call it inside jax.shard_map over "
        f"{planned.axes} with this replica's window."
      )
    state, total, weight, aux, threaded = planned.add(state, args)
    value = (total, weight)
    return planned.result(value, state, aux, threaded)

  f.accumulate = accumulate
  return f
