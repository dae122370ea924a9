"""Certified INT8 decode over the h8 dither layout with two warps per program (Gluon, GPU only; a prototype).

The same contract and arithmetic as :mod:`kvlib.kernels.decode_int8_gluon` (one warp per program), split between
two warps: warp ``h`` owns channel groups ``2h`` and ``2h + 1`` (their codes, scales, QK and PV dots and output
channels). Why: the one-warp kernel is latency bound at two warps per scheduler (Nsight Compute: 54% of issue
slots busy), and its 254 registers forbid a third; each warp here holds half the operands, so a cap of 168
registers fits three per scheduler.

What the warps share, and how:

* the dither: warp ``h`` computes Philox call ``2t + h`` of positions ``g + 8 nt`` (lane ``(g, t)``), half of the
  tile's calls; each call yields one word per group, and the words of the other warp's groups cross through shared
  memory (one layout conversion), so no call is computed twice;
* the scores and the certificate's variance: each warp sums its two groups (the one-warp kernel's
  ``(z0 + z1) + (z2 + z3)`` grouping, so the same rounding) and the halves are added across the warps (one
  reduction through shared memory);
* the softmax and the certificate's accumulators are computed by both warps from the same operands (identical
  values), so each warp rescales its own output accumulators with no further exchange.

Every tensor carries the warp as its leading dimension (size 2), and the dots are batched ``mma_v2`` calls whose
batch is the warp.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvlib.kernels.decode_int8_gluon import LN2_C, LOG2E_C, XI8_CONST, _bits, _ex2, _philox, _rat, gluon_unsupported


def _lin2(reg, lane, shape):
    """A one-warp linear layout with a leading warp dimension of size 2 (warp ``h`` holds half ``h``)."""
    return gl.DistributedLinearLayout(reg_bases=[[0] + b for b in reg], lane_bases=[[0] + b for b in lane],
                                      warp_bases=[[1] + [0] * len(shape)], block_bases=[], shape=[2] + list(shape))


def _rep(reg, lane, shape):
    """A one-warp linear layout replicated on both warps."""
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[[0] * len(shape)], block_bases=[],
                                      shape=list(shape))


def kernel_layouts_w2(bn: int) -> dict[str, object]:
    nt = [[8 * b, 0] for b in _bits(bn // 8)]
    ntc = [[0, 8 * b] for b in _bits(bn // 8)]
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 1, 1], instr_shape=[1, 16, 8])
    z8 = ([[0, 1]] + ntc, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [8, bn])
    pt = ([[1, 0]] + nt, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [bn, 8])
    return dict(
        KW=_lin2([[0, 1], [0, 2], [0, 4]] + nt, [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], [bn, 32]),
        # Philox calls [2 (call bit 0 = warp), BN, 4 (t)]: lane (g, t) of warp c computes call 2 t + c
        WP=gl.DistributedLinearLayout(reg_bases=[[0, 8 * b, 0] for b in _bits(bn // 8)],
                                      lane_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=[[1, 0, 0]], block_bases=[], shape=[2, bn, 4]),
        # dither words of one local group [2 (warp), BN, 8 calls], as the one-warp W (calls 2 t, 2 t + 1)
        W=_lin2([[0, 1]] + nt, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [bn, 8]),
        # the same with both local groups [2 (warp), 2 (local group), BN, 8]
        W2G=gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 1, 0, 0]] + [[0, 0, 8 * b, 0] for b in _bits(bn // 8)],
            lane_bases=[[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
            warp_bases=[[1, 0, 0, 0]], block_bases=[], shape=[2, 2, bn, 8]),
        VW=_lin2([[1, 0]] + nt, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [bn, 8]),
        # a position's two scales of this warp's groups [2, BN, 2] (one 4-byte load)
        SC=_lin2([[0, 1], [1, 0]] + nt, [[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], [bn, 2]),
        MMA=mma,
        QA=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        KB=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        QB=gl.BlockedLayout([1, 1, 4], [1, 4, 8], [2, 1, 1], [2, 1, 0]),
        Z8=_lin2(*z8),
        Z8R=_rep(*z8),
        PT=_lin2(*pt),
        PB=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        VA=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        V8=_lin2([[1, 0, 0], [0, 0, 1], [0, 0, 2]] + [[8 * b, 0, 0] for b in _bits(bn // 8)],
                 [[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [bn, 8, 4]),
    )


BLOCK_N = 16
_BN = gl.constexpr(BLOCK_N)
_NAMES = ("KW", "WP", "W", "W2G", "VW", "SC", "MMA", "QA", "KB", "QB", "Z8", "Z8R", "PT", "PB", "VA", "V8")
KW, WP, W, W2G, VW, SC, MMA, QA, KB, QB, Z8, Z8R, PT, PB, VA, V8 = (
    gl.constexpr(kernel_layouts_w2(BLOCK_N)[k]) for k in _NAMES)
#: registers per thread: three warps per scheduler (16,384 registers each) need at most 170
MAXNREG = 168
#: two-warp programs resident per SM at MAXNREG
PROGRAMS_PER_SM = 6


@gluon.jit
def _to_kb(x, BN: gl.constexpr):
    """``[2, BN, 32]`` in local channel order ``8 t + 4 jj + 2 h + e`` -> the QK B operand ``[2, 32, BN]``."""
    y = gl.reshape(x, [2, BN, 4, 2, 2, 2])
    y = gl.permute(y, [0, 1, 3, 4, 2, 5])
    y = gl.reshape(y, [2, BN, 32])
    return gl.convert_layout(gl.permute(y, [0, 2, 1]), KB, assert_trivial=True)


@gluon.jit
def _replicate4(w, BN: gl.constexpr):
    w2 = gl.join(w, w)
    return gl.reshape(gl.join(w2, w2), [2, BN, 8, 4])


@gluon.jit
def _bytes_kb(w, DITHER: gl.constexpr, BN: gl.constexpr):
    if DITHER:
        x = gl.inline_asm_elementwise(
            "{ prmt.b32 $0, $2, 0xC4C4C4C4, 0x4140; prmt.b32 $1, $2, 0xC4C4C4C4, 0x4342; }",
            "=r,=r,r,r,r,r", [_replicate4(w, BN)], dtype=gl.float16, is_pure=True, pack=4)
    else:
        x = gl.inline_asm_elementwise(
            "{ .reg .b32 t, k; xor.b32 t, $2, 0x80808080; mov.b32 k, 0x64806480; "
            "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
            "sub.rn.f16x2 $0, $0, k; sub.rn.f16x2 $1, $1, k; }",
            "=r,=r,r,r,r,r", [_replicate4(w, BN)], dtype=gl.float16, is_pure=True, pack=4)
    return _to_kb(gl.convert_layout(gl.reshape(x, [2, BN, 32]), KW, assert_trivial=True), BN)


@gluon.jit
def _values_va(vw, BN: gl.constexpr):
    v4 = gl.convert_layout(_replicate4(vw, BN), V8, assert_trivial=True)
    c = gl.inline_asm_elementwise(
        "{ .reg .b32 a, b, x, y, k; mov.b32 k, 0x64806480; "
        "xor.b32 a, $4, 0x80808080; xor.b32 b, $5, 0x80808080; "
        "prmt.b32 x, a, b, 0x5140; prmt.b32 y, a, b, 0x7362; "
        "prmt.b32 $0, x, 0x64646464, 0x4140; prmt.b32 $1, x, 0x64646464, 0x4342; "
        "prmt.b32 $2, y, 0x64646464, 0x4140; prmt.b32 $3, y, 0x64646464, 0x4342; "
        "sub.rn.f16x2 $0, $0, k; sub.rn.f16x2 $1, $1, k; sub.rn.f16x2 $2, $2, k; sub.rn.f16x2 $3, $3, k; }",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [v4], dtype=gl.float16, is_pure=True, pack=8)
    y = gl.reshape(c, [2, BN, 8, 2, 2])
    y = gl.permute(y, [0, 1, 3, 4, 2])
    y = gl.reshape(y, [2, BN, 32])
    return gl.convert_layout(gl.permute(y, [0, 2, 1]), VA, assert_trivial=True)


@gluon.jit
def _split2(x, L: gl.constexpr):
    """``[2, BN, 2]`` fp16 scales -> the two local groups' fp32 ``[2, BN]`` in layout ``L``."""
    a, b = gl.split(x.to(gl.float32))
    return gl.convert_layout(a, L, assert_trivial=True), gl.convert_layout(b, L, assert_trivial=True)


@gluon.jit
def _rows8(x, BN: gl.constexpr):
    lo, hi = gl.split(gl.permute(gl.reshape(x, [2, 2, 8, BN]), [0, 2, 3, 1]))
    return lo


@gluon.jit
def _q_group(Q_row, s_qh, gl_: gl.constexpr, GQA: gl.constexpr):
    """Local group ``gl_``'s query of each warp (group ``2 h + gl_``): the A operand ``[2, 16, 32]`` and per head
    ``sum q_hi``, ``sum q^2``, ``sum |q - q_hi| (1 + 1/255)`` (``[2, 8]`` in the scores' per-head layout)."""
    wA = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, QA)))
    hA = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, QA)))
    kA = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, QA)))
    chA = 8 * ((kA % 8) // 2) + 4 * (kA // 16) + 2 * ((kA // 8) % 2) + (kA % 2)
    grpA = (2 * wA + gl_) * 32
    qa = gl.load(Q_row + hA[None, :, None] * s_qh + grpA[:, None, None] + chA[None, None, :],
                 mask=(hA < GQA)[None, :, None], other=0.0)
    qa = qa.to(gl.float32).to(gl.float16)
    wB = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, QB)))
    hB = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, QB)))
    cB = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, QB)))
    qg = gl.load(Q_row + hB[None, :, None] * s_qh + ((2 * wB + gl_) * 32)[:, None, None] + cB[None, None, :],
                 mask=(hB < GQA)[None, :, None], other=0.0).to(gl.float32)
    q_hi = qg.to(gl.float16).to(gl.float32)
    r1 = qg - q_hi
    H2: gl.constexpr = gl.SliceLayout(2, Z8)
    q1 = gl.convert_layout(_rows8v(gl.sum(q_hi, 2)), H2)
    q2 = gl.convert_layout(_rows8v(gl.sum(qg * qg, 2)), H2)
    rr = gl.convert_layout(_rows8v(gl.sum(gl.abs(r1) + gl.abs(r1) * (1.0 / 255.0), 2)), H2)
    return qa, q1, q2, rr


@gluon.jit
def _rows8v(x):
    lo, hi = gl.split(gl.permute(gl.reshape(x, [2, 2, 8]), [0, 2, 1]))
    return lo


@gluon.jit
def _load_side(C, S, slot_c, slot_s, mask_s, kvh, s_c_n, s_s_n, L: gl.constexpr):
    """A tile's operands of one side for this warp's two groups: code words ``[2, BN, 8]`` int32 in layout ``L``
    per local group and the two scales ``[2, BN, 2]`` fp16 (0 past the end); code words unmasked, as in the
    one-warp kernel."""
    cw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    hw = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    base = C + slot_c.to(gl.int64)[:, :, None] * s_c_n + kvh * 32 + (hw * 16)[:, None, None] + cw[None, None, :]
    c0 = gl.load(base)
    c1 = gl.load(base + 8)
    cs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SC)))
    hs = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, SC)))
    sc = gl.load(S + slot_s.to(gl.int64)[:, :, None] * s_s_n + kvh * 4 + (2 * hs)[:, None, None] + cs[None, None, :],
                 mask=mask_s[:, :, None], other=0.0)
    return c0, c1, sc


@gluon.jit
def _slots(sl_row, nk, nv, ns, end):
    return (gl.load(sl_row + nk, mask=nk < end, other=0), gl.load(sl_row + nv, mask=nv < end, other=0),
            gl.load(sl_row + ns, mask=ns < end, other=0))


@gluon.jit
def _dither_words(slot, cj, c2, c3k, k0, k1, BN: gl.constexpr):
    """This warp's half of the tile's Philox calls, exchanged so each warp holds its own groups' words of all
    eight calls: two ``[2, BN, 8]`` int32 tensors in layout ``W`` (local groups 0 and 1)."""
    cs = gl.convert_layout(slot.to(gl.uint32), gl.SliceLayout(2, WP), assert_trivial=True)[:, :, None] + gl.zeros(
        [2, BN, 4], gl.uint32, layout=WP)
    o0, o1, o2, o3 = _philox(cs, cj + gl.zeros_like(cs), c2 + gl.zeros_like(cs), c3k + gl.zeros_like(cs), k0, k1)
    # [call bit 0 (warp), BN, t, owner warp, local group]: group 2 * owner + local group
    x = gl.join(gl.join(o0, o2), gl.join(o1, o3))
    x = gl.permute(x, [3, 4, 1, 2, 0])  # [owner, local group, BN, t, call bit 0]
    x = gl.convert_layout(gl.reshape(x, [2, 2, BN, 8]), W2G)  # the exchange (shared memory)
    a, b = gl.split(gl.permute(x, [0, 2, 3, 1]))
    return gl.convert_layout(a, W, assert_trivial=True), gl.convert_layout(b, W, assert_trivial=True)


@gluon.jit
def _qk_group(kc, w, qa, q1, s, BN: gl.constexpr):
    acc = gl.zeros([2, 16, BN], gl.float32, layout=MMA)
    acc = mma_v2(qa, _bytes_kb(kc, False, BN), acc)
    acc = mma_v2(qa, _bytes_kb(w, True, BN), acc)
    acc = gl.convert_layout(_rows8(acc, BN), Z8, assert_trivial=True)
    return (acc + XI8_CONST * q1[:, :, None]) * s[:, None, :]


@gluon.jit
def _pv_group(vw, ppT, vs, acc, BN: gl.constexpr):
    va = _values_va(vw, BN)
    ps = ppT * vs[:, :, None]
    hi = ps.to(gl.float16)
    lo = (ps - hi.to(gl.float32)).to(gl.float16)
    acc = mma_v2(va, gl.convert_layout(hi, PB, assert_trivial=True), acc)
    return mma_v2(va, gl.convert_layout(lo, PB, assert_trivial=True), acc)


@gluon.jit
def _store_group(o_base, s_os_h, acc, sc, gl_: gl.constexpr, GQA: gl.constexpr):
    w = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    m = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    ch = 4 * (m % 8) + 2 * (m // 16) + (m // 8) % 2
    h = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    off = ((2 * w + gl_) * 32)[:, None, None] + ch[None, :, None] + h[None, None, :] * s_os_h
    gl.store(o_base + off, acc * sc[None, None, :], mask=(h < GQA)[None, None, :])


@gluon.jit
def _stage1_g8w2(
    Q, KC, KS, VC, VS, SLOTS, SEQ, O_S, LSE_S, A_S, B_S,
    sm_scale, log_2_over_delta, rad_extra, layer, seed_lo, seed_hi,
    s_qb, s_qh, s_kc_n, s_ks_n, s_vc_n, s_vs_n, s_sl_b,
    s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: gl.constexpr, NUM_SPLITS: gl.constexpr, CERT: gl.constexpr, CERT_B: gl.constexpr,
):
    BN: gl.constexpr = _BN
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(SEQ + b).to(gl.int32)
    split_len = gl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)

    Q_row = Q + b * s_qb + kvh * GQA * s_qh
    qa0, q10, q20, rr0 = _q_group(Q_row, s_qh, 0, GQA)
    qa1, q11, q21, rr1 = _q_group(Q_row, s_qh, 1, GQA)
    H8L: gl.constexpr = gl.SliceLayout(1, Z8R)
    if CERT:
        radm = gl.sqrt(2.0 * (gl.log(gl.maximum(seq_len, 1).to(gl.float32)) + log_2_over_delta)) + rad_extra
        var_c = sm_scale * sm_scale / 12.0 * (1.0 + 2.0**-8)
        # the one-warp kernel's (r0 + r1) + (r2 + r3): each warp sums its pair, then the warps are added
        rat = gl.convert_layout(gl.sum(_rat(rr0, q20) + _rat(rr1, q21), 0), H8L)
        detm = (sm_scale * 127.5 * (1.0 + 2.0**-8)) * gl.sqrt(rat) / gl.sqrt(var_c)
        radm_h = (radm + detm * (1.0 + 2.0**-8)) * LOG2E_C
        v0 = q20 * var_c
        v1 = q21 * var_c

    k0 = seed_lo.to(gl.uint32)
    k1 = seed_hi.to(gl.uint32)
    c3k = ((layer << 1) | 0).to(gl.uint32)
    c2 = kvh.to(gl.uint32)
    cw_i = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, WP)))
    t_i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WP)))
    cj = (2 * t_i[None, None, :] + cw_i[:, None, None]).to(gl.uint32)

    zs = sm_scale * LOG2E_C
    m_i = gl.full([8], float("-inf"), gl.float32, layout=H8L)
    l_t = gl.zeros([8, BN], gl.float32, layout=Z8R)
    a_t = gl.zeros([8, BN], gl.float32, layout=Z8R)
    b_t = gl.zeros([8, BN], gl.float32, layout=Z8R)
    acc0 = gl.zeros([2, 32, 8], gl.float32, layout=MMA)
    acc1 = gl.zeros([2, 32, 8], gl.float32, layout=MMA)

    KNL: gl.constexpr = gl.SliceLayout(2, W)
    VNL: gl.constexpr = gl.SliceLayout(2, VW)
    SNL: gl.constexpr = gl.SliceLayout(2, SC)
    NL: gl.constexpr = gl.SliceLayout(1, Z8)
    NLR: gl.constexpr = gl.SliceLayout(0, Z8R)
    sl_row = SLOTS + b * s_sl_b
    zk = gl.zeros([2, BN], gl.int32, layout=KNL)
    zv = gl.zeros([2, BN], gl.int32, layout=VNL)
    zsn = gl.zeros([2, BN], gl.int32, layout=SNL)
    nk = start + gl.arange(0, BN, layout=gl.SliceLayout(0, KNL))[None, :] + zk
    nv = start + gl.arange(0, BN, layout=gl.SliceLayout(0, VNL))[None, :] + zv
    ns_ = start + gl.arange(0, BN, layout=gl.SliceLayout(0, SNL))[None, :] + zsn
    sk, sv, ss = _slots(sl_row, nk, nv, ns_, end)
    kc0, kc1, ks = _load_side(KC, KS, sk, ss, ns_ < end, kvh, s_kc_n, s_ks_n, W)
    vw0, vw1, vs = _load_side(VC, VS, sv, ss, ns_ < end, kvh, s_vc_n, s_vs_n, VW)
    nk_x = nk + BN
    nv_x = nv + BN
    ns_x = ns_ + BN
    sk_x, sv_x, ss_x = _slots(sl_row, nk_x, nv_x, ns_x, end)
    w0, w1 = _dither_words(sk, cj, c2, c3k, k0, k1, BN)
    for n0 in range(start, end, BN):
        offs_n = n0 + gl.arange(0, BN, layout=NLR)
        mask_n = offs_n < end
        s0, s1 = _split2(ks, NL)
        zh = _qk_group(kc0, w0, qa0, q10, s0, BN) + _qk_group(kc1, w1, qa1, q11, s1, BN)
        kc0, kc1, ks = _load_side(KC, KS, sk_x, ss_x, ns_x < end, kvh, s_kc_n, s_ks_n, W)
        sk = sk_x
        if CERT:
            vh = (s0 * s0)[:, None, :] * v0[:, :, None] + (s1 * s1)[:, None, :] * v1[:, :, None]
            zv2 = gl.sum(gl.join(zh, vh), 0)  # the warps' halves added (shared memory)
            z, var = gl.split(zv2)
            z = gl.convert_layout(z, Z8R, assert_trivial=True)
            var = gl.convert_layout(var, Z8R, assert_trivial=True)
        else:
            z = gl.convert_layout(gl.sum(zh, 0), Z8R, assert_trivial=True)
        z8 = gl.where(mask_n[None, :], z * zs, float("-inf"))

        m_new = gl.maximum(m_i, gl.max(z8, 1))
        p = _ex2(z8 - m_new[:, None])
        if CERT:
            u = gl.sqrt(var) * radm_h[:, None]
            pa = p * _ex2(u)
            if CERT_B:
                pb = p * _ex2(-u)
        alpha = _ex2(m_i - m_new)
        l_t = l_t * alpha[:, None] + p
        if CERT:
            a_t = a_t * alpha[:, None] + pa
            if CERT_B:
                b_t = b_t * alpha[:, None] + pb
        alpha_pv = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        m_i = m_new

        pr = gl.convert_layout(gl.permute(p * 1024.0, [1, 0]), gl.SliceLayout(0, PT), assert_trivial=True)
        ppT = gl.expand_dims(pr, 0) + gl.zeros([2, BN, 8], gl.float32, layout=PT)
        u0, u1 = _split2(vs, gl.SliceLayout(2, PT))
        acc0 = _pv_group(vw0, ppT, u0, acc0 * alpha_pv[None, None, :], BN)
        acc1 = _pv_group(vw1, ppT, u1, acc1 * alpha_pv[None, None, :], BN)
        vw0, vw1, vs = _load_side(VC, VS, sv_x, ss_x, ns_x < end, kvh, s_vc_n, s_vs_n, VW)
        nk_x = nk_x + BN
        nv_x = nv_x + BN
        ns_x = ns_x + BN
        sk_x, sv_x, ss_x = _slots(sl_row, nk_x, nv_x, ns_x, end)
        w0, w1 = _dither_words(sk, cj, c2, c3k, k0, k1, BN)

    l_i = gl.sum(l_t, 1)
    nonempty = l_i != 0.0
    inv_l = gl.where(nonempty, 1.0 / gl.where(nonempty, l_i, 1.0), 0.0)
    lse = gl.where(nonempty, (m_i + gl.log2(gl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    o_base = O_S + b * s_os_b + split * s_os_s + (kvh * GQA) * s_os_h
    sc = gl.convert_layout(inv_l * (1.0 / 1024.0), gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    _store_group(o_base, s_os_h, acc0, sc, 0, GQA)
    _store_group(o_base, s_os_h, acc1, sc, 1, GQA)
    h = gl.arange(0, 8, layout=H8L)
    l_off = b * s_ls_b + (kvh * GQA + h) * s_ls_h + split
    gl.store(LSE_S + l_off, lse, mask=h < GQA)
    if CERT:
        gl.store(A_S + l_off, gl.sum(a_t, 1) * inv_l, mask=h < GQA)
        if CERT_B:
            gl.store(B_S + l_off, gl.sum(b_t, 1) * inv_l, mask=h < GQA)


def gluon_w2_num_splits(batch: int, hkv: int, max_len: int, device: torch.device) -> int:
    """One wave of two-warp programs, splits of at least 64 positions."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms * PROGRAMS_PER_SM // max(1, batch * hkv), math.ceil(max_len / 64)))


def launch_g8w2(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, *, sm: float, delta: float, rad_extra: float,
                layer: int, k0: int, k1: int, ns: int, cert: bool, cert_b: bool) -> None:
    """Launch :func:`_stage1_g8w2` (the same inputs and outputs as
    :func:`kvlib.kernels.decode_int8_gluon.launch_g8`)."""
    B, hq, d = q.shape
    hkv = k.codes.shape[1]
    gqa = hq // hkv
    why = gluon_unsupported(q, k, v)
    if why:
        raise ValueError(why)
    kc = k.codes.contiguous().view(torch.int32)
    vc = v.codes.contiguous().view(torch.int32)
    ks = k.scales.contiguous()
    vs = v.scales.contiguous()
    q = q.contiguous()
    _stage1_g8w2[(B, hkv, ns)](
        q, kc, ks, vc, vs, slots, seq_lens, o_s, lse_s, a_s, b_s,
        sm, math.log(2.0 / delta), rad_extra, layer, k0, k1,
        q.stride(0), q.stride(1), kc.stride(0), ks.stride(0), vc.stride(0), vs.stride(0), slots.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=gqa, NUM_SPLITS=ns, CERT=cert, CERT_B=cert and cert_b, num_warps=2,
        **({} if MAXNREG is None else {"maxnreg": MAXNREG}),
    )
