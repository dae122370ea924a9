"""Where a position of a request lives in the paged pool: a per-token slot table or a vLLM-style block table.

``PAGE == 0``: ``SLOTS`` rows are per-token slot tables ``[B, max_len]``. ``PAGE = block_size > 0``: ``SLOTS`` rows
are block tables ``[B, max_blocks]`` over pages ``[num_blocks, block_size, H_kv, ...]`` flattened to slots, and
position ``t`` of row ``b`` is at ``slot = block_table[b, t // block_size] * block_size + t % block_size`` (the
slot is also the Philox counter of the dithered formats). Positions past the end (``mask`` false) get slot 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlib.core.checks import check_tensor


@triton.jit
def load_slots(ROW, offs_n, mask_n, PAGE: tl.constexpr):
    """int64 slots of positions ``offs_n`` of one request (``ROW``: its table row)."""
    if PAGE > 0:
        # in int32 like the slot table itself (n_slots < 2^31); masked positions read block 0, offset 0
        blk = tl.load(ROW + offs_n // PAGE, mask=mask_n, other=0)
        return tl.where(mask_n, blk * PAGE + offs_n % PAGE, 0).to(tl.int64)
    return tl.load(ROW + offs_n, mask=mask_n, other=0).to(tl.int64)


def request_table(slots, block_table, block_size, batch: int):
    """``(table, page, max_len)`` for a kernel launch from either addressing of the requests.

    ``slots [B, max_len]`` (per-token slots; ``page = 0``) or ``block_table [B, max_blocks]`` int with
    ``block_size`` (``page = block_size``, ``max_len = max_blocks * block_size``): exactly one of the two.
    """
    if (slots is None) == (block_table is None):
        raise ValueError("pass exactly one of slots [B, max_len] and block_table [B, max_blocks] (with block_size)")
    if block_table is None:
        if block_size is not None:
            raise ValueError("block_size goes with block_table, not with slots")
        check_tensor("slots", slots, ndim=2, floating=False)
        if slots.shape[0] != batch:
            raise ValueError(f"slots [B, max_len] must have B={batch} rows, got {tuple(slots.shape)}")
        return slots, 0, slots.shape[1]
    check_tensor("block_table", block_table, ndim=2, dtype=(torch.int32, torch.int64))
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table [B, max_blocks] must have B={batch} rows, got {tuple(block_table.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int with block_table, got {block_size!r}")
    return block_table, block_size, block_table.shape[1] * block_size


def slots_from_block_table(block_table, block_size: int, max_len: int | None = None):
    """The per-token slot table ``[B, max_len]`` (int64) a block table addresses (for the torch references):
    ``slot = block_table[b, t // block_size] * block_size + t % block_size``."""
    _, page, full = request_table(None, block_table, block_size, block_table.shape[0])
    t = torch.arange(full if max_len is None else max_len, device=block_table.device)
    return block_table.to(torch.int64)[:, t // page] * page + t % page


def allocate_blocks(seq_lens, block_size: int, *, num_blocks: int | None = None, generator=None,
                    pad: int = 0):
    """A toy block manager, as a serving engine's would hand tables to the kernels: pages taken from a shuffled
    free list (non-contiguous, out of order), ``ceil(len / block_size)`` per request.

    Returns ``(block_table [B, max_blocks] int32, token_slots)``, ``token_slots[b]`` the int64 slots of request
    ``b``'s positions in order; unused table entries hold ``pad``. ``num_blocks`` (default: what the requests need
    plus a few) is the pool's page count, so the pool has ``num_blocks * block_size`` slots.
    """
    lens = [int(x) for x in seq_lens]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    need = [-(-n // block_size) for n in lens]
    num_blocks = num_blocks if num_blocks is not None else sum(need) + 3
    if sum(need) > num_blocks:
        raise ValueError(f"the requests need {sum(need)} blocks, the pool has num_blocks={num_blocks}")
    free = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.full((len(lens), max(need + [1])), pad, dtype=torch.int32)
    token_slots = []
    for b, (n, nb) in enumerate(zip(lens, need, strict=True)):
        pages = [free.pop() for _ in range(nb)]
        table[b, :nb] = torch.tensor(pages, dtype=torch.int32)
        t = torch.arange(n)
        token_slots.append(table[b, t // block_size].to(torch.int64) * block_size + t % block_size)
    return table, token_slots
