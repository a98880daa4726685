"""Every value a caller hands in passes through the validation package:
a spy on its weight and loss-scale conversions sees the very object the
caller passed, through every public entry point."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa
from weighted_accum._src import validation


class _Seen:
  """Spies on the validation module's weight and loss-scale conversions."""

  def __init__(self, monkeypatch):
    self.values: list[object] = []
    for name in ("weight", "loss_scale", "optional_loss_scale"):
      real = getattr(validation, name)

      def spy(x, *a, _real=real, **k):
        self.values.append(x)
        return _real(x, *a, **k)

      monkeypatch.setattr(validation, name, spy)

  def saw(self, value) -> bool:
    return any(v is value for v in self.values)


PARAMS = {"w": jnp.ones(3)}
GRADS = {"w": jnp.full(3, 2.0)}


def _weights():
  return np.float32(3.0), np.float32(2.0)  # distinct objects per call


@pytest.mark.parametrize(
  "call",
  [
    "accumulate_sum",
    "accumulate_mean",
    "wrapper",
    "train_state",
    "distributed",
  ],
)
def test_every_weight_reaches_the_validation_module(monkeypatch, call):
  seen = _Seen(monkeypatch)
  w, _ = _weights()
  state = wa.init(PARAMS)
  if call in ("accumulate_sum", "accumulate_mean"):
    getattr(wa, call)(state, GRADS, w)
  elif call == "wrapper":
    tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="mean")
    tx.update(GRADS, tx.init(PARAMS), PARAMS, weight=w)
  elif call == "train_state":
    ts = wa.TrainState.create(
      apply_fn=None,
      params=PARAMS,
      tx=wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="mean"),
    )
    ts.apply_gradients(grads=GRADS, weight=w)
  else:
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))

    def step(p, g):
      s = wa.init(p, axis_name="data")
      return wa.accumulate_sum(s, g, w).issued

    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P()),
      out_specs=P(),
      check_vma=False,
    )(PARAMS, GRADS)
  assert seen.saw(w)


@pytest.mark.parametrize(
  "call",
  [
    "init",
    "finish_sums",
    "finish_mean",
    "apply_window",
    "set_loss_scale",
    "wrapper_loss_scale",
    "wrapper_next",
    "in_step",
    "distributed_finish",
  ],
)
def test_every_loss_scale_reaches_the_validation_module(monkeypatch, call):
  seen = _Seen(monkeypatch)
  ls = np.float32(4.0)
  state = wa.accumulate_sum(wa.init(PARAMS), GRADS, 2.0)
  tx = optax.sgd(0.1)
  if call == "init":
    wa.init(PARAMS, loss_scale=ls)
  elif call in ("finish_sums", "finish_mean"):
    getattr(wa, call)(state, next_loss_scale=ls)
  elif call == "apply_window":
    wa.apply_window(tx, state, PARAMS, tx.init(PARAMS), next_loss_scale=ls)
  elif call == "set_loss_scale":
    wa.set_loss_scale(wa.init(PARAMS), ls)
  elif call == "wrapper_loss_scale":
    wa.WeightedMultiSteps(tx, 2, mode="mean", loss_scale=ls)
  elif call == "wrapper_next":
    ms = wa.WeightedMultiSteps(tx, 1, mode="mean")
    ms.update(GRADS, ms.init(PARAMS), PARAMS, weight=1, next_loss_scale=ls)
  elif call == "in_step":
    f = wa.microbatched_value_and_grad(
      lambda p, x: (jnp.sum(p["w"] * x), x.shape[0] * 1.0), 2, mode="sum"
    )
    f(PARAMS, jnp.ones((4, 3)), loss_scale=ls)
  else:
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))

    def step(p, g):
      s = wa.init(p, axis_name="data")
      s = wa.accumulate_sum(s, g, 2.0)
      out, _ = wa.finish_mean(s, next_loss_scale=ls)
      return out.weight

    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
    )(PARAMS, GRADS)
  assert seen.saw(ls)
