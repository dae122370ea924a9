"""Scratch restoration of the tensor-core INT8 kernel's value-dither path (removed at b7182e0, cause unknown) for the
GPU diagnosis :mod:`dev.vdither` (issue 28). Not part of kvlib: the kernel below is ``_decode_int8_stage1_tc`` of
``kvlib/kernels/int8/w24.py`` at de4df59 with the removed ``V_DITHER`` branch put back and diagnosis switches added;
:func:`launch` mirrors ``launch_w24``'s tc branch."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlib.certify.bound import rounding_gamma
from kvlib.core.fp16 import FP16_REL, FP16_SUB
from kvlib.kernels.int8.w24 import _xi
from kvlib.kernels.tl.cert import abs_up_fp16, split_fp16, union_radius
from kvlib.kernels.tl.merge import split_range
from kvlib.kernels.tl.paging import load_slots
from kvlib.kernels.tl.philox import philox4x32


@triton.jit(do_not_specialize=["layer", "seed_lo", "seed_hi"])
def _tc_vd(
    VXI, DBG, s_x_n, s_x_h,
    Q, KC, KS, KO, KOC, VC, VS, VO, VOC, SLOTS, SEQ,
    O_S, LSE_S, A_S, B_S,
    sm_scale, byp_rel, byp_abs, log_2_over_delta, rad_extra, layer, seed_lo, seed_hi,
    s_qb, s_qh,
    s_kc_n, s_kc_h, s_ks_n, s_ks_h, s_ko_n, s_ko_h,
    s_vc_n, s_vc_h, s_vs_n, s_vs_h, s_vo_n, s_vo_h,
    s_sl_b,
    s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    NOK: tl.constexpr, NOK_P: tl.constexpr, NOV: tl.constexpr, NOV_P: tl.constexpr,
    CERT: tl.constexpr, CERT_B: tl.constexpr,
    Q_SPLIT: tl.constexpr, XI_SPLIT: tl.constexpr, PV_TERMS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SKIP_DITHER: tl.constexpr = False, PAGE: tl.constexpr = 0, K_DITHER: tl.constexpr = True,
    V_DITHER: tl.constexpr = False, VD_MODE: tl.constexpr = 0, V_ORDER: tl.constexpr = 0,
):
    """The tensor-core stage 1 of ``kvlib.kernels.int8.w24`` (commit de4df59) with the value-dither path removed at
    b7182e0 restored (``V_DITHER``), plus the diagnosis switches of :mod:`dev.vdither` (``VD_MODE``: 0 the removed
    code, 1 the dither loaded from ``VXI`` instead of regenerated, 2 regenerated and also stored to ``DBG``;
    ``V_ORDER``: 0 ``s (c - xi)`` as removed, 1 ``s c - s xi``, 2 the RTN ``s c`` dots as shipped plus the dither's
    ``s xi`` in dots of its own, a candidate mend)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    NG: tl.constexpr = D // G
    G4: tl.constexpr = G // 4
    seq_len, start, end = split_range(SEQ, b, split, NUM_SPLITS)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    offs_c = tl.arange(0, G)
    offs_j = tl.arange(0, G4)
    offs_d = tl.arange(0, D)
    q_row = Q + b * s_qb + heads[:, None] * s_qh
    if NOK > 0:  # NOK_P >= 16: the bypass dots run on the tensor cores too
        offs_ok = tl.arange(0, NOK_P)
        mask_ok = offs_ok < NOK
        koc = tl.load(KOC + kvh * NOK + offs_ok, mask=mask_ok, other=-1).to(tl.int32)
        q_ko = tl.load(q_row + koc[None, :], mask=mask_h[:, None] & mask_ok[None, :], other=0.0).to(tl.float32)
        # stored outliers are fp16: q_ko as hi + lo fp16 leaves <= 2^-22 |q|, inside byp_rel's fp32 allowance
        qo_hi, qo_lo = split_fp16(q_ko)
    if CERT:
        radm = union_radius(seq_len, log_2_over_delta, rad_extra)
        # per-group sums of q^2 and of the split residual |r|, [BLOCK_H, 16] (columns >= NG are 0), once;
        # every term is >= 0, so the (1 + 2^-8) below keeps the fp32 sums upper bounds
        offs_16 = tl.arange(0, 16)
        qf = tl.load(q_row + offs_d[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32)
        if NOK > 0:
            qf = tl.where((tl.sum((offs_d[:, None] == koc[None, :]).to(tl.int32), 1) > 0)[None, :], 0.0, qf)
        rf = qf - qf.to(tl.float16).to(tl.float32)
        if Q_SPLIT:
            rf = rf - rf.to(tl.float16).to(tl.float32)
        onehot = (tl.arange(0, NG)[:, None] == offs_16[None, :]).to(tl.float32)[None, :, :]  # [1, NG, 16]
        q2pad = tl.sum(tl.sum(tl.reshape(qf * qf, (BLOCK_H, NG, G)), 2)[:, :, None] * onehot, 1)
        rpad = tl.sum(tl.sum(tl.reshape(tl.abs(rf), (BLOCK_H, NG, G)), 2)[:, :, None] * onehot, 1)
        var_c = sm_scale * sm_scale / 12.0 * (1.0 + 2.0**-8)
        # what the query split left, sm 127.5 sum_g R_g s_g (127.5 >= |c - xi|), is bounded by Cauchy-Schwarz
        # as detm * sqrt(var): one multiplier per row, no per-tile work (0 for fp16-exact queries)
        rr = tl.sum(tl.where(q2pad > 0, rpad * rpad / tl.where(q2pad > 0, q2pad, 1.0),
                             tl.where(rpad > 0, float("inf"), 0.0)), 1)
        detm = (sm_scale * 127.5 * (1.0 + 2.0**-8)) * tl.sqrt(rr) / tl.sqrt(var_c)
        radm_h = radm + detm * (1.0 + 2.0**-8)  # [BLOCK_H]
        if NOK > 0:  # |q_o| rounded UP to fp16: the product with the exact fp16 |k_o| is then an upper bound
            q_ko_abs16 = abs_up_fp16(q_ko)
            q_ko_sum = tl.sum(tl.abs(q_ko), 1)
        a_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        if CERT_B:
            b_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if NOV > 0:
        offs_ov = tl.arange(0, NOV_P)
        mask_ov = offs_ov < NOV
        voc = tl.load(VOC + kvh * NOV + offs_ov, mask=mask_ov, other=-1).to(tl.int32)
        acc_vo = tl.zeros([BLOCK_H, NOV_P], dtype=tl.float32)

    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    c3k = ((layer << 1) | 0).to(tl.uint32)
    c3v = ((layer << 1) | 1).to(tl.uint32)
    c2 = kvh.to(tl.uint32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if PAGE > 0:
            slot = load_slots(SLOTS + b * s_sl_b, offs_n, mask_n, PAGE)
        else:  # the slot table inline, as before paging existed (the same binary)
            slot = tl.load(SLOTS + b * s_sl_b + offs_n, mask=mask_n, other=0).to(tl.int64)
        cs = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, G4], dtype=tl.uint32)
        qk = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        if CERT:
            var = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for g in tl.static_range(NG):
            # ---- this group's query slice (outlier channels zeroed: their codes are 0, their dither unused)
            qg = tl.load(q_row + g * G + offs_c[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32)
            if NOK > 0:
                is_ok = tl.sum((g * G + offs_c[:, None] == koc[None, :]).to(tl.int32), 1) > 0
                qg = tl.where(is_ok[None, :], 0.0, qg)
            q_hi = qg.to(tl.float16)
            if Q_SPLIT:
                q_lo = (qg - q_hi.to(tl.float32)).to(tl.float16)  # the difference is exact in fp32
            # ---- keys [BLOCK_N, G]: codes exact in fp16, dither regenerated (one Philox call per 4 channels)
            kc = tl.load(KC + slot[:, None] * s_kc_n + kvh * s_kc_h + g * G + offs_c[None, :],
                         mask=mask_n[:, None], other=0)
            s_g = tl.load(KS + slot * s_ks_n + kvh * s_ks_h + g, mask=mask_n, other=0.0).to(tl.float32)
            kT = tl.trans(kc.to(tl.float16))
            t = tl.dot(q_hi, kT)
            if not K_DITHER and Q_SPLIT:
                t = tl.dot(q_lo, kT, t)
            if K_DITHER:  # the dithered kernel's dots in their validated order
                if SKIP_DITHER:  # timing only (the Philox cost on the roofline): a wrong dither, never a result
                    w0 = cs
                    w1 = cs
                    w2 = cs
                    w3 = cs
                else:
                    cg = (g * G4 + offs_j).to(tl.uint32)[None, :] + tl.zeros_like(cs)
                    w0, w1, w2, w3 = philox4x32(cs, cg, c2 + tl.zeros_like(cs), c3k + tl.zeros_like(cs), k0, k1)
                # join(join(x0, x2), join(x1, x3))[..., i, j] = x_{2i+j}: channel 4 j' + 2i + j in natural order
                xi = tl.reshape(tl.join(tl.join(_xi(w0), _xi(w2)), tl.join(_xi(w1), _xi(w3))), (BLOCK_N, G))
                xi16 = xi.to(tl.float16)
                xT = tl.trans(xi16)
                t = tl.dot(-q_hi, xT, t)
                if XI_SPLIT:  # xi - fp16(xi) is exact in fp32 and <= 2^-13: its fp16 rounding leaves <= 2^-25
                    t = tl.dot(-q_hi, tl.trans((xi - xi16.to(tl.float32)).to(tl.float16)), t)
                if Q_SPLIT:
                    t = tl.dot(q_lo, kT, t)
                    t = tl.dot(-q_lo, xT, t)
            qk += t * s_g[None, :]
            if CERT:  # var = sum_g Q2_g s_g^2 (the group's q^2 sum is cheaper here than a hoisted column)
                var += tl.sum(qg * qg, 1)[:, None] * (s_g * s_g)[None, :]
        if NOK > 0:
            ko = tl.load(KO + slot[:, None] * s_ko_n + kvh * s_ko_h + offs_ok[None, :],
                         mask=mask_n[:, None] & mask_ok[None, :], other=0.0)
            koT = tl.trans(ko.to(tl.float16))
            qk = tl.dot(qo_hi, koT, qk)
            qk = tl.dot(qo_lo, koT, qk)
        qk = tl.where(mask_n[None, :], qk * sm_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if CERT:
            u = tl.sqrt(var * var_c) * radm_h[:, None]
            if NOK > 0:  # fp32 accumulation of exact products: its rounding is inside the (1 + 2^-8)
                byp = tl.dot(q_ko_abs16, tl.trans(tl.abs(ko)).to(tl.float16))
                u += sm_scale * (byp * (byp_rel * (1.0 + 2.0**-8)) + q_ko_sum[:, None] * byp_abs)
            a_i = a_i * alpha + tl.sum(p * tl.exp(u), 1)
            if CERT_B:
                b_i = b_i * alpha + tl.sum(p * tl.exp(-u), 1)

        # ---- values [BLOCK_N, D] (RTN): v = s c exactly as v_hi + v_lo
        vc = tl.load(VC + slot[:, None] * s_vc_n + kvh * s_vc_h + offs_d[None, :], mask=mask_n[:, None], other=0)
        vs = tl.load(VS + slot[:, None] * s_vs_n + kvh * s_vs_h + (offs_d // G)[None, :], mask=mask_n[:, None],
                     other=0.0).to(tl.float32)
        if V_DITHER:  # the removed path (b7182e0^), VD_MODE 0 and 2 exactly as it was
            if VD_MODE == 1:
                vxi = tl.load(VXI + slot[:, None] * s_x_n + kvh * s_x_h + offs_d[None, :], mask=mask_n[:, None],
                              other=0.0)
            else:
                D4: tl.constexpr = D // 4
                offs_g = tl.arange(0, D4)
                vc0 = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, D4], dtype=tl.uint32)
                x0, x1, x2, x3 = philox4x32(vc0, offs_g.to(tl.uint32)[None, :] + tl.zeros_like(vc0),
                                            c2 + tl.zeros_like(vc0), c3v + tl.zeros_like(vc0), k0, k1)
                vxi = tl.reshape(tl.join(tl.join(_xi(x0), _xi(x2)), tl.join(_xi(x1), _xi(x3))), (BLOCK_N, D))
                if VD_MODE == 2:
                    tl.store(DBG + slot[:, None] * s_x_n + kvh * s_x_h + offs_d[None, :], vxi, mask=mask_n[:, None])
            if V_ORDER == 0:
                v = vs * (vc.to(tl.float32) - vxi)
            elif V_ORDER == 1:
                v = vs * vc.to(tl.float32) - vs * vxi
            else:  # 2: the RTN product s c as shipped, the dither's s xi in its own fp16 hi + lo dots (below)
                v = vs * vc.to(tl.float32)
                dv = vs * vxi
        else:
            v = vs * vc.to(tl.float32)
        if NOV > 0:
            vo = tl.load(VO + slot[:, None] * s_vo_n + kvh * s_vo_h + offs_ov[None, :],
                         mask=mask_n[:, None] & mask_ov[None, :], other=0.0).to(tl.float32)
            acc_vo = acc_vo * alpha[:, None] + tl.sum(p[:, :, None] * vo[None, :, :], 1)
        v_hi = v.to(tl.float16)
        pp = p * 1024.0  # keeps small weights out of fp16's subnormal range; undone at the end
        p_hi = pp.to(tl.float16)
        acc = acc * alpha[:, None]
        acc = tl.dot(p_hi, v_hi, acc)
        if PV_TERMS >= 2:
            acc = tl.dot(p_hi, (v - v_hi.to(tl.float32)).to(tl.float16), acc)
        if PV_TERMS >= 3:
            acc = tl.dot((pp - p_hi.to(tl.float32)).to(tl.float16), v_hi, acc)
        if V_DITHER and V_ORDER == 2:  # acc -= p (s xi): s xi as fp16 hi + lo, exact to 2^-22 as the value path
            dv_hi = dv.to(tl.float16)
            acc = tl.dot(-p_hi, dv_hi, acc)
            acc = tl.dot(-p_hi, (dv - dv_hi.to(tl.float32)).to(tl.float16), acc)
            acc = tl.dot(-(pp - p_hi.to(tl.float32)).to(tl.float16), dv_hi, acc)

    nonempty = l_i != 0.0  # NaN (non-finite keys) must stay NaN, not look empty
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_nat = O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + offs_d[None, :]
    if NOV > 0:
        vkeep = tl.sum((voc[:, None] == offs_d[None, :]).to(tl.int32), 0) == 0
        tl.store(o_nat, acc * (inv_l * (1.0 / 1024.0))[:, None], mask=mask_h[:, None] & vkeep[None, :])
        tl.store(O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + voc[None, :],
                 acc_vo * inv_l[:, None], mask=mask_h[:, None] & mask_ov[None, :])
    else:
        tl.store(o_nat, acc * (inv_l * (1.0 / 1024.0))[:, None], mask=mask_h[:, None])
    l_off = b * s_ls_b + heads * s_ls_h + split
    tl.store(LSE_S + l_off, lse, mask=mask_h)
    if CERT:
        tl.store(A_S + l_off, a_i * inv_l, mask=mask_h)
        if CERT_B:
            tl.store(B_S + l_off, b_i * inv_l, mask=mask_h)


def launch(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, *, sm: float, delta: float, rad_extra: float, layer: int,
           k0: int, k1: int, ns: int, cert: bool, cert_b: bool, v_dither: bool, block_n: int, num_warps: int,
           num_stages: int, vd_mode: int = 0, v_order: int = 0, vxi: torch.Tensor | None = None,
           dbg: torch.Tensor | None = None, xi_split: bool = True, pv_terms: int = 3) -> None:
    """``launch_w24``'s tc branch for :func:`_tc_vd` (``vxi``/``dbg``: float32 ``[n_slots, H_kv, d]``)."""
    from kvlib.kernels.backend import triton_available

    if not triton_available(q.device):
        raise RuntimeError("the scratch kernel needs CUDA or TRITON_INTERPRET=1 set before triton is imported")
    B, hq, d = q.shape
    n_slots, hkv, _ = k.codes.shape
    gqa = hq // hkv
    ks = k.scales.contiguous()
    vs = v.scales.contiguous()
    nok = k.outliers.shape[-1] if k.outliers is not None else 0
    nov = v.outliers.shape[-1] if v.outliers is not None else 0
    ko = k.outliers.contiguous() if nok else ks
    koc = k.outlier_channels.contiguous() if nok else slots
    vo = v.outliers.contiguous() if nov else vs
    voc = v.outlier_channels.contiguous() if nov else slots
    block_h = max(16, triton.next_power_of_2(gqa))
    kc = k.codes.contiguous()
    vc = v.codes.contiguous()
    zero = torch.zeros(1, 1, d, dtype=torch.float32, device=q.device)
    vxi = zero if vxi is None else vxi.contiguous()
    dbg = zero if dbg is None else dbg
    if vxi.shape != dbg.shape and vxi is not zero and dbg is not zero:
        raise ValueError("vxi and dbg must have one shape")
    ref = vxi if vxi is not zero else dbg
    _tc_vd[(B, hkv, ns)](
        vxi, dbg, ref.stride(0), ref.stride(1),
        q, kc, ks, ko, koc, vc, vs, vo, voc, slots, seq_lens,
        o_s, lse_s, a_s, b_s,
        sm, FP16_REL + rounding_gamma(d), FP16_SUB, math.log(2.0 / delta), rad_extra, layer, k0, k1,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), ko.stride(0), ko.stride(1) if nok else 0,
        vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1), vo.stride(0), vo.stride(1) if nov else 0,
        slots.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=gqa, BLOCK_H=block_h, BLOCK_N=block_n, D=d, G=k.group,
        NOK=nok, NOK_P=max(16, triton.next_power_of_2(max(nok, 1))), NOV=nov,
        NOV_P=triton.next_power_of_2(max(nov, 1)),
        CERT=cert, CERT_B=cert and cert_b, Q_SPLIT=q.dtype == torch.float32,
        XI_SPLIT=xi_split, PV_TERMS=pv_terms, NUM_SPLITS=ns, SKIP_DITHER=False,
        PAGE=0, K_DITHER=k.dithered, V_DITHER=v_dither, VD_MODE=vd_mode, V_ORDER=v_order,
        num_warps=num_warps, num_stages=num_stages,
    )


@triton.jit
def _mini_pv(P, C, X, S, OUT, BN: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """A minimal form of the removed PV step: ``o = p @ v`` with ``v = s (c - x)`` as fp16 ``hi + lo`` (two dots),
    one ``[16, BN] x [BN, D]`` tile. ``MODE`` 0: ``x`` loaded; 1: ``x`` built in-kernel by joins and a reshape of
    four ``[BN, D/4]`` tiles (as the removed code built the dither), each a function of its index only."""
    h = tl.arange(0, 16)
    n = tl.arange(0, BN)
    d = tl.arange(0, D)
    p = tl.load(P + h[:, None] * BN + n[None, :])
    c = tl.load(C + n[:, None] * D + d[None, :])
    s = tl.load(S + n[:, None] * D + d[None, :])
    if MODE == 0:
        x = tl.load(X + n[:, None] * D + d[None, :])
    else:
        g = tl.arange(0, D // 4)
        base = (n[:, None] * D + 4 * g[None, :]).to(tl.float32)  # channel 4 g + 2 i + j of row n, as a float
        x0 = (base % 7.0) * 0.0625 - 0.1875
        x1 = ((base + 1.0) % 7.0) * 0.0625 - 0.1875
        x2 = ((base + 2.0) % 7.0) * 0.0625 - 0.1875
        x3 = ((base + 3.0) % 7.0) * 0.0625 - 0.1875
        x = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (BN, D))
    v = s * (c.to(tl.float32) - x)
    v_hi = v.to(tl.float16)
    acc = tl.dot(p, v_hi)
    acc = tl.dot(p, (v - v_hi.to(tl.float32)).to(tl.float16), acc)
    tl.store(OUT + h[:, None] * D + d[None, :], acc)


def mini_pv(mode: int, *, bn: int = 16, d: int = 64, dev: str = "cuda", seed: int = 0) -> dict:
    """Run :func:`_mini_pv` against float64 ``p @ (s (c - x))``; ``max_err`` and ``x`` as the kernel saw it."""
    from kvlib.kernels.backend import triton_available

    if not triton_available(torch.device(dev)):
        raise RuntimeError("mini_pv needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(16, bn, generator=g).half()
    c = torch.randint(-127, 128, (bn, d), generator=g, dtype=torch.int8)
    s = (0.01 + 0.02 * torch.rand(bn, d, generator=g))
    idx = (torch.arange(bn)[:, None] * d + torch.arange(d)[None, :]).float()
    x = (idx % 7.0) * 0.0625 - 0.1875  # what MODE 1 builds (exact in fp32)
    o = torch.empty(16, d, dtype=torch.float32, device=dev)
    _mini_pv[(1,)](p.to(dev), c.to(dev), x.to(dev), s.to(dev), o, BN=bn, D=d, MODE=mode, num_warps=4)
    ref = p.double() @ (s.double() * (c.double() - x.double()))
    err = (o.double().cpu() - ref).abs()
    return {"max_err": float(err.max()), "bad": int((err > 1e-3).sum()), "of": err.numel()}
