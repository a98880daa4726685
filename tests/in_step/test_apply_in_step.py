"""An in-step result applied in one call: ``wa.apply_window(tx, out, params,
opt_state)`` applies ``tx`` to the microbatched mean gradient only when
``out.valid``. Two Adam steps agree with optax on the full batch's gradient;
an all-padding batch leaves params, optimizer state and step count
bit-identical, where a plain ``tx.update`` moves them (AdamW's momentum and
weight decay). ``nnx.Optimizer`` does the same with ``nnx.cond`` on
``out.valid`` around ``optimizer.update``."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _helpers import rel_err
import weighted_accum as wa

D, B, K = 3, 16, 4
TX = optax.adamw(0.05, weight_decay=0.1)


def _batch(seed, padding=False):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
  y = jnp.asarray(rng.standard_normal(B), jnp.float32)
  m = jnp.asarray(rng.integers(0, 3, B), jnp.float32)  # unequal weights
  return x, y, jnp.zeros_like(m) if padding else m


def _loss(params, batch):
  x, y, m = batch
  pred = jnp.tanh(x @ params["w"]) + params["b"]
  return jnp.sum(m * (pred - y) ** 2), jnp.sum(m)


def _full_grad(params, batch):
  return jax.grad(lambda p: _loss(p, batch)[0] / jnp.sum(batch[2]))(params)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _params():
  rng = np.random.default_rng(7)
  return {
    "w": jnp.asarray(rng.standard_normal(D), jnp.float32),
    "b": jnp.zeros((), jnp.float32),
  }


def test_two_adam_windows_then_an_all_padding_batch():
  f = wa.microbatched_value_and_grad(_loss, K, mode="sum")

  @jax.jit
  def step(params, opt_state, batch):
    _, out = f(params, batch)
    params, opt_state, _, out = wa.apply_window(TX, out, params, opt_state)
    return params, opt_state, out

  params = _params()
  opt_state = TX.init(params)
  ref_p, ref_s = params, opt_state
  for s in range(2):
    batch = _batch(s)
    g_ref = _full_grad(ref_p, batch)
    params, opt_state, out = step(params, opt_state, batch)
    assert bool(out.valid) and rel_err(out.grads, g_ref) < 1e-6
    u, ref_s = TX.update(g_ref, ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    assert rel_err(params, ref_p) < 1e-6
  assert int(opt_state[0].count) == 2

  empty = _batch(9, padding=True)
  new_p, new_s, out = step(params, opt_state, empty)
  assert not bool(out.valid)
  assert _bits(new_p) == _bits(params)
  assert _bits(new_s) == _bits(opt_state)  # Adam's count included
  # What the one call prevents: tx.update with the zero gradients moves.
  _, out = jax.jit(f)(params, empty)
  u, naive = TX.update(out.grads, opt_state, params)
  assert _bits(optax.apply_updates(params, u)) != _bits(params)
  assert int(naive[0].count) == 3


class _Model(nnx.Module):
  def __init__(self):
    p = _params()
    self.w = nnx.Param(p["w"])
    self.b = nnx.Param(p["b"])

  def __call__(self, x):
    return jnp.tanh(x @ self.w[...]) + self.b[...]


def _model_loss(model, batch):
  x, y, m = batch
  return jnp.sum(m * (model(x) - y) ** 2), jnp.sum(m)


def _update(optimizer, model, grads):
  optimizer.update(model, grads)


def test_nnx_optimizer_with_nnx_cond_on_valid():
  model = _Model()
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  f = wa.microbatched_value_and_grad(_model_loss, K, mode="sum")

  @nnx.jit
  def step(model, optimizer, batch):
    _, out = f(model, batch)
    nnx.cond(out.valid, _update, lambda *_: None, optimizer, model, out.grads)
    return out

  ref_p = _params()
  ref_s = TX.init(ref_p)
  for s in range(2):
    batch = _batch(s)
    g_ref = _full_grad(ref_p, batch)
    out = step(model, optimizer, batch)
    assert rel_err(nnx.to_pure_dict(out.grads), g_ref) < 1e-6
    u, ref_s = TX.update(g_ref, ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    assert rel_err(nnx.to_pure_dict(nnx.state(model, nnx.Param)), ref_p) < 1e-6
  before = _bits(nnx.state((model, optimizer)))
  out = step(model, optimizer, _batch(9, padding=True))
  assert not bool(out.valid)
  assert _bits(nnx.state((model, optimizer))) == before
  assert int(optimizer.step[...]) == 2


def test_nnx_optimizer_tx_through_apply_window():
  """The same through ``apply_window`` with the optimizer's own ``tx`` and
  its state, eagerly."""
  model = _Model()
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  f = wa.microbatched_value_and_grad(_model_loss, K, mode="sum")
  params = nnx.state(model, nnx.Param)
  _, out = nnx.jit(f)(model, _batch(9, padding=True))
  opt_state = nnx.as_pure(optimizer.opt_state)
  new_p, new_s, _, _ = wa.apply_window(
    optimizer.tx, out, nnx.as_pure(params), opt_state
  )
  assert _bits(new_p) == _bits(nnx.as_pure(params))
  assert _bits(new_s) == _bits(opt_state)


def test_in_step_result_refusals():
  params = _params()
  f = wa.microbatched_value_and_grad(_loss, K, mode="sum")
  _, out = f(params, _batch(0))
  opt_state = TX.init(params)
  with pytest.raises(wa.WeightedAccumulationError, match="next_loss_scale"):
    wa.apply_window(TX, out, params, opt_state, next_loss_scale=2.0)
  with pytest.raises(wa.WeightedAccumulationError, match="no gradients"):
    wa.apply_window(TX, out.replace(grads=None), params, opt_state)
  with pytest.raises(wa.WeightedAccumulationError, match="shape"):
    wa.apply_window(
      TX, out, {"w": jnp.zeros(D + 1), "b": jnp.zeros(())}, opt_state
    )
