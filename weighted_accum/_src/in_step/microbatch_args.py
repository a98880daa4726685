"""The arguments of an in-step call by role: differentiated (floating leaves;
an NNX object's Params), split, threaded state, random keys, or passed
unchanged; the roles checked, one call's batch split into microbatches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src import validation
from weighted_accum._src.core import tree_utils
from weighted_accum._src.errors import WeightedAccumulationError

_ROLES = ("argnums", "batch_argnums", "state_argnums", "key_argnums")


class Roles(NamedTuple):
  """The validated argument roles and split of one microbatched function."""

  argnums: tuple[int, ...]
  single: bool  # argnums was an int: the grads are that argument's tree
  batch_argnums: tuple[int, ...]
  batch_argnames: tuple[str, ...]
  in_axes: tuple[int, ...]  # one per batch argument, positional then keyword
  state_argnums: tuple[int, ...]
  single_state: bool
  key_argnums: tuple[int, ...]
  split: str
  split_named: bool  # split= was given (required with num_real_microbatches)
  num_microbatches: int | None
  microbatch_size: int | None


def _batch(batch: Any) -> tuple[Any, tuple, Any]:
  """``batch_argnums`` as positions, keyword names and batch axes."""
  if batch is None:
    return 1, (), 0  # the default: argument 1
  keys = [batch] if isinstance(batch, (str, int, np.integer)) else list(batch)
  names = tuple(k for k in keys if isinstance(k, str))
  if isinstance(batch, (int, np.integer)):
    return batch, names, 0
  nums = tuple(k for k in keys if not isinstance(k, str))
  if not isinstance(batch, Mapping):
    return nums, names, 0
  return nums, names, tuple(batch[k] for k in (*nums, *names))


def configure(
  what,
  num_microbatches,
  microbatch_size,
  argnums,
  batch_argnums,
  split,
  state_argnums,
  key_argnums,
) -> Roles:
  """Validates the roles (each named in its error) and their disjointness."""
  hint = "pass num_real_microbatches to run fewer without recompiling."
  count = lambda n, s, h: (
    None
    if n is None
    else validation.static_int(n, what=f"{what}({s}=...)", hint=h)
  )
  k = count(num_microbatches, "num_microbatches", hint)
  size = count(microbatch_size, "microbatch_size", "")
  if (k is None) == (size is None):
    raise WeightedAccumulationError(
      f"{what}: pass exactly one of num_microbatches and microbatch_size."
    )
  batch, names, in_axes = _batch(batch_argnums)
  names = validation.argnames(names, what=what, name="batch_argnums")
  given = (argnums, batch, state_argnums, key_argnums)
  roles = {
    name: validation.optional_argnums(x, what=what, name=name)
    for name, x in zip(_ROLES, given)
  }
  if not roles["argnums"]:
    raise WeightedAccumulationError(
      f"{what}(argnums=()): nothing to differentiate; pass the params' index."
    )
  if not roles["batch_argnums"] and not names:
    raise WeightedAccumulationError(
      f"{what}: no batch argument to split; pass batch_argnums."
    )
  _check_disjoint(what, roles)
  return Roles(
    single=isinstance(argnums, (int, np.integer)),
    batch_argnames=names,
    in_axes=validation.in_axes(
      in_axes, len(roles["batch_argnums"]) + len(names), what=what
    ),
    single_state=isinstance(state_argnums, (int, np.integer)),
    split=validation.split(
      "strided" if split is None else split, what=f"{what}(split=...)"
    ),
    split_named=split is not None,
    num_microbatches=k,
    microbatch_size=size,
    **roles,
  )


def _check_disjoint(what: str, roles: dict[str, tuple[int, ...]]) -> None:
  seen: dict[int, str] = {}
  for name, n in ((name, n) for name, ns in roles.items() for n in ns):
    if n in seen:
      raise WeightedAccumulationError(
        f"{what}: argument {n} is in both {seen[n]} and {name}; give each "
        "argument one role."
      )
    seen[n] = name


# ------------------------------------------------------------ one call --


class Leaf(NamedTuple):
  """A batch leaf: where it is, its batch axis and its size there."""

  name: str
  x: Any
  axis: int
  rows: int


class Diff(NamedTuple):
  """A differentiated argument (an NNX object: its Params, ``rest`` threaded)."""

  treedef: Any
  mask: tuple[bool, ...]
  leaves: tuple[Any, ...]
  node: Any = None
  graphdef: Any = None
  rest: Any = None


class Batch(NamedTuple):
  """A split batch argument."""

  kind: str  # "arg" or "kw"
  where: Any  # positional index or keyword name
  treedef: Any
  leaves: tuple[Any, ...]
  take: tuple[int, ...]


class Call(NamedTuple):
  """One call's arguments, checked and split."""

  args: tuple
  kwargs: dict
  k: int
  batch: tuple[Batch, ...]
  diffs: tuple[Diff, ...]
  rows: int  # the split batch's rows along its batch axis


_ARRAY = (jax.Array, np.ndarray, np.generic)


def differentiable(x: Any) -> bool:
  """A floating array leaf (JAX or NumPy): what is differentiated."""
  return isinstance(x, _ARRAY) and jnp.issubdtype(x.dtype, jnp.floating)


def _refuse_complex(what: str, n: int, x: Any) -> None:
  """Refuses complex array leaves, as ``wa.init`` does."""
  for path, v in tree_utils.flat(x):
    if isinstance(v, _ARRAY) and jnp.iscomplexobj(v):
      raise WeightedAccumulationError(
        f"{what}: argument {n} (argnums) leaf {path} is {v.dtype}; complex "
        "params are not supported: differentiate the real and imaginary "
        "parts as two float arrays, or pass it undifferentiated."
      )


def _python_float(x: Any) -> bool:
  return isinstance(x, float) and not isinstance(x, np.generic)


def float_params(roles: Roles, args: tuple) -> tuple:
  """Python-float-only params as float32 scalars (see :func:`_diff`)."""
  out = list(args)
  for n in roles.argnums:
    if n < len(out) and not any(map(differentiable, jax.tree.leaves(out[n]))):
      out[n] = jax.tree.map(
        lambda v: jnp.asarray(v) if _python_float(v) else v, out[n]
      )
  return tuple(out)


def _diff(what: str, n: int, x: Any) -> Diff:
  """The differentiated leaves of argument ``n``."""
  if nnx.graph.is_graph_node(x):  # as nnx.value_and_grad: Params, the rest
    graphdef, params, rest = nnx.split(x, nnx.Param, ...)
    d = _diff(what, n, params)
    return d._replace(node=x, graphdef=graphdef, rest=rest)
  _refuse_nnx_state(what, n, x)
  _refuse_complex(what, n, x)
  leaves, treedef = jax.tree.flatten(x)
  mask = tuple(differentiable(v) for v in leaves)
  if not any(mask):
    mask = tuple(_python_float(v) for v in leaves)
    leaves = [jnp.asarray(v) if m else v for v, m in zip(leaves, mask)]
  if not any(mask):
    raise WeightedAccumulationError(
      f"{what}: argument {n} (argnums) has no floating leaf to "
      f"differentiate (got {type(x).__name__}); pass floating arrays."
    )
  return Diff(treedef, mask, tuple(leaves))


def _refuse_nnx_state(what: str, n: int, x: Any) -> None:
  """Refuses a tree of NNX variables other than ``nnx.Param``."""
  for path, v in jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_var)[0]:
    if _is_var(v) and not isinstance(v, nnx.Param):
      raise WeightedAccumulationError(
        f"{what}: argument {n} (argnums) holds {type(v).__name__} at "
        f"{jax.tree_util.keystr(path)}, whose updates a tree cannot return: "
        "pass the whole nnx.Module, or that state at state_argnums."
      )


def _batch_trees(what: str, roles: Roles, args: tuple, kwargs: dict) -> list:
  """``(kind, where, tree)`` of each batch argument, the roles' indices checked."""
  for name in _ROLES:
    nums = getattr(roles, name)
    if nums and max(nums) >= len(args):
      raise WeightedAccumulationError(
        f"{what}: {name} {nums} but the function was called with "
        f"{len(args)} positional argument(s); pass the params at argnums."
      )
  missing = [n for n in roles.batch_argnames if n not in kwargs]
  if missing:
    raise WeightedAccumulationError(
      f"{what}: batch_argnums names {missing[0]!r}, but the call has no "
      f"such keyword argument (got {sorted(kwargs)})."
    )
  trees = [("arg", n, args[n]) for n in roles.batch_argnums]
  return trees + [("kw", n, kwargs[n]) for n in roles.batch_argnames]


def batch_leaves(what: str, roles: Roles, args: tuple, kwargs: dict) -> list:
  """Each batch leaf (a :class:`Leaf`) of one call, checked."""
  out = []
  trees = _batch_trees(what, roles, args, kwargs)
  for (kind, where, tree), ax in zip(trees, roles.in_axes):
    name = f"batch argument {where!r}" if kind == "kw" else f"argument {where}"
    for path, x in tree_utils.flat(tree):
      nd = np.ndim(x)
      a = ax + nd if ax < 0 else ax
      if not 0 <= a < nd:
        raise WeightedAccumulationError(
          f"{what}: {name} leaf {path} has shape {np.shape(x)}, with no "
          f"batch axis {ax}; pass other values as another argument."
        )
      out.append(Leaf(f"{name} leaf {path}", x, a, np.shape(x)[a]))
  return out


def num_microbatches(what: str, roles: Roles, sizes: list) -> int:
  b = sizes[0].rows if sizes else 0
  k = roles.num_microbatches
  if roles.microbatch_size is not None:
    k = max(b // roles.microbatch_size, 1)
  for name, _, _, size in sizes:
    if (
      size != b
      or size % k
      or (roles.microbatch_size and size != k * roles.microbatch_size)
    ):
      m = roles.microbatch_size
      count = f"microbatch_size={m}" if m else f"num_microbatches={k}"
      raise WeightedAccumulationError(
        f"{what}: {name} has {size} rows; every batch leaf needs the same "
        f"size along its batch axis, divisible by {count} (first leaf: {b} "
        "rows). Pad the batch (with zero weight) to a multiple of it."
      )
  return k


def _reshape(x: Any, a: int, k: int, split: str) -> tuple[Any, int]:
  """``x``'s batch axis ``a`` split into (rows, K), and the K axis."""
  shape = np.shape(x)
  b = shape[a]
  two = (b // k, k) if split == "strided" else (k, b // k)
  y = jnp.reshape(x, shape[:a] + two + shape[a + 1 :])
  return y, a + 1 if split == "strided" else a


def prepare(what: str, roles: Roles, args: tuple, kwargs: dict) -> Call:
  """Checks one call's arguments against the roles and splits its batch."""
  sizes = batch_leaves(what, roles, args, kwargs)
  k = num_microbatches(what, roles, sizes)
  batch, it = [], iter(sizes)
  for kind, where, tree in _batch_trees(what, roles, args, kwargs):
    leaves, treedef = jax.tree.flatten(tree)
    split = [_reshape(x, next(it).axis, k, roles.split) for x in leaves]
    ys, takes = zip(*split) if split else ((), ())
    batch.append(Batch(kind, where, treedef, tuple(ys), tuple(takes)))
  for n in roles.key_argnums:
    for path, key in tree_utils.flat(args[n]):
      validation.random_key(key, what=f"{what}: argument {n} {path}")
  diffs = tuple(_diff(what, n, args[n]) for n in roles.argnums)
  rows = sizes[0].rows if sizes else 0
  return Call(tuple(args), dict(kwargs), k, tuple(batch), diffs, rows)


def unchanged(call: Call, roles: Roles) -> list[tuple[str, Any, str]]:
  """``(name, value, how to split it)`` of the arguments passed unchanged."""
  batch = (*roles.batch_argnums, *roles.batch_argnames)
  roled = {*roles.argnums, *batch, *roles.state_argnums, *roles.key_argnums}
  out = [(f"argument {n}", a, n) for n, a in enumerate(call.args)]
  out += [(f"keyword argument {k!r}", v, k) for k, v in call.kwargs.items()]
  how = lambda k: f"batch_argnums={(*batch, k)}"
  return [(s, v, how(k)) for s, v, k in out if k not in roled]


# ----------------------------------------------------- one microbatch --


def diff_values(call: Call) -> tuple[list[Any], ...]:
  """What is differentiated: each differentiated argument's floating leaves."""
  return tuple([x for x, m in zip(d.leaves, d.mask) if m] for d in call.diffs)


def as_params(call: Call, values: tuple[list[Any], ...], roles: Roles) -> Any:
  """``values`` (as :func:`diff_values`) in the params' structure."""
  trees = []
  for d, vals in zip(call.diffs, values):
    it = iter(vals)
    trees.append(
      jax.tree.unflatten(d.treedef, [next(it) if m else None for m in d.mask])
    )  # an NNX object's: an nnx.State of its Params, as nnx.grad's
  return trees[0] if roles.single else tuple(trees)


def params(what: str, roles: Roles, args: tuple) -> Any:
  """The differentiated arguments' leaves (``None`` where held fixed)."""
  diffs = tuple(_diff(what, n, args[n]) for n in roles.argnums)
  call = Call((), {}, 0, (), diffs, 0)
  return as_params(call, diff_values(call), roles)


def _combine(d: Diff, vals: list[Any]) -> Any:
  it = iter(vals)
  return jax.tree.unflatten(
    d.treedef, [next(it) if m else x for x, m in zip(d.leaves, d.mask)]
  )


def states(call: Call, roles: Roles) -> tuple[Any, ...]:
  """The threaded values at the call."""
  rests = tuple(d.rest for d in call.diffs if d.node is not None)
  return tuple(call.args[n] for n in roles.state_argnums) + rests


def _nodes(roles: Roles, args: Any) -> list:
  return [
    (n, args[n])
    for n in roles.argnums
    if n < len(args) and nnx.graph.is_graph_node(args[n])
  ]


def rng_states(roles: Roles, args: Any) -> list:
  """The RNG streams of the differentiated NNX objects in ``args``."""
  return [nnx.state(x, nnx.RngState) for _, x in _nodes(roles, args)]


def update_rngs(roles: Roles, args: Any, rngs: list) -> None:
  """Writes :func:`rng_states` back into the objects in ``args``."""
  for (_, x), rng in zip(_nodes(roles, args), rngs):
    nnx.update(x, rng)


def refuse_node_state(what: str, roles: Roles, args: tuple, why: str) -> None:
  """Refuses NNX objects with non-Param state other than RNG streams."""
  for n, x in _nodes(roles, args):
    rest = nnx.state(x, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))
    if jax.tree.leaves(rest):
      vs = jax.tree.leaves(rest, is_leaf=_is_var)
      kinds = ", ".join(sorted({type(v).__name__ for v in vs if _is_var(v)}))
      raise WeightedAccumulationError(
        f"{what}: argument {n} (argnums) is an NNX object with state "
        f"({kinds}) each replica would update its own way; {why}"
      )


def _is_var(v: Any) -> bool:
  return isinstance(v, nnx.Variable)


def fold_rng_keys(tree: Any, r: Any) -> Any:
  """The NNX RNG keys in ``tree`` folded with ``r`` (a replica's stream)."""
  fold = lambda v: v.replace(jax.random.fold_in(v[...], r))
  f = lambda v: fold(v) if isinstance(v, nnx.RngKey) else v
  return jax.tree.map(f, tree, is_leaf=_is_var)


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
  """``tree`` varying over ``axes``, NNX RNG counts apart (alike everywhere)."""
  to = lambda v: tree_utils.to_varying(v, axes)
  f = lambda v: v if isinstance(v, nnx.RngCount) else to(v)
  return jax.tree.map(f, tree, is_leaf=_is_var)


def node_states(call: Call, roles: Roles, args: list) -> tuple[Any, ...]:
  """Each differentiated NNX object's non-Param state in ``args``."""
  nodes = [n for n, d in zip(roles.argnums, call.diffs) if d.node is not None]
  return tuple(nnx.state(args[n], nnx.Not(nnx.Param)) for n in nodes)


def write_back(call: Call, roles: Roles, threaded: tuple) -> tuple:
  """Writes the NNX objects' final state back (keys as they came)."""
  k = len(roles.state_argnums)
  diffs = [d for d in call.diffs if d.node is not None]
  key = lambda new, old: old if isinstance(old, nnx.RngKey) else new
  for d, rest in zip(diffs, threaded[k:]):  # the RNG keys as they came
    nnx.update(d.node, jax.tree.map(key, rest, d.rest, is_leaf=_is_var))
  return threaded[:k]


def fold_keys(roles: Roles, args: tuple, i: Any) -> list:
  """``args`` with each random key folded with ``i``."""
  fold = lambda key: jax.random.fold_in(key, i)
  return [
    jax.tree.map(fold, a) if n in roles.key_argnums else a
    for n, a in enumerate(args)
  ]


def microbatch(
  call: Call,
  roles: Roles,
  i: Any,
  values: tuple[list[Any], ...],
  threaded: tuple[Any, ...],
) -> tuple[list[Any], dict]:
  """The arguments of microbatch ``i``."""
  args, kwargs = fold_keys(roles, call.args, i), dict(call.kwargs)
  for b in call.batch:
    rows = [
      jax.lax.dynamic_index_in_dim(x, i, t, keepdims=False)
      for x, t in zip(b.leaves, b.take)
    ]
    tree = jax.tree.unflatten(b.treedef, rows)
    if b.kind == "arg":
      args[b.where] = tree
    else:
      kwargs[b.where] = tree
  for n, s in zip(roles.state_argnums, threaded):
    # Rebuilt here, in the trace that runs loss_fn: an NNX state's Variables
    # may then be mutated by it (flax refuses mutating one of an outer trace).
    args[n] = jax.tree.map(lambda x: x, s)
  rests = iter(threaded[len(roles.state_argnums) :])
  for n, d, vals in zip(roles.argnums, call.diffs, values):
    args[n] = _combine(d, vals)
    if d.node is not None:  # a fresh object: loss_fn may mutate it
      rest = jax.tree.map(lambda x: x, next(rests))  # in this trace
      args[n] = nnx.merge(d.graphdef, args[n], rest)
  return args, kwargs
