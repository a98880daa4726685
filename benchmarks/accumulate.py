"""Accumulate: ``wa.accumulate_sum`` / ``accumulate_mean`` at the memory limit.

Against a bare jitted donated ``buf + g`` (the baseline: one read of the
buffer and the gradient, one write) and NumPy's in-place add on the host
(float32 gradients), over a transformer-like tree of 98 leaves, float32 and
bfloat16 gradients into float32 buffers, the state donated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness as h
from benchmarks import report
import weighted_accum as wa

TITLE = "Accumulate vs a bare donated add"
TREES_ALIVE = 8  # params, grads, 3 buffers, host copies, margin


def _bare_add(buf, g):
  return jax.tree.map(lambda b, x: b + x.astype(b.dtype), buf, g)


def _numpy_add(buf, g):
  for b, x in zip(buf, g):
    np.add(b, x, out=b)
  return buf


def cases(shapes: Any, gdtype: Any) -> list[h.Case]:
  """The bare add, NumPy's add and both accumulates, on the same data."""
  params = h.make_tree(shapes, jnp.float32, 0)
  grads = h.make_tree(shapes, gdtype, 1)
  w = jnp.float32(3.0)
  out = [
    h.Case(
      "bare_add",
      "bare donated buf + g",
      jax.jit(_bare_add, donate_argnums=0),
      h.fresh_copy(params),
      (grads,),
      what="jitted donated buf + g (the baseline)",
    ),
  ]
  if gdtype == jnp.float32:  # NumPy has no native bfloat16 arithmetic
    out.append(
      h.Case(
        "numpy_add",
        "NumPy in-place add (host)",
        _numpy_add,
        [np.array(x) for x in jax.tree.leaves(params)],
        ([np.asarray(x) for x in jax.tree.leaves(grads)],),
        baseline="bare_add",
        what="np.add(buf, g, out=buf) per leaf on the host, float32",
      )
    )
  for name in ("accumulate_sum", "accumulate_mean"):
    out.append(
      h.Case(
        name,
        name,
        jax.jit(getattr(wa, name), donate_argnums=0),
        wa.init(params),
        (grads, w),
        baseline="bare_add",
        what=f"jax.jit(wa.{name}, donate_argnums=0)",
      )
    )
  return out


def run(cfg: h.Settings) -> dict:
  """Every size, both gradient dtypes (float32 only for smoke)."""
  rows = []
  dtypes = (jnp.float32,) if cfg.smoke else (jnp.float32, jnp.bfloat16)
  layers = 1 if cfg.smoke else 12
  for size in h.sizes(cfg):
    if not report.fits(h.parse_size(size), TREES_ALIVE):
      continue
    shapes = h.tree_shapes(h.parse_size(size), layers)
    for gd in dtypes:
      rows += h.measure(
        cases(shapes, gd),
        cfg,
        size=size,
        params=h.count_params(shapes),
        leaves=len(h.shape_leaves(shapes)),
        grads_dtype=jnp.dtype(gd).name,
      )
  targets = [
    h.target(
      f"{r['case']} / bare add",
      r["ratio"],
      1.10,
      where=f"{r['size']} {r['grads_dtype']}",
    )
    for r in rows
    if r["case"].startswith("accumulate")
  ]
  return dict(rows=rows, targets=targets)


def markdown(result: dict) -> list[str]:
  """One table: median, ratio to the bare add, page faults per call."""
  head = ["params", "grads", "case", "median ms", "ratio", "page-faulted MB"]
  rows = [
    [
      r["size"],
      r["grads_dtype"],
      r["label"],
      f"{r['median_ms']:.3f}",
      f"{r['ratio']:.2f}x",
      f"{r['faulted_mb']:.1f}",
    ]
    for r in result["rows"]
  ]
  return [
    "Ratio: median over rounds of the case's time over the bare donated "
    "add's in the same round. Page-faulted MB: median per call.",
    "",
  ] + report.table(head, rows, "lllrrr")


def figure(result: dict, path) -> bool:
  """Each case's ratio to the bare add, one group per size and dtype."""
  bars = [
    (f"{r['size']} params, {r['grads_dtype']} grads", r["label"], r["ratio"])
    for r in result["rows"]
    if r["case"] != "bare_add"
  ]
  return report.bar_figure(
    path, TITLE, bars, "time / bare donated add (same round; lower is faster)"
  )
