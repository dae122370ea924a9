"""Deterministic fp8 (e4m3fn) with per-token, per-group fp16 scales ``amax / 448``.

Round-to-nearest-even into e4m3 (torch's cast): the kind of deterministic fp8 KV cache a
production engine ships, whose error is a deterministic function of the input (no certificate).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlib._checks import check_group
from kvlib.formats.base import KVFormat, per_token, register_format
from kvlib.formats.rtn_int8 import absmax_scales, check_input, expand_scales, safe_div

E4M3_MAX = 448.0


@dataclasses.dataclass
class Fp8Packed:
    codes: torch.Tensor = per_token()  # uint8 [S, d] (e4m3fn bit patterns)
    scales: torch.Tensor = per_token()  # fp16 [S, d // group]
    group: int = 32


@register_format("fp8-e4m3")
class Fp8E4m3(KVFormat):
    """fp8 e4m3fn codes, per-token per-group fp16 scale."""

    options = ("group",)

    def __init__(self, group: int = 32) -> None:
        self.group = group

    def write(self, x: torch.Tensor, **ctx: Any) -> Fp8Packed:
        x32 = check_input(x, self.group)
        s16 = absmax_scales(x32, self.group, E4M3_MAX)
        y = safe_div(x32, expand_scales(s16, self.group)).clamp(-E4M3_MAX, E4M3_MAX)
        return Fp8Packed(y.to(torch.float8_e4m3fn).view(torch.uint8), s16, self.group)

    def read(self, packed: Fp8Packed) -> torch.Tensor:
        y = packed.codes.view(torch.float8_e4m3fn).to(torch.float32)
        return expand_scales(packed.scales, packed.group) * y

    def bytes_per_position(self, d: int) -> float:
        check_group("group", self.group, d)
        return float(d + 2 * (d // self.group))
