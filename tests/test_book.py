"""The spine: registry, runner (validation, failure isolation), result files, toc in sync, and the executed
notebooks in step with their MyST sources."""

import json
import os
from pathlib import Path

import nbformat
import pytest

from kvlib.publish.assemble import write_toc
from kvlib.publish.provenance import repo_root, save_result
from kvlib.publish.registry import NotebookEntry, all_notebooks, load_registry
from kvlib.publish.runner import run_notebooks, validate
from kvlib.publish.sources import executed_path, load_source, stale_cells

TINY = str(Path(__file__).parent / "data" / "tiny.md")
PROFILES_PRESENT = [(nb, p) for nb in all_notebooks() for p in nb.profiles if executed_path(nb.name, p).exists()]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("KVLIB_EXECUTED_DIR", str(tmp_path / "executed"))
    return tmp_path


def entry(name, **ci):
    return NotebookEntry(name=name, path=TINY, chapter="t", title=name, profiles={"ci": ci})


def test_toc_is_in_sync_with_registry():
    assert (repo_root() / "_toc.yml").read_text() == write_toc(load_registry())


def test_every_registered_notebook_exists_and_accepts_its_parameters():
    for nb in all_notebooks():
        for profile in nb.profiles:
            validate(nb, nb.params(profile))


def test_unknown_parameter_is_rejected_before_running(sandbox):
    with pytest.raises(ValueError, match="no parameter.*'typo'"):
        run_notebooks("ci", entries=[entry("ok"), entry("bad", typo=3)], progress=False)
    assert not (sandbox / "executed").exists()  # nothing ran


def test_failure_is_isolated_and_reported(sandbox):
    out = run_notebooks("ci", entries=[entry("first", fail=True), entry("second", x=5)], progress=False)
    status = {o.name: o.status for o in out}
    assert status == {"first": "failed", "second": "executed"}
    assert "asked to fail" in out[0].detail
    res = json.loads((sandbox / "results" / "ci" / "tiny.json").read_text())
    assert res["values"]["x2"] == 10
    prov = res["provenance"]
    assert {"commit", "device", "packages", "params", "started", "duration_s"} <= set(prov)
    assert prov["params"] == {"fail": False, "x": 5}


def test_profile_without_parameters_is_skipped(sandbox):
    e = NotebookEntry(name="cpuonly", path=TINY, chapter="t", title="x", profiles={"cpu": {}})
    (o,) = run_notebooks("ci", entries=[e], progress=False)
    assert o.status == "skipped"


def test_gpu_notebook_is_skipped_on_cpu(sandbox, monkeypatch):
    monkeypatch.setattr("kvlib.publish.runner.gpu_available", lambda: False)
    e = NotebookEntry(name="g", path=TINY, chapter="t", title="g", profiles={"ci": {}}, needs_gpu=True)
    (o,) = run_notebooks("ci", entries=[e], progress=False)
    assert o.status == "skipped" and "GPU" in o.detail


def test_result_not_overwritten_by_smaller_profile(sandbox, monkeypatch):
    save_result("r", "gpu", {"v": 1}, {})
    gpu_file = sandbox / "results" / "gpu" / "r.json"
    # Point every profile at the gpu folder: a ci record must not replace the gpu one there.
    monkeypatch.setattr("kvlib.publish.provenance.results_dir", lambda profile: gpu_file.parent)
    with pytest.raises(ValueError, match="refusing to overwrite"):
        save_result("r", "ci", {"v": 3}, {})
    assert json.loads(gpu_file.read_text())["v"] == 1
    save_result("r", "ci", {"v": 3}, {}, overwrite=True)  # explicit is allowed
    assert json.loads(gpu_file.read_text())["v"] == 3
    assert not list((sandbox / "results" / "gpu").glob("*.tmp"))


def test_result_json_is_strict(sandbox):
    path = save_result("inf", "ci", {"x": float("inf"), "y": float("nan")}, {})
    rec = json.loads(path.read_text())  # would fail on bare Infinity/NaN with parse_constant below
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert rec["x"] == "inf"


def test_cli_rejects_unknown_notebook():
    from kvlib.publish.__main__ import main

    assert main(["run", "--profile", "ci", "--only", "no-such-notebook", "--no-progress"]) == 2


def test_parameters_cells_are_fully_understood_by_papermill():
    """Every assignment in a parameters cell is a parameter papermill sees (none silently dropped)."""
    import ast

    from kvlib.publish.runner import notebook_parameters

    for nb in all_notebooks():
        source = load_source(repo_root() / nb.path)
        cells = [c for c in source.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(cells) == 1, f"{nb.name}: needs exactly one parameters cell"
        assigned = {t.id for node in ast.parse(cells[0].source).body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        assert "profile" in assigned, f"{nb.name}: parameters cell must define profile"
        assert assigned == notebook_parameters(source), f"{nb.name}: papermill cannot parse some parameter lines"


def test_glue_key_twice_is_an_error(sandbox):
    from kvlib.publish import Run

    run = Run("dup", profile="ci")
    run.glue("x", 1)
    with pytest.raises(ValueError, match="glued twice"):
        run.glue("x", 2)


def test_every_glued_figure_is_shown_once_with_a_numbered_caption():
    """``run.glue_fig`` glues without displaying: a figure reaches the page through a ``{glue:figure}`` directive of
    its own notebook, which numbers it and gives it a caption; displaying it as well (``display(fig)`` or ``fig``
    as a cell's last line) would show it a second time, without one."""
    import re

    lost, twice = [], []
    for nb in all_notebooks():
        cells = load_source(repo_root() / nb.path).cells
        md = "\n".join(c.source for c in cells if c.cell_type == "markdown")
        placed = set(re.findall(r"\{glue:figure\}\s+([\w-]+)", md))
        for c in cells:
            if c.cell_type != "code":
                continue
            last = [ln.strip() for ln in c.source.splitlines() if ln.strip()][-1:]
            for key, var in re.findall(r"glue_fig\(\s*[\"']([\w-]+)[\"']\s*,\s*([\w.]+)", c.source):
                if key not in placed:
                    lost.append(f"{nb.name}: {key}")
                if f"display({var})" in c.source or last == [var]:
                    twice.append(f"{nb.name}: {key}")
    assert not lost, f"glued figures without a {{glue:figure}} directive (caption): {lost}"
    assert not twice, f"glued figures also displayed without a caption: {twice}"


def test_converted_sources_have_stable_unique_cell_ids():
    """nbformat 4.5 cells carry ids; the runner gives each converted cell one that does not change between runs."""
    for nb in all_notebooks():
        ids = [c["id"] for c in load_source(repo_root() / nb.path).cells]
        assert len(set(ids)) == len(ids), nb.name
        assert ids == [c["id"] for c in load_source(repo_root() / nb.path).cells], nb.name


def test_headings_never_skip_a_level():
    """The strict book build refuses a heading more than one level below the one before it (myst.header); this
    finds it in seconds instead of at the end of a build. Fenced code inside markdown cells is skipped."""
    import re

    bad = []
    for nb in all_notebooks():
        prev = 0
        for c in load_source(repo_root() / nb.path).cells:
            if c.cell_type != "markdown":
                continue
            fenced = False
            for ln in c.source.splitlines():
                if ln.lstrip().startswith(("```", "~~~")):
                    fenced = not fenced
                m = None if fenced else re.match(r"(#{1,6})\s", ln)
                if m:
                    level = len(m.group(1))
                    if prev and level > prev + 1:
                        bad.append(f"{nb.name}: H{prev} to H{level}: {ln.strip()[:60]}")
                    prev = level
    assert not bad, bad


def test_every_source_is_myst_markdown_and_nothing_generates_notebooks():
    """One convention: each registered notebook is a MyST source; no .ipynb or generator script beside them."""
    assert all(nb.path.endswith(".md") for nb in all_notebooks())
    notebooks = repo_root() / "notebooks"
    assert not list(notebooks.rglob("*.ipynb")) and not list(notebooks.rglob("*.py"))


@pytest.mark.parametrize(("nb", "profile"), PROFILES_PRESENT, ids=[f"{n.name}-{p}" for n, p in PROFILES_PRESENT])
def test_executed_notebook_ran_its_sources_current_code(nb, profile):
    """The book renders book/executed/<profile>/<name>.ipynb: it must be a run of the source as it is now."""
    import nbformat

    stale = stale_cells(load_source(repo_root() / nb.path), nbformat.read(executed_path(nb.name, profile), 4))
    assert not stale, f"{nb.name} [{profile}] is stale, rerun it: {stale}"


def test_a_changed_code_cell_makes_the_executed_run_stale(tmp_path):
    """The check above can fail: edit one code cell (or add one) of a copy of a source and it is caught."""
    import nbformat

    nb, profile = next((n, p) for n, p in PROFILES_PRESENT if p == "cpu")
    executed = nbformat.read(executed_path(nb.name, profile), 4)
    text = (repo_root() / nb.path).read_text()
    edited = tmp_path / "edited.md"
    end = text.index("\n```\n", text.index("```{code-cell}"))  # the end of the first code cell
    edited.write_text(text[:end] + "\nx = 1" + text[end:])
    assert stale_cells(load_source(edited), executed)
    added = tmp_path / "added.md"
    added.write_text(text + "\n```{code-cell}\nx = 1\n```\n")
    assert any("code cells" in s for s in stale_cells(load_source(added), executed))
    assert not stale_cells(load_source(repo_root() / nb.path), executed)


def test_non_markdown_source_is_rejected():
    e = NotebookEntry(name="nb", path="notebooks/x.ipynb", chapter="t", title="x", profiles={"ci": {}})
    with pytest.raises(ValueError, match="MyST markdown"):
        validate(e, {"profile": "ci"})


def test_api_page_names_live_where_it_says():
    """book/api.md lists each stable name with its home module: both must hold (importable, right home)."""
    import importlib
    import re

    import kvlib

    rows = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|", (repo_root() / "book" / "api.md").read_text(), re.M)
    names = {n for n, _ in rows}
    assert {"philox4x32_10", "certificate", "make_cache", "kvlib.stats.mcnemar"} <= names
    for name, home in rows:
        *mod, attr = name.split(".")
        obj = getattr(importlib.import_module(".".join(mod)) if mod else kvlib, attr)
        assert obj.__module__ == home, f"{name} lives in {obj.__module__}, the page says {home}"


def test_kernel_drops_only_the_widget_fallback_notice(sandbox, tmp_path, monkeypatch):
    """tqdm.auto's 'IProgress not found' remark (the kernel has no widget frontend) stays off the pages; any
    other warning still reaches them, and the runner leaves the caller's PYTHONWARNINGS as it was."""
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    src = tmp_path / "warn.md"
    src.write_text(Path(TINY).read_text().split("```{code-cell}\nfrom kvlib")[0]
                   + '```{code-cell}\nimport warnings\n\nfrom tqdm.auto import tqdm\n\n'
                   + 'warnings.warn("kept warning")\n```\n')
    e = NotebookEntry(name="warn", path=str(src), chapter="t", title="w", profiles={"ci": {}})
    (o,) = run_notebooks("ci", entries=[e], progress=False)
    assert o.status == "executed", o.detail
    text = json.dumps(nbformat.read(executed_path("warn", "ci"), 4))
    assert "kept warning" in text and "IProgress" not in text
    assert os.environ["PYTHONWARNINGS"] == "default"


def test_two_workers_run_everything_once_in_registry_order_and_record_peak_memory(sandbox, monkeypatch):
    """jobs=2: each notebook executed once, failures isolated, outcomes in the registry's order; each kernel got
    cpu_count // 2 threads, and its record holds the kernel's measured peak memory for the next schedule."""
    from kvlib.publish import cache
    from kvlib.publish.runner import expected_cost

    monkeypatch.setenv("KVLIB_MEMORY_MB", "1")  # below any kernel's peak: the schedule runs one at a time
    names = ["a", "b", "c"]
    before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "KVLIB_PROFILE", "PYTHONWARNINGS")}
    out = run_notebooks("ci", entries=[entry("a", x=1), entry("b", fail=True), entry("c", x=3)], progress=False,
                        jobs=2)
    assert [o.name for o in out] == names
    assert [o.status for o in out] == ["executed", "failed", "executed"]
    rec = cache.record_of(nbformat.read(executed_path("c", "ci"), as_version=4))
    assert rec["peak_rss_mb"] > 10  # a Python kernel is tens of MB at least
    wall, peak = expected_cost("c", "ci")
    assert wall > 0 and peak == rec["peak_rss_mb"]
    assert {k: os.environ.get(k) for k in before} == before  # the runner's settings for its kernels are undone
    with pytest.raises(ValueError, match="jobs"):
        run_notebooks("ci", entries=[entry("a")], progress=False, jobs=0)


@pytest.mark.parametrize(("nb", "profile"), [(nb, p) for nb, p in PROFILES_PRESENT if p == "cpu"],
                         ids=lambda v: getattr(v, "name", v))
def test_no_committed_cell_comes_near_the_runner_limit(nb, profile):
    """Every cell of a committed cpu execution took under a third of the runner's per-cell limit, so the same cell
    still passes on a machine three times slower (or sharing its cores with a second worker and other load)."""
    from kvlib.publish.runner import CELL_TIMEOUT

    executed = nbformat.read(executed_path(nb.name, profile), as_version=4)
    slow = [(i, round(c.metadata.get("papermill", {}).get("duration") or 0)) for i, c in enumerate(executed.cells)
            if (c.metadata.get("papermill", {}).get("duration") or 0) > CELL_TIMEOUT[profile] / 3]
    assert not slow, f"{nb.name}: cells (index, seconds) over {CELL_TIMEOUT[profile] / 3:.0f} s: {slow}"


def test_no_cell_ends_in_a_bare_value():
    """A cell whose last line is ``run.glue(...)`` shows the glued value as a bare output ("32768", "0") under
    it: a number with no words. Assign it (``_ = run.glue(...)``) or end the cell otherwise."""
    import ast

    bare = []
    for nb in all_notebooks():
        for i, c in enumerate(load_source(repo_root() / nb.path).cells):
            if c.cell_type != "code" or not c.source.strip() or c.source.rstrip().endswith(";"):
                continue  # IPython shows nothing after a trailing semicolon
            last = ast.parse(c.source).body[-1:]
            if last and isinstance(last[0], ast.Expr) and isinstance(last[0].value, ast.Call) \
                    and ast.unparse(last[0].value.func) == "run.glue":
                bare.append(f"{nb.name}: cell {i}: {ast.unparse(last[0])[:60]}")
    assert not bare, bare
