"""Model, data and reference shared by test_distributed.py and its
multi-process worker (_dp_worker.py). Pure NumPy/JAX, no device set-up.

The model and losses are ``_helpers``'s (item i of microbatch k has weight
``m[k, i]``). The exact target for the whole window
on all replicas is ``grad(sum(m * l)) / sum(m)`` over the concatenated data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import _helpers
from _helpers import loss_mean  # noqa: F401  (re-exported for the tests)
from _helpers import loss_sum
from _helpers import max_rel_err  # noqa: F401
from _helpers import per_item_loss  # noqa: F401

D, H = 5, 8  # input features, hidden units (H divisible by 8)
WEIGHT_CHOICES = np.array([0.0, 0.5, 1.0, 1.0, 3.0], np.float32)


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
  return _helpers.make_params(seed, D, H)


def make_data(
  seed: int,
  k: int,
  replicas: int,
  per_replica: int,
  zero_replica: int | None = None,
  zero_prob: float = 0.3,
):
  """Window data ``x [K, R*B, D]``, ``y [K, R*B]``, ``m [K, R*B]``.

  Replica r owns columns ``r*B:(r+1)*B`` (the layout of ``P(None, 'data')``).
  Each (microbatch, replica) block is empty with probability ``zero_prob``;
  ``zero_replica`` has no items in the whole window. At least one item of the
  window has positive weight.
  """
  rng = np.random.default_rng(seed)
  n = replicas * per_replica
  x = rng.standard_normal((k, n, D)).astype(np.float32)
  y = rng.standard_normal((k, n)).astype(np.float32)
  m = rng.choice(WEIGHT_CHOICES, size=(k, n)).astype(np.float32)
  blocks = m.reshape(k, replicas, per_replica)
  blocks[rng.random((k, replicas)) < zero_prob] = 0.0
  if zero_replica is not None:
    blocks[:, zero_replica] = 0.0
  if blocks.sum() == 0:
    live = (zero_replica + 1) % replicas if zero_replica is not None else 0
    blocks[0, live, 0] = 1.0
  return x, y, blocks.reshape(k, n)


@jax.jit
def _full_batch_grad(p, x, y, m):
  return jax.grad(lambda p: loss_sum(p, x, y, m) / jnp.sum(m))(p)


def reference_grad(params, x, y, m):
  """The single-device full-batch gradient of the window's mean loss."""
  dev = jax.devices()[0]
  args = jax.device_put(
    (params, x.reshape(-1, D), y.reshape(-1), m.reshape(-1)), dev
  )
  return jax.tree.map(np.asarray, _full_batch_grad(*args))


# Multi-process run (tests/_dp_worker.py): 2 processes x 4 CPU devices.
MP_PROCESSES = 2
MP_LOCAL_DEVICES = 4
MP_K = 4  # microbatches per window
MP_SAVE_AFTER = 2  # checkpoint mid-window after this many microbatches
MP_B = 4


def multiprocess_data():
  """Window data for the 8 global replicas with unequal local weights: the
  second process's replicas (4..7) keep only their first item (and replica 5
  none at all), so its local weight is far below the first process's."""
  replicas = MP_PROCESSES * MP_LOCAL_DEVICES
  x, y, m = make_data(21, MP_K, replicas, MP_B, zero_replica=5, zero_prob=0.2)
  blocks = m.reshape(MP_K, replicas, MP_B)
  blocks[:, MP_LOCAL_DEVICES:, 1:] = 0.0
  return x, y, blocks.reshape(MP_K, -1)


def data_axes_batch(x, y, m):
  """The window ``x [K, R*B, D]`` (replica r owns columns ``r*B:(r+1)*B``)
  as one global batch for ``data_axes``: replica r's rows hold its item i
  of microbatch k at local row ``i * K + k``, so its microbatch k (local
  rows ``k::K``) is the same items."""
  k, n = m.shape
  replicas = MP_PROCESSES * MP_LOCAL_DEVICES
  b = n // replicas

  def rows(a):
    a = a.reshape((k, replicas, b) + a.shape[2:])
    a = np.moveaxis(a, 0, 2)  # [R, B, K, ...]
    return a.reshape((replicas * b * k,) + a.shape[3:])

  return {"x": rows(x), "y": rows(y), "m": rows(m)}


def loss_of_batch(p, batch):
  """``(loss sum, item count)`` of a microbatch dict, for
  ``microbatched_value_and_grad``."""
  return loss_sum(p, batch["x"], batch["y"], batch["m"]), jnp.sum(batch["m"])
