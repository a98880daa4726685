"""docs/recipes/planned_grain_checkpoint.md, run as its page says: the
recipe's script killed with SIGKILL mid-window, then run again, ends with
the params of an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("grain")

ROOT = pathlib.Path(__file__).parents[2]
PAGE = ROOT / "docs" / "recipes" / "planned_grain_checkpoint.md"


def _script() -> str:
  region = re.search(
    r"<!-- BEGIN planned-grain-checkpoint -->\n```python\n(.*?)```",
    PAGE.read_text(),
    re.S,
  )
  return region.group(1)


def _run(script, ckpt_dir, **env) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, str(script)],
    cwd=ckpt_dir.parent,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
    env={
      **os.environ,
      "PYTHONPATH": str(ROOT),  # this checkout's package
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "",
      "CKPT_DIR": str(ckpt_dir),
      **env,
    },
  )


def _params(ckpt_dir):
  with np.load(ckpt_dir / "params.npz") as f:
    return {k: f[k] for k in f.files}


@pytest.mark.slow
def test_killed_mid_window_and_resumed_is_bit_identical(tmp_path):
  script = tmp_path / "train.py"
  script.write_text(_script())
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  r = _run(script, whole)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.splitlines() == ["6 2"]

  r = _run(script, killed, PREEMPT_AFTER="4")
  assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
  assert not (killed / "params.npz").exists()
  r = _run(script, killed)
  assert r.returncode == 0, r.stderr[-3000:]
  # Resumed from batch 4: mid-window (the second window's first batch).
  assert r.stdout.splitlines()[0].startswith(
    "resumed after batch 4, 1 of the window's batches"
  ), r.stdout
  assert r.stdout.splitlines()[-1] == "6 2"

  want, got = _params(whole), _params(killed)
  assert sorted(want) == sorted(got) == ["embed", "out"]
  for k in want:
    assert want[k].dtype == got[k].dtype
    assert want[k].tobytes() == got[k].tobytes(), k  # bit for bit
