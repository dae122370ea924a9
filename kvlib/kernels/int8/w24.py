"""Triton stage-1 kernels over the w24 dither layout: ``impl="fma"`` (fp32 dots) and ``impl="tc"`` (tensor cores).

One program per (batch row, KV head, split) loads each KV tile once for all query heads of the GQA group,
regenerates the key dither (one Philox4x32-10 call per four channels, its four words spread over the four
bytes of one int32 code word), dequantises, computes scores, the online softmax and the output, and beside
them the certificate accumulators ``A_s = sum p e^{u}/l`` and ``B_s = sum p e^{-u}/l`` with the radius from
one ``tl.dot`` of ``q^2`` with ``s^2`` per tile (plus the fp16 outlier term); writes ``(o_s, lse_s, A_s, B_s)``.
:func:`launch_w24` launches either on validated inputs (called by ``decode_stage1``).
"""

from __future__ import annotations

import math
import re

import torch
import triton
import triton.language as tl

from kvlib.certify.bound import rounding_gamma
from kvlib.core.fp16 import FP16_REL, FP16_SUB
from kvlib.kernels.tl.cert import abs_up_fp16, split_fp16, union_radius
from kvlib.kernels.tl.merge import split_range
from kvlib.kernels.tl.paging import load_slots
from kvlib.kernels.tl.philox import philox4x32


@triton.jit
def _byte(w, J: tl.constexpr):
    """Signed byte ``J`` (little endian: channel 4g + J) of int32 code words."""
    return (w << (24 - 8 * J)) >> 24


@triton.jit
def _xi(w):
    """WitCert dither ``(w >> 8) 2^-24 + 2^-25 - 1/2`` exact in fp32 (same as philox_tl.word_to_xi)."""
    n = 2 * (w.to(tl.uint32) >> 8).to(tl.int32) + (1 - (1 << 24))
    return n.to(tl.float32) * 2.9802322387695312e-08


@triton.jit(do_not_specialize=["layer", "seed_lo", "seed_hi"])
def _decode_int8_stage1(
    Q, KW, KS, KO, KOC, VW, VS, VO, VOC, SLOTS, SEQ,
    O_S, LSE_S, A_S, B_S,
    sm_scale, byp_rel, byp_abs, log_2_over_delta, rad_extra, layer, seed_lo, seed_hi,
    s_qb, s_qh,
    s_kw_n, s_kw_h, s_ks_n, s_ks_h, s_ko_n, s_ko_h,
    s_vw_n, s_vw_h, s_vs_n, s_vs_h, s_vo_n, s_vo_h,
    s_sl_b,
    s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    NOK: tl.constexpr, NOK_P: tl.constexpr, NOV: tl.constexpr, NOV_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, CERT: tl.constexpr, CERT_B: tl.constexpr, V_DITHER: tl.constexpr,
    K_PREC: tl.constexpr, V_PREC: tl.constexpr, JOIN: tl.constexpr, VAR_DOT: tl.constexpr, PAGE: tl.constexpr = 0,
    K_DITHER: tl.constexpr = True,
):
    """fp32 stage 1 (``impl="fma"``); ``K_DITHER=False``: RTN keys (``xi = 0``, no Philox; ``CERT`` off)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    D4: tl.constexpr = D // 4
    seq_len, start, end = split_range(SEQ, b, split, NUM_SPLITS)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    offs_g = tl.arange(0, D4)
    sgrp = offs_g // (G // 4)  # scale index of each word
    q_base = Q + b * s_qb + heads[:, None] * s_qh + 4 * offs_g[None, :]
    q0 = tl.load(q_base + 0, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(q_base + 1, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_base + 2, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(q_base + 3, mask=mask_h[:, None], other=0.0).to(tl.float32)
    if NOK > 0:
        offs_ok = tl.arange(0, NOK_P)
        mask_ok = offs_ok < NOK
        koc = tl.load(KOC + kvh * NOK + offs_ok, mask=mask_ok, other=-1).to(tl.int32)
        q_ko = tl.load(Q + b * s_qb + heads[:, None] * s_qh + koc[None, :],
                       mask=mask_h[:, None] & mask_ok[None, :], other=0.0).to(tl.float32)
        # outlier channels are not dithered: their codes are 0 and their q leaves the dithered dot
        q0 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 0).to(tl.int32), 0) > 0)[None, :], 0.0, q0)
        q1 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 1).to(tl.int32), 0) > 0)[None, :], 0.0, q1)
        q2 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 2).to(tl.int32), 0) > 0)[None, :], 0.0, q2)
        q3 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 3).to(tl.int32), 0) > 0)[None, :], 0.0, q3)
    if JOIN:
        offs_d = tl.arange(0, D)
        qn = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        qn = qn.to(tl.float32)
        if NOK > 0:
            qn = tl.where((tl.sum((koc[:, None] == offs_d[None, :]).to(tl.int32), 0) > 0)[None, :], 0.0, qn)
    if NOV > 0:
        offs_ov = tl.arange(0, NOV_P)
        mask_ov = offs_ov < NOV
        voc = tl.load(VOC + kvh * NOV + offs_ov, mask=mask_ov, other=-1).to(tl.int32)
        vkeep0 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 0).to(tl.int32), 0) == 0
        vkeep1 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 1).to(tl.int32), 0) == 0
        vkeep2 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 2).to(tl.int32), 0) == 0
        vkeep3 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 3).to(tl.int32), 0) == 0
        acc_vo = tl.zeros([BLOCK_H, NOV_P], dtype=tl.float32)
        if JOIN:
            vkeep = tl.sum((voc[:, None] == offs_d[None, :]).to(tl.int32), 0) == 0
    if CERT:
        qsq = q0 * q0 + q1 * q1 + q2 * q2 + q3 * q3  # [BLOCK_H, D4]: sum of q^2 over each word's 4 channels
        NG: tl.constexpr = D // G
        offs_ng = tl.arange(0, NG)
        # [BLOCK_H, NG]: sum of q^2 over each scale group (outlier channels already zeroed)
        q2g = tl.sum(tl.where(sgrp[None, None, :] == offs_ng[None, :, None], qsq[:, None, :], 0.0), 2)
        # sqrt(2 ln(2N/delta)) + slack, N = this row's length (kvlib.certify.bound.radius_multiplier)
        radm = union_radius(seq_len, log_2_over_delta, rad_extra)
        var_c = sm_scale * sm_scale / 12.0
        if NOK > 0:
            q_ko_abs = tl.abs(q_ko)
            q_ko_sum = tl.sum(q_ko_abs, 1)
        a_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        if CERT_B:
            b_i = tl.zeros([BLOCK_H], dtype=tl.float32)

    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    c3k = ((layer << 1) | 0).to(tl.uint32)
    c3v = ((layer << 1) | 1).to(tl.uint32)
    c2 = kvh.to(tl.uint32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    if JOIN:
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if PAGE > 0:
            slot = load_slots(SLOTS + b * s_sl_b, offs_n, mask_n, PAGE)
        else:  # the slot table inline, as before paging existed (the same binary)
            slot = tl.load(SLOTS + b * s_sl_b + offs_n, mask=mask_n, other=0).to(tl.int64)
        # ---- keys: one int32 word = 4 channels = one Philox call
        kw = tl.load(KW + slot[:, None] * s_kw_n + kvh * s_kw_h + offs_g[None, :], mask=mask_n[:, None], other=0)
        ks = tl.load(KS + slot[:, None] * s_ks_n + kvh * s_ks_h + sgrp[None, :], mask=mask_n[:, None],
                     other=0.0).to(tl.float32)
        c0 = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, D4], dtype=tl.uint32)
        c1 = offs_g.to(tl.uint32)[None, :] + tl.zeros([BLOCK_N, D4], dtype=tl.uint32)
        if K_DITHER:
            w0, w1, w2, w3 = philox4x32(c0, c1, c2 + tl.zeros_like(c0), c3k + tl.zeros_like(c0), k0, k1)
            kh0 = ks * (_byte(kw, 0).to(tl.float32) - _xi(w0))
            kh1 = ks * (_byte(kw, 1).to(tl.float32) - _xi(w1))
            kh2 = ks * (_byte(kw, 2).to(tl.float32) - _xi(w2))
            kh3 = ks * (_byte(kw, 3).to(tl.float32) - _xi(w3))
        else:
            kh0 = ks * _byte(kw, 0).to(tl.float32)
            kh1 = ks * _byte(kw, 1).to(tl.float32)
            kh2 = ks * _byte(kw, 2).to(tl.float32)
            kh3 = ks * _byte(kw, 3).to(tl.float32)
        if JOIN:  # one [BLOCK_N, D] tile in natural channel order: byte J of word g is channel 4g + J
            kh = tl.reshape(tl.join(tl.join(kh0, kh2), tl.join(kh1, kh3)), (BLOCK_N, D))
            qk = tl.dot(qn, tl.trans(kh), input_precision=K_PREC)
        else:
            qk = tl.dot(q0, tl.trans(kh0), input_precision=K_PREC)
            qk += tl.dot(q1, tl.trans(kh1), input_precision=K_PREC)
            qk += tl.dot(q2, tl.trans(kh2), input_precision=K_PREC)
            qk += tl.dot(q3, tl.trans(kh3), input_precision=K_PREC)
        if NOK > 0:
            ko = tl.load(KO + slot[:, None] * s_ko_n + kvh * s_ko_h + offs_ok[None, :],
                         mask=mask_n[:, None] & mask_ok[None, :], other=0.0).to(tl.float32)
            qk += tl.sum(q_ko[:, None, :] * ko[None, :, :], 2)
        qk = tl.where(mask_n[None, :], qk * sm_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if CERT:
            if VAR_DOT:  # one tl.dot of q^2 with s^2 over the words of the tile
                var = tl.dot(qsq, tl.trans(ks * ks), input_precision="ieee")
            else:  # the same sum over the D // G scale groups: NG broadcast FMAs, no layout change
                var = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
                for gi in tl.static_range(NG):
                    s_g = tl.load(KS + slot * s_ks_n + kvh * s_ks_h + gi, mask=mask_n, other=0.0).to(tl.float32)
                    q2_g = tl.sum(tl.where(offs_ng[None, :] == gi, q2g, 0.0), 1)
                    var += q2_g[:, None] * (s_g * s_g)[None, :]
            var = var * var_c  # [BLOCK_H, BLOCK_N]
            u = tl.sqrt(var) * radm
            if NOK > 0:
                u += sm_scale * (tl.sum(q_ko_abs[:, None, :] * tl.abs(ko)[None, :, :], 2) * byp_rel
                                 + q_ko_sum[:, None] * byp_abs)
            a_i = a_i * alpha + tl.sum(p * tl.exp(u), 1)
            if CERT_B:
                b_i = b_i * alpha + tl.sum(p * tl.exp(-u), 1)

        # ---- values
        vw = tl.load(VW + slot[:, None] * s_vw_n + kvh * s_vw_h + offs_g[None, :], mask=mask_n[:, None], other=0)
        vs = tl.load(VS + slot[:, None] * s_vs_n + kvh * s_vs_h + sgrp[None, :], mask=mask_n[:, None],
                     other=0.0).to(tl.float32)
        if V_DITHER:
            x0, x1, x2, x3 = philox4x32(c0, c1, c2 + tl.zeros_like(c0), c3v + tl.zeros_like(c0), k0, k1)
            vh0 = vs * (_byte(vw, 0).to(tl.float32) - _xi(x0))
            vh1 = vs * (_byte(vw, 1).to(tl.float32) - _xi(x1))
            vh2 = vs * (_byte(vw, 2).to(tl.float32) - _xi(x2))
            vh3 = vs * (_byte(vw, 3).to(tl.float32) - _xi(x3))
        else:
            vh0 = vs * _byte(vw, 0).to(tl.float32)
            vh1 = vs * _byte(vw, 1).to(tl.float32)
            vh2 = vs * _byte(vw, 2).to(tl.float32)
            vh3 = vs * _byte(vw, 3).to(tl.float32)
        if NOV > 0 and not JOIN:
            vh0 = tl.where(vkeep0[None, :], vh0, 0.0)
            vh1 = tl.where(vkeep1[None, :], vh1, 0.0)
            vh2 = tl.where(vkeep2[None, :], vh2, 0.0)
            vh3 = tl.where(vkeep3[None, :], vh3, 0.0)
        if NOV > 0:
            vo = tl.load(VO + slot[:, None] * s_vo_n + kvh * s_vo_h + offs_ov[None, :],
                         mask=mask_n[:, None] & mask_ov[None, :], other=0.0).to(tl.float32)
            acc_vo = acc_vo * alpha[:, None] + tl.sum(p[:, :, None] * vo[None, :, :], 1)
        if JOIN:
            vh = tl.reshape(tl.join(tl.join(vh0, vh2), tl.join(vh1, vh3)), (BLOCK_N, D))
            if NOV > 0:
                vh = tl.where(vkeep[None, :], vh, 0.0)
            if V_PREC == "fp16":
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vh.to(tl.float16), out_dtype=tl.float32)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, vh, input_precision=V_PREC)
        elif V_PREC == "fp16":
            pv = p.to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(pv, vh0.to(tl.float16), out_dtype=tl.float32)
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, vh1.to(tl.float16), out_dtype=tl.float32)
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, vh2.to(tl.float16), out_dtype=tl.float32)
            acc3 = acc3 * alpha[:, None] + tl.dot(pv, vh3.to(tl.float16), out_dtype=tl.float32)
        else:
            acc0 = acc0 * alpha[:, None] + tl.dot(p, vh0, input_precision=V_PREC)
            acc1 = acc1 * alpha[:, None] + tl.dot(p, vh1, input_precision=V_PREC)
            acc2 = acc2 * alpha[:, None] + tl.dot(p, vh2, input_precision=V_PREC)
            acc3 = acc3 * alpha[:, None] + tl.dot(p, vh3, input_precision=V_PREC)

    nonempty = l_i != 0.0  # NaN (non-finite keys) must stay NaN, not look empty
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_base = O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + 4 * offs_g[None, :]
    if JOIN:
        o_nat = O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + offs_d[None, :]
        if NOV > 0:
            tl.store(o_nat, acc * inv_l[:, None], mask=mask_h[:, None] & vkeep[None, :])
            tl.store(O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + voc[None, :],
                     acc_vo * inv_l[:, None], mask=mask_h[:, None] & mask_ov[None, :])
        else:
            tl.store(o_nat, acc * inv_l[:, None], mask=mask_h[:, None])
    elif NOV > 0:
        tl.store(o_base + 0, acc0 * inv_l[:, None], mask=mask_h[:, None] & vkeep0[None, :])
        tl.store(o_base + 1, acc1 * inv_l[:, None], mask=mask_h[:, None] & vkeep1[None, :])
        tl.store(o_base + 2, acc2 * inv_l[:, None], mask=mask_h[:, None] & vkeep2[None, :])
        tl.store(o_base + 3, acc3 * inv_l[:, None], mask=mask_h[:, None] & vkeep3[None, :])
        tl.store(O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + voc[None, :],
                 acc_vo * inv_l[:, None], mask=mask_h[:, None] & mask_ov[None, :])
    else:
        tl.store(o_base + 0, acc0 * inv_l[:, None], mask=mask_h[:, None])
        tl.store(o_base + 1, acc1 * inv_l[:, None], mask=mask_h[:, None])
        tl.store(o_base + 2, acc2 * inv_l[:, None], mask=mask_h[:, None])
        tl.store(o_base + 3, acc3 * inv_l[:, None], mask=mask_h[:, None])
    l_off = b * s_ls_b + heads * s_ls_h + split
    tl.store(LSE_S + l_off, lse, mask=mask_h)
    if CERT:
        tl.store(A_S + l_off, a_i * inv_l, mask=mask_h)
        if CERT_B:
            tl.store(B_S + l_off, b_i * inv_l, mask=mask_h)


@triton.jit(do_not_specialize=["layer", "seed_lo", "seed_hi"])
def _decode_int8_stage1_tc(
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
    V_DITHER: tl.constexpr = False,
):
    """Tensor-core stage 1 (see :func:`decode_stage1`, ``impl="tc"``). ``K_DITHER=False``: RTN keys (``xi = 0``:
    no Philox, no dither dots; ``CERT`` off). ``V_DITHER``: dithered values ``v = s (c - xi_v)``, computed as the
    RTN dots of ``s c`` plus dots of their own for ``s xi_v`` (why not one tile: the comment at the value path).

    Scores group by group (``NG = D // G`` unrolled 2-D dots, no cross-thread reductions):
    ``z = sm * sum_g s_g (q_g . c_g - q_g . fp16(xi_g))`` with the int8 codes exact in fp16, the
    query exact in fp16 (fp32 queries: hi + lo, two dots) and the dither as fp16 (``XI_SPLIT``: plus
    its fp16 remainder, a third dot; either way the rounding, ``<= 2^-13``, is inside the radius,
    :func:`kvlib.certify.bound.rounding_slack` ``"tc"``); what the query split leaves
    (``r = q - hi - lo``) enters the radius as ``sm * 127.5 sum_c |r_c| s_c``.
    PV: ``v = s c`` is exact as an fp16 pair ``v_hi + v_lo`` (11 + 7 significant bits), ``1024 p``
    as ``p_hi + p_lo``; ``PV_TERMS`` = 3 (``p_hi v_hi + p_hi v_lo + p_lo v_hi``), 2 or 1.
    The group's query slice is re-read per tile (an L1 hit) because Triton cannot index a list of
    hoisted tensors by the unrolled group number.
    """
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
        if V_DITHER:
            # acc -= p (s xi_v), the dither (one Philox call per 4 channels, counter (slot, channel/4, head,
            # 2 layer + 1)) in dots of its own. Not one tile s (c - xi_v): with that tile Triton 3.6 (sm_90,
            # mma v2) gives the PV operands kWidth = 8 (it can no longer hoist the conversion to the int8 load),
            # a layout 32 deep in K, and at BLOCK_N = 16 < 32 the dot came out wrong on the H200 (max |do| 3.3)
            # while the interpreter was right; the RTN tiles here keep the kWidth 4 of the shipped path
            # (dev/results/README.md, "value-dither bug"; tests/test_decode_int8.py checks the layouts offline)
            D4: tl.constexpr = D // 4
            vc0 = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, D4], dtype=tl.uint32)
            x0, x1, x2, x3 = philox4x32(vc0, tl.arange(0, D4).to(tl.uint32)[None, :] + tl.zeros_like(vc0),
                                        c2 + tl.zeros_like(vc0), c3v + tl.zeros_like(vc0), k0, k1)
            # join(join(x0, x2), join(x1, x3))[..., i, j] = x_{2i+j}: channel 4 j' + 2i + j in natural order
            dv = vs * tl.reshape(tl.join(tl.join(_xi(x0), _xi(x2)), tl.join(_xi(x1), _xi(x3))), (BLOCK_N, D))
            dv_hi = dv.to(tl.float16)  # s xi_v as fp16 hi + lo: exact to 2^-22 |s xi_v|, as the value path
            acc = tl.dot(-p_hi, dv_hi, acc)
            if PV_TERMS >= 2:
                acc = tl.dot(-p_hi, (dv - dv_hi.to(tl.float32)).to(tl.float16), acc)
            if PV_TERMS >= 3:
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


def launch_w24(impl: str, q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, *, sm: float, delta: float,
               rad_extra: float, layer: int, k0: int, k1: int, ns: int, cert: bool, cert_b: bool, v_dither: bool,
               config, page: int = 0) -> None:
    """Launch :func:`_decode_int8_stage1_tc` (``impl="tc"``) or :func:`_decode_int8_stage1` (``"fma"``) on
    validated inputs with the :class:`~kvlib.kernels.int8.config.Int8KernelConfig` ``config``; ``page > 0``:
    ``slots`` is a block table of pages of ``page`` slots (:mod:`kvlib.kernels.tl.paging`)."""
    B, hq, d = q.shape
    n_slots, hkv, _ = k.codes.shape
    gqa = hq // hkv
    block_n = config.block_n
    num_warps, num_stages = config.warps(impl), config.stages(impl)
    ks = k.scales.contiguous()
    vs = v.scales.contiguous()
    nok = k.outliers.shape[-1] if k.outliers is not None else 0
    nov = v.outliers.shape[-1] if v.outliers is not None else 0
    ko = k.outliers.contiguous() if nok else ks
    koc = k.outlier_channels.contiguous() if nok else slots
    vo = v.outliers.contiguous() if nov else vs
    voc = v.outlier_channels.contiguous() if nov else slots
    block_h = max(16, triton.next_power_of_2(gqa))
    if impl == "tc":
        kc = k.codes.contiguous()
        vc = v.codes.contiguous()
        _decode_int8_stage1_tc[(B, hkv, ns)](
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
            XI_SPLIT=config.xi_split, PV_TERMS=config.pv_terms, NUM_SPLITS=ns, SKIP_DITHER=config.skip_philox,
            PAGE=page, K_DITHER=k.dithered, V_DITHER=v_dither, num_warps=num_warps, num_stages=num_stages,
        )
        return
    if impl != "fma":
        raise ValueError(f"launch_w24 runs impl 'tc' or 'fma', got {impl!r}")
    kw = k.codes.contiguous().view(torch.int32)
    vw = v.codes.contiguous().view(torch.int32)
    _decode_int8_stage1[(B, hkv, ns)](
        q, kw, ks, ko, koc, vw, vs, vo, voc, slots, seq_lens,
        o_s, lse_s, a_s, b_s,
        sm, FP16_REL + rounding_gamma(d), FP16_SUB, math.log(2.0 / delta), rad_extra, layer, k0, k1,
        q.stride(0), q.stride(1),
        kw.stride(0), kw.stride(1), ks.stride(0), ks.stride(1), ko.stride(0), ko.stride(1) if nok else 0,
        vw.stride(0), vw.stride(1), vs.stride(0), vs.stride(1), vo.stride(0), vo.stride(1) if nov else 0,
        slots.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=gqa, BLOCK_H=block_h, BLOCK_N=block_n, D=d, G=k.group,
        NOK=nok, NOK_P=triton.next_power_of_2(max(nok, 1)), NOV=nov, NOV_P=triton.next_power_of_2(max(nov, 1)),
        NUM_SPLITS=ns, CERT=cert, CERT_B=cert and cert_b, V_DITHER=v_dither,
        K_PREC=config.k_precision, V_PREC=config.v_precision, JOIN=config.join, VAR_DOT=config.var_dot, PAGE=page,
        K_DITHER=k.dithered, num_warps=num_warps, num_stages=num_stages,
    )


_DOT_OP = re.compile(r"-> tensor<(\d+)x(\d+)x(\w+), #ttg\.dot_op<\{opIdx = (\d), parent = #(\w+), kWidth = (\d+)")
_MMA = re.compile(r"#(mma\w*) = #ttg\.nvidia_mma<\{versionMajor = (\d)")


def tc_dot_layouts(*, block_n: int, d: int, group: int = 32, gqa: int = 7, nok: int = 2, nov: int = 0,
                   v_dither: bool = True, k_dither: bool = True, num_warps: int = 4, num_stages: int = 3) -> list:
    """The tensor-core kernel compiled offline for sm_90 (no GPU; run without ``TRITON_INTERPRET``): every dot
    operand of its TTGIR as ``(rows, cols, dtype, opIdx, mma version, kWidth, K)``.

    Why: an mma v2 operand of 16-bit type with ``4 kWidth > K`` (kWidth 8 at ``K = BLOCK_N = 16``) is the layout
    the H200 computed wrong in the removed value-dither path (dev/results/README.md, "value-dither bug")."""
    from kvlib.kernels.offline import compile_sm90

    cx = dict(GQA=gqa, BLOCK_H=max(16, triton.next_power_of_2(gqa)), BLOCK_N=block_n, D=d, G=group, NOK=nok,
              NOK_P=max(16, triton.next_power_of_2(max(nok, 1))), NOV=nov, NOV_P=triton.next_power_of_2(max(nov, 1)),
              CERT=k_dither, CERT_B=k_dither, Q_SPLIT=True, XI_SPLIT=True, PV_TERMS=3, NUM_SPLITS=2,
              K_DITHER=k_dither, V_DITHER=v_dither)
    cc = compile_sm90(_decode_int8_stage1_tc, cx, {"Q": "*fp32"}, num_warps=num_warps, num_stages=num_stages)
    ir = cc.asm["ttgir"]
    ver = dict(_MMA.findall(ir))
    out = set()
    for a, b, t, i, parent, k in _DOT_OP.findall(ir):
        a, b, i, k = int(a), int(b), int(i), int(k)
        out.add((a, b, t, i, int(ver.get(parent, 0)), k, b if i == 0 else a))
    return sorted(out)
