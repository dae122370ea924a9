"""WitCert certificate reference: formula, theorem inequalities, soundness, vacuous cases, errors."""

import math

import pytest
import torch
from scipy.stats import binom

from kvlib.certify.bound import (
    FP32_MAX,
    certificate,
    certificate_from_scores,
    coverage,
    radius_multiplier,
    request_delta,
    score_radius,
    summarize,
    tv_distance,
    variance_proxy,
)
from kvlib.formats.dither_int8 import dither_dequantize, dither_quantize


def test_variance_proxy_matches_definition():
    g = torch.Generator().manual_seed(0)
    d, G, S = 16, 4, 5
    q = torch.randn(3, d, generator=g, dtype=torch.float64)
    s = torch.rand(S, d // G, generator=g, dtype=torch.float64)
    sm = 0.3
    want = torch.zeros(3, S, dtype=torch.float64)
    for i in range(3):
        for t in range(S):
            want[i, t] = sm**2 / 12 * sum(q[i, c] ** 2 * s[t, c // G] ** 2 for c in range(d))
    got = variance_proxy(q, s, sm_scale=sm, group=G)
    torch.testing.assert_close(got, want)
    sr = variance_proxy(q, s, sm_scale=sm, group=G, proxy="sr")
    torch.testing.assert_close(sr, 3 * got)  # SR proxy: sqrt(3) larger standard deviation


def test_outlier_channels_leave_the_proxy_and_enter_the_bypass_term():
    d, G = 8, 4
    q = torch.ones(d, dtype=torch.float64)
    s = torch.ones(2, d // G, dtype=torch.float64)
    oc = torch.tensor([1, 6])
    v_all = variance_proxy(q, s, sm_scale=1.0, group=G)
    v_out = variance_proxy(q, s, sm_scale=1.0, group=G, outlier_channels=oc)
    torch.testing.assert_close(v_out, v_all * (d - 2) / d)
    outl = torch.tensor([[100.0, -3.0], [0.0, 0.0]])
    u0 = v_out.sqrt() * radius_multiplier(2, 0.1, d)  # the dithered channels' part alone
    u1 = score_radius(q, s, sm_scale=1.0, n=2, delta=0.1, group=G, outlier_channels=oc, outliers=outl)
    assert (u1 >= u0).all()
    assert u1[0] - u0[0] >= 103.0 * 2.0**-11  # fp16 rounding of 100 and 3 is covered
    assert u1[1] - u0[1] < 1e-6  # zero outliers contribute only the subnormal floor


def test_outlier_channels_without_their_values_is_an_error():
    # channels alone would drop them from the proxy and add no bypass term: a radius too small, so refused
    q, s = torch.ones(8, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
    kw = dict(sm_scale=1.0, n=2, delta=0.1, group=4)
    with pytest.raises(ValueError, match="outlier_channels and outliers.*only outlier_channels"):
        score_radius(q, s, outlier_channels=torch.tensor([1, 6]), **kw)
    with pytest.raises(ValueError, match="outlier_channels and outliers.*only outliers"):
        score_radius(q, s, outliers=torch.zeros(2, 2), **kw)
    # an empty channel set drops nothing from the proxy: with or without (empty) values, the plain radius
    none = torch.zeros(0, dtype=torch.int64)
    torch.testing.assert_close(score_radius(q, s, outlier_channels=none, outliers=torch.zeros(2, 0), **kw),
                               score_radius(q, s, **kw))
    torch.testing.assert_close(score_radius(q, s, outlier_channels=none, **kw), score_radius(q, s, **kw))


def test_radius_formula_and_slack():
    q = torch.randn(2, 64, dtype=torch.float64)
    s = torch.rand(7, 2, dtype=torch.float64)
    var = variance_proxy(q, s, sm_scale=0.125)
    bare = score_radius(q, s, sm_scale=0.125, n=7, delta=0.01, slack=False)
    torch.testing.assert_close(bare, var.sqrt() * math.sqrt(2 * math.log(2 * 7 / 0.01)))
    full = score_radius(q, s, sm_scale=0.125, n=7, delta=0.01)
    assert ((full / bare - 1) < 0.02).all() and (full > bare).all()
    assert radius_multiplier(torch.tensor([7]), 0.01, 64).item() == pytest.approx(radius_multiplier(7, 0.01, 64))


def test_theorem_inequalities_hold_deterministically_on_the_event():
    # Whenever |z_hat - z| <= u elementwise: TV(p, p_tilde) <= 1 - B/A <= 1 - 1/A^2, A >= 1 >= B.
    g = torch.Generator().manual_seed(1)
    z = 3 * torch.randn(2000, 40, generator=g, dtype=torch.float64)
    u = 0.5 * torch.rand(2000, 40, generator=g, dtype=torch.float64)
    eps = (2 * torch.rand(2000, 40, generator=g, dtype=torch.float64) - 1) * u
    p, pt = torch.softmax(z, -1), torch.softmax(z + eps, -1)
    c = certificate(pt, u)
    tv = tv_distance(p, pt)
    assert (tv <= c.tv_bound + 1e-12).all()
    assert (c.tv_bound <= c.tv_bound_one + 1e-12).all()
    assert (c.A >= 1 - 1e-12).all() and (c.B <= 1 + 1e-12).all() and (c.A * c.B >= 1 - 1e-12).all()
    c2 = certificate_from_scores(z + eps, u)
    torch.testing.assert_close(c2.A, c.A)
    torch.testing.assert_close(c2.tv_bound, c.tv_bound)


def test_zero_radius_gives_zero_bound():
    p = torch.softmax(torch.randn(4, 9, dtype=torch.float64), -1)
    c = certificate(p, torch.zeros(4, 9, dtype=torch.float64))
    assert (c.tv_bound.abs() < 1e-12).all() and (c.tv_bound_one.abs() < 1e-12).all()


def test_soundness_on_fixed_seed_batch_with_the_write_path():
    g = torch.Generator().manual_seed(2)
    S, d, rows, delta = 64, 64, 96, 0.05
    viol = 0
    total = 0
    for trial in range(4):
        k = torch.randn(S, d, generator=g)
        k[:, 3] *= 30  # a massive channel
        qt = dither_quantize(k, layer=trial, kv_head=0, slots=torch.arange(S), seed=11)
        k_hat = dither_dequantize(qt).to(torch.float64)
        q = 3 * torch.randn(rows, d, generator=g, dtype=torch.float64)
        sm = 1 / math.sqrt(d)
        z, z_hat = sm * q @ k.to(torch.float64).T, sm * q @ k_hat.T
        u = score_radius(q, qt.scales, sm_scale=sm, n=S, delta=delta)
        cert = certificate_from_scores(z_hat, u)
        tv = tv_distance(torch.softmax(z, -1), torch.softmax(z_hat, -1))
        viol += int((tv > cert.tv_bound).sum())
        total += rows
        assert (tv > 0).all()
    # the violation rate is at most delta; allow the binomial 1e-6 upper quantile
    assert viol <= binom.ppf(1 - 1e-6, total, delta)


def test_nan_and_overflow_are_vacuous_and_count_over_threshold():
    p = torch.softmax(torch.randn(3, 5, dtype=torch.float64), -1)
    u = torch.full((3, 5), 0.01, dtype=torch.float64)
    p[1, 2] = math.nan
    u[2, 0] = 200.0  # e^200 > fp32 max: overflow
    c = certificate(p, u)
    assert c.vacuous.tolist() == [False, True, True]
    assert math.isinf(c.tv_bound[1]) and math.isinf(c.tv_bound_one[2])
    assert coverage(c.tv_bound, tau=0.2) == pytest.approx(1 / 3)
    s = summarize(c.tv_bound, 0.2)
    assert s["overflow_count"] == 2 and s["max_finite"] < 0.2 and s["n"] == 3
    assert float(c.A[2]) > FP32_MAX
    z = torch.randn(2, 5)
    z[0, 1] = math.inf
    assert certificate_from_scores(z, torch.zeros(2, 5)).vacuous.tolist() == [True, False]


def test_request_level_allocation():
    assert request_delta(1e-2, layers=28, heads=28, steps=256) == pytest.approx(1e-2 / (28 * 28 * 256))
    with pytest.raises(ValueError, match="layers"):
        request_delta(1e-2, layers=0, heads=1, steps=1)


@pytest.mark.parametrize("delta", [0.0, 1.0, -0.1, 2.0])
def test_delta_outside_unit_interval_raises(delta):
    with pytest.raises(ValueError, match="delta"):
        score_radius(torch.randn(2, 32), torch.rand(3, 1), sm_scale=1.0, n=3, delta=delta)


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="group"):
        score_radius(torch.randn(2, 30), torch.rand(3, 1), sm_scale=1.0, n=3, delta=0.1)
    with pytest.raises(ValueError, match="scales"):
        score_radius(torch.randn(2, 64), torch.rand(3, 3), sm_scale=1.0, n=3, delta=0.1)
    with pytest.raises(TypeError, match="q"):
        score_radius(torch.ones(2, 32, dtype=torch.int64), torch.rand(3, 1), sm_scale=1.0, n=3, delta=0.1)
    with pytest.raises(ValueError, match="p_tilde"):
        certificate(torch.ones(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="u"):
        certificate(torch.full((2, 4), 0.25), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="n"):
        score_radius(torch.randn(2, 32), torch.rand(3, 1), sm_scale=1.0, n=0, delta=0.1)


def test_public_name_certificate_survives_submodule_import():
    import kvlib
    import kvlib.certify.bound  # noqa: F401 - binds the submodule on the package

    p = torch.softmax(torch.randn(2, 6, dtype=torch.float64), -1)
    c = kvlib.certificate(p, torch.full((2, 6), 0.05, dtype=torch.float64))
    assert (c.tv_bound <= c.tv_bound_one + 1e-12).all() and kvlib.score_radius is score_radius
