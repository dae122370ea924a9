"""KIVI-style 2-bit baseline: keys per-channel (groups of ``group`` tokens), values per-token (groups of
``group`` channels), with a full-precision (fp16) residual window of recent tokens.

Tokens accumulate in the fp16 residual; whenever it holds ``residual`` tokens they are quantised as a
block (``residual`` must be a multiple of ``group``), as in the KIVI reference implementation. So the
newest ``n mod residual`` tokens are always exact-ish (fp16) and older ones are 2-bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlib.core.checks import check_group, check_positive_int, check_tensor
from kvlib.formats.base import KVFormat, register_format
from kvlib.formats.kv4 import check_side, fp16_round

LEVELS = 3  # 2-bit codes 0..3


def _pack2(c: torch.Tensor) -> torch.Tensor:
    c = c.to(torch.uint8)
    return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)


def _unpack2(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([(p >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(*p.shape[:-1], 4 * p.shape[-1])


def _affine2(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-bit affine quantisation reducing over ``dim``: codes uint8, fp16 scale and zero (min)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    m = fp16_round(lo, "down")
    delta = fp16_round((hi - m.float()) / LEVELS, "up")
    df = delta.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    c = torch.round((x - m.float()) / safe).clamp_(0, LEVELS).to(torch.uint8)
    return c, delta, m


@dataclass
class KiviPacked:
    """``codes`` uint8 ``[n_q, d//4]``; ``scale``/``zero`` fp16 (keys ``[n_q//group, d]``, values ``[n_q, d//group]``);
    ``residual`` fp16 ``[r, d]`` with ``r < residual_len``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    residual: torch.Tensor
    side: int
    group: int

    @property
    def length(self) -> int:
        return self.codes.shape[0] + self.residual.shape[0]


@register_format("kivi2")
class KiviFormat(KVFormat):
    """2-bit KIVI-style format (default ``group=32``, ``residual=128``)."""

    stateful = True
    deterministic = True
    bounded = True

    options: ClassVar[tuple[str, ...]] = ("group", "residual")
    max_abs: ClassVar[float] = 65504.0  # fp16 residual window, scales and zero points

    def __init__(self, group: int = 32, residual: int = 128) -> None:
        check_positive_int("group", group)
        check_positive_int("residual", residual)
        if residual % group:
            raise ValueError(f"group={group}, residual={residual}: the residual window is quantised in blocks of "
                             "group tokens, so residual must be a multiple of group (pick a group dividing it, or pass "
                             "residual=)")
        self.group, self.residual_len = group, residual

    def _quantize_block(self, x: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, d = x.shape
        g = self.group
        if side == 0:  # per channel, over groups of g tokens
            c, s, z = _affine2(x.reshape(n // g, g, d), dim=1)
            return _pack2(c.reshape(n, d)), s.reshape(n // g, d), z.reshape(n // g, d)
        c, s, z = _affine2(x.reshape(n, d // g, g), dim=2)
        return _pack2(c.reshape(n, d)), s.reshape(n, d // g), z.reshape(n, d // g)

    def write(self, x: torch.Tensor, side: int = 0, **ctx: Any) -> KiviPacked:
        return self.append(None, x, side=side, **ctx)

    def append(self, packed: KiviPacked | None, x: torch.Tensor, side: int = 0, **ctx: Any) -> KiviPacked:
        check_tensor("x", x, ndim=2, floating=True)
        side = check_side(side)
        d = x.shape[1]
        if d % 4:
            raise ValueError(f"x: head dim must be a multiple of 4 to pack 2-bit codes, got {d}")
        if side == 1:
            check_group("group", self.group, d)
        if not torch.isfinite(x).all():
            raise ValueError("x must be finite to quantise")
        if packed is None:
            width = d if side == 0 else d // self.group
            packed = KiviPacked(
                codes=torch.zeros(0, d // 4, dtype=torch.uint8, device=x.device),
                scale=torch.zeros(0, width, dtype=torch.float16, device=x.device),
                zero=torch.zeros(0, width, dtype=torch.float16, device=x.device),
                residual=torch.zeros(0, d, dtype=torch.float16, device=x.device),
                side=side,
                group=self.group,
            )
        res = torch.cat([packed.residual, x.to(torch.float16)])
        n_full = (res.shape[0] // self.residual_len) * self.residual_len
        if n_full:
            c, s, z = self._quantize_block(res[:n_full].float(), packed.side)
            packed.codes = torch.cat([packed.codes, c])
            packed.scale = torch.cat([packed.scale, s])
            packed.zero = torch.cat([packed.zero, z])
        packed.residual = res[n_full:]
        return packed

    def read(self, packed: KiviPacked) -> torch.Tensor:
        # the quantised part changes only when a residual window is flushed (new codes/scale/zero tensors), yet is
        # read at every decode step: its dequantisation is kept on the object until then
        memo = packed.__dict__.get("_quant_read")
        if memo is not None and memo[0] is packed.codes and memo[1] is packed.scale and memo[2] is packed.zero:
            q = memo[3]
        else:
            c = _unpack2(packed.codes).float()
            n, d = c.shape
            g = packed.group
            if packed.side == 0:
                q = c.reshape(n // g, g, d) * packed.scale.float().unsqueeze(1) + packed.zero.float().unsqueeze(1)
            else:
                q = c.reshape(n, d // g, g) * packed.scale.float().unsqueeze(-1) + packed.zero.float().unsqueeze(-1)
            q = q.reshape(n, d)
            packed.__dict__["_quant_read"] = (packed.codes, packed.scale, packed.zero, q)
        return torch.cat([q, packed.residual.float()])

    def bytes_per_position(self, d: int) -> float:
        """2-bit codes + fp16 scale/zero per group (same for K and V); excludes the bounded fp16 residual."""
        check_group("group", self.group, d)
        return d / 4 + 4 * d / self.group

    def error_bound(self, packed: KiviPacked, x_hat: torch.Tensor) -> torch.Tensor:
        """Residual window: fp16 rounding. Quantised part: half a 2-bit step of the fp16 input, plus that
        input's own fp16 rounding, plus fp32 slack. Keys (side 0) only: the scales here are per channel."""
        from kvlib.core.fp16 import FP16_REL, FP16_SUB
        from kvlib.formats.rtn_int8 import FP32_REL

        if packed.side != 0:
            raise ValueError("packed: the KIVI error bound is for keys (side 0), got a value stream")
        kh = x_hat.to(torch.float64).abs()
        n_q, d = packed.codes.shape[0], x_hat.shape[-1]
        e = kh * FP16_REL + FP16_SUB
        if n_q:
            half = 0.5 * packed.scale.to(torch.float64).repeat_interleave(packed.group, dim=0)[:, :d]  # [n_q, d]
            zero = packed.zero.to(torch.float64).abs().repeat_interleave(packed.group, dim=0)[:, :d]
            quant = half * (1.0 + FP32_REL) + FP32_REL * (kh[:n_q] + zero)
            e = e.clone()
            e[:n_q] = quant + (kh[:n_q] + half) * FP16_REL + FP16_SUB
        return e
