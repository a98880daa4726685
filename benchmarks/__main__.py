"""``python -m benchmarks [family ...] [--smoke] [--full] [--runs N]``."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
import sys
import tempfile
import time

FAMILIES = (
  "accumulate",
  "train-step",
  "close",
  "compile",
  "in-step",
  "end-to-end",
  "memory",
  "planning",
)
# glibc settings that stop XLA:CPU's per-call temporaries from being mmapped
# and page-faulted afresh on every call (see benchmarks/README.md).
TUNED_ALLOCATOR = {
  "MALLOC_ARENA_MAX": "1",
  "MALLOC_MMAP_THRESHOLD_": str(2**32),
  "MALLOC_TRIM_THRESHOLD_": str(2**33),
}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m benchmarks",
    description="Benchmarks of weighted_accum; writes <backend>-<date>-"
    "<family>.{json,md,png} per family.",
  )
  p.add_argument(
    "families",
    nargs="*",
    metavar="family",
    help=f"any of {', '.join(FAMILIES)} (default: all)",
  )
  p.add_argument(
    "--smoke",
    action="store_true",
    help="every family at tiny sizes, about a minute: a plumbing check "
    "(writes to a temporary folder unless --out)",
  )
  p.add_argument(
    "--full",
    action="store_true",
    help="adds 256M params, larger models, more compile rounds",
  )
  p.add_argument("--runs", type=int, help="timed rounds per comparison (>= 10)")
  p.add_argument("--warmup", type=int, help="untimed rounds first")
  p.add_argument(
    "--sizes", help="comma-separated parameter counts, e.g. 1M,16M"
  )
  p.add_argument(
    "--lengths",
    help="with planning: comma-separated distributions, e.g. lognormal",
  )
  p.add_argument(
    "--widths", help="with planning: comma-separated model widths, e.g. 128"
  )
  p.add_argument("--out", type=Path, help="results folder")
  p.add_argument(
    "--calibrate",
    action="store_true",
    help="with planning: fit PlanSpec's cost model on this machine, print it",
  )
  p.add_argument(
    "--tuned-allocator",
    action="store_true",
    help="re-run with glibc settings that keep freed memory (Linux CPU)",
  )
  return p


def _families(names: list[str], p: argparse.ArgumentParser) -> list[str]:
  chosen = [n.replace("_", "-") for n in names] or list(FAMILIES)
  bad = [n for n in chosen if n not in FAMILIES]
  if bad:
    p.error(f"unknown family {', '.join(bad)}; choose from {FAMILIES}")
  return list(dict.fromkeys(chosen))


def _reexec_tuned(argv: list[str]) -> None:
  """Restarts this command with the tuned allocator in the environment."""
  os.environ.update(TUNED_ALLOCATOR)
  root = str(Path(__file__).resolve().parents[1])
  os.environ["PYTHONPATH"] = os.pathsep.join(
    [root] + [x for x in [os.environ.get("PYTHONPATH")] if x]
  )
  os.execv(sys.executable, [sys.executable, "-m", "benchmarks", *argv])


def _cpu_s() -> float:
  """CPU seconds (user + system) of this process and its children so far:
  the work of a family, whatever else the machine runs."""
  try:
    import resource
  except ImportError:  # not on Windows
    return float("nan")
  return sum(
    u.ru_utime + u.ru_stime
    for u in (
      resource.getrusage(resource.RUSAGE_SELF),
      resource.getrusage(resource.RUSAGE_CHILDREN),
    )
  )


def run_family(name: str, cfg, out_dir: Path, command: str, allocator: str):
  """Runs one family and writes its results files; returns them."""
  from benchmarks import report

  mod = importlib.import_module(f"benchmarks.{name.replace('-', '_')}")
  meta = report.run_meta(command, allocator, cfg)  # the start time
  load0, t0, cpu0 = report.load_average(), time.perf_counter(), _cpu_s()
  result = mod.run(cfg)
  meta.update(
    family=name,
    seconds=time.perf_counter() - t0,
    cpu_seconds=_cpu_s() - cpu0,
    load_average=load0,
    load_average_end=report.load_average(),
  )
  result = dict(meta=meta, **result)
  stem = out_dir / f"{meta['backend']}-{meta['date']}-{name}"
  has_png = mod.figure(result, stem.with_suffix(".png"))
  md = report.header(meta, mod.TITLE) + mod.markdown(result)
  md += report.targets_table(result["targets"])
  if has_png:
    md += [f"![{mod.TITLE}]({stem.name}.png)", ""]
  report.write(out_dir, name, result, md)
  return result, stem


def _settings(args: argparse.Namespace):
  from benchmarks import harness

  split = lambda s: s and tuple(x.strip() for x in s.split(","))
  return harness.Settings(
    smoke=args.smoke,
    full=args.full,
    runs=args.runs,
    warmup=args.warmup,
    sizes=split(args.sizes) or None,
    lengths=split(args.lengths) or None,
    widths=args.widths and tuple(map(int, split(args.widths))),
  )


def _out_dir(args: argparse.Namespace) -> Path:
  if args.out:
    out = args.out
  elif args.smoke:
    out = Path(tempfile.mkdtemp(prefix="wa-bench-"))
  else:
    out = Path(__file__).resolve().parent / "results"
  out.mkdir(parents=True, exist_ok=True)
  return out


def main(argv: list[str] | None = None) -> int:
  """Runs the chosen families; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = parser()
  args = p.parse_args(argv)
  names = _families(args.families, p)
  if args.runs is not None and args.runs < 10:
    p.error("--runs must be at least 10 (the median of >= 10 rounds)")
  tuned = all(os.environ.get(k) == v for k, v in TUNED_ALLOCATOR.items())
  if args.tuned_allocator and not tuned:
    _reexec_tuned(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  if args.smoke and "optimization_level" not in flags:
    # Compiling dominates a tiny run: ask XLA for less optimisation.
    flags += " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = flags.strip()
  import jax

  if args.calibrate:
    if names != ["planning"]:
      p.error("--calibrate goes with the planning family alone")
    from benchmarks import planning

    planning.calibrate(_settings(args))
    return 0
  cfg, out_dir = _settings(args), _out_dir(args)
  allocator = "default"
  if tuned:
    settings = " ".join(f"{k}={v}" for k, v in TUNED_ALLOCATOR.items())
    allocator = f"glibc tuned ({settings})"
  command = " ".join(["python -m benchmarks", *argv])
  print(
    f"weighted_accum benchmarks on {jax.default_backend()} "
    f"({jax.devices()[0].device_kind}): {', '.join(names)}",
    flush=True,
  )
  t0 = time.perf_counter()
  for name in names:
    result, stem = run_family(name, cfg, out_dir, command, allocator)
    meta, targets = result["meta"], result["targets"]
    met = sum(t["status"] == "met" for t in targets)
    print(
      f"  {name}: {meta['seconds']:.0f} s ({meta['cpu_seconds']:.0f} s CPU), "
      f"{met}/{len(targets)} targets met -> {stem}.{{json,md,png}}",
      flush=True,
    )
  print(f"done in {time.perf_counter() - t0:.0f} s; results in {out_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
