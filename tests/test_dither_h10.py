"""The h10 dither layout (eight 10-bit dithers per Philox call) through storage, write kernel and decode.

Properties only: the dither's grid and range, the channel map's bijection, distinct Philox inputs per
(slot, channel), agreement with a direct Random123 recomputation, the s/2 error bound, the error's
mean and variance against discrete-uniform theory, Triton == torch, and the radius ordering.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import triton
import triton.language as tl

from kvlib.certify.bound import TC_RADIUS_INFLATE, rounding_slack, score_radius
from kvlib.core.philox import (
    DITHER_BIAS,
    dither,
    dither_counter,
    h10_channel_map,
    half_to_xi,
    philox4x32_10,
    seed_key,
)
from kvlib.formats.base import get_format
from kvlib.formats.dither_int8 import DitherQTensor, dither_dequantize, dither_quantize, residual
from kvlib.kernels.int8.decode import PoolSide, as_side, decode_reference, make_pool_side, resolve_impl
from kvlib.kernels.int8.reference import _query_residual_mult
from kvlib.kernels.tl.philox import dither_tile_h8, dither_tile_h10
from kvlib.storage.paged import PagedKV, PagedPool

SEED = 2**63 + 977
INTERP = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x(S: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, d, generator=g) * torch.exp(torch.randn(S, 1, generator=g))


# --- the dither itself ------------------------------------------------------------------------
def test_h10_dither_on_1024_grid_and_in_range():
    xi = dither(torch.arange(4096), 128, layer=3, kv_head=1, seed=SEED, layout="h10").double()
    n = xi * 2**11  # odd integers in [-1023, 1023]
    assert torch.equal(n, n.round()) and bool((n.remainder(2) == 1).all())
    lo, hi = -0.5 + 2.0**-11, 0.5 - 2.0**-11
    assert float(xi.min()) >= lo and float(xi.max()) <= hi
    # 2^19 draws on 1024 points (expected 512 each): every grid point occurs
    assert torch.unique(n).numel() == 1024


@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_channel_map_is_bijection(d):
    cmap = h10_channel_map(d)
    assert tuple(cmap.shape) == (d // 8, 4, 2)
    assert torch.equal(cmap.flatten().sort().values, torch.arange(d))
    # word i covers the contiguous block [i d/4, (i+1) d/4)
    for i in range(4):
        assert torch.equal(cmap[:, i].flatten().sort().values, torch.arange(i * d // 4, (i + 1) * d // 4))


def test_distinct_philox_inputs_per_slot_and_channel():
    d, slots = 64, torch.tensor([0, 1, 7, 2**32 - 1])
    seen = set()
    cmap = h10_channel_map(d)
    for layer in (0, 1):
        for side in (0, 1):
            for kv_head in (0, 3):
                ctr = dither_counter(slots, d, layer=layer, kv_head=kv_head, side=side, layout="h10")
                assert tuple(ctr.shape) == (slots.numel(), d // 8, 4)
                for s in range(slots.numel()):
                    for j in range(d // 8):
                        for i in range(4):
                            for h in range(2):
                                seen.add((tuple(ctr[s, j].tolist()), i, h))
                                assert int(cmap[j, i, h]) < d
    assert len(seen) == 8 * slots.numel() * d  # one (counter, word, half) per (stream, slot, channel)


def test_equals_direct_philox_recomputation():
    d, layer, kv_head, side = 32, 5, 2, 1
    slots = torch.tensor([0, 9, 123456, 2**32 - 1])
    xi = dither(slots, d, layer=layer, kv_head=kv_head, seed=SEED, side=side, layout="h10")
    key = torch.tensor(seed_key(SEED), dtype=torch.int64)
    for r, slot in enumerate(slots.tolist()):
        for j in range(d // 8):
            words = philox4x32_10(torch.tensor([slot, j, kv_head, (layer << 1) | side]), key).tolist()
            for i, w in enumerate(words):
                for h, v in enumerate((w & 0xFFFF, w >> 16)):
                    want = ((v >> 6) + 0.5) * 2.0**-10 - 0.5
                    assert float(xi[r, i * (d // 4) + 2 * j + h]) == want
    assert torch.equal(half_to_xi(torch.tensor([0, 63, 64, 0xFFFF])),
                       torch.tensor([-0.5 + 2**-11, -0.5 + 2**-11, -0.5 + 3 * 2**-11, 0.5 - 2**-11]))


# --- quantisation error -----------------------------------------------------------------------
def test_h10_error_within_half_step():
    x = _x(512, 128, seed=1)
    x[:, 5] *= 40  # an outlier channel inflating its group's scale
    qt = dither_quantize(x, layer=2, kv_head=1, slots=torch.arange(1000, 1512), seed=SEED, dither_layout="h10")
    assert qt.dither_layout == "h10"
    eps, s = residual(x, qt)
    assert int((eps.abs() > 0.5).sum()) == 0
    k_hat = dither_dequantize(qt).double()
    assert int(((k_hat - x.double()).abs() > s / 2).sum()) == 0
    # reading with the other layout breaks the bound (the layout really is part of the storage)
    wrong = DitherQTensor(**{**vars(qt), "dither_layout": "w24"})
    assert int(((dither_dequantize(wrong).double() - x.double()).abs() > s / 2).sum()) > 0


def test_grid_mean_bound_exact():
    """For any fixed y the mean error over the 1024 dither values is at most 2^-11 (DITHER_BIAS)."""
    xi = half_to_xi(torch.arange(0, 2**16, 64)).double()  # the 1024 values, once each
    assert torch.unique(xi).numel() == 1024
    y = torch.rand(4000, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 8 - 4
    y = torch.cat([y, torch.arange(-2048, 2049, dtype=torch.float64)[:, None] * 2.0**-11])  # grid-aligned
    e = torch.round(y + xi) - (y + xi)
    mean = e.mean(-1).abs()
    assert float(mean.max()) <= DITHER_BIAS["h10"] * (1 + 1e-9)
    # centred part: a discrete uniform on 1024 points, variance (1024^2 - 1) / 12 2^-20 < 1/12
    assert float(e.var(-1, correction=0).max()) <= (1024**2 - 1) / 12 * 2.0**-20 * (1 + 1e-9)


def test_error_mean_and_variance_match_theory():
    S, d = 2048, 128
    x = _x(S, d, seed=4)
    qt = dither_quantize(x, layer=0, kv_head=0, slots=torch.arange(S), seed=SEED + 1, dither_layout="h10")
    e = residual(x, qt)[0].flatten()
    n = e.numel()
    var_theory = (1024**2 - 1) / 12 * 2.0**-20  # discrete uniform on 1024 points, step 2^-10
    assert abs(float(e.mean())) <= DITHER_BIAS["h10"] + 5 * math.sqrt(var_theory / n)
    sd_var = math.sqrt((1 / 80 - 1 / 144) / n)  # sd of the mean of e^2 for a uniform error
    assert abs(float(e.pow(2).mean()) - var_theory) <= DITHER_BIAS["h10"] ** 2 + 5 * sd_var


def test_format_class_carries_layout():
    x = _x(16, 64, seed=5)
    fmt = get_format("dither-int8", dither_layout="h10")
    packed = fmt.write(x, slots=torch.arange(16), seed=SEED)
    assert packed.dither_layout == "h10"
    ref = dither_quantize(x, layer=0, kv_head=0, slots=torch.arange(16), seed=SEED, dither_layout="h10")
    assert torch.equal(packed.codes, ref.codes)
    assert torch.equal(fmt.read(packed), dither_dequantize(ref))
    w24 = get_format("dither-int8").write(x, slots=torch.arange(16), seed=SEED)
    assert w24.dither_layout == "w24" and not torch.equal(w24.codes, packed.codes)


# --- paged pool and write kernel --------------------------------------------------------------
def _pool(**kw) -> PagedPool:
    base = dict(n_layers=2, n_slots=40, n_kv_heads=2, d=64, group=32, side=0, seed=SEED, dither_layout="h10")
    return PagedPool(**(base | kw))


def test_paged_read_round_trip_h10():
    from kvlib.kernels.int8.write import write_int8_reference

    pool = _pool(n_out=2)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, 2, 64, generator=g)
    slots = torch.randperm(40, generator=g)[:12]
    write_int8_reference(pool, 1, x, slots)
    view = pool.layer(1)
    assert view.dither_layout == "h10" and as_side(view, "k").dither_layout == "h10"
    k_hat = pool.read(1, slots).double()
    s = pool.scales[1][slots].double().repeat_interleave(32, -1)
    for h in range(2):
        s[:, h, pool.outlier_channels[1, h]] = math.inf  # fp16 bypass, not in s units
        qt = dither_quantize(x[:, h], layer=1, kv_head=h, slots=slots, seed=SEED, side=0,
                             outlier_channels=pool.outlier_channels[1, h], dither_layout="h10")
        assert torch.equal(k_hat[:, h].float(), dither_dequantize(qt))
    assert int(((k_hat - x.double()).abs() > s / 2).sum()) == 0
    kv = PagedKV(n_layers=1, n_slots=4, n_kv_heads=1, d=64, dither_layout="h10")
    assert kv.k.dither_layout == kv.v.dither_layout == "h10"


@pytest.mark.gpu
@pytest.mark.skipif(not INTERP, reason="Triton needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("d,group,n_out", [(64, 32, 0), (128, 32, 4)])
def test_write_kernel_matches_torch_h10(d, group, n_out):
    from kvlib.kernels.int8.write import write_int8

    ref, tri, w24 = (_pool(d=d, group=group, n_out=n_out, device=DEV) for _ in range(3))
    w24.dither_layout = "w24"
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 2, d, generator=g) * torch.exp(torch.randn(9, 2, 1, generator=g))).to(DEV)
    x[0, 1, :group] = 0  # an all-zero group
    slots = torch.randperm(40, generator=g)[:9].to(DEV)
    write_int8(ref, 1, x, slots, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # interpreter's 0/0 on the all-zero group
        write_int8(tri, 1, x, slots, backend="triton", block_s=4)
        write_int8(w24, 1, x, slots, backend="triton", block_s=4)
    assert torch.equal(ref.codes, tri.codes)
    assert torch.equal(ref.scales.view(torch.int16), tri.scales.view(torch.int16))
    assert torch.equal(ref.outliers.view(torch.int16), tri.outliers.view(torch.int16))
    assert not torch.equal(w24.codes, tri.codes)  # the constexpr layout reaches the kernel


@triton.jit
def _tile_kernel(s_ptr, o_ptr, kv_head, layer, side, k0, k1, BS: tl.constexpr, D: tl.constexpr, H8: tl.constexpr):
    r = tl.arange(0, BS)
    if H8:
        xi = dither_tile_h8(tl.load(s_ptr + r), kv_head, layer, side, k0, k1, D)
    else:
        xi = dither_tile_h10(tl.load(s_ptr + r), kv_head, layer, side, k0, k1, D)
    tl.store(o_ptr + r[:, None] * D + tl.arange(0, D)[None, :], xi)


@pytest.mark.gpu
@pytest.mark.skipif(not INTERP, reason="Triton needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize(("layout", "d"), [("h10", 8), ("h10", 64), ("h10", 128), ("h8", 16), ("h8", 64),
                                           ("h8", 128)])
def test_dither_tile_matches_reference(layout, d):
    """The Triton tiles of the half-word layouts against the torch dither, bit for bit (the smallest d is one
    Philox call per position)."""
    slots = torch.tensor([0, 5, 2**32 - 1, 123456], dtype=torch.int64)
    k0, k1 = seed_key(SEED)
    out = torch.empty(4, d, device=DEV)
    for kv_head, layer, side in ((3, 17, 1), (1, 1, 0), (0, 0, 1)):  # 1 and 0 arrive specialised
        _tile_kernel[(1,)](slots.to(DEV), out, kv_head, layer, side, k0, k1, BS=4, D=d, H8=layout == "h8")
        assert torch.equal(out.cpu(), dither(slots, d, layer=layer, kv_head=kv_head, seed=SEED, side=side,
                                             layout=layout))


# --- decode reference and radius --------------------------------------------------------------
@pytest.mark.parametrize("d,group,impl", [(128, 32, "h10"), (64, 16, "fma")])
def test_decode_reference_h10_vs_direct(d, group, impl):
    from kvlib.kernels.int8.write import write_int8_reference

    B, hq, hkv, n_slots = 2, 4, 2, 48
    kv = PagedKV(n_layers=1, n_slots=n_slots, n_kv_heads=hkv, d=d, group=group, seed=SEED, dither_layout="h10",
                 dither_v=False)
    g = torch.Generator().manual_seed(8)
    slots = torch.randperm(n_slots, generator=g)[: 2 * 20].reshape(B, 20)
    seq = torch.tensor([20, 13])
    for side, pool in ((0, kv.k), (1, kv.v)):
        write_int8_reference(pool, 0, torch.randn(n_slots, hkv, d, generator=g)[: 40] * (1 + side), slots.flatten())
    q = torch.randn(B, hq, d, generator=g)
    out = decode_reference(q, kv.k.layer(0), kv.v.layer(0), slots, seq, layer=0, seed=SEED, impl=impl)
    sm = 1 / math.sqrt(d)
    for b in range(B):
        sl = slots[b, : int(seq[b])]
        kh, vh = kv.k.read(0, sl).double(), kv.v.read(0, sl).double()  # [L, hkv, d]
        for h in range(hq):
            z = sm * kh[:, h // 2] @ q[b, h].double()
            p = torch.softmax(z, 0)
            torch.testing.assert_close(out.o[b, h], p @ vh[:, h // 2], rtol=0, atol=1e-5)
            torch.testing.assert_close(out.lse[b, h], torch.logsumexp(z, 0), rtol=0, atol=1e-5)
    assert bool((out.A >= 1).all()) and bool(torch.isfinite(out.tv_bound).all())


def test_radius_h10_not_below_w24():
    g = torch.Generator().manual_seed(9)
    d = 128
    q = torch.randn(3, d, generator=g)
    scales = (torch.rand(50, d // 32, generator=g) + 0.01).half()
    kw = dict(sm_scale=d**-0.5, n=50, delta=1e-3)
    u_w = score_radius(q, scales, **kw)
    u_h = score_radius(q, scales, layout="h10", **kw)
    assert bool((u_h > u_w).all())
    u_h10 = score_radius(q, scales, impl="h10", layout="h10", **kw)
    assert bool((u_h10 > score_radius(q, scales, impl="tc", **kw)).all())
    assert rounding_slack(d, "fma", "h10") - rounding_slack(d, "fma", "w24") == DITHER_BIAS["h10"] - DITHER_BIAS["w24"]
    # query residual: h10 (dither dot with hi only) never below tc; zero for fp16 queries
    assert bool((_query_residual_mult(q, 0.1, 32, None, "h10") >= _query_residual_mult(q, 0.1, 32, None)).all())
    assert float(_query_residual_mult(q.half(), 0.1, 32, None, "h10").abs().max()) == 0.0


def test_query_residual_h10_bounds_split_error():
    """The h10 kernel's split (codes x (hi + lo), dither x hi) differs from the exact dot by at most
    ``sm 127.5 sum_g s_g R'_g``, which ``detm * sqrt(var)`` bounds."""
    g = torch.Generator().manual_seed(10)
    d, G, S, sm = 128, 32, 64, 0.09
    q = torch.randn(2, d, generator=g) * 3
    codes = torch.randint(-127, 128, (S, d), generator=g).double()
    xi = dither(torch.arange(S), d, layer=0, kv_head=0, seed=SEED, layout="h10").double()
    s = (torch.rand(S, d // G, generator=g) + 0.1).double()
    s_c = s.repeat_interleave(G, -1)
    hi = q.half().float()
    lo = (q - hi).half().float()
    exact = sm * (q.double() @ (s_c * (codes - xi)).T)
    split = sm * ((hi + lo).double() @ (s_c * codes).T - hi.double() @ (s_c * xi).T)
    var = sm**2 / 12 * TC_RADIUS_INFLATE * (q.double().pow(2).reshape(2, -1, G).sum(-1) @ s.pow(2).T)
    detm = _query_residual_mult(q, sm, G, None, "h10")
    bound = var.sqrt() * (detm * TC_RADIUS_INFLATE)[:, None]
    assert bool(((split - exact).abs() <= bound).all())


def test_resolve_impl_rules():
    assert resolve_impl("auto", 128, 32, layout="h10") == "h10"
    assert resolve_impl("h10", 256, 64, layout="h10") == "h10"
    assert resolve_impl("fma", 64, 16, layout="h10") == "fma"
    assert resolve_impl("auto", 64, 16, layout="h8") == "h10"  # d = 64 as 4 groups of 16 (tests/test_decode_h10.py)
    for d, g in ((64, 32), (128, 16), (512, 128), (256, 32)):
        with pytest.raises(ValueError, match="group == d // 4"):
            resolve_impl("auto", d, g, layout="h10")
    with pytest.raises(ValueError, match="w24"):
        resolve_impl("tc", 128, 32, layout="h10")
    with pytest.raises(ValueError, match="h10"):
        resolve_impl("h10", 128, 32)
    assert resolve_impl("auto", 128, 32) == "tc" and resolve_impl("auto", 96, 32) == "fma"
    # make_pool_side records the layout; decode_reference then refuses the w24-only tc kernel's slack
    x = torch.randn(8, 1, 128, generator=torch.Generator().manual_seed(11))
    kp = make_pool_side(x, layer=0, seed=SEED, side=0, dither_layout="h10")
    vp = make_pool_side(x, layer=0, seed=SEED, side=1, dithered=False)
    assert kp.dither_layout == "h10" and vp.dither_layout == "w24"
    with pytest.raises(ValueError, match="w24"):
        decode_reference(torch.randn(1, 1, 128), kp, vp, torch.arange(8)[None], torch.tensor([8]), layer=0,
                         seed=SEED, impl="tc")


def test_bad_layout_names_raise():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="dither_layout"):
        dither_quantize(x, layer=0, kv_head=0, slots=torch.arange(4), seed=0, dither_layout="h16")
    with pytest.raises(ValueError, match="dither_layout"):
        PagedPool(n_layers=1, n_slots=4, n_kv_heads=1, d=64, dither_layout="W24")
    with pytest.raises(ValueError, match="dither_layout"):
        get_format("dither-int8", dither_layout=None)
    with pytest.raises(ValueError, match="dither_layout"):
        make_pool_side(x[:, None], layer=0, seed=0, side=0, dither_layout="x")
    with pytest.raises(ValueError, match="dither_layout"):
        resolve_impl("auto", 128, 32, layout="h12")
    with pytest.raises(ValueError, match="dither_layout"):
        as_side(PoolSide(torch.zeros(4, 1, 64, dtype=torch.int8), torch.zeros(4, 1, 2).half(), dither_layout="y"), "k")
    with pytest.raises(ValueError, match="multiple of 8"):
        PagedPool(n_layers=1, n_slots=4, n_kv_heads=1, d=36, group=4, dither_layout="h10")
