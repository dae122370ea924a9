"""Parameters cannot reroute a run (issue 37, items 6 and 8): `-p profile=...` is refused, a notebook's `Run`
refuses a profile other than the one it is executed at, mistyped parameters fail before anything runs, and
`publish list` needs no book extra."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlib.publish.registry import NotebookEntry

TINY = str(Path(__file__).parent / "data" / "tiny.md")


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("KVLIB_EXECUTED_DIR", str(tmp_path / "executed"))
    return tmp_path


def run_notebooks(*a, **kw):
    pytest.importorskip("papermill", reason="the runner needs the book extra")
    from kvlib.publish.runner import run_notebooks as run

    return run(*a, **kw)


def entry(name, **ci):
    return NotebookEntry(name=name, path=TINY, chapter="t", title=name, profiles={"ci": ci, "cpu": {}})


def test_profile_parameter_cannot_reroute_results(sandbox):
    from kvlib.publish.provenance import save_result

    save_result("tiny", "cpu", {"values": {"x2": 84}}, {})  # the "committed" cpu result
    with pytest.raises(ValueError, match="profile"):
        run_notebooks("ci", overrides={"profile": "cpu"}, entries=[entry("tiny")], progress=False)
    assert json.loads((sandbox / "results" / "cpu" / "tiny.json").read_text())["values"]["x2"] == 84


def test_run_refuses_a_profile_other_than_the_executed_one(monkeypatch):
    from kvlib.publish.run import Run

    monkeypatch.setenv("KVLIB_PROFILE", "ci")
    with pytest.raises(ValueError, match="executed at the 'ci' profile"):
        Run("tiny", profile="cpu")
    Run("tiny", profile="ci")  # the executed one is fine


def test_glue_outside_a_kernel_leaves_no_shell_behind(monkeypatch):
    """myst_nb's glue creates a bare InteractiveShell when called outside a kernel; a later Run in the same process
    (another test) then found it and failed to switch it to the inline backend."""
    pytest.importorskip("myst_nb")
    from IPython.core.interactiveshell import InteractiveShell

    from kvlib.publish.run import Run

    if InteractiveShell.initialized():
        pytest.skip("an IPython shell already runs in this process")
    monkeypatch.delenv("KVLIB_PROFILE", raising=False)
    Run("a", profile="ci").glue("x", 1)
    assert not InteractiveShell.initialized()


def test_run_starts_beside_a_bare_ipython_shell(monkeypatch):
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    from kvlib.publish.run import Run

    monkeypatch.delenv("KVLIB_PROFILE", raising=False)
    created = not InteractiveShell.initialized()
    InteractiveShell.instance()  # what IPython's display helpers leave behind outside a kernel
    try:
        Run("a", profile="ci")  # no backend switch on a shell that cannot switch
    finally:
        if created:
            InteractiveShell.clear_instance()


def test_cli_refuses_profile_parameter(sandbox):
    pytest.importorskip("papermill", reason="the runner needs the book extra")
    from kvlib.publish.__main__ import main

    assert main(["run", "--profile", "ci", "--only", "concentration_theory", "-p", "profile=cpu",
                 "--no-progress"]) == 2


@pytest.mark.parametrize("value,ok", [(3, True), ("abc", False), (2.5, False), (True, False)])
def test_parameter_types_checked_before_running(sandbox, value, ok):
    e = entry("typed")
    if ok:
        (o,) = run_notebooks("ci", overrides={"x": value}, entries=[e], progress=False)
        assert o.status == "executed"
    else:
        with pytest.raises(ValueError, match=r"parameter x=.*default 1 is a int"):
            run_notebooks("ci", overrides={"x": value}, entries=[e], progress=False)
        assert not (sandbox / "executed").exists()


def test_registered_parameter_types():
    """Every registered profile's parameters have the type of the notebook's defaults (the check is not too
    strict for the registry itself)."""
    pytest.importorskip("papermill", reason="the runner needs the book extra")
    from kvlib.publish.registry import all_notebooks
    from kvlib.publish.runner import validate

    for nb in all_notebooks():
        for profile in nb.profiles:
            validate(nb, nb.params(profile))


def test_list_needs_no_book_extra(tmp_path):
    # a Python where nbformat (the book extra) cannot be imported
    block = tmp_path / "nbformat.py"
    block.write_text("raise ModuleNotFoundError(\"No module named 'nbformat'\", name='nbformat')\n")
    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{tmp_path}:{root}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "kvlib.publish", "list"], capture_output=True, text=True, env=env,
                         cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "concentration_theory" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvlib.publish", "assemble", "--profile", "ci"], capture_output=True,
                         text=True, env=env, cwd=root, timeout=120)
    assert out.returncode == 2 and "book extra" in out.stderr and "nbformat" in out.stderr
