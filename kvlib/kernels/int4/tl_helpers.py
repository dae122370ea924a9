"""Triton device helpers shared by the KV4 kernels: nibble unpacking, masked and TMA loads, block edges.

Every function here is a ``@triton.jit`` helper inlined into :mod:`kvlib.kernels.int4.region` (whose region and
step also read the paged pool of :mod:`kvlib.kernels.int4.paged`); the constants are the forms a jitted body may
read.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LN2_C: tl.constexpr = tl.constexpr(LN2)  # the form a @triton.jit body may read
#: 2^24: the V planes enter the PV dot as the subnormal fp16 c 2^-24 (:func:`_plane_f16`)
V_UNSUB: tl.constexpr = tl.constexpr(16777216.0)


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


#: nibble ``J`` of each 16-bit half of a register, in place (``_plane_f16``: the subnormal fp16 ``c 2^-24``)
_PLANE_F16_ASM: tl.constexpr = tl.constexpr((
    "and.b32 $0, $1, 0x000F000F;",
    "{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x000F000F; }",
    "{ .reg .b32 t; shr.b32 t, $1, 8; and.b32 $0, t, 0x000F000F; }",
    "{ .reg .b32 t; shr.b32 t, $1, 12; and.b32 $0, t, 0x000F000F; }",
))
#: nibble ``J`` of the four int16 words in two registers, gathered into one register of four bytes (``_plane_i8``)
_PLANE_I8_ASM: tl.constexpr = tl.constexpr((
    "{ .reg .b32 a, b; and.b32 a, $1, 0x000F000F; and.b32 b, $2, 0x000F000F; prmt.b32 $0, a, b, 0x6420; }",
    *(f"{{ .reg .b32 a, b; shr.b32 a, $1, {4 * j}; shr.b32 b, $2, {4 * j}; and.b32 a, a, 0x000F000F; "
      f"and.b32 b, b, 0x000F000F; prmt.b32 $0, a, b, 0x6420; }}" for j in (1, 2, 3)),
))


@triton.jit
def _plane_f16(x, J: tl.constexpr, FAST: tl.constexpr):
    """Nibble J (channel ``4i + J``) of int16 words holding four codes, as the exact subnormal fp16
    ``c 2^-24`` (its bits are the code itself; the tensor cores take subnormals exactly).

    FAST: one ``and`` (plus a shift for J > 0) per two codes. Unlike the magic number ``0x6400 | c``
    (``1024 + c``), this keeps the fp32 accumulator at the output's scale (``V_UNSUB`` after the loop)."""
    if FAST:
        return tl.inline_asm_elementwise(_PLANE_F16_ASM[J], "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    return ((x >> (4 * J)) & 15).to(tl.float16) * 5.960464477539063e-08  # 2^-24: exact in fp16 (subnormal)


@triton.jit
def _plane_i8(x, J: tl.constexpr, FAST: tl.constexpr):
    """Nibble J (channel ``4i + J``) of int16 words holding four codes, as int8. FAST: per four words,
    shift and mask two registers and gather the four low bytes with one ``prmt``."""
    if FAST:
        return tl.inline_asm_elementwise(_PLANE_I8_ASM[J], "=r,r,r", [x], dtype=tl.int8, is_pure=True, pack=4)
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


# ---- scales of a paged pool (kvlib.kernels.int4.paged): consecutive positions are H_kv fp16 apart
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
    """fp16 scales of a paged pool at element indices ``row`` (``(page * PAGE + slot) * HKV + h``) as fp32. PAIR
    (``HKV`` even): read the int32 word holding heads ``h & ~1`` and ``h | 1`` and keep this head's half, so each
    load is 32 bits wide (the software pipeliner makes asynchronous copies of those, not of 16-bit gathers, which stay
    synchronous loads in the loop)."""
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
