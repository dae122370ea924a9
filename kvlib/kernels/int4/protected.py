"""Triton decode attention over the KV4-RL protected region (the INT8 side buffer), torch reference beside it.

The region body :func:`_protected_region` lives here; the fused KV4-RL launch
(:func:`kvlib.kernels.int4.launch.kv4_main_decode` with ``side=``, and the paged launch) runs it as one extra
split per (request, kv head); this standalone launch serves the two-launch path and the tests.

Layout (one layer): ``k8``/``v8`` int8 ``[B, Hkv, C, d]`` with fp16 per-slot scales ``[B, Hkv, C]``;
request ``b`` has its first ``count_b`` slots occupied (sinks fill slots ``0..s-1`` in order, the
recent ring fills ``s..`` in order, so occupancy is always a prefix). Slot order does not matter:
attention is permutation invariant. QK reuses the prepared INT8 query (``s_q s_k (q8·k8)``); PV
dequantises the protected values to bf16 and accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlib.core.checks import check_tensor
from kvlib.kernels.backend import use_triton
from kvlib.kernels.int4.query import QueryInt8
from kvlib.kernels.int4.reference import region_attention_ref
from kvlib.kernels.int4.tl_helpers import LN2_C, LOG2E, _scalar_load


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
def _protected_kernel(
    Q8, QS, K8, KS, V8, VS, COUNT, OUT, LSE, sm_scale_log2, C,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """Grid ``(B, Hkv)``: the same region code the fused KV4-RL launch runs as its extra split."""
    _protected_region(tl.program_id(0), tl.program_id(1), Q8, QS, K8, KS, V8, VS, COUNT, OUT, LSE, sm_scale_log2,
                      C, 0, 1, HKV, G, GP, D, BLOCK_N, INTERP)


def protected_decode_ref(
    qp: QueryInt8, k8: torch.Tensor, k_scale: torch.Tensor, v8: torch.Tensor, v_scale: torch.Tensor,
    count: torch.Tensor, sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch reference: exact attention of the dequantised INT8 query over the dequantised side slots."""
    d = qp.q8.shape[-1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    q = qp.q8.float() * qp.scale.unsqueeze(-1)
    k = k8.float() * k_scale.float().unsqueeze(-1)
    v = v8.float() * v_scale.float().unsqueeze(-1)
    mask = torch.arange(k8.shape[2], device=k8.device)[None, :] < count[:, None].long()
    return region_attention_ref(q, k, v, mask, sm_scale)


def protected_decode(
    qp: QueryInt8, k8: torch.Tensor, k_scale: torch.Tensor, v8: torch.Tensor, v_scale: torch.Tensor,
    count: torch.Tensor, sm_scale: float | None = None, block_n: int = 32, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Decode attention over the first ``count_b`` side slots; ``(o [B, Hq, d] fp32, lse [B, Hq])``."""
    b, hq, d = qp.q8.shape
    check_tensor("k8", k8, ndim=4, dtype=torch.int8)
    check_tensor("v8", v8, ndim=4, dtype=torch.int8)
    if k8.shape != v8.shape or k8.shape[0] != b or k8.shape[3] != d:
        raise ValueError(f"k8/v8 must both be [B={b}, Hkv, C, d={d}], got {tuple(k8.shape)} and {tuple(v8.shape)}")
    _, hkv, c, _ = k8.shape
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(name, t, ndim=3, dtype=torch.float16)
        if t.shape != (b, hkv, c):
            raise ValueError(f"{name} must be [{b}, {hkv}, {c}], got {tuple(t.shape)}")
    check_tensor("count", count, ndim=1, floating=False)
    if hq % hkv or hq // hkv > 16:
        raise ValueError(f"query heads {hq} must be a multiple (at most 16x) of kv heads {hkv}")
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    if not use_triton(qp.q8, backend):
        return protected_decode_ref(qp, k8, k_scale, v8, v_scale, count, sm_scale)
    o = torch.empty(b, hq, d, dtype=torch.float32, device=k8.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=k8.device)
    g = hq // hkv
    _protected_kernel[(b, hkv)](
        qp.q8.contiguous(), qp.scale, k8.contiguous(), k_scale.contiguous(), v8.contiguous(), v_scale.contiguous(),
        count.to(torch.int32), o, lse, sm_scale * LOG2E, c,
        HKV=hkv, G=g, GP=triton.next_power_of_2(g), D=d, BLOCK_N=block_n, INTERP=not k8.is_cuda, num_warps=4,
    )  # fmt: skip
    return o, lse
