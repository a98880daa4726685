"""Differential test of the in-step function and the wrapper against
``docs/semantics.md``, context by context.

Every result of ``wa.microbatched_value_and_grad`` (``f`` and
``f.accumulate``) and of ``wa.WeightedMultiSteps`` is compared with a
float64 NumPy reference that composes the microbatches the semantics page
defines (the global batch's microbatches without ``axis_name``; each
replica's own microbatches with it), and with the same call on one device.
Losses are separable (a sum over rows) and not (centred by the microbatch's
mean; rows weighted by their position in the microbatch), so a context that
runs other microbatches than the documented ones is caught. Values are exact
in every dtype tried (multiples of 1/8), so the reference sees the inputs the
library sees.

Compiled programs are built once per (context, loss, mode, dtype) and reused
across examples: hypothesis varies values, not shapes. CI runs a few examples
per context; ``HYPOTHESIS_PROFILE=long`` runs many (CONTRIBUTING.md).

Contexts the library does not yet honour are listed in ``KNOWN_BROKEN`` and
left out of the properties; each has an explicit regression test below,
marked ``xfail(strict=True)``, that asserts the documented result.
"""

from __future__ import annotations

import contextlib
import functools
import os

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa

R, B, K, D = 2, 8, 2, 3  # replicas, rows, microbatches, features
ROWS = B // R  # rows per replica
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
#: Examples per context and entry point (an eager example compiles, a
#: jitted one reuses its program).
EXAMPLES = 60 if LONG else 3
EAGER_EXAMPLES = 30 if LONG else 1
DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
}
#: Relative error allowed against the float64 reference / the one-device
#: call (of the largest reference entry), by the dtype the grads are handed on.
TOL = {
  "float32": (1e-4, 1e-5),
  "bfloat16": (5e-2, 2e-2),
  "float16": (5e-3, 3e-3),
}

#: (entry point, context) pairs that do not compute the documented result on
#: today's main; each has an xfail(strict=True) regression test below. Empty
#: this set as the fixes land.
KNOWN_BROKEN: set[tuple[str, str]] = {}

#: A value ``loss_fn`` closes over: eager calls must see its current value.
#: It is 0 whenever a program is traced under ``jax.jit``. ``how`` it is
#: read: a Python float, a ``jax.pure_callback`` of a function built for the
#: call, or an array committed to one device outside the meshes.
CLOSURE = {"shift": 0.0, "how": "python"}
HOW = ("python", "callback", "committed")


@contextlib.contextmanager
def closed_over(shift, how="python"):
  """``loss_fn`` reads ``shift`` (as ``how`` says) in the block, 0 after."""
  CLOSURE.update(shift=shift, how=how)
  CLOSURE["read"] = lambda: np.float32(shift)  # a callback of this call
  CLOSURE["committed"] = jax.device_put(jnp.float32(shift), jax.devices()[-1])
  try:
    yield
  finally:
    CLOSURE.update(shift=0.0, how="python")


@pytest.fixture(autouse=True)
def _no_shift_left():
  CLOSURE.update(shift=0.0, how="python")


def closed_shift():
  """The closed-over shift, read as ``CLOSURE["how"]`` says."""
  if CLOSURE["how"] == "callback":
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    return jax.pure_callback(CLOSURE["read"], f32)
  return CLOSURE["committed" if CLOSURE["how"] == "committed" else "shift"]


# --------------------------------------------------------------- losses --


def loss_fn_of(kind: str, mode: str, shift_argument: bool = False):
  """``loss_fn(params, batch) -> (loss, weight)`` of one microbatch; the
  shift read from ``CLOSURE``, or given as a third argument (the one-device
  calls, compiled once)."""

  def loss_fn(p, b, *shift):
    x = b["x"]
    shift = jnp.asarray(shift[0] if shift_argument else closed_shift(), x.dtype)
    r = x @ p["w"] + p["b"] - b["y"] - shift
    if kind == "centred":  # not separable: the microbatch's own mean
      r = r - jnp.mean(r)
    c = b["m"] * b["c"]
    if kind == "positional":  # not separable: the row's place in it
      c = c * (1 + jnp.arange(r.shape[0], dtype=r.dtype))
    s = jnp.sum(c * r * r)
    scale = jnp.mean(b["s"].astype(jnp.float32))  # one value per batch
    n = jnp.sum((b["m"] * b["c"]).astype(jnp.float32)) * scale
    return (s / n if mode == "mean" else s), n

  return loss_fn


def ref_sums(kind, p, b, blocks, shift):
  """float64 ``(grad sums, loss sum, weight, size)`` over ``blocks`` (row
  lists), each block one microbatch; zero-weight blocks add nothing.
  ``size``: the largest sum of the gradient terms' magnitudes (the scale
  of the rounding in a low-precision dtype)."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  gw, gb, loss, weight, size = np.zeros(D), 0.0, 0.0, 0.0, np.zeros(D + 1)
  for rows in blocks:
    x, y, m, c, s = (np.asarray(b[k], np.float64)[rows] for k in "xymcs")
    r = x @ p["w"] + p["b"] - y - shift
    if kind == "centred":
      r = r - r.mean()
    cw = m * c * (1 + np.arange(len(rows)) if kind == "positional" else 1)
    n = float((m * c).sum() * s[0])
    if n == 0:
      continue
    u = 2 * cw * r
    if kind == "centred":
      u = u - u.mean()
    gw, gb = gw + x.T @ u, gb + u.sum()
    loss, weight = loss + float((cw * r * r).sum()), weight + n
    size = size + np.append(np.abs(x).T @ np.abs(u), np.abs(u).sum())
  return {"b": gb, "w": gw}, loss, weight, float(size.max())


def blocks_of(per_replica: bool, rows: int = B) -> list[list[int]]:
  """The documented microbatches: strided over the global batch, or over
  each replica's contiguous rows."""
  if not per_replica:
    return [list(range(k, rows, K)) for k in range(K)]
  size = rows // R
  return [
    [r * size + j for j in range(k, size, K)]
    for r in range(R)
    for k in range(K)
  ]


def mean_of(sums):
  """``(mean grads, mean loss, weight, size of the mean's terms)``."""
  g, loss, weight, size = sums
  if weight == 0:
    return None, None, 0.0, 0.0
  mean = {k: v / weight for k, v in g.items()}
  return mean, loss / weight, weight, size / weight


def add(a, b):
  g = {k: a[0][k] + b[0][k] for k in a[0]}
  return g, a[1] + b[1], a[2] + b[2], a[3] + b[3]


# ---------------------------------------------------------------- values --


def _eighths(rng, lo, hi, size=None):
  return rng.integers(lo, hi + 1, size=size) / 8


#: Random values come from a seed (every example is a full random draw; the
#: simplest is not all zeros); the edge cases are drawn by hypothesis.
seeds = st.integers(0, 2**32 - 1).map(np.random.default_rng)


@st.composite
def batches(draw, n=B):
  """One host batch: exact values, masks with a blank microbatch, replica or
  batch now and then, and a weight scale that can push float16 over."""
  rng = draw(seeds)
  m = (rng.random(n) < 0.7).astype(np.float64)
  blank = draw(st.sampled_from(["none", "microbatch", "replica", "all"]))
  if blank == "microbatch":
    m[draw(st.integers(0, K - 1)) :: K] = 0
  elif blank == "replica":
    m[: n // R] = 0
  elif blank == "all":
    m[:] = 0
  s = draw(st.sampled_from([1.0, 2.0**-16]))
  return {
    "x": _eighths(rng, -16, 16, (n, D)),
    "y": _eighths(rng, -16, 16, n),
    "m": m,
    "c": _eighths(rng, 1, 16, n),
    "s": np.full(n, s),
  }


@st.composite
def param_sets(draw):
  rng = draw(seeds)
  return {"b": np.float64(_eighths(rng, -8, 8)), "w": _eighths(rng, -8, 8, D)}


@st.composite
def shift_values(draw, n):
  """``n`` closed-over shifts, each different from the one before."""
  rng = draw(seeds)
  steps = _eighths(rng, 1, 8, n) * rng.choice([-1, 1], n)
  return tuple(np.cumsum(steps).tolist())


def cast(tree, dtype):
  return jax.tree.map(lambda v: jnp.asarray(v, dtype), tree)


def host(tree):
  return jax.tree.map(lambda v: np.asarray(v, np.float64), tree)


# ------------------------------------------------------------- meshes --


@functools.cache
def mesh_of(kind: str) -> jax.sharding.Mesh:
  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  return jax.make_mesh(
    (R,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:R]
  )


def sharded(tree, mesh):
  return jax.device_put(tree, NamedSharding(mesh, P("data")))


def replicated(tree, mesh):
  return jax.device_put(tree, NamedSharding(mesh, P()))


# ------------------------------------------------------------ checking --


def check(got, ref_mean, dtype, what, tol_index=0, handed=None, edge=False):
  """``got``, ``(grads, weight, valid)``, honours the documented result
  ``ref_mean`` (``mean_of``'s triple): computed in ``dtype``, handed on in
  ``handed`` (default ``dtype``). ``edge``: a microbatch's own values may
  overflow ``dtype`` (then invalid is allowed)."""
  grads, weight, valid = got
  ref, _, n, size = ref_mean
  finfo = jnp.finfo(DTYPES[handed or dtype])
  leaves = [np.asarray(v, np.float64) for v in jax.tree.leaves(grads)]
  if bool(valid):
    assert all(np.isfinite(v).all() for v in leaves), (
      f"{what}: valid, not finite"
    )
  if n == 0:
    assert not bool(valid), f"{what}: zero total weight reported valid"
    return
  np.testing.assert_allclose(float(weight), n, rtol=1e-6, err_msg=what)
  top = max(np.max(np.abs(v)) for v in jax.tree.leaves(ref))
  if top > 2 * float(finfo.max):
    assert not bool(valid), f"{what}: a mean past {dtype} reported valid"
    return
  if top > float(finfo.max) / 2 or (edge and not bool(valid)):
    return  # at the edge: either answer is documented
  assert bool(valid), f"{what}: a representable mean reported invalid"
  diff = max(
    np.max(np.abs(np.asarray(grads[k], np.float64) - ref[k])) for k in ref
  )
  err = diff / max(top, size, 1e-30)
  assert err <= TOL[dtype][tol_index], f"{what}: error {err:.3g} of {top:.3g}"


def triple(out):
  return out.grads, out.weight, out.valid


# ------------------------------------------------- in-step: the contexts --
#
# Each context builds, once per (loss, mode, dtype), a function
# ``call(params, batch) -> AccumulatedGradients`` (and for accumulate
# ``call(params, batch1, batch2) -> AccumulatedGradients`` of one window over
# two calls), and says whether its microbatches are per replica.

IN_STEP = {
  "eager": False,
  "eager_axis_auto": True,
  "eager_explicit": False,
  "jit": False,
  "jit_explicit": False,
  "shard_map": True,
  "jit_axis_auto": True,
  "jit_axis_explicit": True,
  "vmap": False,
}
EAGER = {"eager", "eager_axis_auto", "eager_explicit"}


def _vg(kind, mode, axis=False, k=K):
  return wa.microbatched_value_and_grad(
    loss_fn_of(kind, mode),
    k,
    mode=mode,
    grads_dtype="params",
    axis_name="data" if axis else None,
  )


def _placement(context: str):
  """``(mesh or None, put_params, put_batch)`` for a context."""
  if context in ("eager", "jit", "vmap"):
    return None, lambda t: t, lambda t: t
  mesh = mesh_of("explicit" if "explicit" in context else "auto")
  return mesh, lambda t: replicated(t, mesh), lambda t: sharded(t, mesh)


def _in_mesh(mesh, fn):
  """``fn`` called under ``jax.set_mesh(mesh)`` (when there is a mesh)."""

  def run(*args):
    if mesh is None:
      return fn(*args)
    with jax.set_mesh(mesh):
      return fn(*args)

  return run


@functools.cache
def value_and_grad_call(context, kind, mode, dtype):
  """``call(params, batch) -> (loss, out)`` of ``f`` in ``context``."""
  per_replica = IN_STEP[context]
  mesh, put_p, put_b = _placement(context)
  f = _vg(kind, mode, axis=per_replica)
  if context == "shard_map":
    f = jax.jit(
      jax.shard_map(
        f, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())
      )
    )
  elif context == "vmap":
    f = jax.jit(jax.vmap(f, in_axes=(0, None)))
  elif context not in EAGER:
    f = jax.jit(f)
  fn = _in_mesh(mesh, f)
  return lambda p, b: fn(
    put_p(cast(p, DTYPES[dtype])), put_b(cast(b, DTYPES[dtype]))
  )


@functools.cache
def one_device_call(kind, mode, dtype, per_replica):
  """The same call on one device: ``f`` over the documented microbatches
  (each replica's, when per replica: R*K microbatches of a batch whose
  strided rows are those blocks)."""
  k = R * K if per_replica else K
  f = jax.jit(
    wa.microbatched_value_and_grad(
      loss_fn_of(kind, mode, True), k, mode=mode, grads_dtype="params"
    )
  )
  blocks = blocks_of(per_replica)  # microbatch i takes rows i::k
  order = np.array([blocks[i][j] for j in range(B // k) for i in range(k)])
  dt = DTYPES[dtype]
  return lambda p, b: f(
    cast(p, dt),
    cast({n: v[order] for n, v in b.items()}, dt),
    jnp.float32(CLOSURE["shift"]),
  )


@functools.cache
def accumulate_call(context, kind, mode, dtype):
  """``call(params, b1, b2) -> out``: one window over two ``f.accumulate``
  calls, closed by ``wa.finish_mean``."""
  per_replica = IN_STEP[context]
  mesh, put_p, put_b = _placement(context)
  f = _vg(kind, mode, axis=per_replica)
  dt = DTYPES[dtype]

  def window(p, b1, b2):
    w = wa.init(p, axis_name="data") if context == "shard_map" else wa.init(p)
    w = f.accumulate(w, p, b1)[1]
    w = f.accumulate(w, p, b2)[1]
    return wa.finish_mean(w)[0]

  if context == "shard_map":
    run = jax.jit(
      jax.shard_map(
        window, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
      )
    )
  elif context == "vmap":
    run = jax.jit(jax.vmap(window, in_axes=(0, None, None)))
  else:  # per replica: a stacked window across jitted calls
    acc, close = jax.jit(f.accumulate), jax.jit(lambda w: wa.finish_mean(w)[0])

    def run(p, b1, b2):
      w = wa.init(p, axis_name="data") if per_replica else wa.init(p)
      return close(acc(acc(w, p, b1)[1], p, b2)[1])

  fn = _in_mesh(mesh, run)
  return lambda p, b1, b2: fn(
    put_p(cast(p, dt)), put_b(cast(b1, dt)), put_b(cast(b2, dt))
  )


def _member(tree, i):
  return jax.tree.map(lambda v: v[i], tree)


def _stacked(params_list):
  return jax.tree.map(lambda *v: np.stack(v), *params_list)


def run_value_and_grad(
  context, kind, mode, dtype, params, params2, batch, shifts, how="python"
):
  """Runs ``f`` in ``context`` and checks every result. Eager contexts are
  called twice, the closed-over shift (read as ``how`` says) changed
  between the calls."""
  per_replica = IN_STEP[context]
  blocks = blocks_of(per_replica)
  one = one_device_call(kind, mode, dtype, per_replica)
  call = value_and_grad_call(context, kind, mode, dtype)
  exact = lambda p, b: host(cast(p, DTYPES[dtype]))
  what = f"f in {context} ({kind}, mode={mode}, {dtype}, {how} closure)"
  edge = dtype == "float16" and batch["s"][0] < 1
  for shift in shifts if context in EAGER else (0.0,):
    with closed_over(shift, how):
      ref = mean_of(ref_sums(kind, exact(params, batch), batch, blocks, shift))
      if context == "vmap":
        loss, out = call(_stacked([params, params2]), batch)
        ref2 = mean_of(
          ref_sums(kind, exact(params2, batch), batch, blocks, shift)
        )
        check(
          (_member(out.grads, 1), out.weight[1], out.valid[1]),
          ref2,
          dtype,
          what,
          edge=edge,
        )
        out = jax.tree.map(lambda v: v[0], out)
      elif context in EAGER and ref[2] == 0:
        with pytest.raises(wa.WeightedAccumulationError):
          call(params, batch)
        continue
      else:
        loss, out = call(params, batch)
      check(triple(out), ref, dtype, what, edge=edge)
      if ref[2] and bool(out.valid) and context != "vmap":
        np.testing.assert_allclose(
          float(loss), ref[1], rtol=TOL[dtype][0] * 4, atol=1e-3, err_msg=what
        )
      _, base = one(params, batch)
      assert bool(out.valid) == bool(base.valid), (
        f"{what}: valid differs from one device"
      )
      if bool(base.valid):
        base = (host(base.grads), None, float(base.weight), ref[3])
        check(triple(out), base, dtype, what + " vs one device", 1, edge=edge)


def run_accumulate(
  context, kind, mode, params, b1, b2, shifts, dtype="float32", how="python"
):
  """One window over ``f.accumulate`` calls in ``context``: two, or eagerly
  three (``b1``, ``b2``, ``b1``), the closed-over shift changed before each
  eager call (read as a Python float, then twice as ``how`` says)."""
  blocks = blocks_of(IN_STEP[context])
  p = host(cast(params, DTYPES[dtype]))
  what = f"f.accumulate in {context} ({kind}, {mode}, {dtype}, {how} closure)"
  eager = context in EAGER
  calls = list(zip((b1, b2, b1), shifts)) if eager else [(b1, 0.0), (b2, 0.0)]
  sums = [ref_sums(kind, p, b, blocks, shift) for b, shift in calls]
  ref = mean_of(functools.reduce(add, sums))
  if eager:
    out = _eager_window(context, kind, mode, dtype, params, calls, how)
    if out is None:  # an empty window's eager close raised, as documented
      assert ref[2] == 0, f"{what}: refused a window of weight {ref[2]}"
      return
  elif context == "vmap":
    call = accumulate_call(context, kind, mode, dtype)
    out = jax.tree.map(lambda v: v[0], call(_stacked([params, params]), b1, b2))
  else:
    out = accumulate_call(context, kind, mode, dtype)(params, b1, b2)
  edge = dtype == "float16" and min(b1["s"][0], b2["s"][0]) < 1
  check(triple(out), ref, dtype, what, handed="float32", edge=edge)


def _eager_window(context, kind, mode, dtype, params, calls, how):
  """An eager window over ``f.accumulate`` calls ``[(batch, shift)]``,
  ``CLOSURE`` set to each call's shift before it (the first read as a
  Python float, the others as ``how`` says)."""
  per_replica = IN_STEP[context]
  mesh, put_p, put_b = _placement(context)
  f = _vg(kind, mode, axis=per_replica)
  dt = DTYPES[dtype]
  p = put_p(cast(params, dt))
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    w = wa.init(p, axis_name="data") if per_replica else wa.init(p)
    for i, (b, shift) in enumerate(calls):
      with closed_over(shift, how if i else "python"):
        w = f.accumulate(w, p, put_b(cast(b, dt)))[1]
    if float(jnp.sum(w.total_weight)) == 0:
      with pytest.raises(wa.WeightedAccumulationError):
        wa.finish_mean(w)
      return None
    return wa.finish_mean(w)[0]


#: CI's one structure per context (one compile per context and entry
#: point; hypothesis varies the values): every loss kind, mode and dtype
#: appears. ``HYPOTHESIS_PROFILE=long`` draws the structure too.
CI_STRUCTURE = {
  "eager": ("positional", "sum", "float32"),
  "eager_axis_auto": ("rows", "mean", "bfloat16"),
  "eager_explicit": ("centred", "sum", "float32"),
  "jit": ("centred", "mean", "float16"),
  "jit_explicit": ("positional", "sum", "bfloat16"),
  "shard_map": ("centred", "sum", "bfloat16"),
  "jit_axis_auto": ("positional", "mean", "float32"),
  "jit_axis_explicit": ("rows", "sum", "float16"),
  "vmap": ("centred", "sum", "float16"),
}


#: CI's closure per eager context and entry point (``f``, ``accumulate``):
#: each way of reading it, with and without ``axis_name``. Eager JAX itself
#: refuses an array committed to a device outside the mesh next to the
#: mesh's arrays, so ``eager_explicit`` (no ``axis_name``) reads no such one.
CI_HOW = {
  "eager": ("committed", "callback"),
  "eager_axis_auto": ("callback", "committed"),
  "eager_explicit": ("callback", "callback"),
}


def hows(context, entry):
  """How ``loss_fn`` reads its closure: a Python float under jit (traced
  once), CI's per eager context, any way with ``HYPOTHESIS_PROFILE=long``."""
  if context not in EAGER:
    return st.just("python")
  if LONG:
    return st.sampled_from(HOW[: 2 if context == "eager_explicit" else 3])
  return st.just(CI_HOW[context][entry == "acc"])


@st.composite
def structures(draw, context):
  if not LONG:
    return CI_STRUCTURE[context]
  return (
    draw(st.sampled_from(["rows", "centred", "positional"])),
    draw(st.sampled_from(["sum", "mean"])),
    draw(st.sampled_from(sorted(DTYPES))),
  )


def _scales(dtype):
  """Weight scales: 2**-16 pushes a float16 mean past its range."""
  if dtype == "float16" and ("f", "float16 mean past range") in KNOWN_BROKEN:
    return st.just(1.0)
  return st.sampled_from([1.0, 2.0**-16])


def _live(contexts, entry):
  return sorted(c for c in contexts if (entry, c) not in KNOWN_BROKEN)


def _value_and_grad_property(context, data):
  """``f`` in every context: the documented microbatches' mean gradient
  (float64), the weight, validity in the handed-on dtype, and the same call
  on one device."""
  kind, mode, dtype = data.draw(structures(context))
  batch = data.draw(batches())
  batch["s"][:] = data.draw(_scales(dtype))
  params, params2 = data.draw(param_sets()), data.draw(param_sets())
  shifts, how = data.draw(shift_values(2)), data.draw(hows(context, "f"))
  run_value_and_grad(
    context, kind, mode, dtype, params, params2, batch, shifts, how
  )


@pytest.mark.parametrize("context", _live(set(IN_STEP) - EAGER, "f"))
@hypothesis.settings(max_examples=EXAMPLES, deadline=None)
@hypothesis.given(data=st.data())
def test_value_and_grad_matches_semantics(context, data):
  """``f`` compiled once per context: see ``_value_and_grad_property``."""
  _value_and_grad_property(context, data)


@pytest.mark.parametrize("context", _live(EAGER, "f"))
@hypothesis.settings(max_examples=EAGER_EXAMPLES, deadline=None)
@hypothesis.given(data=st.data())
def test_eager_value_and_grad_matches_semantics(context, data):
  """``f`` called eagerly, twice, the closure changed between the calls."""
  _value_and_grad_property(context, data)


def _accumulate_property(context, data):
  """One window over ``f.accumulate`` calls, closed by ``finish_mean``: the
  mean over all the calls' documented microbatches (float32 buffers)."""
  kind, mode, dtype = data.draw(structures(context))
  b1, b2 = data.draw(batches()), data.draw(batches())
  params = data.draw(param_sets())
  shifts, how = data.draw(shift_values(3)), data.draw(hows(context, "acc"))
  run_accumulate(context, kind, mode, params, b1, b2, shifts, dtype, how)


@pytest.mark.parametrize("context", _live(set(IN_STEP) - EAGER, "f.accumulate"))
@hypothesis.settings(max_examples=EXAMPLES, deadline=None)
@hypothesis.given(data=st.data())
def test_accumulate_window_matches_semantics(context, data):
  """``f.accumulate`` compiled once per context: ``_accumulate_property``."""
  _accumulate_property(context, data)


@pytest.mark.parametrize("context", _live(EAGER, "f.accumulate"))
@hypothesis.settings(max_examples=EAGER_EXAMPLES, deadline=None)
@hypothesis.given(data=st.data())
def test_eager_accumulate_window_matches_semantics(context, data):
  """Eager ``f.accumulate`` calls, the closure changed before each."""
  _accumulate_property(context, data)


# ---------------------------------------------------------- the wrapper --

WRAPPER = ("eager", "jit", "shard_map", "vmap")
EVERY_K, STEPS = 2, 4  # two windows


@functools.cache
def wrapper_step(context, mode, dtype):
  """``step(state, grads, weight, params) -> (updates, state)`` of
  ``WeightedMultiSteps(optax.sgd(1.0))`` in ``context`` (updates: minus the
  window's mean at a close), and its ``init``."""
  axis = "data" if context == "shard_map" else None
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0),
    EVERY_K,
    mode=mode,
    accumulator_dtype=jnp.float32,
    axis_name=axis,
  )
  step = lambda s, g, w, p: tx.update(g, s, p, weight=w)
  if context == "eager":
    return step, tx.init
  if context == "jit":
    return jax.jit(step), tx.init
  if context == "vmap":
    return jax.jit(jax.vmap(step)), jax.vmap(tx.init)
  mesh = mesh_of("auto")
  per = lambda g, w: (jax.tree.map(lambda v: v[0], g), w[0])
  body = lambda s, g, w, p: step(s, *per(g, w), p)
  return (
    jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data"), P()),
        out_specs=(P(), P()),
      )
    ),
    tx.init,
  )


def wrapper_reference(mode, grads, weights):
  """float64 expected updates at each step (``None`` mid-window or where
  nothing may be applied) and whether each close applies."""
  out, sums, total = [], np.zeros(D), 0.0
  for i in range(STEPS):
    for g, w in zip(grads[i], weights[i]):
      if w != 0:
        sums, total = sums + (g * w if mode == "mean" else g), total + w
    if (i + 1) % EVERY_K:
      out.append(None)
    elif total == 0:
      out.append(None)  # an empty window stays open
    else:
      out.append(-sums / total)
      sums, total = np.zeros(D), 0.0
  return out


def run_wrapper(context, mode, dtype, grads, weights):
  """Two windows of ``STEPS`` microbatches; each close's updates against the
  float64 mean of its window; nothing non-finite is ever handed on."""
  dt = DTYPES[dtype]
  step, init = wrapper_step(context, mode, dtype)
  replicas = R if context == "shard_map" else 1
  g = [[grads[i][r] for r in range(replicas)] for i in range(STEPS)]
  w = [[weights[i][r] for r in range(replicas)] for i in range(STEPS)]
  expected = wrapper_reference(mode, g, w)
  params = jnp.zeros(D, dt)
  members = 2 if context == "vmap" else 1
  if context == "vmap":
    params = jnp.zeros((members, D), dt)
  state = init(params)
  finfo = jnp.finfo(dt)
  what = f"WeightedMultiSteps in {context} (mode={mode}, {dtype})"
  for i in range(STEPS):
    gi = jnp.asarray(np.stack(g[i]) if replicas > 1 else g[i][0], dt)
    wi = jnp.asarray(np.array(w[i]) if replicas > 1 else w[i][0], jnp.float32)
    if context == "vmap":
      gi, wi = jnp.stack([gi, gi]), jnp.stack([wi, wi])
    if context == "shard_map":
      mesh = mesh_of("auto")
      gi, wi = sharded(gi, mesh), sharded(wi, mesh)
    updates, state = step(state, gi, wi, params)
    upd = np.asarray(updates, np.float64).reshape(members, D)[0]
    assert np.isfinite(upd).all(), f"{what}: step {i} hands on {upd}"
    want = expected[i]
    if want is None:
      assert not upd.any(), f"{what}: step {i} applied {upd} mid-window"
      continue
    top = np.max(np.abs(want))
    if top > 2 * float(finfo.max):
      assert not upd.any(), f"{what}: step {i}: a mean past {dtype} applied"
      continue
    if top > float(finfo.max) / 2:
      continue
    err = np.max(np.abs(upd - want)) / max(top, 1e-30)
    assert err <= TOL[dtype][0], f"{what}: step {i} error {err:.3g}"


@st.composite
def wrapper_values(draw, mode, dtype):
  """Per (microbatch, replica) grads and weights: zero weights (NaN grads
  with mode="mean": a fully masked mean) and a scale past float16."""
  scale = draw(_wrapper_scales(dtype))
  empty = draw(st.sampled_from([None, 0, 1]))  # a window of weight 0
  rng = draw(seeds)
  grads, weights = [], []
  for i in range(STEPS):
    gs, ws = [], []
    for _ in range(R):
      w = rng.choice([0.0, 0.5, 1.0, 3.0], p=[0.25, 0.25, 0.25, 0.25])
      w = 0.0 if empty == i // EVERY_K else w * scale
      g = _eighths(rng, -16, 16, D)
      gs.append(np.full(D, np.nan) if (w == 0 and mode == "mean") else g)
      ws.append(w)
    grads.append(gs)
    weights.append(ws)
  return grads, weights


def _wrapper_scales(dtype):
  if (
    dtype == "float16"
    and ("wrapper", "float16 mean past range") in KNOWN_BROKEN
  ):
    return st.just(1.0)
  return st.sampled_from([1.0, 2.0**-16])


WRAPPER_CI = {
  "eager": ("sum", "bfloat16"),
  "jit": ("mean", "float16"),
  "shard_map": ("mean", "float32"),
  "vmap": ("sum", "float16"),
}


def _wrapper_property(context, data):
  """``WeightedMultiSteps(optax.sgd(1.0))`` over two windows: each close
  hands on minus its window's weighted mean (float64), an empty window stays
  open, and nothing non-finite reaches the inner optimizer."""
  if LONG:
    mode = data.draw(st.sampled_from(["sum", "mean"]))
    dtype = data.draw(st.sampled_from(sorted(DTYPES)))
  else:
    mode, dtype = WRAPPER_CI[context]
  grads, weights = data.draw(wrapper_values(mode, dtype))
  run_wrapper(context, mode, dtype, grads, weights)


@pytest.mark.parametrize("context", _live(set(WRAPPER) - EAGER, "wrapper"))
@hypothesis.settings(max_examples=EXAMPLES, deadline=None)
@hypothesis.given(data=st.data())
def test_wrapper_windows_match_semantics(context, data):
  """The wrapper compiled once per context: ``_wrapper_property``."""
  _wrapper_property(context, data)


@pytest.mark.parametrize("context", _live(EAGER & set(WRAPPER), "wrapper"))
@hypothesis.settings(max_examples=EAGER_EXAMPLES, deadline=None)
@hypothesis.given(data=st.data())
def test_eager_wrapper_windows_match_semantics(context, data):
  """The wrapper's eager updates: ``_wrapper_property``."""
  _wrapper_property(context, data)


# ------------------------------------------- regressions (KNOWN_BROKEN) --
#
# One explicit case per defect the properties found; each asserts the
# documented result. Remove the xfail marker (and the KNOWN_BROKEN entry)
# when the fix lands.


def _shift_loss(w, b):
  r = b * w - CLOSURE["shift"]
  return jnp.sum(r * r), jnp.float32(b.shape[0])


def _shift_ref(shift):
  x = np.arange(8.0)
  return float(np.mean(2 * (x - shift) * x))


@pytest.mark.parametrize("mesh_kind", ["auto_axis_name", "explicit"])
def test_eager_call_sees_the_changed_closure(mesh_kind):
  mesh = mesh_of("explicit" if mesh_kind == "explicit" else "auto")
  axis = "data" if mesh_kind == "auto_axis_name" else None
  f = wa.microbatched_value_and_grad(_shift_loss, K, mode="sum", axis_name=axis)
  x = sharded(jnp.arange(8.0), mesh)
  got = []
  with jax.set_mesh(mesh):
    for shift in (0.0, 1.0):
      with closed_over(shift):
        got.append(float(f(jnp.float32(1.0), x)[1].grads))
  assert got == [_shift_ref(0.0), _shift_ref(1.0)]  # today: [35.0, 35.0]


def test_eager_accumulate_sees_the_changed_closure():
  mesh = mesh_of("auto")
  f = wa.microbatched_value_and_grad(
    _shift_loss, K, mode="sum", axis_name="data"
  )
  x, p = sharded(jnp.arange(8.0), mesh), jnp.float32(1.0)
  with jax.set_mesh(mesh):
    w = wa.init(p, axis_name="data")
    for shift in (0.0, 1.0, 2.0):  # the third call's window: the second's kind
      with closed_over(shift):
        w = f.accumulate(w, p, x)[1]
    got = float(wa.finish_mean(w)[0].grads)
  want = np.mean([_shift_ref(s) for s in (0.0, 1.0, 2.0)])
  assert got == pytest.approx(want)


def test_without_axis_name_microbatches_are_the_global_batchs():
  mesh = mesh_of("explicit")
  rng = np.random.default_rng(0)
  b = {
    "x": rng.integers(-8, 9, (B, D)) / 4,
    "y": rng.integers(-8, 9, B) / 4,
    "m": np.ones(B),
    "c": np.ones(B),
    "s": np.ones(B),
  }
  p = {"b": np.float64(0.25), "w": np.array([0.5, -0.25, 1.0])}
  f = jax.jit(
    wa.microbatched_value_and_grad(loss_fn_of("centred", "sum"), K, mode="sum")
  )
  with jax.set_mesh(mesh):
    _, out = f(
      replicated(cast(p, jnp.float32), mesh),
      sharded(cast(b, jnp.float32), mesh),
    )
  ref = mean_of(ref_sums("centred", p, b, blocks_of(False), 0.0))
  np.testing.assert_allclose(host(out.grads)["w"], ref[0]["w"], rtol=1e-5)


def _tiny_weight_loss(w, b):  # mean = sum(b) / (n * 2**-18) = 131072
  return jnp.sum(b * w), jnp.float32(2.0**-18) * b.shape[0]


@pytest.mark.parametrize("grads_dtype", ["params", "float16"])
def test_mean_past_float16_is_invalid_and_not_applied(grads_dtype):
  pd = jnp.float16 if grads_dtype == "params" else jnp.float32
  gd = "params" if grads_dtype == "params" else jnp.float16
  f = jax.jit(
    wa.microbatched_value_and_grad(
      _tiny_weight_loss, K, mode="sum", grads_dtype=gd
    )
  )
  p = jnp.asarray(1.0, pd)
  _, out = f(p, jnp.full((4,), 0.5, pd))
  tx = optax.sgd(1.0)
  new, *_ = wa.apply_window(tx, out, p, tx.init(p))
  assert not bool(out.valid) and float(new) == 1.0


def test_wrapper_mean_past_float16_is_not_applied():
  tx = wa.WeightedMultiSteps(
    optax.sgd(1.0), 2, mode="sum", accumulator_dtype=jnp.float32
  )
  p = jnp.zeros(D, jnp.float16)
  state = tx.init(p)
  for _ in range(2):
    updates, state = tx.update(
      jnp.full(D, 2.0, jnp.float16), state, p, weight=2.0**-16
    )
  assert np.isfinite(np.asarray(updates, np.float64)).all()
  assert not np.asarray(updates).any()


def test_eager_zero_weight_call_raises_with_axis_name():
  mesh = mesh_of("auto")
  f = wa.microbatched_value_and_grad(
    lambda w, b: (jnp.sum(b * w), jnp.float32(0.0)),
    K,
    mode="sum",
    axis_name="data",
  )
  with pytest.raises(wa.WeightedAccumulationError):
    f(jnp.float32(1.0), sharded(jnp.arange(8.0), mesh))


def _draws(context):
  """The random draw of each (replica, microbatch): the aux of a loss that
  draws from its key, ``[K, R]``."""
  mesh = mesh_of("auto")

  def loss(w, b, key):
    u = jax.random.uniform(key)
    return (jnp.sum(b * w), jnp.float32(b.shape[0])), u

  f = wa.microbatched_value_and_grad(
    loss, K, mode="sum", has_aux=True, key_argnums=2, axis_name="data"
  )
  x, key = sharded(jnp.arange(8.0), mesh), jax.random.key(0)
  if context == "jit_axis_auto":
    (_, aux), _ = jax.jit(f)(jnp.float32(1.0), x, key)
    return np.asarray(aux)
  run = jax.jit(
    jax.shard_map(
      lambda w, b, k: f(w, b, k)[0][1][:, None],
      mesh=mesh,
      in_specs=(P(), P("data"), P()),
      out_specs=P(None, "data"),
    )
  )
  return np.asarray(run(jnp.float32(1.0), x, key))


def test_each_replica_and_microbatch_draws_its_own_key_under_jit():
  assert len(set(_draws("jit_axis_auto").ravel().tolist())) == K * R


def test_each_replica_and_microbatch_draws_its_own_key_in_shard_map():
  assert len(set(_draws("shard_map").ravel().tolist())) == K * R


def test_apply_window_reads_a_sums_result_as_sums():
  p = {"w": jnp.zeros(2)}
  w = wa.accumulate_sum(
    wa.init(p, loss_scale=4.0), {"w": jnp.array([8.0, 16.0])}, 2.0
  )
  sums, _ = wa.finish_sums(w)
  tx = optax.sgd(1.0)
  try:
    new, *_ = wa.apply_window(tx, sums, p, tx.init(p))
  except wa.WeightedAccumulationError:
    return  # refusing a sums result is documented too
  np.testing.assert_allclose(new["w"], [-1.0, -2.0])  # -(sums / 4) / 2


def test_without_axis_name_inside_shard_map_is_refused_by_name():
  mesh = mesh_of("auto")
  f = wa.microbatched_value_and_grad(_shift_loss, K, mode="sum")
  run = jax.shard_map(
    lambda w, b: f(w, b)[1].grads,
    mesh=mesh,
    in_specs=(P(), P("data")),
    out_specs=P(),
  )
  with pytest.raises(wa.WeightedAccumulationError, match="axis_name"):
    run(jnp.float32(1.0), sharded(jnp.arange(8.0), mesh))
