"""Writes the notebooks of the witcert_certificate chapter.

Run: .venv/bin/python notebooks/witcert_certificate/make_notebooks.py

Kept as code so the cells stay reviewable in diffs; the .ipynb files are what the book runs.
"""

# ruff: noqa: E501  (notebook cell sources are long strings)
from __future__ import annotations

import sys
from pathlib import Path

from nbformat import NotebookNode

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))  # run as a script: kvlib lives at the repository root

from kvlib.publish.nbbuild import code, md, params, write  # noqa: E402

SETUP = """
import os
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
torch.set_num_threads(1)  # small tensors: threads only add contention
"""


# ------------------------------------------------------------------------------------------------
def kernel() -> list[NotebookNode]:
    cells = [
        md(r"""
# The certificate inside the decode kernel: agreement, split invariance, and the GPU

**Question.** Does the Triton split-KV decode kernel (`kvlib.kernels.int8.decode`), which
regenerates the key dither, dequantises and accumulates the certificate $A$ (and $B$) in the same
pass as attention, compute the same output and the same certificate as the float64 torch
reference, whatever the split count? And on the H200: is CUDA-graph replay bit-identical, what does
the certificate cost, and how does certified INT8 decode compare with torch SDPA bf16?

The theorem and the role of each kernel detail are on the {doc}`theorem page </book/witcert_certificate/theorem>`. Here the
kernel runs under the Triton CPU interpreter on a small shape (same code as on the GPU); the GPU
numbers come from `python -m kvlib.bench witcert_decode` (file `data/results/gpu/witcert_decode.json`).
Keys are dithered with fp16 outlier pairs, values RTN, per-row $\delta$ = `delta`. Two kernels: the
tensor-core one over the paper's dither layout (`impl="tc"`, layout `w24`: one 24-bit dither per Philox
word, four per call), scores from exact fp16 operands per scale group, its remaining rounding inside
the radius (the theorem page, Step 3); and the streaming kernel over the `h10` layout (`impl="h10"`:
eight 10-bit dithers per Philox call, exact in fp16; the theorem page's h10 section says what the
coarser dither costs the radius).
"""),
        params(r"""
profile = "cpu"
B = 2
S = 256
hq = 8
hkv = 2
d = 64
splits = [1, 2, 8, 32]
delta = 1e-2
seed = 0
"""),
        code(r"""
import os
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
torch.set_num_threads(1)  # small tensors: threads only add contention

from kvlib.publish import Run, fmt
run = Run("witcert_kernel", profile=profile, params=dict(B=B, S=S, hq=hq, hkv=hkv, d=d, splits=splits,
                                                          delta=delta, seed=seed))
import math
import statistics
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from kvlib.kernels.int8.decode import Int8KernelConfig, decode_int8, decode_reference, make_pool_side
from kvlib.publish.provenance import load_result


def missing(fig_key, why, keys=()):
    # where a result file is absent: its numbers glued as nan and a placeholder figure (the book's figure
    # directives need a figure either way)
    for k in keys:
        run.glue(k, float("nan"))
    fig, ax = plt.subplots(figsize=(6.5, 1.2))
    ax.text(0.5, 0.5, why, ha="center", va="center")
    ax.axis("off")
    run.glue_fig(fig_key, fig)


g = torch.Generator().manual_seed(seed)
K = torch.randn(B * S, hkv, d, generator=g)
K[:, :, :2] *= 10  # one strong RoPE-ish pair per head, bypassed in fp16
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
tab = pd.DataFrame(rows).set_index("splits")
spread = float((torch.stack(certs).amax(0) - torch.stack(certs).amin(0)).max())
run.glue("max_do", float(tab["max|do|"].max()))
run.glue("max_dcert", float(tab["max|dcert|"].max()))
run.glue("split_spread", spread)
run.glue("cert_lo", float(ref.tv_bound.min()))
run.glue("cert_hi", float(ref.tv_bound.max()))
run.record("agreement", rows)
tab.style.format("{:.2e}")
""", hide_input=True),
        md(r"""
The largest differences over all split counts are
$\max|\Delta o|$ = {glue:text}`max_do:.2e` and $\max|\Delta \mathrm{cert}|$ = {glue:text}`max_dcert:.2e`
(certificates between {glue:text}`cert_lo:.3f` and {glue:text}`cert_hi:.3f`). The certificate of a row
changes by at most {glue:text}`split_spread:.1e` between 1 and 32 splits: the per-split $A_s$,
normalised by the split's own exp-sum, merge under the output's LSE weights exactly (rounding only).
"""),
        code(r"""
# the h10 layout: the same keys written with eight 10-bit dithers per Philox call, read by its kernel
# (d = 4 x 32 channels: each Philox word feeds one scale group)
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
    out = decode_int8(q10, pools["h10"], vp10, slots10, seq10, layer=1, seed=seed + 7, delta=delta, num_splits=ns,
                      config=Int8KernelConfig(block_n=16))
    certs10.append(out.tv_bound.double())
    rows10.append({"splits": ns, "max|do|": float((out.o.double() - refs["h10"].o).abs().max()),
                   "max|dcert|": float((out.tv_bound - refs["h10"].tv_bound).abs().max())})
tab10 = pd.DataFrame(rows10).set_index("splits")
run.glue("h10_max_do", float(tab10["max|do|"].max()))
run.glue("h10_max_dcert", float(tab10["max|dcert|"].max()))
run.glue("h10_split_spread", float((torch.stack(certs10).amax(0) - torch.stack(certs10).amin(0)).max()))
ratio10 = refs["h10"].tv_bound / refs["w24"].tv_bound
run.glue("h10_cert_ratio_max", float(ratio10.max()))
run.glue("h10_cert_ratio_median", float(ratio10.median()))
run.record("agreement_h10", rows10)
tab10.style.format("{:.2e}")
"""),
        md(r"""
With the h10 layout the kernel agrees with its reference to $\max|\Delta o|$ =
{glue:text}`h10_max_do:.1e` and $\max|\Delta\mathrm{cert}|$ = {glue:text}`h10_max_dcert:.1e` (split spread
{glue:text}`h10_split_spread:.1e`). The same keys certified through the two layouts: the h10 certificate
is at most {glue:text}`h10_cert_ratio_max:.3f` times the w24 one (median {glue:text}`h10_cert_ratio_median:.3f`):
the 10-bit grid's mean ($2^{-11} s$ per channel) and the kernel's rounding term widen the radius by a
few percent, and the keys' dither differs, so the two certificates are different draws.
"""),
        code(r"""
gpu = load_result("witcert_decode", "gpu")
if gpu is None:
    print("GPU results pending: run `python -m kvlib.bench witcert_decode` on the H200 "
          "(writes data/results/gpu/witcert_decode.json); the GPU rows of the table below stay 'not reproducible here'.")
    lat = None
else:
    r = gpu["results"]
    print("measured on", r["device"], "| commit", gpu["provenance"].get("commit", "?"))
    agr = pd.DataFrame(r["agreement"]["splits"]).T
    exact = agr[agr.index.str.startswith("exact")]  # every tensor-core operand exact; "fast" drops two lo parts
    run.glue("gpu_max_do", float(exact["max_abs_do"].max()))
    run.glue("gpu_max_dcert", float(exact["max_abs_dcert"].max()))
    cg = r["cuda_graph"]
    run.glue("graph_identical", bool(cg["bit_identical"]))
    for lay in ("h10", "h8", "h8g"):
        rows_l = agr[agr.index.str.startswith(lay + "/")]
        if len(rows_l):
            run.glue(f"gpu_{lay}_max_do", float(rows_l["max_abs_do"].max()))
            run.glue(f"gpu_{lay}_max_dcert", float(rows_l["max_abs_dcert"].max()))
    cg_lay = {lay: r[f"cuda_graph_{lay}"] for lay in ("h10", "h8", "h8g") if f"cuda_graph_{lay}" in r}
    lat = pd.DataFrame([{"B": x["B"], "S": x["S"], **{k: v["median_ms"] for k, v in x["timings"].items()
                         if isinstance(v, dict)}} for x in r["latency"] if "timings" in x])
    display(agr.style.format("{:.2e}"))
    display(lat.set_index(["B", "S"]).style.format("{:.3f}"))
""", hide_input=True),
        code(r"""
if lat is None:
    missing("fig_latency", "GPU results pending: python -m kvlib.bench witcert_decode")
if lat is not None:
    modes = list(gpu["results"]["modes"])
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    x = range(len(lat))
    labels = [f"B={b}\nS={s // 1024}k" for b, s in zip(lat.B, lat.S)]
    ax.plot(x, lat["sdpa_bf16"], "k-o", label="torch SDPA bf16")
    ax.plot(x, lat["ours_bf16"], "-s", label="our bf16 split-KV")
    for m in modes:
        ax.plot(x, lat[f"int8_{m}"], "--^", label=f"INT8 ({m})")
        ax.plot(x, lat[f"int8_cert_A_{m}"], "-v", label=f"INT8 + cert A ({m})")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("decode step (ms)")
    ax.legend(fontsize=7)
    run.glue_fig("fig_latency", fig)
    summ = gpu["results"].get("summary", {})
    best = max(modes, key=lambda m: summ["min_speedup_vs_sdpa_S>=16k"][m]) if summ else modes[0]
    run.glue("speedup_long", float(summ["min_speedup_vs_sdpa_S>=16k"][best]) if summ else float("nan"))
    run.glue("cert_cost_median", float(summ["median_cert_cost_A"][best]) if summ else float("nan"))
    if summ and "h10" in summ["max_cert_cost_A"]:
        run.glue("cert_cost_max_h10", float(summ["max_cert_cost_A"]["h10"]))
    paper_shape = lat[(lat.B == 2) & (lat.S == 4096)].iloc[0]
    run.glue("ratio_paper_shape", float(paper_shape[f"int8_cert_A_{best}"] / paper_shape["sdpa_bf16"]))
    graph_note = ""
    # the fastest certified mode timed under graphs (the best eager mode's column when it has one)
    gcols = [f"int8_cert_A_{m}_graph" for m in (best, "h8", "h10", "fast") if f"int8_cert_A_{m}_graph" in lat]
    gcol = gcols[0] if gcols else "int8_cert_A_fast_graph"
    if gcol in lat:  # CUDA-graph replay removes host launch overhead
        lg = lat[lat.S >= 16384]
        run.glue("speedup_long_graph", float((lg["sdpa_bf16_graph"] / lg[gcol]).min()))
        graph_note = f"; under CUDA graphs >= {run.values['speedup_long_graph']:.2f}x ({gcol})"
    # the per-mode picture at the shape the goal names (B=32, S=16k) and the largest one
    for m in ("h10", "h8", "h8g"):  # graph timings: eager ones of sub-0.3 ms steps carry host launch overhead
        if f"int8_cert_A_{m}_graph" not in lat:
            continue
        cost = lat[f"int8_cert_A_{m}_graph"] / lat[f"int8_{m}_graph"] - 1
        lg_m = lat[lat.S >= 16384]
        pc = lat[(lat.B == 2) & (lat.S == 4096)].iloc[0]
        run.glue(f"{m}_graph_cert_cost_median", float(cost.median()))
        run.glue(f"{m}_graph_cert_cost_max", float(cost.max()))
        run.glue(f"{m}_graph_cert_cost_long_max", float(cost[lat.S >= 16384].max()))
        run.glue(f"{m}_graph_cert_cost_paper", float(pc[f"int8_cert_A_{m}_graph"] / pc[f"int8_{m}_graph"] - 1))
        run.glue(f"{m}_graph_speedup_min", float((lg_m["sdpa_bf16_graph"] / lg_m[f"int8_cert_A_{m}_graph"]).min()))
        run.glue(f"{m}_graph_speedup_max", float((lg_m["sdpa_bf16_graph"] / lg_m[f"int8_cert_A_{m}_graph"]).max()))
        run.glue(f"{m}_graph_paper_shape", float(pc[f"int8_cert_A_{m}_graph"] / pc["sdpa_bf16_graph"]))
        run.glue(f"{m}_graph_paper_ms", float(pc[f"int8_cert_A_{m}_graph"]))
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
            run.glue("h10_speedup_32_16k", float(h["SDPA / cert A"].iloc[0]))
            run.glue("h10_cert_cost_32_16k", float(h["cert cost A"].iloc[0]))
        w = mt[(mt["mode"] == "fast") & (mt.B == 32)]
        if len(w):
            run.glue("w24_speedup_32_16k", float(w["SDPA / cert A"].iloc[0]))
        display(mt.set_index(["B", "S", "mode"]).style.format("{:.3f}"))
# why the kernels sit below the roofline, from their compiled sm_90 loops (python -m kvlib.bench sass_count)
sass = load_result("sass_count", "cpu")
if sass is not None:
    sr = sass["results"]
    run.glue("sass_h10_per_elem", float(sr["h10_certA"]["per_element"]))
    run.glue("sass_h8_per_elem", float(sr["h8_certA"]["per_element"]) if "h8_certA" in sr else float("nan"))
    run.glue("sass_h10_regs", int(sr["h10_certA"]["registers"]))
    run.glue("sass_h10_philox_share", float(sr["h10_philox_share"]))
    run.glue("sass_w24_per_elem", float(sr["w24_tc_certA"]["per_element"]))

""", hide_input=True),
        md(r"""
```{glue:figure} fig_latency
:name: fig-witcert-latency
Decode-step latency on the H200 (eager timings, log scale): torch SDPA bf16, our bf16 split-KV kernel, and
INT8 without and with certificate A for each kernel mode.
```
"""),
        md(r"""
## Where the certified step's time goes

The h10 kernel streams half of SDPA's bytes yet takes longer. Development probes on the H200 (CUDA-graph
timings at B = 8, S = 32k, 28 query / 4 KV heads; files under `dev/results/`, each with its
provenance) take the step apart. Dropping one part at a time (`_h10_probe4`, timing only: an ablated
kernel computes no attention) shows that no single part is the gap: without the PV path the step takes
{glue:text}`abl_no_pv_ms:.3f` ms, without the QK path {glue:text}`abl_no_qk_ms:.3f` ms, without Philox
{glue:text}`abl_nophilox_ms:.3f` ms, against {glue:text}`abl_cert_ms:.3f` ms whole and
{glue:text}`abl_sdpa_ms:.3f` ms for SDPA. With QK, PV and Philox all gone, what is left (slot indices,
scales, softmax, certificate) still takes {glue:text}`abl_floor_ms:.3f` ms: a chain of small synchronous
loads per 64-position tile. Loading those one tile ahead (now the kernel's only path, bit-identical)
took the step from {glue:text}`pf_off_ms:.3f` to {glue:text}`pf_on_ms:.3f` ms (`_h10_probe5`). PV
through fewer shared-memory round trips helps a little more but not enough: values rounded to fp16
once and one dot per tile (`decode_int8_h10.PV_DEQUANT`, opt-in because it is not exact: outputs move
by up to {glue:text}`deq_max_do:.1e`) takes {glue:text}`deq_ms:.3f` ms (`_h10_probe6`). A different
structure alone is not enough either: a prototype of just the QK stage as a KV4-style kernel would
compute it (INT8 tensor-core dots of the codes against a two-piece INT8 query, the dither's fp16 dot
generated in the operand's own layout; `_proto_qk`) scores the keys of the same shape in
{glue:text}`proto_qk_ms:.3f` ms, against {glue:text}`proto_copy_ms:.3f` ms to copy those key bytes, before
any softmax or value work. Beating SDPA needs both a leaner loop and less dither regeneration per
element (for example more dithers per Philox call, which the certificate pays for in its mean term).
"""),
        code(r"""
abl = load_result("dev/h10_probe4", "gpu")
p5 = load_result("dev/h10_probe5", "gpu")
p6 = load_result("dev/h10_probe6", "gpu")
if abl and p5 and p6:
    a = pd.DataFrame(abl["results"])
    a = a[(a.B == 8) & (a.S == 32768)].set_index("name")
    for key, name in (("abl_cert_ms", "certA"), ("abl_no_pv_ms", "no_pv"), ("abl_no_qk_ms", "no_qk"),
                      ("abl_nophilox_ms", "nophilox"), ("abl_floor_ms", "no_qk_pv_nophilox")):
        run.glue(key, float(a.loc[name, "ms"]))
    run.glue("abl_sdpa_ms", float(a["sdpa_ms"].iloc[0]))
    t5 = [r for r in p5["results"] if r["kind"] == "timing" and r["B"] == 8 and r["S"] == 32768]
    run.glue("pf_off_ms", next(r["ms"] for r in t5 if list(r["combo"]) == [2, 64, False, 0]))
    run.glue("pf_on_ms", next(r["ms"] for r in t5 if list(r["combo"]) == [2, 64, True, 0]))
    t6 = {r["name"]: r for r in p6["results"] if r["kind"] == "timing" and r["B"] == 8 and r["S"] == 32768}
    run.glue("deq_ms", t6["dequant"]["ms"])
    run.glue("deq_max_do", next(r["max_abs_do"] for r in p6["results"]
                                if r["kind"] == "agreement" and r["name"] == "dequant"))
    pq = load_result("dev/proto_qk", "gpu")
    pq_rows = {r["name"]: r for r in pq["results"]} if pq else {}
    run.glue("proto_qk_ms", min((r["ms"] for k, r in pq_rows.items() if k.startswith("proto_qk")), default=float("nan")))
    run.glue("proto_copy_ms", pq_rows["copy_keys"]["ms"] if pq_rows else float("nan"))
    parts = pd.Series({"whole step": a.loc["certA", "ms"], "without PV": a.loc["no_pv", "ms"],
                       "without QK": a.loc["no_qk", "ms"], "without Philox": a.loc["nophilox", "ms"],
                       "without QK, PV, Philox": a.loc["no_qk_pv_nophilox", "ms"]})
    fig, ax = plt.subplots(figsize=(6.0, 2.4))
    ax.barh(parts.index[::-1], parts.values[::-1], color="tab:blue")
    ax.axvline(float(a["sdpa_ms"].iloc[0]), color="k", ls="--", label="SDPA bf16")
    ax.set_xlabel("certified h10 step (ms), B=8, S=32k, ablations")
    ax.legend(fontsize=7)
    fig.tight_layout()
    run.glue_fig("fig_h10_ablation", fig)
else:
    missing("fig_h10_ablation", "development probes not found under dev/results/",
            ("abl_cert_ms", "abl_no_pv_ms", "abl_no_qk_ms", "abl_nophilox_ms", "abl_floor_ms", "abl_sdpa_ms",
             "pf_off_ms", "pf_on_ms", "deq_ms", "deq_max_do", "proto_qk_ms", "proto_copy_ms"))
""", hide_input=True),
        md(r"""
```{glue:figure} fig_h10_ablation
:name: fig-h10-ablation
The certified h10 step at B = 8, S = 32k with one part dropped at a time (timing only), against SDPA bf16
(dashed). Source: `dev/results/h10_probe4.json`.
```
"""),
        md(r"""
**The certificate's own cost.** Per (position, head) the certificate needs the variance
$\sum_g s_g^2 v_g$, a square root, one exponential and one accumulation. Two changes brought its
marginal cost down (`_h10_probe7`, `_h10_probe8`; three interleaved rounds under CUDA graphs). The kernel
keeps its scores in base 2, so every exponential is one `ex2.approx.ftz` instead of `tl.exp`'s multiply,
`ex2` and subnormal fix-up: {glue:text}`p7_exp_ms:.4f` → {glue:text}`p7_exp2_ms:.4f` ms certified at B = 8,
S = 32k, and faster without the certificate too. The variance is one 16-deep tf32 tensor-core dot per tile,
with $s_g^2$ split into two exact tf32 pieces and $v_g$ into hi + lo, so the tensor cores round nothing
that matters (the `(1 + 2^-8)` margin of the variance covers the truncated lo piece, $2^{-21}$ relative):
the certificate then costs {glue:text}`p8_cost_dot_8_32k:.1%` at B = 8, S = 32k and
{glue:text}`p8_cost_dot_32_16k:.1%` at B = 32, S = 16k, against {glue:text}`p8_cost_fma_8_32k:.1%` and
{glue:text}`p8_cost_fma_32_16k:.1%` with the four-FMA sum, at the same agreement with the float64 reference
(max $|\Delta\mathrm{cert}|$ {glue:text}`p8_dcert:.1e`). At the paper's small step (B = 2, S = 4k,
{glue:text}`p8_us_2_4k:.1f` µs certified on the H200) it still costs {glue:text}`p8_cost_dot_2_4k:.0%`: the default
plan gives each of its programs one 64-position tile, so the certificate's per-program prologue (per-group query sums across
threads, the radius) and its extra accumulator dominate; fewer splits were slower with and without the
certificate.

The cost depends on the GQA ratio and the layout (`_h10_probe12`, `dev/results/h10_probe12.json`, the same
three-round method at S ≥ 16k). With four query heads per program (32 query / 8 KV heads) the exact dot stays as
fast as the FMA sum or faster, and the certificate costs {glue:text}`p12_h10_gqa4_lo:.1%`-{glue:text}`p12_h10_gqa4_hi:.1%`
with h10 and {glue:text}`p12_h8_gqa4_lo:.1%`-{glue:text}`p12_h8_gqa4_hi:.1%` with h8; with seven (28 / 4, the paper's)
{glue:text}`p12_h10_gqa7_lo:.1%`-{glue:text}`p12_h10_gqa7_hi:.1%` with h10 and
{glue:text}`p12_h8_gqa7_lo:.1%`-{glue:text}`p12_h8_gqa7_hi:.1%` with h8. So at long context one layout meets the 3%
goal at each ratio, h10 at GQA 7 and h8 at GQA 4, and neither meets it at both: the same certificate instructions
land differently in the two compiled loops.
"""),
        code(r"""
p7 = load_result("dev/h10_probe7", "gpu")
p8 = load_result("dev/h10_probe8", "gpu")
keys8 = {("default", 8, 32768): "p8_cost_dot_8_32k", ("default", 32, 16384): "p8_cost_dot_32_16k",
         ("fma_var", 8, 32768): "p8_cost_fma_8_32k", ("fma_var", 32, 16384): "p8_cost_fma_32_16k",
         ("default", 2, 4096): "p8_cost_dot_2_4k"}
if p7 and p8:
    t7 = {r["name"]: r["ms"] for r in p7["results"] if r["kind"] == "timing" and (r["B"], r["S"]) == (8, 32768)}
    run.glue("p7_exp_ms", t7["exp_cert"])
    run.glue("p7_exp2_ms", t7["exp2_cert"])
    c8 = {(r["name"], r["B"], r["S"]): r["cost"] for r in p8["results"] if r["kind"] == "cert_cost"}
    for k, g in keys8.items():
        run.glue(g, float(c8[k]))
    run.glue("p8_dcert", next(r["dcert"] for r in p8["results"] if r["kind"] == "agreement" and r["name"] == "cert"))
    run.glue("p8_us_2_4k", 1e3 * next(r["ms"] for r in p8["results"] if r["kind"] == "timing"
                                      and (r["B"], r["S"], r["name"]) == (2, 4096, "cert")))
else:
    for g in ("p7_exp_ms", "p7_exp2_ms", "p8_dcert", "p8_us_2_4k", *keys8.values()):
        run.glue(g, float("nan"))
p12 = load_result("dev/h10_probe12", "gpu")
for lay in ("h10", "h8"):
    for gqa, hq in (("gqa4", 32), ("gqa7", 28)):
        c = [r["cost"] for r in p12["results"] if r["kind"] == "cert_cost" and r["name"] == f"{lay}_dot"
             and r["hq"] == hq] if p12 else []
        run.glue(f"p12_{lay}_{gqa}_lo", min(c) if c else float("nan"))
        run.glue(f"p12_{lay}_{gqa}_hi", max(c) if c else float("nan"))
""", hide_input=True),
        md(r"""
## A loop without shared memory: the Gluon kernel

The analysis above pointed at the loop's structure, so the last kernel rebuilds the loop rather than
tuning it. `kvlib.kernels.int8.gluon` reads the h8 pool (mode `h8g` of the benchmark) with the same
arithmetic as the h8 Triton kernel: the same exact fp16 operands, fp32 accumulation and radius, so the
theorem page's rounding account covers it. It is written in Gluon, Triton's lower-level dialect with explicit
register layouts, and it differs in four ways.

- **One warp per program.** The online softmax's reductions never leave the warp. The GPU is filled with more
  split programs instead: one wave of them, eight per SM.
- **Heads as rows.** Scores are $QK^\top$ with the heads as rows, so the probabilities' accumulator fragment is
  already the operand of $V^\top P^\top$. No transpose is needed.
- **Operands loaded where the tensor cores read them.** The reduction index is permuted so that each thread's
  four channels of a fragment are one stored code word. Codes go straight from 64-bit and 32-bit loads into the
  fragments; the value bytes are paired by `prmt` in registers. Every layout conversion is checked at compile
  time to move no data.
- **Each Philox call computed once.** Every thread computes exactly the two calls per position whose words its
  fragments need, none twice, and computes them one tile ahead, beside the previous tile's PV.

The compiled sm_90 loop uses no shared memory (Triton's h8 loop makes several shared-memory round trips per
tile). It issues {glue:text}`sass_gluon_per_pos:.1f` warp instructions per (position, KV head), against
{glue:text}`sass_h8_per_pos:.1f` for the Triton h8 kernel, with {glue:text}`sass_gluon_regs` registers per
thread.

On the H200, under CUDA graphs, certified decode with this kernel runs at
{glue:text}`h8g_graph_speedup_min:.2f`-{glue:text}`h8g_graph_speedup_max:.2f`x of SDPA bf16's speed at S ≥ 16k.
The h8 Triton kernel reaches {glue:text}`h8_graph_speedup_min:.2f`-{glue:text}`h8_graph_speedup_max:.2f`x on the
same codes. The certificate costs {glue:text}`h8g_graph_cert_cost_median:.1%` (median over the shapes), at most
{glue:text}`h8g_graph_cert_cost_long_max:.1%` at S ≥ 16k and {glue:text}`h8g_graph_cert_cost_paper:.0%` at the
paper's small step. On the performance grid's heads (32 query / 8 KV heads, batch 1-512, `decode_grid.json`)
it is faster than SDPA bf16 at {glue:text}`grid_h8g_faster` of the shapes with S ≥ 16k
({glue:text}`grid_h8g_min:.2f`-{glue:text}`grid_h8g_max:.2f`x). Agreement with the float64 reference on the H200
is that of the other kernels: max
$|\Delta o|$ {glue:text}`gpu_h8g_max_do:.1e` and max $|\Delta\mathrm{cert}|$ {glue:text}`gpu_h8g_max_dcert:.1e`
over splits 1 to 32. Its CUDA-graph replay is bit-identical to eager.

Gluon has no CPU interpreter, so this kernel runs on a GPU only. The CPU tests cover the Triton kernels and check
this kernel's requirements and its sm_90 compile. The GPU tests (`tests/test_decode_gluon.py`) and the benchmark's
agreement check bind it to the reference. `decode_int8(impl="auto")` takes it for an h8 pool on a GPU wherever it
runs: d = 128, at most eight query heads per KV head, fp16/bf16 queries, no outlier channels. Otherwise the Triton
kernel runs.

The probes that shaped it (`_gluon_probe`, three interleaved rounds each, B = 8 and S = 32k unless the table says
otherwise) are in the table below. Each row compares variants timed side by side in one run:
"""),
        code(r"""
def _gp(name):
    f = load_result(f"dev/{name}", "gpu")
    return {} if f is None else {(r["B"], r["S"], r["hq"], r["name"]): r["ms"] for r in f["results"]
                                 if r["kind"] == "timing" and r["ms"]}
g3, g4, g5 = _gp("gluon_probe3"), _gp("gluon_probe4"), _gp("gluon_probe5")
g6, g7, g8 = _gp("gluon_probe6"), _gp("gluon_probe7"), _gp("gluon_probe8")
g10, g11, g12, g13 = _gp("gluon_probe10"), _gp("gluon_probe11"), _gp("gluon_probe12"), _gp("gluon_probe13")
g14 = _gp("gluon_probe14")
rows_g = []
def _row(what, f, a, b, shape=(8, 32768, 28)):
    ta, tb = f.get(shape + (a,)), f.get(shape + (b,))
    if ta and tb:
        rows_g.append({"change": what, "shape": f"B={shape[0]}, S={shape[1] // 1024}k, {shape[2]} q heads",
                       "variant (ms)": ta, "kept (ms)": tb, "variant / kept": ta / tb})
_row("two waves of programs instead of one", g4, "gluon_cert_bn16_ns66", "gluon_cert_bn16_ns33")
_row("half a wave", g4, "gluon_cert_bn16_ns16", "gluon_cert_bn16_ns33")
_row("32-position tiles (spill)", g4, "gluon_cert_bn32_ns33", "gluon_cert_bn16_ns33")
_row("registers capped at 200 (10 programs per SM), best plan", g4, "gluon_cert_bn16_r200_ns82", "gluon_cert_bn16_ns33")
_row("registers capped at 168 (12 per SM), best plan", g3, "gluon_cert_ns99_r168", "gluon_cert_ns33_rNone")
_row("Philox of the same tile (not one ahead), GQA 4", g5, "gluon_cert_bn16_ns4", "gluon_cert_ahead_ns4", (32, 16384, 32))
_row("Philox of the same tile (not one ahead), GQA 7", g5, "gluon_cert_bn16_ns33", "gluon_cert_ahead_ns33")
_row("prefetch of the next tile's rows (removed)", g6, "gluon_cert_pf1_l2_ns33", "gluon_cert_base_ns33")
_row("prefetch, GQA 4 (removed)", g6, "gluon_cert_pf1_l2_ns4", "gluon_cert_base_ns4", (32, 16384, 32))
_row("stream plan: equal pieces across rows (removed)", g7, "gluon_cert_stream", "gluon_cert_grid_ns33")
_row("stream plan at B = 64 (removed)", g7, "gluon_cert_stream", "gluon_cert_grid_ns4", (64, 32768, 28))
_row("radius before the QK dots, stream + prefetch, GQA 4 (removed)", g8, "gluon_cert_stream_pf1_early",
     "gluon_cert_stream_pf1", (32, 16384, 32))
_row("radius before the QK dots, stream + prefetch, B = 64 (removed)", g8, "gluon_cert_stream_pf1_early",
     "gluon_cert_stream_pf1", (64, 32768, 28))
_row("rescale only on tiles where a maximum moved (removed)", g10, "gluon_cert_skip_ns33", "gluon_cert_always_ns33")
_row("registers capped at 224 for 9 programs per SM (removed)", g11, "gluon_cert_cap224_ns37",
     "gluon_cert_default_ns33")
_row("two warps per program, two channel groups each (removed)", g12, "gluon_cert_w2_ns25", "gluon_cert_w1_ns33")
_row("two warps per program, B = 64 (removed)", g12, "gluon_cert_w2_ns3", "gluon_cert_w1_ns4", (64, 32768, 28))
_row("operands staged in shared memory (cp.async), 12 per SM (removed)", g13, "gluon_cert_smem12_ns50",
     "gluon_cert_reg_ns33")
_row("operands staged in shared memory (cp.async), 8 per SM (removed)", g13, "gluon_cert_smem8_ns33",
     "gluon_cert_reg_ns33")
_row("each tile's scores computed one iteration ahead, beside the previous tile's softmax and PV (removed)", g14,
     "gluon_cert_qk_ahead_ns33", "gluon_cert_ahead_ns33")
_row("scores one iteration ahead, B = 64 (removed)", g14, "gluon_cert_qk_ahead_ns4", "gluon_cert_ahead_ns4",
     (64, 32768, 28))
# the scores-ahead variant against the kept kernel at every long shape, each at the kept plan's split count
for kind in ("cert", "nocert"):
    r_ = [t / g14[k[:3] + (f"gluon_{kind}_ahead_" + k[3].rsplit("_", 1)[1],)] for k, t in g14.items()
          if k[1] >= 16384 and k[3].startswith(f"gluon_{kind}_qk_ahead_")
          and k[:3] + (f"gluon_{kind}_ahead_" + k[3].rsplit("_", 1)[1],) in g14]
    run.glue(f"qka_{kind}_min", min(r_) if r_ else float("nan"))
    run.glue(f"qka_{kind}_max", max(r_) if r_ else float("nan"))
gt = pd.DataFrame(rows_g)
if len(gt):
    display(gt.set_index("change").style.format({"variant (ms)": "{:.4f}", "kept (ms)": "{:.4f}",
                                                 "variant / kept": "{:.3f}"}))
if sass is not None and "gluon_h8_certA" in sass["results"]:
    sg, s8 = sass["results"]["gluon_h8_certA"], sass["results"]["h8_certA"]
    run.glue("sass_gluon_per_pos", float(sg["per_position_head"]))
    run.glue("sass_h8_per_pos", float(s8["instructions"] * s8["num_warps"] / s8["block_n"]))
    run.glue("sass_gluon_regs", int(sg["registers"]))
else:
    for k in ("sass_gluon_per_pos", "sass_h8_per_pos", "sass_gluon_regs"):
        run.glue(k, float("nan"))
for k in ("h8g_graph_speedup_min", "h8g_graph_speedup_max", "h8g_graph_cert_cost_median", "h8g_graph_cert_cost_long_max",
          "h8g_graph_cert_cost_paper", "gpu_h8g_max_do", "gpu_h8g_max_dcert", "h8_graph_speedup_min",
          "h8_graph_speedup_max"):
    if k not in run.values:  # no GPU file (or one from before the Gluon kernel): the prose shows nan
        run.glue(k, float("nan"))
grid = load_result("decode_grid", "gpu")
grid_long = [(row["methods"]["sdpa_bf16"]["median_ms"] / row["methods"]["int8_h8g_cert"]["median_ms"])
             for row in (grid["results"]["rows"] if grid else []) if row["ctx"] >= 16384
             and "int8_h8g_cert" in row["methods"] and "sdpa_bf16" in row["methods"]]
run.glue("grid_h8g_faster", f"{sum(x > 1 for x in grid_long)} of {len(grid_long)}" if grid_long else "none measured")
run.glue("grid_h8g_min", min(grid_long) if grid_long else float("nan"))
run.glue("grid_h8g_max", max(grid_long) if grid_long else float("nan"))
run.glue("h8g_goal_status", "met" if run.values["h8g_graph_speedup_min"] >= 1 else
         "not met yet" if run.values["h8g_graph_speedup_min"] > 0 else "not measured here")
""", hide_input=True),
        md(r"""
Rows marked "removed" were variants timed against the kernel and taken out again: each moved the time by about
as much as the compiler's schedule moves between unrelated edits (after a refactor that changed only line
numbers, the same source compiled to a longer loop), and none won at every shape. The latency record
above was re-measured after their removal.

### Where its time goes

Nsight Compute profiled one launch of the certified kernel at B = 64, S = 16k on the H200
(`dev/results/gluon_ncu.json`). It is bound by neither memory nor instruction issue. DRAM runs at
{glue:text}`ncu_dram:.0f`% of its peak and the schedulers issue in {glue:text}`ncu_issue:.0f`% of their cycles.
Each scheduler holds {glue:text}`ncu_warps:.2f` warps (one-warp programs at {glue:text}`ncu_regs` registers,
eight per SM), and on average {glue:text}`ncu_eligible:.2f` of them can issue. The warps' stall samples
({numref}`fig-gluon-stalls`) show latency rather than throughput:

- {glue:text}`ncu_wait:.0%` of the samples wait on a fixed-latency result (Philox's multiply chains, the dots);
- {glue:text}`ncu_long:.0%` wait on global loads; two instructions that consume the next tile's loads hold
  {glue:text}`ncu_hot2:.0%` on their own;
- only {glue:text}`ncu_selected:.0%` are issuing.

Two warps per scheduler cannot hide that latency. More warps need fewer registers, and each way to get them lost
in the table above:

- register caps at 200 and 168 spill;
- a cap at 224 does not spill, but its schedule is slower even at half a wave, and a ninth program per SM may not
  fit at all, since each scheduler has its own quarter of the register file;
- staging the operands through shared memory with `cp.async` (only the current tile in registers, few enough
  that three warps fit per scheduler) adds shared-memory loads and barriers to every tile, and is slower with 12
  programs per SM than with 8;
- splitting a program's tile between two warps (each takes two of the four channel groups, few enough registers
  that three warps fit per scheduler) computes the same values bit for bit, but runs far slower (the table). The tile's
  work is one dependency chain: Philox rounds, then the QK dots, the softmax and PV. Splitting it leaves each warp
  half the independent work along a chain just as long. Each tile also adds two exchanges through shared memory,
  with barriers, on that chain.

Nor did more independent work inside one warp help. Computing each tile's scores (its dither, QK dots and
variance) at the end of the iteration before, so that they form a chain beside the previous tile's softmax and PV
that ptxas could interleave, took {glue:text}`qka_cert_min:.2f`-{glue:text}`qka_cert_max:.2f`x the kept kernel's
time certified (plans of one wave and of half a wave) and {glue:text}`qka_nocert_min:.2f`-{glue:text}`qka_nocert_max:.2f`x
uncertified at every shape with S >= 16k (the last rows of the table; `gluon_probe14.json`).

The uncertified kernel has the same profile, with global loads a larger share.
"""),
        code(r"""
ncu = load_result("dev/gluon_ncu", "gpu")
if ncu is not None:
    nc = ncu["results"]["cert"]
    run.glue("ncu_dram", float(nc["dram_throughput_pct"]))
    run.glue("ncu_issue", float(nc["issue_slots_busy_pct"]))
    run.glue("ncu_warps", float(nc["active_warps_per_scheduler"]))
    run.glue("ncu_eligible", float(nc["eligible_warps_per_scheduler"]))
    run.glue("ncu_regs", int(nc["registers"]))
    st = nc["loop_stall_share"]
    run.glue("ncu_wait", float(st.get("wait", 0.0)))
    run.glue("ncu_long", float(st.get("long_sb", 0.0)))
    run.glue("ncu_selected", float(st.get("selected", 0.0)))
    run.glue("ncu_hot2", float(sum(h["samples_share"] for h in nc["loop_hotspots"][:2])))
    names = {"selected": "issuing", "wait": "fixed-latency dependency", "dispatch": "dispatch",
             "not_selected": "eligible, not selected", "long_sb": "global load", "math": "math pipe busy"}
    rows_n = [{"reason": names.get(k, "other"), "kernel": lab, "share": v}
              for lab, key in (("certified", "cert"), ("uncertified", "nocert"))
              for k, v in ncu["results"][key]["loop_stall_share"].items()]
    sdf = pd.DataFrame(rows_n).groupby(["reason", "kernel"], as_index=False)["share"].sum()
    order = [names[k] for k in names]
    fig, ax = plt.subplots(figsize=(6.0, 2.6))
    sns.barplot(sdf, y="reason", x="share", hue="kernel", order=order + ["other"], ax=ax)
    ax.set_xlabel("share of the loop's warp stall samples (B=64, S=16k, H200)")
    ax.set_ylabel("")
    ax.legend(fontsize=7)
    fig.tight_layout()
    run.glue_fig("fig_gluon_stalls", fig)
else:
    missing("fig_gluon_stalls", "no Nsight Compute summary under dev/results/",
            ("ncu_dram", "ncu_issue", "ncu_warps", "ncu_eligible", "ncu_regs", "ncu_wait", "ncu_long",
             "ncu_selected", "ncu_hot2"))
""", hide_input=True),
        md(r"""
```{glue:figure} fig_gluon_stalls
:name: fig-gluon-stalls
Why the Gluon kernel's warps were not issuing, sampled by Nsight Compute over its inner loop: the certified and
uncertified kernels at B = 64, S = 16k on the H200. Source: `dev/results/gluon_ncu.json`.
```

### Power

The kernel also draws more power than SDPA does. A probe timed the certified step and SDPA bf16 at B = 64,
S = 32k (28/4 heads) in interleaved rounds, first on a cold GPU and then after a minute of continuous replays of
each (`dev/results/power_probe.json`), and read `nvidia-smi` after every timing.

- Under load the board draws up to {glue:text}`pp_power_max:.0f` W, and `nvidia-smi` reports
  {glue:text}`pp_throttle` as the active throttle reason.
- The SM clock the board then allows depends on the kernel that is running: a median of
  {glue:text}`pp_clock_h8g:.0f` MHz for the certified step and {glue:text}`pp_clock_sdpa:.0f` MHz for SDPA.
- SDPA's time over the step's is {glue:text}`pp_ratio_cold:.3f` on the cold GPU and
  {glue:text}`pp_ratio_hot:.3f` after sustained load, in line with the latency record at that shape.

The development probes in the table above time each variant over shorter windows than this probe does, too short
for the power draw to reach the cap. At this shape they read the step {glue:text}`pp_probe_gap:.1%` faster than
sustained operation does, so the table's ratios are for comparing variants with each other, not with SDPA.
"""),
        code(r"""
pp = load_result("dev/power_probe", "gpu")
if pp is not None:
    def _smi(r):
        clk, _mem, _temp, pw, thr = [x.strip() for x in r["smi"].split(",")]
        return float(clk.split()[0]), float(pw.split()[0]), int(thr, 16)
    hot = [r for r in pp["results"] if r["phase"] != "cold"]
    med = lambda rows, n, i: statistics.median(_smi(r)[i] if i is not None else r["ms"]  # noqa: E731
                                               for r in rows if r["name"] == n)
    run.glue("pp_power_max", max(_smi(r)[1] for r in hot))
    run.glue("pp_throttle", "the software power cap" if all(_smi(r)[2] & 0x4 for r in hot)
             else "no power cap on every reading")
    run.glue("pp_clock_h8g", med(hot, "h8g_cert", 0))
    run.glue("pp_clock_sdpa", med(hot, "sdpa", 0))
    cold = [r for r in pp["results"] if r["phase"] == "cold"]
    run.glue("pp_ratio_cold", med(cold, "sdpa", None) / med(cold, "h8g_cert", None))
    run.glue("pp_ratio_hot", med(hot, "sdpa", None) / med(hot, "h8g_cert", None))
    p13 = _gp("gluon_probe13").get((64, 32768, 28, "gluon_cert_reg_ns4"))
    run.glue("pp_probe_gap", 1 - p13 / med(hot, "h8g_cert", None) if p13 else float("nan"))
else:
    for k in ("pp_power_max", "pp_clock_h8g", "pp_clock_sdpa", "pp_ratio_cold", "pp_ratio_hot", "pp_probe_gap"):
        run.glue(k, float("nan"))
    run.glue("pp_throttle", "(no power probe file)")
""", hide_input=True),
        md(r"""
## Paper vs this run
"""),
        code(r"""
run.claim("witcert-kernel-do", ours=f"max|do| = {run.values['max_do']:.1e} (interpreter, splits {splits})"
          + (f"; H200 (exact mode) {run.values['gpu_max_do']:.1e}" if gpu else "")
          + (f"; h10 kernel: interpreter {run.values['h10_max_do']:.1e}"
             + (f", H200 {run.values['gpu_h10_max_do']:.1e}" if "gpu_h10_max_do" in run.values else "")),
          verdict="reproduced" if run.values["max_do"] < 1e-5 else "differs",
          why="fp32 kernel vs float64 reference on the same stored codes; same order as the paper's 2.9e-6")
run.claim("witcert-kernel-dcert", ours=f"max|dcert| = {run.values['max_dcert']:.1e}"
          + (f"; H200 {run.values['gpu_max_dcert']:.1e}" if gpu else "")
          + (f"; h10 kernel: interpreter {run.values['h10_max_dcert']:.1e}"
             + (f", H200 {run.values['gpu_h10_max_dcert']:.1e}" if "gpu_h10_max_dcert" in run.values else "")
             + (f", h8 layout H200 {run.values['gpu_h8_max_dcert']:.1e}" if "gpu_h8_max_dcert" in run.values else "")
             + (f", Gluon h8 kernel H200 {run.values['gpu_h8g_max_dcert']:.1e}" if "gpu_h8g_max_dcert" in run.values
                else "")),
          verdict="reproduced" if run.values["max_dcert"] < 1e-5 else "differs",
          why="our radius includes the fp32/dither-mean slack in both kernel and reference")
run.claim("witcert-split-merge-exact", ours=f"certificate spread over {splits} splits: {spread:.1e}",
          verdict="reproduced" if spread < 1e-5 else "differs", why="stage 2 = fold of merge_states (tested)")
if gpu is None:
    for cid in ("witcert-graph-replay", "witcert-cert-marginal-cost", "witcert-latency-vs-fp16"):
        run.claim(cid, ours="pending: no GPU result file", verdict="not reproducible here",
                  why="needs `python -m kvlib.bench witcert_decode` on the H200")
else:
    ok_lay = all(c["bit_identical"] and c["finite_cert_every_step"] for c in cg_lay.values())
    run.claim("witcert-graph-replay", ours=f"{cg['interleaved_replays']} interleaved replays bit-identical: "
              f"{cg['bit_identical']}; finite certificate at all {cg['steps']} captured steps: {cg['finite_cert_every_step']}"
              + "".join(f"; {lay} kernel: {c['bit_identical']} / {c['finite_cert_every_step']}"
                        for lay, c in cg_lay.items()),
              verdict="reproduced" if cg["bit_identical"] and cg["finite_cert_every_step"] and ok_lay else "differs")
    graphed = [m for m in ("h10", "h8", "h8g") if f"{m}_graph_cert_cost_median" in run.values]  # no host overhead
    run.claim("witcert-cert-marginal-cost", ours=f"median {run.values['cert_cost_median']:+.1%} (A only, {best}, eager)"
              + "".join(f"; {m} layout under CUDA graphs: median {run.values[f'{m}_graph_cert_cost_median']:+.1%}, "
                        f"at most {run.values[f'{m}_graph_cert_cost_long_max']:+.1%} at S >= 16k, "
                        f"{run.values[f'{m}_graph_cert_cost_paper']:+.1%} at the paper's B=2, S=4k "
                        f"(a {1e3 * run.values[f'{m}_graph_paper_ms']:.0f} us step)"
                        for m in graphed),
              verdict="reproduced" if min([run.values[f"{m}_graph_cert_cost_median"] for m in graphed]
                                          or [run.values["cert_cost_median"]]) <= 0.03 else "differs",
              why="our goal: <= 3%" + ("; met with the h10 layout, not with the faster h8 layout (the same absolute "
                                       "certificate work in a shorter step)"
                                       if {"h10", "h8"} <= set(graphed)
                                       and run.values["h10_graph_cert_cost_median"] <= 0.03
                                       < run.values["h8_graph_cert_cost_median"] else "")
              + (f"; at GQA 4 (32 query / 8 KV heads) it is the other way round: h8 costs at most "
                 f"{run.values['p12_h8_gqa4_hi']:.1%} at S >= 16k, h10 up to {run.values['p12_h10_gqa4_hi']:.1%} "
                 "(dev/h10_probe12.json)"
                 if run.values.get("p12_h8_gqa4_hi", float("nan")) <= 0.03 else "")
              + (f"; the Gluon kernel (h8g): median {run.values['h8g_graph_cert_cost_median']:.1%}, at most "
                 f"{run.values['h8g_graph_cert_cost_long_max']:.1%} at S >= 16k" if "h8g" in graphed else "")
              + ("; at the small paper shape the certificate's per-program prologue dominates"
                 if graphed and run.values[f"{graphed[0]}_graph_cert_cost_paper"] > 0.03 else ""))
    gmodes = [m for m in ("h10", "h8", "h8g") if f"{m}_graph_speedup_min" in run.values]
    gbest = max(gmodes, key=lambda m: run.values[f"{m}_graph_speedup_min"]) if gmodes else None
    eager = (f"eager (host launch overhead included): INT8+cert / SDPA bf16 = {run.values['ratio_paper_shape']:.2f}x at "
             f"the paper shape, SDPA / INT8+cert >= {run.values['speedup_long']:.2f}x at S >= 16k ({best}){graph_note}")
    run.claim("witcert-latency-vs-fp16",
              ours=(f"under CUDA graphs the fastest certified kernel ({gbest}) is "
                    f"{run.values[f'{gbest}_graph_paper_shape']:.2f}x slower than SDPA bf16 at the paper shape and runs "
                    f"at {run.values[f'{gbest}_graph_speedup_min']:.2f}-{run.values[f'{gbest}_graph_speedup_max']:.2f}x "
                    "of SDPA's speed at S >= 16k"
                    + "".join(f"; {m}: {run.values[f'{m}_graph_speedup_min']:.2f}-"
                              f"{run.values[f'{m}_graph_speedup_max']:.2f}x at S >= 16k, "
                              f"{run.values[f'{m}_graph_paper_shape']:.2f}x slower at the paper shape"
                              for m in gmodes if m != gbest) + "; " + eager) if gbest else eager,
              verdict="differs", why="H200 vs RTX 4090 (synthetic codes at the paper's heads)"
              + (f"; on the performance grid's 32 / 8 heads the Gluon kernel is faster than SDPA at "
                 f"{run.values['grid_h8g_faster']} shapes with S >= 16k ({run.values['grid_h8g_min']:.2f}-"
                 f"{run.values['grid_h8g_max']:.2f}x)" if grid_long else "")
              + "; our goal, faster than SDPA bf16 at S >= 16k, is " + ("met" if gbest and run.values[f"{gbest}_graph_speedup_min"] >= 1 else
                                            "not met" + (f": the fastest certified kernel ({gbest}) reaches "
                                                         f"{run.values[f'{gbest}_graph_speedup_min']:.2f}-"
                                                         f"{run.values[f'{gbest}_graph_speedup_max']:.2f}x"
                                                         if gbest else "")))
run.claims_table()
run.save()
""", hide_input=True),
        md(r"""
**Verdict.** Kernel and reference agree to fp32 rounding at every split count
($\max|\Delta o|$ {glue:text}`max_do:.1e`, $\max|\Delta\mathrm{cert}|$ {glue:text}`max_dcert:.1e`), and the
certificate is split-invariant because $A$ and $B$ ride the output's LSE weights. The GPU rows
(graph replay, certificate cost, latency against SDPA bf16) are read from the benchmark file when it
exists; where they say *differs*, the kernel is correct but not yet at the bandwidth roofline. The h10
layout is what made the largest step: one Philox call now serves eight channels, the dither enters
the tensor-core dot exactly, and codes become fp16 without integer-to-float conversions, so certified
INT8 decode at B=32, S=16k moved from {glue:text}`w24_speedup_32_16k:.2f`x to
{glue:text}`h10_speedup_32_16k:.2f`x of SDPA bf16's speed; the certificate's marginal cost there is
{glue:text}`h10_cert_cost_32_16k:.1%`. Under CUDA graphs (no host launch overhead) certified h10 decode
runs at {glue:text}`h10_graph_speedup_min:.2f`-{glue:text}`h10_graph_speedup_max:.2f`x of SDPA's speed at
S ≥ 16k and the certificate costs {glue:text}`h10_graph_cert_cost_median:.1%` (median over the shapes; at most
{glue:text}`h10_graph_cert_cost_long_max:.1%` at S ≥ 16k, {glue:text}`h10_graph_cert_cost_paper:.0%` at the
paper's small step). (Eager timings of the smaller steps, about 0.2 ms of GPU work, carry the host's launch
overhead and show up to {glue:text}`cert_cost_max_h10:.0%`; the graph timings are the kernel's.) The table below
judges the certificate against its 3% goal from these graph timings; certified INT8 is still slower than SDPA, the
other goal. The h8 layout (sixteen 8-bit dithers per Philox call; the theorem page) halves the Philox work for about
one percent more radius: under CUDA graphs certified h8 decode runs at {glue:text}`h8_graph_speedup_min:.2f`-{glue:text}`h8_graph_speedup_max:.2f`x
of SDPA's speed at S ≥ 16k, the fastest certified step here, and its certificate costs
{glue:text}`h8_graph_cert_cost_median:.1%` (the same absolute work in a shorter step). Its compiled
sm_90 loop (`python -m kvlib.bench sass_count`, file `data/results/cpu/sass_count.json`) issues
{glue:text}`sass_h10_per_elem:.1f` instructions per stored K/V element (over h8
{glue:text}`sass_h8_per_elem:.1f`; the w24 kernel {glue:text}`sass_w24_per_elem:.1f`), {glue:text}`sass_h10_philox_share:.0%` of them Philox, with
{glue:text}`sass_h10_regs` registers per thread (two warps per scheduler): it is issue- and
latency-bound, not memory-bound. The ablations above locate the rest: the PV path, the QK path, Philox and a chain of per-tile
metadata loads each cost a comparable share, so no single change closes the gap to SDPA. h8 halves the dither
regeneration; even with Philox dropped entirely the step took {glue:text}`abl_nophilox_ms:.3f` ms against SDPA's
{glue:text}`abl_sdpa_ms:.3f` ms in the ablation, so what remains for the certified INT8 goal is the loop's structure
(shared-memory round trips, two warps per scheduler), a different kernel rather than another tweak. The Gluon
kernel above is that kernel. It has no shared-memory round trips and runs one warp per program. Certified, it runs
at {glue:text}`h8g_graph_speedup_min:.2f`-{glue:text}`h8g_graph_speedup_max:.2f`x of SDPA's speed at S ≥ 16k with
the certificate at {glue:text}`h8g_graph_cert_cost_median:.1%`: the goal of beating SDPA is
{glue:text}`h8g_goal_status`.
"""),
    ]
    return cells


# ------------------------------------------------------------------------------------------------
def soundness() -> list[NotebookNode]:
    cells = [
        md(r"""
# Soundness: how often does the true TV exceed the certificate?

**Question.** The theorem promises $\mathrm{TV}(p, \tilde p) \le 1 - B/A$ except with probability at
most $\delta$, the probability being over the key dither with keys and queries fixed. Over at least
$10^5$ (row, trial) pairs per key family (Gaussian, heavy-tailed Student $t_3$, and Gaussian with four
massive RoPE pairs) we redraw only the dither (a fresh Philox seed per trial, the real write path),
and count (i) rows with $\mathrm{TV}_\text{true} > $ certificate, (ii) rows where the union-bound event
fails (some $|\hat z_t - z_t| > u_t$), each with an exact Clopper–Pearson interval, against $\delta$.
We also look at tightness (certificate / true TV) and at what the second accumulator $B$ buys.
No outlier bypass here (the massive pairs stay in the scales); per-row $\delta$, $N = S$.
"""),
        params("""
profile = "cpu"
S = 256
d = 128
rows = 500
trials = 200
q_scale = 3.0
deltas = [0.5, 0.1, 0.01, 0.001]
seed = 0
"""),
        code(SETUP + """
from kvlib.publish import Run, fmt
run = Run("witcert_soundness", profile=profile, params=dict(S=S, d=d, rows=rows, trials=trials, q_scale=q_scale,
                                                             deltas=deltas, seed=seed))
import numpy as np
import pandas as pd
import seaborn as sns
import matplotlib.pyplot as plt
from scipy.stats import binomtest
from kvlib.certify.bound import certify_trials, synthetic_keys

g = torch.Generator().manual_seed(seed)
res, table = {}, []
for fam in ("gaussian", "heavy", "massive"):
    k = synthetic_keys(fam, S, d, generator=g)
    q = q_scale * torch.randn(rows, d, generator=g)
    r = certify_trials(k, q, trials=trials, deltas=tuple(deltas), seed0=seed * 1000 + 1)
    res[fam] = r
    n = r["tv"].numel()
    for i, dl in enumerate(deltas):
        viol = int((r["tv"] > r["cert"][i]).sum())
        ev = int(r["event"][i].sum())
        ci_v = binomtest(viol, n).proportion_ci(method="exact")
        ci_e = binomtest(ev, n).proportion_ci(method="exact")
        table.append({"keys": fam, "delta": dl, "pairs": n, "TV > cert": viol, "rate": viol / n,
                      "rate 95% hi": ci_v.high, "event fails": ev, "event rate": ev / n, "event 95% hi": ci_e.high})
tab = pd.DataFrame(table)
run.record("violations", table)
n_pairs = int(tab.groupby("keys")["pairs"].first().min())
run.glue("n_pairs", n_pairs)
run.glue("total_viol", int(tab["TV > cert"].sum()))
run.glue("max_event_over_delta", float((tab["event 95% hi"] / tab["delta"]).max()))
d01 = tab[tab.delta == 0.01]
run.glue("viol_hi_001", float(d01["rate 95% hi"].max()))
tab.set_index(["keys", "delta"]).style.format({"rate": "{:.1e}", "rate 95% hi": "{:.1e}", "event rate": "{:.1e}",
                                                "event 95% hi": "{:.1e}"})
""", hide_input=True),
        md(r"""
Across {glue:text}`n_pairs:,` (row, trial) pairs per family and every $\delta$, the true TV exceeded the
certificate {glue:text}`total_viol` times. At $\delta = 0.01$ the 95% upper confidence limit of the
violation rate is at most {glue:text}`viol_hi_001:.1e`, and the union-bound event fails far less often
than $\delta$ (its upper limit is at most {glue:text}`max_event_over_delta:.2f` $\times\,\delta$): the
sub-Gaussian tail and the union bound are both conservative, so the certificate is sound with room.
"""),
        code("""
i01 = deltas.index(0.01) if 0.01 in deltas else 0
parts = []
for fam, r in res.items():
    tight = (r["cert"][i01] / r["tv"]).flatten()
    gain = (r["cert_one"][i01] / r["cert"][i01]).flatten()
    parts.append(pd.DataFrame({"keys": fam, "tightness": tight.numpy(), "one/two": gain.numpy(),
                               "cert": r["cert"][i01].flatten().numpy()}))
    run.glue(f"tight_median_{fam}", float(tight.median()))
    run.glue(f"gain_median_{fam}", float(gain.median()))
    run.glue(f"cert_median_{fam}", float(r["cert"][i01].median()))
df = pd.concat(parts)
fig, axs = plt.subplots(1, 2, figsize=(8, 3))
sns.histplot(df, x="tightness", hue="keys", log_scale=True, element="step", stat="density", common_norm=False, ax=axs[0])
axs[0].set_xlabel("certificate / true TV  (delta = 0.01)")
sns.histplot(df, x="one/two", hue="keys", element="step", stat="density", common_norm=False, ax=axs[1])
axs[1].set_xlabel("(1 - 1/A^2) / (1 - B/A)")
fig.tight_layout()
run.glue_fig("fig_tightness", fig)
""", hide_input=True),
        md(r"""
```{glue:figure} fig_tightness
:name: fig-witcert-tightness
Left: tightness, the certificate over the true TV, per row and trial ($\delta = 0.01$). Right: how much
looser the one-accumulator bound $1 - 1/A^2$ is than the two-accumulator $1 - B/A$.
```

Median tightness: Gaussian {glue:text}`tight_median_gaussian:.1f`×, heavy-tailed
{glue:text}`tight_median_heavy:.1f`×, massive channels {glue:text}`tight_median_massive:.1f`×. The second
accumulator tightens the bound by a median factor of {glue:text}`gain_median_gaussian:.2f` (Gaussian keys);
for small radii $1 - 1/A^2 \approx 2\bar u$ and $1 - B/A \approx 2\bar u - $ (spread of $u$), so the gain is
modest when the radius is nearly constant across tokens.
"""),
        md(r"""
## The coarser dither layouts

The kernels read two faster layouts (the theorem page): h10 (a 1024-point dither grid, mean up to $2^{-11}s$)
and h8 (256 points, mean up to $2^{-9}s$), each carried in the radius. The same check on fresh Gaussian keys,
per layout, at $\delta = 0.01$:
"""),
        code("""
gl = torch.Generator().manual_seed(seed + 7)
k_l = synthetic_keys("gaussian", S, d, generator=gl)
q_l = q_scale * torch.randn(rows, d, generator=gl)
lay_rows = []
for lay in ("w24", "h10", "h8"):
    r = certify_trials(k_l, q_l, trials=trials, deltas=(0.01,), seed0=seed * 1000 + 77, layout=lay)
    n = r["tv"].numel()
    viol = int((r["tv"] > r["cert"][0]).sum())
    lay_rows.append({"layout": lay, "pairs": n, "TV > cert": viol,
                     "rate 95% hi": binomtest(viol, n).proportion_ci(method="exact").high,
                     "event fails": int(r["event"][0].sum()), "median cert": float(r["cert"][0].median()),
                     "median tightness": float((r["cert"][0] / r["tv"]).median())})
lt = pd.DataFrame(lay_rows).set_index("layout")
run.record("layouts", lay_rows)
run.glue("lay_viol_total", int(lt["TV > cert"].sum()))
run.glue("lay_h8_over_w24_cert", float(lt.loc["h8", "median cert"] / lt.loc["w24", "median cert"]))
run.glue("lay_h10_over_w24_cert", float(lt.loc["h10", "median cert"] / lt.loc["w24", "median cert"]))
run.glue("lay_viol_hi_h8", float(lt.loc["h8", "rate 95% hi"]))
lt.style.format({"rate 95% hi": "{:.1e}", "median cert": "{:.4f}", "median tightness": "{:.1f}"})
""", hide_input=True),
        md(r"""
Over the three layouts the true TV exceeded the certificate {glue:text}`lay_viol_total` times (h8's 95% upper
limit {glue:text}`lay_viol_hi_h8:.1e`). The coarser grids cost little: the median certificate is
{glue:text}`lay_h10_over_w24_cert:.3f`× w24's with h10 and {glue:text}`lay_h8_over_w24_cert:.3f`× with h8.
"""),
        md("## Paper vs this run"),
        code("""
tm = run.values["tight_median_gaussian"]
run.claim("witcert-soundness", ours=f"{run.values['total_viol']} violations over {n_pairs:,} pairs per family x 3 families "
          f"x {len(deltas)} deltas; 95% upper limit at delta=0.01: {run.values['viol_hi_001']:.1e}",
          verdict="reproduced" if run.values["viol_hi_001"] <= 0.01 else "differs",
          why="synthetic keys, dither redrawn with keys/queries fixed (the theorem's regime)")
run.claim("witcert-tightness", ours=f"median {tm:.1f}x (Gaussian), {run.values['tight_median_heavy']:.1f}x (heavy), "
          f"{run.values['tight_median_massive']:.1f}x (massive)",
          verdict="reproduced" if 5 <= tm <= 100 else "differs",
          why="same order as the paper's 22.2x; depends on S, d and the query scale")
run.claim("witcert-two-accumulator", ours=f"1 - 1/A^2 is {run.values['gain_median_gaussian']:.2f}x the two-accumulator "
          "bound (median, Gaussian); never smaller (AB >= 1)", verdict="reproduced")
run.claims_table()
run.save()
""", hide_input=True),
        md(r"""
**Verdict.** Sound, with a wide margin: no row's true TV exceeded its certificate on any key family,
and the failure probability of the underlying event is far below $\delta$. The price of soundness is
looseness (median tightness {glue:text}`tight_median_gaussian:.0f`× on Gaussian keys), from the
sub-Gaussian tail, the union bound over tokens, and the worst-case ratio bounds.
"""),
    ]
    return cells


# ------------------------------------------------------------------------------------------------
def sr_long() -> list[NotebookNode]:
    cells = [
        md(r"""
# Stochastic rounding is not a substitute; and the certificate at long context

**Question.** (1) Stochastic rounding (SR, $c = \lfloor x/s + U \rfloor$, no subtraction at read) is
unbiased too, but its residual has proxy $s^2/4$ per channel instead of $s^2/12$: a $\sqrt 3$ larger
radius, inside an exponential. What does that do to coverage at $\tau = 0.2$ across outlier budgets
$m$ (RoPE pairs bypassed in fp16)? (2) How do coverage and radius move from $S$ = 1k to 32k?

Keys: Gaussian with 16 RoPE pairs of graded magnitude (pair $i$ scaled by `massive`$\cdot 0.85^i$), so
each larger budget removes more of the scale; queries Gaussian times `q_scale`, chosen so that dither
at $m = 16$ sits just under $\tau$, the regime of the paper's synthetic table (its maximum 0.18). Coverage = fraction of
certificates $\le \tau$; request-level $\delta_\text{loc} = 10^{-2} / (28 \cdot 28 \cdot 256)$ unless said.
"""),
        params("""
profile = "cpu"
S = 1024
d = 128
rows = 256
trials = 2
budgets = [0, 2, 4, 8, 16]
massive = 12.0
# q_scale puts dither at m=16 just under tau, as in the paper synthetic setting, max 0.18
q_scale = 2.4
contexts = [1024, 2048, 4096, 8192, 16384, 32768]
ctx_rows = 64
seed = 0
"""),
        code(SETUP + """
from kvlib.publish import Run, fmt
run = Run("witcert_sr_long", profile=profile, params=dict(S=S, d=d, rows=rows, trials=trials, budgets=budgets,
          massive=massive, q_scale=q_scale, contexts=contexts, ctx_rows=ctx_rows, seed=seed))
import math
import pandas as pd
import matplotlib.pyplot as plt
from kvlib.certify.bound import certify_trials, request_delta, variance_proxy, coverage, score_radius
from kvlib.core.outliers import rope_pairs, select_outlier_pairs

tau = 0.2
d_loc = request_delta(1e-2, layers=28, heads=28, steps=256)
run.glue("delta_loc", d_loc)
g = torch.Generator().manual_seed(seed)

def graded_keys(n):
    k = torch.randn(n, d, generator=g)
    pairs = rope_pairs(d)[:16]
    for i, (a, b) in enumerate(pairs.tolist()):
        k[:, [a, b]] *= massive * 0.85 ** i
    return k

k = graded_keys(S)
q = q_scale * torch.randn(rows, d, generator=g)
# the proxy ratio, measured on the stored scales
s = torch.rand(S, d // 32, dtype=torch.float64)
ratio = float((variance_proxy(q, s, sm_scale=1.0, proxy="sr") / variance_proxy(q, s, sm_scale=1.0)).sqrt().mean())
run.glue("proxy_ratio", ratio)
cov = []
for m in budgets:
    oc = select_outlier_pairs(k, m) if m else None
    for scheme in ("dither", "sr"):
        r = certify_trials(k, q, trials=trials, deltas=(d_loc,), seed0=seed + 11, outlier_channels=oc, scheme=scheme)
        c = r["cert"][0]
        cov.append({"m": m, "scheme": scheme, "coverage": coverage(c, tau), "median cert": float(c.median()),
                    "max cert": float(c.max()), "TV > cert": int((r["tv"] > c).sum())})
cov = pd.DataFrame(cov)
run.record("sr_vs_dither", cov.to_dict("records"))
run.glue("sr_cov_max", float(cov[cov.scheme == "sr"].coverage.max()))
for m in budgets:
    run.glue(f"dither_cov_m{m}", float(cov[(cov.scheme == "dither") & (cov.m == m)].coverage.iloc[0]))
cov.pivot(index="m", columns="scheme", values=["coverage", "median cert", "TV > cert"])
""", hide_input=True),
        md(r"""
The SR radius is {glue:text}`proxy_ratio:.4f` times the dither radius ($\sqrt 3 = 1.7321$) for the same
stored scales. At $\tau = 0.2$ the best SR coverage over all budgets is {glue:text}`sr_cov_max:.3f`,
while dither reaches {glue:text}`dither_cov_m4:.3f` at $m = 4$ and {glue:text}`dither_cov_m16:.3f` at $m = 16$
(request-level $\delta_\text{loc}$ = {glue:text}`delta_loc:.1e`). SR is still sound (its own proxy is
used), just useless at this threshold: the constant in the proxy, not unbiasedness, is what matters.
"""),
        code("""
long = []
for n in contexts:
    kk = torch.randn(n, d, generator=g)
    qq = q_scale * torch.randn(ctx_rows, d, generator=g)
    for alloc, dl in (("per-row 1e-2", 1e-2), ("request-level", d_loc)):
        r = certify_trials(kk, qq, trials=1, deltas=(dl,), seed0=seed + n)
        c = r["cert"][0]
        from kvlib.formats.dither_int8 import dither_quantize
        qt = dither_quantize(kk, layer=0, kv_head=0, slots=torch.arange(n), seed=seed + n)
        u = score_radius(qq.double(), qt.scales, sm_scale=1 / math.sqrt(d), n=n, delta=dl)
        long.append({"S": n, "allocation": alloc, "coverage": coverage(c, tau), "median cert": float(c.median()),
                     "median radius": float(u.median()), "TV > cert": int((r["tv"] > c).sum())})
long = pd.DataFrame(long)
run.record("long_context", long.to_dict("records"))
rl = long[long.allocation == "request-level"].set_index("S")
run.glue("long_cov_first", float(rl.coverage.iloc[0]))
run.glue("long_cov_last", float(rl.coverage.iloc[-1]))
run.glue("radius_growth", float(rl["median radius"].iloc[-1] / rl["median radius"].iloc[0] - 1))
run.glue("cov_4096", float(rl.coverage.get(4096, float("nan"))))
fig, axs = plt.subplots(1, 3, figsize=(10, 2.8))
for m_, sub in cov.groupby("scheme"):
    axs[0].plot(sub.m, sub.coverage, "-o", label=m_)
axs[0].set_xlabel("outlier budget m (pairs)"); axs[0].set_ylabel(f"coverage at tau={tau}"); axs[0].legend()
for a, sub in long.groupby("allocation"):
    axs[1].plot(sub.S, sub.coverage, "-o", label=a)
    axs[2].plot(sub.S, sub["median radius"], "-o", label=a)
for ax in axs[1:]:
    ax.set_xscale("log", base=2); ax.set_xlabel("context S")
axs[1].set_ylabel("coverage"); axs[2].set_ylabel("median radius u"); axs[2].legend(fontsize=7)
fig.tight_layout()
run.glue_fig("fig_sr_long", fig)
long.pivot(index="S", columns="allocation", values=["coverage", "median cert", "median radius"])
""", hide_input=True),
        md(r"""
```{glue:figure} fig_sr_long
:name: fig-witcert-sr-long
Left: coverage at $\tau = 0.2$, dither vs stochastic rounding, by outlier budget. Middle and right:
coverage and median radius from $S$ = 1k to 32k (Gaussian keys, no bypass), per-row vs request-level $\delta$.
```

From $S$ = 1k to 32k, request-level coverage moves from {glue:text}`long_cov_first:.3f` to
{glue:text}`long_cov_last:.3f` and the median radius grows by {glue:text}`radius_growth:.1%`: the radius
depends on $S$ only through $\sqrt{2\ln(2S/\delta)}$.
"""),
        md("## Paper vs this run"),
        code("""
run.claim("witcert-sr-proxy", ours=f"measured radius ratio {ratio:.4f}", verdict="reproduced",
          why="exact: proxy 1/4 vs 1/12 per channel")
run.claim("witcert-sr-coverage", ours=f"SR coverage <= {run.values['sr_cov_max']:.3f} for m in {budgets}; dither "
          f"{run.values['dither_cov_m4']:.3f} (m=4), {run.values['dither_cov_m16']:.3f} (m=16)",
          verdict="reproduced" if run.values["sr_cov_max"] <= 0.05 else "differs",
          why="our synthetic graded-pair keys, per-token G=32 scales (paper: per-block scales)")
run.claim("witcert-long-context", ours=f"coverage {run.values['long_cov_first']:.3f} (S={contexts[0]}) -> "
          f"{run.values['long_cov_last']:.3f} (S={contexts[-1]}); median radius +{run.values['radius_growth']:.1%}",
          verdict="reproduced" if run.values["radius_growth"] < 0.2 else "differs",
          why="synthetic Gaussian keys, not Qwen activations: only the radius growth is comparable")
run.claim("witcert-coverage-paper-shape", ours=f"coverage {run.values['cov_4096']:.3f} at S=4096 (Gaussian keys, "
          f"q scale {q_scale})", verdict="reproduced" if run.values["cov_4096"] >= 0.99 else "differs",
          why="synthetic inputs; coverage depends on the query and key scales chosen")
run.claims_table()
run.save()
""", hide_input=True),
        md(r"""
**Verdict.** Stochastic rounding is sound but its $\sqrt 3$ larger radius, amplified by the
exponential, leaves essentially no certificate under $\tau = 0.2$ at any outlier budget, as the paper
found; subtractive dither with a large enough bypass covers (almost) every row. Over a 32× longer
context the radius grows only logarithmically and coverage barely moves.
"""),
    ]
    return cells


# ------------------------------------------------------------------------------------------------
def fallback() -> list[NotebookNode]:
    cells = [
        md(r"""
# Fallback: recompute what the certificate flags, whole head or block by block

**Question.** When a certificate exceeds $\tau$, does exact recomputation from the fp16 copy fix the
rows it selects (is the certificate *discriminative*), at what cost in bits per element, and how much
traffic does block-level paging save against paging the whole head?

Setting: keys Gaussian; the first `n_sink` tokens of each sequence (attention-sink-like) and a rare
`sink_frac` of the others carry a massive channel (magnitude `sink_mag`) that inflates their scales;
only in KV head 0 (a "sink head"); half of the query heads weigh that channel; values RTN;
$\tau = 0.2$; per-row $\delta$ = 0.01. Head level: `kvlib.certify.fallback.fallback_heads`; block level
(blocks of `block` tokens, ranked by $\sum_{t\in j}\tilde p_t(e^{u_t}-1)$): `kvlib.certify.fallback.block_fallback`.
"""),
        params("""
profile = "cpu"
B = 4
S = 512
hq = 8
hkv = 4
d = 128
S_block = 32768
block = 256
block_rows = 24
n_sink = 4
sink_frac = 0.0001
sink_mag = 60.0
seed = 0
"""),
        code(SETUP + """
from kvlib.publish import Run, fmt
run = Run("witcert_fallback", profile=profile, params=dict(B=B, S=S, hq=hq, hkv=hkv, d=d, S_block=S_block, block=block,
          block_rows=block_rows, n_sink=n_sink, sink_frac=sink_frac, sink_mag=sink_mag, seed=seed))
import math
import numpy as np
import pandas as pd
import matplotlib.pyplot as plt
from kvlib.certify.bound import score_radius, certificate_from_scores, tv_distance
from kvlib.certify.fallback import fallback_heads, block_fallback, fp16_radius
from kvlib.formats.dither_int8 import dither_quantize, dither_dequantize
from kvlib.kernels.int8.decode import decode_reference, make_pool_side

tau, delta = 0.2, 1e-2
g = torch.Generator().manual_seed(seed)

def sink_keys(n, heads, seq_len):
    # Gaussian keys; the first n_sink tokens of each sequence (and a sink_frac of the rest) carry a
    # massive channel, like the attention sinks / massive activations of real models
    k = torch.randn(n, heads, d, generator=g)
    sink = torch.rand(n, heads, generator=g) < sink_frac
    sink |= (torch.arange(n) % seq_len < n_sink)[:, None]
    sink[:, 1:] = False  # only KV head 0 has massive activations (a "sink head")
    k[..., 3] += sink * sink_mag * (1 + torch.rand(n, heads, generator=g))
    return k

K = sink_keys(B * S, hkv, S)
V = torch.randn(B * S, hkv, d, generator=g)
kp = make_pool_side(K, layer=0, seed=seed + 5, side=0)
vp = make_pool_side(V, layer=0, seed=seed + 5, side=1, dithered=False)
slots = torch.arange(B * S).view(B, S)
seq = torch.full((B,), S)
q = 1.5 * torch.randn(B, hq, d, generator=g)
q[:, ::2, 3] += 4.0  # half of the query heads weigh the sink channel
out = decode_reference(q, kp, vp, slots, seq, layer=0, seed=seed + 5, delta=delta)
new, rep = fallback_heads(out, q, K.half(), V.half(), slots, seq, tau=tau)
gqa = hq // hkv
exact_o = torch.zeros_like(out.o)
for b in range(B):
    for h in range(hq):
        kk, vv = K[slots[b], h // gqa].double(), V[slots[b], h // gqa].double()
        exact_o[b, h] = torch.softmax(q[b, h].double() @ kk.T / math.sqrt(d), -1) @ vv
err_before = (out.o - exact_o).norm(dim=-1) / exact_o.norm(dim=-1)
err_after = (new.o - exact_o).norm(dim=-1) / exact_o.norm(dim=-1)
sel = ~(out.tv_bound <= tau)
run.glue("frac_selected", float(sel.double().mean()))
run.glue("err_sel_before", float(err_before[sel].mean()) if sel.any() else float("nan"))
run.glue("err_rest", float(err_before[~sel].mean()) if (~sel).any() else float("nan"))
run.glue("err_sel_after", float(err_after[sel].mean()) if sel.any() else float("nan"))
run.glue("err_drop", run.values["err_sel_before"] / run.values["err_sel_after"] if sel.any() else float("nan"))
run.glue("eff_bits", rep.effective_bits)
pd.DataFrame({"selected rows": [int(sel.sum())], "of": [sel.numel()], "KV heads paged": [rep.kv_heads_paged],
              "rel. error selected (before)": [run.values["err_sel_before"]],
              "rel. error selected (after)": [run.values["err_sel_after"]],
              "rel. error not selected": [run.values["err_rest"]], "effective bits": [rep.effective_bits]})
""", hide_input=True),
        md(r"""
The certificate selects {glue:text}`frac_selected:.1%` of the rows. Their mean relative output error is
{glue:text}`err_sel_before:.2e` before fallback (rows not selected: {glue:text}`err_rest:.2e`) and
{glue:text}`err_sel_after:.2e` after, a {glue:text}`err_drop:.0f`× drop. Reading the INT8 cache plus the
paged fp16 heads costs {glue:text}`eff_bits:.2f` bits per element (8.5 without fallback: codes plus scales).
"""),
        code("""
sm = 1 / math.sqrt(d)
res = []
kk = sink_keys(S_block, 1, S_block)[:, 0]
qt = dither_quantize(kk, layer=0, kv_head=0, slots=torch.arange(S_block), seed=seed + 9)
k_hat = dither_dequantize(qt).double()
k16 = kk.half()
qs = 1.5 * torch.randn(4 * block_rows, d, generator=g, dtype=torch.float64)
qs[:, 3] += 4.0
for i in range(qs.shape[0]):
    qi = qs[i]
    z_hat = sm * k_hat @ qi
    u = score_radius(qi, qt.scales, sm_scale=sm, n=S_block, delta=delta)
    if not float(certificate_from_scores(z_hat, u).tv_bound) > tau:
        continue
    r = block_fallback(z_hat, sm * k16.double() @ qi, u, tau=tau, block_size=block,
                       u_paged=fp16_radius(qi, k16, sm_scale=sm), bytes_per_token=2 * d * 2)
    res.append({"blocks": r.blocks_paged, "of": len(r.order), "cert before": r.cert_before,
                "cert after": r.cert_after, "MB moved": r.bytes_moved / 2**20,
                "MB whole head": r.bytes_whole_head / 2**20, "traffic ratio": r.traffic_ratio})
    if len(res) >= block_rows:
        break
bf = pd.DataFrame(res)
run.record("block_fallback", res)
run.glue("n_block_cases", len(bf))
if len(bf):
    run.glue("median_blocks", float(bf.blocks.median()))
    run.glue("median_traffic_ratio", float(bf["traffic ratio"].median()))
    run.glue("mb_whole", float(bf["MB whole head"].iloc[0]))
    run.glue("mb_median", float(bf["MB moved"].median()))
    fig, ax = plt.subplots(figsize=(4.5, 2.8))
    ax.hist(bf.blocks, bins=range(0, int(bf.blocks.max()) + 2), align="left")
    ax.set_xlabel(f"blocks of {block} tokens paged to reach tau={tau}")
    ax.set_ylabel("rows")
    run.glue_fig("fig_blocks", fig)
bf.describe().T[["mean", "50%", "max"]] if len(bf) else bf
""", hide_input=True),
        md(r"""
```{glue:figure} fig_blocks
:name: fig-witcert-blocks
Blocks paged per over-threshold row (block-level fallback, $S$ = `S_block`).
```

Over {glue:text}`n_block_cases` over-threshold rows, the median row needs {glue:text}`median_blocks:.0f`
block(s): {glue:text}`mb_median:.3f` MB moved instead of {glue:text}`mb_whole:.1f` MB for the whole head
(median traffic ratio {glue:text}`median_traffic_ratio:.0f`×).
"""),
        md("## Paper vs this run"),
        code("""
run.claim("witcert-fallback-head", ours=f"{run.values['frac_selected']:.1%} selected; error drops "
          f"{run.values['err_drop']:.1f}x; {run.values['eff_bits']:.2f} effective bits",
          verdict="reproduced" if run.values["err_drop"] > 3 and run.values["err_sel_before"] > run.values["err_rest"]
          else "differs", why="synthetic sink tokens, not Qwen2.5-7B; the bits count the fp16 paging traffic")
if len(bf):
    run.claim("witcert-fallback-block", ours=f"median {run.values['median_blocks']:.0f} block(s); "
              f"{run.values['mb_whole']:.1f} MB -> {run.values['mb_median']:.3f} MB "
              f"({run.values['median_traffic_ratio']:.0f}x less)",
              verdict="reproduced" if run.values["median_blocks"] <= 2 else "differs",
              why="synthetic sink tokens; one head, K and V fp16")
else:
    run.claim("witcert-fallback-block", ours="no row over tau at this profile", verdict="not reproducible here")
run.claims_table()
run.save()
""", hide_input=True),
        md(r"""
**Verdict.** The certificate is discriminative, not only sound: the rows it flags are the ones with
large error, and exact recomputation removes most of it. When the excess comes from a few tokens, as
with attention sinks, block-level paging ranked by each block's share of $A - 1$ reaches $\tau$ after
very few blocks, moving a small fraction of the whole-head traffic.
"""),
    ]
    return cells


def main() -> None:
    for name, build in (("kernel", kernel), ("soundness", soundness), ("sr_long", sr_long), ("fallback", fallback)):
        write(build(), HERE / f"{name}.ipynb")
        print("wrote", HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
