"""Close: the step that ends a window, against a bare optimizer step.

The baseline is a bare jitted donated AdamW ``tx.update`` +
``optax.apply_updates`` on the same gradients: the optimizer's own traffic.
Against it: ``wa.apply_window`` (finish, update, apply, reset; everything
donated) and the wrapper's closing call (``finish=True``) + apply_updates.
``wa.finish_mean`` on its own is timed against a bare donated ``buf * c``
and against the floor its contract implies (the scale plus fresh zero
buffers for the next window). Every close starts from a window holding
weight (refilled untimed), so it does the whole close.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness as h
from benchmarks import report
import weighted_accum as wa

TITLE = "Closing a window vs a bare optimizer step"
TREES_ALIVE = 24


def _bare_opt_step(tx):
  def step(state, grads):
    params, opt_state = state
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=0)


def _apply_window_step(tx):
  """Params, opt state and window donated, returned in the same order."""

  def step(state):
    params, opt_state, acc = state
    params, opt_state, acc, _ = wa.apply_window(tx, acc, params, opt_state)
    return params, opt_state, acc

  return jax.jit(step, donate_argnums=0)


def _wrapper_close(tx):
  def step(state, g, w):
    params, opt_state = state
    updates, opt_state = tx.update(
      g, opt_state, params, weight=w, finish=jnp.bool_(True)
    )
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=0)


def _bare_scale(buf, c):
  return jax.tree.map(lambda b: b * c.astype(b.dtype), buf)


def _scale_and_zeros(buf, c):
  return _bare_scale(buf, c), jax.tree.map(jnp.zeros_like, buf)


def cases(shapes: Any) -> list[h.Case]:
  """The closes and their baselines, on the same float32 gradients."""
  params = h.make_tree(shapes, jnp.float32, 0)
  grads = h.make_tree(shapes, jnp.float32, 1)
  refill = jax.jit(lambda s: wa.accumulate_sum(s, grads, 7.0), donate_argnums=0)
  return _optimizer_cases(params, grads, refill) + _finish_cases(params, refill)


def _optimizer_cases(params, grads, refill) -> list[h.Case]:
  inner = h.adamw()
  wrapper = wa.WeightedMultiSteps(h.adamw(), every_k_schedule=None, mode="mean")
  return [
    h.Case(
      "bare_opt_step",
      "bare AdamW step",
      _bare_opt_step(inner),
      h.fresh_copy((params, inner.init(params))),
      (grads,),
      what="jitted donated adamw tx.update + apply_updates (the baseline)",
    ),
    h.Case(
      "apply_window_close",
      "wa.apply_window",
      _apply_window_step(inner),
      h.fresh_copy((params, inner.init(params), refill(wa.init(params)))),
      keep=lambda out: (out[0], out[1], refill(out[2])),
      baseline="bare_opt_step",
      what="wa.apply_window(adamw): finish, update, apply, reset; donated",
    ),
    h.Case(
      "wrapper_close",
      "wa.WeightedMultiSteps closing call",
      _wrapper_close(wrapper),
      h.fresh_copy((params, wrapper.init(params))),
      (grads, jnp.float32(3.0)),
      baseline="bare_opt_step",
      what="WeightedMultiSteps(adamw, None, mode='mean').update(finish=True) "
      "+ apply_updates, donated",
    ),
  ]


def _finish_cases(params, refill) -> list[h.Case]:
  c = jnp.float32(0.5)
  return [
    h.Case(
      "bare_scale",
      "bare donated buf * c",
      jax.jit(_bare_scale, donate_argnums=0),
      h.fresh_copy(params),
      (c,),
      baseline="bare_opt_step",
      what="jitted donated buf * c (finish_mean's baseline)",
    ),
    h.Case(
      "scale_and_zeros",
      "buf * c + fresh zeros (finish's floor)",
      jax.jit(_scale_and_zeros, donate_argnums=0),
      h.fresh_copy(params),
      (c,),
      keep=lambda out: out[0],
      baseline="bare_scale",
      what="donated buf * c plus zero buffers for the next window",
    ),
    h.Case(
      "finish_mean",
      "wa.finish_mean",
      jax.jit(wa.finish_mean, donate_argnums=0),
      refill(wa.init(params)),
      keep=lambda out: refill(out[1]),
      baseline="bare_scale",
      what="jax.jit(wa.finish_mean, donate_argnums=0), a window with weight",
    ),
  ]


def run(cfg: h.Settings) -> dict:
  """1M and 16M params (``--full``: 256M too), float32."""
  rows = []
  for size in h.sizes(cfg, default=("1M", "16M")):
    if not report.fits(h.parse_size(size), TREES_ALIVE):
      continue
    shapes = h.tree_shapes(h.parse_size(size), 1 if cfg.smoke else 12)
    group = h.measure(
      cases(shapes), cfg, size=size, params=h.count_params(shapes)
    )
    h.add_ratio(group, "vs_opt_step", "bare_opt_step")
    rows += group
  limits = {
    "apply_window_close": 1.35,
    "wrapper_close": 1.75,
    "finish_mean": 1.2,
  }
  targets = [
    h.target(
      f"{r['label']} / {r['baseline'].replace('_', ' ')}",
      r["ratio"],
      limits[r["case"]],
      where=r["size"],
    )
    for r in rows
    if r["case"] in limits
  ]
  return dict(rows=rows, targets=targets)


def markdown(result: dict) -> list[str]:
  """One table: median, ratio to its baseline and to the bare AdamW step."""
  head = [
    "params",
    "case",
    "median ms",
    "ratio",
    "baseline",
    "vs AdamW step",
    "page-faulted MB",
  ]
  rows = [
    [
      r["size"],
      r["label"],
      f"{r['median_ms']:.3f}",
      f"{r['ratio']:.2f}x",
      r["baseline"],
      f"{r['vs_opt_step']:.2f}x",
      f"{r['faulted_mb']:.1f}",
    ]
    for r in result["rows"]
  ]
  return [
    "Ratios: median over rounds of the case's time over the baseline's in "
    "the same round (AdamW, float32, everything donated).",
    "",
  ] + report.table(head, rows, "lllrlrr")


def figure(result: dict, path) -> bool:
  """Each close's ratio to its baseline, one group per size."""
  names = {
    "apply_window_close": "wa.apply_window / AdamW step",
    "wrapper_close": "wrapper close / AdamW step",
    "scale_and_zeros": "scale + zeros / bare scale",
    "finish_mean": "wa.finish_mean / bare scale",
  }
  bars = [
    (f"{r['size']} params", names[r["case"]], r["ratio"])
    for r in result["rows"]
    if r["case"] in names
  ]
  return report.bar_figure(path, TITLE, bars, "time / baseline (same round)")
