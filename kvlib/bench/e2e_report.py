"""The book's view of the end-to-end decode benchmark (:mod:`kvlib.bench.e2e`): tables, figure, goals' glue and the
paper-versus-run claims, read from its result (``data/results/<profile>/e2e.json``); nothing here runs a model."""

from __future__ import annotations

import math
import statistics
from typing import Any

from kvlib.bench.e2e import GRAPH_PEER, REFERENCE


def fmt_na(v: Any, spec: str = ".3f") -> str:
    """``v`` formatted, "n/a" for None or NaN (the chapter never prints nan), and never "-0.00" for a value that
    rounds to zero (a group that gave back a few bytes more than it took)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    s = format(v, spec)
    return s[1:] if s.startswith("-") and s[1:2].isdigit() and not any(c in "123456789" for c in s.split("e")[0]) \
        else s


def verdict(g: dict) -> str:
    """met / missed / not measured (with why) of one goal."""
    if g["met"] is None:
        return f"not measured: {g.get('why_not_measured', 'no measurement')}"
    return "met" if g["met"] else "missed"


def summary_lines(result: dict) -> list[str]:
    """Goals as printable lines: measured ratio, target, reference, met/missed, the graph peer's ratio beside."""
    lines = []
    for g in result["goals"]:
        v = fmt_na(g["measured"])
        share = f"; reference KV share {g['kv_share']:.2f}" if g.get("kv_share") is not None else ""
        ref = f" vs {g['reference']}" if g.get("reference") else ""
        side = (f"; vs static graph {g['vs_static_graph']:.3f}" if g.get("vs_static_graph") is not None
                and g.get("reference") != GRAPH_PEER else "")
        lines.append(f"{g['method']:<12} {g['goal'][:58]:<58} {v}{ref} ({g.get('where', '')}{share}{side}): "
                     f"{verdict(g)[:160]}")
        if g.get("where_time_went"):
            lines.append(f"{'':<12}   where the time went: {g['where_time_went']}")
    return lines


# ------------------------------------------------------------------------------------------------ rendering
# What the chapter (notebooks/e2e/model_decode.md) shows, computed here so its cells stay short.


def frame(result: dict, cell: str | None = "grid"):
    """Rows as a DataFrame (``cell``: "grid", "budget" or None for both)."""
    import pandas as pd

    rows = [r for r in result["rows"] + result["budget"]["rows"] if cell is None or r["cell"] == cell]
    return pd.DataFrame(rows)


def decode_table(result: dict):
    """One line per (B, S, method) that ran: speed, ratios, the step's split, bytes (GB), formatted."""
    df = frame(result)
    if df.empty or "step_ms" not in df:
        return df
    df = df[df["status"] == "ok"].copy()
    gb = 1e9
    out = df.assign(kv_GB=df["kv_bytes"] / gb, peak_GB=df["peak_bytes"] / gb)
    cols = {"batch": "B", "ctx": "S", "method": "method", "ms_per_token": "ms/step", "tokens_per_s": "tokens/s",
            "speedup_vs_dynamic": "x DynamicCache", "speedup_vs_static_graph": "x StaticCache graph",
            "attention_ms": "attention ms", "noattn_ms": "rest ms", "kv_share": "KV share of bytes read",
            "kv_GB": "KV GB", "kv_bytes_vs_bf16": "KV / bf16", "peak_GB": "peak GB", "graphed": "graph",
            "kernel_path": "decode path", "write_path": "write path", "block_size": "page"}
    out = out[[c for c in cols if c in out]].rename(columns=cols)
    return out.sort_values(["S", "B", "method"]).reset_index(drop=True)


def not_run_table(result: dict):
    """Every (cell, method) that did not run, with its status and reason."""
    df = frame(result, None)
    if df.empty:
        return df
    df = df[df["status"] != "ok"].copy()
    df["batch"] = [fmt_na(b, "d") if isinstance(b, int) or b is None else fmt_na(int(b), "d") if b == b else "n/a"
                   for b in df["batch"]]
    return df[["cell", "batch", "ctx", "method", "status", "reason"]].rename(columns={"batch": "B", "ctx": "S"})


def budget_table(result: dict):
    """Per method and S: bytes per token, largest batch in the KV budget, tokens/s there, the ratios against both
    bf16 peers at their own largest batch, the time split and KV share there."""
    import pandas as pd

    bud, bpt = result["budget"], result["bytes_per_token"]
    rows = []
    for r in bud["rows"]:
        key = f"{r['method']}@{r['ctx']}"
        rows.append({"method": r["method"], "S": r["ctx"], "KV bytes/token": fmt_na(bpt.get(r["method"]), ",.0f"),
                     "max batch": fmt_na(bud["max_batch"].get(key), "d"),
                     "tokens/s": fmt_na(r.get("tokens_per_s"), ",.0f"),
                     "x DynamicCache": fmt_na(bud["throughput_ratio"].get(key)),
                     "x StaticCache graph": fmt_na(bud.get("throughput_ratio_vs_static", {}).get(key)),
                     "attention / rest ms": (f"{fmt_na(r.get('attention_ms'), '.2f')} / "
                                             f"{fmt_na(r.get('noattn_ms'), '.2f')}" if r.get("status") == "ok"
                                             else "n/a"),
                     "KV share of bytes read": fmt_na(r.get("kv_share"), ".2f"),
                     "graph": r.get("graphed", "n/a") if r.get("status") == "ok" else "n/a",
                     "status": r["status"], "reason": r.get("reason", "")})
    return pd.DataFrame(rows)


def bytes_share_table(result: dict):
    """Per cell: weight bytes a step reads, the bf16 KV bytes, and each format's KV share of the bytes read."""
    df = frame(result)
    if df.empty or "kv_share" not in df:
        return df
    ok = df[df["status"] == "ok"]
    t = ok.pivot_table(index=["batch", "ctx"], columns="method", values="kv_share")
    t.insert(0, "weights GB read", result["weight_bytes"]["read_per_step"] / 1e9)
    return t


def goals_table(result: dict):
    """One line per goal: the ratio beside its target and reference, the verdict (met / missed / not measured and
    why), the graph peer's ratio, the time split of ours and of the reference, the KV share of the bytes read."""
    import pandas as pd

    rows = []
    for g in result["goals"]:
        o, r = g.get("ours") or {}, g.get("ref") or {}
        rows.append({"method": g["method"], "goal": g["goal"], "target": f"{g['target']:g}",
                     "measured": fmt_na(g["measured"]),
                     "reference": g.get("reference") or "n/a", "where": g.get("where", ""),
                     "verdict": verdict(g),
                     "x StaticCache graph": fmt_na(g.get("vs_static_graph")),
                     "x DynamicCache": fmt_na(g.get("vs_dynamic")),
                     "ours: attention / rest ms": (f"{fmt_na(o.get('attention_ms'), '.2f')} / "
                                                   f"{fmt_na(o.get('rest_ms'), '.2f')}") if o else "n/a",
                     "reference: attention / rest ms": (f"{fmt_na(r.get('attention_ms'), '.2f')} / "
                                                        f"{fmt_na(r.get('rest_ms'), '.2f')}") if r else "n/a",
                     "KV share of bytes read (ours / ref)": (f"{fmt_na(o.get('kv_share'), '.2f')} / "
                                                             f"{fmt_na(r.get('kv_share'), '.2f')}") if o else "n/a",
                     "where the time went": g.get("where_time_went", "")})
    return pd.DataFrame(rows)


def goal_glue(result: dict) -> dict[str, str]:
    """Glue keys for the prose: ``goal_<method>_<kind>`` (measured, 3 digits), ``..._verdict`` (met / missed / not
    measured), ``..._ref`` (the reference it is judged against)."""
    out = {}
    for g in result["goals"]:
        key = f"goal_{g['method']}_{g['kind']}".replace("-", "_")
        out[key] = "n/a" if g["measured"] is None else f"{g['measured']:.3g}"
        out[key + "_verdict"] = {True: "met", False: "missed", None: "not measured"}[g["met"]]
        out[key + "_ref"] = g.get("reference") or "n/a"
    return out


def _gb(x: float | None) -> float | None:
    return None if x is None else x / 1e9


def memory_table(result: dict):
    """Device memory before each memory group and what each group did not give back (GB)."""
    import pandas as pd

    rows = []
    for m in result.get("memory_log", []):
        b, nr = m.get("before") or {}, m.get("not_returned")
        rows.append({"cell": m["cell"], "B": m["batch"], "S": m["ctx"], "group": m["group"],
                     "methods": ", ".join(m["methods"]), "free before (GB)": fmt_na(_gb(b.get("free")), ".1f"),
                     "reserved before (GB)": fmt_na(_gb(b.get("reserved")), ".1f"),
                     "not returned (GB)": fmt_na(_gb(nr), ".2f")})
    return pd.DataFrame(rows)


def time_split_table(result: dict, batch: int | None = None, ctx: int | None = None):
    """Where the step's time goes at one cell (default: the goal cell): attention vs the rest, per method."""
    b, s = (batch, ctx) if batch is not None else tuple(result["goal_cell"])
    df = frame(result)
    if df.empty or "attention_ms" not in df:
        return df
    df = df[(df["batch"] == b) & (df["ctx"] == s) & (df["status"] == "ok")]
    return pd_cols(df, {"method": "method", "step_ms": "step ms", "attention_ms": "attention ms",
                        "noattn_ms": "rest ms", "attention_frac": "attention share of time",
                        "kv_share": "KV share of bytes read", "speedup_vs_dynamic": "x DynamicCache"})


def pd_cols(df, cols: dict):
    return df[[c for c in cols if c in df]].rename(columns=cols).reset_index(drop=True)


def tokens_per_s_figure(result: dict):
    """tokens/s against batch, one panel per S, one line per method (log-log)."""
    import matplotlib.pyplot as plt

    df = frame(result)
    ctxs = sorted(df["ctx"].unique()) if not df.empty else []
    fig, axes = plt.subplots(1, max(1, len(ctxs)), figsize=(3.2 * max(1, len(ctxs)), 2.8), sharey=True, squeeze=False)
    ok = df[df["status"] == "ok"] if not df.empty else df
    for ax, s in zip(axes[0], ctxs, strict=False):
        for m, g in ok[ok["ctx"] == s].groupby("method"):
            g = g.sort_values("batch")
            ax.plot(g["batch"], g["tokens_per_s"], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"S = {s:,}")
        ax.set_xlabel("batch B")
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def _ok(result: dict, method: str, cell: str = "grid") -> list[dict]:
    return [r for r in result["rows"] + result["budget"]["rows"]
            if r["method"] == method and r["cell"] == cell and r.get("status") == "ok"]


def _why_not(result: dict, method: str) -> str:
    r = next((r for r in result["rows"] if r["method"] == method and r.get("status") != "ok"), None)
    return f"{method} did not run: {r.get('reason', r['status'])}" if r else f"{method} did not run"


def paper_vs_run(result: dict) -> list[dict]:
    """Our side of each paper claim: the measurement, its verdict decided by :func:`kvlib.publish.verdicts.judge`
    under the claim's rule in data/claims/e2e.yml."""
    from kvlib.publish.verdicts import judge

    cfg_l, cfg_h = result["model"]["num_hidden_layers"], result["model"]["num_key_value_heads"]
    out = []
    bpt = result["bytes_per_token"].get("dither-int8")
    if bpt is None:
        out.append(judge("witcert-e2e-bytes", ours="not measured", note=_why_not(result, "dither-int8")))
    else:
        per = bpt / (2 * cfg_l * cfg_h)
        out.append(judge("witcert-e2e-bytes", ours=f"{per:.1f} B per token per head per side, measured from the "
                         "cache's tensors (page table included)", measured=float(per)))
    ref = result["bytes_per_token"].get(REFERENCE)
    if bpt is None or ref is None:
        out.append(judge("witcert-e2e-capacity", ours="not measured",
                         note=_why_not(result, "dither-int8" if bpt is None else REFERENCE)))
    else:
        cap = ref / bpt
        out.append(judge("witcert-e2e-capacity", ours=f"{cap:.2f}x tokens in the same KV bytes", measured=float(cap)))
    # the paper compares quantised with fp16 serving, both as an engine runs them: our like-for-like peer is the
    # bf16 StaticCache + SDPA step in a CUDA graph (DynamicCache's eager step carries Python overhead per layer)
    key = "speedup_vs_static_graph"
    rows = [r for r in _ok(result, "dither-int8") if r.get(key)]
    if not rows:
        out.append(judge("witcert-e2e-throughput", ours="not measured", note=_why_not(result, "dither-int8")))
    else:
        # the paper's requests are short (~50 tokens): our closest setting is the shortest S, where weights dominate
        s_min = min(r["ctx"] for r in rows)
        short = statistics.median(r[key] for r in rows if r["ctx"] == s_min)
        sp = [r[key] for r in rows]
        dyn = [r["speedup_vs_dynamic"] for r in rows if r.get("speedup_vs_dynamic")]
        vs_dyn = f"; {min(dyn):.2f}x or more vs eager DynamicCache + SDPA" if dyn else ""
        out.append(judge("witcert-e2e-throughput", ours=f"{short:.2f}x tokens/s vs bf16 StaticCache + SDPA (CUDA "
                         f"graphs, equal batch), median over B at S = {s_min} ({min(sp):.2f}-{max(sp):.2f}x over "
                         f"{len(sp)} cells{vs_dyn})", measured=float(short),
                         note=f"their requests are ~50 tokens, ours S >= {s_min}"))
    s = max(result["budget"]["ctxs"]) if result["budget"]["ctxs"] else None
    # the paper's BF16 baseline is a serving engine's, so the strong bf16 peer (StaticCache + SDPA in a CUDA graph)
    # is the one to compare with; the ratio over eager DynamicCache is shown beside it
    r = (result["budget"].get("throughput_ratio_vs_static") or {}).get(f"kv4rl@{s}")
    r_dyn = result["budget"]["throughput_ratio"].get(f"kv4rl@{s}")
    if r is None:
        out.append(judge("kv4rl-e2e-rollout", ours="not measured", note=_why_not(result, "kv4rl")))
    else:
        dyn = f"; {r_dyn:.2f}x vs eager DynamicCache + SDPA" if r_dyn is not None else ""
        out.append(judge("kv4rl-e2e-rollout", ours=f"{r:.2f}x decode throughput vs bf16 StaticCache + SDPA (CUDA "
                         f"graphs) at the fixed KV budget, S = {s}, each at its largest batch{dyn}",
                         measured=float(r), note="a fixed decode batch, not a scheduled GRPO rollout"))
    return out


# ------------------------------------------------------------------------------------------------ SmolLM2 on the GPU
def smollm2_table(res: dict | None):
    """The SmolLM2 GPU check (``dev/gpu/smollm2.py``) as a table, one row per format."""
    import pandas as pd

    if res is None:
        return pd.DataFrame({"note": ["data/results/gpu/smollm2_gpu.json is missing: run dev/gpu/smollm2.sh on a GPU"]})
    rows = []
    for fmt, r in res["formats"].items():
        cert = r.get("cert_max_abs_diff")
        rows.append({"format": fmt, "decode path": r.get("kernel_path", "-"),
                     "token agreement": f"{r['token_match']:.3f}" if "token_match" in r else "-",
                     "greedy-equal rows": f"{r['exact_rows']}/{r['rows']}" if "rows" in r else "-",
                     "first differing token (48: none)": ", ".join(map(str, r.get("first_divergence", []))) or "-",
                     "certificate vs reference": "-" if cert is None else f"{cert:.1e}",
                     "error": r.get("error", "")})
    return pd.DataFrame(rows)


def smollm2_glue(res: dict | None) -> dict[str, str]:
    """Glue values of the SmolLM2 GPU check ("n/a" where it did not run)."""
    if res is None:
        return {"smol_bf16_exact": "n/a", "smol_cert_diff": "n/a", "smol_cert_calls": "n/a"}
    bf, di = res["formats"].get("bf16", {}), res["formats"].get("dither-int8", {})
    return {"smol_bf16_exact": f"{bf['exact_rows']} of {bf['rows']}" if "rows" in bf else "n/a",
            "smol_cert_diff": f"{di['cert_max_abs_diff']:.1e}" if "cert_max_abs_diff" in di else "n/a",
            "smol_cert_calls": str(di.get("cert_checked_calls", "n/a"))}
