"""KV4 / KV4-RL decode over a vLLM-style paged pool: the INT4 region read through a block table.

Layout (one layer; the HF cache builds exactly these tensors):

- ``k_codes``, ``v_codes``: uint8 ``[num_blocks, block_size, H_kv, d // 2]``, two codes per byte, even channel
  low (:func:`kvlib.formats.kv4.pack_nibbles`); keys Hadamard-rotated before quantisation;
- ``k_scale``, ``k_off``, ``v_scale``, ``v_off``: fp16 ``[num_blocks, block_size, H_kv]`` (whole-head affine);
- ``block_table`` int32 ``[B, max_blocks]``: position ``p`` of request ``b`` lives in page
  ``block_table[b, p // block_size]``, slot ``p % block_size``; ``start``, ``end`` int32 ``[B]``: the INT4 region
  ``[start_b, end_b)`` in positions (entries of the table past ``end_b`` are never read);
- ``side`` (KV4-RL): the per-sequence :class:`~kvlib.kernels.int4.launch.SideBuffer`, as in the contiguous path.

The kernel is the contiguous one's bytes-mode step (INT8 query x INT4 codes for QK, fp16 ``p Δ_v`` x the codes as
subnormal fp16 for PV, the same split plan, protected program and fused merge) reading rows through the table, on
one of two paths (``KV4Launch.path``):

- ``"paged-tiles"`` when ``block_size % block_n == 0``: each ``block_n``-position tile lies inside one page, so
  one table entry per tile gives a scalar base, and the rows are addressed as the contiguous kernel addresses them
  (loop-invariant 32-bit row offsets, ``H_kv`` rows apart; the same 16-byte code copies);
- ``"paged-rows"`` otherwise (pages smaller than a tile, e.g. vLLM's 16): each row looks up its page (an int32
  table gather per position, cached), so any ``block_size`` works, at the cost of a 64-bit address per row.

The scales of consecutive positions are ``H_kv`` fp16 apart (no int32 position pairs as in the contiguous layout,
no TMA); with ``H_kv`` even both paths read each as the int32 word of its head pair and keep its half (one
``prmt``), so every load in the loop is an asynchronous copy of the software pipeliner. (The first version read
them as 16-bit gathers, which stay synchronous loads inside the loop, and took about 2x the contiguous kernel's
time at B=32, S=16k, Hq=28, Hkv=4, d=128, at block_size 16 and 256 alike, per-row lookups or not: the gathers are
the likely cause; ``dev/gpu/kern4.sh`` times the paths side by side.) Offline sm_90 loop counts per thread per
256-position tile at d=128, 8 query rows (``python -m dev.kv4_paged_vs_contiguous --sass``): contiguous 1,033;
paged-tiles 1,177 (the head-pair selection, 64 ``prmt``; twice the scale words, 16 more shared-memory reads;
64-bit bases); paged-rows 1,190 (plus the per-row table values from shared memory and a 64-bit address per row;
1,214 before the in-page offset was made loop-invariant); the 16-bit-gather version 1,137
(rows, page 16) and 1,186 (page 256), 8 of them synchronous global loads.

**Recommended page size for INT4 pools: a multiple of ``block_n``** (256 with
:data:`~kvlib.kernels.int4.config.DEFAULT_CONFIG`), so the kernel takes the tile path; with smaller pages pass a
``config`` whose ``block_n`` divides ``block_size`` (at least 16) or accept the per-row path. ``k_mode``,
``int_pv`` and ``tma`` other than the defaults are refused rather than ignored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvlib.core.checks import check_tensor
from kvlib.core.merge import merge_states
from kvlib.kernels.backend import pdl_supported, use_triton
from kvlib.kernels.int4.config import DEFAULT_CONFIG, KV4KernelConfig
from kvlib.kernels.int4.launch import (
    KV4Launch,
    SideBuffer,
    _check_kv,
    _check_side,
    _launch_options,
    _outputs,
    _side_args,
    _tile_rows,
    _words,
    default_num_splits,
)
from kvlib.kernels.int4.protected import _protected_region, protected_decode_ref
from kvlib.kernels.int4.query import QueryInt8
from kvlib.kernels.int4.reference import kv4_main_decode_ref
from kvlib.kernels.int4.region import _last_merges
from kvlib.kernels.int4.tl_helpers import LN2_C, LOG2E, V_UNSUB, _edges, _keep, _nibbles_i8, _plane_f16, _scalar_load


@triton.jit
def _half_f32(w, h, FAST: tl.constexpr):
    """fp16 half ``h & 1`` of int32 words ``w`` (heads ``h & ~1``, ``h | 1``) as fp32. FAST: one ``prmt`` moves the
    two bytes down (its selector built from ``h`` once per program), one ``cvt`` widens them."""
    if FAST:
        sel = tl.full(w.shape, 0x4410, tl.int32) + (h & 1) * 0x22  # bytes {0, 1} or {2, 3}, then zeros
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 l, u; prmt.b32 t, $1, 0, $2; mov.b32 {l, u}, t; cvt.f32.f16 $0, l; }",
            "=r,r,r", [w, sel], dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    bits = (w >> ((h & 1) * 16)) & 0xFFFF
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pool_scales(ptr, row, h, PAIR: tl.constexpr, FAST: tl.constexpr):
    """fp16 pool scales at element indices ``row`` (``(page * PAGE + slot) * HKV + h``) as fp32. PAIR (``HKV`` even):
    read the int32 word holding heads ``h & ~1`` and ``h | 1`` and keep this head's half, so each load is 32 bits
    wide (the software pipeliner makes asynchronous copies of those, not of 16-bit gathers, which stay synchronous
    loads in the loop)."""
    if PAIR:
        return _half_f32(tl.load(ptr.to(tl.pointer_type(tl.int32)) + (row >> 1)), h, FAST)
    return tl.load(ptr + row).to(tl.float32)


@triton.jit
def _tile_scales(base, i, h, PAIR: tl.constexpr, FAST: tl.constexpr):
    """fp16 pool scales at ``base + i`` (``base``: the tile's first row of this head) as fp32; PAIR: through the int32
    words of head pairs, as :func:`_pool_scales` (``base - (h & 1)`` is the pair's even, 4-byte aligned element)."""
    if PAIR:
        return _half_f32(tl.load((base - (h & 1)).to(tl.pointer_type(tl.int32)) + i // 2), h, FAST)
    return tl.load(base + i).to(tl.float32)


@triton.jit
def _paged_step(
    n0, start, end, h, BTb, KC, KS, KO, VW, VS, VO, q0, q1, a_q, c_q, m_i, l_i, acc0, acc1, acc2, acc3, acc_m,
    HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, TILE_SUMS: tl.constexpr,
    FAST: tl.constexpr, MASKED: tl.constexpr, TILES: tl.constexpr = False,
):  # fmt: skip
    """Positions ``[n0, n0 + BLOCK_N)`` through the block table ``BTb`` (this request's row): QK, online softmax,
    PV, as :func:`kvlib.kernels.int4.region._main_step` in bytes mode with fp16 PV.

    TILES (``PAGE % BLOCK_N == 0``, ``"paged-tiles"``): the tile lies inside one page, so one table entry gives
    every row (``row0 + i * HKV``: the contiguous kernel's addressing with a row stride of ``HKV`` rows); otherwise
    (``"paged-rows"``) each row looks up its page. Only the page-table load of the rows path is masked
    (``MASKED == 1``, an edge block): a position outside ``[start, end)`` reads page 0 (in bounds); in the tiles
    path an edge tile's page is the one holding its valid positions, whose other slots are in bounds too. Either
    way such positions get score ``-inf`` and value scales 0 by select, so whatever bits they hold never reach the
    output. Interior blocks (``MASKED == 0``) load unmasked.
    """
    half = tl.arange(0, HALF)
    QV: tl.constexpr = HALF // 2
    qv = tl.arange(0, QV)
    PAIR: tl.constexpr = HKV % 2 == 0
    offs = n0 + tl.arange(0, BLOCK_N)
    valid = (offs >= start) & (offs < end)
    if TILES:
        # one table entry; scalar bases (64-bit math once per tile) plus loop-invariant 32-bit row offsets, as the
        # contiguous kernel addresses its rows (here HKV rows apart)
        page = _scalar_load(BTb + n0 // PAGE)
        r0 = (page.to(tl.int64) * PAGE + n0 % PAGE) * HKV + h  # the tile's first (page, slot, kv head) row
        i = tl.arange(0, BLOCK_N) * HKV
        ks = _tile_scales(KS + r0, i, h, PAIR, FAST)
        ko = _tile_scales(KO + r0, i, h, PAIR, FAST)
        vs = _keep(_tile_scales(VS + r0, i, h, PAIR, FAST), valid, 0.0, MASKED)
        vo = _keep(_tile_scales(VO + r0, i, h, PAIR, FAST), valid, 0.0, MASKED)
        kc_ptr = KC + r0 * HALF + i[:, None] * HALF + half[None, :]
        vw_ptr = VW + r0 * QV + i[:, None] * QV + qv[None, :]
    else:
        if MASKED == 1:
            page = tl.load(BTb + offs // PAGE, mask=valid, other=0)
        else:
            page = tl.load(BTb + offs // PAGE)
        # (page, slot, kv head) in the pool: the page's 64-bit base plus a 32-bit in-page offset, which with
        # BLOCK_N % PAGE == 0 (powers of two) is the same every tile
        row = page.to(tl.int64) * (PAGE * HKV) + ((tl.arange(0, BLOCK_N) + n0 % PAGE) % PAGE * HKV + h)
        ks = _pool_scales(KS, row, h, PAIR, FAST)
        ko = _pool_scales(KO, row, h, PAIR, FAST)
        vs = _keep(_pool_scales(VS, row, h, PAIR, FAST), valid, 0.0, MASKED)
        vo = _keep(_pool_scales(VO, row, h, PAIR, FAST), valid, 0.0, MASKED)
        kc_ptr = KC + row[:, None] * HALF + half[None, :]
        vw_ptr = VW + row[:, None] * QV + qv[None, :]
    kct = tl.trans(tl.load(kc_ptr))
    s_int = tl.dot(q0, _nibbles_i8(kct, False, FAST))
    s_int = tl.dot(q1, _nibbles_i8(kct, True, FAST), s_int, out_dtype=tl.int32)
    if q0.shape[0] != m_i.shape[0]:  # q zero-padded to 16 rows: fold the zero rows away (exact)
        s_int = tl.sum(tl.reshape(s_int, [q0.shape[0] // m_i.shape[0], m_i.shape[0], BLOCK_N]), axis=0)
    s = s_int.to(tl.float32) * (a_q[:, None] * ks[None, :]) + c_q[:, None] * ko[None, :]
    s = _keep(s, valid[None, :], float("-inf"), MASKED)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    pv = p * (vs + 0.0 * vo)[None, :]  # vo feeds a dot so that its load is pipelined (see _main_step)
    vw = tl.load(vw_ptr)  # int16 words of four codes, channels 4i..4i+3
    p16 = pv.to(tl.float16)
    acc0 = tl.dot(p16, _plane_f16(vw, 0, FAST), acc0 * alpha[:, None])
    acc1 = tl.dot(p16, _plane_f16(vw, 1, FAST), acc1 * alpha[:, None])
    acc2 = tl.dot(p16, _plane_f16(vw, 2, FAST), acc2 * alpha[:, None])
    acc3 = tl.dot(p16, _plane_f16(vw, 3, FAST), acc3 * alpha[:, None])
    pm = p * vo[None, :]
    if TILE_SUMS:
        l_i = l_i * alpha[:, None] + p
        acc_m = acc_m * alpha[:, None] + pm
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc_m = acc_m * alpha + tl.sum(pm, axis=1)
    return m_new, l_i, acc0, acc1, acc2, acc3, acc_m


@triton.jit
def _paged_region(
    b, h, sp, QH, QS, QSUM, BT, KC, KS, KO, VW, VS, VO, START, END, OUT, LSE, sm_scale_log2, MAXB, SPLITS, NS,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, TILE_SUMS: tl.constexpr, INTERP: tl.constexpr, TILES: tl.constexpr = False,
):  # fmt: skip
    """Split ``sp`` of request ``b``'s INT4 range, as :func:`kvlib.kernels.int4.region._main_region` (aligned
    blocks, peeled partial edge blocks), reading the pool through the block table."""
    HALF: tl.constexpr = D // 2
    HQ: tl.constexpr = HKV * G
    start = _scalar_load(START + b).to(tl.int32)
    end = tl.maximum(tl.minimum(_scalar_load(END + b).to(tl.int32), MAXB * PAGE), start)  # within the table
    first = start // BLOCK_N
    nblk = tl.where(end > start, tl.cdiv(end, BLOCK_N) - first, 0)
    bps = tl.cdiv(nblk, SPLITS)
    blo = first + sp * bps
    bhi = tl.minimum(blo + bps, first + nblk)

    rows = tl.arange(0, GP)
    row_ok = rows < G
    half = tl.arange(0, HALF)
    qrow = (b * HQ + h * G + rows).to(tl.int64)
    rq = tl.arange(0, 16)  # the QK operand zero-padded to 16 rows, folded back after the dot (see _main_region)
    qrq = (b * HQ + h * G + rq).to(tl.int64)
    qh = tl.load(QH + qrq[:, None] * HALF + half[None, :], mask=(rq < G)[:, None], other=0)
    q0 = qh.to(tl.int8)  # even channels
    q1 = (qh >> 8).to(tl.int8)  # odd channels
    a_q = tl.load(QS + qrow, mask=row_ok, other=0.0) * sm_scale_log2
    c_q = tl.load(QSUM + qrow, mask=row_ok, other=0.0) * sm_scale_log2
    BTb = BT + b.to(tl.int64) * MAXB

    m_i = tl.full([GP], float("-inf"), tl.float32)
    if TILE_SUMS:
        l_i = tl.zeros([GP, BLOCK_N], tl.float32)
        acc_m = tl.zeros([GP, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([GP], tl.float32)
        acc_m = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([GP, HALF // 2], tl.float32)
    acc1 = tl.zeros([GP, HALF // 2], tl.float32)
    acc2 = tl.zeros([GP, HALF // 2], tl.float32)
    acc3 = tl.zeros([GP, HALF // 2], tl.float32)
    head, i_lo, i_hi, tail = _edges(start, end, blo, bhi, BLOCK_N)
    FAST: tl.constexpr = not INTERP
    if head >= 0:
        m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _paged_step(
            head * BLOCK_N, start, end, h, BTb, KC, KS, KO, VW, VS, VO, q0, q1, a_q, c_q,
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HKV, HALF, BLOCK_N, PAGE, TILE_SUMS, FAST, 1, TILES,
        )  # fmt: skip
    if INTERP:  # the CPU interpreter cannot take tensor loop bounds in range()
        n0 = i_lo * BLOCK_N
        while n0 < i_hi * BLOCK_N:
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _paged_step(
                n0, start, end, h, BTb, KC, KS, KO, VW, VS, VO, q0, q1, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HKV, HALF, BLOCK_N, PAGE, TILE_SUMS, False, 0, TILES,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(i_lo * BLOCK_N, i_hi * BLOCK_N, BLOCK_N):
            n0 = tl.multiple_of(n0, BLOCK_N)
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _paged_step(
                n0, start, end, h, BTb, KC, KS, KO, VW, VS, VO, q0, q1, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HKV, HALF, BLOCK_N, PAGE, TILE_SUMS, True, 0, TILES,
            )  # fmt: skip
    if tail >= 0:
        m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _paged_step(
            tail * BLOCK_N, start, end, h, BTb, KC, KS, KO, VW, VS, VO, q0, q1, a_q, c_q,
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HKV, HALF, BLOCK_N, PAGE, TILE_SUMS, FAST, 1, TILES,
        )  # fmt: skip
    if TILE_SUMS:
        l_i = tl.sum(l_i, axis=1)
        acc_m = tl.sum(acc_m, axis=1)

    nonempty = l_i > 0
    inv = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    orow = qrow * NS + sp
    obase = OUT + orow[:, None] * D
    qc = 4 * tl.arange(0, HALF // 2)[None, :]
    acc0, acc1, acc2, acc3 = acc0 * V_UNSUB, acc1 * V_UNSUB, acc2 * V_UNSUB, acc3 * V_UNSUB  # the planes were c 2^-24
    tl.store(obase + qc, (acc0 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
    tl.store(obase + qc + 1, (acc1 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
    tl.store(obase + qc + 2, (acc2 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
    tl.store(obase + qc + 3, (acc3 + acc_m[:, None]) * inv[:, None], mask=row_ok[:, None])
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    tl.store(LSE + orow, lse, mask=row_ok)


@triton.jit(do_not_specialize=["C", "SPLITS"])
def _kv4_paged_kernel(
    Q8, QH, QS, QSUM, BT, KC, KS, KO, VW, VS, VO, START, END,
    K8, K8S, V8, V8S, COUNT, OUT, LSE, CNT, OFIN, LSEFIN,
    sm_scale_log2, MAXB, C, SPLITS,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, TILE_SUMS: tl.constexpr, PROT: tl.constexpr, BLOCK_P: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr = False, FUSE: tl.constexpr = False, NS_P: tl.constexpr = 1,
    TILES: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(B, Hkv, SPLITS + PROT)``, as :func:`kvlib.kernels.int4.region._kv4_decode_kernel`: INT4 splits over
    the paged pool, the protected region as the last program of each pair, and with ``FUSE`` the merge."""
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
            _paged_region(b, h, sp, QH, QS, QSUM, BT, KC, KS, KO, VW, VS, VO, START, END, OUT, LSE, sm_scale_log2,
                          MAXB, SPLITS, NS, HKV, G, GP, D, BLOCK_N, PAGE, TILE_SUMS, INTERP, TILES)
    else:
        _paged_region(b, h, sp, QH, QS, QSUM, BT, KC, KS, KO, VW, VS, VO, START, END, OUT, LSE, sm_scale_log2,
                      MAXB, SPLITS, NS, HKV, G, GP, D, BLOCK_N, PAGE, TILE_SUMS, INTERP, TILES)
    if FUSE:
        _last_merges(b, h, CNT, OUT, LSE, OFIN, LSEFIN, NS, HKV, G, GP, D, NS_P)


def _check_paged(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, block_size,
                 side) -> tuple[int, int, int, int]:
    """Shapes of the paged layout; returns ``(hkv, max_blocks, side slots C, d)``."""
    check_tensor("qp.q8", qp.q8, ndim=3, dtype=torch.int8)
    b, hq, d = qp.q8.shape
    check_tensor("k_codes", k_codes, ndim=4, dtype=torch.uint8)
    nb, page, hkv, half = k_codes.shape
    if v_codes.shape != k_codes.shape or 2 * half != d:
        raise ValueError(f"k_codes/v_codes must both be [num_blocks, block_size, H_kv, d/2={d // 2}], got "
                         f"{tuple(k_codes.shape)} and {tuple(v_codes.shape)}")
    if not isinstance(block_size, int) or block_size != page:
        raise ValueError(f"block_size must be the pool's page size {page} (k_codes.shape[1]), got {block_size!r}")
    _check_kv(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, start, end, (nb, page, hkv))
    check_tensor("block_table", block_table, ndim=2, dtype=torch.int32)
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B={b}, max_blocks], got {tuple(block_table.shape)}")
    if hq % hkv or hq // hkv > 16:
        raise ValueError(f"query heads {hq} must be a multiple (at most 16x) of kv heads {hkv}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 (64 and 128 on the GPU), got {d}")
    c = _check_side(side, b, hkv, d) if side is not None else 0
    return hkv, block_table.shape[1], c, d


def _gather_pages(t: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Pool ``t [num_blocks, block_size, H_kv, ...]`` gathered per request into ``[B, H_kv, max_blocks *
    block_size, ...]`` (table entries outside ``[0, num_blocks)`` read page 0: such positions lie outside
    every region)."""
    idx = torch.where((block_table >= 0) & (block_table < t.shape[0]), block_table, 0).long()
    g = t[idx]  # [B, max_blocks, block_size, H_kv, ...]
    g = g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])
    return g.transpose(1, 2).contiguous()


def kv4_paged_decode_ref(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, *,
    block_size: int, side: SideBuffer | None = None, sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch reference: the pages gathered into the contiguous layout, then
    :func:`~kvlib.kernels.int4.reference.kv4_main_decode_ref` (merged with the side buffer's exact attention)."""
    _check_paged(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, block_size, side)
    d = qp.q8.shape[-1]
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    kc, ks, ko, vc, vs, vo = (_gather_pages(t, block_table) for t in (k_codes, k_scale, k_off, v_codes, v_scale, v_off))
    pos = torch.arange(kc.shape[2], device=kc.device)
    inside = ((pos[None, :] >= start[:, None].long()) & (pos[None, :] < end[:, None].long()))[:, None, :]
    # positions outside the region may hold any bits (NaN scales in a fresh page): zero them so that 0 x NaN
    # cannot reach the output (the kernel selects them away)
    ks, ko, vs, vo = (torch.where(inside, t, torch.zeros_like(t)) for t in (ks, ko, vs, vo))
    o, lse = kv4_main_decode_ref(qp, kc, ks, ko, vc, vs, vo, start, end, sm_scale)
    if side is None:
        return o, lse
    return merge_states(o, lse, *protected_decode_ref(qp, *side, sm_scale=sm_scale))


def plan_kv4_paged_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, *,
    block_size: int, side: SideBuffer | None = None, config: KV4KernelConfig | None = None,
    sm_scale: float | None = None, backend: str = "auto",
) -> KV4Launch:  # fmt: skip
    """The launch :func:`kv4_paged_decode` makes, planned but not run (a :class:`KV4Launch`, ``path="paged-rows"``)."""
    cfg = config or DEFAULT_CONFIG
    hkv, maxb, c, d = _check_paged(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end,
                                   block_size, side)
    if not use_triton(qp.q8, backend):
        raise ValueError("plan_kv4_paged_decode plans the Triton launch: it needs a CUDA tensor or TRITON_INTERPRET=1")
    for name, bad in (("k_mode", cfg.k_mode != "bytes"), ("int_pv", cfg.int_pv), ("tma", cfg.tma)):
        if bad:
            raise ValueError(f"the paged KV4 kernel reads bytes-mode keys with fp16 PV through per-row page lookups "
                             f"only; config.{name}={getattr(cfg, name)!r} is not supported there")
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes), ("k_scale", k_scale), ("k_off", k_off),
                    ("v_scale", v_scale), ("v_off", v_off), ("block_table", block_table)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    b, hq, _ = qp.q8.shape
    g = hq // hkv
    gp = _tile_rows(cfg, g, qp.q8.is_cuda, d)
    dev = qp.q8.device
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    splits = cfg.num_splits or default_num_splits(b, hkv, maxb * block_size, cfg.block_n, dev, cfg.ctas_per_sm,
                                                  cfg.overhead_blocks)
    prot = side is not None
    ns = splits + int(prot)
    q8 = qp.q8.contiguous()
    start32, end32 = start.to(torch.int32), end.to(torch.int32)
    k8, k8s, v8, v8s, cnt = _side_args(side, q8, k_scale, start32)
    pdl = cfg.pdl and pdl_supported(qp.q8)
    fuse, o_s, lse_s, counters, o, lse = _outputs(cfg, qp, b, hq, hkv, d, ns, gp, splits, start32)
    args = (q8, _words(q8, torch.int16), qp.scale, qp.qsum, block_table, k_codes, k_scale, k_off,
            _words(v_codes, torch.int16), v_scale, v_off, start32, end32, k8, k8s, v8, v8s, cnt,
            o_s, lse_s, counters, o, lse, sm_scale * LOG2E, maxb, max(c, 1), splits)
    tiles = block_size % cfg.block_n == 0  # every tile inside one page: one table entry per tile
    meta = dict(HKV=hkv, G=g, GP=gp, D=d, BLOCK_N=cfg.block_n, PAGE=block_size, TILE_SUMS=bool(cfg.tile_sums),
                TILES=tiles,
                PROT=prot, BLOCK_P=cfg.block_p, INTERP=not qp.q8.is_cuda, PDL=pdl, FUSE=fuse,
                NS_P=triton.next_power_of_2(ns) if fuse else 1, **_launch_options(cfg, pdl))
    return KV4Launch(path="paged-tiles" if tiles else "paged-rows", grid=(b, hkv, ns), splits=splits, states=ns,
                     k_mode="bytes", rows=gp,
                     tma=False, pipe_edges=False, fuse=fuse, pdl=pdl, backend=backend, o_s=o_s, lse_s=lse_s, o=o,
                     lse=lse, fn=_kv4_paged_kernel, args=args, meta=meta)


def kv4_paged_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, *,
    block_size: int, side: SideBuffer | None = None, config: KV4KernelConfig | None = None,
    sm_scale: float | None = None, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KV4 (and with ``side`` KV4-RL) decode of the prepared query over a paged pool; see the module docstring.

    Returns ``(o [B, Hq, d] fp32, lse [B, Hq] natural log)``; an empty range (and empty side buffer) gives
    ``lse = -inf``, ``o = 0``. On CPU without the interpreter (or ``backend="torch"``) the torch reference
    :func:`kv4_paged_decode_ref` runs; :func:`plan_kv4_paged_decode` gives the kernel launch as a record.
    """
    args = (qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end)
    if not use_triton(qp.q8, backend):
        return kv4_paged_decode_ref(*args, block_size=block_size, side=side, sm_scale=sm_scale)
    return plan_kv4_paged_decode(*args, block_size=block_size, side=side, config=config, sm_scale=sm_scale,
                                 backend=backend).run()
