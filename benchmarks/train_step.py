"""Train step, mid-window: ``optax.MultiSteps`` vs the wrapper vs the
functional API.

One microbatch's step in the middle of a window (``tx.update`` +
``optax.apply_updates``, params and optimizer state donated, AdamW inside),
the ratio taken against ``optax.MultiSteps``' step in the same round; the
bare donated ``buf + g`` is the floor of any accumulation (ratios to it in
the ``vs bare add`` column). The functional API's step is
``wa.accumulate_mean`` with params and the AdamW state passed through.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness as h
from benchmarks import report
import weighted_accum as wa

TITLE = "Mid-window train step vs optax.MultiSteps"
TREES_ALIVE = 20  # MultiSteps: params, mu, nu, acc, 3 temporaries; 4 cases


def _bare_add(buf, g):
  return jax.tree.map(lambda b, x: b + x.astype(b.dtype), buf, g)


def _core_step(state, grads, w):
  """The functional API mid-window: only the accumulator changes."""
  params, opt_state, acc = state
  return params, opt_state, wa.accumulate_mean(acc, grads, w)


def cases(shapes: Any, gdtype: Any) -> list[h.Case]:
  """MultiSteps, the wrapper, the functional API and the bare add."""
  params = h.make_tree(shapes, jnp.float32, 0)
  grads = h.make_tree(shapes, gdtype, 1)
  w = jnp.float32(3.0)
  ms = optax.MultiSteps(h.adamw(), every_k_schedule=h.NEVER)
  wr = wa.WeightedMultiSteps(h.adamw(), every_k_schedule=h.NEVER, mode="mean")
  inner = h.adamw()
  base = "step_multisteps"
  return [
    h.Case(
      "bare_add",
      "bare donated buf + g (floor)",
      jax.jit(_bare_add, donate_argnums=0),
      h.fresh_copy(params),
      (grads,),
      baseline=base,
      what="jitted donated buf + g",
    ),
    h.Case(
      base,
      "optax.MultiSteps",
      h.train_step(ms, False),
      h.fresh_copy((params, ms.init(params))),
      (grads, w),
      what="optax.MultiSteps(adamw) update + apply_updates (the baseline)",
    ),
    h.Case(
      "step_wrapper",
      "wa.WeightedMultiSteps",
      h.train_step(wr, True),
      h.fresh_copy((params, wr.init(params))),
      (grads, w),
      baseline=base,
      what="wa.WeightedMultiSteps(adamw, mode='mean') update(weight=) + "
      "apply_updates",
    ),
    h.Case(
      "step_core",
      "functional API (accumulate_mean)",
      jax.jit(_core_step, donate_argnums=0),
      h.fresh_copy((params, inner.init(params), wa.init(params))),
      (grads, w),
      baseline=base,
      what="wa.accumulate_mean, params and adamw state passed through donated",
    ),
  ]


def run(cfg: h.Settings) -> dict:
  """16M and 64M params, float32 gradients (``--full``: 1M to 256M,
  bfloat16 too)."""
  rows = []
  dtypes = (jnp.float32, jnp.bfloat16) if cfg.full else (jnp.float32,)
  for size in h.sizes(cfg, default=("16M", "64M")):
    if not report.fits(h.parse_size(size), TREES_ALIVE):
      continue
    shapes = h.tree_shapes(h.parse_size(size), 1 if cfg.smoke else 12)
    for gd in dtypes:
      group = h.measure(
        cases(shapes, gd),
        cfg,
        size=size,
        params=h.count_params(shapes),
        grads_dtype=jnp.dtype(gd).name,
      )
      h.add_ratio(group, "vs_bare_add", "bare_add")
      rows += group
  return dict(rows=rows, targets=_targets(rows))


def _targets(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    where = f"{r['size']} {r['grads_dtype']}"
    if r["case"] == "step_wrapper" and r["params"] >= 16 * h.M:
      out.append(
        h.target("wrapper / MultiSteps", r["ratio"], 0.35, where=where)
      )
    if r["case"] == "step_wrapper":
      out.append(
        h.target("wrapper / bare add", r["vs_bare_add"], 3.0, where=where)
      )
  return out


def markdown(result: dict) -> list[str]:
  """One table: median, ratio to MultiSteps and to the bare add."""
  head = [
    "params",
    "grads",
    "step",
    "median ms",
    "vs MultiSteps",
    "vs bare add",
    "page-faulted MB",
  ]
  rows = [
    [
      r["size"],
      r["grads_dtype"],
      r["label"],
      f"{r['median_ms']:.3f}",
      f"{r['ratio']:.3f}x",
      f"{r['vs_bare_add']:.2f}x",
      f"{r['faulted_mb']:.1f}",
    ]
    for r in result["rows"]
  ]
  return [
    "Ratios: median over rounds of the step's time over the baseline's in "
    "the same round. Page-faulted MB: median per call.",
    "",
  ] + report.table(head, rows, "lllrrrr")


def figure(result: dict, path) -> bool:
  """Each step's ratio to optax.MultiSteps, one group per size and dtype."""
  bars = [
    (f"{r['size']} params, {r['grads_dtype']} grads", r["label"], r["ratio"])
    for r in result["rows"]
    if r["case"] != "step_multisteps"
  ]
  return report.bar_figure(
    path, TITLE, bars, "time / optax.MultiSteps step (same round)"
  )
