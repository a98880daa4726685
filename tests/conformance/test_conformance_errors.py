"""Conformance: every refusal is the library's own error.

Swapped arguments, wrong state types (an ``optax.MultiStepsState`` handed
to ``WeightedMultiSteps``), a ``loss_fn`` returning only its loss,
``apply_window`` on a per-replica window inside ``shard_map``, and a
checkpoint restored into a template of another optimizer raise a
``WeightedAccumulationError`` that says what was expected (never an
``AttributeError``/``TypeError`` or a JAX internal error), and the caller's
state is untouched. The last test checks that the conformance matrix names
every public entry point.
"""

from __future__ import annotations

import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from _conformance import Error
from _conformance import assert_same
from _conformance import host_grads
from _conformance import host_params
from _conformance import snapshot
import weighted_accum as wa
from weighted_accum import distributed as dist

G = host_grads()
P0 = host_params()
TX = optax.sgd(1.0)
WTX = wa.WeightedMultiSteps(optax.sgd(1.0), 2, mode="mean")


def _state():
  return wa.accumulate_mean(wa.init(P0), G, 2)


# name -> (call, regex the message must match)
CASES = {
  "apply_window(tx, params, state, opt_state)": (
    lambda s, o: wa.apply_window(TX, P0, s, o),
    r"apply_window\(state",
  ),
  "apply_window(tx, state, opt_state, params)": (
    lambda s, o: wa.apply_window(TX, s, o, P0),
    r"apply_window\((params|opt_state)",
  ),
  "apply_window(state, tx, params, opt_state)": (
    lambda s, o: wa.apply_window(s, TX, P0, o),
    r"apply_window\(tx",
  ),
  "apply_window(wrapper state)": (
    lambda s, o: wa.apply_window(TX, WTX.init(P0), P0, o),
    r"apply_window\(state",
  ),
  "accumulate_sum(grads, state, weight)": (
    lambda s, o: wa.accumulate_sum(G, s, 1.0),
    r"accumulate_sum\(state",
  ),
  "accumulate_mean(state, weight, grads)": (
    lambda s, o: wa.accumulate_mean(s, 1.0, G),
    r"accumulate_mean\((grads|weight)",
  ),
  "finish_mean(params)": (
    lambda s, o: wa.finish_mean(P0),
    r"finish_mean\(state",
  ),
  "finish_sums(wrapper state)": (
    lambda s, o: wa.finish_sums(WTX.init(P0)),
    r"finish_sums\(state",
  ),
  "set_loss_scale(scale, state)": (
    lambda s, o: wa.set_loss_scale(2.0, s),
    r"set_loss_scale",
  ),
  "WeightedMultiSteps.update(optax.MultiStepsState)": (
    lambda s, o: WTX.update(
      G, optax.MultiSteps(optax.sgd(1.0), 2).init(P0), P0, weight=1
    ),
    r"update\(state",
  ),
  "WeightedMultiSteps.update(AccumState)": (
    lambda s, o: WTX.update(G, s, P0, weight=1),
    r"update\(state",
  ),
  "WeightedMultiSteps.update(inner optimizer state)": (
    lambda s, o: WTX.update(G, o, P0, weight=1),
    r"update\(state",
  ),
  "WeightedMultiSteps.update(state, grads) swapped": (
    lambda s, o: WTX.update(WTX.init(P0), G, P0, weight=1),
    r"update\((state|updates|grads)",
  ),
  "accumulate(wrapper state)": (
    lambda s, o: wa.microbatched_value_and_grad(
      lambda p, b: (jnp.sum(b), 1.0), 2, mode="sum"
    ).accumulate(WTX.init(P0), P0, jnp.ones(4)),
    r"accumulate\(state",
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_wrong_arguments_raise_the_librarys_error(case):
  call, needle = CASES[case]
  s, o = _state(), TX.init(P0)
  snap = snapshot((s, o))
  with pytest.raises(Error, match=needle):
    call(s, o)
  assert_same((s, o), snap)


# ------------------------------------------------------------- loss_fn --


def _loss_only(p, x):
  return jnp.sum((x @ p["b"]) ** 2)


def _loss_weight(p, x):
  return jnp.sum((x @ p["b"]) ** 2), jnp.float32(x.shape[0])


LOSS_CASES = {
  "loss only": (_loss_only, False),
  "(loss, weight) with has_aux": (_loss_weight, True),
  "loss only with has_aux": (_loss_only, True),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
@pytest.mark.parametrize("context", ["eager", "jit"])
def test_loss_fn_of_the_wrong_shape_is_named(case, context):
  fn, has_aux = LOSS_CASES[case]
  f = wa.microbatched_value_and_grad(fn, 2, mode="sum", has_aux=has_aux)
  if context == "jit":
    f = jax.jit(f)
  with pytest.raises(Error, match="loss_fn"):
    f(P0, jnp.ones((4, 8)))


# ------------------------------------- apply_window on a per-replica window --


def test_apply_window_on_a_per_replica_window_in_shard_map():
  """A per-replica window (``wa.init(..., axis_name=...)`` inside
  ``shard_map``) holds per-replica sums; ``apply_window`` reads that from
  the window and reduces them once: every replica applies the global mean
  (8 replicas of the same grads at weight 1: the mean is G)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

  def step(p, g):
    g = jax.tree.map(lambda x: x[0], g)
    s = wa.accumulate_sum(wa.init(p, axis_name="data"), g, 1.0)
    new, _, _, out = wa.apply_window(TX, s, p, TX.init(p))
    return new, out.valid, out.weight

  local = {k: np.stack([v] * 8) for k, v in G.items()}
  f = jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P(), P("data")),
    out_specs=(P(), P(), P()),
  )
  new, valid, weight = jax.jit(f)(P0, local)
  assert bool(valid) and float(weight) == 8.0
  ref = TX.update(
    {k: np.asarray(v, np.float32) for k, v in G.items()}, TX.init(P0), P0
  )[0]
  for k in G:
    np.testing.assert_allclose(
      np.asarray(new[k]) - np.asarray(P0[k]), ref[k], rtol=1e-6, atol=1e-7
    )


# ---------------------------------------------------------- checkpoints --


def _save_restore(saved, template):
  path = tempfile.mkdtemp() + "/accum"
  with ocp.Checkpointer(wa.checkpoint.AccumCheckpointHandler()) as ck:
    ck.save(path, args=wa.checkpoint.AccumSave(saved))
    return ck.restore(path, args=wa.checkpoint.AccumRestore(template))


def _wrapper_state(opt):
  tx = wa.WeightedMultiSteps(opt, 2, mode="mean")
  _, s = tx.update(G, tx.init(P0), P0, weight=2)
  return s


@pytest.mark.parametrize(
  "saved,template",
  [
    (lambda: optax.adam(1e-3), lambda: optax.adamw(1e-3)),
    (lambda: optax.sgd(1e-3), lambda: optax.adam(1e-3)),
  ],
  ids=["adam_into_adamw", "sgd_into_adam"],
)
def test_restore_into_another_optimizers_template_says_so(saved, template):
  s, t = _wrapper_state(saved()), _wrapper_state(template())
  snap = snapshot(t)
  with pytest.raises(Error, match="template") as e:
    _save_restore(s, t)
  assert "corrupt" not in str(e.value), str(e.value)
  assert_same(t, snap)


def test_restore_into_another_work_dtype_names_it():
  s = wa.accumulate_sum(wa.init(P0, dtype=jnp.bfloat16), G, 2)
  with pytest.raises(Error, match="dtype"):
    _save_restore(s, wa.checkpoint.abstract_state(P0, jnp.float32))


# ------------------------------------- the matrix names every entry point --

# Public names that are types or modules, not entry points taking values.
NOT_ENTRY_POINTS = {
  "AccumState",
  "AccumulatedGradients",
  "WeightedMultiStepsState",
  "WeightedAccumulationError",
  "checkpoint",
  "distributed",
  "planning",  # its own conformance tests: tests/planning
  "abstract_state",
  "has_updated",
  "window_counters",
  "REDUCE_MODES",
  "is_reduced",
  "local_grad",
  "local_value_and_grad",
}


def test_every_public_entry_point_is_in_the_matrix():
  here = pathlib.Path(__file__).parent
  text = "\n".join(
    p.read_text() for p in sorted(here.glob("test_conformance_*.py"))
  )
  names = sorted(set(wa.__all__) | set(dist.__all__))
  missing = [
    n
    for n in names
    if n not in NOT_ENTRY_POINTS
    and not re.search(rf"\b(wa|dist)\.{re.escape(n)}\b", text)
  ]
  assert not missing, f"entry points without conformance cases: {missing}"
