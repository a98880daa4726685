"""Measurements: window gradients against the full batch, speed, memory.

The gradient check forms, on the same params and the same global batch,
the full-batch gradient (one ``jax.grad`` of the batch's token-mean loss)
and, from the K microbatches' mean-loss gradients, the two window
gradients the accumulating wrappers would hand their optimizer:

- equal weight (what ``optax.MultiSteps`` forms): ``mean_m g_m``;
- token weighted: ``wa.accumulate_mean(acc, g_m, n_m)`` over the window,
  then ``wa.finish_mean``: ``sum_m n_m g_m / sum_m n_m``.

Errors are relative L2 norms over the whole params tree, in float64 on the
host: ``||g - g_full|| / ||g_full||``.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import weighted_accum as wa

from . import data
from .train import Experiment
from .train import Runner


def _flat(tree) -> np.ndarray:
  leaves = jax.tree.leaves(tree)
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])


def relative_error(grads, reference) -> float:
  """``||grads - reference||_2 / ||reference||_2`` over all leaves."""
  g, r = _flat(grads), _flat(reference)
  return float(np.linalg.norm(g - r) / np.linalg.norm(r))


@functools.cache
def _grad_fn(ex: Experiment):
  return jax.jit(jax.value_and_grad(ex.loss_mean, has_aux=True))


_accumulate = jax.jit(wa.accumulate_mean, donate_argnums=0)


def window_grads(ex: Experiment, params, batch: dict, k: int):
  """The equal-weight and the token-weighted window gradients over K.

  Returns:
    ``(equal, weighted, tokens)``: the two gradients and the microbatches'
    target-token counts.
  """
  vg = _grad_fn(ex)
  acc = wa.init(params, dtype=jnp.float32)
  equal, tokens = None, []
  for m in range(k):
    (_, n), g = vg(params, data.microbatch(batch, m, k))
    acc = _accumulate(acc, g, n)
    equal = g if equal is None else jax.tree.map(jnp.add, equal, g)
    tokens.append(int(n))
  out, _ = wa.finish_mean(acc)
  assert bool(out.valid) and bool(out.finite)
  return jax.tree.map(lambda x: x / k, equal), out.grads, tokens


def gradient_check(ex: Experiment, params, step: int) -> dict:
  """Relative errors of both window gradients at every K of the table.

  Returns:
    ``{K: {"equal": e, "weighted": e, "equal_ungrouped": e, "tokens": [..]}}``
    (``equal_ungrouped``: the equal-weight mean over rows ``m::K`` of the
    batch in its sampled order, without length grouping).
  """
  raw = ex.corpus.train.take(ex.order[step])
  _, full = _grad_fn(ex)(params, raw)
  out = {}
  for k in ex.s.table_ks:
    equal, weighted, tokens = window_grads(ex, params, ex.batch(step, k), k)
    row = {
      "equal": relative_error(equal, full),
      "weighted": relative_error(weighted, full),
      "tokens": tokens,
    }
    if ex.s.group and 1 < k < ex.s.batch_size:
      plain, _, _ = window_grads(ex, params, raw, k)
      row["equal_ungrouped"] = relative_error(plain, full)
    out[k] = row
  return out


def _time_one_step(run: Runner, state, batch):
  start = time.perf_counter()
  state, stats = run.step(state, batch)
  jax.block_until_ready((state, stats))
  return state, time.perf_counter() - start


def speed_table(ex: Experiment) -> list[dict]:
  """Tokens/s and compiled memory of every method at every K.

  Each case is compiled and warmed on global batch 0; then
  ``timing_rounds`` rounds each time one global step of every case, in a
  random order per round, on the same batches; the figure is the median.
  """
  cases = [("full", 1)] + [
    (m, k) for k in ex.s.table_ks for m in ("multisteps", "weighted", "instep")
  ]
  runs = {c: ex.runner(*c) for c in cases}
  states, rows = {}, {}
  for c, run in runs.items():
    rows[c] = {"method": c[0], "k": c[1], **run.compiled_memory()}
    states[c], _ = _time_one_step(run, run.init(), ex.batch(0, c[1]))
  times = {c: [] for c in cases}
  rng = np.random.default_rng(ex.s.seed)
  for r in range(ex.s.timing_rounds):
    step = 1 + r % (ex.s.steps - 1)
    for i in rng.permutation(len(cases)):
      c = cases[i]
      batch = ex.batch(step, c[1])
      states[c], dt = _time_one_step(runs[c], states[c], batch)
      times[c].append((dt, float(batch["mask"].sum())))
  for c in cases:
    dt = statistics.median(t for t, _ in times[c])
    tokens = statistics.median(n for _, n in times[c])
    rows[c].update(seconds_per_step=dt, tokens_per_second=tokens / dt)
  return list(rows.values())
