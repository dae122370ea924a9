"""The certificate's small device functions, shared by every INT8 decode kernel (fma, tc, h10).

Each is a rounding rule the soundness argument of ``book/witcert_certificate/theorem.md`` relies on, so
it lives once: the float64 reference (:mod:`kvlib.certify.bound`, :func:`kvlib.kernels.int8.decode.decode_reference`)
mirrors exactly these.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def union_radius(seq_len, log_2_over_delta, rad_extra):
    """``sqrt(2 ln(2 N / delta)) + slack``, ``N`` the row's own length.

    (:func:`kvlib.certify.bound.radius_multiplier`.)
    """
    return tl.sqrt(2.0 * (tl.log(tl.maximum(seq_len, 1).to(tl.float32)) + log_2_over_delta)) + rad_extra


@triton.jit
def abs_up_fp16(x):
    """``|x|`` rounded UP to fp16: its product with an exact fp16 ``|k|`` is then an upper bound."""
    a = tl.abs(x)
    a16 = a.to(tl.float16)
    return tl.where(a16.to(tl.float32) < a, (a16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), a16)


@triton.jit
def split_fp16(x):
    """``(hi, lo)`` fp16 with ``x - hi`` exact in fp32 and ``lo = fp16(x - hi)`` (what remains is ``<= 2^-22 |x|``)."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)
