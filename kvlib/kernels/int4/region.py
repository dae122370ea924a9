"""The KV4 decode kernel: one aligned block step, the main-region split, the fused split merge, and the launch body.

:func:`_kv4_decode_kernel` is what :func:`kvlib.kernels.int4.launch.kv4_main_decode` launches: programs
``sp < SPLITS`` take split ``sp`` of a request's INT4 range (:func:`_main_region`, or :func:`_main_region_t` for
``k_mode="trans"``), an optional extra program the KV4-RL side buffer
(:func:`kvlib.kernels.int4.protected._protected_region`), and with ``FUSE`` the last program of each
(request, kv head) merges the states (:func:`_last_merges`). The design is described in
:mod:`kvlib.kernels.int4.decode`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvlib.kernels.int4.protected import _protected_region
from kvlib.kernels.int4.tl_helpers import (
    LN2_C,
    V_UNSUB,
    _edge_mask,
    _edges,
    _keep,
    _ld,
    _load_scales,
    _nibbles_i8,
    _plane_f16,
    _plane_i8,
    _pool_scales,
    _scalar_load,
    _tile_scales,
    _tma_rows,
    _tma_scales,
)
from kvlib.kernels.tl.merge import merge_weights


@triton.jit
def _main_step(
    n0, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
    m_i, l_i, acc0, acc1, acc2, acc3, acc_m,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, INT_PV: tl.constexpr, KMODE: tl.constexpr,
    TILE_SUMS: tl.constexpr, SCALE32: tl.constexpr, EVEN: tl.constexpr, FAST: tl.constexpr,
    TMA: tl.constexpr = False, bh=0, MASKED: tl.constexpr = 1,
    PAGE: tl.constexpr = 0, h=0, BTb=0, HKV: tl.constexpr = 1, TILES: tl.constexpr = False,
):  # fmt: skip
    """One aligned block of BLOCK_N positions ``[n0, n0 + BLOCK_N)``: QK, online softmax, PV.

    Loads are masked only by ``offs < N`` (in-bounds memory: with ``N`` a multiple of 16 the masks are
    constant over 16 positions, so every load, the fp16 scales included, is wide enough for the
    software pipeliner's asynchronous copies); positions outside ``[start, end)`` are removed from the
    scores (``-inf``) and their scales zeroed (padding may hold any bits). ``l_i``/``acc_m`` are
    per-row sums, or with ``TILE_SUMS`` per-element tiles reduced once after the loop (fewer
    cross-warp reductions per block). ``KMODE`` picks how the key codes meet the INT8 query (see
    :class:`KV4KernelConfig`); V codes are read as int16 words (four codes, channels ``4i..4i+3``) and
    dequantised per plane in the dot-operand layout, so no 8-bit tile is transposed byte by byte.
    ``TMA`` (bytes mode, fp16 PV): the code tiles and scales arrive through TMA descriptors (row
    ``bh`` of ``[B*Hkv, N, ...]`` views) instead of per-thread addresses.

    ``PAGE > 0`` (bytes mode, fp16 PV; :mod:`kvlib.kernels.int4.paged`): the pool ``KCb, KSb, KOb, VWb, VSb, VOb``
    (``[num_blocks, PAGE, HKV, ...]``) is read through the block table's row ``BTb`` for kv head ``h``. TILES
    (``PAGE % BLOCK_N == 0``, ``"paged-tiles"``): the tile lies inside one page, so one table entry gives every row
    (``row0 + i * HKV``: the contiguous addressing with a row stride of ``HKV`` rows); otherwise (``"paged-rows"``)
    each row looks up its page. Only the page-table load of the rows path is masked (``MASKED == 1``, an edge
    block): a position outside ``[start, end)`` reads page 0 (in bounds); in the tiles path an edge tile's page is
    the one holding its valid positions, whose other slots are in bounds too. Either way such positions get score
    ``-inf`` and value scales 0 by select, so whatever bits they hold never reach the output.
    """
    half = tl.arange(0, HALF)
    QV: tl.constexpr = HALF // 2
    if PAGE:
        qv = tl.arange(0, QV)
        PAIR: tl.constexpr = HKV % 2 == 0
    offs = n0 + tl.arange(0, BLOCK_N)
    if PAGE == 0:
        inb = offs < N
    valid = (offs >= start) & (offs < end)
    if PAGE:
        if TILES:
            # one table entry; scalar bases (64-bit math once per tile) plus loop-invariant 32-bit row offsets, as
            # the contiguous kernel addresses its rows (here HKV rows apart)
            page = _scalar_load(BTb + n0 // PAGE)
            r0 = (page.to(tl.int64) * PAGE + n0 % PAGE) * HKV + h  # the tile's first (page, slot, kv head) row
            i = tl.arange(0, BLOCK_N) * HKV
            ks = _tile_scales(KSb + r0, i, h, PAIR, FAST)
            ko = _tile_scales(KOb + r0, i, h, PAIR, FAST)
            vs = _keep(_tile_scales(VSb + r0, i, h, PAIR, FAST), valid, 0.0, MASKED)
            vo = _keep(_tile_scales(VOb + r0, i, h, PAIR, FAST), valid, 0.0, MASKED)
            kc_ptr = KCb + r0 * HALF + i[:, None] * HALF + half[None, :]
            vw_ptr = VWb + r0 * QV + i[:, None] * QV + qv[None, :]
        else:
            if MASKED == 1:
                page = tl.load(BTb + offs // PAGE, mask=valid, other=0)
            else:
                page = tl.load(BTb + offs // PAGE)
            # (page, slot, kv head) in the pool: the page's 64-bit base plus a 32-bit in-page offset, which with
            # BLOCK_N % PAGE == 0 (powers of two) is the same every tile
            row = page.to(tl.int64) * (PAGE * HKV) + ((tl.arange(0, BLOCK_N) + n0 % PAGE) % PAGE * HKV + h)
            ks = _pool_scales(KSb, row, h, PAIR, FAST)
            ko = _pool_scales(KOb, row, h, PAIR, FAST)
            vs = _keep(_pool_scales(VSb, row, h, PAIR, FAST), valid, 0.0, MASKED)
            vo = _keep(_pool_scales(VOb, row, h, PAIR, FAST), valid, 0.0, MASKED)
            kc_ptr = KCb + row[:, None] * HALF + half[None, :]
            vw_ptr = VWb + row[:, None] * QV + qv[None, :]
    elif TMA:
        ks = _tma_scales(KSb, bh, n0, BLOCK_N)
        ko = _tma_scales(KOb, bh, n0, BLOCK_N)
        vs = _keep(_tma_scales(VSb, bh, n0, BLOCK_N), valid, 0.0, MASKED)
        vo = _keep(_tma_scales(VOb, bh, n0, BLOCK_N), valid, 0.0, MASKED)
    else:
        ks = _load_scales(KSb, n0, N, BLOCK_N, SCALE32, EVEN)
        ko = _load_scales(KOb, n0, N, BLOCK_N, SCALE32, EVEN)
        vs = _keep(_load_scales(VSb, n0, N, BLOCK_N, SCALE32, EVEN), valid, 0.0, MASKED)
        vo = _keep(_load_scales(VOb, n0, N, BLOCK_N, SCALE32, EVEN), valid, 0.0, MASKED)
    if KMODE == 0:  # int16 words, four planes of channels 4i+J: q @ plane^T, K = d/4 each
        QUARTER: tl.constexpr = HALF // 2
        quarter = tl.arange(0, QUARTER)
        kw = tl.trans(_ld(KWb + offs[:, None] * QUARTER + quarter[None, :], inb[:, None], EVEN))
        s_int = tl.dot(q0, _plane_i8(kw, 0, FAST))
        s_int = tl.dot(q1, _plane_i8(kw, 1, FAST), s_int, out_dtype=tl.int32)
        s_int = tl.dot(q2, _plane_i8(kw, 2, FAST), s_int, out_dtype=tl.int32)
        s_int = tl.dot(q3, _plane_i8(kw, 3, FAST), s_int, out_dtype=tl.int32)
        s = s_int.to(tl.float32) * (a_q[:, None] * ks[None, :]) + c_q[:, None] * ko[None, :]
    else:  # bytes, even/odd channels: q @ codes^T
        if PAGE:
            kct = tl.trans(tl.load(kc_ptr))
        elif TMA:
            kct = tl.trans(_tma_rows(KCb, bh, n0, BLOCK_N, HALF))
        else:
            kct = tl.trans(_ld(KCb + offs[:, None] * HALF + half[None, :], inb[:, None], EVEN))
        s_int = tl.dot(q0, _nibbles_i8(kct, False, FAST))
        s_int = tl.dot(q1, _nibbles_i8(kct, True, FAST), s_int, out_dtype=tl.int32)
        if q0.shape[0] != m_i.shape[0]:  # q zero-padded to 16 rows: fold the zero rows away (exact)
            s_int = tl.sum(tl.reshape(s_int, [q0.shape[0] // m_i.shape[0], m_i.shape[0], BLOCK_N]), axis=0)
        s = s_int.to(tl.float32) * (a_q[:, None] * ks[None, :]) + c_q[:, None] * ko[None, :]
    s = _keep(s, valid[None, :], float("-inf"), MASKED)  # [GP, BLOCK_N], log2 units
    if MASKED == 2:
        s, vs, vo = _edge_mask(s, vs, vo, offs, n0, start, end, BLOCK_N, 1)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    # vo is folded in with a zero weight only so that its load feeds a dot: the software pipeliner
    # turns only such loads into asynchronous copies (vs and vo are finite here, so this is exact)
    pv = p * (vs + 0.0 * vo)[None, :]
    if INT_PV:
        vc = _ld(VCb + offs[:, None] * HALF + half[None, :], inb[:, None], EVEN)
        sc = tl.max(pv, axis=1) / 127.0
        sc = tl.where(sc > 0, sc, 1.0)
        pq = (pv / sc[:, None] + 0.5).to(tl.int8)
        acc0 = acc0 * alpha[:, None] + tl.dot(pq, _nibbles_i8(vc, False, FAST)).to(tl.float32) * sc[:, None]
        acc1 = acc1 * alpha[:, None] + tl.dot(pq, _nibbles_i8(vc, True, FAST)).to(tl.float32) * sc[:, None]
        pm = p * vo[None, :]
    else:
        # int16 words of four codes (channels 4i..4i+3); plane J is channel 4i+J as the subnormal fp16
        # c 2^-24 (exact)
        if PAGE:
            vw = tl.load(vw_ptr)
        elif TMA:
            qv = tl.arange(0, QV)
            vw = _tma_rows(VWb, bh, n0, BLOCK_N, QV)
        else:
            qv = tl.arange(0, QV)
            vw = _ld(VWb + offs[:, None] * QV + qv[None, :], inb[:, None], EVEN)
        p16 = pv.to(tl.float16)
        acc0 = tl.dot(p16, _plane_f16(vw, 0, FAST), acc0 * alpha[:, None])
        acc1 = tl.dot(p16, _plane_f16(vw, 1, FAST), acc1 * alpha[:, None])
        acc2 = tl.dot(p16, _plane_f16(vw, 2, FAST), acc2 * alpha[:, None])
        acc3 = tl.dot(p16, _plane_f16(vw, 3, FAST), acc3 * alpha[:, None])
        pm = p * vo[None, :]  # acc holds sum p16 c 2^-24 (scaled back after the loop)
    if TILE_SUMS:
        l_i = l_i * alpha[:, None] + p
        acc_m = acc_m * alpha[:, None] + pm
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc_m = acc_m * alpha + tl.sum(pm, axis=1)
    return m_new, l_i, acc0, acc1, acc2, acc3, acc_m


@triton.jit
def _main_region(
    b, h, sp, Q8, QH, QW, QS, QSUM, KC, KW, KS, KO, VC, VW, VS, VO, START, END, OUT, LSE, sm_scale_log2, N,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS, NS, INT_PV: tl.constexpr, KMODE: tl.constexpr,
    TILE_SUMS: tl.constexpr, SCALE32: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr,
    QPAD: tl.constexpr = True, TMA: tl.constexpr = False, PIPE_EDGES: tl.constexpr = False,
    BT=0, PAGE: tl.constexpr = 0, TILES: tl.constexpr = False,
):  # fmt: skip
    """Split ``sp`` of the INT4 range ``[start_b, end_b)``: whole aligned blocks ``blo..bhi``, state to slot ``sp``.

    QPAD: the bytes-mode QK operand has 16 query rows (zeros past the group), folded back after the dot.
    ``PAGE > 0``: the paged pool of :mod:`kvlib.kernels.int4.paged` (bytes mode, fp16 PV), read through the block
    table ``BT [B, N]`` (``N`` pages per request; TILES: see :func:`_main_step`).
    """
    HALF: tl.constexpr = D // 2
    HQ: tl.constexpr = HKV * G
    start = _scalar_load(START + b).to(tl.int32)  # (the reduction widens; positions fit 32 bits)
    # interior blocks load unmasked; a paged range ends within the table
    end = tl.maximum(tl.minimum(_scalar_load(END + b).to(tl.int32), N * PAGE if PAGE else N), start)
    first = start // BLOCK_N
    nblk = tl.where(end > start, tl.cdiv(end, BLOCK_N) - first, 0)
    bps = tl.cdiv(nblk, SPLITS)
    blo = first + sp * bps
    bhi = tl.minimum(blo + bps, first + nblk)

    rows = tl.arange(0, GP)
    row_ok = rows < G
    half = tl.arange(0, HALF)
    qrow = (b * HQ + h * G + rows).to(tl.int64)
    # q is read as whole words and split into bytes in registers, so the loop-invariant dot operand
    # lands in shared memory row-major (the layout the tensor-core operand loads want)
    if KMODE == 0:
        QUARTER: tl.constexpr = HALF // 2
        qw = tl.load(QW + qrow[:, None] * QUARTER + tl.arange(0, QUARTER)[None, :], mask=row_ok[:, None], other=0)
        q0 = qw.to(tl.int8)  # [GP, d/4], channels 4i + J
        q1 = (qw >> 8).to(tl.int8)
        q2 = (qw >> 16).to(tl.int8)
        q3 = (qw >> 24).to(tl.int8)
    else:
        rq = tl.arange(0, 16 if QPAD else GP)
        qrq = (b * HQ + h * G + rq).to(tl.int64)
        qh = tl.load(QH + qrq[:, None] * HALF + half[None, :], mask=(rq < G)[:, None], other=0)
        q0 = qh.to(tl.int8)  # [GP or 16, HALF], even channels
        q1 = (qh >> 8).to(tl.int8)
        q2 = q0
        q3 = q1
    a_q = tl.load(QS + qrow, mask=row_ok, other=0.0) * sm_scale_log2
    c_q = tl.load(QSUM + qrow, mask=row_ok, other=0.0) * sm_scale_log2

    if PAGE:  # the pool itself, and this request's row of the block table
        BTb = BT + b.to(tl.int64) * N
        bh = 0
    else:
        BTb = BT
        bh = b * HKV + h
    if PAGE or TMA:  # TMA: descriptors over [B*Hkv, N, ...]: the row index replaces the base pointer
        KCb, KWb, VCb, VWb, KSb, KOb, VSb, VOb = KC, KW, VC, VW, KS, KO, VS, VO
    else:
        kv_row0 = bh.to(tl.int64) * N
        KCb = KC + kv_row0 * HALF
        KWb = KW + kv_row0 * (HALF // 2)
        VCb = VC + kv_row0 * HALF
        VWb = VW + kv_row0 * (HALF // 2)
        KSb = KS + kv_row0
        KOb = KO + kv_row0
        VSb = VS + kv_row0
        VOb = VO + kv_row0
    m_i = tl.full([GP], float("-inf"), tl.float32)
    if TILE_SUMS:
        l_i = tl.zeros([GP, BLOCK_N], tl.float32)
        acc_m = tl.zeros([GP, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([GP], tl.float32)
        acc_m = tl.zeros([GP], tl.float32)
    ACC_W: tl.constexpr = HALF if INT_PV else HALF // 2  # even/odd channels, or the four planes
    acc0 = tl.zeros([GP, ACC_W], tl.float32)
    acc1 = tl.zeros([GP, ACC_W], tl.float32)
    acc2 = tl.zeros([GP, ACC_W], tl.float32)
    acc3 = tl.zeros([GP, ACC_W], tl.float32)
    # interior blocks run unmasked (no position masks, no load masks: they lie inside [start, end) and so
    # inside N); the split's partial head and tail blocks run the masked step. PIPE_EDGES: every block runs
    # the masked step inside the pipelined loop instead (no edge block outside the software pipeline)
    if PIPE_EDGES:
        head, i_lo, i_hi, tail = -1, blo, bhi, -1
    else:
        head, i_lo, i_hi, tail = _edges(start, end, blo, bhi, BLOCK_N)
    FAST: tl.constexpr = not INTERP
    LOOP_EVEN: tl.constexpr = EVEN if PIPE_EDGES else True
    LOOP_MASK: tl.constexpr = 2 if PIPE_EDGES else 0
    if head >= 0:
        m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step(
            head * BLOCK_N, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, INT_PV, KMODE, TILE_SUMS, SCALE32, EVEN, FAST,
            TMA, bh, 1, PAGE, h, BTb, HKV, TILES,
        )  # fmt: skip
    if INTERP:  # the CPU interpreter cannot take tensor loop bounds in range(); a while loop is equivalent
        n0 = i_lo * BLOCK_N
        while n0 < i_hi * BLOCK_N:
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step(
                n0, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, INT_PV, KMODE, TILE_SUMS, SCALE32, LOOP_EVEN,
                False, TMA, bh, LOOP_MASK, PAGE, h, BTb, HKV, TILES,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(i_lo * BLOCK_N, i_hi * BLOCK_N, BLOCK_N):
            n0 = tl.multiple_of(n0, BLOCK_N)
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step(
                n0, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, INT_PV, KMODE, TILE_SUMS, SCALE32, LOOP_EVEN,
                True, TMA, bh, LOOP_MASK, PAGE, h, BTb, HKV, TILES,
            )  # fmt: skip
    if tail >= 0:
        m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step(
            tail * BLOCK_N, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, INT_PV, KMODE, TILE_SUMS, SCALE32, EVEN, FAST,
            TMA, bh, 1, PAGE, h, BTb, HKV, TILES,
        )  # fmt: skip
    if TILE_SUMS:
        l_i = tl.sum(l_i, axis=1)
        acc_m = tl.sum(acc_m, axis=1)

    nonempty = l_i > 0
    inv = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    orow = qrow * NS + sp
    obase = OUT + orow[:, None] * D
    if INT_PV:
        tl.store(obase + 2 * half[None, :], (acc0 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
        tl.store(obase + 2 * half[None, :] + 1, (acc1 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
    else:
        qc = 4 * tl.arange(0, HALF // 2)[None, :]
        # the planes were c 2^-24
        acc0, acc1, acc2, acc3 = acc0 * V_UNSUB, acc1 * V_UNSUB, acc2 * V_UNSUB, acc3 * V_UNSUB
        tl.store(obase + qc, (acc0 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
        tl.store(obase + qc + 1, (acc1 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
        tl.store(obase + qc + 2, (acc2 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
        tl.store(obase + qc + 3, (acc3 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    tl.store(LSE + orow, lse, mask=row_ok)


@triton.jit
def _main_step_t(
    n0, start, end, N, KCb, KSb, KOb, VWb, VSb, VOb, q0, q1, a_q, c_q,
    m_i, l_i, acc0, acc1, acc2, acc3, acc_m,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, TILE_SUMS: tl.constexpr, SCALE32: tl.constexpr,
    EVEN: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr = False, bh=0, MASKED: tl.constexpr = 1,
):  # fmt: skip
    """:func:`_main_step` transposed (``k_mode="trans"``): ``s^T = codes @ q^T`` and
    ``o^T += planes^T @ p^T``, so the code tiles are the A operands and the few query rows sit in the
    N dimension (no replicated A fragments when the GQA group is below 16)."""
    half = tl.arange(0, HALF)
    QV: tl.constexpr = HALF // 2
    qv = tl.arange(0, QV)
    offs = n0 + tl.arange(0, BLOCK_N)
    inb = offs < N
    valid = (offs >= start) & (offs < end)
    if TMA:
        ks = _tma_scales(KSb, bh, n0, BLOCK_N)
        ko = _tma_scales(KOb, bh, n0, BLOCK_N)
        vs = _keep(_tma_scales(VSb, bh, n0, BLOCK_N), valid, 0.0, MASKED)
        vo = _keep(_tma_scales(VOb, bh, n0, BLOCK_N), valid, 0.0, MASKED)
        kc = _tma_rows(KCb, bh, n0, BLOCK_N, HALF)
    else:
        ks = _load_scales(KSb, n0, N, BLOCK_N, SCALE32, EVEN)
        ko = _load_scales(KOb, n0, N, BLOCK_N, SCALE32, EVEN)
        vs = _keep(_load_scales(VSb, n0, N, BLOCK_N, SCALE32, EVEN), valid, 0.0, MASKED)
        vo = _keep(_load_scales(VOb, n0, N, BLOCK_N, SCALE32, EVEN), valid, 0.0, MASKED)
        kc = _ld(KCb + offs[:, None] * HALF + half[None, :], inb[:, None], EVEN)
    s_int = tl.dot(_nibbles_i8(kc, False, FAST), q0)
    s_int = tl.dot(_nibbles_i8(kc, True, FAST), q1, s_int, out_dtype=tl.int32)  # [BLOCK_N, GP]
    s = s_int.to(tl.float32) * (ks[:, None] * a_q[None, :]) + ko[:, None] * c_q[None, :]
    s = _keep(s, valid[:, None], float("-inf"), MASKED)
    if MASKED == 2:
        s, vs, vo = _edge_mask(s, vs, vo, offs, n0, start, end, BLOCK_N, 0)
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    p16 = (p * (vs + 0.0 * vo)[:, None]).to(tl.float16)  # vo: see _main_step
    if TMA:
        vwt = tl.trans(_tma_rows(VWb, bh, n0, BLOCK_N, QV))  # [QV, BLOCK_N]
    else:
        vwt = tl.trans(_ld(VWb + offs[:, None] * QV + qv[None, :], inb[:, None], EVEN))
    acc0 = tl.dot(_plane_f16(vwt, 0, FAST), p16, acc0 * alpha[None, :])  # [QV, GP]
    acc1 = tl.dot(_plane_f16(vwt, 1, FAST), p16, acc1 * alpha[None, :])
    acc2 = tl.dot(_plane_f16(vwt, 2, FAST), p16, acc2 * alpha[None, :])
    acc3 = tl.dot(_plane_f16(vwt, 3, FAST), p16, acc3 * alpha[None, :])
    pm = p * vo[:, None]
    if TILE_SUMS:
        l_i = l_i * alpha[None, :] + p
        acc_m = acc_m * alpha[None, :] + pm
    else:
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc_m = acc_m * alpha + tl.sum(pm, axis=0)
    return m_new, l_i, acc0, acc1, acc2, acc3, acc_m


@triton.jit
def _main_region_t(
    b, h, sp, Q8, QS, QSUM, KC, KS, KO, VW, VS, VO, START, END, OUT, LSE, sm_scale_log2, N,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS, NS, TILE_SUMS: tl.constexpr, SCALE32: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr,
    TMA: tl.constexpr = False, PIPE_EDGES: tl.constexpr = False,
):  # fmt: skip
    """:func:`_main_region` with the transposed step (fp16 PV only)."""
    HALF: tl.constexpr = D // 2
    QV: tl.constexpr = HALF // 2
    HQ: tl.constexpr = HKV * G
    start = _scalar_load(START + b).to(tl.int32)
    end = tl.maximum(tl.minimum(_scalar_load(END + b).to(tl.int32), N), start)  # interior blocks load unmasked
    first = start // BLOCK_N
    nblk = tl.where(end > start, tl.cdiv(end, BLOCK_N) - first, 0)
    bps = tl.cdiv(nblk, SPLITS)
    blo = first + sp * bps
    bhi = tl.minimum(blo + bps, first + nblk)
    rows = tl.arange(0, GP)
    row_ok = rows < G
    half = tl.arange(0, HALF)
    qrow = (b * HQ + h * G + rows).to(tl.int64)
    q0 = tl.load(Q8 + qrow[None, :] * D + 2 * half[:, None], mask=row_ok[None, :], other=0)  # [HALF, GP]
    q1 = tl.load(Q8 + qrow[None, :] * D + 2 * half[:, None] + 1, mask=row_ok[None, :], other=0)
    a_q = tl.load(QS + qrow, mask=row_ok, other=0.0) * sm_scale_log2
    c_q = tl.load(QSUM + qrow, mask=row_ok, other=0.0) * sm_scale_log2
    bh = b * HKV + h
    if TMA:
        KCb, VWb, KSb, KOb, VSb, VOb = KC, VW, KS, KO, VS, VO
    else:
        kv_row0 = bh.to(tl.int64) * N
        KCb = KC + kv_row0 * HALF
        VWb = VW + kv_row0 * QV
        KSb = KS + kv_row0
        KOb = KO + kv_row0
        VSb = VS + kv_row0
        VOb = VO + kv_row0
    m_i = tl.full([GP], float("-inf"), tl.float32)
    if TILE_SUMS:
        l_i = tl.zeros([BLOCK_N, GP], tl.float32)
        acc_m = tl.zeros([BLOCK_N, GP], tl.float32)
    else:
        l_i = tl.zeros([GP], tl.float32)
        acc_m = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([QV, GP], tl.float32)
    acc1 = tl.zeros([QV, GP], tl.float32)
    acc2 = tl.zeros([QV, GP], tl.float32)
    acc3 = tl.zeros([QV, GP], tl.float32)
    if PIPE_EDGES:  # see _main_region
        head, i_lo, i_hi, tail = -1, blo, bhi, -1
    else:
        head, i_lo, i_hi, tail = _edges(start, end, blo, bhi, BLOCK_N)
    FAST: tl.constexpr = not INTERP
    LOOP_EVEN: tl.constexpr = EVEN if PIPE_EDGES else True
    LOOP_MASK: tl.constexpr = 2 if PIPE_EDGES else 0
    if head >= 0:
        m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step_t(
            head * BLOCK_N, start, end, N, KCb, KSb, KOb, VWb, VSb, VOb, q0, q1, a_q, c_q,
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, TILE_SUMS, SCALE32, EVEN, FAST, TMA, bh, 1,
        )  # fmt: skip
    if INTERP:
        n0 = i_lo * BLOCK_N
        while n0 < i_hi * BLOCK_N:
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step_t(
                n0, start, end, N, KCb, KSb, KOb, VWb, VSb, VOb, q0, q1, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, TILE_SUMS, SCALE32, LOOP_EVEN, False, TMA, bh,
                LOOP_MASK,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(i_lo * BLOCK_N, i_hi * BLOCK_N, BLOCK_N):
            n0 = tl.multiple_of(n0, BLOCK_N)
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step_t(
                n0, start, end, N, KCb, KSb, KOb, VWb, VSb, VOb, q0, q1, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, TILE_SUMS, SCALE32, LOOP_EVEN, True, TMA, bh,
                LOOP_MASK,
            )  # fmt: skip
    if tail >= 0:
        m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step_t(
            tail * BLOCK_N, start, end, N, KCb, KSb, KOb, VWb, VSb, VOb, q0, q1, a_q, c_q,
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, TILE_SUMS, SCALE32, EVEN, FAST, TMA, bh, 1,
        )  # fmt: skip
    if TILE_SUMS:
        l_i = tl.sum(l_i, axis=0)
        acc_m = tl.sum(acc_m, axis=0)
    nonempty = l_i > 0
    inv = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    orow = qrow * NS + sp
    obase = OUT + orow[None, :] * D + 4 * tl.arange(0, QV)[:, None]  # [QV, GP]
    # the planes were c 2^-24
    acc0, acc1, acc2, acc3 = acc0 * V_UNSUB, acc1 * V_UNSUB, acc2 * V_UNSUB, acc3 * V_UNSUB
    tl.store(obase, (acc0 + acc_m[None, :]) * inv[None, :], mask=row_ok[None, :])
    tl.store(obase + 1, (acc1 + acc_m[None, :]) * inv[None, :], mask=row_ok[None, :])
    tl.store(obase + 2, (acc2 + acc_m[None, :]) * inv[None, :], mask=row_ok[None, :])
    tl.store(obase + 3, (acc3 + acc_m[None, :]) * inv[None, :], mask=row_ok[None, :])
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    tl.store(LSE + orow, lse, mask=row_ok)


@triton.jit
def _region(
    b, h, sp, Q8, QH, QW, QS, QSUM, KC, KW, KS, KO, VC, VW, VS, VO, START, END, OUT, LSE, sm_scale_log2, N,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS, NS, INT_PV: tl.constexpr, KMODE: tl.constexpr,
    TILE_SUMS: tl.constexpr, SCALE32: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr,
    TMA: tl.constexpr = False, PIPE_EDGES: tl.constexpr = False,
):  # fmt: skip
    if KMODE == 2:
        _main_region_t(b, h, sp, Q8, QS, QSUM, KC, KS, KO, VW, VS, VO, START, END, OUT, LSE, sm_scale_log2, N,
                       HKV, G, GP, D, BLOCK_N, SPLITS, NS, TILE_SUMS, SCALE32, EVEN, INTERP, TMA, PIPE_EDGES)
    else:
        _main_region(b, h, sp, Q8, QH, QW, QS, QSUM, KC, KW, KS, KO, VC, VW, VS, VO, START, END, OUT, LSE,
                     sm_scale_log2, N, HKV, G, GP, D, BLOCK_N, SPLITS, NS, INT_PV, KMODE, TILE_SUMS, SCALE32, EVEN,
                     INTERP, True, TMA, PIPE_EDGES)


@triton.jit
def _last_merges(b, h, CNT, OUT, LSE, OFIN, LSEFIN, NS, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                 D: tl.constexpr, NS_P: tl.constexpr):
    """The fused split merge: every program of a (request, kv head) counts itself in ``CNT[b, h]`` after its
    state is stored; the last to arrive merges the pair's ``NS`` states into ``OFIN``/``LSEFIN`` (with
    :func:`~kvlib.kernels.tl.merge.merge_weights`, as :func:`~kvlib.kernels.tl.merge.merge_splits` does) and resets
    the counter to zero for the next launch, so no second launch waits for this grid to drain."""
    tl.debug_barrier()  # every thread's state stores come before this program's arrival
    bh = b * HKV + h
    old = tl.atomic_add(CNT + bh, 1, sem="acq_rel", scope="gpu")  # release our states, acquire the others'
    if old == tl.num_programs(2) - 1:
        tl.atomic_xchg(CNT + bh, 0, sem="relaxed", scope="gpu")
        HQ: tl.constexpr = HKV * G
        rows = tl.arange(0, GP)
        row_ok = rows < G
        qrow = (b * HQ + h * G + rows).to(tl.int64)
        s = tl.arange(0, NS_P)
        ok = row_ok[:, None] & (s < NS)[None, :]
        slot = qrow[:, None] * NS + s[None, :]
        # .cg: read at L2, where the other programs' stores are (this SM's L1 is not coherent with them)
        lse_s = tl.load(LSE + slot, mask=ok, other=float("-inf"), cache_modifier=".cg")
        cols = tl.arange(0, D)
        o_s = tl.load(OUT + slot[:, :, None] * D + cols[None, None, :], mask=ok[:, :, None], other=0.0,
                      cache_modifier=".cg")
        w, den, lse, empty = merge_weights(lse_s, 1)
        o = tl.sum(tl.where(empty[:, :, None], 0.0, w[:, :, None] * o_s), 1) / den[:, None]
        tl.store(OFIN + qrow[:, None] * D + cols[None, :], o, mask=row_ok[:, None])
        tl.store(LSEFIN + qrow, lse, mask=row_ok)


@triton.jit(do_not_specialize=["C", "SPLITS"])  # one binary for every split count
def _kv4_decode_kernel(
    Q8, QH, QW, QS, QSUM,
    KC, KW, KS, KO, VC, VW, VS, VO, START, END,
    K8, K8S, V8, V8S, COUNT,
    OUT, LSE, CNT, OFIN, LSEFIN,
    sm_scale_log2, N, C, SPLITS,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, INT_PV: tl.constexpr, KMODE: tl.constexpr,
    TILE_SUMS: tl.constexpr, SCALE32: tl.constexpr, EVEN: tl.constexpr, PROT: tl.constexpr,
    BLOCK_P: tl.constexpr, INTERP: tl.constexpr, TMA: tl.constexpr = False,
    PDL: tl.constexpr = False, PIPE_EDGES: tl.constexpr = False, FUSE: tl.constexpr = False,
    NS_P: tl.constexpr = 1,
):  # fmt: skip
    """Grid ``(B, Hkv, SPLITS + PROT)``: programs ``sp < SPLITS`` take split ``sp`` of the INT4 region;
    with ``PROT`` the last program of each (request, kv head) takes the INT8 protected region, so
    KV4-RL costs one launch like KV4 and its states meet in the same split merge. PDL (programmatic
    dependent launch): this kernel may start while the query preparation finishes, so it waits for it
    first, and lets the split merge after it launch early. FUSE: the last program of each pair merges its
    states into ``OFIN``/``LSEFIN`` (:func:`_last_merges`; ``NS_P``: the state count rounded up to a power of
    two), so no merge launch follows."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    NS = SPLITS + PROT
    if PROT:
        if sp == SPLITS:
            _protected_region(b, h, Q8, QS, K8, K8S, V8, V8S, COUNT, OUT, LSE, sm_scale_log2, C, SPLITS, NS,
                              HKV, G, GP, D, BLOCK_P, INTERP)
        else:
            _region(b, h, sp, Q8, QH, QW, QS, QSUM, KC, KW, KS, KO, VC, VW, VS, VO, START, END, OUT, LSE,
                         sm_scale_log2, N, HKV, G, GP, D, BLOCK_N, SPLITS, NS, INT_PV, KMODE, TILE_SUMS,
                         SCALE32, EVEN, INTERP, TMA, PIPE_EDGES)
    else:
        _region(b, h, sp, Q8, QH, QW, QS, QSUM, KC, KW, KS, KO, VC, VW, VS, VO, START, END, OUT, LSE,
                     sm_scale_log2, N, HKV, G, GP, D, BLOCK_N, SPLITS, NS, INT_PV, KMODE, TILE_SUMS, SCALE32, EVEN,
                     INTERP, TMA, PIPE_EDGES)
    if FUSE:
        _last_merges(b, h, CNT, OUT, LSE, OFIN, LSEFIN, NS, HKV, G, GP, D, NS_P)
