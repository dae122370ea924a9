"""A paged INT8 pool built as a serving engine's block manager would: shuffled, non-contiguous pages, ragged lengths."""

from __future__ import annotations

import dataclasses

import torch

from kvlib.kernels.int8.decode import make_pool_side
from kvlib.kernels.tl.paging import allocate_blocks


def paged_problem(lens, block_size, *, hq, hkv, d, dev, layout="w24", k_out=False, v_out=False, v_dither=False,
                  seed, layer, qdtype=torch.float32, extra_blocks=5):
    """``(q, k_pool, v_pool, block_table, seq_lens, token_slots, K)``; ``K`` ``[T, H_kv, d]`` the keys in token order
    (request 0's positions first), ``token_slots[b]`` request ``b``'s slots. Requests of length ``lens``."""
    g = torch.Generator().manual_seed(len(lens) * 1000 + block_size * 10 + hq + d)
    need = sum(-(-n // block_size) for n in lens)
    num_blocks = need + extra_blocks
    table, tok = allocate_blocks(lens, block_size, num_blocks=num_blocks, generator=g)
    slot_ids = torch.cat(tok)
    T = slot_ids.numel()
    K = torch.randn(T, hkv, d, generator=g)
    K[:, :, 9] *= 25  # a massive channel, bypassed where k_out
    V = torch.randn(T, hkv, d, generator=g)
    koc = torch.stack([torch.tensor([8, 9]) + 16 * h for h in range(hkv)]) if k_out else None
    voc = torch.stack([torch.tensor([0, 3, 33]) for _ in range(hkv)]) if v_out else None
    n_slots = num_blocks * block_size
    kp = make_pool_side(K, layer=layer, seed=seed, side=0, n_slots=n_slots, slot_ids=slot_ids, outlier_channels=koc,
                        dither_layout=layout)
    vp = make_pool_side(V, layer=layer, seed=seed, side=1, n_slots=n_slots, slot_ids=slot_ids, outlier_channels=voc,
                        dithered=v_dither)
    q = (2 * torch.randn(len(lens), hq, d, generator=g)).to(qdtype)
    mv = lambda s: dataclasses.replace(s, codes=s.codes.to(dev), scales=s.scales.to(dev),  # noqa: E731
                                       outliers=None if s.outliers is None else s.outliers.to(dev),
                                       outlier_channels=None if s.outlier_channels is None
                                       else s.outlier_channels.to(dev))
    seq = torch.tensor(lens, dtype=torch.int32)
    return q.to(dev), mv(kp), mv(vp), table.to(dev), seq.to(dev), tok, K


def slot_table(tok, dev):
    """The per-token slot table ``[B, max_len]`` int32 of ``token_slots`` (padded with 0), built without the block
    table: an independent check of the kernels' ``block_table[b, t // bs] * bs + t % bs``."""
    L = max(t.numel() for t in tok)
    out = torch.zeros(len(tok), L, dtype=torch.int32)
    for b, t in enumerate(tok):
        out[b, :t.numel()] = t.to(torch.int32)
    return out.to(dev)
