"""Summaries of the issue-28 GPU lane's JSON (dev/gpu/philox.sh) for dev/results/README.md: the timing table (ms,
ratio to SDPA bf16 and to Philox4x32-10 per generator and batch), the agreement rows, and the value-dither
bisection's failing cases and diagnosis. ``python -m dev.philox_report OUT_DIR`` (the folder holding
philox_timing.json and vdither.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def timing_table(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    rows = doc["results"] if "results" in doc else doc
    out = ["| B | variant | ms | x SDPA | of Philox-10 |", "| --- | --- | --- | --- | --- |"]
    fmt = lambda x, s: "n/a" if x is None else format(x, s)  # noqa: E731
    for r in rows:
        if r.get("kind") == "timing":
            out.append(f"| {r['B']} | {r['name']} | {fmt(r['ms'], '.4f')} | {fmt(r['vs_sdpa'], '.3f')} | "
                       f"{fmt(r['vs_philox10'], '.3f')} |")
    bad = [r for r in rows if r.get("kind") == "agreement" and not r.get("ok")]
    n = sum(1 for r in rows if r.get("kind") == "agreement")
    out.append(f"agreement: {n - len(bad)}/{n} rows ok" + ("" if not bad else f"; failing: {bad}"))
    return out


def vdither_summary(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    out = [f"device: {doc.get('device')}"]
    for r in doc["rows"]:
        out.append(f"- {r['name']}: ok={r.get('ok')} " + " ".join(
            f"{k}={r[k]}" for k in ("do", "dxi", "max_err", "bad", "bad_channels", "error") if k in r))
    out += ["diagnosis:"] + [f"  - {line}" for line in doc.get("diagnosis", [])]
    return out


def main() -> None:
    d = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name, fn in (("philox_timing.json", timing_table), ("vdither.json", vdither_summary)):
        p = d / name
        print(f"## {name}")
        print("\n".join(fn(p)) if p.exists() else f"(missing: {p})")


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "OUT_DIR")
    main()
