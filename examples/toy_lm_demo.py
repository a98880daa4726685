"""The tiny-LM demo: ``python examples/toy_lm_demo.py``.

On a deterministic synthetic dataset of variable-length sequences and a tiny
Flax NNX language model, it compares on one batch the full-batch gradient with
weighted accumulation (this library) and equal-weight accumulation (what
``optax.MultiSteps`` computes), then trains a few windows each way.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import functools
import sys
import time
from typing import Any, NamedTuple

from flax import nnx
import jax
import optax
import toy_lm as toy

import weighted_accum as wa

SIZES = (1, 2, 3, 5, 8, 13, 12, 20)  # rows per microbatch: 64 in all


class _Demo(NamedTuple):
  """The demo's jitted pieces, built once."""

  grad: Callable[..., Any]  # (params, batch, kind) -> grads
  mean_value: Callable[..., Any]  # (params, batch) -> mean loss
  apply: Callable[..., Any]  # (params, opt_state, grads) -> both
  tx: optax.GradientTransformation


def _build(graphdef: Any) -> _Demo:
  def loss(params, batch, kind):
    m = nnx.merge(graphdef, params)
    return toy.mean_loss(m, batch) if kind == "mean" else toy.sum_loss(m, batch)

  tx = optax.adam(3e-3)

  @jax.jit
  def apply(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return _Demo(
    grad=jax.jit(jax.grad(loss), static_argnums=2),
    mean_value=jax.jit(lambda p, b: loss(p, b, "mean")),
    apply=apply,
    tx=tx,
  )


def _microbatches(batch: toy.Batch) -> list[toy.Batch]:
  """The batch's microbatches of ``SIZES`` rows, each padded with empty rows
  to one shape (one compiled gradient, as with a real input pipeline)."""
  return toy.split(batch, SIZES, pad_to=max(SIZES))


_plain_mean = jax.jit(lambda *gs: jax.tree.map(lambda *g: sum(g) / len(g), *gs))
_acc_mean = jax.jit(wa.accumulate_mean, donate_argnums=0)
_finish = jax.jit(wa.finish_mean, donate_argnums=0)


def _weighted(demo: _Demo, params: Any, batch: Any) -> Any:
  """This library: each microbatch's mean gradient weighted by its tokens."""
  state = wa.init(params)
  for mb in _microbatches(batch):
    state = _acc_mean(state, demo.grad(params, mb, "mean"), toy.weight(mb))
  out, _ = _finish(state)
  return out.grads


def _equal_weight(demo: _Demo, params: Any, batch: Any) -> Any:
  """What ``optax.MultiSteps`` computes: the plain mean of the means."""
  gs = [demo.grad(params, mb, "mean") for mb in _microbatches(batch)]
  return _plain_mean(*gs)


def _gradient_table(
  demo: _Demo, params0: Any, batch: Any, n_params: int
) -> None:
  weights = [int(toy.weight(mb)) for mb in _microbatches(batch)]
  print(
    f"weighted_accum demo: TinyLM ({n_params:,} params), one batch of "
    f"{sum(SIZES)} sequences of lengths {int(batch.lengths.min())}.."
    f"{int(batch.lengths.max())}, split into {len(SIZES)} microbatches "
    f"of {list(SIZES)} sequences (each padded to {max(SIZES)} rows)"
  )
  print(f"tokens per microbatch: {weights} (total {sum(weights)})\n")
  full = demo.grad(params0, batch, "mean")
  rows = [
    ("full-batch gradient (reference)", full),
    ("weighted accumulation (weighted_accum)", _weighted(demo, params0, batch)),
    (
      "equal-weight accumulation (optax.MultiSteps)",
      _equal_weight(demo, params0, batch),
    ),
  ]
  print(f"{'gradient':46s} {'relative error vs full batch':>30s}")
  print("-" * 77)
  for name, g in rows:
    print(f"{name:46s} {toy.rel_err(g, full):30.2e}")
  print()


def _train(demo: _Demo, params0: Any, data: list[Any]) -> None:
  runs = {
    "full batch": lambda p, b: demo.grad(p, b, "mean"),
    "weighted_accum": functools.partial(_weighted, demo),
    "equal-weight": functools.partial(_equal_weight, demo),
  }
  params = {k: params0 for k in runs}
  opt = {k: demo.tx.init(params0) for k in runs}
  history = {k: [] for k in runs}
  for w in range(len(data)):
    for k, fn in runs.items():
      history[k].append(float(demo.mean_value(params[k], data[w])))
      params[k], opt[k] = demo.apply(params[k], opt[k], fn(params[k], data[w]))
  print("\ntraining loss (per-token mean) at the start of each window:")
  print(f"{'window':>6s} " + " ".join(f"{k:>16s}" for k in runs))
  step = max(1, len(data) // 8)
  for w in sorted(set(range(0, len(data), step)) | {len(data) - 1}):
    print(f"{w:6d} " + " ".join(f"{history[k][w]:16.5f}" for k in runs))
  drift = {
    k: max(abs(a - b) for a, b in zip(history[k], history["full batch"]))
    for k in runs
  }
  print(
    f"\nmax |loss - full batch loss|: weighted_accum "
    f"{drift['weighted_accum']:.2e}, "
    f"equal-weight {drift['equal-weight']:.2e}"
  )


def main(argv: list[str] | None = None) -> int:
  """Runs the demo; ``--windows 0`` prints the gradient table only."""
  parser = argparse.ArgumentParser(
    prog="python examples/toy_lm_demo.py", description=__doc__.split("\n\n")[1]
  )
  parser.add_argument(
    "--windows",
    type=int,
    default=25,
    help="optimizer steps (accumulation windows) to train; "
    "0: the gradient table only",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  t0 = time.perf_counter()
  data = [
    toy.make_dataset(num_sequences=sum(SIZES), max_len=24, seed=args.seed + i)
    for i in range(max(1, args.windows))
  ]
  model = toy.TinyLM(dim=32, heads=2, max_len=24, rngs=nnx.Rngs(args.seed))
  graphdef, params0 = nnx.split(model, nnx.Param)
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  demo = _build(graphdef)
  _gradient_table(demo, params0, data[0], n_params)
  if args.windows > 0:
    _train(demo, params0, data[: args.windows])
  print(f"done in {time.perf_counter() - t0:.1f} s on {jax.default_backend()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
