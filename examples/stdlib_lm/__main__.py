"""``python examples/stdlib_lm [--short | --full] [--out PREFIX]``.

``--short`` (the default) is a plumbing check of a minute or two; ``--full``
is the run whose results are committed under ``benchmarks/results/``. Both
write ``PREFIX.json``, ``PREFIX.md`` and ``PREFIX.png``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

if __package__ in (None, ""):  # run as a directory: import it as a package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
  __package__ = "stdlib_lm"  # noqa: A001

from stdlib_lm import experiment  # noqa: E402
from stdlib_lm import model  # noqa: E402
from stdlib_lm import report  # noqa: E402
from stdlib_lm.train import Settings  # noqa: E402

SHORT = Settings(
  model=model.Config(seq_len=64, dim=64, layers=2, heads=2),
  batch_size=16,
  steps=30,
  train_ks=(4, 16),
  instep_ks=(16,),
  eval_every=10,
  check_every=3,
  val_rows=64,
  timing_rounds=3,
)
FULL = Settings(
  model=model.Config(seq_len=128, dim=128, layers=4, heads=4),
  batch_size=16,
  steps=120,
  eval_every=20,
  check_every=5,
  val_rows=128,
  timing_rounds=5,
)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--short", action="store_true", help="the default")
  size.add_argument("--full", action="store_true")
  parser.add_argument("--steps", type=int, help="override the steps")
  parser.add_argument("--out", default="stdlib_lm", help="output prefix")
  args = parser.parse_args(argv)
  s = FULL if args.full else SHORT
  if args.steps:
    s = type(s)(**{**s.__dict__, "steps": args.steps})
  res = experiment.run_all(s, log=lambda line: print(line, flush=True))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(res, indent=1))
  text = report.markdown(res, "python " + " ".join(sys.argv))
  out.with_suffix(".md").write_text(text)
  report.figure(res).savefig(out.with_suffix(".png"), dpi=110)
  print(text)


if __name__ == "__main__":
  main()
