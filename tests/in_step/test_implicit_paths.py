"""Nothing implicit changes an in-step result: an eager call runs the
program of its own trace (a changed closure is seen; a call compiles one
program at most), no layout is inferred from the batch's type, and each
(replica, microbatch) draws its own key in every style. References: float64
NumPy on the full batch, or the same call on one device."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from _helpers import Compiles
import weighted_accum as wa

N, D, ROWS, K = 8, 3, 32, 2
Error = wa.WeightedAccumulationError


def _mesh(kind):
  return jax.make_mesh((N,), ("data",), axis_types=(kind,))


AUTO, EXPLICIT = _mesh(AxisType.Auto), _mesh(AxisType.Explicit)


def _data(seed=0):
  r = np.random.default_rng(seed)
  x = r.integers(-2, 3, size=(ROWS, D)).astype(np.float32)
  y = r.integers(-2, 3, size=ROWS).astype(np.float32)
  m = (r.random(ROWS) < 0.7).astype(np.float32)
  w = (r.integers(-4, 5, size=D) / 4).astype(np.float32)
  return w, {"x": x, "y": y, "m": m}


def _put(mesh, tree, spec):
  with jax.set_mesh(mesh):
    return jax.device_put(tree, NamedSharding(mesh, spec))


def _scaled_loss(w, b, c):
  return jnp.sum(b["m"] * (c * (b["x"] @ w) - b["y"]) ** 2), jnp.sum(b["m"])


def _ref(w, b, c):
  """d/dw of sum(m * (c x.w - y)**2) / sum(m), float64."""
  x, y, m = (np.asarray(b[k], np.float64) for k in "xym")
  r = c * (x @ np.float64(w)) - y
  return 2.0 * c * x.T @ (m * r) / m.sum()


class _Holder:
  def __init__(self):
    self.c = 1.0

  def loss(self, w, b):
    return _scaled_loss(w, b, self.c)


def _closure(kind):
  """A loss reading ``c`` from outside, and a setter of ``c``."""
  if kind == "method":
    h = _Holder()
    return h.loss, lambda v: setattr(h, "c", v)
  if kind == "dict":
    g = {"c": 1.0}
    return (lambda w, b: _scaled_loss(w, b, g["c"])), (
      lambda v: g.__setitem__("c", v)
    )
  c = 1.0 if kind == "python" else jnp.float32(1.0)

  def loss(w, b):
    return _scaled_loss(w, b, c)

  def set_c(v):
    nonlocal c
    c = v if kind == "python" else jnp.float32(v)

  return loss, set_c


def _caller(style, loss):
  """The eager call of ``style`` (one function, called again): its mean
  gradient."""
  if style == "explicit_no_axis":  # the batch typed over the data axis
    f = wa.microbatched_value_and_grad(loss, K, mode="sum")

    def call(w, b):
      with jax.set_mesh(EXPLICIT):
        wp, bp = _put(EXPLICIT, w, P()), _put(EXPLICIT, b, P("data"))
        return f(wp, bp)[1].grads

    return call
  f = wa.microbatched_value_and_grad(loss, K, mode="sum", axis_name="data")

  def call(w, b):
    wp, bp = _put(AUTO, w, P()), _put(AUTO, b, P("data"))
    if style == "axis_name":
      return f(wp, bp)[1].grads
    _, st = f.accumulate(wa.init(wp, axis_name="data"), wp, bp)
    return wa.finish_mean(st)[0].grads

  return call


@pytest.mark.parametrize("kind", ["python", "dict", "array", "method"])
@pytest.mark.parametrize(
  "style", ["axis_name", "accumulate", "explicit_no_axis"]
)
def test_an_eager_call_sees_what_loss_fn_closes_over_now(style, kind):
  loss, set_c = _closure(kind)
  call = _caller(style, loss)
  w, b = _data()
  for c in (1.0, 2.0):
    set_c(c)
    np.testing.assert_allclose(call(w, b), _ref(w, b, c), rtol=1e-5, atol=1e-6)


def test_a_python_float_keyword_is_traced_and_used():
  """Eagerly with axis_name, a new value of a Python float keyword is used,
  each call compiling the one program it runs."""
  f = wa.microbatched_value_and_grad(
    lambda w, b, *, c: _scaled_loss(w, b, c), K, mode="sum", axis_name="data"
  )
  w, b = _data(1)
  wp, bp = _put(AUTO, w, P()), _put(AUTO, b, P("data"))
  jax.block_until_ready(f(wp, bp, c=1.0))
  for c in (0.5, 3.0):
    with Compiles() as n:
      got = jax.block_until_ready(f(wp, bp, c=c)[1].grads)
    assert n.n <= 1
    np.testing.assert_allclose(got, _ref(w, b, c), rtol=1e-5)


def _centred_loss(w, b):
  """Centres by the microbatch's mean prediction; weight 1 per microbatch."""
  pred = b["x"] @ w
  return jnp.mean((pred - pred.mean() - b["y"]) ** 2), jnp.float32(1.0)


def test_no_axis_name_sees_the_global_batch_on_an_explicit_mesh():
  """A batch typed over a data axis does not make f per replica: the
  result is the same call's on one device (equal weights of 1 per
  microbatch: total weight K, not N x K)."""
  f = wa.microbatched_value_and_grad(_centred_loss, K, mode="mean")
  w, b = _data(2)
  loss1, one = jax.jit(f)(w, b)
  with jax.set_mesh(EXPLICIT):
    wp, bp = _put(EXPLICIT, w, P()), _put(EXPLICIT, b, P("data"))
    for g in (f, jax.jit(f)):
      loss, out = g(wp, bp)
      assert float(out.weight) == K and int(out.issued) == K
      np.testing.assert_allclose(out.grads, one.grads, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(loss, loss1, rtol=1e-5)


def test_no_axis_name_inside_shard_map_names_the_mismatch():
  f = wa.microbatched_value_and_grad(
    lambda w, b: _scaled_loss(w, b, 1.0), K, mode="sum"
  )
  w, b = _data(3)
  g = jax.shard_map(
    lambda w, b: f(w, b)[1].grads,
    mesh=AUTO,
    in_specs=(P(), P("data")),
    out_specs=P(),
  )
  with pytest.raises(Error, match=r"varies over \('data',\).*axis_name"):
    jax.jit(g)(_put(AUTO, w, P()), _put(AUTO, b, P("data")))


def _noisy_loss(w, key, b):
  noise = jax.random.normal(key, b["y"].shape)
  loss, weight = _scaled_loss(w, b, 1.0)
  return (loss, weight), noise


def test_each_replica_and_microbatch_draws_its_own_key_in_both_styles():
  """Plain jit with axis_name and jax.shard_map draw the same K x N
  distinct masks (one rule: the key folded with the replica's index, then
  the microbatch's)."""
  f = wa.microbatched_value_and_grad(
    _noisy_loss,
    K,
    mode="sum",
    has_aux=True,
    batch_argnums=2,
    key_argnums=1,
    axis_name="data",
  )
  w, b = _data(4)
  wp, bp, key = _put(AUTO, w, P()), _put(AUTO, b, P("data")), jax.random.key(0)
  (_, plain), out = jax.jit(f)(wp, key, bp)
  plain = np.asarray(plain)  # [K, N, rows of a replica's microbatch]
  assert len({tuple(r) for r in plain.reshape(K * N, -1).round(6)}) == K * N
  mapped = jax.jit(
    jax.shard_map(
      lambda w, key, b: f(w, key, b)[0][1],
      mesh=AUTO,
      in_specs=(P(), P(), P("data")),
      out_specs=P(None, "data"),
    )
  )(wp, key, bp)
  np.testing.assert_array_equal(np.asarray(mapped), plain.reshape(K, -1))
  np.testing.assert_allclose(out.grads, _ref(w, b, 1.0), rtol=1e-5)


class _DropNet(nnx.Module):
  def __init__(self):
    rngs = nnx.Rngs(0, dropout=1)
    self.lin = nnx.Linear(D, 1, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.lin(x))[:, 0]


def _drop_loss(model, b):
  out = model(b["x"])
  return (jnp.sum(out**2), jnp.float32(b["x"].shape[0])), out


def _rng(model):
  return nnx.state(model, nnx.RngState)


def test_a_module_with_a_dropout_stream_draws_per_replica_in_both_styles():
  """A whole NNX module with a dropout stream, with axis_name: under plain
  jit and inside jax.shard_map the same K x N distinct masks, and the
  stream's count advanced by K and written back (its key unchanged)."""
  f = wa.microbatched_value_and_grad(
    _drop_loss, K, mode="sum", has_aux=True, axis_name="data"
  )
  b = _put(AUTO, {"x": jnp.ones((N * K * 32, D))}, P("data"))
  plain_model, mapped_model = _DropNet(), _DropNet()
  key0 = jax.random.key_data(_rng(plain_model)["drop"]["rngs"]["key"][...])

  @nnx.jit
  def plain(model, b):
    (_, out), _ = f(model, b)
    return out

  gd, st = nnx.split(mapped_model)

  def body(st, b):
    model = nnx.merge(gd, st)
    (_, out), _ = f(model, b)
    return out, nnx.state(model)

  one = plain(plain_model, b)  # [K, N, rows of a replica's microbatch]
  many, st = jax.jit(
    jax.shard_map(
      body,
      mesh=AUTO,
      in_specs=(P(), P("data")),
      out_specs=(P(None, "data"), P()),
    )
  )(st, b)
  nnx.update(mapped_model, st)
  masks = np.asarray(one).reshape(K * N, -1) != 0
  assert len({tuple(r) for r in masks}) == K * N
  np.testing.assert_array_equal(
    np.asarray(many), np.asarray(one).reshape(K, -1)
  )
  for model in (plain_model, mapped_model):
    rng = _rng(model)["drop"]["rngs"]
    assert int(rng["count"][...]) == K
    np.testing.assert_array_equal(jax.random.key_data(rng["key"][...]), key0)
