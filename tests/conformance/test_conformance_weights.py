"""Conformance: a weight is counted exactly, or refused naming it.

The same hostile weights (``tests/_conformance.py``: NumPy 64-bit integers
beyond int32, a Python int of 2**31, bools, fractions, negative, NaN, Inf,
subnormal, float64 beyond float32, strings, 1-element arrays, a value
committed to another device than the params) through every entry point
that takes one: ``accumulate_sum``/``accumulate_mean`` (params sharded over
8 devices), the optax wrapper's ``update`` with and without
``should_skip_update_fn``, ``TrainState.apply_gradients``,
``distributed.accumulate_sum`` in both modes inside ``shard_map``, and
(traced, from the batch) ``microbatched_value_and_grad``'s ``.accumulate``.

The rule (``docs/inputs.md``): the value that will be stored is validated
after the conversion. Eagerly an invalid weight raises a
``WeightedAccumulationError`` naming ``weight`` and the caller's state is
untouched; a traced invalid weight rejects the microbatch whole and counts
it. Integer weights below 2**48 are counted exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from _conformance import TRACED_WEIGHT_IDS
from _conformance import TRACED_WEIGHTS
from _conformance import WEIGHT_IDS
from _conformance import WEIGHTS
from _conformance import Error
from _conformance import assert_close
from _conformance import assert_same
from _conformance import host_grads
from _conformance import host_params
from _conformance import place
from _conformance import snapshot
from _conformance import weight_ok
import weighted_accum as wa

G = host_grads()
G64 = {k: np.asarray(v, np.float64) for k, v in G.items()}


def _check_total(got, ref) -> None:
  """Integers exactly; fractions as the float64 value of their float32."""
  if isinstance(ref, int):
    assert got == ref, (got, ref)
  else:
    assert got == float(np.float32(ref)), (got, ref)


# ------------------------------------------------- core, 8 devices, eager --


@pytest.mark.parametrize("kind", ["sum", "mean"])
@pytest.mark.parametrize("weight", WEIGHTS, ids=WEIGHT_IDS)
def test_accumulate_sharded_eager(weight, kind):
  _, make, ref = weight
  params = place(host_params(), "dev8")
  fn = wa.accumulate_sum if kind == "sum" else wa.accumulate_mean
  base = wa.accumulate_sum(wa.init(params), place(G, "dev8"), 3)
  snap = snapshot(base)
  if not weight_ok(ref):
    with pytest.raises(Error, match=rf"accumulate_{kind}\(weight\)"):
      fn(base, place(G, "dev8"), make())
    assert_same(base, snap)
    return
  new = fn(base, place(G, "dev8"), make())
  _check_total(new.total_weight, 3 + ref)
  w32 = float(np.float32(ref))
  add = (w32 if kind == "mean" else 1.0) if ref > 0 else 0.0
  assert_close(new.grads, {k: v * (1 + add) for k, v in G64.items()}, 2e-7)
  for k in G:
    assert new.grads[k].sharding.is_equivalent_to(params[k].sharding, G[k].ndim)
  assert_same(base, snap)


@pytest.mark.parametrize("weight", WEIGHTS, ids=WEIGHT_IDS)
def test_from_buffers_total_weight(weight):
  """A restored window of one microbatch whose total weight is hostile;
  zero (with non-zero buffers) is refused too (docs/inputs.md)."""
  _, make, ref = weight
  params = place(host_params(), "dev8")
  counters = {"issued": 1, "total_weight": make()}
  if not weight_ok(ref) or ref == 0:
    with pytest.raises(Error, match=r"'total_weight'|non-zero"):
      wa.from_buffers(params, G, counters)
    return
  s = wa.from_buffers(params, G, counters)
  _check_total(s.total_weight, ref)
  assert_close(s.grads, G64, 0)


_J_MEAN = jax.jit(wa.accumulate_mean)


@pytest.mark.parametrize("weight", TRACED_WEIGHTS, ids=TRACED_WEIGHT_IDS)
def test_accumulate_sharded_jit(weight):
  _, make, ref = weight
  params = place(host_params(), "dev8")
  base = wa.accumulate_sum(wa.init(params), place(G, "dev8"), 3)
  new = _J_MEAN(base, place(G, "dev8"), make())
  if weight_ok(ref):
    _check_total(new.total_weight, 3 + ref)
    assert int(new.rejected) == 0
    w32 = float(np.float32(ref))
    assert_close(new.grads, {k: v * (1 + w32) for k, v in G64.items()}, 2e-7)
  else:
    assert int(new.rejected) == 1 and new.total_weight == 3
    assert_close(new.grads, G64, 0)


# ------------------------------------------------------ the optax wrapper --


def _skip_fn(updates, gradient_step, params):
  return optax.skip_not_finite(updates, gradient_step, params)


WRAPPERS = {
  "WeightedMultiSteps": lambda: wa.WeightedMultiSteps(
    optax.sgd(1.0), 2, mode="sum"
  ),
  "should_skip_update_fn": lambda: wa.WeightedMultiSteps(
    optax.sgd(1.0), 2, should_skip_update_fn=_skip_fn, mode="sum"
  ),
}


# An eager update costs about 0.4 s of CPU: the full list goes through the
# ``should_skip_update_fn`` path (its own weight handling); the plain
# wrapper (and TrainState, which forwards to it) gets the values that
# reach the conversion differently (``tests/validation/test_hostile.py`` has the rest).
SHORT = [
  w
  for w in WEIGHTS
  if w[0]
  in (
    "np_int64_2p33p5",
    "np_uint64_2p40",
    "py_int_2p31",
    "string",
    "np_shape1",
    "other_device",
  )
]
WRAPPER_CASES = [("should_skip_update_fn", w) for w in WEIGHTS] + [
  ("WeightedMultiSteps", w) for w in SHORT
]


@pytest.mark.parametrize(
  "wrapper,weight",
  WRAPPER_CASES,
  ids=[f"{n}-{w[0]}" for n, w in WRAPPER_CASES],
)
def test_wrapper_update_eager(wrapper, weight):
  """Mid-window: the weight is in the window's counters exactly; refused
  ones name ``weight`` and leave the state as it was."""
  _, make, ref = weight
  tx = WRAPPERS[wrapper]()
  params = place(host_params(), "dev0")
  state = tx.init(params)
  snap = snapshot(state)
  if not weight_ok(ref):
    with pytest.raises(Error, match=r"weight"):
      tx.update(place(G, "dev0"), state, params, weight=make())
    assert_same(state, snap)
    return
  upd, new = tx.update(place(G, "dev0"), state, params, weight=make())
  c = wa.window_counters(new)
  _check_total(c["total_weight"], ref)
  assert int(c["rejected"]) == 0 and int(c["issued"]) == 1
  assert int(c["zero_weight"]) == (ref == 0)
  assert_close(upd, {k: 0 * v for k, v in G64.items()}, 0)
  # The window's buffers hold G exactly when the weight is positive.
  want = G64 if ref > 0 else {k: 0 * v for k, v in G64.items()}
  assert_close(new.acc_grads, want, 0)


_J_SKIP = {}


def _jit_update(wrapper):
  if wrapper not in _J_SKIP:
    tx = WRAPPERS[wrapper]()
    _J_SKIP[wrapper] = (
      tx,
      jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w)),
    )
  return _J_SKIP[wrapper]


@pytest.mark.parametrize("weight", TRACED_WEIGHTS, ids=TRACED_WEIGHT_IDS)
@pytest.mark.parametrize("wrapper", ["should_skip_update_fn"])
def test_wrapper_update_jit(wrapper, weight):
  """The ``should_skip_update_fn`` path (the plain one under ``jit``:
  ``tests/validation/test_hostile.py``); one compilation per weight dtype."""
  _, make, ref = weight
  tx, update = _jit_update(wrapper)
  params = host_params()
  _, new = update(G, tx.init(params), params, make())
  c = wa.window_counters(new)
  if weight_ok(ref):
    _check_total(c["total_weight"], ref)
    assert int(c["rejected"]) == 0
  else:
    assert int(c["rejected"]) == 1 and c["total_weight"] == 0


_V_UPDATE = jax.jit(
  jax.vmap(
    lambda g, s, p, w: WRAPPERS["should_skip_update_fn"]().update(
      g, s, p, weight=w
    ),
    in_axes=(None, None, None, 0),
  )
)


def test_wrapper_update_vmap_each_lane_exact_or_rejected():
  tx = WRAPPERS["should_skip_update_fn"]()
  params = host_params()
  ws = [make() for _, make, _ in TRACED_WEIGHTS]
  refs = [ref for _, _, ref in TRACED_WEIGHTS]
  _, new = _V_UPDATE(
    G,
    tx.init(params),
    params,
    jnp.stack([jnp.asarray(w, jnp.float32) for w in ws]),
  )
  for i, ref in enumerate(refs):
    lane = jax.tree.map(lambda x, i=i: x[i], new)
    c = wa.window_counters(lane)
    ref32 = float(np.float32(ref))  # the lanes are float32
    if weight_ok(ref32):
      assert float(c["total_weight"]) == ref32, (i, c)
      assert int(c["rejected"]) == 0
    else:
      assert int(c["rejected"]) == 1 and float(c["total_weight"]) == 0


# -------------------------------------------------------------- TrainState --


@pytest.mark.parametrize("weight", SHORT, ids=[w[0] for w in SHORT])
def test_train_state_apply_gradients_eager(weight):
  _, make, ref = weight
  params = place(host_params(), "dev0")
  ts = wa.TrainState.create(
    apply_fn=None, params=params, tx=WRAPPERS["WeightedMultiSteps"]()
  )
  snap = snapshot(ts)
  if not weight_ok(ref):
    with pytest.raises(Error, match=r"weight"):
      ts.apply_gradients(grads=place(G, "dev0"), weight=make())
    assert_same(ts, snap)
    return
  new = ts.apply_gradients(grads=place(G, "dev0"), weight=make())
  _check_total(wa.window_counters(new.opt_state)["total_weight"], ref)
  assert_same(new.params, snap.params)


# ------------------------------------------------------------ distributed --

N = jax.device_count()
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("data",))


def _dist_totals(w, reduce):
  """Each replica adds its own (local) G with the concrete weight ``w``;
  returns every replica's window total (hi, lo) and rejection count."""

  def step(p, g):
    g = jax.tree.map(lambda x: x[0], g)  # this replica's: varying
    s = wa.init(p, axis_name="data", reduce=reduce)
    s = wa.accumulate_sum(s, g, w)
    return s.weight_hi[None], s.weight_lo[None], s.rejected[None]

  f = jax.shard_map(
    step, mesh=MESH, in_specs=(P(), P("data")), out_specs=(P("data"),) * 3
  )
  local = {k: np.stack([v] * N) for k, v in G.items()}
  return jax.jit(f)(host_params(), local)


@pytest.mark.parametrize("weight", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("reduce", ["window", "microbatch"])
def test_distributed_accumulate_concrete_weight(reduce, weight):
  """A concrete weight inside ``shard_map`` is validated at trace time:
  refused naming it, or counted exactly (per replica in window mode, summed
  over the 8 replicas in microbatch mode)."""
  _, make, ref = weight
  if not weight_ok(ref):
    with pytest.raises(Error, match=r"accumulate_sum\(weight\)"):
      _dist_totals(make(), reduce)
    return
  hi, lo, rejected = _dist_totals(make(), reduce)
  want = ref if reduce == "window" else N * ref
  for h, l in zip(np.asarray(hi, np.float64), np.asarray(lo, np.float64)):
    _check_total(h + l, want)
  assert not np.any(np.asarray(rejected))


# ------------------------------------- in-step: the weight from the batch --

K, ROWS = 4, 8


def _wloss(p, batch):
  x, y, w = batch
  pred = x @ p["b"] + jnp.sum(x @ p["w"], axis=-1)
  return jnp.sum((pred - y) ** 2), w[0]


_MVG = wa.microbatched_value_and_grad(_wloss, K, mode="sum")
_ACC = jax.jit(_MVG.accumulate)


@pytest.mark.parametrize("weight", TRACED_WEIGHTS, ids=TRACED_WEIGHT_IDS)
def test_microbatched_accumulate_traced_weight(weight):
  """``loss_fn`` returns each microbatch's weight (here of the batch's own
  dtype: int32 token counts, bools, bfloat16): counted exactly, or the
  microbatch rejected and counted, as ``accumulate_sum`` does."""
  _, make, ref = weight
  v = make()
  x = (np.arange(ROWS * 8).reshape(ROWS, 8) % 3 - 1.0).astype(np.float32)
  y = np.zeros(ROWS, np.float32)
  w = jnp.full((ROWS,), v, jnp.result_type(v))
  state = wa.init(host_params())
  _, new = _ACC(state, host_params(), (x, y, w))
  if weight_ok(ref):
    _check_total(new.total_weight, K * ref)
    assert int(new.rejected) == 0
  else:
    assert int(new.rejected) == K and new.total_weight == 0


# ------------------------------- params committed to two different devices --


# By design: one jitted computation cannot take arrays committed to different
# devices (the caller's own jax.jit step could not either), so every entry
# point that starts a window refuses such params before any kernel sees
# them, naming the leaf and what to do.


@pytest.mark.parametrize("entry", ["init", "wrapper", "train_state"])
def test_params_on_two_devices_are_refused_naming_the_leaf(entry):
  params = place(host_params(), "split")
  with pytest.raises(Error, match=r"init\(params\): leaf \['w'\].*devices"):
    if entry == "init":
      wa.init(params)
    elif entry == "wrapper":
      WRAPPERS["WeightedMultiSteps"]().init(params)
    else:
      wa.TrainState.create(
        apply_fn=None, params=params, tx=WRAPPERS["WeightedMultiSteps"]()
      )
