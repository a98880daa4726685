"""Compile: what a user meets first, the wrapper's train step compiling.

Compile time (trace + lower, then XLA's compile) of the wrapper's AdamW
train step against ``optax.MultiSteps``' (a fresh transform and a fresh
``jax.jit`` each time, the two interleaved, median over rounds), and the
fused loops XLA emits for each (HLO ``fusion`` instructions per leaf, a
deterministic figure), at 100 and 800 leaves of 64x64 + 64. Also: the
executables compiled over three calls of a user's jitted step from a fresh
state (one each), and ``wa.accumulate_sum`` called eagerly against the same
call in the user's ``jit`` at 800 small leaves (runtime, interleaved).
"""

from __future__ import annotations

import gc
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness as h
from benchmarks import report
import weighted_accum as wa

TITLE = "Compiling the wrapper's step vs optax.MultiSteps"


def _plan(cfg: h.Settings) -> dict[str, Any]:
  """Leaf counts and compile rounds per mode (800 leaves: ~1 min a round)."""
  if cfg.smoke:
    return dict(leaves={8: 1, 16: 1}, eager_leaves=20, count_leaves=8)
  rounds_800 = 3 if cfg.full else 1
  return dict(
    leaves={100: 3, 800: rounds_800}, eager_leaves=800, count_leaves=20
  )


def _transforms() -> dict[str, Any]:
  return {
    "multisteps": lambda: optax.MultiSteps(h.adamw(), every_k_schedule=4),
    "wrapper": lambda: wa.WeightedMultiSteps(
      h.adamw(), every_k_schedule=4, mode="mean"
    ),
  }


def fusion_counts(hlo: str) -> dict[str, int]:
  """Fusion instructions in compiled HLO text, in total and by kind.

  A name is ``%fusion.3``; the opcode ``fusion(`` follows a space.
  """
  kinds = re.findall(r" fusion\([^\n]*?kind=(k\w+)", hlo)
  out = {"fusions": len(re.findall(r" fusion\(", hlo))}
  for k in sorted(set(kinds)):
    out[k] = kinds.count(k)
  out["hlo_lines"] = hlo.count("\n") + 1
  return out


def compile_rounds(n_leaves: int, rounds: int) -> dict[str, Any]:
  """Trace+lower and compile seconds of both steps, interleaved."""
  shapes = h.small_leaves(n_leaves)
  params = h.make_tree(shapes, jnp.float32, 0)
  w = jnp.float32(2.0)
  txs = _transforms()
  lower_s = {k: [] for k in txs}
  compile_s = {k: [] for k in txs}
  counts = {}
  rng = np.random.default_rng(0)
  for _ in range(rounds):
    for name in rng.permutation(list(txs)):
      tx = txs[name]()
      fn = h.train_step(tx, name == "wrapper")
      state = (params, tx.init(params))
      gc.collect()
      t0 = time.perf_counter()
      lowered = fn.lower(state, params, w)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      compile_s[name].append(time.perf_counter() - t1)
      lower_s[name].append(t1 - t0)
      counts[name] = fusion_counts(compiled.as_text())
      del compiled, lowered
  total = {k: float(np.median(np.add(lower_s[k], compile_s[k]))) for k in txs}
  return dict(
    leaves=n_leaves,
    rounds=rounds,
    lower_s=lower_s,
    compile_s=compile_s,
    total_s=total,
    ratio=total["wrapper"] / total["multisteps"],
    hlo=counts,
    fusions_per_leaf={k: counts[k]["fusions"] / n_leaves for k in txs},
  )


def _backend_compiles(step, state, *rest) -> int:
  """Executables compiled over ``state = step(state, *rest)`` three times."""
  events = []

  def listen(event, duration, **kw):
    del duration, kw
    if event == "/jax/core/compile/backend_compile_duration":
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    for _ in range(3):
      state = jax.block_until_ready(step(state, *rest))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return len(events)


def compiles_over_three_calls(n_leaves: int) -> dict[str, int]:
  """One compile each: accumulate, apply_window's step, the wrapper step."""
  params = h.make_tree(h.small_leaves(n_leaves), jnp.float32, 0)
  w = jnp.float32(2.0)
  tx = h.adamw()

  def window_step(state):
    p, o, acc = state
    p, o, acc, _ = wa.apply_window(tx, acc, p, o)
    return p, o, acc

  wr = wa.WeightedMultiSteps(h.adamw(), every_k_schedule=2, mode="mean")
  acc = jax.jit(lambda s, g: wa.accumulate_mean(s, g, w))
  win = jax.jit(window_step, donate_argnums=0)
  return {
    "accumulate from wa.init": _backend_compiles(acc, wa.init(params), params),
    "apply_window step": _backend_compiles(
      win, h.fresh_copy((params, tx.init(params), wa.init(params)))
    ),
    "wrapper step from tx.init": _backend_compiles(
      h.train_step(wr, True), h.fresh_copy((params, wr.init(params))), params, w
    ),
  }


def eager_cases(n_leaves: int) -> list[h.Case]:
  """``wa.accumulate_sum`` eagerly vs inside the caller's ``jax.jit``."""
  shapes = h.small_leaves(n_leaves)
  params = h.make_tree(shapes, jnp.float32, 0)
  grads = h.make_tree(shapes, jnp.float32, 1)
  w = jnp.float32(2.0)
  return [
    h.Case(
      "jit_accumulate",
      "jax.jit(wa.accumulate_sum)",
      jax.jit(wa.accumulate_sum),
      wa.init(params),
      (grads, w),
      what=f"jax.jit(wa.accumulate_sum), {n_leaves} small leaves",
    ),
    h.Case(
      "eager_accumulate",
      "wa.accumulate_sum, eager",
      wa.accumulate_sum,
      wa.init(params),
      (grads, w),
      baseline="jit_accumulate",
      what=f"wa.accumulate_sum called eagerly, {n_leaves} small leaves",
    ),
  ]


def run(cfg: h.Settings) -> dict:
  plan = _plan(cfg)
  comp = [compile_rounds(n, r) for n, r in plan["leaves"].items()]
  n_small = plan["count_leaves"]  # a count: any tree will do
  counts = compiles_over_three_calls(n_small)
  n_eager = plan["eager_leaves"]
  eager = h.measure(eager_cases(n_eager), cfg, leaves=n_eager)
  targets = []
  for c in comp:
    where = f"{c['leaves']} leaves"
    fpl = c["fusions_per_leaf"]
    targets.append(
      h.target(
        "compile time, wrapper / MultiSteps",
        c["ratio"],
        1.0,
        where=where,
        note=f"median of {c['rounds']} rounds",
      )
    )
    targets.append(
      h.target(
        "fused loops per leaf, wrapper / MultiSteps",
        fpl["wrapper"] / fpl["multisteps"],
        1.0,
        where=where,
        note=f"{fpl['wrapper']:.1f} vs {fpl['multisteps']:.1f}",
      )
    )
  # Eager vs jitted is reported, with no target: speed is jax.jit's business.
  for k, v in counts.items():
    targets.append(
      h.target(f"compiles over 3 calls: {k}", v, 1, where=f"{n_small} leaves")
    )
  return dict(
    compile=comp, compiles_over_3_calls=counts, eager=eager, targets=targets
  )


def markdown(result: dict) -> list[str]:
  """Compile seconds and fused loops; compiles per call; eager vs jit."""
  rows = []
  for c in result["compile"]:
    for k, label in (
      ("multisteps", "optax.MultiSteps"),
      ("wrapper", "wa.WeightedMultiSteps"),
    ):
      lo = float(np.median(c["lower_s"][k]))
      co = float(np.median(c["compile_s"][k]))
      hlo = c["hlo"][k]
      rows.append(
        [
          c["leaves"],
          label,
          c["rounds"],
          f"{lo:.2f}",
          f"{co:.2f}",
          f"{c['total_s'][k] / c['total_s']['multisteps']:.2f}x",
          hlo["fusions"],
          f"{c['fusions_per_leaf'][k]:.2f}",
          f"{hlo['hlo_lines']:,}",
        ]
      )
  head = [
    "leaves",
    "train step",
    "rounds",
    "trace+lower s",
    "compile s",
    "total vs MultiSteps",
    "fusions",
    "per leaf",
    "HLO lines",
  ]
  eager = [
    [r["label"], f"{r['median_ms']:.2f}", f"{r['ratio']:.2f}x"]
    for r in result["eager"]
  ]
  return (
    [
      "AdamW inside; each compile from a fresh transform and jax.jit. "
      "Medians over rounds; fusions: XLA fusion instructions in the "
      "compiled HLO (deterministic).",
      "",
    ]
    + report.table(head, rows, "llrrrrrrr")
    + [
      f"Eager vs jitted at {result['eager'][0]['leaves']} leaves "
      "(runtime, interleaved):",
      "",
    ]
    + report.table(["call", "median ms", "ratio"], eager)
  )


def figure(result: dict, path) -> bool:
  """Wrapper / MultiSteps: compile time and fused loops; eager / jit."""
  bars = []
  for c in result["compile"]:
    fpl = c["fusions_per_leaf"]
    g = f"wrapper step / optax.MultiSteps, {c['leaves']} leaves"
    bars.append((g, "compile time", c["ratio"]))
    bars.append((g, "fused loops", fpl["wrapper"] / fpl["multisteps"]))
  e = result["eager"][1]
  bars.append(
    (f"{e['leaves']} small leaves", "eager / jitted accumulate", e["ratio"])
  )
  return report.bar_figure(path, TITLE, bars, "ratio (lower is better)")
