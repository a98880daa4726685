"""The Markdown sources read as prose: no paragraph broken mid-sentence by a
stray blank line (a line ending without punctuation, a blank line, then a
line that starts in lowercase renders as two paragraphs, the second one
starting mid-sentence)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
SOURCES = sorted(
  [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
  + list((ROOT / "docs").rglob("*.md"))
)
SOURCES = [p for p in SOURCES if "_build" not in p.parts]

#: A line (its indentation stripped) that is not running prose: a heading,
#: a table row, a quote, a MyST directive or target, an HTML comment or tag,
#: a math block, a fence, a rule. Lines indented by 4 spaces or more are
#: not read (indented code; a nested list's text).
_NOT_PROSE = re.compile(r"^(#|\||>|:|\(.*\)=$|<|\$\$|\{|```|~~~|---|===)")
#: A list item's marker: the item's text follows it.
_ITEM = re.compile(r"^([-*+]|\d+[.)]) +")
#: A sentence or clause may end there: punctuation, a closing bracket or
#: quote after it, or markup that ends a block (a colon introduces one).
_ENDS = re.compile(r"""[.!?:;,]["')\]*_`]*$|[)\]]$|\*\*$|\$\$$""")


def _prose_lines(text: str) -> list[tuple[int, str]]:
  """``(line number, line)`` of the lines outside code fences and math
  blocks, blank lines kept (as ``""``)."""
  out, fence = [], None
  for n, line in enumerate(text.splitlines(), 1):
    stripped = line.strip()
    opening = re.match(r"^\s*(`{3,}|~{3,}|:{3,})", line)
    if fence is None:
      fence = opening.group(1) if opening else None
      out.append((n, "```" if opening else line.rstrip()))
    elif stripped.startswith(fence[0] * len(fence)) and not stripped.strip(
      fence[0]
    ):
      fence = None
  return out


def broken_paragraphs(text: str) -> list[int]:
  """Line numbers of the blank lines that cut a sentence in two."""
  lines = _prose_lines(text)
  found = []
  for (_, a), (n, blank), (_, b) in zip(lines, lines[1:], lines[2:]):
    if any(x.startswith(("    ", "\t")) for x in (a, b)):
      continue  # an indented code block (or a nested list's text)
    a, b = _ITEM.sub("", a.strip()), b.strip()
    if blank or not a or not b or _ITEM.match(b):
      continue  # a new list item starts a new block
    if _NOT_PROSE.match(a) or _NOT_PROSE.match(b) or _ENDS.search(a):
      continue
    if b[0].islower() or b[0] == "`":  # the sentence goes on
      found.append(n)
  return found


def test_no_paragraph_is_broken_by_a_stray_blank_line():
  broken = {
    str(p.relative_to(ROOT)): lines
    for p in SOURCES
    if (lines := broken_paragraphs(p.read_text()))
  }
  assert not broken, f"a blank line inside a sentence (file: lines): {broken}"


def test_the_check_finds_a_break_and_passes_prose():
  broken = "The window closes when\n\nthe last microbatch is added.\n"
  assert broken_paragraphs(broken) == [2]
  in_item = "- **Saved**: with\n\n  `wa.checkpoint.AccumSave(state)`.\n"
  assert broken_paragraphs(in_item) == [2]
  fine = [
    "Ends a sentence.\n\nnext starts lowercase (a name).\n",
    "A list:\n\n- one\n- two\n",
    "Code follows\n\n```python\nx = 1\n```\n",
    "```text\nno stop here\n\nlowercase\n```\n",
    "| a | b |\n\nlowercase after a table\n",
    "so\n\n    t = 2 a\n\nwhere t is the time.\n",
    "- an item\n\n- another item\n",
  ]
  for text in fine:
    assert not broken_paragraphs(text), text
