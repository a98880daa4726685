"""Where the caller's arrays live: one jitted computation takes arrays
committed to one set of devices only, so every entry point that hands
params, buffers or an optimizer state to a kernel checks them here first,
naming the two leaves that disagree (``docs/inputs.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from weighted_accum._src.core import tree_utils
from weighted_accum._src.errors import WeightedAccumulationError


def _committed(named_trees: Sequence[tuple[str, Any]]):
  for name, tree in named_trees:
    for path, x in tree_utils.flat(tree):
      if (
        isinstance(x, jax.Array) and not tree_utils.is_traced(x) and x.committed
      ):
        yield f"{name}{path}", x.sharding.device_set


def one_device_set(
  named_trees: Sequence[tuple[str, Any]], *, what: str
) -> None:
  """Refuses concrete committed arrays on different sets of devices.

  Uncommitted arrays follow the committed ones (as ``jax.jit`` moves them);
  traced values and host values are not placed yet and pass.

  Args:
    named_trees: ``(name, tree)`` pairs, e.g. ``("params", params)``; a
      leaf is named ``name`` followed by its path in the error.
    what: the entry point, for the error.

  Raises:
    WeightedAccumulationError: naming the first leaf committed to another
      device set than the first committed leaf, and what to do.
  """
  first = None
  for name, devices in _committed(named_trees):
    if first is None:
      first = (name, devices)
    elif devices != first[1]:
      ids = lambda ds: sorted(d.id for d in ds)
      raise WeightedAccumulationError(
        f"{what}: leaf {name} is committed to devices {ids(devices)} but "
        f"leaf {first[0]} to {ids(first[1])}; one jitted computation cannot "
        "take arrays committed to different devices. Put every param on "
        "one device or one mesh (jax.device_put(params, sharding)), and "
        "make the window and the optimizer state from those params."
      )
