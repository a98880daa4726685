"""Hostile inputs: every input the API accepts is handled exactly or refused.

Hypothesis draws input TYPES (Python int/float/bool, NumPy and JAX scalars of
every integer and floating dtype, 0-d and 1-element arrays, strings, None,
complex) x MAGNITUDES (0, subnormal, tiny, 2**24 +- 1, 2**31, 2**53, 1e38,
1e39, inf, nan, negative ...) and feeds them to every public entry point,
eagerly, under ``jax.jit`` and under ``jax.vmap``. Each case asserts one of:

* the result is exact against an independent float64 / ``math.fsum``
  reference computed from the value the caller passed;
* a :class:`WeightedAccumulationError` names the argument, and the caller's
  state is untouched;
* under a transformation, the microbatch (or window) is rejected whole and
  counted, and nothing reports ``valid=True`` for a wrong result.

After every accepted call the invariants are checked: zero total weight =>
all-zero buffers (on the bits, so a subnormal counts as non-zero), ``issued
= zero_weight + rejected + microbatches added``. Jitted functions are built
once per module.
"""

from __future__ import annotations

import json
import math
import tempfile
import warnings

from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import weighted_accum as wa
from weighted_accum import distributed as dist
from weighted_accum._src.checkpointing import checkpoint as checkpoint_impl
from weighted_accum.checkpoint import AccumCheckpointHandler
from weighted_accum.checkpoint import AccumRestore
from weighted_accum.checkpoint import AccumSave

Error = wa.WeightedAccumulationError
F32 = np.finfo(np.float32)
INT32_MAX = 2**31 - 1

PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
GRADS = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array([0.5, 4.0])}
G64 = {k: np.asarray(v, np.float64) for k, v in GRADS.items()}

# ------------------------------------------------------------ the inputs --

MAGNITUDES = [
  0.0,
  -0.0,
  1e-45,
  1e-40,
  1e-38,
  1.2e-38,
  1e-30,
  0.5,
  1.0,
  3.0,
  2.0**24 - 1,
  2.0**24 + 1,
  2.0**31 - 1,
  2.0**31,
  2.0**33 + 5,
  2.0**40,
  2.0**48,
  2.0**53,
  1e38,
  3.4028235e38,
  1e39,
  1e300,
  math.inf,
  -math.inf,
  math.nan,
  -1.0,
  -(2.0**31),
  -1e-40,
]
NP_INTS = [
  np.int8,
  np.int16,
  np.int32,
  np.int64,
  np.uint8,
  np.uint16,
  np.uint32,
  np.uint64,
]
NP_FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
JNP_TYPES = [
  jnp.int8,
  jnp.int16,
  jnp.int32,
  jnp.uint8,
  jnp.uint16,
  jnp.uint32,
  jnp.bool_,
  jnp.float16,
  jnp.bfloat16,
  jnp.float32,
]
KINDS = (
  [
    "py_int",
    "py_float",
    "py_bool",
    "str",
    "none",
    "complex",
    "list1",
    "arr1",
    "jarr1",
  ]
  + [("np", t) for t in NP_INTS + NP_FLOATS]
  + [("arr0", t) for t in NP_INTS + NP_FLOATS]
  + [("jnp", t) for t in JNP_TYPES]
)


class Unmakeable(Exception):
  """The (kind, magnitude) pair has no such value (e.g. int8 of 1e39)."""


def _int_value(dtype, mag):
  if not math.isfinite(mag) or mag != int(mag):
    raise Unmakeable
  info = np.iinfo(dtype)
  if not info.min <= int(mag) <= info.max:
    raise Unmakeable
  return int(mag)


def make(kind, mag):
  """The hostile object, as a user would obtain it."""
  if kind == "py_int":
    if not math.isfinite(mag):
      raise Unmakeable
    return int(mag)
  if kind == "py_float":
    return float(mag)
  if kind == "py_bool":
    if mag not in (0.0, 1.0):
      raise Unmakeable
    return bool(mag)
  if kind == "str":
    return str(mag)
  if kind == "none":
    return None
  if kind == "complex":
    return complex(mag, 0.0)
  if kind == "list1":
    return [mag]
  if kind in ("arr1", "jarr1"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # 1e300 -> inf: the user's value
      arr = np.array([mag], np.float32)
    return arr if kind == "arr1" else jnp.asarray(arr)
  family, dtype = kind
  if dtype == jnp.bool_:
    if mag not in (0.0, 1.0):
      raise Unmakeable
    return jnp.asarray(bool(mag))
  if jnp.issubdtype(dtype, jnp.integer):
    v = _int_value(dtype, mag)
    arr = np.asarray(v, dtype)
  else:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      arr = np.asarray(mag, np.float64).astype(dtype)
  if family == "np":
    return arr[()]
  if family == "arr0":
    return arr
  return jnp.asarray(arr)


def reference(obj):
  """What the caller passed, as an exact Python number (None if not a real
  scalar)."""
  if isinstance(obj, bool):
    return int(obj)
  if isinstance(obj, (int, float)):
    return obj
  if obj is None or isinstance(obj, (str, complex, list)):
    return None
  a = np.asarray(obj)
  if a.ndim != 0:
    return None
  if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
    return int(a.item())
  return float(a.astype(np.float64))


def traceable(obj):
  """A value jit can take without JAX's own argument conversion changing it
  (JAX silently canonicalises 64-bit NumPy scalars at the jit boundary;
  that is JAX's conversion, outside the library)."""
  return isinstance(obj, jax.Array) and obj.ndim == 0


inputs = st.tuples(st.sampled_from(KINDS), st.sampled_from(MAGNITUDES))


def drawn(pair):
  try:
    return make(*pair)
  except Unmakeable:
    return _SKIP


_SKIP = object()


# ------------------------------------------------------------- the rules --


def weight_ok(v) -> bool:
  """The documented rule for a weight's value (float32 tally)."""
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return False
  if v < 0 or v > float(F32.max):
    return False
  if isinstance(v, int) and v >= 2**48:
    return False
  return not 0 < v < float(F32.tiny)


def scale_ok(v) -> bool:
  """The documented rule for a loss scale: a finite, positive, normal
  float32 after conversion."""
  if v is None or not math.isfinite(v) or v <= 0 or v > float(F32.max):
    return False
  return float(np.float32(v)) >= float(F32.tiny)


# -------------------------------------------------------------- checking --


def weight_close(got: float, ref) -> bool:
  """The float32 (hi, lo) tally holds an integer below 2**48 exactly and a
  float64 value to 2**-46 relative, or 2**-126 absolute (a residual below
  float32's normal range is dropped)."""
  if isinstance(ref, int):
    return got == ref
  return abs(got - ref) <= abs(ref) * 2.0**-46 + 2.0**-126


def snapshot(tree):
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_same(tree, snap):
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(snap)):
    np.testing.assert_array_equal(np.asarray(a), b)


def nonzero_bits(x):
  a = np.asarray(x)
  bits = a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
  return np.any(bits & ~np.array(1 << (8 * a.dtype.itemsize - 1), bits.dtype))


def assert_invariants(s, added: int):
  """Zero total weight => zero buffers; every microbatch counted once."""
  if s.total_weight == 0:
    assert not any(nonzero_bits(b) for b in jax.tree.leaves(s.grads)), (
      "zero total weight with non-zero buffers"
    )
  assert int(s.issued) == int(s.zero_weight) + int(s.rejected) + added
  assert math.isfinite(s.total_weight) and s.total_weight >= 0


def base_state():
  """A window with one microbatch of weight 3 already in it."""
  return wa.accumulate_sum(wa.init(PARAMS), GRADS, 3)


BASE = base_state()
BASE_SNAP = snapshot(BASE)

J_SUM = jax.jit(wa.accumulate_sum)
J_MEAN = jax.jit(wa.accumulate_mean)
J_INIT = jax.jit(wa.init)
J_FINISH_MEAN = jax.jit(wa.finish_mean)
J_FINISH_SUMS = jax.jit(wa.finish_sums)
V_SUM = jax.jit(jax.vmap(wa.accumulate_sum, in_axes=(None, None, 0)))


def expected_buffers(mean: bool, w: float):
  """BASE's buffers (GRADS) plus one microbatch of weight ``w``, computed in
  float64 and rounded once to float32 (an overflow is an honest inf, which
  finish reports as non-finite)."""
  with np.errstate(over="ignore"):
    return {
      k: np.float32(G64[k] + (G64[k] * w if mean else G64[k])) for k in G64
    }


def check_accepted(new, w_ref, mean):
  """``new`` = BASE plus a microbatch of weight ``w_ref``, exactly."""
  total = 3 + w_ref
  tol = (
    0
    if isinstance(w_ref, int) or float(np.float32(w_ref)) == w_ref
    else (total * 2.0**-46)
  )
  assert abs(new.total_weight - total) <= tol, (new.total_weight, total)
  exp = expected_buffers(mean, float(np.float32(w_ref))) if w_ref > 0 else G64
  for k in G64:
    np.testing.assert_allclose(
      np.asarray(new.grads[k], np.float64), exp[k], rtol=2.0**-22, atol=1e-37
    )
  added = 2 if w_ref > 0 else 1
  assert_invariants(new, added)


def check_rejected(new):
  assert int(new.rejected) == 1 and int(new.issued) == 2
  assert_same(new.grads, BASE_SNAP.grads)
  assert new.total_weight == 3
  assert_invariants(new, 1)


# ------------------------------------------------------------------ weight --


@settings(max_examples=150)
@given(pair=inputs, mean=st.booleans())
def test_weight_eager_is_exact_or_refused(pair, mean):
  obj = drawn(pair)
  if obj is _SKIP:
    return
  fn = wa.accumulate_mean if mean else wa.accumulate_sum
  ref = reference(obj)
  if weight_ok(ref):
    check_accepted(fn(BASE, GRADS, obj), ref, mean)
  else:
    with pytest.raises(Error, match=r"accumulate_(sum|mean)\(weight\)"):
      fn(BASE, GRADS, obj)
  assert_same(BASE, BASE_SNAP)


@settings(max_examples=80)
@given(pair=inputs, mean=st.booleans())
def test_weight_under_jit_is_exact_or_rejected_and_counted(pair, mean):
  obj = drawn(pair)
  if obj is _SKIP or not traceable(obj):
    return
  ref = reference(obj)
  new = (J_MEAN if mean else J_SUM)(BASE, GRADS, obj)
  if weight_ok(ref):
    check_accepted(new, ref, mean)
  else:
    check_rejected(new)
  assert_same(BASE, BASE_SNAP)


@pytest.mark.parametrize(
  "dtype",
  [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint32, jnp.int8],
)
def test_weight_under_vmap_each_lane_exact_or_rejected(dtype):
  values = [m for m in MAGNITUDES]
  objs, refs = [], []
  for m in values:
    try:
      obj = make(("jnp", dtype), m)
    except Unmakeable:
      continue
    objs.append(obj)
    refs.append(reference(obj))
  out = V_SUM(BASE, GRADS, jnp.stack(objs))
  for i, ref in enumerate(refs):
    lane = jax.tree.map(lambda x, i=i: x[i], out)
    if weight_ok(ref):
      check_accepted(lane, ref, False)
    else:
      check_rejected(lane)


@pytest.mark.parametrize(
  "obj,total",
  [
    (np.int64(2**33 + 5), 2**33 + 8),
    (np.uint64(2**40), 2**40 + 3),
    (2**40 + 1, 2**40 + 4),
    (np.uint32(2**32 - 1), 2**32 + 2),
  ],
)
def test_wide_integer_weights_do_not_wrap(obj, total):
  """Issue examples: counted exactly (the float32 tally holds 48 bits)."""
  new = wa.accumulate_sum(BASE, GRADS, obj)
  assert new.total_weight == total
  assert_invariants(new, 2)


def test_subnormal_weight_never_adds_what_the_tally_drops():
  for w in [1e-38, 1e-40, 1e-45, np.float32(1e-40)]:
    with pytest.raises(Error, match="subnormal"):
      wa.accumulate_sum(BASE, GRADS, w)
  z = wa.init(PARAMS)
  for w in [1e-38, 1e-40, 1e-45]:
    new = J_SUM(z, GRADS, jnp.float32(w))
    assert int(new.rejected) == 1 and new.total_weight == 0
    assert_invariants(new, 0)
    out, kept = J_FINISH_MEAN(new)
    assert not bool(out.valid)
    assert not any(nonzero_bits(b) for b in jax.tree.leaves(kept.grads))


def test_total_weight_overflow_is_refused_or_rejected():
  s = wa.accumulate_sum(wa.init(PARAMS), GRADS, 3e38)
  with pytest.raises(Error, match="total weight would become"):
    wa.accumulate_sum(s, GRADS, 3e38)
  assert s.total_weight == 3e38 and int(s.issued) == 1
  new = J_SUM(s, GRADS, jnp.float32(3e38))
  assert int(new.rejected) == 1 and new.total_weight == 3e38
  out, _ = J_FINISH_MEAN(new)
  assert bool(out.valid) and float(out.weight) == float(np.float32(3e38))
  # G / 3e38 is below float32's normal range (flushed to zero on XLA:CPU).
  np.testing.assert_allclose(
    np.asarray(out.grads["w"]), G64["w"] / 3e38, atol=2e-38
  )


def test_weight_on_another_device_does_not_crash():
  w = jax.device_put(jnp.float32(2.0), jax.devices()[-1])
  ls = jax.device_put(jnp.float32(4.0), jax.devices()[-1])
  new = wa.accumulate_mean(BASE, GRADS, w)
  check_accepted(new, 2, True)
  _, s = wa.finish_sums(new, next_loss_scale=ls)
  assert float(s.loss_scale) == 4.0
  _, s = wa.finish_mean(new, next_loss_scale=ls)
  assert float(s.loss_scale) == 4.0


# -------------------------------------------------------------- loss scale --


@settings(max_examples=120)
@given(pair=inputs)
def test_init_loss_scale_eager_is_stored_exactly_or_refused(pair):
  obj = drawn(pair)
  if obj is _SKIP:
    return
  ref = reference(obj)
  if scale_ok(ref):
    s = wa.init(PARAMS, loss_scale=obj)
    assert float(s.loss_scale) == float(np.float32(ref))
  else:
    with pytest.raises(Error, match=r"init\(loss_scale=...\)"):
      wa.init(PARAMS, loss_scale=obj)


def _mean_window(s, scale):
  """Two microbatches whose mean grads were scaled by ``scale``."""
  s = J_MEAN(s, jax.tree.map(lambda g: g * scale, GRADS), jnp.float32(2.0))
  return J_MEAN(s, jax.tree.map(lambda g: g * scale, GRADS), jnp.float32(1.0))


@settings(max_examples=60)
@given(pair=inputs)
def test_init_loss_scale_under_jit_never_flips_or_reports_valid(pair):
  obj = drawn(pair)
  if obj is _SKIP or not traceable(obj):
    return
  ref = reference(obj)
  s = J_INIT(PARAMS, loss_scale=obj)
  stored = float(np.float32(ref)) if scale_ok(ref) else None
  s = _mean_window(s, np.float32(ref) if stored else np.float32(1.0))
  out, _ = J_FINISH_MEAN(s)
  if stored is not None:
    assert float(s.loss_scale) == stored
    assert int(s.rejected) == 0
    if 1e-30 <= stored <= 1e30:  # the scaled grads neither under- nor overflow
      assert bool(out.valid)
      for k in G64:
        np.testing.assert_allclose(np.asarray(out.grads[k]), G64[k], rtol=1e-5)
    elif stored > 1e38:  # 4 * 2 * scale overflows: reported
      assert not bool(out.finite) and not bool(out.valid)
  else:
    assert np.isnan(float(s.loss_scale))
    assert int(s.rejected) == 2 and s.total_weight == 0
    assert not bool(out.valid)
    for leaf in jax.tree.leaves(out.grads):
      assert not nonzero_bits(leaf)
    assert_invariants(s, 0)


def test_traced_negative_loss_scale_never_flips_the_sign():
  """Issue example: a traced -2 to init under jit."""
  s = _mean_window(J_INIT(PARAMS, loss_scale=jnp.float32(-2.0)), -2.0)
  out, _ = J_FINISH_MEAN(s)
  assert not bool(out.valid)
  assert all(not nonzero_bits(x) for x in jax.tree.leaves(out.grads))
  out, _ = J_FINISH_SUMS(s)
  assert not bool(out.valid)


@settings(max_examples=100)
@given(pair=inputs, which=st.sampled_from(["sums", "mean"]), jit=st.booleans())
def test_next_loss_scale_is_stored_exactly_refused_or_marked(pair, which, jit):
  obj = drawn(pair)
  if obj is _SKIP or (jit and not traceable(obj)):
    return
  ref = reference(obj)
  if obj is None:  # None: the next window keeps the current scale
    assert float(wa.finish_sums(BASE, next_loss_scale=None)[1].loss_scale) == 1
    return
  fn = {
    ("sums", False): wa.finish_sums,
    ("mean", False): wa.finish_mean,
    ("sums", True): J_FINISH_SUMS,
    ("mean", True): J_FINISH_MEAN,
  }[which, jit]
  if not jit and not scale_ok(ref):
    with pytest.raises(Error, match=rf"finish_{which}\(next_loss_scale=...\)"):
      fn(BASE, next_loss_scale=obj)
    assert_same(BASE, BASE_SNAP)
    return
  out, new = fn(BASE, next_loss_scale=obj)
  assert bool(out.valid) and out.weight == 3  # this window is unaffected
  assert_same(BASE, BASE_SNAP)
  if scale_ok(ref):
    assert float(new.loss_scale) == float(np.float32(ref))
    return
  # Marked unusable: the next window's microbatches are rejected and counted.
  assert np.isnan(float(new.loss_scale))
  nxt = J_SUM(new, GRADS, jnp.float32(1.0))
  assert int(nxt.rejected) == 1 and nxt.total_weight == 0
  out, nxt = J_FINISH_MEAN(nxt, next_loss_scale=jnp.float32(2.0))
  assert not bool(out.valid) and float(nxt.loss_scale) == 2.0


def test_float16_mean_overflow_is_not_reported_as_nonfinite():
  """Pending sums finite, the mean overflows float16: finite=True (no
  back-off), valid=False (not applicable)."""
  s = wa.init({"w": jnp.zeros(2)}, dtype=jnp.float16, loss_scale=1.0)
  s = wa.accumulate_sum(s, {"w": jnp.array([60000.0, 1.0], jnp.float16)}, 0.5)
  out, _ = wa.finish_mean(s)
  assert bool(out.finite) and not bool(out.valid)
  s = wa.accumulate_sum(s, {"w": jnp.array([jnp.inf, 1.0], jnp.float16)}, 1)
  out, _ = wa.finish_mean(s)
  assert not bool(out.finite) and not bool(out.valid)


# ---------------------------------------------------------------- counters --

COUNTS = ["issued", "zero_weight", "rejected", "windows"]


def count_ok(obj, ref) -> bool:
  if ref is None or isinstance(obj, (bool, np.bool_)):
    return False
  if isinstance(obj, jax.Array) and obj.dtype == jnp.bool_:
    return False
  if isinstance(ref, float) and (not math.isfinite(ref) or ref != int(ref)):
    return False
  return 0 <= ref <= INT32_MAX


@settings(max_examples=120)
@given(
  pair=inputs, name=st.sampled_from(COUNTS + ["total_weight", "loss_scale"])
)
def test_from_buffers_counters_stored_exactly_or_refused(pair, name):
  obj = drawn(pair)
  if obj is _SKIP:
    return
  ref = reference(obj)
  counters = {"issued": INT32_MAX}
  if name != "issued":
    counters[name] = obj
  else:
    counters = {"issued": obj}
  buffers = jax.tree.map(np.zeros_like, snapshot(PARAMS))
  if name in COUNTS:
    ok = count_ok(obj, ref)
  elif name == "total_weight":
    ok = weight_ok(ref)
    buffers = snapshot(BASE.grads)
    if ok and ref == 0:
      ok = False  # non-zero buffers with zero weight: refused
  else:
    # A saved NaN scale is the unusable window (docs/checkpointing.md): it
    # is reattached as it was; every other invalid scale is refused.
    unusable = ref is not None and math.isnan(ref)
    ok = scale_ok(ref) or unusable
  if not ok:
    with pytest.raises(Error, match=rf"'{name}'|non-zero"):
      wa.from_buffers(PARAMS, buffers, counters)
    return
  s = wa.from_buffers(PARAMS, buffers, counters)
  if name in COUNTS:
    assert int(getattr(s, name)) == int(ref)
  elif name == "total_weight":
    assert weight_close(s.total_weight, ref)
  elif math.isnan(ref):
    assert math.isnan(float(s.loss_scale))
  else:
    assert float(s.loss_scale) == float(np.float32(ref))


@pytest.mark.parametrize(
  "counters,needle",
  [
    ({"issued": 1, "weight_hi": 1e39}, "weight_hi"),
    ({"issued": 1, "total_weight": 1e39}, "total_weight"),
    ({"loss_scale": 1e39}, "loss_scale"),
    ({"loss_scale": 1e-46}, "loss_scale"),
    ({"issued": np.int64(2**33)}, "issued"),
    ({"issued": 1, "weight_hi": 3.0, "weight_lo": 1e-40}, "weight_lo"),
  ],
)
def test_from_buffers_refuses_counters_it_would_store_otherwise(
  counters, needle
):
  buffers = jax.tree.map(np.zeros_like, snapshot(PARAMS))
  with pytest.raises(Error, match=needle):
    wa.from_buffers(PARAMS, buffers, counters)


# --------------------------------------------------------- dtype and flags --


@pytest.mark.parametrize(
  "dtype,ok",
  [
    (jnp.float32, True),
    (jnp.bfloat16, True),
    (jnp.float16, True),
    ("float32", True),
    (np.dtype("float16"), True),
    (jnp.float64, False),
    (jnp.int32, False),
    (jnp.bool_, False),
    ("garbage", False),
    (None, True),  # optax's accumulator_dtype=None: the params' dtype
    (object(), False),
    (3, False),
    (jnp.float8_e4m3fn, False),
    (jnp.complex64, False),
  ],
)
def test_work_dtype_accepted_or_named(dtype, ok):
  for build in (
    lambda d: wa.init(PARAMS, dtype=d),
    lambda d: wa.WeightedMultiSteps(
      optax.sgd(1.0), 2, accumulator_dtype=d, mode="mean"
    ),
  ):
    if ok:
      build(dtype)
    else:
      with pytest.raises(Error, match=r"dtype"):
        build(dtype)


@pytest.mark.parametrize("flag", [1, "yes", None, 0.0, jnp.ones(2, bool)])
def test_static_flags_refuse_non_bools(flag):
  with pytest.raises(Error, match=r"checked=..."):
    wa.accumulate_sum(BASE, GRADS, 1.0, checked=flag)
  with pytest.raises(Error, match=r"checked=..."):
    wa.finish_mean(BASE, checked=flag)


@pytest.mark.parametrize(
  "every_k,ok",
  [
    (1, True),
    (np.int64(3), True),
    (2**31 - 1, True),
    (2**31, False),
    (2**40, False),
    (0, False),
    (-1, False),
    (1.5, False),
    (True, False),
    ("2", False),
    (jnp.int32(2), False),
  ],
)
def test_every_k_accepted_or_named(every_k, ok):
  if ok:
    tx = wa.WeightedMultiSteps(optax.sgd(1.0), every_k, mode="mean")
    _, s = tx.update(GRADS, tx.init(PARAMS), PARAMS, weight=1)
    assert bool(wa.has_updated(s)) == (int(every_k) == 1)
  else:
    with pytest.raises(Error, match="every_k"):
      wa.WeightedMultiSteps(optax.sgd(1.0), every_k, mode="mean")


# ----------------------------------------------------------------- wrapper --

TX = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="mean")
TX_STATE = TX.init(PARAMS)
J_TX_UPDATE = jax.jit(lambda g, s, p, w: TX.update(g, s, p, weight=w))


@settings(max_examples=60)
@given(pair=inputs, jit=st.booleans())
def test_wrapper_update_weight_exact_or_refused_or_rejected(pair, jit):
  obj = drawn(pair)
  if obj is _SKIP or (jit and not traceable(obj)):
    return
  ref = reference(obj)
  if not jit and not weight_ok(ref):
    with pytest.raises(Error, match=r"weight"):
      TX.update(GRADS, TX_STATE, PARAMS, weight=obj)
    return
  update = (
    J_TX_UPDATE if jit else (lambda g, s, p, w: TX.update(g, s, p, weight=w))
  )
  _, s = update(GRADS, TX_STATE, PARAMS, obj)
  c = wa.window_counters(s)
  if weight_ok(ref):
    assert weight_close(c["total_weight"], ref)
    assert int(c["rejected"]) == 0
  else:
    assert int(c["rejected"]) == 1 and c["total_weight"] == 0
  # The second microbatch closes the window. Mean grads G weighted by w and
  # 1 average to G whatever w (a rejected microbatch is simply left out), so
  # SGD(1) applies -G unless G * w overflowed float32, when nothing applies.
  upd, s = update(GRADS, s, PARAMS, jnp.float32(1.0))
  applied = not weight_ok(ref) or ref <= 1e30
  assert bool(wa.has_updated(s)) == applied
  for k in G64:
    np.testing.assert_allclose(
      np.asarray(upd[k]), -G64[k] if applied else 0 * G64[k], rtol=1e-5
    )


@settings(max_examples=40)
@given(pair=inputs)
def test_wrapper_constructor_loss_scale_stored_or_refused(pair):
  obj = drawn(pair)
  if obj is _SKIP:
    return
  ref = reference(obj)
  if scale_ok(ref):
    tx = wa.WeightedMultiSteps(optax.sgd(1.0), 2, loss_scale=obj, mode="mean")
    s = tx.init(PARAMS)
    assert float(wa.window_counters(s)["loss_scale"]) == float(np.float32(ref))
  else:
    with pytest.raises(Error, match="loss_scale"):
      wa.WeightedMultiSteps(optax.sgd(1.0), 2, loss_scale=obj, mode="mean")


# ------------------------------------------------------------- distributed --

N = jax.device_count()
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
W_VALUES = [
  0.0,
  1e-45,
  1e-40,
  1e-30,
  0.5,
  1.0,
  3.0,
  2.0**24 + 1,
  1e37,
  math.inf,
  math.nan,
  -1.0,
]


def _dp_step(reduce):
  def step(p, w):
    w = w[0]
    s = wa.init(p, axis_name="data", reduce=reduce)
    loss = lambda p: jnp.sum(p["w"] * GRADS["w"]) + jnp.sum(p["b"] * GRADS["b"])
    g = dist.local_grad(loss, "data")(p)  # = GRADS on every replica
    s = wa.accumulate_sum(s, g, w)
    s = wa.accumulate_sum(s, g, jnp.float32(1.0))
    out, _ = wa.finish_mean(s)
    rej = jax.lax.psum(s.rejected, "data")
    return out.grads, out.weight, out.valid, rej

  return jax.jit(
    jax.shard_map(
      step, mesh=MESH, in_specs=(P(), P("data")), out_specs=(P(), P(), P(), P())
    )
  )


DP = {r: _dp_step(r) for r in ("window", "microbatch")}


@settings(max_examples=25)
@given(
  ws=st.lists(st.sampled_from(W_VALUES), min_size=N, max_size=N),
  reduce=st.sampled_from(["window", "microbatch"]),
)
def test_distributed_weights_exact_or_rejected_everywhere(ws, reduce):
  grads, weight, valid, rejected = DP[reduce](
    PARAMS, jnp.asarray(ws, jnp.float32)
  )
  good = [weight_ok(float(np.float32(w))) for w in ws]
  if reduce == "microbatch" and not all(good):
    kept = [0.0] * N  # any replica's invalid weight rejects it on all
    assert int(rejected) == N
  else:
    kept = [float(np.float32(w)) if ok else 0.0 for w, ok in zip(ws, good)]
    assert int(rejected) == N - sum(good)
  # Each replica added grads for weights > 0, plus the weight-1 microbatch.
  n_sum = sum(1 for w in kept if w > 0) + N
  total = math.fsum(kept) + N
  # The replicas' weight parts are summed in float32 (one rounding each).
  assert float(weight) == pytest.approx(total, rel=N * 2.0**-24)
  assert bool(valid)
  for k in G64:
    np.testing.assert_allclose(
      np.asarray(grads[k]), G64[k] * n_sum / total, rtol=1e-5
    )


@pytest.mark.parametrize("reduce", ["window", "microbatch"])
def test_distributed_global_weight_overflow_is_never_valid(reduce):
  """Each replica's 3e38 fits float32, their sum does not: never valid=True
  with the zero grads a division by inf would give."""
  grads, weight, valid, rejected = DP[reduce](
    PARAMS, jnp.full(N, 3e38, jnp.float32)
  )
  if reduce == "window":
    assert not bool(valid)
  else:
    # The microbatch's global weight is rejected (and counted) everywhere;
    # the following weight-1 microbatch gives the exact mean of its own.
    assert int(rejected) == N and bool(valid) and float(weight) == N
    for k in G64:
      np.testing.assert_allclose(np.asarray(grads[k]), G64[k], rtol=1e-6)


def test_distributed_axis_name_refused_or_named():
  for bad in [3, "", ("data", "data"), []]:

    def f(p, bad=bad):
      return wa.init(p, axis_name=bad).grads

    with pytest.raises(Error, match="axis_name"):
      jax.eval_shape(
        jax.shard_map(f, mesh=MESH, in_specs=P(), out_specs=P()), PARAMS
      )


# ---------------------------------------------------- shardings and device --


def test_init_and_from_buffers_from_sharded_shape_dtype_structs():
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  specs = {"w": P("data", "model"), "b": P("model")}
  abstract = {
    k: jax.ShapeDtypeStruct(
      s, jnp.float32, sharding=NamedSharding(mesh, specs[k])
    )
    for k, s in {"w": (8, 4), "b": (6,)}.items()
  }
  s = wa.init(abstract)
  for k in abstract:
    assert s.grads[k].sharding.is_equivalent_to(
      abstract[k].sharding, 1 + (k == "w")
    )
  buffers = {"w": np.ones((8, 4), np.float32), "b": np.ones(6, np.float32)}
  r = wa.from_buffers(abstract, buffers, {"issued": 1, "total_weight": 2})
  for k in abstract:
    assert r.grads[k].sharding.is_equivalent_to(
      abstract[k].sharding, buffers[k].ndim
    )
  assert r.total_weight == 2


# -------------------------------------------------------------- checkpoint --


def _save(tree):
  path = tempfile.mkdtemp() + "/accum"
  with ocp.Checkpointer(AccumCheckpointHandler()) as ck:
    ck.save(path, args=AccumSave(tree))
  return path


def _restore(path, template):
  with ocp.Checkpointer(AccumCheckpointHandler()) as ck:
    return ck.restore(path, args=AccumRestore(template))


def test_checkpoint_slash_keys_do_not_collide():
  s1 = wa.accumulate_sum(wa.init(PARAMS), GRADS, 2)
  s2 = wa.accumulate_sum(wa.init(PARAMS, dtype=jnp.bfloat16), GRADS, 5)
  tree = {"a/b": s1, "a": {"b": s2}}
  out = _restore(_save(tree), tree)
  assert out["a/b"].total_weight == 2 and out["a"]["b"].total_weight == 5
  assert out["a"]["b"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
  "bad", ["garbage", 7, "int32", "float64", "float8_e4m3fn"]
)
def test_checkpoint_corrupt_dtype_option_is_named(bad):
  path = _save(BASE)
  meta_file = next(
    p
    for p in __import__("pathlib").Path(path).iterdir()
    if p.name == "_METADATA"
  )
  meta = json.loads(meta_file.read_text())
  meta["custom_metadata"]["weighted_accum"]["states"][""]["dtype"] = bad
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(Error, match="option '(dtype|states)'"):
    _restore(path, BASE)


def test_checkpoint_nnx_optimizer_opt_state_round_trip():
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  tx = wa.WeightedMultiSteps(optax.adam(1e-3), 2, mode="mean")
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.state(model, nnx.Param)
  grads = jax.tree.map(jnp.ones_like, grads)
  opt.update(model, grads, weight=3)
  path = _save(opt.opt_state)
  other = nnx.Optimizer(nnx.Linear(2, 3, rngs=nnx.Rngs(1)), tx, wrt=nnx.Param)
  restored = _restore(path, other.opt_state)
  assert type(restored) is type(other.opt_state)
  c = wa.window_counters(restored)
  assert int(c["issued"]) == 1 and c["total_weight"] == 3.0
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(opt.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------- float64 --


def test_float64_work_dtype_keeps_float64_weights():
  """With x64 and a float64 work dtype the tally, the loss scale and the
  weight multiplying a mean's grads are float64: fractional float64 weights
  give the float64 NumPy result, not one rounded through float32."""
  with jax.enable_x64(True):
    params = {"w": jnp.zeros(3, jnp.float64)}
    weights = [0.1, 0.2, 1.0 / 3.0, 7.0]
    grads = [np.array([1.0, -2.0, 3.0]) * (i + 1) / 3.0 for i in range(4)]
    for jit in (False, True):
      acc = J_MEAN if jit else wa.accumulate_mean
      s = wa.init(params, dtype=jnp.float64, loss_scale=0.1)
      assert s.weight_hi.dtype == jnp.float64
      assert s.loss_scale.dtype == jnp.float64
      for g, w in zip(grads, weights):
        s = acc(s, {"w": jnp.asarray(g * 0.1)}, jnp.float64(w) if jit else w)
      assert abs(s.total_weight - math.fsum(weights)) <= 1e-16
      out, _ = (J_FINISH_MEAN if jit else wa.finish_mean)(s)
      ref = (
        sum(g * 0.1 * w for g, w in zip(grads, weights))
        / 0.1
        / (math.fsum(weights))
      )
      assert out.grads["w"].dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(out.grads["w"]), ref, rtol=1e-14)
      assert bool(out.valid)


def test_docs_inputs_example_runs(capsys):
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  page = (pathlib.Path(__file__).parents[2] / "docs" / "inputs.md").read_text()
  code = re.search(r"```python\n(.*?)```", page, re.DOTALL).group(1)
  exec(compile(code, "docs/inputs.md", "exec"), {})  # pylint: disable=exec-used
  assert capsys.readouterr().out.splitlines() == [
    "refused: accumulate_sum(weight)",
    "1 True",
  ]


@pytest.mark.parametrize(
  "finish,ok",
  [
    (None, True),
    (True, True),
    (np.bool_(True), True),
    (jnp.array(True), True),
    ("yes", False),
    (1, False),
    (np.ones(2, bool), False),
    (0.0, False),
  ],
)
def test_wrapper_finish_flag_accepted_or_named(finish, ok):
  if ok:
    _, s = TX.update(GRADS, TX_STATE, PARAMS, weight=1, finish=finish)
    assert bool(wa.has_updated(s)) == (finish is not None)
  else:
    with pytest.raises(Error, match=r"finish=..."):
      TX.update(GRADS, TX_STATE, PARAMS, weight=1, finish=finish)


@pytest.mark.parametrize(
  "field,value,needle",
  [
    ("loss_scale", 0.0, "loss_scale"),
    ("loss_scale", -2.0, "loss_scale"),
    ("loss_scale", 1e-40, "loss_scale"),
    ("loss_scale", np.inf, "loss_scale"),
    ("issued", -1, "issued"),
    ("rejected", 7, "<= 'issued'"),
    ("weight_hi", -3.0, "total_weight"),
    ("weight_hi", np.inf, "total_weight"),
    ("weight_lo", 1e-40, "weight_lo"),
  ],
)
def test_checkpoint_restore_refuses_corrupt_counters_by_name(
  field, value, needle, monkeypatch
):
  """A saved counter that could not have been stored by the library (as the
  restore would store it) is refused, naming it, by AccumSave (which checks
  what the restore checks) and, written anyway (a corrupt or foreign
  checkpoint), by the restore; the template is untouched."""
  dtype = np.int32 if field in COUNTS else np.float32
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bad = BASE.replace(**{field: jnp.asarray(np.asarray(value).astype(dtype))})
  with pytest.raises(Error, match=needle):
    _save(bad)
  with monkeypatch.context() as m:
    m.setattr(checkpoint_impl, "_check_restorable", lambda *_: None)
    path = _save(bad)
  with pytest.raises(Error, match=needle):
    _restore(path, BASE)
  assert_same(BASE, BASE_SNAP)


@pytest.mark.parametrize("reduce", ["window", "microbatch"])
@pytest.mark.parametrize(
  "scale,ok", [(4.0, True), (1e39, False), (1e-46, False), (-1.0, False)]
)
def test_distributed_next_loss_scale_named_or_stored(reduce, scale, ok):
  def step(p, x):
    s = wa.init(p, axis_name="data", reduce=reduce)
    s = wa.accumulate_sum(s, GRADS, x[0])
    _, s = wa.finish_mean(s, next_loss_scale=scale)
    return s.loss_scale

  f = jax.shard_map(step, mesh=MESH, in_specs=(P(), P("data")), out_specs=P())
  if ok:
    assert float(jax.jit(f)(PARAMS, jnp.ones(N))) == scale
  else:
    with pytest.raises(
      Error,
      match=r"finish_mean\("
      r"next_loss_scale=...\)",
    ):
      jax.eval_shape(f, PARAMS, jnp.ones(N))
