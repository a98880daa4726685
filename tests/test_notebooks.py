"""Executes every notebook in notebooks/ (their cells assert their claims)."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted(
  (pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb")
)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    timeout=300,
    kernel_name="python3",
    resources={"metadata": {"path": str(path.parent)}},
  )
  client.execute()
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert not errors
