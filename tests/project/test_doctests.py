"""Every doctest of the package passes, on one device: where a user pastes
them. The suite runs them here only (pyproject.toml's pytest options do not
collect the package): the root conftest's 8 virtual devices cannot be
undone in-process, and the 8-device behaviour of the parallel examples is
the tests' (tests/parallel)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_doctests_pass_on_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  flags = [
    f
    for f in env.pop("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  code = (
    "import jax; assert jax.device_count() == 1, jax.devices()\n"
    "import sys, pytest\n"
    "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-n', '0', "
    "'--noconftest', '--doctest-modules', 'weighted_accum']))"
  )
  res = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
