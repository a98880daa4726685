"""Checks that this environment holds exactly the declared dependency floors.

Every ``name>=floor`` of ``[project].dependencies`` in pyproject.toml must be
pinned as ``name==floor`` in ci/lower-bounds.txt, and installed at that
version; so the lower-bound CI run tests the floors users are promised. A
test-extra package pinned there (chex) must match its floor in the extras
(``test-core``, ``test``).
"""

import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _same(a: str | None, b: str) -> bool:
  """Equal release versions (``4.60`` == ``4.60.0``)."""
  key = lambda v: re.sub(r"(\.0+)+$", "", v.strip())
  return a is not None and key(a) == key(b)


def _floors(deps: list[str], strict: bool = True) -> dict[str, str] | None:
  """``{name: floor}`` of ``name>=floor`` requirements (None: one is not)."""
  out = {}
  for dep in deps:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)\s*", dep)
    if m:
      out[_norm(m.group(1))] = m.group(2)
    elif strict:
      print(f"pyproject.toml: {dep!r} has no plain '>=floor'")
      return None
  return out


def main() -> int:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  floors = _floors(project["dependencies"])
  if floors is None:
    return 1
  extras = project["optional-dependencies"]
  extra = _floors(extras["test-core"] + extras["test"], strict=False)
  pins = {}
  for line in (ROOT / "ci" / "lower-bounds.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, _, version = line.partition("==")
      pins[_norm(name)] = version.strip()
  bad = []
  floors.update({n: extra[n] for n in pins if n not in floors and n in extra})
  for name, floor in floors.items():
    if not _same(pins.get(name), floor):
      bad.append(
        f"{name}: pyproject floor {floor}, lower-bounds.txt pins "
        f"{pins.get(name)}"
      )
    installed = importlib.metadata.version(name)
    if not _same(installed, floor):
      bad.append(f"{name}: installed {installed}, floor {floor}")
  for line in bad:
    print("lower bounds:", line)
  if not bad:
    print("lower bounds:", ", ".join(f"{n}=={v}" for n, v in floors.items()))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
