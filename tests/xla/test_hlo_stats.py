"""benchmarks/hlo.py counts what a compiled program executes per step.

Each program's collectives are known by construction (one psum, K psums in
a loop, a psum in one branch of a cond, a scan, nested loops, one of each
collective kind); the expected counts and bytes are written from the
program's shapes, never read back from the helper. The asynchronous forms,
which XLA's CPU backend does not emit, are checked on hand-written HLO text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from benchmarks import hlo

N = 8  # devices (conftest.py)
F32 = 4


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == N
  return jax.sharding.Mesh(np.array(jax.devices()), ("data",))


def _compile(mesh, f, *args, in_specs, out_specs=None):
  out_specs = P() if out_specs is None else out_specs
  step = jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  )
  return step.lower(*args).compile()


def test_one_psum(mesh):
  c = _compile(
    mesh,
    lambda x: jax.lax.psum(x, "data"),
    jnp.ones((N * 16,)),
    in_specs=P("data"),
  )
  s = hlo.hlo_stats(c)
  assert s.count("all-reduce") == 1 and s.count() == 1
  assert s.nbytes("all-reduce") == 16 * F32
  assert s.in_loops() == 0 and s.loops == {}
  (op,) = s.collectives
  assert op.group_size == N and op.executions == 1
  assert op.ring_bytes() == 2 * (N - 1) / N * 16 * F32
  # The text and the executable read the same.
  assert hlo.hlo_stats(c.as_text()) == s


@pytest.mark.parametrize("k", [2, 5, 8])
def test_fori_loop_of_k_psums(mesh, k):
  def f(x):
    def body(i, acc):  # depends on i: XLA cannot hoist the psum
      return acc + jax.lax.psum(x * i, "data")

    return jax.lax.fori_loop(0, k, body, jnp.zeros((16,)))

  s = hlo.hlo_stats(_compile(mesh, f, jnp.ones((N * 16,)), in_specs=P("data")))
  assert s.static_count("all-reduce") == 1
  assert s.count("all-reduce") == k == s.in_loops("all-reduce")
  assert s.nbytes("all-reduce") == k * 16 * F32
  assert list(s.loops.values()) == [k]


@pytest.mark.parametrize("dtype,size", [(jnp.float16, 2), (jnp.int8, 1)])
def test_bytes_follow_the_dtype(mesh, dtype, size):
  """(The bytes are the compiled op's: XLA's CPU backend all-reduces a
  bfloat16 psum in float32, so it is not among these.)"""
  c = _compile(
    mesh,
    lambda x: jax.lax.psum(x, "data"),
    jnp.ones((N * 3, 5), dtype),
    in_specs=P("data"),
  )
  assert hlo.hlo_stats(c).nbytes("all-reduce") == 3 * 5 * size


def test_psum_in_a_cond(mesh):
  """One branch reduces 16 floats, the other 4: one of them runs."""

  def f(pred, x):
    return jax.lax.cond(
      pred,
      lambda x: jax.lax.psum(x, "data"),
      lambda x: jnp.tile(jax.lax.psum(x[:4] * 2.0, "data"), 4),
      x,
    )

  c = _compile(
    mesh, f, jnp.bool_(True), jnp.ones((N * 16,)), in_specs=(P(), P("data"))
  )
  worst = hlo.hlo_stats(c)
  assert worst.count("all-reduce") == 1
  assert worst.nbytes("all-reduce") == 16 * F32
  every = hlo.hlo_stats(c, branches="all")
  assert every.count("all-reduce") == 2
  assert every.nbytes("all-reduce") == (16 + 4) * F32


def test_psum_in_one_branch_only(mesh):
  def f(pred, x):
    return jax.lax.cond(
      pred, lambda x: jax.lax.psum(x, "data"), lambda x: jnp.zeros(16), x
    )

  c = _compile(
    mesh, f, jnp.bool_(True), jnp.ones((N * 16,)), in_specs=(P(), P("data"))
  )
  for branches in ("max", "all"):
    s = hlo.hlo_stats(c, branches=branches)
    assert s.count("all-reduce") == 1
    assert s.nbytes("all-reduce") == 16 * F32


def test_scan(mesh):
  """A scan over 6 rows of a local [6, 16] block: one psum of 16 floats
  per step, and one of a scalar after the scan."""

  def f(xs):
    def body(c, x):
      return c + jax.lax.psum(x, "data"), None

    c, _ = jax.lax.scan(body, jnp.zeros((16,)), xs)
    return c, jax.lax.psum(xs.sum(), "data")

  c = _compile(
    mesh, f, jnp.ones((6, N * 16)), in_specs=P(None, "data"), out_specs=P()
  )
  s = hlo.hlo_stats(c)
  assert s.count("all-reduce") == 6 + 1
  assert s.nbytes("all-reduce") == 6 * 16 * F32 + F32
  assert s.in_loops("all-reduce") == 6


def test_nested_loops_multiply(mesh):
  def f(x):
    def inner(j, acc):
      return acc + jax.lax.psum(x * j, "data")

    def outer(i, acc):
      return jax.lax.fori_loop(0, 4, inner, acc * i)

    return jax.lax.fori_loop(0, 3, outer, jnp.zeros((8,)))

  s = hlo.hlo_stats(_compile(mesh, f, jnp.ones((N * 8,)), in_specs=P("data")))
  assert s.count("all-reduce") == 3 * 4
  assert s.nbytes("all-reduce") == 3 * 4 * 8 * F32
  assert sorted(s.loops.values()) == [3, 4]


def test_traced_trip_count_needs_the_caller(mesh):
  """A loop bound read at run time: XLA knows no trip count."""

  def f(n, x):
    def body(i, acc):
      return acc + jax.lax.psum(x * i, "data")

    return jax.lax.fori_loop(0, n, body, jnp.zeros((16,)))

  c = _compile(
    mesh, f, jnp.int32(3), jnp.ones((N * 16,)), in_specs=(P(), P("data"))
  )
  with pytest.raises(ValueError, match="known_trip_count"):
    hlo.hlo_stats(c)
  s = hlo.hlo_stats(c, trip_count=5)
  assert s.count("all-reduce") == 5
  assert s.nbytes("all-reduce") == 5 * 16 * F32
  (loop,) = s.loops
  assert hlo.hlo_stats(c, trip_count={loop: 2}).count("all-reduce") == 2


def test_every_kind(mesh):
  """Each collective's operand bytes per device: a reduce-scatter's local
  input, an all-gather's shard, an all-to-all's and a permute's block."""

  def f(x):  # x: this device's 64 floats
    a = jax.lax.psum_scatter(x, "data", tiled=True)  # 64 -> 8
    b = jax.lax.all_gather(a, "data", tiled=True)  # 8 -> 64
    c = jax.lax.all_to_all(b.reshape(N, 8), "data", 0, 0, tiled=True)
    return jax.lax.ppermute(c, "data", [(i, (i + 1) % N) for i in range(N)])

  c = _compile(
    mesh, f, jnp.ones((N * 64,)), in_specs=P("data"), out_specs=P("data")
  )
  s = hlo.hlo_stats(c)
  assert s.summary() == {
    "reduce-scatter": dict(count=1, bytes=64 * F32, in_loops=0, static=1),
    "all-gather": dict(count=1, bytes=8 * F32, in_loops=0, static=1),
    "all-to-all": dict(count=1, bytes=64 * F32, in_loops=0, static=1),
    "collective-permute": dict(count=1, bytes=64 * F32, in_loops=0, static=1),
    "executed_fusions": s.executed_fusions(),
    "loops": {},
  }
  # A gradient reduction's bytes, either way: here only the reduce-scatter.
  assert hlo.all_reduced_bytes(c) == 64 * F32


def test_implicit_gradient_all_reduce(mesh):
  """Plain jit, batch sharded over 'data', params replicated: the
  partitioner all-reduces the gradient of the (5, 3) weight once."""
  w = jax.device_put(jnp.ones((5, 3)), NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((N * 4, 5)), NamedSharding(mesh, P("data")))
  c = jax.jit(jax.grad(lambda w, x: jnp.sum(x @ w))).lower(w, x).compile()
  assert hlo.all_reduced_bytes(c) == hlo.tree_bytes(w) == 5 * 3 * F32


def test_fusions_per_computation(mesh):
  """A loop's body runs K times and its condition K + 1 times."""

  def f(x):
    return jax.lax.fori_loop(
      0, 7, lambda i, a: a + jax.lax.psum(x * i, "data"), jnp.zeros((4,))
    )

  s = hlo.hlo_stats(_compile(mesh, f, jnp.ones((N * 4,)), in_specs=P("data")))
  runs = sorted(r for _, r in s.fusions.values())
  assert runs == [1, 7, 8]
  assert s.executed_fusions() == sum(n * r for n, r in s.fusions.values())


# Hand-written HLO in the forms XLA's GPU and TPU backends emit (a trailing
# backslash joins a long instruction to its next line: one line of HLO).
ASYNC = """\
HloModule m, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_rs (p: f32[40]) -> f32[10] {
  %p = f32[40]{0} parameter(0)
  ROOT %rs = f32[10]{0} reduce-scatter(%p), replica_groups={}, \
dimensions={0}, to_apply=%add
}

%fused (x: f32[40]) -> f32[40] {
  %x = f32[40]{0} parameter(0)
  ROOT %n = f32[40]{0} negate(%x)
}

%body (t: (s32[], f32[40])) -> (s32[], f32[40]) {
  %t = (s32[], f32[40]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[40]{0} get-tuple-element(%t), index=1
  %ars = f32[40]{0} all-reduce-start(%v), channel_id=1, \
replica_groups=[2,2]<=[4], to_apply=%add
  %ard = f32[40]{0} all-reduce-done(%ars)
  %neg = f32[40]{0} fusion(%ard), kind=kLoop, calls=%fused
  ROOT %r = (s32[], f32[40]{0}) tuple(%i, %neg)
}

%cond (t: (s32[], f32[40])) -> pred[] {
  %t = (s32[], f32[40]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (p0: f32[40], p1: bf16[8]) -> (f32[40], f32[10], bf16[32], \
f32[40]) {
  %p0 = f32[40]{0} parameter(0)
  %p1 = bf16[8]{0} parameter(1)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[40]{0}) tuple(%z, %p0)
  %w = (s32[], f32[40]{0}) while(%t0), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %lw = f32[40]{0} get-tuple-element(%w), index=1
  %as = ((f32[40]{0}), f32[10]{0}, s32[]) async-start(%lw), calls=%wrapped_rs
  %au = ((f32[40]{0}), f32[10]{0}, s32[]) async-update(%as), calls=%wrapped_rs
  %ad = f32[10]{0} async-done(%au), calls=%wrapped_rs
  %ags = (bf16[8]{0}, bf16[32]{0}) all-gather-start(bf16[8]{0} %p1), \
replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = bf16[32]{0} all-gather-done(%ags)
  %cps = (f32[40]{0}, f32[40]{0}, u32[], u32[]) \
collective-permute-start(%p0), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[40]{0} collective-permute-done(%cps)
  %rss = ((f32[40]{0}), f32[10]{0}) reduce-scatter-start(%p0), \
replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %rsd = f32[10]{0} reduce-scatter-done(%rss)
  ROOT %out = (f32[40]{0}, f32[10]{0}, bf16[32]{0}, f32[40]{0}) tuple(%lw, \
%ad, %agd, %cpd)
}
"""


def test_async_forms_count_once():
  s = hlo.hlo_stats(ASYNC)
  by = {c.name: c for c in s.collectives}
  assert set(by) == {"ars", "rs", "ags", "cps", "rss"}
  assert (by["ars"].executions, by["ars"].nbytes) == (3, 40 * F32)
  assert by["ars"].group_size == 2  # iota groups [2,2]<=[4]
  assert (by["rs"].executions, by["rs"].nbytes) == (1, 40 * F32)
  assert by["rs"].group_size == 4  # replica_groups={}: every partition
  assert (by["ags"].nbytes, by["ags"].group_size) == (8 * 2, 4)
  assert by["cps"].nbytes == 40 * F32
  assert s.count("all-reduce") == 3 and s.nbytes("all-reduce") == 480
  assert s.count("reduce-scatter") == 2
  assert s.nbytes("reduce-scatter") == 2 * 40 * F32
  assert s.count() == 3 + 2 + 1 + 1
  # The loop body's one fusion runs 3 times; the fused computation itself
  # and the reducers are not kernels of their own.
  assert s.fusions == {
    "main": (0, 1),
    "body": (1, 3),
    "cond": (0, 4),
    "wrapped_rs": (0, 1),
  }
  assert s.executed_fusions() == 3
  assert s.loops == {"w": 3}


def test_unknown_kind_is_refused():
  with pytest.raises(ValueError, match="unknown collective kind"):
    hlo.hlo_stats(ASYNC).count("all_reduce")


def test_iota_replica_groups_match_numpy():
  """``[G,S]<=[dims]T(perm)`` is iota(dims).transpose(perm) in G rows."""
  for text, dims, perm, shape in [
    ("[2,4]<=[8]", (8,), None, (2, 4)),
    ("[4,2]<=[2,4]T(1,0)", (2, 4), (1, 0), (4, 2)),
    ("[2,6]<=[2,3,2]T(2,0,1)", (2, 3, 2), (2, 0, 1), (2, 6)),
  ]:
    ids = np.arange(np.prod(dims)).reshape(dims)
    if perm is not None:
      ids = ids.transpose(perm)
    want = tuple(tuple(int(v) for v in row) for row in ids.reshape(shape))
    got = hlo.parse_replica_groups(text, 0)
    assert got == want, text


def test_groups_tell_the_axes_apart():
  """On a 4 x 2 (data, model) mesh, a psum over 'data' runs in the groups
  of devices sharing a model index, one over 'model' in the others."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  pos = np.arange(N).reshape(4, 2)  # device positions in the mesh
  over_data = frozenset(frozenset(int(v) for v in pos[:, j]) for j in range(2))
  over_model = frozenset(frozenset(int(v) for v in pos[i]) for i in range(4))
  assert hlo.mesh_groups(mesh, "data") == over_data
  assert hlo.mesh_groups(mesh, ("model",)) == over_model
  assert hlo.mesh_groups(mesh, ("data", "model")) == {frozenset(range(N))}

  def f(x, y):  # x: [3] per device, y: [5] per device
    return jax.lax.psum(x, "data"), jax.lax.psum(y, "model")

  c = _compile(
    mesh,
    f,
    jnp.ones((4 * 3, 2)),
    jnp.ones((4, 2 * 5)),
    in_specs=(P("data", "model"), P("data", "model")),
    out_specs=(P(None, "model"), P("data", None)),
  )
  s = hlo.hlo_stats(c)
  assert s.nbytes("all-reduce", over_data) == 3 * F32
  assert s.nbytes("all-reduce", over_model) == 5 * F32
  assert hlo.all_reduced_bytes(s, over_data) == 3 * F32


def test_mesh_axes_replica_groups():
  """The partitioner's form ``mesh[...] {axes}``: on a 4 x 2 mesh, a
  replicated weight's gradient is all-reduced over 'data' alone."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  w = jax.device_put(jnp.ones((5, 3)), NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((N * 4, 5)), NamedSharding(mesh, P("data")))
  c = jax.jit(jax.grad(lambda w, x: jnp.sum(x @ w))).lower(w, x).compile()
  assert "replica_groups=mesh[" in c.as_text()
  s = hlo.hlo_stats(c)
  assert s.nbytes("all-reduce", hlo.mesh_groups(mesh, "data")) == 15 * F32
  assert s.nbytes("all-reduce") == 15 * F32
  # A sub-axis 'x':(2)2 of an axis of 8 is the middle factor of [2, 2, 2].
  ids = np.arange(8).reshape(2, 2, 2)
  want = {tuple(int(v) for v in ids[i, :, j]) for i in range(2) for j in (0, 1)}
  got = hlo.parse_replica_groups("mesh['x'=8] {'x':(2)2}", 8)
  assert set(got) == want


def test_mesh_axes_with_device_order():
  """``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}`` (as the
  partitioner prints a reduction over 'model' of a 4 x 2 mesh): the mesh's
  devices are iota(8).reshape(4, 2).T flattened, [0,2,4,6,1,3,5,7], laid
  out as 2 x 4 and reduced over the first axis."""
  text = (
    "HloModule m, num_partitions=8\n\n"
    "%add (a: f32[], b: f32[]) -> f32[] {\n"
    "  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
    "  ROOT %s = f32[] add(%a, %b)\n}\n\n"
    "ENTRY %main (p: f32[3]) -> f32[3] {\n"
    "  %p = f32[3]{0} parameter(0)\n"
    "  ROOT %r = f32[3]{0} all-reduce(%p), channel_id=1, "
    "replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}, "
    "use_global_device_ids=true, to_apply=%add\n}\n"
  )
  devs = np.arange(8).reshape(4, 2).T.reshape(2, 4)
  want = {frozenset(int(v) for v in devs[:, j]) for j in range(4)}
  (op,) = hlo.hlo_stats(text).collectives
  assert op.groups == want == {frozenset((2 * i, 2 * i + 1)) for i in range(4)}
  assert op.nbytes == 3 * F32
