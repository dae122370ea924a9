"""Triton decode attention over the KV4 (INT4) main region, with its torch references beside it.

Layout (one layer, padded per request; position ``p`` of request ``b`` lives at ``[b, h, p]``):
``k_codes``/``v_codes`` uint8 ``[B, Hkv, N, d//2]`` (two codes per byte, even channel low),
``k_scale``/``k_off``/``v_scale``/``v_off`` fp16 ``[B, Hkv, N]`` (whole-head affine group).
Each request attends over its own position range ``[start_b, end_b)`` (ragged batches; KV4-RL's
main region excludes the protected positions).

QK is INT8 query x INT4 codes on the tensor cores, with the query scale, key scale and key offset
applied after the reduction: ``q̂·k̂ = s_q Δ_k (q8·c) + m_k (s_q Σ q8)``. PV is either dequantised
(``fp16`` probabilities folded with ``Δ_v`` x fp16 codes, fp32 accumulate) or integer
(``p Δ_v`` re-quantised to INT8 per block row, INT8 x INT4 codes, int32 accumulate); the offsets
``m_v`` enter through ``Σ p m_v``. Split-KV partial states are combined by
:func:`kvlib.kernels.merge_tl.merge_splits`, whose reference is a fold of :func:`kvlib.merge.merge_states`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvlib._checks import check_tensor
from kvlib.hadamard import hadamard, hadamard_matrix
from kvlib.kernels._backend import use_triton
from kvlib.kernels.merge_tl import merge_splits

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LAST_KERNEL = None  # the last compiled main kernel (registers/spills are read off it in tuning)
LN2_C: tl.constexpr = tl.constexpr(LN2)  # the form a @triton.jit body may read


# ---------------------------------------------------------------------------------------------
# Query preparation: rotate by H and quantise to INT8 (shared by the main and protected paths)
# ---------------------------------------------------------------------------------------------


@dataclass
class QueryInt8:
    """INT8 query ``q8 [B, Hq, d]`` with per-row fp32 ``scale`` and ``qsum = scale * Σ q8`` (``[B, Hq]``)."""

    q8: torch.Tensor
    scale: torch.Tensor
    qsum: torch.Tensor


def prepare_query_ref(q: torch.Tensor, rotate: bool = True) -> QueryInt8:
    """Torch reference: ``hadamard`` (if ``rotate``), symmetric INT8 per row, ``floor(x/s + 1/2)``."""
    qf = hadamard(q.float()) if rotate else q.float()
    scale = qf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = torch.floor(qf / safe.unsqueeze(-1) + 0.5).clamp_(-127, 127).to(torch.int8)
    return QueryInt8(q8, scale, scale * q8.float().sum(-1))


@triton.jit
def _prep_query_kernel(Q, H, Q8, QS, QSUM, n_rows, D: tl.constexpr, R: tl.constexpr, ROTATE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    rok = rows < n_rows
    cols = tl.arange(0, D)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    q = tl.load(Q + offs, mask=rok[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        h = tl.load(H + cols[:, None] * D + cols[None, :])
        q = tl.dot(q, h, input_precision="ieee")
    amax = tl.max(tl.abs(q), axis=1)
    scale = amax / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    qi = tl.floor(q / safe[:, None] + 0.5)
    qi = tl.minimum(tl.maximum(qi, -127.0), 127.0)
    tl.store(Q8 + offs, qi.to(tl.int8), mask=rok[:, None])
    tl.store(QS + rows, scale, mask=rok)
    tl.store(QSUM + rows, scale * tl.sum(qi, axis=1), mask=rok)


@functools.lru_cache(maxsize=8)
def _hmat(d: int, device: str) -> torch.Tensor:
    return hadamard_matrix(d, torch.float32).to(device).contiguous()


def prepare_query(q: torch.Tensor, rotate: bool = True, backend: str = "auto") -> QueryInt8:
    """Rotate ``q [B, Hq, d]`` by the normalised Hadamard (keys are stored rotated) and quantise to INT8."""
    check_tensor("q", q, ndim=3, floating=True)
    if not use_triton(q, backend):
        return prepare_query_ref(q, rotate)
    b, hq, d = q.shape
    qc = q.contiguous()
    q8 = torch.empty(b, hq, d, dtype=torch.int8, device=q.device)
    qs = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    qsum = torch.empty_like(qs)
    r = 16
    n = b * hq
    _prep_query_kernel[(triton.cdiv(n, r),)](qc, _hmat(d, str(q.device)), q8, qs, qsum, n, D=d, R=r, ROTATE=rotate)
    return QueryInt8(q8, qs, qsum)


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
def _nibbles_f16_plus1024(x, HIGH: tl.constexpr, FAST: tl.constexpr):
    """``1024 + nibble`` as fp16 (exact). FAST: builds the fp16 bits ``0x6400 | c`` with byte permutes,
    avoiding integer-to-float conversions (two PTX ops per 4 codes)."""
    if FAST:
        if HIGH:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, u; shr.u32 u, $2, 4; and.b32 t, u, 0x0F0F0F0F; "
                "prmt.b32 $0, t, 0x64646464, 0x5150; prmt.b32 $1, t, 0x64646464, 0x5352; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4,
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $2, 0x0F0F0F0F; "
            "prmt.b32 $0, t, 0x64646464, 0x5150; prmt.b32 $1, t, 0x64646464, 0x5352; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4,
        )  # fmt: skip
    if HIGH:
        return (x >> 4).to(tl.float16) + 1024.0
    return (x & 15).to(tl.float16) + 1024.0


@triton.jit
def _load_block(n0, hi, kv_row0, KC, KS, KO, VC, VS, VO, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """Codes and per-position scale/offset of positions ``n0 .. n0+BLOCK_N`` (masked at ``hi``)."""
    half = tl.arange(0, HALF)
    offs = n0 + tl.arange(0, BLOCK_N)
    nm = offs < hi
    pos = kv_row0 + offs
    kc = tl.load(KC + pos[:, None] * HALF + half[None, :], mask=nm[:, None], other=0)
    vc = tl.load(VC + pos[:, None] * HALF + half[None, :], mask=nm[:, None], other=0)
    ks = tl.load(KS + pos, mask=nm, other=0.0)
    ko = tl.load(KO + pos, mask=nm, other=0.0)
    vs = tl.load(VS + pos, mask=nm, other=0.0)
    vo = tl.load(VO + pos, mask=nm, other=0.0)
    return kc, ks, ko, vc, vs, vo


@triton.jit
def _main_block(
    n0, hi, kc, ks, ko, vc, vs, vo, q_eT, q_oT, qs, qsum, sm_scale_log2,
    m_i, l_i, acc_e, acc_o, acc_m,
    BLOCK_N: tl.constexpr, INT_PV: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_N positions: INT4 codes x INT8 query, online softmax, PV; returns the updated state.

    Scores are computed transposed, ``s^T [BLOCK_N, GP] = codes @ q8^T``, so the packed codes are the
    row-major A operand of the tensor-core dot (no transposition of 8-bit tiles).
    """
    nm = (n0 + tl.arange(0, BLOCK_N)) < hi
    s_int = tl.dot(_nibbles_i8(kc, False, FAST), q_eT)
    s_int += tl.dot(_nibbles_i8(kc, True, FAST), q_oT)
    ks = ks.to(tl.float32)
    ko = ko.to(tl.float32)
    s = (s_int.to(tl.float32) * ks[:, None] * qs[None, :] + ko[:, None] * qsum[None, :]) * sm_scale_log2
    s = tl.where(nm[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])  # [BLOCK_N, GP]
    vs = vs.to(tl.float32)
    vo = vo.to(tl.float32)
    pv = tl.trans(p * vs[:, None])  # [GP, BLOCK_N]
    if INT_PV:
        sc = tl.max(pv, axis=1) / 127.0
        sc = tl.where(sc > 0, sc, 1.0)
        pq = (pv / sc[:, None] + 0.5).to(tl.int8)
        acc_e = acc_e * alpha[:, None] + tl.dot(pq, _nibbles_i8(vc, False, FAST)).to(tl.float32) * sc[:, None]
        acc_o = acc_o * alpha[:, None] + tl.dot(pq, _nibbles_i8(vc, True, FAST)).to(tl.float32) * sc[:, None]
        acc_m = acc_m * alpha + tl.sum(p * vo[:, None], axis=0)
    else:
        # fp16 codes are 1024 + c (exact); the 1024 Σ p16 excess is removed through acc_m
        p16 = pv.to(tl.float16)
        acc_e = acc_e * alpha[:, None] + tl.dot(p16, _nibbles_f16_plus1024(vc, False, FAST))
        acc_o = acc_o * alpha[:, None] + tl.dot(p16, _nibbles_f16_plus1024(vc, True, FAST))
        excess = 1024.0 * tl.sum(p16.to(tl.float32), axis=1)
        acc_m = acc_m * alpha + tl.sum(p * vo[:, None], axis=0) - excess
    l_i = l_i * alpha + tl.sum(p, axis=0)
    return m_new, l_i, acc_e, acc_o, acc_m


@triton.jit
def _kv4_main_kernel(
    Q8, QS, QSUM,
    KC, KS, KO, VC, VS, VO,
    START, END,
    OUT, LSE,
    sm_scale_log2, N,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, INT_PV: tl.constexpr, INTERP: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    HALF: tl.constexpr = D // 2
    HQ: tl.constexpr = HKV * G
    start = _scalar_load(START + b)
    end = _scalar_load(END + b)
    length = tl.maximum(end - start, 0)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = start + sp * chunk
    hi = tl.minimum(lo + chunk, end)

    rows = tl.arange(0, GP)
    row_ok = rows < G
    half = tl.arange(0, HALF)
    qrow = (b * HQ + h * G + rows).to(tl.int64)
    q_eT = tl.load(Q8 + qrow[None, :] * D + 2 * half[:, None], mask=row_ok[None, :], other=0)  # [HALF, GP]
    q_oT = tl.load(Q8 + qrow[None, :] * D + 2 * half[:, None] + 1, mask=row_ok[None, :], other=0)
    qs = tl.load(QS + qrow, mask=row_ok, other=0.0)
    qsum = tl.load(QSUM + qrow, mask=row_ok, other=0.0)

    kv_row0 = (b * HKV + h).to(tl.int64) * N
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_e = tl.zeros([GP, HALF], tl.float32)
    acc_o = tl.zeros([GP, HALF], tl.float32)
    acc_m = tl.zeros([GP], tl.float32)
    # PREFETCH: register double buffering (next block's loads issued before this block's math);
    # costs registers, hence occupancy.
    if INTERP:  # the CPU interpreter cannot take tensor loop bounds in range(); a while loop is equivalent
        kc, ks, ko, vc, vs, vo = _load_block(lo, hi, kv_row0, KC, KS, KO, VC, VS, VO, HALF, BLOCK_N)
        n0 = lo
        while n0 < hi:
            nxt = _load_block(n0 + BLOCK_N, hi, kv_row0, KC, KS, KO, VC, VS, VO, HALF, BLOCK_N)
            m_i, l_i, acc_e, acc_o, acc_m = _main_block(
                n0, hi, kc, ks, ko, vc, vs, vo, q_eT, q_oT, qs, qsum, sm_scale_log2,
                m_i, l_i, acc_e, acc_o, acc_m, BLOCK_N, INT_PV, False,
            )  # fmt: skip
            kc, ks, ko, vc, vs, vo = nxt
            n0 += BLOCK_N
    else:
        if PREFETCH:
            kc, ks, ko, vc, vs, vo = _load_block(lo, hi, kv_row0, KC, KS, KO, VC, VS, VO, HALF, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            if PREFETCH:
                nxt = _load_block(n0 + BLOCK_N, hi, kv_row0, KC, KS, KO, VC, VS, VO, HALF, BLOCK_N)
            else:
                kc, ks, ko, vc, vs, vo = _load_block(n0, hi, kv_row0, KC, KS, KO, VC, VS, VO, HALF, BLOCK_N)
            m_i, l_i, acc_e, acc_o, acc_m = _main_block(
                n0, hi, kc, ks, ko, vc, vs, vo, q_eT, q_oT, qs, qsum, sm_scale_log2,
                m_i, l_i, acc_e, acc_o, acc_m, BLOCK_N, INT_PV, True,
            )  # fmt: skip
            if PREFETCH:
                kc, ks, ko, vc, vs, vo = nxt

    nonempty = l_i > 0
    inv = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    o_e = (acc_e + acc_m[:, None]) * inv[:, None]
    o_o = (acc_o + acc_m[:, None]) * inv[:, None]
    orow = qrow * SPLITS + sp
    tl.store(OUT + orow[:, None] * D + 2 * half[None, :], o_e, mask=row_ok[:, None])
    tl.store(OUT + orow[:, None] * D + 2 * half[None, :] + 1, o_o, mask=row_ok[:, None])
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    tl.store(LSE + orow, lse, mask=row_ok)


def _num_splits(b: int, hkv: int, max_len: int, block_n: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 2 if max_len > block_n else 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * sms, b * hkv)
    return int(max(1, min(want, triton.cdiv(max_len, 4 * block_n), 16)))


def kv4_main_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    start: torch.Tensor, end: torch.Tensor,
    sm_scale: float | None = None, int_pv: bool = False, num_splits: int | None = None,
    block_n: int = 64, num_warps: int = 4, num_stages: int = 3, prefetch: bool = False, maxnreg: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Decode attention of the prepared query over positions ``[start_b, end_b)`` of the INT4 cache.

    Returns ``(o [B, Hq, d] fp32, lse [B, Hq] natural log)``; an empty range gives ``lse = -inf``, ``o = 0``.
    Tuning knobs: ``block_n`` positions per step, ``num_warps``/``num_stages``, ``prefetch`` (register
    double buffering), ``maxnreg`` (register cap). On the H200 the kernel was seen register-bound
    (233 registers/thread at ``block_n=128`` with prefetch: 2 CTAs per SM, ~1.4 TB/s effective).
    """
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
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    if not use_triton(qp.q8, backend):
        return kv4_main_decode_ref(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, start, end, sm_scale)
    g = hq // hkv
    if g > 16:
        raise ValueError(f"GQA group {g} > 16 is not supported by the kernel")
    splits = num_splits or _num_splits(b, hkv, n, block_n, qp.q8.device)
    o_s = torch.empty(b, hq, splits, d, dtype=torch.float32, device=qp.q8.device)
    lse_s = torch.empty(b, hq, splits, dtype=torch.float32, device=qp.q8.device)
    global LAST_KERNEL
    LAST_KERNEL = _kv4_main_kernel[(b, hkv, splits)](
        qp.q8, qp.scale, qp.qsum,
        k_codes, k_scale, k_off, v_codes, v_scale, v_off,
        start.to(torch.int32), end.to(torch.int32),
        o_s, lse_s, sm_scale * LOG2E, n,
        HKV=hkv, G=g, GP=16, D=d, BLOCK_N=block_n, SPLITS=splits, INT_PV=bool(int_pv),
        INTERP=not qp.q8.is_cuda,
        PREFETCH=bool(prefetch), num_warps=num_warps, num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    if splits == 1:
        return o_s[:, :, 0], lse_s[:, :, 0]
    return merge_splits(o_s, lse_s, backend=backend)[:2]


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
