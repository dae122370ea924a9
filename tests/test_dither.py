"""Dithered INT8 (WitCert): the s/2 bound, no clipping, outlier bypass, read == write dither, bad input."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from kvlib.core.philox import dither
from kvlib.formats.dither_int8 import dither_dequantize, dither_quantize


def _quant(x, seed=11, **kw):
    S = x.shape[0]
    kw = dict(layer=2, kv_head=1, slots=torch.arange(100, 100 + S), seed=seed) | kw
    return dither_quantize(x, **kw)


def _exact_err(x, qt):
    """(k_hat - x) in float64 (exact for these operands) and the per-channel scale."""
    d = x.shape[1]
    xi = dither(qt.slots, d, layer=qt.layer, kv_head=qt.kv_head, seed=qt.seed, side=qt.side).double()
    s = qt.scales.double().repeat_interleave(qt.group, -1)
    return s * (qt.codes.double() - xi) - x.double(), s


@pytest.mark.parametrize("kind", ["gauss", "student_t2", "lognormal_scale"])
def test_half_scale_bound(kind):
    g = torch.Generator().manual_seed(0)
    S, d = 512, 128
    if kind == "gauss":
        x = torch.randn(S, d, generator=g)
    elif kind == "student_t2":
        x = torch.distributions.StudentT(2.0).sample((S, d)) * 5
    else:
        x = torch.randn(S, d, generator=g) * torch.exp(3 * torch.randn(S, 1, generator=g))
    qt = _quant(x)
    k_hat = dither_dequantize(qt)
    err, s = _exact_err(x, qt)
    # the read-side fp32 value satisfies the bound up to fp32 rounding slack (2^-16 s, see residual())
    assert int(((k_hat.double() - x.double()).abs() > s / 2 + s * 2.0**-16).sum()) == 0
    # in exact arithmetic the only excess is fp32 rounding of x/s + xi: at most 2^-16 s
    assert float(((err.abs() - s / 2) / s).max()) <= 2.0**-16
    assert int(qt.codes.abs().max()) <= 127


def test_no_clipping_and_scale_is_fp16_of_amax():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g) * 10
    qt = _quant(x, group=32)
    amax = x.abs().unflatten(-1, (-1, 32)).amax(-1)
    assert torch.equal(qt.scales, (amax / 126.5).to(torch.float16))
    xi = dither(qt.slots, 64, layer=2, kv_head=1, seed=11)
    y = x / qt.scales.float().repeat_interleave(32, -1) + xi
    assert float(y.abs().max()) < 127.5  # so clamp(-127, 127) never bites: zero clipping
    assert torch.equal(qt.codes.float(), torch.round(y))


def test_zero_group_and_subnormal_scales():
    x = torch.randn(8, 64) * 1e-5
    x[0, :32] = 0
    qt = _quant(x)
    assert qt.scales[0, 0] == 0 and bool((qt.codes[0, :32] == 0).all())
    k_hat = dither_dequantize(qt)
    assert bool((k_hat[0, :32] == 0).all())
    s = qt.scales.float().repeat_interleave(32, -1)
    assert bool((s * 127 >= x.abs()).all())  # bumped where fp16 rounding went low
    err, s64 = _exact_err(x, qt)
    assert float(((err.abs() - s64 / 2) / s64.clamp_min(1e-30)).max()) <= 2.0**-16


def test_error_is_uniform_and_input_independent():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 64, generator=g)
    qt = _quant(x)
    err, s = _exact_err(x, qt)
    eps = (err / s).flatten().numpy()
    assert stats.kstest(eps, stats.uniform(loc=-0.5, scale=1).cdf).pvalue > 1e-3
    assert abs(stats.pearsonr(eps, x.flatten().numpy())[0]) < 0.02


def test_outlier_bypass_and_amax_exclusion():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g)
    oc = torch.tensor([35, 3])  # unsorted on purpose (a RoPE pair (3, 35) for rotate-half at d=64)
    x[:, oc] = 500.0
    qt = _quant(x, outlier_channels=oc)
    assert qt.outlier_channels.tolist() == [3, 35]
    assert bool((qt.codes[:, [3, 35]] == 0).all())
    k_hat = dither_dequantize(qt)
    assert torch.equal(k_hat[:, [3, 35]], x[:, [3, 35]].half().float())
    inc = _quant(x, outlier_channels=oc, include_outliers_in_amax=True)
    assert bool((inc.scales.float() > 50 * qt.scales.float()).all())  # the scale does not drop
    plain = _quant(x)
    assert torch.equal(plain.scales, inc.scales)


def test_read_regenerates_write_dither_and_slot_not_position():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 64, generator=g)
    slots = torch.randperm(1000, generator=g)[:40]
    qt = _quant(x, slots=slots)
    perm = torch.randperm(40, generator=g)
    qp = _quant(x[perm], slots=slots[perm])  # batch order changes nothing per slot
    assert torch.equal(qp.codes, qt.codes[perm]) and torch.equal(qp.scales, qt.scales[perm])
    first, second = _quant(x[:17], slots=slots[:17]), _quant(x[17:], slots=slots[17:])
    assert torch.equal(torch.cat([first.codes, second.codes]), qt.codes)
    assert torch.equal(dither_dequantize(qp), dither_dequantize(qt)[perm])


def test_seed_layer_head_side_change_codes():
    x = torch.randn(16, 64)
    base = _quant(x).codes
    for kw in (dict(seed=12), dict(layer=3), dict(kv_head=0), dict(side=1)):
        assert not torch.equal(_quant(x, **kw).codes, base)


@pytest.mark.parametrize(
    "x,kw,exc",
    [
        (torch.randint(0, 5, (4, 64)), {}, TypeError),
        (torch.randn(4, 64), dict(group=48), ValueError),
        (torch.randn(4, 64), dict(slots=torch.arange(3)), ValueError),
        (torch.tensor([[float("nan")] * 64] * 4), {}, ValueError),
        (torch.full((4, 64), float("inf")), {}, ValueError),
        (torch.full((4, 64), 1e7), {}, ValueError),
        (torch.randn(4, 64), dict(outlier_channels=torch.tensor([64])), ValueError),
        (torch.randn(4, 64), dict(outlier_channels=torch.tensor([1, 1])), ValueError),
        (torch.randn(4, 64), dict(slots=torch.arange(4.0)), TypeError),
    ],
)
def test_bad_input_raises(x, kw, exc):
    with pytest.raises(exc):
        _quant(x, **kw)


def test_undithered_mode_is_rtn_on_the_same_layout():
    x = torch.randn(32, 64)
    qt = _quant(x, dithered=False)
    s = qt.scales.float().repeat_interleave(32, -1)
    assert torch.equal(qt.codes.float(), torch.round(x / s))
    assert torch.equal(dither_dequantize(qt), s * qt.codes.float())


def test_fp32_scale_bug_breaks_the_bound_and_residual_helper():
    from kvlib.formats.dither_int8 import residual

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 64, generator=g)
    good, bad = _quant(x), _quant(x, quantize_scale="fp32")
    eps_good, _ = residual(x, good)
    eps_bad, _ = residual(x, bad)
    assert float(eps_good.abs().max()) <= 0.5 + 2.0**-16
    assert int((eps_bad.abs() > 0.5 + 2.0**-16).sum()) > 0
    with pytest.raises(ValueError):
        _quant(x, quantize_scale="bf16")
