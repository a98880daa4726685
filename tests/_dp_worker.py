"""One process of the two-process data-parallel run in test_distributed.py.

Not a test module. Usage (the test sets XLA_FLAGS to 4 CPU devices):
  python tests/_dp_worker.py PROCESS_ID PORT CKPT_DIR OUT_NPZ

Both processes form one 8-device mesh over 127.0.0.1 (jax.distributed, gloo
CPU collectives) and run:

1. Explicit style: shard_map over 'data' with local gradients, one reduction
   per window (distributed.finish_mean), unequal local weights.
   Then the in-step data_axes style (microbatched_value_and_grad under plain
   jit over the global batch): its grads and its compiled step's reduction
   over the data axis (bytes and count).
2. Implicit style: jit over global arrays, params and accumulator buffers
   sharded over all 8 devices (both processes); after MP_SAVE_AFTER
   microbatches the accumulator is saved with an Orbax CheckpointManager
   (weighted_accum.checkpoint.AccumSave), the window is finished, then the
   checkpoint is restored (AccumRestore) into a fresh template and the same
   microbatches are replayed: restored buffers/counters and the final result
   must equal the uninterrupted ones bit for bit.

Writes OUT_NPZ with this process's view of the results; the test compares
them with a single-process reference.
"""

from __future__ import annotations

import os
import sys


def main(process_id: int, port: int, ckpt_dir: str, out_path: str) -> None:
  # pylint: disable=g-import-not-at-top
  # The package and benchmarks/ of this checkout (not an installed copy).
  sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )
  # jax is imported here, after the caller's XLA_FLAGS took effect.
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=60,
    heartbeat_timeout_seconds=30,
    shutdown_timeout_seconds=30,
  )

  from jax.experimental import multihost_utils
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import orbax.checkpoint as ocp

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _dp_common as common
  import weighted_accum as wa
  from weighted_accum import distributed as dist
  from weighted_accum.checkpoint import AccumRestore
  from weighted_accum.checkpoint import AccumSave
  from weighted_accum.checkpoint import abstract_state

  assert jax.process_count() == 2 and jax.device_count() == 8, (
    jax.process_count(),
    jax.device_count(),
  )
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

  def global_array(host, spec):
    return jax.make_array_from_callback(
      host.shape, NamedSharding(mesh, spec), lambda idx: host[idx]
    )

  host_params = common.make_params(0)
  x, y, m = common.multiprocess_data()
  results = {"package": np.asarray(os.path.abspath(wa.__file__))}

  # 1. Explicit style.
  params = jax.tree.map(lambda a: global_array(a, P()), host_params)
  spec = P(None, "data")
  xs, ys, ms = (global_array(a, spec) for a in (x, y, m))

  def body(params, x, y, m):
    state = wa.init(params, axis_name="data")
    for k in range(common.MP_K):
      g = dist.local_grad(common.loss_sum, "data")(params, x[k], y[k], m[k])
      state = wa.accumulate_sum(state, g, jnp.sum(m[k]))
    out, _ = wa.finish_mean(state)
    return out.grads, out.weight, out.valid

  grads, weight, valid = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P(), spec, spec, spec), out_specs=P()
    )
  )(params, xs, ys, ms)
  for k, v in grads.items():
    results[f"explicit/{k}"] = np.asarray(v.addressable_data(0))
  results["explicit_weight"] = np.asarray(weight.addressable_data(0))
  results["explicit_valid"] = np.asarray(valid.addressable_data(0))
  local_w = float(
    m.reshape(common.MP_K, 8, -1)[:, 4 * process_id : 4 * process_id + 4].sum()
  )
  results["local_weight"] = np.float32(local_w)

  # 2a. In-step data_axes style: microbatched_value_and_grad under plain jit
  # over the global batch (replica r's rows hold its items of microbatch k at
  # local rows k::K), one reduction per call.
  results.update(_data_axes_case(mesh, host_params, x, y, m, global_array))

  # 2. Implicit style, FSDP over all 8 devices, checkpoint mid-window.
  fsdp = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data")}
  params = jax.tree.map(global_array, host_params, fsdp)
  grad_fn = jax.jit(
    lambda p, x, y, m: (jax.grad(common.loss_sum)(p, x, y, m), jnp.sum(m))
  )
  acc = jax.jit(wa.accumulate_sum, donate_argnums=0)
  finish = jax.jit(wa.finish_mean, donate_argnums=0)

  def feed(state, ks):
    for k in ks:
      g, n = grad_fn(params, xs[k], ys[k], ms[k])
      state = acc(state, g, n)
    return state

  def local_shards(tree):
    """This process's values of every leaf, by the global index they hold
    (copied: the arrays are donated afterwards)."""
    return [
      {
        str(s.index): np.array(s.data, copy=True)
        for s in leaf.addressable_shards
      }
      for leaf in jax.tree.leaves(tree)
    ]

  def bitwise_equal(a, b):
    return len(a) == len(b) and all(
      x.keys() == y.keys()
      and all(
        x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x
      )
      for x, y in zip(a, b)
    )

  state = feed(wa.init(params), range(common.MP_SAVE_AFTER))
  assert state.grads["w1"].addressable_shards[0].data.shape == (
    common.D,
    common.H // 8,
  )
  saved = local_shards(state)
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    mngr.save(
      common.MP_SAVE_AFTER, args=ocp.args.Composite(accum=AccumSave(state))
    )
    mngr.wait_until_finished()
  state = feed(state, range(common.MP_SAVE_AFTER, common.MP_K))
  out, _ = finish(state)
  first = local_shards(out)
  for k, g in out.grads.items():
    results[f"implicit/{k}"] = np.asarray(
      multihost_utils.process_allgather(g, tiled=True)
    )
  results["implicit_weight"] = np.asarray(out.weight.addressable_data(0))

  # Resume from the checkpoint, as a restarted job would.
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    step = mngr.latest_step()
    restored = mngr.restore(
      step, args=ocp.args.Composite(accum=AccumRestore(abstract_state(params)))
    ).accum
  results["restored_bitwise"] = np.bool_(
    step == common.MP_SAVE_AFTER
    and bitwise_equal(local_shards(restored), saved)
  )
  results["restored_sharding"] = np.bool_(
    all(
      r.sharding.is_equivalent_to(p.sharding, p.ndim)
      for r, p in zip(jax.tree.leaves(restored.grads), jax.tree.leaves(params))
    )
  )
  state = feed(restored, range(common.MP_SAVE_AFTER, common.MP_K))
  out2, _ = finish(state)
  results["resume_bitwise"] = np.bool_(bitwise_equal(local_shards(out2), first))

  np.savez(out_path, **results)
  jax.distributed.shutdown()
  print(f"process {process_id}: done", flush=True)


def _data_axes_case(mesh, host_params, x, y, m, global_array) -> dict:
  """The window's items as one global batch for ``data_axes``: its grads,
  weight and the compiled step's reduction over the data axis."""
  # pylint: disable=g-import-not-at-top
  import jax
  from jax.sharding import PartitionSpec as P
  import numpy as np

  import _dp_common as common
  from benchmarks import hlo
  import weighted_accum as wa

  batch = common.data_axes_batch(x, y, m)
  batch = {k: global_array(v, P("data")) for k, v in batch.items()}
  params = jax.tree.map(lambda a: global_array(a, P()), host_params)
  f = jax.jit(
    wa.microbatched_value_and_grad(
      common.loss_of_batch,
      common.MP_K,
      mode="sum",
      axis_name="data",
    )
  )
  stats = hlo.hlo_stats(f.lower(params, batch).compile())
  groups = hlo.mesh_groups(mesh, "data")
  _, out = f(params, batch)
  res = {
    f"data_axes/{k}": np.asarray(v.addressable_data(0))
    for k, v in out.grads.items()
  }
  res["data_axes_weight"] = np.asarray(out.weight.addressable_data(0))
  res["data_axes_bytes"] = np.int64(hlo.all_reduced_bytes(stats, groups))
  res["data_axes_reductions"] = np.int64(
    stats.count("all-reduce", groups) + stats.count("reduce-scatter", groups)
  )
  return res


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
