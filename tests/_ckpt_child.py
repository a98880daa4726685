"""Child process for tests/checkpointing/test_checkpoint.py (not a test module itself).

Also the shared problem definition: deterministic microbatch gradients and
weights, so that the test process and a fresh child process feed exactly the
same values. Gradients are generated, not computed from a model, so that they
are bitwise the same on any mesh (accumulation is elementwise).

Usage (the caller sets XLA_FLAGS for the device count):
  python tests/_ckpt_child.py resume CKPT_DIR OUT_NPZ   # every saved step
  python tests/_ckpt_child.py crash CKPT_DIR            # hangs in step 2's
                                                        # write; kill it
  python tests/_ckpt_child.py optax CKPT_DIR OUT_NPZ    # wrapper resume
  python tests/_ckpt_child.py stacked CKPT_DIR OUT_NPZ  # stacked window
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np

SHAPES = {"dense": {"kernel": (16, 8), "bias": (8,)}, "head": (8, 4)}
SPECS = {"dense": {"kernel": ("a", "b"), "bias": ("b",)}, "head": ("a",)}
# Fractional, zero and repeated weights; microbatch 1 is fully masked (its
# mean-loss gradient is NaN and must add nothing).
WEIGHTS = (3.0, 0.0, 2.5, 7.0, 1.0, 4.0)
MEAN = (True, True, False, True, False, True)  # accumulate_mean or _sum
K = len(WEIGHTS)
DTYPE = "bfloat16"
LOSS_SCALE = 8.0


def _tree_map(fn, *trees):
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(fn, *trees, is_leaf=lambda x: isinstance(x, tuple))


def host_params() -> dict:
  rng = np.random.default_rng(0)
  return _tree_map(lambda s: rng.standard_normal(s).astype(np.float32), SHAPES)


def make_mesh(n_devices: int):
  import jax  # pylint: disable=g-import-not-at-top

  devs = np.array(jax.devices()[:n_devices])
  return jax.sharding.Mesh(
    devs.reshape(n_devices // 2, 2)
    if n_devices > 2
    else devs.reshape(n_devices, 1),
    ("a", "b"),
  )


def shardings(mesh) -> dict:
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top

  return _tree_map(
    lambda spec: NamedSharding(mesh, PartitionSpec(*spec)), SPECS
  )


def place(tree: dict, mesh) -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(jax.device_put, tree, shardings(mesh))


def _random_grads(seed: int, masked: bool) -> dict:
  """Generated gradients (times LOSS_SCALE), float32, on host; NaN when
  ``masked`` (a fully masked microbatch's mean-loss gradient)."""
  rng = np.random.default_rng(seed)

  def leaf(s):
    g = (rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3)).astype(
      np.float32
    ) * np.float32(LOSS_SCALE)
    if masked:
      g[...] = np.nan
    return g

  return _tree_map(leaf, SHAPES)


def host_grads(i: int) -> dict:
  """Microbatch i's gradient (times LOSS_SCALE), in float32, on host."""
  return _random_grads(1000 + i, WEIGHTS[i] == 0)


@functools.cache  # compile once per process
def feed_fn():
  """The jitted, donating step both runs use: one microbatch in."""
  import jax  # pylint: disable=g-import-not-at-top

  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  def feed(state, grads, weight, mean):
    fn = wa.accumulate_mean if mean else wa.accumulate_sum
    return fn(state, grads, weight)

  return jax.jit(feed, static_argnums=3, donate_argnums=0)


def run(state, start: int, stop: int, mesh):
  feed = feed_fn()
  for i in range(start, stop):
    state = feed(
      state, place(host_grads(i), mesh), np.float32(WEIGHTS[i]), MEAN[i]
    )
  return state


def to_host(tree) -> dict:
  """Flat {keystr path: NumPy copy} of a tree's leaves."""
  import jax  # pylint: disable=g-import-not-at-top

  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def _resume(ckpt_dir: str, out: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  mesh = make_mesh(len(jax.devices()))
  params = place(host_params(), mesh)
  template = wa.checkpoint.abstract_state(params, jnp.dtype(DTYPE))
  results = {}
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    for step in mngr.all_steps():
      got = mngr.restore(
        step,
        args=ocp.args.Composite(
          accum=wa.checkpoint.AccumRestore(template),
          data=ocp.args.JsonRestore(),
        ),
      )
      state = got.accum
      # Where the restored buffers live: must be this process's mesh.
      results[f"{step}/placed_as_params"] = np.array(
        all(
          b.sharding.is_equivalent_to(p.sharding, b.ndim)
          for b, p in zip(jax.tree.leaves(state.grads), jax.tree.leaves(params))
        )
      )
      results[f"{step}/issued"] = np.asarray(state.issued)
      state = run(state, got.data["next_microbatch"], K, mesh)
      out_grads, _ = wa.finish_mean(state)
      for path, x in to_host(out_grads.grads).items():
        results[f"{step}/grads{path}"] = x.view(np.uint16)
      results[f"{step}/weight"] = np.asarray(out_grads.weight)
  np.savez(out, **results)
  print("DONE", flush=True)


OPTAX_K = 3  # microbatches per window; K microbatches make two windows


def optax_tx():
  import optax  # pylint: disable=g-import-not-at-top

  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  return wa.WeightedMultiSteps(
    optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=OPTAX_K, mode="mean"
  )


@functools.cache
def optax_step_fn():
  """One jitted, donating microbatch step of the wrapper + apply_updates.

  The gradient depends on the params (elementwise), so a resume is only
  exact if params, inner optimizer state and window all come back exactly.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  tx = optax_tx()

  def step(params, opt_state, noise, weight):
    grads = jax.tree.map(lambda p, n: jnp.sin(3.0 * p) + n, params, noise)
    updates, opt_state = tx.update(grads, opt_state, params, weight=weight)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1))


def optax_run(params, opt_state, start: int, stop: int):
  step = optax_step_fn()
  for i in range(start, stop):
    noise = host_grads(i)  # NaN for the zero-weight microbatch
    params, opt_state = step(params, opt_state, noise, np.float32(WEIGHTS[i]))
  return params, opt_state


def _optax(ckpt_dir: str, out: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  params0 = jax.tree.map(jax.numpy.asarray, host_params())
  abstract_params = jax.eval_shape(lambda: params0)
  template = jax.eval_shape(optax_tx().init, params0)
  results = {}
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    for step in mngr.all_steps():
      got = mngr.restore(
        step,
        args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract_params),
          opt=wa.checkpoint.AccumRestore(template),
          data=ocp.args.JsonRestore(),
        ),
      )
      params, opt_state = optax_run(
        got.params, got.opt, got.data["next_microbatch"], K
      )
      for path, x in to_host(params).items():
        results[f"{step}/params{path}"] = x
      results[f"{step}/gradient_step"] = np.asarray(opt_state.gradient_step)
  np.savez(out, **results)
  print("DONE", flush=True)


def _crash(ckpt_dir: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  mesh = make_mesh(len(jax.devices()))
  params = place(host_params(), mesh)
  state = run(wa.init(params, jnp.dtype(DTYPE), LOSS_SCALE), 0, 2, mesh)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  mngr = ocp.CheckpointManager(ckpt_dir, options=options)
  mngr.save(1, args=ocp.args.Composite(accum=wa.checkpoint.AccumSave(state)))
  mngr.wait_until_finished()
  state = run(state, 2, 4, mesh)

  # Stall step 2's write after its array data is written and before its
  # metadata is, so that the SIGKILL lands in the middle of the save. A plain
  # function blocks the commit thread whether Orbax awaits the call (0.12) or
  # not (0.11).
  def stall(*args, **kwargs):
    del args, kwargs
    print("WRITING", flush=True)
    time.sleep(600)

  ocp.BasePyTreeCheckpointHandler._write_metadata_file = stall  # pylint: disable=protected-access
  mngr.save(2, args=ocp.args.Composite(accum=wa.checkpoint.AccumSave(state)))
  print("SAVE-RETURNED", flush=True)
  time.sleep(600)


# A stacked per-replica window (wa.init(params, axis_name="data") outside
# shard_map): R replicas, each fed its own microbatch per step.
R = 4
# Per step, each replica's weight; a zero weight comes with NaN gradients
# (a fully masked microbatch: adds nothing).
STACKED_WEIGHTS = (
  (3.0, 0.0, 2.5, 1.0),
  (7.0, 1.0, 4.0, 0.5),
  (2.0, 5.0, 0.0, 6.0),
)
STACKED_STEPS = len(STACKED_WEIGHTS)


def replica_mesh(devices):
  import jax  # pylint: disable=g-import-not-at-top

  return jax.sharding.Mesh(np.array(devices), ("data",))


def stacked_params(mesh) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top

  return jax.device_put(host_params(), NamedSharding(mesh, PartitionSpec()))


def stacked_grads(i: int) -> dict:
  """Step i's gradients, one microbatch per replica: leaves [R, ...]."""
  per = [
    _random_grads(2000 + i * R + r, STACKED_WEIGHTS[i][r] == 0)
    for r in range(R)
  ]
  return _tree_map(lambda *xs: np.stack(xs), *per)


_STACKED_STEPS_BY_MESH = {}


def stacked_step_fn(mesh, specs):
  """One jitted, donating step: each replica adds its microbatch's mean."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top

  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  def add(block, g, w):
    return wa.accumulate_mean(block, jax.tree.map(lambda x: x[0], g), w[0])

  if mesh not in _STACKED_STEPS_BY_MESH:  # compile once per mesh
    data = PartitionSpec("data")
    _STACKED_STEPS_BY_MESH[mesh] = jax.jit(
      jax.shard_map(
        add, mesh=mesh, in_specs=(specs, data, data), out_specs=specs
      ),
      donate_argnums=0,
    )
  return _STACKED_STEPS_BY_MESH[mesh]


def stacked_run(state, start: int, stop: int, mesh):
  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  step = stacked_step_fn(mesh, wa.distributed.window_specs(state))
  for i in range(start, stop):
    w = np.asarray(STACKED_WEIGHTS[i], np.float32)
    state = step(state, stacked_grads(i), w)
  return state


def _stacked(ckpt_dir: str, out: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import weighted_accum as wa  # pylint: disable=g-import-not-at-top

  mesh = replica_mesh(jax.devices()[:R])
  params = stacked_params(mesh)
  template = wa.checkpoint.abstract_state(
    params, jnp.dtype(DTYPE), axis_name="data"
  )
  results = {}
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    for step in mngr.all_steps():
      got = mngr.restore(
        step,
        args=ocp.args.Composite(
          accum=wa.checkpoint.AccumRestore(template),
          data=ocp.args.JsonRestore(),
        ),
      )
      state = got.accum
      results[f"{step}/issued"] = np.asarray(state.issued)
      state = stacked_run(state, got.data["next_step"], STACKED_STEPS, mesh)
      out_grads, _ = wa.finish_mean(state)
      for path, x in to_host(out_grads.grads).items():
        results[f"{step}/grads{path}"] = x.view(np.uint16)
      results[f"{step}/weight"] = np.asarray(out_grads.weight)
  np.savez(out, **results)
  print("DONE", flush=True)


def main(argv: list[str]) -> None:
  cmd = argv[1]
  if cmd == "resume":
    _resume(argv[2], argv[3])
  elif cmd == "crash":
    _crash(argv[2])
  elif cmd == "optax":
    _optax(argv[2], argv[3])
  elif cmd == "stacked":
    _stacked(argv[2], argv[3])
  else:
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
  main(sys.argv)
