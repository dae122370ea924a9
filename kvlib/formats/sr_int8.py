"""Stochastic-rounding INT8: ``c = floor(x/s + u)``, ``u`` uniform on [0, 1), read ``s c`` (no subtraction).

Unbiased but its residual is only bounded by ``s`` with sub-Gaussian proxy ``s^2/4`` (vs ``s^2/12``
for subtractive dither): the comparison that shows why the certificate needs subtractive dither.
``u`` comes from the same Philox stream as the dither (``u = xi + 1/2``), so runs are reproducible.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlib._checks import check_group
from kvlib.formats.base import KVFormat, register_format
from kvlib.formats.rtn_int8 import Int8Packed, absmax_scales, check_input, expand_scales, safe_div
from kvlib.philox import dither


@register_format("sr-int8")
class SrInt8(KVFormat):
    """Stochastic rounding INT8, per-token per-group fp16 scale ``amax / 127``."""

    options = ("group",)

    def __init__(self, group: int = 32) -> None:
        self.group = group

    def write(self, x: torch.Tensor, **ctx: Any) -> Int8Packed:
        x32 = check_input(x, self.group)
        S, d = x32.shape
        slots = ctx.get("slots")
        if slots is None:
            slots = torch.arange(S, dtype=torch.int64)
        u = dither(slots, d, layer=ctx.get("layer", 0), kv_head=ctx.get("kv_head", 0), seed=ctx.get("seed", 0),
                   side=ctx.get("side", 0)).to(x32.device) + 0.5
        s16 = absmax_scales(x32, self.group, 127.0)
        c = torch.floor(safe_div(x32, expand_scales(s16, self.group)) + u).clamp(-127, 127)
        return Int8Packed(c.to(torch.int8), s16, self.group)

    def read(self, packed: Int8Packed) -> torch.Tensor:
        return expand_scales(packed.scales, packed.group) * packed.codes.to(torch.float32)

    def bytes_per_position(self, d: int) -> float:
        check_group("group", self.group, d)
        return float(d + 2 * (d // self.group))
