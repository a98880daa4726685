"""The docs' layout rules for wide tables and figures, checked without a
browser (``ci/check_rendering.py`` checks the rendered pages at 1280 px in
headless Chromium; this pins the rules and markup it relies on).
"""

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
DOCS = ROOT / "docs"
CSS = DOCS / "_static" / "layout.css"


def _rules(css: str) -> dict[str, dict[str, str]]:
  """``{selector: {property: value}}`` of a flat stylesheet (no @media)."""
  css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
  rules: dict[str, dict[str, str]] = {}
  for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css):
    decls = dict(
      (k.strip(), v.strip())
      for k, v in (d.split(":", 1) for d in body.split(";") if ":" in d)
    )
    for sel in selectors.split(","):
      rules.setdefault(" ".join(sel.split()), {}).update(decls)
  return rules


@pytest.fixture(scope="module")
def rules():
  return _rules(CSS.read_text())


def test_the_stylesheet_is_served():
  conf = (DOCS / "conf.py").read_text()
  assert re.search(r'^html_static_path = \["_static"\]$', conf, re.M)
  assert re.search(r'^html_css_files = \["layout.css"\]$', conf, re.M)
  assert '"figures",' in conf  # docs/_ext/figures.py


def test_table_cells_and_their_code_wrap(rules):
  for cell in ("article table.docutils td", "article table.docutils th"):
    assert rules[cell]["overflow-wrap"] in ("break-word", "anywhere")
  for code in (
    "article table.docutils code.literal",
    "article table.docutils span.pre",
  ):
    assert rules[code]["white-space"] == "normal"
    assert rules[code]["overflow-wrap"] == "anywhere"
  assert rules["article table.docutils"]["max-width"] == "100%"


def test_a_table_that_cannot_fit_scrolls_in_its_wrapper(rules):
  wrapper = rules['[role="main"] .table-wrapper.container']
  assert wrapper["overflow-x"] == "auto"


def test_figures_fill_the_column_and_are_never_upscaled(rules):
  img = rules["article img.wa-figure"]
  assert img["max-width"] == "100%"
  # auto beats the inline width Sphinx writes (the one that adds the link).
  assert img["width"] == "auto !important"
  assert img["height"] == "auto !important"
  assert rules["article a.wa-figure"]["display"] == "block"


def test_every_image_becomes_a_link_to_its_full_size_file(tmp_path):
  """A one-page Sphinx build with the extension: the image is wrapped in a
  link to the copied file and carries the class the stylesheet sizes."""
  sphinx_app = pytest.importorskip("sphinx.application")
  src = tmp_path / "src"
  src.mkdir()
  (src / "conf.py").write_text(
    f"import sys\nsys.path.insert(0, {str(DOCS / '_ext')!r})\n"
    "extensions = ['figures']\n"
  )
  (src / "wide.png").write_bytes((DOCS.parent / _a_png()).read_bytes())
  (src / "index.rst").write_text("Page\n====\n\n.. image:: wide.png\n")
  app = sphinx_app.Sphinx(
    str(src),
    str(src),
    str(tmp_path / "out"),
    str(tmp_path / "doctrees"),
    "html",
    status=None,
    warningiserror=True,
  )
  app.build()
  html = (tmp_path / "out" / "index.html").read_text()
  link = re.search(r'<a class="([^"]*)" href="([^"]*)"><img ([^>]*)>', html)
  assert link, html
  assert "wa-figure" in link.group(1) and link.group(2) == "_images/wide.png"
  assert 'class="wa-figure"' in link.group(3)


def _a_png() -> str:
  """A figure of the repository (the benchmark plot the docs show)."""
  found = sorted((ROOT / "benchmarks" / "results").glob("*.png"))
  assert found, "no benchmark figure in benchmarks/results/"
  return str(found[0].relative_to(ROOT))


def test_the_rendering_check_measures_tables_and_figures():
  sys.path.insert(0, str(ROOT / "ci"))
  try:
    import check_rendering  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(ROOT / "ci"))
  script = check_rendering._MEASURE  # pylint: disable=protected-access
  assert (check_rendering.WIDTH, check_rendering.HEIGHT) == (1280, 2400)
  for probe in ("article table", "scrollWidth", "article img", "naturalWidth"):
    assert probe in script
  assert "ci/check_rendering.py" in (ROOT / "CONTRIBUTING.md").read_text()
