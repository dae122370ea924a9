"""Writes the notebooks of the witcert_contract chapter.

Run: .venv/bin/python notebooks/witcert_contract/make_notebooks.py

Kept as code so the cells stay reviewable in diffs; the .ipynb files are what the book runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nbformat import NotebookNode

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))  # run as a script: kvlib lives at the repository root

from kvlib.publish.nbbuild import code, md, params, write  # noqa: E402


# ------------------------------------------------------------------------------------------------
def bound() -> list[NotebookNode]:
    cells = [
        md(
            r"""
# The error contract: $|\hat k - k| \le s/2$, uniform, input-independent, no clipping

**Question.** The certificate's theorem assumes every stored key coordinate carries an error
$s\,\varepsilon$ with $\varepsilon$ uniform on $[-1/2, 1/2)$ and independent of the key. Does
the write path (`kvlib.dither_quantize`, the torch reference that the Triton kernel matches bit
for bit) deliver that? Four checks: the elementwise bound with zero violations on Gaussian and
heavy-tailed inputs; how many violations appear when the codes are computed with an fp32 scale
while fp16 is stored (the paper's bug); uniformity and input independence against
round-to-nearest (RTN) on the same layout; and what the outlier bypass does to the scale with
and without excluding the bypassed channels from the group amax.

Setting: per-token scales over groups of `group` channels, $s = \mathrm{fp16}(\mathrm{amax}/126.5)$,
codes $c = \mathrm{rne}(x/s + \xi)$ in fp32 with the stored scale, read $\hat k = s(c-\xi)$,
Philox dither (storage contract in `kvlib.storage.paged`).
"""
        ),
        params(
            """
profile = "cpu"
n_tokens = 32768  # tokens per input distribution
d = 128
group = 32
seed = 0
"""
        ),
        code(
            """
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import display
from scipy import stats

from kvlib.publish import Run
from kvlib.formats.dither_int8 import BOUND_SLACK, dither_dequantize, dither_quantize, residual
from kvlib.core.outliers import inject_massive_pairs, select_outlier_pairs
from kvlib.core.philox import dither

run = Run("witcert_contract_bound", profile=profile, params=dict(n_tokens=n_tokens, d=d, group=group, seed=seed))
torch.manual_seed(seed)
g = torch.Generator().manual_seed(seed)
slots = torch.arange(n_tokens)
ctx = dict(layer=3, kv_head=1, slots=slots, seed=seed + 1, group=group)
inputs = {
    "gaussian": torch.randn(n_tokens, d, generator=g),
    "student-t, df=2": torch.distributions.StudentT(2.0).sample((n_tokens, d)),
    "massive tokens (log-normal token scale)": torch.randn(n_tokens, d, generator=g)
    * torch.exp(3 * torch.randn(n_tokens, 1, generator=g)),
}
""",
            hide_input=True,
        ),
        md("## The elementwise bound, and the fp32-scale bug"),
        code(
            """
rows = []
for name, x in inputs.items():
    qt = dither_quantize(x, **ctx)
    eps, s = residual(x, qt)  # exact (float64) error in units of s
    k_hat = dither_dequantize(qt)  # what a reader computes in fp32
    xi = dither(slots, d, layer=3, kv_head=1, seed=seed + 1)
    y = x / qt.scales.float().repeat_interleave(group, -1) + xi
    tie = (y - torch.floor(y)) == 0.5
    viol_exact = eps.abs() > 0.5
    bad = dither_quantize(x, **ctx, quantize_scale="fp32")
    eps_bad, _ = residual(x, bad)
    k_bad = dither_dequantize(bad)
    err_read = (k_hat.double() - x.double()).abs()
    rows.append({
        "input": name,
        "elements": x.numel(),
        "violations beyond slack (fp32 read)": int((err_read > s / 2 + BOUND_SLACK * s).sum()),
        "strict violations (fp32 read)": int((err_read > s / 2).sum()),
        "max |err|/(s/2)": float(eps.abs().max() * 2),
        "strict excess, exact arithmetic": int(viol_exact.sum()),
        "  of which off fp32 ties": int((viol_exact & ~tie).sum()),
        "max excess / s": float((eps.abs().max() - 0.5).clamp_min(0)),
        "clipped codes": int((y.abs() >= 127.5).sum()),
        "max |x/s + xi|": float(y.abs().max()),
        "fp32-scale bug: violations beyond slack": int(((k_bad.double() - x.double()).abs()
                                                        > s / 2 + BOUND_SLACK * s).sum()),
        "fp32-scale bug: max |err|/(s/2)": float(eps_bad.abs().max() * 2),
    })
bound = pd.DataFrame(rows)
run.record("bound", rows)
n_el = int(bound["elements"].sum())
run.glue("n_elements", n_el)
run.glue("viol_fp16", int(bound["violations beyond slack (fp32 read)"].sum()))
run.glue("viol_strict", int(bound["strict violations (fp32 read)"].sum()))
run.glue("max_ratio", float(bound["max |err|/(s/2)"].max()))
run.glue("n_tie_excess", int(bound["strict excess, exact arithmetic"].sum()))
run.glue("n_excess_off_ties", int(bound["  of which off fp32 ties"].sum()))
run.glue("max_excess", float(bound["max excess / s"].max()))
run.glue("n_clipped", int(bound["clipped codes"].sum()))
run.glue("max_y", float(bound["max |x/s + xi|"].max()))
run.glue("viol_fp32", int(bound["fp32-scale bug: violations beyond slack"].sum()))
run.glue("viol_fp32_gauss", int(bound["fp32-scale bug: violations beyond slack"][0]))
display(bound.set_index("input").T)
""",
            hide_input=True,
        ),
        md(
            """
Over {glue:text}`n_elements:,.0f` stored coordinates the bound evaluated as a reader sees it
(fp32 $\\hat k$ against $x$) has {glue:text}`viol_fp16:,.0f` violations beyond the fp32 rounding
slack $2^{-16}s$; the largest error is {glue:text}`max_ratio:.6f` $\\times\\, s/2$ (1.0000 at
the paper's precision). Strictly, without slack, {glue:text}`viol_strict:,.0f` read values exceed
$s/2$, and in exact arithmetic {glue:text}`n_tie_excess:,.0f` stored values do, of which
{glue:text}`n_excess_off_ties:,.0f` are not at an exact fp32 rounding tie of $x/s+\\xi$; the
largest excess is {glue:text}`max_excess:.2e`$\\,s$. That is the fp32 rounding of $x/s+\\xi$
(two roundings of at most $2^{-18}$ each for $|y|<128$), below one fp32 ulp of the group's
largest value, so below what an fp32 key can resolve; the certificate's radius can absorb it
as a relative $2^{-15}$ inflation of $s$. No code clipped ({glue:text}`n_clipped:,.0f`; the largest
$|x/s+\\xi|$ is {glue:text}`max_y:.3f` < 127.5). Computing the codes with the fp32 scale
$\\mathrm{amax}/126.5$ while storing its fp16 rounding gives {glue:text}`viol_fp32:,.0f`
violations over the same coordinates ({glue:text}`viol_fp32_gauss:,.0f` on the Gaussian input
alone): the error then grows with $|c|\\,|s_{16}-s_{32}|$ and exceeds $s/2$ on large codes.
The mean of the dither is exactly 0 (its $2^{24}$-point grid is symmetric about 0), and the
conditional bias of the error given $x$ is at most $2^{-25}s \\approx 3\\times10^{-8}s$, below
fp32 resolution of a code-scale value.
"""
        ),
        md("## Uniform and independent of the input, for dither and not for RTN"),
        code(
            """
x = inputs["gaussian"]
qd = dither_quantize(x, **ctx)
qr = dither_quantize(x, **ctx, dithered=False)  # RTN on the same layout and scales
eps_d, s = residual(x, qd)
eps_r, _ = residual(x, qr)
u = (x.double() / s).numpy().ravel()
frac = u - np.round(u)  # RTN's error is a function of this: eps = -frac
ks = lambda e: stats.kstest(e, stats.uniform(loc=-0.5, scale=1).cdf)  # noqa: E731
sub = np.random.default_rng(seed).choice(eps_d.numel(), size=min(eps_d.numel(), 200_000), replace=False)
ed, er = eps_d.numpy().ravel(), eps_r.numpy().ravel()
# the same key vector stored at many slots: dither errors vary, RTN errors repeat exactly
n_rep = min(n_tokens, 4096)
x_rep = x[:1].repeat(n_rep, 1)
rep = dict(ctx, slots=torch.arange(n_rep))
e_rep_d, _ = residual(x_rep, dither_quantize(x_rep, **rep))
e_rep_r, _ = residual(x_rep, dither_quantize(x_rep, **rep, dithered=False))
uni = pd.DataFrame({
    "KS p-value vs U(-1/2,1/2) (200k sample)": [ks(ed[sub]).pvalue, ks(er[sub]).pvalue],
    "corr(err, x)": [stats.pearsonr(ed[sub], u[sub])[0], stats.pearsonr(er[sub], u[sub])[0]],
    "corr(err, x/s - rne(x/s))": [stats.pearsonr(ed[sub], frac[sub])[0], stats.pearsonr(er[sub], frac[sub])[0]],
    "repeated key: std of err over slots (1/sqrt(12)=0.289)": [
        float(e_rep_d.std(0).mean()), float(e_rep_r.std(0).mean())],
    "repeated key: KS p-value, channel 0": [ks(e_rep_d[:, 0].numpy()).pvalue, ks(e_rep_r[:, 0].numpy()).pvalue],
}, index=["dither", "RTN"]).T
run.record("uniformity", uni.to_dict())
run.glue("ks_p_dither", float(uni.loc[uni.index[0], "dither"]))
run.glue("ks_p_rtn", float(uni.loc[uni.index[0], "RTN"]))
run.glue("corr_x_dither", float(uni.loc[uni.index[1], "dither"]))
run.glue("corr_frac_dither", float(uni.loc[uni.index[2], "dither"]))
run.glue("corr_frac_rtn", float(uni.loc[uni.index[2], "RTN"]))
run.glue("rep_std_dither", float(uni.loc[uni.index[3], "dither"]))
run.glue("rep_std_rtn", float(uni.loc[uni.index[3], "RTN"]))
display(uni)

fig, ax = plt.subplots(1, 3, figsize=(13, 3.4))
pts = sub[:20_000]
ax[0].scatter(frac[pts], er[pts], s=1, alpha=0.3, label="RTN", color="C3")
ax[0].scatter(frac[pts], ed[pts], s=1, alpha=0.3, label="dither", color="C0")
ax[0].set(xlabel="x/s - rne(x/s)", ylabel="error / s", title="error against the input")
ax[0].legend(markerscale=8, loc="upper right")
bins = np.linspace(-0.5, 0.5, 41)
ax[1].hist(ed[sub], bins=bins, density=True, histtype="step", lw=1.5, label="dither")
ax[1].hist(er[sub], bins=bins, density=True, histtype="step", lw=1.5, label="RTN", color="C3")
ax[1].axhline(1, color="k", lw=0.8)
ax[1].set(xlabel="error / s", ylabel="density", title="marginal (Gaussian keys)")
ax[1].legend()
ax[2].hist(e_rep_d[:, :8].numpy().ravel(), bins=bins, density=True, histtype="step", lw=1.5, label="dither")
ax[2].hist(e_rep_r[:, :8].numpy().ravel(), bins=bins, density=True, histtype="step", lw=1.5, label="RTN",
           color="C3")
ax[2].set(xlabel="error / s", ylabel="density (log)", title="one key at many slots (8 channels)", yscale="log")
ax[2].legend()
fig.tight_layout()
run.glue_fig("fig_uniform", fig)
display(fig)
""",
            hide_input=True,
        ),
        md(
            """
Dither's error is uniform (KS p = {glue:text}`ks_p_dither:.3f`) and uncorrelated with the
key ({glue:text}`corr_x_dither:.4f`) and with the rounding residual of the key
({glue:text}`corr_frac_dither:.4f`). RTN's error is a deterministic function of the key:
its correlation with that residual is {glue:text}`corr_frac_rtn:.4f` (the straight line in
the left panel). Its marginal can look uniform on smooth inputs (KS p = {glue:text}`ks_p_rtn:.3g`),
which is why marginal tests alone are not enough: a key stored at many slots keeps exactly the
same RTN error (standard deviation over slots {glue:text}`rep_std_rtn:.3f`), while the dithered
errors spread uniformly ({glue:text}`rep_std_dither:.3f`, against $1/\\sqrt{12} = 0.289$).
"""
        ),
        md("## Outlier bypass: the bypassed pairs must leave the group amax"),
        code(
            """
x0 = inputs["gaussian"]
x_inj, true_ch = inject_massive_pairs(x0, 4, 50.0, seed=seed)
calib = select_outlier_pairs(x_inj[: n_tokens // 2], 4)  # fixed set chosen on a calibration prefix
jacc = len(set(calib.tolist()) & set(true_ch.tolist())) / len(set(calib.tolist()) | set(true_ch.tolist()))
q = torch.randn(d, generator=g)
sigma = d**-0.5


def summary(name, x, **kw):
    qt = dither_quantize(x, **ctx, **kw)
    s = qt.scales.double().repeat_interleave(group, -1)
    keep = torch.ones(d, dtype=torch.bool)
    if qt.outlier_channels is not None:
        keep[qt.outlier_channels] = False
    # score-error proxy of the theorem page: varsigma_t^2 = sigma^2/12 sum_c q_c^2 s_c^2 (dithered channels)
    vs = (sigma**2 / 12 * (q.double()[keep] ** 2 * s[:, keep] ** 2).sum(-1)).sqrt()
    eps, _ = residual(x, qt)
    return {"configuration": name, "mean scale": float(qt.scales.float().mean()),
            "mean varsigma_t": float(vs.mean()),
            "clipped (non-outlier)": int((eps[:, keep].abs() > 0.5 + 2**-16).sum())}


amax = pd.DataFrame([
    summary("no injection, no bypass", x0),
    summary("4 massive pairs, no bypass", x_inj),
    summary("4 massive pairs, bypass, kept in amax", x_inj, outlier_channels=calib, include_outliers_in_amax=True),
    summary("4 massive pairs, bypass, excluded from amax", x_inj, outlier_channels=calib),
]).set_index("configuration")
base = amax.loc["4 massive pairs, no bypass", "mean varsigma_t"]
amax["varsigma vs no bypass"] = amax["mean varsigma_t"] / base
run.record("amax_exclusion", amax.reset_index().to_dict("records"))
run.glue("jaccard", jacc)
run.glue("kept_ratio", float(amax["varsigma vs no bypass"].iloc[2]))
run.glue("excl_ratio", float(amax["varsigma vs no bypass"].iloc[3]))
run.glue("n_clip_bypass", int(amax["clipped (non-outlier)"].sum()))
display(amax)
""",
            hide_input=True,
        ),
        md(
            """
With four RoPE pairs scaled by 50 (the set chosen from the first half of the tokens matches the
injected one with Jaccard {glue:text}`jaccard:.2f`), bypassing them in fp16 but keeping them in
the group amax leaves the score-error proxy at {glue:text}`kept_ratio:.3f` of the no-bypass
value: the scale does not drop. Excluding them from the amax brings it to
{glue:text}`excl_ratio:.3f`. No non-outlier coordinate clipped in any configuration
({glue:text}`n_clip_bypass:,.0f`).
"""
        ),
        code(
            """
viol, n_el = run.values["viol_fp16"], run.values["n_elements"]
run.claim("witcert-bound-half-scale", ours=f"{viol:,} violations beyond fp32 slack 2^-16 s over {n_el:,} coordinates; "
          f"max ratio {run.values['max_ratio']:.6f}; strict: {run.values['viol_strict']} (fp32 read), "
          f"{run.values['n_tie_excess']} (exact), excess <= {run.values['max_excess']:.1e} s",
          verdict="reproduced" if viol == 0 else "differs",
          why="strict excesses are fp32 rounding (ties of x/s + xi, read rounding), below fp32 resolution"
          if viol == 0 else "violations found")
run.claim("witcert-fp32-scale-violations", ours=f"{run.values['viol_fp32']:,} violations over {n_el:,} coordinates "
          f"(3 synthetic inputs, d={d}, G={group})", verdict="reproduced" if run.values["viol_fp32"] > 0 else "differs",
          why="the count depends on the number and distribution of coordinates, which the paper does not state")
run.claim("witcert-no-clipping", ours=f"{run.values['n_clipped'] + run.values['n_clip_bypass']} clipped; "
          f"max |x/s + xi| = {run.values['max_y']:.3f} < 127.5",
          verdict="reproduced" if run.values["n_clipped"] + run.values["n_clip_bypass"] == 0 else "differs",
          why="" if run.values["n_clipped"] + run.values["n_clip_bypass"] == 0 else "clipping found")
ok_u = (run.values["ks_p_dither"] > 1e-3 and abs(run.values["corr_frac_dither"]) < 0.01
        and abs(run.values["corr_frac_rtn"]) > 0.9)
run.claim("witcert-dither-uniform", ours=f"dither KS p={run.values['ks_p_dither']:.2f}, corr with rounding residual "
          f"{run.values['corr_frac_dither']:.4f}; RTN {run.values['corr_frac_rtn']:.3f}, repeated-key error std "
          f"{run.values['rep_std_rtn']:.3f} (dither {run.values['rep_std_dither']:.3f})",
          verdict="reproduced" if ok_u else "differs", why="" if ok_u else "see the uniformity table")
ok_a = run.values["kept_ratio"] > 0.9 and run.values["excl_ratio"] < 0.5 * run.values["kept_ratio"]
run.claim("witcert-amax-exclusion", ours=f"varsigma ratio to no bypass: kept in amax {run.values['kept_ratio']:.3f}, "
          f"excluded {run.values['excl_ratio']:.3f}", verdict="reproduced" if ok_a else "differs",
          why="" if ok_a else "see the table")
run.claims_table()
""",
            hide_input=True,
        ),
        md(
            """
**Verdict.** The stored error honours the theorem's premise: bounded by $s/2$ as a reader
computes it, exactly uniform and independent of the key under subtractive dither, and not under
RTN; quantizing with the stored fp16 scale is what makes the bound hold, and the outlier bypass
helps only when the bypassed pairs leave the amax.
"""
        ),
        code("run.save()", hide_input=True),
    ]
    return cells


# ------------------------------------------------------------------------------------------------
def philox() -> list[NotebookNode]:
    cells = [
        md(
            """
# Philox: known answers, unique streams, the same dither at read time, scheduling invariance

**Question.** The theorem needs a fresh, independent dither for every (layer, KV head, slot,
channel), and the reader must regenerate exactly the dither the writer used, whatever order
and grouping the tokens were written in. Do the Philox4x32-10 implementations (torch reference
`kvlib.philox4x32_10`, Triton device function `kvlib.kernels.tl.philox.philox4x32`) reproduce
Random123's known answers and Triton's own `tl.philox`; are the counters unique over a pool;
does the read-time dither reproduce the stored codes; are the stored bytes independent of batch
order and launch grouping; and do the Triton write kernel and the torch reference store the
same bytes?

On a machine without a GPU the Triton code runs under the CPU interpreter (`TRITON_INTERPRET=1`),
on small shapes; the GPU rows come from the benchmark's result file when present.
"""
        ),
        params(
            """
profile = "cpu"
n_layers = 28  # pool for the stream-uniqueness census (Qwen2.5-7B: 28 layers, 4 KV heads)
n_kv_heads = 4
n_slots = 512
d = 128
n_write = 48  # tokens per write experiment (Triton interpreter on CPU: keep small)
seed = 0
"""
        ),
        code(
            """
import os
import warnings

import torch

warnings.filterwarnings("ignore", category=RuntimeWarning)  # the CPU interpreter's numpy 0/0 on all-zero groups
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
""",
            hide_input=True,
        ),
        code(
            """
import hashlib
import json

import pandas as pd
import triton
import triton.language as tl
from IPython.display import display

from kvlib.publish import Run
from kvlib.formats.dither_int8 import quantize_codes
from kvlib.kernels.tl.philox import philox4x32
from kvlib.kernels.int8.write import write_int8
from kvlib.storage.paged import PagedPool
from kvlib.core.philox import dither, dither_counter, philox4x32_10, seed_key
from kvlib.publish.provenance import repo_root, results_dir

run = Run("witcert_contract_philox", profile=profile,
          params=dict(n_layers=n_layers, n_kv_heads=n_kv_heads, n_slots=n_slots, d=d, n_write=n_write, seed=seed))
dev = "cuda" if torch.cuda.is_available() else "cpu"
triton_mode = "GPU" if dev == "cuda" else "CPU interpreter"
run.glue("triton_mode", triton_mode);
""",
            hide_input=True,
        ),
        md("## Known answers (Random123 `kat_vectors`)"),
        code(
            """
@triton.jit
def _philox_kernel(c_ptr, k_ptr, o_ptr, N_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    w0, w1, w2, w3 = philox4x32(tl.load(c_ptr + 4 * i), tl.load(c_ptr + 4 * i + 1), tl.load(c_ptr + 4 * i + 2),
                                tl.load(c_ptr + 4 * i + 3), tl.load(k_ptr + 2 * i), tl.load(k_ptr + 2 * i + 1),
                                N_ROUNDS)
    tl.store(o_ptr + 4 * i, w0.to(tl.int64))
    tl.store(o_ptr + 4 * i + 1, w1.to(tl.int64))
    tl.store(o_ptr + 4 * i + 2, w2.to(tl.int64))
    tl.store(o_ptr + 4 * i + 3, w3.to(tl.int64))


@triton.jit
def _tl_philox_kernel(c_ptr, o_ptr, seed, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    w0, w1, w2, w3 = tl.philox(seed, tl.load(c_ptr + 4 * i).to(tl.uint32), tl.load(c_ptr + 4 * i + 1).to(tl.uint32),
                               tl.load(c_ptr + 4 * i + 2).to(tl.uint32), tl.load(c_ptr + 4 * i + 3).to(tl.uint32))
    tl.store(o_ptr + 4 * i, w0.to(tl.int64))
    tl.store(o_ptr + 4 * i + 1, w1.to(tl.int64))
    tl.store(o_ptr + 4 * i + 2, w2.to(tl.int64))
    tl.store(o_ptr + 4 * i + 3, w3.to(tl.int64))


kat = json.loads((repo_root() / "data" / "kat" / "philox.json").read_text())["vectors"]
h = lambda v: torch.tensor([int(s, 16) for s in v], dtype=torch.int64)  # noqa: E731
rows = []
for v in kat:
    ctr, key, want = h(v["counter"]), h(v["key"]), h(v["output"])
    ours = philox4x32_10(ctr, key, rounds=v["rounds"])
    out = torch.empty(1, 4, dtype=torch.int64, device=dev)
    _philox_kernel[(1,)](ctr[None].to(dev), key[None].to(dev), out, N_ROUNDS=v["rounds"], BLOCK=1)
    row = {"rounds": v["rounds"], "counter": " ".join(v["counter"]), "key": " ".join(v["key"]),
           "expected": " ".join(v["output"]), "torch": bool(torch.equal(ours, want)),
           f"Triton ({triton_mode})": bool(torch.equal(out[0].cpu(), want))}
    if v["rounds"] == 10:  # tl.philox is 10 rounds with key (seed & 0xffffffff, seed >> 32)
        o2 = torch.empty(1, 4, dtype=torch.int64, device=dev)
        _tl_philox_kernel[(1,)](ctr[None].to(dev), o2, int(key[0]) | (int(key[1]) << 32), BLOCK=1)
        row["tl.philox"] = bool(torch.equal(o2[0].cpu(), want))
    rows.append(row)
katdf = pd.DataFrame(rows)
run.record("kat", rows)
n_kat_ok = int(katdf[["torch", f"Triton ({triton_mode})"]].all(axis=1).sum())
run.glue("n_kat", len(katdf))
run.glue("n_kat_ok", n_kat_ok)
display(katdf)
""",
            hide_input=True,
        ),
        md(
            """
{glue:text}`n_kat_ok`/{glue:text}`n_kat` vectors pass in both implementations. Triton's
`tl.philox(seed, c0, c1, c2, c3)` with 32-bit counters is exactly Random123 philox4x32-10 with
key `(seed & 0xffffffff, seed >> 32)` (same round function and key schedule), so the cross-check
needs no adaptation; the 7-round vectors are checked on ours only (`tl.philox` is called with
its default 10 rounds here).
"""
        ),
        md("## Stream uniqueness over a pool"),
        code(
            """
for key, val in dict(n_layers=n_layers, n_kv_heads=n_kv_heads, n_slots=n_slots).items():
    run.glue(key, val)
ctrs = []
for layer in range(n_layers):
    for kv in range(n_kv_heads):
        for side in (0, 1):
            ctrs.append(dither_counter(torch.arange(n_slots), d, layer=layer, kv_head=kv, side=side).reshape(-1, 4))
ctr = torch.cat(ctrs)
n_calls = ctr.shape[0]
# pack the four counter words (each < 2^32 here far below) into one int64 key per call
packed = ((ctr[:, 0] * (d // 4) + ctr[:, 1]) * n_kv_heads + ctr[:, 2]) * (2 * n_layers) + ctr[:, 3]
n_unique = torch.unique(packed).numel()
run.glue("n_streams", n_calls * 4)
run.glue("n_calls", n_calls)
run.glue("n_calls_unique", n_unique)
# a sample of words: collisions of 32-bit words should follow the birthday law, no more
sub = ctr[torch.randperm(n_calls, generator=torch.Generator().manual_seed(seed))[: min(n_calls, 2**18)]]
words = philox4x32_10(sub, torch.tensor(seed_key(seed))).flatten()
n_w = words.numel()
run.glue("n_words", n_w)
run.glue("word_dups", n_w - torch.unique(words).numel())
run.glue("word_dups_expected", n_w * (n_w - 1) / 2 / 2**32);
""",
            hide_input=True,
        ),
        md(
            """
A pool of {glue:text}`n_layers` layers × {glue:text}`n_kv_heads` KV heads × {glue:text}`n_slots`
slots × d channels × 2 sides holds {glue:text}`n_streams:,.0f` dither streams from
{glue:text}`n_calls:,.0f` Philox calls; {glue:text}`n_calls_unique:,.0f` of the counters are
distinct, so no (layer, kv_head, slot, channel, side) shares a word. Among
{glue:text}`n_words:,.0f` sampled 32-bit words, {glue:text}`word_dups:,.0f` repeat, against
{glue:text}`word_dups_expected:.1f` expected for independent uniform words.
"""
        ),
        md("## Read-time dither, scheduling invariance, Triton against torch"),
        code(
            """
g = torch.Generator().manual_seed(seed)
H, L = 2, 3
x = (torch.randn(n_write, H, d, generator=g) * torch.exp(torch.randn(n_write, H, 1, generator=g))).to(dev)
slots = torch.randperm(4 * n_write, generator=g)[:n_write].to(dev)
mk = lambda: PagedPool(n_layers=L, n_slots=4 * n_write, n_kv_heads=H, d=d, seed=seed + 7, device=dev)  # noqa: E731


def digest(p, layer):
    v = p.layer(layer)
    blob = torch.cat([v.codes[slots].flatten().view(torch.uint8), v.scales[slots].flatten().view(torch.uint8)])
    return hashlib.sha256(blob.cpu().numpy().tobytes()).hexdigest()[:16]


ref = mk()
write_int8(ref, 1, x, slots, backend="torch")
tri = mk()
write_int8(tri, 1, x, slots, backend="triton")
pools = {"torch reference, one call": ref, f"Triton ({triton_mode}), one launch": tri}
p = mk()
perm = torch.randperm(n_write, generator=g).to(dev)
write_int8(p, 1, x[perm], slots[perm], backend="triton")
pools["Triton, shuffled token order"] = p
p = mk()
for chunk in torch.randperm(n_write, generator=g).to(dev).split([1, 5, n_write // 3, n_write - 6 - n_write // 3]):
    write_int8(p, 1, x[chunk], slots[chunk], backend="triton", block_s=4)
pools["Triton, 4 launches of 1..n tokens, shuffled"] = p
p = mk()
other = torch.tensor(sorted(set(range(4 * n_write)) - set(slots.tolist()))[:n_write], device=dev)
write_int8(p, 1, torch.randn(len(other), H, d, device=dev), other, backend="triton")  # another request first
write_int8(p, 0, x, slots, backend="triton")  # and another layer
write_int8(p, 1, x, slots, backend="triton")
pools["Triton, interleaved with another request and layer"] = p
sched = pd.DataFrame({"bytes digest (sha256 of codes+scales)": {k: digest(v, 1) for k, v in pools.items()}})
sched["equal to the reference"] = sched.iloc[:, 0] == sched.iloc[0, 0]
n_sched_ok = int(sched["equal to the reference"].sum())
run.glue("n_sched", len(sched))
run.glue("n_sched_ok", n_sched_ok)
codes_mismatch = int((ref.codes != tri.codes).sum())
run.glue("codes_mismatch", codes_mismatch)
run.glue("n_codes", n_write * H * d)
display(sched)

# the reader regenerates xi from (layer, kv_head, slot, channel, side): codes must be reproducible from it
v = ref.layer(1)
viol_same = viol_wrong = recode_equal = 0
for kv in range(H):
    s16 = v.scales[slots, kv].cpu()
    xs = x[:, kv].float().cpu()
    xi_read = dither(slots.cpu(), d, layer=1, kv_head=kv, seed=ref.seed, side=0)
    recode_equal += int((quantize_codes(xs, s16, xi_read, 32) == v.codes[slots, kv].cpu()).sum())
    s = s16.double().repeat_interleave(32, -1)
    c = v.codes[slots, kv].cpu().double()
    viol_same += int(((s * (c - xi_read.double()) - xs.double()).abs() > s / 2 + 2**-16 * s).sum())
    # a reader with another stream (e.g. tl.rand, or the sequence position instead of the slot)
    xi_pos = dither(torch.arange(n_write), d, layer=1, kv_head=kv, seed=ref.seed, side=0)
    viol_wrong += int(((s * (c - xi_pos.double()) - xs.double()).abs() > s / 2 + 2**-16 * s).sum())
run.glue("recode_equal", recode_equal)
run.glue("viol_same", viol_same)
run.glue("viol_wrong", viol_wrong)

# exact .5 ties of x/s + xi, and the bound for both rounding directions there
s_all = v.scales[slots].float().cpu().repeat_interleave(32, -1)
xi_all = torch.stack([dither(slots.cpu(), d, layer=1, kv_head=kv, seed=ref.seed) for kv in range(H)], 1)
y = x.float().cpu() / s_all + xi_all
tie = (y - torch.floor(y)) == 0.5
lo, hi = torch.floor(y)[tie], torch.floor(y)[tie] + 1
xt, st, xit = x.float().cpu()[tie], s_all[tie], xi_all[tie]
both = bool(((st * (lo - xit) - xt).abs() <= st / 2).all() and ((st * (hi - xit) - xt).abs() <= st / 2).all())
run.glue("n_ties", int(tie.sum()))
run.glue("ties_both_ok", both)

gpu_file = results_dir("gpu") / "witcert_write.json"
gpu_ok = None
if gpu_file.exists():
    gres = json.loads(gpu_file.read_text())["results"]
    gpu_ok = bool(gres.get("all_bit_identical"))
    run.glue("gpu_tokens", max(r["n_tokens"] for r in gres["rows"]))
run.glue("gpu_bit_identical", "n/a (no GPU result file yet)" if gpu_ok is None else str(gpu_ok));
""",
            hide_input=True,
        ),
        md(
            """
The reference pool's codes are reproduced exactly from the read-time dither
({glue:text}`recode_equal:,.0f` of {glue:text}`n_codes:,.0f`), and the error computed with it has
{glue:text}`viol_same:,.0f` violations of $s/2$; a reader using another stream (here the
sequence position instead of the slot, the analogue of the paper's `tl.rand` read side) sees
{glue:text}`viol_wrong:,.0f` violations, so the contract check catches it.
{glue:text}`n_sched_ok`/{glue:text}`n_sched` ways of scheduling the same tokens store identical
bytes. The Triton write kernel ({glue:text}`triton_mode`) and the torch reference differ on
{glue:text}`codes_mismatch:,.0f` of {glue:text}`n_codes:,.0f` codes: both compute $x/s$ with
IEEE division (`tl.math.div_rn`) and round half to even, so even exact .5 ties
({glue:text}`n_ties:,.0f` here; at each, both rounding directions satisfy the bound:
{glue:text}`ties_both_ok`) round the same way. GPU benchmark (all shapes bit-identical):
{glue:text}`gpu_bit_identical`.
"""
        ),
        code(
            """
ok_stream = run.values["n_calls_unique"] == run.values["n_calls"] and run.values["viol_same"] == 0
run.claim("witcert-philox-stream",
          ours=f"{run.values['n_calls_unique']:,}/{run.values['n_calls']:,} counters distinct; "
          f"read-time dither reproduces all codes, {run.values['viol_same']} violations (wrong stream: "
          f"{run.values['viol_wrong']:,})", verdict="reproduced" if ok_stream else "differs",
          why="" if ok_stream else "see above")
ok_sched = run.values["n_sched_ok"] == run.values["n_sched"]
run.claim("witcert-schedule-invariance", ours=f"{run.values['n_sched_ok']}/{run.values['n_sched']} schedules store "
          "identical bytes", verdict="reproduced" if ok_sched else "differs",
          why="CUDA-graph replay is not exercised here" if ok_sched else "bytes differ across schedules")
gpu_txt = "" if gpu_ok is None else (
    f"; GPU benchmark shapes up to {run.values['gpu_tokens']:,} tokens bit-identical: {gpu_ok}")
ok_codes = codes_mismatch == 0 and gpu_ok is not False
run.claim("witcert-triton-torch-codes", ours=f"{codes_mismatch} of {run.values['n_codes']:,} codes differ "
          f"({triton_mode}){gpu_txt}", verdict="reproduced" if ok_codes else "differs",
          why="ours is stronger: IEEE division and RNE on both sides remove the tie disagreements" if ok_codes
          else "codes differ")
run.claims_table()
""",
            hide_input=True,
        ),
        md(
            """
**Verdict.** The Philox implementations are Random123-exact and agree with `tl.philox`; every
(layer, kv_head, slot, channel, side) has its own counter; the reader's dither reproduces the
writer's codes; the stored bytes do not depend on how tokens were batched; and the Triton write
kernel stores exactly the reference's bytes.
"""
        ),
        code("run.save()", hide_input=True),
    ]
    return cells


# ------------------------------------------------------------------------------------------------
def bytes_speed() -> list[NotebookNode]:
    cells = [
        md(
            """
# Byte account and write throughput

**Question.** What does each KV format cost per token, per head, per side, counted from the
layout and measured from the allocated tensors, at d = 64 and d = 128? Does the paper's 136 B
come out of the same code at d = 128? And how fast is the Triton write kernel against the torch
reference, and against the GPU's copy bandwidth (the paper: 82× per call)?
"""
        ),
        params(
            """
profile = "cpu"
n_tokens = 512  # tokens written to measure allocations (two full 256-token blocks)
"""
        ),
        code(
            """
import json

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display

from kvlib.publish import Run
from kvlib.formats import get_format
from kvlib.storage.paged import PagedPool
from kvlib.publish.provenance import results_dir

run = Run("witcert_contract_bytes", profile=profile, params=dict(n_tokens=n_tokens))
""",
            hide_input=True,
        ),
        md("## Bytes per token per head per side"),
        code(
            """
rows = []
for d in (64, 128):
    x = torch.randn(n_tokens, d)
    slots = torch.arange(n_tokens)
    pairs = torch.tensor([0, d // 2, 1, d // 2 + 1, 2, d // 2 + 2, 3, d // 2 + 3])  # m = 4 rotate-half pairs
    configs = [
        ("fp16 (baseline)", None, {}),
        ("dither-int8, G=32", "dither-int8", {}),
        ("dither-int8, G=32, m=4 pairs", "dither-int8", {"outlier_channels": pairs}),
        ("rtn-int8, G=32", "rtn-int8", {}),
        ("sr-int8, G=32", "sr-int8", {}),
        ("fp8-e4m3, G=32", "fp8-e4m3", {}),
        ("block-int8, BLK=256", "block-int8", {}),
    ]
    for label, name, opts in configs:
        if name is None:
            layout, measured = 2.0 * d, x.half().numel() * 2 / n_tokens
        else:
            f = get_format(name, **opts)
            layout, measured = f.bytes_per_position(d), f.nbytes(f.write(x, slots=slots)) / n_tokens
        rows.append({"d": d, "format": label, "layout B": layout, "measured B": measured,
                     "saved vs fp16": 1 - layout / (2 * d)})
    for m in (0, 4):
        pool = PagedPool(n_layers=2, n_slots=n_tokens, n_kv_heads=4, d=d, n_out=2 * m)
        rows.append({"d": d, "format": f"paged pool, G=32, m={m}", "layout B": pool.bytes_per_token_head(),
                     "measured B": pool.measured_bytes_per_token_head(),
                     "saved vs fp16": 1 - pool.bytes_per_token_head() / (2 * d)})
bytes_df = pd.DataFrame(rows)
run.record("bytes", rows)
exact = bool((bytes_df["layout B"] == bytes_df["measured B"]).all())
pick = lambda d, f: float(bytes_df[(bytes_df.d == d) & (bytes_df.format == f)]["measured B"].iloc[0])  # noqa: E731
run.glue("b136", pick(128, "paged pool, G=32, m=0"))
run.glue("b136_kv", 2 * pick(128, "paged pool, G=32, m=0"))
run.glue("saved136", 1 - pick(128, "paged pool, G=32, m=0") / 256)
run.glue("b_m4", pick(128, "paged pool, G=32, m=4"))
run.glue("b_blk", pick(128, "block-int8, BLK=256"))
run.glue("b64", pick(64, "paged pool, G=32, m=0"))
run.glue("bytes_exact", exact)
display(bytes_df.pivot(index="format", columns="d", values=["layout B", "measured B"]).round(3))
""",
            hide_input=True,
        ),
        md(
            """
Layout and allocation agree exactly for every format ({glue:text}`bytes_exact`). At d = 128 the
paged WitCert pool costs {glue:text}`b136:.0f` B per token per head per side (int8 codes 128 B +
four fp16 group scales 8 B; K + V {glue:text}`b136_kv:.0f` B, {glue:text}`saved136:.1%` saved
against fp16), {glue:text}`b_m4:.0f` B with m = 4 fp16 RoPE pairs (their channel set is a
per-(layer, head) constant, not a per-token cost), and {glue:text}`b64:.0f` B at d = 64. The
paper body's block format costs {glue:text}`b_blk:.1f` B (one fp16 scale per channel per 256
tokens); the paper's 145.1 B for K adds 16 B of fp16 outlier pairs and 0.1 B of per-block indices.
Block-int8 with a trailing partial block measures slightly more per token, which is why the
allocation is measured on whole blocks here.
"""
        ),
        md("## Write throughput on the GPU"),
        code(
            """
gpu_file = results_dir("gpu") / "witcert_write.json"
have_gpu = gpu_file.exists()
run.glue("have_gpu", have_gpu)
if have_gpu:
    res = json.loads(gpu_file.read_text())
    g = res["results"]
    tp = pd.DataFrame(g["rows"])[["kind", "n_tokens", "n_out", "torch_ms", "triton_ms", "speedup_vs_torch",
                                  "achieved_GBps", "fraction_of_copy", "block_s", "bit_identical"]]
    run.record("throughput", tp.to_dict("records"))
    run.glue("gpu_device", g["device"])
    run.glue("copy_GBps", g["copy"]["bandwidth_GBps"])
    run.glue("speedup_min", float(tp.speedup_vs_torch.min()))
    run.glue("speedup_median", float(tp.speedup_vs_torch.median()))
    run.glue("frac_max", float(g["max_fraction_of_copy"]))
    run.glue("gpu_commit", res["provenance"]["commit"][:12])
    display(tp.round(4))
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.4))
    for n_out, grp in tp.groupby("n_out"):
        ax[0].loglog(grp.n_tokens, grp.speedup_vs_torch, "o-", label=f"{n_out} outlier channels")
        ax[1].semilogx(grp.n_tokens, grp.fraction_of_copy, "o-", label=f"{n_out} outlier channels")
    ax[0].axhline(82, color="k", ls=":", label="paper: 82x")
    ax[0].set(xlabel="new tokens per call (4 KV heads, d=128)", ylabel="torch ms / Triton ms", title="per-call speedup")
    ax[1].axhline(0.7, color="k", ls=":", label="goal 70%")
    ax[1].set(xlabel="new tokens per call", ylabel="fraction of copy bandwidth", title="achieved bandwidth",
              ylim=(0, 1))
    for a in ax:
        a.legend(fontsize=8)
    fig.tight_layout()
    run.glue_fig("fig_throughput", fig)
    display(fig)
else:
    display(Markdown("**GPU run pending:** `data/results/gpu/witcert_write.json` does not exist yet "
                     "(`python -m kvlib.bench witcert_write --profile gpu` on the H200 writes it)."))
""",
            hide_input=True,
        ),
        code(
            """
if have_gpu:
    display(Markdown(
        f"On the {run.values['gpu_device']} (commit `{run.values['gpu_commit']}`), the Triton kernel is "
        f"{run.values['speedup_min']:,.0f}x to {tp.speedup_vs_torch.max():,.0f}x faster per call than the torch "
        f"reference (median {run.values['speedup_median']:,.0f}x); the reference pays for ten rounds of int64 "
        f"Philox tensor ops and its host-side validation on every call, so small calls are dominated by launches "
        f"and synchronisation, as in the paper's observation. At the largest prefill shapes the kernel reaches "
        f"{run.values['frac_max']:.0%} of the measured copy bandwidth ({run.values['copy_GBps']:,.0f} GB/s); "
        f"decode-sized calls are launch-bound and their bandwidth fraction is not meaningful."))
""",
            hide_input=True,
        ),
        code(
            """
ok_b = run.values["b136"] == 136 and exact
run.claim("witcert-bytes-136", ours=f"{run.values['b136']:.0f} B from layout and from allocated tensors "
          f"(K+V {run.values['b136_kv']:.0f} B, {run.values['saved136']:.1%} saved)",
          verdict="reproduced" if ok_b else "differs", why="" if ok_b else "byte account differs")
run.claim("witcert-bytes-block", ours=f"block-int8 {run.values['b_blk']:.1f} B; + m=4 fp16 pairs = "
          f"{run.values['b_blk'] + 16:.1f} B (per-block index bytes not modelled)", verdict="reproduced"
          if abs(run.values["b_blk"] - 129) < 1e-9 else "differs",
          why="the 0.1 B of per-block indices is not stored here")
if have_gpu:
    run.claim("witcert-write-speedup", ours=f"{run.values['speedup_min']:,.0f}x to {tp.speedup_vs_torch.max():,.0f}x "
              f"per call ({run.values['gpu_device']}); {run.values['frac_max']:.0%} of copy bandwidth "
              "at the largest shape",
              verdict="reproduced" if run.values["speedup_min"] >= 82 else "differs",
              why="larger than the paper's 82x: our torch reference synchronises on its validation every call"
              if run.values["speedup_min"] >= 82 else "slower than the paper")
else:
    run.claim("witcert-write-speedup", ours="GPU run pending", verdict="not reproducible here",
              why="needs the H200 result file data/results/gpu/witcert_write.json")
run.claims_table()
""",
            hide_input=True,
        ),
        md(
            """
**Verdict.** The byte account is exact and reproduces the paper's 136 B at d = 128, G = 32; the
write path is a single kernel launch per layer and side, orders of magnitude faster than the
int64 torch reference per call (see the table for where it stands against copy bandwidth).
"""
        ),
        code("run.save()", hide_input=True),
    ]
    return cells


if __name__ == "__main__":
    for name, fn in (("bound", bound), ("philox", philox), ("bytes_speed", bytes_speed)):
        write(fn(), HERE / f"{name}.ipynb")
        print("wrote", HERE / f"{name}.ipynb")
