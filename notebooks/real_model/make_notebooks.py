"""Writes the notebooks of the real_model chapter (SmolLM2-135M, real activations, real generation).

Run: .venv/bin/python notebooks/real_model/make_notebooks.py
"""

# ruff: noqa: E501  (notebook cell sources are long strings)
from __future__ import annotations

import sys
from pathlib import Path

from nbformat import NotebookNode

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))  # run as a script: kvlib lives at the repository root

from kvlib.book.nbbuild import code, md, params, write  # noqa: E402


def hidden(src: str) -> NotebookNode:
    """A code cell whose input the book hides."""
    return code(src, hide_input=True)


SETUP = """
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import pandas as pd
import torch
import matplotlib.pyplot as plt
from kvlib import corpus
from kvlib.model import load_model
"""


def stability() -> list[NotebookNode]:
    return [
        md(r"""
# Are SmolLM2's outlier RoPE pairs a fixed set?

**Question.** WitCert's paging-safe layout bypasses a *fixed* set of $m$ RoPE pairs per
(layer, KV head) in fp16 instead of choosing them per block. That is only sound in practice if the
high-energy pairs do not move along the sequence. The paper chose the top-8 pairs by energy
$\sum_t (k_{t,i}^2 + k_{t,i+d/2}^2)$ on the first half of a sequence and on the second half and
found Jaccard 0.940 on average (minimum 0.750) on Qwen2.5-7B. We repeat the measurement on the
post-RoPE keys of SmolLM2-135M-Instruct (30 layers, 3 KV heads, $d = 64$, i.e. 32 pairs per head)
over the three domains of the corpus (code, technical prose, narrative).
"""),
        params("""
profile = "cpu"
S = 2048
docs_per_domain = 1
layer_stride = 1
m = 8
"""),
        hidden(SETUP + """
from kvlib.book import Run
from kvlib import real_activations as ra
run = Run("real_outlier_stability", profile=profile, params=dict(S=S, docs_per_domain=docs_per_domain,
                                                              layer_stride=layer_stride, m=m))
model, tok = load_model()
layers = list(range(0, model.config.num_hidden_layers, layer_stride))
frames = []
for doc, ids in corpus.sequences(tok, S, per_domain=docs_per_domain):
    acts = ra.capture(model, ids, layers)
    frames.append(ra.pair_stability(acts, m).assign(domain=doc.domain, doc=doc.name))
    del acts
jac = pd.concat(frames, ignore_index=True)
by_domain = jac.groupby("domain")["jaccard"].agg(["mean", "min", "count"])
run.glue("jac_mean", float(jac.jaccard.mean()))
run.glue("jac_min", float(jac.jaccard.min()))
run.glue("n_heads", int(len(jac)))
run.glue("frac_perfect", float((jac.jaccard == 1).mean()))
run.record("jaccard", jac.to_dict(orient="list"))
by_domain
"""),
        hidden("""
fig, ax = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [3, 1]})
piv = jac.groupby(["layer", "kv_head"])["jaccard"].mean().unstack()
im = ax[0].imshow(piv.T.values, aspect="auto", vmin=0, vmax=1, cmap="viridis")
ax[0].set_xticks(range(len(piv.index))[::max(1, len(piv.index) // 10)], piv.index[::max(1, len(piv.index) // 10)])
ax[0].set_xlabel("layer"); ax[0].set_ylabel("KV head"); fig.colorbar(im, ax=ax[0], label="Jaccard (mean over docs)")
jac.boxplot(column="jaccard", by="domain", ax=ax[1]); ax[1].set_title(""); ax[1].set_ylabel("Jaccard")
fig.suptitle(f"top-{m} pairs, first vs second half, S = {S}")
fig.tight_layout()
run.glue_fig("fig_jaccard", fig)
fig
"""),
        md(r"""
Over {glue:text}`n_heads` (layer, KV head, document) cases the mean Jaccard is
{glue:text}`jac_mean:.3f` and the minimum {glue:text}`jac_min:.3f`;
{glue:text}`frac_perfect:.0%` of the cases keep exactly the same 8 pairs. With 32 pairs per head,
8 of them chosen at random would give an expected Jaccard near 0.14, so the top pairs are
far from random in both halves.
"""),
        hidden("""
jm, jn = float(jac.jaccard.mean()), float(jac.jaccard.min())
run.claim("witcert-real-pair-jaccard", ours=f"mean {jm:.3f}, min {jn:.3f} (SmolLM2-135M, S={S}, {len(jac)} cases)",
          verdict="reproduced" if jm >= 0.85 else "differs",
          why=("mean close to the paper's" if jm >= 0.85 else "SmolLM2's top pairs move more between halves than Qwen2.5-7B's")
              + (f"; the minimum ({jn:.3f}) is below the paper's 0.750: a few heads swap pairs" if jn < 0.75 else ""))
run.claims_table()
"""),
        md(r"""
**Verdict.** The paper's design choice transfers if the mean Jaccard is high: a fixed per-(layer,
KV head) set chosen on a calibration prefix captures the pairs the rest of the sequence needs. The
minimum is what a deployment must plan for: a head whose set moves pays with a larger scale on
the channels that left the set (the coverage notebook measures what that costs).
"""),
        code("run.save()"),
    ]


def coverage() -> list[NotebookNode]:
    return [
        md(r"""
# Coverage against the outlier budget on real activations

**Question.** How often is SmolLM2's dithered INT8 key cache certified (TV bound $\le \tau = 0.2$),
as a function of the number $m$ of RoPE pairs bypassed in fp16? Is there a zero-fallback budget,
and what margin to $\tau$ does it leave? Are the exceedances of the query heads that share a KV head
correlated (the paper: 23.0 % any-of-group fallback against 72.6 % if independent)? What does
each setting cost in bytes?

Setting: post-RoPE queries and keys captured from one cache-less forward over each corpus sequence
(fixed token history, so the theorem applies exactly); per (layer, KV head) the $m$ pairs are chosen
on the first half and held fixed; keys dithered INT8 with group 32, bypassed channels excluded
from the amax; the query at position $t$ (positions spread over the second half) certified against
keys $0..t$ with the request-level allocation $\delta_\mathrm{loc} = \delta_\mathrm{req}/(L \cdot H_q \cdot T)$,
$L = 30$, $H_q = 9$, $T$ = `steps`. The certificate is the two-accumulator bound $1 - B/A$.
"""),
        params("""
profile = "cpu"
S = 2048
docs_per_domain = 1
layer_stride = 3
budgets = [0, 2, 4, 8, 16]
n_queries = 8
tau = 0.2
delta_req = 0.01
steps = 256
seed = 0
"""),
        hidden(SETUP + """
from kvlib.book import Run
from kvlib import real_activations as ra
run = Run("real_coverage", profile=profile, params=dict(S=S, docs_per_domain=docs_per_domain, layer_stride=layer_stride,
                                                     budgets=budgets, n_queries=n_queries, tau=tau,
                                                     delta_req=delta_req, steps=steps, seed=seed))
model, tok = load_model()
cfg = model.config
layers = list(range(0, cfg.num_hidden_layers, layer_stride))
frames = []
for doc, ids in corpus.sequences(tok, S, per_domain=docs_per_domain):
    acts = ra.capture(model, ids, layers)
    c = ra.certify_budget(acts, budgets, n_layers=cfg.num_hidden_layers, n_queries=n_queries,
                          delta_req=delta_req, steps=steps, seed=seed)
    frames.append(c.assign(domain=doc.domain, doc=doc.name))
    del acts
certs = pd.concat(frames, ignore_index=True)
tab = ra.budget_table(certs, tau=tau, d=cfg.head_dim)
per_domain = pd.concat({dom: ra.budget_table(df, tau=tau, d=cfg.head_dim)["coverage"]
                        for dom, df in certs.groupby("domain")}, axis=1)
run.record("budget_table", tab.reset_index().to_dict(orient="list"))
run.record("coverage_by_domain", per_domain.reset_index().to_dict(orient="list"))
for m_ in budgets:
    run.glue(f"cov_m{m_}", float(tab.loc[m_, "coverage"]))
    run.glue(f"fb_m{m_}", float(tab.loc[m_, "fallback"]))
    run.glue(f"fbind_m{m_}", float(tab.loc[m_, "fallback_if_independent"]))
    run.glue(f"max_m{m_}", float(tab.loc[m_, "max_cert"]))
zero = [m_ for m_ in budgets if tab.loc[m_, "coverage"] == 1.0]
m0 = zero[0] if zero else None
run.glue("zero_fallback_m", -1 if m0 is None else m0)
run.glue("zero_fallback_margin", float("nan") if m0 is None else tau / float(tab.loc[m0, "max_cert"]))
run.glue("n_certs", int(len(certs) // len(budgets)))
run.glue("violations", int(tab["violations"].sum()))
tab.style.format({"coverage": "{:.3f}", "fallback": "{:.3f}", "fallback_if_independent": "{:.3f}",
                  "max_cert": "{:.3g}", "max_A": "{:.3g}", "overflow": "{:.3f}"})
"""),
        hidden("""
fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
for dom in per_domain.columns:
    ax[0].plot(per_domain.index, per_domain[dom], marker="o", label=dom)
ax[0].set_xlabel("outlier budget m (RoPE pairs)"); ax[0].set_ylabel(f"coverage at tau = {tau}"); ax[0].legend()
ax[0].set_xscale("symlog", linthresh=1); ax[0].set_xticks(budgets, budgets)
mx = certs.groupby(["m", "layer", "q_head"])["cert"].max().unstack("m")
ax[1].boxplot([mx[m_].values for m_ in budgets]); ax[1].set_xticks(range(1, len(budgets) + 1), [str(m_) for m_ in budgets])
ax[1].axhline(tau, color="k", ls="--", lw=1); ax[1].set_yscale("log")
ax[1].set_xlabel("m"); ax[1].set_ylabel("max certificate per (layer, head)")
fig.tight_layout()
run.glue_fig("fig_coverage", fig)
fig
"""),
        md(r"""
Each budget is certified on {glue:text}`n_certs` (layer, query head, position, document) cases;
the true TV of each case (exact keys vs dequantised keys, same query) never exceeded its
certificate ({glue:text}`violations` violations over all budgets). Without bypass the coverage is
{glue:text}`cov_m0:.3f`; with $m = 2$ it is {glue:text}`cov_m2:.3f`, with $m = 4$
{glue:text}`cov_m4:.3f`, with $m = 8$ {glue:text}`cov_m8:.3f` and with $m = 16$ {glue:text}`cov_m16:.3f`.
The first budget with coverage 1 is $m$ = {glue:text}`zero_fallback_m` (−1: none), with a margin
$\tau / \max$ cert = {glue:text}`zero_fallback_margin:.2f`. Any-of-group fallback without bypass is
{glue:text}`fb_m0:.3f` against {glue:text}`fbind_m0:.3f` if the three heads of a group exceeded
independently. Key bytes per token per head: 64 codes + 2 fp16 scales + $2m$ fp16 bypass values.
"""),
        hidden("""
c0, c16 = float(tab.loc[budgets[0], "coverage"]), float(tab.loc[budgets[-1], "coverage"])
mono = bool(np.all(np.diff(tab["coverage"].values) >= -1e-12))
run.claim("witcert-real-coverage-budget",
          ours=f"coverage {c0:.4f} (m=0) -> " + " -> ".join(f"{tab.loc[m_, 'coverage']:.4f}" for m_ in budgets[1:]) + f" (m={budgets[1:]})",
          verdict="reproduced" if mono and c16 > c0 else "differs",
          why="SmolLM2-135M, S = %d, every %d-th layer; the no-bypass coverage is model-specific" % (S, layer_stride))
if m0 is not None:
    mx0 = float(tab.loc[m0, "max_cert"])
    run.claim("witcert-real-zero-fallback", ours=f"coverage 1.000 from m = {m0}; max cert {mx0:.3g} ({tau / mx0:.1f}x below tau)",
              verdict="reproduced" if m0 <= 16 else "differs", why="" if m0 <= 16 else "zero-fallback only beyond m = 16")
else:
    mL = budgets[-1]
    n_over = int(round((1 - float(tab.loc[mL, "coverage"])) * (len(certs) // len(budgets))))
    run.claim("witcert-real-zero-fallback",
              ours=f"no zero-fallback budget up to m = {mL}: there {n_over} of {len(certs) // len(budgets)} certificates exceed tau "
                   f"(coverage {float(tab.loc[mL, 'coverage']):.4f}, max {float(tab.loc[mL, 'max_cert']):.3g})",
              verdict="differs", why="SmolLM2's certificates exceed tau even at the largest budget"
              + ("; the maximum is within 1.5x of tau, a marginal point that depends on the positions sampled"
                 if float(tab.loc[mL, "max_cert"]) < 1.5 * tau else ""))
fb, fi = float(tab.loc[budgets[0], "fallback"]), float(tab.loc[budgets[0], "fallback_if_independent"])
run.claim("witcert-real-group-correlation", ours=f"m = 0: any-of-3 fallback {fb:.3f} vs {fi:.3f} if independent",
          verdict="reproduced" if fb < 0.8 * fi else "differs",
          why="groups of 3 query heads (SmolLM2), not 6" + ("" if fb < 0.8 * fi else "; exceedances look nearly independent here"))
maxes = [float(tab.loc[m_, "max_cert"]) for m_ in budgets]
dec = bool(np.all(np.diff(maxes) <= 1e-12))
run.claim("witcert-real-massive-heads", ours="max 1-B/A: " + " -> ".join(f"{x:.3g}" for x in maxes) + "; max A: " + " -> ".join(f"{float(tab.loc[m_, 'max_A']):.3g}" for m_ in budgets),
          verdict="reproduced" if dec else "differs",
          why="our certificate 1-B/A is a TV bound, at most 1; the paper's 1.6e2 can only be an unnormalised quantity, so we compare the monotone collapse (offline capture, not generation)")
run.claims_table()
"""),
        md(r"""
**Verdict.** The table answers the three questions for SmolLM2 at this length: where coverage
saturates (the zero-fallback budget, if any, and its margin), how strongly exceedances cluster
within a KV group, and what each budget adds in bytes. The certificates were computed from the
model's own queries at a fixed token history, where the theorem holds exactly.
"""),
        code("run.save()"),
    ]


def fidelity() -> list[NotebookNode]:
    return [
        md(r"""
# Real generation through the cache: teacher-forced fidelity of every format, and live certificates

**Question.** With SmolLM2 generating through `kvlib.make_cache(format, config)`, how far does each
KV format move the next-token distribution? We force the full-precision model's own greedy
continuation (prefill `prompt_len` tokens of a corpus document, then `n_new` tokens) through every
cache and compare logits step by step: KL$(p_\mathrm{ref} \| q)$ in float64 over the full
vocabulary, top-1 agreement and top-5 overlap. Then the dithered INT8 cache decodes token by token
with certificate telemetry from the real post-RoPE queries (every layer, every query head, every
step), for outlier budgets chosen on the prompt, and we count the certificates above $\tau$ and
measure what the telemetry costs.
"""),
        params("""
profile = "cpu"
prompt_len = 256
n_new = 32
docs_per_domain = 1
formats = "all"
budgets = [0, 4, 16]
gen_steps = 16
stride = 8
tau = 0.2
"""),
        hidden(SETUP + """
import time
from kvlib.book import Run
from kvlib import fidelity as fid
from kvlib import real_activations as ra
from kvlib.formats.base import available_formats
from kvlib.hf_cache import make_cache
run = Run("real_fidelity", profile=profile, params=dict(prompt_len=prompt_len, n_new=n_new, docs_per_domain=docs_per_domain,
                                                     formats=formats, budgets=budgets, gen_steps=gen_steps, stride=stride, tau=tau))
model, tok = load_model()
cfg = model.config
names = available_formats() if formats == "all" else list(formats)
rows, skipped = [], set()
seqs = corpus.sequences(tok, prompt_len, per_domain=docs_per_domain)
for doc, prompt in seqs:
    full = model.generate(prompt[None], max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          past_key_values=make_cache("fp32", cfg))
    specs = {}
    for name in names:
        specs[name] = name
    tables = {m_: ra.outlier_table(model, prompt[None], m_) for m_ in budgets if m_}
    for m_, table in tables.items():
        specs[f"dither-int8 m={m_}"] = ("dither-int8", {"outlier_table": table})
    ref = fid.forced_logits(model, full, prompt_len, None, mode="chunk")  # the reference, once per document
    for name, spec in specs.items():
        try:
            test, cache = fid.forced_logits(model, full, prompt_len, spec, return_cache=True)
        except NotImplementedError:  # offline-only formats cannot append token by token
            skipped.add(name)
            continue
        cmp = fid.compare_logits(ref, test)
        rows.append({"name": name, "kl_mean": float(cmp["kl"].mean()), "kl_max": float(cmp["kl"].max()),
                     "top1": float(cmp["top1"].mean()), "top5": float(cmp["top5"].mean()),
                     "packed_bytes": cache.packed_nbytes(), "domain": doc.domain, "doc": doc.name})
res = pd.DataFrame(rows)
L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
S_tot = prompt_len + n_new - 1
res["bytes_per_tok_head_side"] = res["packed_bytes"] / (2 * L * hkv * S_tot)
summary = res.groupby("name")[["kl_mean", "top1", "top5", "bytes_per_tok_head_side"]].mean().sort_values("kl_mean")
run.record("fidelity", res.to_dict(orient="list"))
run.glue("skipped", ", ".join(sorted(skipped)) or "none")
for name in ("fp32", "fp16", "rtn-int8", "dither-int8", "sr-int8", "kv4"):
    if name in summary.index:
        key = name.replace("-", "_")
        run.glue(f"kl_{key}", float(summary.loc[name, "kl_mean"]))
        run.glue(f"top1_{key}", float(summary.loc[name, "top1"]))
summary.style.format({"kl_mean": "{:.2e}", "top1": "{:.3f}", "top5": "{:.3f}", "bytes_per_tok_head_side": "{:.1f}"})
"""),
        hidden("""
fig, ax = plt.subplots(figsize=(6.5, 3.6))
s = summary.drop(index=[n for n in ("fp32",) if n in summary.index])
ax.scatter(s["bytes_per_tok_head_side"], s["kl_mean"].clip(lower=1e-9))
for n, r in s.iterrows():
    ax.annotate(n, (r["bytes_per_tok_head_side"], max(r["kl_mean"], 1e-9)), fontsize=7, xytext=(3, 2), textcoords="offset points")
ax.set_xscale("log"); ax.set_yscale("log")
ax.set_xlabel("packed bytes per token per head per side (measured)"); ax.set_ylabel("mean KL(p_ref || q), teacher forced")
fig.tight_layout()
run.glue_fig("fig_fidelity", fig)
fig
"""),
        md(r"""
The fp32 passthrough gives KL {glue:text}`kl_fp32:.1e` exactly (same engine, same path). The
dithered INT8 cache sits at KL {glue:text}`kl_dither_int8:.2e` (top-1 {glue:text}`top1_dither_int8:.3f`),
round-to-nearest INT8 at {glue:text}`kl_rtn_int8:.2e` (top-1 {glue:text}`top1_rtn_int8:.3f`). Formats that
cannot append token by token and were left out: {glue:text}`skipped`.

## Live certificates during decoding

The dithered cache now decodes `gen_steps` forced tokens one at a time; at every forward call each
layer certifies the last query row of all nine query heads (stride 1), request-level
$\delta_\mathrm{loc} = 10^{-2}/(30 \cdot 9 \cdot 256)$.
"""),
        hidden("""
doc, prompt = seqs[0]
full = model.generate(prompt[None], max_new_tokens=gen_steps, min_new_tokens=gen_steps, do_sample=False,
                      past_key_values=make_cache("fp32", cfg))
gen_rows = {}
def run_gen(m_, stride_):
    opts = {"telemetry": True, "stride": stride_, "tau": tau}
    if m_:
        opts["outlier_table"] = ra.outlier_table(model, prompt[None], m_)
    t0 = time.perf_counter()
    _, cache = fid.forced_logits(model, full, prompt_len, ("dither-int8", opts), mode="decode", return_cache=True)
    wall = time.perf_counter() - t0
    s = cache.telemetry_summary()
    s.update(wall_s=wall, cost_fraction=s["seconds"] / (wall - s["seconds"]),
             over_tau=int(round(s["n"] * (1 - s["coverage"]))))
    return s
for m_ in budgets:
    gen_rows[m_] = run_gen(m_, 1)
sampled = run_gen(budgets[-1], stride)
gen = pd.DataFrame(gen_rows).T[["n", "coverage", "over_tau", "max_finite", "mean_finite", "overflow_fraction", "seconds", "wall_s", "cost_fraction"]]
gen.index.name = "m"
run.record("generation", {str(k): v for k, v in gen_rows.items()})
run.record("generation_sampled", sampled)
for m_ in budgets:
    run.glue(f"gen_cov_m{m_}", float(gen.loc[m_, "coverage"]))
    run.glue(f"gen_max_m{m_}", float(gen.loc[m_, "max_finite"]))
    run.glue(f"gen_over_m{m_}", int(gen.loc[m_, "over_tau"]))
run.glue("gen_n", int(gen.iloc[0]["n"]))
run.glue("cost_full", float(gen.iloc[-1]["cost_fraction"]))
run.glue("cost_sampled", float(sampled["cost_fraction"]))
run.glue("n_sampled", int(sampled["n"]))
gen
"""),
        md(r"""
With stride 1 each budget yields {glue:text}`gen_n` certificates. Without bypass
{glue:text}`gen_over_m0` exceed $\tau$ (coverage {glue:text}`gen_cov_m0:.3f`, max {glue:text}`gen_max_m0:.3g`);
at the largest budget {glue:text}`gen_over_m16` exceed it (max {glue:text}`gen_max_m16:.3g`).
Telemetry cost relative to the rest of the decode step: {glue:text}`cost_full:.1%` at stride 1
and {glue:text}`cost_sampled:.1%` at stride `stride` ({glue:text}`n_sampled` certificates). On this
CPU the cost is the torch reference of the certificate (float64) and the decode step is a small
model, so the fraction is an upper bound for what a fused kernel would pay.
"""),
        hidden("""
dm = [n for n in summary.index if n.startswith("dither-int8")]
kl_by_m = {0: float(summary.loc["dither-int8", "kl_mean"])} if "dither-int8" in summary.index else {}
kl_by_m.update({int(n.split("=")[1]): float(summary.loc[n, "kl_mean"]) for n in dm if "m=" in n})
ms = sorted(kl_by_m)
top1_by_m = [float(summary.loc["dither-int8" if m_ == 0 else f"dither-int8 m={m_}", "top1"]) for m_ in ms]
mono = bool(np.all(np.diff([kl_by_m[m_] for m_ in ms]) <= 0))
run.claim("witcert-real-teacher-forcing",
          ours="dither-int8 KL " + " / ".join(f"{kl_by_m[m_]:.2e}" for m_ in ms) + " and top-1 " + " / ".join(f"{t:.3f}" for t in top1_by_m) + f" at m = {ms} (prompt {prompt_len} + {n_new})",
          verdict="reproduced" if mono and min(top1_by_m) >= 0.9 else "differs",
          why="" if mono and min(top1_by_m) >= 0.9 else "KL not monotone in m or top-1 below 0.9 on SmolLM2")
mlast = budgets[-1]
run.claim("witcert-real-gen-certified",
          ours=f"m = {mlast}: {int(gen.loc[mlast, 'n'] - gen.loc[mlast, 'over_tau'])} / {int(gen.loc[mlast, 'n'])} certificates <= {tau}, max {float(gen.loc[mlast, 'max_finite']):.3g}",
          verdict="reproduced" if int(gen.loc[mlast, "over_tau"]) == 0 else "differs",
          why="SmolLM2-135M, 30 layers x 9 query heads, every decode step" + ("" if int(gen.loc[mlast, "over_tau"]) == 0 else "; some heads stay above tau"))
cs = float(sampled["cost_fraction"])
run.claim("witcert-telemetry-cost", ours=f"{cs:.1%} of the decode step at stride {stride} ({float(gen.iloc[-1]['cost_fraction']):.1%} at stride 1)",
          verdict="reproduced" if cs < 0.1 else "differs",
          why="CPU, torch float64 reference certificate" + ("" if cs < 0.1 else "; above a tenth at this stride"))
run.claims_table()
"""),
        md(r"""
**Verdict.** Teacher forcing ranks the formats by what they do to the next-token distribution at
a fixed history, and the live telemetry shows which (layer, head) certificates the real queries
push above $\tau$ at each outlier budget. Greedy free-running text would not: one diverging token
separates the trajectories for good.
"""),
        code("run.save()"),
    ]


def ablation() -> list[NotebookNode]:
    return [
        md(r"""
# The 2×2 ablation on real attention output: is dither quality neutral, and what does the bypass buy?

**Question.** WitCert stores K and V in 8 bits with two independent knobs: the quantizer
(subtractive dither, which the certificate needs, or plain round-to-nearest) and the fp16 bypass of
$m$ outlier pairs. Which knob moves the quality of the *attention output*? The paper measured the
relative error $\|\hat o - o\| / \|o\|$ with real V on Qwen2.5-7B and found the dither gain to be
1.01× (quality neutral) and the whole gain, 1.38×, to come from the bypass at +12.4 % memory; an
earlier "1.7–1.8× better than RTN" rested on a K-side proxy and was retracted. We repeat the
2×2 on SmolLM2-135M.

Setting: post-RoPE q, k and v captured from one cache-less forward over a corpus sequence of each
domain (fixed token history); per (layer, KV head) the bypassed pairs of K and of V are chosen on the
first half and held fixed, and leave the group amax. The two quantizers share the layout and the
scale rule (per token, groups of 32 channels, $s = \mathrm{fp16}(\mathrm{amax}/126.5)$); RTN is
the same write with the dither $\xi = 0$, so only the rounding differs. Each query at a position in
the second half attends causally to all earlier tokens; every query head of the layers used is
measured. Besides the brief's $m = 16$ we run $m = 2$: with $d = 64$ that is the paper's byte
fraction (1/16 of the pairs; the paper's bypass added 12.4 %).
"""),
        params("""
profile = "cpu"
S = 2048
docs_per_domain = 1
layer_stride = 3
budgets = [0, 2, 16]
m = 16
n_queries = 8
tau = 0.2
delta_req = 0.01
steps = 256
seed = 0
"""),
        hidden(SETUP + """
from kvlib.book import Run
from kvlib import real_activations as ra
from kvlib.model import truncated_model
run = Run("real_ablation", profile=profile, params=dict(S=S, docs_per_domain=docs_per_domain, layer_stride=layer_stride,
                                                     budgets=budgets, m=m, n_queries=n_queries, tau=tau,
                                                     delta_req=delta_req, steps=steps, seed=seed))
model, tok = load_model()
cfg = model.config
d = cfg.head_dim
layers = list(range(0, cfg.num_hidden_layers, layer_stride))
cap_model = truncated_model(model, layers[-1] + 1)  # later layers cannot change the captured ones
frames = []
for doc, ids in corpus.sequences(tok, S, per_domain=docs_per_domain):
    acts = ra.capture(cap_model, ids, layers)
    e = ra.ablation_errors(acts, m=budgets, n_layers=cfg.num_hidden_layers, n_queries=n_queries,
                           delta_req=delta_req, steps=steps, seed=seed)
    frames.append(e.assign(domain=doc.domain, doc=doc.name))
    del acts
errs = pd.concat(frames, ignore_index=True)
tab = ra.ablation_table(errs, tau=tau, d=d)
by_domain = errs.groupby(["quantizer", "m", "domain"])["rel_err"].mean().unstack("domain")
run.record("ablation_table", tab.reset_index().to_dict(orient="list"))
run.record("err_by_domain", by_domain.reset_index().to_dict(orient="list"))
for (qn, m_), r in tab.iterrows():
    run.glue(f"err_{qn}_m{m_}", float(r["err_mean"]))
    run.glue(f"p99_{qn}_m{m_}", float(r["err_p99"]))
    run.glue(f"max_{qn}_m{m_}", float(r["err_max"]))
    if qn == "dither":  # bytes and coverage are per budget, glued once
        run.glue(f"bytes_m{m_}", int(r["bytes_kv"]))
        run.glue(f"cov_m{m_}", float(r["coverage"]))
        run.glue(f"maxcert_m{m_}", float(r["max_cert"]))
run.glue("n_rows", int(len(errs) // len(tab)))
run.glue("bytes_fp16", 2 * 2 * d)  # K and V, d fp16 values each
run.glue("violations", int(tab.loc["dither", "violations"].sum()))
tab.style.format({c: "{:.3e}" for c in ("err_mean", "err_median", "err_p90", "err_p99", "err_max", "head_mean_max")}
                 | {"coverage": "{:.3f}", "max_cert": "{:.3g}"})
"""),
        hidden("""
import seaborn as sns
head = errs.groupby(["quantizer", "m", "layer", "q_head"], as_index=False)["rel_err"].mean()
fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
sns.boxplot(data=head, x="m", y="rel_err", hue="quantizer", hue_order=["dither", "rtn"], ax=ax[0], fliersize=2)
ax[0].set_yscale("log"); ax[0].set_xlabel("bypassed pairs m (K and V)")
ax[0].set_ylabel("mean ||o_hat - o|| / ||o|| per (layer, head)")
per_layer = errs.groupby(["quantizer", "m", "layer"])["rel_err"].mean()
for i, m_ in enumerate(budgets):
    for qn, ls in (("dither", "-"), ("rtn", "--")):
        r = per_layer.loc[(qn, m_)]
        ax[1].plot(r.index, r.values, marker=".", ls=ls, color=f"C{i}", label=f"{qn}, m={m_}")
ax[1].set_yscale("log"); ax[1].set_xlabel("layer"); ax[1].set_ylabel("mean relative output error"); ax[1].legend(fontsize=7, ncol=3)
fig.suptitle(f"SmolLM2-135M, S = {S}, 8-bit K+V, real V")
fig.tight_layout()
run.glue_fig("fig_ablation", fig)
fig
"""),
        md(r"""
Each setting is measured on {glue:text}`n_rows` (layer, query head, position, document) rows.
Without bypass the mean relative output error is {glue:text}`err_dither_m0:.3e` with dither and
{glue:text}`err_rtn_m0:.3e` with RTN; with $m = 16$ it is {glue:text}`err_dither_m16:.3e` and
{glue:text}`err_rtn_m16:.3e`, at {glue:text}`bytes_m16` bytes per token per head (K+V) instead of
{glue:text}`bytes_m0` (fp16: {glue:text}`bytes_fp16`). The byte-matched $m = 2$ gives {glue:text}`err_dither_m2:.3e`
(dither) and {glue:text}`err_rtn_m2:.3e` (RTN) at {glue:text}`bytes_m2` bytes. The tails
(99th percentile, maximum) are in the table above.

**Certificates.** Only the dithered rows carry a certificate. Its theorem needs the key error to be
$s\,\varepsilon$ with $\varepsilon$ uniform on $[-\tfrac12, \tfrac12]$ and independent of the key,
which subtractive dither guarantees for any input; RTN's error $s(\mathrm{rne}(x/s) - x/s)$ is a
fixed function of the key, so there is no probability to bound: the same keys give the same error,
possibly all aligned with the query, and no radius holds "with probability $1 - \delta$". The
formula could be evaluated on RTN scales, but the number would certify nothing. At $\tau = 0.2$ the
dithered coverage is {glue:text}`cov_m0:.3f` without bypass, {glue:text}`cov_m2:.3f` at $m = 2$ and
{glue:text}`cov_m16:.3f` at $m = 16$ (max certificate {glue:text}`maxcert_m16:.3g`); the true TV of
the attention weights exceeded its certificate {glue:text}`violations` times.
"""),
        hidden("""
def ratio(a, b):
    return float(tab.loc[a, "err_mean"] / tab.loc[b, "err_mean"])
dith = {m_: ratio(("rtn", m_), ("dither", m_)) for m_ in budgets}          # > 1: dither better
byp = {(qn, m_): ratio((qn, 0), (qn, m_)) for qn in ("dither", "rtn") for m_ in budgets if m_}  # > 1: bypass better
mem = {m_: float(tab.loc[("dither", m_), "bytes_kv"] / tab.loc[("dither", 0), "bytes_kv"] - 1) for m_ in budgets if m_}
for m_ in budgets:
    run.glue(f"dither_gain_m{m_}", dith[m_])
for m_, x in mem.items():
    run.glue(f"mem_m{m_}", x)
for (qn, m_), r in byp.items():
    run.glue(f"bypass_gain_{qn}_m{m_}", r)
run.record("ratios", {"dither_gain": {str(k): v for k, v in dith.items()},
                      "bypass_gain": {f"{k[0]}_m{k[1]}": v for k, v in byp.items()},
                      "memory_increase": {str(k): v for k, v in mem.items()}})
NEUTRAL = 0.05  # |gain - 1| below 5 %: quality neutral
neutral = all(abs(g - 1) < NEUTRAL for g in dith.values())
run.claim("witcert-real-ablation-dither",
          ours="RTN / dither error " + ", ".join(f"{dith[m_]:.3f}x (m={m_})" for m_ in budgets),
          verdict="reproduced" if neutral else "differs",
          why=f"quality neutral taken as within {NEUTRAL:.0%} of 1" + ("" if neutral else
          f"; RTN's error is {min(dith.values()):.2f}x to {max(dith.values()):.2f}x the dither's (SmolLM2, S = {S})"))
m_small = min(m_ for m_ in budgets if m_)
gain_small = byp[("dither", m_small)]
gain_m = byp[("dither", m)]
helps = all(r > 1 + NEUTRAL for r in byp.values())
dominant = gain_small > max(dith.values())  # at the paper's byte fraction the bypass beats the dither
run.claim("witcert-real-ablation-bypass",
          ours=f"dither: {gain_small:.2f}x at m={m_small} (+{mem[m_small]:.1%} memory), {gain_m:.2f}x at m={m} (+{mem[m]:.1%}); "
               f"RTN: {byp[('rtn', m_small)]:.2f}x / {byp[('rtn', m)]:.2f}x",
          verdict="reproduced" if helps and dominant else "differs",
          why=("the bypass is the larger knob" if helps and dominant else
               "the bypass does not lower the output error beyond 5 %" if not helps else "the dither gain exceeds the bypass gain")
              + ("" if neutral else f" (the dither gain, {max(dith.values()):.2f}x, is not zero here)")
              + f"; SmolLM2 d = 64, m = {m_small} is the paper's byte fraction, S = {S}")
lo, hi = min(dith.values()), max(dith.values())
if neutral:
    vtext = "Dither is quality neutral here, as in the paper: the certificate costs no output quality."
elif lo > 1:
    vtext = (f"Dither is not neutral here but better: RTN's error is {lo:.2f}x to {hi:.2f}x the dither's at the same bytes. "
             "RTN's error is a fixed function of the value (a value below s/2 in a group with a large amax is "
             "rounded to 0, i.e. deleted), a bias that does not average out over tokens; the dither's error is "
             "independent of the value. The certificate costs no output quality.")
elif hi < 1:
    vtext = f"Dither costs output quality here: its error is {1 / hi:.2f}x to {1 / lo:.2f}x RTN's at the same bytes."
else:
    vtext = f"The dither gain changes sign with the bypass ({lo:.2f}x to {hi:.2f}x)."
run.glue("verdict_dither", vtext)
run.claims_table()
"""),
        md(r"""
**Verdict.** The 2×2 separates the two knobs on the quantity that matters, the attention output
with real V: the dither gain (RTN error over dither error at the same bypass, ≈ 1 means quality
neutral) is {glue:text}`dither_gain_m0:.3f`× without bypass and {glue:text}`dither_gain_m16:.3f`× at
$m = 16$, while the bypass gain (error without over error with) is
{glue:text}`bypass_gain_dither_m2:.2f`× at the byte-matched $m = 2$ (+{glue:text}`mem_m2:.1%` bytes) and
{glue:text}`bypass_gain_dither_m16:.2f`× at $m = 16$ (+{glue:text}`mem_m16:.1%`). {glue:text}`verdict_dither` What improves quality most is the
bypass, which is independent of the certificate and costs memory. Caveat: SmolLM2 has $d = 64$ and
3 KV heads, so each bypassed pair is twice the byte fraction it is on Qwen2.5-7B, and $S$ here is
shorter than the paper's 8k.
"""),
        code("run.save()"),
    ]


if __name__ == "__main__":
    for name, fn in (("outlier_stability", stability), ("coverage", coverage), ("fidelity", fidelity),
                     ("ablation", ablation)):
        print("wrote", write(fn(), HERE / f"{name}.ipynb"))
