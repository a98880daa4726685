"""Every spelling removed in version 1.0 is refused naming its new one
(``validation/removed.MOVED``, one line per spelling)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

import weighted_accum as wa
from weighted_accum._src.validation.removed import MOVED

FUNCTIONS = {
  "apply_window": wa.apply_window,
  "peek_mean": wa.peek_mean,
  "window_specs": wa.distributed.window_specs,
  "microbatched_value_and_grad": wa.microbatched_value_and_grad,
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_removed_spelling_is_refused_naming_the_new_one(old):
  expected = re.escape(f"{old} was removed in version 1.0: use {MOVED[old]}")
  if "(" not in old:  # a namespace's attribute
    module, name = old.replace("wa", "weighted_accum", 1).rsplit(".", 1)
    namespace = {
      "weighted_accum": wa,
      "weighted_accum.distributed": wa.distributed,
    }
    with pytest.raises(AttributeError, match=expected):
      getattr(namespace[module], name)
  else:  # a function's keyword
    fn, keyword = re.fullmatch(r"(\w+)\((\w+)=\)", old).groups()
    with pytest.raises(wa.WeightedAccumulationError, match=expected):
      FUNCTIONS[fn](**{keyword: "data"})


def test_a_removed_trailing_positional_is_refused_too():
  state = wa.init({"w": jnp.zeros(3)})
  with pytest.raises(
    wa.WeightedAccumulationError, match=r"window_specs\(state\)"
  ):
    wa.distributed.window_specs(state, "data")


def test_an_unknown_name_is_the_usual_attribute_error():
  with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
    wa.distributed.nonsense  # noqa: B018
