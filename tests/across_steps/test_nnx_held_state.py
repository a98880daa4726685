"""The window functions on the optax wrapper's state as Flax NNX holds it:
``nnx.Optimizer(...).opt_state`` (``nnx.Variable`` leaves) and
``nnx.state(optimizer)["opt_state"]`` (a nested ``nnx.State``). Reads agree
with the plain state driven alongside; ``discard`` gives the state back in
the caller's types, so the optimizer keeps working, and what it then applies
equals optax's Adam on the weighted mean of the kept microbatches."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _helpers import rel_err
import weighted_accum as wa

LR = 0.05


def _setup():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = wa.WeightedMultiSteps(optax.adam(LR), 2, mode="mean")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  return model, tx, optimizer


def _grads(model, seed):
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((4, 3)))
  return nnx.grad(lambda m: jnp.mean(m(x.astype(jnp.float32)) ** 2))(model)


def _plain(tree):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.State(tree)))


def _reads(state):
  c = wa.window_counters(state)
  return (
    {k: float(v) for k, v in c.items()},
    bool(wa.has_updated(state)),
    _plain(wa.peek_mean(state).grads),
  )


@pytest.mark.parametrize("held", ["opt_state", "nnx_state"])
def test_reads_agree_with_the_plain_state(held):
  model, tx, optimizer = _setup()
  params = nnx.state(model, nnx.Param)
  plain = tx.init(params)
  g = _grads(model, 0)
  optimizer.update(model, g, weight=3.0)
  _, plain = tx.update(g, plain, params, weight=3.0)
  state = optimizer.opt_state
  if held == "nnx_state":
    state = nnx.state(optimizer)["opt_state"]
    assert isinstance(state, nnx.State)
  got, want = _reads(state), _reads(plain)
  assert got[:2] == want[:2]
  jax.tree.map(np.testing.assert_array_equal, got[2], want[2])


def _adam_reference(params, grads_and_weights):
  """optax's Adam on the weighted mean of each window's gradients."""
  opt = optax.adam(LR)
  p = jax.tree.map(jnp.asarray, _plain(params))
  s = opt.init(p)
  for window in grads_and_weights:
    ws = [w for _, w in window]
    mean = jax.tree.map(
      lambda *gs, ws=ws: sum(w * g for g, w in zip(gs, ws)) / sum(ws),
      *[_plain(g) for g, _ in window],
    )
    u, s = opt.update(mean, s, p)
    p = optax.apply_updates(p, u)
  return p


@pytest.mark.parametrize("held", ["opt_state", "nnx_state", "nnx_jit"])
def test_discard_keeps_the_callers_types(held):
  model, _, optimizer = _setup()
  params0 = jax.tree.map(lambda v: v, nnx.state(model, nnx.Param))
  g0, g1, g2 = (_grads(model, s) for s in range(3))
  optimizer.update(model, g0, weight=5.0)  # dropped below
  if held == "opt_state":
    optimizer.opt_state = wa.discard(optimizer.opt_state)
    assert type(optimizer.opt_state.mini_step).__name__ == "OptArray"
  elif held == "nnx_state":
    st = nnx.state(optimizer)
    new = wa.discard(st["opt_state"])
    assert isinstance(new, nnx.State) and set(new) == set(st["opt_state"])
    st["opt_state"] = new
    nnx.update(optimizer, st)
  else:

    @nnx.jit
    def drop(optimizer):
      optimizer.opt_state = wa.discard(optimizer.opt_state)

    drop(optimizer)
  c = wa.window_counters(optimizer.opt_state)
  assert (int(c["mini_step"]), int(c["issued"]), c["total_weight"]) == (0, 0, 0)
  optimizer.update(model, g1, weight=1.0)
  optimizer.update(model, g2, weight=3.0)  # closes: Adam's first step
  assert bool(wa.has_updated(optimizer.opt_state))
  want = _adam_reference(params0, [[(g1, 1.0), (g2, 3.0)]])
  assert rel_err(_plain(nnx.state(model, nnx.Param)), want) < 1e-6


def test_discard_of_an_optimizer_state_with_next_loss_scale():
  model, _, optimizer = _setup()
  optimizer.update(model, _grads(model, 0), weight=2.0)
  optimizer.opt_state = wa.discard(optimizer.opt_state, next_loss_scale=8.0)
  assert float(wa.window_counters(optimizer.opt_state)["loss_scale"]) == 8.0
  optimizer.update(model, _grads(model, 1), weight=2.0)  # still works
