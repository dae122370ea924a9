"""Development tool: summarise Nsight Compute exports of one kernel (``ncu -i r.ncu-rep --page details --csv`` and
``--page source --csv --print-source sass``) into the few numbers that say where its time goes: issue slots,
warps per scheduler, DRAM throughput, the warps' stall reasons over the whole kernel and in its hottest loop, and
the loop's costliest instructions.

``python -m dev.ncu_summary out.json label=prefix ... --commit C --started T --command "..."``, where
``prefix_details.csv`` and ``prefix_sass.csv`` exist for each label (the GPU call writes them; the summary is
made wherever the CSVs are, so the provenance names the GPU run's commit, device and time given on the command
line, not this machine's)."""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import re
from pathlib import Path
from typing import Any

from kvlib.publish.provenance import write_json_atomic

_SECTION = {"GPU Speed Of Light Throughput": {"Duration": "duration_us", "SM Frequency": "sm_ghz",
                                               "DRAM Throughput": "dram_throughput_pct"},
            "Memory Workload Analysis": {"Memory Throughput": "memory_tbps"},
            "Compute Workload Analysis": {"Issue Slots Busy": "issue_slots_busy_pct"},
            "Scheduler Statistics": {"Active Warps Per Scheduler": "active_warps_per_scheduler",
                                     "Eligible Warps Per Scheduler": "eligible_warps_per_scheduler",
                                     "No Eligible": "no_eligible_pct"},
            "Warp State Statistics": {"Warp Cycles Per Issued Instruction": "warp_cycles_per_issue"},
            "Launch Statistics": {"Registers Per Thread": "registers", "Grid Size": "grid"},
            "Occupancy": {"Achieved Active Warps Per SM": "achieved_warps_per_sm"}}
#: (section, metric) -> the summary's key
DETAILS = {(sec, metric): key for sec, metrics in _SECTION.items() for metric, key in metrics.items()}


def _num(x: str) -> float:
    return float(x.replace(",", "")) if x not in ("", None) else 0.0


def details(path: Path) -> dict[str, float]:
    out = {}
    for r in csv.DictReader(open(path)):
        key = DETAILS.get((r.get("Section Name"), r.get("Metric Name")))
        if key:
            out[key] = _num(r["Metric Value"])
    return out


def source(path: Path, top: int = 8) -> dict[str, Any]:
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    data = [dict(zip(hdr, r, strict=False)) for r in rows[2:] if len(r) >= len(hdr) - 1]
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    execd = [_num(r["Instructions Executed"]) for r in data]
    # the inner loop: the instructions executed most often (once per tile)
    loop_count = max(execd)
    loop = [r for r, e in zip(data, execd, strict=True) if e == loop_count]

    def breakdown(rs):
        tot = collections.Counter()
        for r in rs:
            for s in stalls:
                tot[s[6:]] += _num(r[s])
        n = sum(tot.values())
        return {k: v / n for k, v in tot.most_common() if v}, n

    whole, n_whole = breakdown(data)
    in_loop, n_loop = breakdown(loop)
    hot = sorted(loop, key=lambda r: -_num(r["Warp Stall Sampling (All Samples)"]))[:top]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", r["Source"].strip()).split()[0].split(".")[0]
                              for r in loop)
    return {"stall_share": whole, "samples": n_whole, "loop_instructions": len(loop),
            "loop_executions": loop_count, "loop_stall_share": in_loop, "loop_samples_share": n_loop / n_whole,
            "loop_opcodes": dict(ops.most_common(12)),
            "loop_hotspots": [{"sass": r["Source"].strip(), "samples_share": _num(
                r["Warp Stall Sampling (All Samples)"]) / n_whole,
                "stalls": {s[6:]: _num(r[s]) for s in stalls if _num(r[s]) > 0.05 * _num(
                    r["Warp Stall Sampling (All Samples)"])}} for r in hot]}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m dev.ncu_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("labels", nargs="+", help="label=path prefix of the exported CSVs")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--started", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--device", default="NVIDIA H200")
    ap.add_argument("--tool", default="ncu 2025.3.1 (--clock-control none --set full)")
    a = ap.parse_args()
    res = {}
    for item in a.labels:
        label, prefix = item.split("=", 1)
        res[label] = {**details(Path(prefix + "_details.csv"))}
        sass = Path(prefix + "_sass.csv")
        if sass.exists():
            res[label].update(source(sass))
    prov = {"commit": a.commit, "device": {"device": a.device}, "tool": a.tool, "params": {"command": a.command},
            "started": a.started, "summarised": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    write_json_atomic(Path(a.out), {"name": "ncu_summary", "profile": "gpu", "provenance": prov, "results": res})


if __name__ == "__main__":
    main()
