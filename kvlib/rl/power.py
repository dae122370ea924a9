"""How many seeds an RLVR comparison needs: a power analysis from the spread of runs already made.

The comparison is paired by seed: per seed ``s``, ``D_s = acc(arm, s) - acc(bf16, s)`` (held-out accuracy in
percentage points, one common evaluator). ``D_s`` varies for two reasons: the training itself (when a seed
"takes off", which dominates before every seed has plateaued) and the evaluator's finite problem set (binomial).
Both are in the observed spread, so the analysis works from it directly.

Two questions, each answered for a standard deviation of ``D``:

- **a lag:** the paired t-test (two-sided) that detects a true difference of ``delta`` pp with the given power
  (:func:`seeds_to_detect`, statsmodels' ``TTestPower``);
- **parity:** two one-sided tests (TOST) that show ``|D| < margin`` when the true difference is ``true_diff``
  (:func:`tost_power`, exact: one integral over the sample standard deviation; :func:`seeds_for_parity`).

A standard deviation from three seeds is itself uncertain, so :func:`sd_upper` gives its one-sided upper
confidence bound (chi-square); :func:`plan` reports both the point estimate and that bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: fewer seeds than this are never planned, whatever the arithmetic says (the issue's floor, and t's tails)
MIN_SEEDS = 5


def _pos(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return float(x)


def _prob(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < 1:
        raise ValueError(f"{name} must be in (0, 1), got {x!r}")
    return float(x)


def sd_upper(sd: float, n: int, conf: float = 0.95) -> float:
    """One-sided ``conf`` upper confidence bound of a normal standard deviation estimated as ``sd`` from ``n``
    values: ``sd * sqrt((n - 1) / chi2.ppf(1 - conf, n - 1))``."""
    from scipy.stats import chi2

    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    if isinstance(sd, bool) or not isinstance(sd, (int, float)) or not math.isfinite(sd) or sd < 0:
        raise ValueError(f"sd must be a finite number >= 0, got {sd!r}")
    conf = _prob(conf, "conf")
    return float(sd) * math.sqrt((n - 1) / chi2.ppf(1 - conf, n - 1))


def seeds_to_detect(sd_pp: float, delta_pp: float = 5.0, *, alpha: float = 0.05, power: float = 0.8) -> int:
    """Seeds for a two-sided paired t-test at ``alpha`` to detect a true difference of ``delta_pp`` with
    ``power`` when the per-seed difference has standard deviation ``sd_pp`` (at least :data:`MIN_SEEDS`)."""
    from statsmodels.stats.power import TTestPower

    sd, delta = _pos(sd_pp, "sd_pp"), _pos(delta_pp, "delta_pp")
    n = TTestPower().solve_power(effect_size=delta / sd, alpha=_prob(alpha, "alpha"), power=_prob(power, "power"),
                                 alternative="two-sided")
    return max(MIN_SEEDS, math.ceil(float(np.atleast_1d(n)[0])))


def tost_power(n: int, sd_pp: float, margin_pp: float = 5.0, true_diff_pp: float = 0.0, *,
               alpha: float = 0.05) -> float:
    """Exact power of TOST (each one-sided t-test at ``alpha``) to conclude ``|D| < margin_pp`` from ``n``
    paired seeds with true mean difference ``true_diff_pp`` and standard deviation ``sd_pp``.

    Both tests reject iff ``-m + t_c s / sqrt(n) < mean < m - t_c s / sqrt(n)``; the mean is normal and
    independent of ``s``, with ``(n - 1) s^2 / sd^2 ~ chi2(n - 1)``, so the power is one integral over ``s``."""
    from scipy import integrate
    from scipy.stats import chi2, norm, t

    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    sd, m = _pos(sd_pp, "sd_pp"), _pos(margin_pp, "margin_pp")
    if isinstance(true_diff_pp, bool) or not isinstance(true_diff_pp, (int, float)) or not math.isfinite(true_diff_pp):
        raise ValueError(f"true_diff_pp must be a finite number, got {true_diff_pp!r}")
    tc = t.ppf(1 - _prob(alpha, "alpha"), n - 1)
    se, df = sd / math.sqrt(n), n - 1
    # the window is empty once t_c s / sqrt(n) >= m: s >= m sqrt(n) / t_c, i.e. chi2 >= df (m sqrt(n) / (t_c sd))^2
    q_max = df * (m * math.sqrt(n) / (tc * sd)) ** 2

    def inner(q: float) -> float:
        half = m - tc * sd * math.sqrt(q / df) / math.sqrt(n)
        return (norm.cdf((half - true_diff_pp) / se) - norm.cdf((-half - true_diff_pp) / se)) * chi2.pdf(q, df)

    val, _ = integrate.quad(inner, 0.0, q_max, limit=200, epsabs=1e-10)
    return float(min(1.0, max(0.0, val)))


def seeds_for_parity(sd_pp: float, margin_pp: float = 5.0, true_diff_pp: float = 0.0, *, alpha: float = 0.05,
                     power: float = 0.8, n_max: int = 10_000) -> int | None:
    """The fewest seeds (at least :data:`MIN_SEEDS`) whose TOST power reaches ``power``; None past ``n_max``
    (for instance when ``|true_diff_pp| >= margin_pp``, where parity cannot be shown)."""
    target = _prob(power, "power")
    if abs(true_diff_pp) >= _pos(margin_pp, "margin_pp"):
        return None
    for n in range(max(2, MIN_SEEDS), n_max + 1):
        if tost_power(n, sd_pp, margin_pp, true_diff_pp, alpha=alpha) >= target:
            return n
    return None


def paired_sd(diffs_pp: Sequence[float]) -> float:
    """Sample standard deviation (ddof 1) of per-seed paired differences."""
    d = np.asarray(diffs_pp, dtype=float)
    if d.ndim != 1 or d.size < 2 or not np.isfinite(d).all():
        raise ValueError(f"diffs_pp must be >= 2 finite numbers, got {diffs_pp!r}")
    return float(d.std(ddof=1))


def detect_power(n: int, sd_pp: float, delta_pp: float = 5.0, *, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at ``alpha`` with ``n`` seeds against a true ``delta_pp``."""
    from statsmodels.stats.power import TTestPower

    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    es = _pos(delta_pp, "delta_pp") / _pos(sd_pp, "sd_pp")
    return float(TTestPower().power(effect_size=es, nobs=n, alpha=_prob(alpha, "alpha"), alternative="two-sided"))


def plan(scenarios: dict[str, dict[str, Any]], *, delta_pp: float = 5.0, margin_pp: float = 5.0,
         alpha: float = 0.05, power: float = 0.8, conf: float = 0.95, n_planned: int | None = None,
         ) -> list[dict[str, Any]]:
    """One row per scenario ``{name: {"sd_pp": s, "n": k, "what": text}}`` (``s`` estimated from ``k``
    values): the seeds needed to detect a ``delta_pp`` lag and to show parity within ``margin_pp`` (true
    difference 0), at the point estimate and at its ``conf`` upper bound; with ``n_planned``, also the power
    of both tests at that many seeds."""
    rows = []
    for name, sc in scenarios.items():
        sd, k = float(sc["sd_pp"]), int(sc["n"])
        up = sd_upper(sd, k, conf)
        row = {"scenario": name, "what": sc.get("what", ""), "sd_pp": sd, "from_n": k, "sd_upper_pp": up}
        for tag, s in (("point", sd), ("upper", up)):
            s = max(s, 1e-9)
            row[f"detect_{tag}"] = seeds_to_detect(s, delta_pp, alpha=alpha, power=power)
            row[f"parity_{tag}"] = seeds_for_parity(s, margin_pp, 0.0, alpha=alpha, power=power)
            if n_planned is not None:
                row[f"detect_power_{tag}"] = detect_power(n_planned, s, delta_pp, alpha=alpha)
                row[f"parity_power_{tag}"] = tost_power(n_planned, s, margin_pp, 0.0, alpha=alpha)
        rows.append(row)
    return rows
