"""A decode step's addressing in one launch: :meth:`kvlib.storage.blocks.PageTable.step_addresses` (the torch
reference) as a Triton kernel, one program per row (dispatched by :func:`kvlib.backends.base.step_addresses`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlib.storage.blocks import PageTable


@triton.jit
def step_addresses_kernel(bt_ptr, lens_ptr, wpos_ptr, tok_ptr, out_ptr, B, sbt, stok,
                          BS: tl.constexpr, TOKEN: tl.constexpr):
    b = tl.program_id(0)
    p = tl.load(lens_ptr + b).to(tl.int64)
    if TOKEN:
        w = tl.load(wpos_ptr + b).to(tl.int64)  # token-slot mode: the row's own append-only write index
    else:
        w = p
    blk = tl.load(bt_ptr + b * sbt + w // BS).to(tl.int64)
    slot = blk * BS + w % BS
    if TOKEN:
        tl.store(tok_ptr + b * stok + p, slot.to(tl.int32))
    tl.store(out_ptr + b, b.to(tl.int64))
    tl.store(out_ptr + B + b, p)
    tl.store(out_ptr + 2 * B + b, slot)
    tl.store(out_ptr + 3 * B + b, p + 1)


def launch_step_addresses(table: PageTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, pos, slots, lens_after)`` int64 ``[B]`` of ``table``'s next decode step (recorded in ``tok`` in
    token-slot mode), without advancing, in one launch; nothing is read back to the host."""
    out = torch.empty(4, table.batch, dtype=torch.int64, device=table.seq_lens.device)
    if table.batch:
        bt = table.block_table
        tok = table.tok if table.token_slots else table.seq_lens  # unused pointer without token slots
        step_addresses_kernel[(table.batch,)](bt, table.seq_lens, table.wpos, tok, out, table.batch, bt.stride(0),
                                              tok.stride(0) if table.token_slots else 0, BS=table.block_size,
                                              TOKEN=table.token_slots, num_warps=1)
    return out[0], out[1], out[2], out[3]
