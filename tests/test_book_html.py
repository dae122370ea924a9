"""The built book read back as a reader meets it (kvlib.publish.htmlcheck).

`make test` runs this file again after building the ci book, with ``KVLIB_BOOK_HTML=_build/html``: then
``test_built_book_has_nothing_a_reader_must_not_see`` reads every page of that build. In the unit-test pass
(before any build) that test is skipped, and the checker itself is tested on small pages it must flag."""

import os
from pathlib import Path

import pytest

from kvlib.publish.htmlcheck import check_book, check_page

CLEAN = """<html><body><main>
<h1>Page</h1><p>Speed-up 1.5x over 4096 nanoseconds; n/a where over budget.</p>
<div class="cell_input"><pre>x = np.nan  # code, not a value</pre></div>
<p>The IEEE value <code>NaN</code> stays <code>NaN</code>.</p>
<h2>Paper vs this run</h2><img src="fig.png">
<table><caption>Step time per shape (ms)</caption><thead><tr><th></th><th>ms</th></tr>
<tr><th>shape</th><th></th></tr></thead><tbody><tr><th>(8, 64)</th><td>1.5</td></tr></tbody></table>
<table><caption>Verdicts</caption><thead><tr><th>claim</th></tr></thead><tbody><tr><td>3.1</td></tr></tbody></table>
</main>
<a class="btn btn-download-source-button" href="page.ipynb">dl</a></body></html>"""


def page(tmp_path, body, *, name="page.html", notebook=True):
    (tmp_path / "fig.png").write_bytes(b"\x89PNG")
    (tmp_path / "page.ipynb").write_text("{}")
    p = tmp_path / name
    p.write_text(body)
    return check_page(p, tmp_path, notebook)


def test_a_clean_page_passes(tmp_path):
    assert page(tmp_path, CLEAN) == []


@pytest.mark.parametrize(
    ("insert", "finding"),
    [
        ("<td>+nan%</td>", "nan shown as a value"),
        ("<td>NaN</td>", "nan shown as a value"),
        ('<div class="output"><code>nan</code></div>', "nan shown as a value"),
        ("<pre>Traceback (most recent call last)</pre>", "'Traceback'"),
        ("<pre>TqdmWarning: IProgress not found</pre>", "'Warning'"),
        ("<pre>/work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py:21</pre>", "local path"),
        ("<pre>.venv/lib/python3.11/site-packages/tqdm/auto.py:21</pre>", "local path"),
        ("<p>see /home/me/x.json</p>", "local path"),
        ('<div class="cell_input"><pre>open("/tmp/x")</pre></div>', "local path"),
        ("<p>as issue #4's goal says</p>", "issue reference"),
        ('<img src="gone.png">', "missing image"),
        ('<div class="output"><pre>&lt;torch._C.Generator at 0x7f14ccf652d0&gt;</pre></div>', "object repr"),
    ],
)
def test_each_defect_is_flagged(tmp_path, insert, finding):
    found = page(tmp_path, CLEAN.replace("</main>", insert + "</main>"))
    assert any(finding in f for f in found), found


def test_notebook_page_needs_the_paper_heading_and_a_download(tmp_path):
    no_heading = CLEAN.replace("<h2>Paper vs this run</h2>", "<h2>Results</h2>")
    assert any("Paper vs this run" in f for f in page(tmp_path, no_heading))
    assert page(tmp_path, no_heading, notebook=False) == []  # a prose page needs neither
    no_dl = CLEAN.replace('href="page.ipynb"', 'href="missing.ipynb"')
    assert any("download" in f for f in page(tmp_path, no_dl))


BARE = ("<table><caption>Runs</caption><thead><tr><th></th><th>ms</th></tr></thead>"
        "<tbody><tr><th>0</th><td>1.5</td></tr><tr><th>1</th><td>2.5</td></tr></tbody></table>")


@pytest.mark.parametrize(
    ("table", "finding"),
    [
        # a pandas frame shown as it is: no caption, and its 0..N row numbers
        ('<table class="dataframe"><thead><tr><th>ms</th></tr></thead><tbody><tr><td>1.5</td></tr></tbody></table>',
         "no caption"),
        ("<table><caption> </caption><tbody><tr><td>1.5</td></tr></tbody></table>", "no caption"),
        (BARE, "bare 0..1 index"),
        (BARE.replace("<caption>Runs</caption>", ""), "no caption"),
        (BARE.replace("<th>0</th>", "<th>fp16</th>").replace("<th>1</th>", "<th>int4</th>"),
         "index without a name"),
    ],
)
def test_a_notebook_table_needs_a_caption_and_no_bare_index(tmp_path, table, finding):
    found = page(tmp_path, CLEAN.replace("</main>", table + "</main>"))
    assert any(finding in f for f in found), found
    assert page(tmp_path, CLEAN.replace("</main>", table + "</main>"), notebook=False) == []


def test_missing_build_is_a_finding(tmp_path):
    assert check_book(tmp_path) and "no built book" in check_book(tmp_path)[0]


BUILT = os.environ.get("KVLIB_BOOK_HTML")


@pytest.mark.skipif(not BUILT, reason="reads a built book: make test sets KVLIB_BOOK_HTML after building it")
def test_built_book_has_nothing_a_reader_must_not_see():
    found = check_book(Path(BUILT))
    assert not found, f"{len(found)} problem(s) in the built book:\n" + "\n".join(found)
