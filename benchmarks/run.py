"""``python benchmarks/run.py ...``: an alias of ``python -m benchmarks ...``."""

from pathlib import Path
import sys

if __name__ == "__main__":
  sys.path[0] = str(Path(__file__).resolve().parents[1])  # not benchmarks/
  from benchmarks.__main__ import main

  sys.exit(main())
