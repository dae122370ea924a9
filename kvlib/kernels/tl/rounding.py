"""Rounding in Triton spelled with exact operations, so the CPU interpreter (no libdevice) rounds as the GPU does."""

import triton
import triton.language as tl


@triton.jit
def rne(y):
    """Round half to even for |y| < 2^23, exact (floor, compare, parity)."""
    f = tl.floor(y)
    r = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (r > 0.5) | ((r == 0.5) & odd)
    return f + up.to(tl.float32)
