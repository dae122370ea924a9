"""The execution cache: a committed execution is reused while what it ran is unchanged.

At execution the runner wraps the notebook in two cells of its own (removed from the saved notebook): a
prologue that installs an audit hook (:func:`sys.addaudithook`) recording which files of the repository the
kernel opens, and an import hook (:mod:`kvlib.publish._watch`) that records each ``kvlib`` function the first
time it is entered; and an epilogue that reports every ``kvlib`` module the kernel had loaded (``sys.modules``)
with the hash of its module-level code and of each function the execution ran, the sha256 of every repository
file it read (its data inputs: GPU result files, known-answer vectors), and the hash of the rule of every claim it
judged (the claims files themselves are not inputs: editing one claim's rule makes stale only the executions that
judged that claim). Both run inside the kernel, so the record is what that execution really ran, not a guess from
the imports written in the source: a change to a function it never called (another kernel in the same file)
leaves it current. The runner stores the record, with hashes of the source's code and markdown cells and the
parameters, as ``metadata.kvlib`` of the executed notebook (:data:`KEY`).

:func:`why_stale` compares that record with the files as they are now: an empty answer means a fresh
execution would run the same code, on the same inputs, with the same parameters, so the build renders the
committed one. Not covered (said here so nobody relies on it): package versions, files read by native code
that bypasses Python's ``open`` (e.g. safetensors' mmap), files outside the repository (model weights), and
kvlib code reached other than by a Python call of one of its functions (a Python child process counts every
function of every loaded module as run; Triton kernels compiled rather than interpreted likewise).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import nbformat

from kvlib.publish import _watch
from kvlib.publish.provenance import repo_root

#: the executed notebook's metadata key holding the cache record
KEY = "kvlib"
#: version of the record's layout: 2 keys each module on the functions the execution ran (:mod:`._watch`), 1 (still
#: read) on the whole file of every module loaded; a record of another version is stale
FORMAT = 2
READ_FORMATS = (1, 2)
#: tag of the runner's own cells (prologue, epilogue); they never reach a saved notebook
RECORD_TAG = "kvlib-record"
RECORD_MIME = "application/vnd.kvlib.record+json"

# Standard library only, and no kvlib import: the record must not change the module set it reports. The prologue
# runs kvlib/publish/_watch.py's text (not an import) to instrument every later kvlib import.
PROLOGUE = '''\
def _kvlib_watch():
    import os, sys
    root = os.getcwd() + os.sep  # the runner starts the kernel in the repository root
    skip = (root + ".git" + os.sep, root + ".venv" + os.sep)
    seen = {"read": set(), "written": set(), "subprocess": False}

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & 0o103)
        elif event == "os.rename":
            path, writing = args[1], True
        elif event in ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn"):
            # what a Python child process ran is not seen: then every function of a loaded module counts as run
            argv = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [args[0]]
            exe = [os.fspath(a) for a in (args[0], *argv[:1]) if isinstance(a, (str, bytes, os.PathLike))]
            if any("python" in os.path.basename(str(a)) for a in exe):
                seen["subprocess"] = True
            return
        else:
            return
        if isinstance(path, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(path))
            if path.startswith(root) and not path.startswith(skip) and "__pycache__" not in path:
                seen["written" if writing else "read"].add(path[len(root):])

    sys.addaudithook(hook)
    ns = {"__name__": "_kvlib_watch"}
    with open(os.path.join(root, "kvlib", "publish", "_watch.py")) as f:
        exec(compile(f.read(), "_kvlib_watch", "exec"), ns)
    seen["watch"], seen["ran"] = ns, ns["install"](root)
    return seen


_kvlib_seen = _kvlib_watch()
'''

EPILOGUE = '''\
def _kvlib_report(seen):
    import hashlib, os, resource, sys
    from IPython.display import display

    def sha(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    modules = seen["watch"]["report"](seen["ran"], os.getcwd(), subprocess_python=seen["subprocess"])
    files = {p for p in seen["read"] - seen["written"] if os.path.isfile(p)}
    files -= {m["file"] for m in modules.values()}
    inputs = {p: sha(p) for p in sorted(files) if not p.endswith(".py") or not p.startswith("kvlib" + os.sep)}
    # the rules of the claims this execution judged (their hashes), in place of the whole claims files it read
    rules = dict(getattr(sys.modules.get("kvlib.publish.verdicts"), "JUDGED", None) or {})
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the kernel's peak resident set (Linux: KB)
    display({"__MIME__": {"modules": modules, "inputs": inputs, "rules": rules, "peak_rss_mb": round(peak_mb, 1)}},
            raw=True)


_kvlib_report(_kvlib_seen)
'''.replace("__MIME__", RECORD_MIME)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _canon(params: dict[str, Any]) -> Any:
    # YAML gives lists, a CLI override may give tuples: compare what papermill would inject.
    return json.loads(json.dumps(params, sort_keys=True, default=str))


def source_hashes(nb: nbformat.NotebookNode) -> dict[str, str]:
    """sha256 of the code cells (as :func:`sources.code_cells` compares them) and of the markdown cells."""
    from kvlib.publish.sources import code_cells

    md = [c.source.rstrip() for c in nb.cells if c.cell_type == "markdown"]
    return {"code": sha256_text(json.dumps(code_cells(nb))), "markdown": sha256_text(json.dumps(md))}


def instrument(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` with the prologue first and the epilogue last (both hidden, tagged :data:`RECORD_TAG`)."""
    import copy

    out = copy.deepcopy(nb)
    meta = {"tags": [RECORD_TAG, "remove-cell"]}
    pro = nbformat.v4.new_code_cell(PROLOGUE, metadata=dict(meta, tags=list(meta["tags"])))
    epi = nbformat.v4.new_code_cell(EPILOGUE, metadata=dict(meta, tags=list(meta["tags"])))
    pro["id"], epi["id"] = "kvlib-record-prologue", "kvlib-record-epilogue"
    out.cells = [pro, *out.cells, epi]
    return out


def strip_record(nb: nbformat.NotebookNode) -> dict[str, Any] | None:
    """Remove the runner's cells from an executed notebook; return the epilogue's report (None: it never ran)."""
    report = None
    for c in nb.cells:
        if RECORD_TAG in c.metadata.get("tags", []):
            for o in c.get("outputs", []):
                if RECORD_MIME in o.get("data", {}):
                    report = o["data"][RECORD_MIME]
    nb.cells = [c for c in nb.cells if RECORD_TAG not in c.metadata.get("tags", [])]
    return report


def make_record(source_nb: nbformat.NotebookNode, params: dict[str, Any], report: dict[str, Any], *,
                commit: str, profile: str, source: str, wall_s: float, stamped: dict[str, Any] | None = None,
                ) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "profile": profile,
        "source": source,
        **{f"{k}_sha256": v for k, v in source_hashes(source_nb).items()},
        "params": _canon(params),
        "modules": report["modules"],
        # a claims file is an input only through the rules of the claims judged: editing another claim's rule
        # must not make this execution stale
        "inputs": {p: h for p, h in report["inputs"].items() if _is_input(p)},
        "rules": dict(report.get("rules") or {}),
        "commit": commit,
        "wall_s": round(wall_s, 3),
        "peak_rss_mb": report.get("peak_rss_mb"),
        "stamped": stamped,
    }


def _is_input(path: str) -> bool:
    """Whether a file an execution read counts towards its cache key. Not the claims files (see make_record), and
    not the package's install metadata (``kvlib.egg-info``): importlib.metadata reads it, and ``pip install -e``
    rewrites it whenever pyproject.toml's dependencies change, which changes no notebook's result."""
    return not _is_claims_file(path) and ".egg-info/" not in path


def _is_claims_file(path: str) -> bool:
    return Path(path).parent.as_posix() == "data/claims" and path.endswith(".yml")


def record_of(executed: nbformat.NotebookNode) -> dict[str, Any] | None:
    rec = executed.metadata.get(KEY)
    return rec if isinstance(rec, dict) and rec.get("format") in READ_FORMATS else None


def why_stale(source_nb: nbformat.NotebookNode, params: dict[str, Any], executed: nbformat.NotebookNode | None,
              ) -> list[str]:
    """What changed since ``executed`` ran (empty: nothing; rendering it equals re-executing it)."""
    if executed is None:
        return ["no committed execution"]
    rec = record_of(executed)
    if rec is None:
        return ["no cache key (executed before the cache existed; see `python -m kvlib.publish stamp`)"]
    root = repo_root()
    out = []
    now = source_hashes(source_nb)
    if rec.get("code_sha256") != now["code"]:
        out.append("code cells changed")
    if rec.get("markdown_sha256") != now["markdown"]:
        out.append("markdown changed")
    if rec.get("params") != _canon(params):
        out.append(f"parameters changed ({rec.get('params')} -> {_canon(params)})")
    mods = []
    for m, v in sorted(rec.get("modules", {}).items()):
        if sha256_file(root / v["file"]) == v["sha256"]:
            continue
        if "skeleton" not in v:  # a format-1 record: any change to a loaded module counts
            mods.append(m)
            continue
        try:
            what = _watch.changed(v, (root / v["file"]).read_text())
        except FileNotFoundError:
            what = _watch.changed(v, None)
        except SyntaxError:
            what = ["does not parse"]
        if what:
            mods.append(f"{m} ({', '.join(what[:3])}{f' +{len(what) - 3} more' if len(what) > 3 else ''})")
    if mods:
        out.append(f"kvlib changed: {', '.join(mods[:4])}" + (f" (+{len(mods) - 4} more)" if len(mods) > 4 else ""))
    ins = [p for p, h in sorted(rec.get("inputs", {}).items())
           if _is_input(p) and sha256_file(root / p) != h]
    if ins:
        out.append(f"input changed: {', '.join(ins[:3])}" + (f" (+{len(ins) - 3} more)" if len(ins) > 3 else ""))
    from kvlib.publish.verdicts import stale_rules

    rules = stale_rules(rec.get("rules") or {})
    if rules:
        out.append(f"rule changed: {', '.join(rules[:3])}" + (f" (+{len(rules) - 3} more)" if len(rules) > 3 else ""))
    return out


# -- stamping executions made before the cache --------------------------------------------------------------

def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True, timeout=60)


def stamp_problems(entry, profile: str) -> tuple[list[str], dict[str, Any] | None]:
    """Why an execution without a cache key cannot be stamped (empty: it can), and the record to stamp.

    A stamp claims what the kernel would have recorded. It is written only when that claim can be checked:
    the executed code and markdown cells are the source's, the injected parameters are the registry's, the
    result file was written by this very execution (its start time lies inside papermill's) from a clean tree
    at a commit C that descends from the source's last change, and nothing it may have read changed since C:
    the source, all of ``kvlib/`` and every data file (``data/``, ``dev/results/``) other than the registered
    notebooks' own result files. Because the modules it loaded are unknown, the stamp lists every ``kvlib``
    file and every such data file: conservative, so any later change there re-executes it.
    """
    from kvlib.publish.commits import parse_commit, result_problems
    from kvlib.publish.provenance import load_result
    from kvlib.publish.registry import all_notebooks
    from kvlib.publish.sources import executed_path, load_source, shown, source_path, stale_cells

    path = executed_path(entry.name, profile)
    params = entry.params(profile)
    if params is None:
        return [f"no {profile!r} profile"], None
    if not path.exists():
        return ["no committed execution"], None
    executed = nbformat.read(path, as_version=4)
    if record_of(executed) is not None:
        return ["already has a cache key"], None
    src = source_path(entry)
    source_nb = load_source(src)
    problems = list(stale_cells(source_nb, executed))
    md_now = [c.source.rstrip() for c in source_nb.cells if c.cell_type == "markdown"]
    md_ran = [c.source.rstrip() for c in executed.cells if c.cell_type == "markdown"]
    if md_now != md_ran:
        problems.append("markdown cells differ from the source")
    pm = executed.metadata.get("papermill", {})
    if _canon(pm.get("parameters", {})) != _canon(params):
        problems.append(f"injected parameters {pm.get('parameters')} are not the registry's {params}")
    res = load_result(entry.name, profile)
    if res is None:
        return problems + ["no result file"], None
    pv = res.get("provenance", {})
    rel = shown(src)
    sha = parse_commit(pv.get("commit"))[0]
    problems += result_problems(pv.get("commit"), str(rel))
    if sha is None:
        return problems, None
    started, t0, t1 = pv.get("started", ""), pm.get("start_time", ""), pm.get("end_time", "")
    if not (t0 and t1 and t0[:19] <= started[:19] <= t1[:19]):
        problems.append(f"result started {started}, outside the execution {t0}..{t1}: another run wrote it")
    outputs = {f"data/results/{p}/{nb.name}.json" for nb in all_notebooks() for p in ("ci", "cpu", "gpu")}
    excl = [f":(exclude){o}" for o in sorted(outputs)]
    changed = _git("diff", "--name-only", sha, "--", "kvlib", "data", "dev/results", rel, *excl).stdout.split()
    if changed:
        problems.append(f"changed since {sha[:12]}: {', '.join(changed[:4])}" + (
            f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""))
    if problems:
        return problems, None
    root = repo_root()
    tracked = _git("ls-files", "kvlib", "data", "dev/results").stdout.split()
    modules, inputs = {}, {}
    for f in tracked:
        if f.startswith("kvlib/") and f.endswith(".py"):
            name = f.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            modules[name] = {"file": f, "sha256": sha256_file(root / f)}
        elif not f.startswith("kvlib/") and f not in outputs:
            inputs[f] = sha256_file(root / f)
    report = {"modules": modules, "inputs": inputs,
              "rules": {c["id"]: c["rule_sha256"] for c in res.get("claims", []) if c.get("rule_sha256")}}
    rec = make_record(source_nb, params, report, commit=pv["commit"], profile=profile, source=rel,
                      wall_s=float(pm.get("duration") or 0.0),
                      stamped={"from_commit": sha, "conservative": True})
    return [], rec


def stamp(entries, profile: str, write: bool = True) -> list[tuple[str, str]]:
    """Stamp every execution of ``entries`` at ``profile`` that :func:`stamp_problems` clears."""
    from kvlib.publish.sources import executed_path

    out = []
    for e in entries:
        problems, rec = stamp_problems(e, profile)
        if rec is None:
            out.append((e.name, "not stamped: " + "; ".join(problems)))
            continue
        if write:
            path = executed_path(e.name, profile)
            nb = nbformat.read(path, as_version=4)
            nb.metadata[KEY] = rec
            nbformat.write(nb, path)
        out.append((e.name, "stamped" if write else "can be stamped"))
    return out
