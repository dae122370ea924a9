"""The s/2 bound of the dithered INT8 write checked on inputs (witcert_contract_bound): violations at fp32
read and in exact arithmetic, ties, clipping and the fp32-scale bug; the error's uniformity against RTN; and
the score-error proxy with outlier pairs kept in or excluded from the amax."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from kvlib.core.philox import dither
from kvlib.formats.dither_int8 import BOUND_SLACK, dither_dequantize, dither_quantize, residual


def bound_row(name: str, x: torch.Tensor, ctx: dict[str, Any]) -> dict[str, Any]:
    """One input ``x [n, d]`` written with ``dither_quantize(x, **ctx)`` (``ctx``: layer, kv_head, slots, seed,
    group): bound violations read in fp32 (beyond the slack, and strict), the exact-arithmetic excess and how
    much of it lies off fp32 ties of x/s + xi, clipping, and the same counts with the fp32-scale bug."""
    group, d = ctx["group"], x.shape[-1]
    qt = dither_quantize(x, **ctx)
    eps, s = residual(x, qt)  # exact (float64) error in units of s
    k_hat = dither_dequantize(qt)  # what a reader computes in fp32
    xi = dither(ctx["slots"], d, layer=ctx["layer"], kv_head=ctx["kv_head"], seed=ctx["seed"])
    y = x / qt.scales.float().repeat_interleave(group, -1) + xi
    tie = (y - torch.floor(y)) == 0.5
    viol_exact = eps.abs() > 0.5
    bad = dither_quantize(x, **ctx, quantize_scale="fp32")
    eps_bad, _ = residual(x, bad)
    k_bad = dither_dequantize(bad)
    err_read = (k_hat.double() - x.double()).abs()
    return {
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
    }


def uniformity(x: torch.Tensor, ctx: dict[str, Any], seed: int, n_rep: int):
    """Dither against RTN on the same layout and scales: KS tests against U(-1/2, 1/2) and correlations on a
    200k sample, and the same key vector stored at ``n_rep`` slots (dither errors vary, RTN's repeat).
    Returns the table (rows: statistic, columns: dither, RTN) and the arrays the figure draws."""
    from scipy import stats

    qd = dither_quantize(x, **ctx)
    qr = dither_quantize(x, **ctx, dithered=False)  # RTN on the same layout and scales
    eps_d, s = residual(x, qd)
    eps_r, _ = residual(x, qr)
    u = (x.double() / s).numpy().ravel()
    frac = u - np.round(u)  # RTN's error is a function of this: eps = -frac

    def ks(e):
        return stats.kstest(e, stats.uniform(loc=-0.5, scale=1).cdf)

    sub = np.random.default_rng(seed).choice(eps_d.numel(), size=min(eps_d.numel(), 200_000), replace=False)
    ed, er = eps_d.numpy().ravel(), eps_r.numpy().ravel()
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
    return uni, dict(frac=frac, ed=ed, er=er, sub=sub, e_rep_d=e_rep_d, e_rep_r=e_rep_r)


def uniformity_figure(a: dict[str, Any]):
    """Error against the input, its marginal, and one key at many slots (``a``: arrays of ``uniformity``)."""
    import matplotlib.pyplot as plt

    frac, ed, er, sub = a["frac"], a["ed"], a["er"], a["sub"]
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
    ax[2].hist(a["e_rep_d"][:, :8].numpy().ravel(), bins=bins, density=True, histtype="step", lw=1.5, label="dither")
    ax[2].hist(a["e_rep_r"][:, :8].numpy().ravel(), bins=bins, density=True, histtype="step", lw=1.5, label="RTN",
               color="C3")
    ax[2].set(xlabel="error / s", ylabel="density (log)", title="one key at many slots (8 channels)", yscale="log")
    ax[2].legend()
    fig.tight_layout()
    return fig


def amax_summary(name: str, x: torch.Tensor, q: torch.Tensor, ctx: dict[str, Any], **kw) -> dict[str, Any]:
    """Mean scale, mean score-error proxy varsigma_t = sqrt(sigma^2/12 sum_c q_c^2 s_c^2) over the dithered
    channels (sigma = d^-1/2), and clipped non-outlier coordinates, for ``dither_quantize(x, **ctx, **kw)``."""
    d, group = x.shape[-1], ctx["group"]
    sigma = d**-0.5
    qt = dither_quantize(x, **ctx, **kw)
    s = qt.scales.double().repeat_interleave(group, -1)
    keep = torch.ones(d, dtype=torch.bool)
    if qt.outlier_channels is not None:
        keep[qt.outlier_channels] = False
    vs = (sigma**2 / 12 * (q.double()[keep] ** 2 * s[:, keep] ** 2).sum(-1)).sqrt()
    eps, _ = residual(x, qt)
    return {"configuration": name, "mean scale": float(qt.scales.float().mean()),
            "mean varsigma_t": float(vs.mean()),
            "clipped (non-outlier)": int((eps[:, keep].abs() > 0.5 + 2**-16).sum())}
