"""Conformance: a weight is used or refused, never ignored; a rejected
microbatch is counted where the caller can read it.

* ``wa.TrainState.apply_gradients(weight=...)`` with a ``tx`` that is not a
  weighted accumulator (``optax.MultiSteps``, a plain optimizer) raises a
  ``WeightedAccumulationError`` naming ``weight``; with one it is exact.
* ``wa.optax_accumulator`` gives the exact weighted mean under
  ``optax.microbatching.micro_vmap``, ``micro_grad`` and ``microbatch``, with
  and without ``microbatch_size`` (optax calls only ``aggregate`` without
  one), and adds nothing for a zero-weight example (a padded NaN example).
* A microbatch rejected for a negative or NaN traced weight leaves a trace:
  the caller can tell it from a zero-weight microbatch after the window
  closes (the wrapper), in the result (``optax_accumulator``,
  ``microbatched_value_and_grad``), or in the state (``.accumulate``).

References: the full batch's weighted mean gradient in float64 NumPy, and
optax's own ported ``test_micro_grad_basic`` (expected ``-1.5``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import microbatching
import pytest

from _conformance import Error
from _conformance import assert_close
from _conformance import host_grads
from _conformance import host_params
import weighted_accum as wa

G = host_grads()

# ------------------------------------------------ TrainState: weight used --


@pytest.mark.parametrize(
  "tx",
  [
    lambda: optax.MultiSteps(optax.sgd(1.0), 2),
    lambda: optax.sgd(1.0),
    lambda: optax.chain(optax.clip(1.0), optax.sgd(1.0)),
  ],
  ids=["optax.MultiSteps", "optax.sgd", "optax.chain"],
)
def test_train_state_weight_with_an_unweighted_tx_is_refused(tx):
  ts = wa.TrainState.create(apply_fn=None, params=host_params(), tx=tx())
  with pytest.raises(Error, match="weight"):
    ts.apply_gradients(grads=G, weight=3)


def test_train_state_weight_with_the_wrapper_is_exact():
  """Two windows of mean grads G (weight 3) and 5 G (weight 1): each
  window's mean is 2 G, applied by SGD(1)."""
  tx = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="mean")
  ts = wa.TrainState.create(apply_fn=None, params=host_params(), tx=tx)
  step = jax.jit(lambda ts, g, w: ts.apply_gradients(grads=g, weight=w))
  for _ in range(2):
    ts = step(ts, G, 3.0)
    ts = step(ts, {k: 5 * v for k, v in G.items()}, 1.0)
  hp = host_params()
  assert_close(ts.params, {k: hp[k] - 4.0 * G[k] for k in G}, 1e-6)


# --------------------------------------------------- optax_accumulator --

B = 8


def _data(padded_nan: bool = True):
  rng = np.random.default_rng(0)
  x = rng.integers(-2, 3, size=(B, 8)).astype(np.float32) / 2
  y = rng.integers(-2, 3, size=B).astype(np.float32)
  m = np.array([1.0, 2.0, 0.0, 0.5, 3.0, 1.0, 0.0, 1.5], np.float32)
  if padded_nan:
    x[2] = np.nan  # a padded example (weight 0) holding NaN
  return x, y, m


def _row_loss(p, x, y, m, mode):
  """One example's (loss, weight): ``m * l`` for "sum", ``m * l / m`` (0/0
  when padded) for "mean"."""
  l = (x @ p["b"] + jnp.sum(x @ p["w"], axis=-1) - y) ** 2
  s = jnp.sum(m * l)
  return (s if mode == "sum" else s / jnp.sum(m)), jnp.sum(m)


def _reference(x, y, m):
  keep = m > 0
  x, y, m = (np.asarray(a[keep], np.float64) for a in (x, y, m))
  p = {k: np.asarray(v, np.float64) for k, v in host_params().items()}
  r = x @ (p["b"] + p["w"].sum(axis=1)) - y
  gb = 2.0 * (m * r) @ x / m.sum()
  loss = float(np.sum(m * r**2) / m.sum())
  return loss, float(m.sum()), {"b": gb, "w": np.repeat(gb[:, None], 4, 1)}


def _check(result, x, y, m):
  (loss, weight), grads = result
  ref_loss, ref_weight, ref_grads = _reference(x, y, m)
  assert float(weight) == ref_weight
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  assert_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


SIZES = [None, 2, 4]
_MICRO = {}


def _micro(how, mode, size):
  """One jitted function per (optax entry point, mode, microbatch size)."""
  key = (how, mode, size)
  if key not in _MICRO:
    vg = jax.value_and_grad(
      lambda p, x, y, m: _row_loss(p, x, y, m, mode), has_aux=True
    )
    acc = wa.optax_accumulator(mode=mode)
    if how == "micro_vmap":
      f = microbatching.micro_vmap(
        vg, in_axes=(None, 0, 0, 0), microbatch_size=size, accumulator=acc
      )
    else:
      f = microbatching.microbatch(
        vg, argnums=(1, 2, 3), microbatch_size=size, accumulator=acc
      )
    _MICRO[key] = jax.jit(f)
  return _MICRO[key]


@pytest.mark.parametrize("padded", ["clean", "nan"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_optax_accumulator_micro_vmap(mode, size, padded):
  """Per-example ``((loss, weight), grads)`` over the batch axis; example 2
  has weight 0 (and, "nan", NaN inputs: it must add nothing)."""
  x, y, m = _data(padded == "nan")
  _check(_micro("micro_vmap", mode, size)(host_params(), x, y, m), x, y, m)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_optax_accumulator_microbatch(mode, size):
  """Microbatches of ``size`` examples: ``((loss, weight), grads)`` each."""
  # optax splits column-major: with size 2, microbatch 2 holds rows 2 and
  # 6, both padded (0/0 in "mean" mode, NaN inputs): it adds nothing. With
  # size 4 the padded rows share microbatches with real ones, where a NaN
  # input would make the caller's own loss NaN: no NaN then.
  x, y, m = _data(padded_nan=size == 2)
  _check(_micro("microbatch", mode, size)(host_params(), x, y, m), x, y, m)


@pytest.mark.parametrize("keep_batch_dim", [True, False])
@pytest.mark.parametrize("size", [None, 2])
def test_optax_accumulator_micro_grad_basic_ported(size, keep_batch_dim):
  """optax's ``test_micro_grad_basic``: per-example gradients of
  ``0.5 * mean((x p - t)**2)`` at ``p = 0`` are ``-t``; each example has
  weight 1, so the weighted mean is ``-(0 + 1 + 2 + 3) / 4 = -1.5``."""

  def mean_squared_loss(params, features, targets):
    assert features.ndim == int(keep_batch_dim) + 1
    diff = features @ params - targets
    return 0.5 * jnp.mean(diff**2)

  grad_fn = microbatching.micro_grad(
    mean_squared_loss,
    argnums=0,
    batch_argnums=(1, 2),
    keep_batch_dim=keep_batch_dim,
    microbatch_size=size,
    transform_fn=lambda g: ((jnp.float32(0.0), jnp.float32(1.0)), g),
    accumulator=wa.optax_accumulator(mode="sum"),
  )
  params = jnp.zeros(1)
  features = jnp.ones((4, 1))
  targets = jnp.array([0, 1, 2, 3], dtype=jnp.float32)
  ((_, weight), grads), _ = grad_fn(params, features, targets)
  assert float(weight) == 4.0
  np.testing.assert_allclose(np.asarray(grads), [-1.5], rtol=1e-6)


# ------------------------------------------- a rejected microbatch counted --


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _differs(a, b) -> bool:
  la, lb = _leaves(a), _leaves(b)
  if len(la) != len(lb):
    return True
  return any(
    x.shape != y.shape or not np.array_equal(x, y, equal_nan=True)
    for x, y in zip(la, lb)
  )


_TX = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="sum")
_J_UPD = jax.jit(lambda g, s, p, w: _TX.update(g, s, p, weight=w))


@pytest.mark.parametrize("bad", [-1.0, np.nan], ids=["negative", "nan"])
def test_wrapper_rejected_microbatch_is_readable_after_the_close(bad):
  """Two windows; the first window's second microbatch has a traced bad
  weight (rejected) or weight 0. After the first close, and again after
  the second, the caller can tell the two runs apart from the state."""

  def run(w):
    p = host_params()
    s = _TX.init(p)
    states = []
    for weight in (2.0, w, 2.0, 1.0):
      _, s = _J_UPD(G, s, p, jnp.float32(weight))
      states.append(s)
    return states[1], states[3]

  closed_bad, later_bad = run(bad)
  closed_zero, later_zero = run(0.0)
  assert bool(wa.has_updated(closed_bad))
  assert _differs(closed_bad, closed_zero), "no trace after the close"
  assert _differs(later_bad, later_zero), "no trace after the next window"


def _acc_run(weights):
  """``optax.microbatching.microbatch`` of 4 microbatches of 2 examples,
  the weight of microbatch k given by ``weights[k]`` (traced)."""
  vg = jax.value_and_grad(
    lambda p, x, y, w: (jnp.sum((x @ p["b"] - y) ** 2), w[0]), has_aux=True
  )
  f = microbatching.microbatch(
    vg,
    argnums=(1, 2, 3),
    microbatch_size=2,
    accumulator=wa.optax_accumulator(mode="sum"),
  )
  x, y, _ = _data()
  x = np.nan_to_num(x)
  # optax splits column-major: microbatch k holds rows k and k + 4.
  w = np.tile(np.asarray(weights, np.float32), 2)
  return jax.jit(f)(host_params(), x, y, jnp.asarray(w))


@pytest.mark.parametrize("bad", [-1.0, np.nan], ids=["negative", "nan"])
def test_optax_accumulator_rejected_microbatch_is_readable(bad):
  got = _acc_run([1.0, bad, 2.0, 1.0])
  zero = _acc_run([1.0, 0.0, 2.0, 1.0])
  assert _differs(got, zero), f"rejected {bad} reads as weight 0: {got}"


def _mvg_loss(p, batch):
  x, y, w = batch
  return jnp.sum((x @ p["b"] - y) ** 2), w[0]


_MVG = wa.microbatched_value_and_grad(_mvg_loss, 4, mode="sum")
_J_MVG = jax.jit(_MVG)
_J_MVG_ACC = jax.jit(_MVG.accumulate)


def _mvg_batch(w1):
  x, y, _ = _data()
  w = np.array([1.0, w1, 2.0, 1.0] * 2, np.float32)  # microbatch k: rows k::4
  return np.nan_to_num(x), y, w


@pytest.mark.parametrize("bad", [-1.0, np.nan], ids=["negative", "nan"])
def test_microbatched_rejected_microbatch_is_reported(bad):
  _, out = _J_MVG(host_params(), _mvg_batch(bad))
  assert not bool(out.valid)
  _, new = _J_MVG_ACC(wa.init(host_params()), host_params(), _mvg_batch(bad))
  assert int(new.rejected) == 1 and new.total_weight == 4.0


@pytest.mark.parametrize("size", [None, 2])
def test_optax_accumulator_folds_examples_through_the_weight_rules(size):
  """micro_vmap's per-example fold validates each weight as accumulate
  does: weights 2**24 and 1 are tallied exactly (the gradient is
  2 / (2**24 + 1), float64 reference), and a subnormal weight, which the
  float32 tally would flush to 0, is refused (NaN loss and grads, the
  weight -1: one rejected), not silently dropped."""
  vg = jax.value_and_grad(
    lambda w, x, m: (jnp.sum(m * (x * w) ** 2), jnp.sum(m)), has_aux=True
  )
  f = jax.jit(
    microbatching.micro_vmap(
      vg,
      in_axes=(None, 0, 0),
      microbatch_size=size,
      accumulator=wa.optax_accumulator("sum"),
    )
  )
  x = jnp.arange(4.0)
  (_, weight), g = f(1.0, x, jnp.asarray([2.0**24, 1.0, 0.0, 0.0]))
  assert float(weight) == float(np.float32(2.0**24 + 1))
  np.testing.assert_allclose(float(g), 2.0 / (2.0**24 + 1), rtol=1e-6)
  (loss, weight), g = f(1.0, x, jnp.asarray([1e-45, 1.0, 1.0, 1.0]))
  assert np.isnan(float(g)) and np.isnan(float(loss)) and float(weight) == -1
