"""Checkpoints of every window kind, the unusable (NaN-scale) window and
NNX-held windows.

References are independent of the code under test: an uninterrupted run
against one saved mid-window and restored (in this process, on other devices,
and in a fresh process), and NumPy copies taken before saving.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from test_checkpoint import _bits
from test_checkpoint import _restore
from test_checkpoint import _save
from test_checkpoint import _save_unchecked

import _ckpt_child as child
import weighted_accum as wa

CHILD = pathlib.Path(__file__).parents[1] / "_ckpt_child.py"
BF16 = jnp.dtype(child.DTYPE)
Error = wa.WeightedAccumulationError


def _mesh(first=0, n=child.R):
  return child.replica_mesh(jax.devices()[first : first + n])


def _fresh(mesh):
  params = child.stacked_params(mesh)
  return params, wa.init(params, BF16, child.LOSS_SCALE, axis_name="data")


def _closed(state):
  out, _ = jax.jit(wa.finish_mean)(state)
  return _bits(out.grads), float(out.weight)


@pytest.fixture(scope="module")
def uninterrupted():
  """Run A: every step of the stacked window, then its close."""
  mesh = _mesh()
  _, state = _fresh(mesh)
  return _closed(child.stacked_run(state, 0, child.STACKED_STEPS, mesh))


@pytest.fixture(scope="module")
def saved_stacked(tmp_path_factory):
  """Run B's first part: the stacked window saved after step 1 of 3."""
  mesh = _mesh()
  _, state = _fresh(mesh)
  state = child.stacked_run(state, 0, 1, mesh)
  path = tmp_path_factory.mktemp("stacked") / "accum"
  copy = _bits(state)
  _save(path, state)
  return path, copy


# 1. A stacked window resumes bit for bit ------------------------------------------


@pytest.mark.parametrize(
  "template_kind,devices",
  [
    ("abstract_state", "same"),
    ("abstract_state", "other"),  # another mesh of as many replicas
    # Without shardings in the template, the saved ones are used.
    ("eval_shape", "same"),
  ],
)
def test_stacked_window_resumes_mid_window_bitwise(
  saved_stacked, uninterrupted, template_kind, devices
):
  path, copy = saved_stacked
  mesh = _mesh(0 if devices == "same" else child.R)
  params = child.stacked_params(mesh)
  template = (
    wa.checkpoint.abstract_state(params, BF16, axis_name="data")
    if template_kind == "abstract_state"
    else jax.eval_shape(
      lambda: wa.init(params, BF16, child.LOSS_SCALE, axis_name="data")
    )
  )
  got = _restore(path, template)
  assert got.placement == wa.init(params, axis_name="data").placement
  assert _bits(got) == copy  # every buffer and counter, bit for bit
  _, fresh = _fresh(mesh)
  for name in ("grads", "issued", "weight_hi", "loss_scale"):
    for g, f in zip(
      jax.tree.leaves(getattr(got, name)), jax.tree.leaves(getattr(fresh, name))
    ):  # where wa.init puts it, on this mesh's devices
      assert g.sharding.is_equivalent_to(f.sharding, g.ndim), name
  resumed = child.stacked_run(got, 1, child.STACKED_STEPS, mesh)
  assert _closed(resumed) == uninterrupted


@pytest.mark.slow
def test_stacked_window_resumes_in_a_new_process_bitwise(
  tmp_path, uninterrupted
):
  mesh = _mesh()
  _, state = _fresh(mesh)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    for i in range(child.STACKED_STEPS):
      if i in (1, 2):
        mngr.save(
          i,
          args=ocp.args.Composite(
            accum=wa.checkpoint.AccumSave(state),
            data=ocp.args.JsonSave({"next_step": i}),
          ),
        )
        mngr.wait_until_finished()
      state = child.stacked_run(state, i, i + 1, mesh)
  out = tmp_path / "resumed.npz"
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={child.R}"
  env["JAX_PLATFORMS"] = "cpu"
  # The child imports this checkout's weighted_accum, not an installed one.
  root = str(CHILD.parent.parent)
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, str(CHILD), "stacked", str(tmp_path / "ckpt"), str(out)],
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(out)
  want_grads, want_weight = uninterrupted
  for step in (1, 2):
    assert got[f"{step}/issued"].tolist() == [step] * child.R
    assert float(got[f"{step}/weight"]) == want_weight
    for path, _, shape, raw in want_grads:
      x = got[f"{step}/grads{path}"]
      assert x.shape == shape and x.tobytes() == raw, (step, path)


def test_abstract_state_is_shaped_and_placed_as_init():
  """On a 2-D mesh with a param sharded over the model axis: the stacked
  template has wa.init's shapes, dtypes and shardings, leaf by leaf."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()).reshape(4, 2), ("data", "model")
  )
  params = {
    "w": jax.device_put(
      jnp.zeros((3, 4)), NamedSharding(mesh, P(None, "model"))
    ),
    "b": jax.device_put(jnp.zeros(4), NamedSharding(mesh, P())),
  }
  real = wa.init(params, BF16, axis_name="data")
  abstract = wa.checkpoint.abstract_state(params, BF16, axis_name="data")
  assert abstract.placement == real.placement and abstract.dtype == BF16
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
    assert (a.shape, a.dtype) == (r.shape, r.dtype)
    assert a.sharding.is_equivalent_to(r.sharding, len(r.shape))
  with pytest.raises(Error, match=r"abstract_state\(axis_name=...\).*mesh"):
    wa.checkpoint.abstract_state({"w": jnp.zeros(3)}, axis_name="data")


# 2. Other kinds, replica counts and meshes: exact or refused --------------------


def test_stacked_save_is_refused_by_a_global_template(saved_stacked):
  path, _ = saved_stacked
  params = child.stacked_params(_mesh())
  with pytest.raises(Error) as info:
    _restore(path, wa.checkpoint.abstract_state(params, BF16))
  msg = str(info.value)
  for needle in (str(path), "stacked", "4 replicas", "global", "axis_name"):
    assert needle in msg, (needle, msg)


def test_stacked_save_is_refused_by_another_replica_count(saved_stacked):
  path, _ = saved_stacked
  params = child.stacked_params(_mesh(n=2))
  template = wa.checkpoint.abstract_state(params, BF16, axis_name="data")
  with pytest.raises(Error, match="4 replicas.*2 replicas.*close the window"):
    _restore(path, template)


def test_global_save_is_refused_by_a_stacked_template(tmp_path):
  params = child.stacked_params(_mesh())
  state = wa.accumulate_sum(
    wa.init(params, BF16), jax.tree.map(jnp.ones_like, params), 2.0
  )
  _save(tmp_path / "accum", state)
  template = wa.checkpoint.abstract_state(params, BF16, axis_name="data")
  with pytest.raises(Error, match="holds a global window.*template is a st"):
    _restore(tmp_path / "accum", template)
  got = _restore(tmp_path / "accum", wa.checkpoint.abstract_state(params, BF16))
  assert _bits(got) == _bits(state) and got.placement.kind == "global"


def test_a_per_replica_window_keeps_its_placement(tmp_path):
  """A per-replica window returned from shard_map (reduce="microbatch":
  it holds the global sums) restores into a template of its kind, placement
  included, and is refused by a global one."""
  mesh = _mesh()
  params = {"w": jnp.zeros(3)}

  def body(p, g):
    s = wa.init(p, axis_name="data", reduce="microbatch")
    return wa.accumulate_sum(s, {"w": g[0]}, 2.0)

  make = jax.shard_map(
    body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
  )
  state = jax.jit(make)(params, jnp.arange(12.0).reshape(4, 3))
  _save(tmp_path / "accum", state)
  got = _restore(tmp_path / "accum", state)
  assert got.placement == state.placement and _bits(got) == _bits(state)
  with pytest.raises(Error, match="reduce='microbatch'.*template is a global"):
    _restore(tmp_path / "accum", wa.init(params))


def test_a_version_1_item_restores_as_a_global_window(tmp_path):
  """Items written before placements were saved hold global windows."""
  params = {"w": jnp.zeros(3)}
  state = wa.accumulate_sum(wa.init(params), {"w": jnp.ones(3)}, 5.0)
  path = tmp_path / "accum"
  _save(path, state)
  meta_file = path / "_METADATA"
  meta = json.loads(meta_file.read_text())
  options = meta["custom_metadata"]["weighted_accum"]
  options["format_version"] = 1
  del options["states"][""]["placement"]
  meta_file.write_text(json.dumps(meta))
  assert _bits(_restore(path, wa.init(params))) == _bits(state)
  mesh = _mesh()
  per_replica = jax.jit(
    jax.shard_map(
      lambda p: wa.init(p, axis_name="data", reduce="microbatch"),
      mesh=mesh,
      in_specs=P(),
      out_specs=P(),
    )
  )(params)
  with pytest.raises(
    Error, match="holds a global window.*template is a per-replica"
  ):
    _restore(path, per_replica)


def test_abstract_state_under_set_mesh_is_the_window_init_makes_there():
  """Params without shardings (jax.eval_shape) under jax.set_mesh: the
  template is the stacked window wa.init makes there."""
  mesh = _mesh()
  shapes = jax.eval_shape(lambda: {"w": jnp.zeros(3)})
  with jax.set_mesh(mesh):
    made = wa.init({"w": jnp.zeros(3)}, axis_name="data")
    abstract = wa.checkpoint.abstract_state(shapes, axis_name="data")
  assert abstract.placement == made.placement
  assert abstract.grads["w"].shape == made.grads["w"].shape
  assert abstract.grads["w"].sharding.spec == made.grads["w"].sharding.spec


# 3. A stacked window's counters are checked replica by replica -------------------


def _corrupt(state, name, replica, value):
  x = np.asarray(getattr(state, name)).copy()
  x[replica] = value
  return state.replace(**{name: jnp.asarray(x)})


@pytest.mark.parametrize(
  "name,value,needle",
  [
    ("issued", -1, "'issued'"),
    ("zero_weight", 5, "<= 'issued'"),
    ("weight_hi", -2.0, "'total_weight'"),
    ("weight_lo", np.nan, "'total_weight'"),
  ],
)
def test_stacked_counters_are_validated_per_replica(
  tmp_path, name, value, needle, monkeypatch
):
  mesh = _mesh()
  params, state = _fresh(mesh)
  state = child.stacked_run(state, 0, 1, mesh)
  bad = _corrupt(state, name, 2, value)
  _save_unchecked(tmp_path / "accum", bad, monkeypatch)
  template = wa.checkpoint.abstract_state(params, BF16, axis_name="data")
  with pytest.raises(Error) as info:
    _restore(tmp_path / "accum", template)
  assert "replica 2" in str(info.value) and needle in str(info.value)


def test_nonzero_buffers_of_a_zero_weight_replica_are_refused(
  tmp_path, monkeypatch
):
  """Replica 1 fed only a zero-weight microbatch: its weight is 0, so its
  buffers must be zero; a save claiming otherwise is corrupt."""
  mesh = _mesh()
  params, state = _fresh(mesh)
  state = child.stacked_run(state, 0, 1, mesh)
  assert np.asarray(state.weight_hi)[1] == 0
  grads = jax.tree.map(lambda b: b.at[1].set(1.0), state.grads)
  _save_unchecked(tmp_path / "accum", state.replace(grads=grads), monkeypatch)
  template = wa.checkpoint.abstract_state(params, BF16, axis_name="data")
  with pytest.raises(Error, match="replica 1: the total weight is 0.*non-zero"):
    _restore(tmp_path / "accum", template)


# 4. The unusable window (NaN loss scale) restores as it was --------------------------


def test_a_window_with_a_nan_loss_scale_restores_and_recovers(tmp_path):
  """A traced invalid next_loss_scale leaves a NaN scale (docs/inputs.md):
  what AccumSave wrote restores as it was, and the window is usable again
  after a valid next_loss_scale."""
  params = {"w": jnp.zeros(3)}
  held = wa.accumulate_sum(wa.init(params), {"w": jnp.ones(3)}, 2.0)
  finish = jax.jit(lambda s, ls: wa.finish_mean(s, next_loss_scale=ls))
  _, unusable = finish(held, jnp.float32(-1.0))
  assert np.isnan(float(unusable.loss_scale))
  _save(tmp_path / "accum", unusable)
  got = _restore(tmp_path / "accum", wa.checkpoint.abstract_state(params))
  assert _bits(got) == _bits(unusable)
  with pytest.raises(Error, match="loss scale is nan"):
    wa.accumulate_sum(got, {"w": jnp.ones(3)}, 1.0)  # eager: refused
  rejected = jax.jit(wa.accumulate_sum)(got, {"w": jnp.ones(3)}, 1.0)
  assert int(rejected.rejected) == 1 and rejected.total_weight == 0
  out, nxt = finish(rejected, jnp.float32(2.0))
  assert not bool(out.valid) and float(nxt.loss_scale) == 2.0
  ok = wa.accumulate_sum(nxt, {"w": jnp.full(3, 2.0)}, 1.0)
  out, _ = wa.finish_mean(ok)
  assert bool(out.valid) and out.grads["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_stacked_window_with_a_nan_loss_scale_restores(tmp_path):
  mesh = _mesh()
  params, state = _fresh(mesh)
  state = child.stacked_run(state, 0, 1, mesh)
  unusable = jax.jit(wa.set_loss_scale)(state, 2.0)  # holds weight: NaN
  assert np.isnan(float(unusable.loss_scale))
  _save(tmp_path / "accum", unusable)
  template = wa.checkpoint.abstract_state(params, BF16, axis_name="data")
  assert _bits(_restore(tmp_path / "accum", template)) == _bits(unusable)


# 5. Windows held by an nnx.Optimizer -----------------------------------------------


def _nnx_optimizer():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = wa.WeightedMultiSteps(optax.sgd(0.1), 3, mode="mean")
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _nnx_feed(model, optimizer, weight):
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(model)
  optimizer.update(model, grads, weight=weight)


@pytest.mark.parametrize("what", ["opt_state", "nnx_state"])
def test_nnx_optimizer_window_restores_and_reads(tmp_path, what):
  """``optimizer.opt_state`` restores as a window (validated, in its
  ``nnx.Variable``s); ``nnx.state(optimizer)`` restores as the State it is
  and goes back in with ``nnx.update``. The readers then work."""
  model, optimizer = _nnx_optimizer()
  _nnx_feed(model, optimizer, 4.0)
  want = wa.window_counters(optimizer.opt_state)
  saved = optimizer.opt_state if what == "opt_state" else nnx.state(optimizer)
  _save(tmp_path / "accum", saved)
  _, other = _nnx_optimizer()
  if what == "opt_state":
    got = _restore(tmp_path / "accum", other.opt_state)
    assert isinstance(got, wa.WeightedMultiStepsState)
  else:
    nnx.update(other, _restore(tmp_path / "accum", nnx.state(other)))
    got = other.opt_state
  counters = wa.window_counters(got)
  assert counters["total_weight"] == 4.0 == want["total_weight"]
  assert int(counters["issued"]) == 1 and int(counters["mini_step"]) == 1
