"""Packing plans against what users would pick instead, in one run.

A 2-layer decoder LM (widths 128 and 256, 4 heads, L x L attention masked
causal, and by segment on packed rows; byte vocabulary) takes 64-row
batches of variable-length rows. Methods, on the same batches, interleaved
(each round runs every method on one batch): padding every row to 512 at
K = 8 microbatches (``wa.microbatched_value_and_grad``); first-fit packing
into rows of 512 (Grain's ``FirstFitPackIterDataset`` on the rows sorted
longest first), in microbatches of 8 and of 2 packed rows (the targets'
baselines) and of 1 (a microbatch of 512 tokens, as small as the plan's
on the lognormal lengths: on a CPU, whose caches favour small
microbatches, it separates the plan's gain from its buckets from that of
its small microbatches), each weighted by its real tokens, only the filled
microbatches run; and the packing plan
(``PlanSpec.from_lengths(..., pack=True)`` on a separate sample of the
distribution, at most 3 shapes). ``--lengths`` and ``--widths`` pick the
distributions and widths to run. Lengths: lognormal (median 60, sigma 1,
clipped to [8, 512]), the standard library's docstrings (one per row,
bytes, cut at 512) and, at width 128, the real-text corpus's documents
(``examples/stdlib_lm``, cut at 512). Per distribution: real tokens/s of the
packing plan over each method (median of paired ratios), padded / real
tokens, the fresh plan + pack time (best of 5 per batch, median), compile
seconds (lowering and compiling), XLA's compiled memory (arguments +
outputs + temporaries) and the bytes a batch sends to the device. Each step
is compiled once, for the first batch; the 50 batches share one signature.
``--calibrate`` fits ``PlanSpec.cost`` on this machine instead.
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

TITLE = "Packing plans vs padding, first-fit packing and plans"
SIZES = {
  "smoke": dict(dim=16, layers=1, heads=2, rows=16, top=64, budget=256, runs=2),
  "default": dict(
    dim=128, layers=2, heads=4, rows=64, top=512, budget=4096, runs=5
  ),
}
VOCAB = 257
PACKED_ROWS = (8, 2, 1)  # packed rows per microbatch, the baselines


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
  def token_nll(p, tokens, targets, segments=None, positions=None):
    b, t = tokens.shape
    at = jnp.arange(t) if positions is None else positions
    x = p["emb"][tokens] + p["pos"][at]
    mask = None  # packed rows: causal AND same segment
    if segments is not None:
      same = segments[:, :, None] == segments[:, None, :]
      mask = (same & jnp.tri(t, dtype=bool))[:, None]
    for lp in p["layers"]:
      q, k, v = jnp.split(x @ lp["qkv"], 3, -1)
      q, k, v = (a.reshape(b, t, heads, -1) for a in (q, k, v))
      att = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=mask is None
      )
      x = x + att.reshape(b, t, -1) @ lp["o"]
      x = x + jax.nn.gelu(x @ lp["up"]) @ lp["down"]
    logp = jax.nn.log_softmax(x @ p["out"])
    return -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]

  def padded(p, batch):  # padded rows, or packed rows with their segments
    nll = token_nll(
      p, batch["tokens"], batch["targets"],
      batch.get("segments"), batch.get("positions"),
    )  # fmt: skip
    return jnp.sum(nll * batch["mask"]), batch["mask"].sum()

  def planned(p, mb):
    seg = (mb.segment_ids, mb.positions) if len(mb) == 4 else ()
    nll = token_nll(p, mb.rows["tokens"], mb.rows["targets"], *seg)
    return jnp.sum(nll * mb.mask), mb.mask.sum()

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


def _docstrings(c, rng):
  """The standard library's docstrings, one per row, in bytes."""
  if "docstrings" not in _DOCS:
    import ast  # pylint: disable=g-import-not-at-top

    _real_text(c, np.random.default_rng(0))  # examples/ on the path
    from stdlib_lm import data  # pylint: disable=g-import-not-at-top

    found = []
    for _, text in data.stdlib_sources():
      try:
        tree = ast.parse(text)
      except (SyntaxError, ValueError):
        continue
      for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
          doc = ast.get_docstring(node)
          found += [len(doc.encode())] if doc else []
    _DOCS["docstrings"] = np.asarray(found, np.int64)
  return np.clip(rng.choice(_DOCS["docstrings"], c["rows"]), 1, c["top"])


def _first_fit(rows, lengths, top, nbins):
  """Plain packing, the baseline: the rows sorted longest first, packed
  first-fit into ``nbins`` rows of ``top`` (Grain's packer), with segment
  ids, positions and the mask; and the rows used."""
  import grain  # pylint: disable=g-import-not-at-top

  order = np.argsort(-lengths, kind="stable")
  source = [{k: rows[k][i, : lengths[i]] for k in rows} for i in order]
  bins = list(
    grain.experimental.FirstFitPackIterDataset(
      grain.MapDataset.source(source).to_iter_dataset(),
      length_struct={k: top for k in rows},
      num_packing_bins=nbins,
      shuffle_bins=False,
    )
  )
  out = {k: np.zeros((nbins, top), np.int32) for k in rows}
  out["segments"] = np.zeros((nbins, top), np.int32)
  out["positions"] = np.zeros((nbins, top), np.int32)
  for i, b in enumerate(bins):
    for k in rows:
      out[k][i] = b[k]
    out["segments"][i] = b["tokens_segment_ids"]
    out["positions"][i] = b["tokens_positions"]
  out["mask"] = (out["segments"] > 0).astype(np.float32)
  return out, len(bins)


def _batch(lengths, top, rng):
  tokens = rng.integers(0, VOCAB, (len(lengths), top)).astype(np.int32)
  targets = rng.integers(0, VOCAB, (len(lengths), top)).astype(np.int32)
  mask = (np.arange(top)[None] < lengths[:, None]).astype(np.float32)
  return dict(tokens=tokens * (mask > 0), targets=targets * (mask > 0)), mask


def _compiled(cache, key, fn, *args):
  """``fn`` compiled once for ``args``' signature (shared by the runs): the
  executable, its compiled bytes (arguments + outputs + temporaries),
  temporaries, and the seconds lowering and compiling took."""
  if key not in cache:
    t0 = time.perf_counter()
    exe = fn.lower(*args).compile()
    seconds = time.perf_counter() - t0
    m = exe.memory_analysis()
    peak = (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      - m.alias_size_in_bytes
      + m.temp_size_in_bytes
    )
    cache[key] = exe, int(peak), int(m.temp_size_in_bytes), seconds
  return cache[key]


def _steps(c):
  """The padded and the packed steps (shared by the distributions)."""
  padded = _loss_fn(c["heads"])[0]
  base = jax.jit(wa.microbatched_value_and_grad(padded, 8, mode="sum"))
  packs = {  # first-fit packed rows, r per microbatch, the filled ones run
    r: jax.jit(
      wa.microbatched_value_and_grad(
        padded, c["rows"] // r, mode="sum", split="contiguous"
      )
    )
    for r in PACKED_ROWS
  }
  return base, packs, {}


def _packed_spec(c, draw):
  """The packing plan's spec, chosen from a sample of the distribution."""
  sample = np.concatenate(
    [draw(c, np.random.default_rng(100 + i)) for i in range(8)]
  )
  return planning.PlanSpec.from_lengths(
    sample, budget=c["budget"], batch_rows=c["rows"], pack=True,
    cost=(1.0, 1.0 / (6 * c["dim"])), longest=c["top"],
  )  # fmt: skip


def _prepare(c, draw, specs, rng):
  """One batch, ready for every method, and the fresh plan + pack ms."""
  lengths = draw(c, rng)
  rows, mask = _batch(lengths, c["top"], rng)
  args, ms = {"padded": dict(rows, mask=mask)}, {}
  for key, spec in specs.items():
    best = float("inf")
    for _ in range(5):  # best of 5: the machine may be shared
      t0 = time.perf_counter()
      args[key] = planning.plan_batch(spec, rows, lengths)
      best = min(best, (time.perf_counter() - t0) * 1e3)
    ms[key] = best
  packed, bins = _first_fit(rows, lengths, c["top"], c["rows"])
  for r in PACKED_ROWS:
    args[f"packed, {r} row{'s' * (r > 1)}"] = (packed, np.int32(-(-bins // r)))
  return lengths, args, ms, bins


def _distribution(c, name, draw, cfg, steps) -> dict:
  rng = np.random.default_rng(0)
  base, packs, cache = steps
  pspec = _packed_spec(c, draw)
  specs = {"planned, packed": pspec}
  fns = {
    "padded": base,
    "planned, packed": jax.jit(
      planning.planned_value_and_grad(
        _loss_fn(c["heads"])[1], pspec, mode="sum"
      )
    ),
  }
  for r, f in packs.items():
    fns[f"packed, {r} row{'s' * (r > 1)}"] = jax.jit(
      lambda p, b, f=f: f(p, b[0], num_real_microbatches=b[1])
    )
  params = _params(c)
  batches = [_prepare(c, draw, specs, rng) for _ in range(50)]
  b0 = batches[0][1]
  exes = {
    k: _compiled(cache, (k, name), f, params, b0[k]) for k, f in fns.items()
  }
  runs = cfg.runs or c["runs"]
  times = {k: [] for k in fns}
  for i in range(runs + 1):  # interleaved: the same batch, every method
    lengths, args = batches[i][:2]
    for key, exe in exes.items():
      t0 = time.perf_counter()
      jax.block_until_ready(exe[0](params, args[key]))
      if i:  # the first round warms up
        times[key].append((time.perf_counter() - t0) / lengths.sum())
  real = [int(b[0].sum()) for b in batches]
  used = lambda k, sp: [
    sum(r * n * m for (r, n), m in zip(sp.shapes, b[1][k].counts[0]))
    for b in batches
  ]
  mine = np.array(times["planned, packed"])
  sig = {
    tuple((x.shape, x.dtype) for x in jax.tree.leaves(b[1]["planned, packed"]))
    for b in batches
  }
  nbytes = lambda k: sum(
    np.asarray(x).nbytes for x in jax.tree.leaves(batches[0][1][k])
  )
  return dict(
    distribution=name,
    dim=c["dim"],
    packed_shapes=[list(s) for s in pspec.shapes],
    ratios={  # real tokens/s of the packing plan over each method's
      k: float(np.median(np.array(t) / mine)) for k, t in times.items()
    },
    tokens_per_s={k: float(1 / np.median(t)) for k, t in times.items()},
    padded_over_real={
      "planned, packed": float(
        np.sum(used("planned, packed", pspec)) / np.sum(real)
      ),
      "packed": float(
        np.mean([b[3] for b in batches]) * c["top"] / np.mean(real)
      ),
      "padded": float(c["rows"] * c["top"] * len(real) / np.sum(real)),
    },
    compile_s={k: e[3] for k, e in exes.items()},
    memory_bytes={k: e[1] for k, e in exes.items()},
    temp_bytes={k: e[2] for k, e in exes.items()},
    transfer_bytes={k: nbytes(k) for k in fns},
    plan_pack_ms={
      k: float(np.median([b[2][k] for b in batches])) for k in specs
    },
    distinct_signatures=len(sig),
  )


def calibrate(cfg: h.Settings) -> tuple[float, float, float]:
  """Fits ``PlanSpec.cost`` on this machine and prints it: the benchmark's
  LM (at ``--widths``' first, else 128) on packed rows (one segment each,
  the segment mask as packing plans run it), ``K`` microbatches of a few
  ``(rows, length)`` shapes per step, timed (median of runs). The step's
  time is fitted on ``K rows L`` (per token), ``K rows L^2`` (per pair),
  ``K`` (per microbatch) and 1 (the step's own fixed cost) by non-negative
  least squares of the relative error (each step's time weighs alike,
  short or long; no term may go below 0, as a spec's cost may not), and
  printed in units of the per-token term with the fit's worst error."""
  from scipy import optimize  # pylint: disable=g-import-not-at-top

  c = SIZES["smoke" if cfg.smoke else "default"]
  c = dict(c, dim=(cfg.widths or (c["dim"],))[0])
  top, params = c["top"], _params(c)
  loss = _loss_fn(c["heads"])[0]
  rows, times = [], []
  for r, n in ((1, top // 16), (16, top // 16), (1, top // 4), (4, top // 4),
               (1, top), (2, top)):  # fmt: skip
    for k in (1, 4):
      lengths = np.full(k * r, n)
      batch, mask = _batch(lengths, n, np.random.default_rng(0))
      seg = dict(segments=mask.astype(np.int32),
                 positions=np.broadcast_to(np.arange(n, dtype=np.int32), mask.shape))  # fmt: skip
      f = jax.jit(wa.microbatched_value_and_grad(loss, k, mode="sum"))
      args = (params, dict(batch, mask=mask, **seg))
      jax.block_until_ready(f(*args))
      runs = []
      for _ in range(cfg.runs or 5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        runs.append(time.perf_counter() - t0)
      rows.append([k * r * n, k * r * n * n, k, 1.0])
      times.append(np.median(runs))
  x, t = np.asarray(rows), np.asarray(times)
  fit = optimize.nnls(x / t[:, None], np.ones_like(t))[0]
  a, b, o, s = fit
  worst = float(np.max(np.abs(x @ fit / t - 1)))
  for (tokens, pairs, k, _), got, want in zip(rows, t, x @ fit):
    n = int(pairs // tokens)
    print(f"  K={int(k)} x {int(tokens // k // n)} rows x {n}: "
          f"{got * 1e3:.1f} ms, fitted {want * 1e3:.1f} ms")  # fmt: skip
  cost = (1.0, float(b / a), float(o / a))
  print(f"d={c['dim']}: per token {a * 1e9:.1f} ns, per pair {b * 1e9:.3f} "
        f"ns, per microbatch {o * 1e6:.0f} us, per step {s * 1e6:.0f} us; "
        f"worst error {worst:.1%} over {len(t)} steps")  # fmt: skip
  print(f"PlanSpec(..., cost=({cost[0]}, {cost[1]:.4g}, {cost[2]:.4g}))")
  return cost


def _targets(r) -> list[dict]:
  """The figures of one distribution against their targets."""
  where, x = f"{r['distribution']}, d={r['dim']}", r["ratios"]
  best = min(x["packed, 8 rows"], x["packed, 2 rows"])
  floor = 1.15 if r["distribution"] == "lognormal" else 1.0
  pk, pad = "planned, packed", "padded"
  out = [
    h.target("best packing / packing plan, time per real token", 1 / best,
             1 / floor, where=where, note=f"{best:.2f}x tokens/s"),
    h.target("compile s, packing plan / packed (2 rows)",
             r["compile_s"][pk] / r["compile_s"]["packed, 2 rows"], 3.0,
             where=where),
    h.target("compiled memory, packing plan / padded",
             r["memory_bytes"][pk] / r["memory_bytes"][pad], 1.02,
             where=where),
    h.target("transfer bytes, packing plan / padded",
             r["transfer_bytes"][pk] / r["transfer_bytes"][pad], 2.0,
             where=where),
    h.target("plan + pack ms per batch (median of best of 5)",
             r["plan_pack_ms"][pk], 2.0, where=where),
    h.target("signatures over 50 batches", r["distinct_signatures"], 1,
             where=where),
  ]  # fmt: skip
  if r["distribution"] == "lognormal":
    out.append(
      h.target("padded / packing plan, time per real token", 1 / x[pad],
               1 / 4, where=where, note=f"{x[pad]:.2f}x tokens/s")
    )  # fmt: skip
  return out


DISTRIBUTIONS = {
  "lognormal": _lognormal,
  "docstrings": _docstrings,
  "real text": _real_text,
}


def run(cfg: h.Settings) -> dict:
  c = SIZES["smoke" if cfg.smoke else "default"]
  names = cfg.lengths or tuple(DISTRIBUTIONS)
  bad = [n for n in names if n not in DISTRIBUTIONS]
  if bad:
    raise SystemExit(f"--lengths: unknown {bad}; one of {list(DISTRIBUTIONS)}")
  widths = cfg.widths or ((c["dim"],) if cfg.smoke else (128, 256))
  rows = []
  for dim in widths:
    w = dict(c, dim=dim)
    steps = _steps(w)
    for name in names:  # the real text at the first width only
      if name != "real text" or dim == widths[0]:
        rows.append(_distribution(w, name, DISTRIBUTIONS[name], cfg, steps))
  return dict(config=c, rows=rows, targets=sum(map(_targets, rows), []))


METHODS = ("padded", "packed, 8 rows", "packed, 2 rows", "packed, 1 row")


def markdown(result: dict) -> list[str]:
  head = ["lengths", "shapes"] + [
    f"tokens/s packing plan / {m}" for m in METHODS
  ]
  head += ["compile s (plan, packed 2)", "memory / padded",
           "transfer / padded", "padded/real (plan, packed, padded)",
           "plan+pack ms"]  # fmt: skip
  pk = "planned, packed"
  rows = []
  for r in result["rows"]:
    por, c = r["padded_over_real"], r["compile_s"]
    rows.append(
      [f"{r['distribution']}, d={r['dim']}", str(r["packed_shapes"])]
      + [f"{r['ratios'][m]:.2f}x" for m in METHODS]
      + [
        f"{c[pk]:.1f} / {c['packed, 2 rows']:.1f}",
        f"{r['memory_bytes'][pk] / r['memory_bytes']['padded']:.3f}",
        f"{r['transfer_bytes'][pk] / r['transfer_bytes']['padded']:.2f}",
        f"{por[pk]:.2f} / {por['packed']:.2f} / {por['padded']:.2f}",
        f"{r['plan_pack_ms'][pk]:.2f}",
      ]
    )
  return ["## Results", ""] + report.table(head, rows) + [""]


def figure(result: dict, path) -> bool:
  bars = [
    (f"{r['distribution']}, d={r['dim']}", f"over {m}", r["ratios"][m])
    for r in result["rows"]
    for m in METHODS
  ]
  return report.bar_figure(
    path, TITLE, bars, "real tokens/s, packing plan / method"
  )
