"""The checks of how an in-step microbatched function is configured and
called: argument roles (indices, keyword names, batch axes), the split, the
gradients' dtype, random keys and loss-term normalisers.

Part of the validation package (built on its scalar conversions and option
checks; callers use ``validation.in_axes(...)`` etc.). Each function returns
the value to store, or raises a
:class:`~weighted_accum.WeightedAccumulationError` naming the argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum._src.core.tree_utils import is_traced
from weighted_accum._src.errors import WeightedAccumulationError
from weighted_accum._src.validation import options
from weighted_accum._src.validation import values

#: How rows are dealt to microbatches (``split=``).
SPLITS = ("strided", "contiguous")


def _is_int(a: Any) -> bool:
  return isinstance(a, (int, np.integer)) and not isinstance(
    a, (bool, np.bool_)
  )


def optional_argnums(x: Any, *, what: str, name: str) -> tuple[int, ...]:
  """Argument indices (``validation.argnums``), or ``()`` for an empty
  tuple or list."""
  if isinstance(x, (tuple, list)) and not x:
    return ()
  return options.argnums(x, what=what, name=name)


def argnames(x: Any, *, what: str, name: str) -> tuple[str, ...]:
  """A keyword-argument name or a tuple of distinct ones (may be empty)."""
  names = (x,) if isinstance(x, str) else x
  try:
    names = tuple(names)
  except TypeError:
    names = None
  if (
    names is None
    or not all(isinstance(n, str) and n.isidentifier() for n in names)
    or len(set(names)) != len(names)
  ):
    raise WeightedAccumulationError(
      f"{what}({name}={x!r}): expected a keyword-argument name or a tuple "
      "of distinct names."
    )
  return names


def in_axes(x: Any, n: int, *, what: str) -> tuple[int, ...]:
  """The batch axis of each of ``n`` batch arguments: one int for all, or a
  sequence of ``n`` ints (negative ones count from the end)."""
  axes = (x,) * n if _is_int(x) else x
  try:
    axes = tuple(axes)
  except TypeError:
    axes = None
  if axes is None or len(axes) != n or not all(map(_is_int, axes)):
    raise WeightedAccumulationError(
      f"{what}(batch_argnums' axes {x!r}): expected an int, or {n} ints: "
      "the batch axis of each batch argument (a mapping "
      "{argument: axis} as batch_argnums)."
    )
  return tuple(int(a) for a in axes)


def split(x: Any, *, what: str) -> str:
  """How rows are dealt to microbatches: ``"strided"`` or ``"contiguous"``."""
  return options.choice(
    x,
    SPLITS,
    what=what,
    name="split",
    hint="'strided': microbatch k holds rows k::K (a data-sharded batch "
    "stays spread over the devices); 'contiguous': microbatch k holds the "
    "k-th block of B/K rows (a loader's padded batch, real rows first).",
  )


def grads_dtype(x: Any, *, what: str) -> np.dtype | str | None:
  """The dtype gradients are returned in: ``None`` (the work dtype),
  ``"params"`` (each param's own dtype) or a floating dtype."""
  if x is None or (isinstance(x, str) and x == "params"):
    return x
  try:
    return values.work_dtype(x, what=what)
  except WeightedAccumulationError as e:
    raise WeightedAccumulationError(
      f"{e} Or pass grads_dtype='params' for each param's own dtype, or "
      "None for the work dtype."
    ) from None


def random_key(x: Any, *, what: str) -> Any:
  """One PRNG key: a typed key array (``jax.random.key``) or a raw
  ``uint32[2]`` one (``jax.random.PRNGKey``)."""
  dt = getattr(x, "dtype", None)
  typed = dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
  if typed and np.shape(x) == ():
    return x
  if not typed and dt == np.uint32 and np.shape(x) == (2,):
    return x
  raise WeightedAccumulationError(
    f"{what}: expected one PRNG key (jax.random.key(0), or a raw "
    f"jax.random.PRNGKey(0)), got {type(x).__name__} of dtype {dt} and "
    f"shape {np.shape(x)}. It is folded with each microbatch's index; keys "
    "per row belong in the batch."
  )


NORMALIZER_NOUN = "a loss term's normaliser (e.g. the batch's token count)"


def normalizer(x: Any, *, what: str) -> Any:
  """A loss term's normaliser known before the loop, as float32: a finite
  positive real scalar. A traced invalid one comes back as NaN (the result
  is then invalid)."""
  if is_traced(x):
    values.traced_scalar(x, what, NORMALIZER_NOUN)
    v = x.astype(jnp.float32)
    return jnp.where(jnp.isfinite(v) & (v > 0), v, jnp.nan)
  v = values.host_number(x, what=what, noun=NORMALIZER_NOUN)
  with np.errstate(over="ignore"):
    stored = np.float32(v) if math.isfinite(v) else np.float32(np.nan)
  if not (np.isfinite(stored) and stored >= np.finfo(np.float32).tiny):
    raise WeightedAccumulationError(
      f"{what} is {v!r}; it must be a finite positive float32 number, "
      f"{NORMALIZER_NOUN}, which the term's sum is divided by."
    )
  return stored


def normalizers(x: Any, terms: Sequence[Any], *, what: str) -> dict:
  """Normalisers by term: ``None`` (none known), one number for a single
  unnamed loss (``terms == [None]``), or a mapping from some of the loss
  terms' names to numbers."""
  if x is None:
    return {}
  if list(terms) == [None]:
    if isinstance(x, Mapping):
      raise WeightedAccumulationError(
        f"{what}: got a mapping, but loss_fn returns one loss; pass one "
        "number (its normaliser), or return a dict of loss terms."
      )
    return {None: normalizer(x, what=what)}
  if not isinstance(x, Mapping):
    raise WeightedAccumulationError(
      f"{what}: loss_fn returns the loss terms {sorted(terms)}; pass a "
      "mapping from term names to their normalisers."
    )
  unknown = sorted(map(str, set(x) - set(terms)))
  if unknown:
    raise WeightedAccumulationError(
      f"{what}: {unknown[0]!r} is not one of loss_fn's terms "
      f"{sorted(map(str, terms))}."
    )
  return {t: normalizer(v, what=f"{what}[{t!r}]") for t, v in x.items()}


def unsplit_batch(
  unchanged: Sequence[tuple[str, Any, str]], batch_size: int, *, what: str
) -> WeightedAccumulationError | None:
  """The error for an argument that looks like a forgotten batch: ``loss_fn``
  failed on a microbatch while an argument passed unchanged (neither split,
  differentiated, threaded nor a key) holds an array whose leading axis has
  the batch's ``batch_size`` rows. ``None`` when none does (the failure is
  then ``loss_fn``'s own).

  Args:
    unchanged: ``(name, value, fix)`` of each argument passed unchanged,
      ``fix`` the role setting that would split it.
    batch_size: the rows of the split batch arguments.
    what: the entry point, for the error.
  """
  for name, tree, fix in unchanged:
    for x in jax.tree.leaves(tree):
      shape = np.shape(x) if hasattr(x, "shape") else ()
      if shape and shape[0] == batch_size:
        return WeightedAccumulationError(
          f"{what}: loss_fn failed on a microbatch, and {name} is passed "
          f"unchanged to every microbatch although its leading axis has "
          f"the batch's {batch_size} rows (shape {tuple(shape)}). If it is "
          f"part of the batch, pass {fix} so it is split with the rest "
          "(batch_argnums takes positions and keyword names); loss_fn's own "
          "error is chained "
          "below."
        )
  return None
