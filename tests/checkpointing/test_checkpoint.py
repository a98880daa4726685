"""Orbax checkpoints of accumulator state (``weighted_accum.checkpoint``).

References are independent of the code under test: an uninterrupted run
(in this process) against a resumed one (in a fresh process), NumPy copies
taken before saving, and ``wa.init``'s placement for the shardings.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import _ckpt_child as child
import weighted_accum as wa
from weighted_accum._src.checkpointing import checkpoint as checkpoint_impl
from weighted_accum.checkpoint import AccumCheckpointHandler

CHILD = pathlib.Path(__file__).parents[1] / "_ckpt_child.py"
BF16 = jnp.dtype(child.DTYPE)


def _child_env(n_devices: int) -> dict[str, str]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
  env["JAX_PLATFORMS"] = "cpu"
  # The child imports this checkout's weighted_accum, not an installed one.
  root = str(CHILD.parent.parent)
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  return env


def _bits(tree) -> list[tuple[str, str, tuple, bytes]]:
  """Leaves as (path, dtype, shape, raw bytes): equality is bitwise."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [
    (
      jax.tree_util.keystr(p),
      str(np.asarray(x).dtype),
      np.shape(x),
      np.asarray(x).tobytes(),
    )
    for p, x in flat
  ]


def _save(path, tree) -> None:
  with ocp.Checkpointer(AccumCheckpointHandler()) as ckptr:
    ckptr.save(path, args=wa.checkpoint.AccumSave(tree))


def _restore(path, template):
  with ocp.Checkpointer(AccumCheckpointHandler()) as ckptr:
    return ckptr.restore(path, args=wa.checkpoint.AccumRestore(template))


def _mid_window(mesh, n=3):
  params = child.place(child.host_params(), mesh)
  state = wa.init(params, BF16, child.LOSS_SCALE)
  return params, child.run(state, 0, n, mesh)


@pytest.fixture(scope="module")
def mesh8():
  return child.make_mesh(8)


# 1. Resume equivalence in a new process ---------------------------------------


@pytest.mark.slow
def test_resume_in_new_process_on_other_mesh_is_bitwise(tmp_path, mesh8):
  params = child.place(child.host_params(), mesh8)
  # Run A: uninterrupted.
  state = wa.init(params, BF16, child.LOSS_SCALE)
  out_a, _ = wa.finish_mean(child.run(state, 0, child.K, mesh8))
  want = _bits(out_a.grads)
  # Run B: checkpoint mid-window at several points (async, donated at once).
  saved_at = (0, 1, 2, 5)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  state = wa.init(params, BF16, child.LOSS_SCALE)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
    for i in range(child.K):
      if i in saved_at:
        mngr.save(
          i,
          args=ocp.args.Composite(
            accum=wa.checkpoint.AccumSave(state),
            params=ocp.args.StandardSave(params),
            data=ocp.args.JsonSave({"next_microbatch": i}),
          ),
        )
      state = child.run(state, i, i + 1, mesh8)
  # A fresh process with 2 devices (mesh 2x1 instead of 4x2) resumes each.
  out = tmp_path / "resumed.npz"
  proc = subprocess.run(
    [sys.executable, str(CHILD), "resume", str(tmp_path / "ckpt"), str(out)],
    env=_child_env(2),
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(out)
  for step in saved_at:
    assert bool(got[f"{step}/placed_as_params"])
    assert int(got[f"{step}/issued"]) == step
    assert float(got[f"{step}/weight"]) == float(out_a.weight)
    for path, dtype, shape, raw in want:
      x = got[f"{step}/grads{path}"]
      assert x.shape == shape and dtype == "bfloat16"
      assert x.tobytes() == raw, (step, path)


@pytest.mark.slow
def test_optax_wrapper_resume_in_new_process_is_bitwise(tmp_path):
  fresh = lambda: jax.tree.map(jnp.asarray, child.host_params())
  tx = child.optax_tx()
  # Run A: two windows of adamw, uninterrupted (the step donates its inputs).
  params_a, state_a = child.optax_run(fresh(), tx.init(fresh()), 0, child.K)
  assert int(state_a.gradient_step) == 2
  # Run B: saved mid-window 1, at the close of window 1, mid-window 2.
  saved_at = (1, 3, 4)
  params = fresh()
  opt_state = tx.init(params)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
    for i in range(child.K):
      if i in saved_at:
        mngr.save(
          i,
          args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt=wa.checkpoint.AccumSave(opt_state),
            data=ocp.args.JsonSave({"next_microbatch": i}),
          ),
        )
      params, opt_state = child.optax_run(params, opt_state, i, i + 1)
  assert _bits(params) == _bits(params_a)  # donation did not hurt the saves
  out = tmp_path / "resumed.npz"
  proc = subprocess.run(
    [sys.executable, str(CHILD), "optax", str(tmp_path / "ckpt"), str(out)],
    env=_child_env(1),
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(out)
  for step in saved_at:
    assert int(got[f"{step}/gradient_step"]) == 2
    for path, _, shape, raw in _bits(params_a):
      x = got[f"{step}/params{path}"]
      assert x.shape == shape and x.tobytes() == raw, (step, path)


@pytest.mark.parametrize("template_kind", ["fresh", "eval_shape"])
def test_optax_wrapper_state_resumes_on_a_mesh(tmp_path, mesh8, template_kind):
  fresh = lambda: child.place(child.host_params(), mesh8)
  tx = child.optax_tx()
  params_a, state_a = child.optax_run(fresh(), tx.init(fresh()), 0, child.K)
  params, state = child.optax_run(fresh(), tx.init(fresh()), 0, 4)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(
      4,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt=wa.checkpoint.AccumSave(state)
      ),
    )
  # A fresh state (its scalars uncommitted) or an abstract one as template.
  template = (
    tx.init(fresh())
    if template_kind == "fresh"
    else jax.eval_shape(tx.init, fresh())
  )
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    got = mngr.restore(
      4,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(
          jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh())
        ),
        opt=wa.checkpoint.AccumRestore(template),
      ),
    )
  assert isinstance(got.opt, wa.WeightedMultiStepsState)
  assert int(got.opt.mini_step) == 1 and int(got.opt.gradient_step) == 1
  params_b, state_b = child.optax_run(got.params, got.opt, 4, child.K)
  assert _bits(params_b) == _bits(params_a)
  assert _bits(state_b) == _bits(state_a)


@given(
  weights=st.lists(
    st.sampled_from([0.0, 0.5, 1.0, 3.0, 1e3, 7.25]), min_size=1, max_size=5
  ),
  j=st.integers(0, 5),
  seed=st.integers(0, 2**16),
  dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
)
def test_resume_in_process_is_bitwise(weights, j, seed, dtype):
  j = min(j, len(weights))
  rng = np.random.default_rng(seed)
  params = {"a": jnp.zeros((3, 5)), "b": [jnp.zeros(2), None]}
  grads = [
    jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
    )
    for _ in weights
  ]

  def feed(state, lo, hi):
    for g, w in zip(grads[lo:hi], weights[lo:hi]):
      state = wa.accumulate_mean(state, g, w)
    return state

  fresh = wa.init(params, dtype, loss_scale=2.0)
  uninterrupted = feed(fresh, 0, len(weights))
  with tempfile.TemporaryDirectory() as d:
    _save(pathlib.Path(d) / "accum", feed(fresh, 0, j))
    template = jax.eval_shape(functools.partial(wa.init, dtype=dtype), params)
    resumed = _restore(pathlib.Path(d) / "accum", template)
  resumed = feed(resumed, j, len(weights))
  assert _bits(resumed) == _bits(uninterrupted)
  assert resumed.dtype == jnp.dtype(dtype)


# 2. Crash safety ----------------------------------------------------------------


def _wait_for_line(proc, marker: str, timeout: float) -> None:
  """Reads the child's stdout until ``marker``; fails after ``timeout`` s."""
  lines: queue.Queue[str] = queue.Queue()
  threading.Thread(
    target=lambda: [lines.put(l.strip()) for l in proc.stdout], daemon=True
  ).start()
  seen, deadline = [], time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      line = lines.get(timeout=0.1)
    except queue.Empty:
      if proc.poll() is not None:
        break
      continue
    if line == marker:
      return
    seen.append(line)
  raise AssertionError(f"child never printed {marker!r}; stdout: {seen}")


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_step(tmp_path):
  ckpt = tmp_path / "ckpt"
  proc = subprocess.Popen(  # pylint: disable=consider-using-with
    [sys.executable, str(CHILD), "crash", str(ckpt)],
    env=_child_env(8),
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  try:
    _wait_for_line(proc, "WRITING", timeout=120)
    # Step 2's array data is on disk, its metadata is not: kill now.
    partial = [p for p in ckpt.iterdir() if p.name.startswith("2.")]
    assert partial and not (ckpt / "2").exists(), list(ckpt.iterdir())
    assert any(f.parent.name == "d" for f in partial[0].rglob("*")), list(
      partial[0].rglob("*")
    )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL

  mesh = child.make_mesh(8)
  params, step1 = _mid_window(mesh, 2)
  template = wa.checkpoint.abstract_state(params, BF16)
  with ocp.CheckpointManager(ckpt) as mngr:
    assert mngr.latest_step() == 1
    assert mngr.all_steps() == [1]
    got = mngr.restore(
      1, args=ocp.args.Composite(accum=wa.checkpoint.AccumRestore(template))
    ).accum
    assert _bits(got) == _bits(step1)
    step2 = child.run(got, 2, 4, mesh)
    mngr.save(2, args=ocp.args.Composite(accum=wa.checkpoint.AccumSave(step2)))
    mngr.wait_until_finished()
    assert mngr.latest_step() == 2
    again = mngr.restore(
      2, args=ocp.args.Composite(accum=wa.checkpoint.AccumRestore(template))
    ).accum
  _, want2 = _mid_window(mesh, 4)
  assert _bits(again) == _bits(want2)


# 3. Sharded restore --------------------------------------------------------------


def test_sharded_restore_on_the_same_mesh(tmp_path, mesh8):
  params, state = _mid_window(mesh8)
  want = _bits(state)
  _save(tmp_path / "accum", state)
  continued = _bits(
    child.run(jax.tree.map(jnp.copy, state), 3, child.K, mesh8)
  )  # run() donates its input
  for template in (
    wa.checkpoint.abstract_state(params, BF16),
    state,
    wa.init(params, BF16),
  ):
    got = _restore(tmp_path / "accum", template)
    assert _bits(got) == want
    assert _bits(child.run(got, 3, child.K, mesh8)) == continued
    reference = wa.init(params, BF16)  # where init puts each buffer
    for g, r in zip(
      jax.tree.leaves(got.grads), jax.tree.leaves(reference.grads)
    ):
      assert g.sharding.is_equivalent_to(r.sharding, g.ndim)
      assert len(g.sharding.device_set) == 8


@pytest.mark.parametrize("n_devices", [4, 2])
def test_restore_onto_a_smaller_mesh(tmp_path, mesh8, n_devices):
  _, state = _mid_window(mesh8)
  _save(tmp_path / "accum", state)
  mesh = child.make_mesh(n_devices)
  params = child.place(child.host_params(), mesh)
  got = _restore(tmp_path / "accum", wa.checkpoint.abstract_state(params, BF16))
  assert _bits(got) == _bits(state)
  for g, p in zip(jax.tree.leaves(got.grads), jax.tree.leaves(params)):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim)
    assert len(g.sharding.device_set) == n_devices
  # The restored window continues on the new mesh like the original would.
  assert _bits(child.run(got, 3, child.K, mesh)) == _bits(
    child.run(state, 3, child.K, mesh8)
  )


def test_abstract_state_keeps_shardings_eval_shape_does_not(mesh8):
  params = child.place(child.host_params(), mesh8)
  abstract = wa.checkpoint.abstract_state(params, BF16)
  concrete = wa.init(params, BF16)
  for a, c in zip(
    jax.tree.leaves(abstract.grads), jax.tree.leaves(concrete.grads)
  ):
    assert (a.shape, a.dtype) == (c.shape, c.dtype)
    assert a.sharding.is_equivalent_to(c.sharding, len(a.shape))
  assert abstract.dtype == BF16
  # The reason the helper exists: eval_shape drops them.
  assert all(
    x.sharding is None
    for x in jax.tree.leaves(
      jax.eval_shape(functools.partial(wa.init, dtype=BF16), params).grads
    )
  )


def test_eval_shape_template_restores_on_the_saved_sharding(tmp_path):
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  state = wa.accumulate_sum(
    wa.init(params), {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}, 2.0
  )
  _save(tmp_path / "accum", state)
  got = _restore(tmp_path / "accum", jax.eval_shape(wa.init, params))
  assert _bits(got) == _bits(state)
  assert got.grads["w"].sharding == state.grads["w"].sharding


# 4. Validation --------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
  """A bfloat16 mid-window state saved to tmp_path/'accum'."""
  params = {
    "dense": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)},
    "head": jnp.zeros((3, 2)),
  }
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.25), params)
  state = wa.accumulate_mean(wa.init(params, BF16, 4.0), grads, 6.0)
  _save(tmp_path / "accum", state)
  return tmp_path / "accum", params, state


def _assert_refused(path, template, *needles):
  before = _bits(template)
  with pytest.raises(wa.WeightedAccumulationError) as info:
    _restore(path, template)
  msg = str(info.value)
  for needle in (str(path),) + needles:
    assert needle in msg, (needle, msg)
  # The caller's state is unchanged and still usable.
  if isinstance(template, wa.AccumState) and not isinstance(
    jax.tree.leaves(template)[0], jax.ShapeDtypeStruct
  ):
    assert _bits(template) == before
    ones = jax.tree.map(jnp.ones_like, template.grads)
    assert wa.accumulate_sum(template, ones, 1.0).issued == template.issued + 1
  return msg


def test_refuses_a_missing_leaf(saved):
  path, params, _ = saved
  params = dict(params, extra=jnp.zeros(2))
  _assert_refused(path, wa.init(params, BF16), "['grads']['extra']", "missing")


def test_refuses_an_extra_leaf(saved):
  path, params, _ = saved
  del params["head"]
  _assert_refused(path, wa.init(params, BF16), "['grads']['head']", "extra")


def test_refuses_a_shape_mismatch(saved):
  path, params, _ = saved
  params["dense"]["kernel"] = jnp.zeros((4, 4))
  _assert_refused(
    path,
    wa.init(params, BF16),
    "['grads']['dense']['kernel']",
    "(4, 3)",
    "(4, 4)",
  )


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_refuses_another_work_dtype(saved, dtype):
  path, params, _ = saved
  _assert_refused(path, wa.init(params, dtype), "bfloat16", dtype, "dtype")
  # Abstract template too (Orbax alone would cast it silently).
  _assert_refused(
    path, wa.checkpoint.abstract_state(params, dtype), "bfloat16", dtype
  )


def test_refuses_a_cast_of_another_leaf(tmp_path):
  state = wa.init({"w": jnp.zeros(2)})
  _save(tmp_path / "tree", {"accum": state, "mu": jnp.zeros(2, BF16)})
  template = {"accum": state, "mu": jnp.zeros(2, jnp.float32)}
  _assert_refused(tmp_path / "tree", template, "['mu']", "bfloat16", "float32")


def test_state_without_buffers_keeps_its_work_dtype(tmp_path):
  state = wa.init({}, dtype=BF16)
  _save(tmp_path / "accum", state)
  got = _restore(tmp_path / "accum", wa.init({}, dtype=BF16))
  assert got.dtype == BF16
  assert jax.tree.structure(got) == jax.tree.structure(state)


@pytest.mark.parametrize("template_dtype", ["float32", "float16"])
def test_refuses_a_state_without_buffers_of_another_work_dtype(
  tmp_path, template_dtype
):
  """A window without buffers has no leaf whose dtype could tell: the saved
  work dtype option alone refuses to restore a bfloat16 window as another
  (concrete and abstract templates)."""
  _save(tmp_path / "accum", wa.init({}, dtype=BF16))
  for template in (
    wa.init({}, dtype=template_dtype),
    wa.checkpoint.abstract_state({}, template_dtype),
  ):
    _assert_refused(tmp_path / "accum", template, "bfloat16", template_dtype)


def test_an_unusable_window_saves_and_restores_as_it_was(tmp_path):
  """A traced invalid next_loss_scale leaves the next window unusable (NaN
  scale). What the library makes, it restores: saved and restored bit for
  bit (still unusable), and after a close with a valid scale it is usable
  again."""
  state = wa.accumulate_sum(wa.init({"w": jnp.zeros(2)}), {"w": jnp.ones(2)}, 2)
  close = jax.jit(lambda s, x: wa.finish_mean(s, next_loss_scale=x))
  _, unusable = close(state, jnp.float32(-1.0))
  assert np.isnan(float(unusable.loss_scale))
  _save(tmp_path / "nan", unusable)
  back = _restore(tmp_path / "nan", unusable)
  assert np.isnan(float(back.loss_scale))
  assert int(back.windows) == int(unusable.windows)
  _, usable = jax.jit(wa.finish_sums)(back, next_loss_scale=jnp.float32(8))
  _save(tmp_path / "good", usable)
  got = _restore(tmp_path / "good", usable)
  assert float(got.loss_scale) == 8.0


def test_refuses_a_python_scalar_of_another_type(tmp_path):
  # A float saved where the template holds an int would come back truncated
  # (7.5 -> 7) if not refused.
  state = wa.init({"w": jnp.zeros(2)})
  _save(tmp_path / "tree", {"accum": state, "step": 7.5})
  _assert_refused(
    tmp_path / "tree",
    {"accum": state, "step": 0},
    "['step']",
    "float64",
    "int64",
  )


def _save_unchecked(path, tree, monkeypatch) -> None:
  """Writes ``tree`` although AccumSave refuses it (AccumSave checks what
  AccumRestore checks): a corrupt or foreign checkpoint."""
  with pytest.raises(wa.WeightedAccumulationError, match="AccumSave"):
    _save(path, tree)
  with monkeypatch.context() as m:
    m.setattr(checkpoint_impl, "_check_restorable", lambda *_: None)
    _save(path, tree)


@pytest.mark.parametrize(
  "field,value,needle",
  [
    ("weight_hi", -1.0, "'total_weight'"),
    ("weight_hi", np.nan, "'total_weight'"),
    ("weight_lo", np.inf, "'total_weight'"),
    ("issued", -1, "'issued'"),
    ("zero_weight", -3, "'zero_weight'"),
    ("rejected", -1, "'rejected'"),
    ("windows", -2, "'windows'"),
    ("loss_scale", 0.0, "'loss_scale'"),
    ("loss_scale", -2.0, "'loss_scale'"),
  ],
)
def test_refuses_invalid_counters(saved, field, value, needle, monkeypatch):
  path, params, state = saved
  bad = state.replace(
    **{field: jnp.asarray(value, getattr(state, field).dtype)}
  )
  _save_unchecked(path.with_name("bad"), bad, monkeypatch)
  _assert_refused(
    path.with_name("bad"), wa.init(params, BF16), needle, "counters"
  )


def test_refuses_nonzero_buffers_with_zero_weight(saved, monkeypatch):
  path, params, state = saved
  bad = state.replace(weight_hi=jnp.float32(0), weight_lo=jnp.float32(0))
  _save_unchecked(path.with_name("bad"), bad, monkeypatch)
  _assert_refused(
    path.with_name("bad"), wa.init(params, BF16), "total weight is 0"
  )


def _edit_metadata(path, edit) -> None:
  meta_file = path / "_METADATA"
  meta = json.loads(meta_file.read_text())
  edit(meta["custom_metadata"])
  meta_file.write_text(json.dumps(meta))


def test_refuses_an_unknown_format_version(saved):
  path, params, _ = saved
  _edit_metadata(path, lambda m: m["weighted_accum"].update(format_version=99))
  _assert_refused(path, wa.init(params, BF16), "'format_version'", "99")


def test_refuses_a_checkpoint_not_written_by_accum_save(saved):
  path, params, state = saved
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path.with_name("std"), state)
  _assert_refused(
    path.with_name("std"),
    wa.init(params, BF16),
    "'weighted_accum'",
    "AccumSave",
  )


def test_refuses_a_different_accumulator_layout(saved, tmp_path):
  path, params, state = saved
  _assert_refused(path, {"accum": state}, "AccumState", "['accum']")
  _save(tmp_path / "two", {"a": state, "b": state})
  _assert_refused(
    tmp_path / "two", {"a": state, "b": state.grads}, "AccumState", "['b']"
  )


def _data_files(path):
  files = [p for p in path.rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files, list(path.rglob("*"))
  return files


# Orbax leaves an "Event loop is closed" callback behind after a failed read.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_refuses_missing_or_truncated_array_files(saved, damage):
  path, params, _ = saved
  for f in _data_files(path):
    if damage == "delete":
      f.unlink()
    else:
      f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
  _assert_refused(path, wa.init(params, BF16), "missing, truncated or corrupt")


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_refuses_missing_or_truncated_metadata(saved, damage):
  path, params, _ = saved
  meta_file = path / "_METADATA"
  if damage == "delete":
    meta_file.unlink()
    needle = "missing"
  else:
    meta_file.write_text(meta_file.read_text()[:100])
    needle = "missing, truncated or corrupt"
  _assert_refused(path, wa.init(params, BF16), "metadata", needle)


def test_refuses_a_missing_item_directory(saved):
  path, params, _ = saved
  # Checkpointer and CheckpointManager check for the directory themselves
  # (FileNotFoundError, KeyError); the handler refuses on its own as well.
  with pytest.raises(wa.WeightedAccumulationError, match="does not exist"):
    AccumCheckpointHandler().restore(
      path.with_name("nowhere"),
      args=wa.checkpoint.AccumRestore(wa.init(params, BF16)),
    )


def test_restore_without_a_template_is_refused(saved):
  path, _, state = saved
  mngr_dir = path.parent / "mngr"
  with ocp.CheckpointManager(mngr_dir) as mngr:
    mngr.save(0, args=ocp.args.Composite(accum=wa.checkpoint.AccumSave(state)))
    mngr.wait_until_finished()
  with ocp.CheckpointManager(mngr_dir) as mngr:  # fresh: no handler known
    with pytest.raises(wa.WeightedAccumulationError, match="template"):
      mngr.restore(0)


# 5. Async save, then donation at once -------------------------------------------


def test_async_save_then_donation_writes_the_pre_donation_values(
  tmp_path, mesh8
):
  shard = jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec("a"))
  params = {
    "big": jax.device_put(jnp.zeros((1 << 12, 1 << 10)), shard),
    "small": jnp.zeros(7),
  }
  params["small"] = jax.device_put(
    params["small"],
    jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec()),
  )
  ones = jax.tree.map(jnp.ones_like, params)
  step = jax.jit(lambda s, g: wa.accumulate_sum(s, g, 1.0), donate_argnums=0)
  state = step(wa.init(params), ones)
  before = _bits(state)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
    mngr.save(1, args=ocp.args.Composite(accum=wa.checkpoint.AccumSave(state)))
    assert _bits(state) == before  # saving changed nothing
    for _ in range(3):  # overwrite the saved buffers in place
      state = step(state, ones)
    mngr.wait_until_finished()
    got = mngr.restore(
      1,
      args=ocp.args.Composite(
        accum=wa.checkpoint.AccumRestore(wa.checkpoint.abstract_state(params))
      ),
    ).accum
  assert _bits(got) == before
  assert float(state.grads["big"][0, 0]) == 4.0 and state.total_weight == 4.0


# Trees holding accumulators (e.g. an optax wrapper's state) -----------------------


def test_tree_with_accumulator_and_optimizer_state(tmp_path):
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  opt = optax.adamw(1e-2)
  opt_state = opt.init(params)
  _, opt_state = opt.update(jax.tree.map(jnp.sin, params), opt_state, params)
  accum = wa.accumulate_mean(
    wa.init(params, BF16), jax.tree.map(jnp.cos, params), 5.0
  )
  tree = {"opt": opt_state, "accum": accum, "step": 7}
  _save(tmp_path / "tree", tree)
  template = {
    "opt": jax.eval_shape(opt.init, params),
    "accum": wa.checkpoint.abstract_state(params, BF16),
    "step": 0,
  }
  got = _restore(tmp_path / "tree", template)
  assert _bits(got) == _bits(tree)
  assert got["step"] == 7 and isinstance(got["step"], int)
  assert jax.tree.structure(got) == jax.tree.structure(tree)


def test_readme_checkpoint_example_runs(capsys):
  readme = (
    pathlib.Path(__file__).parents[2] / "docs" / "checkpointing.md"
  ).read_text()
  section = readme.split("<!-- BEGIN checkpoint -->")[1].split(
    "<!-- END checkpoint -->"
  )[0]
  code = section.split("```python\n")[1].split("```")[0]
  exec(compile(code, "README checkpoint", "exec"), {})  # pylint: disable=exec-used
  assert capsys.readouterr().out.split() == ["1", "7.0", "bfloat16"]


def test_import_loads_no_orbax_until_the_checkpoint_namespace_is_used():
  code = (
    "import sys, weighted_accum as wa\n"
    "assert not any(m.startswith('orbax') for m in sys.modules)\n"
    "assert wa.checkpoint.AccumSave.__name__ == 'AccumSave'\n"
    "assert 'orbax.checkpoint' in sys.modules\n"
    "from weighted_accum.checkpoint import abstract_state\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code],
    env=_child_env(1),
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
