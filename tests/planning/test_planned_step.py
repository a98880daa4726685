"""The planned step's options, its one compile over many batches, and bad
input refused with a clear error (nothing changed)."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_planned_conformance import D
from test_planned_conformance import V
from test_planned_conformance import _batch
from test_planned_conformance import _loss_fn
from test_planned_conformance import _params
from test_planned_conformance import _reference
from test_planned_conformance import _rel
from test_planned_conformance import _token_losses

import weighted_accum as wa
from weighted_accum import planning

SMALL = dict(buckets=(8, 16), budget=16, row_divisors=(1,), batch_rows=12)


def _lengths(seed, n=12):
  return np.random.default_rng(seed).integers(0, 17, n).tolist()


def _aux_state_key_loss(p, mb, count, key):
  rows, mask = mb
  tl = _token_losses(p, rows["tokens"], rows["targets"])
  noise = jax.random.uniform(key, ())  # differs per slot: not differentiated
  aux = {"tokens": mask.sum(), "noise": noise}
  loss = jnp.sum(tl * mask) / mask.sum()  # mode="mean"
  return ((loss, mask.sum()), aux), count + 1


def test_aux_state_keys_and_loss_scale_thread_through_every_shape():
  spec = planning.PlanSpec(**SMALL)
  lengths = _lengths(7)
  batch = _batch(lengths, 7)
  packed = planning.plan_batch(spec, batch, lengths)
  f = planning.planned_value_and_grad(
    _aux_state_key_loss, spec, mode="mean", has_aux=True,
    state_argnums=2, key_argnums=3, loss_scale=8.0, grads_dtype=jnp.bfloat16,
  )  # fmt: skip
  params = _params(jnp.float32)
  ((loss, aux), out), count = jax.jit(f)(
    params, packed, jnp.int32(0), jax.random.key(0)
  )
  ref_loss, ref = _reference(params, batch, packed)
  assert out.grads["w"].dtype == jnp.bfloat16  # cast once, at the end
  assert _rel(out.grads, ref) <= 1e-2 and abs(loss - ref_loss) <= 1e-5
  assert int(count) == int(packed.counts.sum())  # one per real microbatch
  assert len(aux) == len(spec.shapes)
  tokens = sum(float(a["tokens"].sum()) for a in aux)
  assert tokens == sum(lengths)
  noise = np.concatenate(
    [a["noise"][:c] for a, c in zip(aux, packed.counts[0])]
  )
  assert len(set(noise.tolist())) == len(noise)  # a key per (shape, slot)


def test_accumulate_spans_batches_in_one_window():
  spec = planning.PlanSpec(**SMALL)
  f = planning.planned_value_and_grad(_loss_fn, spec, mode="sum")
  params = _params(jnp.float32)
  state = wa.init(params)
  grads, weight = [], 0.0
  for seed in (1, 2):
    lengths = _lengths(seed)
    batch = _batch(lengths, seed)
    packed = planning.plan_batch(spec, batch, lengths, seed=seed)
    (_, w), state = jax.jit(f.accumulate)(state, params, packed)
    ref = _reference(params, batch, packed)[1]
    grads.append(jax.tree.map(lambda g, w=float(w): g * w, ref))
    weight += float(w)
  out, _ = wa.finish_mean(state)
  both = jax.tree.map(lambda a, b: (a + b) / weight, *grads)
  assert _rel(out.grads, both) <= 2e-6 and float(out.weight) == weight


class _Net(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.emb = nnx.Embed(V, D, rngs=rngs)
    self.out = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    h = self.emb(tokens)
    h = jnp.cumsum(h, axis=1) / jnp.arange(1, tokens.shape[1] + 1)[:, None]
    return self.out(jnp.tanh(h))


def _nll(model, tokens, targets):
  logits = model(tokens)
  picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return jax.nn.logsumexp(logits, -1) - picked


def test_a_whole_nnx_module_gets_the_full_batch_gradient():
  def loss_fn(model, mb):
    rows, mask = mb
    return jnp.sum(
      _nll(model, rows["tokens"], rows["targets"]) * mask
    ), mask.sum()

  spec = planning.PlanSpec(**SMALL)
  lengths = _lengths(3)
  batch = _batch(lengths, 3)
  model = _Net(nnx.Rngs(0))
  f = planning.planned_value_and_grad(loss_fn, spec, mode="sum")
  _, out = f(model, planning.plan_batch(spec, batch, lengths))
  mask = np.arange(max(lengths)) < np.asarray(lengths)[:, None]
  ref = nnx.grad(
    lambda m: (
      jnp.sum(_nll(m, batch["tokens"], batch["targets"]) * mask) / mask.sum()
    )
  )(model)
  assert isinstance(out.grads, nnx.State)
  assert _rel(out.grads, jax.tree.map(np.asarray, ref)) <= 2e-6


# ---------------------------------------------------------------- refusals --


def test_a_budget_below_one_row_names_the_smallest_that_works():
  with pytest.raises(
    wa.WeightedAccumulationError, match="smallest budget that works is 512"
  ):
    planning.PlanSpec(buckets=(32, 512), budget=256, batch_rows=8)
  for bad in [dict(buckets=()), dict(buckets=(0, 8)), dict(overlong="drop"),
              dict(row_divisors=(1.5,)), dict(cost=(1.0,))]:  # fmt: skip
    with pytest.raises(wa.WeightedAccumulationError, match="PlanSpec"):
      planning.PlanSpec(**{**SMALL, **bad})


def test_bad_batches_are_refused_and_nothing_changes():
  spec = planning.PlanSpec(**SMALL)
  lengths = [3, 20, 5]
  batch = _batch(lengths)
  before = jax.tree.map(np.copy, batch)
  with pytest.raises(
    wa.WeightedAccumulationError, match="row 1 has 20 tokens.*16"
  ):
    planning.plan_batch(spec, batch, lengths)
  with pytest.raises(wa.WeightedAccumulationError, match=r"batch\['targets'\]"):
    planning.plan_batch(spec, batch, [3, 5])  # lengths do not match
  with pytest.raises(wa.WeightedAccumulationError, match="lengths"):
    planning.plan_batch(spec, batch, [3.0, 5.0, 1.0])
  with pytest.raises(wa.WeightedAccumulationError, match="batch_rows=12"):
    planning.plan_batch(spec, _batch([4] * 13), [4] * 13)
  jax.tree.map(np.testing.assert_array_equal, batch, before)
  trunc = planning.PlanSpec(**SMALL, overlong="truncate")
  packed = planning.plan_batch(trunc, batch, lengths)
  assert sum(m.sum() for _, m in packed.shapes) == 3 + 16 + 5


def test_a_batch_planned_for_another_spec_is_refused():
  spec = planning.PlanSpec(**SMALL)
  other = planning.PlanSpec(**{**SMALL, "budget": 32})
  packed = planning.plan_batch(other, _batch([4, 5]), [4, 5])
  f = planning.planned_value_and_grad(_loss_fn, spec, mode="sum")
  with pytest.raises(wa.WeightedAccumulationError, match="planned for"):
    f(_params(jnp.float32), packed)
  with pytest.raises(wa.WeightedAccumulationError, match="not a batch"):
    f(_params(jnp.float32), _batch([4, 5]))
  with pytest.raises(wa.WeightedAccumulationError, match="replicas"):
    planning.planned_value_and_grad(
      _loss_fn, spec, mode="sum", axis_name="data"
    )
  fsdp = wa.distributed.DataParallel("data")
  with pytest.raises(wa.WeightedAccumulationError, match="FSDP"):
    planning.planned_value_and_grad(_loss_fn, spec, mode="sum", axis_name=fsdp)


@pytest.mark.parametrize("grads_dtype", ["params", jnp.float16])
def test_a_mean_past_float16_is_invalid_in_the_dtype_handed_on(grads_dtype):
  """Validity is decided on the grads as handed on: a mean of 2**17 fits the
  float32 window but not float16, so the result is invalid (it was
  ``inf`` with ``valid=True``); the same values in float32 are valid."""

  def loss_fn(w, mb):
    rows, mask = mb
    return jnp.sum(mask * rows["x"] * w) * 2.0**17, mask.sum()

  spec = planning.PlanSpec(buckets=(4, 8), budget=8, batch_rows=4)
  packed = planning.plan_batch(
    spec, {"x": np.ones((4, 8), np.float32)}, [8, 3, 2, 1]
  )
  w16 = jnp.float16(1.0) if grads_dtype == "params" else jnp.float32(1.0)
  f16 = jax.jit(
    planning.planned_value_and_grad(
      loss_fn, spec, mode="sum", grads_dtype=grads_dtype
    )
  )
  _, out = f16(w16, packed)
  assert out.grads.dtype == jnp.float16
  assert not bool(out.valid)
  f32 = jax.jit(planning.planned_value_and_grad(loss_fn, spec, mode="sum"))
  _, ref = f32(jnp.float32(1.0), packed)
  assert bool(ref.valid) and float(ref.grads) == 2.0**17


def test_an_empty_shape_runs_no_loss_fn():
  """Only filled slots run ``loss_fn``: counted by a callback in it, per
  call of the jitted step (a step that ran one all-padding slot of an
  empty shape would count more)."""
  calls = []

  def loss_fn(p, mb):
    rows, mask = mb
    jax.debug.callback(lambda m: calls.append(float(m.sum())), mask)
    return _loss_fn(p, mb)

  spec = planning.PlanSpec(
    buckets=(4, 8, 16), budget=16, row_divisors=(1, 2), batch_rows=12
  )
  f = jax.jit(planning.planned_value_and_grad(loss_fn, spec, mode="sum"))
  for lengths in ([3, 2, 4, 1], [16, 16, 9], [0, 0, 7]):
    packed = planning.plan_batch(spec, _batch(lengths), lengths)
    assert (packed.counts == 0).any()  # some shapes are empty
    calls.clear()
    jax.block_until_ready(f(_params(jnp.float32), packed))
    jax.effects_barrier()
    assert len(calls) == int(packed.counts.sum())
    assert all(c > 0 for c in calls) and sum(calls) == sum(lengths)


@pytest.mark.parametrize("name", ["batch_argnames", "in_axes", "num_real"])
def test_unknown_keywords_are_refused_naming_the_accepted_ones(name):
  spec = planning.PlanSpec(**SMALL)
  with pytest.raises(
    wa.WeightedAccumulationError, match=f"{name}=.*mode, has_aux"
  ):
    planning.planned_value_and_grad(_loss_fn, spec, mode="sum", **{name: 0})
  f = planning.planned_value_and_grad(_loss_fn, spec, mode="sum")
  packed = planning.plan_batch(spec, _batch([3, 4]), [3, 4])
  params = _params(jnp.float32)
  with pytest.raises(wa.WeightedAccumulationError, match="loss_scale"):
    f(params, packed, **{name: 0})
  with pytest.raises(wa.WeightedAccumulationError, match="no keywords"):
    f.accumulate(wa.init(params), params, packed, **{name: 0})


def test_loss_scale_none_is_the_builders_scale():
  """``f(..., loss_scale=None)``, as documented, runs at the builder's
  scale: the sums are scaled by it and the mean is not."""
  spec = planning.PlanSpec(**SMALL)
  packed = planning.plan_batch(spec, _batch([3, 4]), [3, 4])
  params = _params(jnp.float32)
  f = planning.planned_value_and_grad(
    _loss_fn, spec, mode="sum", loss_scale=4.0
  )
  _, ref = f(params, packed)
  _, out = f(params, packed, loss_scale=None)
  one_f = planning.planned_value_and_grad(_loss_fn, spec, mode="sum")
  _, one = one_f(params, packed)
  assert float(out.loss_scale) == float(ref.loss_scale) == 4.0
  for a, b in zip(jax.tree.leaves(out.grads), jax.tree.leaves(one.grads)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
