"""Sphinx directive ``wa-api``: one topic of the API reference.

Each page of ``docs/api/`` lists the public names of one topic::

  .. wa-api::

     init
     accumulate_sum
     distributed          (a public submodule: its own names)

and gets a summary table (name, first line of its docstring) followed by
each name's entry, documented under its public path
(``weighted_accum.init``, ``weighted_accum.distributed.window_specs``), never under
the private module that defines it. A submodule lists the names of its
``__all__`` that are not also exported at the top level (those are
documented once, under their top-level name).

The build checks that the topics cover ``weighted_accum.__all__`` exactly: a
new export that no topic lists, a name listed twice or a name that is not
exported fails the ``-W`` build, so the reference never silently misses one.
"""

from __future__ import annotations

import importlib
import inspect

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

PACKAGE = "weighted_accum"
logger = logging.getLogger(__name__)


def _kind(obj) -> str:
  if inspect.ismodule(obj):
    return "module"
  if inspect.isclass(obj):
    return "exception" if issubclass(obj, BaseException) else "class"
  return "function" if callable(obj) else "data"


def _summary(obj) -> str:
  doc = inspect.getdoc(obj) or ""
  first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
  return first or " "


def _role(kind: str) -> str:
  return {"function": "func", "module": "mod", "data": "data"}.get(
    kind, "class"
  )


def _entry(full: str, obj, kind: str) -> list[str]:
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


def _members(name: str) -> list[tuple[str, object, str]]:
  """(public path, object, kind) of one listed name; a submodule expands."""
  pkg = importlib.import_module(PACKAGE)
  obj = getattr(pkg, name)
  kind = _kind(obj)
  if kind != "module":
    return [(f"{PACKAGE}.{name}", obj, kind)]
  top = {id(getattr(pkg, n)) for n in pkg.__all__}
  out = []
  if not hasattr(obj, "__all__"):
    logger.warning(
      "wa-api: %s has no __all__: its names are not documented", obj.__name__
    )
  for sub in getattr(obj, "__all__", ()):
    member = getattr(obj, sub)
    if id(member) not in top:
      out.append((f"{obj.__name__}.{sub}", member, _kind(member)))
  return out


def api_lines(names: list[str]) -> list[str]:
  """The reStructuredText of one topic: a summary table, then the entries.

  Top-level names come first; a submodule's names follow under its
  ``.. module::`` (which changes how short references resolve below it).
  """
  pkg = importlib.import_module(PACKAGE)
  names = sorted(names, key=lambda n: _kind(getattr(pkg, n)) == "module")
  lines = [".. currentmodule:: " + PACKAGE, ""]
  lines += [".. list-table::", "   :widths: 40 60", "   :class: wa-api-summary"]
  lines.append("")
  for name in names:
    for full, obj, kind in _members(name):
      shown = full.removeprefix(PACKAGE + ".")
      lines += [
        f"   * - :{_role(kind)}:`{shown} <{full}>`",
        f"     - {_summary(obj)}",
      ]
  lines.append("")
  for name in names:
    obj = getattr(pkg, name)
    if _kind(obj) == "module":
      lines += [f".. module:: {obj.__name__}", ""]
      doc = (inspect.getdoc(obj) or "").split("\n\n")[0]
      lines += [doc, ""] if doc else []
    for full, member, kind in _members(name):
      lines += _entry(full, member, kind)
  return lines


class ApiTopic(SphinxDirective):
  """``.. wa-api::`` with one public name per content line."""

  has_content = True

  def run(self) -> list[nodes.Node]:
    names = [n.strip() for n in self.content if n.strip()]
    pkg = importlib.import_module(PACKAGE)
    self.env.note_dependency(pkg.__file__)
    listed = self.env.domaindata.setdefault("wa_api", {})
    for name in names:
      if name not in pkg.__all__:
        logger.warning(
          "wa-api: %r is not in %s.__all__",
          name,
          PACKAGE,
          location=self.get_location(),
        )
      listed.setdefault(name, []).append(self.env.docname)
    node = nodes.section()
    node.document = self.state.document
    nested_parse_with_titles(
      self.state, StringList(api_lines(names), "<wa-api>"), node
    )
    return node.children


def _purge(app, env, docname):
  del app
  listed = env.domaindata.get("wa_api", {})
  for name in list(listed):
    listed[name] = [d for d in listed[name] if d != docname]
    if not listed[name]:
      del listed[name]


def _merge(app, env, docnames, other):
  del app, docnames
  listed = env.domaindata.setdefault("wa_api", {})
  for name, docs in other.domaindata.get("wa_api", {}).items():
    listed.setdefault(name, []).extend(docs)


def _check(app, env):
  del app
  pkg = importlib.import_module(PACKAGE)
  listed = env.domaindata.get("wa_api", {})
  missing = [n for n in pkg.__all__ if n not in listed]
  twice = {n: d for n, d in listed.items() if len(d) > 1}
  if missing:
    logger.warning(
      "wa-api: no page of docs/api/ lists %s (add each to a topic)",
      ", ".join(missing),
    )
  if twice:
    logger.warning("wa-api: listed on more than one page: %s", twice)


def setup(app):
  app.add_directive("wa-api", ApiTopic)
  app.connect("env-purge-doc", _purge)
  app.connect("env-merge-info", _merge)
  app.connect("env-check-consistency", _check)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
