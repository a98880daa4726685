"""The training runs: full batch, optax.MultiSteps, and weighted_accum.

Every run starts from the same init, sees the same global batches in the
same order and uses the same AdamW with a warm-up + cosine schedule (one
inner step per global batch). They differ only in how a global batch's
gradient is formed:

- ``full``: one gradient of the batch's token-mean loss (the reference);
- ``multisteps``: ``optax.MultiSteps`` over K microbatches of each global
  batch, fed each microbatch's mean-loss gradient (an equal-weight mean of
  the K means);
- ``weighted``: ``wa.WeightedMultiSteps`` over the same microbatches, fed
  the same gradients with ``weight=`` each microbatch's target tokens;
- ``instep``: ``wa.microbatched_value_and_grad`` over the K microbatches
  inside one jitted step (the weighted result, in one call).

Microbatch ``m`` of ``K`` is rows ``m::K`` of the global batch after
:func:`data.group_by_length` (when ``Settings.group`` is set).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import weighted_accum as wa

from . import data
from . import model

METHODS = ("full", "multisteps", "weighted", "instep")


@dataclasses.dataclass(frozen=True)
class Settings:
  """One experiment's configuration (see ``__main__`` for the presets)."""

  model: model.Config = model.Config()
  batch_size: int = 16
  steps: int = 200
  train_ks: tuple[int, ...] = (4, 16)  # K of the wrappers' training runs
  instep_ks: tuple[int, ...] = (16,)  # K of the in-step training runs
  table_ks: tuple[int, ...] = (1, 4, 16)  # K of the gradient/speed table
  peak_lr: float = 2e-3
  warmup_fraction: float = 0.1
  weight_decay: float = 0.1
  seed: int = 0
  group: bool = True
  eval_every: int = 25
  check_every: int = 5
  val_rows: int = 256
  timing_rounds: int = 5


def optimizer(s: Settings) -> optax.GradientTransformation:
  """AdamW with a linear warm-up and a cosine decay over ``s.steps``."""
  warmup = max(1, int(s.warmup_fraction * s.steps))
  lr = optax.warmup_cosine_decay_schedule(
    0.0, s.peak_lr, warmup, s.steps, end_value=0.1 * s.peak_lr
  )
  return optax.adamw(lr, weight_decay=s.weight_decay)


class Experiment:
  """The corpus, the model and the data order shared by every run."""

  def __init__(self, s: Settings, corpus: data.Corpus | None = None):
    self.s = s
    self.corpus = corpus or data.load_corpus(s.model.seq_len)
    self.graphdef, self.params0 = model.init(s.model, s.seed)
    self.loss_sum, self.loss_mean = model.make_losses(self.graphdef)
    self.order = data.batch_order(
      len(self.corpus.train), s.batch_size, s.steps, s.seed
    )
    pick = np.random.default_rng(s.seed + 1).permutation(len(self.corpus.valid))
    self.val = self.corpus.valid.take(np.sort(pick[: s.val_rows]))
    self._runners = {}

  def runner(self, method: str, k: int) -> Runner:
    """The (cached, so compiled once) :class:`Runner` of a method at K."""
    key = (method, 1 if method == "full" else k)
    if key not in self._runners:
      self._runners[key] = Runner(self, *key)
    return self._runners[key]

  def runs(self) -> list[tuple[str, int]]:
    """The training runs: ``(method, K)`` pairs, the reference first."""
    pairs = [("full", 1)]
    for k in self.s.train_ks:
      pairs += [("multisteps", k), ("weighted", k)]
    return pairs + [("instep", k) for k in self.s.instep_ks]

  def batch(self, step: int, k: int = 1) -> dict[str, np.ndarray]:
    """Global batch ``step``, arranged for K microbatches."""
    b = self.corpus.train.take(self.order[step])
    return data.group_by_length(b, k) if self.s.group and k > 1 else b

  def fresh_params(self):
    """A copy of the shared init (runs donate their params)."""
    return jax.tree.map(jnp.copy, self.params0)


def _apply(tx, grads, opt_state, params):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def full_step(ex: Experiment, tx):
  """``step(params, opt_state, batch) -> (params, opt_state, (sum, n))``."""
  vg = jax.value_and_grad(ex.loss_mean, has_aux=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    (mean, n), grads = vg(params, batch)
    params, opt_state = _apply(tx, grads, opt_state, params)
    return params, opt_state, (mean * n, n)

  return step


def instep_step(ex: Experiment, tx, k: int):
  """The full step with ``wa.microbatched_value_and_grad`` over K."""
  f = wa.microbatched_value_and_grad(ex.loss_mean, k, mode="mean")

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    mean, out = f(params, batch)
    params, opt_state = _apply(tx, out.grads, opt_state, params)
    return params, opt_state, (mean * out.weight, out.weight)

  return step


def micro_step(ex: Experiment, wrapper, weighted: bool):
  """One microbatch through an accumulating wrapper (params donated)."""
  vg = jax.value_and_grad(ex.loss_mean, has_aux=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, mb):
    (mean, n), grads = vg(params, mb)
    extra = {"weight": n} if weighted else {}
    updates, opt_state = wrapper.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, (mean * n, n)

  return step


class Runner:
  """One method at one K: ``init()`` and ``step(state, batch)``."""

  def __init__(self, ex: Experiment, method: str, k: int):
    self.ex, self.method, self.k = ex, method, k
    tx = optimizer(ex.s)
    if method == "multisteps":
      self.tx = optax.MultiSteps(tx, every_k_schedule=k)
      self._step = micro_step(ex, self.tx, weighted=False)
    elif method == "weighted":
      self.tx = wa.WeightedMultiSteps(tx, every_k_schedule=k, mode="mean")
      self._step = micro_step(ex, self.tx, weighted=True)
    elif method == "instep":
      self.tx, self._step = tx, instep_step(ex, tx, k)
    elif method == "full":
      self.tx, self._step = tx, full_step(ex, tx)
    else:
      raise ValueError(f"method must be one of {METHODS}, got {method!r}")

  @property
  def micro(self) -> bool:
    return self.method in ("multisteps", "weighted")

  def init(self):
    params = self.ex.fresh_params()
    return params, self.tx.init(params)

  def step(self, state, batch):
    """One global batch; returns ``(state, (loss_sum, n))`` on device."""
    params, opt_state = state
    if not self.micro:
      params, opt_state, stats = self._step(params, opt_state, batch)
      return (params, opt_state), stats
    total, count = 0.0, 0.0
    for m in range(self.k):
      mb = data.microbatch(batch, m, self.k)
      params, opt_state, (s, n) = self._step(params, opt_state, mb)
      total, count = total + s, count + n
    return (params, opt_state), (total, count)

  def compiled_memory(self) -> dict[str, int]:
    """XLA's memory analysis of the compiled call (a microbatch's for the
    accumulating wrappers, the whole step's otherwise)."""
    params, opt_state = self.init()
    batch = self.ex.batch(0, self.k)
    if self.micro:
      batch = data.microbatch(batch, 0, self.k)
    ma = self._step.lower(params, opt_state, batch).compile().memory_analysis()
    args, out = ma.argument_size_in_bytes, ma.output_size_in_bytes
    alias, temp = ma.alias_size_in_bytes, ma.temp_size_in_bytes
    return {
      "argument_bytes": int(args),
      "output_bytes": int(out),
      "alias_bytes": int(alias),
      "temp_bytes": int(temp),
      "peak_bytes": int(args + out - alias + temp),
    }


def validation_loss(ex: Experiment, params, chunk: int) -> float:
  """The token-mean loss over the fixed validation rows."""
  f = _val_fn(ex)
  total, count = 0.0, 0.0
  for i in range(0, ex.s.val_rows, chunk):
    part = {name: x[i : i + chunk] for name, x in ex.val.items()}
    s, n = f(params, part)
    total, count = total + float(s), count + float(n)
  return total / count


@functools.cache
def _val_fn(ex: Experiment):
  return jax.jit(ex.loss_sum)


def train(ex: Experiment, method: str, k: int, on_step=None) -> dict[str, Any]:
  """Trains one run over every global batch.

  Args:
    ex: the shared experiment.
    method: one of :data:`METHODS`.
    k: microbatches per global batch (ignored by ``full``).
    on_step: called as ``on_step(step, params)`` before each step (the
      gradient check hooks in here on the reference run).

  Returns:
    ``{"train_loss": [...], "val_steps": [...], "val_loss": [...],
    "seconds": ...}``: the token-mean training loss of each global batch
    (at the params the step starts from) and the validation curve.
  """
  run = ex.runner(method, k)
  state = run.init()
  s, curve, val_steps, val = ex.s, [], [], []
  start = time.perf_counter()
  for step in range(s.steps):
    if step % s.eval_every == 0:
      val_steps.append(step)
      val.append(validation_loss(ex, state[0], s.batch_size))
    if on_step is not None:
      on_step(step, state[0])
    state, (total, count) = run.step(state, ex.batch(step, k))
    curve.append(float(total) / float(count))
  val_steps.append(s.steps)
  val.append(validation_loss(ex, state[0], s.batch_size))
  seconds = time.perf_counter() - start
  return {
    "train_loss": curve,
    "val_steps": val_steps,
    "val_loss": val,
    "seconds": seconds,
  }
