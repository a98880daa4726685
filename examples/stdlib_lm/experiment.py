"""One whole experiment: the training runs, the gradient checks, the table.

:func:`run_all` returns a JSON-ready dict; :mod:`.report` turns it into
Markdown and a figure.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import sys
import time
from typing import Any

import flax
import jax
import numpy as np
import optax

from . import measure
from . import model
from .train import Experiment
from .train import Settings
from .train import train


def run_name(method: str, k: int) -> str:
  """A run's key: ``full`` or ``<method> K=<k>``."""
  return "full" if method == "full" else f"{method} K={k}"


def machine() -> dict[str, Any]:
  """The machine and the versions the figures were measured with."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [ln.split(":", 1)[1] for ln in f if ln.startswith("model name")]
    cpu = names[0].strip() if names else cpu
  except OSError:
    pass
  return {
    "date": datetime.date.today().isoformat(),
    "platform": platform.platform(),
    "cpu": cpu,
    "cores": os.cpu_count(),
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()[:1]],
    "python": sys.version.split()[0],
    "jax": jax.__version__,
    "jaxlib": importlib.metadata.version("jaxlib"),
    "optax": optax.__version__,
    "flax": flax.__version__,
    "numpy": np.__version__,
    "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else [],
  }


def corpus_stats(ex: Experiment) -> dict[str, Any]:
  """Sizes and length spreads of the corpus as the runs see it."""
  c, q = ex.corpus, [0, 10, 50, 90, 99, 100]
  targets = c.train.mask.sum(1)
  return {
    "files": {"train": c.num_files[0], "valid": c.num_files[1]},
    "documents": {"train": len(c.train), "valid": len(c.valid)},
    "doc_length_percentiles": dict(
      zip(map(str, q), np.percentile(c.train_doc_lengths, q).tolist())
    ),
    "row_target_percentiles": dict(
      zip(map(str, q), np.percentile(targets, q).tolist())
    ),
    "full_rows_fraction": float(np.mean(targets == ex.s.model.seq_len)),
  }


def _summary(checks: list[dict], runs: dict[str, dict], s: Settings) -> dict:
  grads = {}
  for k in s.table_ks:
    rows = [c["K"][str(k)] for c in checks]
    grads[str(k)] = {
      f"{kind}_{stat}": float(f([r[kind] for r in rows]))
      for kind in ("equal", "weighted", "equal_ungrouped")
      if kind in rows[0]
      for stat, f in (("median", np.median), ("max", np.max))
    }
  ref, tail = runs["full"], max(1, s.steps // 10)
  losses = {}
  for name, r in runs.items():
    diff = np.abs(np.array(r["train_loss"]) - ref["train_loss"])
    losses[name] = {
      "final_val_loss": r["val_loss"][-1],
      "final_train_loss": float(np.mean(r["train_loss"][-tail:])),
      "val_gap": r["val_loss"][-1] - ref["val_loss"][-1],
      "train_gap": float(np.mean(r["train_loss"][-tail:]))
      - float(np.mean(ref["train_loss"][-tail:])),
      "max_abs_train_diff": float(diff.max()),
    }
  return {"gradient_error": grads, "loss": losses, "tail_steps": tail}


def run_all(
  s: Settings, *, speed: bool = True, log=print, ex: Experiment | None = None
) -> dict[str, Any]:
  """Runs every training run, the gradient checks and the speed table.

  Args:
    s: the settings.
    speed: also measure the tokens/s and compiled-memory table.
    log: called with one progress line at a time.
    ex: an :class:`Experiment` of these settings to reuse (its corpus and
      compiled steps); by default a new one.

  Returns:
    The results, JSON-ready.
  """
  start = time.perf_counter()
  info = machine()
  ex = ex or Experiment(s)
  log(f"corpus read; {model.num_params(ex.params0):,} params")
  checks = []

  def check(step, params):
    if step % s.check_every == 0:
      errs = measure.gradient_check(ex, params, step)
      checks.append({"step": step, "K": {str(k): v for k, v in errs.items()}})

  runs = {}
  for method, k in ex.runs():
    hook = check if method == "full" else None
    runs[run_name(method, k)] = train(ex, method, k, on_step=hook)
    log(
      f"{run_name(method, k)}: val {runs[run_name(method, k)]['val_loss'][-1]:.4f}"
    )
  table = measure.speed_table(ex) if speed else []
  info["load_average_end"] = list(os.getloadavg())
  return {
    "settings": dataclasses.asdict(s),
    "machine": info,
    "params": model.num_params(ex.params0),
    "corpus": corpus_stats(ex),
    "checks": checks,
    "runs": runs,
    "speed": table,
    "summary": _summary(checks, runs, s),
    "wall_seconds": time.perf_counter() - start,
  }
