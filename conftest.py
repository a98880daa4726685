"""Repository-wide pytest set-up, loaded before any test or doctest module.

XLA_FLAGS must be set before jax is first imported: 8 virtual CPU devices for
the sharding tests.
"""

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# examples/ holds importable example modules (the tiny LM of the tests).
sys.path.insert(0, str(pathlib.Path(__file__).parent / "examples"))

from hypothesis import settings  # noqa: E402  pylint: disable=g-import-not-at-top

settings.register_profile("ci", max_examples=25, deadline=None, print_blob=True)
# The CI's lower-bound stage (.ci/run): the same properties, fewer examples.
settings.register_profile(
  "floors", max_examples=10, deadline=None, print_blob=True
)
# By hand: many examples, every structure of the differential test drawn.
settings.register_profile(
  "long", max_examples=200, deadline=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ------------------------------------------------------- xdist schedule --
# `pytest -n 2` (README.md) schedules whole test modules, not single tests:
# a module's tests share the programs it compiles (jitted functions built
# once per module, hostile values fed to them as data), and a module split
# over two workers compiles each of them twice. The tests below run on
# their own instead (independent long runs, each in its own process), and
# they and the longest modules start first, so that the last unit of work
# is short and both cores stay busy to the end.
_ALONE = ("tests/project/test_notebooks.py", "tests/project/test_doctests.py")
_FIRST = (
  *_ALONE,
  "tests/project/test_docs_site.py",
  "tests/parallel/test_scaleout.py",
  "tests/across_steps/test_optax_ported.py",
)


def _module(nodeid: str) -> str:
  return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items):
  """The longest first: the order in which the schedule hands them out."""
  rank = {path: i for i, path in enumerate(_FIRST)}
  items.sort(key=lambda item: rank.get(_module(item.nodeid), len(rank)))


try:
  from xdist.scheduler import LoadScopeScheduling  # noqa: E402
except ImportError:  # pytest-xdist is the test extra's; without it, no -n
  LoadScopeScheduling = None
else:

  class _ByModule(LoadScopeScheduling):
    """One unit of work per test module (per test in ``_ALONE``), handed
    out in collection order."""

    def __init__(self, config, log=None):
      config.option.loadscopereorder = False
      super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
      module = _module(nodeid)
      return nodeid if module in _ALONE else module

  import pytest  # noqa: E402

  @pytest.hookimpl(optionalhook=True)
  def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":  # another --dist mode wins
      return None
    return _ByModule(config, log)
