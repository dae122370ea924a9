"""WitCert's real-activation measurements on SmolLM2: outlier-pair stability, coverage vs budget,
and the 2x2 ablation (dither vs RTN x outlier bypass) on attention output with real V.

Activations are captured offline with :func:`kvlib.hf.model.prefill_activations` (one cache-less
forward over a corpus sequence, fixed token history), so the certificate theorem applies exactly:
the probability is over the key dither of the layer being certified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from kvlib.certify.bound import (
    bypass_radius,
    certificate_from_scores,
    radius_multiplier,
    request_delta,
    score_radius,
    variance_proxy,
)
from kvlib.core.outliers import select_outlier_pairs
from kvlib.core.philox import dither
from kvlib.formats.dither_int8 import (
    dequantize_codes,
    dither_dequantize,
    dither_int8_bytes,
    dither_quantize,
    group_scales,
    quantize_codes,
)


def pair_ids(channels: torch.Tensor, d: int) -> set[int]:
    """RoPE pair indices (rotate-half: channel ``i`` and ``i + d/2`` are pair ``i``) of a channel set."""
    return {int(c) % (d // 2) for c in channels.flatten().tolist()}


def jaccard(a: set[int], b: set[int]) -> float:
    """``|a ∩ b| / |a ∪ b|`` (1.0 for two empty sets)."""
    return 1.0 if not (a or b) else len(a & b) / len(a | b)


def pair_stability(acts: dict[int, dict[str, torch.Tensor]], m: int = 8, calib: int | None = None) -> pd.DataFrame:
    """Top-``m`` energy pairs from the first half of the keys vs the second half, per (layer, kv head).

    ``acts[layer]["k"]`` is ``[1, Hkv, S, d]`` (post-RoPE). With ``calib`` the first set comes from
    the first ``calib`` tokens instead of the first half (a short calibration prefix held for a
    long sequence). Returns one row per (layer, kv_head) with the Jaccard index of the two pair sets.
    """
    rows = []
    for layer, a in sorted(acts.items()):
        k = a["k"][0]  # [Hkv, S, d]
        n_kv, S, d = k.shape
        half = S // 2
        cal = half if calib is None else calib
        if not isinstance(cal, int) or not 1 <= cal <= half:
            raise ValueError(f"calib must be an int in [1, S // 2 = {half}], got {calib!r}")
        for h in range(n_kv):
            first = pair_ids(select_outlier_pairs(k[h, :cal], m), d)
            second = pair_ids(select_outlier_pairs(k[h, half:], m), d)
            rows.append({"layer": layer, "kv_head": h, "jaccard": jaccard(first, second)})
    return pd.DataFrame(rows)


def query_positions(S: int, n: int) -> list[int]:
    """``n`` query positions spread evenly over the second half of a length-``S`` sequence."""
    return sorted({int(round(x)) for x in np.linspace(S // 2, S - 1, n)})


def dither_keys(x: torch.Tensor, xi: torch.Tensor, outlier_channels: torch.Tensor | None = None, *,
                group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(k_hat fp32 [S, d], scales fp16, outliers fp16 | None)`` of one dithered INT8 write and read.

    The same numbers as ``dither_dequantize(dither_quantize(x, ...))`` when ``xi`` is that write's
    Philox dither (:func:`kvlib.core.philox.dither`), which does not depend on the outlier budget: a budget
    sweep draws it once per (layer, kv head) instead of twice per budget (Philox in torch dominates).
    """
    x32 = x.to(torch.float32)
    d = x32.shape[-1]
    mask = None
    if outlier_channels is not None and outlier_channels.numel():
        mask = torch.zeros(d, dtype=torch.bool, device=x32.device)
        mask[outlier_channels] = True
    else:
        outlier_channels = None
    s16 = group_scales(x32, group, mask)
    if not bool(torch.isfinite(s16).all()):
        raise ValueError("x has values too large for an fp16 scale (amax / 126.5 > 65504)")
    k_hat = dequantize_codes(quantize_codes(x32, s16, xi, group, zero=mask), s16, xi, group)
    outliers = None
    if outlier_channels is not None:
        outliers = x32[:, outlier_channels].to(torch.float16)
        if not bool(torch.isfinite(outliers).all()):
            raise ValueError("an outlier channel of x overflows fp16")
        k_hat[:, outlier_channels] = outliers.to(torch.float32)
    return k_hat, s16, outliers


def certify_budget(acts: dict[int, dict[str, torch.Tensor]], budgets: Sequence[int], *, n_layers: int,
                   n_queries: int = 16, delta_req: float = 1e-2, steps: int = 256, group: int = 32,
                   seed: int = 0, calib: int | None = None) -> pd.DataFrame:
    """Certificates of real queries against dithered real keys, for each outlier budget ``m``.

    Per (layer, kv head) the ``m`` bypassed RoPE pairs are chosen once on a calibration prefix
    (``calib`` tokens, default the first half) and held fixed; keys are dithered INT8 with the
    bypassed channels in fp16 and excluded from the group amax. The query at position ``t`` is
    certified against keys ``0..t`` (causal), under the request-level allocation
    ``delta_loc = delta_req / (n_layers * Hq * steps)``. One row per (m, layer, query head, t).
    """
    rows = []
    for layer, a in sorted(acts.items()):
        q, k = a["q"][0], a["k"][0]  # [Hq, S, d], [Hkv, S, d]
        n_q, S, d = q.shape
        n_kv = k.shape[0]
        g = n_q // n_kv
        sm = d ** -0.5
        dloc = request_delta(delta_req, layers=n_layers, heads=n_q, steps=steps)
        pos = query_positions(S, n_queries)
        cal = S // 2 if calib is None else calib
        for h in range(n_kv):
            xi = dither(torch.arange(S), d, layer=layer, kv_head=h, seed=seed, side=0)  # one draw for all m
            k64 = k[h].double()
            # the queries and the exact attention weights do not depend on the budget: once per (head, t)
            qs = {t: q[h * g:(h + 1) * g, t].double() for t in pos}  # [g, d] each
            p_true = {t: torch.softmax((qs[t] @ k64[: t + 1].T) * sm, -1) for t in pos}
            for m in budgets:
                oc = select_outlier_pairs(k[h, :cal], m) if m else None
                khat, scales, outliers = dither_keys(k[h], xi, oc, group=group)
                khat = khat.double()
                for t in pos:
                    qh = qs[t]
                    z_hat = (qh @ khat[: t + 1].T) * sm
                    u = score_radius(qh, scales[: t + 1], sm_scale=sm, n=t + 1, delta=dloc, group=group,
                                     outlier_channels=oc,
                                     outliers=None if outliers is None else outliers[: t + 1])
                    c = certificate_from_scores(z_hat, u)
                    tv = 0.5 * (p_true[t] - torch.softmax(z_hat, -1)).abs().sum(-1)
                    for j in range(g):
                        rows.append({"m": m, "layer": layer, "kv_head": h, "q_head": h * g + j, "t": t,
                                     "cert": float(c.tv_bound[j]), "cert_one": float(c.tv_bound_one[j]),
                                     "A": float(c.A[j]),
                                     "tv_true": float(tv[j])})
    return pd.DataFrame(rows)


def budget_table(certs: pd.DataFrame, *, tau: float = 0.2, d: int = 64, group: int = 32,
                 col: str = "cert") -> pd.DataFrame:
    """Per budget ``m``: coverage at ``tau``, measured any-of-group fallback, the independence
    prediction ``1 - coverage^g``, max certificate, and key bytes per token per head."""
    out = []
    for m, df in certs.groupby("m"):
        ok = np.isfinite(df[col]) & (df[col] <= tau)
        cov = float(ok.mean())
        grp = df.assign(over=~ok).groupby(["layer", "kv_head", "t", *(["doc"] if "doc" in df else [])])["over"].any()
        g = int(df.groupby(["layer", "kv_head"])["q_head"].nunique().max())
        fin = df[col][np.isfinite(df[col])]
        out.append({"m": int(m), "coverage": cov, "fallback": float(grp.mean()),
                    "fallback_if_independent": 1.0 - cov ** g, "max_cert": float(fin.max()) if len(fin) else np.inf,
                    "max_A": float(df["A"].max()) if "A" in df else np.nan,
                    "overflow": float((~np.isfinite(df[col])).mean()),
                    "violations": int((df["tv_true"] > df[col]).sum()),
                    "key_bytes": dither_int8_bytes(d, group, 2 * int(m))})
    return pd.DataFrame(out).set_index("m")


def _exceeds(df: pd.DataFrame, tau: float, col: str) -> pd.Series:
    """True where a certificate is above ``tau`` or not finite (overflow counts as no guarantee)."""
    return ~(np.isfinite(df[col]) & (df[col] <= tau))


def group_exceedance(certs: pd.DataFrame, *, tau: float = 0.2, col: str = "cert") -> pd.DataFrame:
    """How the exceedances of the query heads that share a KV head co-occur, per budget ``m``.

    Columns: ``fallback`` (measured: some head of the group exceeds ``tau``, over (layer, kv head,
    t[, doc])); ``fallback_if_independent`` (``1 - coverage^g`` from the pooled coverage, the
    paper's comparison); ``fallback_if_independent_heads`` (the same with each head's own exceedance
    rate, so that heads which simply differ in rate do not pass for correlation); ``phi_within`` and
    ``phi_across``: Pearson (phi) correlation of the exceedance indicators of two query heads of the
    same KV head, and of two heads of different KV heads of the same layer, after removing each
    (layer, head) rate (NaN where no head varies).
    """
    keys = ["layer", "t", *(["doc"] if "doc" in certs else [])]
    out = []
    for m, df in certs.groupby("m"):
        over = _exceeds(df, tau, col)
        d = df.assign(over=over.astype(float))
        g = int(d.groupby(["layer", "kv_head"])["q_head"].nunique().max())
        grp_keys = ["layer", "kv_head", *keys[1:]]
        fallback = float(d.groupby(grp_keys)["over"].max().mean())
        rate = d.groupby(["layer", "q_head"])["over"].transform("mean")
        p_ok = (1.0 - rate).groupby([d[k] for k in grp_keys]).prod()
        wide = d.assign(c=d["over"] - rate).pivot_table(index=keys, columns="q_head", values="c", aggfunc="first")
        head_kv = d.groupby("q_head")["kv_head"].first()
        x = wide.fillna(0.0).to_numpy()
        ss = (x * x).sum(0)
        within, across = [], []
        cols = list(wide.columns)
        for i in range(len(cols)):
            for j in range(i + 1, len(cols)):
                if ss[i] == 0 or ss[j] == 0:
                    continue
                r = float((x[:, i] * x[:, j]).sum() / math.sqrt(ss[i] * ss[j]))
                (within if head_kv[cols[i]] == head_kv[cols[j]] else across).append(r)
        cov = 1.0 - float(over.mean())
        out.append({"m": int(m), "fallback": fallback, "fallback_if_independent": 1.0 - cov ** g,
                    "fallback_if_independent_heads": float((1.0 - p_ok).mean()),
                    "phi_within": float(np.mean(within)) if within else math.nan,
                    "phi_across": float(np.mean(across)) if across else math.nan,
                    "pairs_within": len(within), "pairs_across": len(across)})
    return pd.DataFrame(out).set_index("m")


def head_max(certs: pd.DataFrame, *, col: str = "cert") -> pd.DataFrame:
    """Maximum certificate per (layer, query head) over positions (and documents), one column per
    budget ``m``, rows sorted by the smallest budget's maximum, largest first: the top rows are the
    massive-activation heads. Overflow (inf) stays inf."""
    mx = certs.groupby(["layer", "q_head", "m"])[col].max().unstack("m")
    return mx.sort_values(mx.columns.min(), ascending=False)


def capture(model: Any, ids: torch.Tensor, layers: Sequence[int] | None = None,
            keep: Sequence[str] = ("q", "k", "v")) -> dict[int, dict[str, torch.Tensor]]:
    """Post-RoPE q, k, v per layer of one cache-less forward over ``ids`` (``[S]`` or ``[1, S]``).

    Runs the decoder stack only: no LM head (at 8k tokens its logits are 0.5 TFLOP and 1.6 GB that
    nobody reads) and no layer after the last one asked for (:func:`kvlib.hf.model.truncated_model`).
    The captured tensors equal those of :func:`kvlib.hf.model.prefill_activations`. ``keep`` names the tensors
    returned (and kept in the on-disk store of model computations, :mod:`kvlib.hf.memo`: a capture of these ids,
    layers and tensors made before is read back, bit for bit, instead of recomputed).
    """
    from kvlib.hf.model import capture_qkv, instrument, truncated_model

    if ids.ndim == 1:
        ids = ids[None]
    n = model.config.num_hidden_layers
    if layers is not None:
        layers = sorted({int(i) for i in layers})
        if not layers or layers[0] < 0 or layers[-1] >= n:
            raise ValueError(f"layers must be a non-empty set of layer indices in [0, {n}), got {layers!r}")
    from kvlib.hf.memo import memoized
    from kvlib.hf.model import _kvlib_sdpa, observe

    keep = sorted({str(x) for x in keep})
    if not keep or not set(keep) <= {"q", "k", "v"}:
        raise ValueError(f"keep must name some of 'q', 'k', 'v', got {keep!r}")

    def compute() -> dict[str, torch.Tensor]:
        m = instrument(model)
        if layers is not None and layers[-1] + 1 < n:
            m = truncated_model(m, layers[-1] + 1)  # later layers cannot change the captured ones
        with torch.no_grad(), capture_qkv(layers) as acts:
            m.model(input_ids=ids.to(m.device), use_cache=False)
        return {f"{i}.{name}": t for i, d in acts.items() for name, t in d.items() if name in keep}

    # the model's own activations of these exact token ids (kept on disk: no kvlib format or kernel enters them)
    code = (compute, instrument, capture_qkv, observe, _kvlib_sdpa, truncated_model)
    out, _, _ = memoized("capture_qkv", model, {"ids": ids, "layers": layers, "keep": keep}, code, compute)
    acts: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in out.items():
        i, name = key.split(".")
        acts.setdefault(int(i), {})[name] = t.to(model.device)
    return dict(sorted(acts.items()))


def outlier_table(model: Any, ids: torch.Tensor, m: int) -> torch.Tensor:
    """int64 ``[L, Hkv, 2m]``: per (layer, kv head) the ``m`` highest-energy RoPE pairs of the keys
    of ``ids`` (a calibration prefix ``[S]``, ``[1, S]``, or a batch ``[B, S]`` whose rows are pooled: one table
    for a batched cache), for ``make_cache(..., outlier_table=...)``."""
    return outlier_tables(model, ids, [m])[m]


def outlier_tables(model: Any, ids: torch.Tensor, ms: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{m: outlier_table(model, ids, m)}`` for every budget of ``ms`` from one capture of ``ids`` (the
    forward is the cost; the tables are the same as one :func:`outlier_table` call per budget)."""
    ms = [int(m) for m in ms]
    if not ms:
        return {}
    acts = capture(model, ids, keep=("k",))
    # [B, Hkv, S, d] -> [B*S, Hkv, d]: the pair energies summed over every calibration token of every row
    keys = [acts[i]["k"].transpose(1, 2).flatten(0, 1) for i in sorted(acts)]
    return {m: torch.stack([select_outlier_pairs(k, m) for k in keys]) for m in ms}


# ----------------------------------------------------------------------------------------------
# the 2x2 ablation: quantizer (dither / RTN) x outlier bypass, on real attention output with real V
QUANTIZERS = ("dither", "rtn")


def kv_bytes(d: int, m: int, group: int = 32) -> int:
    """K+V bytes per token per head of the ablation layout: each side ``d`` int8 codes, ``d/group``
    fp16 scales and ``m`` bypassed pairs (``2m`` fp16 values). The per-head channel set is not per token."""
    return 2 * dither_int8_bytes(d, group, 2 * m)


def _causal(z: torch.Tensor, pos: torch.Tensor, fill: float) -> torch.Tensor:
    """Scores ``[..., nq, S]`` with keys after each query position ``pos [nq]`` set to ``fill``."""
    future = torch.arange(z.shape[-1], device=z.device)[None, :] > pos[:, None]
    return z.masked_fill(future, fill)


def ablation_errors(acts: dict[int, dict[str, torch.Tensor]], *, m: int | Sequence[int] = 16, n_layers: int,
                    n_queries: int = 16, delta_req: float = 1e-2, steps: int = 256, group: int = 32,
                    seed: int = 0, calib: int | None = None,
                    quantizers: Sequence[str] = QUANTIZERS) -> pd.DataFrame:
    """WitCert's 2x2 ablation on captured activations: relative attention-output error with real V.

    For each quantizer (``"dither"``: subtractive Philox dither; ``"rtn"``: the same layout and
    scale rule with ``xi = 0``, i.e. round to nearest) and each bypass budget (0 and ``m``), K and V
    are stored 8-bit; with a budget the ``m`` highest-energy channel pairs of K and of V (chosen once
    on the calibration prefix, ``calib`` tokens, default the first half) stay fp16 and leave the
    group amax. The query at position ``t`` attends causally to ``0..t``; the row reports
    ``||o_hat - o|| / ||o||`` (float64), the true TV of the attention weights and, for dither only,
    the certificate ``1 - B/A`` with the request-level ``delta_loc`` (NaN for RTN: its error is a
    deterministic function of the keys, so the certificate's hypothesis does not hold).
    One row per (quantizer, m, layer, query head, t).
    """
    budgets = sorted({0, *([m] if isinstance(m, int) else m)})
    for q_name in quantizers:
        if q_name not in QUANTIZERS:
            raise ValueError(f"quantizers must be among {QUANTIZERS}, got {q_name!r}")
    rows: list[dict[str, Any]] = []
    for layer, a in sorted(acts.items()):
        q, k, v = a["q"][0], a["k"][0], a["v"][0]  # [Hq, S, d], [Hkv, S, d], [Hkv, S, d]
        n_q, S, d = q.shape
        n_kv = k.shape[0]
        g = n_q // n_kv
        sm = d ** -0.5
        dloc = request_delta(delta_req, layers=n_layers, heads=n_q, steps=steps)
        pos = torch.tensor(query_positions(S, n_queries))
        mult = radius_multiplier(pos + 1, dloc, d)[:, None]  # [nq, 1]: union bound over t + 1 keys
        cal = S // 2 if calib is None else calib
        for h in range(n_kv):
            qh = q[h * g:(h + 1) * g, pos].double()  # [g, nq, d]
            kh, vh = k[h].double(), v[h].double()
            p = torch.softmax(_causal(qh @ kh.T * sm, pos, -math.inf), -1)  # [g, nq, S]
            o = p @ vh
            o_norm = o.norm(dim=-1)
            for mm in budgets:
                oc_k = select_outlier_pairs(k[h, :cal], mm) if mm else None
                oc_v = select_outlier_pairs(v[h, :cal], mm) if mm else None
                for q_name in quantizers:
                    ctx = dict(layer=layer, kv_head=h, slots=torch.arange(S), seed=seed, group=group,
                               dithered=q_name == "dither")
                    qk = dither_quantize(k[h], outlier_channels=oc_k, side=0, **ctx)
                    qv = dither_quantize(v[h], outlier_channels=oc_v, side=1, **ctx)
                    z_hat = qh @ dither_dequantize(qk).double().T * sm
                    p_hat = torch.softmax(_causal(z_hat, pos, -math.inf), -1)
                    o_hat = p_hat @ dither_dequantize(qv).double()
                    rel = (o_hat - o).norm(dim=-1) / o_norm  # [g, nq]
                    tv = 0.5 * (p_hat - p).abs().sum(-1)
                    cert = torch.full_like(rel, math.nan)
                    if q_name == "dither":
                        u = variance_proxy(qh, qk.scales, sm_scale=sm, group=group,
                                           outlier_channels=qk.outlier_channels).sqrt() * mult
                        if qk.outliers is not None:
                            u = u + bypass_radius(qh, qk.outliers, qk.outlier_channels, sm_scale=sm)
                        # future keys: a finite, hugely negative score carries no weight in A or B
                        cert = certificate_from_scores(_causal(z_hat, pos, -1e300), u).tv_bound
                    for j in range(g):
                        for i, t in enumerate(pos.tolist()):
                            rows.append({"quantizer": q_name, "m": mm, "layer": layer, "kv_head": h,
                                         "q_head": h * g + j, "t": t, "rel_err": float(rel[j, i]),
                                         "tv_true": float(tv[j, i]), "cert": float(cert[j, i])})
    return pd.DataFrame(rows)


def ablation_table(errs: pd.DataFrame, *, tau: float = 0.2, d: int = 64, group: int = 32) -> pd.DataFrame:
    """Per (quantizer, m): relative output error (mean, median, p90, p99, max over rows, and the mean
    of the per-(layer, head) means), coverage at ``tau`` and certificate violations (dither only),
    and K+V bytes per token per head."""
    out = []
    for (q_name, mm), df in errs.groupby(["quantizer", "m"], sort=False):
        e = df["rel_err"]
        per_head = df.groupby(["layer", "q_head"])["rel_err"].mean()
        c = df["cert"]
        certified = bool(c.notna().any())  # RTN rows carry NaN: no certificate exists for them
        ok = np.isfinite(c) & (c <= tau)
        out.append({"quantizer": q_name, "m": int(mm), "err_mean": float(e.mean()), "err_median": float(e.median()),
                    "err_p90": float(e.quantile(0.9)), "err_p99": float(e.quantile(0.99)), "err_max": float(e.max()),
                    "head_mean_max": float(per_head.max()),
                    "coverage": float(ok.mean()) if certified else np.nan,
                    "max_cert": float(c[np.isfinite(c)].max()) if np.isfinite(c).any() else np.nan,
                    "violations": int((df["tv_true"] > c).sum()) if certified else -1,
                    "bytes_kv": kv_bytes(d, int(mm), group)})
    return pd.DataFrame(out).set_index(["quantizer", "m"])
