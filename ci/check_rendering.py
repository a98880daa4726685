"""Renders the documentation at 1280 px in headless Chromium and checks that
no table or figure overflows the content column.

  .venv/bin/python ci/check_rendering.py                 # build, then check
  .venv/bin/python ci/check_rendering.py --html DIR      # an existing build
  .venv/bin/python ci/check_rendering.py --pages choosing performance
  .venv/bin/python ci/check_rendering.py --shots /tmp/shots   # + screenshots

Needs ``chromium`` (Debian: ``apt-get install chromium``) and the ``docs``
extra. For each page it writes a copy of the built HTML with a small
measuring script appended, loads it at a 1280 x 2400 window with
``chromium --headless --dump-dom`` (no DevTools protocol, no extra Python
package) and reads the script's report back from the dumped DOM. A page
fails when:

- a table is wider than its wrapper (the reader would have to scroll it
  sideways, or it is cut off at the column's edge), or a table or figure
  ends right of the content column (by more than 8 px: furo's table
  wrapper pads 0.2 rem past the column on every page);
- a figure (``article img``) is shown narrower than 90% of the column while
  its file is wider (a thumbnail), or is not a link to its full-size file.

Exit status 0 when every page passes; 1 otherwise (each finding printed);
2 when Chromium or the build is unavailable.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1280, 2400
SKIP = {"genindex", "search", "py-modindex"}
MARK = "WA_RENDER_REPORT"

# Runs after the page (and its images) loaded; writes a JSON report into
# the DOM, which --dump-dom prints.
_MEASURE = """
<script>
window.addEventListener("load", function () {
  var findings = [], tables = 0, figures = 0;
  var article = document.querySelector("article") || document.body;
  var col = article.getBoundingClientRect();
  function where(el) {
    var s = el.closest("section");
    return s && s.id ? "#" + s.id : "(top)";
  }
  document.querySelectorAll("article table").forEach(function (t) {
    tables++;
    var wrap = t.closest(".table-wrapper") || t.parentElement;
    var r = t.getBoundingClientRect();
    if (wrap.scrollWidth > wrap.clientWidth + 1)
      findings.push("table in " + where(t) + " is " + Math.round(r.width) +
        " px wide in a " + wrap.clientWidth + " px wrapper (scrolls sideways)");
    else if (r.right > col.right + SLACK)
      findings.push("table in " + where(t) + " ends at " + Math.round(r.right)
        + " px, past the column's edge at " + Math.round(col.right) + " px");
  });
  document.querySelectorAll("article img").forEach(function (img) {
    if (img.closest(".sidebar-logo, .headerlink")) return;
    figures++;
    var r = img.getBoundingClientRect(), name = img.getAttribute("src");
    if (r.right > col.right + SLACK)
      findings.push("figure " + name + " ends past the column's edge");
    if (img.naturalWidth > r.width + 1 && r.width < 0.9 * col.width)
      findings.push("figure " + name + " shown " + Math.round(r.width) +
        " px wide of " + img.naturalWidth + " px in a " +
        Math.round(col.width) + " px column (a thumbnail)");
    var link = img.closest("a");
    if (!link || !link.getAttribute("href"))
      findings.push("figure " + name + " is not a link to its full size");
  });
  var pre = document.createElement("pre");
  pre.id = "MARK";
  pre.textContent = JSON.stringify({
    column: Math.round(col.width), tables: tables, figures: figures,
    findings: findings});
  document.body.appendChild(pre);
});
</script>
""".replace("MARK", MARK).replace("SLACK", "8")


def chromium() -> str | None:
  for name in ("chromium", "chromium-browser", "google-chrome"):
    if path := shutil.which(name):
      return path
  return None


def build(out: pathlib.Path) -> None:
  subprocess.run(
    [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q"]
    + ["-b", "html", "docs", str(out)],
    cwd=ROOT,
    check=True,
  )


def _browser(browser: str, *args: str) -> str:
  return subprocess.run(
    [browser, "--headless", "--no-sandbox", "--disable-gpu"]
    + ["--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}"]
    + ["--virtual-time-budget=10000", *args],
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  ).stdout


def measure(browser: str, page: pathlib.Path) -> dict:
  """The report of one built page, measured at 1280 px."""
  probe = page.with_name(page.stem + ".wa-render-check.html")
  text = page.read_text(encoding="utf-8")
  probe.write_text(text.replace("</body>", _MEASURE + "</body>", 1), "utf-8")
  try:
    dom = _browser(browser, "--dump-dom", probe.as_uri())
  finally:
    probe.unlink()
  found = re.search(rf'<pre id="{MARK}">(.*?)</pre>', dom, re.S)
  if not found:
    return {"findings": ["no report: the page did not finish loading"]}
  raw = found.group(1)
  for entity, char in (("&quot;", '"'), ("&lt;", "<"), ("&gt;", ">")):
    raw = raw.replace(entity, char)
  return json.loads(raw.replace("&amp;", "&"))


def pages(html: pathlib.Path, names: list[str] | None) -> list[pathlib.Path]:
  if names:
    return [html / f"{n}.html" for n in names]
  found = [
    p
    for p in sorted(html.rglob("*.html"))
    if p.stem not in SKIP
    and not p.relative_to(html).parts[0].startswith("_")
    and not p.stem.endswith(".wa-render-check")
  ]
  return found


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--html", type=pathlib.Path, help="an existing build")
  parser.add_argument("--pages", nargs="*", help="page names, e.g. choosing")
  parser.add_argument("--shots", type=pathlib.Path, help="save screenshots")
  args = parser.parse_args(argv)
  browser = chromium()
  if browser is None:
    print("chromium not found (apt-get install chromium)", file=sys.stderr)
    return 2
  with tempfile.TemporaryDirectory() as tmp:
    html = args.html
    if html is None:
      html = pathlib.Path(tmp) / "html"
      try:
        build(html)
      except subprocess.CalledProcessError:
        print("the docs build failed", file=sys.stderr)
        return 2
    failed = 0
    for page in pages(html, args.pages):
      name = page.relative_to(html).with_suffix("").as_posix()
      report = measure(browser, page)
      if args.shots:
        args.shots.mkdir(parents=True, exist_ok=True)
        shot = args.shots / (name.replace("/", "_") + ".png")
        _browser(browser, f"--screenshot={shot}", page.as_uri())
      findings = report.get("findings", [])
      failed += bool(findings)
      print(
        f"{'FAIL' if findings else 'ok  '} {name}: "
        f"{report.get('tables', '?')} tables, "
        f"{report.get('figures', '?')} figures, "
        f"column {report.get('column', '?')} px"
      )
      for f in findings:
        print(f"       {f}")
  print(f"{failed} page(s) with findings at {WIDTH} px" if failed else "ok")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
