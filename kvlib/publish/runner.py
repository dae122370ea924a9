"""Execute registered notebooks with papermill for one profile; isolate failures; report.

A notebook's source is a MyST markdown file (``notebooks/<chapter>/<name>.md``, jupytext's ``md:myst``), the
one file a researcher edits. It is converted to a notebook in memory and executed; only the executed
``.ipynb`` is written (``book/executed/<profile>/<name>.ipynb``), with its cache key in ``metadata.kvlib``
(:mod:`kvlib.publish.cache`): ``build`` executes a notebook again only when that key no longer holds.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from kvlib.publish.provenance import repo_root
from kvlib.publish.registry import NotebookEntry, all_notebooks

#: warning filters of the executing kernel: it has no widget frontend, so ``tqdm.auto`` (imported by transformers)
#: falls back to text progress bars and says so on stderr, a remark on the execution environment that would
#: otherwise head every page that loads a model. Every other warning still reaches the page.
KERNEL_WARNINGS = "ignore:IProgress not found:Warning"  # (tqdm.TqdmWarning is not importable at interpreter start)
#: per-notebook wall-clock limit (s) by profile, enforced by papermill's cell timeout
CELL_TIMEOUT = {"ci": 600, "cpu": 1800, "gpu": 3600}

#: jupytext's name for the sources' format
SOURCE_FORMAT = "md:myst"


@dataclass
class Outcome:
    name: str
    status: str  # reused | executed | failed | skipped
    seconds: float
    detail: str = ""


def executed_path(name: str, profile: str) -> Path:
    """Where the executed notebook of ``name`` at ``profile`` is kept (``$KVLIB_EXECUTED_DIR`` overrides)."""
    override = os.environ.get("KVLIB_EXECUTED_DIR")
    base = Path(override) if override else repo_root() / "book" / "executed"
    return base / profile / f"{name}.ipynb"


def source_path(entry: NotebookEntry) -> Path:
    """The entry's MyST source, absolute; a missing file or another format is an error."""
    path = Path(entry.path) if Path(entry.path).is_absolute() else repo_root() / entry.path
    if path.suffix != ".md":
        raise ValueError(f"notebook {entry.name!r}: path must be a MyST markdown source (.md), got {entry.path!r}")
    if not path.exists():
        raise FileNotFoundError(f"notebook {entry.name!r}: {entry.path} does not exist")
    return path


def load_source(path: str | Path) -> nbformat.NotebookNode:
    """The notebook a MyST source stands for, with stable cell ids (``<stem>-<index>``), so that two runs
    of unchanged code give notebooks that differ only in their outputs."""
    import jupytext

    path = Path(path)
    nb = jupytext.read(path, fmt=SOURCE_FORMAT)
    # The executed notebook is not a jupytext pair of the source; without this key Jupyter treats it as plain.
    nb.metadata.pop("jupytext", None)
    nb.metadata.setdefault("language_info", {"name": "python"})
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", path.stem)[:56]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{stem}-{i:03d}"
    nbformat.validate(nb)
    return nb


def notebook_parameters(source: str | Path | nbformat.NotebookNode) -> set[str]:
    """Names declared in the notebook's ``parameters`` cell (papermill's own inspection)."""
    import papermill as pm

    nb = source if isinstance(source, nbformat.NotebookNode) else load_source(source)
    # papermill inspects files only; the converted notebook goes through a temporary one.
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "source.ipynb"
        nbformat.write(nb, tmp)
        return set(pm.inspect_notebook(str(tmp)).keys())


def _parameter_defaults(nb: nbformat.NotebookNode) -> dict[str, str]:
    """``{name: default source text}`` of the notebook's ``parameters`` cell (papermill's own inspection)."""
    import papermill as pm

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "source.ipynb"
        nbformat.write(nb, tmp)
        return {k: v.get("default") for k, v in pm.inspect_notebook(str(tmp)).items()}


def _fits(default: Any, value: Any) -> bool:
    """Whether ``value`` can stand for a parameter whose default is ``default``: numbers are strict (an int takes
    an int, a float an int or a float, a bool a bool), a str default also takes a list of str, and a list default
    also takes one element of its first element's type (the notebooks accept a scalar for a one-element list)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, str):
        return isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value))
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple)) or (len(default) > 0 and _fits(default[0], value))
    return True


def _type_problem(name: str, default_src: str | None, value: Any) -> str | None:
    """Why ``value`` cannot stand for a parameter whose default is the source text ``default_src`` (None: it can;
    a default of None or one that is not a literal takes anything). See :func:`_fits`."""
    import ast

    try:
        default = ast.literal_eval(default_src) if default_src is not None else None
    except (ValueError, SyntaxError):
        return None
    if default is None or _fits(default, value):
        return None
    return (f"parameter {name}={value!r} is a {type(value).__name__}; the notebook's default {default_src} is a "
            f"{type(default).__name__}")


def validate(entry: NotebookEntry, params: dict[str, Any]) -> nbformat.NotebookNode:
    """Unknown or mistyped parameters are an error before anything runs; returns the converted notebook."""
    nb = load_source(source_path(entry))
    defaults = _parameter_defaults(nb)
    declared = set(defaults)
    if not declared:
        raise ValueError(f"notebook {entry.name!r} has no cell tagged 'parameters'")
    unknown = sorted(set(params) - declared)
    if unknown:
        raise ValueError(
            f"notebook {entry.name!r} has no parameter(s) {unknown}; it declares {sorted(declared)}"
        )
    bad = [m for k, v in params.items() if (m := _type_problem(k, defaults[k], v))]
    if bad:
        raise ValueError(f"notebook {entry.name!r}: " + "; ".join(bad))
    return nb


def code_cells(nb: nbformat.NotebookNode) -> list[str]:
    """The code a notebook runs, cell by cell: papermill's injected parameters cell left out, and trailing
    whitespace at the end of a cell ignored (a MyST source cannot carry it)."""
    return [c.source.rstrip() for c in nb.cells
            if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])]


def stale_cells(source: nbformat.NotebookNode, executed: nbformat.NotebookNode) -> list[str]:
    """Where ``executed`` did not run ``source``'s current code: one line per differing cell (empty: it did)."""
    want, ran = code_cells(source), code_cells(executed)
    out = [f"code cell {i}: source and executed run differ" for i, (a, b) in enumerate(zip(want, ran)) if a != b]
    if len(want) != len(ran):
        out.append(f"the source has {len(want)} code cells, the executed run {len(ran)}")
    return out


def gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def select(profile: str, only: list[str] | None = None) -> list[NotebookEntry]:
    entries = all_notebooks()
    if only:
        names = {e.name for e in entries}
        missing = [o for o in only if o not in names]
        if missing:
            raise ValueError(f"--only names unknown notebook(s) {missing}; registered: {sorted(names)}")
        entries = [e for e in entries if e.name in only]
    return entries


def reexecute_reasons(entry: NotebookEntry, profile: str, params: dict[str, Any], nb: nbformat.NotebookNode,
                      ) -> list[str]:
    """Why the build must execute ``entry`` again (empty: render its committed execution).

    The cache key first (:func:`kvlib.publish.cache.why_stale`); then, at a committed profile and only when the
    tree is clean (so that a new run would fix it), a result the strict build would refuse: from a dirty tree or
    from a commit older than the source's last change.
    """
    from kvlib.publish import cache
    from kvlib.publish.commits import COMMITTED_PROFILES, result_problems
    from kvlib.publish.provenance import git_commit, load_result

    path = executed_path(entry.name, profile)
    executed = nbformat.read(path, as_version=4) if path.exists() else None
    why = cache.why_stale(nb, params, executed)
    if why or profile not in COMMITTED_PROFILES or git_commit().endswith("+dirty"):
        return why
    res = load_result(entry.name, profile)
    if res is None:
        return ["no result file"]
    return result_problems(res.get("provenance", {}).get("commit"), _shown(source_path(entry)))


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(repo_root()))
    except ValueError:
        return str(path)


def _finish(tmp: Path, entry: NotebookEntry, nb: nbformat.NotebookNode, params: dict[str, Any], profile: str,
            commit: str, seconds: float) -> bool:
    """Name the source, drop the runner's record cells and store the cache key; False: the epilogue never ran."""
    from kvlib.publish import cache

    if not tmp.exists():
        return False
    executed = nbformat.read(tmp, as_version=4)
    report = cache.strip_record(executed)
    executed.metadata.get("papermill", {})["input_path"] = _shown(source_path(entry))
    if report is not None:
        executed.metadata[cache.KEY] = cache.make_record(
            nb, params, report, commit=commit, profile=profile, source=_shown(source_path(entry)), wall_s=seconds)
    nbformat.write(executed, tmp)
    return report is not None


def run_notebooks(
    profile: str,
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress: bool = True,
    entries: list[NotebookEntry] | None = None,
    reuse: bool = False,
) -> list[Outcome]:
    """Run every selected notebook at ``profile``; one failure never stops the others.

    ``entries`` replaces the registry (tests use it); ``only`` selects among them by name. With ``reuse``, a
    notebook whose committed execution is still current (:func:`reexecute_reasons`) is not executed again.
    """
    import papermill as pm
    from tqdm.auto import tqdm

    from kvlib.publish import cache
    from kvlib.publish.provenance import git_commit

    if "profile" in (overrides or {}):
        # the profile decides where results are written: it is --profile's, never a parameter's
        raise ValueError(f"-p profile={overrides['profile']!r}: the profile is not a parameter; use --profile "
                         "(a parameter cannot reroute a run into another profile's results)")
    entries = select(profile, only) if entries is None else [e for e in entries if not only or e.name in only]
    plan: list[tuple[NotebookEntry, dict[str, Any] | None, nbformat.NotebookNode | None, str]] = []
    # Validate everything first, so a typo fails in a second, not after an hour of runs.
    for e in entries:
        params = e.params(profile)
        if params is None:
            plan.append((e, None, None, f"no {profile!r} profile"))
            continue
        params.update(overrides or {})
        if e.needs_gpu and not gpu_available():
            plan.append((e, None, None, "needs a GPU; the book shows the committed GPU run"))
            continue
        plan.append((e, params, validate(e, params), ""))

    outcomes: list[Outcome] = []
    env_backup = os.environ.get("KVLIB_PROFILE")
    warn_backup = os.environ.get("PYTHONWARNINGS")
    bar = tqdm(plan, desc=f"notebooks [{profile}]", unit="nb", disable=not progress)
    for e, params, nb, why in bar:
        bar.set_postfix_str(e.name)
        if params is None:
            outcomes.append(Outcome(e.name, "skipped", 0.0, why))
            continue
        reasons = reexecute_reasons(e, profile, params, nb) if reuse else ["asked to run"]
        if not reasons:
            rec = cache.record_of(nbformat.read(executed_path(e.name, profile), as_version=4)) or {}
            outcomes.append(Outcome(e.name, "reused", 0.0, f"unchanged since its execution at {rec.get('commit')}"))
            continue
        out = executed_path(e.name, profile)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial.ipynb")
        commit = git_commit()
        t0 = time.perf_counter()
        try:
            os.environ["KVLIB_PROFILE"] = profile
            os.environ["PYTHONWARNINGS"] = KERNEL_WARNINGS  # read by the kernel process at its start
            pm.execute_notebook(
                cache.instrument(nb),
                str(tmp),
                parameters=params,
                cwd=str(repo_root()),
                progress_bar=False,
                execution_timeout=CELL_TIMEOUT[profile],
                kernel_name="python3",
            )
            if not _finish(tmp, e, nb, params, profile, commit, time.perf_counter() - t0):
                raise RuntimeError("the runner's epilogue cell left no record of the modules the kernel loaded")
            os.replace(tmp, out)
            outcomes.append(Outcome(e.name, "executed", time.perf_counter() - t0, "; ".join(reasons)))
        except Exception as exc:  # noqa: BLE001 - any failure is reported, the rest still run
            _finish(tmp, e, nb, params, profile, commit, time.perf_counter() - t0)
            detail = str(exc).strip().splitlines()
            msg = detail[-1] if detail else type(exc).__name__
            if not isinstance(exc, pm.PapermillExecutionError):
                msg = traceback.format_exception_only(type(exc), exc)[-1].strip()
            msg = " ".join(msg.split())  # one line in the summary table
            outcomes.append(Outcome(e.name, "failed", time.perf_counter() - t0, f"{msg[:300]} (see {tmp.name})"))
    for key, value in (("KVLIB_PROFILE", env_backup), ("PYTHONWARNINGS", warn_backup)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return outcomes


def summary_table(outcomes: list[Outcome]) -> str:
    from tabulate import tabulate

    rows = [(o.name, o.status, f"{o.seconds:.1f}", o.detail) for o in outcomes]
    statuses = ("reused", "executed", "failed", "skipped")
    counts = ", ".join(f"{sum(o.status == s for o in outcomes)} {s}" for s in statuses)
    return tabulate(rows, headers=["notebook", "status", "time (s)", "why"], tablefmt="github") + f"\n\n{counts}"
