"""Round-to-nearest INT8 with per-token, per-group fp16 scales (``s = fp16(amax / 127)``).

The deterministic comparison format: same layout and bytes as dither-int8 without outliers, but
its error ``s (rne(x/s) - x/s)`` is a deterministic function of ``x`` (not input-independent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from kvlib.core.checks import check_group, check_tensor
from kvlib.formats.base import KVFormat, per_token, register_format
from kvlib.formats.dither_int8 import check_x


def absmax_scales(x32: torch.Tensor, group: int, qmax: float) -> torch.Tensor:
    """fp16 ``[..., d // group]`` scales ``fp16(amax / qmax)``; bumped to the next fp16 up only where
    rounding (subnormal scales) would push ``|x / s|`` past ``qmax + 1/2`` (clipping)."""
    amax = x32.abs().unflatten(-1, (-1, group)).amax(-1)
    s16 = (amax / qmax).to(torch.float16)
    low = s16.to(torch.float32) * (qmax + 0.5) < amax
    if bool(low.any()):
        s16 = torch.where(low, (s16.view(torch.int16) + 1).view(torch.float16), s16)
    if not bool(torch.isfinite(s16).all()):
        raise ValueError("x has values too large for an fp16 scale")
    return s16


def expand_scales(s16: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 per-channel view of per-group fp16 scales."""
    return s16.to(torch.float32).repeat_interleave(group, dim=-1)


def safe_div(x32: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x / s`` with 0 where ``s == 0`` (an all-zero group)."""
    return torch.where(s == 0, torch.zeros_like(x32), x32 / torch.where(s == 0, torch.ones_like(s), s))


@dataclasses.dataclass
class Int8Packed:
    """int8 codes and fp16 group scales (shared by rtn-int8 and sr-int8)."""

    codes: torch.Tensor = per_token()  # int8 [S, d]
    scales: torch.Tensor = per_token()  # fp16 [S, d // group]
    group: int = 32


def check_input(x: Any, group: int) -> torch.Tensor:
    check_x(x)
    check_tensor("x", x, ndim=2)
    check_group("group", group, x.shape[-1])
    return x.to(torch.float32)


class GroupScaledFormat(KVFormat):
    """Base of the one-byte-per-element formats with per-token, per-group fp16 scales ``amax / qmax``
    (rtn-int8, sr-int8, fp8-e4m3): the option, the scaling, the read and the byte account are shared;
    a subclass sets ``qmax``, rounds in ``write`` and, if its codes are not integers, overrides
    :meth:`code_values`."""

    deterministic = True

    options = ("group",)
    #: the largest code magnitude, mapped to each group's amax
    qmax: ClassVar[float] = 127.0

    @property
    def max_abs(self) -> float:  # type: ignore[override]
        return 65504.0 * self.qmax  # the fp16 scale amax / qmax stays finite

    def __init__(self, group: int = 32) -> None:
        self.group = group

    def scaled(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked ``x / s`` per channel (fp32, 0 in all-zero groups) and the fp16 group scales ``s``."""
        x32 = check_input(x, self.group)
        s16 = absmax_scales(x32, self.group, self.qmax)
        return safe_div(x32, expand_scales(s16, self.group)), s16

    def code_values(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 value of stored codes (before scaling)."""
        return codes.to(torch.float32)

    def read(self, packed: Any) -> torch.Tensor:
        c = self.code_values(packed.codes)  # the same products as expand_scales(s) * c, without the expansion
        return (c.unflatten(-1, (-1, packed.group)) * packed.scales.to(torch.float32).unsqueeze(-1)).flatten(-2)

    def bytes_per_position(self, d: int) -> float:
        check_group("group", self.group, d)
        return float(d + 2 * (d // self.group))


#: generous relative slack of a few fp32 operations (divide, multiply, add) in write and read
FP32_REL = 2.0**-22


def scaled_bound(packed: Any, x_hat: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """float64 ``E = s step(|x_hat|/s) (1 + eps32) + eps32 |x_hat|`` of a group-scaled packed object, where
    ``step(y)`` bounds the rounding error in scale units at scaled magnitude ``y``."""
    kh = x_hat.to(torch.float64).abs()
    s = packed.scales.to(torch.float64).repeat_interleave(packed.group, dim=-1)  # [S, d]
    y = torch.where(s > 0, kh / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(kh))
    return s * step(y) * (1.0 + FP32_REL) + FP32_REL * kh


@register_format("rtn-int8")
class RtnInt8(GroupScaledFormat):
    """Deterministic round-to-nearest INT8, per-token per-group fp16 scale.

    The INT8 decode kernels read it in their RTN-key mode (a pool side with ``dithered=False``: no dither, and no
    certificate, so ``cert=False``).
    """

    bounded = True
    kernel = "int8"
    batch_heads = True

    def error_bound(self, packed: Int8Packed, x_hat: torch.Tensor) -> torch.Tensor:
        """Half a step: ``|x/s| <= 127.5`` (scales ``amax/127``, bumped), so the clamp error is <= 1/2 too."""
        return scaled_bound(packed, x_hat, lambda y: torch.full_like(y, 0.5))

    def write(self, x: torch.Tensor, **ctx: Any) -> Int8Packed:
        y, s16 = self.scaled(x)
        c = torch.round(y).clamp(-127, 127)
        return Int8Packed(c.to(torch.int8), s16, self.group)
