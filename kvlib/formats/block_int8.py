"""The paper body's block format: dithered INT8 with one fp16 scale per channel per 256-token block.

``s[b, c] = fp16(amax_{t in block b} |x[t, c]| / 126.5)``, codes and dither exactly as dither-int8
(same Philox counters, by slot), read ``s (c - xi)``. A trailing partial block gets its own amax.
Offline format: a block's scale needs the whole block, so tokens cannot be appended one by one
(the paper's deployment holds the active block's tail in fp16; the paged WitCert path uses
per-token group scales instead). Bytes per position: ``d + 2 d / 256`` (129 B at d = 128).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlib.core.checks import check_positive_int
from kvlib.core.philox import dither
from kvlib.formats.base import KVFormat, register_format
from kvlib.formats.dither_int8 import QMAX, SCALE_DIV
from kvlib.formats.rtn_int8 import check_input


@dataclasses.dataclass
class BlockInt8Packed:
    codes: torch.Tensor  # int8 [S, d]
    scales: torch.Tensor  # fp16 [ceil(S / block), d]
    slots: torch.Tensor  # int64 [S]
    block: int = 256
    layer: int = 0
    kv_head: int = 0
    seed: int = 0
    side: int = 0


@register_format("block-int8")
class BlockInt8(KVFormat):
    """Dithered INT8, per-256-token-block per-channel fp16 scales (paper body)."""

    stateful = True

    options = ("block",)

    def __init__(self, block: int = 256) -> None:
        self.block = check_positive_int("block", block)

    def _xi(self, slots: torch.Tensor, d: int, ctx: dict[str, Any]) -> torch.Tensor:
        return dither(slots, d, layer=ctx["layer"], kv_head=ctx["kv_head"], seed=ctx["seed"], side=ctx["side"])

    def write(self, x: torch.Tensor, **ctx: Any) -> BlockInt8Packed:
        x32 = check_input(x, 1)
        S, d = x32.shape
        slots = ctx.get("slots")
        slots = torch.arange(S, dtype=torch.int64) if slots is None else slots.to(torch.int64)
        if slots.shape != (S,):
            raise ValueError(f"slots must have length S={S}, got {tuple(slots.shape)}")
        c = {k: ctx.get(k, 0) for k in ("layer", "kv_head", "seed", "side")}
        nb = -(-S // self.block)
        pad = torch.zeros(nb * self.block - S, d)
        amax = torch.cat([x32.abs(), pad]).unflatten(0, (nb, self.block)).amax(1)  # [nb, d]
        s16 = (amax / SCALE_DIV).to(torch.float16)
        low = s16.float() * QMAX < amax
        s16 = torch.where(low, (s16.view(torch.int16) + 1).view(torch.float16), s16)
        if not bool(torch.isfinite(s16).all()):
            raise ValueError("x has values too large for an fp16 scale")
        s = s16.float().repeat_interleave(self.block, 0)[:S]
        xi = self._xi(slots, d, c).to(x32.device)
        y = x32 / torch.where(s == 0, torch.ones_like(s), s) + xi
        codes = torch.where(s == 0, torch.zeros_like(y), torch.round(y).clamp(-QMAX, QMAX)).to(torch.int8)
        return BlockInt8Packed(codes, s16, slots, self.block, **c)

    def read(self, packed: BlockInt8Packed) -> torch.Tensor:
        S, d = packed.codes.shape
        c = dict(layer=packed.layer, kv_head=packed.kv_head, seed=packed.seed, side=packed.side)
        xi = self._xi(packed.slots, d, c).to(packed.codes.device)
        s = packed.scales.float().repeat_interleave(packed.block, 0)[:S]
        return s * (packed.codes.float() - xi)

    def append(self, packed: Any, x: torch.Tensor, **ctx: Any) -> Any:
        if packed is None:
            return self.write(x, **ctx)
        raise NotImplementedError("block-int8 is an offline format: a block scale needs the whole block")

    def bytes_per_position(self, d: int) -> float:
        return float(d + 2 * d / self.block)

    def nbytes(self, packed: BlockInt8Packed) -> int:
        return sum(t.numel() * t.element_size() for t in (packed.codes, packed.scales))
