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


# -- when each rule was declared, and when each claim was first measured (the register's pre-registration) --------

def _cat(specs: list[str]) -> list[bytes | None]:
    """Blobs ``<commit>:<path>`` through one ``git cat-file --batch`` (None where a spec names nothing)."""
    if not specs:
        return []
    out = subprocess.run(["git", "cat-file", "--batch"], cwd=repo_root(), input="\n".join(specs).encode() + b"\n",
                         capture_output=True, timeout=120).stdout
    blobs: list[bytes | None] = []
    i = 0
    for _ in specs:
        nl = out.index(b"\n", i)
        head = out[i:nl].split()
        if len(head) < 3 or head[1] == b"missing":
            blobs.append(None)
            i = nl + 1
            continue
        size = int(head[2])
        blobs.append(out[nl + 1:nl + 1 + size])
        i = nl + 1 + size + 1
    return blobs


_RULE_COMMITS: dict[str, tuple[str, str]] | None = None


def rule_commits() -> dict[str, tuple[str, str]]:
    """``{claim id: (commit, commit date)}``: the commit that introduced each claim's current rule (the oldest
    commit of the unbroken run, back from HEAD, in which the claim's rule hash is the one HEAD has). A claim
    whose rule in the working tree differs from HEAD's is absent (its rule is not committed)."""
    global _RULE_COMMITS
    if _RULE_COMMITS is not None:
        return _RULE_COMMITS
    import yaml

    from kvlib.publish.verdicts import rule_hash

    def hashes(texts: list[bytes | None]) -> dict[str, str]:
        out = {}
        for t in texts:
            for c in (yaml.safe_load(t) or {}).get("claims", []) if t else []:
                if isinstance(c, dict) and "id" in c:
                    out[c["id"]] = rule_hash(_rule_of(c))
        return out

    log = _git("log", "--format=%H %cI", "--", "data/claims").stdout.split("\n")
    commits = [line.split() for line in log if line.strip()]
    per_commit = []
    for sha, date in commits:
        files = [f for f in _git("ls-tree", "--name-only", sha, "data/claims/").stdout.split() if f.endswith(".yml")]
        per_commit.append((sha, date, hashes(_cat([f"{sha}:{f}" for f in files]))))
    now = hashes([p.read_bytes() for p in sorted((repo_root() / "data" / "claims").glob("*.yml"))])
    found = {}
    for cid, h in now.items():
        intro = None
        for sha, date, hs in per_commit:  # newest first
            if hs.get(cid) != h:
                break
            intro = (sha, date)
        if intro is not None:
            found[cid] = intro
    _RULE_COMMITS = found
    return found


def _rule_of(c: dict) -> dict:
    # as kvlib.publish.verdicts.rule_of, on a raw entry (no validation: old commits hold old rule schemas)
    if "context_of" in c:
        return {"context_of": c["context_of"], "measure": c.get("measure", "")}
    return dict(c.get("rule") or {})


_FIRST: dict[str, tuple[str, str]] | None = None


def first_measurements() -> dict[str, tuple[str, str]]:
    """``{claim id: (commit, commit date)}``: the first commit whose result files (``data/results/*/*.json``)
    carry a record of the claim, i.e. when a number for it was first committed (and so seen)."""
    global _FIRST
    if _FIRST is not None:
        return _FIRST
    import re

    out: dict[str, tuple[str, str]] = {}
    text = _git("log", "-p", "--reverse", "--format=@@commit %H %cI", "--", "data/results/*/*.json").stdout
    rx = re.compile(r'^\+\s*"id": "([^"]+)"')
    current = ("", "")
    for line in text.split("\n"):
        if line.startswith("@@commit "):
            _, sha, date = line.split()
            current = (sha, date)
        else:
            m = rx.match(line)
            if m and m.group(1) not in out:
                out[m.group(1)] = current
    _FIRST = out
    return out
