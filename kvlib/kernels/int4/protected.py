"""Triton decode attention over the KV4-RL protected region (the INT8 side buffer), torch reference beside it.

The kernel body is :func:`kvlib.kernels.int4.decode._protected_region`, which the fused KV4-RL launch
(:func:`kvlib.kernels.int4.decode.kv4_main_decode` with ``side=``) also runs as one extra split per
(request, kv head); this standalone launch serves the two-launch path and the tests.

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
from kvlib.kernels.int4.decode import LOG2E, QueryInt8, _protected_region, region_attention_ref, use_triton


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
