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
conditional's outputs are materialised: the updates leave it for the
caller's ``apply_updates``. That loop, and the pending sums' finiteness read
at a close, are what the wrapper adds per leaf at a close; the closed
window's buffers are not reset in a loop of their own (the next window's
first accumulate overwrites them). Measured at leaves of 512x512 (above
65,536 elements, where each leaf has its own finiteness read), counting the
loops that read or write a leaf-sized array.
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


def _big(types: str) -> bool:
  """Whether an HLO type string names an array above 65,536 elements."""
  dims = re.findall(r"\[([\d,]+)\]", types)
  return any(np.prod([int(d) for d in x.split(",")]) > 65536 for x in dims)


def _leaf_loops(comps, name: str, pick) -> int:
  """As :func:`_loops`, counting only fusions that read or write a
  leaf-sized array (the scalar work around them is not a loop over a
  leaf)."""
  n = 0
  for line in comps[name]:
    if re.search(r"\sfusion\(", line):
      called = re.search(r"calls=%?([\w.\-]+)", line).group(1)
      params = [l for l in comps[called] if "parameter(" in l]
      n += _big(line.split("fusion(")[0]) or any(map(_big, params))
    elif re.search(r"\sconditional\(", line):
      n += pick(_leaf_loops(comps, b, pick) for b in _branches(line))
  return n


def _big_step(kind: str, leaves: int) -> str:
  inner = optax.adamw(1e-3, weight_decay=1e-4)
  if kind == "multisteps":
    tx, kw = optax.MultiSteps(inner, 4), {}
  else:
    tx, kw = wa.WeightedMultiSteps(inner, 4, mode="mean"), {"weight": 2.0}

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params, **kw)
    return optax.apply_updates(params, updates), opt_state

  params = {f"w{i}": jnp.full((512, 512), 0.5) for i in range(leaves)}
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
    params, tx.init(params), params
  )
  return lowered.compile().as_text()


@pytest.fixture(scope="module")
def big_leaf():
  """Loops over a 512x512 leaf, mid-window and at a close, per leaf."""
  out = {}
  for kind in ("multisteps", "wrapper"):
    one, three = (_computations(_big_step(kind, n)) for n in (1, 3))
    out[kind] = {
      k: (_leaf_loops(*three, pick) - _leaf_loops(*one, pick)) / 2
      for k, pick in (("mid_window", min), ("closing", max))
    }
  return out


def test_mid_window_step_runs_half_multisteps_loops(big_leaf):
  """Mid-window the wrapper runs the accumulate (which also overwrites a
  closed window's buffers) and the caller's apply of zero updates: 2 loops
  per leaf, no inner update, no reset; MultiSteps runs 4."""
  assert big_leaf["multisteps"]["mid_window"] == 4
  assert big_leaf["wrapper"]["mid_window"] == 2


def test_window_runs_fewer_loops_than_multisteps(big_leaf):
  """A closing step runs the accumulate, the finiteness read, AdamW's two
  moments, its updates (materialised by the conditional that skips it
  mid-window) and the caller's apply: 6 loops per leaf against
  MultiSteps' 4. No multi-output fusion on XLA:CPU, so the read is a loop
  of its own. A window of K = 4 runs 3 * 2 + 6 = 12 against 16."""
  wrapper, multisteps = big_leaf["wrapper"], big_leaf["multisteps"]
  assert wrapper["closing"] <= 6
  k = 4
  window = (k - 1) * wrapper["mid_window"] + wrapper["closing"]
  assert window < k * multisteps["closing"]


def test_scalar_checks_are_not_copied_into_every_leaf(per_leaf):
  """Each leaf's accumulate loop reads one precomputed weight: the fused
  code per leaf stays below MultiSteps' (whose 4 loops each recompute the
  AdamW chain) but for the close's exact division (three factors, computed
  once: 98 -> 117 per leaf). With the weight's ~60 validity instructions in
  every loop it was 140 per leaf against MultiSteps' 109; with the exact
  divisor's exponent arithmetic re-derived per leaf, 187."""
  wrapper, multisteps = per_leaf["wrapper"], per_leaf["multisteps"]
  assert wrapper["fused_instructions"] <= multisteps["fused_instructions"] + 10
