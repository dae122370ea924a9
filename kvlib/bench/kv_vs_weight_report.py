"""Tables and the register's quantities from a :mod:`kvlib.bench.kv_vs_weight` result.

Per (phase, arm) the speedup over bf16 is ``sum tau_ref / sum tau_arm`` over the phase's timed states, each arm's
``tau_ref`` the bf16 step of its own interleaved group (:func:`kvlib.bench.replay.aggregate_speedup`, the replay
topic's aggregation). The claim ``kv4rl-kv-vs-weight-quant`` compares KV4's speedup with the best weight arm's.
"""

from __future__ import annotations

from typing import Any

from kvlib.bench.kv_vs_weight import WEIGHT_ARMS

WEIGHT_ONLY = ("w8-int8wo", "w4-int4wo")
W8A8 = ("w8a8-fp8",)
PHASES = ("early", "late")


def _rows(result: dict) -> list[dict]:
    res = result.get("results", result)  # a saved result file wraps the topic's dict in "results"
    if "rows" not in res:
        raise ValueError("result must be a kv_vs_weight result (a dict with 'rows'), got keys "
                         f"{sorted(res)[:8]}")
    return res["rows"]


def speedups(result: dict) -> dict[tuple[str, str], dict[str, Any]]:
    """``(phase, arm) -> {speedup, n_states, ref_ms_sum, ms_sum, reference}`` over the arm's timed states."""
    from kvlib.bench.replay import aggregate_speedup

    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for r in _rows(result):
        if r.get("status") != "ok" or r.get("reference") is None or r.get("reference_step_ms") is None:
            continue
        a = acc.setdefault((r["phase"], r["arm"]), {"ref": [], "ms": [], "reference": r["reference"]})
        a["ref"].append(r["reference_step_ms"])
        a["ms"].append(r["step_ms"])
    return {k: {"speedup": aggregate_speedup(v["ref"], v["ms"]), "n_states": len(v["ms"]),
                "ref_ms_sum": float(sum(v["ref"])), "ms_sum": float(sum(v["ms"])), "reference": v["reference"]}
            for k, v in acc.items()}


def claim_quantities(result: dict) -> tuple[dict[str, float] | None, dict[str, int], str]:
    """``(measured, given, why)`` for ``kv4rl-kv-vs-weight-quant``: ``measured`` = {kv4_over_weight_early,
    kv4_over_weight_late} (None when KV4 or every weight arm is missing at a phase; ``why`` says which),
    ``given`` = {weight_only_phases, w8a8_phases} (the rule's preconditions)."""
    sp = speedups(result)
    given = {"weight_only_phases": sum(any((p, a) in sp for a in WEIGHT_ONLY) for p in PHASES),
             "w8a8_phases": sum(any((p, a) in sp for a in W8A8) for p in PHASES)}
    measured: dict[str, float] = {}
    missing = []
    for p in PHASES:
        kv = sp.get((p, "kv4"))
        w = [sp[(p, a)]["speedup"] for a in WEIGHT_ARMS if (p, a) in sp]
        if kv is None or not w:
            missing.append(f"{p}: " + ("KV4 not timed" if kv is None else "no weight arm timed"))
            continue
        measured[f"kv4_over_weight_{p}"] = kv["speedup"] / max(w)
    if missing:
        return None, given, "; ".join(missing)
    return measured, given, ""


def table(result: dict):
    """One row per (phase, state, group, arm; bf16 recurs as the reference of each group) in words: the arm, what it
    quantises, step ms, tokens/s, speedup over its bf16 reference, the bytes, and the status or skip reason."""
    import pandas as pd

    cols = ["phase", "batch", "ctx", "group", "arm", "what", "reference", "step_ms", "tokens_per_s", "speedup_vs_bf16",
            "weight_bytes", "weight_bytes_read", "kv_bytes", "step_read_bytes", "kv_share", "status", "reason",
            "model", "device"]
    rows = _rows(result)
    return pd.DataFrame([{c: r.get(c) for c in cols} for r in rows], columns=cols)
