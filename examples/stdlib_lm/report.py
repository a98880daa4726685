"""The results as Markdown and as one figure."""

from __future__ import annotations

from typing import Any

import numpy as np

_COLORS = {"full": "k", "multisteps": "C3", "weighted": "C2", "instep": "C0"}


def _style(name: str) -> dict[str, Any]:
  method = name.split()[0]
  dashed = name.endswith("K=4")
  return {"color": _COLORS[method], "ls": "--" if dashed else "-", "lw": 1.2}


def markdown(res: dict[str, Any], command: str = "") -> str:
  """A Markdown report of :func:`experiment.run_all`'s results."""
  m, s, c = res["machine"], res["settings"], res["corpus"]
  out = [
    "# A byte-level LM on the standard library's sources",
    "",
    f"Machine: {m['cpu']}, {m['cores']} cores; {m['backend']}; Python "
    f"{m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, optax "
    f"{m['optax']}, flax {m['flax']}; {m['date']}; load average "
    f"{m['load_average'][0]:.1f} at start, {m['load_average_end'][0]:.1f} "
    f"at end; {res['wall_seconds'] / 60:.1f} min."
    + (f" `{command}`" if command else ""),
    "",
    f"Model: {res['params']:,} params ({s['model']}). Global batch "
    f"{s['batch_size']} rows x {s['model']['seq_len']} targets, "
    f"{s['steps']} steps, AdamW (peak lr {s['peak_lr']}, weight decay "
    f"{s['weight_decay']}, warm-up {s['warmup_fraction']:.0%} + cosine). "
    f"Corpus: {c['files']['train']} + {c['files']['valid']} files (train + "
    f"validation), {c['documents']['train']} training documents; document "
    f"bytes p0/p50/p99/p100 = "
    + "/".join(
      f"{c['doc_length_percentiles'][q]:.0f}" for q in ("0", "50", "99", "100")
    )
    + f"; {c['full_rows_fraction']:.0%} of rows full.",
    "",
  ]
  out += _gradient_table(res) + _loss_table(res) + _speed_table(res)
  return "\n".join(out) + "\n"


def _gradient_table(res) -> list[str]:
  checks = res["checks"]
  every = res["settings"]["check_every"]
  lines = [
    f"## Window gradient against the full batch ({len(checks)} checks, every "
    f"{every} steps on the reference run's params)",
    "",
    "Relative L2 error `||g - g_full|| / ||g_full||`, median (max).",
    "",
    "| K | equal weight (optax.MultiSteps) | equal weight, no length grouping "
    "| token weighted (weighted_accum) |",
    "|---:|---:|---:|---:|",
  ]
  for k, g in res["summary"]["gradient_error"].items():
    cells = [
      _cell(g, kind) for kind in ("equal", "equal_ungrouped", "weighted")
    ]
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  return lines + [""]


def _cell(g: dict, kind: str) -> str:
  if kind + "_median" not in g:
    return "same"
  return f"{g[kind + '_median']:.2e} ({g[kind + '_max']:.2e})"


def _num(x: float, sign: str = "+") -> str:
  """Fixed point, or scientific below 1e-3 (rounding-sized gaps)."""
  if x == 0 or abs(x) >= 1e-3:
    return f"{x:{sign}.4f}"
  return f"{x:{sign}.1e}"


def _loss_table(res) -> list[str]:
  tail = res["summary"]["tail_steps"]
  lines = [
    "## Losses (nats per byte)",
    "",
    f"Final train loss: the mean over the last {tail} steps (the same "
    "batches in every run); gaps are to the full-batch run.",
    "",
    "| run | final val loss | val gap | final train loss | train gap "
    "| max abs train-loss diff |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for name, r in res["summary"]["loss"].items():
    lines.append(
      f"| {name} | {r['final_val_loss']:.4f} | {_num(r['val_gap'])} | "
      f"{r['final_train_loss']:.4f} | {_num(r['train_gap'])} | "
      f"{_num(r['max_abs_train_diff'], sign='')} |"
    )
  return lines + [""]


def _speed_table(res) -> list[str]:
  if not res["speed"]:
    return []
  lines = [
    "## Throughput and compiled memory",
    "",
    "Target tokens/s: median of interleaved warm global steps (on a shared "
    "machine, compare them with the load average in mind; the memory "
    "figures are deterministic). Memory: XLA "
    "`memory_analysis` of the compiled call (one microbatch's call for the "
    "across-step wrappers, the whole step otherwise); peak = arguments + "
    "outputs - aliased + temporaries.",
    "",
    "| method | K | s/step | tokens/s | temp MB | peak MB |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in res["speed"]:
    lines.append(
      f"| {r['method']} | {r['k']} | {r['seconds_per_step']:.3f} | "
      f"{r['tokens_per_second']:.0f} | {r['temp_bytes'] / 1e6:.1f} | "
      f"{r['peak_bytes'] / 1e6:.1f} |"
    )
  return lines + [""]


def figure(res: dict[str, Any]):
  """Six panels: gradient errors, speed and memory; the training and
  validation losses, and their gaps to the full-batch run's."""
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(2, 3, figsize=(15, 7.5))
  _plot_gradients(ax[0, 0], res)
  _plot_train(ax[0, 1], res)
  _plot_validation(ax[0, 2], res, gap=False)
  _plot_speed(ax[1, 0], res)
  _plot_train_gap(ax[1, 1], res)
  _plot_validation(ax[1, 2], res, gap=True)
  fig.tight_layout()
  return fig


def _plot_gradients(ax, res):
  steps = [c["step"] for c in res["checks"]]
  for k in res["settings"]["table_ks"]:
    if k == 1:
      continue
    ls = "--" if k == 4 else "-"
    for kind, color in (("equal", "C3"), ("weighted", "C2")):
      err = [c["K"][str(k)][kind] for c in res["checks"]]
      label = "equal weight" if kind == "equal" else "token weighted"
      ax.plot(steps, err, color=color, ls=ls, label=f"{label}, K={k}")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("relative gradient error vs full batch")
  ax.legend(fontsize=8)


def _running_mean(x, n):
  x = np.asarray(x)
  c = np.cumsum(np.insert(x, 0, 0.0))
  return np.array(
    [(c[i + 1] - c[max(0, i + 1 - n)]) / min(n, i + 1) for i in range(len(x))]
  )


def _plot_train_gap(ax, res):
  ref, n = res["runs"]["full"]["train_loss"], res["summary"]["tail_steps"]
  for name, r in res["runs"].items():
    if name != "full":
      gap = np.array(r["train_loss"]) - ref
      ax.plot(_running_mean(gap, n), label=name, **_style(name))
  ax.axhline(0.0, color="k", lw=0.6)
  ax.set_xlabel("step")
  ax.set_ylabel(f"train loss - full batch's ({n}-step running mean)")
  ax.legend(fontsize=8)


def _plot_train(ax, res):
  n = res["summary"]["tail_steps"]
  for name, r in res["runs"].items():
    ax.plot(_running_mean(r["train_loss"], n), label=name, **_style(name))
  ax.set_xlabel("step")
  ax.set_ylabel(f"train loss, nats/byte ({n}-step running mean)")
  ax.legend(fontsize=8)


def _plot_validation(ax, res, gap: bool):
  ref = np.array(res["runs"]["full"]["val_loss"])
  for name, r in res["runs"].items():
    y = np.array(r["val_loss"]) - (ref if gap else 0.0)
    if not (gap and name == "full"):
      ax.plot(r["val_steps"], y, marker=".", label=name, **_style(name))
  if gap:
    ax.axhline(0.0, color="k", lw=0.6)
  ax.set_xlabel("step")
  what = "validation loss - full batch's" if gap else "validation loss"
  ax.set_ylabel(what + " (nats/byte)")
  ax.legend(fontsize=8)


def _plot_speed(ax, res):
  rows = res["speed"]
  if not rows:
    ax.set_axis_off()
    return
  labels = [f"{r['method']}\nK={r['k']}" for r in rows]
  x = np.arange(len(rows))
  colors = [_COLORS[r["method"]] for r in rows]
  ax.bar(x, [r["tokens_per_second"] for r in rows], color=colors, alpha=0.7)
  ax.set_xticks(x, labels, fontsize=7, rotation=60)
  ax.set_ylabel("target tokens/s (bars)")
  twin = ax.twinx()
  twin.plot(x, [r["peak_bytes"] / 1e6 for r in rows], "ko", label="peak MB")
  twin.set_ylabel("peak compiled memory, MB (dots)")
  twin.set_ylim(bottom=0)
