"""NVFP4 numerical probe: E2M1 values, 16-element E4M3 block scales, one fp32 global scale per vector.

Bits per element ``4 + 8/16 + 32/d`` (4.75 at d=128). Also home of the shared E2M1 helpers used by
:mod:`kvlib.formats.mxfp4`. Values are rounded to the nearest E2M1 grid point (ties to even mantissa)
after division by the block scale, saturating at ±6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlib.core.checks import check_group, check_tensor
from kvlib.core.hadamard import hadamard
from kvlib.formats.base import KVFormat, per_token, register_format
from kvlib.formats.kv4 import check_rotate, check_side, pack_nibbles, rotates, unpack_nibbles

#: the non-negative E2M1 magnitudes, indexed by the 3 low code bits
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_MIDS = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float ``v`` to the nearest E2M1 value (ties to even, saturating) -> uint8 codes ``sign<<3 | idx``."""
    a = v.float().abs().clamp(max=E2M1_MAX)
    mids = _MIDS.to(a.device)
    lo = torch.bucketize(a, mids, right=False)  # mids[lo - 1] < a <= mids[lo]
    # a tie (a exactly on the midpoint mids[lo]) goes to the even one of lo, lo + 1 (one search, not two)
    tie = a == mids[lo.clamp(max=len(mids) - 1)]
    idx = torch.where(tie & (lo % 2 == 1), lo + 1, lo)
    sign = (v < 0) & (idx > 0)
    return (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8)


def e2m1_decode(c: torch.Tensor) -> torch.Tensor:
    """float32 value of uint8 E2M1 codes."""
    grid = E2M1_GRID.to(c.device)
    mag = grid[(c & 7).long()]
    return torch.where((c & 8) > 0, -mag, mag)


@dataclass
class Fp4Tensor:
    """Packed FP4 vectors: ``codes`` uint8 ``[S, d//2]``; ``block_scale`` uint8 ``[S, d//block]`` holding
    E4M3 bits (NVFP4) or the biased E8M0 exponent (MXFP4); ``global_scale`` fp32 ``[S]`` (NVFP4;
    MXFP4 holds an empty ``[S, 0]``)."""

    codes: torch.Tensor = per_token()
    block_scale: torch.Tensor = per_token()
    global_scale: torch.Tensor = per_token()
    block: int = 16
    kind: str = "nvfp4"
    rotated: bool = False


def fp4_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked fp32 ``x [S, d]`` and its ``[S, d // block, block]`` view (``block`` must divide ``d``)."""
    check_tensor("x", x, ndim=2, floating=True)
    check_group("block", block, x.shape[-1])
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise ValueError("x must be finite to quantise")
    return xf, xf.unflatten(-1, (-1, block))


def pack_e2m1(xb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of blocks ``xb [S, nb, block]`` divided by their ``scale [S, nb]``, two per byte ``[S, d//2]``."""
    return pack_nibbles(e2m1_encode(xb / scale.unsqueeze(-1)).flatten(-2))


def nvfp4_quantize(x: torch.Tensor, block: int = 16) -> Fp4Tensor:
    """NVFP4 of the last dim of ``x [S, d]``: global ``s_g = amax/(6·448)``, E4M3 block scales, E2M1 values."""
    xf, xb = fp4_blocks(x, block)
    amax = xf.abs().amax(-1)
    sg = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    bs = (xb.abs().amax(-1) / E2M1_MAX / sg.unsqueeze(-1)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = bs.float() * sg.unsqueeze(-1)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    return Fp4Tensor(
        codes=pack_e2m1(xb, safe), block_scale=bs.view(torch.uint8), global_scale=sg, block=block, kind="nvfp4"
    )


def fp4_dequantize(qt: Fp4Tensor) -> torch.Tensor:
    """float32 reconstruction of an NVFP4 or MXFP4 :class:`Fp4Tensor`."""
    if not isinstance(qt, Fp4Tensor):
        raise TypeError(f"qt must be an Fp4Tensor, got {type(qt).__name__}")
    vals = e2m1_decode(unpack_nibbles(qt.codes))
    s, d = vals.shape
    if qt.kind == "nvfp4":
        scale = qt.block_scale.view(torch.float8_e4m3fn).float() * qt.global_scale.float().unsqueeze(-1)
    else:
        scale = torch.exp2(qt.block_scale.float() - 127.0)
    return (vals.reshape(s, d // qt.block, qt.block) * scale.unsqueeze(-1)).reshape(s, d)


class _Fp4Format(KVFormat):
    deterministic = True
    batch_heads = True
    options: ClassVar[tuple[str, ...]] = ("rotate",)

    def __init__(self, rotate: str = "none") -> None:
        self.rotate = check_rotate(rotate)

    def _quantize(self, x: torch.Tensor) -> Fp4Tensor:
        raise NotImplementedError

    def write(self, x: torch.Tensor, side: int = 0, **ctx: Any) -> Fp4Tensor:
        check_tensor("x", x, ndim=2, floating=True)
        rot = rotates(self.rotate, check_side(side))
        qt = self._quantize(hadamard(x.float()) if rot else x)
        qt.rotated = rot
        return qt

    def read(self, packed: Fp4Tensor) -> torch.Tensor:
        x = fp4_dequantize(packed)
        return hadamard(x) if packed.rotated else x


@register_format("nvfp4")
class NVFP4Format(_Fp4Format):
    """NVFP4 probe (no rotation by default; ``rotate="k"`` for the ablation)."""

    def _quantize(self, x: torch.Tensor) -> Fp4Tensor:
        return nvfp4_quantize(x, 16)

    def bytes_per_position(self, d: int) -> float:
        check_group("block", 16, d)
        return d / 2 + d / 16 + 4
