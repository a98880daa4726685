"""The one close path (``finish``, ``close``) of every window: division,
validity marks, the cross-replica round. Rationale: ``docs/design.md``,
"Closing a window"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from weighted_accum._src import validation
from weighted_accum._src.core import base
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core.base import AccumState
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError

Axes = tuple[str, ...]

# --------------------------------------------------------------- division --


def usable_divisors(loss_scale: jax.Array, weight: jax.Array) -> jax.Array:
  """A positive finite weight and a usable (finite, positive, normal) scale."""
  return (weight > 0) & jnp.isfinite(weight) & validation.scale_ok(loss_scale)


#: A divisor above this is scaled down by it (its reciprocal would be subnormal).
_BIG = 2.0**64


def _divisors(
  loss_scale: jax.Array, weight: jax.Array, ct: Any, check: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(f0, f1, f2)``: ``((x * f0) * f1) * f2 == x / loss_scale / weight``.
  Where one divisor is a power of two, ``f0`` is the reciprocal of their
  product's mantissa (exact by exponent arithmetic) and ``f1 * f2`` a power
  of two; else the larger divisor's reciprocal first, then the smaller's."""
  ls, w = loss_scale.astype(ct), weight.astype(ct)
  one, zero = jnp.ones((), ct), jnp.zeros((), ct)
  ok = usable_divisors(loss_scale, weight) if check else w > 0
  ls, w = jnp.where(ok, ls, one), jnp.where(ok, w, one)
  exact, d, f1, f2 = numerics.exact_divisor(ls, w)
  big, small = jnp.maximum(ls, w), jnp.minimum(ls, w)
  down = jnp.where(big > _BIG, jnp.asarray(1.0 / _BIG, ct), one)
  f0 = jnp.where(ok, one, zero) / jnp.where(exact, d, big * down)
  f1, f2 = jnp.where(exact, f1, down / small), jnp.where(exact, f2, one)
  return tuple(map(numerics.computed_once, (f0, f1, f2)))  # not per leaf


def _scaled(x: jax.Array, divisors: tuple[jax.Array, ...]) -> jax.Array:
  f0, f1, f2 = divisors
  return ((x * f0) * f1) * f2


def divide(
  sums: Any,
  loss_scale: jax.Array,
  weight: jax.Array,
  *,
  wide: bool = False,
  usable: bool = False,
) -> Any:
  """``sums / loss_scale / weight`` per leaf, in at least float32 (see
  :func:`_divisors`); 0 where the divisors are unusable, NaN where a sum is
  not finite. ``wide``: in the compute dtype; ``usable``: the divisors are
  known usable and the sums finite (no checks)."""
  factors = {}

  def one(b):
    ct = numerics.compute_dtype(b.dtype)
    if ct not in factors:
      factors[ct] = _divisors(loss_scale, weight, ct, check=not usable)
    x = b.astype(ct)
    g = _scaled(x, factors[ct])
    if not usable:
      g = g + (x - x)  # NaN where the sum is NaN or Inf
    return g if wide else g.astype(b.dtype)

  return jax.tree.map(one, sums)


# ------------------------------------------------------ the next window --


def next_window(
  state: AccumState, next_loss_scale: Any = None, *, keep: Any = None
) -> AccumState:
  """An empty window after ``state``; where ``keep``, its counters but the scale."""
  ls = state.loss_scale if next_loss_scale is None else next_loss_scale
  counters = base.at_finish(state, jnp.asarray(ls, state.loss_scale.dtype))
  if keep is not None:
    old = base.of(state)
    counters = {
      k: v if k == "loss_scale" else jnp.where(keep, old[k], v)
      for k, v in counters.items()
    }
  return state.replace(
    grads=jax.tree.map(tree_utils.zeros_like, state.grads), **counters
  )


# ------------------------------------------------------ collectives --


LeafReduce = tree_utils.LeafReduce


#: The scalars of a two-float tally pair, summed exactly by psum_window.
PAIR = ("weight_hi", "weight_lo")


def _leaf_axes(x: Any, axes: Axes, vma_on: bool) -> Axes:
  """The axes a leaf varies over (an unvarying leaf is already global)."""
  if not vma_on:
    return axes
  return tuple(a for a in axes if a in tree_utils.varying_axes(x))


def _plans(leaves: list[Any], plan: Any, axes: Axes, vma_on: bool) -> list:
  plan = [None] * len(leaves) if plan is None else list(plan)
  out = []
  for x, p in zip(leaves, plan):
    if p is None:
      p = LeafReduce(_leaf_axes(x, axes, vma_on))
    elif vma_on:
      p = p._replace(psum=_leaf_axes(x, p.psum, True))
    out.append(p)
  return out


def _scalar_values(scalars: Mapping[str, Any], w: int) -> dict:
  """The scalars as one psum sums them (a float32 :data:`PAIR` in limbs)."""
  values = {}
  for k, v in scalars.items():
    v = jnp.asarray(v)
    values[k] = v.astype(jnp.promote_types(v.dtype, jnp.float32))
  if all(k in values for k in PAIR) and values[PAIR[0]].dtype == jnp.float32:
    hi, lo = (values.pop(k) for k in PAIR)
    pieces = zip(numerics.split_limbs(hi, w), numerics.split_limbs(lo, w))
    values["_limbs"] = [a + b for a, b in pieces]  # exact: small integers
  return values


def psum_window(
  sums: Any,
  scalars: Mapping[str, Any],
  axes: Axes,
  *,
  vma_on: bool,
  plan: Any = None,
) -> tuple[Any, dict[str, jax.Array]]:
  """One collective round: the sums (each over the axes it varies over, or
  as ``plan`` says: a :class:`LeafReduce` per leaf) with the per-replica
  ``scalars`` (summed over ``axes``; a float32 weight pair summed exactly in
  limbs, :func:`numerics.split_limbs`). Returns ``(sums, scalars)``."""
  leaves, treedef = jax.tree.flatten(sums)
  plans = _plans(leaves, plan, axes, vma_on)
  out = list(leaves)
  for i, p in enumerate(plans):
    if p.scatter:
      out[i] = tree_utils.reduce_scatter(out[i], p.scatter, p.dim)
  groups: dict[Axes, list[int]] = {}
  for i, p in enumerate(plans):
    if p.psum:
      groups.setdefault(p.psum, []).append(i)
  size = math.prod(lax.axis_size(a) for a in axes)
  w = numerics.limb_width(size)
  values = _scalar_values(scalars, w)
  values = tree_utils.to_varying(values, axes) if vma_on else values
  full = groups.pop(axes, [])
  red, values = lax.psum(([out[i] for i in full], values), axes)
  for i, v in zip(full, red):
    out[i] = v
  for ax, idx in groups.items():
    for i, v in zip(idx, lax.psum([out[i] for i in idx], ax)):
      out[i] = v
  if "_limbs" in values:
    values.update(zip(PAIR, numerics.join_limbs(values.pop("_limbs"), w)))
  return jax.tree.unflatten(treedef, out), values


def global_marks(marks: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """Marks summed over the manual axes they vary over (every shard decides alike)."""
  axes = tree_utils.manual_axes()
  if not axes:
    return marks
  if tree_utils.vma_checked(axes):
    out = []
    for m in marks:
      ax = tuple(a for a in axes if a in tree_utils.varying_axes(m))
      out.append(lax.psum(m, ax) if ax else m)
    return tuple(out)
  return tuple(lax.psum(marks, axes))


def gated_mark(
  sums: Any, mark: Callable[[Any], jax.Array], when: jax.Array | None
) -> jax.Array:
  """The global ``mark(sums)``, read only where ``when`` (0 elsewhere)."""
  if when is None:
    return global_marks((mark(sums),))[0]
  return lax.cond(
    when,
    lambda t: global_marks((mark(t),))[0],
    lambda t: jnp.zeros((), jnp.float32),
    sums,
  )


def _check_scale_shared(loss_scale: jax.Array, axes: Axes, what: str) -> None:
  if set(axes) & tree_utils.varying_axes(loss_scale):
    raise WeightedAccumulationError(
      f"{what}: the loss scale varies over {axes}; every replica must use "
      "the same loss scale for a window. Pass it in with P() (unvarying)."
    )


# ---------------------------------------------------------------- result --


def _range_mark(sums: Any, loss_scale: Any, divisor: Any, dtypes: Any):
  """:func:`window_mark` from each leaf's largest magnitude (rounding is monotone)."""
  marks, factors = [jnp.zeros((), jnp.float32)], {}
  leaves = jax.tree.leaves(sums)
  outs = [b.dtype for b in leaves] if dtypes is None else dtypes
  for b, out in zip(leaves, outs):
    if b.size == 0:
      continue
    ct = numerics.compute_dtype(b.dtype)
    if ct not in factors:
      factors[ct] = _divisors(loss_scale, divisor, ct, check=True)
    zero, x = jnp.zeros((), ct), b.astype(ct)
    if numerics.unpartitioned(b):  # one loop; else XLA gathers partials
      fin, big = lax.reduce(
        (x - x, jnp.abs(x)),
        (zero, zero),
        lambda u, v: (u[0] + v[0], jnp.maximum(u[1], v[1])),
        tuple(range(b.ndim)),
      )
    else:
      fin, big = jnp.sum(x - x), jnp.max(jnp.abs(x))
    fits = jnp.isfinite(_scaled(big, factors[ct]).astype(b.dtype).astype(out))
    marks.append((fin + jnp.where(fits, zero, jnp.inf)).astype(jnp.float32))
  return sum(marks[1:], marks[0])


def _narrows(sums: Any, dtypes: Any) -> bool:
  """Whether a leaf is handed on in a dtype of smaller range than its own."""
  if dtypes is None:
    return False
  pairs = zip(jax.tree.leaves(sums), dtypes)
  return any(jnp.finfo(o).max < jnp.finfo(b.dtype).max for b, o in pairs)


def window_mark(
  sums: Any, loss_scale: jax.Array, weight: jax.Array, check: str, dtypes: Any
) -> jax.Array:
  """Local mark: NaN for a NaN/Inf sum, +Inf if ``check`` overflows ``dtypes``, 0."""
  if check == "sums":
    return numerics.tree_mark(sums)
  divisor = weight if check == "mean" else jnp.ones_like(weight)
  ranged = lambda t: _range_mark(t, loss_scale, divisor, dtypes)
  if _narrows(sums, dtypes):  # finite sums may not fit what is handed on
    return ranged(sums)
  ls, d = (jnp.asarray(v, jnp.float32) for v in (loss_scale, divisor))
  # Both divisors >= 1, or their product >= 2: finite sums give a result
  # no larger than the sums, so the cheaper finiteness read decides.
  shrinks = (jnp.minimum(ls, d) >= 1) | (ls >= 2 / d)
  return lax.cond(shrinks, numerics.tree_mark, ranged, sums)


def result(
  sums: Any,
  weight: jax.Array,
  loss_scale: jax.Array,
  issued: jax.Array,
  *,
  mean: bool,
  require_weight: bool,
  check: str | None = None,
  when: jax.Array | None = None,
  dtypes: Any = None,
) -> AccumulatedGradients:
  """A finish's result from the global sums; validity decided in ``dtypes``."""
  loss_scale = jnp.asarray(loss_scale)
  usable = validation.scale_ok(loss_scale)
  if require_weight:
    usable = usable & usable_divisors(loss_scale, weight)
  if mean:
    divisor = jnp.ones_like(weight) if check == "unscaled" else weight
    grads = tree_utils.cast_to(divide(sums, loss_scale, divisor), dtypes)
    mark = global_marks((numerics.tree_mark(grads, numerics.range_mark),))[0]
  else:
    grads = sums
    check = check or "sums"
    mark = gated_mark(
      sums, lambda t: window_mark(t, loss_scale, weight, check, dtypes), when
    )
  finite = ~jnp.isnan(mark)
  return AccumulatedGradients(
    grads=grads,
    weight=weight,
    loss_scale=loss_scale,
    issued=jnp.asarray(issued).astype(jnp.int32),
    finite=finite,
    valid=finite & (mark == 0) & usable,
    kind="mean" if mean else "sums",
  )


def reduce(
  state: AccumState,
  axes: Axes = (),
  *,
  extra: Mapping[str, Any] | None = None,
  plan: Any = None,
  what: str = "finish",
) -> tuple[Any, dict[str, jax.Array], jax.Array]:
  """The window's global ``(sums, scalars, weight)``: one round over ``axes``."""
  sums = state.grads
  scalars = {k: getattr(state, k) for k in base.named(base.SUMMED)}
  scalars.update(extra or {})
  if axes:
    vma_on = tree_utils.vma_checked(axes)
    if vma_on:
      _check_scale_shared(state.loss_scale, axes, what)
    sums, scalars = psum_window(sums, scalars, axes, vma_on=vma_on, plan=plan)
  # In the tally's dtype: float32, or float64 for a float64 work dtype.
  weight = jnp.asarray(scalars["weight_hi"]) + jnp.asarray(scalars["weight_lo"])
  return sums, scalars, weight


def advance(
  state: AccumState,
  out: AccumulatedGradients,
  next_loss_scale: Any,
  axes: Axes,
  keep: Any = None,
) -> AccumState:
  """The window after ``state`` closed as ``out`` (a callable scale reads ``out``)."""
  if callable(next_loss_scale):  # a dynamic scale, from this window's result
    next_loss_scale = next_loss_scale(out)
  new_state = next_window(state, next_loss_scale, keep=keep)
  if axes:
    new_state = jax.tree.map(
      lambda r, s: tree_utils.vary_like(r, s, axes), new_state, state
    )
  return new_state


def finish(
  state: AccumState,
  *,
  mean: bool,
  next_loss_scale: Any = None,
  axes: Axes = (),
  what: str = "finish",
  check: str | None = None,
  dtypes: Any = None,
) -> tuple[AccumulatedGradients, AccumState]:
  """Finishes ``state``'s window (reduce, result, next window); ``dtypes``:
  per leaf, the dtype the result is handed on (and decided) in."""
  sums, scalars, weight = reduce(state, axes, what=what)
  out = result(
    sums,
    weight,
    state.loss_scale,
    scalars["issued"],
    mean=mean,
    check=check or ("mean" if mean else "sums"),
    require_weight=mean,
    dtypes=dtypes,
  )
  keep = ~(weight > 0) if mean else None
  return out, advance(state, out, next_loss_scale, axes, keep)


def reduce_finished(
  out: AccumulatedGradients, axes: Axes, *, what: str = "reduce_sums"
) -> AccumulatedGradients:
  """The global mean from one replica's ``finish_sums`` result."""
  if out.kind != "sums":
    raise WeightedAccumulationError(
      f"{what}(out): out holds a {out.kind}, not finish_sums' sums; pass "
      "this replica's finish_sums result."
    )
  vma_on = tree_utils.vma_checked(axes)
  if vma_on:
    _check_scale_shared(out.loss_scale, axes, what)
  local = {"weight_hi": out.weight, "weight_lo": jnp.zeros_like(out.weight)}
  sums, scalars = psum_window(
    out.grads, dict(local, issued=out.issued), axes, vma_on=vma_on
  )
  return result(
    sums,
    scalars["weight_hi"] + scalars["weight_lo"],
    jnp.asarray(out.loss_scale),
    scalars["issued"],
    mean=True,
    require_weight=True,
  )


# ---------------------------------------------------------------- close --


def close(
  state: AccumState,
  operands: Any,
  apply: Callable[[Any, Any], Any],
  skip: Callable[[Any, Any], Any],
  *,
  next_loss_scale: Any = None,
  mean: bool = True,
  axes: Axes = (),
  when: jax.Array | None = None,
  dtypes: Any = None,
) -> tuple[Any, jax.Array, AccumState, AccumulatedGradients]:
  """The close kernel of ``apply_window`` and the wrapper (``apply`` gets the mean)."""
  sums, scalars, weight = reduce(state, axes)
  out = result(
    sums,
    weight,
    state.loss_scale,
    scalars["issued"],
    mean=False,
    check="mean" if mean else "unscaled",
    require_weight=True,
    when=when,
    dtypes=dtypes,
  )
  new_state = advance(state, out, next_loss_scale, axes, ~(weight > 0))
  zero_dtype = out.weight.dtype

  def valid_branch(sums, operands):
    divisor = out.weight if mean else jnp.ones((), zero_dtype)
    # A valid window has a usable loss scale and a positive finite weight.
    grads = divide(sums, out.loss_scale, divisor, wide=True, usable=True)
    grads = tree_utils.cast_to(grads, dtypes)
    return apply(grads, operands), jnp.zeros((), zero_dtype)

  def invalid_branch(sums, operands):
    # 0 as well (the weight is finite and non-negative), but not a constant
    # that XLA could forward out of the conditional.
    return skip(sums, operands), jnp.minimum(out.weight, 0)

  pred = out.valid if when is None else when & out.valid
  res, zero = lax.cond(pred, valid_branch, invalid_branch, out.grads, operands)
  return (
    res,
    zero,
    new_state,
    out.replace(grads=None, kind="mean" if mean else "sums"),
  )


def refill(state: AccumState, zero: jax.Array) -> AccumState:
  """``state`` with every buffer filled from ``zero`` (see :func:`close`)."""
  return state.replace(
    grads=jax.tree.map(lambda b: tree_utils.fill_like(b, zero), state.grads)
  )
