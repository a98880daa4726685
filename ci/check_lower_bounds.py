"""Checks that this environment holds exactly the declared dependency floors.

Every ``name>=floor`` of ``[project].dependencies`` in pyproject.toml must be
pinned as ``name==floor`` in ci/lower-bounds.txt, and installed at that
version; so the lower-bound CI run tests the floors users are promised.
"""

import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "dependencies"]
  floors = {}
  for dep in deps:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)\s*", dep)
    if not m:
      print(f"pyproject.toml: {dep!r} has no plain '>=floor'")
      return 1
    floors[_norm(m.group(1))] = m.group(2)
  pins = {}
  for line in (ROOT / "ci" / "lower-bounds.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, _, version = line.partition("==")
      pins[_norm(name)] = version.strip()
  bad = []
  for name, floor in floors.items():
    if pins.get(name) != floor:
      bad.append(f"{name}: pyproject floor {floor}, lower-bounds.txt pins "
                 f"{pins.get(name)}")
    installed = importlib.metadata.version(name)
    if installed != floor:
      bad.append(f"{name}: installed {installed}, floor {floor}")
  for line in bad:
    print("lower bounds:", line)
  if not bad:
    print("lower bounds:", ", ".join(f"{n}=={v}" for n, v in floors.items()))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
