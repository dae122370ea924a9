"""Tests of kvlib.analysis.stats against closed-form cases and simulated coverage."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest
import scipy.stats as scipy_stats

from kvlib.analysis.stats import (
    bootstrap_mean_ci,
    cluster_bootstrap_mean_ci,
    compare_paired,
    discordant_counts,
    flag_rates,
    mcnemar,
    paired_bootstrap_ci,
    paired_table,
    proportion_ci,
)


def _paired_outcomes(n11: int, n10: int, n01: int, n00: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """0/1 vectors with the given 2x2 cell counts, shuffled."""
    a = np.array([1] * n11 + [1] * n10 + [0] * n01 + [0] * n00)
    b = np.array([1] * n11 + [0] * n10 + [1] * n01 + [0] * n00)
    perm = np.random.default_rng(seed).permutation(a.size)
    return a[perm], b[perm]


def _exact_mcnemar_by_hand(n10: int, n01: int) -> float:
    n = n10 + n01
    k = min(n10, n01)
    cdf = sum(comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * cdf)


# ----------------------------------------------------------------------------- McNemar
@pytest.mark.parametrize("n10,n01", [(5, 1), (1, 5), (0, 3), (4, 4), (7, 2), (0, 12)])
def test_mcnemar_matches_binomial_by_hand(n10: int, n01: int) -> None:
    a, b = _paired_outcomes(13, n10, n01, 9)
    assert mcnemar(a, b) == pytest.approx(_exact_mcnemar_by_hand(n10, n01), rel=1e-12)


def test_mcnemar_paper_example_five_vs_one() -> None:
    a, b = _paired_outcomes(1000, 5, 1, 83)
    assert mcnemar(a, b) == pytest.approx(14 / 64)  # 2 * (1 + 6) / 2**6
    assert discordant_counts(a, b) == (5, 1)


@pytest.mark.parametrize("n10,n01", [(5, 1), (0, 4), (9, 2)])
def test_mcnemar_mid_p_by_hand(n10: int, n01: int) -> None:
    a, b = _paired_outcomes(20, n10, n01, 7)
    n, k = n10 + n01, min(n10, n01)
    below = sum(comb(n, i) for i in range(k)) / 2**n
    expected = 2 * (below + comb(n, k) / 2**n / 2)
    assert mcnemar(a, b, mid_p=True) == pytest.approx(expected, rel=1e-12)
    assert mcnemar(a, b, mid_p=True) < mcnemar(a, b)


def test_mcnemar_mid_p_five_vs_one_is_one_eighth() -> None:
    a, b = _paired_outcomes(600, 5, 1, 483)
    assert mcnemar(a, b, mid_p=True) == pytest.approx(0.125)


def test_mcnemar_no_discordant_pairs_is_one() -> None:
    a, b = _paired_outcomes(10, 0, 0, 5)
    assert mcnemar(a, b) == 1.0


def test_mcnemar_symmetric_and_concordant_cells_irrelevant() -> None:
    a, b = _paired_outcomes(3, 6, 1, 2)
    a2, b2 = _paired_outcomes(300, 6, 1, 200, seed=3)
    assert mcnemar(a, b) == pytest.approx(mcnemar(b, a))
    assert mcnemar(a, b) == pytest.approx(mcnemar(a2, b2))


def test_mcnemar_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="a must hold 0/1"):
        mcnemar([0, 1, 2], [0, 1, 1])
    with pytest.raises(ValueError, match="b must hold 0/1"):
        mcnemar([0, 1, 1], [0.5, 1, 1])
    with pytest.raises(ValueError, match="equal length"):
        mcnemar([0, 1, 1], [0, 1])
    with pytest.raises(ValueError, match="a must be 1-D"):
        mcnemar([[0, 1]], [[0, 1]])


# ----------------------------------------------------------------------------- bootstrap
def test_constant_difference_gives_degenerate_ci() -> None:
    a = np.linspace(0, 1, 50)
    mean, low, high = paired_bootstrap_ci(a + 0.25, a)
    assert mean == pytest.approx(0.25)
    assert low == pytest.approx(0.25) and high == pytest.approx(0.25)


def test_identical_configurations_give_zero_interval() -> None:
    a = np.random.default_rng(1).integers(0, 2, 150)
    assert paired_bootstrap_ci(a, a) == (0.0, 0.0, 0.0)


def test_ci_contains_mean_and_is_ordered() -> None:
    rng = np.random.default_rng(2)
    a = rng.integers(0, 2, 150)
    b = rng.integers(0, 2, 150)
    for method in ("percentile", "BCa"):
        mean, low, high = paired_bootstrap_ci(a, b, n_resamples=2000, method=method)
        assert mean == pytest.approx(np.mean(a - b))
        assert low <= mean <= high
        assert -1.0 <= low and high <= 1.0


def test_bootstrap_is_reproducible_under_seed() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=80), rng.normal(size=80)
    assert paired_bootstrap_ci(a, b, seed=7) == paired_bootstrap_ci(a, b, seed=7)
    groups = np.repeat(np.arange(20), 4)
    assert paired_bootstrap_ci(a, b, seed=7, groups=groups) == paired_bootstrap_ci(a, b, seed=7, groups=groups)


def test_paired_ci_narrower_than_unpaired_spread_for_correlated_scores() -> None:
    # Strongly correlated configurations: the paired CI width reflects only the noise of
    # the difference, far below the spread of either score.
    rng = np.random.default_rng(4)
    base = rng.normal(size=200) * 10
    a, b = base + rng.normal(size=200) * 0.1, base
    _, low, high = paired_bootstrap_ci(a, b, n_resamples=2000)
    assert high - low < 0.1


def test_percentile_ci_coverage_near_nominal() -> None:
    # 300 simulated normal data sets of size 60 with true mean difference 0.3: the 95%
    # percentile interval should cover in about 95% of them (SE of the rate ~0.013;
    # the percentile bootstrap undercovers slightly at this n).
    rng = np.random.default_rng(12345)
    true = 0.3
    hits = 0
    reps = 300
    for r in range(reps):
        b = rng.normal(size=60)
        a = b + true + rng.normal(size=60)
        _, low, high = paired_bootstrap_ci(a, b, n_resamples=1000, seed=r)
        hits += low <= true <= high
    coverage = hits / reps
    assert 0.89 <= coverage <= 0.99


def test_cluster_bootstrap_wider_than_naive_for_clustered_data() -> None:
    # 30 clusters of 10 samples sharing a strong cluster effect: the effective sample size
    # is ~30, not 300, so the cluster CI must be markedly wider (about sqrt(10) here).
    rng = np.random.default_rng(5)
    groups = np.repeat(np.arange(30), 10)
    values = rng.normal(size=30)[groups] * 3 + rng.normal(size=300) * 0.1
    _, lo_n, hi_n = bootstrap_mean_ci(values, n_resamples=4000)
    _, lo_c, hi_c = bootstrap_mean_ci(values, n_resamples=4000, groups=groups)
    assert (hi_c - lo_c) > 2.0 * (hi_n - lo_n)


def test_cluster_bootstrap_with_singleton_groups_matches_naive() -> None:
    rng = np.random.default_rng(6)
    values = rng.normal(size=200)
    m1, lo1, hi1 = bootstrap_mean_ci(values, n_resamples=5000)
    m2, lo2, hi2 = cluster_bootstrap_mean_ci(values, np.arange(200), n_resamples=5000)
    assert m1 == pytest.approx(m2)
    assert lo2 == pytest.approx(lo1, abs=0.03) and hi2 == pytest.approx(hi1, abs=0.03)


def test_cluster_bootstrap_point_is_pooled_mean_and_labels_any_type() -> None:
    values = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    groups = ["p0", "p0", "p0", "p1", "p2", "p2"]
    mean, low, high = cluster_bootstrap_mean_ci(values, groups, n_resamples=500)
    assert mean == pytest.approx(4 / 6)
    assert 0.0 <= low <= mean <= high <= 1.0


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"a": [1, 2, 3], "b": [1, 2]}, ValueError, "equal length"),
        ({"a": [1, 2], "b": [1, 2], "confidence": 1.0}, ValueError, "confidence"),
        ({"a": [1, 2], "b": [1, 2], "confidence": 0.0}, ValueError, "confidence"),
        ({"a": [1, 2], "b": [1, 2], "n_resamples": 0}, ValueError, "n_resamples"),
        ({"a": [1, 2], "b": [1, 2], "method": "bca"}, ValueError, "method"),
        ({"a": [], "b": []}, ValueError, "a must not be empty"),
        ({"a": [1, np.nan], "b": [1, 2]}, ValueError, "a must be finite"),
        ({"a": "ab", "b": [1, 2]}, TypeError, "a must be"),
        ({"a": [1, 2], "b": [1, 2], "groups": [0]}, ValueError, "groups"),
        (
            {"a": [1, 2], "b": [3, 2], "groups": [0, 0]},
            ValueError,
            "two distinct groups",
        ),
    ],
)
def test_paired_bootstrap_rejects_bad_input(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        paired_bootstrap_ci(**kwargs)


# ----------------------------------------------------------------------------- rates
def test_proportion_ci_known_values() -> None:
    # Clopper-Pearson for 0/n has the closed form upper = 1 - (alpha/2)^(1/n).
    rate, low, high = proportion_ci(0, 20, method="exact")
    assert rate == 0.0 and low == 0.0
    assert high == pytest.approx(1 - 0.025 ** (1 / 20))
    # and for n/n, lower = (alpha/2)^(1/n).
    _, low, high = proportion_ci(20, 20, method="exact")
    assert low == pytest.approx(0.025 ** (1 / 20)) and high == 1.0
    # Wilson score interval by its formula.
    k, n, z = 7, 30, 1.959963984540054
    p = k / n
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / (1 + z**2 / n)
    _, low, high = proportion_ci(k, n)
    assert low == pytest.approx(centre - half) and high == pytest.approx(centre + half)


def test_proportion_ci_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="successes"):
        proportion_ci(5, 4)
    with pytest.raises(ValueError, match="n must be"):
        proportion_ci(0, 0)
    with pytest.raises(TypeError, match="successes"):
        proportion_ci(1.5, 4)
    with pytest.raises(ValueError, match="method"):
        proportion_ci(1, 4, method="agresti")
    with pytest.raises(ValueError, match="confidence"):
        proportion_ci(1, 4, confidence=95)


def test_compare_paired_row() -> None:
    a, b = _paired_outcomes(100, 2, 30, 18)
    row = compare_paired(a, b, n_resamples=2000)
    assert row["n"] == 150
    assert row["diff"] == pytest.approx(row["mean_a"] - row["mean_b"])
    assert row["high"] < 0  # a is clearly worse
    assert (row["n_a_only"], row["n_b_only"]) == (2, 30)
    assert row["mcnemar_p"] == pytest.approx(_exact_mcnemar_by_hand(2, 30))
    cont = compare_paired([0.5, 0.2, 0.1], [0.4, 0.2, 0.0], n_resamples=200)
    assert cont["mcnemar_p"] is None


# ----------------------------------------------------------------------------- tables
def _long_frame(by_slice: bool = False):
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(8)
    rows = []
    for s in range(2 if by_slice else 1):
        ref = rng.integers(0, 2, 40)
        bad = ref.copy()
        bad[:15] = 0  # a format that loses up to 15 answers
        for cfg, scores in (("fp32", ref), ("same", ref), ("bad", bad)):
            for i, v in enumerate(scores):
                rows.append({"config": cfg, "task_id": f"s{s}-{i}", "correct": int(v), "slice": s})
    return pd.DataFrame(rows)


def test_paired_table_rows_match_compare_paired() -> None:
    frame = _long_frame()
    table = paired_table(frame, "fp32", n_resamples=1000)
    assert set(table["config"]) == {"fp32", "same", "bad"}
    row = table.set_index("config").loc["bad"]
    bad = frame[frame.config == "bad"].sort_values("task_id")["correct"].to_numpy()
    ref = frame[frame.config == "fp32"].sort_values("task_id")["correct"].to_numpy()
    expected = compare_paired(bad, ref, n_resamples=1000)
    assert row["diff"] == pytest.approx(expected["diff"])
    assert row["mcnemar_p"] == pytest.approx(expected["mcnemar_p"])
    same = table.set_index("config").loc["same"]
    assert (same["diff"], same["low"], same["high"], same["mcnemar_p"]) == (0.0, 0.0, 0.0, 1.0)


def test_paired_table_by_slice_and_errors() -> None:
    frame = _long_frame(by_slice=True)
    table = paired_table(frame, "fp32", by="slice", n_resamples=500)
    assert len(table) == 6 and set(table["slice"]) == {0, 1}
    with pytest.raises(ValueError, match="reference"):
        paired_table(frame, "fp16")
    with pytest.raises(ValueError, match="score column"):
        paired_table(frame, "fp32", score="acc")
    with pytest.raises(ValueError, match="same samples"):
        paired_table(frame.iloc[1:], "fp32", by="slice")
    with pytest.raises(ValueError, match="repeated"):
        paired_table(frame.iloc[[0, *range(len(frame))]], "fp32")
    with pytest.raises(TypeError, match="frame"):
        paired_table({"a": 1}, "fp32")


def test_flag_rates_known_counts() -> None:
    # 10 wrong answers, 8 flagged; 30 right answers, 3 flagged
    correct = np.array([0] * 10 + [1] * 30)
    flagged = np.array([1] * 8 + [0] * 2 + [1] * 3 + [0] * 27)
    out = flag_rates(flagged, correct)
    assert (out["wrong"]["flagged"], out["wrong"]["n"]) == (8, 10)
    assert out["wrong"]["rate"] == pytest.approx(0.8)
    assert out["right"]["rate"] == pytest.approx(0.1)
    assert out["wrong"]["low"] <= 0.8 <= out["wrong"]["high"]
    expected = scipy_stats.fisher_exact([[8, 3], [2, 27]]).pvalue
    assert out["fisher_p"] == pytest.approx(expected)
    assert out["fisher_p"] < 1e-3
    none_wrong = flag_rates([0, 1], [1, 1])
    assert none_wrong["wrong"]["n"] == 0 and np.isnan(none_wrong["wrong"]["rate"])
    with pytest.raises(ValueError, match="flagged"):
        flag_rates([2, 0], [1, 1])
    with pytest.raises(ValueError, match="equal length"):
        flag_rates([1, 0, 1], [1, 1])


def test_auroc_known_answers_and_pair_count() -> None:
    from kvlib.analysis.stats import auroc, auroc_ci

    assert auroc([3, 4, 1, 2], [1, 1, 0, 0]) == 1.0 and auroc([1, 2, 3, 4], [1, 1, 0, 0]) == 0.0
    assert auroc([1.0] * 6, [1, 1, 1, 0, 0, 0]) == 0.5  # a constant score (e.g. a saturated certificate)
    assert np.isnan(auroc([1, 2], [1, 1]))
    rng = np.random.default_rng(0)
    s, y = rng.normal(size=60).round(1), rng.integers(0, 2, 60)  # rounding makes ties
    pairs = [(a > b) + 0.5 * (a == b) for a in s[y == 1] for b in s[y == 0]]
    assert abs(auroc(s, y) - np.mean(pairs)) < 1e-12
    point, lo, hi = auroc_ci(s, y, n_resamples=500, seed=1)
    assert lo <= point <= hi and 0 <= lo and hi <= 1
    assert auroc_ci([1.0] * 6, [1, 1, 1, 0, 0, 0], n_resamples=200) == (0.5, 0.5, 0.5)
    # stratified: a configuration whose scores are all lower and all right does not make another one's
    # constant (vacuous) certificate look discriminative
    scores, wrong, cfg = [1.0] * 6 + [0.3] * 3, [1, 1, 1, 0, 0, 0, 0, 0, 0], ["a"] * 6 + ["b"] * 3
    assert auroc(scores, wrong) > 0.5 and auroc(scores, wrong, cfg) == 0.5
    assert auroc_ci(scores, wrong, n_resamples=200, groups=cfg) == (0.5, 0.5, 0.5)
