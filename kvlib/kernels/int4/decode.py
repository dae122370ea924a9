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
Launch parameters live in :class:`KV4KernelConfig` (tuned on the GPU by :mod:`dev.kv4_sweep`).

The family's modules, one way down the import graph: :mod:`~kvlib.kernels.int4.config` (the launch
parameters), :mod:`~kvlib.kernels.int4.query` (query preparation), :mod:`~kvlib.kernels.int4.tl_helpers`
(Triton device helpers), :mod:`~kvlib.kernels.int4.reference` (torch references),
:mod:`~kvlib.kernels.int4.protected` (the INT8 side-buffer region), :mod:`~kvlib.kernels.int4.region` (the
main-region kernel), :mod:`~kvlib.kernels.int4.launch` (the launcher and split planner) and
:mod:`~kvlib.kernels.int4.paged` (the same decode over a vLLM-style paged pool). This module re-exports their
public names (the family's face: ``from kvlib.kernels.int4.decode import ...``), and holds the paged dispatcher
(:func:`kv4_paged_decode`: the warp-specialised kernel of :mod:`~kvlib.kernels.int4.wspec` or the Triton one).
"""

import torch

from kvlib.kernels.int4.config import DEFAULT_CONFIG, MIN_ROWS, KV4KernelConfig
from kvlib.kernels.int4.launch import (
    KV4Launch,
    SideBuffer,
    default_num_splits,
    fuse_merge_applies,
    kv4_main_decode,
    pipe_edges_applies,
    plan_kv4_decode,
    tma_applies,
    tma_refusal,
)
from kvlib.kernels.int4.paged import kv4_paged_decode as _kv4_paged_decode_triton
from kvlib.kernels.int4.paged import kv4_paged_decode_ref, plan_kv4_paged_decode
from kvlib.kernels.int4.query import QueryInt8, prepare_query, prepare_query_ref
from kvlib.kernels.int4.reference import kv4_main_decode_ref, region_attention_ref
from kvlib.kernels.int4.tl_helpers import LN2, LOG2E

__all__ = [
    "DEFAULT_CONFIG", "KV4KernelConfig", "KV4Launch", "LN2", "LOG2E", "MIN_ROWS", "QueryInt8", "SideBuffer",
    "default_num_splits", "fuse_merge_applies",
    "kv4_main_decode", "kv4_main_decode_ref", "kv4_paged_decode", "kv4_paged_decode_ref", "pipe_edges_applies",
    "plan_kv4_decode", "plan_kv4_paged_decode", "prepare_query", "prepare_query_ref", "region_attention_ref",
    "tma_applies", "tma_refusal",
]


def kv4_paged_decode(qp: QueryInt8, k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
                     v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor, block_table: torch.Tensor,
                     start: torch.Tensor, end: torch.Tensor, *, block_size: int, side: SideBuffer | None = None,
                     config: KV4KernelConfig | None = None, sm_scale: float | None = None,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """KV4 / KV4-RL decode over a paged pool, the family's dispatcher: ``(o [B, Hq, d] fp32, lse [B, Hq])``.

    ``backend="auto"`` without a Triton ``config`` takes the warp-specialised kernel
    (:func:`kvlib.kernels.int4.wspec.wspec4_decode` with :data:`~kvlib.kernels.int4.wspec.DISPATCH_CONFIG`) where
    :func:`~kvlib.kernels.int4.wspec.wspec4_unsupported` says it applies (KV4 on a Hopper GPU), else the Triton paged
    kernel (:func:`kvlib.kernels.int4.paged.kv4_paged_decode`: its ``backend`` values ``"auto"``, ``"triton"``,
    ``"torch"``); ``backend="wspec"`` asks for the warp-specialised kernel and raises ValueError where it cannot
    run. Lives here, not in ``paged``, so that the family imports one way (``wspec`` reads ``paged``'s checks)."""
    args = (qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end)
    if backend == "wspec" or (backend == "auto" and config is None):
        from kvlib.kernels.int4 import wspec as W

        why = W.wspec4_unsupported(qp, k_codes, block_table, block_size=block_size, side=side)
        if backend == "wspec" and why:
            raise ValueError(f"backend='wspec': {why}")
        if not why:  # KV4-RL reaches here only where DISPATCH_CONFIG_RL opts in (read now, not at import)
            cfg = W.DISPATCH_CONFIG if side is None else W.DISPATCH_CONFIG_RL
            return W.wspec4_decode(*args, block_size=block_size, side=side, sm_scale=sm_scale,
                                   config=W.WSpec4Config(**cfg))
    return _kv4_paged_decode_triton(*args, block_size=block_size, side=side, config=config, sm_scale=sm_scale,
                                    backend=backend)
