"""In-step: every microbatch of a global batch inside one jitted step.

``wa.microbatched_value_and_grad`` at K = 8 on a Flax NNX LM against a
MaxText-style hand-written ``lax.scan`` (the baseline: the loss sum and the
total weight in the carry, one division at the end) and
``optax.microbatching`` (``microbatch`` of ``value_and_grad``, and
``micro_grad``, both SUM); with ``--full`` the same call at K = 1 and 4. Time per step
(interleaved, paired per round), tokens/s, and XLA's compiled temporaries.
Also the all-reduces each data-parallel style executes per step on an
8-device mesh, counted in the compiled HLO of a child process (the device
count is fixed when jax starts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness as h
from benchmarks import lm
from benchmarks import report
import weighted_accum as wa

TITLE = "In-step microbatching vs a hand-written scan"
K = 8
CONFIGS = {
  "smoke": dict(vocab=128, dim=32, layers=1, heads=2, rows=16, seq=16),
  "default": dict(vocab=1024, dim=128, layers=2, heads=4, rows=32, seq=64),
  "full": dict(vocab=4096, dim=256, layers=4, heads=4, rows=32, seq=128),
}
tmap = jax.tree.map
BASE = "mb_hand_scan"


def _hand_scan(losses, k: int):
  """MaxText-style: scan over rows k::K; loss sum, weight in the carry."""

  def step(p, tokens, lengths):
    def split(x):
      return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)

    def body(carry, mb):
      g_acc, l_acc, w_acc = carry
      (l, w), g = jax.value_and_grad(losses, has_aux=True)(p, *mb)
      return (tmap(jnp.add, g_acc, g), l_acc + l, w_acc + w), None

    zero = jnp.zeros((), jnp.float32)
    init = (tmap(jnp.zeros_like, p), zero, zero)
    (g, l, w), _ = jax.lax.scan(body, init, (split(tokens), split(lengths)))
    return l / w, tmap(lambda x: x / w, g)

  return jax.jit(step)


def _optax_microbatch(losses, k: int, rows: int):
  mb = optax.microbatching.microbatch(
    jax.value_and_grad(losses, has_aux=True),
    argnums=(1, 2),
    microbatch_size=rows // k,
    accumulator=optax.microbatching.AccumulationType.SUM,
  )

  def step(p, tokens, lengths):
    (l, w), g = mb(p, tokens, lengths)
    return l / w, tmap(lambda x: x / w, g)

  return jax.jit(step)


def _optax_micro_grad(losses, k: int, rows: int):
  mg = optax.microbatching.micro_grad(
    losses,
    has_aux=True,
    batch_argnums=(1, 2),
    microbatch_size=rows // k,
    accumulator=optax.microbatching.AccumulationType.SUM,
  )

  def step(p, tokens, lengths):
    g, aux = mg(p, tokens, lengths)
    w = jnp.sum(aux.aux)
    return jnp.sum(aux.values) / w, tmap(lambda x: x / w, g)

  return jax.jit(step)


def cases(cfg: dict, other_k: bool = False):
  """The step variants, each compiled once (its temporaries read); K = 1
  and 4 too when ``other_k``."""
  params, losses = lm.make_lm(cfg)
  rows = cfg["rows"]
  tokens, lengths, n_tok = lm.token_batch(cfg, rows, cfg["seq"], seed=0)
  wa_k = lambda k: jax.jit(
    wa.microbatched_value_and_grad(losses, k, mode="sum", batch_argnums=(1, 2))
  )
  variants = [
    (BASE, f"hand-written lax.scan, K={K}", _hand_scan(losses, K)),
    ("mb_wa", f"wa.microbatched_value_and_grad, K={K}", wa_k(K)),
    (
      "mb_optax_microbatch",
      "optax.microbatching.microbatch, SUM",
      _optax_microbatch(losses, K, rows),
    ),
    (
      "mb_optax_micro_grad",
      "optax.microbatching.micro_grad, SUM",
      _optax_micro_grad(losses, K, rows),
    ),
  ] + [
    (f"mb_wa_k{k}", f"wa.microbatched_value_and_grad, K={k}", wa_k(k))
    for k in ((1, 4) if other_k else ())
  ]
  out, temps = [], {}
  for name, label, fn in variants:
    compiled = fn.lower(params, tokens, lengths).compile()
    temps[name] = int(compiled.memory_analysis().temp_size_in_bytes)
    out.append(
      h.Case(
        name,
        label,
        compiled,
        params,
        (tokens, lengths),
        keep=lambda _, p=params: p,
        baseline=None if name == BASE else BASE,
        what=label,
      )
    )
  info = dict(cfg, params=lm.n_params(params), tokens=n_tok, k=K)
  return out, temps, info


def run(cfg: h.Settings) -> dict:
  model = CONFIGS["smoke" if cfg.smoke else "full" if cfg.full else "default"]
  cs, temps, info = cases(model, other_k=cfg.full)
  rows = h.measure(cs, cfg, runs=h.MODEL_RUNS, warmup=1)
  for r in rows:
    r["tokens_per_s"] = info["tokens"] / (r["median_ms"] / 1e3)
    r["temp_bytes"] = temps[r["case"]]
    r["temp_ratio"] = temps[r["case"]] / max(temps[BASE], 1)
  all_reduces = (
    all_reduce_counts(model)  # e.g. under the test suite's 8 CPU devices
    if jax.device_count() == 8
    else all_reduces_in_child(model)
  )
  by = {r["case"]: r for r in rows}
  wa_r = by["mb_wa"]["ratio"]
  targets = [
    h.target("wa / hand scan (time)", wa_r, 1.03),
    h.target("wa / hand scan (temporaries)", by["mb_wa"]["temp_ratio"], 1.0),
    h.target(
      "wa / optax microbatch (time)",
      wa_r / by["mb_optax_microbatch"]["ratio"],
      1.03,
    ),
    h.target(
      "wa / optax micro_grad (time)",
      wa_r / by["mb_optax_micro_grad"]["ratio"],
      1.03,
    ),
  ]
  if all_reduces:
    targets.append(
      h.target(
        "shard_map all-reduces executed per step",
        all_reduces["shard_map"]["executed_per_step"],
        1,
      )
    )
  return dict(config=info, rows=rows, all_reduces=all_reduces, targets=targets)


# ----------------------------------------------------------------------------
# All-reduces per step (to move onto benchmarks/hlo.py's counter).
# ----------------------------------------------------------------------------


def _while_bodies(hlo: str) -> dict[str, str]:
  """Every computation reachable from a while loop's body, by name."""
  comps = dict(
    re.findall(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M)
  )
  todo = re.findall(r"while\([^\n]*body=%?([\w.\-]+)", hlo)
  seen = {}
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen[name] = comps[name]
    todo += re.findall(
      r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name]
    )
  return seen


def count_all_reduces(hlo: str, k: int) -> dict[str, int]:
  """All-reduces in and outside the loop body; executed per step."""
  pat = r"all-reduce(?:-start)?\("
  total = len(re.findall(pat, hlo))
  inside = sum(len(re.findall(pat, t)) for t in _while_bodies(hlo).values())
  return dict(
    in_loop_body=inside,
    outside=total - inside,
    executed_per_step=total - inside + k * inside,
  )


def all_reduce_counts(cfg: dict) -> dict:
  """shard_map with ``axis_name`` and implicit jit over a sharded batch,
  on a 'data' mesh of every device (run in an 8-device process)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  params, losses = lm.make_lm(cfg)
  tokens, lengths, _ = lm.token_batch(
    cfg, K * jax.device_count(), cfg["seq"], seed=0
  )
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  f = wa.microbatched_value_and_grad(
    losses, K, mode="sum", batch_argnums=(1, 2), axis_name="data"
  )
  sm = jax.jit(
    jax.shard_map(
      f, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
    )
  )
  imp = jax.jit(
    wa.microbatched_value_and_grad(losses, K, mode="sum", batch_argnums=(1, 2))
  )
  data = [
    jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (tokens, lengths)
  ]
  p = jax.device_put(params, NamedSharding(mesh, P()))
  hlo = lambda fn: fn.lower(p, *data).compile().as_text()
  return dict(
    devices=jax.device_count(),
    k=K,
    shard_map=count_all_reduces(hlo(sm), K),
    implicit=count_all_reduces(hlo(imp), K),
  )


def all_reduces_in_child(cfg: dict) -> dict | None:
  """:func:`all_reduce_counts` in a child process with 8 CPU devices."""
  root = str(Path(__file__).resolve().parents[1])
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [root] + [x for x in [env.get("PYTHONPATH")] if x]
  )
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  res = subprocess.run(
    [sys.executable, "-m", "benchmarks.in_step", json.dumps(cfg)],
    env=env,
    cwd=root,
    capture_output=True,
    text=True,
    check=False,
  )
  if res.returncode:
    print(f"  all-reduce count failed: {res.stderr[-2000:]}", file=sys.stderr)
    return None
  return json.loads(res.stdout.strip().splitlines()[-1])


def markdown(result: dict) -> list[str]:
  c = result["config"]
  head = [
    "step",
    "ms/step",
    "tokens/s",
    "vs hand scan",
    "of medians",
    "temp MB",
    "temp vs hand scan",
  ]
  rows = [
    [
      r["label"],
      f"{r['median_ms']:.2f}",
      f"{r['tokens_per_s']:.0f}",
      f"{r['ratio']:.3f}x",
      f"{r['ratio_of_medians']:.3f}x",
      f"{r['temp_bytes'] / 1e6:.1f}",
      f"{r['temp_ratio']:.3f}x",
    ]
    for r in result["rows"]
  ]
  out = [
    f"Flax NNX LM, {c['params'] / 1e6:.2f}M params ({c['layers']} "
    f"blocks, dim {c['dim']}), one jitted step over a global batch of "
    f"{c['rows']}x{c['seq']} tokens with unequal lengths ({c['tokens']} "
    "valid targets). Ratios: median of per-round ratios; also the ratio "
    "of medians.",
    "",
  ] + report.table(head, rows)
  ar = result.get("all_reduces")
  if ar:
    out += [
      f"All-reduces per step, {ar['devices']}-device data mesh, K = {ar['k']}:",
      "",
    ]
    out += report.table(
      ["style", "in loop body", "outside", "executed per step"],
      [[s, *ar[s].values()] for s in ("shard_map", "implicit")],
    )
  return out


def figure(result: dict, path) -> bool:
  c = result["config"]
  g = f"{c['params'] / 1e6:.2f}M-param NNX LM, {c['rows']}x{c['seq']} tokens"
  bars = [
    (g, r["label"], r["ratio"]) for r in result["rows"] if r["case"] != BASE
  ]
  return report.bar_figure(
    path, TITLE, bars, "time / hand-written scan (same round)"
  )


if __name__ == "__main__":  # the all-reduce child (all_reduces_in_child)
  print(json.dumps(all_reduce_counts(json.loads(sys.argv[1]))))
