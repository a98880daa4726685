"""A user's jitted step compiles once, whatever way its state was born.

``jax.jit`` keys its cache on each argument's commitment and sharding; a step
returns committed arrays as soon as one input is committed. A state born with
uncommitted scalars beside committed buffers made the second call compile
again. Each test runs the step three times from a freshly born state and
counts the executables in the step's cache (``_cache_size()``), for every
birth path and for uncommitted, single-device, FSDP-sharded and replicated
params.
"""

from __future__ import annotations

import functools
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import weighted_accum as wa

MESH = jax.sharding.Mesh(np.array(jax.devices()), ("data",))


def _params(kind):
  params = {"w": jnp.arange(32.0).reshape(8, 4) / 7, "b": jnp.ones(8)}
  if kind == "uncommitted":
    return params
  if kind == "device":
    return jax.device_put(params, jax.devices()[0])
  spec = P("data") if kind == "fsdp" else P()
  return jax.device_put(params, NamedSharding(MESH, spec))


PLACEMENTS = ["uncommitted", "device", "fsdp", "replicated"]


def _compiles(step, *args, calls=3):
  """Calls ``step`` ``calls`` times, feeding its outputs back; returns how
  many executables it compiled."""
  for _ in range(calls):
    args = step(*args)
  jax.block_until_ready(args)
  return step._cache_size()  # pylint: disable=protected-access


def _accumulate_step():
  @jax.jit
  def step(state, params):
    grads = jax.tree.map(lambda p: 2 * p, params)
    return wa.accumulate_mean(state, grads, 3.0), params

  return step


def _born(how, params):
  if how == "init":
    return wa.init(params)
  if how == "init_bf16_scaled":
    return wa.init(params, dtype=jnp.bfloat16, loss_scale=2.0**8)
  filled = wa.accumulate_sum(wa.init(params), params, 5.0)
  if how == "from_buffers_device":
    return wa.from_buffers(params, filled.grads, filled.counters)
  if how == "from_buffers_numpy":
    host = jax.tree.map(np.asarray, filled.grads)
    counters = {k: np.asarray(v) for k, v in filled.counters.items()}
    return wa.from_buffers(params, host, counters)
  raise ValueError(how)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
  "how",
  ["init", "init_bf16_scaled", "from_buffers_device", "from_buffers_numpy"],
)
def test_core_state_step_compiles_once(how, placement):
  params = _params(placement)
  assert _compiles(_accumulate_step(), _born(how, params), params) == 1


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_state_leaves_are_placed_as_a_step_returns_them(placement):
  """The cause, checked directly: every leaf of a fresh state has the
  commitment and sharding that the step's output has."""
  params = _params(placement)
  state = wa.init(params)
  out, _ = _accumulate_step()(state, params)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(out)):
    assert a.committed == b.committed
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert jax.typeof(a).weak_type == jax.typeof(b).weak_type


@pytest.mark.parametrize("template", ["concrete", "abstract"])
@pytest.mark.parametrize("placement", ["device", "fsdp"])
def test_restored_state_step_compiles_once(template, placement):
  params = _params(placement)
  state = wa.accumulate_sum(wa.init(params), params, 5.0)
  tmpl = (
    wa.init(params)
    if template == "concrete"
    else wa.checkpoint.abstract_state(params)
  )
  with tempfile.TemporaryDirectory() as d, ocp.CheckpointManager(d) as mngr:
    mngr.save(1, args=ocp.args.Composite(accum=wa.checkpoint.AccumSave(state)))
    mngr.wait_until_finished()
    restored = mngr.restore(
      1, args=ocp.args.Composite(accum=wa.checkpoint.AccumRestore(tmpl))
    ).accum
  assert _compiles(_accumulate_step(), restored, params) == 1


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_wrapper_step_compiles_once(placement):
  params = _params(placement)
  tx = wa.WeightedMultiSteps(optax.adamw(1e-3), every_k_schedule=2, mode="mean")

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state):
    grads = jax.tree.map(jnp.sin, params)
    updates, opt_state = tx.update(grads, opt_state, params, weight=2.0)
    return optax.apply_updates(params, updates), opt_state

  params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
  assert _compiles(step, params, tx.init(params)) == 1


def test_apply_window_step_compiles_once():
  params = _params("uncommitted")
  tx = optax.adam(1e-3)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def step(params, opt_state, state):
    state = wa.accumulate_mean(state, jax.tree.map(jnp.cos, params), 2.0)
    params, opt_state, state, _ = wa.apply_window(tx, state, params, opt_state)
    return params, opt_state, state

  params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
  assert _compiles(step, params, tx.init(params), wa.init(params)) == 1


def test_distributed_state_step_compiles_once():
  """A window born by dist.init inside shard_map, leaving it and carried
  between calls of a shard_map step (replicated: every replica computes the
  same grads here, so out_specs=P() holds)."""
  params = _params("replicated")

  def born(p):
    return wa.init(p, axis_name="data")

  def micro(state, p):
    g = jax.tree.map(lambda x: x * 2, p)
    return wa.accumulate_sum(state, g, 1.0), p

  sm = functools.partial(jax.shard_map, mesh=MESH, check_vma=False)
  make = jax.jit(sm(born, in_specs=P(), out_specs=P()))
  step = jax.jit(sm(micro, in_specs=(P(), P()), out_specs=(P(), P())))
  assert _compiles(step, make(params), params) == 1
