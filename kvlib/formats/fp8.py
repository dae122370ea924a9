"""Deterministic fp8 (e4m3fn) with per-token, per-group fp16 scales ``amax / 448``.

Round-to-nearest-even into e4m3 (torch's cast): the kind of deterministic fp8 KV cache a
production engine ships, whose error is a deterministic function of the input (no certificate).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlib.formats.base import per_token, register_format
from kvlib.formats.rtn_int8 import GroupScaledFormat, scaled_bound

E4M3_MAX = 448.0
E4M3_HALF_ULP = 2.0**-4  # half an ulp of a 3-bit mantissa, relative to the magnitude
E4M3_SUB_HALF = 2.0**-10  # half the e4m3 subnormal spacing 2^-9
_E4M3_VALUES = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


@dataclasses.dataclass
class Fp8Packed:
    codes: torch.Tensor = per_token()  # uint8 [S, d] (e4m3fn bit patterns)
    scales: torch.Tensor = per_token()  # fp16 [S, d // group]
    group: int = 32


@register_format("fp8-e4m3")
class Fp8E4m3(GroupScaledFormat):
    """fp8 e4m3fn codes, per-token per-group fp16 scale."""

    qmax = E4M3_MAX
    bounded = True
    batch_heads = True

    def error_bound(self, packed: Fp8Packed, x_hat: torch.Tensor) -> torch.Tensor:
        """RNE to e4m3 in scale units (clamp at 448 included, ``|x/s| <= 448.5``): half an ulp relative plus
        half the subnormal step, taken relative to the stored magnitude ``y`` (hence the ``1/(1 - u)``)."""
        return scaled_bound(packed, x_hat, lambda y: (E4M3_HALF_ULP * y + E4M3_SUB_HALF) / (1.0 - E4M3_HALF_ULP))

    def write(self, x: torch.Tensor, **ctx: Any) -> Fp8Packed:
        y, s16 = self.scaled(x)
        y = y.clamp(-E4M3_MAX, E4M3_MAX)
        return Fp8Packed(y.to(torch.float8_e4m3fn).view(torch.uint8), s16, self.group)

    def code_values(self, codes: torch.Tensor) -> torch.Tensor:
        # a 256-entry table of every e4m3fn bit pattern's value (the same values as the cast, which is slow on CPUs)
        table = _E4M3_VALUES.to(codes.device)
        return table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)
