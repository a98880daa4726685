"""Scaling out: one gradient reduction per step whatever K, in every sharding
style, and exact cross-replica weights.

Collective bytes come from the compiled HLO (``benchmarks/hlo.py``, an op in a
loop counted once per trip) and are compared with bytes written from the
shapes (``hlo.tree_bytes`` of the gradient tree plus scalars), never read back
from the library. Gradients are compared with the single-device full-batch
``jax.grad`` of the mean loss; weights with float64 NumPy sums.
"""

from __future__ import annotations

import contextlib
import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

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
    per = wa.init({"g": jnp.zeros(())}, axis_name="data")
    glob = wa.init({"g": jnp.zeros(())}, axis_name="data", reduce="microbatch")
    for i in range(w.shape[1]):
      per = wa.accumulate_sum(per, {"g": zero}, w[0, i])
      glob = wa.accumulate_sum(glob, {"g": zero}, w[0, i])
    out, _ = wa.finish_mean(per)
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
    per = wa.init(jax.tree.map(lambda x: x[0], g), axis_name="data")
    local = jax.tree.map(lambda x: x[0], g)
    per = wa.accumulate_sum(per, local, w[0])
    return wa.finish_mean(per)[0]

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


# ------------------------------------------------------------ the model --

D, H = 16, 32  # P = (16*32 + 32 + 32) * 4 = 2304 bytes
ROWS = 64 * N  # 64 rows per replica: divisible by N * K for K = 1, 2, 8
KS = (1, 2, 8)
#: The K of the matrices below: K = 8 (a loop of several trips) in every
#: sharding style, and K = 1 (one trip) beside it where K changes what is
#: asserted (FSDP's per-microbatch reduce-scatters) and once per axis type:
#: the same bytes for both K there.
K_SWEEP = {"auto", "explicit", "auto_fsdp"}
#: Scalars in the in-step call's one reduction: the weight pair as 5 limbs,
#: issued, the loss sum and the rejected count.
STEP_SCALARS = 5 + 3
#: The validity mark (a NaN-safe sum) of reduce-scattered gradients,
#: reduced after them: 1 float32.
MARKS = 1


def _params_np():
  r = np.random.default_rng(0)
  return {
    "w1": (r.standard_normal((D, H)) / 4).astype(np.float32),
    "b1": (0.1 * r.standard_normal(H)).astype(np.float32),
    "w2": (r.standard_normal(H) / 6).astype(np.float32),
  }


def _batch_np(seed=1):
  """Masked rows; replica 0's rows (the first eighth) all masked."""
  r = np.random.default_rng(seed)
  m = (r.random(ROWS) < 0.6).astype(np.float32)
  m[: ROWS // N] = 0
  return {
    "x": r.standard_normal((ROWS, D)).astype(np.float32),
    "y": r.standard_normal(ROWS).astype(np.float32),
    "m": m,
  }


def _loss_sum(p, b, matmul=jnp.matmul):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  pred = matmul(h, p["w2"])
  return jnp.sum(b["m"] * (pred - b["y"]) ** 2), jnp.sum(b["m"])


def _loss_mean(p, b, matmul=jnp.matmul):
  """A per-microbatch mean, unguarded: 0/0 = NaN for an all-masked one."""
  s, n = _loss_sum(p, b, matmul)
  return s / n, n


def _explicit_matmul(h, w):
  # On an Explicit data x model mesh the contraction over the model axis
  # names its output sharding (the model's business, not the library's).
  return jnp.matmul(h, w, out_sharding=P(None))


def _reference(params, batch):
  """The single-device full-batch gradient of the mean loss."""
  p, b = jax.device_put((params, batch), jax.devices()[0])
  g = jax.jit(jax.grad(lambda p: _loss_sum(p, b)[0] / jnp.sum(b["m"])))(p)
  return jax.tree.map(np.asarray, g)


def _err(got, ref) -> float:
  """The largest error relative to each leaf's scale."""
  return max(
    float(np.max(np.abs(np.asarray(got[k], np.float64) - ref[k])))
    / float(np.max(np.abs(ref[k])))
    for k in ref
  )


REPLICATED = {k: P() for k in ("w1", "b1", "w2")}
MODEL = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model")}
FSDP = {"w1": P("data", None), "b1": P("data"), "w2": P("data")}


class _Style:
  """A mesh and a layout of the params: where to put them and what one
  reduction of their gradient moves per device over the data axes."""

  def __init__(self, name, shape, axes_names, specs, data_axes, explicit):
    self.name, self.specs, self.data_axes = name, specs, data_axes
    kind = (
      jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    )
    self.mesh = jax.make_mesh(
      shape, axes_names, axis_types=(kind,) * len(shape)
    )
    self.explicit = explicit
    self.fsdp = any("data" in str(s) for s in specs.values())
    axes = (data_axes,) if isinstance(data_axes, str) else data_axes
    self.replicas = int(np.prod([self.mesh.shape[a] for a in axes]))

  def context(self):
    import contextlib  # pylint: disable=g-import-not-at-top

    return (
      jax.set_mesh(self.mesh) if self.explicit else contextlib.nullcontext()
    )

  def put(self, params, batch):
    with self.context():
      p = {
        k: jax.device_put(v, NamedSharding(self.mesh, self.specs[k]))
        for k, v in params.items()
      }
      b = jax.device_put(batch, NamedSharding(self.mesh, P(self.data_axes)))
    return p, b

  def groups(self):
    return hlo.mesh_groups(self.mesh, self.data_axes)

  def loss(self, mode):
    fn = _loss_sum if mode == "sum" else _loss_mean
    if self.explicit and "model" in self.mesh.axis_names:
      return functools.partial(fn, matmul=_explicit_matmul)
    return fn


STYLES = {
  "auto": ("auto", (N,), ("data",), REPLICATED, "data", False),
  "auto_2d": ("auto_2d", (4, 2), ("data", "model"), MODEL, "data", False),
  "auto_two_axes": (
    "auto_two_axes",
    (2, 4),
    ("replica", "data"),
    REPLICATED,
    ("replica", "data"),
    False,
  ),
  "auto_fsdp": ("auto_fsdp", (N,), ("data",), FSDP, "data", False),
  "explicit": ("explicit", (N,), ("data",), REPLICATED, "data", True),
  "explicit_2d": (
    "explicit_2d",
    (4, 2),
    ("data", "model"),
    MODEL,
    "data",
    True,
  ),
  "explicit_fsdp": ("explicit_fsdp", (N,), ("data",), FSDP, "data", True),
}


@functools.cache
def _style(name):
  return _Style(*STYLES[name])


def _shard_bytes(params) -> int:
  """Bytes of each param's shard on one device (what one reduction of its
  gradient over the data axes moves per device)."""
  return sum(x.addressable_shards[0].data.nbytes for x in params.values())


def _same_sharding(got, params) -> bool:
  return all(
    got[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim)
    for k in params
  )


# ---------------------------------------------- in step, one reduction --

IN_STEP = [
  ("auto", "gather_once"),
  ("auto_2d", "gather_once"),
  ("auto_two_axes", "gather_once"),
  ("auto_fsdp", "gather_once"),
  ("auto_fsdp", "scatter_each"),
  ("explicit", "gather_once"),
  ("explicit_2d", "gather_once"),
  ("explicit_fsdp", "gather_once"),
  ("explicit_fsdp", "scatter_each"),
]


def _in_step(name, fsdp, k, mode, has_aux=False):
  style = _style(name)
  params, batch = style.put(_params_np(), _batch_np())
  specs = None if style.explicit else style.specs
  loss = style.loss(mode)
  if has_aux:
    base = loss
    loss = lambda p, b: (base(p, b), {"m": b["m"], "n": jnp.sum(b["m"])})
  f = jax.jit(
    wa.microbatched_value_and_grad(
      loss,
      k,
      mode=mode,
      has_aux=has_aux,
      axis_name=wa.distributed.DataParallel(
        style.data_axes, param_specs=specs, fsdp=fsdp
      ),
    )
  )
  with style.context():
    compiled = f.lower(params, batch).compile()
    value, out = f(params, batch)
  return style, params, compiled, value, out


IN_STEP_K = [
  (name, fsdp, k)
  for name, fsdp in IN_STEP
  for k in ((1, 8) if name in K_SWEEP else (8,))
]


@pytest.mark.parametrize("name,fsdp,k", IN_STEP_K)
def test_one_reduction_per_call_whatever_k(name, fsdp, k):
  """Under plain jit (Auto or Explicit axes, replicated, data x model, two
  data axes, FSDP): one reduction of the gradient tree plus the scalars per
  call, the same bytes for every K, nothing reduced in the loop (but the
  per-microbatch reduce-scatters of fsdp='scatter_each', K of them); the
  result is the full-batch gradient (replica 0 has no item), on the params'
  shardings."""
  style, params, compiled, _, out = _in_step(name, fsdp, k, "sum")
  stats = hlo.hlo_stats(compiled)
  groups = style.groups()
  p_bytes = _shard_bytes(params) if not style.fsdp else hlo.tree_bytes(params)
  ar = stats.nbytes("all-reduce", groups)
  rs = stats.nbytes("reduce-scatter", groups)
  if not style.fsdp:
    assert (ar, rs) == (p_bytes + 4 * STEP_SCALARS, 0)
    assert stats.count("all-reduce", groups) == 1
    assert stats.in_loops(None, groups) == 0
  else:
    each = fsdp == "scatter_each"
    assert ar == 4 * (STEP_SCALARS + MARKS)
    assert rs == (k if each else 1) * p_bytes
    assert stats.in_loops("all-reduce", groups) == 0
    if not each or k == 1:
      assert stats.in_loops(None, groups) == 0
  batch = _batch_np()
  assert _err(out.grads, _reference(_params_np(), batch)) <= 1e-5
  assert float(out.weight) == float(batch["m"].sum())
  assert int(out.issued) == style.replicas * k and bool(out.valid)
  assert _same_sharding(out.grads, params)


@pytest.mark.parametrize("name", ["explicit", "explicit_2d"])
def test_explicit_batch_without_axis_name_is_the_global_batch(name):
  """On an Explicit mesh without ``axis_name`` the batch's type chooses no
  per-replica path: the microbatches are the global batch's (the full-batch
  gradient on the params' shardings, ``issued`` K)."""
  k = 2
  style = _style(name)
  params, batch = style.put(_params_np(), _batch_np())
  f = jax.jit(wa.microbatched_value_and_grad(style.loss("sum"), k, mode="sum"))
  with style.context():
    _, out = f(params, batch)
  assert _err(out.grads, _reference(_params_np(), _batch_np())) <= 1e-5
  assert int(out.issued) == k and bool(out.valid)
  assert _same_sharding(out.grads, params)


# Each way the sum across replicas is taken: one all-reduce (one and two
# data axes, and under a model axis on an Explicit mesh), FSDP's
# reduce-scatter after the loop and in it (Auto and Explicit).
MEAN_STYLES = [
  ("auto", "gather_once"),
  ("auto_two_axes", "gather_once"),
  ("auto_fsdp", "gather_once"),
  ("auto_fsdp", "scatter_each"),
  ("explicit_2d", "gather_once"),
  ("explicit_fsdp", "scatter_each"),
]


@pytest.mark.parametrize("name,fsdp", MEAN_STYLES)
def test_mean_losses_with_an_empty_replica_are_exact(name, fsdp):
  """mode='mean' with unguarded per-microbatch means: replica 0's
  microbatches are 0/0 = NaN and add nothing (a select before any sum
  across replicas, reduce-scatters included)."""
  k = 8
  _, params, _, (loss), out = _in_step(name, fsdp, k, "mean")
  batch = _batch_np()
  ref = _reference(_params_np(), batch)
  assert bool(out.valid) and bool(out.finite)
  assert _err(out.grads, ref) <= 1e-5
  full = _loss_sum(_params_np(), batch)[0] / batch["m"].sum()
  assert float(loss) == pytest.approx(float(full), rel=1e-5)
  assert _same_sharding(out.grads, params)


@pytest.mark.parametrize("k", (1, 8))
def test_shard_map_style_reduces_once_with_the_same_bytes(k):
  """The shard_map style (axis_name, this replica's rows) moves what the
  plain-jit data_axes style does: one all-reduce of P plus the scalars."""
  style = _style("auto")
  params, batch = style.put(_params_np(), _batch_np())
  f = wa.microbatched_value_and_grad(_loss_sum, k, mode="sum", axis_name="data")
  step = jax.jit(
    jax.shard_map(f, mesh=style.mesh, in_specs=(P(), P("data")), out_specs=P())
  )
  stats = hlo.hlo_stats(step.lower(params, batch).compile())
  assert stats.nbytes("all-reduce") == hlo.tree_bytes(params) + 4 * STEP_SCALARS
  assert stats.count() == 1 and stats.in_loops() == 0
  _, out = step(params, batch)
  assert _err(out.grads, _reference(_params_np(), _batch_np())) <= 1e-5


def test_aux_per_replica_merges_back_into_the_microbatch_layout():
  """has_aux with data_axes: each aux leaf is [K, N, ...] (replica r's value
  for its rows of microbatch k); a per-row aux reshaped to [K, -1] is the
  aux of the same function without data_axes, and per-replica counts sum
  to the microbatch's count."""
  k = 4
  style, params, _, (loss, aux), out = _in_step(
    "auto", "gather_once", k, "sum", has_aux=True
  )
  assert aux["m"].shape == (k, N, ROWS // (N * k))
  assert aux["n"].shape == (k, N)
  assert aux["m"].sharding.spec == P(None, "data")
  plain = wa.microbatched_value_and_grad(
    lambda p, b: (_loss_sum(p, b), {"m": b["m"], "n": jnp.sum(b["m"])}),
    k,
    mode="sum",
    has_aux=True,
  )
  (loss2, aux2), _ = jax.jit(plain)(*style.put(_params_np(), _batch_np()))
  np.testing.assert_array_equal(
    np.asarray(aux["m"]).reshape(k, -1), np.asarray(aux2["m"])
  )
  np.testing.assert_array_equal(
    np.asarray(aux["n"]).sum(axis=1), np.asarray(aux2["n"])
  )
  assert float(loss) == pytest.approx(float(loss2), rel=1e-6)


def test_traced_number_of_real_microbatches_reduces_once():
  """num_real_microbatches traced (a while loop of unknown trip count): one
  reduction, and the gradient of the rows of the microbatches run."""
  k, real = 8, 5
  style = _style("auto")
  params, batch = style.put(_params_np(), _batch_np())
  f = wa.microbatched_value_and_grad(
    _loss_sum,
    k,
    mode="sum",
    axis_name="data",
    split="strided",
  )
  g = jax.jit(lambda p, b, n: f(p, b, num_real_microbatches=n))
  stats = hlo.hlo_stats(
    g.lower(params, batch, jnp.int32(real)).compile(), trip_count=k
  )
  assert stats.nbytes("all-reduce") == hlo.tree_bytes(params) + 4 * STEP_SCALARS
  assert stats.in_loops() == 0
  _, out = g(params, batch, jnp.int32(real))
  local = ROWS // N  # replica r's microbatch j: its local rows j::K
  keep = np.zeros(ROWS, bool)
  for r in range(N):
    for j in range(real):
      keep[r * local + j : (r + 1) * local : k] = True
  sub = jax.tree.map(lambda x: x[keep], _batch_np())
  assert _err(out.grads, _reference(_params_np(), sub)) <= 1e-5
  assert int(out.issued) == N * real


def test_fsdp_options_trade_bytes_for_memory():
  """A param-dominated model (P = 2 MiB, two 512 x 512 layers sharded over
  the data axis), K = 8: 'scatter_each' moves K times the bytes of
  'gather_once' and needs less compiled temporary memory (a carry of P/N
  instead of P); both are the full-batch gradient."""
  mesh = _style("auto").mesh
  r = np.random.default_rng(0)
  w = {
    "w1": (r.standard_normal((512, 512)) / 20).astype(np.float32),
    "w2": (r.standard_normal((512, 512)) / 20).astype(np.float32),
  }
  specs = {"w1": P("data", None), "w2": P(None, "data")}
  x = r.standard_normal((8 * 8 * N, 512)).astype(np.float32)
  m = (r.random(len(x)) < 0.7).astype(np.float32)

  def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    return jnp.sum(b["m"][:, None] * (h @ p["w2"] - b["x"]) ** 2), b["m"].sum()

  params = {
    k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in w.items()
  }
  batch = jax.device_put({"x": x, "m": m}, NamedSharding(mesh, P("data")))
  ref = jax.grad(lambda p: loss(p, {"x": x, "m": m})[0] / m.sum())(w)
  got = {}
  for fsdp in ("gather_once", "scatter_each"):
    f = jax.jit(
      wa.microbatched_value_and_grad(
        loss,
        8,
        mode="sum",
        axis_name=wa.distributed.DataParallel(
          "data", param_specs=specs, fsdp=fsdp
        ),
      )
    )
    c = f.lower(params, batch).compile()
    _, out = f(params, batch)
    assert _err(out.grads, jax.tree.map(np.asarray, ref)) <= 1e-5
    assert _same_sharding(out.grads, params)
    got[fsdp] = (
      hlo.all_reduced_bytes(c, hlo.mesh_groups(mesh, "data")),
      c.memory_analysis().temp_size_in_bytes,
    )
  p_bytes = hlo.tree_bytes(params)
  assert got["gather_once"][0] == p_bytes + 4 * (STEP_SCALARS + MARKS)
  assert got["scatter_each"][0] == 8 * p_bytes + 4 * (STEP_SCALARS + MARKS)
  assert got["scatter_each"][1] < got["gather_once"][1]


# --------------------------------------------------------------- errors --


def test_data_axes_errors_name_what_is_wrong():
  style = _style("auto")
  params, batch = style.put(_params_np(), _batch_np())
  mv = wa.microbatched_value_and_grad
  with pytest.raises(wa.WeightedAccumulationError, match="axis_name"):
    mv(_loss_sum, 2, mode="sum", axis_name=3)
  with pytest.raises(wa.WeightedAccumulationError, match="fsdp='each'"):
    wa.distributed.DataParallel("data", fsdp="each")
  with pytest.raises(wa.WeightedAccumulationError, match="not a Partition"):
    wa.distributed.DataParallel("data", param_specs={"w1": "x"})
  f = mv(_loss_sum, 2, mode="sum", axis_name="model")
  with pytest.raises(wa.WeightedAccumulationError, match="not on a mesh"):
    jax.jit(f)(params, batch)
  f = mv(_loss_sum, 3, mode="sum", axis_name="data")
  with pytest.raises(wa.WeightedAccumulationError, match="divisible by 24"):
    jax.jit(f)(params, batch)
  dp = wa.distributed.DataParallel("data", param_specs={"w1": P()})
  f = mv(_loss_sum, 2, mode="sum", axis_name=dp)
  with pytest.raises(wa.WeightedAccumulationError, match="do not match"):
    jax.jit(f)(params, batch)
  bad = {"w1": P("data", "data"), "b1": P(), "w2": P()}
  f = mv(
    _loss_sum,
    2,
    mode="sum",
    axis_name=wa.distributed.DataParallel("data", param_specs=bad),
  )
  with pytest.raises(wa.WeightedAccumulationError, match="one dimension"):
    jax.jit(f)(params, batch)


@pytest.mark.parametrize("fsdp", ["gather_once", "scatter_each"])
def test_param_specs_are_checked_against_the_mesh_naming_the_leaf(fsdp):
  """A spec naming an axis the mesh lacks, or an FSDP dimension the 4 data
  replicas do not divide (6 columns): named with the leaf path and the
  fix, before any kernel (jax's own errors name neither)."""
  style = _style("auto_2d")  # data 4 x model 2
  params, batch = style.put(_params_np(), _batch_np())
  mv = wa.microbatched_value_and_grad
  missing = {"w1": P(None, "tensor"), "b1": P(), "w2": P()}
  dp = wa.distributed.DataParallel("data", param_specs=missing)
  f = mv(_loss_sum, 2, mode="sum", axis_name=dp)
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=r"param \['w1'\]: its spec .*names the axis 'tensor', which the "
    r"mesh \(axes \('data', 'model'\)\) lacks.*param_specs",
  ):
    jax.jit(f)(params, batch)
  odd = dict(_params_np(), w1=np.zeros((D, 6), np.float32))
  odd_params, _ = style.put(odd, _batch_np())
  fsdp_specs = {"w1": P(None, "data"), "b1": P(), "w2": P()}
  f = mv(
    lambda p, b: (jnp.sum(p["w1"]) * jnp.sum(b["m"]), jnp.sum(b["m"])),
    2,
    mode="sum",
    axis_name=wa.distributed.DataParallel(
      "data", param_specs=fsdp_specs, fsdp=fsdp
    ),
  )
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=r"param \['w1'\].*dimension 1 \(size 6\) over \('data',\), 4 "
    r"shards.*multiple of 4",
  ):
    jax.jit(f)(odd_params, batch)


def _tp_loss(p, b, explicit):
  """A tanh layer whose hidden axis the model axis shards."""
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  pred = jnp.matmul(h, p["w2"], out_sharding=P(None) if explicit else None)
  return jnp.sum(b["m"] * (pred - b["y"]) ** 2), jnp.sum(b["m"])


def _tp_reference64(params, batch):
  """The full-batch mean gradient of ``_tp_loss``, by hand in float64."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x, y, m = (np.asarray(batch[k], np.float64) for k in ("x", "y", "m"))
  h = np.tanh(x @ p["w1"] + p["b1"])
  r = 2 * m * (h @ p["w2"] - y) / m.sum()
  dh = r[:, None] * p["w2"][None, :] * (1 - h**2)
  return {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ r}


@pytest.mark.parametrize("fsdp", ["gather_once", "scatter_each"])
@pytest.mark.parametrize(
  "spec", [P("data", "model"), P(("data", "model"), None)]
)
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_fsdp_with_tensor_parallel_params_is_exact(kind, spec, fsdp):
  """FSDP plus tensor parallelism: a param sharded over the data axis and a
  model axis (on another dimension, or after it on the same one), on a 2x4
  data x model mesh of either axis type (Explicit: as jax.make_mesh makes
  it by default). The gradient is the float64 full-batch one and the same
  call's on one device, reduce-scattered over the data axis (the model
  axis untouched) and on the param's sharding."""
  explicit = kind == "explicit"
  mesh = (
    jax.make_mesh((2, 4), ("data", "model"))
    if explicit
    else jax.make_mesh(
      (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
  )
  assert explicit == (mesh.axis_types[0] == jax.sharding.AxisType.Explicit), (
    "jax.make_mesh's default axis type changed"
  )
  specs = {"w1": spec, "b1": P("model"), "w2": P("model")}
  params_np, batch_np = _params_np(), _batch_np()
  loss = functools.partial(_tp_loss, explicit=explicit)
  dp = wa.distributed.DataParallel(
    "data", param_specs=None if explicit else specs, fsdp=fsdp
  )
  f = jax.jit(wa.microbatched_value_and_grad(loss, 2, mode="sum", axis_name=dp))
  with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
    params = {
      k: jax.device_put(v, NamedSharding(mesh, specs[k]))
      for k, v in params_np.items()
    }
    batch = jax.device_put(batch_np, NamedSharding(mesh, P("data")))
    _, out = f(params, batch)
    stats = hlo.hlo_stats(f.lower(params, batch).compile())
  assert bool(out.valid)
  for k in specs:
    assert out.grads[k].sharding.is_equivalent_to(params[k].sharding, 2), k
  ref64 = _tp_reference64(params_np, batch_np)
  assert _err(out.grads, ref64) < 1e-5
  one = jax.device_put((params_np, batch_np), jax.devices()[0])
  single = wa.microbatched_value_and_grad(
    functools.partial(_tp_loss, explicit=False), 2, mode="sum"
  )
  _, want = jax.jit(single)(*one)
  for k in specs:
    np.testing.assert_allclose(
      out.grads[k], want.grads[k], rtol=2e-5, atol=1e-7
    )
  data = hlo.mesh_groups(mesh, "data")
  # The data axis reduce-scatters the FSDP gradient: never all-reduced.
  assert stats.count("reduce-scatter", data) >= 1
  assert stats.nbytes("all-reduce", data) < D * H * 4 // 4


def test_explicit_batch_must_be_sharded_over_the_data_axes():
  style = _style("explicit")
  params, _ = style.put(_params_np(), _batch_np())
  with style.context():
    batch = jax.device_put(_batch_np(), NamedSharding(style.mesh, P()))
    f = wa.microbatched_value_and_grad(
      _loss_sum,
      2,
      mode="sum",
      axis_name="data",
    )
    with pytest.raises(wa.WeightedAccumulationError, match="exactly the data"):
      jax.jit(f)(params, batch)


# --------------------------------------------------------- across steps --

#: Scalars in a stacked window's close: the weight pair's 5 limbs and
#: issued (the per-replica diagnostics zero_weight and rejected are summed
#: too, but the close does not use them and XLA drops them).
CLOSE_SCALARS = 5 + 1
ACROSS = [
  "auto",
  "auto_2d",
  "auto_fsdp",
  "explicit",
  "explicit_2d",
  "explicit_fsdp",
]


def _windows_reference(tx, batches, windows, calls):
  """Single device: tx applied to each window's full-batch gradient."""
  import optax  # pylint: disable=g-import-not-at-top

  p = jax.tree.map(jnp.asarray, _params_np())
  s = tx.init(p)
  for w in range(windows):
    part = batches[w * calls : (w + 1) * calls]
    full = jax.tree.map(lambda *x: np.concatenate(x), *part)
    g = jax.tree.map(jnp.asarray, _reference(jax.tree.map(np.asarray, p), full))
    u, s = tx.update(g, s, p)
    p = optax.apply_updates(p, u)
  return jax.tree.map(np.asarray, p)


def _adam():
  import optax  # pylint: disable=g-import-not-at-top

  return optax.adam(1e-2)


@pytest.mark.parametrize(
  "name,k",
  [(name, k) for name in ACROSS for k in (KS if name == "auto" else (2,))],
)
def test_across_steps_under_jit_reduce_once_per_window(name, k):
  """A stacked per-replica window (distributed.init outside shard_map) fed
  by f.accumulate with data_axes under plain jit: a mid-window step reduces
  nothing over the data axes, the close (apply_window with axis_name)
  reduces the gradient tree and the scalars once; over two Adam windows of
  two calls each the params equal the single-device reference."""
  style = _style(name)
  tx = _adam()
  calls, windows = 2, 2
  batches = [_batch_np(seed=10 + i) for i in range(calls * windows)]
  params, _ = style.put(_params_np(), batches[0])
  specs = None if style.explicit else style.specs
  f = wa.microbatched_value_and_grad(
    style.loss("sum"),
    k,
    mode="sum",
    axis_name=wa.distributed.DataParallel(style.data_axes, param_specs=specs),
  )
  mid = jax.jit(f.accumulate, donate_argnums=0)
  close = jax.jit(
    lambda s, p, o: wa.apply_window(tx, s, p, o),
    donate_argnums=(0, 1, 2),
  )
  groups = style.groups()
  with style.context():
    state = wa.init(params, axis_name=style.data_axes)
    opt = tx.init(params)
    for w in range(windows):
      for c in range(calls):
        _, b = style.put(_params_np(), batches[w * calls + c])
        if w == c == 0:
          s = hlo.hlo_stats(mid.lower(state, params, b).compile())
          assert s.count("all-reduce", groups) == 0
          assert s.count("reduce-scatter", groups) == 0
          if not style.fsdp:  # FSDP: the forward's all-gather of the params
            assert s.count(None, groups) == 0
        (loss_sum, weight), state = mid(state, params, b)
        assert weight.shape == (style.replicas,)
      if w == 0:
        s = hlo.hlo_stats(close.lower(state, params, opt).compile())
        ar = s.nbytes("all-reduce", groups)
        rs = s.nbytes("reduce-scatter", groups)
        if style.fsdp and style.explicit:  # reduce-scattered onto the params
          assert rs == hlo.tree_bytes(params)
          # Scalar marks only: per leaf its finiteness and, in the range
          # read's branch, its largest magnitude (two float32 scalars).
          assert 0 <= ar - 4 * CLOSE_SCALARS <= 8 * len(params)
        else:
          p_bytes = (
            hlo.tree_bytes(params) if style.fsdp else _shard_bytes(params)
          )
          assert (ar, rs) == (p_bytes + 4 * CLOSE_SCALARS, 0)
          assert s.count("all-reduce", groups) == 1
      params, opt, state, out = close(state, params, opt)
      assert bool(out.valid) and int(out.issued) == style.replicas * k * calls
      assert int(state.windows) == w + 1
      assert state.weight_hi.shape == (style.replicas,)
  ref = _windows_reference(tx, batches, windows, calls)
  assert _err(params, ref) <= 1e-5
  assert _same_sharding(params, style.put(_params_np(), batches[0])[0])


def test_across_steps_in_shard_map_reduce_once_per_window():
  """The shard_map style: the stacked window passed in and out with
  distributed.window_specs; mid-window steps (f.accumulate with axis_name,
  or local_grad + distributed.accumulate_sum, on this replica's block) run
  no collective; apply_window(axis_name=) and distributed.finish_mean run
  one all-reduce; two Adam windows equal the reference."""
  style = _style("auto")
  mesh, tx, k = style.mesh, _adam(), 2
  batches = [_batch_np(seed=10 + i) for i in range(4)]
  params, _ = style.put(_params_np(), batches[0])
  state = wa.init(params, axis_name="data")
  sp = dist.window_specs(state)
  f = wa.microbatched_value_and_grad(_loss_sum, k, mode="sum", axis_name="data")

  def by_f(s, p, b):
    return f.accumulate(s, p, b)[1]

  def by_grad(s, p, b):
    g = dist.local_grad(lambda p, b: _loss_sum(p, b)[0], "data")(p, b)
    return wa.accumulate_sum(s, g, jnp.sum(b["m"]))

  def sm(fn, ins, outs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs))

  mids = [sm(fn, (sp, P(), P("data")), sp) for fn in (by_f, by_grad)]
  close = sm(
    lambda s, p, o: wa.apply_window(tx, s, p, o),
    (sp, P(), P()),
    (P(), P(), sp, P()),
  )
  opt = tx.init(params)
  for w in range(2):
    for c in range(2):
      _, b = style.put(_params_np(), batches[2 * w + c])
      mid = mids[c]
      if w == 0:
        assert hlo.hlo_stats(mid.lower(state, params, b).compile()).count() == 0
      state = mid(state, params, b)
    if w == 0:
      s = hlo.hlo_stats(close.lower(state, params, opt).compile())
      assert s.count() == 1
      assert s.nbytes() == hlo.tree_bytes(params) + 4 * CLOSE_SCALARS
      fin = jax.jit(lambda s: wa.finish_mean(s))
      s = hlo.hlo_stats(fin.lower(state).compile())
      assert s.count() == 1
      out, nxt = fin(state)
      full = jax.tree.map(lambda *x: np.concatenate(x), *batches[:2])
      assert _err(out.grads, _reference(_params_np(), full)) <= 1e-5
      assert int(nxt.windows) == 1 and nxt.weight_hi.shape == (N,)
    params, opt, state, out = close(state, params, opt)
    assert bool(out.valid)
  assert _err(params, _windows_reference(tx, batches, 2, 2)) <= 1e-5


def test_an_empty_stacked_window_stays_open():
  """A window whose every item is masked: the close applies nothing, keeps
  the window's counters (windows not advanced) and its params."""
  style = _style("auto")
  tx = _adam()
  batch = _batch_np()
  batch["m"][:] = 0
  params, b = style.put(_params_np(), batch)
  f = wa.microbatched_value_and_grad(
    _loss_sum,
    2,
    mode="sum",
    axis_name="data",
  )
  state = wa.init(params, axis_name="data")
  _, state = jax.jit(f.accumulate)(state, params, b)
  opt = tx.init(params)
  new_p, _, new_state, out = jax.jit(
    lambda s, p, o: wa.apply_window(tx, s, p, o)
  )(state, params, opt)
  assert not bool(out.valid) and float(out.weight) == 0
  assert int(new_state.windows) == 0
  np.testing.assert_array_equal(np.asarray(new_state.issued), np.full(N, 2))
  assert _err(new_p, jax.tree.map(np.asarray, params)) == 0


def test_stacked_windows_are_refused_where_they_do_not_belong():
  style = _style("auto")
  params, b = style.put(_params_np(), _batch_np())
  state = wa.init(params, axis_name="data")
  grads = jax.tree.map(jnp.zeros_like, params)
  # Added to per replica only (inside shard_map, or f.accumulate).
  with pytest.raises(
    wa.WeightedAccumulationError,
    match=r"stacked per replica over \(.data.,\): add to it",
  ):
    wa.accumulate_sum(state, grads, 1.0)
  # Closed as what it is: reduced once; an empty one has no mean.
  with pytest.raises(wa.WeightedAccumulationError, match="total weight is 0"):
    wa.finish_mean(state)
  new, _, _, out = wa.apply_window(_adam(), state, params, _adam().init(params))
  assert not bool(out.valid)
  assert all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))
  )
  f = wa.microbatched_value_and_grad(
    _loss_sum,
    2,
    mode="sum",
    axis_name="data",
  )
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"wa.init\(params, axis_name="
  ):
    jax.jit(f.accumulate)(wa.init(params), params, b)
  g = wa.microbatched_value_and_grad(
    _loss_sum,
    2,
    mode="sum",
    axis_name=wa.distributed.DataParallel(
      "data", param_specs=FSDP, fsdp="scatter_each"
    ),
  )
  with pytest.raises(wa.WeightedAccumulationError, match="gather_once"):
    jax.jit(g.accumulate)(state, params, b)


def test_scaling_page_data_axes_section_runs():
  """docs/scaling.md's data_axes examples run as written (they assert the
  full-batch gradient and the window's microbatch count)."""
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  page = (pathlib.Path(__file__).parents[2] / "docs" / "scaling.md").read_text()
  section = page.split("<!-- BEGIN data_axes -->")[1].split(
    "<!-- END data_axes -->"
  )[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 2
  scope = {}
  exec(compile("\n".join(blocks), "scaling.md data_axes", "exec"), scope)  # pylint: disable=exec-used
  assert bool(scope["out"].valid)
