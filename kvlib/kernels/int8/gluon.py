"""Certified INT8 decode over the h8 dither layout, written in Gluon with explicit register layouts (GPU only).

Same contract as :func:`kvlib.kernels.int8.h10._decode_int8_stage1_h10` with ``H8`` (split-KV stage 1;
stage 2 is :func:`kvlib.kernels.tl.merge.merge_splits`), for ``d = 128``, groups of 32, a GQA group of at most
8 heads, fp16/bf16 queries and up to 16 outlier channels per side (``NOK``/``NOV``; SmolLM2 needs m >= 4 RoPE
pairs). The arithmetic is the Triton kernel's with the variance as
the four-FMA sum (``VAR_DOT=False`` there): the same exact fp16 operands (codes ``1152 + c - 1152``, the dither
``-(4 + b 2^-8)``, the value codes, ``1024 p s_v`` as hi + lo), fp32 accumulation, the same radius, so the same
rounding analysis covers it; the outlier channels take the Triton kernel's fp16 bypass (two MMAs of the fp16
outliers with the query's hi + lo, the bypass term in the radius; value outliers by their own MMA with
``1024 p`` as hi + lo). ``K_DITHER=False`` reads RTN keys (``xi = 0``: no Philox, no dither MMA, no certificate).

Why Gluon: the Triton kernel's remaining cost is its layout conversions (13 shared-memory round trips per
tile at two warps per scheduler, ``dev/results/README.md``). Here every operand is *loaded* in the
register layout the tensor cores read, and every conversion is checked at compile time to move no data
(``convert_layout(..., assert_trivial=True)``):

* one warp per program, so the online softmax's reductions never leave the warp (no shared memory, no
  barrier); the GPU is filled with more split programs instead;
* scores are ``S = Q K^T`` with the heads as M (padded to 16, rows 8-15 unused) and the positions as N, so the
  probabilities' C fragment is already the B fragment of ``O^T = V^T P^T`` (the FlashAttention-2 register
  reuse), and the output accumulator is ``[channels, heads]``: 32 registers per thread;
* the reduction index (channels) of ``Q K^T`` is permuted so each thread's four channels of a k-chunk are one
  code word, and the channels of ``V^T`` so each thread's rows are one word: codes are loaded as 64-bit
  (keys) and 32-bit (values) words straight into the fragments; the value bytes are transposed in registers
  (``prmt``), never through shared memory;
* the Philox calls are spread so each thread computes exactly the calls whose words its key fragments need
  (two per position), none twice;
* the next tile's slots, codes and scales are loaded while the current one is computed (registers, no
  ``cp.async``).

Not run under ``TRITON_INTERPRET`` (Gluon has no interpreter): the CPU tests cover the Triton kernel, and the
GPU agreement check binds this one to it and to the float64 reference
(:mod:`dev.gluon_vs_triton_h8`, ``tests/test_decode_gluon.py`` on a GPU).
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvlib.kernels.tl.philox_gluon import counter_words, philox4x32

XI8_CONST: gl.constexpr = gl.constexpr(4.5 - 2.0**-9)
LOG2E_C: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2_C: gl.constexpr = gl.constexpr(0.6931471805599453)


# ----------------------------------------------------------------------------------------------
# layouts (built on the host for a tile of BN positions; one warp)
def _bits(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


def kernel_layouts(bn: int) -> dict[str, object]:
    """Every register layout of :func:`_stage1_g8` for ``bn`` positions per tile (a power of two >= 16); both
    dots use the one MMA layout ``MMA``."""
    if bn % 16 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {bn}")
    nt = [[8 * b, 0] for b in _bits(bn // 8)]  # position bases above the n8 tile (positions first)
    ntc = [[0, 8 * b] for b in _bits(bn // 8)]  # the same, positions second
    lin = lambda reg, lane, shape: gl.DistributedLinearLayout(  # noqa: E731 - one warp, one CTA
        reg_bases=reg, lane_bases=lane, warp_bases=[], block_bases=[], shape=shape)
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    return dict(
        # key codes of one group [BN, 32]: lane (g, t) holds positions g + 8 nt, local channels 8 t + 0..7
        KW=lin([[0, 1], [0, 2], [0, 4]] + nt, [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], [bn, 32]),
        # Philox words [BN, 8 calls]: lane (g, t) computes calls 2 t, 2 t + 1 of positions g + 8 nt
        W=lin([[0, 1]] + nt, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [bn, 8]),
        # value words of one group [BN, 8]: lane (g, t) holds word g of positions 2 t + e + 8 h + 16 kc
        VW=lin([[1, 0]] + nt, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [bn, 8]),
        # the four scales of a position [BN, 4] (one 8-byte load): lane (g, t) positions 2 t + e + 8 nt
        SC=lin([[0, 1], [0, 2], [1, 0]] + nt, [[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], [bn, 4]),
        MMA=mma,
        QA=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        KB=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        # a blocked layout for the prologue's query statistics [16 heads, 32 channels]
        QB=gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0]),
        # scores of the 8 heads [8, BN]: head on lanes g, positions 2 t + r0 + 8 nt
        Z8=lin([[0, 1]] + ntc, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [8, bn]),
        # its transpose [BN, 8]
        PT=lin([[1, 0]] + nt, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [bn, 8]),
        PB=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        VA=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        # value words replicated per byte [BN, 8, 4], the position pair innermost then the byte
        V8=lin([[1, 0, 0], [0, 0, 1], [0, 0, 2]] + [[8 * b, 0, 0] for b in _bits(bn // 8)],
               [[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [bn, 8, 4]),
    )


#: positions per tile (larger tiles spill: 32 positions took a 48-byte stack and more instructions per position)
BLOCK_N = 16
_BN = gl.constexpr(BLOCK_N)
# The kernel's register layouts as module constants, not launch arguments: the JIT specialises on every constexpr
# argument at each launch. With the thirteen layouts as arguments an eager certified step took 0.62 ms at B=2, S=4k
# against 0.018 ms replayed from a CUDA graph (witcert_decode at c49fe48); that the constants remove this host cost
# is the expectation, not yet measured (python -m dev.gluon_vs_triton_h8 --eager)
_LAYOUT_NAMES = ("KW", "W", "VW", "SC", "MMA", "QA", "KB", "QB", "Z8", "PT", "PB", "VA", "V8")
KW, W, VW, SC, MMA, QA, KB, QB, Z8, PT, PB, VA, V8 = (gl.constexpr(kernel_layouts(BLOCK_N)[k]) for k in _LAYOUT_NAMES)


# ----------------------------------------------------------------------------------------------
# device helpers
@gluon.jit
def _dither_words(slot, cj, c2, c3k, k0, k1, BN: gl.constexpr, W: gl.constexpr, GEN: gl.constexpr = 0,
                  N_ROUNDS: gl.constexpr = 10):
    """The four Philox words of counter ``(slot, call j, kv head, layer << 1)`` for each position and call ``[BN, 8]``
    (word ``i`` is group ``i``'s dither of the call's 16 channels). ``GEN``/``N_ROUNDS``: another generator
    (:func:`kvlib.kernels.tl.philox.generator_constexprs`; Philox4x32-10, each product one ``mul.wide.u32``, is
    called directly, the validated path)."""
    cs = slot.to(gl.uint32)[:, None] + gl.zeros([BN, 8], gl.uint32, layout=W)
    if GEN == 0 and N_ROUNDS == 10:
        w0, w1, w2, w3 = philox4x32(cs, cj + gl.zeros_like(cs), c2 + gl.zeros_like(cs), c3k + gl.zeros_like(cs),
                                    k0, k1, 10)
    else:
        w0, w1, w2, w3 = counter_words(cs, cj + gl.zeros_like(cs), c2 + gl.zeros_like(cs), c3k + gl.zeros_like(cs),
                                       k0, k1, GEN, N_ROUNDS)
    return w0, w1, w2, w3


@gluon.jit
def _to_kb(x, BN: gl.constexpr, KB: gl.constexpr):
    """``[BN, 32]`` in local channel order ``8 t + 4 jj + 2 h + e`` -> the QK B operand ``[32, BN]`` whose
    reduction index is ``16 jj + 8 h + 2 t + e`` (a relabelling: no data moves)."""
    y = gl.reshape(x, [BN, 4, 2, 2, 2])
    y = gl.permute(y, [0, 2, 3, 1, 4])
    y = gl.reshape(y, [BN, 32])
    return gl.convert_layout(gl.permute(y, [1, 0]), KB, assert_trivial=True)


@gluon.jit
def _replicate4(w, BN: gl.constexpr):
    """Words ``[BN, 8]`` -> ``[BN, 8, 4]``, each word once per byte: the copies are register aliases, so an
    elementwise asm sees one word per four output channels."""
    w2 = gl.join(w, w)
    return gl.reshape(gl.join(w2, w2), [BN, 8, 4])


@gluon.jit
def _bytes_kb(w, DITHER: gl.constexpr, BN: gl.constexpr, KB: gl.constexpr, KW: gl.constexpr):
    """Words ``[BN, 8]`` whose byte ``b`` of word ``j`` is local channel ``4 j + b`` -> an exact fp16 QK B operand.
    Key codes (``DITHER=False``): bytes ``c ^ 0x80`` under ``0x64`` (= 1152 + c), one packed subtract of 1152 per
    two codes. Philox words of the h8 layout (``DITHER=True``): ``-(4 + b 2^-8)`` as fp16 bits ``0xC4 | b``, one
    ``prmt`` per two channels."""
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
    return _to_kb(gl.convert_layout(gl.reshape(x, [BN, 32]), KW, assert_trivial=True), BN, KB)


@gluon.jit
def _values_va(vw, BN: gl.constexpr, VA: gl.constexpr, V8: gl.constexpr):
    """int32 value words ``[BN, 8]`` (word ``g`` of the group at lane ``g``) -> the PV A operand ``[32, BN]``
    (exact fp16 codes; row ``16 mt + 8 r + g`` is local channel ``4 g + 2 mt + r``): the bytes of positions
    ``n, n + 1`` are paired by ``prmt`` in registers."""
    # position pairs innermost: a register renaming
    v4 = gl.convert_layout(_replicate4(vw, BN), V8, assert_trivial=True)
    c = gl.inline_asm_elementwise(
        "{ .reg .b32 a, b, x, y, k; mov.b32 k, 0x64806480; "
        "xor.b32 a, $4, 0x80808080; xor.b32 b, $5, 0x80808080; "
        "prmt.b32 x, a, b, 0x5140; prmt.b32 y, a, b, 0x7362; "
        "prmt.b32 $0, x, 0x64646464, 0x4140; prmt.b32 $1, x, 0x64646464, 0x4342; "
        "prmt.b32 $2, y, 0x64646464, 0x4140; prmt.b32 $3, y, 0x64646464, 0x4342; "
        "sub.rn.f16x2 $0, $0, k; sub.rn.f16x2 $1, $1, k; sub.rn.f16x2 $2, $2, k; sub.rn.f16x2 $3, $3, k; }",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [v4], dtype=gl.float16, is_pure=True, pack=8)
    y = gl.reshape(c, [BN, 8, 2, 2])  # [n, g, mt, r]
    y = gl.permute(y, [0, 2, 3, 1])  # [n, mt, r, g]
    y = gl.reshape(y, [BN, 32])
    return gl.convert_layout(gl.permute(y, [1, 0]), VA, assert_trivial=True)


@gluon.jit
def _split4(x, BN: gl.constexpr, L1: gl.constexpr):
    """``[BN, 4]`` fp16 scales -> the four groups' fp32 ``[BN]`` in layout ``L1``."""
    a, b = gl.split(gl.reshape(x.to(gl.float32), [BN, 2, 2]))  # a: groups 0, 2; b: 1, 3
    s0, s2 = gl.split(a)
    s1, s3 = gl.split(b)
    return (gl.convert_layout(s0, L1, assert_trivial=True), gl.convert_layout(s1, L1, assert_trivial=True),
            gl.convert_layout(s2, L1, assert_trivial=True), gl.convert_layout(s3, L1, assert_trivial=True))


@gluon.jit
def _is_outlier(ch, OC_row, NO: gl.constexpr):
    """Whether each channel of ``ch`` is one of the ``NO`` outlier channels at ``OC_row`` (scalar loads, unrolled:
    no layout conversion)."""
    hit = ch < 0
    for i in gl.static_range(NO):
        hit = hit | (ch == gl.load(OC_row + i).to(gl.int32))
    return hit


@gluon.jit
def _q_group(Q_row, s_qh, g: gl.constexpr, GQA: gl.constexpr, QA: gl.constexpr, QB: gl.constexpr,
             MMA: gl.constexpr, KOC_row=None, NOK: gl.constexpr = 0):
    """Group ``g``'s query: the A operand ``[16, 32]`` (fp16, channels permuted as the keys') and per head
    ``sum q_hi``, ``sum q^2``, ``sum |q - q_hi| (1 + 1/255)`` (``[16]`` in the scores' row layout). The ``NOK``
    key-outlier channels are zeroed (their codes are 0; they enter through the fp16 bypass)."""
    hA = gl.arange(0, 16, layout=gl.SliceLayout(1, QA))
    kA = gl.arange(0, 32, layout=gl.SliceLayout(0, QA))
    chA = 8 * ((kA % 8) // 2) + 4 * (kA // 16) + 2 * ((kA // 8) % 2) + (kA % 2)
    qa = gl.load(Q_row + hA[:, None] * s_qh + (g * 32 + chA)[None, :], mask=(hA < GQA)[:, None], other=0.0)
    qa = qa.to(gl.float32)
    if NOK > 0:
        qa = gl.where(_is_outlier(g * 32 + chA, KOC_row, NOK)[None, :], 0.0, qa)
    qa = qa.to(gl.float16)
    hB = gl.arange(0, 16, layout=gl.SliceLayout(1, QB))
    cB = gl.arange(0, 32, layout=gl.SliceLayout(0, QB))
    qg = gl.load(Q_row + hB[:, None] * s_qh + (g * 32 + cB)[None, :], mask=(hB < GQA)[:, None],
                 other=0.0).to(gl.float32)
    if NOK > 0:
        qg = gl.where(_is_outlier(g * 32 + cB, KOC_row, NOK)[None, :], 0.0, qg)
    q_hi = qg.to(gl.float16).to(gl.float32)
    r1 = qg - q_hi
    L: gl.constexpr = gl.SliceLayout(1, MMA)
    q1 = gl.convert_layout(gl.sum(q_hi, 1), L)
    q2 = gl.convert_layout(gl.sum(qg * qg, 1), L)
    rr = gl.convert_layout(gl.sum(gl.abs(r1) + gl.abs(r1) * (1.0 / 255.0), 1), L)
    return qa, q1, q2, rr


@gluon.jit
def _rat(rg, q2g):
    """``R'_g^2 / Q2_g`` (``inf`` where the group's query is 0 but its residual is not)."""
    return gl.where(q2g > 0, rg * rg / gl.where(q2g > 0, q2g, 1.0), gl.where(rg > 0, float("inf"), 0.0))


@gluon.jit
def _ex2(x):
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _rows8(x, BN: gl.constexpr):
    """Rows 0-7 of a ``[16, BN]`` C fragment (the heads; rows 8-15 are padding): a register selection."""
    lo, hi = gl.split(gl.permute(gl.reshape(x, [2, 8, BN]), [1, 2, 0]))
    return lo


@gluon.jit
def _rows8v(x):
    """Entries 0-7 of a per-row ``[16]`` vector of the scores (the heads; 8-15 are padding)."""
    lo, hi = gl.split(gl.permute(gl.reshape(x, [2, 8]), [1, 0]))
    return lo


@gluon.jit
def _slot(sl_row, n, end, PAGE: gl.constexpr):
    """Slots of positions ``n``: the slot table's entries, or (``PAGE`` = block size > 0) from the block table,
    ``block_table[t // PAGE] * PAGE + t % PAGE`` (:mod:`kvlib.kernels.tl.paging`); 0 past the end."""
    if PAGE > 0:
        blk = gl.load(sl_row + n // PAGE, mask=n < end, other=0)
        return gl.where(n < end, blk * PAGE + n % PAGE, 0)
    return gl.load(sl_row + n, mask=n < end, other=0)


@gluon.jit
def _slots(sl_row, nk, nv, ns, end, PAGE: gl.constexpr = 0):
    """A tile's slot indices in the three position layouts (key words, value words, scales); 0 past the end."""
    return _slot(sl_row, nk, end, PAGE), _slot(sl_row, nv, end, PAGE), _slot(sl_row, ns, end, PAGE)


@gluon.jit
def _load_side(C, S, slot_c, slot_s, mask_s, kvh, s_c_n, s_s_n, L: gl.constexpr, SC: gl.constexpr):
    """A tile's operands of one side (contiguous pools: a head's 32 code words and 4 scales are adjacent): code
    words per group ``[BN, 8]`` int32 in layout ``L`` (keys ``W``: lane ``t`` holds words ``2 t, 2 t + 1`` of
    positions ``g + 8 nt``; values ``VW``: lane ``g`` holds word ``g`` of positions ``2 t + e + 8 h + 16 kc``) and
    the scales ``[BN, 4]`` fp16 (0 past the end).

    The code words are loaded without a mask: a position past the end reads slot 0 (its slot load is masked to 0),
    a real row of the pool, and is removed by its score (-inf) and its scale (0, so p s c = 0); a masked load
    would cost a zeroing move per register."""
    cw = gl.arange(0, 8, layout=gl.SliceLayout(0, L))
    base = C + slot_c.to(gl.int64)[:, None] * s_c_n + kvh * 32 + cw[None, :]
    c0 = gl.load(base)
    c1 = gl.load(base + 8)
    c2 = gl.load(base + 16)
    c3 = gl.load(base + 24)
    cs = gl.arange(0, 4, layout=gl.SliceLayout(0, SC))
    sc = gl.load(S + slot_s.to(gl.int64)[:, None] * s_s_n + kvh * 4 + cs[None, :], mask=mask_s[:, None], other=0.0)
    return c0, c1, c2, c3, sc


@gluon.jit
def _qk_group(kc, w, qa, q1, s, BN: gl.constexpr, KB: gl.constexpr, KW: gl.constexpr, MMA: gl.constexpr,
              Z8: gl.constexpr, K_DITHER: gl.constexpr = True):
    """Group scores ``s_g (q.c - q.m' + (4.5 - 2^-9) sum q)`` of the 8 head rows, ``[8, BN]`` (RTN keys,
    ``K_DITHER=False``: ``s_g q.c``; ``w`` unused)."""
    acc = gl.zeros([16, BN], gl.float32, layout=MMA)
    acc = mma_v2(qa, _bytes_kb(kc, False, BN, KB, KW), acc)
    if K_DITHER:
        acc = mma_v2(qa, _bytes_kb(w, True, BN, KB, KW), acc)
    acc = gl.convert_layout(_rows8(acc, BN), Z8, assert_trivial=True)
    if K_DITHER:
        return (acc + XI8_CONST * q1[:, None]) * s[None, :]
    return acc * s[None, :]


@gluon.jit
def _pv_group(vw, ppT, vs, acc, BN: gl.constexpr, VA: gl.constexpr, V8: gl.constexpr, PB: gl.constexpr):
    """``acc + c^T (1024 p s_v)`` for one group, ``[32, 8]`` (PV exact: ``1024 p s`` as fp16 hi + lo)."""
    va = _values_va(vw, BN, VA, V8)
    ps = ppT * vs[:, None]
    hi = ps.to(gl.float16)
    lo = (ps - hi.to(gl.float32)).to(gl.float16)
    acc = mma_v2(va, gl.convert_layout(hi, PB, assert_trivial=True), acc)
    return mma_v2(va, gl.convert_layout(lo, PB, assert_trivial=True), acc)


@gluon.jit
def _store_group(o_base, s_os_h, acc, sc, g: gl.constexpr, GQA: gl.constexpr, MMA: gl.constexpr, VOC_row=None,
                 NOV: gl.constexpr = 0):
    m = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    ch = g * 32 + 4 * (m % 8) + 2 * (m // 16) + (m // 8) % 2
    h = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    mask = (h < GQA)[None, :]
    if NOV > 0:  # the value-outlier channels are written from their fp16 accumulator
        mask = mask & (~_is_outlier(ch, VOC_row, NOV))[:, None]
    gl.store(o_base + h[None, :] * s_os_h + ch[:, None], acc * sc[None, :], mask=mask)


# layer and seed are run-time values: a layer (or seed word) equal to 1 must not become a constexpr
@gluon.jit(do_not_specialize=["layer", "seed_lo", "seed_hi"])
def _stage1_g8(
    Q, KC, KS, VC, VS, SLOTS, SEQ, O_S, LSE_S, A_S, B_S, KO, KOC, VO, VOC,
    sm_scale, log_2_over_delta, rad_extra, layer, seed_lo, seed_hi, byp_rel, byp_abs,
    s_qb, s_qh, s_kc_n, s_ks_n, s_vc_n, s_vs_n, s_sl_b, s_ko_n, s_ko_h, s_vo_n, s_vo_h,
    s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: gl.constexpr, NUM_SPLITS: gl.constexpr, CERT: gl.constexpr, CERT_B: gl.constexpr, AHEAD: gl.constexpr,
    PAGE: gl.constexpr = 0, K_DITHER: gl.constexpr = True, NOK: gl.constexpr = 0, NOV: gl.constexpr = 0,
    GEN: gl.constexpr = 0, N_ROUNDS: gl.constexpr = 10,
):
    # NOK / NOV (<= 16 each): outlier channels of the keys / values, stored fp16 beside the codes (code 0 there), as
    # in the Triton h10 kernel: the keys' enter the scores by two fp16 MMAs (q hi + lo) and the radius by the bypass
    # term; the values' accumulate by their own MMA and are stored at their channels
    # K_DITHER=False: RTN keys (xi = 0): no Philox, no dither MMA (CERT off, the dispatcher's rule)
    BN: gl.constexpr = _BN
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(SEQ + b).to(gl.int32)
    split_len = gl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)

    Q_row = Q + b * s_qb + kvh * GQA * s_qh
    KOC_row = KOC + kvh * NOK
    VOC_row = VOC + kvh * NOV
    qa0, q10, q20, rr0 = _q_group(Q_row, s_qh, 0, GQA, QA, QB, MMA, KOC_row, NOK)
    qa1, q11, q21, rr1 = _q_group(Q_row, s_qh, 1, GQA, QA, QB, MMA, KOC_row, NOK)
    qa2, q12, q22, rr2 = _q_group(Q_row, s_qh, 2, GQA, QA, QB, MMA, KOC_row, NOK)
    qa3, q13, q23, rr3 = _q_group(Q_row, s_qh, 3, GQA, QA, QB, MMA, KOC_row, NOK)
    if NOK > 0:  # the outlier channels' query [16 heads, 16 channels] as fp16 hi + lo A operands
        hA = gl.arange(0, 16, layout=gl.SliceLayout(1, QA))
        cA = gl.arange(0, 16, layout=gl.SliceLayout(0, QA))
        kocA = gl.load(KOC_row + cA, mask=cA < NOK, other=0)
        qo = gl.load(Q_row + hA[:, None] * s_qh + kocA[None, :], mask=(hA < GQA)[:, None] & (cA < NOK)[None, :],
                     other=0.0).to(gl.float32)
        qo_hi = qo.to(gl.float16)
        qo_lo = (qo - qo_hi.to(gl.float32)).to(gl.float16)
        cK = gl.arange(0, 16, layout=gl.SliceLayout(1, KB))  # outlier index, the B operand's reduction rows
        KBN: gl.constexpr = gl.SliceLayout(0, KB)
    H8L: gl.constexpr = gl.SliceLayout(1, Z8)  # per head, heads on lanes g
    NL: gl.constexpr = gl.SliceLayout(0, Z8)  # per position of the scores
    q10 = gl.convert_layout(_rows8v(q10), H8L)
    q11 = gl.convert_layout(_rows8v(q11), H8L)
    q12 = gl.convert_layout(_rows8v(q12), H8L)
    q13 = gl.convert_layout(_rows8v(q13), H8L)
    if CERT:
        radm = gl.sqrt(2.0 * (gl.log(gl.maximum(seq_len, 1).to(gl.float32)) + log_2_over_delta)) + rad_extra
        var_c = sm_scale * sm_scale / 12.0 * (1.0 + 2.0**-8)
        rat = (_rat(rr0, q20) + _rat(rr1, q21)) + (_rat(rr2, q22) + _rat(rr3, q23))
        detm = (sm_scale * 127.5 * (1.0 + 2.0**-8)) * gl.sqrt(rat) / gl.sqrt(var_c)
        radm_h = gl.convert_layout(_rows8v((radm + detm * (1.0 + 2.0**-8)) * LOG2E_C), H8L)
        v0 = gl.convert_layout(_rows8v(q20 * var_c), H8L)
        v1 = gl.convert_layout(_rows8v(q21 * var_c), H8L)
        v2 = gl.convert_layout(_rows8v(q22 * var_c), H8L)
        v3 = gl.convert_layout(_rows8v(q23 * var_c), H8L)
        if NOK > 0:  # |q_o| rounded UP to fp16 (its product with the exact fp16 |k_o| bounds from above), sum |q_o|
            qa_abs = gl.abs(qo)
            qa16 = qa_abs.to(gl.float16)
            qo_abs16 = gl.where(qa16.to(gl.float32) < qa_abs,
                                (qa16.to(gl.int16, bitcast=True) + 1).to(gl.float16, bitcast=True), qa16)
            hB = gl.arange(0, 16, layout=gl.SliceLayout(1, QB))
            cB = gl.arange(0, 16, layout=gl.SliceLayout(0, QB))
            kocB = gl.load(KOC_row + cB, mask=cB < NOK, other=0)
            qoB = gl.load(Q_row + hB[:, None] * s_qh + kocB[None, :], mask=(hB < GQA)[:, None] & (cB < NOK)[None, :],
                          other=0.0).to(gl.float32)
            qo_sum = gl.convert_layout(_rows8v(gl.convert_layout(gl.sum(gl.abs(qoB), 1), gl.SliceLayout(1, MMA))),
                                       H8L)

    k0 = seed_lo.to(gl.uint32)
    k1 = seed_hi.to(gl.uint32)
    c3k = ((layer << 1) | 0).to(gl.uint32)
    c2 = kvh.to(gl.uint32)
    cj = gl.arange(0, 8, layout=gl.SliceLayout(0, W)).to(gl.uint32)[None, :]

    zs = sm_scale * LOG2E_C
    m_i = gl.full([8], float("-inf"), gl.float32, layout=H8L)
    l_t = gl.zeros([8, BN], gl.float32, layout=Z8)
    a_t = gl.zeros([8, BN], gl.float32, layout=Z8)
    b_t = gl.zeros([8, BN], gl.float32, layout=Z8)
    acc0 = gl.zeros([32, 8], gl.float32, layout=MMA)
    acc1 = gl.zeros([32, 8], gl.float32, layout=MMA)
    acc2 = gl.zeros([32, 8], gl.float32, layout=MMA)
    acc3 = gl.zeros([32, 8], gl.float32, layout=MMA)
    if NOV > 0:
        acc_vo = gl.zeros([16, 8], gl.float32, layout=MMA)
        cV = gl.arange(0, 16, layout=gl.SliceLayout(1, VA))  # outlier index, the A operand's rows
        VAN: gl.constexpr = gl.SliceLayout(0, VA)

    KNL: gl.constexpr = gl.SliceLayout(1, W)
    VNL: gl.constexpr = gl.SliceLayout(1, VW)
    SNL: gl.constexpr = gl.SliceLayout(1, SC)
    sl_row = SLOTS + b * s_sl_b
    # tile `start`: slots, then its operands; the next tile's slots
    nk = start + gl.arange(0, BN, layout=KNL)
    nv = start + gl.arange(0, BN, layout=VNL)
    ns_ = start + gl.arange(0, BN, layout=SNL)
    sk, sv, ss = _slots(sl_row, nk, nv, ns_, end, PAGE)
    kc0, kc1, kc2, kc3, ks = _load_side(KC, KS, sk, ss, ns_ < end, kvh, s_kc_n, s_ks_n, W, SC)
    vw0, vw1, vw2, vw3, vs = _load_side(VC, VS, sv, ss, ns_ < end, kvh, s_vc_n, s_vs_n, VW, SC)
    nk_x = nk + BN
    nv_x = nv + BN
    ns_x = ns_ + BN
    sk_x, sv_x, ss_x = _slots(sl_row, nk_x, nv_x, ns_x, end, PAGE)

    if AHEAD and K_DITHER:
        w0, w1, w2, w3 = _dither_words(sk, cj, c2, c3k, k0, k1, BN, W, GEN, N_ROUNDS)
    if not K_DITHER:  # placeholders, never read
        w0 = kc0
        w1 = kc0
        w2 = kc0
        w3 = kc0
    for n0 in range(start, end, BN):
        offs_n = n0 + gl.arange(0, BN, layout=NL)
        mask_n = offs_n < end
        # the next tile's operands are loaded once this tile's are consumed (keys after the scores, values after
        # PV), so the registers of one tile, not two, are live at the Philox and QK peak
        if not AHEAD and K_DITHER:
            w0, w1, w2, w3 = _dither_words(sk, cj, c2, c3k, k0, k1, BN, W, GEN, N_ROUNDS)
        s0, s1, s2, s3 = _split4(ks, BN, NL)
        z = (_qk_group(kc0, w0, qa0, q10, s0, BN, KB, KW, MMA, Z8, K_DITHER)
             + _qk_group(kc1, w1, qa1, q11, s1, BN, KB, KW, MMA, Z8, K_DITHER))
        z += (_qk_group(kc2, w2, qa2, q12, s2, BN, KB, KW, MMA, Z8, K_DITHER)
              + _qk_group(kc3, w3, qa3, q13, s3, BN, KB, KW, MMA, Z8, K_DITHER))
        if NOK > 0:  # the bypass: fp16 outliers [16 outliers, BN] as the B operand, the query as hi + lo
            n_o = n0 + gl.arange(0, BN, layout=KBN)
            s_o = _slot(sl_row, n_o, end, PAGE)
            ko = gl.load(KO + s_o.to(gl.int64)[None, :] * s_ko_n + kvh * s_ko_h + cK[:, None],
                         mask=(cK < NOK)[:, None] & (n_o < end)[None, :], other=0.0).to(gl.float16)
            zo = gl.zeros([16, BN], gl.float32, layout=MMA)
            zo = mma_v2(qo_hi, ko, zo)
            zo = mma_v2(qo_lo, ko, zo)
            z += gl.convert_layout(_rows8(zo, BN), Z8, assert_trivial=True)
        z8 = gl.where(mask_n[None, :], z * zs, float("-inf"))
        kc0, kc1, kc2, kc3, ks = _load_side(KC, KS, sk_x, ss_x, ns_x < end, kvh, s_kc_n, s_ks_n, W, SC)
        sk = sk_x

        m_new = gl.maximum(m_i, gl.max(z8, 1))
        p = _ex2(z8 - m_new[:, None])
        if CERT:
            var = ((s0 * s0)[None, :] * v0[:, None] + (s1 * s1)[None, :] * v1[:, None]) + (
                (s2 * s2)[None, :] * v2[:, None] + (s3 * s3)[None, :] * v3[:, None])
            u = gl.sqrt(var) * radm_h[:, None]
            if NOK > 0:  # fp32 accumulation of exact products: its rounding is inside the (1 + 2^-8)
                byp = mma_v2(qo_abs16, gl.abs(ko), gl.zeros([16, BN], gl.float32, layout=MMA))
                byp = gl.convert_layout(_rows8(byp, BN), Z8, assert_trivial=True)
                u += zs * (byp * (byp_rel * (1.0 + 2.0**-8)) + qo_sum[:, None] * byp_abs)
            pa = p * _ex2(u)
            if CERT_B:
                pb = p * _ex2(-u)
        alpha = _ex2(m_i - m_new)
        l_t = l_t * alpha[:, None] + p
        if CERT:
            a_t = a_t * alpha[:, None] + pa
            if CERT_B:
                b_t = b_t * alpha[:, None] + pb
        alpha_pv = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))
        m_i = m_new

        ppT = gl.convert_layout(gl.permute(p * 1024.0, [1, 0]), PT, assert_trivial=True)  # [BN, 8]
        u0, u1, u2, u3 = _split4(vs, BN, gl.SliceLayout(1, PT))
        acc0 = _pv_group(vw0, ppT, u0, acc0 * alpha_pv[None, :], BN, VA, V8, PB)
        acc1 = _pv_group(vw1, ppT, u1, acc1 * alpha_pv[None, :], BN, VA, V8, PB)
        acc2 = _pv_group(vw2, ppT, u2, acc2 * alpha_pv[None, :], BN, VA, V8, PB)
        acc3 = _pv_group(vw3, ppT, u3, acc3 * alpha_pv[None, :], BN, VA, V8, PB)
        if NOV > 0:  # value outliers [16 outliers, BN] fp16 as the A operand, 1024 p as hi + lo (exact)
            n_v = n0 + gl.arange(0, BN, layout=VAN)
            s_v = _slot(sl_row, n_v, end, PAGE)
            vo = gl.load(VO + s_v.to(gl.int64)[None, :] * s_vo_n + kvh * s_vo_h + cV[:, None],
                         mask=(cV < NOV)[:, None] & (n_v < end)[None, :], other=0.0).to(gl.float16)
            p_hi = ppT.to(gl.float16)
            p_lo = (ppT - p_hi.to(gl.float32)).to(gl.float16)
            acc_vo = mma_v2(vo, gl.convert_layout(p_hi, PB, assert_trivial=True), acc_vo * alpha_pv[None, :])
            acc_vo = mma_v2(vo, gl.convert_layout(p_lo, PB, assert_trivial=True), acc_vo)
        vw0, vw1, vw2, vw3, vs = _load_side(VC, VS, sv_x, ss_x, ns_x < end, kvh, s_vc_n, s_vs_n, VW, SC)
        nk_x = nk_x + BN
        nv_x = nv_x + BN
        ns_x = ns_x + BN
        sk_x, sv_x, ss_x = _slots(sl_row, nk_x, nv_x, ns_x, end, PAGE)
        if AHEAD and K_DITHER:  # the next tile's dither, beside this tile's PV
            w0, w1, w2, w3 = _dither_words(sk, cj, c2, c3k, k0, k1, BN, W, GEN, N_ROUNDS)

    l_i = gl.sum(l_t, 1)
    nonempty = l_i != 0.0
    inv_l = gl.where(nonempty, 1.0 / gl.where(nonempty, l_i, 1.0), 0.0)
    lse = gl.where(nonempty, (m_i + gl.log2(gl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    o_base = O_S + b * s_os_b + split * s_os_s + (kvh * GQA) * s_os_h
    sc = gl.convert_layout(inv_l * (1.0 / 1024.0), gl.SliceLayout(0, MMA))
    _store_group(o_base, s_os_h, acc0, sc, 0, GQA, MMA, VOC_row, NOV)
    _store_group(o_base, s_os_h, acc1, sc, 1, GQA, MMA, VOC_row, NOV)
    _store_group(o_base, s_os_h, acc2, sc, 2, GQA, MMA, VOC_row, NOV)
    _store_group(o_base, s_os_h, acc3, sc, 3, GQA, MMA, VOC_row, NOV)
    if NOV > 0:
        mo = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        ho = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        voc = gl.load(VOC_row + mo, mask=mo < NOV, other=0)
        gl.store(o_base + ho[None, :] * s_os_h + voc[:, None], acc_vo * sc[None, :],
                 mask=(mo < NOV)[:, None] & (ho < GQA)[None, :])
    h = gl.arange(0, 8, layout=H8L)
    l_off = b * s_ls_b + (kvh * GQA + h) * s_ls_h + split
    gl.store(LSE_S + l_off, lse, mask=h < GQA)
    if CERT:
        gl.store(A_S + l_off, gl.sum(a_t, 1) * inv_l, mask=h < GQA)
        if CERT_B:
            gl.store(B_S + l_off, gl.sum(b_t, 1) * inv_l, mask=h < GQA)


def gluon_unsupported(q: torch.Tensor, k, v, v_dither: bool = False) -> str | None:
    """Why the Gluon kernel cannot run this request (``None`` when it can): it needs a CUDA device, d = 128,
    groups of 32, an h8 key pool (any layout label for RTN keys), RTN values, at most 8 query heads per KV head,
    fp16/bf16 queries and at most 16 outlier channels per side."""
    d = q.shape[-1]
    gqa = q.shape[1] // k.codes.shape[1]
    checks = [
        (q.device.type == "cuda", "a CUDA device"),
        (d == 128 and k.group == 32 and v.group == 32, f"d = 128 with groups of 32 (got d={d}, group={k.group})"),
        (k.dither_layout == "h8" or not k.dithered, f"an h8 key pool (got dither_layout={k.dither_layout!r})"),
        (not v_dither, "RTN values (v_dither=False)"),
        (gqa <= 8, f"at most 8 query heads per KV head (got {gqa})"),
        (q.dtype in (torch.float16, torch.bfloat16), f"fp16/bf16 queries (got {q.dtype})"),
        (all(s.outliers is None or s.outliers.shape[-1] <= 16 for s in (k, v)),
         "at most 16 outlier channels per side (8 RoPE pairs)"),
    ]
    missing = [what for ok, what in checks if not ok]
    return None if not missing else "impl='gluon' needs " + ", ".join(missing)


def gluon_auto_ok(k, v, cert: bool = True) -> bool:
    """Whether ``impl="auto"`` takes the Gluon kernel for a request it can run: only its variants whose sm_90 binary
    has no spills (offline compiles, ``tests/test_decode_gluon.py``): no outliers, RTN keys, or key outliers (up to 16
    channels) with the certificate on. Value outliers (16-32 B of stack at 4-16 channels) and uncertified key
    outliers (8 B) spill, so ``auto`` gives those to the Triton h10 kernel; ``impl="gluon"`` still runs them."""
    if v.outliers is not None:
        return False
    return k.outliers is None or cert


def gluon_num_splits(batch: int, hkv: int, max_len: int, device: torch.device, programs_per_sm: int = 8) -> int:
    """One wave of one-warp programs, ``programs_per_sm`` resident per SM (8 at the kernel's 255 registers; the
    H200 probe's best at every long-context shape: ``dev/results/gluon_probe4.json``), splits of at least 64
    positions."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms * programs_per_sm // max(1, batch * hkv), math.ceil(max_len / 64)))


def launch_g8(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, *, sm: float, delta: float, rad_extra: float,
              layer: int, k0: int, k1: int, ns: int, cert: bool, cert_b: bool, ahead: bool = True,
              page: int = 0, byp_rel: float = 0.0, byp_abs: float = 0.0, generator: str = "philox4x32-10") -> None:
    """Launch :func:`_stage1_g8` on validated inputs (the h8 pool, d = 128, group 32, GQA <= 8, at most 16 outlier
    channels per side; ``byp_rel``/``byp_abs``: the fp16 bypass's rounding allowance, as the h10 kernel's);
    ``ahead`` is :attr:`kvlib.kernels.int8.config.Int8KernelConfig.ahead`; ``page > 0``: ``slots`` is a block table
    of pages of ``page`` slots; ``generator``: the key dither's generator
    (:attr:`kvlib.kernels.int8.config.Int8KernelConfig.generator`, ``"none"``: timing only)."""
    from kvlib.kernels.tl.philox import generator_constexprs

    gen = generator_constexprs(generator)
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
    nok = k.outliers.shape[-1] if k.outliers is not None else 0
    nov = v.outliers.shape[-1] if v.outliers is not None else 0
    ko = k.outliers.contiguous() if nok else ks  # placeholders where a side has none (never read)
    koc = k.outlier_channels.contiguous() if nok else slots
    vo = v.outliers.contiguous() if nov else vs
    voc = v.outlier_channels.contiguous() if nov else slots
    _stage1_g8[(B, hkv, ns)](
        q, kc, ks, vc, vs, slots, seq_lens, o_s, lse_s, a_s, b_s, ko, koc, vo, voc,
        sm, math.log(2.0 / delta), rad_extra, layer, k0, k1, byp_rel, byp_abs,
        q.stride(0), q.stride(1), kc.stride(0), ks.stride(0), vc.stride(0), vs.stride(0), slots.stride(0),
        ko.stride(0), ko.stride(1) if nok else 0, vo.stride(0), vo.stride(1) if nov else 0,
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=gqa, NUM_SPLITS=ns, CERT=cert, CERT_B=cert and cert_b, AHEAD=ahead, PAGE=page, K_DITHER=k.dithered,
        NOK=nok, NOV=nov, num_warps=1, **gen,
    )
