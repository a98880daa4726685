"""Sphinx directive ``wa-api``: documents every name in ``weighted_accum.__all__``.

A new export appears in the API reference without editing the docs. Names are
grouped into classes, functions and submodules; a submodule lists only the
members that are not also exported at the top level (those are documented
once, under their public name).
"""

import importlib
import inspect

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _kind(obj) -> str:
  if inspect.ismodule(obj):
    return "module"
  if inspect.isclass(obj):
    return "exception" if issubclass(obj, BaseException) else "class"
  return "function" if callable(obj) else "data"


_TITLES = (
  ("function", "Functions"),
  ("class", "Classes"),
  ("exception", "Exceptions"),
  ("data", "Constants"),
  ("module", "Submodules"),
)


def api_lines(package: str) -> list[str]:
  """The reStructuredText that documents ``package.__all__``."""
  pkg = importlib.import_module(package)
  groups = {}
  for name in pkg.__all__:
    obj = getattr(pkg, name)
    groups.setdefault(_kind(obj), []).append((name, obj))
  top = {id(getattr(pkg, n)) for n in pkg.__all__}
  lines = []
  for kind, title in _TITLES:
    if kind not in groups:
      continue
    lines += [title, "-" * len(title), ""]
    for name, obj in groups[kind]:
      lines += _entry(package, name, obj, kind, top)
  return lines


def _entry(package, name, obj, kind, top) -> list[str]:
  full = f"{package}.{name}"
  if kind == "module":
    hidden = [
      n
      for n in getattr(obj, "__all__", dir(obj))
      if id(getattr(obj, n, None)) in top
    ]
    opts = ["   :members:"]
    if hidden:
      opts.append("   :exclude-members: " + ", ".join(sorted(hidden)))
    return [f".. automodule:: {obj.__name__}", *opts, ""]
  if kind in ("class", "exception"):
    # NamedTuple / dataclass fields are documented by the class docstring's
    # ``Attributes:`` section; autodoc would describe them a second time.
    fields = set(getattr(obj, "_fields", ()))
    fields |= set(getattr(obj, "__dataclass_fields__", {}))
    opts = ["   :members:"]
    if fields:
      opts.append("   :exclude-members: " + ", ".join(sorted(fields)))
    return [f".. autoclass:: {full}", *opts, ""]
  if kind == "function":
    return [f".. autofunction:: {full}", ""]
  return [f".. autodata:: {full}", ""]


class ApiAll(SphinxDirective):
  """``.. wa-api:: package``: the package's ``__all__``, grouped by kind."""

  required_arguments = 1

  def run(self) -> list[nodes.Node]:
    lines = api_lines(self.arguments[0])
    self.env.note_dependency(
      importlib.import_module(self.arguments[0]).__file__
    )
    node = nodes.section()
    node.document = self.state.document
    nested_parse_with_titles(self.state, StringList(lines, "<wa-api>"), node)
    return node.children


def setup(app):
  app.add_directive("wa-api", ApiAll)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
