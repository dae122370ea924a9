"""MXFP4 numerical probe (OCP MX): E2M1 values with one E8M0 (power-of-two) scale per 32 elements.

Scale ``2^(floor(log2 amax) - 2)`` so the block maximum lands in E2M1's top binade; values saturate
at ±6. Bits per element ``4 + 8/32 = 4.25``.
"""

from __future__ import annotations

import torch

from kvlib.core.checks import check_group
from kvlib.formats.base import register_format
from kvlib.formats.nvfp4 import Fp4Tensor, _Fp4Format, fp4_blocks, pack_e2m1

MX_BLOCK = 32
E2M1_EMAX = 2  # exponent of E2M1's largest binade (4..6)


def mxfp4_quantize(x: torch.Tensor, block: int = MX_BLOCK) -> Fp4Tensor:
    """MXFP4 of the last dim of ``x [S, d]`` (``block`` must divide ``d``)."""
    _, xb = fp4_blocks(x, block)
    amax = xb.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-38))) - E2M1_EMAX, torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    return Fp4Tensor(
        codes=pack_e2m1(xb, torch.exp2(e)),
        block_scale=(e + 127).to(torch.uint8),
        global_scale=torch.ones(x.shape[0], 0, device=x.device),  # MX has no global scale
        block=block,
        kind="mxfp4",
    )


@register_format("mxfp4")
class MXFP4Format(_Fp4Format):
    """MXFP4 probe (no rotation by default; ``rotate="k"`` for the ablation)."""

    def _quantize(self, x: torch.Tensor) -> Fp4Tensor:
        return mxfp4_quantize(x, MX_BLOCK)

    def bytes_per_position(self, d: int) -> float:
        check_group("block", MX_BLOCK, d)
        return d / 2 + d / MX_BLOCK
