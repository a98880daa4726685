#!/usr/bin/env bash
# Formats and lint-fixes the whole repository with the project's ruff
# configuration (pyproject.toml). Run from anywhere; uses .venv if present.
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
"$py" -m ruff format .
"$py" -m ruff check --fix .
"$py" -m ruff format .   # --fix may re-order imports; keep the format stable
"$py" -m ruff check .
"$py" -m ruff format --check .
