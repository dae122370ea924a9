"""Read the built book as a reader meets it and list what must not be there.

Checked on every page of the table of contents (``_build/html``): a ``nan`` shown as a value, a ``Traceback``,
a ``Warning``, a local path (``/work``, ``/home``, ``/tmp``, ``.venv/lib``), an issue reference (``issue #``), an
image that does not load, developer residue (:data:`RESIDUE`: "the lent H200", "device call", "Issue 28", a
Python error name, ``Profile.x``, the runner's "results:" line, ``-0.00``, a printed dict, ``True``/``False``);
and on each notebook page: a "Paper vs this run" heading, a download link to a notebook that exists, a caption
on every table (what it shows), and no table that shows a bare 0..N row index or an index without a name (a
pandas frame displayed as it is). Code a page shows as input (hidden or not) is not prose: ``np.nan`` there is
no value shown, so the value checks read the page without its input cells; local paths are looked for
everywhere.
"""

from __future__ import annotations

import re
from pathlib import Path

#: a ``nan`` as a value: ``nan``, ``NaN``, ``+nan%``, ``-nan`` (a word of its own, so "nanoseconds" passes)
NAN = re.compile(r"(?<![\w.])[+-]?nan(?![\w])", re.IGNORECASE)
#: a path of the machine that ran the notebook; the repository's own ``.venv/bin/python`` (the rerun line) is not one,
#: an installed package's file (``.venv/lib/...``) is
LOCAL_PATH = re.compile(r"(?<![\w.])(/work/|/home/|/tmp/|\S*\.venv/lib\b)")
ISSUE = re.compile(r"issue\s*#", re.IGNORECASE)
WORDS = {"Traceback": re.compile(r"Traceback"), "Warning": re.compile(r"Warning\b")}
PAPER_HEADING = re.compile(r"paper vs\.? this run", re.IGNORECASE)
#: what a developer wrote for themselves and a reader should not meet (in prose and in outputs, not in code shown
#: as code): the machine lending, internal issue numbers, private names, printouts of the runner and of Python
RESIDUE = {
    "lent machine": re.compile(r"\blent (H200|GPU|machine)\b"),
    "device call": re.compile(r"\bdevice calls?\b"),
    "issue number": re.compile(r"\b[Ii]ssue \d+\b"),
    "Python error in output": re.compile(r"\b(ModuleNotFoundError|ImportError|AttributeError|KeyError)\b"),
    "private attribute": re.compile(r"\bProfile\.\w+"),
    "runner printout": re.compile(r"\bresults: data/results/"),
    "negative zero": re.compile(r"(?<![\w.])-0(\.0+)?(?![\d.])%?"),
    "printed dict": re.compile(r"\{'[A-Za-z_][\w-]*': "),
    "Python boolean": re.compile(r"(?<![\w`'\"=])(True|False)(?![\w`'\"])"),
    "object repr": re.compile(r"<[A-Za-z_][\w.]* (object )?at 0x[0-9a-f]+>"),
}


def _main(soup):
    return soup.find("main") or soup.find("article") or soup.body or soup


def _snippet(text: str, m: re.Match, width: int = 50) -> str:
    a, b = max(0, m.start() - width), min(len(text), m.end() + width)
    return " ".join(text[a:b].split())


def _cells(row) -> list:
    return row.find_all(["th", "td"], recursive=False)


def check_tables(main, rel) -> list[str]:
    """Findings on the tables a notebook page shows: each needs a caption that says what it shows; a row index is
    shown only when it means something (not 0, 1, ..., N-1) and then under a name."""
    out = []
    for k, table in enumerate(main.find_all("table"), 1):
        head = [" ".join(_cells(r)[0].get_text(" ").split()) for r in table.select("thead tr") if _cells(r)]
        body = [r for r in table.find_all("tr") if r.find_parent("thead") is None]
        first = [" ".join(_cells(r)[0].get_text(" ").split()) for r in body if _cells(r)]
        label = " | ".join(c.get_text(" ", strip=True) for c in (table.select("thead tr") or body[:1] or [table])[0]
                           .find_all(["th", "td"])[:4])
        where = f"{rel}: table {k} ({label[:60]})"
        cap = table.find("caption")
        if cap is None or not cap.get_text(strip=True):
            out.append(f"{where}: no caption")
        # a row index: the first cell of every body row is a header cell
        indexed = bool(body) and all(_cells(r) and _cells(r)[0].name == "th" for r in body)
        if not indexed:
            continue
        if first == [str(i) for i in range(len(first))]:
            out.append(f"{where}: shows a bare 0..{len(first) - 1} index")
        elif head and not any(head):
            out.append(f"{where}: shows an index without a name")
    return out


def check_page(path: Path, html_root: Path, notebook: bool) -> list[str]:
    """Problems of one built page (empty: none)."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(Path(path).read_text(errors="replace"), "html.parser")
    main = _main(soup)
    for tag in main.find_all(["script", "style"]):
        tag.decompose()
    rel = path.relative_to(html_root)
    out = []
    full = main.get_text(" ")
    attrs = " ".join(str(v) for t in main.find_all(True) for k, v in t.attrs.items() if k in ("href", "src"))
    for text in (full, attrs):
        for m in LOCAL_PATH.finditer(text):
            out.append(f"{rel}: local path {m.group(1)!r}: ...{_snippet(text, m)}...")
    for tag in main.select(".cell_input, .highlight-ipython3, .highlight-python"):
        tag.decompose()
    prose = main.get_text(" ")
    # A ``NaN`` set as code in prose names the IEEE value (the theorem's edge cases); one in an output is shown.
    for tag in main.find_all("code"):
        if not tag.find_parent(class_=re.compile(r"output")):
            tag.decompose()
    values = main.get_text(" ")
    for m in NAN.finditer(values):
        out.append(f"{rel}: nan shown as a value: ...{_snippet(values, m)}...")
    for word, rx in WORDS.items():
        for m in rx.finditer(prose):
            out.append(f"{rel}: {word!r} on the page: ...{_snippet(prose, m)}...")
    for m in ISSUE.finditer(prose):
        out.append(f"{rel}: issue reference: ...{_snippet(prose, m)}...")
    for what, rx in RESIDUE.items():
        for m in rx.finditer(values):
            out.append(f"{rel}: {what}: ...{_snippet(values, m)}...")
    for img in main.find_all("img"):
        src = img.get("src", "")
        if not src or src.startswith(("data:", "http://", "https://")):
            if not src:
                out.append(f"{rel}: image without a src")
            continue
        target = (path.parent / src.split("#")[0].split("?")[0]).resolve()
        if not target.is_file():
            out.append(f"{rel}: missing image {src}")
    if notebook:
        heads = [h.get_text(" ") for h in main.find_all(["h1", "h2", "h3", "h4", "h5", "h6"])]
        if not any(PAPER_HEADING.search(h) for h in heads):
            out.append(f"{rel}: no 'Paper vs this run' heading")
        links = [a.get("href", "") for a in soup.select("a.btn-download-source-button")]
        if not any(h.endswith(".ipynb") and (path.parent / h).resolve().is_file() for h in links):
            out.append(f"{rel}: no download link to the page's notebook")
        out += check_tables(main, rel)
    # one finding per kind and snippet is enough for a reader of the report
    return list(dict.fromkeys(out))


def book_pages(html_root: Path) -> list[tuple[Path, bool]]:
    """Every page of the table of contents, with whether it is a notebook's page."""
    import yaml

    from kvlib.publish.provenance import repo_root
    from kvlib.publish.registry import all_notebooks

    toc = yaml.safe_load((repo_root() / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(items):
        for it in items or []:
            if "file" in it:
                files.append(it["file"])
            walk(it.get("sections"))

    walk(toc.get("chapters"))
    nb_names = {nb.name for nb in all_notebooks()}
    return [(html_root / f"{f}.html", Path(f).name in nb_names and f.startswith("book/_render/")) for f in files]


def check_book(html_root: str | Path = "_build/html") -> list[str]:
    """Problems of every page of the built book (a page missing from the build is one)."""
    from kvlib.publish.provenance import repo_root

    root = Path(html_root)
    root = root if root.is_absolute() else repo_root() / root
    if not (root / "index.html").exists():
        return [f"{root}: no built book here (run python -m kvlib.publish build first)"]
    out = []
    for page, is_nb in book_pages(root):
        if not page.exists():
            out.append(f"{page.relative_to(root)}: page missing from the build")
            continue
        out += check_page(page, root, is_nb)
    return out
