"""The window functions that take a tree, on an Equinox model's trainable
half (``eqx.filter(model, eqx.is_array)``, ``None`` where a leaf is static):
``peek_mean`` and ``discard`` of a functional window and of the optax
wrapper's state, ``window_counters``/``has_updated``, and ``apply_window``
of an in-step result. References: ``eqx.filter_grad`` per microbatch and
optax's Adam on their weighted mean."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import weighted_accum as wa

TX = optax.adam(0.05)


class _Net(eqx.Module):
  lin: eqx.nn.Linear
  act: object  # a static leaf: a function

  def __init__(self, key):
    self.lin = eqx.nn.Linear(3, 2, key=key)
    self.act = jnp.tanh

  def __call__(self, x):
    return self.act(self.lin(x))


def _model():
  return _Net(jax.random.key(0))


def _micro(seed, n=4):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((n, 2)), jnp.float32)
  m = jnp.asarray(rng.integers(1, 3, n), jnp.float32)
  return x, y, m


def _sum_loss(model, x, y, m):
  return jnp.sum(m[:, None] * (jax.vmap(model)(x) - y) ** 2)


def _grad(model, mb):
  """The microbatch's loss-sum gradient, as Equinox computes it."""
  return eqx.filter_grad(_sum_loss)(model, *mb)


def _mean(model, mbs):
  total = sum(float(mb[2].sum()) for mb in mbs)
  gs = [_grad(model, mb) for mb in mbs]
  return jax.tree.map(lambda *g: sum(g) / total, *gs)


def _close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_peek_mean_and_discard_of_a_functional_window():
  model = _model()
  params = eqx.filter(model, eqx.is_array)
  mbs = [_micro(s) for s in range(3)]
  state = wa.init(params)
  for mb in mbs[:2]:
    state = wa.accumulate_sum(state, _grad(model, mb), mb[2].sum())
  peek = wa.peek_mean(state)
  assert peek.grads.act is None
  _close(peek.grads, _mean(model, mbs[:2]))
  state = wa.discard(state)
  assert jax.tree.structure(state.grads) == jax.tree.structure(params)
  state = wa.accumulate_sum(state, _grad(model, mbs[2]), mbs[2][2].sum())
  out, _ = wa.finish_mean(state)
  _close(out.grads, _mean(model, mbs[2:]))


def test_wrapper_state_reads_and_discard():
  model = _model()
  params = eqx.filter(model, eqx.is_array)
  tx = wa.WeightedMultiSteps(TX, 2, mode="sum")
  state = tx.init(params)
  mbs = [_micro(s) for s in range(3)]
  _, state = tx.update(
    _grad(model, mbs[0]), state, params, weight=mbs[0][2].sum()
  )
  c = wa.window_counters(state)
  assert (int(c["mini_step"]), c["total_weight"]) == (1, float(mbs[0][2].sum()))
  assert not bool(wa.has_updated(state))
  _close(wa.peek_mean(state).grads, _mean(model, mbs[:1]))
  state = wa.discard(state)  # the first microbatch is dropped
  for mb in mbs[1:]:
    updates, state = tx.update(
      _grad(model, mb), state, params, weight=mb[2].sum()
    )
  assert bool(wa.has_updated(state))
  want, _ = TX.update(_mean(model, mbs[1:]), TX.init(params), params)
  _close(updates, want)


def test_apply_window_of_an_in_step_result():
  model = _model()
  x, y, m = (jnp.concatenate(t) for t in zip(*[_micro(s) for s in range(2)]))

  def loss(model, x, y, m):
    return _sum_loss(model, x, y, m), m.sum()

  f = wa.microbatched_value_and_grad(
    loss, 2, mode="sum", batch_argnums=(1, 2, 3)
  )

  @eqx.filter_jit
  def step(model, opt_state, x, y, m):
    _, out = f(model, x, y, m)
    params, static = eqx.partition(model, eqx.is_array)
    params, opt_state, _, out = wa.apply_window(TX, out, params, opt_state)
    return eqx.combine(params, static), opt_state, out

  opt_state = TX.init(eqx.filter(model, eqx.is_array))
  new, new_state, out = step(model, opt_state, x, y, m)
  ref = eqx.filter_grad(lambda mo: _sum_loss(mo, x, y, m) / m.sum())(model)
  _close(out.grads, ref)
  u, _ = TX.update(ref, opt_state, eqx.filter(model, eqx.is_array))
  _close(eqx.filter(new, eqx.is_array), eqx.apply_updates(model, u))
  same, same_state, out = step(new, new_state, x, y, jnp.zeros_like(m))
  assert not bool(out.valid)
  bits = lambda t: [np.asarray(v).tobytes() for v in jax.tree.leaves(t)]
  assert bits(eqx.filter(same, eqx.is_array)) == bits(
    eqx.filter(new, eqx.is_array)
  )
  assert bits(same_state) == bits(new_state)
