"""The Triton kernel behind :meth:`kvlib.storage.blocks.PageTable.step_addresses` (one program per row)."""

from __future__ import annotations

import triton
import triton.language as tl


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
