"""Sphinx inventories written from ``docs/_inventories/objects.txt``.

intersphinx reads an ``objects.inv`` per project to turn ``optax.MultiSteps``
into a link to optax's page. Fetching those files needs the network, so the
objects these pages reference are listed by hand, each with its public URL,
in ``objects.txt``; this module writes one inventory per project from it at
the start of every build (the format: four header lines, then zlib-compressed
``name domain:role priority uri dispname`` lines). ``$`` in a URI of the list
stands for the name, anywhere in it (intersphinx expands only a final
``$``, so this module writes the URIs in full). See
``docs/_inventories/README.md``.
"""

from __future__ import annotations

import pathlib
import zlib


def read_objects(path: pathlib.Path) -> dict[str, list[tuple[str, str, str]]]:
  """project -> [(name, domain:role, uri)] from the curated list."""
  out: dict[str, list[tuple[str, str, str]]] = {}
  for n, line in enumerate(path.read_text().splitlines(), 1):
    line = line.strip()
    if not line or line.startswith("#"):  # a URI may hold "#": whole lines only
      continue
    parts = line.split()
    if len(parts) != 4 or ":" not in parts[1]:
      raise ValueError(
        f"{path}:{n}: want 'project domain:role name uri', got {line!r}"
      )
    project, role, name, uri = parts
    out.setdefault(project, []).append((name, role, uri))
  return out


def write_inventories(
  objects: pathlib.Path, outdir: pathlib.Path
) -> dict[str, pathlib.Path]:
  """Writes ``<project>.inv`` for each project of ``objects``; their paths."""
  outdir.mkdir(parents=True, exist_ok=True)
  paths = {}
  for project, entries in read_objects(objects).items():
    header = (
      "# Sphinx inventory version 2\n"
      f"# Project: {project}\n"
      "# Version: \n"
      "# The remainder of this file is compressed using zlib.\n"
    )
    body = "".join(
      f"{name} {role} 1 {uri.replace('$', name)} -\n"
      for name, role, uri in sorted(entries)
    )
    path = outdir / f"{project}.inv"
    path.write_bytes(header.encode() + zlib.compress(body.encode()))
    paths[project] = path
  return paths
