"""Shared builders of the conformance matrix (``tests/test_conformance_*``).

The matrix drives the same hostile values through every public entry point,
in every context (eager, ``jax.jit``, ``jax.vmap``, ``jax.shard_map``, params
on one device, sharded over 8 devices, a 2-D ``data x model`` mesh) and work
dtype.
Each case asserts one documented outcome (``docs/inputs.md``,
``docs/design.md``, the docstrings): exact against float64 NumPy or an
independent reference, or refused with a ``WeightedAccumulationError``
naming the argument, the caller's state untouched.

Only the public API is used. Jitted functions are built once per module and
keyed on what changes their compilation (placement, dtype), so the hostile
values are data fed to one executable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import weighted_accum as wa

Error = wa.WeightedAccumulationError
F32 = np.finfo(np.float32)
DEVICES = jax.devices()
OTHER = DEVICES[-1]  # "another device than the params" (params: device 0)

# ------------------------------------------------------------ placements --

# Two leaves whose leading axis splits over 8 devices.
SHAPES = {"b": (8,), "w": (8, 4)}
_MESHES = {
  "dev8": (np.array(DEVICES), ("model",)),
  "mesh2d": (np.array(DEVICES).reshape(4, 2), ("data", "model")),
}
_SPECS = {
  "dev8": {"b": P("model"), "w": P("model")},
  "mesh2d": {"b": P("model"), "w": P("data", "model")},
}
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
# (placement, work dtype) pairs of the matrix: every dtype sharded over 8
# devices (where a narrow dtype's per-shard read could split the decision),
# float32 on one device (unsharded) and on the 2-D mesh, the narrow dtypes'
# worst (float16) there too. Each pair is one compilation per entry point;
# the pairs left out (a narrow dtype unsharded, float32 over 2 devices) run
# the kernels of these.
PLACED = (
  [("one", jnp.float32)]
  + [("dev8", d) for d in DTYPES]
  + [("mesh2d", jnp.float16), ("mesh2d", jnp.float32)]
)
PLACED_IDS = [f"{p}-{jnp.dtype(d).name}" for p, d in PLACED]


def mesh_of(placement: str) -> jax.sharding.Mesh:
  devices, names = _MESHES[placement]
  return jax.sharding.Mesh(devices, names)


def place(tree: dict, placement: str) -> dict:
  """``tree`` (host arrays keyed like ``SHAPES``) placed as ``placement``
  says: "one" leaves them on the default device, uncommitted; "dev0"
  commits them to device 0; "split" commits ``b`` to device 0 and ``w`` to
  device 1 (params committed to two different devices)."""
  if placement == "one":
    return {k: jnp.asarray(v) for k, v in tree.items()}
  if placement == "dev0":
    return {
      k: jax.device_put(np.asarray(v), DEVICES[0]) for k, v in tree.items()
    }
  if placement == "split":
    return {
      "b": jax.device_put(np.asarray(tree["b"]), DEVICES[0]),
      "w": jax.device_put(np.asarray(tree["w"]), DEVICES[1]),
    }
  mesh = mesh_of(placement)
  return {
    k: jax.device_put(np.asarray(v), NamedSharding(mesh, _SPECS[placement][k]))
    for k, v in tree.items()
  }


def host_params(dtype=np.float32, seed: int = 0) -> dict:
  """Small non-zero params, exactly representable in float16/bfloat16."""
  rng = np.random.default_rng(seed)
  return {
    k: (rng.integers(-8, 9, size=s) / 8.0).astype(np.float32).astype(dtype)
    for k, s in SHAPES.items()
  }


def host_grads(scale: float = 1.0, bad=None, where: str = "first") -> dict:
  """Small-integer gradients (exact in every work dtype), optionally with
  one ``bad`` value (NaN/Inf) at the first element of ``w`` (device 0) or
  the last element of ``b`` (the last device)."""
  g = {
    "b": (np.arange(8, dtype=np.float32) % 3 - 1.0) * scale,
    "w": (np.arange(32, dtype=np.float32).reshape(8, 4) % 5 - 2.0) * scale,
  }
  if bad is not None:
    if where == "first":
      g["w"][0, 0] = bad
    else:
      g["b"][-1] = bad
  return g


BAD_CASES = [
  ("finite", None, "first"),
  ("nan_first_device", math.nan, "first"),
  ("nan_last_device", math.nan, "last"),
  ("neg_inf_last_device", -math.inf, "last"),
]
BAD_IDS = [c[0] for c in BAD_CASES]


def cast(tree: dict, dtype) -> dict:
  return {k: np.asarray(v, np.float32).astype(dtype) for k, v in tree.items()}


# ----------------------------------------------------------------- checks --


def snapshot(tree):
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_same(tree, snap) -> None:
  """Bit-for-bit the same leaves as ``snap``."""
  got, want = jax.tree.leaves(tree), jax.tree.leaves(snap)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), b)


def every_shard(x) -> list:
  """The value of scalar ``x`` as each device holding it sees it."""
  if isinstance(x, jax.Array):
    return [np.asarray(s.data).item() for s in x.addressable_shards]
  return [np.asarray(x).item()]


def assert_flag(x, expected: bool, name: str) -> None:
  """``x`` is ``expected`` on every shard (one decision for the window)."""
  seen = every_shard(x)
  assert all(bool(v) == expected for v in seen), (
    f"{name}: expected {expected} on every shard, saw {seen}"
  )


def assert_finite(tree, name: str = "params") -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(leaf, np.float64)
    assert np.all(np.isfinite(a)), f"{name}{jax.tree_util.keystr(path)}: {a}"


def assert_close(tree, ref, rtol: float, atol: float = 0.0) -> None:
  for k in ref:
    np.testing.assert_allclose(
      np.asarray(tree[k], np.float64),
      np.asarray(ref[k], np.float64),
      rtol=rtol,
      atol=atol,
      err_msg=k,
    )


def rtol_of(dtype) -> float:
  """One rounding in ``dtype`` (relative)."""
  return float(jnp.finfo(dtype).eps)


# ------------------------------------------------------- hostile values --


def _np_array1(v):
  return np.array([v], np.float32)


# (id, make, reference): ``make()`` builds the value as a user would;
# ``reference`` is the exact number the caller meant (None: not a real
# scalar, so refused whatever its value).
WEIGHTS = [
  ("np_int64_2p33p5", lambda: np.int64(2**33 + 5), 2**33 + 5),
  ("np_uint64_2p40", lambda: np.uint64(2**40), 2**40),
  ("py_int_2p31", lambda: 2**31, 2**31),
  ("py_int_2p48", lambda: 2**48, 2**48),
  ("py_float_2p5", lambda: 2.5, 2.5),
  ("py_bool", lambda: True, 1),
  ("zero", lambda: 0, 0),
  ("np_float16", lambda: np.float16(3.0), 3.0),
  ("negative", lambda: -1.0, -1.0),
  ("nan", lambda: math.nan, math.nan),
  ("inf", lambda: math.inf, math.inf),
  ("subnormal", lambda: 1e-40, 1e-40),
  ("f64_beyond_f32", lambda: 1e39, 1e39),
  ("string", lambda: "2", None),
  ("none", lambda: None, None),
  ("np_shape1", lambda: _np_array1(2.0), None),
  ("jnp_shape1", lambda: jnp.asarray(_np_array1(2.0)), None),
  ("other_device", lambda: jax.device_put(jnp.float32(2.0), OTHER), 2.0),
]
WEIGHT_IDS = [w[0] for w in WEIGHTS]

# Traced weights: JAX scalars only (JAX converts NumPy 64-bit scalars at the
# jit boundary itself; docs/inputs.md).
TRACED_WEIGHTS = [
  ("f32_2p5", lambda: jnp.float32(2.5), 2.5),
  ("i32_2p31m1", lambda: jnp.int32(2**31 - 1), 2**31 - 1),
  ("u32_2p32m1", lambda: jnp.uint32(2**32 - 1), 2**32 - 1),
  ("bool", lambda: jnp.bool_(True), 1),
  ("zero", lambda: jnp.float32(0.0), 0),
  ("bf16_3", lambda: jnp.bfloat16(3.0), 3.0),
  ("negative", lambda: jnp.float32(-1.0), -1.0),
  ("nan", lambda: jnp.float32(math.nan), math.nan),
  ("inf", lambda: jnp.float32(math.inf), math.inf),
  ("subnormal", lambda: jnp.float32(1e-40), 1e-40),
]
TRACED_WEIGHT_IDS = [w[0] for w in TRACED_WEIGHTS]

SCALES = [
  ("np_int64_2p33p5", lambda: np.int64(2**33 + 5), 2**33 + 5),
  ("np_uint64_2p40", lambda: np.uint64(2**40), 2**40),
  ("py_int_2p31", lambda: 2**31, 2**31),
  ("py_float_0p1", lambda: 0.1, 0.1),
  ("py_bool", lambda: True, 1),
  ("np_float16", lambda: np.float16(8.0), 8.0),
  ("zero", lambda: 0.0, 0.0),
  ("negative", lambda: -2.0, -2.0),
  ("nan", lambda: math.nan, math.nan),
  ("inf", lambda: math.inf, math.inf),
  ("subnormal", lambda: 1e-40, 1e-40),
  ("f64_beyond_f32", lambda: 1e39, 1e39),
  ("string", lambda: "2", None),
  ("np_shape1", lambda: _np_array1(2.0), None),
  ("other_device", lambda: jax.device_put(jnp.float32(4.0), OTHER), 4.0),
]
SCALE_IDS = [s[0] for s in SCALES]

TRACED_SCALES = [
  ("f32_4", lambda: jnp.float32(4.0), 4.0),
  ("f16_8", lambda: jnp.float16(8.0), 8.0),
  ("i32_2p20", lambda: jnp.int32(2**20), 2**20),
  ("zero", lambda: jnp.float32(0.0), 0.0),
  ("negative", lambda: jnp.float32(-1.0), -1.0),
  ("nan", lambda: jnp.float32(math.nan), math.nan),
  ("inf", lambda: jnp.float32(math.inf), math.inf),
  ("subnormal", lambda: jnp.float32(1e-40), 1e-40),
]
TRACED_SCALE_IDS = [s[0] for s in TRACED_SCALES]


def weight_ok(ref) -> bool:
  """The documented rule for a weight (float32 tally, docs/inputs.md)."""
  if ref is None or (isinstance(ref, float) and not math.isfinite(ref)):
    return False
  if ref < 0 or ref > float(F32.max):
    return False
  if isinstance(ref, int) and ref >= 2**48:
    return False
  return not 0 < ref < float(F32.tiny)


def scale_ok(ref) -> bool:
  """The documented rule for a loss scale: a finite, positive, normal
  float32 after conversion."""
  if ref is None or not math.isfinite(ref) or not 0 < ref <= float(F32.max):
    return False
  return float(np.float32(ref)) >= float(F32.tiny)


def stored_scale(ref) -> float:
  """A valid scale as stored: rounded once to float32."""
  return float(np.float32(ref))
