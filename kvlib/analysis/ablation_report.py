"""The 2x2 ablation of real_ablation (dither vs RTN x outlier bypass on SmolLM2-135M's captured K/V): the
error collection over the corpus, its figure, the gain ratios and the claims with the verdict sentence."""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvlib.analysis import corpus
from kvlib.analysis import real_activations as ra

NEUTRAL = 0.05  # |gain - 1| below 5 %: quality neutral


def collect_errors(cap_model, tok, S: int, docs_per_domain: int, layers: list[int], *, budgets: list[int],
                   n_layers: int, n_queries: int, delta_req: float, steps: int, seed: int) -> pd.DataFrame:
    """``ra.ablation_errors`` on the captured ``layers`` of every corpus sequence of S tokens, one frame with
    the document's domain and name."""
    frames = []
    for doc, ids in corpus.sequences(tok, S, per_domain=docs_per_domain):
        acts = ra.capture(cap_model, ids, layers)
        e = ra.ablation_errors(acts, m=budgets, n_layers=n_layers, n_queries=n_queries,
                               delta_req=delta_req, steps=steps, seed=seed)
        frames.append(e.assign(domain=doc.domain, doc=doc.name))
        del acts
    return pd.concat(frames, ignore_index=True)


def ablation_figure(errs: pd.DataFrame, budgets: list[int], S: int):
    """Per-(layer, head) error by budget and quantizer, and the mean error per layer."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    head = errs.groupby(["quantizer", "m", "layer", "q_head"], as_index=False)["rel_err"].mean()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    sns.boxplot(data=head, x="m", y="rel_err", hue="quantizer", hue_order=["dither", "rtn"], ax=ax[0], fliersize=2)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("bypassed pairs m (K and V)")
    ax[0].set_ylabel("mean ||o_hat - o|| / ||o|| per (layer, head)")
    per_layer = errs.groupby(["quantizer", "m", "layer"])["rel_err"].mean()
    for i, m_ in enumerate(budgets):
        for qn, ls in (("dither", "-"), ("rtn", "--")):
            r = per_layer.loc[(qn, m_)]
            ax[1].plot(r.index, r.values, marker="o" if qn == "dither" else "s", ms=3.5, ls=ls, color=f"C{i}",
                       label=f"{qn}, m={m_}")
    ax[1].set_yscale("log")
    ax[1].set_xlabel("layer")
    ax[1].set_ylabel("mean relative output error")
    ax[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"SmolLM2-135M, S = {S}, 8-bit K+V, real V")
    fig.tight_layout()
    return fig


def gains(tab: pd.DataFrame, budgets: list[int]):
    """Error ratios of the ablation table: RTN / dither per budget (> 1: dither better), no bypass / bypass
    per quantizer and budget (> 1: bypass better), and the memory increase of each budget over m = 0."""
    def ratio(a, b):
        return float(tab.loc[a, "err_mean"] / tab.loc[b, "err_mean"])

    dith = {m_: ratio(("rtn", m_), ("dither", m_)) for m_ in budgets}
    byp = {(qn, m_): ratio((qn, 0), (qn, m_)) for qn in ("dither", "rtn") for m_ in budgets if m_}
    mem = {m_: float(tab.loc[("dither", m_), "bytes_kv"] / tab.loc[("dither", 0), "bytes_kv"] - 1)
           for m_ in budgets if m_}
    return dith, byp, mem


def ablation_claims(dith: dict, byp: dict, mem: dict, budgets: list[int], m: int, S: int) -> tuple[list[dict], str]:
    """The dither and bypass claims (keyword arguments of ``Run.claim``) and the verdict sentence on the dither."""
    neutral = all(abs(g - 1) < NEUTRAL for g in dith.values())
    claims = [dict(claim_id="witcert-real-ablation-dither",
                   ours="RTN / dither error " + ", ".join(f"{dith[m_]:.3f}x (m={m_})" for m_ in budgets),
                   measured=float(max(abs(g - 1) for g in dith.values())),
                   why=f"quality neutral taken as within {NEUTRAL:.0%} of 1" + ("" if neutral else
                   f"; RTN's error is {min(dith.values()):.2f}x to {max(dith.values()):.2f}x the dither's "
                   f"(SmolLM2, S = {S})"))]
    m_small = min(m_ for m_ in budgets if m_)
    gain_small = byp[("dither", m_small)]
    gain_m = byp[("dither", m)]
    claims.append(dict(
        claim_id="witcert-real-ablation-bypass",
        ours=f"dither: {gain_small:.2f}x at m={m_small} (+{mem[m_small]:.1%} memory), {gain_m:.2f}x at m={m} "
             f"(+{mem[m]:.1%}); RTN: {byp[('rtn', m_small)]:.2f}x / {byp[('rtn', m)]:.2f}x",
        measured={"min_bypass_gain": float(min(byp.values())),
                  "bypass_over_dither_gain": float(gain_small / max(dith.values()))},
        why=("" if neutral else f"the dither gain, {max(dith.values()):.2f}x, is not zero here; ")
            + f"SmolLM2 d = 64, m = {m_small} is the paper's byte fraction, S = {S}"))
    lo, hi = min(dith.values()), max(dith.values())
    if neutral:
        vtext = "Dither is quality neutral here, as in the paper: the certificate costs no output quality."
    elif lo > 1:
        vtext = (f"Dither is not neutral here but better: RTN's error is {lo:.2f}x to {hi:.2f}x the dither's at the "
                 "same bytes. RTN's error is a fixed function of the value (a value below s/2 in a group with a large "
                 "amax is rounded to 0, i.e. deleted), a bias that does not average out over tokens; the dither's "
                 "error is independent of the value. The certificate costs no output quality.")
    elif hi < 1:
        vtext = (f"Dither costs output quality here: its error is {1 / hi:.2f}x to {1 / lo:.2f}x RTN's at the "
                 "same bytes.")
    else:
        vtext = f"The dither gain changes sign with the bypass ({lo:.2f}x to {hi:.2f}x)."
    return claims, vtext


def record_of_gains(dith: dict, byp: dict, mem: dict) -> dict[str, Any]:
    """The three gain dicts of ``gains`` with string keys, for the result file."""
    return {"dither_gain": {str(k): v for k, v in dith.items()},
            "bypass_gain": {f"{k[0]}_m{k[1]}": v for k, v in byp.items()},
            "memory_increase": {str(k): v for k, v in mem.items()}}
