"""Benchmarks of weighted_accum against the memory-bandwidth limit and optax.

One command::

  python benchmarks/run.py            # default: 1M/16M/64M params, < 5 min on 2 CPU cores
  python benchmarks/run.py --full     # adds 256M params and a larger end-to-end model
  python benchmarks/run.py --smoke    # tiny sizes, a few seconds (plumbing check)
  python benchmarks/run.py --microbatch-only   # only case 7 (short model)

writes ``benchmarks/results/<backend>-<date>.{json,md,png}`` and prints the
Markdown table. It runs unchanged on CPU, GPU and TPU (the default JAX device).

Method: every comparison is measured in the same process, on the same data,
interleaved (each round calls every case once, in a random order), warm,
with ``jax.block_until_ready``; the figure is the median of ``--runs`` rounds
(at least 10) and is reported as a ratio to the baseline of the same group.

Cases, over a transformer-like tree of ~100 leaves (embedding, 12 blocks of
attention/MLP kernels, biases and norm scales), with float32 and bfloat16
gradients accumulated into float32 buffers:

1. the limit: NumPy in-place add (host) and a bare jitted donated ``buf + g``;
2. ``accumulate_sum`` / ``accumulate_mean``, jitted, state donated;
3. a mid-window train step (update + ``optax.apply_updates``, params and optimizer
   state donated, ``optax.adamw`` inner): ``optax.MultiSteps`` vs
   ``weighted_accum.weighted_multi_steps`` vs the core functional API alone;
4. ``finish_mean`` vs a bare donated ``buf * c`` (and the floor its contract
   implies: the scale plus fresh zero buffers for the next window);
5. end to end: a Flax NNX transformer, one window of 8 microbatches of unequal
   token counts, wrapper vs ``optax.MultiSteps`` vs a minimal hand-written
   accumulation loop (tokens/s);
6. compiled memory analysis (aliased, temporary and output bytes) of 2-4;
7. in-step microbatching: ``wa.microbatched_value_and_grad`` against a
   MaxText-style hand scan and ``optax.microbatching`` (SUM) at K = 8 on a
   Flax NNX LM, the same model at K = 1 and 4 (tokens/s, compiled
   temporaries), and the all-reduces each data-parallel style executes per
   step on an 8-device mesh (counted in a child process's compiled HLO).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
from pathlib import Path
import platform
import re
import subprocess
import sys
import tempfile
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

try:  # The repository root, when run as ``python benchmarks/run.py``.
  import weighted_accum as wa
except ImportError:  # pragma: no cover
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import weighted_accum as wa

weighted_multi_steps = wa.weighted_multi_steps

M = 2**20
# glibc settings that stop XLA:CPU's per-call temporaries from being mmapped and
# page-faulted afresh on every call (see README, "Benchmarks").
TUNED_ALLOCATOR = {
  "MALLOC_ARENA_MAX": "1",
  "MALLOC_MMAP_THRESHOLD_": str(2**32),
  "MALLOC_TRIM_THRESHOLD_": str(2**33),
}
RESULTS = Path(__file__).resolve().parent / "results"
NEVER = 2**30  # every_k of the mid-window cases: the window never closes.

# ----------------------------------------------------------------------------
# Data: a transformer-like parameter tree.
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
  per_block = sum(math.prod(s) for s in _leaves(block))
  vocab = max((n_params - layers * per_block - d) // d, 1)
  tree = {"embed": {"embedding": (vocab, d)}, "final_ln": {"scale": (d,)}}
  for i in range(layers):
    tree[f"block_{i:02d}"] = block
  return tree


def _leaves(shapes: Any) -> list[tuple[int, ...]]:
  return jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))


def make_tree(shapes: Any, dtype: Any, seed: int, scale: float = 1e-3) -> Any:
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.standard_normal(s, np.float32) * scale, dtype),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def nbytes(tree: Any) -> int:
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------
# The harness.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
  """One benchmarked call: ``state = keep(fn(state, *args))``, timed."""

  name: str
  fn: Callable[..., Any]
  state: Any
  args: tuple = ()
  keep: Callable[[Any], Any] = lambda out: out
  baseline: str | None = None  # the case its ratio is taken against
  what: str = ""
  memory: bool = False  # report its compiled memory analysis (a jitted fn)
  donated: Callable[[Any], Any] | None = None  # the donated buffers in state

  faults: list = dataclasses.field(default_factory=list)

  def __call__(self) -> float:
    f0 = _minor_faults()
    t0 = time.perf_counter()
    out = self.fn(self.state, *self.args)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    self.faults.append(_minor_faults() - f0)
    self.state = self.keep(out)
    del out  # Anything not kept (e.g. finish's out.grads) is freed untimed.
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
  """Interleaved timing: each round calls every case once, in a fresh random
  order (seeded), so no case always follows the same neighbour (whose freed
  or freshly touched memory would bias it)."""
  for _ in range(warmup):
    for c in cases:
      c()
  times = {c.name: [] for c in cases}
  for c in cases:
    c.faults.clear()
  rng = np.random.default_rng(0)
  gc.collect()
  gc.disable()
  try:
    for _ in range(runs):
      for i in rng.permutation(len(cases)):
        c = cases[i]
        times[c.name].append(c())
  finally:
    gc.enable()
  return times


def compile_and_analyse(case: Case) -> dict[str, Any]:
  """Compiles a jitted case once (timing then reuses the executable) and
  returns its compiled memory figures (deterministic)."""
  compiled = case.fn.lower(case.state, *case.args).compile()
  case.fn = compiled
  ma = compiled.memory_analysis()
  donated = nbytes(case.donated(case.state)) if case.donated else 0
  out = {
    "argument_bytes": int(ma.argument_size_in_bytes),
    "output_bytes": int(ma.output_size_in_bytes),
    "alias_bytes": int(ma.alias_size_in_bytes),
    "temp_bytes": int(ma.temp_size_in_bytes),
    "buffer_bytes": donated,
  }
  out["all_aliased"] = bool(out["alias_bytes"] >= donated)
  out["temp_pct_of_buffers"] = (
    100.0 * out["temp_bytes"] / donated if donated else None
  )
  return out


# ----------------------------------------------------------------------------
# Cases 1-4: one group per (size, grads dtype).
# ----------------------------------------------------------------------------

tmap = jax.tree.map


@jax.jit
def _copy(tree):
  return tmap(jnp.copy, tree)


def _bare_add(buf, g):
  return tmap(lambda b, x: b + x.astype(b.dtype), buf, g)


def _bare_scale(buf, c):
  return tmap(lambda b: b * c.astype(b.dtype), buf)


def _scale_and_zeros(buf, c):
  return _bare_scale(buf, c), tmap(jnp.zeros_like, buf)


def _numpy_add(buf, g):
  for b, x in zip(buf, g):
    np.add(b, x, out=b)
  return buf


def _train_step(tx: optax.GradientTransformation, with_weight: bool):
  """update + apply_updates; params and optimizer state are donated."""

  def step(state, grads, w):
    params, opt_state = state
    kw = {"weight": w} if with_weight else {}
    updates, opt_state = tx.update(grads, opt_state, params, **kw)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=0)


def _core_step(state, grads, w):
  """The functional API's mid-window step: only the accumulator changes."""
  params, opt_state, acc = state
  return params, opt_state, wa.accumulate_mean(acc, grads, w)


def _inner():
  return optax.adamw(1e-3, weight_decay=1e-4)


def group_cases(
  shapes: Any, gdtype: Any, *, numpy_ref: bool, finish: bool
) -> list[Case]:
  """The cases of one (size, grads dtype) group; fresh arrays for each."""
  params = make_tree(shapes, jnp.float32, 0)
  grads = make_tree(shapes, gdtype, 1)
  w = jnp.float32(3.0)
  c = jnp.float32(0.5)
  donate0 = dict(donate_argnums=0)
  cases = [
    Case(
      "bare_add",
      jax.jit(_bare_add, **donate0),
      _copy(params),
      (grads,),
      what="jitted donated buf + g (baseline)",
      memory=True,
      donated=lambda s: s,
    ),
  ]
  if numpy_ref:
    host_buf = [np.array(x) for x in jax.tree.leaves(params)]
    host_g = [np.asarray(x) for x in jax.tree.leaves(grads)]
    cases.append(
      Case(
        "numpy_add",
        _numpy_add,
        host_buf,
        (host_g,),
        baseline="bare_add",
        what="NumPy in-place add on the host",
      )
    )
  for name, fn in (
    ("accumulate_sum", wa.accumulate_sum),
    ("accumulate_mean", wa.accumulate_mean),
  ):
    cases.append(
      Case(
        name,
        jax.jit(fn, **donate0),
        wa.init(params),
        (grads, w),
        baseline="bare_add",
        what=f"wa.{name}, state donated",
        memory=True,
        donated=lambda s: s.grads,
      )
    )

  # Case 3: mid-window train steps.
  tx_ms = optax.MultiSteps(_inner(), every_k_schedule=NEVER)
  cases.append(
    Case(
      "step_multisteps",
      _train_step(tx_ms, False),
      _copy((params, tx_ms.init(params))),
      (grads, w),
      baseline="bare_add",
      what="optax.MultiSteps(adamw) mid-window step",
      memory=True,
      donated=lambda s: s,
    )
  )
  if weighted_multi_steps is not None:
    tx_wa = weighted_multi_steps(_inner(), NEVER, mode="mean")
    cases.append(
      Case(
        "step_wrapper",
        _train_step(tx_wa, True),
        _copy((params, tx_wa.init(params))),
        (grads, w),
        baseline="bare_add",
        what="wa.weighted_multi_steps(adamw) mid-window step",
        memory=True,
        donated=lambda s: s,
      )
    )
  inner = _inner()
  cases.append(
    Case(
      "step_core",
      jax.jit(_core_step, **donate0),
      _copy((params, inner.init(params), wa.init(params))),
      (grads, w),
      baseline="bare_add",
      what="functional API mid-window step: accumulate_mean, params and "
      "adamw state passed through donated",
      memory=True,
      donated=lambda s: s,
    )
  )

  if finish:

    def filled():  # a window holding data, so finish has something to do
      return wa.accumulate_sum(wa.init(params), grads, 7.0)

    cases += [
      Case(
        "bare_scale",
        jax.jit(_bare_scale, **donate0),
        _copy(params),
        (c,),
        what="jitted donated buf * c (finish baseline)",
        memory=True,
        donated=lambda s: s,
      ),
      Case(
        "scale_and_zeros",
        jax.jit(_scale_and_zeros, **donate0),
        _copy(params),
        (c,),
        keep=lambda out: out[0],
        baseline="bare_scale",
        what="donated buf * c plus fresh zero buffers (finish's floor)",
        memory=True,
        donated=lambda s: s,
      ),
      Case(
        "finish_mean",
        jax.jit(wa.finish_mean, **donate0),
        filled(),
        keep=lambda out: out[1],
        baseline="bare_scale",
        what="wa.finish_mean, state donated",
        memory=True,
        donated=lambda s: s.grads,
      ),
    ]
  return cases


def run_group(size_label: str, shapes: Any, gdtype: Any, args) -> list[dict]:
  cases = group_cases(
    shapes, gdtype, numpy_ref=not args.no_numpy, finish=gdtype == jnp.float32
  )
  n_params = sum(math.prod(s) for s in _leaves(shapes))
  t0 = time.perf_counter()
  mem = {c.name: compile_and_analyse(c) for c in cases if c.memory}
  times = interleaved(cases, args.runs, args.warmup)
  med = {k: float(np.median(v)) for k, v in times.items()}
  rows = []
  for c in cases:
    base = c.baseline or c.name
    rows.append(
      dict(
        size=size_label,
        params=n_params,
        leaves=len(_leaves(shapes)),
        grads_dtype=jnp.dtype(gdtype).name,
        case=c.name,
        what=c.what,
        median_ms=med[c.name] * 1e3,
        baseline=base,
        ratio=med[c.name] / med[base],
        runs=len(times[c.name]),
        times_ms=[t * 1e3 for t in times[c.name]],
        faulted_mb=float(np.median(c.faults)) * 4096 / 1e6,
        memory=mem.get(c.name),
      )
    )
  print(
    f"  {size_label} {jnp.dtype(gdtype).name}: {len(cases)} cases x "
    f"{args.runs} runs in {time.perf_counter() - t0:.1f}s",
    flush=True,
  )
  del cases
  gc.collect()
  return rows


# ----------------------------------------------------------------------------
# Issue 11: the closing step, one compile, the eager call, compile time.
# ----------------------------------------------------------------------------


def _bare_opt_step(tx):
  """A bare donated ``tx.update + apply_updates`` (the closing baseline)."""

  def step(state, grads):
    params, opt_state = state
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=0)


def _apply_window_step(tx):
  """The functional closing step: params, opt state, window donated, in the
  order they are returned."""

  def step(state):
    params, opt_state, acc = state
    params, opt_state, acc, _ = wa.apply_window(tx, acc, params, opt_state)
    return params, opt_state, acc

  return jax.jit(step, donate_argnums=0)


def _refill(state):
  """Marks the (zeroed) window as holding weight again, untimed, so the next
  call does the whole close (the work is the same on zero buffers)."""
  params, opt_state, acc = state
  put = lambda v, like: jax.device_put(v, like.sharding)
  return (
    params,
    opt_state,
    acc.replace(
      weight_hi=put(np.float32(7.0), acc.weight_hi),
      issued=put(np.int32(1), acc.issued),
    ),
  )


def close_cases(shapes: Any) -> list[Case]:
  """Closing steps against a bare donated optimizer step, same grads."""
  params = make_tree(shapes, jnp.float32, 0)
  grads = make_tree(shapes, jnp.float32, 1)
  inner = _inner()
  everything = dict(memory=True, donated=lambda s: s)
  acc = wa.accumulate_sum(wa.init(params), grads, 7.0)
  cases = [
    Case(
      "bare_opt_step",
      _bare_opt_step(inner),
      _copy((params, inner.init(params))),
      (grads,),
      what="jitted donated adamw tx.update + apply_updates (closing baseline)",
      **everything,
    ),
    Case(
      "apply_window_close",
      _apply_window_step(inner),
      _copy((params, inner.init(params), acc)),
      keep=_refill,
      baseline="bare_opt_step",
      what="wa.apply_window(adamw): finish, update, apply, reset; all donated",
      **everything,
    ),
  ]
  if weighted_multi_steps is not None:
    tx = weighted_multi_steps(_inner(), None, mode="mean")

    def close(state, g, w):
      params, opt_state = state
      updates, opt_state = tx.update(
        g, opt_state, params, weight=w, finish=jnp.bool_(True)
      )
      return optax.apply_updates(params, updates), opt_state

    cases.append(
      Case(
        "wrapper_close",
        jax.jit(close, donate_argnums=0),
        _copy((params, tx.init(params))),
        (grads, jnp.float32(3.0)),
        baseline="bare_opt_step",
        what="weighted_multi_steps(adamw) closing call (finish=True) + "
        "apply_updates, donated",
        **everything,
      )
    )
  return cases


def _small_leaves(n_layers: int) -> dict[str, Any]:
  """``2 * n_layers`` small leaves: (64x64 + 64) per layer."""
  return {
    f"layer_{i:03d}": {"kernel": (64, 64), "bias": (64,)}
    for i in range(n_layers)
  }


def eager_cases(n_layers: int) -> list[Case]:
  """``accumulate_sum`` called eagerly vs the same call in the user's jit."""
  shapes = _small_leaves(n_layers)
  params = make_tree(shapes, jnp.float32, 0)
  grads = make_tree(shapes, jnp.float32, 1)
  w = jnp.float32(2.0)
  return [
    Case(
      "jit_accumulate_small",
      jax.jit(wa.accumulate_sum),
      wa.init(params),
      (grads, w),
      what=f"jax.jit(wa.accumulate_sum), {2 * n_layers} small leaves",
    ),
    Case(
      "eager_accumulate_small",
      wa.accumulate_sum,
      wa.init(params),
      (grads, w),
      baseline="jit_accumulate_small",
      what=f"wa.accumulate_sum eagerly, {2 * n_layers} small leaves",
    ),
  ]


def run_cases(
  label: str, cases: list[Case], args, leaves: int, n_params: int
) -> list[dict]:
  mem = {c.name: compile_and_analyse(c) for c in cases if c.memory}
  times = interleaved(cases, args.runs, args.warmup)
  med = {k: float(np.median(v)) for k, v in times.items()}
  rows = []
  for c in cases:
    base = c.baseline or c.name
    rows.append(
      dict(
        size=label,
        params=n_params,
        leaves=leaves,
        grads_dtype="float32",
        case=c.name,
        what=c.what,
        median_ms=med[c.name] * 1e3,
        baseline=base,
        ratio=med[c.name] / med[base],
        runs=len(times[c.name]),
        times_ms=[t * 1e3 for t in times[c.name]],
        faulted_mb=float(np.median(c.faults)) * 4096 / 1e6,
        memory=mem.get(c.name),
      )
    )
  return rows


def compile_figures(n_layers: int, runs: int) -> dict[str, Any]:
  """Compile time of the wrapper's train step vs ``optax.MultiSteps``' (a
  fresh function each time, interleaved, median), and the compiles of a
  user's jitted step over 3 calls from a freshly born state."""
  shapes = _small_leaves(n_layers)
  params = make_tree(shapes, jnp.float32, 0)
  grads = make_tree(shapes, jnp.float32, 1)
  w = jnp.float32(2.0)
  txs = {
    "multisteps": lambda: optax.MultiSteps(_inner(), 4),
    "wrapper": lambda: weighted_multi_steps(_inner(), 4, mode="mean"),
  }
  times: dict[str, list[float]] = {k: [] for k in txs}
  rng = np.random.default_rng(0)
  for _ in range(runs):
    for name in rng.permutation(list(txs)):
      tx = txs[name]()
      fn = _train_step(tx, name == "wrapper")
      state = (params, tx.init(params))
      t0 = time.perf_counter()
      fn.lower(state, grads, w).compile()
      times[name].append(time.perf_counter() - t0)
  med = {k: float(np.median(v)) for k, v in times.items()}

  def compiles(step, state, *rest):
    """``state = step(state, *rest)`` three times; executables compiled."""
    for _ in range(3):
      state = step(state, *rest)
    jax.block_until_ready(state)
    return step._cache_size()  # pylint: disable=protected-access

  tx = _inner()
  counts = {
    "accumulate (wa.init)": compiles(
      jax.jit(lambda s, p: wa.accumulate_mean(s, p, w)), wa.init(params), params
    ),
    "apply_window step": compiles(
      _apply_window_step(tx), _copy((params, tx.init(params), wa.init(params)))
    ),
  }
  if weighted_multi_steps is not None:
    tx_wa = weighted_multi_steps(_inner(), 2, mode="mean")
    counts["wrapper step (tx.init)"] = compiles(
      _train_step(tx_wa, True), (_copy(params), tx_wa.init(params)), grads, w
    )
  return dict(
    leaves=2 * n_layers,
    runs=runs,
    compile_s={k: med[k] for k in med},
    compile_times_s=times,
    compile_ratio=med["wrapper"] / med["multisteps"],
    compiles_over_3_calls=counts,
  )


def issue11_rows(sizes: list[str], args) -> tuple[list[dict], dict]:
  rows = []
  for s in sizes:
    shapes = tree_shapes(parse_size(s), layers=args.layers)
    n = sum(math.prod(x) for x in _leaves(shapes))
    t0 = time.perf_counter()
    rows += run_cases(s, close_cases(shapes), args, len(_leaves(shapes)), n)
    print(f"  {s} closing steps in {time.perf_counter() - t0:.1f}s", flush=True)
    gc.collect()
  n_layers = 20 if args.smoke else 400
  rows += run_cases(
    f"{2 * n_layers} leaves",
    eager_cases(n_layers),
    args,
    2 * n_layers,
    n_layers * (64 * 64 + 64),
  )
  comp = compile_figures(n_layers, args.compile_runs)
  return rows, comp


def issue11_checks(rows: list[dict], comp: dict | None) -> list[dict]:
  limits = {
    "apply_window_close": 1.35,
    "wrapper_close": 1.75,
    "eager_accumulate_small": 1.20,
  }
  checks = []
  for r in rows:
    if r["case"] in limits:
      lim = limits[r["case"]]
      checks.append(
        dict(
          bar=f"{r['case']} / {r['baseline']}",
          size=r["size"],
          grads_dtype=r["grads_dtype"],
          value=r["ratio"],
          limit=lim,
          status="pass" if r["ratio"] <= lim else "miss",
          note="",
        )
      )
    m = r["memory"]
    if m and r["case"] in ("apply_window_close", "wrapper_close"):
      # Every array buffer; a freshly computed flag (a few bytes) may not be.
      unaliased = m["buffer_bytes"] - m["alias_bytes"]
      checks.append(
        dict(
          bar=f"{r['case']}: every donated array aliased",
          size=r["size"],
          grads_dtype=r["grads_dtype"],
          value=float(max(unaliased, 0)),
          limit=64.0,
          status="pass" if unaliased <= 64 else "miss",
          note=f"unaliased bytes; temp {m['temp_bytes']} bytes "
          f"({m['temp_pct_of_buffers']:.3f}% of the donated)",
        )
      )
  if comp:
    checks.append(
      dict(
        bar="wrapper step compile time / optax.MultiSteps'",
        size=f"{comp['leaves']} leaves",
        grads_dtype="float32",
        value=comp["compile_ratio"],
        limit=1.0,
        status="pass" if comp["compile_ratio"] <= 1.0 else "miss",
        note=" vs ".join(f"{k} {v:.2f}s" for k, v in comp["compile_s"].items()),
      )
    )
    for k, v in comp["compiles_over_3_calls"].items():
      if v is not None:
        checks.append(
          dict(
            bar=f"compiles over 3 calls: {k}",
            size=f"{comp['leaves']} leaves",
            grads_dtype="float32",
            value=float(v),
            limit=1.0,
            status="pass" if v <= 1 else "miss",
            note="",
          )
        )
  return checks


# ----------------------------------------------------------------------------
# Case 5: end to end, a Flax NNX transformer.
# ----------------------------------------------------------------------------


def e2e(cfg: dict, args) -> dict:
  """One window of 8 unequal microbatches, three ways; tokens/s."""
  from flax import nnx

  vocab, dim, depth, heads = (
    cfg["vocab"],
    cfg["dim"],
    cfg["layers"],
    cfg["heads"],
  )
  rows, seq, k = cfg["rows"], cfg["seq"], 8

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(
        num_heads=heads, in_features=dim, decode=False, rngs=rngs
      )
      self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
      self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
      self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.attn(self.ln1(x), mask=mask)
      return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, dim, rngs=rngs)
      self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, dim)) * 0.02)
      for i in range(depth):
        setattr(self, f"block_{i}", Block(rngs))
      self.ln_f = nnx.LayerNorm(dim, rngs=rngs)
      self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens, lengths):
      x = self.embed(tokens) + self.pos[: tokens.shape[1]]
      valid = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
      mask = nnx.combine_masks(
        nnx.make_attention_mask(valid, valid), nnx.make_causal_mask(tokens)
      )
      for i in range(depth):
        x = getattr(self, f"block_{i}")(x, mask)
      return self.head(self.ln_f(x))

  graphdef, params = nnx.split(LM(nnx.Rngs(0)), nnx.Param)
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))

  def losses(p, tokens, lengths):
    logits = nnx.merge(graphdef, p)(tokens, lengths)[:, :-1]
    targets = tokens[:, 1:]
    mask = (jnp.arange(seq - 1)[None] < (lengths[:, None] - 1)).astype(
      jnp.float32
    )
    nll = -jnp.take_along_axis(
      jax.nn.log_softmax(logits), targets[..., None], axis=-1
    )[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)

  def mean_loss(p, tokens, lengths):
    s, n = losses(p, tokens, lengths)
    return s / jnp.maximum(n, 1.0)

  def sum_loss(p, tokens, lengths):
    return losses(p, tokens, lengths)[0]

  # Unequal microbatches: same padded shape, very different valid lengths.
  rng = np.random.default_rng(0)
  batches, total_tokens = [], 0
  for m in range(k):
    hi = max(2, int(seq * (m + 1) / k))
    lengths = rng.integers(1, hi + 1, rows).astype(np.int32)
    tokens = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    total_tokens += int(np.sum(np.maximum(lengths - 1, 0)))
    batches.append((jnp.asarray(tokens), jnp.asarray(lengths)))

  def opt_step(tx, loss, with_weight):
    def step(state, tokens, lengths):
      p, opt_state = state
      g = jax.grad(loss)(p, tokens, lengths)
      kw = {}
      if with_weight:
        kw["weight"] = jnp.sum(jnp.maximum(lengths - 1, 0)).astype(jnp.float32)
      updates, opt_state = tx.update(g, opt_state, p, **kw)
      return optax.apply_updates(p, updates), opt_state

    return jax.jit(step, donate_argnums=0)

  # The hand-written loop: sum-loss grads added into a buffer, one division
  # and one adamw update at the end of the window (the weight known up front).
  inner = _inner()

  @functools.partial(jax.jit, donate_argnums=0)
  def hand_micro(acc, p, tokens, lengths):  # mid-window: only acc changes
    return tmap(jnp.add, acc, jax.grad(sum_loss)(p, tokens, lengths))

  @functools.partial(jax.jit, donate_argnums=0)
  def hand_last(state, tokens, lengths, total):
    p, opt_state, acc = state
    g = jax.grad(sum_loss)(p, tokens, lengths)
    g = tmap(lambda a, b: (a + b) / total, acc, g)
    updates, opt_state = inner.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, tmap(jnp.zeros_like, acc)

  total = jnp.float32(total_tokens)

  # Compile each jitted step once: its memory figures, then the timed calls.
  def compiled(fn, *args):
    c = fn.lower(*args).compile()
    return c, int(c.memory_analysis().temp_size_in_bytes)

  tx_ms = optax.MultiSteps(_inner(), every_k_schedule=k)
  ms_state = _copy((params, tx_ms.init(params)))
  hand_state = _copy((params, inner.init(params), tmap(jnp.zeros_like, params)))
  ms_step, ms_temp = compiled(
    opt_step(tx_ms, mean_loss, False), ms_state, *batches[0]
  )
  micro, micro_temp = compiled(
    hand_micro, hand_state[2], hand_state[0], *batches[0]
  )
  last, last_temp = compiled(hand_last, hand_state, *batches[0], total)

  def window_fn(step):
    def window(state):
      for tokens, lengths in batches:
        state = step(state, tokens, lengths)
      return state

    return window

  def hand_window(state):
    p, opt_state, acc = state
    for tokens, lengths in batches[:-1]:
      acc = micro(acc, p, tokens, lengths)
    return last((p, opt_state, acc), *batches[-1], total)

  cases = [
    Case(
      "e2e_multisteps",
      window_fn(ms_step),
      ms_state,
      what="optax.MultiSteps(adamw), mean loss",
    ),
    Case(
      "e2e_hand_loop",
      hand_window,
      hand_state,
      baseline="e2e_multisteps",
      what="hand-written loop: jitted grad + add into a donated buffer, "
      "params read-only; the last microbatch also divides and applies "
      "adamw",
    ),
  ]
  temps = {
    "e2e_multisteps": ms_temp,
    "e2e_hand_loop": max(micro_temp, last_temp),
  }
  if weighted_multi_steps is not None:
    tx_wa = weighted_multi_steps(_inner(), k, mode="mean")
    wa_state = _copy((params, tx_wa.init(params)))
    wa_step, temps["e2e_wrapper"] = compiled(
      opt_step(tx_wa, mean_loss, True), wa_state, *batches[0]
    )
    cases.append(
      Case(
        "e2e_wrapper",
        window_fn(wa_step),
        wa_state,
        baseline="e2e_multisteps",
        what="wa.weighted_multi_steps(adamw), mean loss + weight",
      )
    )
  t0 = time.perf_counter()
  times = interleaved(cases, args.e2e_runs, 1)
  med = {kk: float(np.median(v)) for kk, v in times.items()}
  out = []
  for c in cases:
    out.append(
      dict(
        case=c.name,
        what=c.what,
        params=n_params,
        microbatches=k,
        tokens_per_window=total_tokens,
        median_ms=med[c.name] * 1e3,
        tokens_per_s=total_tokens / med[c.name],
        ratio_vs_multisteps=med[c.name] / med["e2e_multisteps"],
        ratio_vs_hand_loop=med[c.name] / med["e2e_hand_loop"],
        runs=len(times[c.name]),
        times_ms=[t * 1e3 for t in times[c.name]],
        faulted_mb=float(np.median(c.faults)) * 4096 / 1e6,
        step_temp_bytes=temps[c.name],
      )
    )
  print(
    f"  e2e {n_params / 1e6:.1f}M params: {len(cases)} variants x "
    f"{args.e2e_runs} windows in {time.perf_counter() - t0:.1f}s",
    flush=True,
  )
  return dict(config=dict(cfg, params=n_params), rows=out)


# ----------------------------------------------------------------------------
# Case 7: in-step microbatching (issue 12): one jitted step over a global
# batch of K microbatches, against the hand-written and optax recipes.
# ----------------------------------------------------------------------------

MICRO_CFG = {
  "smoke": dict(vocab=128, dim=32, layers=1, heads=2, rows=16, seq=16),
  "short": dict(vocab=1024, dim=128, layers=2, heads=4, rows=32, seq=64),
  "default": dict(vocab=4096, dim=256, layers=4, heads=4, rows=32, seq=128),
}


def _micro_lm(cfg: dict):
  """A Flax NNX causal LM; returns ``(params, losses)`` with ``losses(p,
  tokens, lengths) -> (loss SUM over valid next-token targets, count)``."""
  from flax import nnx

  dim, seq, vocab = cfg["dim"], cfg["seq"], cfg["vocab"]

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(
        num_heads=cfg["heads"], in_features=dim, decode=False, rngs=rngs
      )
      self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
      self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
      self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.attn(self.ln1(x), mask=mask)
      return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, dim, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(cfg["layers"])])
      self.ln_f = nnx.LayerNorm(dim, rngs=rngs)
      self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens, lengths):
      valid = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
      mask = nnx.combine_masks(
        nnx.make_attention_mask(valid, valid), nnx.make_causal_mask(tokens)
      )
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x, mask)
      return self.head(self.ln_f(x))

  graphdef, params = nnx.split(LM(nnx.Rngs(0)), nnx.Param)

  def losses(p, tokens, lengths):
    logits = nnx.merge(graphdef, p)(tokens, lengths)[:, :-1]
    mask = (jnp.arange(seq - 1)[None] < (lengths[:, None] - 1)).astype(
      jnp.float32
    )
    nll = -jnp.take_along_axis(
      jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1
    )[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)

  return params, losses


def _micro_data(cfg: dict, rows: int, seed: int = 0):
  """Token rows with very unequal valid lengths (1..seq)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, cfg["seq"] + 1, rows).astype(np.int32)
  tokens = rng.integers(0, cfg["vocab"], (rows, cfg["seq"])).astype(np.int32)
  return (
    jnp.asarray(tokens),
    jnp.asarray(lengths),
    int(np.sum(np.maximum(lengths - 1, 0))),
  )


def _hand_scan(losses, k: int):
  """MaxText-style: a scan over rows k::K, sum loss and total weight in the
  carry, one division at the end."""

  def step(p, tokens, lengths):
    def split(x):
      return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)

    def body(carry, mb):
      g_acc, l_acc, w_acc = carry
      (l, w), g = jax.value_and_grad(losses, has_aux=True)(p, *mb)
      return (tmap(jnp.add, g_acc, g), l_acc + l, w_acc + w), None

    zero = jnp.zeros((), jnp.float32)
    (g, l, w), _ = jax.lax.scan(
      body,
      (tmap(jnp.zeros_like, p), zero, zero),
      (split(tokens), split(lengths)),
    )
    return l / w, tmap(lambda x: x / w, g)

  return jax.jit(step)


def _optax_microbatch_sum(losses, k: int, rows: int):
  mb = optax.microbatching.microbatch(
    jax.value_and_grad(losses, has_aux=True),
    argnums=(1, 2),
    microbatch_size=rows // k,
    accumulator=optax.microbatching.AccumulationType.SUM,
  )

  def step(p, tokens, lengths):
    (l, w), g = mb(p, tokens, lengths)
    return l / w, tmap(lambda x: x / w, g)

  return jax.jit(step)


def _optax_micro_grad_sum(losses, k: int, rows: int):
  mg = optax.microbatching.micro_grad(
    losses,
    has_aux=True,
    batch_argnums=(1, 2),
    microbatch_size=rows // k,
    accumulator=optax.microbatching.AccumulationType.SUM,
  )

  def step(p, tokens, lengths):
    g, aux = mg(p, tokens, lengths)
    w = jnp.sum(aux.aux)
    return jnp.sum(aux.values) / w, tmap(lambda x: x / w, g)

  return jax.jit(step)


def _micro_case(name, fn, params, data, base, what) -> Case:
  return Case(
    name,
    fn,
    params,
    data,
    keep=lambda out, p=params: p,
    baseline=base,
    what=what,
    memory=True,
  )


def microbatch_bench(cfg: dict, args, k: int = 8) -> dict:
  """Ratios at K = 8 against the hand scan and optax; the NNX model at
  K in {1, 4, 8}; all-reduces per step (8-device child process)."""
  params, losses = _micro_lm(cfg)
  rows = cfg["rows"]
  tokens, lengths, n_tok = _micro_data(cfg, rows)
  data = (tokens, lengths)
  wa_f = lambda kk: jax.jit(
    wa.microbatched_value_and_grad(losses, kk, batch_argnums=(1, 2), mode="sum")
  )
  hand = "mb_hand_scan"
  cases = [
    _micro_case(
      hand,
      _hand_scan(losses, k),
      params,
      data,
      None,
      f"MaxText-style lax.scan, K={k}, sum loss + weight carry",
    ),
    _micro_case(
      "mb_wa",
      wa_f(k),
      params,
      data,
      hand,
      f"wa.microbatched_value_and_grad, K={k}",
    ),
    _micro_case(
      "mb_optax_microbatch_sum",
      _optax_microbatch_sum(losses, k, rows),
      params,
      data,
      hand,
      "optax.microbatching.microbatch(value_and_grad), SUM",
    ),
    _micro_case(
      "mb_optax_micro_grad_sum",
      _optax_micro_grad_sum(losses, k, rows),
      params,
      data,
      hand,
      "optax.microbatching.micro_grad (per-example grads), SUM",
    ),
  ]
  cases += [
    _micro_case(
      f"mb_wa_k{kk}",
      wa_f(kk),
      params,
      data,
      "mb_wa",
      f"wa.microbatched_value_and_grad, K={kk}",
    )
    for kk in (1, 4)
  ]
  mem = {c.name: compile_and_analyse(c) for c in cases}
  t0 = time.perf_counter()
  times = interleaved(cases, args.e2e_runs, 1)
  med = {kk: float(np.median(v)) for kk, v in times.items()}
  out = []
  for c in cases:
    base = c.baseline or c.name
    # Per-round ratios (both cases timed in the same round): robust to the
    # load swings of a shared machine, which a ratio of medians is not.
    paired = float(np.median(np.array(times[c.name]) / np.array(times[base])))
    out.append(
      dict(
        case=c.name,
        what=c.what,
        median_ms=med[c.name] * 1e3,
        baseline=base,
        ratio=paired,
        ratio_of_medians=med[c.name] / med[base],
        min_ratio=min(times[c.name]) / min(times[base]),
        tokens_per_s=n_tok / med[c.name],
        temp_bytes=mem[c.name]["temp_bytes"],
        temp_ratio=mem[c.name]["temp_bytes"] / max(mem[base]["temp_bytes"], 1),
        runs=len(times[c.name]),
        times_ms=[t * 1e3 for t in times[c.name]],
      )
    )
  print(
    f"  microbatch: {len(cases)} cases x {args.e2e_runs} runs in "
    f"{time.perf_counter() - t0:.1f}s",
    flush=True,
  )
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))
  return dict(
    config=dict(cfg, params=n_params, tokens=n_tok, k=k),
    rows=out,
    all_reduces=_all_reduces_in_child(cfg, k),
  )


def _while_bodies(hlo: str) -> dict[str, str]:
  """Every computation reachable from a while loop's body, by name."""
  comps = dict(
    re.findall(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M)
  )
  todo = re.findall(r"while\([^\n]*body=%?([\w.\-]+)", hlo)
  seen = {}
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen[name] = comps[name]
    todo += re.findall(
      r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name]
    )
  return seen


def _count_all_reduces(compiled, k: int) -> dict:
  hlo = compiled.as_text()
  pat = r"all-reduce(?:-start)?\("
  total = len(re.findall(pat, hlo))
  inside = sum(len(re.findall(pat, t)) for t in _while_bodies(hlo).values())
  return dict(
    in_loop_body=inside,
    outside=total - inside,
    executed_per_step=total - inside + k * inside,
  )


def all_reduce_counts(cfg: dict, k: int) -> dict:
  """Both styles on an 8-device 'data' mesh (run in a process with 8
  devices): shard_map with axis_name, and implicit jit over a sharded batch."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  params, losses = _micro_lm(cfg)
  n = jax.device_count()
  tokens, lengths, _ = _micro_data(cfg, k * n)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  f = wa.microbatched_value_and_grad(
    losses, k, batch_argnums=(1, 2), axis_name="data", mode="sum"
  )
  sm = jax.jit(
    jax.shard_map(
      f, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
    )
  )
  imp = jax.jit(
    wa.microbatched_value_and_grad(losses, k, batch_argnums=(1, 2), mode="sum")
  )
  rep = NamedSharding(mesh, P())
  data = [
    jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (tokens, lengths)
  ]
  p = jax.device_put(params, rep)
  return dict(
    devices=n,
    k=k,
    shard_map=_count_all_reduces(sm.lower(p, *data).compile(), k),
    implicit=_count_all_reduces(imp.lower(p, *data).compile(), k),
  )


def _all_reduces_in_child(cfg: dict, k: int) -> dict | None:
  env = dict(
    os.environ, WA_BENCH_ALLREDUCE_CHILD=json.dumps(dict(cfg=cfg, k=k))
  )
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  res = subprocess.run(
    [sys.executable, os.path.abspath(__file__)],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if res.returncode:
    print(f"  all-reduce count failed: {res.stderr[-2000:]}", file=sys.stderr)
    return None
  return json.loads(res.stdout.strip().splitlines()[-1])


def microbatch_markdown(res: dict) -> list[str]:
  cfg = res["config"]
  L = [
    "",
    f"In-step microbatching (issue 12): Flax NNX LM, "
    f"{cfg['params'] / 1e6:.2f}M params ({cfg['layers']} layers, dim "
    f"{cfg['dim']}), global batch {cfg['rows']}x{cfg['seq']} tokens with "
    f"unequal lengths ({cfg['tokens']} valid), one jitted step.",
    "",
    "ratio: median of per-round ratios to the baseline (same round); "
    "also the ratio of medians and of minima.",
    "",
    "| case | ms/step | tokens/s | ratio | of medians | of minima | "
    "baseline | temp MB | temp ratio |",
    "|---|---:|---:|---:|---:|---:|---|---:|---:|",
  ]
  for r in res["rows"]:
    L.append(
      f"| {r['case']} | {r['median_ms']:.2f} | {r['tokens_per_s']:.0f}"
      f" | {r['ratio']:.3f}x | {r['ratio_of_medians']:.3f}x | "
      f"{r['min_ratio']:.3f}x | {r['baseline']} | "
      f"{_mb(r['temp_bytes'])} | {r['temp_ratio']:.3f}x |"
    )
  ar = res.get("all_reduces")
  if ar:
    L += [
      "",
      f"All-reduces per step, {ar['devices']}-device data mesh, K = {ar['k']}:",
      "",
      "| style | in loop body | outside | executed per step |",
      "|---|---:|---:|---:|",
    ]
    for style in ("shard_map", "implicit"):
      c = ar[style]
      L.append(
        f"| {style} | {c['in_loop_body']} | {c['outside']} | "
        f"{c['executed_per_step']} |"
      )
  return L


def microbatch_checks(res: dict) -> list[dict]:
  by = {r["case"]: r for r in res["rows"]}
  out = []

  def add(name, value, limit, note=""):
    out.append(
      dict(
        bar=name,
        size="",
        grads_dtype="",
        value=value,
        limit=limit,
        status="pass" if value <= limit else "miss",
        note=note,
      )
    )

  add(
    "microbatched_value_and_grad / hand scan (time)", by["mb_wa"]["ratio"], 1.03
  )
  add(
    "microbatched_value_and_grad / hand scan (temporaries)",
    by["mb_wa"]["temp_ratio"],
    1.0,
  )
  for name in ("mb_optax_microbatch_sum", "mb_optax_micro_grad_sum"):
    # Both are timed against the hand scan in the same rounds.
    add(
      f"microbatched_value_and_grad / {name[3:]} (time)",
      by["mb_wa"]["ratio"] / by[name]["ratio"],
      1.03,
    )
  ar = res.get("all_reduces")
  if ar:
    add(
      "shard_map all-reduces executed per step",
      ar["shard_map"]["executed_per_step"],
      1,
    )
  return out


# ----------------------------------------------------------------------------
# The bar (issue 5) and the report.
# ----------------------------------------------------------------------------


def bar_checks(
  rows: list[dict], e2e_res: dict | None, big_sizes: set[str]
) -> list[dict]:
  checks = []

  def ratio(size, gd, case):
    for r in rows:
      if (r["size"], r["grads_dtype"], r["case"]) == (size, gd, case):
        return r["ratio"], r
    return None, None

  def add(name, value, limit, size="", gd="", note="", info=False):
    checks.append(
      dict(
        bar=name,
        size=size,
        grads_dtype=gd,
        value=value,
        limit=limit,
        status=(
          "n/a"
          if value is None
          else "info"
          if info
          else "pass"
          if value <= limit
          else "miss"
        ),
        note=note,
      )
    )

  groups = sorted(
    {(r["size"], r["grads_dtype"]) for r in rows},
    key=lambda t: (rows_index(rows, t), t[1]),
  )
  for size, gd in groups:
    for case in ("accumulate_sum", "accumulate_mean"):
      add(f"{case} / bare add", ratio(size, gd, case)[0], 1.10, size, gd)
  for size, gd in groups:
    ms, _ = ratio(size, gd, "step_multisteps")
    wr, _ = ratio(size, gd, "step_wrapper")
    if size in big_sizes:
      add(
        "wrapper step / MultiSteps step",
        None if wr is None else wr / ms,
        0.35,
        size,
        gd,
      )
    add(
      "wrapper step / bare add (floor ~3x)",
      wr,
      3.0,
      size,
      gd,
      note="target: as close to 3x as possible",
    )
    add(
      "core step (params, opt state passed through) / bare add",
      ratio(size, gd, "step_core")[0],
      1.10,
      size,
      gd,
      info=True,
      note="not in the bar; accumulate_* rows are the 1x path",
    )
  for size, gd in groups:
    fm, _ = ratio(size, gd, "finish_mean")
    if fm is not None:
      add("finish_mean / bare scale", fm, 1.20, size, gd)
  for r in rows:
    m = r["memory"]
    if m is None or r["case"] not in (
      "accumulate_sum",
      "accumulate_mean",
      "finish_mean",
    ):
      continue
    add(
      f"{r['case']}: every buffer aliased",
      0.0 if m["all_aliased"] else 1.0,
      0.0,
      r["size"],
      r["grads_dtype"],
      note=f"{m['alias_bytes']} of {m['buffer_bytes']} bytes aliased",
    )
    add(
      f"{r['case']}: temporaries % of buffers",
      m["temp_pct_of_buffers"],
      1.0,
      r["size"],
      r["grads_dtype"],
      note=f"{m['temp_bytes']} bytes",
    )
  if e2e_res:
    by = {r["case"]: r for r in e2e_res["rows"]}
    w = by.get("e2e_wrapper")
    add(
      "e2e window: wrapper / MultiSteps", w and w["ratio_vs_multisteps"], 1.00
    )
    add("e2e window: wrapper / hand loop", w and w["ratio_vs_hand_loop"], 1.05)
  return checks


def rows_index(rows, key):
  for i, r in enumerate(rows):
    if (r["size"], r["grads_dtype"]) == key:
      return i
  return len(rows)


def _mb(x):
  return f"{x / 1e6:.1f}"


def markdown(
  meta: dict,
  rows: list[dict],
  e2e_res: dict | None,
  checks: list[dict],
  plot_name: str | None,
) -> str:
  L = []
  L.append(
    f"Machine: {meta['machine']}; {meta['backend']} "
    f"({meta['device_kind']}), jax {meta['versions']['jax']}, optax "
    f"{meta['versions']['optax']}, flax {meta['versions']['flax']}; "
    f"{meta['date']}; load average "
    f"{(meta['load_average'] or [float('nan')])[0]:.1f} at start; "
    f"allocator {meta['allocator']}; "
    f"`{meta['command']}`; median of {meta['runs']} "
    "interleaved warm runs, ratio to the baseline of the same group."
  )
  L.append("")
  L.append(
    "| params | grads | case | median ms | ratio | baseline | "
    "page-faulted MB/call |"
  )
  L.append("|---:|---|---|---:|---:|---|---:|")
  for r in rows:
    L.append(
      f"| {r['size']} | {r['grads_dtype']} | {r['case']} | "
      f"{r['median_ms']:.3f} | {r['ratio']:.2f}x | {r['baseline']} | "
      f"{r['faulted_mb']:.1f} |"
    )
  L.append("")
  L.append("Compiled memory (XLA `memory_analysis`, MB):")
  L.append("")
  L.append(
    "| params | grads | case | donated | aliased | temp | temp % | output |"
  )
  L.append("|---:|---|---|---:|---:|---:|---:|---:|")
  for r in rows:
    m = r["memory"]
    if not m:
      continue
    pct = m["temp_pct_of_buffers"]
    L.append(
      f"| {r['size']} | {r['grads_dtype']} | {r['case']} | "
      f"{_mb(m['buffer_bytes'])} | {_mb(m['alias_bytes'])} | "
      f"{_mb(m['temp_bytes'])} | "
      f"{'' if pct is None else f'{pct:.2f}'} | "
      f"{_mb(m['output_bytes'])} |"
    )
  if e2e_res:
    cfg = e2e_res["config"]
    L.append("")
    L.append(
      f"End to end: Flax NNX transformer, {cfg['params'] / 1e6:.1f}M "
      f"params ({cfg['layers']} layers, dim {cfg['dim']}, vocab "
      f"{cfg['vocab']}), one window of 8 microbatches of "
      f"{cfg['rows']}x{cfg['seq']} tokens with unequal valid lengths "
      f"({e2e_res['rows'][0]['tokens_per_window']} tokens)."
    )
    L.append("")
    L.append(
      "| variant | window ms | tokens/s | vs MultiSteps | vs hand loop "
      "| step temp MB | page-faulted MB/window |"
    )
    L.append("|---|---:|---:|---:|---:|---:|---:|")
    for r in e2e_res["rows"]:
      L.append(
        f"| {r['case']} | {r['median_ms']:.1f} | "
        f"{r['tokens_per_s']:.0f} | {r['ratio_vs_multisteps']:.3f}x | "
        f"{r['ratio_vs_hand_loop']:.3f}x | "
        f"{_mb(r['step_temp_bytes'])} | {r['faulted_mb']:.1f} |"
      )
  L.append("")
  L.append("The bar (issue 5):")
  L.append("")
  L.append("| bar | params | grads | value | limit | status | note |")
  L.append("|---|---:|---|---:|---:|---|---|")
  for c in checks:
    v = "" if c["value"] is None else f"{c['value']:.3f}"
    L.append(
      f"| {c['bar']} | {c['size']} | {c['grads_dtype']} | {v} | "
      f"{c['limit']} | {c['status']} | {c['note']} |"
    )
  if plot_name:
    L.append("")
    L.append(f"![benchmark ratios]({plot_name})")
  return "\n".join(L) + "\n"


def plot(path: Path, rows: list[dict], e2e_res: dict | None) -> bool:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot", file=sys.stderr)
    return False
  dtypes = sorted({r["grads_dtype"] for r in rows}, reverse=True)
  ncols = len(dtypes) + (1 if e2e_res else 0)
  fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5), squeeze=False)
  for ax, gd in zip(axes[0], dtypes):
    sel = [
      r for r in rows if r["grads_dtype"] == gd and r["baseline"] != r["case"]
    ]
    sizes = list(dict.fromkeys(r["size"] for r in sel))
    cases = list(dict.fromkeys(r["case"] for r in sel))
    width = 0.8 / max(len(sizes), 1)
    for i, s in enumerate(sizes):
      vals = [
        next(
          (r["ratio"] for r in sel if r["size"] == s and r["case"] == c), np.nan
        )
        for c in cases
      ]
      ax.bar(np.arange(len(cases)) + i * width, vals, width, label=s)
    ax.set_xticks(np.arange(len(cases)) + width * (len(sizes) - 1) / 2)
    ax.set_xticklabels(cases, rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.1, color="g", lw=0.8, ls="--", label="1.10x bar")
    ax.set_ylabel("time / baseline (bare donated add or scale)")
    ax.set_title(f"{gd} grads into float32 buffers")
    ax.legend(fontsize=8)
  if e2e_res:
    ax = axes[0][-1]
    names = [r["case"].replace("e2e_", "") for r in e2e_res["rows"]]
    ax.bar(
      names,
      [r["tokens_per_s"] for r in e2e_res["rows"]],
      color=["C3", "C2", "C0"][: len(names)],
    )
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title(
      f"end to end, {e2e_res['config']['params'] / 1e6:.1f}M-param "
      "NNX transformer"
    )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  mem = ""
  try:
    with open("/proc/meminfo") as f:
      kb = int(f.readline().split()[1])
      mem = f", {kb / 2**20:.0f} GiB RAM"
  except (OSError, ValueError, IndexError):
    pass
  return f"{cpu}, {os.cpu_count()} cores{mem}"


def available_bytes() -> int | None:
  """Memory the benchmark may use: the device's on accelerators, else RAM."""
  dev = jax.devices()[0]
  if dev.platform != "cpu":
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


# Parameter-sized float32 trees alive at once in the largest group (every case
# holds its own state; MultiSteps holds params, mu, nu, its accumulator and 3
# temporaries), with a margin.
TREES_ALIVE = 28


def parse_size(s: str) -> int:
  s = s.strip().upper()
  mult = {"K": 2**10, "M": M, "G": 2**30}.get(s[-1])
  return int(float(s[:-1]) * mult) if mult else int(s)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--full",
    action="store_true",
    help="also 256M params and a ~20M-param end-to-end model",
  )
  p.add_argument(
    "--smoke",
    action="store_true",
    help="tiny sizes, for a quick plumbing check",
  )
  p.add_argument(
    "--sizes",
    help="comma-separated sizes, e.g. 1M,16M ('none': "
    "only the end-to-end case)",
  )
  p.add_argument(
    "--runs",
    type=int,
    default=None,
    help="timed rounds per group (median; default 15)",
  )
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--e2e-runs", type=int, default=None)
  p.add_argument(
    "--layers",
    type=int,
    default=None,
    help="transformer blocks of the tree (default 12: 98 leaves)",
  )
  p.add_argument("--no-e2e", action="store_true")
  p.add_argument(
    "--issue11",
    action="store_true",
    help="only the closing-step, eager-call and compile rows "
    "(with their baselines)",
  )
  p.add_argument(
    "--compile-runs",
    type=int,
    default=None,
    help="compiles per variant for the compile-time row (default 5)",
  )
  p.add_argument("--no-numpy", action="store_true")
  p.add_argument(
    "--no-microbatch",
    action="store_true",
    help="skip the in-step microbatching rows (issue 12)",
  )
  p.add_argument(
    "--microbatch-only",
    action="store_true",
    help="only the in-step microbatching rows (a short run)",
  )
  p.add_argument(
    "--tuned-allocator",
    action="store_true",
    help="re-run this process with glibc malloc settings that keep "
    "freed memory (no per-call page faults; Linux CPU only)",
  )
  p.add_argument(
    "--out",
    type=Path,
    default=None,
    help="output folder (default benchmarks/results; --smoke: a "
    "temporary folder)",
  )
  args = p.parse_args(argv)
  tuned = all(os.environ.get(k) == v for k, v in TUNED_ALLOCATOR.items())
  if args.tuned_allocator and not tuned:
    os.environ.update(TUNED_ALLOCATOR)
    os.execv(
      sys.executable,
      [sys.executable, os.path.abspath(__file__)]
      + list(argv if argv is not None else sys.argv[1:]),
    )

  if args.smoke:
    sizes = ["64K"]
    e2e_cfg = dict(vocab=128, dim=32, layers=1, heads=2, rows=2, seq=16)
  elif args.full:
    sizes = ["1M", "16M", "64M", "256M"]
    e2e_cfg = dict(vocab=8192, dim=512, layers=4, heads=8, rows=8, seq=128)
  else:
    sizes = ["1M", "16M", "64M"]
    e2e_cfg = dict(vocab=4096, dim=256, layers=4, heads=4, rows=4, seq=128)
  if args.sizes:
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip() != "none"]
  micro_cfg = MICRO_CFG[
    "smoke" if args.smoke else "default" if args.full else "short"
  ]
  if args.microbatch_only:
    sizes, args.no_e2e, args.no_microbatch = [], True, False
  elif args.smoke:  # keep the plumbing check short: --smoke --microbatch-only
    args.no_microbatch = True
  args.layers = args.layers or (1 if args.smoke else 12)
  args.runs = args.runs or 15
  args.e2e_runs = args.e2e_runs or 12
  if args.runs < 10 or args.e2e_runs < 10:
    p.error("--runs and --e2e-runs must be at least 10 (median of >= 10)")
  out_dir = args.out or (
    Path(tempfile.mkdtemp(prefix="wa-bench-")) if args.smoke else RESULTS
  )
  out_dir.mkdir(parents=True, exist_ok=True)

  backend = jax.default_backend()
  dev = jax.devices()[0]
  import flax

  date = datetime.datetime.now().strftime("%Y-%m-%d")
  stem = (
    f"{backend}-{date}"
    + ("-smoke" if args.smoke else "")
    + ("-tuned-allocator" if tuned else "")
    + ("-microbatch" if args.microbatch_only else "")
  )
  meta = dict(
    backend=backend,
    device_kind=dev.device_kind,
    devices=jax.device_count(),
    machine=machine(),
    date=date,
    timestamp=datetime.datetime.now().isoformat(timespec="seconds"),
    command=" ".join(
      ["python benchmarks/run.py"]
      + list(argv if argv is not None else sys.argv[1:])
    ),
    runs=args.runs,
    e2e_runs=args.e2e_runs,
    warmup=args.warmup,
    versions=dict(
      jax=jax.__version__,
      optax=optax.__version__,
      flax=flax.__version__,
      numpy=np.__version__,
      python=platform.python_version(),
    ),
    wrapper_available=weighted_multi_steps is not None,
    allocator=(
      "glibc tuned: " + " ".join(f"{k}={v}" for k, v in TUNED_ALLOCATOR.items())
    )
    if tuned
    else "default",
    load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
  )
  print(
    f"weighted_accum benchmarks on {backend} ({dev.device_kind}); "
    f"{meta['machine']}",
    flush=True,
  )
  if weighted_multi_steps is None:
    print(
      "  weighted_accum.transform is not available: wrapper cases skipped",
      flush=True,
    )

  t_start = time.perf_counter()
  rows = []
  avail = available_bytes()
  args.compile_runs = args.compile_runs or (2 if args.smoke else 5)
  for s in [] if args.issue11 else sizes:
    need = parse_size(s) * 4 * TREES_ALIVE
    if avail is not None and need > 0.8 * avail:
      print(
        f"  skipping {s}: needs ~{need / 2**30:.1f} GiB, "
        f"{avail / 2**30:.1f} GiB available",
        flush=True,
      )
      continue
    shapes = tree_shapes(parse_size(s), layers=args.layers)
    for gd in (jnp.float32,) if args.smoke else (jnp.float32, jnp.bfloat16):
      rows += run_group(s, shapes, gd, args)
  e2e_res = None if (args.no_e2e or args.issue11) else e2e(e2e_cfg, args)
  big = {r["size"] for r in rows if r["params"] >= 16 * M}
  checks = bar_checks(rows, e2e_res, big)
  mb_res = (
    None
    if (args.no_microbatch or args.issue11)
    else microbatch_bench(micro_cfg, args)
  )
  if mb_res:
    checks += microbatch_checks(mb_res)
  comp = None
  if not args.microbatch_only:
    rows11, comp = issue11_rows(sizes, args)
    rows += rows11
    checks += issue11_checks(rows11, comp)
  meta["seconds"] = time.perf_counter() - t_start

  png = out_dir / f"{stem}.png"
  has_plot = bool(rows or e2e_res) and plot(png, rows, e2e_res)
  md = markdown(meta, rows, e2e_res, checks, png.name if has_plot else None)
  if mb_res:
    md += "\n".join(microbatch_markdown(mb_res)) + "\n"
  (out_dir / f"{stem}.md").write_text(md)
  (out_dir / f"{stem}.json").write_text(
    json.dumps(
      dict(
        meta=meta,
        rows=rows,
        e2e=e2e_res,
        compile=comp,
        bar=checks,
        microbatch=mb_res,
      ),
      indent=1,
    )
  )
  print()
  print(md)
  print(
    f"wrote {out_dir / stem}.{{json,md{',png' if has_plot else ''}}} in "
    f"{meta['seconds']:.0f}s"
  )
  return 0


if __name__ == "__main__":
  if "WA_BENCH_ALLREDUCE_CHILD" in os.environ:  # see _all_reduces_in_child
    _spec = json.loads(os.environ["WA_BENCH_ALLREDUCE_CHILD"])
    print(json.dumps(all_reduce_counts(_spec["cfg"], _spec["k"])))
    sys.exit(0)
  sys.exit(main())
