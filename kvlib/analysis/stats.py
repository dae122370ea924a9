"""Paired statistics for task-level comparisons (WitCert Table 18 protocol).

Two configurations scored on the *same* prompts are compared through their per-sample
differences: a paired bootstrap CI for the mean difference (10^4 resamples, as in the
paper), McNemar's exact test for paired 0/1 outcomes, and rate CIs (Wilson or
Clopper-Pearson) for single proportions such as certificate flag rates.

When samples come in groups that are not independent (several prompts built from one
haystack, tokens of one rollout, requests of one path), pass ``groups``: the bootstrap
then resamples whole groups (cluster bootstrap), which keeps the within-group correlation
and gives honest, usually wider, intervals.

Interval method: ``"percentile"`` by default (the plain per-sample bootstrap of the paper,
well defined for the 0/1 scores and degenerate differences typical here); ``"BCa"`` is
available for the ungrouped case through :func:`scipy.stats.bootstrap`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.stats
from statsmodels.stats.contingency_tables import mcnemar as _sm_mcnemar

__all__ = [
    "bootstrap_mean_ci",
    "cluster_bootstrap_mean_ci",
    "compare_paired",
    "discordant_counts",
    "flag_rates",
    "mcnemar",
    "paired_table",
    "paired_bootstrap_ci",
    "proportion_ci",
]

_METHODS = ("percentile", "BCa")


# ----------------------------------------------------------------------------- validation
def _as_1d(x: Any, name: str) -> np.ndarray:
    """Return ``x`` as a finite 1-D float array, or raise naming ``name``."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a 1-D sequence of numbers, got {type(x).__name__}")
    try:
        arr = np.asarray(x, dtype=float)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a 1-D sequence of numbers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (found NaN or inf)")
    return arr


def _check_same_length(a: np.ndarray, b: np.ndarray, na: str = "a", nb: str = "b") -> None:
    if a.shape != b.shape:
        raise ValueError(f"{na} and {nb} must be paired samples of equal length, got {a.size} and {b.size}")


def _paired(a: Any, b: Any, as_array: Callable[[Any, str], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``a`` and ``b`` converted by ``as_array`` (:func:`_as_1d` or :func:`_as_binary`), equal lengths."""
    xa = as_array(a, "a")
    xb = as_array(b, "b")
    _check_same_length(xa, xb)
    return xa, xb


def _check_confidence(confidence: float) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float, np.floating)):
        raise TypeError(f"confidence must be a float in (0, 1), got {type(confidence).__name__}")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    return float(confidence)


def _check_resamples(n_resamples: int) -> int:
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, (int, np.integer)):
        raise TypeError(f"n_resamples must be an int, got {type(n_resamples).__name__}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    return int(n_resamples)


def _check_method(method: str) -> str:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    return method


def _as_binary(x: Any, name: str) -> np.ndarray:
    arr = _as_1d(x, name)
    if not np.all((arr == 0) | (arr == 1)):
        bad = arr[(arr != 0) & (arr != 1)][:3]
        raise ValueError(f"{name} must hold 0/1 outcomes only, found e.g. {bad.tolist()}")
    return arr.astype(np.int64)


def _group_codes(groups: Any, n: int) -> np.ndarray:
    """Map arbitrary group labels to codes ``0..G-1`` (order of first appearance)."""
    if isinstance(groups, (str, bytes)):
        raise TypeError("groups must be a 1-D sequence of labels, one per sample")
    labels = np.asarray(groups)
    if labels.ndim != 1:
        raise ValueError(f"groups must be 1-D, got shape {labels.shape}")
    if labels.size != n:
        raise ValueError(f"groups must have one label per sample ({n}), got {labels.size}")
    _, codes = np.unique(labels, return_inverse=True)
    return codes.reshape(-1)


# ----------------------------------------------------------------------------- bootstrap
def cluster_bootstrap_mean_ci(
    values: Sequence[float] | np.ndarray,
    groups: Sequence[Any] | np.ndarray,
    n_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Percentile CI of the overall mean, resampling whole groups with replacement.

    The statistic is the pooled mean (sum of resampled group sums over the number of
    resampled samples), so groups of unequal size are weighted by their size, exactly as
    the point estimate ``mean(values)`` is. Use it for bootstrap-over-paths CIs where the
    samples of one path (or one haystack, one request) must stay together.
    Returns ``(mean, low, high)``.
    """
    x = _as_1d(values, "values")
    confidence = _check_confidence(confidence)
    n_resamples = _check_resamples(n_resamples)
    codes = _group_codes(groups, x.size)
    n_groups = int(codes.max()) + 1
    if n_groups < 2:
        raise ValueError("groups must contain at least two distinct groups to resample")
    sums = np.bincount(codes, weights=x, minlength=n_groups)
    sizes = np.bincount(codes, minlength=n_groups).astype(float)
    point = float(x.mean())
    if np.ptp(x) == 0.0:
        return point, point, point
    rng = np.random.default_rng(seed)
    stats = np.empty(n_resamples)
    batch = max(1, 2_000_000 // n_groups)  # bound memory of the index matrix
    for start in range(0, n_resamples, batch):
        stop = min(n_resamples, start + batch)
        idx = rng.integers(0, n_groups, size=(stop - start, n_groups))
        stats[start:stop] = sums[idx].sum(axis=1) / sizes[idx].sum(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(stats, [alpha / 2, 1.0 - alpha / 2])
    return point, float(low), float(high)


def bootstrap_mean_ci(
    values: Sequence[float] | np.ndarray,
    n_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
    *,
    groups: Sequence[Any] | np.ndarray | None = None,
    method: str = "percentile",
) -> tuple[float, float, float]:
    """Bootstrap CI of ``mean(values)``; ``(mean, low, high)``.

    Without ``groups``: :func:`scipy.stats.bootstrap` over samples (``method`` percentile
    or BCa). With ``groups``: cluster bootstrap (:func:`cluster_bootstrap_mean_ci`,
    percentile only). A constant sample gives the degenerate interval at that constant.
    """
    x = _as_1d(values, "values")
    confidence = _check_confidence(confidence)
    n_resamples = _check_resamples(n_resamples)
    method = _check_method(method)
    if groups is not None:
        if method != "percentile":
            raise ValueError("method must be 'percentile' when groups are given")
        return cluster_bootstrap_mean_ci(x, groups, n_resamples, confidence, seed)
    point = float(x.mean())
    if x.size == 1 or np.ptp(x) == 0.0:
        return point, point, point
    res = scipy.stats.bootstrap(
        (x,),
        np.mean,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method=method,
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    ci = res.confidence_interval
    return point, float(ci.low), float(ci.high)


def paired_bootstrap_ci(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    n_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
    *,
    groups: Sequence[Any] | np.ndarray | None = None,
    method: str = "percentile",
) -> tuple[float, float, float]:
    """Paired bootstrap CI of ``mean(a - b)``; returns ``(mean_difference, low, high)``.

    ``a`` and ``b`` are per-sample scores of two configurations on the same samples.
    The bootstrap resamples the paired differences (so pairing is kept); with ``groups``
    it resamples whole groups. Percentile interval by default (see module docstring).
    """
    xa, xb = _paired(a, b, _as_1d)
    return bootstrap_mean_ci(xa - xb, n_resamples, confidence, seed, groups=groups, method=method)


# ----------------------------------------------------------------------------- tests on 0/1
def discordant_counts(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> tuple[int, int]:
    """Discordant pair counts ``(n_a_only, n_b_only)`` of paired 0/1 outcomes.

    ``n_a_only`` counts samples where ``a`` is right and ``b`` wrong (the paper's
    "McNemar: 5 vs 1" reads these two numbers).
    """
    xa, xb = _paired(a, b, _as_binary)
    return int(np.sum((xa == 1) & (xb == 0))), int(np.sum((xa == 0) & (xb == 1)))


def mcnemar(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray, *, mid_p: bool = False) -> float:
    """Exact two-sided McNemar p-value for paired 0/1 outcomes ``a`` and ``b``.

    Binomial test of the discordant counts against p = 1/2 (statsmodels, ``exact=True``);
    1.0 when there is no discordant pair. ``mid_p=True`` gives the mid-p variant
    (the exact p minus the probability of the observed count), less conservative.
    """
    xa, xb = _paired(a, b, _as_binary)
    table = np.array(
        [
            [np.sum((xa == 1) & (xb == 1)), np.sum((xa == 1) & (xb == 0))],
            [np.sum((xa == 0) & (xb == 1)), np.sum((xa == 0) & (xb == 0))],
        ]
    )
    if table[0, 1] + table[1, 0] == 0:
        return 1.0
    p = float(min(1.0, _sm_mcnemar(table, exact=True).pvalue))
    if mid_p:
        n_disc = int(table[0, 1] + table[1, 0])
        k = int(min(table[0, 1], table[1, 0]))
        p_obs = float(scipy.stats.binom.pmf(k, n_disc, 0.5))
        # two-sided: 2 * (P(X < k) + P(X = k) / 2); the two tails share the mode when k = n/2
        p = min(1.0, 2.0 * float(scipy.stats.binom.cdf(k, n_disc, 0.5)) - p_obs)
    return p


def proportion_ci(
    successes: int, n: int, confidence: float = 0.95, method: str = "wilson"
) -> tuple[float, float, float]:
    """Rate ``successes / n`` with its CI; ``(rate, low, high)``.

    ``method``: ``"wilson"`` (score interval, good coverage for moderate n) or
    ``"exact"`` (Clopper-Pearson, conservative); computed by
    :meth:`scipy.stats.binomtest(...).proportion_ci`.
    """
    for name, v in (("successes", successes), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, n={n}], got {successes}")
    confidence = _check_confidence(confidence)
    if method not in ("wilson", "exact", "wilsoncc"):
        raise ValueError(f"method must be 'wilson', 'wilsoncc' or 'exact', got {method!r}")
    ci = scipy.stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method=method)
    return successes / n, float(ci.low), float(ci.high)


def compare_paired(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    n_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
    *,
    groups: Sequence[Any] | np.ndarray | None = None,
) -> dict[str, float | int | None]:
    """One row of a paired comparison table: means, difference with CI, McNemar.

    ``mcnemar_p`` and the discordant counts are given when both score vectors are 0/1,
    else ``None``.
    """
    xa, xb = _paired(a, b, _as_1d)
    diff, low, high = paired_bootstrap_ci(xa, xb, n_resamples, confidence, seed, groups=groups)
    binary = bool(np.all(np.isin(xa, (0, 1))) and np.all(np.isin(xb, (0, 1))))
    n_a_only, n_b_only = discordant_counts(xa, xb) if binary else (None, None)
    return {
        "n": int(xa.size),
        "mean_a": float(xa.mean()),
        "mean_b": float(xb.mean()),
        "diff": diff,
        "low": low,
        "high": high,
        "n_a_only": n_a_only,
        "n_b_only": n_b_only,
        "mcnemar_p": mcnemar(xa, xb) if binary else None,
    }


def paired_table(
    frame: Any,
    reference: str,
    *,
    score: str = "correct",
    config: str = "config",
    sample: str = "task_id",
    by: str | None = None,
    n_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Any:
    """Paired comparison of every configuration against ``reference``, one row each.

    ``frame``: a long ``pandas.DataFrame`` of per-sample results with columns ``config``,
    ``sample`` (the id pairing rows across configurations) and ``score``; ``by`` (e.g. a
    slice column) gives one row per (group, configuration). Samples missing in either
    configuration are an error, since unpaired rows would bias the difference. Columns:
    those of :func:`compare_paired`, with ``a`` the configuration and ``b`` the reference.
    """
    import pandas as pd

    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
    for name, col in (("score", score), ("config", config), ("sample", sample), ("by", by)):
        if col is not None and col not in frame.columns:
            raise ValueError(f"{name} column {col!r} is not in frame (columns: {list(frame.columns)})")
    if reference not in set(frame[config]):
        raise ValueError(f"reference {reference!r} is not a value of column {config!r}")
    groups = [(None, frame)] if by is None else list(frame.groupby(by, sort=True))
    rows = []
    for key, part in groups:
        dup = part.duplicated([config, sample])
        if dup.any():
            raise ValueError(
                f"frame has repeated ({config}, {sample}) rows, e.g. {part[dup].iloc[0][[config, sample]].tolist()}"
            )
        wide = part.pivot(index=sample, columns=config, values=score)
        if reference not in wide.columns:
            raise ValueError(f"reference {reference!r} has no rows in group {by}={key!r}")
        for name in wide.columns:
            a, b = wide[name], wide[reference]
            if a.isna().any() or b.isna().any():
                raise ValueError(
                    f"configuration {name!r} and reference {reference!r} are not scored on the "
                    f"same samples{'' if by is None else f' in group {by}={key!r}'}"
                )
            row = compare_paired(a.to_numpy(), b.to_numpy(), n_resamples, confidence, seed)
            rows.append(({} if by is None else {by: key}) | {"config": name} | row)
    return pd.DataFrame(rows)


def flag_rates(
    flagged: Sequence[int] | np.ndarray,
    correct: Sequence[int] | np.ndarray,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """How often a detector (the certificate) flags wrong vs right answers.

    Returns ``{"wrong": {...}, "right": {...}, "fisher_p": p}``: for wrong and for right
    answers the flagged count, the count, the flag rate and its Wilson CI (NaN when there is
    no such answer), and Fisher's exact two-sided p-value for independence of flag and error
    (a useful detector flags wrong answers far more often).
    """
    f = _as_binary(flagged, "flagged")
    c = _as_binary(correct, "correct")
    _check_same_length(f, c, "flagged", "correct")
    out: dict[str, Any] = {}
    for label, mask in (("wrong", c == 0), ("right", c == 1)):
        n = int(mask.sum())
        k = int(f[mask].sum())
        rate, low, high = proportion_ci(k, n, confidence) if n else (float("nan"),) * 3
        out[label] = {"flagged": k, "n": n, "rate": rate, "low": low, "high": high}
    table = [
        [int(np.sum((f == 1) & (c == 0))), int(np.sum((f == 1) & (c == 1)))],
        [int(np.sum((f == 0) & (c == 0))), int(np.sum((f == 0) & (c == 1)))],
    ]
    out["fisher_p"] = float(scipy.stats.fisher_exact(table).pvalue)
    return out


def _mann_whitney_u(s: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """U of the positives over the negatives (ties one half) and the number of (positive, negative) pairs."""
    n1, n0 = int(y.sum()), int(y.size - y.sum())
    if n1 == 0 or n0 == 0:
        return 0.0, 0
    ranks = scipy.stats.rankdata(s)  # average ranks: ties count one half
    return float(ranks[y == 1].sum() - n1 * (n1 + 1) / 2), n1 * n0


def auroc(scores: Sequence[float] | np.ndarray, positive: Sequence[int] | np.ndarray,
          groups: Sequence[Any] | np.ndarray | None = None) -> float:
    """Area under the ROC curve of ``scores`` for ``positive`` (1) against negative (0) cases: the probability
    that a random positive scores above a random negative, ties counting one half (Mann-Whitney U over
    n_pos x n_neg). With ``groups``, only pairs within a group count (a stratified AUROC: scores of different
    configurations are not compared). 0.5: the score does not discriminate; NaN when no pair exists."""
    s = _as_1d(scores, "scores").astype(float)
    y = _as_binary(positive, "positive")
    _check_same_length(s, y, "scores", "positive")
    codes = np.zeros(s.size, dtype=int) if groups is None else _group_codes(groups, s.size)
    u = pairs = 0.0
    for g in np.unique(codes):
        ug, pg = _mann_whitney_u(s[codes == g], y[codes == g])
        u, pairs = u + ug, pairs + pg
    return float(u / pairs) if pairs else float("nan")


def auroc_ci(scores: Sequence[float] | np.ndarray, positive: Sequence[int] | np.ndarray, n_resamples: int = 10000,
             confidence: float = 0.95, seed: int = 0, groups: Sequence[Any] | np.ndarray | None = None,
             ) -> tuple[float, float, float]:
    """:func:`auroc` with a percentile bootstrap CI, resampling cases within each (group, class) cell (the cell
    sizes are those observed): ``(auroc, low, high)``."""
    s = _as_1d(scores, "scores").astype(float)
    y = _as_binary(positive, "positive")
    _check_same_length(s, y, "scores", "positive")
    n_resamples, confidence = _check_resamples(n_resamples), _check_confidence(confidence)
    codes = np.zeros(s.size, dtype=int) if groups is None else _group_codes(groups, s.size)
    point = auroc(s, y, codes)
    if np.isnan(point):
        return point, point, point
    cells = [np.flatnonzero((codes == g) & (y == c)) for g in np.unique(codes) for c in (0, 1)]
    cells = [c for c in cells if c.size]
    rng = np.random.default_rng(seed)
    stats = np.empty(n_resamples)
    for i in range(n_resamples):
        idx = np.concatenate([rng.choice(c, c.size) for c in cells])
        stats[i] = auroc(s[idx], y[idx], codes[idx])
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return point, float(lo), float(hi)
