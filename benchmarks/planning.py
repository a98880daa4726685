"""Microbatch plans against padding: real tokens per second of one step.

A 2-layer decoder LM (width 128, 4 heads, causal L x L attention, byte
vocabulary) takes 64-row batches of variable-length rows. The baseline pads
every row to 512 and runs ``wa.microbatched_value_and_grad`` at K = 8 (8
rows x 512 = a budget of 4,096 tokens per microbatch); the planned step
plans each batch with ``weighted_accum.planning`` (budget 4,096, buckets 32
to 512) and runs every shape into one window. Two length distributions:
lognormal (median 60, sigma 1, clipped to [8, 512]) and the real-text
corpus's documents (``examples/stdlib_lm``, truncated to 512). Per
distribution, one run: paired time per batch, real tokens/s, padded / real
tokens, plan + pack time, executables compiled over 50 batches and XLA's
compiled memory (arguments + outputs + temporaries) of both steps. Each
step is compiled once, for the first batch, and that executable runs every
batch: the 50 batches share one signature (what `jax.jit` compiles for).
"""

from __future__ import annotations

from pathlib import Path
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness as h
from benchmarks import report
import weighted_accum as wa
from weighted_accum import planning

TITLE = "Microbatch plans vs padding to the longest row"
SIZES = {
  "smoke": dict(dim=16, layers=1, heads=2, rows=16, top=64, budget=256, runs=2),
  "default": dict(
    dim=128, layers=2, heads=4, rows=64, top=512, budget=4096, runs=5
  ),
}
VOCAB = 257


def _params(c, seed=0):
  rng = np.random.default_rng(seed)
  d, f = c["dim"], 4 * c["dim"]
  norm = lambda *s: jnp.asarray(rng.normal(size=s) * 0.02, jnp.float32)
  layer = lambda: dict(
    qkv=norm(d, 3 * d), o=norm(d, d), up=norm(d, f), down=norm(f, d)
  )
  return dict(
    emb=norm(VOCAB, d),
    pos=norm(c["top"], d),
    out=norm(d, VOCAB),
    layers=[layer() for _ in range(c["layers"])],
  )


def _loss_fn(heads):
  def token_nll(p, tokens, targets):
    b, t = tokens.shape
    x = p["emb"][tokens] + p["pos"][:t]
    for lp in p["layers"]:
      q, k, v = jnp.split(x @ lp["qkv"], 3, -1)
      q, k, v = (a.reshape(b, t, heads, -1) for a in (q, k, v))
      att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
      x = x + att.reshape(b, t, -1) @ lp["o"]
      x = x + jax.nn.gelu(x @ lp["up"]) @ lp["down"]
    logp = jax.nn.log_softmax(x @ p["out"])
    return -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]

  def padded(p, batch):  # the baseline: rows padded to the top length
    nll = token_nll(p, batch["tokens"], batch["targets"])
    return jnp.sum(nll * batch["mask"]), batch["mask"].sum()

  def planned(p, mb):
    rows, mask = mb
    nll = token_nll(p, rows["tokens"], rows["targets"])
    return jnp.sum(nll * mask), mask.sum()

  return padded, planned


def _lognormal(c, rng):
  n = np.round(rng.lognormal(np.log(60 * c["top"] / 512), 1.0, c["rows"]))
  return np.clip(n, 8 * c["top"] // 512, c["top"]).astype(np.int64)


_DOCS: dict = {}  # the corpus's document lengths, read once


def _real_text(c, rng):
  _cache = _DOCS
  if "docs" not in _cache:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from stdlib_lm import data  # pylint: disable=g-import-not-at-top

    lengths = [
      len(data.encode(d)) - 1
      for _, t in data.stdlib_sources()
      for d in data.split_documents(t)
    ]
    _cache["docs"] = np.asarray(lengths, np.int64)
  docs = _cache["docs"]
  return np.clip(rng.choice(docs, c["rows"]), 1, c["top"])


def _batch(lengths, top, rng):
  tokens = rng.integers(0, VOCAB, (len(lengths), top)).astype(np.int32)
  targets = rng.integers(0, VOCAB, (len(lengths), top)).astype(np.int32)
  mask = (np.arange(top)[None] < lengths[:, None]).astype(np.float32)
  return dict(tokens=tokens * (mask > 0), targets=targets * (mask > 0)), mask


def _compiled(cache, key, fn, *args):
  """``fn`` compiled once for ``args``' signature (shared by the runs) and
  its compiled bytes: arguments + outputs + temporaries, temporaries."""
  if key not in cache:
    exe = fn.lower(*args).compile()
    m = exe.memory_analysis()
    peak = (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      - m.alias_size_in_bytes
      + m.temp_size_in_bytes
    )
    cache[key] = exe, int(peak), int(m.temp_size_in_bytes)
  return cache[key]


def _steps(c):
  """The spec and both jitted steps (shared by the distributions)."""
  spec = planning.PlanSpec(
    buckets=[b for b in (32, 64, 128, 256, 512) if b <= c["top"]] or [c["top"]],
    budget=c["budget"],
    batch_rows=c["rows"],
    cost=(1.0, 1.0 / (6 * c["dim"])),
  )
  padded, planned = _loss_fn(c["heads"])
  base = jax.jit(wa.microbatched_value_and_grad(padded, 8, mode="sum"))
  step = jax.jit(planning.planned_value_and_grad(planned, spec, mode="sum"))
  return spec, base, step, {}


def _distribution(c, name, draw, cfg, steps) -> dict:
  rng = np.random.default_rng(0)
  spec, base, step, cache = steps
  params = _params(c)
  batches, plan_ms = [], []
  for _ in range(50):  # 50 batches: plan + pack time, compiles
    lengths = draw(c, rng)
    rows, mask = _batch(lengths, c["top"], rng)
    best = float("inf")
    for _ in range(5):  # best of 5: the machine may be shared
      t0 = time.perf_counter()
      packed = planning.plan_batch(spec, rows, lengths)
      best = min(best, (time.perf_counter() - t0) * 1e3)
    plan_ms.append(best)
    batches.append((lengths, dict(rows, mask=mask), packed))
  avals = {jax.tree.structure(b[2]) for b in batches}
  shapes = {
    tuple((x.shape, x.dtype) for x in jax.tree.leaves(b[2])) for b in batches
  }
  b0 = batches[0]
  base, mem_base, tmp_base = _compiled(cache, "padded", base, params, b0[1])
  step, mem_plan, tmp_plan = _compiled(cache, "planned", step, params, b0[2])
  runs = cfg.runs or c["runs"]
  times = {"padded": [], "planned": []}
  for i in range(runs + 1):  # paired: the same batch, both steps
    lengths, rows, packed = batches[i]
    for key, fn, arg in (("padded", base, rows), ("planned", step, packed)):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(params, arg))
      if i:  # the first round warms up
        times[key].append((time.perf_counter() - t0) / lengths.sum())
  used = [
    sum(r * l * n for (r, l), n in zip(spec.shapes, b[2].counts[0]))
    for b in batches
  ]
  real = [int(b[0].sum()) for b in batches]
  ratio = np.median(np.array(times["padded"]) / np.array(times["planned"]))
  return dict(
    distribution=name,
    tokens_per_s_ratio=float(ratio),
    planned_tokens_per_s=float(1 / np.median(times["planned"])),
    padded_tokens_per_s=float(1 / np.median(times["padded"])),
    padded_over_real=float(np.sum(used) / np.sum(real)),
    baseline_padded_over_real=float(
      c["rows"] * c["top"] * len(real) / np.sum(real)
    ),
    plan_pack_ms=float(np.median(plan_ms)),
    plan_pack_ms_p95=float(np.percentile(plan_ms, 95)),
    distinct_signatures=len(avals) * len(shapes),
    memory_ratio=mem_plan / mem_base,
    temp_ratio=tmp_plan / tmp_base,
    memory_bytes=dict(
      planned=mem_plan,
      padded=mem_base,
      planned_temp=tmp_plan,
      padded_temp=tmp_base,
    ),
    shapes=len(spec.shapes),
  )


def calibrate(cfg: h.Settings) -> tuple[float, float, float]:
  """Fits ``PlanSpec.cost`` on this machine and prints it: the benchmark's
  LM, ``K`` microbatches of a few ``(rows, length)`` shapes per step, timed
  (median of runs); least squares of the step's time on ``K rows L`` (per
  token), ``K rows L^2`` (per pair), ``K`` (per microbatch) and 1 (the
  step's own fixed cost), in units of the per-token term."""
  c = SIZES["smoke" if cfg.smoke else "default"]
  top, params = c["top"], _params(c)
  loss = _loss_fn(c["heads"])[0]
  rows, times = [], []
  for r, n in ((1, top // 16), (16, top // 16), (1, top // 4), (4, top // 4),
               (1, top), (2, top)):  # fmt: skip
    for k in (1, 4):
      lengths = np.full(k * r, n)
      batch, mask = _batch(lengths, n, np.random.default_rng(0))
      f = jax.jit(wa.microbatched_value_and_grad(loss, k, mode="sum"))
      args = (params, dict(batch, mask=mask))
      jax.block_until_ready(f(*args))
      runs = []
      for _ in range(cfg.runs or 5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        runs.append(time.perf_counter() - t0)
      rows.append([k * r * n, k * r * n * n, k, 1.0])
      times.append(np.median(runs))
  fit = np.linalg.lstsq(np.asarray(rows), np.asarray(times), rcond=None)[0]
  a, b, o = np.maximum(fit[:3], 0.0)
  cost = (1.0, float(b / a), float(o / a))
  print(f"per token {a * 1e9:.1f} ns, per pair {b * 1e9:.3f} ns, per "
        f"microbatch {o * 1e6:.0f} us, per step {fit[3] * 1e6:.0f} us")  # fmt: skip
  print(f"PlanSpec(..., cost=({cost[0]}, {cost[1]:.4g}, {cost[2]:.4g}))")
  return cost


def run(cfg: h.Settings) -> dict:
  c = SIZES["smoke" if cfg.smoke else "default"]
  steps = _steps(c)
  rows = [
    _distribution(c, "lognormal", _lognormal, cfg, steps),
    _distribution(c, "real text", _real_text, cfg, steps),
  ]
  lo, text = rows
  targets = [
    h.target(
      "padded / planned time per real token",
      1 / lo["tokens_per_s_ratio"],
      1 / 3,
      where="lognormal",
      note=f"{lo['tokens_per_s_ratio']:.2f}x tokens/s",
    ),
    h.target(
      "planned padded / real tokens",
      lo["padded_over_real"],
      1.6,
      where="lognormal",
    ),
    h.target(
      "padded / planned time per real token",
      1 / text["tokens_per_s_ratio"],
      1 / 1.15,
      where="real text",
      note=f"{text['tokens_per_s_ratio']:.2f}x tokens/s",
    ),
  ]
  for r in rows:
    where = r["distribution"]
    targets += [
      h.target(
        "compiled memory, planned / padded",
        r["memory_ratio"],
        1.02,
        where=where,
        note=f"temporaries {r['temp_ratio']:.3f}",
      ),
      h.target(
        "signatures over 50 batches", r["distinct_signatures"], 1, where=where
      ),
      h.target(
        "plan + pack ms per batch (median of best of 5)",
        r["plan_pack_ms"],
        1.0,
        where=where,
      ),
    ]
  return dict(config=c, rows=rows, targets=targets)


def markdown(result: dict) -> list[str]:
  head = [
    "lengths",
    "tokens/s planned / padded",
    "planned tok/s",
    "padded tok/s",
    "padded/real planned",
    "padded/real padded",
    "plan+pack ms",
    "memory planned / padded",
  ]
  rows = [
    [
      r["distribution"],
      f"{r['tokens_per_s_ratio']:.2f}x",
      f"{r['planned_tokens_per_s']:.0f}",
      f"{r['padded_tokens_per_s']:.0f}",
      f"{r['padded_over_real']:.2f}",
      f"{r['baseline_padded_over_real']:.2f}",
      f"{r['plan_pack_ms']:.2f}",
      f"{r['memory_ratio']:.3f}",
    ]
    for r in result["rows"]
  ]
  return ["## Results", ""] + report.table(head, rows, "lrrrrrrr") + [""]


def figure(result: dict, path) -> bool:
  bars = [
    (r["distribution"], "tokens/s, planned / padded", r["tokens_per_s_ratio"])
    for r in result["rows"]
  ]
  return report.bar_figure(path, TITLE, bars, "ratio to padding (K = 8)")
