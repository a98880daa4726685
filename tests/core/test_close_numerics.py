"""Closing a window at float32's edges: one validity decision for every
close, the two divisions in order, what is stored and what is converted.

References are independent of the code under test: float64 NumPy for the
mean, optax's own SGD step, and bit patterns computed with NumPy/ml_dtypes.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import weighted_accum as wa

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
TINY = 2.0**-126  # float32's smallest normal number


def _window(sums, weight, loss_scale=1.0, dtype=F32):
  """A window holding ``sums`` of total ``weight`` (one accumulate_sum)."""
  state = wa.init({"w": jnp.zeros(2)}, dtype=dtype, loss_scale=loss_scale)
  return wa.accumulate_sum(state, {"w": jnp.asarray(sums, dtype)}, weight)


def _closes(sums, weight, dtype):
  """(name, valid, applied mean or None) for every close of one window."""
  params = {"w": jnp.zeros(2)}
  sgd = optax.sgd(1.0)
  state = _window(sums, weight, dtype=dtype)
  got = []
  for name, fn in (
    ("finish_mean", wa.finish_mean),
    ("jit", jax.jit(wa.finish_mean)),
  ):
    out, _ = fn(state)
    got.append((name, bool(out.valid), np.asarray(out.grads["w"], np.float64)))
  new, _, _, out = wa.apply_window(sgd, state, params, sgd.init(params))
  got.append(
    ("apply_window", bool(out.valid), -np.asarray(new["w"], np.float64))
  )
  tx = wa.WeightedMultiSteps(sgd, 1, accumulator_dtype=dtype, mode="sum")
  grads = {"w": jnp.asarray(sums, dtype)}
  upd, st = jax.jit(tx.update)(grads, tx.init(params), params, weight=weight)
  got.append(("wrapper", bool(st.updated), -np.asarray(upd["w"], np.float64)))

  def loss_fn(w, batch):
    return jnp.sum(w * batch), jnp.float32(weight)

  f = wa.microbatched_value_and_grad(loss_fn, 1, mode="sum", dtype=dtype)
  _, o = jax.jit(f)(jnp.zeros(2), jnp.asarray(sums, F32)[None])
  got.append(("in_step", bool(o.valid), np.asarray(o.grads, np.float64)))
  return got


@pytest.mark.parametrize(
  "sums,weight,dtype,fits",
  [
    ([1.0, 0.0], TINY, F32, True),  # mean 2**126
    ([4.0, 0.0], TINY, F32, False),  # mean 2**128: beyond float32
    ([1.0, -3.0], 2.0**-10, F16, True),  # mean 3072
    ([1.0, 0.0], 2.0**-16, F16, False),  # mean 65536: beyond float16
  ],
)
def test_every_close_decides_validity_alike(sums, weight, dtype, fits):
  """finish_mean, apply_window, the optax wrapper and the in-step loop read
  one validity decision: a mean beyond the work dtype is invalid for all of
  them and applied by none; a mean that fits is applied by all, equal to
  float64 NumPy's."""
  ref = np.asarray(sums, np.float64) / np.float64(np.float32(weight))
  for name, valid, mean in _closes(sums, weight, dtype):
    assert valid == fits, name
    if fits:
      np.testing.assert_allclose(
        mean, ref, rtol=2e-3 if dtype == F16 else 3e-7, err_msg=name
      )
    elif name in ("apply_window", "wrapper"):
      assert np.all(mean == 0), name  # nothing applied


def _ulps(got, ref):
  """Distance in float32 ulps of ``ref`` (a float64 array)."""
  ref32 = ref.astype(np.float32)
  return np.abs(got.astype(np.float64) - ref) / np.spacing(np.abs(ref32))


EDGES = [
  # (sum, loss scale, weight): each division stays within float32 while
  # the product of the divisors does not (or its reciprocal is subnormal).
  (1.0, TINY, 0.5),  # scale * weight = 2**-127
  (2.0**100, 2.0**100, 1e10),  # scale * weight > float32's max
  (2.0**127, 2.0**127, 1.0),  # 1 / scale is subnormal
  (3.0 * 2.0**120, 2.0**127, 3.0),
  (3.0, 1.0, 2.0**127),  # 1 / weight is subnormal
  (2.0**127, 2.0**63, 2.0**63),
  (7.0, 3.0, 3.0),
  # a loss scale below 1: dividing by it first overflows, the mean fits
  (3e38, 0.5, 4.0),
  (2.0**127, 2.0**-10, 2.0**20),
]


@pytest.mark.parametrize("x,scale,weight", EDGES)
def test_mean_divides_by_the_larger_divisor_first(x, scale, weight):
  """(sums / loss_scale) / weight as float64 NumPy computes it (within two
  float32 roundings), where one division by loss_scale * weight, or the
  division by a loss scale below 1 first, overflows or underflows float32;
  reported valid. apply_window applies the same
  mean, bit for bit."""
  sums = np.array([x, -x, 0.0], np.float32)
  state = wa.init({"w": jnp.zeros(3)}, loss_scale=scale)
  state = wa.accumulate_sum(state, {"w": jnp.asarray(sums)}, weight)
  ref = (sums.astype(np.float64) / np.float64(np.float32(scale))) / np.float64(
    np.float32(weight)
  )
  out, _ = wa.finish_mean(state)
  got = np.asarray(out.grads["w"])
  assert bool(out.valid) and bool(out.finite)
  assert np.all(_ulps(got[:2], ref[:2]) <= 2), (got, ref)
  assert got[2] == 0
  params = {"w": jnp.zeros(3)}
  sgd = optax.sgd(1.0)
  new, _, _, applied = wa.apply_window(sgd, state, params, sgd.init(params))
  assert bool(applied.valid)
  np.testing.assert_array_equal(-np.asarray(new["w"]), got)


@pytest.mark.parametrize("bad", [1e-40, 0.0, -1.0, np.inf, np.nan])
def test_traced_invalid_loss_scale_is_never_stored(bad):
  """Eagerly refused; under jit the scale is not stored: the window is
  marked unusable (NaN), its microbatches are rejected and counted, its
  close reports valid=False, and a close with a valid next scale starts a
  usable window again (docs/inputs.md)."""
  state = wa.init({"w": jnp.zeros(2)})
  with pytest.raises(wa.WeightedAccumulationError, match="set_loss_scale"):
    wa.set_loss_scale(state, bad)
  new = jax.jit(wa.set_loss_scale)(state, jnp.float32(bad))
  assert np.isnan(np.asarray(new.loss_scale))
  new = jax.jit(wa.accumulate_sum)(new, {"w": jnp.ones(2)}, 2.0)
  assert int(new.rejected) == 1 and new.total_weight == 0
  out, nxt = jax.jit(wa.finish_sums)(new, next_loss_scale=jnp.float32(4.0))
  assert not bool(out.valid)
  assert float(nxt.loss_scale) == 4.0


@pytest.mark.parametrize("bad", [np.nan, 0.0, np.inf, 1e-40, -1.0])
def test_a_window_with_an_unusable_scale_closes_to_zeros(bad):
  """A window holding sums whose loss scale is unusable (NaN, 0, Inf,
  subnormal, negative) closes to zero grads, valid=False, eagerly and under
  jit, and apply_window leaves the params as they were."""
  state = _window([3.0, -3.0], 2.0).replace(loss_scale=jnp.float32(bad))
  for finish in (wa.finish_mean, jax.jit(wa.finish_mean)):
    out, _ = finish(state)
    assert not bool(out.valid)
    np.testing.assert_array_equal(np.asarray(out.grads["w"]), [0.0, 0.0])
  params = {"w": jnp.ones(2)}
  sgd = optax.sgd(1.0)
  new, _, _, out = wa.apply_window(sgd, state, params, sgd.init(params))
  assert not bool(out.valid)
  np.testing.assert_array_equal(np.asarray(new["w"]), [1.0, 1.0])


def _bf16_bits(x):
  return np.asarray(x).view(np.uint16)


def test_accumulate_mean_converts_before_it_weights():
  """accumulate_mean converts the gradient to the work dtype FIRST, then
  multiplies by the weight in at least float32, then rounds to the work
  dtype once. Both orders are computed with NumPy and differ in their bits
  here, so the test fails if the multiplication moves before the
  conversion."""
  w = 3.0
  # bfloat16 grads into a float32 window: the product is exact in float32,
  # rounded if taken in bfloat16 first.
  g = np.array([1.0 + 2.0**-7, -(1.0 + 3 * 2.0**-7)], ml_dtypes.bfloat16)
  right = g.astype(np.float32) * np.float32(w)
  wrong = (g * ml_dtypes.bfloat16(w)).astype(np.float32)
  assert not np.array_equal(right, wrong)
  state = wa.accumulate_mean(
    wa.init({"w": jnp.zeros(2)}), {"w": jnp.asarray(g)}, w
  )
  np.testing.assert_array_equal(
    np.asarray(state.grads["w"]).view(np.uint32), right.view(np.uint32)
  )
  # float32 grads into a bfloat16 window: converted first, then weighted.
  g = np.array([1.0 + 3 * 2.0**-9, 2.0 + 3 * 2.0**-8], np.float32)
  right = (
    g.astype(ml_dtypes.bfloat16).astype(np.float32) * np.float32(w)
  ).astype(ml_dtypes.bfloat16)
  wrong = (g * np.float32(w)).astype(ml_dtypes.bfloat16)
  assert not np.array_equal(_bf16_bits(right), _bf16_bits(wrong))
  state = wa.init({"w": jnp.zeros(2)}, dtype=BF16)
  state = jax.jit(wa.accumulate_mean)(state, {"w": jnp.asarray(g)}, w)
  assert _bf16_bits(state.grads["w"]).tolist() == _bf16_bits(right).tolist()


def _masked_loss(w, batch):
  """A loss SUM and its weight (the mask's count); NaN for a fully masked
  microbatch (as 0 * log 0 gives)."""
  x, mask = batch
  s = jnp.sum(jnp.where(mask, (x * w) ** 2, 0.0))
  n = mask.sum()
  return jnp.where(n > 0, s, jnp.nan), n


@pytest.mark.parametrize("normalizers", [None, 5.0], ids=["by_weight", "known"])
def test_in_step_sum_mode_ignores_a_fully_masked_microbatch(normalizers):
  """mode="sum": a microbatch of weight 0 adds nothing to the reported loss,
  not even its NaN loss sum, with the total weight as normaliser and with a
  known one (normalizers=); the window stays valid, the loss and gradient
  are the full batch's (float64 NumPy)."""
  x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  mask = np.array([[1, 1], [0, 0], [1, 0], [1, 1]], bool)  # row 1: masked
  w = np.float32(1.5)
  f = wa.microbatched_value_and_grad(_masked_loss, 4, mode="sum")
  kw = {} if normalizers is None else {"normalizers": normalizers}
  loss, out = jax.jit(lambda w, b: f(w, b, **kw))(w, (x, mask))
  norm = mask.sum() if normalizers is None else normalizers
  xs = x.astype(np.float64)[mask]
  ref_loss = np.sum((xs * np.float64(w)) ** 2) / norm
  ref_grad = np.sum(2 * xs**2 * np.float64(w)) / norm
  assert bool(out.valid) and bool(out.finite)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
  np.testing.assert_allclose(float(out.grads), ref_grad, rtol=1e-6)


def test_a_result_is_applied_as_what_it_is():
  """finish_sums' still-scaled sums are refused by apply_window (eagerly
  and under jit), and finish_mean's mean by reduce_sums, each naming what
  to pass; finish_mean's mean is applied as the float64 mean."""
  from jax.sharding import PartitionSpec as P

  from weighted_accum import distributed

  params = {"w": jnp.zeros(2)}
  sgd = optax.sgd(1.0)
  state = _window([8.0, -16.0], 2.0, loss_scale=4.0)
  sums, _ = wa.finish_sums(state)
  assert sums.kind == "sums"
  step = lambda o: wa.apply_window(sgd, o, params, sgd.init(params))
  for fn in (step, jax.jit(step)):
    with pytest.raises(wa.WeightedAccumulationError, match="finish_sums"):
      fn(sums)
  mean, _ = wa.finish_mean(state)
  new, _, _, _ = step(mean)
  np.testing.assert_array_equal(np.asarray(new["w"]), [-1.0, 2.0])
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  reduce = jax.shard_map(
    lambda o: distributed.reduce_sums(o, "data").grads,
    mesh=mesh,
    in_specs=P(),
    out_specs=P(),
  )
  np.testing.assert_array_equal(np.asarray(reduce(sums)["w"]), [1.0, -2.0])
  with pytest.raises(wa.WeightedAccumulationError, match="finish_sums"):
    reduce(mean)


def test_a_hand_built_result_says_what_it_is():
  """A hand-built AccumulatedGradients has no default kind: without one
  (or with another word) it is refused; as sums it is refused by
  apply_window, as a mean applied as given (optax's own SGD step)."""
  params = {"w": jnp.zeros(2)}
  fields = dict(
    grads={"w": jnp.asarray([8.0, -16.0])},
    weight=jnp.float32(8.0),
    loss_scale=jnp.float32(1.0),
    issued=jnp.int32(1),
    finite=jnp.bool_(True),
    valid=jnp.bool_(True),
  )
  for kind in ({}, {"kind": "Mean"}, {"kind": None}):
    with pytest.raises(wa.WeightedAccumulationError, match="kind='mean'"):
      wa.AccumulatedGradients(**fields, **kind)
  sgd = optax.sgd(1.0)
  step = lambda o: wa.apply_window(sgd, o, params, sgd.init(params))
  with pytest.raises(wa.WeightedAccumulationError, match="finish_sums"):
    step(wa.AccumulatedGradients(**fields, kind="sums"))
  new, _, _, _ = step(wa.AccumulatedGradients(**fields, kind="mean"))
  want, _ = sgd.update(fields["grads"], sgd.init(params), params)
  np.testing.assert_array_equal(
    new["w"], optax.apply_updates(params, want)["w"]
  )


# ----------------------------------------- the mean rounded once, exactly --


def _normal_or_zero(dtype, sign=True):
  """Values of ``dtype`` built from their bit fields: 0 or a normal number
  of any binade (the edges included), any mantissa."""
  fi = ml_dtypes.finfo(np.dtype(dtype))
  top = (1 << fi.nexp) - 2  # the largest normal exponent field

  def build(fields):
    s, e, m = fields
    bits = (s << (fi.nexp + fi.nmant)) | (e << fi.nmant) | m
    uint = np.uint32 if fi.bits == 32 else np.uint16
    return np.asarray(bits, uint).view(np.dtype(dtype))

  exponent = st.one_of(
    st.sampled_from([0, 1, 2, top - 1, top]), st.integers(1, top)
  )
  mantissa = st.integers(0, (1 << fi.nmant) - 1)
  fields = st.tuples(st.integers(0, int(sign)), exponent, mantissa)
  return fields.map(lambda f: build(f if f[1] else (f[0], 0, 0)))


@st.composite
def _divisors_one_a_power_of_two(draw):
  """A usable loss scale and a weight, float32 normal, one a power of two
  (the other too, sometimes: their product is then a power of two)."""
  power = 2.0 ** draw(st.integers(-126, 127))
  other = 2.0 ** draw(st.integers(-126, 127))
  if draw(st.booleans()):
    other = float(draw(_normal_or_zero(F32, sign=False).filter(bool)))
  return (power, other) if draw(st.booleans()) else (other, power)


def _steps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """How many representable values apart ``a`` and ``b`` (same sign) are."""
  ints = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
  return np.abs(a.view(ints).astype(np.int64) - b.view(ints).astype(np.int64))


@given(
  dtype=st.sampled_from([F32, F16, BF16]),
  divisors=_divisors_one_a_power_of_two(),
  data=st.data(),
)
def test_the_mean_is_never_flushed_where_it_is_normal(dtype, divisors, data):
  """Where the loss scale or the weight is a power of two (scale 1, a
  DynamicLossScale from a power of two with its default factors), their
  product is exact by exponent arithmetic, so wherever the float64
  quotient ``sums / (scale * weight)`` rounded to the work dtype is a
  normal number (or 0), however far the divisors lie from 1, the mean is
  that number, or its neighbour (a reciprocal multiplied: no division per
  element, which would cost a parameter-sized temporary in apply_window),
  and exactly that number when the product is a power of two; eagerly,
  under jit and through apply_window."""
  scale, weight = divisors
  sums = data.draw(st.lists(_normal_or_zero(dtype), min_size=4, max_size=4))
  sums = np.asarray(sums, np.dtype(dtype))
  q = np.asarray(sums, np.float64) / (scale * weight)  # the product is exact
  with np.errstate(over="ignore"):
    want = q.astype(np.dtype(dtype))
  fi = ml_dtypes.finfo(np.dtype(dtype))
  keep = (want == 0) & (q == 0) | (np.abs(want) >= fi.tiny) & np.isfinite(want)
  power = np.frexp(scale * weight)[0] == 0.5
  state = wa.init({"w": jnp.zeros(4, dtype)}, dtype=dtype, loss_scale=scale)
  state = wa.accumulate_sum(state, {"w": jnp.asarray(sums)}, weight)
  params = {"w": jnp.zeros(4, dtype)}
  sgd = optax.sgd(1.0)
  step = jax.jit(lambda s: wa.apply_window(sgd, s, params, sgd.init(params)))
  got = [wa.finish_mean(state)[0], jax.jit(wa.finish_mean)(state)[0]]
  means = [np.asarray(out.grads["w"]) for out in got]
  if keep.all():  # valid: applied (an invalid window is not)
    assert all(bool(out.valid) for out in got)
    means.append(-np.asarray(step(state)[0]["w"]))
  nonzero = keep & (want != 0)
  for g in means:
    assert (g[keep] == 0).tolist() == (want[keep] == 0).tolist(), g
    assert (_steps(g[nonzero], want[nonzero]) <= (0 if power else 1)).all(), g


def test_a_mean_that_fits_is_not_flushed_by_the_divisors():
  """Loss scale 2**20, weight 2**-20: the divisors' product is 1 and the
  mean of sums [2**-110, 1] is [2**-110, 1] (dividing by 2**20 first went
  through 2**-130, below float32's normal range, and gave 0)."""
  state = wa.init({"w": jnp.zeros(2)}, loss_scale=2.0**20)
  state = wa.accumulate_sum(
    state, {"w": jnp.asarray([2.0**-110, 1.0])}, 2.0**-20
  )
  for fn in (wa.finish_mean, jax.jit(wa.finish_mean)):
    out, _ = fn(state)
    np.testing.assert_array_equal(np.asarray(out.grads["w"]), [2.0**-110, 1.0])
    assert bool(out.valid)
