"""Paired 0/1 outcomes rebuilt from discordant counts, for checking a paper's paired statistics: the
McNemar variants on one table, the reconstruction of a reported paired-bootstrap interval, and what one
slice of n prompts can resolve (tasks_paired_stats)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlib.analysis.stats import mcnemar, paired_bootstrap_ci


def paired_outcomes(n: int, a_only: int, b_only: int) -> tuple[np.ndarray, np.ndarray]:
    """0/1 outcomes of systems a and b on n samples with the given discordant counts (a right and b wrong
    on ``a_only`` samples, the reverse on ``b_only``, both right on the rest)."""
    if min(n, a_only, b_only) < 0 or a_only + b_only > n:
        raise ValueError(f"paired_outcomes: need 0 <= a_only + b_only <= n, got n={n}, a_only={a_only}, "
                         f"b_only={b_only}")
    a, b = np.ones(n, dtype=int), np.ones(n, dtype=int)
    b[:a_only] = 0
    a[a_only : a_only + b_only] = 0
    return a, b


def mcnemar_variants(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """McNemar's p-value four ways: exact binomial, exact mid-p (ours), and statsmodels' chi-square with and
    without continuity correction on the same 2x2 table."""
    from statsmodels.stats.contingency_tables import mcnemar as sm_mcnemar

    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]])
    return {
        "exact (binomial)": mcnemar(a.astype(int), b.astype(int)),
        "exact mid-p": mcnemar(a.astype(int), b.astype(int), mid_p=True),
        "chi-square": float(sm_mcnemar(table, exact=False, correction=False).pvalue),
        "chi-square, continuity-corrected": float(sm_mcnemar(table, exact=False, correction=True).pvalue),
    }


def reconstruct_ci(paper: dict[str, tuple[float, float, float]], n: int, n_resamples: int, seed: int,
                   max_raw_only: int = 30) -> list[dict[str, Any]]:
    """For each config's reported (difference, low, high) in points on n prompts, the 0/1 reconstruction
    (reference-only vs raw-only discordant counts with the reported net loss) whose paired-bootstrap interval
    is closest to the reported one, with its largest endpoint error."""
    rows = []
    for name, (d_p, lo_p, hi_p) in paper.items():
        net = round(-d_p * n / 100)  # reference-only minus raw-only discordant count
        best = None
        for raw_only in range(0, max_raw_only + 1):
            ref, raw = paired_outcomes(n, net + raw_only, raw_only)
            d, lo_, hi_ = (100 * v for v in paired_bootstrap_ci(raw, ref, n_resamples, seed=seed))
            err = max(abs(lo_ - lo_p), abs(hi_ - hi_p))
            if best is None or err < best["error"]:
                best = dict(config=name, ref_only=net + raw_only, raw_only=raw_only, diff=d, low=lo_, high=hi_,
                            error=err, paper=f"{d_p:+.1f} [{lo_p:+.1f}, {hi_p:+.1f}]")
        rows.append(best)
    return rows


def slice_resolution(n: int, xs, n_resamples: int, seed: int) -> list[dict[str, Any]]:
    """For x silent failures among n prompts (reference right, format wrong; none the other way): McNemar's
    exact p and the upper end of the paired-bootstrap interval (points)."""
    res = []
    for x in xs:
        ref, fmt_ = paired_outcomes(n, int(x), 0)
        _, lo_, hi_ = paired_bootstrap_ci(fmt_, ref, n_resamples, seed=seed)
        res.append(dict(x=int(x), p=mcnemar(fmt_, ref), ci_high=100 * hi_))
    return res
