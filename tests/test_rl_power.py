"""The RLVR power analysis: known answers, and the exact TOST power against a seeded Monte-Carlo."""

import math

import numpy as np
import pytest
from scipy.stats import t

from kvlib.rl import power


def test_paired_t_known_answer():
    # Cohen's table / G*Power: one-sample (paired) two-sided t, d = 0.5, alpha .05, power .8 -> 34
    assert power.seeds_to_detect(10.0, 5.0) == 34
    assert power.seeds_to_detect(1.0, 5.0) == power.MIN_SEEDS  # the floor binds when the arithmetic says 2


@pytest.mark.parametrize("n,sd,diff", [(5, 3.0, 0.0), (8, 4.0, 1.0), (12, 6.0, -2.0)])
def test_tost_power_matches_simulation(n, sd, diff):
    rng = np.random.default_rng(0)
    reps = 40_000
    d = rng.normal(diff, sd, size=(reps, n))
    mean, s = d.mean(1), d.std(1, ddof=1)
    tc = t.ppf(0.95, n - 1)
    hit = ((mean + 5.0) / (s / math.sqrt(n)) > tc) & ((mean - 5.0) / (s / math.sqrt(n)) < -tc)
    p_mc = hit.mean()
    se = math.sqrt(p_mc * (1 - p_mc) / reps)
    assert power.tost_power(n, sd, 5.0, diff) == pytest.approx(p_mc, abs=5 * se + 1e-6)


def test_parity_needs_more_seeds_when_noisier_and_is_impossible_past_the_margin():
    a, b = power.seeds_for_parity(3.0), power.seeds_for_parity(8.0)
    assert a is not None and b is not None and b > a
    assert power.tost_power(b, 8.0) >= 0.8 > power.tost_power(b - 1, 8.0)
    assert power.seeds_for_parity(3.0, 5.0, true_diff_pp=5.0) is None


def test_sd_upper_known_answer_and_bad_input():
    # chi2(2).ppf(0.05) = 0.10259: sqrt(2 / 0.10259) = 4.4153
    assert power.sd_upper(1.0, 3) == pytest.approx(4.4153, rel=1e-4)
    with pytest.raises(ValueError, match="n must"):
        power.sd_upper(1.0, 1)
    with pytest.raises(ValueError, match="sd_pp"):
        power.seeds_to_detect(0.0)
    with pytest.raises(ValueError, match="alpha"):
        power.tost_power(5, 1.0, alpha=1.5)
