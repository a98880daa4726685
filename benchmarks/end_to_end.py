"""End to end: one window of a Flax NNX transformer, tokens/s.

A window of 8 microbatches of equal padded shape and very unequal valid
lengths, each a jitted train step (grad + ``tx.update`` +
``optax.apply_updates``, state donated, AdamW inside): the wrapper against
``optax.MultiSteps`` (the baseline) and a minimal hand-written loop (sum-loss
gradients added into a donated buffer, params read-only, one division and
one AdamW update at the end of the window, the total weight known up front).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness as h
from benchmarks import lm
from benchmarks import report
import weighted_accum as wa

TITLE = "End to end: one window of an NNX transformer"
K = 8  # microbatches per window
CONFIGS = {
  "smoke": dict(vocab=128, dim=32, layers=1, heads=2, rows=2, seq=16),
  "default": dict(vocab=4096, dim=256, layers=4, heads=4, rows=2, seq=128),
  "full": dict(vocab=8192, dim=512, layers=4, heads=8, rows=8, seq=128),
}
tmap = jax.tree.map


def _opt_step(tx, loss, with_weight: bool):
  def step(state, tokens, lengths):
    p, opt_state = state
    g = jax.grad(loss)(p, tokens, lengths)
    kw = {}
    if with_weight:
      kw["weight"] = jnp.sum(jnp.maximum(lengths - 1, 0)).astype(jnp.float32)
    updates, opt_state = tx.update(g, opt_state, p, **kw)
    return optax.apply_updates(p, updates), opt_state

  return jax.jit(step, donate_argnums=0)


def _hand_window(sum_loss, batches, total):
  """The hand-written loop over one window; params read mid-window."""
  inner = h.adamw()

  @functools.partial(jax.jit, donate_argnums=0)
  def micro(acc, p, tokens, lengths):
    return tmap(jnp.add, acc, jax.grad(sum_loss)(p, tokens, lengths))

  @functools.partial(jax.jit, donate_argnums=0)
  def last(state, tokens, lengths):
    p, opt_state, acc = state
    g = jax.grad(sum_loss)(p, tokens, lengths)
    g = tmap(lambda a, b: (a + b) / total, acc, g)
    updates, opt_state = inner.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, tmap(jnp.zeros_like, acc)

  def window(state):
    p, opt_state, acc = state
    for tokens, lengths in batches[:-1]:
      acc = micro(acc, p, tokens, lengths)
    return last((p, opt_state, acc), *batches[-1])

  return window, inner


def _cases(cfg: dict):
  params, losses = lm.make_lm(cfg)
  batches, tokens = [], 0
  for m in range(K):
    hi = max(2, cfg["seq"] * (m + 1) // K)
    t, n_len, n = lm.token_batch(cfg, cfg["rows"], hi, seed=m)
    batches.append((t, n_len))
    tokens += n

  def mean_loss(p, t, n_len):
    s, n = losses(p, t, n_len)
    return s / jnp.maximum(n, 1.0)

  def windows(step):
    def window(state):
      for t, n_len in batches:
        state = step(state, t, n_len)
      return state

    return window

  ms = optax.MultiSteps(h.adamw(), every_k_schedule=K)
  wr = wa.WeightedMultiSteps(h.adamw(), every_k_schedule=K, mode="mean")
  sum_loss = lambda p, t, n_len: losses(p, t, n_len)[0]
  hand, inner = _hand_window(sum_loss, batches, jnp.float32(tokens))
  zeros = tmap(jnp.zeros_like, params)
  base = "e2e_multisteps"
  cases = [
    h.Case(
      base,
      "optax.MultiSteps",
      windows(_opt_step(ms, mean_loss, False)),
      h.fresh_copy((params, ms.init(params))),
      what="optax.MultiSteps(adamw, 8), mean loss (the baseline)",
    ),
    h.Case(
      "e2e_wrapper",
      "wa.WeightedMultiSteps",
      windows(_opt_step(wr, mean_loss, True)),
      h.fresh_copy((params, wr.init(params))),
      baseline=base,
      what="wa.WeightedMultiSteps(adamw, 8, mode='mean'), weight = "
      "the microbatch's valid targets",
    ),
    h.Case(
      "e2e_hand_loop",
      "hand-written loop",
      hand,
      h.fresh_copy((params, inner.init(params), zeros)),
      baseline=base,
      what="jitted grad + add into a donated buffer, params read-only; "
      "the last microbatch divides and applies adamw",
    ),
  ]
  return cases, dict(
    cfg, params=lm.n_params(params), microbatches=K, tokens_per_window=tokens
  )


def run(cfg: h.Settings) -> dict:
  model = CONFIGS["smoke" if cfg.smoke else "full" if cfg.full else "default"]
  cases, info = _cases(model)
  rows = h.measure(cases, cfg, runs=h.MODEL_RUNS, warmup=1)
  h.add_ratio(rows, "vs_hand_loop", "e2e_hand_loop")
  for r in rows:
    r["tokens_per_s"] = info["tokens_per_window"] / (r["median_ms"] / 1e3)
  by = {r["case"]: r for r in rows}
  w = by["e2e_wrapper"]
  targets = [
    h.target("wrapper window / MultiSteps'", w["ratio"], 1.0),
    h.target("wrapper window / hand loop's", w["vs_hand_loop"], 1.05),
  ]
  return dict(config=info, rows=rows, targets=targets)


def markdown(result: dict) -> list[str]:
  c = result["config"]
  head = [
    "variant",
    "window ms",
    "tokens/s",
    "vs MultiSteps",
    "vs hand loop",
    "page-faulted MB",
  ]
  rows = [
    [
      r["label"],
      f"{r['median_ms']:.1f}",
      f"{r['tokens_per_s']:.0f}",
      f"{r['ratio']:.3f}x",
      f"{r['vs_hand_loop']:.3f}x",
      f"{r['faulted_mb']:.1f}",
    ]
    for r in result["rows"]
  ]
  return [
    f"Flax NNX transformer, {c['params'] / 1e6:.2f}M params ({c['layers']} "
    f"blocks, dim {c['dim']}, vocab {c['vocab']}); a window of {K} "
    f"microbatches of {c['rows']}x{c['seq']} tokens with unequal valid "
    f"lengths ({c['tokens_per_window']} valid targets). Ratios: median over "
    "windows of the per-window ratio (same round).",
    "",
  ] + report.table(head, rows)


def figure(result: dict, path) -> bool:
  c = result["config"]
  bars = [
    (
      f"{c['params'] / 1e6:.1f}M-param NNX transformer, window of {K}",
      r["label"],
      r["tokens_per_s"],
    )
    for r in result["rows"]
  ]
  return report.bar_figure(
    path, TITLE, bars, "valid tokens per second (higher is better)", ref=None
  )
