"""KV4-RL: every position in KV4, plus a fixed-capacity INT8 side buffer for sinks and recent positions.

The side buffer has ``sink + recent`` slots: position ``p < sink`` lives in slot ``p`` forever; a later
position ``p`` lives in ring slot ``sink + (p - sink) % recent``. Both copies are written from the
source vector at the same time, so a position leaving the recent window needs no transfer or
re-quantisation (its INT4 entry already exists; its ring slot is simply overwritten). For a stream of
length ``n`` the protected set is ``{p < sink} ∪ {p >= max(sink, n - recent)}`` and the main (INT4)
region is the rest: two disjoint regions covering every position once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlib.core.checks import check_tensor
from kvlib.core.hadamard import hadamard
from kvlib.formats.base import KVFormat, register_format
from kvlib.formats.kv4 import (
    Int4Tensor,
    KV4Format,
    check_rotate,
    check_side,
    fp16_round,
    int4_dequantize,
    rotates,
)

INT8_MAX = 127
_PROTECT = ("int8", "bf16")


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-vector INT8 of the last dim: ``(codes int8, scale fp16)`` with ``|x - s c| <= s/2``."""
    check_tensor("x", x, floating=True)
    codes, scale = int8_quantize_unchecked(x)
    if not torch.isfinite(scale).all():
        raise ValueError("x must be finite and within the fp16 range of the INT8 scale")
    return codes, scale


def int8_quantize_unchecked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int8_quantize` without its checks (a host sync: a CUDA graph cannot hold one); what the kv4rl pools'
    side buffer stores."""
    xf = x.float()
    scale = fp16_round(xf.abs().amax(-1) / INT8_MAX, "up")
    sf = scale.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    return torch.round(xf / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``scale * codes`` (scale per vector, broadcast over the last dim)."""
    return codes.float() * scale.float().unsqueeze(-1)


# The side buffer's semantics, written once: the format, the pools, the kernels' launchers and the analyses call
# these (Triton kernels take ``sink`` and ``recent`` as parameters and apply the same rules).

def is_protected(p, n, sink, recent):
    """Bool: position ``p`` of a stream of length ``n`` is held by the side buffer (``p < sink`` or
    ``p >= max(sink, n - recent)``); ``p`` and ``n`` broadcast (ints or tensors). Unannotated and operators
    only, as :func:`ring_index`: Triton compiles this source too."""
    return (p < sink) | (p >= n - recent)


def protected_mask(n: int, sink: int, recent: int) -> torch.Tensor:
    """Bool ``[n]``: positions held by the side buffer of a stream of length ``n``."""
    return is_protected(torch.arange(n), n, sink, recent)


def ring_index(p, sink, recent):
    """Ring slot of a protected position ``p >= sink``: ``sink + (p - sink) % recent`` (``recent > 0``).

    Operators only, no torch call: the same source serves ints, torch tensors and Triton tensors (the fused write
    kernel :mod:`kvlib.kernels.write.int4` jits this function and :func:`is_protected`), so the rule is written
    once. Python's and Triton's ``%`` agree here because ``p - sink >= 0``."""
    return sink + (p - sink) % recent


def ring_slot(p: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Side-buffer slot of position ``p``: ``p`` for a sink, :func:`ring_index` in the ring (valid only while ``p``
    is protected)."""
    if recent == 0:
        return p.clone()
    return torch.where(p < sink, p, ring_index(p, sink, recent))


def side_count(n: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Occupied side slots of streams of lengths ``n``: ``min(n, sink) + clamp(n - sink, 0, recent)`` (n's dtype)."""
    return n.clamp(max=sink) + (n - sink).clamp(min=0).clamp(max=recent)


def main_range(n: torch.Tensor, sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)``: the positions ``[start, end)`` of streams of lengths ``n`` read from the main (INT4)
    region, between the sinks and the recent window (n's dtype)."""
    start = n.clamp(max=sink)
    return start, torch.maximum(start, n - recent)


def side_positions(lengths: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """int64 ``[B, sink+recent]``: the position held by each side slot after writing ``lengths`` tokens (-1 empty),
    the inverse of :func:`ring_slot`."""
    n = lengths.long().unsqueeze(-1)
    sl = torch.arange(sink + recent, device=lengths.device).unsqueeze(0)
    sink_pos = torch.where(sl < n, sl, torch.full_like(sl, -1))
    r = sl - sink
    # newest p < n with p ≡ sink + r (mod recent) and p >= sink
    last = n - 1 - sink
    p = sink + r + recent * torch.div(last - r, max(recent, 1), rounding_mode="floor")
    ring_ok = (last - r >= 0) & (p >= n - recent)
    ring_pos = torch.where(ring_ok, p, torch.full_like(p, -1))
    return torch.where(sl < sink, sink_pos, ring_pos)


@dataclass
class KV4RLPacked:
    """One (layer, kv_head, side) stream: ``main`` INT4 for all positions; ``side`` slots
    (int8 codes + fp16 ``side_scale``, or bf16 when ``protect="bf16"``) with ``side_pos`` (-1 = empty)."""

    main: Int4Tensor
    side: torch.Tensor
    side_scale: torch.Tensor
    side_pos: torch.Tensor
    length: int
    sink: int
    recent: int
    rotated: bool

    def protected_positions(self) -> torch.Tensor:
        """Sorted positions currently held in the side buffer."""
        return torch.sort(self.side_pos[self.side_pos >= 0]).values


@register_format("kv4rl")
class KV4RLFormat(KVFormat):
    """KV4 main cache + INT8 (or bf16) side buffer of ``sink`` + ``recent`` slots (default 16 + 128)."""

    stateful = True
    deterministic = True
    kernel = "int4"

    options: ClassVar[tuple[str, ...]] = ("sink", "recent", "capacity", "protect", "group", "rotate")
    max_abs: ClassVar[float] = 65504.0  # the KV4 main store's fp16 offset; the INT8 side's scales allow more

    def _stored_view(self, x: torch.Tensor, side: int) -> torch.Tensor:
        return hadamard(x.float()) if rotates(self.rotate, side) else x

    def surely_representable(self, x: torch.Tensor, side: int = 0) -> torch.Tensor:
        if not rotates(self.rotate, side):
            return self.representable(x, side)
        # |H x|_inf <= ||x||_1 / sqrt(d) (the entries of H are +-1/sqrt(d)), with room for fp32 rounding: no rotation
        return x.float().abs().sum(-1) * (x.shape[-1] ** -0.5 * (1 + 2.0**-10)) <= self.max_abs

    def __init__(
        self,
        sink: int = 16,
        recent: int = 128,
        capacity: int | None = None,
        protect: str = "int8",
        group: int | None = None,
        rotate: str = "k",
    ) -> None:
        for name, v in (("sink", sink), ("recent", recent)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        cap = sink + recent if capacity is None else capacity
        if not isinstance(cap, int) or cap < sink + recent:
            raise ValueError(
                f"capacity={cap!r} is smaller than sink + recent = {sink + recent} (the window does not fit)"
            )
        if protect not in _PROTECT:
            raise ValueError(f"protect must be one of {_PROTECT}, got {protect!r}")
        self.sink, self.recent, self.capacity, self.protect = sink, recent, cap, protect
        self.rotate = check_rotate(rotate)
        self.main = KV4Format(group=group, rotate=rotate)

    # -- writing ---------------------------------------------------------------------------------
    def write(self, x: torch.Tensor, side: int = 0, positions: torch.Tensor | None = None, **ctx: Any) -> KV4RLPacked:
        return self.append(None, x, side=side, positions=positions, **ctx)

    def append(
        self,
        packed: KV4RLPacked | None,
        x: torch.Tensor,
        side: int = 0,
        positions: torch.Tensor | None = None,
        **ctx: Any,
    ) -> KV4RLPacked:
        """Write new tokens at the next positions: INT4 entries and, for protected positions, side slots."""
        check_tensor("x", x, ndim=2, floating=True)
        s_new, d = x.shape
        start = 0 if packed is None else packed.length
        expect = torch.arange(start, start + s_new)
        if positions is not None:
            check_tensor("positions", positions, ndim=1, floating=False)
            if positions.shape[0] != s_new or not torch.equal(positions.cpu().long(), expect):
                raise ValueError(
                    f"positions must be consecutive from the stream length {start}, got {positions.tolist()[:8]}..."
                )
        rot = rotates(self.rotate, check_side(side))
        xr = hadamard(x.float()) if rot else x.float()
        new_main = self.main.write(x, side=side)
        if packed is None:
            side_dtype = torch.int8 if self.protect == "int8" else torch.bfloat16
            packed = KV4RLPacked(
                main=new_main,
                side=torch.zeros(self.capacity, d, dtype=side_dtype, device=x.device),
                side_scale=torch.ones(self.capacity, dtype=torch.float16, device=x.device),
                side_pos=torch.full((self.capacity,), -1, dtype=torch.int64, device=x.device),
                length=0,
                sink=self.sink,
                recent=self.recent,
                rotated=rot,
            )
        else:
            if packed.side.shape[1] != d:
                raise ValueError(f"x: head dim {d} differs from the stream's {packed.side.shape[1]}")
            m = packed.main
            packed.main = Int4Tensor(
                codes=torch.cat([m.codes, new_main.codes]),
                scale=torch.cat([m.scale, new_main.scale]),
                offset=torch.cat([m.offset, new_main.offset]),
                group=m.group,
                rotated=m.rotated,
            )
        n = start + s_new
        pos = expect.to(x.device)
        # sinks, and only the newest `recent` non-sink positions (older ones would be overwritten anyway)
        keep = is_protected(pos, n, self.sink, self.recent)
        pos_k, x_k = pos[keep], xr[keep]
        if pos_k.numel():
            slots = ring_slot(pos_k, self.sink, self.recent)
            if self.protect == "int8":
                codes, scale = int8_quantize(x_k)
                packed.side[slots] = codes
                packed.side_scale[slots] = scale
            else:
                packed.side[slots] = x_k.to(torch.bfloat16)
            packed.side_pos[slots] = pos_k
        packed.length = n
        return packed

    # -- reading ---------------------------------------------------------------------------------
    def read_side(self, packed: KV4RLPacked) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, values)`` of the occupied side slots, values float32 in the original basis."""
        occ = packed.side_pos >= 0
        vals = packed.side[occ].float() * packed.side_scale[occ].float().unsqueeze(-1)
        return packed.side_pos[occ], hadamard(vals) if packed.rotated else vals

    def read(self, packed: KV4RLPacked) -> torch.Tensor:
        """Effective float32 ``[n, d]``: side-buffer values at protected positions, INT4 elsewhere."""
        x = int4_dequantize(packed.main)
        if packed.rotated:
            x = hadamard(x)
        pos, vals = self.read_side(packed)
        x[pos] = vals
        return x

    def bytes_per_position(self, d: int) -> float:
        """Per-position bytes of the INT4 main cache; the side buffer is the fixed :meth:`fixed_bytes`."""
        return self.main.bytes_per_position(d)

    def side_count(self, lengths: torch.Tensor) -> torch.Tensor:
        """Sinks plus the recent window per stream length (:func:`side_count`)."""
        return side_count(lengths.long(), self.sink, self.recent)

    def fixed_bytes(self, d: int) -> int:
        """Side-buffer bytes per (layer, kv_head, side), independent of the sequence length."""
        per_slot = d + 2 if self.protect == "int8" else 2 * d
        return self.capacity * per_slot
