"""The comparisons with optax that README.md and the docs state, measured.

Each number or claim about a peer that the docs give is computed here
against an independent reference (the full-batch gradient; float64 NumPy):

- in one step, ``optax.microbatching.microbatch`` over the gradient of a loss
  SUM with a SUM accumulator, divided by the batch's item count, IS the
  full-batch gradient (README's comparison, the in-step page);
- the MEAN accumulator over per-microbatch mean losses is not;
- across steps, ``optax.MultiSteps`` (equal weight per microbatch) is off by
  the relative errors quoted in README.md and the migration guide on the
  demo's variable-length batch (the same numbers ``python -m weighted_accum``
  prints), and ``wa.WeightedMultiSteps`` with the two-line migration is not;
- Adam amplifies float32 rounding of near-zero gradients (the migration guide:
  compare gradients, not Adam-updated params).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import weighted_accum as wa
from weighted_accum._src import demo

# The relative gradient errors of optax.MultiSteps vs the full batch on the
# demo's batch (seed 0), as README.md and the migration guide quote them.
QUOTED_MULTISTEPS_ERROR = {2: 0.039, 4: 0.045, 8: 0.107, 16: 0.245}


@pytest.fixture(scope="module")
def lm():
  """The demo's bigram LM, its variable-length batch and full-batch grads."""
  params = demo.init_params(0)
  tokens, mask = demo.make_batch(0)
  return params, tokens, mask, demo.mean_loss_and_grad(params, tokens, mask)[1]


def _sum_loss(params, tokens, mask):
  return jnp.sum(mask * demo.token_losses(params, tokens))


def _mean_loss(params, tokens, mask):
  return _sum_loss(params, tokens, mask) / jnp.maximum(mask.sum(), 1.0)


def _rel(tree, ref):
  return demo.rel_err(tree, ref)


def test_optax_microbatching_sum_of_sum_losses_is_exact(lm):
  params, tokens, mask, full = lm
  grad_sum = optax.microbatching.microbatch(
    jax.grad(_sum_loss),
    argnums=(1, 2),
    microbatch_size=8,
    accumulator=optax.microbatching.AccumulationType.SUM,
  )
  grads = jax.tree.map(
    lambda g: g / mask.sum(), jax.jit(grad_sum)(params, tokens, mask)
  )
  assert _rel(grads, full) < 1e-6
  # The microbatches really are unequal: 8 strided rows each.
  counts = [mask[k::8].sum() for k in range(8)]
  assert max(counts) > 1.3 * min(counts)


def test_optax_microbatching_mean_of_mean_losses_is_biased(lm):
  params, tokens, mask, full = lm
  grad_mean = optax.microbatching.microbatch(
    jax.grad(_mean_loss),
    argnums=(1, 2),
    microbatch_size=8,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )
  assert _rel(jax.jit(grad_mean)(params, tokens, mask), full) > 1e-2


_mean_grad = jax.jit(jax.grad(_mean_loss))


def _window_gradient(tx, params, parts, weighted):
  """Feeds the microbatches' mean-loss grads; the close's updates."""
  if weighted:
    update = jax.jit(lambda g, s, n: tx.update(g, s, params, weight=n))
  else:
    update = jax.jit(lambda g, s, n: tx.update(g, s, params))
  state = tx.init(params)
  for t, m in parts:
    updates, state = update(_mean_grad(params, t, m), state, m.sum())
  return updates


@pytest.mark.parametrize("k", sorted(QUOTED_MULTISTEPS_ERROR))
def test_optax_multisteps_error_is_as_quoted(lm, k):
  params, tokens, mask, full = lm
  rows = demo.ROWS // k
  parts = []  # rows [i, i + rows) of the batch: unequal token counts
  for i in range(0, demo.ROWS, rows):
    own = np.zeros_like(mask)  # the whole batch's shape: one compilation
    own[i : i + rows] = mask[i : i + rows]
    parts.append((tokens, own))
  before = optax.MultiSteps(optax.identity(), every_k_schedule=k)
  err = _rel(_window_gradient(before, params, parts, False), full)
  assert err == pytest.approx(QUOTED_MULTISTEPS_ERROR[k], abs=1e-3)
  # The same error, from the equal-weight mean of means in float64 NumPy.
  means = [_mean_grad(params, t, m) for t, m in parts]
  equal = jax.tree.map(lambda *g: sum(np.float64(x) for x in g) / k, *means)
  assert err == pytest.approx(_rel(equal, full), rel=1e-4)
  # The two-line migration: WeightedMultiSteps(..., mode="mean") + weight=.
  after = wa.WeightedMultiSteps(optax.identity(), k, mode="mean")
  assert _rel(_window_gradient(after, params, parts, True), full) < 1e-5


def test_adam_amplifies_rounding_of_near_zero_gradients():
  """At a least-squares optimum the full-batch gradient is float32 rounding
  noise (~1e-7); an exact accumulation differs from it by rounding, and one
  Adam step turns that into a param difference ~1e4 times larger."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8))
  y = x @ rng.normal(size=8) + 0.1 * rng.normal(size=64)
  optimum = np.linalg.lstsq(x, y, rcond=None)[0]  # float64: zero gradient
  x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  params = {"w": jnp.asarray(optimum, jnp.float32)}

  def loss_sum(p, xb, yb):
    return jnp.sum((xb @ p["w"] - yb) ** 2)

  full = jax.grad(lambda p: loss_sum(p, x, y) / 64)(params)
  acc = wa.init(params)
  for s in (slice(0, 5), slice(5, 40), slice(40, 64)):
    g = jax.grad(loss_sum)(params, x[s], y[s])
    acc = wa.accumulate_sum(acc, g, s.stop - s.start)
  accumulated = wa.finish_mean(acc)[0].grads
  grad_diff = float(jnp.max(jnp.abs(accumulated["w"] - full["w"])))
  assert grad_diff < 1e-6  # exact up to float32 rounding

  tx = optax.adam(1e-3)

  def adam_step(g):
    return optax.apply_updates(params, tx.update(g, tx.init(params), params)[0])

  param_diff = float(
    jnp.max(jnp.abs(adam_step(accumulated)["w"] - adam_step(full)["w"]))
  )
  assert param_diff > 1e-5 and param_diff > 1e3 * grad_diff


def test_readme_quotes_the_measured_errors():
  """README.md's numbers are the ones the tests above measure."""
  readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
  text = " ".join(readme.split())
  for k in (2, 8, 16):
    quoted = f"{100 * QUOTED_MULTISTEPS_ERROR[k]:.1f}% at K = {k}"
    assert quoted in text, quoted
  assert "optax.microbatching.microbatch(jax.grad(sum_loss)," in text
  assert "compare gradients, not Adam-updated params" in text
