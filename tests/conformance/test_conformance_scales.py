"""Conformance: a loss scale is stored exactly as float32, or refused.

The same hostile loss scales (``tests/_conformance.py``) through every entry
point that takes one: ``init``, ``finish_sums``/``finish_mean``,
``apply_window``, ``set_loss_scale``, ``DynamicLossScale``, the optax
wrapper's constructors and ``update(next_loss_scale=...)``,
``TrainState.apply_gradients``, ``microbatched_value_and_grad`` (built with
one, and per call), ``distributed.init`` and ``distributed.finish_mean``.
Params are committed to device 0; the "other_device" scale is committed to
the last one.

The rule (``docs/inputs.md``): a loss scale is a finite, positive, normal
float32 after conversion, stored rounded to float32; a concrete value
outside it raises a ``WeightedAccumulationError`` naming the argument (the
caller's state untouched). Traced, it marks the window unusable: nothing
scaled by it is ever reported valid (never a sign-flipped or zero gradient
applied).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from _conformance import SCALES
from _conformance import TRACED_SCALE_IDS
from _conformance import TRACED_SCALES
from _conformance import Error
from _conformance import assert_same
from _conformance import host_grads
from _conformance import host_params
from _conformance import place
from _conformance import scale_ok
from _conformance import snapshot
from _conformance import stored_scale
import weighted_accum as wa

G = host_grads()
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("data",))


def _params():
  return place(host_params(), "dev0")


def _grads():
  return place(G, "dev0")


def _window():
  """An open window with one microbatch (to finish)."""
  return wa.accumulate_mean(wa.init(_params()), _grads(), 2)


def _sgd_wrapper(**kw):
  return wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="mean", **kw)


def _dist_init(v):
  f = jax.shard_map(
    lambda p: wa.init(p, loss_scale=v, axis_name="data").loss_scale,
    mesh=MESH,
    in_specs=P(),
    out_specs=P(),
  )
  return jax.jit(f)(host_params())


def _dist_finish(v):
  def step(p):
    s = wa.accumulate_sum(wa.init(p, axis_name="data"), G, 2.0)
    _, s = wa.finish_mean(s, next_loss_scale=v)
    return s.loss_scale

  f = jax.shard_map(step, mesh=MESH, in_specs=P(), out_specs=P())
  return jax.jit(f)(host_params())


def _apply(v):
  tx = optax.sgd(1.0)
  p = _params()
  return wa.apply_window(tx, _window(), p, tx.init(p), next_loss_scale=v)[
    2
  ].loss_scale


def _update(v):
  tx = _sgd_wrapper()
  p = _params()
  _, s = tx.update(
    _grads(), tx.init(p), p, weight=2, finish=True, next_loss_scale=v
  )
  return wa.window_counters(s)["loss_scale"]


def _train_state(v):
  ts = wa.TrainState.create(apply_fn=None, params=_params(), tx=_sgd_wrapper())
  ts = ts.apply_gradients(
    grads=_grads(), weight=2, finish=True, next_loss_scale=v
  )
  return wa.window_counters(ts.opt_state)["loss_scale"]


def _loss(p, batch):
  x, y = batch
  pred = x @ p["b"] + jnp.sum(x @ p["w"], axis=-1)
  return jnp.sum((pred - y) ** 2), jnp.float32(x.shape[0])


def _batch():
  x = (np.arange(64).reshape(8, 8) % 3 - 1.0).astype(np.float32)
  return x, np.zeros(8, np.float32)


def _mvg_built(v):
  f = wa.microbatched_value_and_grad(_loss, 4, mode="sum", loss_scale=v)
  return f(_params(), _batch())[1].loss_scale


def _mvg_call(v):
  f = wa.microbatched_value_and_grad(_loss, 4, mode="sum")
  return f(_params(), _batch(), loss_scale=v)[1].loss_scale


# entry point -> (store the value, read the stored scale back; the regex
# the refusal must match: the entry point and the argument).
ENTRIES = {
  "init": (
    lambda v: wa.init(_params(), loss_scale=v).loss_scale,
    r"init\(loss_scale",
  ),
  "finish_sums": (
    lambda v: wa.finish_sums(_window(), next_loss_scale=v)[1].loss_scale,
    r"finish_sums\(next_loss_scale",
  ),
  "finish_mean": (
    lambda v: wa.finish_mean(_window(), next_loss_scale=v)[1].loss_scale,
    r"finish_mean\(next_loss_scale",
  ),
  "apply_window": (_apply, r"apply_window\(next_loss_scale"),
  "set_loss_scale": (
    lambda v: wa.set_loss_scale(wa.init(_params()), v).loss_scale,
    r"set_loss_scale\(loss_scale",
  ),
  "DynamicLossScale": (
    lambda v: wa.DynamicLossScale(v, min_scale=2.0**-126).scale,
    r"DynamicLossScale.*scale",
  ),
  "WeightedMultiSteps": (
    lambda v: wa.window_counters(_sgd_wrapper(loss_scale=v).init(_params()))[
      "loss_scale"
    ],
    r"WeightedMultiSteps\(loss_scale",
  ),
  "update": (_update, r"update\(next_loss_scale"),
  "TrainState.apply_gradients": (_train_state, r"next_loss_scale"),
  "microbatched_value_and_grad": (
    _mvg_built,
    r"microbatched_value_and_grad\(loss_scale",
  ),
  "microbatched_value_and_grad(...)(loss_scale=)": (_mvg_call, r"loss_scale"),
  "from_buffers": (
    lambda v: (
      wa.from_buffers(
        _params(),
        {k: np.zeros_like(x) for k, x in host_params().items()},
        {"loss_scale": v},
      ).loss_scale
    ),
    r"loss_scale",
  ),
  "distributed.init": (_dist_init, r"init\(loss_scale"),
  "distributed.finish_mean": (_dist_finish, r"finish_mean\(next_loss_scale"),
}


# Every scale goes through the entry points that store it without running a
# step (the one validation module decides each value). The entry points that
# run a step or compile a program per value get a value of each kind: three
# accepted (a NumPy int64 beyond float32's integers, a float64 fraction, a
# scale on another device) and one refusal of each reason (not a number, not
# a scalar, not finite, not positive, beyond float32), each naming the entry
# point and its argument.
SLOW = {
  "apply_window",
  "update",
  "TrainState.apply_gradients",
  "microbatched_value_and_grad",
  "microbatched_value_and_grad(...)(loss_scale=)",
  "from_buffers",
  "distributed.init",
  "distributed.finish_mean",
}
SHORT = {
  "np_int64_2p33p5",
  "py_float_0p1",
  "other_device",
  "string",
  "np_shape1",
  "nan",
  "negative",
  "f64_beyond_f32",
}
SCALE_CASES = [
  (e, sc) for e in ENTRIES for sc in SCALES if e not in SLOW or sc[0] in SHORT
]


@pytest.mark.parametrize(
  "entry,scale", SCALE_CASES, ids=[f"{e}-{sc[0]}" for e, sc in SCALE_CASES]
)
def test_concrete_scale_stored_or_refused(entry, scale):
  name, make, ref = scale
  store, needle = ENTRIES[entry]
  if entry == "from_buffers" and name == "nan":
    # A window made unusable under jit (a NaN scale) is reattached as it
    # was saved: what the library writes, it restores (docs/inputs.md).
    assert np.isnan(float(store(make())))
    return
  if not scale_ok(ref):
    with pytest.raises(Error, match=needle):
      store(make())
    return
  got = store(make())
  assert float(got) == stored_scale(ref), (float(got), ref)
  assert jnp.result_type(got) == jnp.float32


def test_refusals_leave_the_callers_state_untouched():
  """The window, params and optimizer state handed to a refusing call."""
  tx = optax.sgd(1.0)
  p, s = _params(), _window()
  o = tx.init(p)
  snap = snapshot((p, s, o))
  for bad in (-1.0, np.nan, 1e39, "2"):
    with pytest.raises(Error):
      wa.apply_window(tx, s, p, o, next_loss_scale=bad)
    with pytest.raises(Error):
      wa.finish_mean(s, next_loss_scale=bad)
    with pytest.raises(Error):
      wa.set_loss_scale(wa.init(p), bad)
  assert_same((p, s, o), snap)


# -------------------------------------------- traced: never reported valid --


def _traced_then_window(set_scale):
  """A jitted step: the next window's scale set to the traced ``v``, then a
  microbatch whose mean grads were scaled by ``v``, then its finish."""

  def step(v):
    s = set_scale(v)
    g = jax.tree.map(lambda x: x * v.astype(jnp.float32), host_grads())
    s = wa.accumulate_mean(s, g, 2.0)
    out, _ = wa.finish_mean(s)
    return out.valid, out.grads, s.loss_scale

  return jax.jit(step)


def _via_apply(v):
  tx = optax.sgd(1.0)
  p = host_params()
  s = wa.accumulate_mean(wa.init(p), host_grads(), 2.0)
  return wa.apply_window(tx, s, p, tx.init(p), next_loss_scale=v)[2]


TRACED_ENTRIES = {
  "set_loss_scale": _traced_then_window(
    lambda v: wa.set_loss_scale(wa.init(host_params()), v)
  ),
  "finish_mean": _traced_then_window(
    lambda v: wa.finish_mean(
      wa.accumulate_mean(wa.init(host_params()), host_grads(), 2.0),
      next_loss_scale=v,
    )[1]
  ),
  "apply_window": _traced_then_window(_via_apply),
  "init": _traced_then_window(lambda v: wa.init(host_params(), loss_scale=v)),
}


@pytest.mark.parametrize("scale", TRACED_SCALES, ids=TRACED_SCALE_IDS)
@pytest.mark.parametrize("entry", list(TRACED_ENTRIES))
def test_traced_scale_exact_or_window_unusable(entry, scale):
  _, make, ref = scale
  valid, grads, stored = TRACED_ENTRIES[entry](make())
  if scale_ok(ref):
    assert float(stored) == stored_scale(ref)
    assert bool(valid)
    for k, v in G.items():
      np.testing.assert_allclose(np.asarray(grads[k]), v, rtol=1e-6)
  else:
    assert not bool(valid), f"scale {ref} reported valid: {grads}"


_V_SET = jax.jit(jax.vmap(wa.set_loss_scale, in_axes=(None, 0)))


def test_set_loss_scale_vmap_each_lane():
  vals = [jnp.asarray(make(), jnp.float32) for _, make, _ in TRACED_SCALES]
  out = _V_SET(wa.init(host_params()), jnp.stack(vals))
  for i, (_, _, ref) in enumerate(TRACED_SCALES):
    got = float(out.loss_scale[i])
    if scale_ok(ref):
      assert got == stored_scale(ref)
    else:  # never silently the previous scale (1.0): the window unusable
      assert np.isnan(got), (ref, got)


_TX = wa.WeightedMultiSteps(optax.sgd(1.0), 1, mode="mean")
_J_UPDATE = jax.jit(
  lambda g, s, p, v: _TX.update(g, s, p, weight=2.0, next_loss_scale=v)
)
_J_UPDATE_PLAIN = jax.jit(lambda g, s, p: _TX.update(g, s, p, weight=2.0))


@pytest.mark.parametrize("scale", TRACED_SCALES, ids=TRACED_SCALE_IDS)
def test_wrapper_traced_next_scale_exact_or_next_window_unapplied(scale):
  """Window 1 closes with the traced next scale; window 2's grads are
  scaled by it: applied exactly (SGD(1): -G), or never applied."""
  _, make, ref = scale
  v = make()
  p = host_params()
  _, s = _J_UPDATE(host_grads(), _TX.init(p), p, v)
  scaled = jax.tree.map(lambda x: x * jnp.float32(v), host_grads())
  upd, s = _J_UPDATE_PLAIN(scaled, s, p)
  if scale_ok(ref):
    assert float(wa.window_counters(s)["loss_scale"]) == stored_scale(ref)
    assert bool(wa.has_updated(s))
    for k, g in G.items():
      np.testing.assert_allclose(np.asarray(upd[k]), -g, rtol=1e-6)
  else:
    assert not bool(wa.has_updated(s))
    for k in G:
      assert not np.any(np.asarray(upd[k]))


_J_MVG = jax.jit(
  lambda p, b, v: wa.microbatched_value_and_grad(_loss, 4, mode="sum")(
    p, b, loss_scale=v
  )
)


@pytest.mark.parametrize("scale", TRACED_SCALES, ids=TRACED_SCALE_IDS)
def test_microbatched_traced_scale_exact_or_invalid(scale):
  _, make, ref = scale
  _, out = _J_MVG(host_params(), _batch(), make())
  if scale_ok(ref):
    assert float(out.loss_scale) == stored_scale(ref) and bool(out.valid)
  else:
    assert not bool(out.valid)


# ------------------------- a scale on another device, then a whole window --


def _other():
  return jax.device_put(jnp.float32(4.0), jax.devices()[-1])


def _scaled_grads():
  return place({k: v * 4.0 for k, v in G.items()}, "dev0")


def _apply_sgd(s, p):
  tx = optax.sgd(1.0)
  new, _, _, out = wa.apply_window(tx, s, p, tx.init(p))
  assert bool(out.valid)
  return new


WHOLE_WINDOWS = {
  "init": lambda p: _apply_sgd(
    wa.accumulate_mean(wa.init(p, loss_scale=_other()), _scaled_grads(), 2),
    p,
  ),
  "set_loss_scale": lambda p: _apply_sgd(
    wa.accumulate_mean(
      wa.set_loss_scale(wa.init(p), _other()), _scaled_grads(), 2
    ),
    p,
  ),
  "finish_mean": lambda p: _apply_sgd(
    wa.accumulate_mean(
      wa.finish_mean(
        wa.accumulate_mean(wa.init(p), place(G, "dev0"), 2),
        next_loss_scale=_other(),
      )[1],
      _scaled_grads(),
      2,
    ),
    p,
  ),
}


def _wrapper_whole(p):
  tx = _sgd_wrapper(loss_scale=_other())
  s = tx.init(p)
  for _ in range(2):
    upd, s = tx.update(_scaled_grads(), s, p, weight=2)
  assert bool(wa.has_updated(s))
  return optax.apply_updates(p, upd)


WHOLE_WINDOWS["WeightedMultiSteps"] = _wrapper_whole


@pytest.mark.parametrize("entry", list(WHOLE_WINDOWS))
def test_scale_on_another_device_through_a_whole_window(entry):
  """The scale 4 committed to the last device, the params to device 0:
  the window's mean (G) is applied by SGD(1) exactly."""
  new = WHOLE_WINDOWS[entry](_params())
  hp = host_params()
  for k, g in G.items():
    np.testing.assert_allclose(np.asarray(new[k]), hp[k] - g, rtol=1e-6)
