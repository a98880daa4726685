"""The documentation site, built once as a reader gets it, then checked.

The build is the command README.md gives (warnings are errors; no network).
The checks read the rendered HTML, not the sources: signatures spelled with
public names, every internal link and anchor resolving, the landing page
orienting a new user, math served from the site. Links in the Markdown
sources are also checked as the repository view resolves them (a link into
a git-ignored build folder works in the site but not there).
"""

from __future__ import annotations

import fcntl
import html
from html.parser import HTMLParser
import os
import pathlib
import re
import subprocess
import sys
import urllib.parse

import pytest

import weighted_accum

ROOT = pathlib.Path(__file__).parents[2]
DOCS = ROOT / "docs"
SOURCES = [
  ROOT / "README.md",
  ROOT / "CONTRIBUTING.md",
  *DOCS.glob("*.md"),
  *DOCS.glob("recipes/*.md"),
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> pathlib.Path:
  """The built site; one build shared by the pytest-xdist workers."""
  shared = tmp_path_factory.getbasetemp().parent / "docs-site"
  shared.mkdir(exist_ok=True)
  out, done = shared / "html", shared / "built"
  with open(shared / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker builds, others wait
    if not done.exists():
      r = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q"]
        + ["-b", "html", "docs", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
      )
      done.write_text(f"{r.returncode}\n{r.stdout[-5000:]}{r.stderr[-10000:]}")
  code, _, log = done.read_text().partition("\n")
  assert code == "0", f"the docs build failed:\n{log}"
  return out


class _Page(HTMLParser):
  """The links, anchors, scripts and signature texts of one HTML page."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.hrefs, self.ids, self.scripts = [], set(), []
    self.signatures: list[str] = []
    self._sig_depth = 0
    self._text: list[str] = []

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    if "id" in a:
      self.ids.add(a["id"])
    if tag == "a" and "href" in a:
      self.hrefs.append(a["href"])
    if tag == "script" and a.get("src"):
      self.scripts.append(a["src"])
    if tag == "link" and a.get("href") and "stylesheet" in a.get("rel", ""):
      self.scripts.append(a["href"])
    if tag == "dt" and "sig" in a.get("class", "").split():
      self._sig_depth, self._text = 1, []
    elif self._sig_depth:
      self._sig_depth += tag not in ("br", "img", "wbr")

  def handle_endtag(self, tag):
    if self._sig_depth:
      self._sig_depth -= 1
      if self._sig_depth == 0:
        self.signatures.append(re.sub(r"\s+", " ", "".join(self._text)))

  def handle_data(self, data):
    if self._sig_depth:
      self._text.append(data)


def _pages(site: pathlib.Path) -> dict[pathlib.Path, _Page]:
  out = {}
  for path in sorted(site.rglob("*.html")):
    if "_modules" in path.parts:  # viewcode's source listings
      continue
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    out[path] = page
  return out


@pytest.fixture(scope="session")
def pages(site):
  return _pages(site)


def _api_pages(pages):
  return {p: v for p, v in pages.items() if p.parent.name == "api"}


def test_every_public_name_has_an_entry(site, pages):
  ids = set().union(*(p.ids for p in _api_pages(pages).values()))
  missing = [
    n
    for n in weighted_accum.__all__
    if f"weighted_accum.{n}" not in ids
    and f"module-weighted_accum.{n}" not in ids
  ]
  assert not missing, f"not in the API reference: {missing}"
  notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
  rendered = sorted(p.stem for p in (site / "notebooks").glob("*.html"))
  assert rendered == notebooks


def test_signatures_use_public_names(pages):
  bad = []
  for path, page in _api_pages(pages).items():
    for sig in page.signatures:
      text = sig.replace("¶", "").replace("[source]", "")
      private = [
        t
        for t in re.findall(r"[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+", text)
        if any(part.startswith("_") for part in t.split("."))
      ]
      if "<class '" in text or "~" in text or private:
        bad.append(f"{path.name}: {text}")
  assert not bad, "signatures with private or raw names:\n" + "\n".join(bad)


def test_no_raw_markup_or_reprs_in_the_api_reference(site):
  bad = []
  for path in sorted((site / "api").glob("*.html")):
    text = path.read_text(encoding="utf-8")
    body = html.unescape(re.sub(r"<[^>]+>", "", text))
    for needle in ("<class '", "``", "TypeAliasForwardRef", "jaxlib._jax"):
      if needle in body:
        i = body.index(needle)
        bad.append(f"{path.name}: {needle!r} in ...{body[i - 60 : i + 60]}...")
  assert not bad, "\n".join(bad)


def test_types_link_to_their_projects(site):
  text = (site / "api" / "optax.html").read_text(encoding="utf-8")
  for url in (
    "https://optax.readthedocs.io/en/latest/api/generated/"
    "optax.GradientTransformation.html#optax.GradientTransformation",
    "https://docs.jax.dev/en/latest/_autosummary/jax.Array.html#jax.Array",
  ):
    assert f'href="{url}"' in text, url


def test_every_internal_link_and_anchor_resolves(site, pages):
  broken = []
  for path, page in pages.items():
    for href in page.hrefs:
      parts = urllib.parse.urlsplit(href)
      if parts.scheme or href.startswith(("mailto:", "//")):
        continue
      target = (path.parent / urllib.parse.unquote(parts.path)).resolve()
      if not parts.path:
        target = path
      if target.is_dir():
        target = target / "index.html"
      if not target.exists():
        broken.append(f"{path.relative_to(site)}: {href}")
        continue
      frag = urllib.parse.unquote(parts.fragment)
      in_site = target.suffix == ".html" and target in pages
      if frag and in_site and frag not in pages[target].ids:
        broken.append(f"{path.relative_to(site)}: {href} (no such anchor)")
  assert not broken, "broken links:\n" + "\n".join(sorted(set(broken)))


def test_nothing_is_loaded_from_a_network(site, pages):
  remote = {
    f"{p.relative_to(site)}: {s}"
    for p, page in pages.items()
    for s in page.scripts
    if urllib.parse.urlsplit(s).scheme or s.startswith("//")
  }
  assert not remote, "\n".join(sorted(remote))
  index = (site / "index.html").read_text(encoding="utf-8")
  assert "_static/mathjax/tex-chtml.js" in index
  assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
  fonts = site / "_static" / "mathjax" / "output" / "chtml" / "fonts"
  assert any(fonts.rglob("*.woff"))


def test_landing_page_orients(site):
  text = (site / "index.html").read_text(encoding="utf-8")
  body = html.unescape(re.sub(r"<[^>]+>", "", text))
  readme = (ROOT / "README.md").read_text()
  install = re.search(r"^python3 -m venv .* -m weighted_accum$", readme, re.M)
  assert install and install.group(0) in body, "the README's install line"
  assert "pip install -q -e . " in install.group(0)  # the lean install
  assert "Python 3.11" in body
  # The chooser: one row per way of training, each linking to its guide.
  for row, page in (
    ("across steps", "optax.html"),
    ("functional", "functional.html"),
    ("in-step", "microbatching.html"),
    ("data parallel", "scaling.html"),
  ):
    assert row in body, row
    assert f'href="{page}' in text, page
  for page in ("quickstart", "choosing", "migration", "glossary"):
    assert f'href="{page}.html' in text, page
  # The guide's reading order in the navigation; maintainer notes apart.
  nav = re.search(r'class="sidebar-tree">(.*?)</div>', text, re.S).group(1)
  order = [
    re.sub(r"<[^>]+>", "", c)
    for c in re.findall(r'<p class="caption[^"]*"[^>]*>(.*?)</p>', nav, re.S)
  ]
  assert order[0] == "Guide" and "Internals" in order, order
  guide = re.findall(r'href="([\w/]+)\.html"', nav)
  assert guide[:3] == ["quickstart", "choosing", "migration"], guide
  assert guide.index("design") > guide.index("api/index")


# Markdown links: [text](target), not images.
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def _ignored(paths: list[pathlib.Path]) -> set[pathlib.Path]:
  r = subprocess.run(
    ["git", "check-ignore", "--no-index", "--stdin"],
    cwd=ROOT,
    input="\n".join(str(p) for p in paths),
    capture_output=True,
    text=True,
    check=False,
  )
  assert r.returncode in (0, 1), r.stderr
  return {pathlib.Path(line) for line in r.stdout.splitlines()}


def _in_code(text: str) -> list[tuple[int, int]]:
  return [m.span() for m in re.finditer(r"```.*?```|`[^`\n]+`", text, re.S)]


def _source_links():
  for page in SOURCES:
    text = page.read_text()
    code = _in_code(text)
    for m in _LINK.finditer(text):
      if any(a <= m.start() < b for a, b in code):
        continue
      yield page, m.group(1), m.group(2)


def test_source_links_resolve_on_the_repository_view():
  targets, broken = {}, []
  for page, _, href in _source_links():
    parts = urllib.parse.urlsplit(href)
    if parts.scheme or not parts.path:
      continue
    target = (page.parent / parts.path).resolve()
    if not target.exists():
      broken.append(f"{page.relative_to(ROOT)}: {href}")
    else:
      targets[target] = f"{page.relative_to(ROOT)}: {href}"
  ignored = _ignored(list(targets))
  broken += [f"{targets[t]} (git-ignored)" for t in targets if t in ignored]
  assert not broken, "links that the repository view cannot follow:\n" + (
    "\n".join(broken)
  )


def test_link_texts_are_not_file_names():
  bad = [
    f"{page.relative_to(ROOT)}: [{text}]({href})"
    for page, text, href in _source_links()
    if not urllib.parse.urlsplit(href).scheme  # a page of this project
    and re.fullmatch(r"`?[\w./-]+\.(md|rst|ipynb|py)`?", text)
  ]
  assert not bad, "name the page, not its file:\n" + "\n".join(bad)
