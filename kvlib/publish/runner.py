"""Execute registered notebooks with papermill for one profile; isolate failures; report.

A notebook's source is a MyST markdown file (``notebooks/<chapter>/<name>.md``, jupytext's ``md:myst``), the
one file a researcher edits. It is converted to a notebook in memory and executed; only the executed
``.ipynb`` is written (``book/executed/<profile>/<name>.ipynb``), with its cache key in ``metadata.kvlib``
(:mod:`kvlib.publish.cache`): ``build`` executes a notebook again only when that key no longer holds.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from kvlib.publish.provenance import repo_root
from kvlib.publish.registry import NotebookEntry, all_notebooks
from kvlib.publish.sources import executed_path, load_source, shown, source_path

#: warning filters of the executing kernel: it has no widget frontend, so ``tqdm.auto`` (imported by transformers)
#: falls back to text progress bars and says so on stderr, a remark on the execution environment that would
#: otherwise head every page that loads a model. Every other warning still reaches the page.
KERNEL_WARNINGS = "ignore:IProgress not found:Warning"  # (tqdm.TqdmWarning is not importable at interpreter start)
#: per-notebook wall-clock limit (s) by profile, enforced by papermill's cell timeout
CELL_TIMEOUT = {"ci": 600, "cpu": 1800, "gpu": 3600}

@dataclass
class Outcome:
    name: str
    status: str  # reused | executed | failed | skipped
    seconds: float
    detail: str = ""


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
    return result_problems(res.get("provenance", {}).get("commit"), shown(source_path(entry)))


def stale_report(profile: str, only: list[str] | None = None, entries: list[NotebookEntry] | None = None,
                 ) -> list[tuple[str, list[str]]]:
    """(notebook, why) for every selected notebook whose execution at ``profile`` a build would run again
    (``entries`` replaces the registry)."""
    out = []
    for e in select(profile, only) if entries is None else entries:
        params = e.params(profile)
        if params is None or (e.needs_gpu and profile != "gpu"):
            continue
        why = reexecute_reasons(e, profile, params, validate(e, params))
        if why:
            out.append((e.name, why))
    return out



def _finish(tmp: Path, entry: NotebookEntry, nb: nbformat.NotebookNode, params: dict[str, Any], profile: str,
            commit: str, seconds: float) -> bool:
    """Name the source, drop the runner's record cells and store the cache key; False: the epilogue never ran."""
    from kvlib.publish import cache

    if not tmp.exists():
        return False
    executed = nbformat.read(tmp, as_version=4)
    report = cache.strip_record(executed)
    executed.metadata.get("papermill", {})["input_path"] = shown(source_path(entry))
    if report is not None:
        executed.metadata[cache.KEY] = cache.make_record(
            nb, params, report, commit=commit, profile=profile, source=shown(source_path(entry)), wall_s=seconds)
    nbformat.write(executed, tmp)
    return report is not None


#: memory (MB) assumed for an execution whose record holds no measured peak (executed before it was recorded)
DEFAULT_PEAK_MB = 4096


def expected_cost(name: str, profile: str) -> tuple[float, float]:
    """(wall seconds, peak resident MB) of the previous execution of ``name`` at ``profile``, from its record
    (unknown: 0 s and :data:`DEFAULT_PEAK_MB`); the schedule starts the longest first and keeps the sum of the
    running executions' peaks within the memory budget."""
    from kvlib.publish import cache

    path = executed_path(name, profile)
    if not path.exists():
        return 0.0, float(DEFAULT_PEAK_MB)
    nb = nbformat.read(path, as_version=4)
    rec = cache.record_of(nb) or {}
    wall = rec.get("wall_s") or nb.metadata.get("papermill", {}).get("duration") or 0.0
    return float(wall), float(rec.get("peak_rss_mb") or DEFAULT_PEAK_MB)


def memory_budget_mb() -> float:
    """Memory the parallel schedule may plan with: ``$KVLIB_MEMORY_MB``, else 80% of what the OS reports
    available now."""
    env = os.environ.get("KVLIB_MEMORY_MB")
    if env:
        return float(env)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return 0.8 * int(line.split()[1]) / 1024
    except OSError:
        pass
    return 8192.0


def run_notebooks(
    profile: str,
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress: bool = True,
    entries: list[NotebookEntry] | None = None,
    reuse: bool = False,
    jobs: int = 1,
) -> list[Outcome]:
    """Run every selected notebook at ``profile``; one failure never stops the others.

    ``entries`` replaces the registry (tests use it); ``only`` selects among them by name. With ``reuse``, a
    notebook whose committed execution is still current (:func:`reexecute_reasons`) is not executed again.
    ``jobs`` > 1 executes that many notebooks at a time (each kernel then gets ``cpu_count // jobs`` threads),
    longest first, and starts one only while the recorded peaks of those running fit :func:`memory_budget_mb`.
    Outcomes come back in the registry's order.
    """
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from tqdm.auto import tqdm

    from kvlib.publish import cache

    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
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

    done: dict[str, Outcome] = {}
    todo = []
    for e, params, nb, why in plan:
        if params is None:
            done[e.name] = Outcome(e.name, "skipped", 0.0, why)
            continue
        reasons = reexecute_reasons(e, profile, params, nb) if reuse else ["asked to run"]
        if not reasons:
            rec = cache.record_of(nbformat.read(executed_path(e.name, profile), as_version=4)) or {}
            done[e.name] = Outcome(e.name, "reused", 0.0, f"unchanged since its execution at {rec.get('commit')}")
            continue
        todo.append((e, params, nb, reasons, *expected_cost(e.name, profile)))

    saved = {k: os.environ.get(k) for k in ("KVLIB_PROFILE", "PYTHONWARNINGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ["KVLIB_PROFILE"] = profile
    os.environ["PYTHONWARNINGS"] = KERNEL_WARNINGS  # read by the kernel process at its start
    if jobs > 1 and saved["OMP_NUM_THREADS"] is None:
        # kernels inherit this at their start: jobs kernels of cpu_count // jobs threads share the machine
        threads = str(max(1, (os.cpu_count() or 1) // jobs))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
    bar = tqdm(total=len(todo), desc=f"notebooks [{profile}]", unit="nb", disable=not progress or not todo)
    try:
        if jobs == 1:
            for e, params, nb, reasons, _, _ in todo:
                bar.set_postfix_str(e.name)
                done[e.name] = _execute(e, params, nb, profile, reasons)
                bar.update()
        else:
            budget = memory_budget_mb()
            queue = sorted(todo, key=lambda t: -t[4])  # longest first: the last to finish starts early
            running: dict[Any, float] = {}
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                while queue or running:
                    used = sum(running.values())
                    pick = next((t for t in queue if not running or used + t[5] <= budget), None)
                    if pick is not None and len(running) < jobs:
                        queue.remove(pick)
                        e, params, nb, reasons, _, peak = pick
                        running[pool.submit(_execute, e, params, nb, profile, reasons)] = peak
                        continue
                    finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                    for f in finished:
                        running.pop(f)
                        o = f.result()
                        done[o.name] = o
                        bar.set_postfix_str(o.name)
                        bar.update()
    finally:
        bar.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return [done[e.name] for e, *_ in plan]


def _execute(e: NotebookEntry, params: dict[str, Any], nb: nbformat.NotebookNode, profile: str,
             reasons: list[str]) -> Outcome:
    """Execute one notebook with papermill (its own kernel process); a failure is an outcome, never raised."""
    import papermill as pm

    from kvlib.publish import cache
    from kvlib.publish.provenance import git_commit

    out = executed_path(e.name, profile)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial.ipynb")
    commit = git_commit()
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(
            cache.instrument(nb),
            str(tmp),
            parameters=params,
            cwd=str(repo_root()),
            progress_bar=False,
            execution_timeout=CELL_TIMEOUT[profile],
            kernel_name="python3",
            # the kernel's own log (an unencrypted-TCP notice at every start, a KeyboardInterrupt at shutdown) is
            # about the runner's local kernel, not the notebook; cell errors still reach the notebook and the table
            extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
        )
        if not _finish(tmp, e, nb, params, profile, commit, time.perf_counter() - t0):
            raise RuntimeError("the runner's epilogue cell left no record of the modules the kernel loaded")
        os.replace(tmp, out)
        return Outcome(e.name, "executed", time.perf_counter() - t0, "; ".join(reasons))
    except Exception as exc:  # noqa: BLE001 - any failure is reported, the rest still run
        _finish(tmp, e, nb, params, profile, commit, time.perf_counter() - t0)
        detail = str(exc).strip().splitlines()
        msg = detail[-1] if detail else type(exc).__name__
        if not isinstance(exc, pm.PapermillExecutionError):
            msg = traceback.format_exception_only(type(exc), exc)[-1].strip()
        msg = " ".join(msg.split())  # one line in the summary table
        return Outcome(e.name, "failed", time.perf_counter() - t0, f"{msg[:300]} (see {tmp.name})")


def summary_table(outcomes: list[Outcome]) -> str:
    from tabulate import tabulate

    rows = [(o.name, o.status, f"{o.seconds:.1f}", o.detail) for o in outcomes]
    statuses = ("reused", "executed", "failed", "skipped")
    counts = ", ".join(f"{sum(o.status == s for o in outcomes)} {s}" for s in statuses)
    return tabulate(rows, headers=["notebook", "status", "time (s)", "why"], tablefmt="github") + f"\n\n{counts}"
