"""Loss terms of in-step microbatching: one loss or a dict of terms, each
normalised by its own total weight (a window each) or by a normaliser known
before the loop (one shared window with ``mode="sum"``); their close.
Rationale: ``docs/microbatching.md``."""

from __future__ import annotations

from collections.abc import Mapping
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from weighted_accum._src import validation
from weighted_accum._src.core import numerics
from weighted_accum._src.core import tree_utils
from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumulatedGradients
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.in_step import microbatch_args as margs

_F32 = jnp.float32
_WHAT = "microbatched_value_and_grad"


class Eval(NamedTuple):
  """``loss_fn`` on one microbatch."""

  terms: dict
  weights: dict
  aux: Any
  states: tuple


class Group(NamedTuple):
  """Terms added into one window."""

  terms: tuple
  known: bool


# -------------------------------------------------------- one microbatch --


def _pair(x: Any) -> tuple:
  if not isinstance(x, (tuple, list)) or len(x) != 2:
    raise TypeError  # a dict of two keys would unpack as its keys
  return tuple(x)


def _unpack(cfg: Any, res: Any) -> tuple[Any, Any, Any, tuple]:
  """``loss_fn``'s result as ``(loss, weight, aux, states)``."""
  roles, got = cfg.roles, res
  states: tuple = ()
  want = "((loss, weight), aux)" if cfg.has_aux else "(loss, weight)"
  try:
    if roles.state_argnums:
      want = f"({want}, new_state)"
      res, new = _pair(res)
      states = (new,) if roles.single_state else tuple(new)
      if len(states) != len(roles.state_argnums):
        raise ValueError
    res, aux = _pair(res) if cfg.has_aux else (res, None)
    loss, weight = _pair(res)
  except (TypeError, ValueError):
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): it returned {type(got).__name__} "
      f"{jax.tree.structure(got)}; with has_aux={cfg.has_aux}, state_argnums="
      f"{roles.state_argnums} it must return {want} (loss: a scalar or dict)."
    ) from None
  return loss, weight, aux, states


def _scalar(x: Any, kind: str, name: Any, floating: bool) -> jax.Array:
  x = jnp.asarray(x)
  bad = x.ndim or (floating and not jnp.issubdtype(x.dtype, jnp.floating))
  if bad:
    term = "" if name is None else f" of term {name!r}"
    want = "a floating scalar" if floating else "a scalar item count"
    raise WeightedAccumulationError(
      f"{_WHAT}(loss_fn): the {kind}{term} is {jax.typeof(x)}, expected {want}."
    )
  return x


def evaluate(cfg: Any, args: list, kwargs: dict) -> Eval:
  loss, weight, aux, states = _unpack(cfg, cfg.loss_fn(*args, **kwargs))
  if isinstance(loss, Mapping):
    terms = dict(loss)
    if not isinstance(weight, Mapping):
      weight = {t: weight for t in terms}
    elif set(weight) != set(terms):
      raise WeightedAccumulationError(
        f"{_WHAT}(loss_fn): the weights' keys {sorted(map(str, weight))} "
        f"differ from the loss terms' {sorted(map(str, terms))}; give each "
        "term its weight (1.0 per microbatch: averaged over microbatches)."
      )
  else:
    terms, weight = {None: loss}, {None: weight}
  terms = {t: _scalar(v, "loss", t, True) for t, v in terms.items()}
  weights = {
    t: jax.lax.stop_gradient(_scalar(v, "weight", t, False))
    for t, v in weight.items()
  }
  return Eval(terms, weights, aux, states)


def groups(names: list, norms: dict, mode: str) -> tuple[Group, ...]:
  """The windows: one per unknown normaliser, the known ones shared (sum)."""
  known = tuple(t for t in names if t in norms)
  own = tuple(Group((t,), False) for t in names if t not in norms)
  if mode == "mean":
    return own + tuple(Group((t,), True) for t in known)
  return own + ((Group(known, True),) if known else ())


def part(cfg: Any, ev: Eval, t: Any, dtype: Any = _F32) -> jax.Array:
  """A term's loss SUM over the microbatch, in ``dtype``."""
  loss, w = ev.terms[t].astype(dtype), ev.weights[t].astype(dtype)
  if cfg.mode == "sum":
    return loss
  return jnp.where(w > 0, loss * w, 0.0)


def presence(ev: Eval, terms: tuple) -> jax.Array:
  """A known-normaliser window's weight."""
  ws = [
    validation.weight(ev.weights[t], what=f"{_WHAT}(loss_fn) weight of {t!r}")
    for t in terms
  ]
  bad = jnp.any(jnp.stack([~jnp.asarray(w.ok) for w in ws]))
  present = jnp.any(jnp.stack([jnp.asarray(w.ok) & (w.hi > 0) for w in ws]))
  return jnp.where(bad, jnp.nan, jnp.where(present, 1.0, 0.0))


# ---------------------------------------------------------------- closing --


def _finish_all(cfg: Any, groups: tuple, carry: Any, dtypes: Any) -> tuple:
  """Each window closed on the one close path: results, sums, rejections."""
  names = list(carry.sums)
  extra = {f"loss{j}": carry.sums[t][0] for j, t in enumerate(names)}
  extra |= {f"weight{j}": carry.sums[t][1] for j, t in enumerate(names)}
  extra |= {
    f"rejected{j}": st.rejected.astype(_F32)
    for j, st in enumerate(carry.states)
  }
  outs, ex = [], {}
  for j, (g, st) in enumerate(zip(groups, carry.states)):
    sums, got, weight = window.reduce(
      st,
      st.placement.axes,
      extra=extra if j == 0 else None,
      plan=None if cfg.spmd is None else cfg.spmd.plan,
      what=_WHAT,
    )
    out = window.result(
      sums,
      weight,
      st.loss_scale,
      got["issued"],
      mean=True,
      check="unscaled" if g.known else "mean",
      require_weight=True,
      dtypes=dtypes,
    )
    outs.append(out)
    if j == 0:
      ex = {k: got[k] for k in extra}
  sums = {t: (ex[f"loss{j}"], ex[f"weight{j}"]) for j, t in enumerate(names)}
  rejected = [ex[f"rejected{j}"] for j in range(len(outs))]
  return outs, sums, rejected


def _grads_dtypes(cfg: Any, call: margs.Call, work: Any) -> list:
  """Each gradient leaf's returned dtype (``grads_dtype``)."""
  values = jax.tree.leaves(margs.diff_values(call))
  if cfg.grads_dtype == "params":
    return [jnp.result_type(v) for v in values]
  dtype = work if cfg.grads_dtype is None else cfg.grads_dtype
  return [dtype] * len(values)


def _all(flags: list) -> jax.Array:
  return functools.reduce(jnp.logical_and, flags, jnp.bool_(True))


def _summed(outs: list) -> Any:
  """The windows' results summed, in the compute dtype."""
  wide = lambda x: x.astype(numerics.compute_dtype(x.dtype))
  parts = [jax.tree.map(wide, o.grads) for o in outs]
  return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)


def conclude(cfg, call, groups, norms, carry: Any):
  """The exact loss (per term) and the gradient of their sum, with flags."""
  dtypes = _grads_dtypes(cfg, call, carry.states[0].dtype)
  one = len(groups) == 1  # the gradient is its window's result
  outs, sums, rejected = _finish_all(
    cfg, groups, carry, dtypes if one else None
  )
  own = {g.terms[0]: o for g, o in zip(groups, outs) if not g.known}
  weight, loss = {}, {}
  for t, (loss_sum, w_sum) in sums.items():
    weight[t] = own[t].weight if t in own else w_sum
    loss[t] = (
      loss_sum / norms[t]
      if t in norms
      else jnp.where(weight[t] > 0, loss_sum / weight[t], 0.0)
    )
  finite = _all([o.finite for o in outs])
  finite = finite & _all([jnp.isfinite(s) for s, _ in sums.values()])
  valid = finite & _all([o.valid for o in outs])
  valid = valid & _all([r == 0 for r in rejected])
  valid = valid & _all([jnp.isfinite(v) for v in norms.values()])
  grads = outs[0].grads if one else tree_utils.cast_to(_summed(outs), dtypes)
  if not one:  # a sum of the windows' results may not fit where each did
    marks = (numerics.tree_mark(grads, numerics.range_mark),)
    valid = valid & (window.global_marks(marks)[0] == 0)
  single = list(loss) == [None]
  out = AccumulatedGradients(
    grads=grads,
    weight=weight[None] if single else weight,
    loss_scale=outs[0].loss_scale,
    issued=outs[0].issued,
    finite=finite,
    valid=valid,
    kind="mean",
  )
  return (loss[None] if single else loss), out
