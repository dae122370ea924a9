"""The execution cache, the strict provenance checks and the rendered page's one parameters view."""

import copy
import dataclasses
import hashlib
from pathlib import Path

import nbformat
import pytest

from kvlib.publish import cache
from kvlib.publish.commits import parse_commit, result_problems, show_commit, source_last_change
from kvlib.publish.provenance import repo_root
from kvlib.publish.registry import NotebookEntry, all_notebooks
from kvlib.publish.runner import run_notebooks
from kvlib.publish.sources import executed_path, load_source, stale_cells

TINY = Path(__file__).parent / "data" / "tiny.md"
JUDGED = "witcert-fallback-block"  # the claim the tiny notebook judges


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("KVLIB_EXECUTED_DIR", str(tmp_path / "executed"))
    return tmp_path


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def executed_once(tmp_path_factory):
    """One execution of a tiny notebook that imports kvlib.publish, reads the claims files and judges one claim."""
    import os

    d = tmp_path_factory.mktemp("cache")
    src = d / "reads.md"
    src.write_text(TINY.read_text().replace("run.save()", "from kvlib.publish.verdicts import load_claims\n"
                                            "n_claims = len(load_claims())\n"
                                            "tiny_src = open('tests/data/tiny.md').read()  # a data input\n"
                                            f"run.claim({JUDGED!r}, ours='2 blocks', measured=2.0)\nrun.save()"))
    entry = NotebookEntry(name="reads", path=str(src), chapter="t", title="r", profiles={"ci": {"x": 2}})
    old = {k: os.environ.get(k) for k in ("KVLIB_RESULTS_DIR", "KVLIB_EXECUTED_DIR")}
    os.environ["KVLIB_RESULTS_DIR"], os.environ["KVLIB_EXECUTED_DIR"] = str(d / "results"), str(d / "executed")
    try:
        first = run_notebooks("ci", entries=[entry], progress=False, reuse=True)
        second = run_notebooks("ci", entries=[entry], progress=False, reuse=True)
        forced = run_notebooks("ci", entries=[entry], progress=False)  # `run` (and --fresh) always executes
        executed = nbformat.read(executed_path("reads", "ci"), as_version=4)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return entry, src, first, second, forced, executed


def test_the_record_is_what_the_kernel_loaded_and_read(executed_once):
    entry, src, first, *_, executed = executed_once
    assert first[0].status == "executed" and "no committed execution" in first[0].detail
    rec = executed.metadata[cache.KEY]
    mods = rec["modules"]
    assert mods["kvlib.publish.run"]["sha256"] == sha(repo_root() / "kvlib" / "publish" / "run.py")
    # kvlib is lazy: a notebook that never touches the model loader has not loaded it, and the runner's own
    # record cells add nothing to the set they report
    assert "kvlib.hf.model" not in mods and "kvlib.publish.cache" not in mods and "kvlib.publish.runner" not in mods
    # the claims files are inputs only through the rule of the claim judged: its hash, nothing else
    assert not any(p.startswith("data/claims/") for p in rec["inputs"])
    assert rec["inputs"]["tests/data/tiny.md"] == sha(TINY)
    from kvlib.publish.verdicts import load_claims, rule_hash, rule_of

    assert rec["rules"] == {JUDGED: rule_hash(rule_of(load_claims()[JUDGED]))}
    assert not any(p.startswith("kvlib/") and p.endswith(".py") for p in rec["inputs"])
    assert rec["params"] == {"x": 2, "profile": "ci"}
    # the runner's cells are gone: the saved notebook is the source's code, executed
    assert not any(cache.RECORD_TAG in c.metadata.get("tags", []) for c in executed.cells)
    assert stale_cells(load_source(src), executed) == []


def test_the_record_keys_each_module_on_the_functions_it_ran(executed_once):
    """Only the functions the execution entered count: an edit to one it never called leaves it current, an edit
    to one it called or to module-level code makes it stale, naming what changed."""
    from kvlib.publish import _watch

    *_, executed = executed_once
    run = executed.metadata[cache.KEY]["modules"]["kvlib.publish.run"]
    assert {"Run.__init__", "Run.glue", "Run.save", "Run.claim"} <= set(run["functions"])
    assert "load_claims" in executed.metadata[cache.KEY]["modules"]["kvlib.publish.verdicts"]["functions"]
    assert "Run.claims_table" not in run["functions"]  # defined in the same file, never called by the notebook
    text = (repo_root() / run["file"]).read_text()
    assert _watch.changed(run, text) == []
    claim = text.index("    def claims_table(")
    body = text.index(":\n", claim) + 2
    assert _watch.changed(run, text[:body] + "        _unused = 1\n" + text[body:]) == []
    glue = text.index("    def glue(")
    body = text.index(":\n", glue) + 2
    assert _watch.changed(run, text[:body] + "        _unused = 1\n" + text[body:]) == ["Run.glue"]
    assert _watch.changed(run, text + "\nNEW_CONSTANT = 1\n") == ["module-level code"]
    assert _watch.changed(run, "# a comment only\n" + text) == []  # positions and comments are not code
    assert _watch.changed(run, None) == ["the file is gone"]


def test_an_unchanged_notebook_is_reused_and_run_always_executes(executed_once):
    _, _, _, second, forced, _ = executed_once
    assert second[0].status == "reused", second[0].detail
    assert forced[0].status == "executed" and forced[0].detail == "asked to run"


def test_each_change_is_caught_and_named(executed_once, tmp_path):
    entry, src, *_, executed = executed_once
    source = load_source(src)
    params = {"x": 2, "profile": "ci"}
    assert cache.why_stale(source, params, executed) == []
    assert cache.why_stale(source, dict(params, x=3), executed)[0].startswith("parameters changed")
    code = tmp_path / "code.md"
    code.write_text(src.read_text().replace("run.glue(\"x2\", 2 * x)", "run.glue(\"x2\", 3 * x)"))
    assert cache.why_stale(load_source(code), params, executed) == ["code cells changed"]
    md = tmp_path / "md.md"
    md.write_text(src.read_text().replace("# Tiny notebook", "# A tiny notebook"))
    assert cache.why_stale(load_source(md), params, executed) == ["markdown changed"]
    tampered = copy.deepcopy(executed)
    tampered.metadata[cache.KEY]["modules"]["kvlib.publish.run"]["sha256"] = "0" * 64
    assert cache.why_stale(source, params, tampered) == []  # the file differs, nothing it ran does
    tampered.metadata[cache.KEY]["modules"]["kvlib.publish.run"]["functions"]["Run.glue"] = "0" * 64
    assert cache.why_stale(source, params, tampered) == ["kvlib changed: kvlib.publish.run (Run.glue)"]
    tampered = copy.deepcopy(executed)
    tampered.metadata[cache.KEY]["modules"]["kvlib.publish.run"]["sha256"] = "0" * 64
    tampered.metadata[cache.KEY]["modules"]["kvlib.publish.run"]["skeleton"] = "0" * 64
    assert cache.why_stale(source, params, tampered) == ["kvlib changed: kvlib.publish.run (module-level code)"]
    tampered = copy.deepcopy(executed)
    first_input = sorted(tampered.metadata[cache.KEY]["inputs"])[0]
    tampered.metadata[cache.KEY]["inputs"][first_input] = "0" * 64
    assert cache.why_stale(source, params, tampered) == [f"input changed: {first_input}"]
    tampered = copy.deepcopy(executed)  # the judged claim's rule changed since the execution
    tampered.metadata[cache.KEY]["rules"][JUDGED] = "0" * 64
    assert cache.why_stale(source, params, tampered) == [f"rule changed: {JUDGED}"]
    tampered = copy.deepcopy(executed)  # a claims file it read changed, in another claim's rule: still current
    tampered.metadata[cache.KEY]["inputs"]["data/claims/e2e.yml"] = "0" * 64
    assert cache.why_stale(source, params, tampered) == []
    # the install metadata importlib.metadata reads: `pip install -e` rewrites it when pyproject's dependencies change
    tampered.metadata[cache.KEY]["inputs"]["kvlib.egg-info/PKG-INFO"] = "0" * 64
    assert cache.why_stale(source, params, tampered) == []
    del tampered.metadata[cache.KEY]
    assert "no cache key" in cache.why_stale(source, params, tampered)[0]
    assert cache.why_stale(source, params, None) == ["no committed execution"]


def test_stale_lists_what_a_build_would_execute_again(executed_once, tmp_path, monkeypatch):
    from kvlib.publish.runner import stale_report

    entry, src, *_, executed = executed_once
    monkeypatch.setenv("KVLIB_EXECUTED_DIR", str(tmp_path))
    path = executed_path(entry.name, "ci")
    path.parent.mkdir(parents=True)
    nbformat.write(executed, path)
    assert stale_report("ci", entries=[entry]) == []
    changed = dataclasses.replace(entry, profiles={"ci": {"x": 5}})
    assert stale_report("ci", entries=[changed])[0][1][0].startswith("parameters changed")
    path.unlink()
    assert stale_report("ci", entries=[entry]) == [(entry.name, ["no committed execution"])]


def test_commits_read_back_in_full_with_their_dirty_state():
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True, text=True).stdout.strip()
    assert parse_commit(head) == (head, False, "")
    assert parse_commit(head[:7])[0] == head and len(show_commit(head[:7])) == 40
    assert parse_commit(head + "+dirty") == (head, True, "+dirty")
    assert show_commit(head + "+dirty") == head + " +dirty"
    assert parse_commit("unknown")[0] is None
    assert result_problems(head + "+dirty") == ["ran from a dirty tree (+dirty)"]
    assert "not a commit" in result_problems("unknown")[0]


def test_a_result_older_than_its_source_is_refused():
    nb = next(n for n in all_notebooks() if source_last_change(n.path))
    last = source_last_change(nb.path)
    before = parse_commit(f"{last}^")[0]
    assert any("predates the last change" in p for p in result_problems(before, nb.path))
    ok = result_problems(last, nb.path)
    assert ok == [] or ok == [f"its source {nb.path} has uncommitted changes"]


def test_a_claim_answered_by_two_notebooks_is_an_error_naming_both(monkeypatch):
    from kvlib.publish import assemble
    from kvlib.publish.verdicts import load_claims

    cid = next(iter(load_claims()))
    fake = {"claims": [{"id": cid, "ours": "x", "verdict": "reproduced", "why": ""}]}
    monkeypatch.setattr(assemble, "load_result", lambda name, prof: fake)
    with pytest.raises(ValueError, match=f"{cid}.*nb_a.*nb_b"):
        assemble.claims_rows({"nb_a": "cpu", "nb_b": "cpu"})
    found = []
    rows = assemble.claims_rows({"nb_a": "cpu", "nb_b": "cpu"}, found)
    assert len(found) == 1 and next(r for r in rows if r["id"] == cid)["verdict"].startswith("conflict")


def test_one_parameters_view_showing_the_values_used():
    from kvlib.publish.assemble import merge_parameters

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell('profile = "cpu"\nprompt_len = 256  # tokens\nxs = [1,\n      2]\nk = 3',
                                  metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell('# Parameters\nprofile = "ci"\nprompt_len = 2048\nxs = [1, 2]\n',
                                  metadata={"tags": ["injected-parameters"]}),
        nbformat.v4.new_code_cell("print(prompt_len)"),
    ]
    nb.metadata["papermill"] = {"parameters": {"profile": "ci", "prompt_len": 2048, "xs": [1, 2]}}
    assert merge_parameters(nb)
    assert len(nb.cells) == 2 and "injected-parameters" not in str(nb.cells[0].metadata)
    assert nb.cells[0].source.splitlines() == [
        'profile = "ci"  # source default: "cpu"',
        "prompt_len = 2048  # tokens (source default: 256)",
        "xs = [1,", "      2]",  # the same value: left as written
        "k = 3",
    ]
    ns = {}
    exec(nb.cells[0].source, ns)  # still runnable: the downloaded page runs with the values shown
    assert (ns["profile"], ns["prompt_len"], ns["xs"], ns["k"]) == ("ci", 2048, [1, 2], 3)


def test_stamp_refuses_an_execution_it_cannot_check(sandbox, tmp_path):
    """A pre-cache execution is stamped only when its code, parameters, result and inputs check out: an edited
    code cell, or no result file of that execution, leaves it unstamped."""
    import shutil

    nb = next(n for n in all_notebooks() if "cpu" in n.profiles and (repo_root() / "book" / "executed" / "cpu"
                                                                     / f"{n.name}.ipynb").exists())
    committed = repo_root() / "book" / "executed" / "cpu" / f"{nb.name}.ipynb"
    dst = executed_path(nb.name, "cpu")
    dst.parent.mkdir(parents=True)
    shutil.copyfile(committed, dst)
    # a pre-cache execution: without the key (committed executions gain one when they are re-run)
    pre = nbformat.read(dst, as_version=4)
    pre.metadata.pop(cache.KEY, None)
    nbformat.write(pre, dst)
    text = (repo_root() / nb.path).read_text()
    end = text.index("\n```\n", text.index("```{code-cell}"))
    edited = tmp_path / "edited.md"
    edited.write_text(text[:end] + "\nx = 1" + text[end:])
    e = NotebookEntry(name=nb.name, path=str(edited), chapter=nb.chapter, title="t", profiles=nb.profiles)
    problems, rec = cache.stamp_problems(e, "cpu")
    assert rec is None and any("code cell" in p for p in problems) and "no result file" in problems
    assert cache.stamp([e], "cpu")[0][1].startswith("not stamped")
    assert cache.KEY not in nbformat.read(dst, as_version=4).metadata


@pytest.mark.parametrize(
    ("profile", "problem", "strict", "built"),
    [
        ("cpu", "nb [cpu]: ran from a dirty tree (+dirty)", True, False),  # committed results must be clean
        ("ci", "nb [ci]: ran from a dirty tree (+dirty)", True, True),  # a ci smoke run only warns
        ("ci", "claim id 'x' is answered by 2 notebooks: a, b", True, False),  # a claim conflict fails everywhere
        ("cpu", "nb [cpu]: ran from a dirty tree (+dirty)", False, True),  # --no-strict builds anyway
    ],
)
def test_the_build_refuses_what_the_checks_find(monkeypatch, capsys, profile, problem, strict, built):
    from kvlib.publish import assemble
    from kvlib.publish.__main__ import main

    calls = []
    monkeypatch.setattr(assemble, "assemble", lambda prof, outcomes, problems: problems.append(problem))
    monkeypatch.setattr(assemble, "build_html", lambda strict: calls.append(strict) or 0)
    rc = main(["build", "--profile", profile, "--no-run", *([] if strict else ["--no-strict"])])
    assert (rc == 0) == built and bool(calls) == built
    assert problem in capsys.readouterr().err
