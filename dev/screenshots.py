"""Screenshots of the built book's pages in headless Chromium, as a reader's browser draws them.

The HTML test (`kvlib.publish.htmlcheck`) reads the markup; this looks at the rendering (typeset math, figure
sizes, tables that overflow), which only a browser shows. Needs Debian's chromium (`apt-get install chromium`).

    python -m dev.screenshots                       # every page of _build/html/book -> /tmp/kvlib_shots/*.png
    python -m dev.screenshots --pages rlvr/grpo claims --height 6000

The flags are those this workplace's notes give for a root, offline, headless Chromium (no sandbox, no
background networking, a fresh profile).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def shoot(page: Path, out: Path, width: int, height: int, browser: str) -> bool:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
               "--virtual-time-budget=15000",  # let MathJax typeset before the shot
               f"--screenshot={out}", page.resolve().as_uri()]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and out.is_file()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", default="_build/html", help="the built book (default: _build/html)")
    ap.add_argument("--pages", nargs="*", default=None,
                    help="pages under book/ without .html (default: all)")
    ap.add_argument("--out", default="/tmp/kvlib_shots")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=4000)
    ap.add_argument("--browser", default=shutil.which("chromium") or "chromium")
    a = ap.parse_args(argv)
    if not Path(a.browser).exists() and not shutil.which(a.browser):
        raise SystemExit(f"--browser: {a.browser!r} not found (apt-get install chromium)")
    root = Path(a.html) / "book"
    if not root.is_dir():
        raise SystemExit(f"--html: {root} is not a built book (run `make book`)")
    pages = ([root / f"{p}.html" for p in a.pages] if a.pages else sorted(root.rglob("*.html")))
    missing = [p for p in pages if not p.is_file()]
    if missing:
        raise SystemExit(f"--pages: not built: {', '.join(map(str, missing))}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for p in pages:
        png = out / (str(p.relative_to(root).with_suffix("")).replace("/", "__") + ".png")
        ok = shoot(p, png, a.width, a.height, a.browser)
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {png}")
    print(f"{len(pages) - bad}/{len(pages)} pages shot into {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
