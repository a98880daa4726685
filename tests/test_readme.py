"""README.md: the set-up commands CI runs, and the quickstart really runs."""

import pathlib
import re

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()


def test_two_setup_commands_first_and_ci_runs_the_test_one():
  block = re.search(r"## Set up\s+```bash\n(.*?)```", README, re.S).group(1)
  lines = block.strip().splitlines()
  assert len(lines) == 2
  assert lines[0].endswith("-m weighted_accum") and "pytest" in lines[1]
  ci = (pathlib.Path(__file__).parent.parent / ".ci" / "run").read_text()
  assert "grep -m1 -E '^python3 -m venv .* -m pytest' README.md" in ci
  assert re.search(r"^python3 -m venv .* -m pytest.*$", README, re.M).group(0) \
      == lines[1]


def test_quickstart_runs(capsys):
  section = README.split("<!-- BEGIN quickstart -->")[1].split(
      "<!-- END quickstart -->")[0]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(code, "README quickstart", "exec"), {})  # pylint: disable=exec-used
  assert capsys.readouterr().out.strip() == "3 0.0"
