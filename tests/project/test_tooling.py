"""Project tooling: ruff (lint and format), the typing marker.

These run the same commands a developer runs (see README.md), so CI fails on
a lint finding or an unformatted file. The docs build and the built site are
checked in tests/project/test_docs_site.py.
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def test_ruff_lint_is_clean():
  r = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
  assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean():
  r = _run("ruff", "format", "--no-cache", "--check", ".")
  assert r.returncode == 0, (
    "run `ci/format.sh` (ruff format + ruff check --fix):\n"
    + r.stdout
    + r.stderr
  )


def test_package_ships_the_typing_marker():
  import weighted_accum  # pylint: disable=g-import-not-at-top

  assert (pathlib.Path(weighted_accum.__file__).parent / "py.typed").is_file()
