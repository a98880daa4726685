"""In-step microbatching under plain ``jit`` with ``data_axes``, combined
with the argument roles: keyword batches on another batch axis,
``microbatch_size``, arguments that are not arrays, loss terms with their
own and known normalisers, random keys, ``grads_dtype``, and
``f.accumulate`` into a stacked window.

Every gradient is judged against float64 NumPy on the full batch; the call
reduces once (all-reduce count from the compiled HLO, ``benchmarks/hlo.py``,
an op in a loop counted once per trip). What cannot be per-replica-exact
(threaded state, ``split="contiguous"``) is refused with a named error.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from _helpers import Compiles
from benchmarks import hlo
import weighted_accum as wa
from weighted_accum import distributed as dist

N = 8  # devices (conftest.py)
D, ROWS, K = 4, 32, 2
Error = wa.WeightedAccumulationError


class _Mesh:
  def __init__(self, shape, names, explicit, specs):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    self.mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))
    self.explicit, self.specs = explicit, specs

  def context(self):
    return (
      jax.set_mesh(self.mesh) if self.explicit else contextlib.nullcontext()
    )

  def put(self, tree, spec):
    with self.context():
      return jax.device_put(tree, NamedSharding(self.mesh, spec))


MESHES = {
  "auto": lambda: _Mesh((N,), ("data",), False, P()),
  "auto_2d": lambda: _Mesh((4, 2), ("data", "model"), False, P("model")),
  "explicit": lambda: _Mesh((N,), ("data",), True, P()),
}


def _data(seed=0):
  r = np.random.default_rng(seed)
  x = r.integers(-2, 3, size=(D, ROWS)).astype(np.float32) / 2  # batch axis 1
  y = r.integers(-2, 3, size=ROWS).astype(np.float32)
  m = (r.random(ROWS) < 0.6).astype(np.float32)
  m[: ROWS // N] = 0  # replica 0's rows all masked
  w = (r.integers(-4, 5, size=D) / 4).astype(np.float32)
  return w, x, y, m


def _ref_grad(w, x, y, m):
  """d/dw of sum(m * (w @ x - y)**2) / sum(m), float64."""
  w, x, y, m = (np.asarray(a, np.float64) for a in (w, x, y, m))
  r = w @ x - y
  return 2.0 * (x * (m * r)).sum(axis=1) / m.sum()


def _loss(params, tag, *, xs, rows):
  assert tag == "a string reaches loss_fn"
  x, y, m = xs, rows["y"], rows["m"]
  pred = params["act"](params["w"] @ x)
  return jnp.sum(m * (pred - y) ** 2), jnp.sum(m)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_keyword_batch_on_axis_1_with_microbatch_size(name):
  """batch_argnames + in_axes=1 + microbatch_size + a string argument + a
  function in the params (held fixed, None gradient) + grads_dtype: the
  full batch's gradient, one all-reduce."""
  mesh = MESHES[name]()
  w, x, y, m = _data()
  wp = mesh.put(w, mesh.specs)
  xs = mesh.put(x, P(None, "data"))
  rows = mesh.put({"y": y, "m": m}, P("data"))
  f = wa.microbatched_value_and_grad(
    _loss,
    mode="sum",
    microbatch_size=ROWS // K,
    batch_argnums={"xs": 1, "rows": 0},
    grads_dtype="params",
    axis_name="data",
  )
  tag = "a string reaches loss_fn"
  with mesh.context():
    step = jax.jit(
      lambda w, xs, rows: f({"w": w, "act": lambda z: z}, tag, xs=xs, rows=rows)
    )
    _, out = step(wp, xs, rows)
    stats = hlo.hlo_stats(step.lower(wp, xs, rows).compile(), trip_count=K)
  assert out.grads["act"] is None
  assert out.grads["w"].dtype == jnp.float32
  np.testing.assert_allclose(out.grads["w"], _ref_grad(w, x, y, m), rtol=1e-5)
  assert float(out.weight) == float(m.sum()) and bool(out.valid)
  assert stats.count("all-reduce", hlo.mesh_groups(mesh.mesh, "data")) == 1


def _terms_loss(w, b):
  """Two terms: a masked squared error (its own weight) and an L2 term on
  every row (a normaliser known before the loop)."""
  pred = b["x"] @ w
  err = jnp.sum(b["m"] * (pred - b["y"]) ** 2)
  l2 = jnp.sum(pred**2)
  return {"err": err, "l2": l2}, {"err": jnp.sum(b["m"]), "l2": jnp.ones(())}


@pytest.mark.parametrize("name", ["auto", "auto_2d"])
def test_loss_terms_and_known_normalizer(name):
  mesh = MESHES[name]()
  w, x, y, m = _data(1)
  xt = x.T
  batch = mesh.put({"x": xt, "y": y, "m": m}, P("data"))
  wp = mesh.put(w, mesh.specs)
  f = wa.microbatched_value_and_grad(
    _terms_loss,
    K,
    mode="sum",
    axis_name="data",
  )
  step = jax.jit(lambda w, b: f(w, b, normalizers={"l2": float(ROWS)}))
  loss, out = step(wp, batch)
  x64, y64, m64, w64 = (np.asarray(a, np.float64) for a in (xt, y, m, w))
  pred = x64 @ w64
  ref = 2 * x64.T @ (m64 * (pred - y64)) / m64.sum() + 2 * x64.T @ pred / ROWS
  np.testing.assert_allclose(out.grads, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    float(loss["err"]), (m64 * (pred - y64) ** 2).sum() / m64.sum(), rtol=1e-5
  )
  np.testing.assert_allclose(
    float(loss["l2"]), (pred**2).sum() / ROWS, rtol=1e-5
  )
  assert float(out.weight["err"]) == float(m.sum()) and bool(out.valid)


def _noisy_loss(w, key, b):
  noise = jax.random.normal(key, b["y"].shape)
  pred = b["x"] @ w
  return (jnp.sum(b["m"] * (pred - b["y"]) ** 2), jnp.sum(b["m"])), noise


def test_random_keys_differ_across_replicas_and_microbatches():
  mesh = MESHES["auto"]()
  w, x, y, m = _data(2)
  batch = mesh.put({"x": x.T, "y": y, "m": m}, P("data"))
  f = wa.microbatched_value_and_grad(
    _noisy_loss,
    K,
    mode="sum",
    has_aux=True,
    batch_argnums=2,
    key_argnums=1,
    axis_name="data",
  )
  (_, noise), out = jax.jit(f)(mesh.put(w, P()), jax.random.key(0), batch)
  noise = np.asarray(noise)  # [K, N, rows per replica per microbatch]
  assert noise.shape == (K, N, ROWS // N // K)
  flat = noise.reshape(K * N, -1)
  assert len({tuple(r) for r in flat.round(6)}) == K * N  # all draws differ
  np.testing.assert_allclose(out.grads, _ref_grad(w, x, y, m), rtol=1e-5)


def test_accumulate_with_keyword_batch_into_a_stacked_window():
  """f.accumulate (keyword batch) into a stacked window over two calls,
  closed by apply_window(axis_name=) with SGD(1): the update is minus the
  mean gradient over both calls' rows."""
  mesh = MESHES["auto"]()
  w, x, y, m = _data(3)
  _, x2, y2, m2 = _data(4)
  params = {"w": mesh.put(w, P()), "act": lambda z: z}
  f = wa.microbatched_value_and_grad(
    _loss,
    K,
    mode="sum",
    batch_argnums={"xs": 1, "rows": 0},
    axis_name="data",
  )
  state = wa.init({"w": params["w"]}, axis_name="data")
  tag = "a string reaches loss_fn"

  @jax.jit
  def mid(state, w, xs, rows):
    p = {"w": w, "act": lambda z: z}
    (_, wsum), st = f.accumulate(state, p, tag, xs=xs, rows=rows)
    return st, wsum

  for xs, ys, ms in ((x, y, m), (x2, y2, m2)):
    xs = mesh.put(xs, P(None, "data"))
    rows = mesh.put({"y": ys, "m": ms}, P("data"))
    state, wsum = mid(state, params["w"], xs, rows)
    assert wsum.shape == (N,)
  tx = optax.sgd(1.0)
  close = jax.jit(lambda s, p, o: wa.apply_window(tx, s, p, o))
  p = {"w": params["w"]}
  new, _, _, out = close(state, p, tx.init(p))
  ref = _ref_grad(
    w,
    np.concatenate([x, x2], 1),
    np.concatenate([y, y2]),
    np.concatenate([m, m2]),
  )
  np.testing.assert_allclose(
    np.asarray(new["w"]) - w, -ref, rtol=1e-5, atol=1e-6
  )
  assert bool(out.valid)


def _stateful_loss(w, count, b):
  return (jnp.sum(b["m"] * (b["x"] @ w) ** 2), jnp.sum(b["m"])), count + 1


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(state_argnums=1, batch_argnums=2), r"state_argnums"),
    (dict(split="contiguous"), r"split='contiguous'"),
  ],
)
def test_refused_roles_are_named(kw, match):
  mesh = MESHES["auto"]()
  w, x, y, m = _data()
  batch = mesh.put({"x": x.T, "y": y, "m": m}, P("data"))
  loss = (
    _stateful_loss
    if "state_argnums" in kw
    else (lambda w, b: (jnp.sum(b["m"] * (b["x"] @ w) ** 2), jnp.sum(b["m"])))
  )
  f = wa.microbatched_value_and_grad(
    loss,
    K,
    **kw,
    mode="sum",
    axis_name="data",
  )
  args = (w, jnp.int32(0), batch) if "state_argnums" in kw else (w, batch)
  with pytest.raises(Error, match=match):
    jax.jit(f)(*args)


def test_microbatch_size_not_splitting_over_replicas_is_refused():
  mesh = MESHES["auto"]()
  w, x, y, m = _data()
  batch = mesh.put({"x": x.T, "y": y, "m": m}, P("data"))
  f = wa.microbatched_value_and_grad(
    lambda w, b: (jnp.sum(b["m"] * (b["x"] @ w) ** 2), jnp.sum(b["m"])),
    mode="sum",
    microbatch_size=ROWS // 8 // 2 * 3,  # 3: K = 10 does not divide 32 / 8
    axis_name="data",
  )
  with pytest.raises(Error, match=r"divisible by"):
    jax.jit(f)(w, batch)


def _plain_loss(w, b):
  return jnp.sum(b["m"] * (b["x"] @ w) ** 2), jnp.sum(b["m"])


def _plain_batch(mesh):
  w, x, y, m = _data()
  return w, mesh.put({"x": x.T, "y": y, "m": m}, P("data"))


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan])
def test_normalizers_are_checked_before_the_shard_map(bad):
  """Eagerly, a bad normaliser is refused as without data_axes (inside the
  shard_map it would be traced, and only make the result NaN)."""
  mesh = MESHES["auto"]()
  w, batch = _plain_batch(mesh)
  f = wa.microbatched_value_and_grad(
    _plain_loss,
    K,
    mode="sum",
    axis_name="data",
  )
  with pytest.raises(Error, match=r"normaliser"):
    f(w, batch, normalizers=jnp.float32(bad))


@pytest.mark.parametrize("key", [0, "zeros3"])
def test_keys_are_checked_before_they_are_folded(key):
  mesh = MESHES["auto"]()
  w, batch = _plain_batch(mesh)
  key = jnp.zeros(3) if key == "zeros3" else key
  f = wa.microbatched_value_and_grad(
    lambda w, b, k: _plain_loss(w, b),
    K,
    mode="sum",
    key_argnums=2,
    axis_name="data",
  )
  with pytest.raises(Error, match=r"PRNG key"):
    f(w, batch, key)


@pytest.mark.parametrize("size", [5, 24])
def test_microbatch_size_is_enforced_as_without_data_axes(size):
  mesh = MESHES["auto"]()
  w, batch = _plain_batch(mesh)
  f = wa.microbatched_value_and_grad(
    _plain_loss,
    mode="sum",
    microbatch_size=size,
    axis_name="data",
  )
  with pytest.raises(Error, match=rf"microbatch_size={size}"):
    f(w, batch)


def test_accumulate_refuses_a_window_stacked_for_another_replica_count():
  mesh = MESHES["auto"]()
  w, batch = _plain_batch(mesh)
  small = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  state = wa.init(
    jax.device_put(w, NamedSharding(small, P())), axis_name="data"
  )
  f = wa.microbatched_value_and_grad(
    _plain_loss,
    K,
    mode="sum",
    axis_name="data",
  )
  with pytest.raises(
    Error, match=r"'data': 2 Auto.*called on mesh \{'data': 8"
  ):
    f.accumulate(state, w, batch)


def test_peek_mean_reads_a_stacked_window_whole_and_per_block():
  """A stacked window (per-replica sums) knows it is one: peek_mean under
  plain jit (or eagerly) reduces it once, and inside shard_map each block
  gives the same global mean."""
  mesh = MESHES["auto"]()
  w, x, y, m = _data(5)
  batch = mesh.put({"x": x.T, "y": y, "m": m}, P("data"))
  wp = mesh.put(w, P())
  f = wa.microbatched_value_and_grad(
    _plain_loss,
    K,
    mode="sum",
    axis_name="data",
  )
  state = jax.jit(lambda s, w, b: f.accumulate(s, w, b)[1])(
    wa.init(wp, axis_name="data"), wp, batch
  )
  xt = np.asarray(x, np.float64)
  ref = 2 * xt @ (np.asarray(m, np.float64) * (w @ xt)) / m.sum()
  for peek in (wa.peek_mean, jax.jit(wa.peek_mean)):
    np.testing.assert_allclose(peek(state).grads, ref, rtol=1e-5)
  sp = dist.window_specs(state)
  read = jax.jit(
    jax.shard_map(
      lambda s: wa.peek_mean(s).grads,
      mesh=mesh.mesh,
      in_specs=(sp,),
      out_specs=P(),
    )
  )
  np.testing.assert_allclose(read(state), ref, rtol=1e-5)


@pytest.mark.parametrize("name", ["auto", "explicit"])
def test_an_eager_call_compiles_one_program(name):
  """An eager call compiles the one program it runs (an eager shard_map
  compiled each of its hundreds of operations, every call), nothing kept:
  the second call with new values compiles one and is exact."""
  mesh = MESHES[name]()
  w, x, y, m = _data()
  f = wa.microbatched_value_and_grad(
    lambda p, b: (
      jnp.sum(b["m"] * (p @ b["x"] - b["y"]) ** 2),
      jnp.sum(b["m"]),
    ),
    K,
    mode="sum",
    axis_name="data",
    batch_argnums={1: -1},
  )

  def batch(x, y, m):
    return {
      "x": mesh.put(x, P(None, "data")),
      **mesh.put({"y": y, "m": m}, P("data")),
    }

  with mesh.context():
    p = mesh.put(jnp.asarray(w), P())
    f(p, batch(x, y, m))
    x2 = x[::-1].copy()
    with Compiles() as c:
      _, out = f(p, batch(x2, y, m))
      jax.block_until_ready(out)
    assert c.n <= 1
    np.testing.assert_allclose(out.grads, _ref_grad(w, x2, y, m), rtol=1e-5)
    # f.accumulate into a stacked window, eagerly: the same.
    state = wa.init(p, axis_name="data")
    for rows in (x, x2):
      _, state = f.accumulate(state, p, batch(rows, y, m))
    with Compiles() as c:
      _, state = f.accumulate(state, p, batch(x, y, m))
      jax.block_until_ready(state)
    assert c.n <= 1
    tx = optax.sgd(1.0)
    new, *_ = wa.apply_window(tx, state, p, tx.init(p))
  both = np.concatenate([x, x2, x], axis=1), np.tile(y, 3), np.tile(m, 3)
  np.testing.assert_allclose(
    w - np.asarray(new), _ref_grad(w, *both), rtol=1e-5
  )


def test_a_python_float_param_with_data_axes():
  """A Python float as the differentiated argument (as jax.grad takes it),
  eagerly and under jit, with data_axes: the full-batch gradient."""
  mesh = MESHES["auto"]()
  x = np.arange(ROWS, dtype=np.float32) / ROWS
  m = (np.arange(ROWS) % 3 != 0).astype(np.float32)
  f = wa.microbatched_value_and_grad(
    lambda w, x, m: (jnp.sum(m * (x * w) ** 2), jnp.sum(m)),
    K,
    mode="sum",
    batch_argnums=(1, 2),
    axis_name="data",
  )
  ref = 2 * 1.5 * float(np.sum(m * x.astype(np.float64) ** 2) / m.sum())
  xs, ms = mesh.put(x, P("data")), mesh.put(m, P("data"))
  for g in (f, jax.jit(f)):
    _, out = g(1.5, xs, ms)
    np.testing.assert_allclose(float(out.grads), ref, rtol=1e-6)
