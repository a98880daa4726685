"""Compiled-memory guarantees of the hot paths, and a smoke run of the benchmark.

Everything asserted here is deterministic: XLA's ``memory_analysis`` of the
compiled executables and the device addresses of the buffers before and after a
donated call (equal addresses = updated in place). No timing (that lives in
``benchmarks/``, whose smoke run is checked here).
"""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import weighted_accum as wa

ROOT = Path(__file__).resolve().parents[2]

# A small transformer-like tree: unequal leaf shapes, one large embedding.
SHAPES = {
  "embed": (1024, 96),
  "block": {
    "qkv": (96, 288),
    "out": (96, 96),
    "up": (96, 384),
    "up_bias": (384,),
    "down": (384, 96),
    "down_bias": (96,),
    "ln": (96,),
  },
  "head": {"ln": (96,)},
}


def _tree(dtype, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.standard_normal(s, np.float32), dtype),
    SHAPES,
    is_leaf=lambda x: isinstance(x, tuple),
  )


PARAMS = _tree(jnp.float32, 0)
BUFFER_BYTES = sum(x.nbytes for x in jax.tree.leaves(PARAMS))
TWO_LEAVES = sum(sorted(x.nbytes for x in jax.tree.leaves(PARAMS))[-2:])


def _addresses(tree):
  return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]


def _fresh_copy(tree):
  """Copies that own their buffers (donating PARAMS itself would delete it)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@pytest.mark.parametrize(
  "gdtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"]
)
@pytest.mark.parametrize(
  "fn", [wa.accumulate_sum, wa.accumulate_mean], ids=["sum", "mean"]
)
def test_accumulate_updates_every_buffer_in_place(fn, gdtype):
  grads = _tree(gdtype, 1)
  state = wa.accumulate_sum(wa.init(PARAMS), _tree(jnp.float32, 2), 2.0)
  before = np.array(jax.tree.leaves(state.grads)[0])
  step = jax.jit(fn, donate_argnums=0)
  compiled = step.lower(state, grads, 3.0).compile()
  ma = compiled.memory_analysis()
  assert ma.alias_size_in_bytes >= BUFFER_BYTES
  assert ma.temp_size_in_bytes <= 0.01 * BUFFER_BYTES
  # Nothing parameter-sized is written besides the aliased buffers.
  assert ma.output_size_in_bytes - ma.alias_size_in_bytes <= 1024

  addresses = _addresses(state.grads)
  new = compiled(state, grads, 3.0)
  assert _addresses(new.grads) == addresses
  assert all(x.is_deleted() for x in jax.tree.leaves(state.grads))
  # And the values are right (in place, not merely aliased): float64 NumPy.
  g = np.asarray(jax.tree.leaves(grads)[0], np.float64)
  expect = before + (3.0 * g if fn is wa.accumulate_mean else g)
  np.testing.assert_allclose(
    np.asarray(jax.tree.leaves(new.grads)[0]), expect, rtol=1e-6, atol=1e-6
  )


@pytest.mark.parametrize(
  "fn", [wa.finish_mean, wa.finish_sums], ids=["mean", "sums"]
)
def test_finish_writes_result_in_place_and_little_else(fn):
  state = wa.accumulate_sum(wa.init(PARAMS), _tree(jnp.float32, 1), 4.0)
  before = np.array(jax.tree.leaves(state.grads)[0], np.float64)
  step = jax.jit(fn, donate_argnums=0)
  compiled = step.lower(state).compile()
  ma = compiled.memory_analysis()
  assert ma.alias_size_in_bytes >= BUFFER_BYTES
  assert ma.temp_size_in_bytes <= 0.01 * BUFFER_BYTES
  assert ma.temp_size_in_bytes <= TWO_LEAVES
  # Exactly two parameter-sized outputs: the result and the next window's
  # zero buffers; nothing else.
  assert ma.output_size_in_bytes <= 2 * BUFFER_BYTES + 1024

  addresses = _addresses(state.grads)
  out, new = compiled(state)
  assert _addresses(out.grads) == addresses
  assert not set(_addresses(new.grads)) & set(addresses)
  expect = before / 4.0 if fn is wa.finish_mean else before
  np.testing.assert_allclose(
    np.asarray(jax.tree.leaves(out.grads)[0]), expect, rtol=1e-6
  )
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(new.grads))


def _wrapper_step(tx):
  def step(params, opt_state, grads, weight):
    updates, opt_state = tx.update(grads, opt_state, params, weight=weight)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1))


@pytest.mark.parametrize(
  "inner", [optax.adamw(1e-3), optax.sgd(0.1)], ids=["adamw", "sgd"]
)
def test_wrapper_mid_window_step_is_in_place_without_temporaries(inner):
  """update + apply_updates mid-window: params, inner state and buffers are
  updated in place and nothing parameter-sized is allocated: the zero updates
  are a select over the buffers that XLA fuses into apply_updates, and the
  inner state goes through the window's lax.cond without a copy."""
  tx = wa.WeightedMultiSteps(inner, 4, mode="mean")
  grads = _tree(jnp.float32, 1)
  # Donate the state exactly as init returns it: every leaf must be its own
  # buffer for that to work.
  params, opt_state = _fresh_copy(PARAMS), tx.init(PARAMS)
  compiled = _wrapper_step(tx).lower(params, opt_state, grads, 2.0).compile()
  ma = compiled.memory_analysis()
  donated_bytes = sum(
    x.nbytes for x in jax.tree.leaves((params, opt_state)) if x.size > 1
  )
  assert ma.alias_size_in_bytes >= donated_bytes
  assert ma.temp_size_in_bytes <= 0.01 * BUFFER_BYTES

  addresses = _addresses((params, opt_state))
  new_params, new_state = compiled(params, opt_state, grads, 2.0)
  new_addresses = _addresses((new_params, new_state))
  big = [
    i for i, x in enumerate(jax.tree.leaves((params, opt_state))) if x.size > 1
  ]
  assert [new_addresses[i] for i in big] == [addresses[i] for i in big]
  np.testing.assert_array_equal(
    np.asarray(new_params["embed"]), np.asarray(PARAMS["embed"])
  )


def _peak_bytes(compiled) -> int:
  """What a call holds at most: its arguments, its outputs that do not alias
  a donated argument, and its temporaries."""
  ma = compiled.memory_analysis()
  return (
    ma.argument_size_in_bytes
    + ma.output_size_in_bytes
    - ma.alias_size_in_bytes
    + ma.temp_size_in_bytes
  )


@pytest.mark.parametrize("closing", [False, True], ids=["mid", "close"])
def test_wrapper_step_peak_is_a_bare_step_plus_the_buffers(closing):
  """The wrapper's donated train step, mid-window and closing, holds what a
  bare donated AdamW step holds (params, moments, grads) plus one
  parameter-sized tree: its buffers. optax.MultiSteps holds 4 more (its
  buffers and 3 temporaries), the reference for the mid-window figure."""
  inner = optax.adamw(1e-3)
  grads = _tree(jnp.float32, 1)

  def bare(params, opt_state, g):
    updates, opt_state = inner.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  bare_peak = _peak_bytes(
    jax.jit(bare, donate_argnums=(0, 1))
    .lower(_fresh_copy(PARAMS), inner.init(PARAMS), grads)
    .compile()
  )
  tx = wa.WeightedMultiSteps(inner, 4, mode="mean")

  def step(params, opt_state, g, w):
    updates, opt_state = tx.update(
      g, opt_state, params, weight=w, finish=jnp.bool_(closing)
    )
    return optax.apply_updates(params, updates), opt_state

  peak = _peak_bytes(
    jax.jit(step, donate_argnums=(0, 1))
    .lower(_fresh_copy(PARAMS), tx.init(PARAMS), grads, 2.0)
    .compile()
  )
  assert bare_peak >= 4 * BUFFER_BYTES
  assert peak <= bare_peak + 1.01 * BUFFER_BYTES


def test_wrapper_with_narrower_buffers_keeps_one_temporary_and_works():
  """bfloat16 buffers cannot carry float32 updates exactly: the wrapper falls
  back to zero updates out of its conditional (one parameter-sized
  temporary), still in place, and applies the same window as with float32
  buffers up to bfloat16 rounding of the sums."""
  grads = [_tree(jnp.float32, 1), _tree(jnp.float32, 2)]
  results = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = wa.WeightedMultiSteps(
      optax.sgd(1.0), 2, accumulator_dtype=dtype, mode="mean"
    )
    step = _wrapper_step(tx)
    params, state = _fresh_copy(PARAMS), tx.init(PARAMS)
    ma = step.lower(params, state, grads[0], 2.0).compile().memory_analysis()
    assert ma.temp_size_in_bytes <= 1.01 * BUFFER_BYTES
    for g, w in zip(grads, (3.0, 1.0)):
      params, state = step(params, state, g, w)
    assert int(state.gradient_step) == 1
    results[dtype] = params
  # Reference in float64: sgd(1) on the weighted mean of the two microbatches.
  ref = jax.tree.map(
    lambda p, a, b: (
      np.asarray(p, np.float64)
      - (3 * np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 4
    ),
    PARAMS,
    *grads,
  )
  for dtype, rtol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
    for got, want in zip(jax.tree.leaves(results[dtype]), jax.tree.leaves(ref)):
      np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol)


# The cases every family's smoke run must report (benchmarks/README.md).
SMOKE_CASES = {
  "accumulate": {"bare_add", "numpy_add", "accumulate_sum", "accumulate_mean"},
  "train-step": {"bare_add", "step_multisteps", "step_wrapper", "step_core"},
  "close": {
    "bare_opt_step",
    "apply_window_close",
    "wrapper_close",
    "bare_scale",
    "scale_and_zeros",
    "finish_mean",
  },
  "compile": {"jit_accumulate", "eager_accumulate"},
  "in-step": {
    "mb_hand_scan",
    "mb_wa",
    "mb_optax_microbatch",
    "mb_optax_micro_grad",
  },
  "end-to-end": {"e2e_multisteps", "e2e_wrapper", "e2e_hand_loop"},
  "memory": {"accumulate_mean", "step_wrapper", "apply_window_close"},
}


@pytest.mark.slow
def test_benchmark_smoke_run(tmp_path):
  """python -m benchmarks --smoke runs every family and writes its files."""
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  for family, cases in SMOKE_CASES.items():
    (stem,) = {p.with_suffix("") for p in tmp_path.glob(f"*-{family}.*")}
    for suffix in (".json", ".md", ".png"):
      assert stem.with_suffix(suffix).is_file(), (family, suffix)
    result = json.loads(stem.with_suffix(".json").read_text())
    meta = result["meta"]
    assert meta["family"] == family and meta["mode"] == "smoke"
    assert {"jax", "optax", "flax"} <= set(meta["versions"])
    assert "load_average" in meta and meta["machine"]
    rows = result["eager"] if family == "compile" else result["rows"]
    assert cases <= {r["case"] for r in rows}, family
    assert {t["status"] for t in result["targets"]} <= {"met", "missed"}
    if family == "memory":
      acc = next(r for r in rows if r["case"] == "accumulate_mean")
      assert acc["unaliased_donated_bytes"] == 0
      continue
    for r in rows:
      base = next(
        b
        for b in rows
        if b["case"] == r["baseline"]
        and b.get("size") == r.get("size")
        and b.get("grads_dtype") == r.get("grads_dtype")
      )
      assert r["runs"] >= 10 and len(r["times_ms"]) == r["runs"]
      paired = np.median(np.divide(r["times_ms"], base["times_ms"]))
      assert r["ratio"] == pytest.approx(paired)
  comp = json.loads(next(tmp_path.glob("*-compile.json")).read_text())
  for c in comp["compile"]:
    assert all(h["fusions"] > 0 for h in c["hlo"].values())
