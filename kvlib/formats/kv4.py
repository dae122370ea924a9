"""KV4: head-wise affine INT4 (``x̂ = Δ c + m``, ``c ∈ {0..15}``), codes packed two per byte, fp16 ``Δ`` and ``m``.

One (Δ, m) pair per group of ``group`` channels (``None`` = the whole head, as in the paper). Keys are
stored in the Hadamard-rotated basis (``rotate="k"``, the paper's choice; ``"none"`` and ``"kv"`` are
the ablations). ``Δ`` is rounded *up* and ``m`` *down* to fp16 so every input lies in
``[m, m + 15Δ]`` and the reconstruction error is at most ``Δ/2`` (up to fp32 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvlib.core.checks import check_group, check_positive_int, check_tensor
from kvlib.core.hadamard import hadamard
from kvlib.formats.base import KVFormat, per_token, register_format

LEVELS = 15  # 4-bit codes 0..15

_ROTATIONS = ("none", "k", "kv")


@dataclass
class Int4Tensor:
    """Packed INT4 tensor: ``codes`` uint8 ``[..., d//2]`` (even channel in the low nibble),
    ``scale``/``offset`` fp16 ``[..., d//group]``; ``rotated`` says the codes hold ``hadamard(x)``."""

    codes: torch.Tensor = per_token()
    scale: torch.Tensor = per_token()
    offset: torch.Tensor = per_token()
    group: int = 0
    rotated: bool = False

    @property
    def d(self) -> int:
        return 2 * self.codes.shape[-1]


def fp16_round(v: torch.Tensor, direction: str) -> torch.Tensor:
    """Round float32 ``v`` to fp16 towards ``+inf`` (``"up"``) or ``-inf`` (``"down"``)."""
    t = v.to(torch.float16)
    if direction == "up":
        bad = t.float() < v
        t = torch.where(bad, torch.nextafter(t, torch.full_like(t, float("inf"))), t)
    else:
        bad = t.float() > v
        t = torch.where(bad, torch.nextafter(t, torch.full_like(t, float("-inf"))), t)
    return t


def pack_nibbles(c: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in 0..15 ``[..., d]`` (d even) two per byte: channel ``2i`` low, ``2i+1`` high."""
    if c.shape[-1] % 2:
        raise ValueError(f"codes: last dim must be even to pack two per byte, got {c.shape[-1]}")
    c = c.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., d//2]`` -> uint8 ``[..., d]``."""
    check_tensor("codes", p, dtype=torch.uint8)
    return torch.stack((p & 15, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def int4_quantize(x: torch.Tensor, group: int | None = None) -> Int4Tensor:
    """Affine INT4 quantisation of the last dim of ``x`` in groups of ``group`` channels (``None`` = all)."""
    check_tensor("x", x, floating=True)
    if x.ndim == 0:
        raise ValueError("x must have at least one dim")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"x: last dim must be even to pack INT4 codes two per byte, got d={d}")
    g = d if group is None else check_group("group", group, d)
    xf = x.float().reshape(*x.shape[:-1], d // g, g)
    if not torch.isfinite(xf).all():
        raise ValueError("x must be finite to quantise")
    c, delta, m = _affine_int4(xf)
    if not (torch.isfinite(m).all() and torch.isfinite(delta).all()):
        raise ValueError("x exceeds the fp16 range of the INT4 scale/offset")
    codes = pack_nibbles(c.reshape(x.shape).to(torch.uint8))
    return Int4Tensor(codes=codes, scale=delta, offset=m, group=g)


def _affine_int4(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One affine INT4 group per last-dim row of fp32 ``xf``: codes (float, in ``[0, 15]``), fp16 scale ``Δ`` and
    offset ``m`` (rounded down, ``Δ`` up, so every code lands in range)."""
    lo, hi = xf.amin(-1), xf.amax(-1)
    m = fp16_round(lo, "down")
    delta = fp16_round((hi - m.float()) / LEVELS, "up")
    df = delta.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    c = torch.round((xf - m.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, LEVELS)
    return c, delta, m


def int4_quantize_unchecked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`int4_quantize` with one group per row of the last dim, the same operations in the same order, minus
    its finiteness checks (a host sync: a CUDA graph cannot hold one). Packed codes uint8 ``[..., d//2]``, fp16
    scale and offset ``[...]``: what the kv4 pools store, and what the fused write kernel reproduces bit for bit."""
    c, delta, m = _affine_int4(x.float())
    return pack_nibbles(c.to(torch.uint8)), delta, m


def int4_dequantize(qt: Int4Tensor) -> torch.Tensor:
    """float32 reconstruction ``Δ c + m`` of an :class:`Int4Tensor` (in the basis it was stored in)."""
    if not isinstance(qt, Int4Tensor):
        raise TypeError(f"qt must be an Int4Tensor, got {type(qt).__name__}")
    c = unpack_nibbles(qt.codes).float()
    d = c.shape[-1]
    c = c.reshape(*c.shape[:-1], d // qt.group, qt.group)
    x = c * qt.scale.float().unsqueeze(-1) + qt.offset.float().unsqueeze(-1)
    return x.reshape(*c.shape[:-2], d)


def rotates(rotate: str, side: int) -> bool:
    """Whether stream ``side`` (0 keys, 1 values) is Hadamard-rotated under rotation mode ``rotate``."""
    return rotate == "kv" or (rotate == "k" and side == 0)


def check_rotate(rotate: str) -> str:
    if rotate not in _ROTATIONS:
        raise ValueError(f"rotate must be one of {_ROTATIONS}, got {rotate!r}")
    return rotate


def check_side(side: Any) -> int:
    if side not in (0, 1):
        raise ValueError(f"side must be 0 (keys) or 1 (values), got {side!r}")
    return int(side)


@register_format("kv4")
class KV4Format(KVFormat):
    """KV4 storage: affine INT4 per group (default: whole head), fp16 scale/offset, rotated keys.

    ``read`` returns the reconstruction in the original basis (``H`` undone), which is exactly what
    rotating the query by ``H`` and attending in the rotated basis computes.
    """

    deterministic = True
    kernel = "int4"

    options: ClassVar[tuple[str, ...]] = ("group", "rotate")
    default_group: ClassVar[int | None] = None
    max_abs: ClassVar[float] = 65504.0  # the fp16 offset (the group's minimum) and scale
    batch_heads = True

    def _stored_view(self, x: torch.Tensor, side: int) -> torch.Tensor:
        return hadamard(x.float()) if rotates(self.rotate, side) else x

    def surely_representable(self, x: torch.Tensor, side: int = 0) -> torch.Tensor:
        if not rotates(self.rotate, side):
            return self.representable(x, side)
        # |H x|_inf <= ||x||_1 / sqrt(d) (the entries of H are +-1/sqrt(d)), with room for fp32 rounding: no rotation
        return x.float().abs().sum(-1) * (x.shape[-1] ** -0.5 * (1 + 2.0**-10)) <= self.max_abs

    def __init__(self, group: int | None = -1, rotate: str = "k") -> None:
        self.group = self.default_group if group == -1 else group
        if self.group is not None:
            check_positive_int("group", self.group)  # divisibility by the head dim is checked on write
        self.rotate = check_rotate(rotate)

    def write(self, x: torch.Tensor, side: int = 0, **ctx: Any) -> Int4Tensor:
        check_tensor("x", x, ndim=2, floating=True)
        rot = rotates(self.rotate, check_side(side))
        qt = int4_quantize(hadamard(x.float()) if rot else x, self.group)
        qt.rotated = rot
        return qt

    def read(self, packed: Int4Tensor) -> torch.Tensor:
        x = int4_dequantize(packed)
        return hadamard(x) if packed.rotated else x

    def bytes_per_position(self, d: int) -> float:
        g = d if self.group is None else check_group("group", self.group, d)
        return d / 2 + 4 * (d // g)


@register_format("kv4-g32")
class KV4G32Format(KV4Format):
    """KV4 with affine groups of 32 channels (5.00 bits per element at d=128)."""

    kernel = None

    default_group: ClassVar[int | None] = 32


@register_format("kv4-g16")
class KV4G16Format(KV4Format):
    """KV4 with affine groups of 16 channels (6.00 bits per element at d=128)."""

    kernel = None

    default_group: ClassVar[int | None] = 16


_ = field  # keep dataclasses.field importable for subclasses' per-token markers
