"""The generated pages of the book machinery: chapter index pages (story + claims table) and the claims register
(summary counts, contents order, rule column, math-safe cells). Built from the committed result files, no build."""

import re
from collections import Counter

import pytest

from kvlib.publish import assemble as asm
from kvlib.publish.provenance import load_result, repo_root
from kvlib.publish.registry import all_notebooks, load_registry


@pytest.fixture(scope="module")
def book():
    chapters = load_registry()
    rendered = {nb.name: "cpu" for nb in all_notebooks(chapters) if load_result(nb.name, "cpu") is not None}
    problems: list[str] = []
    rows = asm.claims_rows(rendered, problems)
    return chapters, rendered, rows


def _table_rows(md: str) -> list[list[str]]:
    """The rows of the first list-table in ``md`` (header first), as lists of cell texts."""
    block = md.split(":::{list-table}", 1)[1].split("\n:::", 1)[0]
    rows: list[list[str]] = []
    for line in block.splitlines():
        if line.startswith("* - "):
            rows.append([line[4:]])
        elif line.startswith("  - "):
            rows[-1].append(line[4:])
    return rows


def test_every_chapter_has_a_story(book):
    chapters, _, _ = book
    for ch in chapters:
        assert ch.story, f"chapter {ch.id} declares no story in the registry"
        assert (repo_root() / ch.story).is_file(), ch.story


def test_a_chapter_page_has_its_story_and_a_table_of_its_claims(book):
    chapters, rendered, rows = book
    for ch in chapters:
        problems: list[str] = []
        page = asm.chapter_page(ch, rows, rendered, problems)
        assert problems == [], problems
        story = (repo_root() / ch.story).read_text()
        first = asm.PLACEHOLDER.split(story.strip().split("\n\n")[0])[0].strip()
        assert first and first in page, f"{ch.id}: the story's opening is not on the page"
        assert "[[" not in page, f"{ch.id}: a placeholder was left unfilled"
        mine = [r for r in rows if r["chapter"] == ch.id]
        if not mine:
            continue
        table = _table_rows(page)
        assert table[0] == ["claim", "paper (setting)", "ours (setting)", "verdict"]
        assert f":::{{list-table}} The claims of {ch.title}" in page  # the table's caption
        assert len(table) - 1 == len(mine)
        ordered = [r for _, rs in asm.rows_in_contents_order(mine, [ch]) for r in rs]
        for r, cells in zip(ordered, table[1:]):
            assert r["where"] in cells[0] and cells[0].startswith("↳ ") == (r["role"] == "context")
            assert cells[3] == asm._verdict_cell(r)
            assert cells[3].startswith("*context*" if r["role"] == "context" else f"**{r['label']}**")


def test_story_numbers_come_from_the_result_file(monkeypatch):
    fake = {"nb": {"values": {"x": 0.123456, "n": 12345, "bad": float("nan"), "txt": "n/a"}}}
    monkeypatch.setattr(asm, "load_result", lambda name, prof: fake.get(name))
    problems: list[str] = []
    out = asm.fill_story("a [[nb.x:.2f]] b [[nb.n:,]] c [[nb.bad:.1f]] d [[nb.txt:.2f]] e [[nb.gone]] f [[other.x]]",
                         {"nb": "cpu"}, problems)
    assert out == "a 0.12 b 12,345 c n/a d n/a e n/a f n/a"
    assert len(problems) == 2 and "nb.gone" in problems[0] and "other.x" in problems[1]


def test_stories_carry_no_numbers_of_their_own_nor_issue_probe_or_path_names(book):
    chapters, _, _ = book
    bad = re.compile(r"issue|#\d|_probe|probe\d|\.json|dev/|/work|/home|\.venv", re.IGNORECASE)
    for ch in chapters:
        prose = asm.PLACEHOLDER.sub("", (repo_root() / ch.story).read_text())  # notebook names may say "probe"
        assert not bad.search(prose), f"{ch.story}: {bad.search(prose).group(0)!r}"
        prose = re.sub(r"(Proposition|Section|Sec\.|Eq\.|Table|Fig\.|App\.)\s+[\d.]+", "", prose)  # references
        # measured numbers come from placeholders; what remains may name settings (1k, 2x2, 135M, Sec. 6)
        decimals = re.findall(r"(?<![\w.])\d+\.\d+(?!\w)", prose)
        assert decimals == [], f"{ch.story}: hand-typed numbers {decimals}"


def test_no_page_reads_the_development_records(book):
    """The book renders data/ and notebook runs only: dev/results/ holds probes' raw records, which reach a page
    only through a curated file under data/results/ (dev.curate_*). Checked on every registered notebook's source
    and on the kvlib helpers notebooks call."""
    chapters, _, _ = book
    reads_dev = re.compile(r"dev/results|load_result\(\s*f?[\"']dev/")
    for nb in all_notebooks(chapters):
        text = (repo_root() / nb.path).read_text()
        assert not reads_dev.search(text), f"{nb.path}: {reads_dev.search(text).group(0)!r}"
    for py in (repo_root() / "kvlib").rglob("*.py"):
        hit = re.search(r"load_result\(\s*f?[\"']dev/", py.read_text())
        assert hit is None, f"{py.relative_to(repo_root())} reads a development record: {hit.group(0)!r}"


def test_register_summary_counts_equal_the_claims_verdicts(book):
    chapters, _, rows = book
    page = asm.claims_page([dict(r) for r in rows], chapters)
    table = _table_rows(page)
    header, body = table[0], table[1:]
    assert header[0] == "chapter" and header[-1] == "total"
    assert header[1:5] == ["reproduced", "checked", "differs", "not reproducible here"]  # the classes, always
    groups = asm.rows_in_contents_order(rows, chapters)
    assert len(body) == len(groups) + 1
    for (ch, rs), cells in zip(groups, body):
        primary = [r for r in rs if r["role"] != "context"]  # context rows have no verdict of their own
        counts = Counter(r["verdict word"] for r in primary)
        assert cells[1:] == [str(counts.get(v, 0)) for v in header[1:-1]] + [str(len(primary))], ch
        assert sum(counts.get(v, 0) for v in header[1:-1]) == len(primary), f"{ch}: a verdict has no column"
    primary = [r for r in rows if r["role"] != "context"]
    total = Counter(r["verdict word"] for r in primary)
    assert body[-1][1:] == [f"**{total.get(v, 0)}**" for v in header[1:-1]] + [f"**{len(primary)}**"]


def test_register_follows_the_contents_order(book):
    chapters, _, rows = book
    page = asm.claims_page([dict(r) for r in rows], chapters)
    sections = re.findall(r"^\(claims-([\w-]+)\)=$", page, re.MULTILINE)
    assert sections[0] == "summary"
    with_claims = {r["chapter"] for r in rows}
    assert sections[1:] == [ch.id for ch in chapters if ch.id in with_claims]


def test_register_rows_name_both_settings_and_when_the_rule_was_committed(book):
    chapters, _, rows = book
    page = asm.claims_page([dict(r) for r in rows], chapters)
    ch = rows[0]["chapter"]
    section = page.split(f"(claims-{ch})=", 1)[1]
    table = _table_rows(section)
    assert table[0] == ["claim", "paper (setting)", "ours (setting)", "verdict", "rule / measured"]
    for r, cells in zip(asm.rows_in_contents_order(rows, chapters)[0][1], table[1:]):
        assert cells[1].endswith("*") and cells[2].endswith("*")  # each figure followed by its setting, in italics
        if r["role"] != "context":
            assert cells[4].startswith("rule ") and ("post hoc" in cells[4] or "pre-registered" in cells[4])
    fold = section.split(":::{admonition} Rules and reasons", 1)[1].split("\n:::", 1)[0]
    assert "Rule committed" in fold


def test_a_verdict_whose_rule_changed_or_was_never_recorded_reads_re_run(monkeypatch):
    from kvlib.publish.verdicts import load_claims, rule_hash, rule_of

    known = load_claims()
    good = {"id": "witcert-fallback-block", "ours": "2", "verdict": "differs", "why": "x", "measured": 2.0,
            "rule_sha256": rule_hash(rule_of(known["witcert-fallback-block"])), "claims_commit": "abc",
            "judged_at": "2026-12-06T00:00:00+00:00"}
    stale = dict(good, id="witcert-tightness", verdict="reproduced", rule_sha256="0" * 64)
    old = {"id": "witcert-soundness", "ours": "x", "verdict": "reproduced", "why": ""}  # before rule hashes
    monkeypatch.setattr(asm, "load_result", lambda name, prof: {"claims": [good, stale, old]})
    problems: list[str] = []
    rows = {r["id"]: r for r in asm.claims_rows({"nb": "cpu"}, problems)}
    assert rows["witcert-fallback-block"]["verdict word"] == "differs"
    assert rows["witcert-tightness"]["verdict word"] == "re-run" and "rule changed" in rows["witcert-tightness"]["why"]
    assert rows["witcert-soundness"]["verdict word"] == "re-run"
    assert len(problems) == 2 and all("re-run it" in p for p in problems)
    assert any("'witcert-tightness'" in p and "its rule changed since it was measured" in p for p in problems)
    with pytest.raises(ValueError, match="re-run it"):
        asm.claims_rows({"nb": "cpu"})
    # the register still renders, with the refused verdicts counted apart
    page = asm.claims_page(list(rows.values()), load_registry())
    assert "re-run" in _table_rows(page)[0]


def test_post_hoc_rules_are_labelled(monkeypatch, book):
    chapters, _, rows = book
    from kvlib.publish.commits import first_measurements, rule_commits

    commits, first = rule_commits(), first_measurements()
    for r in rows:
        if r["role"] == "context":
            continue
        intro, seen = commits.get(r["id"]), first.get(r["id"])
        if intro is None or (seen is not None and intro[1] > seen[1]):
            assert r["registration"].startswith("post hoc"), r["id"]
        else:
            assert r["registration"] == "pre-registered", r["id"]


def test_list_table_cells_keep_math_and_escape_list_markers():
    out = asm.list_table([["$|x| \\le s/2$", "- 3 points", "1. first"]], ["a", "b", "c"], [1, 1, 1])
    assert "* - $|x| \\le s/2$" in out
    assert "  - \\- 3 points" in out and "  - 1\\. first" in out
    assert out.startswith(":::{list-table}") and out.rstrip().endswith(":::")
    cap = asm.list_table([["1"]], ["a"], [1], caption="What it shows,\n in units")
    assert cap.startswith(":::{list-table} What it shows, in units\n")


def test_the_rerun_line_runs_when_pasted_into_a_fresh_shell():
    """The page's rerun command names the venv's interpreter, so a shell with nothing activated and no PYTHONPATH
    runs it from the repository root (with `run` swapped for `stale --only`, which executes nothing)."""
    import re
    import subprocess

    from kvlib.publish.assemble import rerun_line
    from kvlib.publish.provenance import repo_root
    from kvlib.publish.registry import all_notebooks

    entry = all_notebooks()[0]
    cmd = re.search(r"`(\.venv/bin/python -m kvlib\.publish run [^`]+)`", rerun_line(entry, "cpu")).group(1)
    makefile = (repo_root() / "Makefile").read_text()
    assert "VENV ?= .venv" in makefile and "PY := $(VENV)/bin/python" in makefile  # what `make install` creates
    if not (repo_root() / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in this checkout (make install creates it; CI has one)")
    probe = cmd.replace(" run ", " stale ", 1)
    out = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "bash", "-c", probe], cwd=repo_root(),
                         capture_output=True, text=True, timeout=300)
    assert "ModuleNotFoundError" not in out.stderr and out.returncode in (0, 1), out.stderr[-2000:]
