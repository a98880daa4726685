"""Memory: XLA's compiled memory analysis of every hot path.

Each step is compiled from abstract arrays (nothing is allocated or run),
with its state donated as a training loop would, and XLA's
``memory_analysis`` read: argument, output, aliased (updated in place) and
temporary bytes. ``peak`` is what the executable holds at once (arguments +
outputs not aliased to an argument + temporaries), in units of P, the
params' bytes: a bare AdamW step holds 4 P (params, two moments, the
gradient). The wrapper's step is one executable, mid-window or closing.
Deterministic figures, of the kind the tests assert.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness as h
from benchmarks import report
import weighted_accum as wa

TITLE = "Compiled memory of each step (P = the params' bytes)"


def _accumulate_steps(p: Any) -> dict[str, tuple[str, Any, tuple]]:
  """name -> (label, jitted fn, abstract args): the buffer-only steps."""
  acc = jax.eval_shape(wa.init, p)
  w = jax.ShapeDtypeStruct((), jnp.float32)
  add = lambda b, g: jax.tree.map(jnp.add, b, g)
  jit = lambda f: jax.jit(f, donate_argnums=0)
  return {
    "bare_add": ("bare donated buf + g", jit(add), (p, p)),
    "accumulate_sum": (
      "wa.accumulate_sum",
      jit(wa.accumulate_sum),
      (acc, p, w),
    ),
    "accumulate_mean": (
      "wa.accumulate_mean",
      jit(wa.accumulate_mean),
      (acc, p, w),
    ),
    "finish_mean": ("wa.finish_mean", jit(wa.finish_mean), (acc,)),
  }


def _optimizer_steps(p: Any) -> dict[str, tuple[str, Any, tuple]]:
  """name -> (label, jitted fn, abstract args): steps with AdamW."""
  w = jax.ShapeDtypeStruct((), jnp.float32)
  opt = h.adamw()
  ms = optax.MultiSteps(h.adamw(), every_k_schedule=h.NEVER)
  wr = wa.WeightedMultiSteps(h.adamw(), every_k_schedule=h.NEVER, mode="mean")
  st = lambda tx: (p, jax.eval_shape(tx.init, p))
  core_state = st(opt) + (jax.eval_shape(wa.init, p),)

  def core(state, g, w):
    params, o, a = state
    return params, o, wa.accumulate_mean(a, g, w)

  def window(state):
    params, o, a = state
    params, o, a, _ = wa.apply_window(opt, a, params, o)
    return params, o, a

  jit = lambda f: jax.jit(f, donate_argnums=0)
  return {
    "bare_opt_step": (
      "bare AdamW step",
      h.train_step(opt, False),
      (st(opt), p, w),
    ),
    "step_multisteps": (
      "optax.MultiSteps step",
      h.train_step(ms, False),
      (st(ms), p, w),
    ),
    "step_wrapper": (
      "wa.WeightedMultiSteps step",
      h.train_step(wr, True),
      (st(wr), p, w),
    ),
    "step_core": (
      "functional API mid-window step",
      jit(core),
      (core_state, p, w),
    ),
    "apply_window_close": ("wa.apply_window close", jit(window), (core_state,)),
  }


def analyse(fn: Any, args: tuple, p_bytes: int) -> dict[str, Any]:
  """Compiles ``fn(*args)`` (first argument donated) and reads its memory."""
  ma = fn.lower(*args).compile().memory_analysis()
  out = dict(
    argument_bytes=int(ma.argument_size_in_bytes),
    output_bytes=int(ma.output_size_in_bytes),
    alias_bytes=int(ma.alias_size_in_bytes),
    temp_bytes=int(ma.temp_size_in_bytes),
    donated_bytes=h.nbytes(args[0]),
  )
  out["peak_bytes"] = (
    out["argument_bytes"]
    + out["output_bytes"]
    - out["alias_bytes"]
    + out["temp_bytes"]
  )
  out["unaliased_donated_bytes"] = max(
    out["donated_bytes"] - out["alias_bytes"], 0
  )
  for k in ("peak", "temp", "output", "alias"):
    out[f"{k}_P"] = out[f"{k}_bytes"] / p_bytes
  return out


def run(cfg: h.Settings) -> dict:
  """Every step at one size: 64K (smoke), 16M, or 64M (full)."""
  size = "64K" if cfg.smoke else "64M" if cfg.full else "16M"
  if cfg.sizes:
    size = cfg.sizes[-1]
  shapes = h.tree_shapes(h.parse_size(size), 1 if cfg.smoke else 12)
  p_bytes = h.count_params(shapes) * 4
  rows = []
  p = h.abstract_tree(shapes, jnp.float32)
  steps = {**_accumulate_steps(p), **_optimizer_steps(p)}
  for name, (label, fn, args) in steps.items():
    rows.append(
      dict(
        analyse(fn, args, p_bytes),
        case=name,
        label=label,
        size=size,
        params_bytes=p_bytes,
      )
    )
  return dict(rows=rows, targets=_targets(rows, size))


def _targets(rows: list[dict], size: str) -> list[dict]:
  by = {r["case"]: r for r in rows}
  out = []
  for name in (
    "accumulate_sum",
    "accumulate_mean",
    "finish_mean",
    "step_wrapper",
    "apply_window_close",
  ):
    r = by[name]
    out.append(
      h.target(
        f"{r['label']}: donated bytes not aliased",
        r["unaliased_donated_bytes"],
        64,
        where=size,
      )
    )
    out.append(
      h.target(
        f"{r['label']}: temporaries (P)",
        r["temp_P"],
        0.01,
        where=size,
        note=f"{r['temp_bytes']} bytes",
      )
    )
  extra = by["step_wrapper"]["peak_P"] - by["bare_opt_step"]["peak_P"]
  out.append(
    h.target(
      "wrapper step peak - bare AdamW step peak (P)",
      extra,
      1.01,
      where=size,
      note="the window's buffers: 1 P",
    )
  )
  return out


def markdown(result: dict) -> list[str]:
  """One table, bytes in MB and peaks in P."""
  mb = lambda b: f"{b / 1e6:.1f}"
  head = [
    "step",
    "arguments MB",
    "outputs MB",
    "aliased MB",
    "temp MB",
    "peak MB",
    "peak (P)",
  ]
  rows = [
    [
      r["label"],
      mb(r["argument_bytes"]),
      mb(r["output_bytes"]),
      mb(r["alias_bytes"]),
      mb(r["temp_bytes"]),
      mb(r["peak_bytes"]),
      f"{r['peak_P']:.2f}",
    ]
    for r in result["rows"]
  ]
  r0 = result["rows"][0]
  return [
    f"{r0['size']} float32 params (P = {r0['params_bytes'] / 1e6:.1f} MB), "
    "state donated; peak = arguments + outputs - aliased + temporaries.",
    "",
  ] + report.table(head, rows)


def figure(result: dict, path) -> bool:
  """Peak compiled memory of each step, in P."""
  groups = {
    "bare_add": "accumulate",
    "accumulate_sum": "accumulate",
    "accumulate_mean": "accumulate",
    "finish_mean": "accumulate",
    "apply_window_close": "closing step",
  }
  bars = [
    (groups.get(r["case"], "train step"), r["label"], r["peak_P"])
    for r in result["rows"]
  ]
  bars.sort(
    key=lambda b: ["accumulate", "train step", "closing step"].index(b[0])
  )
  return report.bar_figure(
    path, TITLE, bars, "peak compiled memory / params' bytes (P)", ref=None
  )
