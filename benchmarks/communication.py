"""Bytes reduced per step and per window against K, for every sharding style.

One command::

  python benchmarks/communication.py        # a few minutes on 2 CPU cores

writes ``benchmarks/results/cpu-<date>-communication.{json,md}`` and prints
the Markdown. Every figure is read from a compiled program's optimised HLO
with ``benchmarks/hlo.py`` (an op inside a loop counted once per trip), on 8
virtual CPU devices: deterministic, no timing. "Data-axis bytes" are the
operand bytes per device of the all-reduces and reduce-scatters whose replica
groups are a reduction over the data axes (``hlo.mesh_groups``);
tensor-parallel (model-axis) reductions of the model itself are reported
apart.

Styles, each at K = 1, 2, 8 microbatches per call:

- ``microbatched_value_and_grad`` inside ``jax.shard_map`` with ``axis_name``;
- the same under plain ``jax.jit`` without ``data_axes`` (XLA reduces every
  microbatch's gradient where autodiff produces it) and with ``data_axes``,
  on Auto and Explicit meshes: params replicated, ``data x model`` (params
  sharded over ``model``), two data axes, FSDP (params sharded over
  ``data``; ``fsdp="gather_once"`` and ``"scatter_each"``);
- a hand-written MaxText-style ``lax.scan`` and ``optax.microbatching``
  (SUM) under plain ``jit``;
- across steps, a window of 4 calls: ``f.accumulate`` into a global window
  (``wa.init``) under plain ``jit``, and into a stacked per-replica window
  (``distributed.init``) closed by ``apply_window(axis_name=...)``.

Only the public API and ``benchmarks/hlo.py`` are used. The cost model of
``docs/scaling.md`` is computed from these bytes (``--bandwidth``,
``--latency``, ``--param-bytes``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
from pathlib import Path
import platform
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package and benchmarks/

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import hlo  # noqa: E402
import weighted_accum as wa  # noqa: E402

N = 8
KS = (1, 2, 8)
CALLS = 4  # calls (steps) per window, across steps
D, H = 16, 32
ROWS = 64 * N

REPLICATED = {"w1": P(), "b1": P(), "w2": P()}
MODEL = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model")}
FSDP = {"w1": P("data", None), "b1": P("data"), "w2": P("data")}


# ------------------------------------------------------------ the model --


def _params():
  r = np.random.default_rng(0)
  return {
    "w1": (r.standard_normal((D, H)) / 4).astype(np.float32),
    "b1": (0.1 * r.standard_normal(H)).astype(np.float32),
    "w2": (r.standard_normal(H) / 6).astype(np.float32),
  }


def _batch():
  r = np.random.default_rng(1)
  m = (r.random(ROWS) < 0.6).astype(np.float32)
  m[: ROWS // N] = 0
  return {
    "x": r.standard_normal((ROWS, D)).astype(np.float32),
    "y": r.standard_normal(ROWS).astype(np.float32),
    "m": m,
  }


def loss_fn(p, b, matmul=jnp.matmul):
  """``(loss SUM, item count)`` of a masked regression microbatch."""
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  pred = matmul(h, p["w2"])
  return jnp.sum(b["m"] * (pred - b["y"]) ** 2), jnp.sum(b["m"])


def loss_explicit_2d(p, b):
  """On an Explicit data x model mesh the model-axis contraction names its
  output sharding (the model's business)."""
  return loss_fn(p, b, lambda h, w: jnp.matmul(h, w, out_sharding=P(None)))


def hand_scan(k):
  """MaxText-style: the loss sum and the total weight in the scan carry."""

  def f(p, b):
    bs = jax.tree.map(
      lambda x: jnp.moveaxis(
        x.reshape((x.shape[0] // k, k) + x.shape[1:]), 1, 0
      ),
      b,
    )

    def body(c, mb):
      g, (total, w) = c
      (s, n), gi = jax.value_and_grad(loss_fn, has_aux=True)(p, mb)
      return (jax.tree.map(jnp.add, g, gi), (total + s, w + n)), None

    zeros = jax.tree.map(jnp.zeros_like, p)
    (g, (total, w)), _ = jax.lax.scan(body, (zeros, (0.0, 0.0)), bs)
    return total / w, jax.tree.map(lambda x: x / w, g)

  return f


def optax_sum(k):
  vg = jax.value_and_grad(loss_fn, has_aux=True)
  return optax.microbatching.microbatch(
    vg,
    argnums=1,
    microbatch_size=ROWS // k,
    accumulator=optax.microbatching.AccumulationType.SUM,
  )


# ---------------------------------------------------------------- meshes --


class Mesh:
  """A mesh, its data axes and where the params live."""

  def __init__(self, shape, names, specs, data_axes, explicit):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    self.mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))
    self.specs, self.data_axes, self.explicit = specs, data_axes, explicit

  def context(self):
    if self.explicit:
      return jax.set_mesh(self.mesh)
    return contextlib.nullcontext()

  def put(self, params, batch):
    with self.context():
      p = {
        k: jax.device_put(v, NamedSharding(self.mesh, self.specs[k]))
        for k, v in params.items()
      }
      b = jax.device_put(batch, NamedSharding(self.mesh, P(self.data_axes)))
    return p, b


def measure(mesh: Mesh, fn, *args, **hlo_kw) -> dict:
  """The compiled step's collectives: data-axis bytes and counts, the
  all-gathers over the data axes, the rest (model-axis) bytes."""
  with mesh.context():
    compiled = jax.jit(fn).lower(*args).compile()
  s = hlo.hlo_stats(compiled, **hlo_kw)
  g = hlo.mesh_groups(mesh.mesh, mesh.data_axes)
  reduced = hlo.all_reduced_bytes(s, g)
  return {
    "data_bytes": reduced,
    "reductions": s.count("all-reduce", g) + s.count("reduce-scatter", g),
    "in_loops": s.in_loops("all-reduce", g) + s.in_loops("reduce-scatter", g),
    "all_gather_bytes": s.nbytes("all-gather", g),
    "ring_bytes": s.ring_bytes("all-reduce", g)
    + s.ring_bytes("reduce-scatter", g),
    "other_bytes": s.nbytes()
    - sum(c.executions * c.nbytes for c in s.select(None, g)),
    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
  }


def in_step_rows() -> list[dict]:
  """Bytes per step of one call, every in-step style and K."""
  meshes = {
    "replicated": Mesh((N,), ("data",), REPLICATED, "data", False),
    "data4 x model2": Mesh((4, 2), ("data", "model"), MODEL, "data", False),
    "two data axes 2 x 4": Mesh(
      (2, 4), ("replica", "data"), REPLICATED, ("replica", "data"), False
    ),
    "FSDP over data": Mesh((N,), ("data",), FSDP, "data", False),
    "Explicit replicated": Mesh((N,), ("data",), REPLICATED, "data", True),
    "Explicit data4 x model2": Mesh(
      (4, 2), ("data", "model"), MODEL, "data", True
    ),
    "Explicit FSDP over data": Mesh((N,), ("data",), FSDP, "data", True),
  }
  rows = []
  mv = wa.microbatched_value_and_grad
  for k in KS:
    for label, m in meshes.items():
      p, b = m.put(_params(), _batch())
      loss = loss_explicit_2d if m.explicit and "model" in label else loss_fn
      specs = None if m.explicit else m.specs
      cases = {}
      if not (m.explicit and "FSDP" in label):  # the model itself refuses it
        cases["jit, no data_axes"] = mv(loss, k, mode="sum")
      fsdps = (
        ("gather_once", "scatter_each") if "FSDP" in label else ("gather_once",)
      )
      for fsdp in fsdps:
        name = "jit, data_axes" + (f", fsdp={fsdp}" if "FSDP" in label else "")
        cases[name] = mv(
          loss,
          k,
          mode="sum",
          axis_name=wa.distributed.DataParallel(
            m.data_axes, param_specs=specs, fsdp=fsdp
          ),
        )
      if label == "replicated":
        inner = mv(loss, k, mode="sum", axis_name="data")
        cases["shard_map + axis_name"] = jax.shard_map(
          inner, mesh=m.mesh, in_specs=(P(), P("data")), out_specs=P()
        )
        cases["hand MaxText-style scan"] = hand_scan(k)
        cases["optax.microbatching SUM"] = optax_sum(k)
      for case, fn in cases.items():
        rows.append(dict(mesh=label, style=case, k=k, **measure(m, fn, p, b)))
  return rows


def across_rows() -> list[dict]:
  """Bytes per window of CALLS calls: mid-window step and close."""
  tx = optax.adam(1e-2)
  rows = []
  meshes = {
    "replicated": Mesh((N,), ("data",), REPLICATED, "data", False),
    "Explicit FSDP over data": Mesh((N,), ("data",), FSDP, "data", True),
  }
  for k in KS:
    for label, m in meshes.items():
      p, b = m.put(_params(), _batch())
      with m.context():
        opt = tx.init(p)
        plain = wa.microbatched_value_and_grad(loss_fn, k, mode="sum")
        if not m.explicit:
          glob = wa.init(p)
          mid = measure(m, plain.accumulate, glob, p, b)
          close = measure(
            m, lambda s, p, o: wa.apply_window(tx, s, p, o), glob, p, opt
          )
          rows.append(
            _window(label, "f.accumulate into wa.init, jit", k, mid, close)
          )
        f = wa.microbatched_value_and_grad(
          loss_fn,
          k,
          mode="sum",
          axis_name="data",
        )
        stacked = wa.init(p, axis_name="data")
        mid = measure(m, f.accumulate, stacked, p, b)
        close = measure(
          m,
          lambda s, p, o: wa.apply_window(tx, s, p, o),
          stacked,
          p,
          opt,
        )
        rows.append(
          _window(label, "stacked window, data_axes, jit", k, mid, close)
        )
  return rows


def _window(label, style, k, mid, close) -> dict:
  return dict(
    mesh=label,
    style=style,
    k=k,
    mid_bytes=mid["data_bytes"],
    mid_reductions=mid["reductions"],
    close_bytes=close["data_bytes"],
    close_reductions=close["reductions"],
    window_bytes=CALLS * mid["data_bytes"] + close["data_bytes"],
    window_reductions=CALLS * mid["reductions"] + close["reductions"],
  )


# ------------------------------------------------------------ cost model --


def cost_rows(rows, param_bytes, bandwidth, latency, hosts) -> list[dict]:
  """Per-step communication time of a model of ``param_bytes`` gradient
  bytes at ``hosts`` data-parallel hosts: the measured data-axis bytes, as
  a whole number of gradient trees (this model's P) plus scalars, with the
  trees scaled to ``param_bytes``, sent as a ring all-reduce (``2 (n-1)/n``
  of its bytes per device) over a ``bandwidth`` link, plus ``latency`` per
  reduction."""
  p_model = hlo.tree_bytes(_params())
  out = []
  for r in rows:
    if r["mesh"] != "replicated" or r["style"] not in (
      "jit, no data_axes",
      "jit, data_axes",
      "shard_map + axis_name",
    ):
      continue
    for n in hosts:
      trees, scalars = divmod(r["data_bytes"], p_model)
      ring = 2 * (n - 1) / n * (trees * param_bytes + scalars)
      out.append(
        dict(
          style=r["style"],
          k=r["k"],
          hosts=n,
          seconds=ring / bandwidth + latency * r["reductions"],
        )
      )
  return out


def markdown(meta, in_step, across, cost, args) -> str:
  lines = [
    f"Machine: {meta['machine']}; jax {meta['jax']}, optax {meta['optax']}; "
    f"{meta['date']}; `python benchmarks/communication.py`. 8 virtual CPU "
    "devices; figures from the compiled HLO (benchmarks/hlo.py), per device.",
    "",
    f"Model: a tanh MLP, P = {hlo.tree_bytes(_params())} bytes of float32 "
    f"gradient; batch {ROWS} rows, replica 0's rows all masked.",
    "",
    "## Bytes reduced over the data axes per step (one call of K microbatches)",
    "",
    "| mesh | style | K | data-axis bytes | reductions | in loops | "
    "all-gather bytes | model-axis bytes | temp bytes |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in in_step:
    lines.append(
      f"| {r['mesh']} | {r['style']} | {r['k']} | {r['data_bytes']} | "
      f"{r['reductions']} | {r['in_loops']} | {r['all_gather_bytes']} | "
      f"{r['other_bytes']} | {r['temp_bytes']} |"
    )
  lines += [
    "",
    f"## Across steps: a window of {CALLS} calls of K microbatches",
    "",
    "| mesh | style | K | mid-window bytes / call | reductions / call | "
    "close bytes | close reductions | bytes / window | reductions / window |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in across:
    lines.append(
      f"| {r['mesh']} | {r['style']} | {r['k']} | {r['mid_bytes']} | "
      f"{r['mid_reductions']} | {r['close_bytes']} | {r['close_reductions']} | "
      f"{r['window_bytes']} | {r['window_reductions']} |"
    )
  gb = args.param_bytes / 2**30
  lines += [
    "",
    f"## Cost model: {gb:g} GiB of gradient, {args.bandwidth / 1e9:g} GB/s "
    f"links, {args.latency * 1e6:g} us per reduction",
    "",
    "| style | K | " + " | ".join(f"{n} hosts (ms)" for n in args.hosts) + " |",
    "|---|---:|" + "---:|" * len(args.hosts),
  ]
  keys = sorted(
    {(c["style"], c["k"]) for c in cost}, key=lambda t: (t[0], t[1])
  )
  for style, k in keys:
    cells = [
      f"{1e3 * c['seconds']:.1f}"
      for c in cost
      if c["style"] == style and c["k"] == k
    ]
    lines.append(f"| {style} | {k} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--param-bytes", type=float, default=2.0**30)
  ap.add_argument("--bandwidth", type=float, default=25e9, help="bytes/s")
  ap.add_argument("--latency", type=float, default=20e-6, help="s")
  ap.add_argument("--hosts", type=int, nargs="+", default=[2, 8, 64])
  ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  args = ap.parse_args(argv)
  assert jax.device_count() == N, jax.devices()
  meta = {
    "machine": f"{platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} cores",
    "jax": jax.__version__,
    "optax": optax.__version__,
    "date": datetime.date.today().isoformat(),
  }
  in_step = in_step_rows()
  across = across_rows()
  cost = cost_rows(
    in_step, args.param_bytes, args.bandwidth, args.latency, args.hosts
  )
  md = markdown(meta, in_step, across, cost, args)
  args.out.mkdir(parents=True, exist_ok=True)
  stem = args.out / f"{jax.default_backend()}-{meta['date']}-communication"
  stem.with_suffix(".json").write_text(
    json.dumps(
      dict(
        meta=meta,
        in_step=in_step,
        across=across,
        cost=cost,
        args={k: str(v) for k, v in vars(args).items()},
      ),
      indent=1,
    )
  )
  stem.with_suffix(".md").write_text(md)
  print(md)


if __name__ == "__main__":
  main()
