"""The demo (``python -m weighted_accum``) runs and shows what it claims."""

import re
import subprocess
import sys

import pytest

from weighted_accum import __main__ as demo


def _errors(text):
  found = dict(re.findall(r"^(\w[\w -]+?) \(.*?\)\s+([0-9.e+-]+)$", text, re.M))
  return {k: float(v) for k, v in found.items()}


def _check_table(out):
  errs = _errors(out)
  assert errs["full-batch gradient"] == 0.0
  assert errs["weighted accumulation"] <= 1e-5
  assert errs["equal-weight accumulation"] >= 1e-2


def test_demo_table_shows_bias_and_its_absence(capsys):
  assert demo.main(["--windows", "0"]) == 0
  out = capsys.readouterr().out
  _check_table(out)
  assert "training loss" not in out


@pytest.mark.slow
def test_demo_trains_each_way(capsys):
  assert demo.main(["--windows", "3"]) == 0
  out = capsys.readouterr().out
  _check_table(out)
  assert "training loss" in out and "max |loss - full batch loss|" in out


def test_module_entry_point_help():
  res = subprocess.run(
    [sys.executable, "-m", "weighted_accum", "--help"],
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert "--windows" in res.stdout
