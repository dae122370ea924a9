"""Execute registered notebooks with papermill for one profile; isolate failures; report."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlib.publish.provenance import repo_root
from kvlib.publish.registry import NotebookEntry, all_notebooks

#: per-notebook wall-clock limit (s) by profile, enforced by papermill's cell timeout
CELL_TIMEOUT = {"ci": 600, "cpu": 1800, "gpu": 3600}


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | skipped
    seconds: float
    detail: str = ""


def executed_path(name: str, profile: str) -> Path:
    """Where the executed notebook of ``name`` at ``profile`` is kept (``$KVLIB_EXECUTED_DIR`` overrides)."""
    override = os.environ.get("KVLIB_EXECUTED_DIR")
    base = Path(override) if override else repo_root() / "book" / "executed"
    return base / profile / f"{name}.ipynb"


def notebook_parameters(path: Path) -> set[str]:
    """Names declared in the notebook's ``parameters`` cell (papermill's own inspection)."""
    import papermill as pm

    return set(pm.inspect_notebook(str(path)).keys())


def validate(entry: NotebookEntry, params: dict[str, Any]) -> None:
    """Unknown parameters are an error before anything runs."""
    path = Path(entry.path) if Path(entry.path).is_absolute() else repo_root() / entry.path
    if not path.exists():
        raise FileNotFoundError(f"notebook {entry.name!r}: {entry.path} does not exist")
    declared = notebook_parameters(path)
    if not declared:
        raise ValueError(f"notebook {entry.name!r} has no cell tagged 'parameters'")
    unknown = sorted(set(params) - declared)
    if unknown:
        raise ValueError(
            f"notebook {entry.name!r} has no parameter(s) {unknown}; it declares {sorted(declared)}"
        )


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


def run_notebooks(
    profile: str,
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress: bool = True,
    entries: list[NotebookEntry] | None = None,
) -> list[Outcome]:
    """Run every selected notebook at ``profile``; one failure never stops the others.

    ``entries`` replaces the registry (tests use it); ``only`` selects among them by name.
    """
    import papermill as pm
    from tqdm.auto import tqdm

    entries = select(profile, only) if entries is None else [e for e in entries if not only or e.name in only]
    plan: list[tuple[NotebookEntry, dict[str, Any] | None, str]] = []
    # Validate everything first, so a typo fails in a second, not after an hour of runs.
    for e in entries:
        params = e.params(profile)
        if params is None:
            plan.append((e, None, f"no {profile!r} profile"))
            continue
        params.update(overrides or {})
        if e.needs_gpu and not gpu_available():
            plan.append((e, None, "needs a GPU; the book shows the committed GPU run"))
            continue
        validate(e, params)
        plan.append((e, params, ""))

    outcomes: list[Outcome] = []
    env_backup = os.environ.get("KVLIB_PROFILE")
    bar = tqdm(plan, desc=f"notebooks [{profile}]", unit="nb", disable=not progress)
    for e, params, why in bar:
        bar.set_postfix_str(e.name)
        if params is None:
            outcomes.append(Outcome(e.name, "skipped", 0.0, why))
            continue
        out = executed_path(e.name, profile)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial.ipynb")
        t0 = time.perf_counter()
        try:
            os.environ["KVLIB_PROFILE"] = profile
            pm.execute_notebook(
                str(e.path if Path(e.path).is_absolute() else repo_root() / e.path),
                str(tmp),
                parameters=params,
                cwd=str(repo_root()),
                progress_bar=False,
                execution_timeout=CELL_TIMEOUT[profile],
                kernel_name="python3",
            )
            os.replace(tmp, out)
            outcomes.append(Outcome(e.name, "ok", time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - any failure is reported, the rest still run
            detail = str(exc).strip().splitlines()
            msg = detail[-1] if detail else type(exc).__name__
            if not isinstance(exc, pm.PapermillExecutionError):
                msg = traceback.format_exception_only(type(exc), exc)[-1].strip()
            outcomes.append(Outcome(e.name, "failed", time.perf_counter() - t0, f"{msg[:300]} (see {tmp.name})"))
    if env_backup is None:
        os.environ.pop("KVLIB_PROFILE", None)
    else:
        os.environ["KVLIB_PROFILE"] = env_backup
    return outcomes


def summary_table(outcomes: list[Outcome]) -> str:
    from tabulate import tabulate

    rows = [(o.name, o.status, f"{o.seconds:.1f}", o.detail) for o in outcomes]
    return tabulate(rows, headers=["notebook", "status", "time (s)", "detail"], tablefmt="github")
