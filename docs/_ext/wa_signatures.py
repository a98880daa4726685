"""Readable API signatures and docstrings: public names only.

autodoc prints a type by where it is defined (``optax._src.base.
GradientTransformation``, ``jax.jaxlib._jax.Array``, this package's private
modules), a default value by its ``repr`` (``<class 'jax.numpy.float32'>``)
and a type alias by its expansion (``optax.OptState`` as a ten-member union).
This extension rewrites every signature to the names a user imports:

- a type defined anywhere is shown by its public path, found by looking up
  the object in the public namespaces below (``weighted_accum.__all__``, its
  public submodules' ``__all__``, and those of jax, optax, flax, orbax,
  numpy); this package's own types are shown by their short name and link to
  their entry. It works whatever the private module that defines them;
- a string annotation through a module alias (``state_lib.AccumState``) is
  shown by the public name of the class it names;
- a known type alias's expansion is folded back to the alias's name;
- ``<class 'jax.numpy.float32'>`` is shown as ``jnp.float32`` (defaults are
  otherwise taken from the source text: ``autodoc_preserve_defaults``).

A cross-reference that does not resolve as written (a type in an
``Attributes:`` field, taken from the class's annotations; a name a
submodule re-exports) is resolved by the same public name, and shown as it.

In docstrings, a reference to a documentation page by its repository path
(````docs/inputs.md````) becomes a link to that page, and ````X````\\ s (a
plural right after an inline literal, which reStructuredText does not end)
is rendered as intended.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

# Public namespaces, most specific first: an object reachable from several
# is shown by the first that exports it.
EXTERNAL_NAMESPACES = (
  "jax",
  "jax.sharding",
  "jax.typing",
  "jax.numpy",
  "optax",
  "optax.microbatching",
  "flax.struct",
  "flax.core",
  "flax.training.train_state",
  "flax.nnx",
  "orbax.checkpoint",
  "orbax.checkpoint.args",
  "numpy",
  "pathlib",
)
# Type aliases whose expansion autodoc prints in their place. optax's
# ``OptState``, ``Params`` and ``Updates`` are one alias (``chex.ArrayTree``),
# so one expansion can only be folded back to one name: the only annotation
# of this package that uses it is ``TrainState.opt_state``.
ALIASES = ("optax.OptState",)
# Types with no inventory to link to: shown by their public name, unlinked.
UNLINKED = {"etils.epath.abstract_path.Path": "epath.Path"}
# Shown by their last component (``Any``, ``Callable``), as Python users read them.
SHORT_MODULES = ("typing", "collections.abc", "typing_extensions")
PACKAGE = "weighted_accum"

_DOTTED = re.compile(r"~?\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_CLASS_REPR = re.compile(r"<class '([\w.]+)'>")
_DOC_PATH = re.compile(r"``docs/([\w-]+)\.(?:md|rst)``")
_PLURAL = re.compile(r"``([^`\n]+)``s\b")


def _public_path(obj: Any) -> str | None:
  mod = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if isinstance(mod, str) and isinstance(qualname, str):
    return f"{mod}.{qualname}"
  return None


@functools.cache
def public_names() -> tuple[dict[str, str], dict[str, str]]:
  """(defined path -> public path, class name -> public path of ours)."""
  by_path: dict[str, str] = dict(UNLINKED)
  ours: dict[str, str] = {}
  pkg = importlib.import_module(PACKAGE)
  spaces = [(PACKAGE, pkg)]
  spaces += [
    (f"{PACKAGE}.{n}", getattr(pkg, n))
    for n in pkg.__all__
    if type(getattr(pkg, n)).__name__ == "module"
  ]
  for space, module in spaces:
    for name in module.__all__:
      obj = getattr(module, name)
      path = _public_path(obj)
      if path and not isinstance(obj, type(pkg)):
        by_path.setdefault(path, f"{space}.{name}")
        ours.setdefault(name, f"{space}.{name}")
  for space in EXTERNAL_NAMESPACES:
    try:
      module = importlib.import_module(space)
    except ImportError:
      continue
    names = getattr(module, "__all__", None) or dir(module)
    for name in names:
      if name.startswith("_"):
        continue
      obj = getattr(module, name, None)
      path = _public_path(obj) if isinstance(obj, type) else None
      if path:
        by_path.setdefault(path, f"{space}.{name}")
  return by_path, ours


@functools.cache
def _alias_expansions() -> tuple[tuple[str, str], ...]:
  from sphinx.util.typing import stringify_annotation  # noqa: PLC0415

  pairs = []
  for alias in ALIASES:
    module, _, name = alias.rpartition(".")
    try:
      value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
      continue
    for mode in ("smart", "fully-qualified-except-typing"):
      pairs.append((stringify_annotation(value, mode), alias))
  # Longest first, so that no expansion is cut by a shorter one.
  return tuple(sorted(set(pairs), key=lambda p: -len(p[0])))


def _rewrite_token(match: re.Match) -> str:
  token = match.group(0).lstrip("~")
  by_path, ours = public_names()
  public = by_path.get(token)
  if public is None:
    head, _, last = token.rpartition(".")
    if head in SHORT_MODULES:
      return "~" + token
    if last in ours and not token.startswith(f"{PACKAGE}."):
      public = ours[last]  # a module alias: ``state_lib.AccumState``
    elif last in ours and "._" in token:
      public = ours[last]  # a private module of ours
    else:
      return match.group(0)
  if public.startswith(f"{PACKAGE}."):
    return "~" + public  # short, linked to its entry on these pages
  return public


def _class_repr(match: re.Match) -> str:
  path = match.group(1)
  if path.startswith("jax.numpy."):
    return "jnp." + path.removeprefix("jax.numpy.")
  if path.startswith("numpy."):
    return "np." + path.removeprefix("numpy.")
  by_path, _ = public_names()
  return by_path.get(path, path)


def rewrite(text: str | None) -> str | None:
  """A signature or annotation as the public names spell it."""
  if not text:
    return text
  text = re.sub(r"TypeAliasForwardRef\('([^']+)'\)", r"\1", text)
  text = _CLASS_REPR.sub(_class_repr, text)
  for expansion, alias in _alias_expansions():
    text = text.replace(expansion, alias)
  return _DOTTED.sub(_rewrite_token, text)


_TYPING = {
  "Any": "typing.Any",
  "Callable": "collections.abc.Callable",
  "Sequence": "collections.abc.Sequence",
  "Mapping": "collections.abc.Mapping",
  "Iterable": "collections.abc.Iterable",
}


def public_target(target: str) -> tuple[str, str] | None:
  """(public path, text shown) for a reference target, or None."""
  by_path, ours = public_names()
  head, _, last = target.rpartition(".")
  if target in by_path:
    public = by_path[target]
  elif last in _TYPING and head not in SHORT_MODULES:
    public = _TYPING[last]  # ``Any`` read in another module's context
  elif last in ours and (
    not head or head.startswith(PACKAGE) or "._" in target
  ):
    public = ours[last]
  else:
    return None
  if public.startswith(f"{PACKAGE}.") or public in _TYPING.values():
    return public, public.rpartition(".")[2]
  return public, public


def _missing_reference(app, env, node, contnode):
  """Resolves a reference by the public name of what it names."""
  from docutils import nodes  # noqa: PLC0415
  from sphinx.ext import intersphinx  # noqa: PLC0415

  if node.get("refdomain") != "py":
    return None
  target = node["reftarget"]
  if target in UNLINKED.values():
    found = (target, target)
  else:
    found = public_target(target)
  if found is None or found[0] == target and target not in UNLINKED.values():
    return None
  public, shown = found
  if isinstance(contnode, nodes.Text):
    text = nodes.Text(shown)
  else:
    text = contnode.deepcopy()
    text.children = [nodes.Text(shown)]
  if public in UNLINKED.values():
    return text
  new = node.deepcopy()
  new["reftarget"] = public
  py = env.get_domain("py")
  for reftype in (node["reftype"], "obj"):
    res = py.resolve_xref(
      env, node["refdoc"], app.builder, reftype, public, new, text
    )
    if res is not None:
      return res
  return intersphinx.missing_reference(app, env, new, text)


def _signature(app, what, name, obj, options, signature, return_annotation):
  del app, what, name, obj, options
  return rewrite(signature), rewrite(return_annotation)


def _docstring(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  for i, line in enumerate(lines):
    line = _DOC_PATH.sub(r":doc:`/\1`", line)
    lines[i] = _PLURAL.sub(r"``\1``\\ s", line)


def setup(app):
  app.connect("autodoc-process-signature", _signature)
  app.connect("autodoc-process-docstring", _docstring)
  # Before intersphinx's own handler (priority 500) sees the private path.
  app.connect("missing-reference", _missing_reference, priority=400)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
