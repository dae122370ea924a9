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

from kvlib.publish.nbbuild import code, md, params, write  # noqa: E402


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
from kvlib.analysis import corpus
from kvlib.hf.model import load_model
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
over the three domains of the corpus (code, technical prose, narrative), at a 2k and an 8k context
(the paper's length), and ask one deployment question more: does a set chosen on a short prefix
(the first half of the short context) still match the second half of the long sequence?
"""),
        params("""
profile = "cpu"
S = [2048, 8192]  # context lengths (an int runs one)
docs_per_domain = 1
layer_stride = 1
m = 8
"""),
        hidden(SETUP + """
import time
from kvlib.publish import Run
from kvlib.analysis import real_activations as ra
run = Run("real_outlier_stability", profile=profile, params=dict(S=S, docs_per_domain=docs_per_domain,
                                                              layer_stride=layer_stride, m=m))
contexts = sorted({int(s_) for s_ in ([S] if isinstance(S, int) else S)})
model, tok = load_model()
layers = list(range(0, model.config.num_hidden_layers, layer_stride))
calib = contexts[0] // 2  # the short context's first half, held for the long sequence
frames, prefix, wall = [], [], {}
for s_ in contexts:
    t0 = time.perf_counter()
    for doc, ids in corpus.sequences(tok, s_, per_domain=docs_per_domain):
        acts = ra.capture(model, ids, layers)
        frames.append(ra.pair_stability(acts, m).assign(S=s_, domain=doc.domain, doc=doc.name))
        if s_ == contexts[-1]:
            prefix.append(ra.pair_stability(acts, m, calib=calib).assign(S=s_, domain=doc.domain, doc=doc.name))
        del acts
    wall[s_] = time.perf_counter() - t0
jac = pd.concat(frames, ignore_index=True)
jac_prefix = pd.concat(prefix, ignore_index=True)
by_domain = jac.groupby(["S", "domain"])["jaccard"].agg(["mean", "min", "count"]).unstack("S")
run.record("jaccard", jac.to_dict(orient="list"))
run.record("jaccard_prefix", jac_prefix.to_dict(orient="list"))
run.record("wall_s", {str(k): v for k, v in wall.items()})
roles = {"short": contexts[0], "long": contexts[-1]}
for r, s_ in roles.items():
    j = jac[jac.S == s_].jaccard
    run.glue(f"S_{r}", s_)
    run.glue(f"jac_mean_{r}", float(j.mean()))
    run.glue(f"jac_min_{r}", float(j.min()))
    run.glue(f"n_heads_{r}", int(len(j)))
    run.glue(f"frac_perfect_{r}", float((j == 1).mean()))
    run.glue(f"wall_{r}", float(wall[s_]))
run.glue("calib_tokens", calib)
run.glue("jac_prefix_mean", float(jac_prefix.jaccard.mean()))
run.glue("jac_prefix_min", float(jac_prefix.jaccard.min()))
run.glue("contexts_run", ", ".join(str(s_) for s_ in contexts))
by_domain
"""),
        hidden("""
import seaborn as sns
fig, ax = plt.subplots(1, len(contexts) + 1, figsize=(4.5 * len(contexts) + 3.5, 3.2),
                       gridspec_kw={"width_ratios": [3] * len(contexts) + [2]})
for i, s_ in enumerate(contexts):
    piv = jac[jac.S == s_].groupby(["layer", "kv_head"])["jaccard"].mean().unstack()
    im = ax[i].imshow(piv.T.values, aspect="auto", vmin=0, vmax=1, cmap="viridis")
    step = max(1, len(piv.index) // 10)
    ax[i].set_xticks(range(len(piv.index))[::step], piv.index[::step])
    ax[i].set_yticks(range(len(piv.columns)), piv.columns)
    ax[i].set_xlabel("layer"); ax[i].set_ylabel("KV head"); ax[i].set_title(f"S = {s_}")
fig.colorbar(im, ax=ax[len(contexts) - 1], label="Jaccard (mean over docs)")
both = pd.concat([jac, jac_prefix.assign(S=f"{contexts[-1]}, prefix {calib}")], ignore_index=True).astype({"S": str})
sns.barplot(data=both, x="domain", y="jaccard", hue="S", ax=ax[-1], errorbar=None)
sns.stripplot(data=both.groupby(["domain", "S"], as_index=False)["jaccard"].min(), x="domain", y="jaccard", hue="S",
              dodge=True, marker="v", palette="dark:k", ax=ax[-1], legend=False)
ax[-1].set_ylim(0, 1.05); ax[-1].set_ylabel("Jaccard: mean (bar), min (v)")
ax[-1].legend(fontsize=7, title="S", loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.suptitle(f"top-{m} pairs, first vs second half")
fig.tight_layout()
run.glue_fig("fig_jaccard", fig)
fig
"""),
        md(r"""
At $S$ = {glue:text}`S_short`, over {glue:text}`n_heads_short` (layer, KV head, document) cases, the
mean Jaccard is {glue:text}`jac_mean_short:.3f` and the minimum {glue:text}`jac_min_short:.3f`
({glue:text}`frac_perfect_short:.0%` of the cases keep exactly the same 8 pairs); at $S$ =
{glue:text}`S_long` ({glue:text}`n_heads_long` cases) the mean is {glue:text}`jac_mean_long:.3f`, the
minimum {glue:text}`jac_min_long:.3f` and {glue:text}`frac_perfect_long:.0%` are exact (contexts run:
{glue:text}`contexts_run`; wall time {glue:text}`wall_short:.0f` s and {glue:text}`wall_long:.0f` s).
A set chosen on the first {glue:text}`calib_tokens` tokens only and compared with the second half of
the {glue:text}`S_long`-token sequence gives mean {glue:text}`jac_prefix_mean:.3f`, minimum
{glue:text}`jac_prefix_min:.3f`. With 32 pairs per head, 8 of them chosen at random would give an
expected Jaccard near 0.14, so the top pairs are far from random in both halves.
"""),
        hidden("""
ctx = " and ".join(str(s_) for s_ in contexts)
stats = {s_: (float(jac[jac.S == s_].jaccard.mean()), float(jac[jac.S == s_].jaccard.min()), int((jac.S == s_).sum()))
         for s_ in contexts}
ok = all(jm >= 0.85 for jm, _, _ in stats.values())
low_min = min(jn for _, jn, _ in stats.values())
run.claim("witcert-real-pair-jaccard",
          ours="; ".join(f"S={s_}: mean {jm:.3f}, min {jn:.3f} ({n} cases)" for s_, (jm, jn, n) in stats.items())
               + f"; prefix {calib} tokens vs second half of {contexts[-1]}: mean {jac_prefix.jaccard.mean():.3f}, min {jac_prefix.jaccard.min():.3f}",
          verdict="reproduced" if ok else "differs",
          why=f"SmolLM2-135M, contexts run: S = {ctx}, {docs_per_domain} doc(s) per domain, layer stride {layer_stride}; "
              + ("mean close to the paper's" if ok else "SmolLM2's top pairs move more between halves than Qwen2.5-7B's")
              + (f"; the minimum ({low_min:.3f}) is below the paper's 0.750: a few heads swap pairs" if low_min < 0.75 else ""))
run.claims_table()
"""),
        md(r"""
**Verdict.** The paper's design choice transfers if the mean Jaccard is high: a fixed per-(layer,
KV head) set chosen on a calibration prefix captures the pairs the rest of the sequence needs, and
the prefix comparison says whether a short prefix suffices for an 8k sequence. The minimum is what a
deployment must plan for: a head whose set moves pays with a larger scale on the channels that left
the set (the coverage notebook measures what that costs).
"""),
        code("run.save()"),
    ]


def coverage() -> list[NotebookNode]:
    return [
        md(r"""
# Coverage against the outlier budget on real activations, at 2k and 8k tokens

**Question.** How often is SmolLM2's dithered INT8 key cache certified (TV bound $\le \tau = 0.2$),
as a function of the number $m$ of RoPE pairs bypassed in fp16, and does the answer change between
a 2k and an 8k context (the paper measured at 8k and 32k)? Is there a zero-fallback budget, and what
margin to $\tau$ does it leave? Are the exceedances of the query heads that share a KV head
correlated (the paper: 23.0 % any-of-group fallback against 72.6 % if independent)? Do the
massive-activation heads' certificates collapse monotonically as $m$ grows? What does each
setting cost in bytes?

Setting: post-RoPE queries and keys captured from one cache-less forward over each corpus sequence
(fixed token history, so the theorem applies exactly), for every context length in `S`, on the
same documents (the shorter sequence is a prefix of the longer one); per (layer, KV head) the
$m$ pairs are chosen on the first half and held fixed; keys dithered INT8 with group 32, bypassed
channels excluded from the amax; the query at position $t$ (positions spread over the second
half) certified against keys $0..t$ with the request-level allocation
$\delta_\mathrm{loc} = \delta_\mathrm{req}/(L \cdot H_q \cdot T)$, $L = 30$, $H_q = 9$,
$T$ = `steps`. The certificate is the two-accumulator bound $1 - B/A$.
"""),
        params("""
profile = "cpu"
S = [2048, 8192]  # context lengths (an int runs one)
docs_per_domain = 2
layer_stride = 3
budgets = [0, 2, 4, 8, 16]
n_queries = 8
tau = 0.2
delta_req = 0.01
steps = 256
seed = 0
n_massive = 5
"""),
        hidden(SETUP + """
import time
from kvlib.publish import Run
from kvlib.analysis import real_activations as ra
from IPython.display import display
from kvlib.certify.bound import request_delta
run = Run("real_coverage", profile=profile, params=dict(S=S, docs_per_domain=docs_per_domain, layer_stride=layer_stride,
                                                     budgets=budgets, n_queries=n_queries, tau=tau, delta_req=delta_req,
                                                     steps=steps, seed=seed, n_massive=n_massive))
contexts = sorted({int(s_) for s_ in ([S] if isinstance(S, int) else S)})
model, tok = load_model()
cfg = model.config
layers = list(range(0, cfg.num_hidden_layers, layer_stride))
frames, wall = [], {}
for s_ in contexts:
    t0 = time.perf_counter()
    for doc, ids in corpus.sequences(tok, s_, per_domain=docs_per_domain):
        acts = ra.capture(model, ids, layers)
        c = ra.certify_budget(acts, budgets, n_layers=cfg.num_hidden_layers, n_queries=n_queries,
                              delta_req=delta_req, steps=steps, seed=seed)
        frames.append(c.assign(S=s_, domain=doc.domain, doc=doc.name))
        del acts
    wall[s_] = time.perf_counter() - t0
certs = pd.concat(frames, ignore_index=True)
GROUP_COLS = ["fallback_if_independent_heads", "phi_within", "phi_across"]
tab = pd.concat({s_: ra.budget_table(df, tau=tau, d=cfg.head_dim).join(ra.group_exceedance(df, tau=tau)[GROUP_COLS])
                 for s_, df in certs.groupby("S")}, names=["S"])
per_domain = pd.concat({s_: pd.concat({dom: ra.budget_table(d2, tau=tau, d=cfg.head_dim)["coverage"]
                                       for dom, d2 in df.groupby("domain")}, axis=1)
                        for s_, df in certs.groupby("S")}, names=["S"])
run.record("budget_table", tab.reset_index().to_dict(orient="list"))
run.record("coverage_by_domain", per_domain.reset_index().to_dict(orient="list"))
run.record("wall_s", {str(k): v for k, v in wall.items()})
# prose cites the shortest and the longest context run (the same one when only one is run)
roles = {"short": contexts[0], "long": contexts[-1]}
zero = {}
for r, s_ in roles.items():
    t_ = tab.loc[s_]
    run.glue(f"S_{r}", s_)
    run.glue(f"wall_{r}", float(wall[s_]))
    run.glue(f"n_certs_{r}", int((certs.S == s_).sum() // len(budgets)))
    run.glue(f"n_docs_{r}", int(certs.loc[certs.S == s_, "doc"].nunique()))
    run.glue(f"violations_{r}", int(t_["violations"].sum()))
    for m_ in budgets:
        run.glue(f"cov_m{m_}_{r}", float(t_.loc[m_, "coverage"]))
        run.glue(f"fb_m{m_}_{r}", float(t_.loc[m_, "fallback"]))
        run.glue(f"max_m{m_}_{r}", float(t_.loc[m_, "max_cert"]))
    m0 = budgets[0]
    run.glue(f"fbind_m{m0}_{r}", float(t_.loc[m0, "fallback_if_independent"]))
    run.glue(f"fbindh_m{m0}_{r}", float(t_.loc[m0, "fallback_if_independent_heads"]))
    run.glue(f"phiw_m{m0}_{r}", float(t_.loc[m0, "phi_within"]))
    run.glue(f"phia_m{m0}_{r}", float(t_.loc[m0, "phi_across"]))
    ok = [m_ for m_ in budgets if t_.loc[m_, "coverage"] == 1.0]
    zero[s_] = ok[0] if ok else None
    run.glue(f"zero_fallback_m_{r}", -1 if zero[s_] is None else zero[s_])
    run.glue(f"zero_fallback_margin_{r}", float("nan") if zero[s_] is None else tau / float(t_.loc[zero[s_], "max_cert"]))
for s_ in contexts:
    if s_ not in roles.values():
        ok = [m_ for m_ in budgets if tab.loc[(s_, m_), "coverage"] == 1.0]
        zero[s_] = ok[0] if ok else None
for m_ in budgets:
    run.glue(f"bytes_m{m_}", int(tab.loc[(contexts[0], m_), "key_bytes"]))
run.glue("bytes_fp16", 2 * cfg.head_dim)
run.glue("delta_loc", request_delta(delta_req, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads, steps=steps))
run.glue("contexts_run", ", ".join(str(s_) for s_ in contexts))
tab.style.format({"coverage": "{:.4f}", "fallback": "{:.3f}", "fallback_if_independent": "{:.3f}",
                  "fallback_if_independent_heads": "{:.3f}", "phi_within": "{:.2f}", "phi_across": "{:.2f}",
                  "max_cert": "{:.3g}", "max_A": "{:.3g}", "overflow": "{:.3f}"})
"""),
        hidden("""
fig, ax = plt.subplots(1, 3, figsize=(13, 3.4))
styles = ["-", "--", ":", "-."]
for i, s_ in enumerate(contexts):
    pdm = per_domain.loc[s_]
    for j, dom in enumerate(pdm.columns):
        ax[0].plot(pdm.index, pdm[dom], marker="o", ls=styles[i % 4], color=f"C{j}", label=f"{dom}, S={s_}")
    t_ = tab.loc[s_]
    ax[1].plot(t_.index, t_["fallback"], marker="o", ls=styles[i % 4], color="C3", label=f"measured, S={s_}")
    ax[1].plot(t_.index, t_["fallback_if_independent_heads"], marker="x", ls=styles[i % 4], color="C7",
               label=f"if independent, S={s_}")
for a in ax[:2]:
    a.set_xscale("symlog", linthresh=1); a.set_xticks(budgets, budgets); a.set_xlabel("outlier budget m (RoPE pairs)")
ax[0].set_ylabel(f"coverage at tau = {tau}"); ax[0].legend(fontsize=7)
ax[1].set_ylabel("any-of-group fallback"); ax[1].legend(fontsize=7)
mx = certs.groupby(["S", "m", "layer", "q_head"])["cert"].max().rename("max_cert").reset_index()
import seaborn as sns
sns.boxplot(data=mx, x="m", y="max_cert", hue="S", ax=ax[2], fliersize=2)
ax[2].axhline(tau, color="k", ls="--", lw=1); ax[2].set_yscale("log")
ax[2].set_xlabel("m"); ax[2].set_ylabel("max certificate per (layer, head)")
fig.tight_layout()
run.glue_fig("fig_coverage", fig)
fig
"""),
        md(r"""
At $S$ = {glue:text}`S_short` each budget is certified on {glue:text}`n_certs_short` (layer,
query head, position, document) cases from {glue:text}`n_docs_short` documents, at $S$ =
{glue:text}`S_long` on {glue:text}`n_certs_long` cases from {glue:text}`n_docs_long` documents
(contexts run: {glue:text}`contexts_run`; wall time {glue:text}`wall_short:.0f` s and
{glue:text}`wall_long:.0f` s). The request-level budget $\delta_\mathrm{req}$ = `delta_req` gives
$\delta_\mathrm{loc}$ = {glue:text}`delta_loc:.2e` per certificate. The true TV of each case (exact
keys vs dequantised keys, same query) never exceeded its certificate ({glue:text}`violations_short`
and {glue:text}`violations_long` violations over all budgets).

| $m$ | key bytes / token / head | coverage, $S$ = {glue:text}`S_short` | coverage, $S$ = {glue:text}`S_long` | any-of-group fallback, {glue:text}`S_short` | fallback, {glue:text}`S_long` |
|---|---|---|---|---|---|
| 0 | {glue:text}`bytes_m0` | {glue:text}`cov_m0_short:.4f` | {glue:text}`cov_m0_long:.4f` | {glue:text}`fb_m0_short:.3f` | {glue:text}`fb_m0_long:.3f` |
| 2 | {glue:text}`bytes_m2` | {glue:text}`cov_m2_short:.4f` | {glue:text}`cov_m2_long:.4f` | {glue:text}`fb_m2_short:.3f` | {glue:text}`fb_m2_long:.3f` |
| 4 | {glue:text}`bytes_m4` | {glue:text}`cov_m4_short:.4f` | {glue:text}`cov_m4_long:.4f` | {glue:text}`fb_m4_short:.3f` | {glue:text}`fb_m4_long:.3f` |
| 8 | {glue:text}`bytes_m8` | {glue:text}`cov_m8_short:.4f` | {glue:text}`cov_m8_long:.4f` | {glue:text}`fb_m8_short:.3f` | {glue:text}`fb_m8_long:.3f` |
| 16 | {glue:text}`bytes_m16` | {glue:text}`cov_m16_short:.4f` | {glue:text}`cov_m16_long:.4f` | {glue:text}`fb_m16_short:.3f` | {glue:text}`fb_m16_long:.3f` |

Key bytes are 64 int8 codes + 2 fp16 scales + $2m$ fp16 bypass values (an fp16 key is
{glue:text}`bytes_fp16` bytes). The first budget with coverage 1 is $m$ =
{glue:text}`zero_fallback_m_short` at {glue:text}`S_short` and $m$ = {glue:text}`zero_fallback_m_long`
at {glue:text}`S_long` (−1: none up to 16), with margins $\tau / \max$ cert =
{glue:text}`zero_fallback_margin_short:.2f` and {glue:text}`zero_fallback_margin_long:.2f`.

**Correlation within a KV group.** Without bypass the measured any-of-3 fallback is
{glue:text}`fb_m0_short:.3f` / {glue:text}`fb_m0_long:.3f` (short / long context) against
{glue:text}`fbind_m0_short:.3f` / {glue:text}`fbind_m0_long:.3f` predicted by $1 - c^3$ from the pooled
coverage $c$ (the paper's comparison), and {glue:text}`fbindh_m0_short:.3f` /
{glue:text}`fbindh_m0_long:.3f` predicted from each head's own exceedance rate. The correlation of
the exceedance indicators of two query heads, after removing each head's rate, is
{glue:text}`phiw_m0_short:.2f` / {glue:text}`phiw_m0_long:.2f` for two heads of the same KV head and
{glue:text}`phia_m0_short:.2f` / {glue:text}`phia_m0_long:.2f` for two heads of different KV heads of
the same layer.
"""),
        hidden("""
# massive-activation heads: the heads with the largest certificate without bypass, followed over m
def monotone(row):
    return bool(np.all(np.diff(row[budgets].to_numpy(dtype=float)) <= 1e-12))
heads = {}
for s_ in contexts:
    hm = ra.head_max(certs[certs.S == s_]).head(n_massive)
    heads[s_] = hm.assign(monotone=hm.apply(monotone, axis=1))
massive = pd.concat(heads, names=["S"])
run.glue("n_massive_heads", int(n_massive))
run.record("massive_heads", massive.reset_index().to_dict(orient="list"))
for r, s_ in roles.items():
    mh = heads[s_]
    run.glue(f"massive_mono_{r}", int(mh["monotone"].sum()))
    top = mh.index[0]
    run.glue(f"massive_top_{r}", f"layer {top[0]}, query head {top[1]}")
    run.glue(f"massive_top_m0_{r}", float(mh.iloc[0][budgets[0]]))
    run.glue(f"massive_top_mL_{r}", float(mh.iloc[0][budgets[-1]]))
    worst = ra.head_max(certs[certs.S == s_])[budgets[-1]].idxmax()
    run.glue(f"worst_mL_{r}", f"layer {worst[0]}, query head {worst[1]}")
fig, ax = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.2), squeeze=False)
for i, s_ in enumerate(contexts):
    a = ax[0, i]
    for (layer, qh), row in heads[s_].iterrows():
        a.plot(budgets, row[budgets].to_numpy(dtype=float), marker="o", label=f"L{layer} h{qh}")
    a.plot(budgets, tab.loc[s_, "max_cert"].to_numpy(), color="k", lw=2, ls=":", label="max over all heads")
    a.axhline(tau, color="k", ls="--", lw=1)
    a.set_xscale("symlog", linthresh=1); a.set_xticks(budgets, budgets); a.set_yscale("log")
    a.set_xlabel("m"); a.set_ylabel("max certificate"); a.set_title(f"S = {s_}"); a.legend(fontsize=7)
fig.tight_layout()
run.glue_fig("fig_massive", fig)
display(fig)
massive.style.format({m_: "{:.3g}" for m_ in budgets})
"""),
        md(r"""
**Massive-activation heads.** The table follows, per context, the {glue:text}`n_massive_heads`
(layer, query head) pairs with the largest certificate without bypass: at $S$ = {glue:text}`S_long` the worst is
{glue:text}`massive_top_long` (max {glue:text}`massive_top_m0_long:.3g` at $m = 0$,
{glue:text}`massive_top_mL_long:.3g` at $m = 16$); at $S$ = {glue:text}`S_short` it is
{glue:text}`massive_top_short` ({glue:text}`massive_top_m0_short:.3g` → {glue:text}`massive_top_mL_short:.3g`).
Of these heads {glue:text}`massive_mono_short` (short context) and {glue:text}`massive_mono_long`
(long context) decrease monotonically with $m$ (column `monotone`). The largest certificate at
$m = 16$ (the dotted line, the maximum over all heads) belongs to {glue:text}`worst_mL_short` at
{glue:text}`S_short` and to {glue:text}`worst_mL_long` at {glue:text}`S_long`.
"""),
        hidden("""
ctx = " and ".join(str(s_) for s_ in contexts)
RUN = f"contexts run: S = {ctx}; {docs_per_domain} doc(s) per domain, layer stride {layer_stride}"
def seq(s_, col, fmt="{:.4f}"):
    return " -> ".join(fmt.format(float(tab.loc[(s_, m_), col])) for m_ in budgets)
mono = {s_: bool(np.all(np.diff(tab.loc[s_, "coverage"].to_numpy()) >= -1e-12)) for s_ in contexts}
rises = {s_: float(tab.loc[(s_, budgets[-1]), "coverage"]) > float(tab.loc[(s_, budgets[0]), "coverage"]) for s_ in contexts}
run.claim("witcert-real-coverage-budget",
          ours="; ".join(f"S={s_}: {seq(s_, 'coverage')}" for s_ in contexts) + f" (m = {budgets})",
          verdict="reproduced" if all(mono.values()) and all(rises.values()) else "differs",
          why=f"SmolLM2-135M, {RUN}; the no-bypass coverage is model-specific")
parts = []
for s_ in contexts:
    if zero[s_] is not None:
        mx0 = float(tab.loc[(s_, zero[s_]), "max_cert"])
        parts.append(f"S={s_}: coverage 1 from m = {zero[s_]}, max cert {mx0:.3g} ({tau / mx0:.2f}x below tau)")
    else:
        mL = budgets[-1]
        n_all = int((certs.S == s_).sum() // len(budgets))
        n_over = int(round((1 - float(tab.loc[(s_, mL), "coverage"])) * n_all))
        parts.append(f"S={s_}: none up to m = {mL} ({n_over} of {n_all} certificates above tau, max {float(tab.loc[(s_, mL), 'max_cert']):.3g})")
all_zero = all(zero[s_] is not None for s_ in contexts)
missing = [str(s_) for s_ in contexts if zero[s_] is None]
margins = [f"{tau / float(tab.loc[(s_, zero[s_]), 'max_cert']):.2f}x at S={s_}" for s_ in contexts if zero[s_] is not None]
run.claim("witcert-real-zero-fallback", ours="; ".join(parts),
          verdict="reproduced" if all_zero else "differs",
          why=RUN + ("" if all_zero else f"; no zero-fallback budget up to m = {budgets[-1]} at S = {', '.join(missing)}")
              + (f"; margin {', '.join(margins)} against the paper's 2.3x" if margins else ""))
m0 = budgets[0]
corr = {s_: float(tab.loc[(s_, m0), "fallback"]) < 0.8 * float(tab.loc[(s_, m0), "fallback_if_independent"]) for s_ in contexts}
group_ours = ("; ".join(f"S={s_}: any-of-3 fallback {tab.loc[(s_, m0), 'fallback']:.3f} vs {tab.loc[(s_, m0), 'fallback_if_independent']:.3f} "
                         f"(1 - c^3), {tab.loc[(s_, m0), 'fallback_if_independent_heads']:.3f} (per-head rates); "
                         f"phi within {tab.loc[(s_, m0), 'phi_within']:.2f} vs across {tab.loc[(s_, m0), 'phi_across']:.2f}"
                         for s_ in contexts) + f" (m = {m0})")
pos = all(float(tab.loc[(s_, m0), "phi_within"]) > float(tab.loc[(s_, m0), "phi_across"]) for s_ in contexts)
run.claim("witcert-real-group-correlation", ours=group_ours,
          verdict="reproduced" if all(corr.values()) else "differs",
          why=f"groups of 3 query heads (SmolLM2), not 6; {RUN}"
              + ("" if all(corr.values()) else
                 "; exceedances " + ("are positively correlated within a KV group (phi above the across-group value), but "
                                     if pos else "are not more correlated within a KV group than across, and ")
                 + "at this coverage almost every group has some head above tau, so the any-of-3 fallback stays near the independence prediction"))
dec = {s_: bool(np.all(np.diff(tab.loc[s_, "max_cert"].to_numpy()) <= 1e-12)) for s_ in contexts}
run.claim("witcert-real-massive-heads",
          ours="; ".join(f"S={s_}: max 1-B/A {seq(s_, 'max_cert', '{:.3g}')}, max A {seq(s_, 'max_A', '{:.3g}')}, "
                         f"{int(heads[s_]['monotone'].sum())}/{len(heads[s_])} worst heads monotone" for s_ in contexts),
          verdict="reproduced" if all(dec.values()) else "differs",
          why="our certificate 1-B/A is a TV bound, at most 1; the paper's 1.6e2 can only be an unnormalised quantity, "
              f"so we compare the monotone collapse (offline capture, not generation); {RUN}")
if len(contexts) > 1:
    lo, hi = contexts[0], contexts[-1]
    dc = float(tab.loc[(hi, m0), "coverage"] - tab.loc[(lo, m0), "coverage"])
    slow = abs(dc) <= 0.05
    run.claim("witcert-real-coverage-context",
              ours=f"{lo} -> {hi} tokens (m = {m0}): coverage {tab.loc[(lo, m0), 'coverage']:.3f} -> {tab.loc[(hi, m0), 'coverage']:.3f}, "
                   f"fallback {tab.loc[(lo, m0), 'fallback']:.3f} -> {tab.loc[(hi, m0), 'fallback']:.3f}; "
                   f"m = {budgets[-1]}: coverage {tab.loc[(lo, budgets[-1]), 'coverage']:.4f} -> {tab.loc[(hi, budgets[-1]), 'coverage']:.4f}",
              verdict="reproduced" if slow else "differs",
              why=f"a {hi / lo:g}x longer context within SmolLM2's native window; slow taken as |change| <= 5 points; {RUN}"
                  + ("" if slow else f"; coverage moved {dc:+.3f}"))
run.claims_table()
"""),
        md(r"""
**Verdict.** The tables answer the questions for SmolLM2 at both context lengths: where coverage
saturates (the zero-fallback budget, if any, and its margin), whether the 4× longer context moves
it, how strongly exceedances cluster within a KV group once each head's own rate is accounted
for, whether the worst heads collapse monotonically with the bypass, and what each budget adds in
bytes. The certificates were computed from the model's own queries at a fixed token history, where
the theorem holds exactly.
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
from kvlib.publish import Run
from kvlib.analysis import fidelity as fid
from kvlib.analysis import real_activations as ra
from kvlib.formats.base import available_formats
from kvlib.hf.cache import make_cache
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
from kvlib.publish import Run
from kvlib.analysis import real_activations as ra
from kvlib.hf.model import truncated_model
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
