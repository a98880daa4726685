"""README.md, docs/*.md and docs/recipes/*.md: the set-up commands CI runs,
and every example runs.

Convention for examples in README.md, docs/*.md and docs/recipes/*.md
(Markdown):

- A marked region ``<!-- BEGIN name -->`` ... ``<!-- END name -->`` is one
  test: its ```` ```python ```` blocks run in order, in one fresh namespace,
  in a temporary working directory.
- A line of such a block that starts with ``print(`` (indented or not) and
  ends with a comment
  (``print(x)  # 3 0.0``) states that print's output: the region's captured
  stdout must be exactly these comments, line by line, in order.
- Every ```` ```python ```` block of these files lies inside a marked
  region, so no example can rot; or the page is executed by its own test
  module (one that names the page's file, e.g. ``"docs" / "inputs.md"``). A
  block that cannot run here (e.g. it needs several hosts) is preceded by the
  line ``<!-- not executed: why -->``.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
PAGES = [
  ROOT / "README.md",
  *sorted((ROOT / "docs").glob("*.md")),
  *sorted((ROOT / "docs" / "recipes").glob("*.md")),
]

_REGION = re.compile(r"<!-- BEGIN (\S+) -->\n(.*?)<!-- END \1 -->", re.S)
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_EXPECTED = re.compile(r"^[ \t]*print\(.*\)\s+#\s?(.*?)\s*$", re.M)
_SKIP = re.compile(r"<!-- not executed: [^>]+ -->\n```python\n")


def _regions():
  for page in PAGES:
    text = page.read_text()
    for m in _REGION.finditer(text):
      rel = page.relative_to(ROOT).as_posix()
      yield pytest.param(
        rel, m.group(1), _BLOCK.findall(m.group(2)), id=f"{rel}::{m.group(1)}"
      )


REGIONS = list(_regions())


def test_two_setup_commands_first_and_ci_runs_the_test_one():
  section = README.split("## Set up", 1)[1]
  block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
  lines = block.strip().splitlines()
  assert len(lines) == 2
  # The first is the lean install (the package alone) that runs the demo.
  assert lines[0] == (
    "python3 -m venv .venv && .venv/bin/pip install -q -e . "
    "&& .venv/bin/python -m weighted_accum"
  )
  assert "pytest" in lines[1]
  assert re.search(r"Python 3\.11 or later", section.split("```")[0])
  ci = (ROOT / ".ci" / "run").read_text()
  assert "grep -m1 -E '^python3 -m venv .* -m pytest' README.md" in ci
  assert (
    re.search(r"^python3 -m venv .* -m pytest.*$", README, re.M).group(0)
    == lines[1]
  )


def test_readme_is_at_most_8_kb():
  assert len((ROOT / "README.md").read_bytes()) <= 8 * 1024


def test_readme_has_a_quickstart_and_shows_how_to_build_the_docs():
  assert any(r.values[:2] == ("README.md", "quickstart") for r in REGIONS)
  assert re.search(
    r"^.*-m sphinx -W --keep-going -b html docs .*$", README, re.M
  )


def _run_by_own_test(page: pathlib.Path) -> bool:
  """Whether a test module other than this one names the page's file."""
  return page.parent.name == "docs" and any(
    page.name in t.read_text()
    for t in (ROOT / "tests").rglob("test_*.py")
    if t.name != pathlib.Path(__file__).name
  )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_example_is_executed(page):
  text = page.read_text()
  covered = sum(len(_BLOCK.findall(m.group(2))) for m in _REGION.finditer(text))
  skipped = len(_SKIP.findall(text))
  total = len(_BLOCK.findall(text))
  if covered + skipped < total:
    assert _run_by_own_test(page), (
      f"{page.name}: {total - covered - skipped} ```python block(s) outside "
      "a <!-- BEGIN name --> ... <!-- END name --> region, and no test "
      "module names the page (see this test module's docstring)"
    )


def test_regions_are_well_formed():
  for page in PAGES:
    text = page.read_text()
    begins = re.findall(r"<!-- BEGIN (\S+) -->", text)
    ends = re.findall(r"<!-- END (\S+) -->", text)
    assert begins == ends, page.name
    assert len(set(begins)) == len(begins), f"{page.name}: duplicate names"
    assert len(_REGION.findall(text)) == len(begins), page.name


@pytest.mark.parametrize("page,name,blocks", REGIONS)
def test_example_runs(page, name, blocks, capsys, tmp_path, monkeypatch):
  assert blocks, f"{page}::{name} has no ```python block"
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": f"docs_example_{name}"}
  for i, code in enumerate(blocks):
    exec(compile(code, f"{page}::{name}[{i}]", "exec"), namespace)  # pylint: disable=exec-used
  expected = [e for code in blocks for e in _EXPECTED.findall(code)]
  assert capsys.readouterr().out.splitlines() == expected
