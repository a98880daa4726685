"""Shared fixtures. The environment (8 CPU devices, hypothesis profile) is set
in the repository's root conftest.py, before jax is imported."""

import jax
import pytest


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
