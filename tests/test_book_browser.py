"""The built book in a real browser (kvlib.publish.browser): Debian's Chromium through Playwright.

The checker is tested on small pages that carry one defect each (it must flag each) and on a clean page (it must
pass). `make test` runs this file again after building the ci book, with ``KVLIB_BOOK_HTML=_build/html``: then
``test_built_book_reads_in_a_browser`` loads every page of that build at 1400 px and 390 px."""

import os
from pathlib import Path

import pytest

from kvlib.publish import browser

# Skipped on a developer's machine without Chromium; never in CI, where .ci/run installs it (a missing browser
# is then a finding, and the test fails).
pytestmark = pytest.mark.skipif(not Path(browser.CHROMIUM).exists() and not os.environ.get("CI"),
                                reason="no Chromium (apt-get install -y chromium)")

HEAD = """<!doctype html><html><head><meta name="viewport" content="width=device-width, initial-scale=1">
<style>body { margin: 0; font: 16px sans-serif; } article { width: 300px; margin: 0 20px; }
td, th { padding: 4px; } .scroll { overflow-x: auto; }</style></head><body><main>
<article class="bd-article">"""
TAIL = "</article></main></body></html>"
PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")

CLEAN = """<h1>A page</h1><p>Short text.</p>
<table><tr><th>B</th><th>S</th></tr><tr><td>32</td><td>32,768</td></tr></table>
<div class="scroll"><table><tr><td>a_very_long_value_in_a_wide_table_that_scrolls_in_its_own_box</td></tr></table></div>
<img src="pixel.png">"""

DEFECTS = {
    "cell": ("<table style='table-layout: fixed; width: 200px'><tr><td style='width: 50px; overflow: hidden'>"
             "unbreakable_identifier_wider_than_its_cell</td><td>x</td></tr></table>", "overflows its cell"),
    "wide": ("<pre style='overflow: visible'>" + "x" * 120 + "</pre>", "wider than the text column"),
    "image": ("<img src='missing.png'>", "did not load"),
    "console": ("<script>console.error('boom')</script>", "console error: boom"),
    "exception": ("<script>undefined_function_called()</script>", "uncaught exception"),
    "mathjax": ("<mjx-container><mjx-merror>Undefined control sequence</mjx-merror></mjx-container>",
                "MathJax error"),
    "clipped": ("<div style='width: 60px; overflow: hidden'><mjx-container style='display: inline-block'>"
                "<mjx-math style='display: inline-block; width: 200px'>x</mjx-math></mjx-container></div>",
                "formula clipped"),
}


def _page(tmp_path, name, body):
    import base64

    (tmp_path / "pixel.png").write_bytes(base64.b64decode(PIXEL))
    p = tmp_path / f"{name}.html"
    p.write_text(HEAD + body + TAIL)
    return (name, p)


def test_the_checker_passes_a_clean_page_and_flags_each_defect(tmp_path):
    pages = [_page(tmp_path, "clean", CLEAN)] + [_page(tmp_path, k, CLEAN + b) for k, (b, _) in DEFECTS.items()]
    found = browser.check_pages(pages, screenshots=tmp_path / "shots")
    assert not [f for f in found if f.startswith("clean ")], found
    for k, (_, what) in DEFECTS.items():
        mine = [f for f in found if f.startswith(f"{k} ")]
        assert any(what in f for f in mine), (k, mine)
        # at both widths, and nothing else on the page is blamed for it
        assert {f.split("]")[0].split("[")[1] for f in mine if what in f} == {"desktop 1400px", "phone 390px"}
    assert (tmp_path / "shots" / "clean-phone.png").is_file()


@pytest.mark.skipif(not os.environ.get("KVLIB_BOOK_HTML"), reason="reads a built book (make test sets KVLIB_BOOK_HTML)")
def test_built_book_reads_in_a_browser():
    shots = os.environ.get("KVLIB_BOOK_SCREENSHOTS")
    found = browser.check_book(os.environ["KVLIB_BOOK_HTML"], screenshots=shots)
    assert not found, f"{len(found)} finding(s):\n" + "\n".join(found[:60])
