"""Triton decode attention over the KV4 (INT4) main region, with its torch references beside it.

Layout (one layer, padded per request; position ``p`` of request ``b`` lives at ``[b, h, p]``):
``k_codes``/``v_codes`` uint8 ``[B, Hkv, N, d//2]`` (two codes per byte, even channel low),
``k_scale``/``k_off``/``v_scale``/``v_off`` fp16 ``[B, Hkv, N]`` (whole-head affine group).
Each request attends over its own position range ``[start_b, end_b)`` (ragged batches; KV4-RL's
main region excludes the protected positions).

QK is INT8 query x INT4 codes on the tensor cores, with the query scale, key scale and key offset
applied after the reduction: ``q̂·k̂ = s_q Δ_k (q8·c) + m_k (s_q Σ q8)``. PV is either dequantised
(fp16 ``p Δ_v`` x the codes as the exact subnormal fp16 ``c 2^-24``, whose bits are the code itself,
fp32 accumulate, scaled back by ``2^24`` after the loop; the default) or integer (``p Δ_v``
re-quantised to INT8 per block row, INT8 x INT4 codes, int32 accumulate); the offsets ``m_v`` enter
through one sum. (The magic number ``0x6400 | c = 1024 + c`` used before made the fp32 accumulator carry
about a thousand times the output's scale; its error grew with the positions a split accumulates,
``dev/results/kv4_split_accuracy.json``.)

Decode reads each byte once, so the kernel is a streaming kernel: it must keep enough loads in flight
and issue few instructions per byte (at 4 TB/s an H200 SM has ~570 cycles per 64 positions). Design:

* blocks are aligned to ``block_n`` in absolute positions and splits take whole blocks, so every
  load is unmasked or masked with a mask constant over 16 positions; the fp16 scales are read as
  int32 pairs; all loads then become the software pipeliner's asynchronous copies (``num_stages``);
* a split's interior blocks (wholly inside ``[start_b, end_b)``) run a step with no position or load
  masks in the pipelined loop; only its partial head and tail blocks run the masked step (17% fewer
  loop instructions at the default tile, sm_90 SASS);
* V codes are read as int16 words (four codes) and dequantised per nibble plane in the tensor-core
  operand layout (one ``lop3`` per two codes, operand loads by ``ldmatrix.trans``); K codes as
  bytes (even/odd nibbles), the query as int16/int32 words split in registers (row-major operands);
* query rows are the GQA group rounded to a power of two (not 16): the softmax arithmetic scales
  with the rows; the QK operand is zero-padded to 16 rows and folded back (exact) to avoid
  replicated tensor-core fragments;
* the softmax sums can be kept as per-element tiles reduced once after the loop (``tile_sums``);
* KV4-RL's protected region (INT8 side buffer) runs in the same launch as one extra split per
  (request, kv head), its state merged with the INT4 splits by the same merge, so KV4-RL costs
  the launches of KV4.

Split-KV partial states are combined by :func:`kvlib.kernels.tl.merge.merge_splits`, whose reference
is a fold of :func:`kvlib.core.merge.merge_states`, or, where the INT4 region has two or more splits, by the
last program of each pair inside the decode launch (``KV4KernelConfig.fuse_merge``, the same algebra).
Launch parameters live in :class:`KV4KernelConfig`
(tuned on the GPU by :mod:`dev.kv4_sweep`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvlib.core.checks import check_tensor
from kvlib.core.hadamard import hadamard, hadamard_matrix
from kvlib.kernels.backend import pdl_supported, use_triton
from kvlib.kernels.tl.merge import merge_splits, merge_weights

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LAST_KERNEL = None  # the last compiled main kernel (registers/spills are read off it in tuning)
#: probe only (timing, wrong results): launch the KV4-RL kernel without its protected programs
_PROBE_NO_PROT_PROGRAMS = False
LN2_C: tl.constexpr = tl.constexpr(LN2)  # the form a @triton.jit body may read
#: 2^24: the V planes enter the PV dot as the subnormal fp16 c 2^-24 (:func:`_plane_f16`)
V_UNSUB: tl.constexpr = tl.constexpr(16777216.0)


# ---------------------------------------------------------------------------------------------
# Query preparation: rotate by H and quantise to INT8 (shared by the main and protected paths)
# ---------------------------------------------------------------------------------------------


@dataclass
class QueryInt8:
    """INT8 query ``q8 [B, Hq, d]`` with per-row fp32 ``scale`` and ``qsum = scale * Σ q8`` (``[B, Hq]``)."""

    q8: torch.Tensor
    scale: torch.Tensor
    qsum: torch.Tensor
    #: ``[B * Hq]`` int32 zeros for the decode kernel's fused merge (:func:`prepare_query` zeroes them in its own
    #: launch; the decode kernel leaves them at zero, so a prepared query may be decoded again)
    arrivals: torch.Tensor | None = None


def prepare_query_ref(q: torch.Tensor, rotate: bool = True) -> QueryInt8:
    """Torch reference: ``hadamard`` (if ``rotate``), symmetric INT8 per row, ``floor(x/s + 1/2)``."""
    qf = hadamard(q.float()) if rotate else q.float()
    scale = qf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = torch.floor(qf / safe.unsqueeze(-1) + 0.5).clamp_(-127, 127).to(torch.int8)
    return QueryInt8(q8, scale, scale * q8.float().sum(-1))


@triton.jit
def _prep_query_kernel(Q, H, Q8, QS, QSUM, ARR, n_rows, D: tl.constexpr, R: tl.constexpr, ROTATE: tl.constexpr,
                       PIECES: tl.constexpr = 0, INTERP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Rotate and quantise ``R`` query rows. ``PIECES = 0``: one fp32 (IEEE, FMA) dot with the normalised
    Hadamard ``H``; ``PIECES = 1..3``: ``H`` is the +-1 Hadamard in bf16 (exact) and the rows enter
    tensor-core dots as 1-3 bf16 pieces (hi, mid, lo: exact for bf16 / fp16 / fp32 inputs, so only the fp32
    accumulation rounds), scaled by ``1/sqrt(D)`` after. PDL: let the decode kernel launch now (it waits
    for this kernel's stores before it reads the query). ``ARR``: the decode kernel's arrival counters, zeroed
    here (one per query row, at least one per kv head)."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    rok = rows < n_rows
    cols = tl.arange(0, D)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    q = tl.load(Q + offs, mask=rok[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        h = tl.load(H + cols[:, None] * D + cols[None, :])
        if PIECES == 0:
            q = tl.dot(q, h, input_precision="ieee")
        else:
            if INTERP:  # the CPU interpreter's bf16 dot is wrong: the same exact pieces in an fp32 dot
                h = h.to(tl.float32)
            hi = q.to(tl.bfloat16)
            acc = tl.dot(hi.to(tl.float32) if INTERP else hi, h)
            if PIECES > 1:
                r = q - hi.to(tl.float32)
                mid = r.to(tl.bfloat16)
                acc = tl.dot(mid.to(tl.float32) if INTERP else mid, h, acc)
                if PIECES > 2:
                    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
                    acc = tl.dot(lo.to(tl.float32) if INTERP else lo, h, acc)
            q = acc * (D**-0.5)
    amax = tl.max(tl.abs(q), axis=1)
    scale = amax / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    qi = tl.floor(tl.math.div_rn(q, safe[:, None]) + 0.5)  # IEEE division: the GPU's plain / is approximate
    qi = tl.minimum(tl.maximum(qi, -127.0), 127.0)
    tl.store(Q8 + offs, qi.to(tl.int8), mask=rok[:, None])
    tl.store(QS + rows, scale, mask=rok)
    tl.store(QSUM + rows, scale * tl.sum(qi, axis=1), mask=rok)
    tl.store(ARR + rows, tl.zeros([R], tl.int32), mask=rok)


@functools.lru_cache(maxsize=8)
def _hmat(d: int, device: str) -> torch.Tensor:
    return hadamard_matrix(d, torch.float32).to(device).contiguous()


@functools.lru_cache(maxsize=8)
def _hmat_pm1(d: int, device: str) -> torch.Tensor:
    """The unnormalised (+-1) Sylvester Hadamard in bf16: exact."""
    return (hadamard_matrix(d, torch.float64) * d**0.5).round().to(torch.bfloat16).to(device).contiguous()


#: bf16 pieces that hold a query element exactly
_PIECES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def prepare_query(q: torch.Tensor, rotate: bool = True, backend: str = "auto", precision: str = "mma",
                  pdl: bool = False) -> QueryInt8:
    """Rotate ``q [B, Hq, d]`` by the normalised Hadamard (keys are stored rotated) and quantise to INT8.

    ``precision`` (GPU): ``"mma"``: tensor-core dots of the exact bf16 pieces of ``q`` with the +-1
    Hadamard; ``"ieee"``: one fp32 FMA dot with the normalised Hadamard (slower). ``pdl`` (GPU): let a
    decode kernel launched with programmatic dependent launch start early (``KV4KernelConfig.pdl``; ignored
    before sm_90 and off the GPU)."""
    if precision not in ("mma", "ieee"):
        raise ValueError(f"precision must be 'mma' or 'ieee', got {precision!r}")
    check_tensor("q", q, ndim=3, floating=True)
    if not use_triton(q, backend):
        return prepare_query_ref(q, rotate)
    b, hq, d = q.shape
    qc = q.contiguous()
    q8 = torch.empty(b, hq, d, dtype=torch.int8, device=q.device)
    qs = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    qsum = torch.empty_like(qs)
    arrivals = torch.empty(b * hq, dtype=torch.int32, device=q.device)  # zeroed by the kernel (no memset launch)
    r = 16
    n = b * hq
    mma = precision == "mma" and q.dtype in _PIECES
    h = _hmat_pm1(d, str(q.device)) if mma else _hmat(d, str(q.device))
    _prep_query_kernel[(triton.cdiv(n, r),)](qc, h, q8, qs, qsum, arrivals, n, D=d, R=r, ROTATE=rotate,
                                             PIECES=_PIECES[q.dtype] if mma else 0, INTERP=not q.is_cuda,
                                             PDL=pdl and pdl_supported(q))
    return QueryInt8(q8, qs, qsum, arrivals)


# ---------------------------------------------------------------------------------------------
# Main-region kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _scalar_load(ptr):
    # a 0-d load that also stays 0-d under the CPU interpreter (which returns shape (1,) for ptr loads)
    return tl.sum(tl.load(ptr + tl.arange(0, 1)), axis=0)


@triton.jit
def _nibbles_i8(x, HIGH: tl.constexpr, FAST: tl.constexpr):
    """Low (or high) nibbles of a uint8 code tile as int8. FAST: one PTX op per 4 codes (GPU only)."""
    if FAST:
        if HIGH:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
                "=r,r", [x], dtype=tl.int8, is_pure=True, pack=4,
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            "and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [x], dtype=tl.int8, is_pure=True, pack=4
        )
    if HIGH:
        return (x >> 4).to(tl.int8)
    return (x & 15).to(tl.int8)


@triton.jit
def _plane_f16(x, J: tl.constexpr, FAST: tl.constexpr):
    """Nibble J (channel ``4i + J``) of int16 words holding four codes, as the exact subnormal fp16
    ``c 2^-24`` (its bits are the code itself; the tensor cores take subnormals exactly).

    FAST: one ``and`` (plus a shift for J > 0) per two codes. Unlike the magic number ``0x6400 | c``
    (``1024 + c``), this keeps the fp32 accumulator at the output's scale (``V_UNSUB`` after the loop)."""
    if FAST:
        if J == 0:
            return tl.inline_asm_elementwise("and.b32 $0, $1, 0x000F000F;", "=r,r", [x], dtype=tl.float16,
                                             is_pure=True, pack=2)
        elif J == 1:
            return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x000F000F; }",
                                             "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
        elif J == 2:
            return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 8; and.b32 $0, t, 0x000F000F; }",
                                             "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 12; and.b32 $0, t, 0x000F000F; }",
                                             "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    return ((x >> (4 * J)) & 15).to(tl.float16) * 5.960464477539063e-08  # 2^-24: exact in fp16 (subnormal)


@triton.jit
def _plane_i8(x, J: tl.constexpr, FAST: tl.constexpr):
    """Nibble J (channel ``4i + J``) of int16 words holding four codes, as int8. FAST: per four words,
    shift and mask two registers and gather the four low bytes with one ``prmt``."""
    if FAST:
        if J == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 a, b; and.b32 a, $1, 0x000F000F; and.b32 b, $2, 0x000F000F; prmt.b32 $0, a, b, 0x6420; }",
                "=r,r,r", [x], dtype=tl.int8, is_pure=True, pack=4,
            )  # fmt: skip
        if J == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 a, b; shr.b32 a, $1, 4; shr.b32 b, $2, 4; and.b32 a, a, 0x000F000F; "
                "and.b32 b, b, 0x000F000F; prmt.b32 $0, a, b, 0x6420; }",
                "=r,r,r", [x], dtype=tl.int8, is_pure=True, pack=4,
            )  # fmt: skip
        if J == 2:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 a, b; shr.b32 a, $1, 8; shr.b32 b, $2, 8; and.b32 a, a, 0x000F000F; "
                "and.b32 b, b, 0x000F000F; prmt.b32 $0, a, b, 0x6420; }",
                "=r,r,r", [x], dtype=tl.int8, is_pure=True, pack=4,
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; shr.b32 a, $1, 12; shr.b32 b, $2, 12; and.b32 a, a, 0x000F000F; "
            "and.b32 b, b, 0x000F000F; prmt.b32 $0, a, b, 0x6420; }",
            "=r,r,r", [x], dtype=tl.int8, is_pure=True, pack=4,
        )  # fmt: skip
    return ((x >> (4 * J)) & 15).to(tl.int8)


@triton.jit
def _ld(ptrs, mask, EVEN: tl.constexpr):
    """``tl.load(ptrs, mask, other=0)``, or unmasked when EVEN (every aligned block lies inside ``N``)."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _load_scales(ptr, n0, N, BLOCK_N: tl.constexpr, SCALE32: tl.constexpr, EVEN: tl.constexpr):
    """fp16 per-position scales of ``[n0, n0 + BLOCK_N)`` as fp32. SCALE32 (``N`` and ``n0`` even): read as
    int32 pairs, so each load is 32 bits wide whatever layout the compiler gives the vector (16-bit
    loads are not turned into asynchronous copies by the pipeliner)."""
    if SCALE32:
        offs2 = n0 // 2 + tl.arange(0, BLOCK_N // 2)
        w = _ld(ptr.to(tl.pointer_type(tl.int32)) + offs2, offs2 < N // 2, EVEN)
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        return tl.reshape(tl.join(lo, hi), [BLOCK_N]).to(tl.float32)
    offs = n0 + tl.arange(0, BLOCK_N)
    return _ld(ptr + offs, offs < N, EVEN).to(tl.float32)


@triton.jit
def _keep(x, valid, fill, MASKED: tl.constexpr):
    """``x`` where ``valid`` else ``fill`` in an edge block (``MASKED == 1``); ``x`` itself otherwise (no select)."""
    if MASKED == 1:
        return tl.where(valid, x, fill)
    return x


@triton.jit
def _edge_mask(s, vs, vo, offs, n0, start, end, BLOCK_N: tl.constexpr, POS_AXIS: tl.constexpr):
    """``MASKED == 2``: in a block that crosses ``start`` or ``end`` (one uniform branch per block), the scores
    of positions outside ``[start, end)`` become ``-inf`` and their value scales 0; interior blocks skip it."""
    if (n0 < start) | (n0 + BLOCK_N > end):
        ok = (offs - start).to(tl.uint32) < (end - start).to(tl.uint32)
        if POS_AXIS == 1:
            s = tl.where(ok[None, :], s, float("-inf"))
        else:
            s = tl.where(ok[:, None], s, float("-inf"))
        vs = tl.where(ok, vs, 0.0)
        vo = tl.where(ok, vo, 0.0)
    return s, vs, vo


@triton.jit
def _edges(start, end, blo, bhi, BLOCK_N: tl.constexpr):
    """Split ``[blo, bhi)`` of aligned blocks as ``(head, i_lo, i_hi, tail)``: interior blocks ``[i_lo, i_hi)``
    lie wholly inside ``[start, end)`` (no masks); ``head``/``tail`` are the partial edge blocks of the
    split (``-1`` when there is none). A block that is both is the head: then ``i_hi >= i_lo > blo = bhi - 1``,
    so it is not also the tail."""
    i_lo = tl.maximum(blo, tl.cdiv(start, BLOCK_N))
    i_hi = tl.maximum(tl.minimum(bhi, end // BLOCK_N), i_lo)
    head = tl.where(blo < tl.minimum(i_lo, bhi), blo, -1)
    tail = tl.where(bhi - 1 >= i_hi, bhi - 1, -1)
    return head, i_lo, i_hi, tail


@triton.jit
def _tma_scales(desc, bh, n0, BLOCK_N: tl.constexpr):
    """fp16 per-position scales of ``[n0, n0 + BLOCK_N)`` of row ``bh`` through a TMA descriptor, as fp32."""
    return tl.reshape(desc.load([bh, n0]), [BLOCK_N]).to(tl.float32)


@triton.jit
def _tma_rows(desc, bh, n0, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """Code rows ``[n0, n0 + BLOCK_N)`` (``W`` words each) of row ``bh`` through a TMA descriptor (past
    ``N`` the copy engine fills zeros)."""
    return tl.reshape(desc.load([bh, n0, 0]), [BLOCK_N, W])


@triton.jit
def _main_step(
    n0, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
    m_i, l_i, acc0, acc1, acc2, acc3, acc_m,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, INT_PV: tl.constexpr, KMODE: tl.constexpr,
    TILE_SUMS: tl.constexpr, SCALE32: tl.constexpr, EVEN: tl.constexpr, FAST: tl.constexpr,
    TMA: tl.constexpr = False, bh=0, MASKED: tl.constexpr = 1,
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
    """
    half = tl.arange(0, HALF)
    offs = n0 + tl.arange(0, BLOCK_N)
    inb = offs < N
    valid = (offs >= start) & (offs < end)
    if TMA:
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
        if TMA:
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
        QV: tl.constexpr = HALF // 2
        qv = tl.arange(0, QV)
        if TMA:
            vw = _tma_rows(VWb, bh, n0, BLOCK_N, QV)
        else:
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
):  # fmt: skip
    """Split ``sp`` of the INT4 range ``[start_b, end_b)``: whole aligned blocks ``blo..bhi``, state to slot ``sp``.

    QPAD: the bytes-mode QK operand has 16 query rows (zeros past the group), folded back after the dot.
    """
    HALF: tl.constexpr = D // 2
    HQ: tl.constexpr = HKV * G
    start = _scalar_load(START + b).to(tl.int32)  # (the reduction widens; positions fit 32 bits)
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

    bh = b * HKV + h
    if TMA:  # descriptors over [B*Hkv, N, ...]: the row index replaces the base pointer
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
            TMA, bh, 1,
        )  # fmt: skip
    if INTERP:  # the CPU interpreter cannot take tensor loop bounds in range(); a while loop is equivalent
        n0 = i_lo * BLOCK_N
        while n0 < i_hi * BLOCK_N:
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step(
                n0, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, INT_PV, KMODE, TILE_SUMS, SCALE32, LOOP_EVEN,
                False, TMA, bh, LOOP_MASK,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(i_lo * BLOCK_N, i_hi * BLOCK_N, BLOCK_N):
            n0 = tl.multiple_of(n0, BLOCK_N)
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step(
                n0, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
                m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, INT_PV, KMODE, TILE_SUMS, SCALE32, LOOP_EVEN,
                True, TMA, bh, LOOP_MASK,
            )  # fmt: skip
    if tail >= 0:
        m_i, l_i, acc0, acc1, acc2, acc3, acc_m = _main_step(
            tail * BLOCK_N, start, end, N, KCb, KWb, KSb, KOb, VCb, VWb, VSb, VOb, q0, q1, q2, q3, a_q, c_q,
            m_i, l_i, acc0, acc1, acc2, acc3, acc_m, HALF, BLOCK_N, INT_PV, KMODE, TILE_SUMS, SCALE32, EVEN, FAST,
            TMA, bh, 1,
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
def _protected_step(n0, cnt, slot0, q, a_q, K8, K8S, V8, V8S, m_i, l_i, acc, D: tl.constexpr, BLOCK_P: tl.constexpr,
                    INTERP: tl.constexpr):
    """Side slots ``[n0, n0 + BLOCK_P)`` (masked at ``cnt``): INT8 QK, online softmax, bf16 PV."""
    cols = tl.arange(0, D)
    offs = n0 + tl.arange(0, BLOCK_P)
    nm = offs < cnt
    slot = slot0 + offs
    k = tl.load(K8 + slot[:, None] * D + cols[None, :], mask=nm[:, None], other=0)
    ks = tl.load(K8S + slot, mask=nm, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * (a_q[:, None] * ks[None, :])
    s = tl.where(nm[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v8 = tl.load(V8 + slot[:, None] * D + cols[None, :], mask=nm[:, None], other=0)
    vs = tl.load(V8S + slot, mask=nm, other=0.0).to(tl.float32)
    v = (v8.to(tl.float32) * vs[:, None]).to(tl.bfloat16)
    if INTERP:  # the CPU interpreter's bf16 dot is wrong; same bf16 operands, fp32 dot
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16).to(tl.float32), v.to(tl.float32))
    else:
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def _protected_region(
    b, h, Q8, QS, K8, K8S, V8, V8S, COUNT, OUT, LSE, sm_scale_log2, C, orow_split,
    NS, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """The KV4-RL side slots ``0..count_b-1``: INT8 QK, bf16 PV (fp32 accumulate), state to slot ``orow_split``."""
    HQ: tl.constexpr = HKV * G
    # at least 16 query rows (zero rows beyond G, never stored): the GPU's int8/bf16 dots want M >= 16
    RP: tl.constexpr = GP if GP >= 16 else 16
    cnt = tl.minimum(_scalar_load(COUNT + b), C)
    rows = tl.arange(0, RP)
    row_ok = rows < G
    cols = tl.arange(0, D)
    qrow = (b * HQ + h * G + rows).to(tl.int64)
    q = tl.load(Q8 + qrow[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0)
    a_q = tl.load(QS + qrow, mask=row_ok, other=0.0) * sm_scale_log2
    slot0 = (b * HKV + h).to(tl.int64) * C
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, D], tl.float32)
    if INTERP:
        n0 = cnt * 0
        while n0 < cnt:
            m_i, l_i, acc = _protected_step(n0, cnt, slot0, q, a_q, K8, K8S, V8, V8S, m_i, l_i, acc, D, BLOCK_P, True)
            n0 += BLOCK_P
    else:
        for n0 in range(0, cnt, BLOCK_P):
            m_i, l_i, acc = _protected_step(n0, cnt, slot0, q, a_q, K8, K8S, V8, V8S, m_i, l_i, acc, D, BLOCK_P, False)
    nonempty = l_i > 0
    inv = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    orow = qrow * NS + orow_split
    tl.store(OUT + orow[:, None] * D + cols[None, :], acc * inv[:, None], mask=row_ok[:, None])
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    tl.store(LSE + orow, lse, mask=row_ok)


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


@dataclass(frozen=True)
class KV4KernelConfig:
    """Launch parameters of :func:`kv4_main_decode` (the sweep in :mod:`dev.kv4_sweep` tunes them).

    - ``block_n``: positions per loop step; ``num_warps``; ``num_stages``: software-pipelined
      asynchronous copies of the next blocks in flight.
    - ``num_splits``: split-KV programs per (request, kv head); ``None``: the wave model of
      :func:`default_num_splits` with ``ctas_per_sm`` programs resident per SM and a fixed cost per
      program of ``overhead_blocks`` position blocks (0: the earlier model, without it).
    - ``int_pv``: integer PV (INT8 probabilities x INT4 codes) instead of dequantised fp16 PV.
    - ``k_mode``: how QK reads the key codes: ``"bytes"`` uint8 even/odd nibbles (two INT8 dots of
      K = d/2), ``"planes"`` int16 words split into four nibble planes (four dots of K = d/4; needs
      d >= 128), ``"trans"`` bytes but transposed throughout (``s^T = codes @ q^T``,
      ``o^T += V^T @ p^T``: code tiles as A operands, query rows in N; fp16 PV only).
    - ``rows``: query rows per tile (``None``: the GQA group rounded up to a power of two, at least
      :data:`MIN_ROWS`; the tensor cores pad small tiles themselves, so fewer rows means less softmax
      arithmetic, but 8 rows timed at least as fast as 4 at GQA 4, ``dev/results/kv4_sweep_packed2.json``).
    - ``tile_sums``: per-element softmax-sum tiles (one reduction after the loop instead of two per block).
    - ``block_p``: side slots per step of the protected region; ``maxnreg``: register cap.
    - ``tma``: read the code tiles and scales through Hopper TMA descriptors (bulk asynchronous
      copies, no per-thread addresses; k_mode "bytes"/"trans" with fp16 PV, ``N`` a multiple of 8
      so every row stride is 16-byte aligned; otherwise the pointer loads are used).
    - KV4-RL's protected region is one extra program per (request, kv head). Six other layouts were
      timed on the H200 and removed, each slower for KV4-RL: the last INT4 split running it after its
      blocks, without and with an L2 prefetch of the side buffer (B=32, S=16k: 0.174 vs 0.167 ms;
      dev/results/kv4_prot_last.json, kv4_sweep_plans2.json), the first split running it before
      its blocks and starting its INT4 loop from the side state, so no extra program and at one split no
      merge (B=32, S=16k: 0.1664 vs 0.1645 ms; faster only at B=512, S=4k; kv4rl_fold.json), a standalone
      protected kernel on a forked stream (kv4_sweep_par.json), a persistent merge launch (one or two
      programs per SM, a programmatic dependent launch beside the INT4 wave) attending over the side slots
      before merging (B=32, S=16k: 0.168-0.181 vs 0.164 ms; kv4rl_side_merge.json), and the protected
      regions packed several pairs per program into the last wave's idle slots (kv4_sweep_packed2.json): a
      protected pair is latency-bound while the INT4 programs saturate memory.
    - ``pipe_edges``: a split's partial first and last blocks run the masked step inside the
      software-pipelined loop (one uniform branch per block decides whether to mask), instead of as two
      steps peeled before and after it whose loads nothing prefetches. ``None``: on with a side buffer
      (a KV4-RL main region starts after the sinks and ends before the recent window, so it is unaligned at
      both ends), off without (a KV4 region starts at 0: at most its last block is partial). On the H200,
      KV4-RL with it: B=32, S=16k 0.1626 vs 0.1652 ms, B=512, S=4k 0.712 vs 0.775 ms, the ragged B=320
      batch 0.444 vs 0.487 ms; KV4 on aligned uniform lengths 1.5% slower at B=32, S=16k, on the ragged
      batch 2.8% faster, so set it for ragged KV4 batches (dev/results/kv4rl_edges_run1.json). Three other
      ways to take the branch out of the loop were timed and removed, each slower at every long shape (B=32, S=16k,
      CUDA graphs, interleaved rounds): the partial blocks given to one more program per pair while the splits
      ran KV4's loop over the interior blocks (offline 1038 loop instructions against 1148; 0.1732 ms against
      0.1629: at one wave only the spare slots and the tail are left for the extra programs;
      dev/results/kv4rl_edge.json, code at 55fcf8e), and the mask as a -inf bias folded into the offset
      multiply-add, set by one branch before the block's arithmetic (253 registers; 0.1677 against 0.1639) or read
      from a table with no branch (168 registers; 0.1689; dev/results/kv4rl_bias.json, code at 032f913).
    - ``fuse_merge``: the last program of each (request, kv head) to finish merges the pair's split states (an
      atomic arrival counter per pair, zeroed by :func:`prepare_query` and left at zero by that program), instead
      of a second launch; taken when the pair has more than one state and its ``rows x states x d`` tile is at
      most 64 fp32 per thread (:func:`fuse_merge_applies`). Each prepared query has its own counters, so
      decodes on different streams never share them. ``None`` (default): fused when the INT4 region has two or
      more splits. On the H200 (CUDA graphs, three interleaved rounds, six runs) KV4 at B=8, S=32k took
      0.0899-0.0904 ms fused against 0.0935-0.0939 ms with the merge launch, KV4-RL there 0.0915-0.0919 against
      0.0936-0.0944; with one split KV4-RL's two states (split and protected) merged in the decode launch were
      0.5% slower at B=32, S=16k (0.1650-0.1658 vs 0.1642-0.1649 ms) and up to 4% slower at B=512, S=4k
      (dev/results/kv4rl_side*.json). An earlier sweep had timed the same idea at one split and
      dropped it.
    - KV4-RL's protected region and its main region's two partial blocks were also timed in a second kernel
      launched as a programmatic dependent launch right after the decode launch (so that its programs would
      run in the registers the decode programs leave free while the splits ran KV4's unmasked loop over the
      whole aligned blocks, both launches arriving at the fused merge's counters), and removed: slower at every
      shape (B=32, S=16k: 0.1751-0.1855 ms against 0.1644; B=32, S=1k 0.046 against 0.035). Kernel timestamps
      showed its programs starting only as the decode programs retired, with 4, 2 or 1 warps, a 64-register
      cap (four warps fit each scheduler's 16,384 registers beside two decode warps of 224) and the largest
      shared-memory carveout alike; at 64 registers it spilled and took 60-80 us alone. Without the peeled
      edge steps compiled in, ptxas also gave the decode kernel 168 registers and a loop 10% longer (1133 vs
      1033 instructions, sm_90), 15% slower (dev/results/kv4rl_side*.json; code at ee8fef6).
    - ``pdl``: programmatic dependent launch (sm_90+; ignored elsewhere): the decode kernel may launch
      while the query preparation finishes, and the split merge while the decode kernel finishes; each
      waits (``griddepcontrol.wait``) before reading what the one before wrote. On by default: 1% less
      time on mean over the sweep's shapes, 3% at B=32, S=1k (dev/results/kv4_sweep_pdl.json).
    """

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    int_pv: bool = False
    k_mode: str = "bytes"
    tile_sums: bool = True
    rows: int | None = None
    block_p: int = 32
    ctas_per_sm: int = 3
    overhead_blocks: float = 0.0
    maxnreg: int | None = None
    tma: bool = False
    pdl: bool = True
    pipe_edges: bool | None = None
    fuse_merge: bool | None = None

    def replace(self, **kw) -> KV4KernelConfig:
        """A copy with the given fields changed."""
        return dataclasses.replace(self, **kw)


_KMODES = ("planes", "bytes", "trans")
#: fewest query rows per tile when ``rows`` is None: 8 rows (218 registers) tied or beat the GQA group's 4 at
#: every shape of three H200 sweeps (B=32, S=16k: 0.161 vs 0.163 ms; ragged B=320: 0.464 vs 0.483 ms;
#: dev/results/kv4_sweep_par.json, kv4_sweep_packed.json, kv4_sweep_packed2.json)
MIN_ROWS = 8
#: block_n 256: the H200 sweep's best mean over its shapes (dev.kv4_sweep); the split plan plans for the
#: two CTAs per SM that its registers allow (218 at 8 query rows, 4 warps), with one block of fixed cost per
#: program (the "waves" sweep: one wave of programs beats more splits, and ragged batches lose with many
#: splits); the protected region as one extra program per pair (every other layout timed was slower for KV4-RL:
#: see the ``KV4KernelConfig`` docstring), its main region's unaligned edge blocks inside the pipelined loop
#: (``pipe_edges`` None: on with a side buffer); programmatic dependent launch (``pdl``, on by default)
DEFAULT_CONFIG = KV4KernelConfig(block_n=256, ctas_per_sm=2, overhead_blocks=1.0)


class SideBuffer(NamedTuple):
    """KV4-RL protected region of a batch: int8 ``k8``/``v8 [B, Hkv, C, d]`` (keys rotated), fp16
    per-slot scales ``[B, Hkv, C]``, and the occupied prefix length ``count [B]``."""

    k8: torch.Tensor
    k8_scale: torch.Tensor
    v8: torch.Tensor
    v8_scale: torch.Tensor
    count: torch.Tensor


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(b: int, hkv: int, max_len: int, block_n: int, device: torch.device,
                       ctas_per_sm: int = 2, overhead_blocks: float = 1.0) -> int:
    """Split-KV programs per (request, kv head), from a wave model: with ``R = SMs x ctas_per_sm``
    programs resident, ``P = b x hkv`` pairs and ``s`` splits of ``blocks`` position blocks, the time
    goes as ``ceil(P s / R) x (blocks / s + overhead_blocks)`` (waves x work per program, each program
    paying a fixed prologue/epilogue worth ``overhead_blocks`` blocks); the smallest ``s`` (at most 32,
    at least two blocks per split) minimising it is taken. ``max_len`` is the capacity: with ragged
    lengths most programs are shorter than it, and the overhead term keeps the plan from splitting
    short requests into many near-empty programs. CPU: 2 when there is more than one block (to
    exercise the merge)."""
    blocks = triton.cdiv(max(max_len, 1), block_n)
    if device.type != "cuda":
        return 2 if blocks > 1 else 1
    resident = _sm_count(device.index or 0) * max(ctas_per_sm, 1)
    pairs = b * hkv
    best, best_cost = 1, float("inf")
    for s in range(1, max(1, min(32, blocks // 2)) + 1):
        cost = -(-pairs * s // resident) * (blocks / s + overhead_blocks)
        if overhead_blocks == 0:
            cost += 0.01 * s * blocks  # the model before the overhead term: a small per-split merge cost
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = s, cost
    return best


def _check_side(side: SideBuffer, b: int, hkv: int, d: int) -> int:
    check_tensor("k8", side.k8, ndim=4, dtype=torch.int8)
    check_tensor("v8", side.v8, ndim=4, dtype=torch.int8)
    if side.k8.shape != side.v8.shape or side.k8.shape[:2] != (b, hkv) or side.k8.shape[3] != d:
        raise ValueError(f"k8/v8 must both be [B={b}, Hkv={hkv}, C, d={d}], got {tuple(side.k8.shape)} and "
                         f"{tuple(side.v8.shape)}")
    c = side.k8.shape[2]
    for name, t in (("k8_scale", side.k8_scale), ("v8_scale", side.v8_scale)):
        check_tensor(name, t, ndim=3, dtype=torch.float16)
        if t.shape != (b, hkv, c):
            raise ValueError(f"{name} must be [{b}, {hkv}, {c}], got {tuple(t.shape)}")
    check_tensor("count", side.count, ndim=1, floating=False)
    if side.count.shape[0] != b:
        raise ValueError(f"count must have one entry per request ({b}), got {side.count.shape[0]}")
    return c


def _words(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` viewed as wider words along its last dim (the kernel's packed reads); ``x`` itself if it
    does not divide (the modes that need the view are then not chosen)."""
    size = torch.tensor([], dtype=dtype).element_size()
    return x.view(dtype) if x.shape[-1] % size == 0 else x


def tma_applies(config: KV4KernelConfig, n: int, d: int) -> bool:
    """Whether ``config.tma`` takes effect at capacity ``n`` and head dim ``d``: TMA rows must be 16-byte
    aligned (``n`` a multiple of 8 for the fp16 scales) and the step reading them is the bytes or
    transposed one with fp16 PV."""
    return bool(config.tma) and config.k_mode != "planes" and not config.int_pv and n % 8 == 0 and d % 4 == 0


def pipe_edges_applies(config: KV4KernelConfig, side: bool) -> bool:
    """Whether a launch runs its partial edge blocks inside the pipelined loop: ``config.pipe_edges``, or when it
    is ``None``, exactly when a side buffer is given (a KV4-RL main region is unaligned at both ends; KV4's starts
    at 0)."""
    return side if config.pipe_edges is None else bool(config.pipe_edges)


def fuse_merge_applies(config: KV4KernelConfig, ns: int, rows: int, d: int, splits: int | None = None) -> bool:
    """Whether a launch with ``ns`` states per pair (``splits`` of them INT4 splits; default all) merges them in its
    own last program: ``config.fuse_merge`` (``None``: two or more INT4 splits), more than one state, and the
    ``rows x next_pow2(ns) x d`` fp32 tile at most 64 values per thread."""
    splits = ns if splits is None else splits
    wanted = splits >= 2 if config.fuse_merge is None else bool(config.fuse_merge)
    return wanted and ns > 1 and rows * triton.next_power_of_2(ns) * d <= 64 * 32 * config.num_warps


def _tma_descriptors(kc, vw, ks, ko, vs, vo, block_n: int) -> tuple:
    """Host TMA descriptors over the ``[B*Hkv, N, ...]`` views of the code words and scales (one
    ``block_n``-row box each); the kernel indexes them by ``b * Hkv + h``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def rows(t):
        v = t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])
        return TensorDescriptor.from_tensor(v, [1, block_n, v.shape[2]])

    def scales(t):
        v = t.view(t.shape[0] * t.shape[1], t.shape[2])
        return TensorDescriptor.from_tensor(v, [1, block_n])

    return rows(kc), rows(vw), scales(ks), scales(ko), scales(vs), scales(vo)


def kv4_main_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    start: torch.Tensor, end: torch.Tensor,
    sm_scale: float | None = None, int_pv: bool | None = None, num_splits: int | None = None,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    maxnreg: int | None = None, backend: str = "auto", *,
    side: SideBuffer | None = None, config: KV4KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Decode attention of the prepared query over positions ``[start_b, end_b)`` of the INT4 cache
    and, with ``side`` (KV4-RL), also over the side buffer's occupied slots, in one launch.

    Returns ``(o [B, Hq, d] fp32, lse [B, Hq] natural log)``; an empty range gives ``lse = -inf``,
    ``o = 0``. The split states (and the protected region's state) are combined by one
    :func:`~kvlib.kernels.tl.merge.merge_splits` launch (a fold of :func:`kvlib.core.merge.merge_states`), or inside
    the decode launch by each pair's last program (``config.fuse_merge``).
    Launch parameters come from ``config`` (default :data:`DEFAULT_CONFIG`); the explicit keyword
    arguments, when given, override it.
    """
    cfg = config or DEFAULT_CONFIG
    over = dict(int_pv=int_pv, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                num_stages=num_stages, maxnreg=maxnreg)
    cfg = cfg.replace(**{k: v for k, v in over.items() if v is not None})
    b, hq, d = qp.q8.shape
    check_tensor("k_codes", k_codes, ndim=4, dtype=torch.uint8)
    check_tensor("v_codes", v_codes, ndim=4, dtype=torch.uint8)
    _, hkv, n, half = k_codes.shape
    if k_codes.shape[0] != b or 2 * half != d or v_codes.shape != k_codes.shape:
        raise ValueError(f"k_codes/v_codes must be [B={b}, Hkv, N, d/2={d // 2}], got {tuple(k_codes.shape)}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    for name, t in (("k_scale", k_scale), ("k_off", k_off), ("v_scale", v_scale), ("v_off", v_off)):
        check_tensor(name, t, ndim=3, dtype=torch.float16)
        if t.shape != (b, hkv, n):
            raise ValueError(f"{name} must be [{b}, {hkv}, {n}], got {tuple(t.shape)}")
    for name, t in (("start", start), ("end", end)):
        check_tensor(name, t, ndim=1, floating=False)
        if t.shape[0] != b:
            raise ValueError(f"{name} must have one entry per request ({b}), got {t.shape[0]}")
    c = _check_side(side, b, hkv, d) if side is not None else 0
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    if not use_triton(qp.q8, backend):
        o, lse = kv4_main_decode_ref(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, start, end, sm_scale)
        if side is None:
            return o, lse
        from kvlib.core.merge import merge_states
        from kvlib.kernels.int4.protected import protected_decode_ref

        return merge_states(o, lse, *protected_decode_ref(qp, *side, sm_scale=sm_scale))
    g = hq // hkv
    if g > 16:
        raise ValueError(f"GQA group {g} > 16 is not supported by the kernel")
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes), ("k_scale", k_scale), ("k_off", k_off),
                    ("v_scale", v_scale), ("v_off", v_off)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    dev = qp.q8.device
    q8 = qp.q8.contiguous()
    if cfg.k_mode not in _KMODES:
        raise ValueError(f"k_mode must be one of {_KMODES}, got {cfg.k_mode!r}")
    gp = cfg.rows or max(MIN_ROWS, triton.next_power_of_2(g))
    if gp < g or gp & (gp - 1):
        raise ValueError(f"rows={cfg.rows} must be a power of two >= the GQA group {g}")
    if qp.q8.is_cuda and d < 64:
        raise ValueError(f"the KV4 kernel needs d >= 64 on the GPU (INT8 tensor-core dots take K >= 32), got d={d}")
    k_mode = cfg.k_mode
    if k_mode == "trans" and cfg.int_pv:
        k_mode = "bytes"  # the transposed step has fp16 PV only
    if k_mode == "planes" and (d < 128 or n % 2):
        k_mode = "bytes"  # INT8 dots need K >= 32 (d/4 >= 32); int16 views need even sizes
    splits = cfg.num_splits or default_num_splits(b, hkv, n, cfg.block_n, dev, cfg.ctas_per_sm, cfg.overhead_blocks)
    prot = side is not None
    ns = splits + int(prot)
    start32, end32 = start.to(torch.int32), end.to(torch.int32)
    o_s = torch.empty(b, hq, ns, d, dtype=torch.float32, device=dev)
    lse_s = torch.empty(b, hq, ns, dtype=torch.float32, device=dev)
    if prot:
        k8, k8s, v8, v8s = (t.contiguous() for t in side[:4])
        cnt = side.count.to(torch.int32)
    else:
        k8, k8s, v8, v8s, cnt = q8, k_scale, q8, k_scale, start32  # unused (same dtypes: one signature)
    kc, kw, ks, ko, vc, vw, vs, vo = (k_codes, _words(k_codes, torch.int16), k_scale, k_off, v_codes,
                                      _words(v_codes, torch.int16), v_scale, v_off)
    tma = tma_applies(cfg.replace(k_mode=k_mode), n, d)
    if tma:
        kc, vw, ks, ko, vs, vo = _tma_descriptors(kc, vw, ks, ko, vs, vo, cfg.block_n)
    global LAST_KERNEL
    pdl = cfg.pdl and pdl_supported(qp.q8)
    fuse = fuse_merge_applies(cfg, ns, gp, d, splits) and not _PROBE_NO_PROT_PROGRAMS
    if fuse:
        # from the query preparation (zeroed there), else zeros here (a memset launch)
        counters = qp.arrivals if qp.arrivals is not None and qp.arrivals.numel() >= b * hkv else torch.zeros(
            b * hkv, dtype=torch.int32, device=dev)
        o, lse = torch.empty(b, hq, d, dtype=torch.float32, device=dev), torch.empty(b, hq, dtype=torch.float32,
                                                                                     device=dev)
    else:
        counters, o, lse = start32, o_s, lse_s  # unused
    LAST_KERNEL = _kv4_decode_kernel[(b, hkv, splits if (_PROBE_NO_PROT_PROGRAMS and prot) else ns)](
        q8, _words(q8, torch.int16), _words(q8, torch.int32), qp.scale, qp.qsum,
        kc, kw, ks, ko, vc, vw, vs, vo,
        start32, end32,
        k8, k8s, v8, v8s, cnt,
        o_s, lse_s, counters, o, lse, sm_scale * LOG2E, n, max(c, 1), splits,
        HKV=hkv, G=g, GP=gp, D=d, BLOCK_N=cfg.block_n, INT_PV=bool(cfg.int_pv),
        KMODE=_KMODES.index(k_mode), TILE_SUMS=bool(cfg.tile_sums), SCALE32=n % 2 == 0,
        EVEN=n % cfg.block_n == 0, PROT=prot, BLOCK_P=cfg.block_p,
        INTERP=not qp.q8.is_cuda, TMA=tma,
        PDL=pdl, PIPE_EDGES=pipe_edges_applies(cfg, prot), FUSE=fuse, NS_P=triton.next_power_of_2(ns) if fuse else 1,
        **({"launch_pdl": True} if pdl else {}),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )  # fmt: skip
    if ns == 1:
        return o_s[:, :, 0], lse_s[:, :, 0]
    if fuse:
        return o, lse
    return merge_splits(o_s, lse_s, backend=backend, pdl=pdl)[:2]


def _unpack(c: torch.Tensor) -> torch.Tensor:
    return torch.stack((c & 15, c >> 4), dim=-1).reshape(*c.shape[:-1], 2 * c.shape[-1]).float()


def region_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention of ``q [B, Hq, d]`` over ``k, v [B, Hkv, N, d]`` restricted to ``mask [B, N]`` (GQA).

    Returns ``(o, lse)`` in float64-accumulated float32; an empty region gives ``lse = -inf``, ``o = 0``.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), kk) * sm_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    o = torch.einsum("bhn,bhnd->bhd", w, vv)
    return o.float(), lse.float()


def kv4_main_decode_ref(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    start: torch.Tensor, end: torch.Tensor, sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch reference: exact attention of the dequantised query over the dequantised INT4 region."""
    d = qp.q8.shape[-1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    q = qp.q8.float() * qp.scale.unsqueeze(-1)
    k = _unpack(k_codes) * k_scale.float().unsqueeze(-1) + k_off.float().unsqueeze(-1)
    v = _unpack(v_codes) * v_scale.float().unsqueeze(-1) + v_off.float().unsqueeze(-1)
    p = torch.arange(k_codes.shape[2], device=k_codes.device)
    mask = (p[None, :] >= start[:, None].long()) & (p[None, :] < end[:, None].long())
    return region_attention_ref(q, k, v, mask, sm_scale)
