"""The synthetic studies of the WitCert certificate notebooks: fallback whole head or block by block
(witcert_fallback), and stochastic rounding against dither and long context (witcert_sr_long)."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlib.certify.bound import certificate_from_scores, certify_trials, coverage, score_radius
from kvlib.certify.fallback import block_fallback, fp16_radius
from kvlib.core.outliers import select_outlier_pairs
from kvlib.formats.dither_int8 import dither_dequantize, dither_quantize


def exact_gqa_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of ``q [B, hq, d]`` over the keys/values ``[n, hkv, d]`` at ``slots [B, S]``
    (query head h reads KV head h // (hq / hkv)): the reference a fallback's output is compared with."""
    B, hq, d = q.shape
    gqa = hq // K.shape[1]
    exact_o = torch.zeros(B, hq, V.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(hq):
            kk, vv = K[slots[b], h // gqa].double(), V[slots[b], h // gqa].double()
            exact_o[b, h] = torch.softmax(q[b, h].double() @ kk.T / math.sqrt(d), -1) @ vv
    return exact_o


def block_fallback_rows(kk: torch.Tensor, qs: torch.Tensor, *, tau: float, delta: float, block: int,
                        max_rows: int, seed: int) -> list[dict[str, Any]]:
    """One head's keys ``kk [S, d]`` dither-quantised (``seed``); for each query of ``qs`` whose certificate
    exceeds ``tau``, the blocks of ``block`` tokens paged in fp16 (K and V) until it meets ``tau``, and the
    traffic against paging the whole head; at most ``max_rows`` rows."""
    S_block, d = kk.shape
    sm = 1 / math.sqrt(d)
    qt = dither_quantize(kk, layer=0, kv_head=0, slots=torch.arange(S_block), seed=seed)
    k_hat = dither_dequantize(qt).double()
    k16 = kk.half()
    res = []
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
        if len(res) >= max_rows:
            break
    return res


def sr_dither_coverage(k: torch.Tensor, q: torch.Tensor, *, budgets: list[int], trials: int, delta: float,
                       tau: float, seed: int) -> list[dict[str, Any]]:
    """Coverage at ``tau`` and the certificate's median / max for dither and stochastic rounding at each
    outlier budget m (pairs), with the count of trials whose TV exceeded the certificate."""
    cov = []
    for m in budgets:
        oc = select_outlier_pairs(k, m) if m else None
        for scheme in ("dither", "sr"):
            r = certify_trials(k, q, trials=trials, deltas=(delta,), seed0=seed + 11, outlier_channels=oc,
                               scheme=scheme)
            c = r["cert"][0]
            cov.append({"m": m, "scheme": scheme, "coverage": coverage(c, tau), "median cert": float(c.median()),
                        "max cert": float(c.max()), "TV > cert": int((r["tv"] > c).sum())})
    return cov


def long_context_rows(contexts: list[int], d: int, *, q_scale: float, rows: int, delta_request: float,
                      tau: float, seed: int, generator: torch.Generator) -> list[dict[str, Any]]:
    """At each context S, Gaussian keys and queries (drawn from ``generator``) certified with a per-row
    delta of 1e-2 and with the request-level ``delta_request``: coverage, median certificate and radius."""
    long = []
    for n in contexts:
        kk = torch.randn(n, d, generator=generator)
        qq = q_scale * torch.randn(rows, d, generator=generator)
        for alloc, dl in (("per-row 1e-2", 1e-2), ("request-level", delta_request)):
            r = certify_trials(kk, qq, trials=1, deltas=(dl,), seed0=seed + n)
            c = r["cert"][0]
            qt = dither_quantize(kk, layer=0, kv_head=0, slots=torch.arange(n), seed=seed + n)
            u = score_radius(qq.double(), qt.scales, sm_scale=1 / math.sqrt(d), n=n, delta=dl)
            long.append({"S": n, "allocation": alloc, "coverage": coverage(c, tau), "median cert": float(c.median()),
                         "median radius": float(u.median()), "TV > cert": int((r["tv"] > c).sum())})
    return long


def soundness_trials(families, S: int, d: int, *, rows: int, trials: int, q_scale: float, deltas: list[float],
                     seed: int, generator: torch.Generator):
    """For each key family of ``synthetic_keys`` (keys and ``rows`` queries drawn from ``generator``),
    ``trials`` dither draws certified at each delta: the raw results per family, and one row per (family,
    delta) with the certificate's violations (TV > cert) and the failures of its concentration event, each
    with an exact 95% upper bound on its rate."""
    from scipy.stats import binomtest

    from kvlib.certify.bound import synthetic_keys

    res, table = {}, []
    for fam in families:
        k = synthetic_keys(fam, S, d, generator=generator)
        q = q_scale * torch.randn(rows, d, generator=generator)
        r = certify_trials(k, q, trials=trials, deltas=tuple(deltas), seed0=seed * 1000 + 1)
        res[fam] = r
        n = r["tv"].numel()
        for i, dl in enumerate(deltas):
            viol = int((r["tv"] > r["cert"][i]).sum())
            ev = int(r["event"][i].sum())
            ci_v = binomtest(viol, n).proportion_ci(method="exact")
            ci_e = binomtest(ev, n).proportion_ci(method="exact")
            table.append({"keys": fam, "delta": dl, "pairs": n, "TV > cert": viol, "rate": viol / n,
                          "rate 95% hi": ci_v.high, "event fails": ev, "event rate": ev / n,
                          "event 95% hi": ci_e.high})
    return res, table
