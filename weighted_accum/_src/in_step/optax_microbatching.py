"""``optax_accumulator``: the exact weighting as an
``optax.microbatching.Accumulator`` (why MEAN is biased on padded data:
``docs/microbatching.md``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from weighted_accum._src import validation
from weighted_accum._src.core import accumulation
from weighted_accum._src.core import window
from weighted_accum._src.errors import WeightedAccumulationError

_F32 = jnp.float32


class _Folded(NamedTuple):
  """``aggregate``'s output."""

  value: Any
  grads: Any


def _unpack_value(value: Any) -> tuple[Any, Any, Any]:
  try:
    (loss, weight), grads = value
  except (TypeError, ValueError):
    raise WeightedAccumulationError(
      "optax_accumulator: each microbatch's value must be ((loss, weight), "
      "grads), as returned by jax.value_and_grad(loss_fn, has_aux=True) "
      f"with loss_fn returning (loss, weight); got {type(value).__name__}."
    ) from None
  return loss, weight, grads


def optax_accumulator(mode: str, dtype: Any = jnp.float32) -> Any:
  """An exact weighted ``optax.microbatching.Accumulator``.

  A drop-in for ``accumulator=AccumulationType.MEAN`` in
  ``optax.microbatching`` (``microbatch``, ``micro_vmap``, ``micro_grad``,
  and ``aggregate`` on per-example values): the microbatched function
  returns ``((loss, weight), grads)`` and the result is ``((mean_loss,
  total_weight), mean_grads)``, the exact full-batch values (MEAN divides by
  the microbatch count). Weight 0 adds nothing (even NaN). A negative, NaN or
  infinite weight cannot raise inside optax's loop: the microbatch (or, in
  ``aggregate``, the example) is rejected, the loss and grads are NaN
  (caught by e.g. ``optax.apply_if_finite``) and the weight is minus the
  number rejected, never 0 and never a total weight.

  Args:
    mode: required. ``"sum"`` when ``loss`` is the microbatch's loss SUM,
      ``"mean"`` when it is the SUM divided by ``weight``.
    dtype: the gradient buffers' work dtype (``None``: the gradients').

  Returns:
    An ``optax.microbatching.Accumulator``.

  Raises:
    WeightedAccumulationError: for an unknown mode, a non-floating dtype, or
      a value that is not ``((loss, weight), grads)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import weighted_accum as wa
    >>> def loss_fn(w, x, mask):          # a per-microbatch masked mean
    ...   n = mask.sum()
    ...   return jnp.sum(mask * (x * w) ** 2) / jnp.maximum(n, 1), n
    >>> x = jnp.arange(8.0)
    >>> mask = jnp.array([1., 1, 1, 1, 1, 1, 0, 0])
    >>> f = optax.microbatching.microbatch(
    ...     jax.value_and_grad(loss_fn, has_aux=True), argnums=(1, 2),
    ...     microbatch_size=2, accumulator=wa.optax_accumulator('mean'))
    >>> (loss, weight), grads = f(1.0, x, mask)
    >>> float(loss), float(weight), float(grads)   # (0+1+4+9+16+25) / 6
    (9.166666984558105, 6.0, 18.33333396911621)
  """
  from optax import microbatching  # pylint: disable=g-import-not-at-top

  what = "optax_accumulator"
  mean = validation.mode(mode, what=f"{what}(mode=...)") == "mean"
  dt = dtype  # None: the gradients' (read by init)
  if dt is not None:
    dt = validation.work_dtype(dt, what=f"{what}(dtype=...)")

  def init(value):
    _, _, grads = _unpack_value(value)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grads)
    return accumulation.init(zeros, dt), jnp.zeros((), _F32), jnp.int32(0)

  def update(carry, value, _):
    st, loss_sum, rejected = carry
    folded = isinstance(value, _Folded)
    loss, weight, grads = _unpack_value(value)
    as_mean = mean or folded
    new = accumulation.add(st, grads, weight, mean=as_mean, name=what)
    wt = validation.weight(
      weight, what=f"{what}: the weight", tally=st.weight_hi.dtype
    )
    w = (jnp.asarray(wt.hi) + jnp.asarray(wt.lo)).astype(_F32)
    part = jnp.asarray(loss, _F32) * (w if as_mean else 1.0)
    took = (new.rejected == st.rejected) & (w > 0)
    n = -jnp.asarray(weight, _F32) if folded else jnp.float32(1)  # -rejected
    n = jnp.where(new.rejected == st.rejected, 0, jnp.where(n >= 1, n, 1))
    n = n.astype(jnp.int32)  # the carry's type, also with x64 on
    return new, loss_sum + jnp.where(took, part, 0.0), rejected + n

  def finalize(carry):
    st, loss_sum, rejected = carry
    out, _ = window.finish(st, mean=True, what=what)
    loss = jnp.where(out.weight > 0, loss_sum / out.weight, 0.0)
    bad = rejected > 0
    nan = lambda x: jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)
    weight = jnp.where(bad, -rejected.astype(_F32), out.weight)
    return (nan(loss), weight), jax.tree.map(nan, out.grads)

  def aggregate(values):
    """Per-example values (leading axis) folded on the same paths."""
    _unpack_value(values)
    n = jax.tree.leaves(values)[0].shape[0]
    one = lambda i: jax.tree.map(lambda x: x[i], values)

    def body(i, carry):
      return update(carry, one(i), None)

    (loss, weight), grads = finalize(
      jax.lax.fori_loop(0, n, body, init(one(0)))
    )
    return _Folded((loss, weight), grads)

  return microbatching.Accumulator(
    init=init,
    update=update,
    finalize=finalize,
    aggregate=aggregate,
  )
