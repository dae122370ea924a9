"""Split-KV decode attention over an fp16/bf16 paged pool: the baseline with the INT8 kernel's structure.

Same grid, same slot table, same GQA tile (all query heads of a KV head from one load), same stage 2
(:func:`kvlib.kernels.tl.merge.merge_splits`), no dequantisation and no certificate, so the
difference to :mod:`kvlib.kernels.int8.decode` is the storage format alone. Pools: ``k``/``v``
``[n_slots, H_kv, d]`` in fp16 or bf16. :func:`decode_bf16_reference` (float64 torch) is the reference.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvlib.core.checks import check_tensor
from kvlib.kernels.backend import triton_available
from kvlib.kernels.int8.decode import DecodeOut, default_num_splits
from kvlib.kernels.tl.merge import merge_splits, split_range
from kvlib.kernels.tl.paging import load_slots, request_table, slots_from_block_table


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None, seq_lens: torch.Tensor,
           block_table: torch.Tensor | None = None, block_size: int | None = None) -> tuple[torch.Tensor, int, int]:
    check_tensor("q", q, ndim=3, floating=True)
    check_tensor("k", k, ndim=3, dtype=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("v", v, ndim=3, dtype=(k.dtype,))
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, hq, d = q.shape
    if k.shape[-1] != d or hq % k.shape[1]:
        raise ValueError(f"q [B, Hq, d] must match the pool's d={k.shape[-1]} with Hq a multiple of H_kv={k.shape[1]}")
    table = request_table(slots, block_table, block_size, B)
    check_tensor("seq_lens", seq_lens, ndim=1, floating=False)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens [B] must have B={B} rows, got {tuple(seq_lens.shape)}")
    return table


def decode_bf16_reference(q, k, v, slots, seq_lens, *, sm_scale: float | None = None,
                          block_table: torch.Tensor | None = None, block_size: int | None = None) -> DecodeOut:
    """float64 torch reference: softmax attention over each row's slots (or its block table's)."""
    _check(q, k, v, slots, seq_lens, block_table, block_size)
    if block_table is not None:
        slots = slots_from_block_table(block_table, block_size)
    B, hq, d = q.shape
    gqa = hq // k.shape[1]
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    o = torch.zeros(B, hq, d, dtype=torch.float64)
    lse = torch.zeros(B, hq, dtype=torch.float64)
    for b in range(B):
        sl = slots[b, : int(seq_lens[b])].long().cpu()
        kk = k.cpu()[sl].double().repeat_interleave(gqa, dim=1)  # [L, hq, d]
        vv = v.cpu()[sl].double().repeat_interleave(gqa, dim=1)
        z = sm * torch.einsum("hd,lhd->hl", q[b].cpu().double(), kk)
        o[b] = torch.einsum("hl,lhd->hd", torch.softmax(z, -1), vv)
        lse[b] = torch.logsumexp(z, -1)
    return DecodeOut(o, lse)


@triton.jit
def _decode_bf16_stage1(
    Q, K, V, SLOTS, SEQ, O_S, LSE_S, sm_scale,
    s_qb, s_qh, s_k_n, s_k_h, s_v_n, s_v_h, s_sl_b, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, PAGE: tl.constexpr = 0,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, start, end = split_range(SEQ, b, split, NUM_SPLITS)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = load_slots(SLOTS + b * s_sl_b, offs_n, mask_n, PAGE)
        k = tl.load(K + slot[:, None] * s_k_n + kvh * s_k_h + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * s_v_n + kvh * s_v_h + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if DOT_F32:  # "ieee": Triton's default for fp32 dots on CUDA is tf32 (2^-11), not the fp32 a pool promises
            qk = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
        qk = tl.where(mask_n[None, :], qk * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, out_dtype=tl.float32, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
    nonempty = l_i != 0.0
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + offs_d[None, :], acc * inv_l[:, None],
             mask=mask_h[:, None])
    tl.store(LSE_S + b * s_ls_b + heads * s_ls_h + split, lse, mask=mask_h)


def decode_bf16(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None, seq_lens: torch.Tensor, *,
    sm_scale: float | None = None, num_splits: int | None = None, block_n: int = 64,
    num_warps: int = 4, num_stages: int = 2, block_table: torch.Tensor | None = None, block_size: int | None = None,
) -> DecodeOut:
    """Decode attention over an fp16/bf16 slot pool (same split-KV structure as the INT8 kernel).

    Requests address the pool by ``slots [B, max_len]`` or by ``block_table [B, max_blocks]`` over pages of
    ``block_size`` slots (``slots=None``; :mod:`kvlib.kernels.tl.paging`). On CPU without ``TRITON_INTERPRET=1``
    it returns :func:`decode_bf16_reference` (``DecodeOut.path`` says ``"reference"``; the kernel ``"bf16"``).
    """
    table, page, max_len = _check(q, k, v, slots, seq_lens, block_table, block_size)
    if not triton_available(q.device):
        return decode_bf16_reference(q, k, v, slots, seq_lens, sm_scale=sm_scale, block_table=block_table,
                                     block_size=block_size)
    B, hq, d = q.shape
    hkv = k.shape[1]
    gqa = hq // hkv
    if d & (d - 1):
        raise ValueError(f"d must be a power of two for the kernel, got {d}")
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    ns = num_splits or default_num_splits(B, hkv, max_len, block_n, q.device)
    q, k, v, slots = q.contiguous(), k.contiguous(), v.contiguous(), table.contiguous()
    o_s = torch.empty(B, hq, ns, d, dtype=torch.float32, device=q.device)
    lse_s = torch.empty(B, hq, ns, dtype=torch.float32, device=q.device)
    # the CPU interpreter has no bf16 matmul: compute in fp32 there
    dot_f32 = k.dtype == torch.float32 or (q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
                                           and k.dtype == torch.bfloat16)
    _decode_bf16_stage1[(B, hkv, ns)](
        q, k, v, slots, seq_lens, o_s, lse_s, sm,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=gqa, BLOCK_H=max(16, triton.next_power_of_2(gqa)), BLOCK_N=block_n, D=d, NUM_SPLITS=ns,
        DOT_F32=dot_f32, PAGE=page, num_warps=num_warps, num_stages=num_stages,
    )
    o, lse = merge_splits(o_s, lse_s)[:2]
    return DecodeOut(o, lse, path="bf16")
