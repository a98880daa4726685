"""Conformance: reading and dropping an open window (``peek_mean``,
``discard``) keep every promise of the close.

``peek_mean`` decides finiteness like the close (one NaN or Inf on any
device is seen on every shard), equals the float64 weighted mean, and
leaves the window open; ``discard`` returns the empty window on the params'
shardings and takes its new loss scale through the one validation module
(a hostile scale is refused, eagerly and under ``jit`` alike). Eager and
jitted, params on one device, on 8 devices and on a 2-D mesh, each
work dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _conformance import BAD_CASES
from _conformance import PLACED
from _conformance import PLACED_IDS
from _conformance import SCALE_IDS
from _conformance import SCALES
from _conformance import Error
from _conformance import assert_close
from _conformance import assert_flag
from _conformance import cast
from _conformance import host_grads
from _conformance import host_params
from _conformance import place
from _conformance import rtol_of
from _conformance import scale_ok
from _conformance import stored_scale
import weighted_accum as wa

CONTEXTS = ["eager", "jit"]


_PEEK = jax.jit(wa.peek_mean)


# A clean window, and an Inf on the last device (where a cross-device max
# would drop it). peek_mean reads through window.finish, whose NaN cases on
# either device test_conformance_finite runs.
PEEK_CASES = [c for c in BAD_CASES if c[0] in ("finite", "neg_inf_last_device")]


@pytest.mark.parametrize("case", PEEK_CASES, ids=[c[0] for c in PEEK_CASES])
@pytest.mark.parametrize("placement, dtype", PLACED, ids=PLACED_IDS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_peek_mean_is_the_mean_and_sees_every_bad_value(
  context, placement, dtype, case
):
  _, bad, where = case
  params = place(cast(host_params(), dtype), placement)
  g1 = place(cast(host_grads(), dtype), placement)
  g2 = place(cast(host_grads(2.0, bad=bad, where=where), dtype), placement)
  s = wa.accumulate_mean(wa.init(params, dtype=dtype), g1, 3)
  s = wa.accumulate_mean(s, g2, 1)
  out = (_PEEK if context == "jit" else wa.peek_mean)(s)
  ok = bad is None
  assert_flag(out.finite, ok, "finite")
  assert_flag(out.valid, ok, "valid")
  assert int(s.issued) == 2  # still open
  if ok:  # (3 * g + 1 * 2g) / 4, in float64
    ref = {k: v * 5.0 / 4.0 for k, v in host_grads().items()}
    assert_close(out.grads, ref, rtol=rtol_of(dtype))
    closed, _ = wa.finish_mean(s)
    assert_close(out.grads, closed.grads, rtol=0.0)
    for k, v in out.grads.items():
      assert v.sharding.is_equivalent_to(params[k].sharding, v.ndim)


_DISCARD = jax.jit(lambda s, ls: wa.discard(s, next_loss_scale=ls))


@pytest.mark.parametrize("placement, dtype", PLACED, ids=PLACED_IDS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_discard_opens_an_empty_window_on_the_params_shardings(
  context, placement, dtype
):
  params = place(cast(host_params(), dtype), placement)
  g = place(cast(host_grads(bad=math.nan), dtype), placement)
  s = wa.accumulate_sum(wa.init(params, dtype=dtype, loss_scale=4.0), g, 2)
  new = (
    _DISCARD(s, 8.0) if context == "jit" else wa.discard(s, next_loss_scale=8.0)
  )
  assert float(new.total_weight) == 0.0 and int(new.issued) == 0
  assert int(new.windows) == int(s.windows) + 1
  assert float(new.loss_scale) == 8.0
  for k, v in new.grads.items():
    assert not np.any(np.asarray(v, np.float64))  # the NaN is gone
    assert v.dtype == jnp.dtype(dtype)
    assert v.sharding.is_equivalent_to(params[k].sharding, v.ndim)
  g1 = place(cast(host_grads(8.0), dtype), placement)  # of the scaled loss
  out, _ = wa.finish_mean(wa.accumulate_mean(new, g1, 1))
  assert_flag(out.valid, True, "valid after discard")
  assert_close(out.grads, host_grads(), rtol=rtol_of(dtype))


@pytest.mark.parametrize("case", SCALES, ids=SCALE_IDS)
def test_discard_takes_its_loss_scale_through_validation(case):
  """A hostile next_loss_scale: stored as the documented rule says, or
  refused with the library's error, the caller's window untouched."""
  _, make, ref = case
  s = wa.accumulate_sum(wa.init(host_params()), host_grads(), 2)
  if not scale_ok(ref) or isinstance(make(), str):
    with pytest.raises(Error, match=r"discard\(next_loss_scale"):
      wa.discard(s, next_loss_scale=make())
    assert float(s.total_weight) == 2.0
    return
  new = wa.discard(s, next_loss_scale=make())
  assert float(new.loss_scale) == stored_scale(ref)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_discard_traced_invalid_scale_makes_the_next_window_invalid(bad):
  """Under jit a Python error cannot depend on the value: the new window's
  scale is NaN, so its close reports invalid rather than a wrong gradient."""
  s = wa.accumulate_sum(wa.init(host_params()), host_grads(), 2)
  new = _DISCARD(s, jnp.float32(bad))
  assert math.isnan(float(new.loss_scale))
  with pytest.raises(Error, match=r"loss scale is nan"):
    wa.accumulate_mean(new, host_grads(), 1)  # eagerly: refused
  step = jax.jit(lambda s, g: wa.finish_mean(wa.accumulate_mean(s, g, 1))[0])
  assert not bool(step(new, host_grads()).valid)  # jitted: invalid


def test_discard_and_peek_on_the_wrapper_over_two_windows():
  """A window dropped mid-way, then two full windows with Adam: the result
  equals optax.adam on the two windows' exact means (the dropped
  microbatch leaves no trace), and peek_mean mid-window is the mean so far."""
  params = {"w": jnp.zeros(3)}
  tx = wa.WeightedMultiSteps(optax.adam(0.1), 2, mode="sum")
  st = tx.init(params)
  grads = [np.array([1.0, -2.0, 3.0]), np.array([4.0, 0.5, -1.0])]
  _, st = tx.update({"w": jnp.full(3, 1e6)}, st, params, weight=1.0)
  st = wa.discard(st)
  ref_tx, ref_p = optax.adam(0.1), {"w": jnp.zeros(3)}
  ref_st = ref_tx.init(ref_p)
  for w in range(2):
    g = [grads[0] * (w + 1), grads[1] / (w + 1)]
    u, st = tx.update({"w": jnp.asarray(g[0])}, st, params, weight=3.0)
    peek = wa.peek_mean(st)
    np.testing.assert_allclose(peek.grads["w"], g[0] / 3.0, rtol=1e-6)
    u, st = tx.update({"w": jnp.asarray(g[1])}, st, params, weight=1.0)
    params = optax.apply_updates(params, u)
    mean = {"w": jnp.asarray((g[0] + g[1]) / 4.0, jnp.float32)}
    ru, ref_st = ref_tx.update(mean, ref_st, ref_p)
    ref_p = optax.apply_updates(ref_p, ru)
  np.testing.assert_allclose(params["w"], ref_p["w"], rtol=1e-6)
