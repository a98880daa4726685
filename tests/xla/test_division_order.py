"""The window's mean is never a division by the product of its two
divisors as XLA would compute it, in the COMPILED program: XLA rewrites
``(a / b) / c`` into ``a / (b * c)``, and the product of a loss scale and a
weight overflows or underflows float32 at its edges; dividing by a loss
scale below 1 first overflows where the mean fits
(``tests/core/test_close_numerics.py``). Where one divisor is a power of
two the product is formed by exponent arithmetic (on the bits, no
multiplication): the sums are multiplied by its mantissa's reciprocal, then
by powers of two; else by the larger divisor's reciprocal first, then the
smaller's.

Read from the optimised HLO text of ``jit``-compiled closes: which of the
caller's sums, loss scale and weight each instruction's value is computed
from (a select's predicate does not count: it picks, it does not compute),
per tuple element. The program must multiply a value already divided by
one divisor (computed from the sums and both divisors, as the divisor is
picked by value) by a second divisor factor, must never multiply two
divisor factors together (no value computed from the divisors alone times
another). The compiled closes are also run at the edges where either fixed
order loses the window.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import weighted_accum as wa
from weighted_accum._src.core import window

_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_LINE = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s*=\s*(.*)$")


def _balanced(s: str, i: int) -> int:
  """The index of the parenthesis closing the one at ``s[i]``."""
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j
  raise ValueError(s)


def _split_top(s: str) -> list[str]:
  out, depth, cur = [], 0, ""
  for ch in s:
    depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      out.append(cur)
      cur = ""
    else:
      cur += ch
  return out + [cur] if cur.strip() else out


def _parse(text: str) -> tuple[dict, str]:
  """{computation: {"order": [names], "root": name, name: instruction}}."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    if cur is None:
      m = _HEADER.match(line)
      if m:
        cur = comps.setdefault(m.group(2), {"order": [], "root": None})
        entry = m.group(2) if m.group(1) else entry
      continue
    if line.startswith("}"):
      cur = None
      continue
    m = _LINE.match(line)
    if not m:
      continue
    rest = m.group(3)
    if rest.startswith("("):
      rest = rest[_balanced(rest, 0) + 1 :].lstrip()
    else:
      rest = rest.split(" ", 1)[1]
    op = rest[: rest.index("(")]
    close = _balanced(rest, len(op))
    operands = [
      re.findall(r"%([^\s,)]+)", o)[-1]
      for o in _split_top(rest[len(op) + 1 : close])
      if "%" in o
    ]
    attrs = rest[close + 1 :]
    called = re.findall(
      r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)",
      attrs,
    )
    b = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if b:
      called += [c.strip().lstrip("%") for c in b.group(1).split(",")]
    index = re.search(r"index=(\d+)", attrs)
    name_meta = re.search(r'op_name="([^"]*)"', attrs)
    cur[m.group(2)] = dict(
      op=op,
      operands=operands,
      called=called,
      index=int(index.group(1)) if index else None,
      param=name_meta.group(1).replace("\\'", "'") if name_meta else None,
      number=int(re.match(r"parameter\((\d+)", rest).group(1))
      if op == "parameter"
      else None,
    )
    cur["order"].append(m.group(2))
    if m.group(1):
      cur["root"] = m.group(2)
  return comps, entry


def _union(v) -> frozenset:
  if isinstance(v, tuple):
    return frozenset().union(*map(_union, v)) if v else frozenset()
  return v


class _Flow:
  """Which entry parameters (by role) each instruction is computed from;
  records every multiply and the roles of its two operands."""

  def __init__(self, text: str, roles: dict[str, str]):
    self.comps, entry = _parse(text)
    self.roles = roles
    self.products: list[tuple[frozenset, frozenset]] = []
    self.where: list = []
    self._run(entry, None)

  def _run(self, comp: str, args):
    c, env = self.comps[comp], {}
    for name in c["order"]:
      ins = c[name]
      vals = [env[o] for o in ins["operands"]]
      op = ins["op"]
      if op == "parameter":
        if args is None:  # the entry computation: a caller's argument
          v = self.roles.get(ins["param"], frozenset())
          v = frozenset({v}) if isinstance(v, str) else v
        else:
          v = args[ins["number"]]
      elif op == "tuple":
        v = tuple(vals)
      elif op == "get-tuple-element":
        v = vals[0][ins["index"]] if isinstance(vals[0], tuple) else vals[0]
      elif op == "select":
        v = _union(vals[1]) | _union(vals[2])
      elif op == "conditional":
        outs = [
          self._run(b, [vals[i + 1]]) for i, b in enumerate(ins["called"])
        ]
        v = _merge(outs)
      elif op in ("fusion", "call"):
        v = self._run(ins["called"][0], vals)
      else:
        v = frozenset().union(*map(_union, vals)) if vals else frozenset()
        if op == "multiply":
          self.products.append((_union(vals[0]), _union(vals[1])))
          self.where.append((comp, name))
      env[name] = v
    return env[c["root"]]


def _merge(outs):
  if isinstance(outs[0], tuple):
    return tuple(_merge([o[i] for o in outs]) for i in range(len(outs[0])))
  return frozenset().union(*outs)


def _check_order(flow: _Flow) -> None:
  divisors = frozenset({"scale", "weight"})
  for a, b in flow.products:
    assert not (a and b and a <= divisors and b <= divisors), (
      "a product of the divisors"
    )
  assert any(
    {"sums", "scale", "weight"} <= u and v and v <= divisors
    for a, b in flow.products
    for u, v in ((a, b), (b, a))
  ), "no second division after the first"


def _state():
  state = wa.init({"w": jnp.zeros((4, 8))}, loss_scale=2.0**10)
  return wa.accumulate_sum(state, {"w": jnp.ones((4, 8))}, 3.0)


ROLES = {
  "state.grads['w']": "sums",
  "state.loss_scale": "scale",
  "state.weight_hi": "weight",
  "state.weight_lo": "weight",
}


def test_divide_never_divides_by_the_product():
  fn = jax.jit(lambda sums, ls, w: window.divide(sums, ls, w))
  text = fn.lower(jnp.ones((4, 8)), jnp.float32(2.0), jnp.float32(3.0))
  flow = _Flow(
    text.compile().as_text(), {"sums": "sums", "ls": "scale", "w": "weight"}
  )
  _check_order(flow)


def test_finish_mean_divides_in_order():
  text = jax.jit(wa.finish_mean).lower(_state()).compile().as_text()
  _check_order(_Flow(text, ROLES))


def test_apply_window_divides_in_order():
  sgd = optax.sgd(0.1)
  params = {"w": jnp.zeros((4, 8))}

  def step(state, params, opt_state):
    return wa.apply_window(sgd, state, params, opt_state)

  lowered = jax.jit(step).lower(_state(), params, sgd.init(params))
  _check_order(_Flow(lowered.compile().as_text(), ROLES))


def _one_division(b, ls, w):
  return b / (ls * w)


def _divided_then_selected(b, ls, w):
  """(b / ls) / w, then zeros where the divisors are unusable: the close's
  division before this check existed, which XLA compiles into one division
  by ``ls * w``."""
  ok = (w > 0) & jnp.isfinite(w) & (ls > 0) & jnp.isfinite(ls)
  g = jnp.where(ok, (b / ls) / w, 0.0)
  return jnp.where(jnp.isfinite(b), g, jnp.nan)


@pytest.mark.parametrize("mutant", [_one_division, _divided_then_selected])
def test_the_check_refuses_a_product_of_the_divisors(mutant):
  """The check fails on the forms it must refuse: one division by the
  product, and (b / scale) / weight as XLA compiles it."""
  text = jax.jit(mutant).lower(jnp.ones((4, 8)), jnp.float32(2), jnp.float32(3))
  flow = _Flow(
    text.compile().as_text(), {"b": "sums", "ls": "scale", "w": "weight"}
  )
  with pytest.raises(AssertionError):
    _check_order(flow)


@pytest.mark.parametrize(
  "x,scale,weight",
  [(3e38, 0.5, 4.0), (2.0**127, 2.0**-10, 2.0**20), (1.0, 2.0**-126, 0.5)],
)
def test_the_compiled_closes_keep_a_window_either_fixed_order_loses(
  x, scale, weight
):
  """finish_mean and apply_window under jit: the float64 mean, valid."""
  state = wa.init({"w": jnp.zeros(2)}, loss_scale=scale)
  state = wa.accumulate_sum(state, {"w": jnp.asarray([x, -x])}, weight)
  ref = x / scale / weight
  out, _ = jax.jit(wa.finish_mean)(state)
  assert bool(out.valid)
  np.testing.assert_allclose(np.asarray(out.grads["w"]), [ref, -ref], 1e-6)
  sgd = optax.sgd(1.0)
  params = {"w": jnp.zeros(2)}
  step = jax.jit(lambda s, p, o: wa.apply_window(sgd, s, p, o))
  new, _, _, out = step(state, params, sgd.init(params))
  assert bool(out.valid)
  np.testing.assert_allclose(np.asarray(new["w"]), [-ref, ref], 1e-6)
