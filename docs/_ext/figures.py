"""Figures at the content column's full width, each a link to its file.

A Markdown image (``![alt](path.png)``) is rendered by Sphinx at its
natural size, capped at the column's width: a wide multi-panel benchmark
figure becomes a small picture with no way to enlarge it. This extension
marks every image (the pages' figures and the notebooks' plots) with the
``wa-figure`` class and a width; the width makes Sphinx's HTML builder wrap
the image in a link to the full-size file (``html_scaled_image_link``, on
by default). ``_static/layout.css`` then sizes the class: a figure wider
than the content column fills it, a narrower one keeps its natural size
(never upscaled, so never blurred).
"""

from __future__ import annotations

from typing import Any

from docutils import nodes

FIGURE_CLASS = "wa-figure"


def mark_figures(doctree: nodes.Node) -> int:
  """Marks the images of one page; returns how many it marked.

  Args:
    doctree: the page's document tree, before the HTML builder runs.

  Returns:
    The number of images marked.
  """
  marked = 0
  for image in doctree.findall(nodes.image):
    if FIGURE_CLASS not in image["classes"]:
      image["classes"].append(FIGURE_CLASS)
    image.setdefault("width", "100%")
    marked += 1
  return marked


def _on_doctree_read(app: Any, doctree: nodes.document) -> None:
  del app
  mark_figures(doctree)


def setup(app: Any) -> dict[str, Any]:
  app.connect("doctree-read", _on_doctree_read)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
