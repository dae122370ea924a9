"""WitCert's real-activation measurements on SmolLM2: outlier-pair stability and coverage vs budget.

Activations are captured offline with :func:`kvlib.model.prefill_activations` (one cache-less
forward over a corpus sequence, fixed token history), so the certificate theorem applies exactly:
the probability is over the key dither of the layer being certified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from kvlib.certificate import certificate_from_scores, request_delta, score_radius
from kvlib.formats.dither_int8 import dither_dequantize, dither_int8_bytes, dither_quantize
from kvlib.outliers import select_outlier_pairs


def pair_ids(channels: torch.Tensor, d: int) -> set[int]:
    """RoPE pair indices (rotate-half: channel ``i`` and ``i + d/2`` are pair ``i``) of a channel set."""
    return {int(c) % (d // 2) for c in channels.flatten().tolist()}


def jaccard(a: set[int], b: set[int]) -> float:
    """``|a ∩ b| / |a ∪ b|`` (1.0 for two empty sets)."""
    return 1.0 if not (a or b) else len(a & b) / len(a | b)


def pair_stability(acts: dict[int, dict[str, torch.Tensor]], m: int = 8) -> pd.DataFrame:
    """Top-``m`` energy pairs from the first half of the keys vs the second half, per (layer, kv head).

    ``acts[layer]["k"]`` is ``[1, Hkv, S, d]`` (post-RoPE). Returns one row per (layer, kv_head)
    with the Jaccard index of the two pair sets.
    """
    rows = []
    for layer, a in sorted(acts.items()):
        k = a["k"][0]  # [Hkv, S, d]
        n_kv, S, d = k.shape
        half = S // 2
        for h in range(n_kv):
            first = pair_ids(select_outlier_pairs(k[h, :half], m), d)
            second = pair_ids(select_outlier_pairs(k[h, half:], m), d)
            rows.append({"layer": layer, "kv_head": h, "jaccard": jaccard(first, second)})
    return pd.DataFrame(rows)


def query_positions(S: int, n: int) -> list[int]:
    """``n`` query positions spread evenly over the second half of a length-``S`` sequence."""
    return sorted({int(round(x)) for x in np.linspace(S // 2, S - 1, n)})


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
            for m in budgets:
                oc = select_outlier_pairs(k[h, :cal], m) if m else None
                qt = dither_quantize(k[h], layer=layer, kv_head=h, slots=torch.arange(S), seed=seed, group=group,
                                     outlier_channels=oc)
                khat = dither_dequantize(qt).double()
                for t in pos:
                    qh = q[h * g:(h + 1) * g, t].double()  # [g, d]
                    z_hat = (qh @ khat[: t + 1].T) * sm
                    u = score_radius(qh, qt.scales[: t + 1], sm_scale=sm, n=t + 1, delta=dloc, group=group,
                                     outlier_channels=qt.outlier_channels,
                                     outliers=None if qt.outliers is None else qt.outliers[: t + 1])
                    z = (qh @ k[h, : t + 1].double().T) * sm
                    c = certificate_from_scores(z_hat, u)
                    tv = 0.5 * (torch.softmax(z, -1) - torch.softmax(z_hat, -1)).abs().sum(-1)
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


def capture(model: Any, ids: torch.Tensor, layers: Sequence[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Post-RoPE q, k, v per layer of one cache-less forward over ``ids`` (thin wrapper)."""
    from kvlib.model import prefill_activations

    return prefill_activations(model, ids, layers)


def outlier_table(model: Any, ids: torch.Tensor, m: int) -> torch.Tensor:
    """int64 ``[L, Hkv, 2m]``: per (layer, kv head) the ``m`` highest-energy RoPE pairs of the keys
    of ``ids`` (a calibration prefix), for ``make_cache(..., outlier_table=...)``."""
    acts = capture(model, ids)
    return torch.stack([select_outlier_pairs(acts[i]["k"][0].transpose(0, 1), m) for i in sorted(acts)])
