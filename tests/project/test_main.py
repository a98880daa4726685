"""The demo (``python -m weighted_accum``) runs and shows what it claims."""

import re
import subprocess
import sys

import pytest

from weighted_accum._src import demo


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


def test_demo_trains_each_way(capsys):
  assert demo.main(["--windows", "3"]) == 0
  out = capsys.readouterr().out
  _check_table(out)
  assert "training loss" in out
  drift = re.search(
    r"weighted_accum ([0-9.e+-]+), equal-weight ([0-9.e+-]+)", out
  )
  assert float(drift.group(1)) < 1e-5 < float(drift.group(2))


@pytest.mark.slow
def test_tiny_lm_example_demo_runs(capsys):
  """The NNX tiny-LM demo in examples/ shows the same bias and its absence."""
  import toy_lm_demo  # pylint: disable=g-import-not-at-top

  assert toy_lm_demo.main(["--windows", "0"]) == 0
  _check_table(capsys.readouterr().out)


def test_module_entry_point_help():
  res = subprocess.run(
    [sys.executable, "-m", "weighted_accum", "--help"],
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert "--windows" in res.stdout
