"""The layout's rules, checked from the source: no import cycle between the
package's modules, every public name one hop from ``weighted_accum``, small
modules and functions, and every value a caller hands in passing through the
one validation module."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import weighted_accum as wa
from weighted_accum._src import validation

PKG = pathlib.Path(wa.__file__).parent
MODULES = sorted(PKG.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(PKG.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _is_module(dotted: str) -> bool:
  path = PKG.parent / dotted.replace(".", "/")
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: pathlib.Path) -> set[str]:
  """The package's modules that ``path`` imports, anywhere in the file."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module.startswith("weighted_accum"):
        for alias in node.names:
          sub = f"{node.module}.{alias.name}"
          found.add(sub if _is_module(sub) else node.module)
    elif isinstance(node, ast.Import):
      found |= {
        a.name for a in node.names if a.name.startswith("weighted_accum")
      }
  return found


def test_no_import_cycle_between_modules():
  graph = {_module_name(p): _imports(p) for p in MODULES}
  # The package's __init__ re-exports; cycles through it do not count.
  # Package __init__ modules only re-export: cycles through them (a
  # submodule importing a sibling through its package) do not count.
  inits = {_module_name(p) for p in MODULES if p.name == "__init__.py"}
  graph = {
    m: {d for d in deps if d not in inits and d in graph}
    for m, deps in graph.items()
  }
  state: dict[str, int] = {}

  def visit(m, stack):
    state[m] = 1
    for d in graph[m]:
      if state.get(d) == 1:
        raise AssertionError(f"import cycle: {' -> '.join(stack + [m, d])}")
      if d not in state:
        visit(d, stack + [m])
    state[m] = 2

  for m in graph:
    if m not in state:
      visit(m, [])


def test_public_names_are_one_hop_from_the_package():
  for name in wa.__all__:
    obj = getattr(wa, name)
    assert obj is not None, name
  for ns in (wa.distributed, wa.checkpoint):
    for name in ns.__all__:
      assert getattr(ns, name) is not None


def _public_objects():
  """(namespace.name, object) of every public name of the three
  namespaces (the two submodules themselves not counted)."""
  out = []
  for ns, label in (
    (wa, "weighted_accum"),
    (wa.distributed, "weighted_accum.distributed"),
    (wa.checkpoint, "weighted_accum.checkpoint"),
  ):
    for name in ns.__all__:
      obj = getattr(ns, name)
      if obj not in (wa.distributed, wa.checkpoint):
        out.append((f"{label}.{name}", obj))
  return out


def test_public_surface_is_small_and_each_name_means_one_thing():
  objs = _public_objects()
  assert len(objs) <= 32, [n for n, _ in objs]
  short = {}
  for full, _ in objs:
    name = full.rsplit(".", 1)[1]
    assert name not in short, f"{name} is public twice: {short[name]}, {full}"
    short[name] = full


def _parameters(obj) -> list[tuple[str, int]]:
  """(where, number of parameters) of a public callable and, for a class,
  its constructor and public methods."""
  import inspect

  def count(fn):
    sig = inspect.signature(fn)
    return len([q for q in sig.parameters.values() if q.name != "self"])

  if inspect.isclass(obj) and issubclass(obj, Exception):
    return []
  if inspect.isclass(obj):
    found = [("__init__", count(obj))]
    for name, member in vars(obj).items():
      if callable(member) and not name.startswith("_"):
        found.append((name, count(member)))
    return found
  return [("", count(obj))] if callable(obj) else []


def test_no_public_callable_takes_more_than_14_parameters():
  for full, obj in _public_objects():
    for where, n in _parameters(obj):
      assert n <= 14, f"{full}{'.' + where if where else ''}: {n} parameters"


def _import_graph() -> dict[str, set[str]]:
  graph = {_module_name(p): _imports(p) for p in MODULES}
  inits = {_module_name(p) for p in MODULES if p.name == "__init__.py"}
  return {
    m: {d for d in deps if d not in inits and d in graph}
    for m, deps in graph.items()
    if m not in inits
  }


def test_import_chains_are_at_most_7_modules_deep():
  graph = _import_graph()
  depth: dict[str, int] = {}

  def longest(m):
    if m not in depth:
      depth[m] = 1 + max((longest(d) for d in graph[m]), default=0)
    return depth[m]

  deepest = max(graph, key=longest)
  assert longest(deepest) <= 7, (deepest, longest(deepest))


def test_design_notes_map_every_module():
  design = (PKG.parent / "docs" / "design.md").read_text()
  for path in MODULES:
    if path.name == "__init__.py" or path.parent == PKG:
      continue
    rel = path.relative_to(PKG / "_src").with_suffix("").as_posix()
    assert f"`{rel}`" in design or f"`{rel}`," in design, rel


def test_removed_spellings_are_refused_naming_the_new_one():
  for ns, name, new in [
    (wa, "weighted_multi_steps", "WeightedMultiSteps"),
    (wa, "AccumSave", "checkpoint.AccumSave"),
    (wa, "local_grad", "distributed.local_grad"),
    (wa.distributed, "init", "weighted_accum.init"),
    (wa.distributed, "finish_mean", "weighted_accum.finish_mean"),
  ]:
    with pytest.raises(AttributeError, match=new):
      getattr(ns, name)
  state = wa.init(PARAMS)
  with pytest.raises(wa.WeightedAccumulationError, match="wa.init"):
    wa.peek_mean(state, axis_name="data")
  with pytest.raises(wa.WeightedAccumulationError, match="DataParallel"):
    wa.microbatched_value_and_grad(lambda p, b: 0, 2, mode="sum", fsdp="x")
  with pytest.raises(wa.WeightedAccumulationError, match="batch_argnums"):
    wa.microbatched_value_and_grad(lambda p, b: 0, 2, mode="sum", in_axes=1)


def _code_lines(node) -> int:
  n = node.end_lineno - node.lineno + 1
  body = node.body
  if (
    body
    and isinstance(body[0], ast.Expr)
    and isinstance(body[0].value, ast.Constant)
    and isinstance(body[0].value.value, str)
  ):
    n -= body[0].end_lineno - body[0].lineno + 1
  return n


def test_modules_and_functions_are_small():
  for path in MODULES:
    text = path.read_text()
    assert len(text.splitlines()) <= 600, path
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        assert _code_lines(node) <= 60, f"{path}:{node.lineno} {node.name}"


def test_errors_module_holds_the_exception_only():
  tree = ast.parse((PKG / "_src" / "errors.py").read_text())
  defs = [
    n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
  ]
  assert [d.name for d in defs] == ["WeightedAccumulationError"]


# -- every value a caller hands in goes through the validation module --------


class _Seen:
  """Spies on the validation module's weight and loss-scale conversions."""

  def __init__(self, monkeypatch):
    self.values: list[object] = []
    for name in ("weight", "loss_scale", "optional_loss_scale"):
      real = getattr(validation, name)

      def spy(x, *a, _real=real, **k):
        self.values.append(x)
        return _real(x, *a, **k)

      monkeypatch.setattr(validation, name, spy)

  def saw(self, value) -> bool:
    return any(v is value for v in self.values)


PARAMS = {"w": jnp.ones(3)}
GRADS = {"w": jnp.full(3, 2.0)}


def _weights():
  return np.float32(3.0), np.float32(2.0)  # distinct objects per call


@pytest.mark.parametrize(
  "call",
  [
    "accumulate_sum",
    "accumulate_mean",
    "wrapper",
    "train_state",
    "distributed",
  ],
)
def test_every_weight_reaches_the_validation_module(monkeypatch, call):
  seen = _Seen(monkeypatch)
  w, _ = _weights()
  state = wa.init(PARAMS)
  if call in ("accumulate_sum", "accumulate_mean"):
    getattr(wa, call)(state, GRADS, w)
  elif call == "wrapper":
    tx = wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="mean")
    tx.update(GRADS, tx.init(PARAMS), PARAMS, weight=w)
  elif call == "train_state":
    ts = wa.TrainState.create(
      apply_fn=None,
      params=PARAMS,
      tx=wa.WeightedMultiSteps(optax.sgd(0.1), 2, mode="mean"),
    )
    ts.apply_gradients(grads=GRADS, weight=w)
  else:
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))

    def step(p, g):
      s = wa.init(p, axis_name="data")
      return wa.accumulate_sum(s, g, w).issued

    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P()),
      out_specs=P(),
      check_vma=False,
    )(PARAMS, GRADS)
  assert seen.saw(w)


@pytest.mark.parametrize(
  "call",
  [
    "init",
    "finish_sums",
    "finish_mean",
    "apply_window",
    "set_loss_scale",
    "wrapper_loss_scale",
    "wrapper_next",
    "in_step",
    "distributed_finish",
  ],
)
def test_every_loss_scale_reaches_the_validation_module(monkeypatch, call):
  seen = _Seen(monkeypatch)
  ls = np.float32(4.0)
  state = wa.accumulate_sum(wa.init(PARAMS), GRADS, 2.0)
  tx = optax.sgd(0.1)
  if call == "init":
    wa.init(PARAMS, loss_scale=ls)
  elif call in ("finish_sums", "finish_mean"):
    getattr(wa, call)(state, next_loss_scale=ls)
  elif call == "apply_window":
    wa.apply_window(tx, state, PARAMS, tx.init(PARAMS), next_loss_scale=ls)
  elif call == "set_loss_scale":
    wa.set_loss_scale(wa.init(PARAMS), ls)
  elif call == "wrapper_loss_scale":
    wa.WeightedMultiSteps(tx, 2, mode="mean", loss_scale=ls)
  elif call == "wrapper_next":
    ms = wa.WeightedMultiSteps(tx, 1, mode="mean")
    ms.update(GRADS, ms.init(PARAMS), PARAMS, weight=1, next_loss_scale=ls)
  elif call == "in_step":
    f = wa.microbatched_value_and_grad(
      lambda p, x: (jnp.sum(p["w"] * x), x.shape[0] * 1.0), 2, mode="sum"
    )
    f(PARAMS, jnp.ones((4, 3)), loss_scale=ls)
  else:
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))

    def step(p, g):
      s = wa.init(p, axis_name="data")
      s = wa.accumulate_sum(s, g, 2.0)
      out, _ = wa.finish_mean(s, next_loss_scale=ls)
      return out.weight

    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
    )(PARAMS, GRADS)
  assert seen.saw(ls)
