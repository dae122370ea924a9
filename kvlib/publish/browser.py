"""The built book in a real browser: every page at a desktop and a phone width, checked for what breaks layout.

Debian's Chromium (``/usr/bin/chromium``; ``.ci/run`` installs it) driven by Playwright for Python, which never
downloads a browser of its own here. Each page of the table of contents is loaded at each width, MathJax is given
time to typeset, and the page is measured in the browser (:data:`MEASURE`). A finding is one of:

- a table cell whose content overflows it (the cell's scroll width exceeds its box, or a child sticks out of it);
- an element wider than the text column that is not inside a box of its own that scrolls;
- the page itself scrolling sideways;
- a MathJax error, or a formula whose box is narrower than the formula (clipped or scrolled out of view);
- an image that did not load (or any file the page asks for that is missing);
- a console error or an uncaught exception in the page.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the browser; Playwright's own download is never used
CHROMIUM = os.environ.get("KVLIB_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-extensions", "--disable-sync", "--mute-audio", "--hide-scrollbars"]
#: (name, CSS width in px) of the viewports every page is checked at
WIDTHS = (("desktop", 1400), ("phone", 390))
#: slack (px) for sub-pixel rounding
SLACK = 1.5

# Runs in the page; returns a list of findings (strings). Kept in one place so a reader sees the whole rule.
MEASURE = r"""
(slack) => {
  const out = [];
  const art = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
  const col = art.getBoundingClientRect();
  const cs = (el) => getComputedStyle(el);
  const scrolls = (el) => ["auto", "scroll"].includes(cs(el).overflowX);
  const label = (el) => {
    let s = el.tagName.toLowerCase();
    if (el.id) s += "#" + el.id;
    const c = (typeof el.className === "string" ? el.className : "").trim().split(/\s+/).filter(Boolean)[0];
    if (c) s += "." + c;
    const t = (el.innerText || el.textContent || "").replace(/\s+/g, " ").trim().slice(0, 50);
    return t ? `${s} "${t}"` : s;
  };
  // a box between el and the article that scrolls sideways and itself fits the column
  const ownScrollBox = (el) => {
    for (let p = el.parentElement; p && p !== art; p = p.parentElement) {
      if (scrolls(p)) {
        const r = p.getBoundingClientRect();
        return r.left >= col.left - slack && r.right <= col.right + slack;
      }
    }
    return false;
  };
  const visible = (el) => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; };

  // 1. table cells whose content overflows them
  for (const cell of art.querySelectorAll("td, th")) {
    if (!visible(cell)) continue;
    const r = cell.getBoundingClientRect();
    if (cell.scrollWidth > cell.clientWidth + slack && cs(cell).overflowX !== "auto") {
      const by = Math.round(cell.scrollWidth - cell.clientWidth);
      out.push(`cell content overflows its cell by ${by} px: ${label(cell)}`);
      continue;
    }
    for (const k of cell.querySelectorAll("*")) {
      if (!visible(k) || k.closest("mjx-assistive-mml")) continue;  // MathJax's hidden copy for screen readers
      const kr = k.getBoundingClientRect();
      if ((kr.right > r.right + slack || kr.left < r.left - slack) && !ownScrollBoxWithin(k, cell)) {
        const by = Math.round(Math.max(kr.right - r.right, r.left - kr.left));
        out.push(`cell content sticks out of its cell by ${by} px: ${label(cell)}`);
        break;
      }
    }
  }
  function ownScrollBoxWithin(el, stop) {
    for (let p = el.parentElement; p && p !== stop; p = p.parentElement) if (scrolls(p)) return true;
    return false;
  }

  // 2. elements wider than the text column without a scroll box of their own (an element whose content spills out
  //    of it, overflow visible, is as wide as its content)
  const extent = (el) => {
    const r = el.getBoundingClientRect();
    const spill = cs(el).overflowX === "visible" && el.tagName !== "svg" ? el.scrollWidth - el.clientWidth : 0;
    return [r.left, r.right + Math.max(0, spill), r.width + Math.max(0, spill)];
  };
  const sticksOut = (el) => { const [l, rt] = extent(el); return rt > col.right + slack || l < col.left - slack; };
  for (const el of art.querySelectorAll("*")) {
    if (!visible(el) || el.closest("mjx-assistive-mml") || !sticksOut(el) || ownScrollBox(el)) continue;
    // report the outermost offender only
    const p = el.parentElement;
    if (p && p !== art && sticksOut(p) && !scrolls(p)) continue;
    const w = `${Math.round(extent(el)[2])} px, column ${Math.round(col.width)} px`;
    out.push(`wider than the text column (${w}) without its own scroll box: ${label(el)}`);
  }
  if (document.documentElement.scrollWidth > window.innerWidth + slack)
    out.push(`the page scrolls sideways (${document.documentElement.scrollWidth} px, window ${window.innerWidth} px)`);

  // 3. MathJax errors and clipped formulas
  for (const e of document.querySelectorAll("mjx-merror, .MathJax_Error, [data-mjx-error]"))
    out.push(`MathJax error: ${label(e.closest("mjx-container") || e)}`);
  // A formula is clipped when its drawn math extends past the nearest box that does not let it overflow. Display
  // formulas outside tables may scroll in their own block (as code does); a formula in a table cell may not.
  for (const math of art.querySelectorAll("mjx-container > mjx-math")) {
    const m = math.parentElement;
    if (!visible(math)) continue;
    const r = math.getBoundingClientRect();
    for (let p = m; p && p !== document.body; p = p.parentElement) {
      const o = cs(p).overflowX;
      if (o === "visible") continue;
      const pr = p.getBoundingClientRect();
      const displayBlock = !m.closest("td, th") && (p.matches("div.math, mjx-container[display='true']"));
      if (!displayBlock && (r.right > pr.right + slack || r.left < pr.left - slack))
        out.push(`formula clipped (${Math.round(r.width)} px of formula, ${Math.round(pr.width)} px of `
                 + `${label(p).split(" ")[0]}): ${label(m)}`);
      break;
    }
  }

  // 4. images that did not load
  for (const img of document.querySelectorAll("img")) {
    if (img.loading === "lazy") img.loading = "eager";
    if (img.complete && img.naturalWidth === 0) out.push(`image did not load: ${img.getAttribute("src")}`);
  }
  return out;
}
"""


def book_urls(html_root: Path) -> list[tuple[str, Path]]:
    """(page as the contents names it, built file) for every page of the table of contents."""
    from kvlib.publish.htmlcheck import book_pages

    return [(str(p.relative_to(html_root)), p) for p, _ in book_pages(html_root)]


def check_pages(pages: list[tuple[str, Path]], screenshots: Path | None = None, widths=WIDTHS,
                timeout_ms: int = 30000) -> list[str]:
    """Findings for every page at every width (empty: none); full-page PNGs into ``screenshots`` when given."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        return [f"no browser at {CHROMIUM} (Debian: apt-get install -y chromium)"]
    out: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            for wname, width in widths:
                ctx = browser.new_context(viewport={"width": width, "height": 900}, device_scale_factor=1)
                for name, path in pages:
                    shot = None if screenshots is None else screenshots / (
                        name.removesuffix(".html").replace("book/_render/", "").replace("/", "-") + f"-{wname}.png")
                    out += [f"{name} [{wname} {width}px]: {f}" for f in _check_one(ctx, path, shot, timeout_ms)]
                ctx.close()
        finally:
            browser.close()
    return list(dict.fromkeys(out))


def _check_one(ctx, path: Path, shot: Path | None, timeout_ms: int) -> list[str]:
    if not path.exists():
        return ["page missing from the build"]
    page = ctx.new_page()
    found: list[str] = []
    page.on("console", lambda m: found.append(f"console {m.type}: {m.text[:200]}") if m.type == "error" else None)
    page.on("pageerror", lambda e: found.append(f"uncaught exception: {str(e)[:200]}"))
    page.on("requestfailed", lambda r: found.append(f"failed to load {r.url.rsplit('/', 1)[-1]}: {r.failure}"))
    try:
        page.goto(path.resolve().as_uri(), wait_until="load", timeout=timeout_ms)
        # MathJax typesets after load; wait for it (a page without math has no MathJax object)
        page.evaluate("""async () => {
            if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
            for (const img of document.images)
                if (!img.complete) await new Promise(r => { img.onload = img.onerror = r; });
        }""")
        # MathJax's text holds lone surrogates (math alphanumerics split in two): make each finding printable
        found += [f.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                  for f in page.evaluate(MEASURE, SLACK)]
        if shot is not None:
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
    except Exception as e:  # noqa: BLE001 - a page that cannot be measured is a finding, the others still run
        found.append(f"could not check the page: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    finally:
        page.close()
    return found


def check_book(html_root: str | Path = "_build/html", screenshots: str | Path | None = None) -> list[str]:
    from kvlib.publish.provenance import repo_root

    root = Path(html_root)
    root = root if root.is_absolute() else repo_root() / root
    if not (root / "index.html").exists():
        return [f"{root}: no built book here (run python -m kvlib.publish build first)"]
    return check_pages(book_urls(root), Path(screenshots) if screenshots else None)
