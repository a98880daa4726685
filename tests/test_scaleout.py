"""Scaling out: one gradient reduction per step whatever K, in every sharding
style, and exact cross-replica weights.

Collective bytes come from the compiled HLO (``benchmarks/hlo.py``, an op in a
loop counted once per trip) and are compared with bytes written from the
shapes (``hlo.tree_bytes`` of the gradient tree plus scalars), never read back
from the library. Gradients are compared with the single-device full-batch
``jax.grad`` of the mean loss; weights with float64 NumPy sums.
"""

from __future__ import annotations

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks import hlo
import weighted_accum as wa
from weighted_accum import distributed as dist

N = 8  # devices (conftest.py)


def _mesh1d():
  return jax.sharding.Mesh(np.array(jax.devices()), ("data",))


# ------------------------------------------------- exact weights across replicas


@functools.cache
def _weight_step():
  """Each replica tallies its row of microbatch weights; returns the window
  mode's global weight (``finish_mean``), ``reduce_sums``' and the exact
  pair of a ``reduce='microbatch'`` window, and the compiled program."""
  mesh = _mesh1d()

  def step(w):
    zero = jax.lax.pcast(jnp.zeros(()), "data", to="varying")
    per = dist.init({"g": jnp.zeros(())}, "data")
    glob = wa.init({"g": jnp.zeros(())})
    for i in range(w.shape[1]):
      per = dist.accumulate_sum(per, {"g": zero}, w[0, i], "data")
      glob = dist.accumulate_sum(
        glob, {"g": zero}, w[0, i], "data", reduce="microbatch"
      )
    out, _ = dist.finish_mean(per, "data")
    summed = dist.reduce_sums(wa.finish_sums(per)[0], "data")
    return out.weight, summed.weight, glob.weight_hi, glob.weight_lo

  return jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P())
  )


def _weights(w: np.ndarray):
  f = _weight_step()
  x = jax.device_put(
    np.asarray(w, np.float32), NamedSharding(_mesh1d(), P("data"))
  )
  return [np.asarray(v) for v in f(x)]


def test_cross_replica_weight_beyond_2_24_is_exact():
  """Replica 0 tallies 2**30 - 2**25, replica 1 2**25 and 65 (its pair:
  2**25 + 64, +1): the exact total 2**30 + 65. Summing the pairs' parts as
  two float32 values gives 2**30 (the tie 2**30 + 64 rounds to even, then
  the 1 is lost); the limbs give the float32 of the exact total."""
  w = np.zeros((N, 2), np.float32)
  w[0] = [2.0**30 - 2.0**25, 0.0]
  w[1] = [2.0**25, 65.0]
  exact = 2**30 + 65
  window, summed, hi, lo = _weights(w)
  assert float(window) == float(np.float32(exact)) == 2.0**30 + 128
  # reduce_sums gets each replica's float32 weight (finish_sums rounds
  # 2**25 + 65 to 2**25 + 64), and sums those exactly: 2**30 + 64, a tie.
  assert float(summed) == float(np.float32(2**30 + 64)) == 2.0**30
  assert int(np.float64(hi)) + int(np.float64(lo)) == exact


#: Scalars in a window's one reduction: the weight pair as 4 limbs of 12
#: bits and a fraction, and ``issued`` (float32 each).
SCALARS = 5 + 1


def test_cross_replica_weights_ride_the_gradient_all_reduce():
  """The limbs travel in the window's one all-reduce: the compiled finish
  reduces the gradient's bytes plus six float32 scalars, once."""
  mesh = _mesh1d()
  grads = {"a": jnp.zeros((N, 25)), "b": jnp.zeros((N, 3, 25))}

  def step(g, w):
    per = dist.init(jax.tree.map(lambda x: x[0], g), "data")
    local = jax.tree.map(lambda x: x[0], g)
    per = dist.accumulate_sum(per, local, w[0], "data")
    return dist.finish_mean(per, "data")[0]

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P()))
  c = f.lower(grads, jnp.ones(N)).compile()
  stats = hlo.hlo_stats(c)
  one = jax.tree.map(lambda x: x[0], grads)
  assert stats.count("all-reduce") == 1
  assert stats.nbytes("all-reduce") == hlo.tree_bytes(one) + 4 * SCALARS


@hypothesis.settings(deadline=None)
@hypothesis.given(
  st.lists(
    st.lists(st.integers(0, 2**40 - 1), min_size=3, max_size=3),
    min_size=N,
    max_size=N,
  )
)
def test_integer_weights_sum_exactly_across_replicas(rows):
  """Integer weights below 2**40 (beyond float32's 2**24), 3 per replica:
  the global pair equals the exact integer total, and the window's weight
  is its float32 rounding (float64 NumPy reference)."""
  w = np.asarray(rows, np.float64).astype(np.float32).astype(np.float64)
  exact = int(w.sum())
  window, summed, hi, lo = _weights(w)
  assert int(np.float64(hi)) + int(np.float64(lo)) == exact
  assert float(window) == float(np.float32(exact))
  # reduce_sums sums each replica's float32 weight (finish_sums' rounding).
  local = w.sum(axis=1).astype(np.float32).astype(np.float64)
  assert float(summed) == float(np.float32(local.sum()))


@hypothesis.settings(deadline=None)
@hypothesis.given(
  st.lists(
    st.lists(
      st.floats(2.0**-3, 2.0**30, allow_nan=False, width=32),
      min_size=3,
      max_size=3,
    ),
    min_size=N,
    max_size=N,
  )
)
def test_fractional_weights_sum_within_float32_rounding(rows):
  """Fractional weights: only the fractions are rounded, so the pair is
  within 1e-12 of the float64 total and the weight is its float32."""
  w = np.asarray(rows, np.float32).astype(np.float64)
  exact = float(w.sum())
  window, _, hi, lo = _weights(w)
  assert abs(np.float64(hi) + np.float64(lo) - exact) <= 1e-12 * exact
  assert abs(float(window) - exact) <= 2.0**-24 * exact
