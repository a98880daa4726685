"""Project tooling: ruff (lint and format), the docs build, the typing marker.

These run the same commands a developer runs (see README.md), so CI fails on
a lint finding, an unformatted file or a documentation warning.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


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


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
  r = _run(
    "sphinx",
    "-W",
    "--keep-going",
    "-q",
    "-b",
    "html",
    "docs",
    str(tmp_path / "html"),
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-10000:]
  html = tmp_path / "html"
  assert (html / "api.html").is_file()
  api = (html / "api.html").read_text()
  import weighted_accum  # pylint: disable=g-import-not-at-top

  missing = [
    n
    for n in weighted_accum.__all__
    if f'id="weighted_accum.{n}"' not in api
    and f'id="module-weighted_accum.{n}"' not in api
  ]
  assert not missing, f"not in the API reference: {missing}"
  notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
  rendered = sorted(p.stem for p in (html / "notebooks").glob("*.html"))
  assert rendered == notebooks
