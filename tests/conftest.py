"""Test configuration: 8 virtual CPU devices for the sharding tests.

XLA_FLAGS must be set before jax is imported anywhere, hence here.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") +
    " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top

from hypothesis import settings  # noqa: E402  pylint: disable=g-import-not-at-top

settings.register_profile("ci", max_examples=25, deadline=None,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=["eager", "jit"])
def variant(request):
  """Runs a test with a function called eagerly and under ``jax.jit``.

  In the spirit of ``chex.variants``: ``variant(fn)`` returns ``fn`` itself or
  ``jax.jit(fn)``, with the given static argument names.
  """

  def wrap(fn, **jit_kwargs):
    if request.param == "eager":
      return fn
    return jax.jit(fn, **jit_kwargs)

  wrap.name = request.param
  return wrap
