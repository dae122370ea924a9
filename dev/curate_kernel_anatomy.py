"""Curate the H200 development records the kernel chapter quotes into one book-readable result file.

The book does not read ``dev/results/``. The kernel page's account of where the certified INT8 step's time goes
(ablation, certificate cost, Nsight Compute stalls, power) rests on a few probe files there; this script reads
exactly those, extracts the values the page shows, and writes ``data/results/gpu/witcert_kernel_anatomy.json``
with each source's values beside its original provenance, verbatim, and a provenance of the curation itself.
Nothing is re-measured. Run from the repo root: ``python -m dev.curate_kernel_anatomy``.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import statistics
from pathlib import Path
from typing import Any

from kvlib.publish.commits import parse_commit
from kvlib.publish.provenance import provenance, repo_root, results_dir, write_json_atomic

NAME = "witcert_kernel_anatomy"
DEVICE = "curation of H200 records"


def load_record(root: Path, stem: str) -> dict[str, Any]:
    """``dev/results/<stem>.json`` under ``root``; a missing record is an error, never skipped."""
    path = root / "dev" / "results" / f"{stem}.json"
    if not path.exists():
        raise FileNotFoundError(f"source record {path} is missing")
    return json.loads(path.read_text())


def _load(stem: str) -> dict[str, Any]:
    return load_record(repo_root(), stem)


def _rows(doc: dict[str, Any], kind: str | None = None, B: int | None = None, S: int | None = None) -> list[dict]:
    return [r for r in doc["results"] if (kind is None or r.get("kind") == kind)
            and (B is None or r.get("B") == B) and (S is None or r.get("S") == S)]


def ablation(doc) -> dict[str, Any]:
    """Timing-only ablations of the h10 step at B=8, S=32k (an ablated kernel computes no attention)."""
    a = {r["name"]: r for r in _rows(doc, B=8, S=32768)}
    names = {"abl_cert_ms": "certA", "abl_no_pv_ms": "no_pv", "abl_no_qk_ms": "no_qk", "abl_nophilox_ms": "nophilox",
             "abl_floor_ms": "no_qk_pv_nophilox"}
    v = {k: float(a[n]["ms"]) for k, n in names.items()}
    v["abl_sdpa_ms"] = float(a["certA"]["sdpa_ms"])
    v["parts_ms"] = {"whole step": v["abl_cert_ms"], "without PV": v["abl_no_pv_ms"], "without QK": v["abl_no_qk_ms"],
                     "without Philox": v["abl_nophilox_ms"], "without QK, PV, Philox": v["abl_floor_ms"]}
    return v


def prefetch(doc) -> dict[str, Any]:
    """Slot indices and scales loaded one tile ahead (combo: warps, block_n, prefetch, PV_DIRECT)."""
    t = _rows(doc, "timing", 8, 32768)
    return {"pf_off_ms": next(r["ms"] for r in t if list(r["combo"]) == [2, 64, False, 0]),
            "pf_on_ms": next(r["ms"] for r in t if list(r["combo"]) == [2, 64, True, 0])}


def pv_dequant(doc) -> dict[str, Any]:
    t = {r["name"]: r for r in _rows(doc, "timing", 8, 32768)}
    return {"deq_ms": t["dequant"]["ms"],
            "deq_max_do": next(r["max_abs_do"] for r in _rows(doc, "agreement") if r["name"] == "dequant")}


def proto_qk(doc) -> dict[str, Any]:
    rows = {r["name"]: r for r in doc["results"]}
    return {"proto_qk_ms": min(r["ms"] for k, r in rows.items() if k.startswith("proto_qk")),
            "proto_copy_ms": rows["copy_keys"]["ms"]}


def exp2(doc) -> dict[str, Any]:
    t = {r["name"]: r["ms"] for r in _rows(doc, "timing", 8, 32768)}
    return {"p7_exp_ms": t["exp_cert"], "p7_exp2_ms": t["exp2_cert"]}


def var_dot(doc) -> dict[str, Any]:
    keys = {("default", 8, 32768): "p8_cost_dot_8_32k", ("default", 32, 16384): "p8_cost_dot_32_16k",
            ("fma_var", 8, 32768): "p8_cost_fma_8_32k", ("fma_var", 32, 16384): "p8_cost_fma_32_16k",
            ("default", 2, 4096): "p8_cost_dot_2_4k"}
    c = {(r["name"], r["B"], r["S"]): r["cost"] for r in _rows(doc, "cert_cost")}
    v = {g: float(c[k]) for k, g in keys.items()}
    v["p8_dcert"] = next(r["dcert"] for r in _rows(doc, "agreement") if r["name"] == "cert")
    v["p8_us_2_4k"] = 1e3 * next(r["ms"] for r in _rows(doc, "timing", 2, 4096) if r["name"] == "cert")
    return v


def gqa_layout(doc) -> dict[str, Any]:
    """The certificate's cost range at S >= 16k per layout (h10, h8) and GQA ratio (32/8 and 28/4 heads)."""
    v = {}
    for lay in ("h10", "h8"):
        for gqa, hq in (("gqa4", 32), ("gqa7", 28)):
            c = [r["cost"] for r in _rows(doc, "cert_cost") if r["name"] == f"{lay}_dot" and r["hq"] == hq]
            v[f"p12_{lay}_{gqa}_lo"], v[f"p12_{lay}_{gqa}_hi"] = min(c), max(c)
    return v


def ncu(doc) -> dict[str, Any]:
    nc = doc["results"]["cert"]
    st = nc["loop_stall_share"]
    return dict(ncu_dram=float(nc["dram_throughput_pct"]), ncu_issue=float(nc["issue_slots_busy_pct"]),
                ncu_warps=float(nc["active_warps_per_scheduler"]),
                ncu_eligible=float(nc["eligible_warps_per_scheduler"]), ncu_regs=int(nc["registers"]),
                ncu_wait=float(st.get("wait", 0.0)), ncu_long=float(st.get("long_sb", 0.0)),
                ncu_selected=float(st.get("selected", 0.0)),
                ncu_hot2=float(sum(h["samples_share"] for h in nc["loop_hotspots"][:2])),
                loop_stall_share={k: dict(doc["results"][k]["loop_stall_share"]) for k in ("cert", "nocert")})


def power(doc) -> dict[str, Any]:
    def smi(r):  # "clock MHz, mem MHz, temp, power W, throttle bits"
        clk, _mem, _temp, pw, thr = [x.strip() for x in r["smi"].split(",")]
        return float(clk.split()[0]), float(pw.split()[0]), int(thr, 16)

    def med(rows, n, i=None):
        return statistics.median(smi(r)[i] if i is not None else r["ms"] for r in rows if r["name"] == n)

    hot = [r for r in doc["results"] if r["phase"] != "cold"]
    cold = [r for r in doc["results"] if r["phase"] == "cold"]
    return dict(pp_power_max=max(smi(r)[1] for r in hot),
                pp_throttle="the software power cap" if all(smi(r)[2] & 0x4 for r in hot)
                else "no power cap on every reading",
                pp_clock_h8g=med(hot, "h8g_cert", 0), pp_clock_sdpa=med(hot, "sdpa", 0),
                pp_ratio_cold=med(cold, "sdpa") / med(cold, "h8g_cert"),
                pp_ratio_hot=med(hot, "sdpa") / med(hot, "h8g_cert"), pp_hot_h8g_ms=med(hot, "h8g_cert"))


def short_window(doc) -> dict[str, Any]:
    """The certified Gluon step at B=64, S=32k (28/4 heads) timed over a short window, for the power comparison."""
    t = [r["ms"] for r in _rows(doc, "timing", 64, 32768) if r["hq"] == 28 and r["name"] == "gluon_cert_reg_ns4"]
    return {"short_window_h8g_ms": t[0]}


#: source -> (record under dev/results/, what it measured, extractor)
SOURCES = {
    "ablation": ("h10_probe4", "the h10 step with one part dropped at a time (timing only), B=8, S=32k", ablation),
    "prefetch": ("h10_probe5", "slot indices and scales loaded one tile ahead vs not, B=8, S=32k", prefetch),
    "pv_dequant": ("h10_probe6", "values rounded to fp16 once, one PV dot per tile (opt-in, not exact)", pv_dequant),
    "qk_prototype": ("proto_qk", "the QK stage alone as INT8 tensor-core dots, against a copy of the key bytes",
                     proto_qk),
    "exp2": ("h10_probe7", "exponentials in base 2 against tl.exp, certified, CUDA graphs", exp2),
    "variance_dot": ("h10_probe8", "the certificate's variance as an exact tf32 dot against a four-FMA sum", var_dot),
    "gqa_layout": ("h10_probe12", "the certificate's cost by layout (h10, h8) and GQA ratio at S >= 16k",
                   gqa_layout),
    "ncu": ("gluon_ncu", "Nsight Compute profile of the certified and uncertified Gluon kernel, B=64, S=16k", ncu),
    "power": ("power_probe", "power, clocks and SDPA / certified step, cold and after a minute of load", power),
    "short_window": ("gluon_probe13", "the certified Gluon step at B=64, S=32k over a short timing window",
                     short_window),
}


def recorded_state(prov: dict[str, Any]) -> dict[str, Any]:
    """What the record's own provenance says about the code it ran: a commit of this repository, marked dirty or
    not, and whether its notes say the code was uncommitted (read from the record, never assumed)."""
    sha, dirty, _ = parse_commit(prov.get("commit"))
    uncommitted = bool(re.search(r"uncommitted", json.dumps(prov)))
    return {"commit_resolves": sha is not None, "commit_full": sha, "dirty": dirty,
            "ran_uncommitted_code": dirty or uncommitted}


def curate_sources(sources: dict[str, tuple[str, str, Any]], name: str, command: str,
                   load: Any = _load) -> dict[str, Any]:
    """The curated result ``name``: per key of ``sources`` (``key: (record stem, what, extractor)``) the record's
    name, its provenance verbatim, what that provenance says of its code, and the extracted values; plus a
    provenance of the curation itself. Shared by every curation script of ``dev/``."""
    started = _dt.datetime.now(_dt.UTC)
    out = {}
    for key, (stem, what, fn) in sources.items():
        doc = load(stem)
        out[key] = {"record": f"dev/results/{stem}.json", "what": what, "provenance": doc["provenance"],
                    "recorded_state": recorded_state(doc["provenance"]), "values": fn(doc)}
    prov = provenance({"command": command, "sources": sorted(f"dev/results/{s}.json" for s, _, _ in sources.values())},
                      started)
    prov["device"] = {"device": DEVICE, "note": "no measurement: values copied from the H200 records named in "
                      "results.sources, each with its own provenance"}
    return {"name": name, "profile": "gpu", "provenance": prov, "results": {"sources": out}}


def write_curated(doc: dict[str, Any]) -> Path:
    path = results_dir("gpu") / f"{doc['name']}.json"
    write_json_atomic(path, doc)  # temp file + os.replace
    print(f"wrote {path}")
    return path


def curate() -> dict[str, Any]:
    return curate_sources(SOURCES, NAME, "python -m dev.curate_kernel_anatomy")


def main() -> Path:
    return write_curated(curate())


if __name__ == "__main__":
    main()
