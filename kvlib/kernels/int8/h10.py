"""Certified INT8 decode over the half-word dither layouts: the streaming kernel (``impl="h10"``).

Same contract as :func:`kvlib.kernels.int8.decode.decode_stage1` (split-KV stage 1; stage 2 is
:func:`kvlib.kernels.tl.merge.merge_splits`), for pools whose keys carry the ``h10`` dither layout
(:mod:`kvlib.core.philox`: eight 10-bit dithers per Philox call) or the ``h8`` one (sixteen 8-bit dithers per
call; the constexpr ``H8``). What makes it cheaper per element than the ``w24`` kernels, following the
spec's performance facts (``../shared/spec/witcert-math.md``):

* each Philox call is computed once per (position, 8 channels; h8: 16 channels) and its four words go to
  the four scale groups (word ``i`` is group ``i`` when ``d = 4 G``), so no word is shuffled between threads;
* the dither enters the tensor-core dot exactly: ``-xi = -(1 + (v >> 6) 2^-10) + (1.5 - 2^-11)``,
  the first term built as fp16 bits ``0xBC00 | (v >> 6)`` (one shift and one ``lop3`` per two
  channels), the constant folded into ``(1.5 - 2^-11) sum_c q_c`` once per query (h8:
  ``-xi = -(4 + b 2^-8) + (4.5 - 2^-9)``, fp16 bits ``0xC4 | b`` from one ``prmt`` per two channels);
* int8 codes become exact fp16 from their bits, never through integer-to-float conversions (a
  quarter-rate pipe on Hopper): key bytes permuted under ``0x64`` (``0x64 | (c ^ 0x80)`` = 1152 + c),
  value bytes sign-extended plus ``0x6480``, then one packed fp16 subtract of 1152 per two codes;
* operands are swapped: the streamed tiles are the tensor-core A operand and the GQA group the N
  dimension, so no query row is padded or replicated;
* the key scale is applied to the group's dot result and the value scale to the probabilities
  (``sum_t p_t s_t c_t = (p s) . c``), so neither side dequantises per element.

Scores per group ``g``: ``t_g = q_hi.c + q_lo.c + q_hi.(-m) + (1.5 - 2^-11) sum q_hi`` (``q_lo`` only
for fp32 queries); ``z = sm sum_g s_g t_g``, kept in base 2 (``sm log2 e``) so every exponential is one
``ex2``; the radius's variance is one exact tf32 dot per tile (``Int8KernelConfig.var_dot``). What the query rounding
leaves (``r2 = q - hi - lo`` against the codes, ``r1 = q - hi`` against the dither, ``|xi| <= 1/2``)
enters the radius as a per-row Cauchy-Schwarz multiplier
(:func:`kvlib.kernels.int8.reference._query_residual_mult` ``"h10"``); the accumulation rounding and the
dither mean are :func:`kvlib.certify.bound.rounding_slack` ``"h10"`` with the pool's layout.

The fast integer paths are inline PTX (GPU only); under the CPU interpreter (``FAST=False``) the
same values are built with plain Triton arithmetic, so the interpreter test checks the algebra and
the GPU run checks the bit tricks (``kvlib.bench.witcert_decode`` compares against the reference).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlib.kernels.tl.cert import abs_up_fp16, split_fp16, union_radius
from kvlib.kernels.tl.merge import split_range
from kvlib.kernels.tl.paging import load_slots
from kvlib.kernels.tl.philox import counter_words, generator_constexprs

#: ``xi = m - (1.5 - 2^-11)`` with ``m = 1 + (v >> 6) 2^-10`` (see :func:`kvlib.core.philox.half_to_xi`)
XI_CONST: tl.constexpr = tl.constexpr(1.5 - 2.0**-11)
#: h8 layout: ``xi = m' - (4.5 - 2^-9)`` with ``m' = 4 + b 2^-8`` (see :func:`kvlib.core.philox.byte_to_xi`)
XI8_CONST: tl.constexpr = tl.constexpr(4.5 - 2.0**-9)
LOG2E_C: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2_C: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _ex2(x, FAST: tl.constexpr):
    """``2^x``. FAST: one ``ex2.approx.ftz.f32``. ``tl.exp`` is the same ``ex2.approx`` behind a multiply by
    ``log2 e`` and a two-instruction subnormal fix-up; the fix-up only changes results below 2^-126, which no sum
    here can see, and the kernel keeps its scores in base 2 so the multiply is folded into ``sm_scale``. 2-3%
    less time, with and without the certificate (B=8, S=32k and B=32, S=16k on the H200:
    dev/results/h10_probe7.json)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.exp2(x)


@triton.jit
def _codes_f16(c, FAST: tl.constexpr):
    """int8 codes as exact fp16. FAST: ``prmt`` the bytes ``c ^ 0x80`` under ``0x64`` (= 1152 + c),
    then one packed subtract per two codes."""
    if FAST:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, k; xor.b32 t, $2, 0x80808080; mov.b32 k, 0x64806480; "
            "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
            "sub.rn.f16x2 $0, $0, k; sub.rn.f16x2 $1, $1, k; }",
            "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4,
        )  # fmt: skip
    return c.to(tl.float16)


@triton.jit
def _words_f16(w):
    """int32 words of four int8 codes ``[R, C]`` -> exact fp16 ``[R, 4 C]`` in channel order.

    Integer-to-float conversions run at a quarter rate on Hopper, so the fp16 bits are built instead:
    the sign-extended byte plus ``0x6480`` is the fp16 ``1152 + c`` (``c in [-127, 127]``), and one
    packed fp16 subtract per two codes removes the 1152. The bytes are split with shifts and joined
    (not read as an int8 tile) so the compiler transposes 16-bit values (``ldmatrix.trans``), not bytes."""
    c0 = ((w << 24) >> 24) + 0x6480
    c1 = ((w << 16) >> 24) + 0x6480
    c2 = ((w << 8) >> 24) + 0x6480
    c3 = (w >> 24) + 0x6480
    x = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [..., i, j] = c_{2i + j}: channel 4 k + 2 i + j
    x = tl.reshape(x, (w.shape[0], 4 * w.shape[1])).to(tl.int16).to(tl.float16, bitcast=True)
    return x - 1152.0


@triton.jit
def _neg_m(w, FAST: tl.constexpr):
    """``-m`` as fp16 ``[R, 2 C]`` from Philox words ``[R, C]``: element ``2j + h`` is half ``h`` of word
    ``j``, ``m = 1 + (v >> 6) 2^-10`` (exact). FAST: the word joined with itself, then the fp16x2 bits
    ``0xBC00 | (v >> 6)`` of both halves from one shift and one ``lop3``, already packed as a pair."""
    ww = tl.reshape(tl.join(w, w), (w.shape[0], 2 * w.shape[1]))
    if FAST:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; shr.b32 t, $1, 6; lop3.b32 $0, t, 0x03FF03FF, 0xBC00BC00, 0xEA; }",
            "=r,r,r", [ww], dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip
    h = (tl.arange(0, 2 * w.shape[1]) % 2)[None, :].to(tl.uint32)
    v = ((ww >> (6 + 16 * h)) & 0x3FF).to(tl.float32)
    return (-(1.0 + v * 0.0009765625)).to(tl.float16)


@triton.jit
def _neg_m8(w, FAST: tl.constexpr):
    """``-m'`` as fp16 ``[R, 4 C]`` from Philox words ``[R, C]`` of the h8 layout: element ``4j + k`` is byte ``k``
    of word ``j``, ``m' = 4 + b 2^-8`` (exact: the byte is the low mantissa byte of an fp16 in [4, 5)). FAST:
    two ``prmt`` per word put the bytes under ``0xC4``, the fp16 bits of ``-(4 + b 2^-8)``, already packed as
    pairs: one instruction per two channels."""
    w2 = tl.join(w, w)
    ww = tl.reshape(tl.join(w2, w2), (w.shape[0], 4 * w.shape[1]))
    if FAST:
        return tl.inline_asm_elementwise(
            "{ prmt.b32 $0, $2, 0xC4C4C4C4, 0x4140; prmt.b32 $1, $2, 0xC4C4C4C4, 0x4342; }",
            "=r,=r,r,r,r,r", [ww], dtype=tl.float16, is_pure=True, pack=4,
        )  # fmt: skip
    k = (tl.arange(0, 4 * w.shape[1]) % 4)[None, :].to(tl.uint32)
    b = ((ww >> (8 * k)) & 0xFF).to(tl.float32)
    return (-(4.0 + b * 0.00390625)).to(tl.float16)


@triton.jit
def _scales_tile(S, slot, mask_n, kvh, s_n, s_h):
    """A tile's four fp16 scales per position, ``[BLOCK_N, 4]`` (one 8-byte load per position)."""
    return tl.load(S + slot[:, None] * s_n + kvh * s_h + tl.arange(0, 4)[None, :], mask=mask_n[:, None], other=0.0)


@triton.jit
def _split4(x):
    """``[BLOCK_N, 4]`` fp16 scales -> the four groups' fp32 ``[BLOCK_N]``."""
    a, b = tl.split(tl.reshape(x.to(tl.float32), (x.shape[0], 2, 2)))  # a: groups 0, 2; b: groups 1, 3
    s0, s2 = tl.split(a)
    s1, s3 = tl.split(b)
    return s0, s1, s2, s3


@triton.jit
def _tf32_hi(x):
    """``x`` with its low 13 mantissa bits cleared: a tf32 value, and ``x - _tf32_hi(x)`` is exact in fp32."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _s2_operand(ks):
    """The variance dot's A operand ``[BLOCK_N, 16]`` from the tile's fp16 scales ``[BLOCK_N, 4]``: columns
    ``4 g .. 4 g + 3`` are ``(a_g, b_g, a_g, b_g)`` with ``a_g + b_g = s_g^2`` exactly and both tf32 values
    (``s_g^2`` of an fp16 scale has at most 22 significant bits: 11 in each piece), so the tensor cores read it
    without rounding."""
    s = ks.to(tl.float32)
    s2 = s * s
    a = _tf32_hi(s2)
    b = s2 - a
    # join adds a trailing axis: [..., g, copy, piece] flattens to column 4 g + 2 copy + piece
    return tl.reshape(tl.join(tl.join(a, a), tl.join(b, b)), (ks.shape[0], 16))


@triton.jit
def _v_operand(v0, v1, v2, v3):
    """The variance dot's B operand ``[16, BH]``: rows ``4 g .. 4 g + 3`` are ``(hi, hi, lo, lo)`` of ``v_g`` with
    ``hi = _tf32_hi(v_g)`` and ``lo = v_g - hi`` (which the tensor cores truncate by at most ``2^-21 v_g``), so
    ``A @ B = sum_g (a_g + b_g) (hi_g + lo_g)``: every product exact in fp32."""
    r = tl.arange(0, 16)[:, None]
    g = r // 4
    v = tl.where(g == 0, v0[None, :], tl.where(g == 1, v1[None, :], tl.where(g == 2, v2[None, :], v3[None, :])))
    hi = _tf32_hi(v)
    return tl.where((r % 4) < 2, hi, v - hi)


@triton.jit
def _qT_group(Q_T, mask_h, koc, g: tl.constexpr, G: tl.constexpr, NOK: tl.constexpr, Q_SPLIT: tl.constexpr):
    """Transposed query operands of group ``g`` (outlier channels zeroed): hi/lo ``[G, BH]`` and per head
    ``sum q_hi``, ``sum q^2``, ``R'_g = sum |r2| + |r1| / 255`` (``[BH]``). (The three sums as one joined
    reduction was slower on the H200, also at long context: dev/results/h10_probe8.json)"""
    offs_c = tl.arange(0, G)
    qg = tl.load(Q_T + (g * G + offs_c)[:, None], mask=mask_h[None, :], other=0.0).to(tl.float32)
    if NOK > 0:
        qg = tl.where((tl.sum((g * G + offs_c[:, None] == koc[None, :]).to(tl.int32), 1) > 0)[:, None], 0.0, qg)
    q_hi = qg.to(tl.float16)
    r1 = qg - q_hi.to(tl.float32)
    if Q_SPLIT:
        q_lo = r1.to(tl.float16)
        r2 = r1 - q_lo.to(tl.float32)
    else:
        q_lo = q_hi  # unused
        r2 = r1
    q1 = tl.sum(q_hi.to(tl.float32), 0)
    q2 = tl.sum(qg * qg, 0)
    rr = tl.sum(tl.abs(r2) + tl.abs(r1) * (1.0 / 255.0), 0)
    return q_hi, q_lo, q1, q2, rr


@triton.jit
def _kT_group(KC, slot, mask_n, kvh, s_kc_n, s_kc_h, w, s_g, q_hi, q_lo, q1,
              g: tl.constexpr, G: tl.constexpr, Q_SPLIT: tl.constexpr, FAST: tl.constexpr,
              SKIP_DITHER: tl.constexpr, H8: tl.constexpr = False, K_DITHER: tl.constexpr = True):
    """Group ``g``'s scores ``s_g t_g`` transposed, ``[BLOCK_N, BH]`` (``K_DITHER=False``: RTN keys,
    ``s_g q.c``)."""
    offs_c = tl.arange(0, G)
    kc = tl.load(KC + slot[:, None] * s_kc_n + kvh * s_kc_h + g * G + offs_c[None, :], mask=mask_n[:, None], other=0)
    k16 = _codes_f16(kc, FAST)
    t = tl.dot(k16, q_hi)
    if Q_SPLIT:
        t = tl.dot(k16, q_lo, t)
    if not K_DITHER:
        return t * s_g[:, None]
    if not SKIP_DITHER:
        if H8:
            t = tl.dot(_neg_m8(w, FAST), q_hi, t)  # element 4j + k = channel g G + 4j + k
        else:
            t = tl.dot(_neg_m(w, FAST), q_hi, t)  # element 2j + h = channel g G + 2j + h
    return (t + (XI8_CONST if H8 else XI_CONST) * q1[None, :]) * s_g[:, None]


@triton.jit
def _vT_group(VC, slot, mask_n, kvh, s_vc_n, s_vc_h, vs, ppT, accT, alpha,
              g: tl.constexpr, G: tl.constexpr, PV_TERMS: tl.constexpr, FAST: tl.constexpr):
    """``acc_g^T alpha + c_g^T (1024 p s_g)^T`` ``[G, BH]``."""
    offs_w = tl.arange(0, G // 4)
    vw = tl.load(VC + slot[:, None] * s_vc_n + kvh * s_vc_h + g * (G // 4) + offs_w[None, :], mask=mask_n[:, None],
                 other=0)
    vT = tl.trans(_words_f16(vw))
    ps = ppT * vs[:, None]
    p_hi = ps.to(tl.float16)
    accT = accT * alpha[None, :]
    accT = tl.dot(vT, p_hi, accT)
    if PV_TERMS >= 2:
        accT = tl.dot(vT, (ps - p_hi.to(tl.float32)).to(tl.float16), accT)
    return accT


@triton.jit
def _slots(SLOTS, b, s_sl_b, offs_n, mask_n, PAGE: tl.constexpr = 0):
    """A tile's slot indices (int64; :func:`kvlib.kernels.tl.paging.load_slots`)."""
    if PAGE > 0:
        return load_slots(SLOTS + b * s_sl_b, offs_n, mask_n, PAGE)
    # the slot table inline, as before paging existed: the validated binaries stay instruction for instruction
    return tl.load(SLOTS + b * s_sl_b + offs_n, mask=mask_n, other=0).to(tl.int64)


@triton.jit
def _rat(rg, q2g):
    """``R'_g^2 / Q2_g`` (``inf`` where the group's query is 0 but its residual is not)."""
    return tl.where(q2g > 0, rg * rg / tl.where(q2g > 0, q2g, 1.0), tl.where(rg > 0, float("inf"), 0.0))


@triton.jit
def _storeT_group(o_base, s_os_h, heads, accT, sc, mask_h, voc, g: tl.constexpr, G: tl.constexpr):
    offs_c = tl.arange(0, G)
    keep = tl.sum(((g * G + offs_c)[:, None] == voc[None, :]).to(tl.int32), 1) == 0
    tl.store(o_base + heads[None, :] * s_os_h + (g * G + offs_c)[:, None], accT * sc[None, :],
             mask=mask_h[None, :] & keep[:, None])


# layer and seed are run-time values: a layer (or seed word) equal to 1 must not become a constexpr
@triton.jit(do_not_specialize=["layer", "seed_lo", "seed_hi"])
def _decode_int8_stage1_h10(
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
    CERT: tl.constexpr, CERT_B: tl.constexpr, Q_SPLIT: tl.constexpr, PV_TERMS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FAST: tl.constexpr, TILE_SUMS: tl.constexpr, SKIP_DITHER: tl.constexpr = False,
    WIDE_MUL: tl.constexpr = False, VAR_DOT: tl.constexpr = False,
    PV_DEQUANT: tl.constexpr = False, H8: tl.constexpr = False, PAGE: tl.constexpr = 0,
    K_DITHER: tl.constexpr = True, GEN: tl.constexpr = 0, N_ROUNDS: tl.constexpr = 10,
):
    """Stage 1 over the h10 layout (module docstring); ``D = 4 G``: Philox word ``i`` feeds group ``i``.
    ``K_DITHER=False``: RTN keys (``xi = 0``), no Philox and no dither dot (``CERT`` must be off).

    Operands are swapped ("swap AB"): the streamed tiles are the tensor-core A operand (16 positions
    or channels per fragment) and the GQA group the N dimension (8 heads fill an n8 fragment), so no
    query row is padded or replicated and the loop-invariant query is the small B operand; every
    score tile is ``[positions, heads]``."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    D8: tl.constexpr = D // 16 if H8 else D // 8  # Philox calls per position
    seq_len, start, end = split_range(SEQ, b, split, NUM_SPLITS)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    Q_T = Q + b * s_qb + heads[None, :] * s_qh  # [1, BH] row pointer; channels go down the rows
    koc = tl.zeros([1], dtype=tl.int32)
    if NOK > 0:
        offs_ok = tl.arange(0, NOK_P)
        mask_ok = offs_ok < NOK
        koc = tl.load(KOC + kvh * NOK + offs_ok, mask=mask_ok, other=-1).to(tl.int32)
        q_koT = tl.load(Q_T + koc[:, None], mask=mask_ok[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
        qo_hi, qo_lo = split_fp16(q_koT)
    qh0, ql0, q10, q20, rr0 = _qT_group(Q_T, mask_h, koc, 0, G, NOK, Q_SPLIT)
    qh1, ql1, q11, q21, rr1 = _qT_group(Q_T, mask_h, koc, 1, G, NOK, Q_SPLIT)
    qh2, ql2, q12, q22, rr2 = _qT_group(Q_T, mask_h, koc, 2, G, NOK, Q_SPLIT)
    qh3, ql3, q13, q23, rr3 = _qT_group(Q_T, mask_h, koc, 3, G, NOK, Q_SPLIT)
    if CERT:
        radm = union_radius(seq_len, log_2_over_delta, rad_extra)
        # (1 + 2^-8): the variance's fp32 sums of nonnegative terms (and the variance dot's truncated lo pieces,
        # 2^-21 relative) stay upper bounds, as in the tc kernel (kvlib.certify.bound.TC_RADIUS_INFLATE)
        var_c = sm_scale * sm_scale / 12.0 * (1.0 + 2.0**-8)
        rat = (_rat(rr0, q20) + _rat(rr1, q21)) + (_rat(rr2, q22) + _rat(rr3, q23))
        detm = (sm_scale * 127.5 * (1.0 + 2.0**-8)) * tl.sqrt(rat) / tl.sqrt(var_c)
        radm_h = (radm + detm * (1.0 + 2.0**-8)) * LOG2E_C  # radii in base-2 units, like the scores
        v0 = q20 * var_c
        v1 = q21 * var_c
        v2 = q22 * var_c
        v3 = q23 * var_c
        if VAR_DOT:
            vmat = _v_operand(v0, v1, v2, v3)
        if NOK > 0:
            q_ko_abs16 = abs_up_fp16(q_koT)
            q_ko_sum = tl.sum(tl.abs(q_koT), 0)
    voc = tl.full([1], -1, dtype=tl.int32)
    if NOV > 0:
        offs_ov = tl.arange(0, NOV_P)
        mask_ov = offs_ov < NOV
        voc = tl.load(VOC + kvh * NOV + offs_ov, mask=mask_ov, other=-1).to(tl.int32)
        acc_voT = tl.zeros([NOV_P, BLOCK_H], dtype=tl.float32)

    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    c3k = ((layer << 1) | 0).to(tl.uint32)
    c2 = kvh.to(tl.uint32)
    cj = tl.arange(0, D8).to(tl.uint32)[None, :]

    zs = sm_scale * LOG2E_C  # scores (and m_i) in base 2: every exponential is one ex2
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    # softmax and certificate sums kept per (position, head) and reduced once after the loop: a
    # per-tile sum over positions crosses warps (shared memory and a barrier), an FMA does not
    TR: tl.constexpr = BLOCK_N if TILE_SUMS else 1
    l_t = tl.zeros([TR, BLOCK_H], dtype=tl.float32)
    if CERT:
        a_t = tl.zeros([TR, BLOCK_H], dtype=tl.float32)
        if CERT_B:
            b_t = tl.zeros([TR, BLOCK_H], dtype=tl.float32)
    if PV_DEQUANT:
        acc0 = tl.zeros([D, BLOCK_H], dtype=tl.float32)
    else:
        acc0 = tl.zeros([G, BLOCK_H], dtype=tl.float32)
        acc1 = tl.zeros([G, BLOCK_H], dtype=tl.float32)
        acc2 = tl.zeros([G, BLOCK_H], dtype=tl.float32)
        acc3 = tl.zeros([G, BLOCK_H], dtype=tl.float32)
    # the slots and scales of tile i + 1 are loaded while tile i is worked on: they are plain loads (the
    # pipeliner leaves them synchronous), and every tile's key and value addresses and dot scales depend on them.
    # Bit-identical output, 4% less time at B=8, S=32k and B=32, S=16k on the H200 (dev/results/
    # h10_probe5.json; the same run found PV with the probabilities as the A operand slower, so it was removed)
    offs_x = start + tl.arange(0, BLOCK_N)
    mask_x = offs_x < end
    slot_x = _slots(SLOTS, b, s_sl_b, offs_x, mask_x, PAGE)
    ks_x = _scales_tile(KS, slot_x, mask_x, kvh, s_ks_n, s_ks_h)  # carried as loaded: [BLOCK_N, 4] fp16
    vs_x = _scales_tile(VS, slot_x, mask_x, kvh, s_vs_n, s_vs_h)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = slot_x
        s0, s1, s2, s3 = _split4(ks_x)
        vs_t = vs_x
        ks_t = ks_x
        vs0, vs1, vs2, vs3 = _split4(vs_x)
        offs_x = offs_n + BLOCK_N
        mask_x = offs_x < end  # all false on the last tile: nothing is read
        slot_x = _slots(SLOTS, b, s_sl_b, offs_x, mask_x, PAGE)
        ks_x = _scales_tile(KS, slot_x, mask_x, kvh, s_ks_n, s_ks_h)
        vs_x = _scales_tile(VS, slot_x, mask_x, kvh, s_vs_n, s_vs_h)
        if SKIP_DITHER or not K_DITHER:  # RTN keys: no dither (else timing only: never a result)
            w0 = slot.to(tl.uint32)[:, None] + cj
            w1 = w0
            w2 = w0
            w3 = w0
        else:
            cs = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, D8], dtype=tl.uint32)
            # GEN/N_ROUNDS: the generator (Int8KernelConfig.generator); WIDE: one mul.wide per Philox product
            w0, w1, w2, w3 = counter_words(cs, cj + tl.zeros_like(cs), c2 + tl.zeros_like(cs),
                                           c3k + tl.zeros_like(cs), k0, k1, GEN, N_ROUNDS, WIDE_MUL and FAST)
        qk = (_kT_group(KC, slot, mask_n, kvh, s_kc_n, s_kc_h, w0, s0, qh0, ql0, q10, 0, G, Q_SPLIT, FAST,
                        SKIP_DITHER, H8, K_DITHER)
              + _kT_group(KC, slot, mask_n, kvh, s_kc_n, s_kc_h, w1, s1, qh1, ql1, q11, 1, G, Q_SPLIT, FAST,
                          SKIP_DITHER, H8, K_DITHER))
        qk += (_kT_group(KC, slot, mask_n, kvh, s_kc_n, s_kc_h, w2, s2, qh2, ql2, q12, 2, G, Q_SPLIT, FAST,
                         SKIP_DITHER, H8, K_DITHER)
               + _kT_group(KC, slot, mask_n, kvh, s_kc_n, s_kc_h, w3, s3, qh3, ql3, q13, 3, G, Q_SPLIT, FAST,
                           SKIP_DITHER, H8, K_DITHER))
        if NOK > 0:
            ko = tl.load(KO + slot[:, None] * s_ko_n + kvh * s_ko_h + offs_ok[None, :],
                         mask=mask_n[:, None] & mask_ok[None, :], other=0.0)
            ko16 = ko.to(tl.float16)
            qk = tl.dot(ko16, qo_hi, qk)
            qk = tl.dot(ko16, qo_lo, qk)
        qk = tl.where(mask_n[:, None], qk * zs, float("-inf"))  # [BLOCK_N, BH]

        m_new = tl.maximum(m_i, tl.max(qk, 0))
        alpha = _ex2(m_i - m_new, FAST)
        p = _ex2(qk - m_new[None, :], FAST)
        if TILE_SUMS:
            l_t = l_t * alpha[None, :] + p
        else:
            l_t = l_t * alpha[None, :] + tl.sum(p, 0)[None, :]
        m_i = m_new
        if CERT:
            if VAR_DOT:  # one 16-deep tf32 dot of s^2 (two exact pieces) with the per-head v_g (hi + lo)
                var = tl.dot(_s2_operand(ks_t), vmat, input_precision="tf32")
            else:
                var = ((s0 * s0)[:, None] * v0[None, :] + (s1 * s1)[:, None] * v1[None, :]) + (
                    (s2 * s2)[:, None] * v2[None, :] + (s3 * s3)[:, None] * v3[None, :])
            u = tl.sqrt(var) * radm_h[None, :]
            if NOK > 0:
                byp = tl.dot(tl.abs(ko16), q_ko_abs16)
                u += zs * (byp * (byp_rel * (1.0 + 2.0**-8)) + q_ko_sum[None, :] * byp_abs)
            pa = p * _ex2(u, FAST)
            if TILE_SUMS:
                a_t = a_t * alpha[None, :] + pa
            else:
                a_t = a_t * alpha[None, :] + tl.sum(pa, 0)[None, :]
            if CERT_B:
                pb = p * _ex2(-u, FAST)
                if TILE_SUMS:
                    b_t = b_t * alpha[None, :] + pb
                else:
                    b_t = b_t * alpha[None, :] + tl.sum(pb, 0)[None, :]

        pp = p * 1024.0
        if PV_DEQUANT:
            vw = tl.load(VC + slot[:, None] * s_vc_n + kvh * s_vc_h + tl.arange(0, D // 4)[None, :],
                         mask=mask_n[:, None], other=0)
            vsc = tl.reshape(tl.broadcast_to(vs_t[:, :, None], (BLOCK_N, 4, G)), (BLOCK_N, D))
            vT = tl.trans(_words_f16(vw) * vsc)  # [D, BLOCK_N] fp16
            acc0 = tl.dot(vT, pp.to(tl.float16), acc0 * alpha[None, :])
        else:
            acc0 = _vT_group(VC, slot, mask_n, kvh, s_vc_n, s_vc_h, vs0, pp, acc0, alpha, 0, G, PV_TERMS, FAST)
            acc1 = _vT_group(VC, slot, mask_n, kvh, s_vc_n, s_vc_h, vs1, pp, acc1, alpha, 1, G, PV_TERMS, FAST)
            acc2 = _vT_group(VC, slot, mask_n, kvh, s_vc_n, s_vc_h, vs2, pp, acc2, alpha, 2, G, PV_TERMS, FAST)
            acc3 = _vT_group(VC, slot, mask_n, kvh, s_vc_n, s_vc_h, vs3, pp, acc3, alpha, 3, G, PV_TERMS, FAST)
        if NOV > 0:
            vo = tl.load(VO + slot[:, None] * s_vo_n + kvh * s_vo_h + offs_ov[None, :],
                         mask=mask_n[:, None] & mask_ov[None, :], other=0.0).to(tl.float32)
            acc_voT = acc_voT * alpha[None, :] + tl.sum(vo[:, :, None] * p[:, None, :], 0)

    l_i = tl.sum(l_t, 0)
    if CERT:
        a_i = tl.sum(a_t, 0)
        if CERT_B:
            b_i = tl.sum(b_t, 0)
    nonempty = l_i != 0.0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    o_base = O_S + b * s_os_b + split * s_os_s
    sc = inv_l * (1.0 / 1024.0)
    if PV_DEQUANT:
        _storeT_group(o_base, s_os_h, heads, acc0, sc, mask_h, voc, 0, D)
    else:
        _storeT_group(o_base, s_os_h, heads, acc0, sc, mask_h, voc, 0, G)
        _storeT_group(o_base, s_os_h, heads, acc1, sc, mask_h, voc, 1, G)
        _storeT_group(o_base, s_os_h, heads, acc2, sc, mask_h, voc, 2, G)
        _storeT_group(o_base, s_os_h, heads, acc3, sc, mask_h, voc, 3, G)
    if NOV > 0:
        tl.store(o_base + heads[None, :] * s_os_h + voc[:, None], acc_voT * inv_l[None, :],
                 mask=mask_ov[:, None] & mask_h[None, :])
    l_off = b * s_ls_b + heads * s_ls_h + split
    tl.store(LSE_S + l_off, lse, mask=mask_h)
    if CERT:
        tl.store(A_S + l_off, a_i * inv_l, mask=mask_h)
        if CERT_B:
            tl.store(B_S + l_off, b_i * inv_l, mask=mask_h)


def check_h10_shape(d: int, group: int) -> None:
    """The kernel's shape rule: ``d = 4 G`` (Philox word ``i`` feeds group ``i``) and ``G in (16, 32, 64)`` (16: the
    tensor cores' smallest reduction depth; d = 64 as SmolLM2's heads)."""
    if group not in (16, 32, 64) or d != 4 * group:
        raise ValueError(f"impl='h10' needs d == 4 * group with group 16, 32 or 64 (d 64, 128 or 256), got d={d}, "
                         f"group={group}")


def launch_h10(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, *, sm: float, byp_rel: float, byp_abs: float,
               delta: float, rad_extra: float, layer: int, k0: int, k1: int, ns: int, cert: bool, cert_b: bool,
               config, page: int = 0) -> None:
    """Launch :func:`_decode_int8_stage1_h10` on validated inputs (called by ``decode_stage1``; ``page > 0``:
    ``slots`` is a block table of pages of ``page`` slots, :mod:`kvlib.kernels.tl.paging`) with the
    :class:`~kvlib.kernels.int8.config.Int8KernelConfig` ``config`` (block_n, warps, stages, pv_terms, tile_sums,
    wide_mul, var_dot, pv_dequant, maxnreg and the timing-only skip_philox)."""
    B, hq, d = q.shape
    n_slots, hkv, _ = k.codes.shape
    gqa = hq // hkv
    check_h10_shape(d, k.group)
    nok = k.outliers.shape[-1] if k.outliers is not None else 0
    nov = v.outliers.shape[-1] if v.outliers is not None else 0
    kc = k.codes.contiguous()
    vc = v.codes.contiguous().view(torch.int32)  # four codes per word (d % 4 == 0)
    ks = k.scales.contiguous()
    vs = v.scales.contiguous()
    ko = k.outliers.contiguous() if nok else ks
    koc = k.outlier_channels.contiguous() if nok else slots
    vo = v.outliers.contiguous() if nov else vs
    voc = v.outlier_channels.contiguous() if nov else slots
    _decode_int8_stage1_h10[(B, hkv, ns)](
        q, kc, ks, ko, koc, vc, vs, vo, voc, slots, seq_lens,
        o_s, lse_s, a_s, b_s,
        sm, byp_rel, byp_abs, math.log(2.0 / delta), rad_extra, layer, k0, k1,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), ko.stride(0), ko.stride(1) if nok else 0,
        vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1), vo.stride(0), vo.stride(1) if nov else 0,
        slots.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=gqa, BLOCK_H=triton.next_power_of_2(gqa), BLOCK_N=config.block_n, D=d, G=k.group,
        NOK=nok, NOK_P=max(16, triton.next_power_of_2(max(nok, 1))), NOV=nov,
        NOV_P=triton.next_power_of_2(max(nov, 1)),
        CERT=cert, CERT_B=cert and cert_b, Q_SPLIT=q.dtype == torch.float32, PV_TERMS=min(config.pv_terms, 2),
        NUM_SPLITS=ns, FAST=q.device.type == "cuda", TILE_SUMS=config.tile_sums, SKIP_DITHER=config.skip_philox,
        WIDE_MUL=config.wide_mul, VAR_DOT=config.var_dot, PV_DEQUANT=config.pv_dequant,
        H8=k.dither_layout == "h8", PAGE=page, K_DITHER=k.dithered, **generator_constexprs(config.generator),
        num_warps=config.warps("h10"),
        num_stages=config.stages("h10"),
        **({} if config.maxnreg is None else {"maxnreg": config.maxnreg}),
    )
