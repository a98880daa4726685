"""A traced ``num_real_microbatches`` of 0 runs nothing, at every K.

At K = 1 a microbatch's slice does not depend on the loop index, so XLA
would hoist ``loss_fn`` out of the loop: it then ran at a count of 0 and its
temporaries lived beside the rest of the program's. The compiled program
must keep every matmul of ``loss_fn`` under control flow that the count
decides (a ``while`` or ``conditional``), never on ``ENTRY``'s own path.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import weighted_accum as wa

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", re.M | re.S)


def _unconditional_dots(hlo: str) -> int:
  """Dots that run on every execution: on ENTRY or in what it calls by
  ``calls=`` (fusions, calls), not inside a while or a conditional."""
  comps = {m.group(1): m.group(2) for m in _COMP.finditer(hlo)}
  entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
  seen, todo, dots = set(), [entry], 0
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    body = comps[name]
    dots += len(re.findall(r" (?:dot|convolution)\(", body))
    todo += re.findall(r"calls=%?([\w.\-]+)", body)
  return dots


def _loss(w, batch):
  x, m = batch
  h = jnp.tanh(x @ w["a"]) @ w["b"]
  return jnp.sum((h**2).sum(-1) * m), m.sum()


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_count_of_zero_runs_no_microbatch(k):
  w = {"a": jnp.full((16, 16), 0.1), "b": jnp.full((16, 8), 0.2)}
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
  m = jnp.ones(8)
  f = wa.microbatched_value_and_grad(_loss, k, mode="sum", split="contiguous")
  step = jax.jit(lambda w, b, n: f(w, b, num_real_microbatches=n))
  compiled = step.lower(w, (x, m), jnp.int32(0)).compile()
  assert _unconditional_dots(compiled.as_text()) == 0
  # ... and the count still decides what is added: all K, then none.
  _, out = compiled(w, (x, m), jnp.int32(k))
  ref = jax.grad(lambda w: _loss(w, (x, m))[0] / 8.0)(w)
  np.testing.assert_allclose(out.grads["a"], ref["a"], rtol=2e-6)
  _, empty = compiled(w, (x, m), jnp.int32(0))
  assert float(empty.weight) == 0.0 and not bool(empty.valid)


def test_the_counter_sees_the_unconditional_path():
  """The HLO reader finds a dot outside control flow (the test can fail)."""
  f = jax.jit(lambda a, b: a @ b)
  hlo = f.lower(jnp.ones((4, 4)), jnp.ones((4, 4))).compile().as_text()
  assert _unconditional_dots(hlo) == 1
