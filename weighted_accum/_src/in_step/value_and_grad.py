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

  One loop iteration adds one microbatch's gradient to work-dtype buffers
  (one microbatch's activations live at a time), divided once: the gradient
  of the full batch's mean loss ``sum(loss sums) / sum(weights)``. Each
  argument of ``loss_fn`` is differentiated (``argnums``), split
  (``batch_argnums``), threaded (``state_argnums``), a key per microbatch
  (``key_argnums``), or passed unchanged.

  What ``loss_fn`` returns for one microbatch, and what ``f`` returns:

  ==================  ======================================  ================================
  options             ``loss_fn`` returns                     ``f(...)`` returns
  ==================  ======================================  ================================
  neither             ``(loss, weight)``                      ``(loss, out)``
  ``has_aux``         ``((loss, weight), aux)``               ``((loss, aux), out)``
  ``state_argnums``   ``((loss, weight), new_state)``         ``((loss, out), state)``
  both                ``(((loss, weight), aux), new_state)``  ``(((loss, aux), out), state)``
  ==================  ======================================  ================================

  ``state`` is the last microbatch's (a tuple for a sequence
  ``state_argnums``).

  Args:
    loss_fn: ``loss_fn(*args, **kwargs)`` on one microbatch, returning as
      the table says; ``weight`` is its item count (e.g. ``mask.sum()``).
      ``loss`` may be a dict of terms, each normalised by its own total
      weight (``weight`` a dict with the same keys, or one for all).
    num_microbatches: K, a positive int dividing the batch size; or
      ``None`` with ``microbatch_size``.
    mode: required. ``"sum"``: ``loss`` is the microbatch's loss SUM;
      ``"mean"``: that sum divided by ``weight`` (0/0 adds nothing).
    microbatch_size: the rows per microbatch instead of K.
    has_aux: whether ``loss_fn`` returns an aux value.
    argnums: the argument(s) to differentiate: their floating leaves (the
      others get ``None``, as ``eqx.filter_value_and_grad``; complex leaves
      refused); an ``nnx.Module``'s ``nnx.Param`` state (its other state
      threaded and written back, as ``nnx.value_and_grad``).
    batch_argnums: the argument(s) to split (pytrees whose leaves share a
      batch axis): a position, a keyword name (optax's ``argnames``), a
      sequence of them (batch axis 0), or a mapping from each to its batch
      axis, e.g. ``{1: 0, "mask": 1}``. Default: argument 1.
    split: ``"strided"`` (default: microbatch k holds rows ``k::K``, as
      optax) or ``"contiguous"`` (rows ``[k*B/K, (k+1)*B/K)``, real rows
      first). Required with ``num_real_microbatches``.
    state_argnums: argument(s) threaded through the loop (batch statistics,
      RNG streams): each microbatch gets the state the previous returned.
    key_argnums: positional argument(s) holding one PRNG key each (or a
      pytree of keys): microbatch i gets ``jax.random.fold_in(key, i)``;
      with ``axis_name``, replica r's gets ``fold_in(fold_in(key, r), i)``.
    dtype: the accumulation work dtype; ``None`` (optax's meaning): the
      params' dtype, which they must share.
    grads_dtype: the dtype of the returned gradients: ``None`` (the work
      dtype), ``"params"`` (each param's own dtype), or a floating dtype.
    loss_scale: multiplies each loss before differentiating, divided out
      once (a number, array or :class:`~weighted_accum.DynamicLossScale`);
      ``f``'s ``loss_scale=`` overrides it per call.
    axis_name: the data axes (or a
      :class:`~weighted_accum.distributed.DataParallel` with the params' FSDP
      layout): inside ``jax.shard_map`` ``f`` takes this replica's rows;
      under plain ``jax.jit`` the global batch (rows divisible by ``N * K``,
      no ``split="contiguous"`` or ``state_argnums``). One reduction per
      call whatever K. Without it ``loss_fn`` sees the global batch's rows.

  Returns:
    ``f(*args, num_real_microbatches=None, loss_scale=None,
    normalizers=None, **kwargs)`` returning ``(loss, out)`` nested as the
    table says: ``loss`` the exact float32 mean loss (a dict of the terms'
    means for a dict of terms), ``aux`` stacked on a leading K axis (zeros
    where skipped), ``out`` an :class:`~weighted_accum.AccumulatedGradients`
    (``valid`` false also when a microbatch's weight was negative or
    non-finite: it is dropped). ``num_real_microbatches`` (an int, traced or
    not) runs microbatches ``k < n`` only, without recompiling.
    ``normalizers`` gives terms' normalisers known before the loop (a number
    for a single loss, else a dict by term, traced values welcome): such a
    term's sum is divided by it; with ``mode="sum"`` such terms share one
    window, otherwise every term has its own. ``kwargs`` go to ``loss_fn``.
    ``f.accumulate(state, *args, num_real_microbatches=None, **kwargs)`` adds
    the call's microbatches to the open window ``state`` (its dtype and loss
    scale) without finishing and returns ``((loss_sum, weight), state)``,
    nested as ``f``'s result. Under plain ``jit`` with ``axis_name``,
    ``aux`` leaves are ``[K, N, ...]`` (replica ``r``'s value at
    ``aux[k, r]``) and ``f.accumulate`` takes a window stacked over the
    replicas (``wa.init(params, axis_name=...)`` outside ``shard_map``),
    runs no collective and returns per-replica ``[N]`` sums; inside
    ``shard_map`` it takes this replica's window or its block of a stacked
    one.

  Raises:
    WeightedAccumulationError: for an invalid configuration, arguments or
      ``loss_fn`` results that do not fit the roles and the table, batches
      K (times the replicas) does not divide, or eagerly a total weight of 0.

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
  return _functions(_configure(**locals()))  # every parameter, by name


def _functions(cfg: _Config) -> Callable[..., Any]:
  """``f`` and its ``.accumulate`` (with ``axis_name`` unbound: per replica)."""
  global_batch = lambda: cfg.dp is not None and not replicas.bound(cfg.axes)

  def f(
    *args, num_real_microbatches=None, loss_scale=None, normalizers=None, **kw
  ):
    args = margs.float_params(cfg.roles, args)
    n_real = num_real_microbatches
    if global_batch():
      call = (args, kw, n_real, call_scale(cfg, loss_scale), normalizers)
      return spmd.value_and_grad(cfg, _step, call)
    return _step(cfg, args, kw, n_real, loss_scale, normalizers)

  def accumulate(state, *args, num_real_microbatches=None, **kw):
    args = margs.float_params(cfg.roles, args)
    call = (args, kw, num_real_microbatches)
    if global_batch():
      return spmd.accumulate(cfg, _accumulate, state, call)
    return _accumulate(cfg, state, *call)

  f.accumulate = accumulate
  return f
