"""What the wrapper's compiled train step is made of, against optax.MultiSteps'.

XLA:CPU compiles a step in time that grows with the fused loops it emits and
the instructions inside them. Counted here, deterministically, in the
optimised HLO of a donated ``update + apply_updates`` step with AdamW inside,
at 10 and 50 leaves (a 64x64 kernel and a 64 bias per layer), per leaf (the
difference between the two sizes over 40 leaves, so fixed scalar work does
not count):

- the fused loops of the whole program, and those a mid-window step and a
  closing step run (a conditional runs one branch: its cheapest mid-window,
  its costliest at a close);
- the instructions inside fused computations (a scalar check that XLA copies
  into every leaf's loop shows here).

``optax.MultiSteps`` runs everything in one computation of 4 loops per leaf
(its buffers, the two moments, the params), computing the inner update on
every step. The wrapper skips it mid-window with a conditional, and a
conditional's outputs are materialised: the buffers are written before it,
the updates leave it for the caller's ``apply_updates``, and the buffers are
reset after the caller's read. These three loops, and the pending sums'
finiteness read at a close, are what the wrapper adds per leaf
(``docs/design.md``, "The optax wrapper's step layout").
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import weighted_accum as wa

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="XLA:CPU's fusion counts"
)

_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_FUSED = ("fused_", "wrapped_")


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """The HLO module's computations (name -> instruction lines) and ENTRY."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    if cur is None:
      m = _HEADER.match(line)
      if m:
        cur = m.group(2)
        comps[cur] = []
        if m.group(1):
          entry = cur
      continue
    if line.startswith("}"):
      cur = None
      continue
    comps[cur].append(line)
  assert entry is not None
  return comps, entry


def _branches(line: str) -> list[str]:
  m = re.search(r"branch_computations=\{([^}]*)\}", line)
  if m:
    return [b.strip().lstrip("%") for b in m.group(1).split(",")]
  return [
    re.search(rf"{k}_computation=%?([\w.\-]+)", line).group(1)
    for k in ("true", "false")
  ]


def _loops(comps, name: str, pick) -> int:
  """Fusions run by computation ``name``, a conditional counted by the
  branch ``pick`` chooses among its branches' counts."""
  n = 0
  for line in comps[name]:
    if re.search(r"\sfusion\(", line):
      n += 1
    elif re.search(r"\sconditional\(", line):
      n += pick(_loops(comps, b, pick) for b in _branches(line))
    elif re.search(r"\scall\(", line):
      n += _loops(
        comps, re.search(r"to_apply=%?([\w.\-]+)", line).group(1), pick
      )
  return n


def _figures(text: str) -> dict[str, int]:
  comps, entry = _computations(text)
  return dict(
    loops=len(re.findall(r"\sfusion\(", text)),
    mid_window=_loops(comps, entry, min),
    closing=_loops(comps, entry, max),
    fused_instructions=sum(
      len(v) for k, v in comps.items() if k.startswith(_FUSED)
    ),
  )


def _params(layers: int):
  rng = np.random.default_rng(0)
  return {
    f"layer_{i:03d}": {
      "kernel": jnp.asarray(rng.standard_normal((64, 64), np.float32)),
      "bias": jnp.asarray(rng.standard_normal(64, np.float32)),
    }
    for i in range(layers)
  }


def _compiled_step(kind: str, layers: int) -> str:
  inner = optax.adamw(1e-3, weight_decay=1e-4)
  if kind == "multisteps":
    tx, kw = optax.MultiSteps(inner, 4), {}
  else:
    tx, kw = wa.WeightedMultiSteps(inner, 4, mode="mean"), {"weight": 2.0}

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params, **kw)
    return optax.apply_updates(params, updates), opt_state

  params = _params(layers)
  grads = jax.tree.map(lambda p: 1e-3 * p, params)
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
    params, tx.init(params), grads
  )
  return lowered.compile().as_text()


@pytest.fixture(scope="module")
def per_leaf():
  """Each figure per leaf, for the wrapper and for optax.MultiSteps."""
  out = {}
  for kind in ("multisteps", "wrapper"):
    small, large = (_figures(_compiled_step(kind, n)) for n in (5, 25))
    out[kind] = {k: (large[k] - small[k]) / 40 for k in small}
  return out


def test_mid_window_step_runs_fewer_loops_than_multisteps(per_leaf):
  """Mid-window the wrapper runs the accumulate, the caller's apply of zero
  updates and the buffers' select: 3 loops per leaf, no inner update."""
  wrapper, multisteps = per_leaf["wrapper"], per_leaf["multisteps"]
  assert multisteps["mid_window"] == 4
  assert wrapper["mid_window"] <= 3


def test_program_adds_two_loops_per_leaf_to_multisteps(per_leaf):
  """The whole program (= the closing path) against MultiSteps' measured in
  this test: its loops per leaf plus exactly the two the conditional
  materialises (measured: 6.0 against 4.0); the finiteness read is one loop
  per group of up to 32 small leaves of one shape.

  Fewer is not possible without giving up what the step keeps: the inner
  update's outputs leave the conditional (its updates, which the caller's
  ``apply_updates`` reads, are written once), and with no parameter-sized
  temporary (``test_memory.py``) they can only live in the window's
  buffers, which therefore are zeroed after that read in a loop of their
  own (XLA:CPU fuses no sibling loops). MultiSteps writes neither: it
  computes the inner update on every step, at 3 P of temporaries."""
  wrapper, multisteps = per_leaf["wrapper"], per_leaf["multisteps"]
  assert wrapper["closing"] == wrapper["loops"]
  assert wrapper["loops"] <= multisteps["loops"] + 2


def test_scalar_checks_are_not_copied_into_every_leaf(per_leaf):
  """Each leaf's accumulate loop reads one precomputed weight: the fused
  code per leaf stays below MultiSteps' (whose 4 loops each recompute the
  AdamW chain). With the weight's ~60 validity instructions in every loop it
  was 140 per leaf against MultiSteps' 109."""
  wrapper, multisteps = per_leaf["wrapper"], per_leaf["multisteps"]
  assert wrapper["fused_instructions"] <= multisteps["fused_instructions"]
