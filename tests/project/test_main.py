"""The demo (``python -m weighted_accum``) runs and shows what it claims."""

import re
import runpy
import sys

import numpy as np
import optax
import pytest

from weighted_accum._src import demo


def _k_table(out):
  """``{K: (optax.MultiSteps error, WeightedMultiSteps error)}``."""
  rows = re.findall(
    r"^\s*(\d+)\s+\d+ to \d+\s+([0-9.e+-]+)\s+([0-9.e+-]+)$", out, re.M
  )
  return {int(k): (float(a), float(b)) for k, a, b in rows}


def _check_k_table(out):
  table = _k_table(out)
  assert sorted(table) == list(demo.MICROBATCH_COUNTS)
  for multi_steps, weighted in table.values():
    assert weighted <= 1e-5 and multi_steps >= 1e-2
  # The equal-weight error grows with K (the spread of microbatch sizes).
  assert table[16][0] > table[2][0]
  assert "docs/migration" in out  # where to go next
  assert "docs/planning" in out


def test_demo_table_shows_bias_and_its_absence(capsys):
  assert demo.main([]) == 0
  _check_k_table(capsys.readouterr().out)


def test_demo_errors_are_the_real_optax_multisteps():
  """The table's optax.MultiSteps column is optax's own wrapper, and its
  error is that of the equal-weight mean of microbatch means (computed here
  independently in float64 NumPy)."""
  params = demo.init_params(0)
  tokens, mask = demo.make_batch(0)
  k = 8
  tx, _ = demo.identity_wrapper("optax.MultiSteps", k)
  assert isinstance(tx, optax.MultiSteps)
  got = demo.accumulated_gradient("optax.MultiSteps", params, tokens, mask, k)
  parts = [
    demo.mean_loss_and_grad(params, t, m)[1]
    for t, m in demo.split(tokens, mask, k)
  ]
  mean_of_means = {
    name: sum(np.asarray(p[name], np.float64) for p in parts) / k
    for name in params
  }
  assert demo.rel_err(got, mean_of_means) < 1e-6
  weighted = demo.accumulated_gradient(
    "WeightedMultiSteps", params, tokens, mask, k
  )
  full = demo.mean_loss_and_grad(params, tokens, mask)[1]
  assert demo.rel_err(weighted, full) < 1e-5


def test_training_example_trains_each_way(capsys):
  """``examples/demo_training.py``: Adam through each wrapper, on the demo's
  model and batches."""
  import demo_training  # examples/, on the path (conftest.py)  # pylint: disable=g-import-not-at-top

  assert demo_training.main(["--windows", "3"]) == 0
  out = capsys.readouterr().out
  rows = re.findall(
    r"^\s+(\d)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.e+-]+)$", out, re.M
  )
  assert [int(r[0]) for r in rows] == [0, 1, 2]
  for _, full, _multi, weighted, err in rows:
    assert abs(float(weighted) - float(full)) < 1e-4
    assert float(err) >= 1e-2
  assert float(rows[-1][2]) != float(rows[-1][1])


@pytest.mark.slow
def test_tiny_lm_example_demo_runs(capsys):
  """The NNX tiny-LM demo in examples/ shows the same bias and its absence."""
  import toy_lm_demo  # pylint: disable=g-import-not-at-top

  assert toy_lm_demo.main(["--windows", "0"]) == 0
  out = capsys.readouterr().out
  errs = {
    k: float(v)
    for k, v in re.findall(r"^(\w[\w -]+?) \(.*?\)\s+([0-9.e+-]+)$", out, re.M)
  }
  assert errs["full-batch gradient"] == 0.0
  assert errs["weighted accumulation"] <= 1e-5
  assert errs["equal-weight accumulation"] >= 1e-2


def test_module_entry_point_help(capsys, monkeypatch):
  """``python -m weighted_accum --help``, run in this process (runpy, as
  ``-m`` does) rather than in a new interpreter that imports jax again; CI's
  wheel check runs ``python -m weighted_accum`` from the installed wheel."""
  monkeypatch.setattr(sys, "argv", ["weighted_accum", "--help"])
  with pytest.raises(SystemExit) as exited:
    runpy.run_module("weighted_accum", run_name="__main__", alter_sys=True)
  assert exited.value.code == 0
  assert "--seed" in capsys.readouterr().out
