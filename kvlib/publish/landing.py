"""The pages a reader opens first and last: the landing page (results at a glance) and "Where the numbers come
from" (one page: which run each page renders, on which device, how long it took, and whether this build ran it).

Kept apart from :mod:`kvlib.publish.assemble` (the claims register lives there) so the two evolve separately. The
landing page reads the register's rows (:func:`kvlib.publish.assemble.claims_rows`); its only coupling to their
layout is :func:`headline` and :func:`glance_cells`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nbformat

from kvlib.publish.provenance import load_result, repo_root

#: verdict classes in the order the counts show them; a class not listed here (a new one) is shown after these
VERDICT_ORDER = ("reproduced", "checked", "differs", "not reproducible here", "pending", "conflict")


# -- where a result was measured -------------------------------------------------------------------------------

def _device_name(dev: dict[str, Any] | None) -> str:
    d = (dev or {}).get("device", "")
    if not d:
        return "unknown"
    if d == "cpu":
        n = (dev or {}).get("cpu_count")
        return f"CPU ({n} cores)" if n else "CPU"
    return d.removeprefix("NVIDIA ")


def measured_on(name: str, profile: str) -> dict[str, Any]:
    """Where the numbers of notebook ``name`` (rendered at ``profile``) were measured.

    {"ran on": device of the notebook's own execution, "measured on": the devices of the GPU result files it
    read (from its cache record), or its own device when it read none, "gpu files": those files}."""
    from kvlib.publish import cache
    from kvlib.publish.sources import executed_path

    res = load_result(name, profile) or {}
    own = _device_name(res.get("provenance", {}).get("device"))
    path = executed_path(name, profile)
    inputs: dict[str, str] = {}
    if path.exists():
        inputs = (cache.record_of(nbformat.read(path, as_version=4)) or {}).get("inputs", {})
    gpu_files = sorted(f for f in inputs if f.startswith("data/results/gpu/") and f.endswith(".json"))
    devices = []
    for f in gpu_files:
        try:
            dev = _device_name(json.loads((repo_root() / f).read_text()).get("provenance", {}).get("device"))
        except (OSError, ValueError):
            continue
        if dev not in devices:
            devices.append(dev)
    return {"ran on": own, "measured on": ", ".join(devices) or own, "gpu files": gpu_files}


# -- the landing page ------------------------------------------------------------------------------------------

def headline(chapter, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The register row the landing page shows for ``chapter``: the registry's ``headline`` claim id; else the first
    row marked ``primary``; else the chapter's first row with a verdict other than pending. (The one place that
    knows which row leads; adapt here if the register's rows change.)"""
    mine = [r for r in rows if r.get("chapter") == chapter.id]
    want = getattr(chapter, "headline", None)
    for r in mine:
        if want and r.get("id") == want:
            return r
    for r in mine:
        if r.get("primary"):
            return r
    return next((r for r in mine if r.get("verdict word") != "pending"), mine[0] if mine else None)


def first_clause(text: str) -> str:
    """``text`` up to its first "; " outside brackets (the headline of a result string), with "..." if cut."""
    depth = 0
    for i, c in enumerate(text):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == ";" and depth == 0 and text[i + 1:i + 2] == " ":
            return text[:i] + " ..."
    return text


def glance_cells(row: dict[str, Any], where: str) -> tuple[str, str, str]:
    """(paper with setting, ours with setting, verdict) of one register row, as table cells."""
    return (row.get("paper's figure", ""), f"{first_clause(row.get('ours', ''))} ({where})",
            f"**{row.get('verdict word', row.get('verdict', ''))}**")


def verdict_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts = {v: 0 for v in VERDICT_ORDER}
    for r in rows:
        w = r.get("verdict word") or "pending"
        counts[w] = counts.get(w, 0) + 1
    return {v: n for v, n in counts.items() if n}


def landing_page(intro: str, chapters, rows: list[dict[str, Any]], rendered: dict[str, str]) -> str:
    """The book's first page: its title, what reproduced at a glance, the register's counts, then ``intro`` (the
    static prose of ``book/intro.md`` after its title: where to start, what the book is)."""
    from kvlib.publish.listtable import list_table

    title, _, rest = intro.strip().partition("\n")
    counts = verdict_counts(rows)
    body = []
    for ch in chapters:
        r = headline(ch, rows)
        if r is None:
            continue
        nb = next((n for n in ch.notebooks if r.get("source", "").startswith(n.name)), None)
        where = "no run"
        if nb is not None and nb.name in rendered:
            m = measured_on(nb.name, rendered[nb.name])
            where = f"{m['measured on']}, {{doc}}`{nb.title} </book/_render/{ch.id}/{nb.name}>`"
        paper, ours, verdict = glance_cells(r, where)
        question = getattr(ch, "question", None) or r.get("statement", "")
        body.append([f"{{doc}}`{ch.title} </book/_render/{ch.id}/index>`", question, paper, ours, verdict])
    total = sum(counts.values())
    count_text = ", ".join(f"**{n}** {v}" for v, n in counts.items())
    parts = [
        title + "\n",
        "## Results at a glance\n",
        "For each chapter, the question it asks and one of its claims: the paper's figure in the paper's setting, "
        "ours in ours (where the paper measured Qwen models of 1.5-8B parameters on serving GPUs, we measure "
        "SmolLM2-135M on a CPU, or kernels at the paper's shapes on one H200), and the verdict of the rule the claim "
        "declares. Every number here is read from the result file of the run the chapter renders.\n",
        list_table(body, ["chapter", "question", "paper (setting)", "ours (setting)", "verdict"],
                   [18, 24, 22, 26, 10], cls="glance-table",
                   caption="Results at a glance: one claim per chapter, the paper's figure beside ours."),
        f"**The {{doc}}`claims register </book/_render/claims>`** judges {total} claims of the two papers: "
        f"{count_text}.\n",
        rest.strip() + "\n",
    ]
    return "\n".join(parts)


# -- where the numbers come from -------------------------------------------------------------------------------

def provenance_rows(chapters, rendered: dict[str, str], outcomes: dict[str, Any], profile: str,
                    ) -> list[dict[str, str]]:
    """One row per notebook: the run rendered, where it ran and where its numbers were measured, the commit, one
    duration (the execution's wall time, papermill's clock), and what this build did with it."""
    from kvlib.publish import cache
    from kvlib.publish.commits import show_commit
    from kvlib.publish.sources import executed_path

    rows = []
    for ch in chapters:
        for entry in ch.notebooks:
            prof = rendered.get(entry.name)
            if prof is None:
                rows.append({"page": entry.title, "profile": "none", "this build": "no execution: placeholder"})
                continue
            nb = nbformat.read(executed_path(entry.name, prof), as_version=4)
            pm = nb.metadata.get("papermill", {})
            rec = cache.record_of(nb)
            pv = (load_result(entry.name, prof) or {}).get("provenance", {})
            m = measured_on(entry.name, prof)
            o = outcomes.get(entry.name)
            if o is not None and o.status == "failed":
                built = f"execution failed ({o.detail}); the previous execution is rendered"
            elif o is not None and o.status == "executed" and prof == profile:
                built = "executed"
            elif o is not None and o.status == "skipped":
                built = f"not run ({o.detail})"
            else:
                built = "rendered as committed"
            wall = pm.get("duration")
            rows.append({
                "page": f"{{doc}}`{entry.title} </book/_render/{ch.id}/{entry.name}>`",
                "profile": prof,
                "ran on": m["ran on"],
                "numbers measured on": m["measured on"] + (f" ({_files(m['gpu files'])})" if m["gpu files"] else ""),
                "execution (s)": f"{wall:,.1f}" if isinstance(wall, (int, float)) else "",
                "commit": f"`{show_commit(pv.get('commit') or (rec or {}).get('commit'))[:12]}`",
                "started (UTC)": str(pv.get("started", pm.get("start_time", "")))[:16].replace("T", " "),
                "this build": built,
            })
    return rows


def _files(paths: list[str], shown: int = 3) -> str:
    """A few result files by name, the rest counted."""
    names = [f"`{Path(f).name}`" for f in paths]
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def gpu_rows() -> list[dict[str, str]]:
    from kvlib.publish.commits import show_commit
    from kvlib.publish.provenance import results_dir

    rows = []
    for path in sorted(results_dir("gpu").glob("*.json")):
        pv = json.loads(path.read_text()).get("provenance", {})
        d = pv.get("duration_s")
        rows.append({"result file": f"`{path.name}`", "device": _device_name(pv.get("device")),
                     "commit": f"`{show_commit(pv.get('commit'))[:12]}`",
                     "started (UTC)": str(pv.get("started", ""))[:16].replace("T", " "),
                     "run (s)": f"{d:,.1f}" if isinstance(d, (int, float)) else ""})
    return rows


def provenance_page(profile: str, checks: str, rows: list[dict[str, str]], gpu: list[dict[str, str]]) -> str:
    from kvlib.publish.listtable import list_table

    cols = ["page", "profile", "ran on", "numbers measured on", "execution (s)", "commit", "started (UTC)",
            "this build"]
    gcols = ["result file", "device", "commit", "started (UTC)", "run (s)"]
    return "\n".join([
        "# Where the numbers come from\n",
        f"This build renders, for each page, one executed run (built for profile `{profile}`). A page *ran on* the "
        "machine that executed its notebook; its *numbers were measured on* that machine, or, for the GPU "
        "chapters, on the H200 whose benchmark result files the notebook reads (named in the row). Each result "
        "file `data/results/<profile>/<notebook>.json` records the full commit, device, package versions, "
        "parameters, start time and duration; *execution* is the notebook's wall time as papermill measured "
        "it. A notebook is executed again only when what it ran changed (its code cells, parameters, the `kvlib` "
        "functions it called, or a repository file it read: `python -m kvlib.publish stale` lists them).\n",
        checks + "\n",
        "## The pages\n",
        list_table([[r.get(c, "") for c in cols] for r in rows], cols, [22, 6, 10, 20, 8, 10, 12, 12],
                   cls="provenance-table", caption="Each page's rendered run: where it ran, where its numbers were "
                   "measured, how long it took, and what this build did with it."),
        "## GPU benchmark results the pages render\n",
        "Written by `python -m kvlib.bench` on the GPU machine (`data/results/gpu/<topic>.json`); *run* is the "
        "benchmark's own duration.\n",
        list_table([[r[c] for c in gcols] for r in gpu], gcols, [30, 14, 16, 22, 18], cls="provenance-table",
                   caption="The GPU result files: device, commit, start and duration."),
    ]) + "\n"
