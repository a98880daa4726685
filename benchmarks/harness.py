"""The timing method and the data every family shares.

Every comparison is measured in one process on the same data: each round
calls every case once in a fresh random order (seeded), after warm-up
rounds, with ``jax.block_until_ready``; a case's time is the median of its
rounds (at least 10), and its ratio to a baseline is the median of the
per-round ratios (both timed in the same round, so a load swing on a shared
machine moves both), with the ratio of the medians kept beside it.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import gc
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
  import resource
except ImportError:  # not on Windows
  resource = None

M = 2**20
NEVER = 2**30  # every_k_schedule of a mid-window step: the window never closes
RUNS = 15  # default timed rounds
MODEL_RUNS = 10  # default timed rounds of a model's step or window (seconds)


@dataclasses.dataclass
class Settings:
  """What a run measures: sizes and rounds, from the command line."""

  smoke: bool = False
  full: bool = False
  runs: int | None = None  # timed rounds; None: each family's default
  warmup: int | None = None  # warm-up rounds; None: each family's default
  sizes: tuple[str, ...] | None = None  # overrides each family's default
  # planning: the length distributions and model widths to run (None: all)
  lengths: tuple[str, ...] | None = None
  widths: tuple[int, ...] | None = None


def sizes(cfg: Settings, default=("1M", "16M", "64M")) -> list[str]:
  """The parameter counts a family runs at: ``--sizes`` if given, else
  64K for smoke, 1M to 256M for full, else the family's default."""
  if cfg.sizes is not None:
    return list(cfg.sizes)
  if cfg.smoke:
    return ["64K"]
  return ["1M", "16M", "64M", "256M"] if cfg.full else list(default)


def parse_size(s: str) -> int:
  """``'16M'`` -> 16 * 2**20; ``'64K'``, ``'1G'`` and plain integers too."""
  s = s.strip().upper()
  mult = {"K": 2**10, "M": M, "G": 2**30}.get(s[-1])
  return int(float(s[:-1]) * mult) if mult else int(s)


# ----------------------------------------------------------------------------
# Parameter trees.
# ----------------------------------------------------------------------------


def tree_shapes(n_params: int, layers: int = 12) -> dict[str, Any]:
  """Shapes of a ~``n_params`` transformer: ``2 + 8 * layers`` leaves.

  Blocks hold ~60% of the parameters (qkv and output kernels, an MLP with
  biases, two norm scales), the embedding the rest, as in small LMs.
  """
  step = 64 if n_params >= M else 8
  d = step
  while 12 * layers * (d + step) ** 2 <= 0.6 * n_params:
    d += step
  block = {
    "attn": {"qkv": {"kernel": (d, 3 * d)}, "out": {"kernel": (d, d)}},
    "ln1": {"scale": (d,)},
    "ln2": {"scale": (d,)},
    "mlp": {
      "up": {"kernel": (d, 4 * d), "bias": (4 * d,)},
      "down": {"kernel": (4 * d, d), "bias": (d,)},
    },
  }
  per_block = sum(math.prod(s) for s in shape_leaves(block))
  vocab = max((n_params - layers * per_block - d) // d, 1)
  tree = {"embed": {"embedding": (vocab, d)}, "final_ln": {"scale": (d,)}}
  for i in range(layers):
    tree[f"block_{i:02d}"] = block
  return tree


def small_leaves(n_leaves: int) -> dict[str, Any]:
  """``n_leaves`` small leaves (even): a 64x64 kernel and a bias per layer."""
  return {
    f"layer_{i:03d}": {"kernel": (64, 64), "bias": (64,)}
    for i in range(n_leaves // 2)
  }


def shape_leaves(shapes: Any) -> list[tuple[int, ...]]:
  """The shape tuples of a tree of shapes."""
  return jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))


def count_params(shapes: Any) -> int:
  """Parameters in a tree of shapes."""
  return sum(math.prod(s) for s in shape_leaves(shapes))


def make_tree(shapes: Any, dtype: Any, seed: int, scale: float = 1e-3) -> Any:
  """Random arrays shaped like ``shapes`` (seeded: equal across cases)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.standard_normal(s, np.float32) * scale, dtype),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def abstract_tree(shapes: Any, dtype: Any) -> Any:
  """``jax.ShapeDtypeStruct`` leaves: compiles without allocating."""
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, dtype),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def nbytes(tree: Any) -> int:
  """Bytes of every array (or abstract array) of a tree."""
  return sum(
    math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


@jax.jit
def fresh_copy(tree: Any) -> Any:
  """A copy in new buffers (each donating case owns its state)."""
  return jax.tree.map(jnp.copy, tree)


# ----------------------------------------------------------------------------
# The steps several families compare.
# ----------------------------------------------------------------------------


def adamw() -> optax.GradientTransformation:
  """The inner optimizer of every optimizer-level case."""
  return optax.adamw(1e-3, weight_decay=1e-4)


def train_step(tx: Any, with_weight: bool) -> Callable[..., Any]:
  """``tx.update`` + ``optax.apply_updates``; params, opt state donated.

  The step is ``step((params, opt_state), grads, weight)``; ``weight`` is
  passed as ``weight=`` to the update when ``with_weight``.
  """

  def step(state, grads, w):
    params, opt_state = state
    kw = {"weight": w} if with_weight else {}
    updates, opt_state = tx.update(grads, opt_state, params, **kw)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=0)


# ----------------------------------------------------------------------------
# Cases and rounds.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
  """One timed call: ``state = keep(fn(state, *args))``.

  Only ``fn`` and its ``block_until_ready`` are timed; ``keep`` (what the
  next call starts from) runs after, untimed, and is waited for.
  """

  name: str
  label: str  # plain words for tables and figures
  fn: Callable[..., Any]
  state: Any
  args: tuple = ()
  keep: Callable[[Any], Any] = lambda out: out
  baseline: str | None = None  # the case its ratio is taken against
  what: str = ""
  faults: list = dataclasses.field(default_factory=list)

  def __call__(self) -> float:
    f0 = _minor_faults()
    t0 = time.perf_counter()
    out = self.fn(self.state, *self.args)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    self.faults.append(_minor_faults() - f0)
    self.state = jax.block_until_ready(self.keep(out))
    del out  # anything not kept (e.g. finish's gradient) is freed untimed
    return dt


def _minor_faults() -> int:
  """Minor page faults of this process so far (0 where not available).

  Every first touch of freshly mapped memory faults once per 4 KiB page: it
  shows which calls allocate new output or temporary buffers.
  """
  if resource is None:
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(cases: list[Case], runs: int, warmup: int) -> dict[str, list]:
  """Times every case ``runs`` times, each round in a fresh random order.

  No case always follows the same neighbour (whose freed or freshly touched
  memory would bias it). Returns each case's times in seconds, by name.
  """
  for _ in range(warmup):
    for c in cases:
      c()
  for c in cases:
    c.faults.clear()
  times = {c.name: [] for c in cases}
  rng = np.random.default_rng(0)
  gc.collect()
  gc.disable()
  try:
    for _ in range(runs):
      for i in rng.permutation(len(cases)):
        times[cases[i].name].append(cases[i]())
  finally:
    gc.enable()
  return times


def paired_ratio(times: dict[str, list], case: str, base: str) -> float:
  """Median over rounds of ``time(case) / time(base)`` in the same round."""
  return float(np.median(np.array(times[case]) / np.array(times[base])))


def measure(
  cases: list[Case],
  cfg: Settings,
  runs: int = RUNS,
  warmup: int = 2,
  **common: Any,
) -> list[dict]:
  """Times ``cases`` interleaved; one result row per case.

  Args:
    cases: the cases of one comparison (their baselines among them).
    cfg: the run's settings: its ``runs`` and ``warmup``, when set, win.
    runs: the family's default timed rounds.
    warmup: the family's default warm-up rounds.
    **common: fields copied into every row (size, dtype, ...).

  Returns:
    Rows with the median time, the paired ratio to the baseline, the ratio
    of medians, the per-round times and the page faults per call.
  """
  runs = cfg.runs or runs
  warmup = warmup if cfg.warmup is None else cfg.warmup
  times = interleaved(cases, runs, warmup)
  med = {k: float(np.median(v)) for k, v in times.items()}
  rows = []
  for c in cases:
    base = c.baseline or c.name
    rows.append(
      dict(
        common,
        case=c.name,
        label=c.label,
        what=c.what,
        baseline=base,
        median_ms=med[c.name] * 1e3,
        ratio=paired_ratio(times, c.name, base),
        ratio_of_medians=med[c.name] / med[base],
        runs=len(times[c.name]),
        times_ms=[t * 1e3 for t in times[c.name]],
        faulted_mb=float(np.median(c.faults)) * 4096 / 1e6,
      )
    )
  gc.collect()
  return rows


def target(name: str, value: float | None, limit: float, **kw: Any) -> dict:
  """A figure against its target: met when ``value <= limit``."""
  status = "n/a" if value is None else "met" if value <= limit else "missed"
  return dict(kw, figure=name, value=value, limit=limit, status=status)


def add_ratio(rows: list[dict], key: str, base: str) -> None:
  """Sets ``row[key]``: the paired ratio of each row to case ``base``.

  Within one :func:`measure` (rows sharing its common fields), the i-th
  time of every row was taken in the same round.
  """
  by = {r["case"]: r for r in rows}
  ref = np.array(by[base]["times_ms"])
  for r in rows:
    r[key] = float(np.median(np.array(r["times_ms"]) / ref))
