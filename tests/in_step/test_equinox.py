"""Equinox as its users write it, against Equinox's own filtered autodiff
(``eqx.filter_value_and_grad`` / ``eqx.filter_grad`` of the full batch, or
of the same microbatches by hand where dropout keys or ``eqx.nn.State``
make the split matter), over several Adam windows: the functional API with
``eqx.filter_jit`` donation, ``WeightedMultiSteps``, and in-step
microbatching of a whole module (its static half held fixed). Also the
docs page ``docs/equinox.md`` (run by tests/project/test_readme.py)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import weighted_accum as wa

K = 4


class _MLP(eqx.Module):
  """A module with a static half: a function leaf, a float hyperparameter,
  an int counter and a bool flag, besides its floating weights."""

  hidden: eqx.nn.Linear
  out: eqx.nn.Linear
  act: object
  rate: float
  steps: jax.Array
  flag: jax.Array

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.hidden = eqx.nn.Linear(3, 8, key=k1)
    self.out = eqx.nn.Linear(8, 1, key=k2)
    self.act = jax.nn.tanh
    self.rate = 0.3
    self.steps = jnp.int32(0)
    self.flag = jnp.bool_(True)

  def __call__(self, x, key=None):
    h = self.act(self.hidden(x))
    if key is not None:
      h = (
        h * jax.random.bernoulli(key, 1 - self.rate, h.shape) / (1 - self.rate)
      )
    return self.out(h)[0]


def _data(seed, n=16):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, 3)).astype(np.float32)
  mask = (rng.random(n) < 0.7).astype(np.float32)
  mask[0] = 1.0
  return jnp.asarray(x), jnp.asarray(x.sum(1)), jnp.asarray(mask)


def sum_loss(model, x, y, mask, key=None):
  keys = None if key is None else jax.random.split(key, x.shape[0])
  pred = jax.vmap(model)(x, keys)
  return jnp.sum(mask * (pred - y) ** 2)


def _trainable(model):
  return eqx.filter(model, eqx.is_inexact_array)


def rel_err(got, want):
  diff = max(
    float(jnp.max(jnp.abs(g - r)))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )
  return diff / max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(want))


def test_init_refuses_int_and_bool_fields_naming_the_filter():
  model = _MLP(jax.random.key(0))
  with pytest.raises(wa.WeightedAccumulationError) as e:
    wa.init(eqx.filter(model, eqx.is_array))
  assert ".steps" in str(e.value) and "eqx.is_inexact_array" in str(e.value)
  state = wa.init(_trainable(model))
  assert jax.tree.structure(state.grads) == jax.tree.structure(
    _trainable(model)
  )


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("jit", [False, True])
def test_a_whole_module_is_differentiated_like_filter_value_and_grad(mode, jit):
  model = _MLP(jax.random.key(1))
  x, y, mask = _data(2)

  def loss(m, x, y, mask):
    s = sum_loss(m, x, y, mask)
    return (s if mode == "sum" else s / mask.sum()), mask.sum()

  f = wa.microbatched_value_and_grad(
    loss, K, mode=mode, batch_argnums=(1, 2, 3)
  )
  f = eqx.filter_jit(f) if jit else f
  value, out = f(model, x, y, mask)
  ref_value, ref = eqx.filter_value_and_grad(
    lambda m: sum_loss(m, x, y, mask) / mask.sum()
  )(model)
  assert jax.tree.structure(out.grads) == jax.tree.structure(ref)
  assert out.grads.act is None and out.grads.rate is None
  assert out.grads.steps is None and out.grads.flag is None
  assert rel_err(out.grads, ref) < 1e-5
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)


def test_apply_window_takes_the_whole_module_with_an_in_step_result():
  """apply_window(tx, out, model, ...) with an in-step result of a whole
  module: its int, bool, Python-float and function leaves are held (no
  "params given to init" refusal); the floating leaves take Adam's step
  on eqx.filter_grad's full-batch gradient."""
  model = _MLP(jax.random.key(4))
  x, y, mask = _data(5)

  def loss(m, x, y, mask):
    return sum_loss(m, x, y, mask), mask.sum()

  f = wa.microbatched_value_and_grad(
    loss, K, mode="sum", batch_argnums=(1, 2, 3)
  )
  tx = optax.adam(0.1)
  opt = tx.init(_trainable(model))
  _, out = f(model, x, y, mask)
  new, _, _, _ = wa.apply_window(tx, out, model, opt)
  g = eqx.filter_grad(lambda m: sum_loss(m, x, y, mask) / mask.sum())(model)
  updates, _ = tx.update(g, opt, _trainable(model))
  ref = eqx.apply_updates(model, updates)
  assert new.act is model.act and new.rate == 0.3 and type(new.rate) is float
  assert new.steps is model.steps and new.flag is model.flag
  assert rel_err(_trainable(new), _trainable(ref)) < 1e-5


def test_the_static_half_as_an_argument_passed_unchanged():
  model = _MLP(jax.random.key(2))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  x, y, mask = _data(3)

  def loss(params, static, x, y, mask):
    return sum_loss(eqx.combine(params, static), x, y, mask), mask.sum()

  f = wa.microbatched_value_and_grad(
    loss, K, mode="sum", batch_argnums=(2, 3, 4)
  )
  _, out = eqx.filter_jit(f)(params, static, x, y, mask)
  ref = eqx.filter_grad(lambda m: sum_loss(m, x, y, mask) / mask.sum())(model)
  assert rel_err(out.grads, ref) < 1e-5


def test_accumulate_a_whole_module_into_a_window_from_the_trainable_half():
  model = _MLP(jax.random.key(3))
  (x1, y1, m1), (x2, y2, m2) = _data(4), _data(5)
  f = wa.microbatched_value_and_grad(
    lambda m, x, y, mask: (sum_loss(m, x, y, mask), mask.sum()),
    K,
    mode="sum",
    batch_argnums=(1, 2, 3),
  )
  acc = eqx.filter_jit(f.accumulate)
  state = wa.init(_trainable(model))
  _, state = acc(state, model, x1, y1, m1)
  _, state = acc(state, model, x2, y2, m2)
  out, _ = wa.finish_mean(state)
  x, y, m = (jnp.concatenate(a) for a in ((x1, x2), (y1, y2), (m1, m2)))
  ref = eqx.filter_grad(lambda mdl: sum_loss(mdl, x, y, m) / m.sum())(model)
  assert rel_err(out.grads, ref) < 1e-5


def _adam_windows(model, windows, lr=0.02):
  """The reference: Adam on each window's full-batch mean gradient."""
  tx = optax.adam(lr)
  opt = tx.init(_trainable(model))
  for window in windows:
    x, y, m = (jnp.concatenate(a) for a in zip(*window))
    g = eqx.filter_grad(
      lambda mdl, x=x, y=y, m=m: sum_loss(mdl, x, y, m) / m.sum()
    )(model)
    updates, opt = tx.update(g, opt, _trainable(model))
    model = eqx.apply_updates(model, updates)
  return model


def test_functional_api_with_filter_jit_donation_over_adam_windows():
  model = _MLP(jax.random.key(4))
  tx = optax.adam(0.02)
  params, static = eqx.partition(model, eqx.is_inexact_array)
  opt_state, state = tx.init(params), wa.init(params)

  @eqx.filter_jit(donate="all-except-first")
  def accumulate(params, state, static, x, y, mask):
    grads = eqx.filter_grad(sum_loss)(eqx.combine(params, static), x, y, mask)
    return wa.accumulate_sum(state, grads, mask.sum())

  @eqx.filter_jit(donate="all")
  def apply(params, opt_state, state):
    return wa.apply_window(tx, state, params, opt_state)

  windows = [[_data(10 * w + i) for i in range(3)] for w in range(3)]
  for window in windows:
    for mb in window:
      old = state
      state = accumulate(params, state, static, *mb)
      assert old.grads.hidden.weight.is_deleted()  # donated: in place
    params, opt_state, state, out = apply(params, opt_state, state)
    assert bool(out.valid)
  # A fresh copy: the donating close consumed the first model's arrays.
  ref = _adam_windows(_MLP(jax.random.key(4)), windows)
  assert rel_err(params, _trainable(ref)) < 1e-5


def test_weighted_multi_steps_over_adam_windows():
  model = _MLP(jax.random.key(5))
  tx = wa.WeightedMultiSteps(optax.adam(0.02), 2, mode="mean")
  opt_state = tx.init(_trainable(model))

  @eqx.filter_jit
  def step(model, opt_state, x, y, mask):
    grads = eqx.filter_grad(lambda m: sum_loss(m, x, y, mask) / mask.sum())(
      model
    )
    updates, opt_state = tx.update(
      grads, opt_state, _trainable(model), weight=mask.sum()
    )
    return eqx.apply_updates(model, updates), opt_state

  windows = [[_data(40 + 2 * w + i) for i in range(2)] for w in range(3)]
  trained = model
  for window in windows:
    for mb in window:
      trained, opt_state = step(trained, opt_state, *mb)
  assert int(opt_state.gradient_step) == 3
  ref = _adam_windows(model, windows)
  assert rel_err(_trainable(trained), _trainable(ref)) < 1e-5
  assert trained.act is jax.nn.tanh and int(trained.steps) == 0


def test_in_step_dropout_key_per_microbatch_over_adam_windows():
  tx = optax.adam(0.02)
  f = wa.microbatched_value_and_grad(
    lambda m, x, y, mask, key: (sum_loss(m, x, y, mask, key), mask.sum()),
    K,
    mode="sum",
    batch_argnums=(1, 2, 3),
    key_argnums=4,
  )

  @eqx.filter_jit
  def step(model, opt, x, y, mask, key):
    _, out = f(model, x, y, mask, key)
    updates, opt = tx.update(out.grads, opt, _trainable(model))
    return eqx.apply_updates(model, updates), opt

  model = ref = _MLP(jax.random.key(6))
  opt = ref_opt = tx.init(_trainable(model))
  for s in range(3):
    (x, y, m), key = _data(60 + s), jax.random.key(300 + s)
    model, opt = step(model, opt, x, y, m, key)
    g = None
    for k in range(K):
      gk = eqx.filter_grad(sum_loss)(
        ref, x[k::K], y[k::K], m[k::K], jax.random.fold_in(key, k)
      )
      g = gk if g is None else jax.tree.map(jnp.add, g, gk)
    total = m.sum()
    g = jax.tree.map(lambda a, n=total: a / n, g)
    updates, ref_opt = tx.update(g, ref_opt, _trainable(ref))
    ref = eqx.apply_updates(ref, updates)
  assert rel_err(_trainable(model), _trainable(ref)) < 1e-5


class _BNNet(eqx.Module):
  lin: eqx.nn.Linear
  bn: eqx.nn.BatchNorm
  out: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.lin = eqx.nn.Linear(3, 8, use_bias=False, key=k1)
    self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="batch")
    self.out = eqx.nn.Linear(8, 1, key=k2)

  def __call__(self, x, state):
    h, state = self.bn(self.lin(x), state)
    return self.out(jax.nn.relu(h))[0], state


def _bn_loss(model, x, y, mask, state):
  pred, state = jax.vmap(
    model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
  )(x, state)
  return (jnp.sum(mask * (pred - y) ** 2), mask.sum()), state


def test_eqx_nn_state_through_the_loop_over_adam_windows():
  model, state = eqx.nn.make_with_state(_BNNet)(jax.random.key(7))
  tx = optax.adam(0.02)
  f = wa.microbatched_value_and_grad(
    _bn_loss, K, mode="sum", batch_argnums=(1, 2, 3), state_argnums=4
  )

  @eqx.filter_jit
  def step(model, opt, state, x, y, mask):
    (_, out), state = f(model, x, y, mask, state)
    updates, opt = tx.update(out.grads, opt, _trainable(model))
    return eqx.apply_updates(model, updates), opt, state

  ref, ref_state = model, state
  opt = ref_opt = tx.init(_trainable(model))
  for s in range(3):
    x, y, m = _data(80 + s)
    model, opt, state = step(model, opt, state, x, y, m)
    g, w = None, 0.0
    for k in range(K):

      def loss(mdl, k=k, st=ref_state, x=x, y=y, m=m):
        (total, n), new = _bn_loss(mdl, x[k::K], y[k::K], m[k::K], st)
        return total, (n, new)

      gk, (n, ref_state) = eqx.filter_grad(loss, has_aux=True)(ref)
      g = gk if g is None else jax.tree.map(jnp.add, g, gk)
      w += float(n)
    g = jax.tree.map(lambda a, w=w: a / w, g)
    updates, ref_opt = tx.update(g, ref_opt, _trainable(ref))
    ref = eqx.apply_updates(ref, updates)
  assert rel_err(_trainable(model), _trainable(ref)) < 1e-5
  floats = lambda t: eqx.filter(t, eqx.is_inexact_array)
  assert rel_err(floats(state), floats(ref_state)) < 1e-5
