"""A Grain pipeline that plans each global batch in its workers.

Variable-length rows -> ``batch`` (16 rows, each padded to 64 tokens, the
longest bucket) -> ``PlanBatches`` (plan + pack, in Grain's worker
processes) -> the planned step. Resumable: the iterator's ``get_state()``
restores the same plans. Run: ``python examples/planned_pipeline.py``.
"""

from __future__ import annotations

import gc

from absl import flags
import grain
from grain._src.python.ipc import shared_memory_array as shm_array
import jax
import jax.numpy as jnp
import numpy as np

from weighted_accum import planning

TOP, ROWS = 64, 16
SPEC = planning.PlanSpec(buckets=(16, 32, 64), budget=256, batch_rows=ROWS)


def row(i: int) -> dict:
  """Row ``i`` of a synthetic corpus: tokens padded to TOP, and its length."""
  rng = np.random.default_rng(i)
  n = int(np.clip(rng.lognormal(np.log(12), 0.8), 2, TOP))
  tokens = np.zeros(TOP, np.int32)
  tokens[:n] = rng.integers(1, 100, n)
  return {"tokens": tokens, "lengths": np.int64(n)}


def pipeline(num_rows: int = 512, workers: int = 0) -> grain.IterDataset:
  """Rows -> shuffled -> batches of ROWS rows -> planned and packed."""
  ds = grain.MapDataset.range(num_rows).shuffle(seed=0).map(row)
  ds = ds.batch(ROWS, drop_remainder=True).map(planning.PlanBatches(SPEC))
  it = ds.to_iter_dataset()
  if workers:  # Grain's workers read absl flags: parsed, or their defaults
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return it


def loss_fn(w, mb):
  """A toy per-token loss: the tokens' embeddings against a target."""
  rows, mask = mb
  h = w[rows["tokens"] % w.shape[0]]
  return jnp.sum(mask * (h - 1.0) ** 2), mask.sum()


def main() -> None:
  step = jax.jit(planning.planned_value_and_grad(loss_fn, SPEC, mode="sum"))
  w = jnp.zeros(100)
  it = iter(pipeline(workers=2))
  for i, packed in enumerate(it):
    loss, out = step(w, packed)
    w = w - 0.5 * out.grads
    if i % 2 == 0:
      print(
        f"batch {i}: loss {float(loss):.4f}, tokens {float(out.weight):.0f}"
      )
  # The workers hand batches over in shared memory, which Grain unlinks when
  # an array is deleted. The iterator holds its last batches in a reference
  # cycle: collect it now, while Grain's deleting thread still runs (at exit
  # it has stopped, and the blocks would leak).
  it.close()
  del it, packed
  gc.collect()
  # Grain unlinks them on a thread pool, which stops at exit: wait for it
  # (Grain has no public call for this; without its pool, nothing to wait).
  pool = getattr(shm_array.SharedMemoryArray, "_del_thread_pool", None)
  if pool is not None:
    pool.apply(gc.collect)  # the pool's queue is first in, first out
  print("compiles:", step._cache_size())  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
