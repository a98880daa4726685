"""The example scripts of ``examples/`` run as a user runs them, in a fresh
interpreter, and end cleanly."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def _run(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, str(ROOT / "examples" / script)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
    env={
      **os.environ,
      "PYTHONPATH": str(ROOT),  # this checkout's package
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "",
    },
  )


@pytest.mark.slow
def test_planned_pipeline_runs_and_leaks_no_shared_memory():
  """Its Grain workers hand batches over in shared memory: every block is
  unlinked before the interpreter exits (no resource-tracker warning)."""
  pytest.importorskip("grain")
  r = _run("planned_pipeline.py")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "compiles: 1" in r.stdout
  assert "leaked" not in r.stderr, r.stderr[-3000:]
