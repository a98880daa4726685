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
