"""What the witcert_kernel notebook computes and reads: the interpreter agreement of the INT8 decode kernel
(w24 and h10 dither layouts) with the float64 reference, the numbers and figures of the ``witcert_decode``
GPU result, the curated H200 records of where the certified step's time goes (``witcert_kernel_anatomy``), and the
paper claims built from them.
Functions that read result files return None or NaN where a file is absent, so the notebook runs anywhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from kvlib.kernels.int8.decode import Int8KernelConfig, decode_int8, decode_reference, make_pool_side
from kvlib.publish.provenance import load_result

NAN = float("nan")


def placeholder_figure(why: str):
    """A figure holding only ``why``: where a result file is absent the book's figure directives still need
    a figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 1.2))
    ax.text(0.5, 0.5, why, ha="center", va="center")
    ax.axis("off")
    return fig


def _spread(certs: list[torch.Tensor]) -> float:
    return float((torch.stack(certs).amax(0) - torch.stack(certs).amin(0)).max())


def split_agreement(B: int, S: int, hq: int, hkv: int, d: int, splits: list[int], delta: float, seed: int):
    """The w24 kernel against the float64 reference on synthetic keys (one strong RoPE-ish pair per head,
    bypassed in fp16) at each split count: rows of max |Δ| (o, lse, certificate A and its one-sided form),
    the certificate's spread over the splits, and the reference's output."""
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(B * S, hkv, d, generator=g)
    K[:, :, :2] *= 10
    V = torch.randn(B * S, hkv, d, generator=g)
    perm = torch.randperm(B * S, generator=g)
    oc = torch.tensor([0, 1, d // 2, d // 2 + 1]).expand(hkv, 4).contiguous()
    kp = make_pool_side(K, layer=1, seed=seed + 7, side=0, slot_ids=perm, outlier_channels=oc)
    vp = make_pool_side(V, layer=1, seed=seed + 7, side=1, slot_ids=perm, dithered=False)
    slots = perm.view(B, S)
    seq = torch.tensor([S - 17 * b for b in range(B)])
    q = 2 * torch.randn(B, hq, d, generator=g)
    ref = decode_reference(q, kp, vp, slots, seq, layer=1, seed=seed + 7, delta=delta)
    rows, certs = [], []
    for ns in splits:
        out = decode_int8(q, kp, vp, slots, seq, layer=1, seed=seed + 7, delta=delta, num_splits=ns,
                          config=Int8KernelConfig(block_n=16))
        certs.append(out.tv_bound.double())
        rows.append({"splits": ns, "max|do|": float((out.o.double() - ref.o).abs().max()),
                     "max|dlse|": float((out.lse.double() - ref.lse).abs().max()),
                     "max|dcert|": float((out.tv_bound - ref.tv_bound).abs().max()),
                     "max|dcert_one|": float((out.tv_bound_one - ref.tv_bound_one).abs().max())})
    return rows, _spread(certs), ref


def h10_agreement(B: int, S: int, hq: int, hkv: int, splits: list[int], delta: float, seed: int):
    """The h10 layout: the same kind of keys written with eight 10-bit dithers per Philox call (d = 4 x 32
    channels: each Philox word feeds one scale group), read by its kernel at the split counts <= 4. Returns
    the agreement rows, the certificate's spread over the splits, and h10's certificate over w24's."""
    d10, S10 = 128, min(S, 128)
    g10 = torch.Generator().manual_seed(seed + 1)
    K10 = torch.randn(B * S10, hkv, d10, generator=g10)
    K10[:, :, :2] *= 10
    V10 = torch.randn(B * S10, hkv, d10, generator=g10)
    perm10 = torch.randperm(B * S10, generator=g10)
    oc10 = torch.tensor([0, 1, d10 // 2, d10 // 2 + 1]).expand(hkv, 4).contiguous()
    pools = {lay: make_pool_side(K10, layer=1, seed=seed + 7, side=0, slot_ids=perm10, outlier_channels=oc10,
                                 dither_layout=lay) for lay in ("w24", "h10")}
    vp10 = make_pool_side(V10, layer=1, seed=seed + 7, side=1, slot_ids=perm10, dithered=False)
    slots10 = perm10.view(B, S10)
    seq10 = torch.tensor([S10 - 5 * b for b in range(B)])
    q10 = 2 * torch.randn(B, hq, d10, generator=g10)
    refs = {lay: decode_reference(q10, kp_, vp10, slots10, seq10, layer=1, seed=seed + 7, delta=delta,
                                  impl="h10" if lay == "h10" else "tc") for lay, kp_ in pools.items()}
    rows10, certs10 = [], []
    for ns in [s for s in splits if s <= 4]:
        out = decode_int8(q10, pools["h10"], vp10, slots10, seq10, layer=1, seed=seed + 7, delta=delta,
                          num_splits=ns, config=Int8KernelConfig(block_n=16))
        certs10.append(out.tv_bound.double())
        rows10.append({"splits": ns, "max|do|": float((out.o.double() - refs["h10"].o).abs().max()),
                       "max|dcert|": float((out.tv_bound - refs["h10"].tv_bound).abs().max())})
    return rows10, _spread(certs10), refs["h10"].tv_bound / refs["w24"].tv_bound


def gpu_agreement(r: dict[str, Any]):
    """From the ``witcert_decode`` results ``r``: the glued agreement numbers, the agreement table, the
    latency table (medians, ms), and the CUDA-graph replay records (w24's and each other layout's)."""
    v: dict[str, Any] = {}
    agr = pd.DataFrame(r["agreement"]["splits"]).T
    exact = agr[agr.index.str.startswith("exact")]  # every tensor-core operand exact; "fast" drops two lo parts
    v["gpu_max_do"] = float(exact["max_abs_do"].max())
    v["gpu_max_dcert"] = float(exact["max_abs_dcert"].max())
    cg = r["cuda_graph"]
    v["graph_identical"] = bool(cg["bit_identical"])
    for lay in ("h10", "h8", "h8g"):
        rows_l = agr[agr.index.str.startswith(lay + "/")]
        if len(rows_l):
            v[f"gpu_{lay}_max_do"] = float(rows_l["max_abs_do"].max())
            v[f"gpu_{lay}_max_dcert"] = float(rows_l["max_abs_dcert"].max())
    cg_lay = {lay: r[f"cuda_graph_{lay}"] for lay in ("h10", "h8", "h8g") if f"cuda_graph_{lay}" in r}
    lat = pd.DataFrame([{"B": x["B"], "S": x["S"], **{k: t["median_ms"] for k, t in x["timings"].items()
                         if isinstance(t, dict)}} for x in r["latency"] if "timings" in x])
    return v, agr, lat, cg, cg_lay


def _yes(flag: Any) -> str:
    """A measured yes/no in words (a reader should not meet Python's True/False)."""
    return "yes" if bool(flag) else "no"


def latency_figure(lat: pd.DataFrame, modes: list[str]):
    """Decode-step time against context, one panel per batch size: SDPA bf16, our bf16 split-KV, and INT8 with and
    without certificate A. A line joins the contexts of one kernel at one batch size, never two shapes of
    different batch sizes; every kernel has its own colour, marker and line style (the book's cycle)."""
    import matplotlib.pyplot as plt

    from kvlib.publish.figures import style_cycle

    series = [("sdpa_bf16", "torch SDPA bf16"), ("ours_bf16", "our bf16 split-KV")]
    for m in modes:
        series += [(f"int8_{m}", f"INT8 ({m})"), (f"int8_cert_A_{m}", f"INT8 + cert A ({m})")]
    looks = dict(zip([c for c, _ in series], style_cycle()))
    batches = sorted(lat.B.unique())
    ncols = min(3, len(batches))
    nrows = -(-len(batches) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols + 2.4, 2.7 * nrows), squeeze=False, sharey=True)
    for ax in axes.flat[len(batches):]:
        ax.set_visible(False)
    for ax, b in zip(axes.flat, batches):
        d = lat[lat.B == b].sort_values("S")
        for col, label in series:
            ax.plot(d.S, d[col], label=label, **looks[col])
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(d.S), [f"{s // 1024}k" for s in d.S])
        ax.set_yscale("log")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context S (tokens)")
    for ax in axes[:, 0]:
        ax.set_ylabel("decode step (ms)")
    axes[0, ncols - 1].legend(loc="upper left", bbox_to_anchor=(1.04, 1.0))
    fig.tight_layout()
    return fig


def latency_summary(results: dict[str, Any], lat: pd.DataFrame):
    """The speed and certificate-cost numbers of the latency table: the glued values, the best eager mode,
    the CUDA-graph note of the latency claim, and the per-mode table at B=32, S=16k and B=64, S=32k."""
    v: dict[str, Any] = {}
    modes = list(results["modes"])
    summ = results.get("summary", {})
    best = max(modes, key=lambda m: summ["min_speedup_vs_sdpa_S>=16k"][m]) if summ else modes[0]
    v["speedup_long"] = float(summ["min_speedup_vs_sdpa_S>=16k"][best]) if summ else NAN
    v["cert_cost_median"] = float(summ["median_cert_cost_A"][best]) if summ else NAN
    if summ and "h10" in summ["max_cert_cost_A"]:
        v["cert_cost_max_h10"] = float(summ["max_cert_cost_A"]["h10"])
    paper_shape = lat[(lat.B == 2) & (lat.S == 4096)].iloc[0]
    v["ratio_paper_shape"] = float(paper_shape[f"int8_cert_A_{best}"] / paper_shape["sdpa_bf16"])
    graph_note = ""
    # the fastest certified mode timed under graphs (the best eager mode's column when it has one)
    gcols = [f"int8_cert_A_{m}_graph" for m in (best, "h8", "h10", "fast") if f"int8_cert_A_{m}_graph" in lat]
    gcol = gcols[0] if gcols else "int8_cert_A_fast_graph"
    if gcol in lat:  # CUDA-graph replay removes host launch overhead
        lg = lat[lat.S >= 16384]
        v["speedup_long_graph"] = float((lg["sdpa_bf16_graph"] / lg[gcol]).min())
        graph_note = f"; under CUDA graphs >= {v['speedup_long_graph']:.2f}x ({gcol})"
    # the per-mode picture at the shape the goal names (B=32, S=16k) and the largest one
    for m in ("h10", "h8", "h8g"):  # graph timings: eager ones of sub-0.3 ms steps carry host launch overhead
        if f"int8_cert_A_{m}_graph" not in lat:
            continue
        cost = lat[f"int8_cert_A_{m}_graph"] / lat[f"int8_{m}_graph"] - 1
        lg_m = lat[lat.S >= 16384]
        pc = lat[(lat.B == 2) & (lat.S == 4096)].iloc[0]
        v[f"{m}_graph_cert_cost_median"] = float(cost.median())
        v[f"{m}_graph_cert_cost_max"] = float(cost.max())
        v[f"{m}_graph_cert_cost_long_max"] = float(cost[lat.S >= 16384].max())
        v[f"{m}_graph_cert_cost_paper"] = float(pc[f"int8_cert_A_{m}_graph"] / pc[f"int8_{m}_graph"] - 1)
        v[f"{m}_graph_speedup_min"] = float((lg_m["sdpa_bf16_graph"] / lg_m[f"int8_cert_A_{m}_graph"]).min())
        v[f"{m}_graph_speedup_max"] = float((lg_m["sdpa_bf16_graph"] / lg_m[f"int8_cert_A_{m}_graph"]).max())
        v[f"{m}_graph_paper_shape"] = float(pc[f"int8_cert_A_{m}_graph"] / pc["sdpa_bf16_graph"])
        v[f"{m}_graph_paper_ms"] = float(pc[f"int8_cert_A_{m}_graph"])
    rows_m = []
    for (b_, s_) in ((32, 16384), (64, 32768)):
        sel = lat[(lat.B == b_) & (lat.S == s_)]
        if len(sel):
            x_ = sel.iloc[0]
            rows_m += [{"B": b_, "S": s_, "mode": m, "cert A (ms)": x_[f"int8_cert_A_{m}"],
                        "SDPA / cert A": x_["sdpa_bf16"] / x_[f"int8_cert_A_{m}"],
                        "cert cost A": x_[f"int8_cert_A_{m}"] / x_[f"int8_{m}"] - 1,
                        "cert cost AB": x_[f"int8_cert_AB_{m}"] / x_[f"int8_{m}"] - 1} for m in modes]
    mt = pd.DataFrame(rows_m)
    if len(mt):
        h = mt[(mt["mode"] == "h10") & (mt.B == 32)]
        if len(h):
            v["h10_speedup_32_16k"] = float(h["SDPA / cert A"].iloc[0])
            v["h10_cert_cost_32_16k"] = float(h["cert cost A"].iloc[0])
        w = mt[(mt["mode"] == "fast") & (mt.B == 32)]
        if len(w):
            v["w24_speedup_32_16k"] = float(w["SDPA / cert A"].iloc[0])
    return v, best, graph_note, mt


def sass_values(sass: dict[str, Any] | None) -> dict[str, Any]:
    """Why the kernels sit below the roofline, from their compiled sm_90 loops (``sass_count``); empty
    without the file."""
    if sass is None:
        return {}
    sr = sass["results"]
    return dict(sass_h10_per_elem=float(sr["h10_certA"]["per_element"]),
                sass_h8_per_elem=float(sr["h8_certA"]["per_element"]) if "h8_certA" in sr else NAN,
                sass_h10_regs=int(sr["h10_certA"]["registers"]), sass_h10_philox_share=float(sr["h10_philox_share"]),
                sass_w24_per_elem=float(sr["w24_tc_certA"]["per_element"]))


#: the sources of ``witcert_kernel_anatomy`` (curated H200 records) and the glued values each gives
ANATOMY_KEYS = {
    "ablation": ("abl_cert_ms", "abl_no_pv_ms", "abl_no_qk_ms", "abl_nophilox_ms", "abl_floor_ms", "abl_sdpa_ms"),
    "prefetch": ("pf_off_ms", "pf_on_ms"),
    "pv_dequant": ("deq_ms", "deq_max_do"),
    "qk_prototype": ("proto_qk_ms", "proto_copy_ms"),
    "exp2": ("p7_exp_ms", "p7_exp2_ms"),
    "variance_dot": ("p8_cost_dot_8_32k", "p8_cost_dot_32_16k", "p8_cost_fma_8_32k", "p8_cost_fma_32_16k",
                     "p8_cost_dot_2_4k", "p8_dcert", "p8_us_2_4k"),
    "gqa_layout": tuple(f"p12_{lay}_{g}_{e}" for lay in ("h10", "h8") for g in ("gqa4", "gqa7") for e in ("lo", "hi")),
    "ncu": ("ncu_dram", "ncu_issue", "ncu_warps", "ncu_eligible", "ncu_regs", "ncu_wait", "ncu_long", "ncu_selected",
            "ncu_hot2"),
    "power": ("pp_power_max", "pp_throttle", "pp_clock_h8g", "pp_clock_sdpa", "pp_ratio_cold", "pp_ratio_hot"),
}


def _sources(anat: dict[str, Any] | None) -> dict[str, Any]:
    return (anat or {}).get("results", {}).get("sources", {})


def anatomy_values(anat: dict[str, Any] | None) -> dict[str, Any]:
    """Every glued value of the curated ``witcert_kernel_anatomy`` result ``anat`` (``ANATOMY_KEYS``), and
    ``pp_probe_gap``: how much faster a short timing window reads the certified Gluon step at B=64, S=32k than
    sustained operation at the power cap. NaN (the throttle: a sentence) where ``anat`` or a source is absent."""
    src = _sources(anat)
    v: dict[str, Any] = {}
    for name, keys in ANATOMY_KEYS.items():
        vals = src.get(name, {}).get("values", {})
        for k in keys:
            v[k] = vals.get(k, "(no power record)" if k == "pp_throttle" else NAN)
    hot = src.get("power", {}).get("values", {}).get("pp_hot_h8g_ms")
    short = src.get("short_window", {}).get("values", {}).get("short_window_h8g_ms")
    v["pp_probe_gap"] = 1 - short / hot if hot and short else NAN
    return v


def ablation_parts(anat: dict[str, Any] | None) -> tuple[pd.Series, float] | None:
    """The h10 step's ablation times (ms) as a Series and SDPA's time, or None without the ablation record."""
    vals = _sources(anat).get("ablation", {}).get("values")
    if not vals:
        return None
    return pd.Series(vals["parts_ms"], dtype=float), float(vals["abl_sdpa_ms"])


def anatomy_sources(anat: dict[str, Any] | None) -> pd.DataFrame:
    """One row per curated record: what it measured, where and when (its own provenance, as recorded) and whether
    that provenance says it ran uncommitted code."""
    rows = []
    for s in _sources(anat).values():
        pv, st = s["provenance"], s["recorded_state"]
        dev = pv.get("device")
        rows.append({"measurement": s["what"], "device": dev.get("device") if isinstance(dev, dict) else dev,
                     "commit": st["commit_full"] or pv.get("commit"), "started": pv.get("started", "?"),
                     "code committed": "no" if st["ran_uncommitted_code"] else "yes",
                     # the record's note in a reader's words (it was written on the GPU machine for ourselves)
                     "note": pv.get("note", "").replace("same lent machine image", "same machine image")})
    return pd.DataFrame(rows)


def ablation_figure(parts: pd.Series, sdpa_ms: float):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 2.4))
    ax.barh(parts.index[::-1], parts.values[::-1], color="tab:blue")
    ax.axvline(sdpa_ms, color="k", ls="--", label="SDPA bf16")
    ax.set_xlabel("certified h10 step (ms), B=8, S=32k, ablations")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return fig


def grid_h8g_speedups() -> list[float]:
    """SDPA bf16 / certified Gluon h8 at every S >= 16k shape of the ``decode_grid`` GPU result."""
    grid = load_result("decode_grid", "gpu")
    return [(row["methods"]["sdpa_bf16"]["median_ms"] / row["methods"]["int8_h8g_cert"]["median_ms"])
            for row in (grid["results"]["rows"] if grid else []) if row["ctx"] >= 16384
            and "int8_h8g_cert" in row["methods"] and "sdpa_bf16" in row["methods"]]


STALL_NAMES = {"selected": "issuing", "wait": "fixed-latency dependency", "dispatch": "dispatch",
               "not_selected": "eligible, not selected", "long_sb": "global load", "math": "math pipe busy"}


def ncu_stalls(anat: dict[str, Any] | None) -> pd.DataFrame | None:
    """The Gluon loop's warp stall shares by reason, certified and uncertified (None without the ncu record)."""
    vals = _sources(anat).get("ncu", {}).get("values")
    if not vals:
        return None
    rows_n = [{"reason": STALL_NAMES.get(k, "other"), "kernel": lab, "share": s}
              for lab, key in (("certified", "cert"), ("uncertified", "nocert"))
              for k, s in vals["loop_stall_share"][key].items()]
    return pd.DataFrame(rows_n).groupby(["reason", "kernel"], as_index=False)["share"].sum()


def stall_figure(sdf: pd.DataFrame):
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(6.0, 2.6))
    sns.barplot(sdf, y="reason", x="share", hue="kernel", order=list(STALL_NAMES.values()) + ["other"], ax=ax)
    ax.set_xlabel("share of the loop's warp stall samples (B=64, S=16k, H200)")
    ax.set_ylabel("")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return fig


def kernel_claims(v: dict[str, Any], splits: list[int], spread: float, gpu: bool, cg=None, cg_lay=None,
                  best=None, graph_note: str = "", grid_long: list[float] = (), ws: dict | None = None,
                  ) -> list[dict[str, Any]]:
    """The notebook's claims (keyword arguments of ``Run.claim``) from its glued values ``v``; ``gpu`` says
    whether the ``witcert_decode`` GPU result exists (``cg``, ``cg_lay``, ``best``, ``graph_note`` come with
    it); ``ws``: the shapes of the ``wspec_decode`` GPU result (the warp-specialised kernels the dispatcher takes
    on Hopper), None when absent. The certificate's cost is judged on the default kernel at its worst measured
    shape, its latency on the kernel ``impl="auto"`` takes at the paper's shape; the other kernels are context."""
    claims = [dict(claim_id="witcert-kernel-do",
                   ours=f"max|do| = {v['max_do']:.1e} (interpreter, splits {splits})"
                   + (f"; H200 (exact mode) {v['gpu_max_do']:.1e}" if gpu else "")
                   + (f"; h10 kernel: interpreter {v['h10_max_do']:.1e}"
                      + (f", H200 {v['gpu_h10_max_do']:.1e}" if "gpu_h10_max_do" in v else "")),
                   measured=float(v["max_do"]),
                   why="fp32 kernel vs float64 reference on the same stored codes; same order as the paper's 2.9e-6"),
              dict(claim_id="witcert-kernel-dcert", ours=f"max|dcert| = {v['max_dcert']:.1e}"
                   + (f"; H200 {v['gpu_max_dcert']:.1e}" if gpu else "")
                   + (f"; h10 kernel: interpreter {v['h10_max_dcert']:.1e}"
                      + (f", H200 {v['gpu_h10_max_dcert']:.1e}" if "gpu_h10_max_dcert" in v else "")
                      + (f", h8 layout H200 {v['gpu_h8_max_dcert']:.1e}" if "gpu_h8_max_dcert" in v else "")
                      + (f", Gluon h8 kernel H200 {v['gpu_h8g_max_dcert']:.1e}" if "gpu_h8g_max_dcert" in v
                         else "")),
                   measured=float(v["max_dcert"]),
                   why="our radius includes the fp32/dither-mean slack in both kernel and reference"),
              dict(claim_id="witcert-split-merge-exact", ours=f"certificate spread over {splits} splits: {spread:.1e}",
                   measured=float(spread), why="stage 2 = fold of merge_states (tested)")]
    if ws:
        costs = [s_["cert_marginal_cost"]["wspec"] for s_ in ws.values()]
        shapes = ", ".join(f"B={s_['batch']} S={s_['seq'] // 1024}k {s_['cert_marginal_cost']['wspec']:+.1%}"
                           for s_ in ws.values())
        claims.append(dict(claim_id="witcert-cert-marginal-cost",
                           ours=f"at most {max(costs):+.1%} (median {float(np.median(costs)):+.1%}) over {shapes}",
                           measured=float(max(costs)),
                           why="the paper's shape (B=2, S=4k) is not among the shapes measured with this kernel"))
    else:
        claims.append(dict(claim_id="witcert-cert-marginal-cost", ours="pending: no GPU result of the default kernel",
                           measured=None, why="needs `python -m kvlib.bench wspec_decode` on the H200"))
    if not gpu:
        return claims + [dict(claim_id=cid, ours="pending: no GPU result file", measured=None,
                              why="needs `python -m kvlib.bench witcert_decode` on the H200")
                         for cid in ("witcert-graph-replay", "witcert-latency-vs-fp16")]
    layouts = {"w24": cg, **cg_lay}
    claims.append(dict(
        claim_id="witcert-graph-replay", ours=f"{cg['interleaved_replays']} interleaved replays per kernel layout ("
        + ", ".join(layouts) + f"), {cg['steps']} captured steps each; bit-identical in "
        f"{sum(bool(c['bit_identical']) for c in layouts.values())} of {len(layouts)} layouts, a finite "
        f"certificate at every step in {sum(bool(c['finite_cert_every_step']) for c in layouts.values())}",
        measured={"replays_differing": sum(not c["bit_identical"] for c in layouts.values()),
                  "steps_without_certificate": sum(not c["finite_cert_every_step"] for c in layouts.values())}))
    graphed = [m for m in ("h10", "h8", "h8g") if f"{m}_graph_cert_cost_median" in v]  # no host overhead
    claims.append(dict(
        claim_id="witcert-cert-cost-layouts", ours=f"median {v['cert_cost_median']:+.1%} (A only, {best}, eager)"
        + "".join(f"; {m} layout under CUDA graphs: median {v[f'{m}_graph_cert_cost_median']:+.1%}, "
                  f"at most {v[f'{m}_graph_cert_cost_long_max']:+.1%} at S >= 16k, "
                  f"{v[f'{m}_graph_cert_cost_paper']:+.1%} at the paper's B=2, S=4k "
                  f"(a {1e3 * v[f'{m}_graph_paper_ms']:.0f} us step)"
                  for m in graphed),
        measured=float(min([v[f"{m}_graph_cert_cost_median"] for m in graphed] or [v["cert_cost_median"]]))))
    gmodes = [m for m in ("h10", "h8", "h8g") if f"{m}_graph_paper_shape" in v]
    eager = (f"eager (host launch overhead included): INT8+cert / SDPA bf16 = {v['ratio_paper_shape']:.2f}x at "
             f"the paper shape, SDPA / INT8+cert >= {v['speedup_long']:.2f}x at S >= 16k ({best}){graph_note}")
    if "h8g" in gmodes:
        claims.append(dict(
            claim_id="witcert-latency-vs-fp16",
            ours=f"the Gluon kernel (impl='auto' on an h8 pool) is {v['h8g_graph_paper_shape']:.2f}x SDPA bf16's "
                 "latency at the paper's shape under CUDA graphs",
            measured=float(v["h8g_graph_paper_shape"]),
            why="H200 vs RTX 4090, synthetic codes at the paper's heads; a different kernel from the paper's"))
    else:
        claims.append(dict(claim_id="witcert-latency-vs-fp16", ours="pending: the Gluon kernel was not timed",
                           measured=None, why="needs `python -m kvlib.bench witcert_decode` with the Gluon kernel"))
    ws_part = ""
    if ws:
        r = [s_["median_ms"]["wspec_cert"] / s_["median_ms"]["sdpa_bf16"] for s_ in ws.values()]
        ws_part = (f"; the warp-specialised default on pages: {min(r):.2f}-{max(r):.2f}x SDPA's latency at "
                   "S >= 16k (B 8-32)")
    claims.append(dict(
        claim_id="witcert-latency-other-kernels",
        ours="; ".join(f"{m}: {v[f'{m}_graph_paper_shape']:.2f}x at the paper shape, SDPA / INT8 "
                       f"{v[f'{m}_graph_speedup_min']:.2f}-{v[f'{m}_graph_speedup_max']:.2f}x at S >= 16k"
                       for m in gmodes if m != "h8g") + ws_part + "; " + eager,
        measured=float(v["ratio_paper_shape"])))
    return claims
