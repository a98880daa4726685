"""The window-level dynamic loss scale: ``DynamicLossScale`` and
``set_loss_scale``.

References are independent of the code under test: a pure-Python transcript
of PyTorch GradScaler's update rule (``_amp_update_scale_``) plus the
``min_scale`` floor, hand-computed numbers, NumPy snapshots taken before a
save, an uninterrupted run against a resumed one, and float32 training of the
demo model for the float16 run.
"""

from __future__ import annotations

import math
import pathlib
import pickle
import re
import tempfile

from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import toy_lm as toy

import weighted_accum as wa
from weighted_accum.checkpoint import AccumCheckpointHandler

PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(2)}


# The reference: GradScaler's rule, one update per window -------------------


def gradscaler_update(
  scale: float,
  tracker: int,
  finite: bool,
  *,
  growth_factor: float,
  backoff_factor: float,
  growth_interval: int,
  min_scale: float,
) -> tuple[float, int]:
  """PyTorch's ``_amp_update_scale_`` kernel in Python floats (the scale is a
  float32 tensor, the factors doubles), plus the ``min_scale`` floor."""
  with np.errstate(over="ignore"):
    if not finite:
      return max(float(np.float32(scale * backoff_factor)), min_scale), 0
    successful = tracker + 1
    if successful == growth_interval:
      grown = float(np.float32(scale * growth_factor))
      return (grown if math.isfinite(grown) else scale), 0
    return scale, successful


def reference_run(scale, flags, **config) -> list[tuple[float, int]]:
  out, tracker = [], 0
  for f in flags:
    scale, tracker = gradscaler_update(scale, tracker, f, **config)
    out.append((scale, tracker))
  return out


def _trajectory(scaler, flags, jit):
  adjust = (
    jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
  )
  out = []
  for f in flags:
    scaler = adjust(scaler, f if jit else bool(f))
    out.append((float(scaler.scale), int(scaler.growth_tracker)))
  return out


CONFIGS = st.fixed_dictionaries(
  dict(
    growth_factor=st.sampled_from([2.0, 1.5, 4.0, 1.25]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.75, 0.125]),
    growth_interval=st.integers(1, 5),
    min_scale=st.sampled_from([1.0, 0.5, 2.0**-10, 1024.0]),
  )
)


@given(
  config=CONFIGS,
  scale_exp=st.integers(-10, 127),
  flags=st.lists(st.booleans(), min_size=1, max_size=40),
  jit=st.booleans(),
)
def test_rule_matches_gradscaler_reference(config, scale_exp, flags, jit):
  scale = max(2.0**scale_exp, config["min_scale"])
  scaler = wa.DynamicLossScale(scale, **config)
  assert _trajectory(scaler, flags, jit) == reference_run(
    scale, flags, **config
  )


def test_scripted_windows_defaults_window_by_window(variant):
  # GradScaler's defaults except the interval: back off, floor, grow.
  flags = [False, True, True, True, False, False, False, True, True, True]
  scaler = wa.DynamicLossScale(8.0, growth_interval=3, min_scale=2.0)
  adjust = variant(lambda s, f: s.adjust(f))
  got = []
  for f in flags:
    scaler = adjust(scaler, jnp.bool_(f))
    got.append((float(scaler.scale), int(scaler.growth_tracker)))
  assert got == [
    (4.0, 0),
    (4.0, 1),
    (4.0, 2),
    (8.0, 0),
    (4.0, 0),
    (2.0, 0),
    (2.0, 0),
    (2.0, 1),
    (2.0, 2),
    (4.0, 0),
  ]
  assert got == reference_run(
    8.0,
    flags,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=3,
    min_scale=2.0,
  )


def test_gradscaler_default_interval_2000():
  scaler = wa.DynamicLossScale(2.0**16)
  assert (
    scaler.growth_factor,
    scaler.backoff_factor,
    scaler.growth_interval,
    scaler.min_scale,
  ) == (2.0, 0.5, 2000, 1.0)
  step = jax.jit(
    lambda s: jax.lax.fori_loop(
      0, 1999, lambda i, s: s.adjust(jnp.bool_(True)), s
    )
  )
  scaler = step(scaler)
  assert (float(scaler.scale), int(scaler.growth_tracker)) == (2.0**16, 1999)
  scaler = scaler.adjust(True)
  assert (float(scaler.scale), int(scaler.growth_tracker)) == (2.0**17, 0)


def test_growth_that_would_overflow_float32_keeps_the_scale(variant):
  top = float(np.finfo(np.float32).max)
  scaler = wa.DynamicLossScale(2.0**127, growth_interval=1)
  out = variant(lambda s: s.adjust(True))(scaler)
  assert float(out.scale) == 2.0**127 and int(out.growth_tracker) == 0
  big = wa.DynamicLossScale(top, growth_interval=1, growth_factor=1.5)
  assert float(variant(lambda s: s.adjust(True))(big).scale) == top


def test_scan_over_windows_matches_reference():
  flags = np.array([True] * 5 + [False] * 3 + [True] * 7)
  scaler = wa.DynamicLossScale(2.0**15, growth_interval=4, min_scale=2.0**13)

  def body(s, f):
    s = s.adjust(f)
    return s, (s.scale, s.growth_tracker)

  _, (scales, trackers) = jax.jit(lambda s, fs: jax.lax.scan(body, s, fs))(
    scaler, jnp.asarray(flags)
  )
  ref = reference_run(
    2.0**15,
    flags.tolist(),
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=4,
    min_scale=2.0**13,
  )
  assert list(zip(scales.tolist(), trackers.tolist())) == ref


# The pytree -------------------------------------------------------------------


def test_is_an_immutable_pytree_with_two_leaves():
  scaler = wa.DynamicLossScale(2.0**16, growth_interval=7)
  leaves, treedef = jax.tree.flatten(scaler)
  assert [np.asarray(x).dtype for x in leaves] == [np.float32, np.int32]
  assert [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(scaler)[0]
  ] == [".scale", ".growth_tracker"]
  again = jax.tree.unflatten(treedef, leaves)
  assert again.growth_interval == 7 and float(again.scale) == 2.0**16
  with pytest.raises(AttributeError):
    scaler.scale = 1.0  # frozen
  # Static fields are part of the tree structure (a new config recompiles).
  assert treedef != jax.tree.structure(wa.DynamicLossScale(2.0**16))


def test_jit_with_donation_and_one_trace():
  traces = []

  def adjust(s, f):
    traces.append(1)
    return s.adjust(f)

  step = jax.jit(adjust, donate_argnums=0)
  scaler = wa.DynamicLossScale(2.0**16, growth_interval=2)
  for f in [True, False, True, True]:
    scaler = step(scaler, jnp.bool_(f))
  assert (float(scaler.scale), int(scaler.growth_tracker)) == (2.0**16, 0)
  assert len(traces) == 1  # new values of the leaves never retrace


def test_replace_is_validated():
  scaler = wa.DynamicLossScale(2.0**16)
  assert int(scaler.replace(growth_tracker=5).growth_tracker) == 5
  with pytest.raises(wa.WeightedAccumulationError, match="growth_tracker"):
    scaler.replace(growth_tracker=2000)
  with pytest.raises(wa.WeightedAccumulationError, match="scale"):
    scaler.replace(scale=float("nan"))


# Validation -------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, needle",
  [
    (dict(scale=0.0), "scale"),
    (dict(scale=-1.0), "scale"),
    (dict(scale=float("inf")), "scale"),
    (dict(scale=float("nan")), "scale"),
    (dict(scale=1e39), "scale"),  # beyond float32
    (dict(scale=1e-46), "scale"),  # rounds to 0 in float32
    (dict(scale=np.ones(2)), "scale"),
    (dict(scale="65536"), "scale"),
    (dict(scale=0.5), "min_scale"),  # below the default min_scale 1
    (dict(scale=4.0, min_scale=8.0), "min_scale"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(growth_factor=1 + 1e-9), "growth_factor"),  # 1.0 in float32
    (dict(growth_factor=float("inf")), "growth_factor"),
    (dict(growth_factor=jnp.float32(2.0) + jnp.zeros(2)), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=-0.5), "backoff_factor"),
    (dict(backoff_factor=float("nan")), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=-3), "growth_interval"),
    (dict(growth_interval=2000.0), "growth_interval"),
    (dict(growth_interval=True), "growth_interval"),
    (dict(growth_interval=2**31), "growth_interval"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=float("nan")), "min_scale"),
    (dict(min_scale=-1.0), "min_scale"),
    (dict(growth_tracker=-1), "growth_tracker"),
    (dict(growth_tracker=2000), "growth_tracker"),
    (dict(growth_tracker=1.5), "growth_tracker"),
  ],
)
def test_constructor_names_the_invalid_argument(kwargs, needle):
  kwargs = dict(kwargs)
  scale = kwargs.pop("scale", 2.0**16)
  with pytest.raises(wa.WeightedAccumulationError, match=needle) as e:
    wa.DynamicLossScale(scale, **kwargs)
  assert isinstance(e.value, ValueError)


@given(
  scale=st.floats(allow_nan=True, allow_infinity=True)
  | st.sampled_from([1e-38, 1.2e-38, 1e-45, 3.4e38, 3.5e38, 0.5, 1.0, -0.0]),
  min_scale=st.sampled_from([1.0, 2.0**-126, 1e-30, 4.0]),
)
def test_constructor_scale_is_accepted_iff_a_float32_number_above_the_floor(
  scale, min_scale
):
  """Independent reference: NumPy's float32 rounding and finfo."""
  with np.errstate(over="ignore"):
    stored = np.float32(scale) if np.isfinite(scale) else np.float32(np.nan)
  ok = bool(
    np.isfinite(stored)
    and stored >= np.finfo(np.float32).tiny
    and stored >= np.float32(min_scale)
  )
  if ok:
    s = wa.DynamicLossScale(scale, min_scale=min_scale)
    assert np.asarray(s.scale).tobytes() == stored.tobytes()
    assert s.scale.dtype == jnp.float32
  else:
    with pytest.raises(wa.WeightedAccumulationError, match="scale"):
      wa.DynamicLossScale(scale, min_scale=min_scale)


def test_pickles_and_evaluates_abstractly():
  s = wa.DynamicLossScale(2.0**16, growth_interval=5).adjust(True)
  t = pickle.loads(pickle.dumps(s))
  assert (float(t.scale), int(t.growth_tracker), t.growth_interval) == (
    2.0**16,
    1,
    5,
  )
  shapes = jax.eval_shape(lambda: wa.DynamicLossScale(8.0).adjust(True))
  assert (shapes.scale.dtype, shapes.growth_tracker.dtype) == (
    jnp.float32,
    jnp.int32,
  )


def test_constructor_accepts_numpy_and_jax_scalars():
  s = wa.DynamicLossScale(
    np.float32(1024),
    growth_factor=np.float64(2),
    growth_interval=np.int64(10),
    growth_tracker=jnp.int32(3),
  )
  assert (float(s.scale), int(s.growth_tracker), s.growth_interval) == (
    1024.0,
    3,
    10,
  )
  assert type(s.growth_interval) is int and type(s.growth_factor) is float
  # A factor is used in float32, as the scale's arithmetic does.
  assert wa.DynamicLossScale(4.0, growth_factor=1.1).growth_factor == float(
    np.float32(1.1)
  )


def test_constructor_under_jit_checks_only_shape_and_type():
  make = jax.jit(
    lambda x: wa.DynamicLossScale(x, growth_interval=3).adjust(jnp.bool_(False))
  )
  assert float(make(jnp.float32(8.0)).scale) == 4.0
  with pytest.raises(wa.WeightedAccumulationError, match="scale"):
    jax.jit(lambda x: wa.DynamicLossScale(x))(jnp.ones(2))


@pytest.mark.parametrize(
  "finite", [1, 1.0, np.array([True, False]), jnp.ones(3, bool), None]
)
def test_adjust_refuses_anything_but_a_bool_scalar(finite):
  scaler = wa.DynamicLossScale(2.0**16)
  with pytest.raises(wa.WeightedAccumulationError, match="finite"):
    scaler.adjust(finite)


# The functional pattern: finish, adjust, next window at the new scale ------


def _scaled_grads(scale, value=1.0):
  return jax.tree.map(lambda p: jnp.full_like(p, value) * scale, PARAMS)


def test_set_loss_scale_on_a_fresh_window(variant):
  state = wa.init(PARAMS, loss_scale=8.0)
  out = variant(wa.set_loss_scale)(state, 2.0**10)
  assert float(out.loss_scale) == 2.0**10
  for a, b in zip(
    jax.tree.leaves(out.replace(loss_scale=state.loss_scale)),
    jax.tree.leaves(state),
  ):
    np.testing.assert_array_equal(a, b)
  scaler = wa.DynamicLossScale(32.0)
  assert float(variant(wa.set_loss_scale)(state, scaler).loss_scale) == 32.0


def test_set_loss_scale_after_only_zero_weight_microbatches():
  state = wa.accumulate_sum(wa.init(PARAMS), _scaled_grads(1.0, np.nan), 0)
  out = wa.set_loss_scale(state, 4.0)
  assert float(out.loss_scale) == 4.0 and int(out.issued) == 1


def test_set_loss_scale_refuses_a_window_holding_weight_eagerly():
  state = wa.accumulate_sum(
    wa.init(PARAMS, loss_scale=8.0), _scaled_grads(8.0), 3
  )
  before = jax.tree.map(np.asarray, state)
  with pytest.raises(
    wa.WeightedAccumulationError,
    match="holds total weight 3.0.*constant within a window",
  ):
    wa.set_loss_scale(state, 4.0)
  jax.tree.map(
    np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state)
  )


def test_set_loss_scale_under_jit_makes_a_window_holding_weight_unusable():
  """Keeping the old scale would divide grads scaled by the new factor by
  the old one (reported valid): the window becomes unusable instead, and
  its close is invalid."""
  state = wa.accumulate_sum(
    wa.init(PARAMS, loss_scale=8.0), _scaled_grads(8.0), 3
  )
  out = jax.jit(wa.set_loss_scale)(state, 4.0)
  assert np.isnan(float(out.loss_scale))
  res, _ = jax.jit(wa.finish_mean)(out)
  assert not bool(res.valid)
  # And checkify reports it.
  checked = checkify.checkify(
    jax.jit(lambda s, x: wa.set_loss_scale(s, x, checked=True))
  )
  err, _ = checked(state, jnp.float32(4.0))
  assert "already holds weight" in err.get()
  err, out = checked(wa.init(PARAMS), jnp.float32(4.0))
  assert err.get() is None and float(out.loss_scale) == 4.0


@pytest.mark.parametrize("bad", [0.0, -2.0, np.inf, np.nan])
def test_set_loss_scale_refuses_an_invalid_scale(bad):
  state = wa.init(PARAMS, loss_scale=8.0)
  with pytest.raises(wa.WeightedAccumulationError, match="loss_scale"):
    wa.set_loss_scale(state, bad)
  # Under jit a traced invalid scale marks the window unusable (NaN):
  # keeping 8.0 would divide grads scaled by the caller's factor by 8.
  out = jax.jit(wa.set_loss_scale)(state, jnp.float32(bad))
  assert np.isnan(float(out.loss_scale))
  nxt = jax.jit(wa.accumulate_sum)(out, _scaled_grads(1.0), 2)
  assert int(nxt.rejected) == 1 and nxt.total_weight == 0.0
  err, _ = checkify.checkify(
    jax.jit(lambda s, x: wa.set_loss_scale(s, x, checked=True))
  )(state, jnp.float32(bad))
  assert "not a finite positive normal number" in err.get()


def test_set_loss_scale_refuses_a_non_state():
  with pytest.raises(wa.WeightedAccumulationError, match="AccumState"):
    wa.set_loss_scale(PARAMS, 2.0)


def _window(state, scaler, grads, weight):
  """The documented pattern, one window."""
  state = wa.accumulate_mean(state, grads, weight)
  out, state = wa.finish_mean(state)
  scaler = scaler.adjust(out.finite)
  state = wa.set_loss_scale(state, scaler)
  return out, state, scaler


def test_functional_pattern_window_by_window(variant):
  """Each window is accumulated at the scale the scaler chose after the
  previous one, and unscaled by it."""
  scaler = wa.DynamicLossScale(2.0**4, growth_interval=2)
  state = wa.init(PARAMS, loss_scale=scaler.scale)
  window = variant(_window)
  overflow = [False, True, False, False, False, True, False]
  expected_scales = [16.0, 16.0, 8.0, 8.0, 16.0, 16.0, 8.0]
  for over, want in zip(overflow, expected_scales):
    assert float(state.loss_scale) == want == float(scaler.scale)
    # A mean gradient of 0.25, scaled by the window's scale (or an Inf).
    g = _scaled_grads(state.loss_scale, np.inf if over else 0.25)
    out, state, scaler = window(state, scaler, g, 4.0)
    assert bool(out.finite) == (not over)
    assert float(out.loss_scale) == want
    if not over:
      for x in jax.tree.leaves(out.grads):
        np.testing.assert_array_equal(x, 0.25)
  assert int(state.windows) == len(overflow)


# Checkpointing ----------------------------------------------------------------


def _save(path, tree) -> None:
  with ocp.Checkpointer(AccumCheckpointHandler()) as ckptr:
    ckptr.save(path, args=wa.checkpoint.AccumSave(tree))


def _restore(path, template):
  with ocp.Checkpointer(AccumCheckpointHandler()) as ckptr:
    return ckptr.restore(path, args=wa.checkpoint.AccumRestore(template))


def _run_windows(state, scaler, flags, start):
  for i, f in enumerate(flags):
    g = _scaled_grads(state.loss_scale, (start + i + 1) if f else np.nan)
    _, state, scaler = _window(state, scaler, g, 2.0)
  return state, scaler


@pytest.mark.parametrize("stop", [3, 6])
def test_checkpoint_between_windows_restores_scale_and_tracker(tmp_path, stop):
  config = dict(growth_interval=3, min_scale=2.0)
  flags = [True, True, False, True, True, True, True, False, True, True]
  scaler0 = wa.DynamicLossScale(2.0**8, **config)
  state0 = wa.init(PARAMS, loss_scale=scaler0.scale)
  # Uninterrupted.
  want_state, want = _run_windows(state0, scaler0, flags, 0)
  # Interrupted between windows, restored into fresh templates.
  state, scaler = _run_windows(state0, scaler0, flags[:stop], 0)
  saved = {"accum": state, "scaler": scaler}
  snapshot = jax.tree.map(np.asarray, saved)
  _save(tmp_path / "ckpt", saved)
  template = {
    "accum": wa.init(PARAMS),
    "scaler": wa.DynamicLossScale(2.0**8, **config),
  }
  template_before = jax.tree.map(np.asarray, template)
  got = _restore(tmp_path / "ckpt", template)
  assert type(got["scaler"]) is wa.DynamicLossScale
  for a, b in zip(jax.tree.leaves(snapshot), jax.tree.leaves(got)):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(a, b)
  assert got["scaler"].growth_interval == 3
  jax.tree.map(
    np.testing.assert_array_equal,
    template_before,
    jax.tree.map(np.asarray, template),
  )
  # The resumed run continues the same scale and tracker.
  state, scaler = _run_windows(got["accum"], got["scaler"], flags[stop:], stop)
  assert (float(scaler.scale), int(scaler.growth_tracker)) == (
    float(want.scale),
    int(want.growth_tracker),
  )
  assert float(state.loss_scale) == float(want_state.loss_scale)


def test_checkpoint_of_a_scaler_alone_with_a_manager(tmp_path):
  scaler = wa.DynamicLossScale(2.0**20, growth_interval=5).adjust(True)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(
      1, args=ocp.args.Composite(scaler=wa.checkpoint.AccumSave(scaler))
    )
    mngr.wait_until_finished()
    out = mngr.restore(
      1,
      args=ocp.args.Composite(
        scaler=wa.checkpoint.AccumRestore(
          wa.DynamicLossScale(1.0, growth_interval=5)
        )
      ),
    )
  assert (float(out.scaler.scale), int(out.scaler.growth_tracker)) == (
    2.0**20,
    1,
  )


def _corrupt(scale, tracker, interval=5):
  """A scaler holding given raw values (as a corrupt file would)."""
  good = wa.DynamicLossScale(2.0**10, growth_interval=interval)
  treedef = jax.tree.structure(good)
  return jax.tree.unflatten(treedef, [jnp.float32(scale), jnp.int32(tracker)])


@pytest.mark.parametrize(
  "scale, tracker, needle",
  [
    (np.nan, 0, "scale"),
    (np.inf, 0, "scale"),
    (0.0, 0, "scale"),
    (-4.0, 0, "scale"),
    (0.25, 0, "min_scale"),
    (8.0, -1, "growth_tracker"),
    (8.0, 5, "growth_tracker"),
  ],
)
def test_restore_refuses_a_corrupt_scaler(tmp_path, scale, tracker, needle):
  _save(tmp_path / "ckpt", {"opt": {"scaler": _corrupt(scale, tracker)}})
  template = {
    "opt": {"scaler": wa.DynamicLossScale(2.0**10, growth_interval=5)}
  }
  before = jax.tree.map(np.asarray, template)
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"\['opt'\]\['scaler'\].*" + needle
  ):
    _restore(tmp_path / "ckpt", template)
  jax.tree.map(
    np.testing.assert_array_equal, before, jax.tree.map(np.asarray, template)
  )


def test_restore_refuses_a_scale_saved_in_another_dtype(tmp_path):
  treedef = jax.tree.structure(wa.DynamicLossScale(2.0))
  saved = jax.tree.unflatten(treedef, [jnp.bfloat16(2.0), jnp.int32(0)])
  _save(tmp_path / "ckpt", saved)
  with pytest.raises(wa.WeightedAccumulationError, match="scale"):
    _restore(tmp_path / "ckpt", wa.DynamicLossScale(2.0))


def test_save_refuses_a_traced_scaler():
  def save_inside(s):
    _save(tempfile.mkdtemp() + "/x", s)
    return s

  with pytest.raises(wa.WeightedAccumulationError, match="traced"):
    jax.jit(save_inside)(wa.DynamicLossScale(2.0))


# The optax wrapper (property 2) -----------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_wrapper_skips_backs_off_grows_and_unscales_each_window(jit):
  """weighted_multi_steps(loss_scale=DynamicLossScale): against GradScaler's
  rule for the scales and float64 SGD on the applied windows' weighted means
  (each window's grads were scaled by the scale the wrapper reported for it)."""
  k, lr = 3, 0.1
  sizes = [
    [4, 9, 3],
    [5, 1, 7],
    [2, 2, 8],
    [6, 3, 1],
    [1, 1, 1],
    [7, 2, 5],
    [3, 3, 3],
    [9, 4, 2],
  ]
  overflow = [False, True, False, False, False, True, True, False]
  rng = np.random.default_rng(3)
  mean_grads = rng.normal(size=(len(sizes), k, 4))
  scaler = wa.DynamicLossScale(2.0**10, growth_interval=2, min_scale=2.0**8)
  tx = wa.WeightedMultiSteps(
    optax.sgd(lr), every_k_schedule=k, loss_scale=scaler, mode="mean"
  )
  params = {"w": jnp.zeros(4, jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  ref = np.zeros(4)
  seen_scales = []
  for w, (ns, over) in enumerate(zip(sizes, overflow)):
    scale = float(wa.window_counters(state)["loss_scale"])
    seen_scales.append(scale)
    for j, n in enumerate(ns):
      g = mean_grads[w, j] * scale
      if over and j == 1:
        g = np.full(4, np.inf)
      updates, state = update(
        {"w": jnp.asarray(g, jnp.float32)}, state, params, weight=n
      )
      params = optax.apply_updates(params, updates)
    assert bool(state.nonfinite) == over
    if not over:
      ref -= lr * (mean_grads[w] * np.array(ns)[:, None]).sum(0) / sum(ns)
    np.testing.assert_allclose(params["w"], ref, rtol=1e-5, atol=1e-6)
  rule = reference_run(
    2.0**10,
    [not o for o in overflow],
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2,
    min_scale=2.0**8,
  )
  assert seen_scales[1:] == [s for s, _ in rule][:-1]
  assert (
    float(state.loss_scaler.scale),
    int(state.loss_scaler.growth_tracker),
  ) == rule[-1]
  assert int(state.nonfinite_windows) == sum(overflow)
  assert int(state.gradient_step) == len(sizes) - sum(overflow)


# Float16 training of the demo model (property 3) ------------------------------

MICRO, ROWS, WINDOWS = 4, 16, 24
START_SCALE = 2.0**24
GROWTH_INTERVAL = 8
GAP_TOLERANCE = 5e-3  # per-token loss, float16 run vs float32 reference


def _mean_loss(graphdef, params, mb, dtype):
  """Per-token mean loss of the demo model run in ``dtype`` (logits in
  float32 for the softmax, as usual in mixed precision)."""
  model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))
  logits = model(mb.tokens)[:, :-1].astype(jnp.float32)
  targets = mb.tokens[:, 1:]
  pos = jnp.arange(targets.shape[1])[None, :]
  mask = (pos < mb.lengths[:, None] - 1).astype(jnp.float32)
  losses = -jnp.take_along_axis(
    jax.nn.log_softmax(logits), targets[..., None], axis=-1
  )[..., 0]
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _train(dtype, scale, allow):
  """Float32 master params, forward and backward in ``dtype``, grads
  accumulated in float32 with the functional pattern. ``allow[w]`` False
  skips window ``w`` (for the reference)."""
  model = toy.TinyLM(dim=32, heads=2, max_len=24, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(3e-3)

  @jax.jit
  def window(params, opt_state, state, scaler, batch, allow):
    low = jax.tree.map(lambda p: p.astype(dtype), params)

    def micro(carry, mb):
      state, loss_sum = carry
      scaled = lambda q: _mean_loss(graphdef, q, mb, dtype) * state.loss_scale
      loss, grads = jax.value_and_grad(scaled)(low)  # grads in dtype
      weight = toy.weight(mb)
      state = wa.accumulate_mean(state, grads, weight)
      return (state, loss_sum + loss / state.loss_scale * weight), None

    (state, loss_sum), _ = jax.lax.scan(micro, (state, jnp.float32(0)), batch)
    out, state = wa.finish_mean(state)
    scaler = scaler.adjust(out.finite)
    state = wa.set_loss_scale(state, scaler)
    updates, new_opt_state = tx.update(out.grads, opt_state, params)
    apply = out.valid & allow
    keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(apply, n, o), new, old
    )
    return (
      keep(optax.apply_updates(params, updates), params),
      keep(new_opt_state, opt_state),
      state,
      scaler,
      loss_sum / out.weight,
      out.finite,
      out.loss_scale,
    )

  scaler = wa.DynamicLossScale(scale, growth_interval=GROWTH_INTERVAL)
  state = wa.init(params, dtype=jnp.float32, loss_scale=scaler.scale)
  opt_state = tx.init(params)
  rows = []
  for w in range(WINDOWS):
    b = toy.make_dataset(num_sequences=MICRO * ROWS, max_len=24, seed=100 + w)
    batch = toy.Batch(
      b.tokens.reshape(MICRO, ROWS, -1), b.lengths.reshape(MICRO, ROWS)
    )
    params, opt_state, state, scaler, loss, finite, used = window(
      params, opt_state, state, scaler, batch, jnp.bool_(allow[w])
    )
    rows.append((float(loss), bool(finite), float(used)))
  return rows


@pytest.fixture(scope="module")
def float16_run():
  f16 = _train(jnp.float16, START_SCALE, [True] * WINDOWS)
  ref = _train(jnp.float32, 1.0, [f for _, f, _ in f16])
  return f16, ref


@pytest.mark.slow
def test_float16_backs_off_from_overflow_then_tracks_float32(float16_run):
  f16, ref = float16_run
  losses, finite, scales = map(np.array, zip(*f16))
  first = int(np.argmax(finite))
  # Backs off within a few windows: 2**24 overflows float16's backward.
  assert 1 <= first <= 8, finite
  assert all(scales[w] == START_SCALE / 2**w for w in range(first + 1))
  # The scale of every window is GradScaler's rule applied to the flags.
  rule = reference_run(
    START_SCALE,
    finite.tolist()[:-1],
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=GROWTH_INTERVAL,
    min_scale=1.0,
  )
  assert scales[1:].tolist() == [s for s, _ in rule]
  # After the back-off, only a window right after a growth may overflow.
  for w in range(first + 1, WINDOWS):
    assert finite[w] or scales[w] > scales[w - 1], (w, scales, finite)
  assert finite[first:].sum() >= WINDOWS - first - 3
  # Tracks float32 training that applied the same windows.
  ref_losses = np.array([loss for loss, _, _ in ref])
  assert all(f for _, f, _ in ref)
  gap = np.abs(losses - ref_losses)
  assert gap.max() <= GAP_TOLERANCE, gap
  # And it trained: the loss fell well below its start.
  assert losses[finite][-1] < 0.75 * losses[first]


# docs/mixed_precision.md ------------------------------------------------------


def test_mixed_precision_doc_examples_run(capsys):
  """Every ```python block of the page, in order, in one namespace (they
  assert their own claims)."""
  page = pathlib.Path(__file__).parents[2] / "docs" / "mixed_precision.md"
  blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
  assert len(blocks) >= 6
  namespace: dict = {}
  for i, code in enumerate(blocks):
    where = f"docs/mixed_precision.md block {i}"
    exec(compile(code, where, "exec"), namespace)  # pylint: disable=exec-used
  assert "windows skipped while backing off" in capsys.readouterr().out


def test_wrapper_state_checkpoint_restores_the_scaler(tmp_path):
  """Property 4 with the wrapper: its state saved between windows comes back
  with the same scale and tracker, and the resumed run equals the
  uninterrupted one."""
  tx = wa.WeightedMultiSteps(
    optax.sgd(0.1),
    every_k_schedule=2,
    loss_scale=wa.DynamicLossScale(2.0**6, growth_interval=3),
    mode="mean",
  )
  params = {"w": jnp.zeros(3, jnp.float32)}
  flags = [True, False, True, True, True, True]

  def run(state, windows):
    for w in windows:
      scale = float(wa.window_counters(state)["loss_scale"])
      for j in range(2):
        g = np.full(3, (w + j + 1) * scale if flags[w] or j else np.nan)
        _, state = tx.update(
          {"w": jnp.asarray(g, jnp.float32)}, state, params, weight=1 + j
        )
    return state

  want = run(tx.init(params), range(6))
  mid = run(tx.init(params), range(3))
  _save(tmp_path / "ckpt", mid)
  got = _restore(tmp_path / "ckpt", tx.init(params))
  assert (
    float(got.loss_scaler.scale),
    int(got.loss_scaler.growth_tracker),
  ) == (float(mid.loss_scaler.scale), int(mid.loss_scaler.growth_tracker))
  got = run(got, range(3, 6))
  assert (
    float(got.loss_scaler.scale),
    int(got.loss_scaler.growth_tracker),
  ) == (float(want.loss_scaler.scale), int(want.loss_scaler.growth_tracker))
