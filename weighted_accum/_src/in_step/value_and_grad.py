"""The public in-step function, ``microbatched_value_and_grad``: its
options (argument roles, the data-parallel part) turned into the loop's
configuration, and the pair ``f`` / ``f.accumulate`` it returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from weighted_accum._src import validation
from weighted_accum._src.in_step import microbatch_args as margs
from weighted_accum._src.in_step import microbatching_spmd as spmd
from weighted_accum._src.in_step.microbatching import _accumulate
from weighted_accum._src.in_step.microbatching import _Config
from weighted_accum._src.in_step.microbatching import _configure
from weighted_accum._src.in_step.microbatching import _step
from weighted_accum._src.in_step.microbatching import call_scale
from weighted_accum._src.parallel import replicas
from weighted_accum._src.parallel.spmd_layout import DataParallel


@validation.refuse_removed(
  "batch_argnames", "in_axes", "data_axes", "param_specs", "fsdp"
)
def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int | None = None,
  *,
  mode: str,
  microbatch_size: int | None = None,
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  batch_argnums: int | str | Sequence[int | str] | Mapping | None = None,
  split: str | None = None,
  state_argnums: int | Sequence[int] = (),
  key_argnums: int | Sequence[int] = (),
  dtype: Any = jnp.float32,
  grads_dtype: Any = None,
  loss_scale: Any = 1.0,
  axis_name: str | Sequence[str] | DataParallel | None = None,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` over K microbatches in one loop, exact.

  The batch arguments are split into K microbatches; one loop iteration
  computes one microbatch's loss and gradient and adds it to work-dtype
  buffers with :func:`weighted_accum.accumulate_sum` (or
  ``accumulate_mean``), so only one microbatch's activations are live at a
  time. The result is divided once: it equals the gradient of the full
  batch's mean loss ``sum(loss sums) / sum(weights)`` whatever the weights
  per microbatch. Each argument of ``loss_fn`` has one role: differentiated
  (``argnums``), split (``batch_argnums``), threaded
  state (``state_argnums``), a random key per microbatch (``key_argnums``),
  or passed unchanged (any value, strings and functions included).

  What ``loss_fn`` returns for one microbatch, and what ``f`` returns:

  ==================  ======================================  ================================
  options             ``loss_fn`` returns                     ``f(...)`` returns
  ==================  ======================================  ================================
  neither             ``(loss, weight)``                      ``(loss, out)``
  ``has_aux``         ``((loss, weight), aux)``               ``((loss, aux), out)``
  ``state_argnums``   ``((loss, weight), new_state)``         ``((loss, out), state)``
  both                ``(((loss, weight), aux), new_state)``  ``(((loss, aux), out), state)``
  ==================  ======================================  ================================

  ``f.accumulate(window, ...)`` nests its result the same way, with
  ``(loss_sum, weight)`` in place of ``loss`` and the new window in place of
  ``out``. ``new_state`` and ``state`` are one state for an int
  ``state_argnums`` and a tuple of states, one per argument, for a
  sequence; ``state`` is the last microbatch's.

  Args:
    loss_fn: called as ``loss_fn(*args, **kwargs)`` on one microbatch;
      returns ``(loss, weight)``, nested with ``aux`` and the new state as
      the table above says. ``weight`` is the microbatch's effective item
      count (e.g. ``mask.sum()``), not differentiated. ``loss`` may be a
      dict of loss terms, each normalised by its own total weight (then
      ``weight`` is a dict with the same keys, or one weight for all; a
      weight of 1 per microbatch averages a term over the microbatches):
      the gradient is that of the sum of the terms' means.
    num_microbatches: K, a positive int dividing the batch size; or
      ``None`` with ``microbatch_size``.
    mode: required. ``"sum"``: ``loss`` is the microbatch's loss SUM over
      its items; ``"mean"``: it is that sum divided by ``weight`` (a fully
      masked microbatch, 0/0, adds nothing). No default is safe: the wrong
      one weights every microbatch wrongly.
    microbatch_size: the rows per microbatch instead of K (K = batch size /
      microbatch_size), as ``optax.microbatching``.
    has_aux: whether ``loss_fn`` returns an aux value.
    argnums: the positional argument(s) to differentiate (the params: any
      pytree, ``nnx.State`` or a whole ``eqx.Module`` included). Only their
      floating array leaves are differentiated; the others (ints, bools,
      Python numbers, functions: an Equinox module's static half) are held
      fixed and get ``None`` gradients, as with
      ``eqx.filter_value_and_grad``; complex leaves are refused, as by
      :func:`weighted_accum.init`. A whole ``nnx.Module`` is taken as
      ``nnx.value_and_grad`` takes it: its ``nnx.Param`` state is
      differentiated (the grads are an ``nnx.State``), its other state (RNG
      streams, batch statistics) is threaded and written back.
    batch_argnums: the argument(s) to split (pytrees whose leaves share a
      batch axis): a position, a keyword name (optax's ``argnames``), a
      sequence of them (batch axis 0), or a mapping from each to its batch
      axis, e.g. ``{1: 0, "mask": 1}``. Default: argument 1.
    split: how rows are dealt: ``"strided"`` (the default: microbatch k
      holds rows ``k::K``, as ``optax.microbatching`` and MaxText; a
      data-sharded batch stays spread over the devices) or ``"contiguous"``
      (microbatch k holds rows ``[k*B/K, (k+1)*B/K)``: a loader's padded
      batch, real rows first). Required with ``num_real_microbatches``.
    state_argnums: positional argument(s) threaded through the loop
      (batch-norm statistics, NNX RNG streams and other non-parameter
      state, flax ``mutable`` collections): each microbatch gets the state
      the previous one returned; ``f`` returns the last.
    key_argnums: positional argument(s) holding one PRNG key each (or a
      pytree of keys): microbatch i gets ``jax.random.fold_in(key, i)``;
      with ``axis_name``, replica r's gets ``fold_in(fold_in(key, r), i)``.
    dtype: the accumulation work dtype; ``None`` (optax's meaning): the
      params' dtype, which they must share.
    grads_dtype: the dtype of the returned gradients: ``None`` (the work
      dtype), ``"params"`` (each param's own dtype), or a floating dtype.
    loss_scale: each microbatch's loss is multiplied by it before
      differentiating; divided out once at the end (float16: e.g. 2**12).
      A number, a scalar array, or a :class:`~weighted_accum.DynamicLossScale`
      (its ``scale``; adjust it with ``out.finite`` after the step). ``f``'s
      own ``loss_scale=`` keyword overrides it per call (a traced value
      does not recompile).
    axis_name: the data axis (or axes) the batch is split over, or a
      :class:`~weighted_accum.distributed.DataParallel` that also gives the
      params' FSDP layout. Called inside ``jax.shard_map`` over these axes,
      ``f`` takes this replica's rows; called under plain ``jax.jit``, the
      global batch sharded over them (the loop then runs in a
      partial-manual ``shard_map`` over just these axes; each batch leaf's
      rows divisible by ``N * K``; ``split="contiguous"`` and
      ``state_argnums`` refused there). Either way a call reduces the sums,
      the weights and the counters ONCE whatever K (``docs/scaling.md``).
      Naming it declares that rows may run per replica; without it
      ``loss_fn`` sees microbatches of the global batch on every mesh.

  Returns:
    ``f(*args, num_real_microbatches=None, loss_scale=None,
    normalizers=None, **kwargs)`` returning ``(loss, out)``, nested with
    ``aux`` and the last state as the table above says. ``loss`` is the
    exact float32 mean loss (a dict of the
    terms' means for a dict of terms), ``aux`` is stacked on a leading K
    axis (microbatch order, zeros where skipped), ``out`` an
    :class:`~weighted_accum.AccumulatedGradients` (mean gradient, total
    weight (per term), ``issued``, ``finite``, ``valid``; ``valid`` is also
    false when a microbatch's weight was negative or non-finite: such a
    microbatch is dropped). ``num_real_microbatches`` (an int, traced or
    not) runs only microbatches ``k < num_real_microbatches``; the others
    are not computed and no recompilation happens across values.
    ``normalizers`` gives loss terms' normalisers known before the loop (a
    number for a single loss, else a dict by term, traced values welcome):
    such a term's sum is divided by it instead of by its total weight, and
    with ``mode="sum"`` all such terms share one window (one buffer, one
    backward pass; with ``"mean"`` each keeps its own, so a fully masked
    term's 0/0 mean adds nothing); every other term of a dict takes a window
    of its own. ``kwargs`` go to
    ``loss_fn``. ``f.accumulate(state, *args, num_real_microbatches=None,
    **kwargs)`` adds the call's microbatches to an open window ``state``
    without finishing and returns ``((loss_sum, weight), state)``, nested
    with ``aux`` and the last threaded state as ``f``'s result (the table
    above), the call's unscaled loss sum and weight; it uses the state's
    work dtype and loss scale.
    Under plain ``jit`` with ``axis_name``, ``aux`` leaves are ``[K, N, ...]`` (``aux[k, r]``
    replica ``r``'s value for its rows of microbatch ``k``, sharded over
    the data axes on dimension 1), and ``f.accumulate`` takes a per-replica
    window stacked over the replicas
    (:func:`weighted_accum.init` with ``axis_name``, outside ``shard_map``)
    and runs no collective: ``loss_sum`` and ``weight`` are per replica,
    ``[N]``; close the window with ``wa.apply_window`` or
    ``wa.finish_mean`` (one reduction). Inside ``shard_map`` it takes this
    replica's window (``wa.init(params, axis_name=...)`` there) or its
    block of a stacked one, and returns the same kind.

  Raises:
    WeightedAccumulationError: for an invalid configuration, arguments that
      do not fit the roles, batch leaves whose sizes differ or are not
      divisible by K, a ``loss_fn`` that does not return ``(loss, weight)``,
      a loss that is not a floating scalar, a returned state shaped unlike
      the state argument, ``num_real_microbatches`` without ``split``, an
      ``axis_name`` that the batch's mesh does not have or whose replicas
      times K do not divide the batch, FSDP param
      specs the reduce-scatter cannot produce, a loss varying over
      ``shard_map`` axes outside ``axis_name``, or (eagerly) a call whose
      total weight is 0.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import weighted_accum as wa
    >>> def loss_fn(w, batch):            # batch: (x, mask)
    ...   x, mask = batch
    ...   return jnp.sum(mask * (x * w) ** 2), mask.sum()
    >>> x = jnp.arange(8.0)
    >>> mask = jnp.array([1., 1, 1, 0, 1, 0, 0, 0])
    >>> f = jax.jit(wa.microbatched_value_and_grad(loss_fn, 4, mode='sum'))
    >>> loss, out = f(jnp.float32(1.0), (x, mask))
    >>> full = jax.grad(lambda w: loss_fn(w, (x, mask))[0] / 4)(1.0)
    >>> float(loss), float(out.grads), float(full), float(out.weight)
    (5.25, 10.5, 10.5, 4.0)
  """
  cfg = _configure(
    loss_fn,
    num_microbatches,
    mode=mode,
    microbatch_size=microbatch_size,
    has_aux=has_aux,
    argnums=argnums,
    batch_argnums=batch_argnums,
    split=split,
    state_argnums=state_argnums,
    key_argnums=key_argnums,
    dtype=dtype,
    grads_dtype=grads_dtype,
    loss_scale=loss_scale,
    axis_name=axis_name,
  )
  return _functions(cfg)


def _functions(cfg: _Config) -> Callable[..., Any]:
  """``f`` and its ``.accumulate`` (with ``axis_name`` unbound: per replica)."""
  eager: dict = {}  # the compiled programs of eager calls (run_eagerly)
  global_batch = lambda: cfg.dp is not None and not replicas.bound(cfg.axes)

  def f(
    *args, num_real_microbatches=None, loss_scale=None, normalizers=None, **kw
  ):
    args = margs.float_params(cfg.roles, args)
    n_real = num_real_microbatches
    if global_batch():
      call = (args, kw, n_real, call_scale(cfg, loss_scale), normalizers)
      return spmd.value_and_grad(cfg, _step, call, eager)
    return _step(cfg, args, kw, n_real, loss_scale, normalizers)

  def accumulate(state, *args, num_real_microbatches=None, **kw):
    args = margs.float_params(cfg.roles, args)
    call = (args, kw, num_real_microbatches)
    if global_batch():
      return spmd.accumulate(cfg, _accumulate, state, call, eager)
    return _accumulate(cfg, state, *call)

  f.accumulate = accumulate
  return f
