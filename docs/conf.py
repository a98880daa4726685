"""Sphinx configuration for the weighted_accum documentation.

Build locally (warnings are errors, as in CI):

  .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

The notebooks in ``notebooks/`` are rendered from their stored outputs (never
re-executed); they are copied into ``docs/notebooks/`` (git-ignored) at each
build so that new notebooks appear without editing this file. The API
reference is generated from ``weighted_accum.__all__`` by ``_ext/api_all.py``.
"""

import os
import pathlib
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _copy_notebooks() -> None:
  """Mirrors notebooks/*.ipynb into docs/notebooks/ (stale copies removed)."""
  src, dst = ROOT / "notebooks", DOCS / "notebooks"
  dst.mkdir(exist_ok=True)
  wanted = {p.name for p in src.glob("*.ipynb")}
  for old in dst.glob("*.ipynb"):
    if old.name not in wanted:
      old.unlink()
  for name in sorted(wanted):
    if (
      not (dst / name).exists()
      or (dst / name).read_bytes() != (src / name).read_bytes()
    ):
      shutil.copyfile(src / name, dst / name)


_copy_notebooks()

import weighted_accum  # noqa: E402  (after sys.path is set)

project = "weighted_accum"
author = "The weighted_accum authors"
copyright = "The weighted_accum authors"  # noqa: A001
release = weighted_accum.__version__
version = release

extensions = [
  "myst_nb",  # Markdown (MyST) pages and .ipynb notebooks
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",  # Google-style docstrings
  "sphinx.ext.intersphinx",
  "sphinx.ext.mathjax",
  "sphinx.ext.viewcode",
  "api_all",  # the API reference from weighted_accum.__all__
]

source_suffix = {
  ".rst": "restructuredtext",
  ".md": "myst-nb",
  ".ipynb": "myst-nb",
}
exclude_patterns = [
  "_build",
  "_ext",
  "Thumbs.db",
  ".DS_Store",
  "**/.ipynb_checkpoints",
]

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks are shown with their stored outputs; the test suite executes them.
nb_execution_mode = "off"
nb_merge_streams = True
# Outputs only a live Jupyter front end can show (e.g. widget progress bars)
# are left out of the HTML instead of failing the -W build.
suppress_warnings = ["mystnb.unknown_mime_type"]

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
# Keep JAX's typing aliases as names instead of their long Union expansion.
autodoc_type_aliases = {
  "ArrayLike": "jax.typing.ArrayLike",
  "DTypeLike": "jax.typing.DTypeLike",
}
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

intersphinx_mapping = {}  # no network during builds: keep offline

html_theme = "furo"
html_title = "weighted_accum"
html_static_path = []


def _alias_names(app, what, name, obj, options, signature, return_annotation):
  """Shows ``X | None`` of an aliased type as such: Sphinx prints the union
  of a type alias with None as ``TypeAliasForwardRef('X') | None``."""
  del app, what, name, obj, options
  fix = lambda s: s and re.sub(r"TypeAliasForwardRef\('([^']+)'\)", r"\1", s)
  return fix(signature), fix(return_annotation)


def setup(app):
  app.connect("autodoc-process-signature", _alias_names)
