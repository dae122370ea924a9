"""The helpers the notebooks call (moved out of their cells): known answers and bad-input errors."""

import numpy as np
import pytest
import torch

from kvlib.analysis.keys import graded_keys, sink_keys
from kvlib.analysis.paired_reconstruction import mcnemar_variants, paired_outcomes
from kvlib.bench.kv4_report import ByteBound
from kvlib.storage.byte_account import byte_account


def test_paired_outcomes_has_the_requested_discordant_counts():
    a, b = paired_outcomes(1089, 5, 1)
    assert int(((a == 1) & (b == 0)).sum()) == 5 and int(((a == 0) & (b == 1)).sum()) == 1
    assert int(((a == 1) & (b == 1)).sum()) == 1083
    with pytest.raises(ValueError, match="a_only"):
        paired_outcomes(3, 2, 2)


def test_mcnemar_variants_agree_with_statsmodels_on_the_table():
    a, b = paired_outcomes(1089, 5, 1)
    p = mcnemar_variants(a, b)
    # chi-square without correction: (5 - 1)^2 / 6 = 2.667 on one degree of freedom
    from scipy.stats import chi2
    assert p["chi-square"] == pytest.approx(chi2.sf(16 / 6, 1))
    assert p["exact (binomial)"] == pytest.approx(2 * 7 / 64)  # P(X <= 1 | n = 6, 1/2), two-sided


def test_sink_keys_mark_only_head_zero_at_sequence_starts():
    g = torch.Generator().manual_seed(0)
    k = sink_keys(64, 2, 16, 8, generator=g, n_sink=2, sink_frac=0.0, sink_mag=100.0)
    big = k[..., 3].abs() > 50
    assert big[:, 1].sum() == 0
    assert big[:, 0].nonzero().flatten().tolist() == [0, 1, 16, 17, 32, 33, 48, 49]
    with pytest.raises(ValueError, match="d > channel"):
        sink_keys(4, 1, 4, 3, generator=g, n_sink=1, sink_frac=0.0, sink_mag=1.0)


def test_graded_keys_scale_pairs_geometrically():
    k = graded_keys(20000, 64, generator=torch.Generator().manual_seed(1), massive=10.0, n_pairs=2, decay=0.5)
    from kvlib.core.outliers import rope_pairs
    (a0, b0), (a1, b1) = rope_pairs(64)[:2].tolist()
    std = k.std(0)
    assert std[[a0, b0]].mean() == pytest.approx(10.0, rel=0.05)
    assert std[[a1, b1]].mean() == pytest.approx(5.0, rel=0.05)
    with pytest.raises(ValueError, match="even"):
        graded_keys(4, 7, generator=torch.Generator(), massive=1.0)


def test_byte_bound_is_one_when_nothing_is_protected_and_the_byte_ratio_when_all_is():
    bb = ByteBound(b4=68.0, b8=130.0, cap=144)
    assert bb(144) == pytest.approx(68 / 130)
    assert bb(10**9) == pytest.approx(1.0, abs=1e-5)
    assert 68 / 130 < bb(4096) < 1


def test_byte_account_layout_equals_allocation():
    rows = byte_account(512, dims=(128,))
    assert all(np.isclose(r["layout B"], r["measured B"]) for r in rows)
    pool = next(r for r in rows if r["format"] == "paged pool, G=32, m=0")
    assert pool["measured B"] == 136
    with pytest.raises(ValueError, match="n_tokens"):
        byte_account(0)
