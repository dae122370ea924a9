"""Unquantised reference formats: ``fp32`` (bit-exact identity) and ``fp16``/``bf16`` (plain casts).

``fp32`` is the control of every adapter test: a cache holding it must reproduce the uncached model
bit for bit. The 16-bit ones are the usual serving baselines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlib.core.checks import check_tensor
from kvlib.formats.base import KVFormat, per_token, register_format


@dataclass
class Plain:
    """Tokens stored as they are, in the format's dtype."""

    data: torch.Tensor = per_token()


class _Cast(KVFormat):
    deterministic = True
    dtype: torch.dtype = torch.float32

    def write(self, x: torch.Tensor, **ctx: Any) -> Plain:
        check_tensor("x", x, ndim=2, floating=True)
        return Plain(x.to(self.dtype).clone() if x.dtype == self.dtype else x.to(self.dtype))

    def read(self, packed: Plain) -> torch.Tensor:
        return packed.data.to(torch.float32)

    def bytes_per_position(self, d: int) -> float:
        return float(d * torch.empty((), dtype=self.dtype).element_size())


@register_format("fp32")
class FP32(_Cast):
    """Identity: float32 in, the same float32 out."""

    kernel = "bf16"  # the 16-bit kernel also reads fp32 pools (fp32 dots: kvlib.kernels.bf16.decode)
    dtype = torch.float32


@register_format("fp16")
class FP16(_Cast):
    """IEEE half precision storage."""

    kernel = "bf16"

    dtype = torch.float16
    max_abs = 65504.0


@register_format("bf16")
class BF16(_Cast):
    """bfloat16 storage."""

    kernel = "bf16"

    dtype = torch.bfloat16
    max_abs = float(torch.finfo(torch.bfloat16).max)
