"""A whole ``nnx.Module`` as the differentiated argument of
``microbatched_value_and_grad``, threaded as ``nnx.value_and_grad`` threads
it: its ``nnx.Param`` state is differentiated, its other state (RNG streams,
batch statistics) runs through the microbatches and is written back. The
reference draws the same dropout masks from flax's own ``nnx.Dropout`` in
the same order and differentiates the full batch's loss."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _helpers import rel_err
import weighted_accum as wa

D, H, B, K = 3, 16, 8, 4


class _Net(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(D, H, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    self.out = nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.lin(x))))[:, 0]


def _loss(model, batch):
  x, y, m = batch
  return jnp.sum(m * (model(x) - y) ** 2), jnp.sum(m)


def _batch(seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
  y = jnp.asarray(rng.standard_normal(B), jnp.float32)
  m = jnp.asarray(rng.uniform(0.5, 2.0, B), jnp.float32)
  return x, y, m


def _masks(n):
  """The next ``n`` masks of a fresh ``Dropout(0.5, Rngs(dropout=0))``, as
  flax draws them (scaled by 1 / keep), one per call, for B / K rows."""
  probe = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
  return [probe(jnp.ones((B // K, H))) for _ in range(n)]


def _reference(params, graphdef, batch, masks):
  """The full batch's mean-loss gradient, microbatch k (rows k::K) under
  ``masks[k]``."""
  x, y, m = batch

  def loss(p):
    net = nnx.merge(
      graphdef, p, nnx.state(_Net(nnx.Rngs(0)), nnx.Not(nnx.Param))
    )
    total = 0.0
    for k in range(K):
      h = nnx.relu(net.lin(x[k::K])) * masks[k]
      pred = net.out(h)[:, 0]
      total += jnp.sum(m[k::K] * (pred - y[k::K]) ** 2)
    return total / jnp.sum(m)

  return jax.grad(loss)(params)


def _count(model):
  return int(model.drop.rngs.count[...])


def test_module_dropout_masks_differ_per_microbatch_and_step():
  model = _Net(nnx.Rngs(0))
  graphdef = nnx.graphdef(model)
  f = wa.microbatched_value_and_grad(_loss, K, mode="sum")
  masks = _masks(2 * K)
  assert not np.array_equal(masks[0], masks[1])  # a repeat would be caught
  for step in range(2):
    params = nnx.state(model, nnx.Param)
    batch = _batch(step)
    _, out = f(model, batch)
    assert isinstance(out.grads, nnx.State)
    ref = _reference(params, graphdef, batch, masks[step * K : (step + 1) * K])
    assert rel_err(out.grads, ref) < 1e-5
    wrong = _reference(params, graphdef, batch, [masks[step * K]] * K)
    assert rel_err(out.grads, wrong) > 1e-2  # one mask for all: not this
    assert _count(model) == (step + 1) * K  # written back, as nnx.grad


def test_module_under_nnx_jit_with_optimizer():
  """Inside ``nnx.jit`` the RNG count comes out too, and the grads (an
  ``nnx.State`` of the Params) go to ``nnx.Optimizer.update``."""
  model = _Net(nnx.Rngs(0))
  graphdef = nnx.graphdef(model)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  f = wa.microbatched_value_and_grad(_loss, K, mode="sum")

  @nnx.jit
  def step(model, optimizer, batch):
    _, out = f(model, batch)
    optimizer.update(model, out.grads)
    return out

  masks = _masks(2 * K)
  for s in range(2):
    params = jax.tree.map(lambda v: v, nnx.state(model, nnx.Param))  # a copy
    batch = _batch(s)
    out = step(model, optimizer, batch)
    ref = _reference(params, graphdef, batch, masks[s * K : (s + 1) * K])
    assert rel_err(out.grads, ref) < 1e-5
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, ref)
    assert rel_err(nnx.state(model, nnx.Param), want) < 1e-5
    assert _count(model) == (s + 1) * K


def test_module_batch_stats_are_threaded_not_differentiated():
  class BN(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D, 1, rngs=rngs)
      self.bn = nnx.BatchNorm(D, momentum=0.5, rngs=rngs)

    def __call__(self, x):
      return self.lin(self.bn(x))[:, 0]

  model = BN(nnx.Rngs(0))
  x, y, m = _batch(3)
  f = wa.microbatched_value_and_grad(_loss, K, mode="sum")
  _, out = f(model, (x, y, m))
  assert {path for path, _ in nnx.to_flat_state(out.grads)} == {
    ("bn", "bias"),
    ("bn", "scale"),
    ("lin", "bias"),
    ("lin", "kernel"),
  }
  mean = np.zeros(D)  # momentum 0.5 over microbatches 0..K-1, in order
  for k in range(K):
    mean = 0.5 * mean + 0.5 * np.asarray(x[k::K]).mean(0)
  np.testing.assert_allclose(model.bn.mean[...], mean, rtol=1e-5, atol=1e-6)


def test_state_with_rng_variables_is_refused():
  model = _Net(nnx.Rngs(0))
  f = wa.microbatched_value_and_grad(
    lambda s, b: _loss(nnx.merge(nnx.graphdef(model), s), b), K, mode="sum"
  )
  with pytest.raises(wa.WeightedAccumulationError, match="state_argnums"):
    f(nnx.state(model), _batch(0))


def test_module_with_batch_stats_refused_with_data_axes():
  """Under plain jit with axis_name each replica would move its own
  BatchNorm statistics: refused naming them (RNG streams are taken)."""
  model = _Net(nnx.Rngs(0))
  model.bn = nnx.BatchNorm(1, rngs=nnx.Rngs(0))
  f = wa.microbatched_value_and_grad(_loss, K, mode="sum", axis_name="data")
  with pytest.raises(wa.WeightedAccumulationError, match="BatchStat"):
    f(model, _batch(0))


def test_module_through_accumulate_spanning_two_calls():
  """``f.accumulate`` threads the stream across calls too: the window of
  two calls is the mean over both calls' microbatches, each with its own
  mask."""
  model = _Net(nnx.Rngs(0))
  graphdef = nnx.graphdef(model)
  params = jax.tree.map(lambda v: v, nnx.state(model, nnx.Param))
  f = wa.microbatched_value_and_grad(_loss, K, mode="sum")
  state = wa.init(params)
  batches = [_batch(5), _batch(6)]
  for b in batches:
    _, state = f.accumulate(state, model, b)
  assert _count(model) == 2 * K
  out, _ = wa.finish_mean(state)
  masks = _masks(2 * K)
  refs = [
    _reference(params, graphdef, b, masks[i * K : (i + 1) * K])
    for i, b in enumerate(batches)
  ]
  ws = [float(jnp.sum(b[2])) for b in batches]
  want = jax.tree.map(
    lambda a, c: (ws[0] * a + ws[1] * c) / sum(ws), refs[0], refs[1]
  )
  assert rel_err(out.grads, want) < 1e-5


class _Sowing(nnx.Module):
  def __init__(self):
    self.lin = nnx.Linear(D, 1, rngs=nnx.Rngs(0))

  def __call__(self, x):
    h = self.lin(x)[:, 0]
    self.sow(nnx.Intermediate, "h", h)
    return h


def test_module_that_sows_is_refused_naming_the_sown_state():
  """A module that sows adds state the loop cannot carry: the error names
  it (not a state the loss never returned) and its advice works: popped
  in loss_fn and returned as aux, the gradient is nnx.grad's of the full
  batch and the intermediates come stacked per microbatch."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((B, D)), jnp.float32)

  def loss(m, x):
    return jnp.sum(m(x)), jnp.float32(x.shape[0])

  f = wa.microbatched_value_and_grad(loss, K, mode="sum")
  with pytest.raises(wa.WeightedAccumulationError, match=r"sow: .*'h'.*pop"):
    f(_Sowing(), x)

  def popped(m, x):
    out = loss(m, x)
    return out, nnx.pop(m, nnx.Intermediate)["h"].value[0]

  g = wa.microbatched_value_and_grad(popped, K, mode="sum", has_aux=True)
  (_, aux), out = g(_Sowing(), x)
  ref = nnx.grad(lambda m: loss(m, x)[0] / B)(_Sowing())
  assert rel_err(out.grads, ref) < 1e-6
  np.testing.assert_allclose(aux, np.asarray(_Sowing()(x)).reshape(-1, K).T)
