"""``peek_mean`` and ``discard``: an open window read mid-window without
closing it, and an open window dropped, on the functional state, the optax
wrapper's state and ``nnx.Optimizer``'s, against full-batch gradients of the
rows seen and optax's Adam applied to them over several windows."""

from __future__ import annotations

from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from _helpers import loss_mean
from _helpers import loss_sum
from _helpers import make_params
from _helpers import max_rel_err
import weighted_accum as wa

SIZES = (5, 2, 7, 3)


def _rows(seed, sizes=SIZES, d=5):
  rng = np.random.default_rng(seed)
  out = []
  for n in sizes:
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    out.append((x, y, np.ones(n, np.float32)))
  return out


def _full_grad(params, mbs):
  """The reference: the gradient of the mean loss over all rows of ``mbs``."""
  x, y, m = (np.concatenate(a) for a in zip(*mbs))
  return jax.grad(loss_mean)(params, x, y, m)


def test_peek_mean_is_the_mean_so_far_and_leaves_the_window_open(variant):
  params = make_params(0)
  mbs = _rows(1)
  state = wa.init(params)
  add = variant(wa.accumulate_sum)
  peek = variant(wa.peek_mean)
  for i, mb in enumerate(mbs):
    state = add(state, jax.grad(loss_sum)(params, *mb), mb[2].sum())
    out = peek(state)
    assert max_rel_err(out.grads, _full_grad(params, mbs[: i + 1])) < 1e-5
    assert float(out.weight) == sum(SIZES[: i + 1]) and bool(out.valid)
    assert int(state.issued) == i + 1  # still open
  out, state = wa.finish_mean(state)
  assert max_rel_err(out.grads, _full_grad(params, mbs)) < 1e-5


def test_peek_mean_of_an_empty_window():
  state = wa.init({"w": jnp.zeros(2)})
  with pytest.raises(wa.WeightedAccumulationError, match="peek_mean"):
    wa.peek_mean(state)
  out = jax.jit(wa.peek_mean)(state)
  assert not bool(out.valid) and float(jnp.abs(out.grads["w"]).sum()) == 0


def test_peek_mean_divides_the_loss_scale_out():
  state = wa.init({"w": jnp.zeros(1)}, dtype=jnp.float16, loss_scale=2.0**10)
  g = {"w": jnp.array([2.0**10 * 3.0], jnp.float16)}  # scaled SUM grads
  state = wa.accumulate_sum(state, g, 4)
  assert wa.peek_mean(state).grads["w"].item() == 0.75


@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(0, 9))
def test_discard_drops_exactly_the_open_window(sizes, seed):
  """Windows before and after a discarded one are exact; the discarded
  one's rows leave no trace (hypothesis over the discarded sizes)."""
  params = make_params(2)
  bad = _rows(seed, [max(n, 1) for n in sizes])
  good = _rows(seed + 100)
  state = wa.init(params)
  for mb in bad:
    state = wa.accumulate_mean(state, jax.grad(loss_mean)(params, *mb), 3.0)
  state = wa.discard(state)
  assert state.total_weight == 0.0 and int(state.issued) == 0
  assert int(state.windows) == 1  # counted as closed, like a finish
  for mb in good:
    state = wa.accumulate_sum(
      state, jax.grad(loss_sum)(params, *mb), len(mb[0])
    )
  out, _ = wa.finish_mean(state)
  assert max_rel_err(out.grads, _full_grad(params, good)) < 1e-5


def test_discard_can_set_the_next_loss_scale():
  state = wa.accumulate_sum(wa.init({"w": jnp.zeros(1)}), {"w": jnp.ones(1)}, 1)
  state = jax.jit(wa.discard)(state, next_loss_scale=8.0)
  assert float(state.loss_scale) == 8.0
  with pytest.raises(wa.WeightedAccumulationError, match="next_loss_scale"):
    wa.discard(state, next_loss_scale=-1.0)
  with pytest.raises(wa.WeightedAccumulationError, match="AccumState"):
    wa.discard({"w": jnp.zeros(1)})


def _adam_reference(params, windows, lr=0.05):
  """optax.adam applied once per window to its full-batch gradient."""
  tx = optax.adam(lr)
  opt = tx.init(params)
  for mbs in windows:
    updates, opt = tx.update(_full_grad(params, mbs), opt, params)
    params = optax.apply_updates(params, updates)
  return params


def test_wrapper_peek_and_discard_over_adam_windows():
  """Peeks mid-window equal the full-batch gradient so far; a discarded
  window is never applied (Adam's state and step untouched), and the
  windows around it match Adam on their full-batch gradients."""
  params0 = make_params(3)
  tx = wa.WeightedMultiSteps(optax.adam(0.05), 2, mode="mean")
  step = jax.jit(
    lambda g, s, p, n: tx.update(g, s, p, weight=n), donate_argnums=1
  )
  params, state = params0, tx.init(params0)
  windows = [_rows(10, (4, 6)), _rows(11, (3, 5)), _rows(12, (7, 2))]
  for w, mbs in enumerate(windows):
    first = mbs[0]
    g = jax.grad(loss_mean)(params, *first)
    updates, state = step(g, state, params, len(first[0]))
    params = optax.apply_updates(params, updates)
    peeked = wa.peek_mean(state)
    assert max_rel_err(peeked.grads, _full_grad(params, mbs[:1])) < 1e-5
    if w == 1:  # drop this window: its first microbatch is bad data
      state = wa.discard(state)
      assert int(state.mini_step) == 0 and int(state.gradient_step) == 1
      continue
    second = mbs[1]
    g = jax.grad(loss_mean)(params, *second)
    updates, state = step(g, state, params, len(second[0]))
    params = optax.apply_updates(params, updates)
    assert bool(wa.has_updated(state))
  assert int(state.gradient_step) == 2
  ref = _adam_reference(params0, [windows[0], windows[2]])
  assert max_rel_err(params, ref) < 1e-5


def test_wrapper_discard_with_a_dynamic_scale_refuses_a_next_scale():
  tx = wa.WeightedMultiSteps(
    optax.sgd(0.1), 2, mode="sum", loss_scale=wa.DynamicLossScale(2.0**4)
  )
  state = tx.init({"w": jnp.zeros(2)})
  with pytest.raises(wa.WeightedAccumulationError, match="DynamicLossScale"):
    wa.discard(state, next_loss_scale=2.0)
  assert float(wa.window_counters(wa.discard(state))["loss_scale"]) == 16.0


def test_nnx_optimizer_peek_inside_and_outside_nnx_jit():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, wa.WeightedMultiSteps(optax.sgd(0.1), 3, mode="sum"), wrt=nnx.Param
  )
  _, params0 = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(4)
  xs = [rng.standard_normal((n, 3)).astype(np.float32) for n in (2, 5)]

  def sum_loss(m, x):
    return jnp.sum(m(x) ** 2)

  @nnx.jit
  def step(model, optimizer, x):
    grads = nnx.grad(sum_loss)(model, x)
    optimizer.update(model, grads, weight=x.shape[0])
    return wa.peek_mean(optimizer.opt_state).grads

  inside = step(model, optimizer, xs[0])
  inside = step(model, optimizer, xs[1])
  outside = wa.peek_mean(optimizer.opt_state).grads
  ref = jax.grad(
    lambda p: (
      sum_loss(nnx.merge(nnx.graphdef(model), p), np.concatenate(xs)) / 7
    )
  )(params0)
  assert max_rel_err(inside, ref) < 1e-5
  assert max_rel_err(outside, ref) < 1e-5


def test_peek_mean_inside_shard_map_is_the_global_mean():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  params = make_params(5)
  rng = np.random.default_rng(6)
  x = rng.standard_normal((4, 3, 5)).astype(np.float32)
  y = rng.standard_normal((4, 3)).astype(np.float32)
  m = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], np.float32)

  def per_replica(p, x, y, m):
    s = wa.init(p, axis_name="data")
    g = wa.distributed.local_grad(loss_sum, "data")(p, x[0], y[0], m[0])
    s = wa.accumulate_sum(s, g, m[0].sum())
    return wa.peek_mean(s).grads

  got = jax.jit(
    jax.shard_map(
      per_replica,
      mesh=mesh,
      in_specs=(P(), P("data"), P("data"), P("data")),
      out_specs=P(),
    )
  )(params, x, y, m)
  ref = jax.grad(loss_mean)(
    params, x.reshape(12, 5), y.reshape(12), m.reshape(12)
  )
  assert max_rel_err(got, ref) < 1e-5
