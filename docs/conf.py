"""Sphinx configuration for the weighted_accum documentation.

Build locally (warnings are errors, as in CI):

  .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

The build needs no network:

- The notebooks in ``notebooks/`` are rendered from their stored outputs
  (never re-executed); they are copied into ``docs/notebooks/`` (git-ignored)
  at each build so that new notebooks appear without editing this file.
  Pages link to them as ``../notebooks/NAME.ipynb``, the path that works on
  the repository view; the build points those links at the rendered copy.
- Math is rendered by MathJax served from the built site
  (``sphinx-mathjax-offline`` copies it into ``_static/mathjax``).
- Links to jax, optax, flax, orbax, numpy and Python objects come from small
  inventories kept in ``docs/_inventories/`` (see its README.md for how to
  regenerate them), not from the projects' sites.
- The API reference (``docs/api/``) is grouped by topic by ``_ext/api_all.py``,
  which fails the build when a name of ``weighted_accum.__all__`` is on no
  page; ``_ext/wa_signatures.py`` shows its signatures with public names.
"""

import os
import pathlib
import re
import shutil
import sys
import tempfile
import tomllib

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

import inventories  # noqa: E402  (docs/_ext, after sys.path is set)

import weighted_accum  # noqa: E402

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
  "sphinx-mathjax-offline",  # MathJax 3 files copied into the built site
  "sphinx.ext.viewcode",
  "api_all",  # the API reference by topic, checked against __all__
  "wa_signatures",  # public names in signatures and docstrings
  "figures",  # figures full-width, each a link to its full-size file
]

source_suffix = {
  ".rst": "restructuredtext",
  ".md": "myst-nb",
  ".ipynb": "myst-nb",
}
exclude_patterns = [
  "_build",
  "_ext",
  "_inventories",
  "_templates",
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

autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
# Defaults as written in the source (``jnp.float32``), not their repr.
autodoc_preserve_defaults = True
# Keep JAX's typing aliases as names instead of their long Union expansion.
autodoc_type_aliases = {
  "ArrayLike": "jax.typing.ArrayLike",
  "DTypeLike": "jax.typing.DTypeLike",
}
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Served from the built site (copied there by sphinx-mathjax-offline): no CDN.
mathjax_path = "mathjax/tex-chtml.js"

# Each project's public URL, with an inventory written at each build from the
# curated docs/_inventories/objects.txt (see its README.md): links to these
# projects' pages without fetching anything.
_INVENTORIES = inventories.write_inventories(
  DOCS / "_inventories" / "objects.txt",
  pathlib.Path(tempfile.mkdtemp(prefix="wa-inventories-")),
)
_SITES = {
  "python": "https://docs.python.org/3/",
  "numpy": "https://numpy.org/doc/stable/",
  "jax": "https://docs.jax.dev/en/latest/",
  "optax": "https://optax.readthedocs.io/en/latest/",
  "flax": "https://flax.readthedocs.io/en/latest/",
  "orbax": "https://orbax.readthedocs.io/en/latest/",
}
intersphinx_mapping = {
  name: (url, str(_INVENTORIES[name]))
  for name, url in _SITES.items()
  if name in _INVENTORIES
}
# Every type in a signature and every cross-reference must resolve: a new
# external type needs a line in docs/_inventories/objects.txt.
nitpicky = True
# AccumState.placement's type is described in AccumState's docstring (a
# named tuple read as data); it is not a public name of its own.
nitpick_ignore = [
  ("py:class", "Placement"),
  ("py:class", "weighted_accum._src.planning.packing.Packed"),
  ("py:class", "weighted_accum._src.core.base.Placement"),
]

html_theme = "furo"
html_title = "weighted_accum"
# Wide tables wrap (or scroll), figures span the column: checked at 1280 px
# by ci/check_rendering.py.
html_static_path = ["_static"]
html_css_files = ["layout.css"]
_URLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get(
  "urls", {}
)
html_theme_options = {}
html_context = {"repository_url": _URLS.get("Repository")}
templates_path = ["_templates"]
# The repository link sits under the site's title (sidebar/repository.html).
html_sidebars = {
  "**": [
    "sidebar/brand.html",
    "sidebar/repository.html",
    "sidebar/search.html",
    "sidebar/scroll-start.html",
    "sidebar/navigation.html",
    "sidebar/scroll-end.html",
  ]
}
if "Repository" in _URLS:  # "view source" / "edit" on every page, as on GitHub
  _REPO = _URLS["Repository"].rstrip("/")
  html_theme_options.update(
    source_view_link=f"{_REPO}/blob/main/docs/{{filename}}",
    source_edit_link=f"{_REPO}/edit/main/docs/{{filename}}",
    top_of_page_buttons=["view", "edit"],
    footer_icons=[
      {"name": "Repository", "url": _REPO, "html": "Source", "class": ""}
    ],
  )

# ../notebooks/NAME.ipynb (the path on the repository view) -> the copy.
_NOTEBOOK_LINK = re.compile(r"\]\(\.\./notebooks/([\w.-]+\.ipynb)")


def _notebook_links(app, docname, source):
  del app
  if not docname.startswith("notebooks/"):
    source[0] = _NOTEBOOK_LINK.sub(r"](notebooks/\1", source[0])


def setup(app):
  app.connect("source-read", _notebook_links)
