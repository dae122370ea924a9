"""Reading provenance back, on the build side: full commits, the dirty state, and the checks the strict build
applies. Kept apart from :mod:`kvlib.publish.provenance`, which every notebook kernel loads: a change here must
not invalidate every cached execution."""

from __future__ import annotations

import subprocess
from typing import Any

from kvlib.publish.provenance import repo_root

#: profiles whose results are committed and so must trace to a clean commit (ci results are a smoke run of the
#: working tree, never committed)
COMMITTED_PROFILES = ("cpu", "gpu")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True, timeout=60)


_RESOLVED: dict[str, str | None] = {}


def resolve_commit(rev: str) -> str | None:
    """The full 40-character commit ``rev`` names in this repository (None: it names none)."""
    if rev not in _RESOLVED:
        out = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}") if rev else None
        _RESOLVED[rev] = out.stdout.strip() if out is not None and out.returncode == 0 else None
    return _RESOLVED[rev]


def parse_commit(recorded: Any) -> tuple[str | None, bool, str]:
    """A recorded commit string (``<sha>``, ``<sha>+dirty``, ``<sha>+uncommitted ...``) as (full sha or None,
    dirty, the note after the sha)."""
    text = str(recorded or "").strip()
    head, plus, note = text.partition("+")
    rev = head.split()[0] if head.split() else ""
    return resolve_commit(rev), bool(plus), (plus + note).strip()


def show_commit(recorded: Any) -> str:
    """The commit as the provenance page shows it: full 40 characters, then the dirty state, never truncated."""
    sha, dirty, note = parse_commit(recorded)
    if sha is None:
        return f"{recorded} (not a commit of this repository)"
    return sha + (f" {note}" if dirty else "")


def source_last_change(source: str) -> str | None:
    """The last commit that changed ``source`` (None: never committed)."""
    out = _git("log", "-1", "--format=%H", "--", source).stdout.strip()
    return out or None


def source_is_modified(source: str) -> bool:
    return bool(_git("status", "--porcelain", "--", source).stdout.strip())


def result_problems(recorded: Any, source: str | None = None) -> list[str]:
    """Why a result's recorded commit cannot back a rendered number: unknown commit, a dirty tree, or (given the
    notebook ``source``) a commit older than the source's last change (``git merge-base --is-ancestor``)."""
    sha, dirty, note = parse_commit(recorded)
    if sha is None:
        return [f"commit {recorded!r} is not a commit of this repository"]
    out = [f"ran from a dirty tree ({note})"] if dirty else []
    if source:
        last = source_last_change(source)
        if last is None or source_is_modified(source):
            out.append(f"its source {source} has uncommitted changes")
        elif _git("merge-base", "--is-ancestor", last, sha).returncode != 0:
            out.append(f"commit {sha} predates the last change to {source} ({last})")
    return out
