"""The h8 dither layout (sixteen 8-bit dithers per Philox call) through storage, write kernel and decode.

Mirrors the h10 tests (tests/test_dither_h10.py) on the properties the certificate uses: exact values on a
256-point grid, one (counter, word, byte) per (stream, slot, channel), error within half a step, a grid mean
of at most 2^-9 (kvlib.core.philox.DITHER_BIAS) that the radius carries, and the Triton write and decode kernels
against their torch references.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

from kvlib.certify.bound import radius_multiplier, rounding_slack
from kvlib.core.philox import DITHER_BIAS, byte_to_xi, dither, dither_counter, h8_channel_map, philox4x32_10, seed_key
from kvlib.formats.dither_int8 import dither_dequantize, dither_quantize, residual
from kvlib.kernels.int8.decode import Int8KernelConfig, decode_int8, decode_reference, make_pool_side, resolve_impl
from kvlib.storage.paged import PagedPool

sys.path.insert(0, os.path.dirname(__file__))
from _soundness import assert_rows_within_certificate  # noqa: E402

SEED = 2**63 + 977
INTERP = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_h8_dither_on_256_grid_and_in_range():
    xi = dither(torch.arange(1024), 128, layer=3, kv_head=1, seed=SEED, layout="h8").double()
    n = xi * 2**9  # odd integers in [-255, 255]
    assert torch.equal(n, n.round()) and bool((n.remainder(2) == 1).all())
    assert float(xi.min()) >= -0.5 + 2.0**-9 and float(xi.max()) <= 0.5 - 2.0**-9
    assert torch.unique(n).numel() == 256  # 2^17 draws on 256 points: every point occurs


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_channel_map_is_bijection(d):
    cmap = h8_channel_map(d)
    assert tuple(cmap.shape) == (d // 16, 4, 4)
    assert torch.equal(cmap.flatten().sort().values, torch.arange(d))
    for i in range(4):  # word i covers the contiguous block [i d/4, (i+1) d/4): one scale group at d = 128
        assert torch.equal(cmap[:, i].flatten().sort().values, torch.arange(i * d // 4, (i + 1) * d // 4))


def test_equals_direct_philox_recomputation():
    d, layer, kv_head, side = 32, 5, 2, 1
    slots = torch.tensor([0, 9, 123456, 2**32 - 1])
    xi = dither(slots, d, layer=layer, kv_head=kv_head, seed=SEED, side=side, layout="h8")
    ctr = dither_counter(slots, d, layer=layer, kv_head=kv_head, side=side, layout="h8")
    assert tuple(ctr.shape) == (4, d // 16, 4)
    key = torch.tensor(seed_key(SEED), dtype=torch.int64)
    for r, slot in enumerate(slots.tolist()):
        for j in range(d // 16):
            words = philox4x32_10(torch.tensor([slot, j, kv_head, (layer << 1) | side]), key).tolist()
            for i, w in enumerate(words):
                for k in range(4):
                    want = (((w >> (8 * k)) & 0xFF) + 0.5) * 2.0**-8 - 0.5
                    assert float(xi[r, i * (d // 4) + 4 * j + k]) == want
    assert torch.equal(byte_to_xi(torch.tensor([0, 1, 255, 256 + 7])),
                       torch.tensor([-0.5 + 2**-9, -0.5 + 3 * 2**-9, 0.5 - 2**-9, -0.5 + 15 * 2**-9]))


def test_grid_mean_bound_exact():
    """For any fixed y the mean error over the 256 dither values is at most 2^-9 (DITHER_BIAS), and the centred
    part is a discrete uniform with variance below 1/12."""
    xi = byte_to_xi(torch.arange(256)).double()
    y = torch.rand(4000, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 8 - 4
    y = torch.cat([y, torch.arange(-512, 513, dtype=torch.float64)[:, None] * 2.0**-9])  # grid-aligned: the worst
    e = torch.round(y + xi) - (y + xi)
    assert float(e.mean(-1).abs().max()) <= DITHER_BIAS["h8"] * (1 + 1e-9)
    assert float(e.mean(-1).abs().max()) >= DITHER_BIAS["h8"] * (1 - 1e-9)  # attained: the bound is tight
    assert float(e.var(-1, correction=0).max()) <= (256**2 - 1) / 12 * 2.0**-16 * (1 + 1e-9)


def test_h8_error_within_half_step_and_layout_matters():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 128, generator=g)
    x[:, 5] *= 40
    qt = dither_quantize(x, layer=2, kv_head=1, slots=torch.arange(1000, 1512), seed=SEED, dither_layout="h8")
    eps, s = residual(x, qt)
    assert qt.dither_layout == "h8" and int((eps.abs() > 0.5).sum()) == 0
    assert int(((dither_dequantize(qt).double() - x.double()).abs() > s / 2).sum()) == 0
    h10 = dither_quantize(x, layer=2, kv_head=1, slots=torch.arange(1000, 1512), seed=SEED, dither_layout="h10")
    assert not torch.equal(h10.codes, qt.codes)


def test_d_must_be_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        PagedPool(n_layers=1, n_slots=4, n_kv_heads=1, d=40, group=8, dither_layout="h8")
    with pytest.raises(ValueError, match="multiple of 16"):
        dither_counter(torch.arange(3), 24, layer=0, kv_head=0, layout="h8")


def test_slack_and_radius_carry_the_larger_mean():
    assert rounding_slack(128, "h10", "h8") - rounding_slack(128, "h10", "h10") == pytest.approx(2.0**-9 - 2.0**-11)
    r8 = radius_multiplier(4096, 1e-2, 128, impl="h10", layout="h8")
    r10 = radius_multiplier(4096, 1e-2, 128, impl="h10", layout="h10")
    assert r10 < r8 < r10 * 1.02  # about 1% more radius
    assert resolve_impl("auto", 128, 32, layout="h8") == "h10"
    with pytest.raises(ValueError, match="w24"):
        resolve_impl("tc", 128, 32, layout="h8")


# the Triton tile dither_tile_h8 is checked with the h10 tile in tests/test_dither_h10.py


@pytest.mark.gpu
@pytest.mark.skipif(not INTERP, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_write_kernel_matches_torch_h8():
    from kvlib.kernels.int8.write import write_int8

    kw = dict(n_layers=2, n_slots=40, n_kv_heads=2, d=128, group=32, side=0, seed=SEED, n_out=4, device=DEV)
    ref, tri, h10 = PagedPool(**kw, dither_layout="h8"), PagedPool(**kw, dither_layout="h8"), PagedPool(
        **kw, dither_layout="h10")
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 2, 128, generator=g) * torch.exp(torch.randn(9, 2, 1, generator=g))).to(DEV)
    slots = torch.randperm(40, generator=g)[:9].to(DEV)
    write_int8(ref, 1, x, slots, backend="torch")
    write_int8(tri, 1, x, slots, backend="triton", block_s=4)
    write_int8(h10, 1, x, slots, backend="triton", block_s=4)
    assert torch.equal(ref.codes, tri.codes) and torch.equal(ref.scales.view(torch.int16), tri.scales.view(torch.int16))
    assert not torch.equal(h10.codes, tri.codes)  # the layout reaches the kernel


def _dev(side):
    return dataclasses.replace(side, **{f.name: getattr(side, f.name).to(DEV) for f in dataclasses.fields(side)
                                        if isinstance(getattr(side, f.name), torch.Tensor)})


def _setup(hq=7, hkv=1, S=40, B=2, d=128):
    g = torch.Generator().manual_seed(hq * 10 + hkv + S)
    K = torch.randn(B * S, hkv, d, generator=g)
    K[:, :, 9] *= 25
    V = torch.randn(B * S, hkv, d, generator=g)
    slot_ids = torch.randperm(B * S + 5, generator=g)[: B * S]
    koc = torch.stack([torch.tensor([8, 9]) + 32 * h for h in range(hkv)])  # an outlier RoPE pair per head
    kp = make_pool_side(K, layer=2, seed=SEED, side=0, n_slots=B * S + 5, slot_ids=slot_ids, outlier_channels=koc,
                        dither_layout="h8", group=d // 4)  # the kernel's shape rule: d = 4 x group
    vp = make_pool_side(V, layer=2, seed=SEED, side=1, n_slots=B * S + 5, slot_ids=slot_ids, dithered=False,
                        group=d // 4)
    slots = slot_ids.view(B, S).to(torch.int32)
    seq = torch.tensor([S - 5 * b for b in range(B)], dtype=torch.int32)
    q = 2 * torch.randn(B, hq, d, generator=g)
    return q.to(DEV), _dev(kp), _dev(vp), slots.to(DEV), seq.to(DEV), (K, slot_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not INTERP, reason="Triton needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_reference_h8(qdtype):
    q, kp, vp, slots, seq, _ = _setup()
    q = q.to(qdtype)
    ref = decode_reference(q, kp, vp, slots, seq, layer=2, seed=SEED, impl="h10")
    out = decode_int8(q, kp, vp, slots, seq, layer=2, seed=SEED, num_splits=3,
                      config=Int8KernelConfig(block_n=16))  # auto -> h10 kernel
    # the h8 dither term, -(4 + b 2^-8) . q_hi, is three times h10's in magnitude, and so is its fp32 rounding:
    # outputs agree to 5e-6 here, against 3e-6 for h10 (tests/test_decode_h10.py)
    for f in ("o", "lse", "A", "B", "tv_bound", "tv_bound_one"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f), atol=5e-6, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not INTERP, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_decode_kernel_matches_reference_h8_d256():
    """d = 256 (groups of 64): sixteen calls per position, each word feeding 64 channels of its group."""
    q, kp, vp, slots, seq, _ = _setup(hq=4, hkv=2, S=24, d=256)
    ref = decode_reference(q, kp, vp, slots, seq, layer=2, seed=SEED, impl="h10")
    out = decode_int8(q, kp, vp, slots, seq, layer=2, seed=SEED, num_splits=2,
                      config=Int8KernelConfig(block_n=16))
    # scores are sums over 256 channels with |o| up to ~3.4 here: the fp32 rounding of o and lse is ~1e-5 for
    # h10 on the same problem as well; the certificate's quantities stay at 1e-6
    for f, atol in (("o", 3e-5), ("lse", 5e-5), ("A", 2e-6), ("tv_bound", 2e-6)):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f), atol=atol, rtol=2e-5)


def test_reference_certificate_sound_on_h8_pool():
    """The rows' true TV against exact keys stays within the h8 reference certificate (the radius with its
    2^-9 mean term)."""
    q, kp, vp, slots, seq, (K, slot_ids) = _setup(hq=4, S=64)
    _, probs = decode_reference(q.cpu(), kp, vp, slots.cpu(), seq.cpu(), layer=2, seed=SEED, impl="h10",
                                return_probs=True)
    out = decode_reference(q.cpu(), kp, vp, slots.cpu(), seq.cpu(), layer=2, seed=SEED, impl="h10")
    assert math.isfinite(float(out.tv_bound.max()))
    assert_rows_within_certificate(q.cpu(), K, slot_ids, slots.cpu(), seq.cpu(), probs, out.tv_bound)


@pytest.mark.parametrize("family", ["gaussian", "massive"])
def test_h8_soundness_over_redrawn_dithers(family):
    """Redraw the h8 dither 30 times over 200 rows (keys and queries fixed): wherever the union-bound event holds
    the true TV is within the certificate (the theorem's deterministic part), and the event fails at a rate whose
    exact 95% interval starts below delta (its probabilistic part, radius with the 2^-9 mean)."""
    from scipy.stats import binomtest

    from kvlib.certify.bound import certify_trials, synthetic_keys

    g = torch.Generator().manual_seed(11)
    k = synthetic_keys(family, 128, 64, generator=g)
    q = 3.0 * torch.randn(200, 64, generator=g)
    deltas = (0.5, 0.1)
    r = certify_trials(k, q, trials=30, deltas=deltas, seed0=500, layout="h8")
    for i, delta in enumerate(deltas):
        ok = r["event"][i] == 0
        assert bool((r["tv"][ok] <= r["cert"][i][ok] + 1e-12).all())
        fails = int(r["event"][i].sum())
        assert binomtest(fails, r["event"][i].numel()).proportion_ci(method="exact").low <= delta
