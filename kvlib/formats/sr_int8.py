"""Stochastic-rounding INT8: ``c = floor(x/s + u)``, ``u`` uniform on [0, 1), read ``s c`` (no subtraction).

Unbiased but its residual is only bounded by ``s`` with sub-Gaussian proxy ``s^2/4`` (vs ``s^2/12``
for subtractive dither): the comparison that shows why the certificate needs subtractive dither.
``u`` comes from the same Philox stream as the dither (``u = xi + 1/2``), so runs are reproducible.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlib.core.dither_tables import cached_dither
from kvlib.formats.base import register_format
from kvlib.formats.rtn_int8 import GroupScaledFormat, Int8Packed


@register_format("sr-int8")
class SrInt8(GroupScaledFormat):
    """Stochastic rounding INT8, per-token per-group fp16 scale ``amax / 127``."""

    variance_proxy = "sr"
    deterministic = False

    def write(self, x: torch.Tensor, **ctx: Any) -> Int8Packed:
        y, s16 = self.scaled(x)
        S, d = y.shape
        slots = ctx.get("slots")
        if slots is None:
            slots = torch.arange(S, dtype=torch.int64)
        # the slot-indexed tables on the CPU (bit for bit dither(slots, ...)); dither itself elsewhere
        u = cached_dither(slots, d, layer=ctx.get("layer", 0), kv_head=ctx.get("kv_head", 0), seed=ctx.get("seed", 0),
                          side=ctx.get("side", 0)).to(y.device) + 0.5
        c = torch.floor(y + u).clamp(-127, 127)
        return Int8Packed(c.to(torch.int8), s16, self.group)
