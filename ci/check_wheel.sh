#!/usr/bin/env bash
# The package as a user installs it: builds the sdist and, from it, the wheel
# (python -m build), checks what each holds, installs the wheel in a fresh
# virtual environment, then imports it and runs the demo from a
# directory outside the source tree (so the installed copy is what runs).
#
#   bash ci/check_wheel.sh [PYTHON]   # PYTHON has `build` (the test extra);
#                                     # default .venv/bin/python
#
# .ci/run runs it in the background, after the README's set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
start=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! "$py" -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1; then
  cat "$tmp/build.log"
  exit 1
fi
sdist=$(echo "$tmp"/dist/*.tar.gz)
wheel=$(echo "$tmp"/dist/*.whl)
echo "+ built $(basename "$sdist") and $(basename "$wheel")"

python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$wheel"
cd "$tmp"
"$tmp/venv/bin/python" - "$sdist" "$wheel" <<'PY'
import pathlib, sys, tarfile, zipfile
import weighted_accum as wa

sdist, wheel = sys.argv[1:]
names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
need = {"pyproject.toml", "README.md", "LICENSE", "weighted_accum/__init__.py",
        "weighted_accum/py.typed"}
assert need <= names, f"sdist lacks {sorted(need - names)}"
files = zipfile.ZipFile(wheel).namelist()
top = {f.split("/")[0] for f in files}
stray = {t for t in top if not t.startswith("weighted_accum")}
assert not stray, f"the wheel ships more than the package: {sorted(stray)}"
assert "weighted_accum/py.typed" in files, "the wheel lacks py.typed"
where = pathlib.Path(wa.__file__)
assert "site-packages" in where.parts, f"imported from {where}, not the wheel"
print(f"+ installed weighted_accum {wa.__version__} from the wheel: "
      f"{len(files)} files")
PY
"$tmp/venv/bin/python" -m weighted_accum
echo "+ wheel check: $((SECONDS - start))s"
