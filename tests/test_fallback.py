"""Head- and block-level fallback: selection, exactness, monotonicity in tau, soundness, bytes."""

import math

import pytest
import torch

from kvlib.certify.bound import certificate_from_scores, score_radius, tv_distance
from kvlib.certify.fallback import block_excess, block_fallback, fallback_heads, fp16_radius
from kvlib.formats.dither_int8 import dither_dequantize, dither_quantize
from kvlib.kernels.int8.decode import decode_reference, make_pool_side


def _row(S=512, d=64, seed=0, massive=12.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, d, generator=g)
    k[:, 5] *= massive * (1 + torch.rand(S, generator=g))  # massive channel: large scales, large radius
    qt = dither_quantize(k, layer=0, kv_head=0, slots=torch.arange(S), seed=3)
    k_hat = dither_dequantize(qt).double()
    q = 2 * torch.randn(d, generator=g, dtype=torch.float64)
    sm = 1 / math.sqrt(d)
    k16 = k.half()
    z_exact = sm * k16.double() @ q
    z_hat = sm * k_hat @ q
    u = score_radius(q, qt.scales, sm_scale=sm, n=S, delta=0.01)
    return z_hat, z_exact, u, fp16_radius(q, k16, sm_scale=sm), sm * k.double() @ q


def test_block_fallback_stops_at_tau_and_is_monotone_in_tau():
    z_hat, z_exact, u, u16, _ = _row()
    res = {tau: block_fallback(z_hat, z_exact, u, tau=tau, block_size=64, u_paged=u16, bytes_per_token=256)
           for tau in (0.05, 0.1, 0.2, 0.4)}
    start = res[0.05].cert_before
    assert start > 0.05  # the setting needs fallback at the smallest tau
    last = None
    for tau, r in sorted(res.items()):
        assert r.cert_after <= tau or r.blocks_paged == len(r.order)
        assert r.bytes_moved == int(r.exact.sum()) * 2 * 64 * 2 and r.bytes_moved <= r.bytes_whole_head
        if last is not None:  # a looser threshold never needs more blocks
            assert r.blocks_paged <= last.blocks_paged and r.bytes_moved <= last.bytes_moved
        last = r
    full = block_fallback(z_hat, z_exact, u, tau=0.0, block_size=64)  # page everything: exact, zero radius
    assert full.blocks_paged == len(full.order) and full.cert_after == pytest.approx(0.0, abs=1e-12)


def test_block_order_follows_the_excess_and_certificates_stay_sound():
    z_hat, z_exact, u, u16, z_true = _row(seed=1)
    r = block_fallback(z_hat, z_exact, u, tau=0.0, block_size=128, u_paged=u16)
    exc = block_excess(z_hat, u, 128)
    assert exc[r.order].tolist() == sorted(exc.tolist(), reverse=True)
    # after each paged block the certificate still bounds the true TV (true = unrounded keys)
    p_true = torch.softmax(z_true, -1)
    exact = torch.zeros_like(z_hat, dtype=torch.bool)
    for k, j in enumerate(r.order):
        exact[j * 128:(j + 1) * 128] = True
        tv = tv_distance(p_true, torch.softmax(torch.where(exact, z_exact, z_hat), -1))
        assert tv <= r.trajectory[k + 1]


def test_nonfinite_row_is_over_threshold_and_paged():
    z_hat, z_exact, u, _, _ = _row(S=256)
    u = u.clone()
    u[10] = math.inf
    r = block_fallback(z_hat, z_exact, u, tau=0.2, block_size=64)
    assert math.isinf(r.cert_before) and r.order[0] == 0 and r.blocks_paged >= 1


def test_head_fallback_recomputes_selected_groups_exactly():
    g = torch.Generator().manual_seed(4)
    B, hq, hkv, d, S = 2, 4, 2, 64, 48
    K = torch.randn(B * S, hkv, d, generator=g)
    K[:, 0, 3] *= 60  # KV head 0 has a massive channel: its certificates are large
    V = torch.randn(B * S, hkv, d, generator=g)
    kp = make_pool_side(K, layer=0, seed=9, side=0)
    vp = make_pool_side(V, layer=0, seed=9, side=1, dithered=False)
    slots = torch.arange(B * S).view(B, S)
    seq = torch.tensor([S, S - 10])
    q = 3 * torch.randn(B, hq, d, generator=g)
    out = decode_reference(q, kp, vp, slots, seq, layer=0, seed=9)
    tau = float(out.tv_bound[:, 2:].max()) + 1e-9  # KV head 1 passes, head 0 does not
    assert (out.tv_bound[:, :2] > tau).all()
    new, rep = fallback_heads(out, q, K.half(), V.half(), slots, seq, tau=tau)
    assert rep.kv_heads_paged == B and rep.paged[:, 0].all() and not rep.paged[:, 1].any()
    assert rep.bytes_moved == sum(2 * int(L) * d * 2 for L in seq)
    assert (new.tv_bound[:, :2] < out.tv_bound[:, :2]).all()  # the fp16 copy's own certificate
    assert torch.equal(new.o[:, 2:], out.o[:, 2:])
    for b in range(B):
        L = int(seq[b])
        rows = slots[b, :L]
        z = q[b, :2].double() @ K[rows, 0].half().double().T / math.sqrt(d)
        torch.testing.assert_close(new.o[b, :2], torch.softmax(z, -1) @ V[rows, 0].half().double())
    c = certificate_from_scores(z, fp16_radius(q[1, :2], K[rows, 0].half(), sm_scale=1 / math.sqrt(d)))
    torch.testing.assert_close(new.tv_bound[1, :2], c.tv_bound)


def test_fallback_bad_inputs():
    z = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="length"):
        block_fallback(z, z[:4], z)
    with pytest.raises(ValueError, match="tau"):
        block_fallback(z, z, z, tau=-1.0)
    with pytest.raises(ValueError, match="block_size"):
        block_fallback(z, z, z, block_size=0)
