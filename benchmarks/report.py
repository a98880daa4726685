"""Results files: the machine, Markdown tables, a figure at page width.

Each family writes ``<backend>-<date>-<family>.{json,md,png}``: the JSON
holds every measurement (per-round times included) with the machine, the
versions and the load average; the Markdown the tables and the targets;
the PNG one figure, 6.5 inches wide (a printed page), plain labels.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path
import platform
import sys
from typing import Any

import jax
import numpy as np
import optax

RESULTS = Path(__file__).resolve().parent / "results"
PAGE_WIDTH_IN = 6.5


def machine() -> str:
  """CPU model, core count and RAM, in words."""
  cpu = platform.processor() or platform.machine()
  mem = ""
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(
        (
          ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")
        ),
        cpu,
      )
    with open("/proc/meminfo") as f:
      mem = f", {int(f.readline().split()[1]) / 2**20:.0f} GiB RAM"
  except (OSError, ValueError, IndexError):
    pass
  return f"{cpu}, {os.cpu_count()} cores{mem}"


def load_average() -> list[float] | None:
  """The 1, 5 and 15 minute load averages (None where not available)."""
  return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def available_bytes() -> int | None:
  """Memory a family may use: the device's on accelerators, else RAM."""
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


def fits(n_params: int, trees_alive: int) -> bool:
  """Whether ``trees_alive`` float32 trees of ``n_params`` fit in 80%."""
  avail = available_bytes()
  need = n_params * 4 * trees_alive
  if avail is None or need <= 0.8 * avail:
    return True
  print(
    f"  skipping {n_params / 2**20:.0f}M params: needs ~{need / 2**30:.1f} "
    f"GiB, {avail / 2**30:.1f} GiB available",
    flush=True,
  )
  return False


def versions() -> dict[str, str]:
  """Versions of everything measured."""
  import flax
  import jaxlib

  import weighted_accum as wa

  return dict(
    weighted_accum=wa.__version__,
    jax=jax.__version__,
    jaxlib=jaxlib.__version__,
    optax=optax.__version__,
    flax=flax.__version__,
    numpy=np.__version__,
    python=platform.python_version(),
  )


def run_meta(command: str, allocator: str, cfg: Any) -> dict[str, Any]:
  """What every results file of a run records about it."""
  dev = jax.devices()[0]
  now = datetime.datetime.now()
  return dict(
    backend=jax.default_backend(),
    device_kind=dev.device_kind,
    devices=jax.device_count(),
    machine=machine(),
    date=now.strftime("%Y-%m-%d"),
    timestamp=now.isoformat(timespec="seconds"),
    command=command,
    versions=versions(),
    allocator=allocator,
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    runs=cfg.runs,
    warmup=cfg.warmup,
    mode="smoke" if cfg.smoke else "full" if cfg.full else "default",
  )


def header(meta: dict[str, Any], title: str) -> list[str]:
  """The Markdown title and the line naming the machine and the run."""
  v = meta["versions"]
  la = meta["load_average"]
  load = "n/a" if la is None else f"{la[0]:.1f} (1 min) at start"
  end = meta.get("load_average_end")
  if end:
    load += f", {end[0]:.1f} at end"
  return [
    f"# {title}",
    "",
    f"{meta['machine']}; {meta['backend']} ({meta['device_kind']}, "
    f"{meta['devices']} devices); weighted_accum {v['weighted_accum']}, "
    f"jax {v['jax']}, optax {v['optax']}, flax {v['flax']}; "
    f"started {meta['timestamp']}; load average {load}; allocator "
    f"{meta['allocator']}; `{meta['command']}` ({meta['mode']} sizes, "
    f"{meta['seconds']:.0f} s, {meta.get('cpu_seconds', float('nan')):.0f} "
    "s CPU).",
    "",
  ]


def table(head: list[str], rows: list[list[Any]], align: str = "") -> list[str]:
  """A Markdown table; ``align`` gives 'l' or 'r' per column (default r,
  except the first)."""
  align = align or "l" + "r" * (len(head) - 1)
  rule = ["---" if a == "l" else "---:" for a in align]
  out = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
  out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return out + [""]


def targets_table(targets: list[dict]) -> list[str]:
  """The targets of a family: figure, where, value, limit, met or missed."""
  if not targets:
    return []
  rows = [
    [
      t["figure"],
      t.get("where", ""),
      "" if t["value"] is None else f"{t['value']:.3f}",
      f"<= {t['limit']}",
      t["status"],
      t.get("note", ""),
    ]
    for t in targets
  ]
  head = ["target", "where", "value", "limit", "status", "note"]
  return ["## Targets", ""] + table(head, rows, "llrrll")


def write(out_dir: Path, family: str, result: dict, md: list[str]) -> Path:
  """Writes the family's JSON and Markdown; returns the path stem."""
  meta = result["meta"]
  stem = out_dir / f"{meta['backend']}-{meta['date']}-{family}"
  stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
  stem.with_suffix(".md").write_text("\n".join(md).rstrip() + "\n")
  return stem


def _layout(bars: list[tuple[str, str, float]]):
  """Bar positions, labels, values, colours (one per group), the groups'
  heading positions, and the height used, top to bottom."""
  groups = list(dict.fromkeys(g for g, _, _ in bars))
  ys, labels, vals, colours, heads = [], [], [], [], []
  y = 0.0
  for gi, g in enumerate(groups):
    heads.append((y, g))
    y += 0.9
    for _, label, v in (b for b in bars if b[0] == g):
      ys.append(y)
      labels.append(label)
      vals.append(v)
      colours.append(f"C{gi % 10}")
      y += 1.0
    y += 0.4
  return ys, labels, vals, colours, heads, y


def bar_figure(
  path: Path,
  title: str,
  bars: list[tuple[str, str, float]],
  xlabel: str,
  ref: float | None = 1.0,
) -> bool:
  """Horizontal bars ``(group, label, value)``, grouped, at page width.

  A vertical line marks ``ref`` (the baseline's 1.0 for ratios). Returns
  False, writing nothing, without matplotlib or bars.
  """
  bars = [b for b in bars if b[2] is not None and math.isfinite(b[2])]
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no figure", file=sys.stderr)
    return False
  if not bars:
    return False
  ys, labels, vals, colours, heads, y = _layout(bars)
  fig, ax = plt.subplots(figsize=(PAGE_WIDTH_IN, 0.9 + 0.2 * y))
  ax.barh(ys, vals, height=0.75, color=colours)
  ax.set_yticks(ys, labels, fontsize=8)
  for y0, g in heads:
    ax.text(
      0.0,
      y0,
      g,
      transform=ax.get_yaxis_transform(),
      fontsize=8.5,
      fontweight="bold",
      va="center",
      ha="left",
    )
  ax.invert_yaxis()
  ax.set_ylim(y - 0.2, -0.8)
  lo, hi = min(vals), max(vals)
  if lo > 0 and hi / lo > 30:
    ax.set_xscale("log")
  if ref is not None:
    ax.axvline(ref, color="k", lw=0.8)
  for yy, v in zip(ys, vals):
    ax.annotate(
      f"{v:.3g}",
      (v, yy),
      xytext=(3, 0),
      textcoords="offset points",
      va="center",
      fontsize=7,
    )
  ax.set_xlabel(xlabel, fontsize=8.5)
  ax.set_title(title, fontsize=9.5)
  ax.tick_params(axis="x", labelsize=8)
  ax.spines[["top", "right"]].set_visible(False)
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)
  return True
