"""WitCert dithered INT8: per-token, per-group fp16 scales, Philox subtractive dither, outlier bypass.

Write: ``s = fp16(amax / 126.5)`` over each group of ``G`` channels (outlier channels excluded from
``amax`` unless ``include_outliers_in_amax``), ``c = clamp(rne(x / s + xi), -127, 127)`` computed in
fp32 **with the stored fp16 scale**, outlier channels stored as fp16 with code 0.
Read: ``k_hat = s (c - xi)`` with ``xi`` regenerated from the same Philox counters
(:func:`kvlib.core.philox.dither`). The full storage contract is in :mod:`kvlib.storage.paged`. The dither
layout (``dither_layout``: ``"w24"``, the paper's 24-bit word per channel, or ``"h10"``, a 10-bit
dither per 16-bit half word, see :mod:`kvlib.core.philox`) is part of the stored tensor and must be the
same at write and read.

Edge cases (documented contract): a group with ``amax == 0`` gets ``s = 0`` and codes 0, so the
read gives exactly 0; where fp16 rounding of ``amax / 126.5`` would put ``s * 127 < amax`` (only
possible for subnormal fp16 scales, ``amax < ~7.7e-3``) the scale is bumped to the next fp16 up,
so ``|x / s| <= 127`` and no code clips. Non-finite ``x`` or a scale that overflows fp16 raise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvlib.core.checks import check_group, check_tensor
from kvlib.core.philox import check_layout, dither, seed_key
from kvlib.formats.base import KVFormat, per_token, register_format

QMAX = 127
BOUND_SLACK = 2.0**-16  # fp32 rounding slack of the s/2 bound, in units of s (see residual())
SCALE_DIV = QMAX - 0.5  # 126.5: |x/s| <= 126.5 and |xi| < 1/2 keep |x/s + xi| < 127 (no clipping)


def group_scales(
    x32: torch.Tensor, group: int, excluded: torch.Tensor | None = None
) -> torch.Tensor:
    """fp16 scales ``[..., d // group]`` = ``fp16(amax / 126.5)`` (bumped up where ``127 s < amax``).

    ``excluded`` is a bool ``[d]`` mask of channels left out of ``amax`` (the outlier bypass).
    NaN counts as inf: the group's scale becomes inf (non-finite at read, never a silent number).
    """
    a = x32.abs().nan_to_num(nan=float("inf"))
    if excluded is not None:
        a = a.masked_fill(excluded, 0.0)
    amax = a.unflatten(-1, (-1, group)).amax(-1)
    s16 = (amax / SCALE_DIV).to(torch.float16)
    low = s16.to(torch.float32) * QMAX < amax  # only for subnormal scales (or fp16 overflow -> inf)
    if bool(low.any()):
        bumped = (s16.view(torch.int16) + 1).view(torch.float16)
        s16 = torch.where(low, bumped, s16)
    return s16


def rne(y: torch.Tensor) -> torch.Tensor:
    """Round half to even (``torch.round`` semantics), spelled out for the record."""
    return torch.round(y)


def quantize_codes(
    x32: torch.Tensor, s16: torch.Tensor, xi: torch.Tensor, group: int, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """int8 codes ``clamp(rne(x / s + xi), -127, 127)`` in fp32 with the stored scale ``s16``.

    Groups with ``s == 0`` (all-zero) and channels in the bool mask ``zero`` get code 0.
    """
    s = s16.to(torch.float32).repeat_interleave(group, dim=-1)
    y = x32 / s + xi
    c = rne(y).clamp(-QMAX, QMAX)
    bad = (s == 0) | torch.isnan(c)
    if zero is not None:
        bad = bad | zero
    return torch.where(bad, torch.zeros_like(c), c).to(torch.int8)


def dequantize_codes(codes: torch.Tensor, s16: torch.Tensor, xi: torch.Tensor, group: int) -> torch.Tensor:
    """``k_hat = s (c - xi)`` in fp32 (outlier channels not yet substituted)."""
    s = s16.to(torch.float32).repeat_interleave(group, dim=-1)
    return s * (codes.to(torch.float32) - xi)


def check_outlier_channels(outlier_channels: Any, d: int) -> torch.Tensor | None:
    """Validate and sort an outlier channel set (int64 ``[n_out]``, unique, in ``[0, d)``)."""
    if outlier_channels is None:
        return None
    oc = torch.as_tensor(outlier_channels)
    check_tensor("outlier_channels", oc, ndim=1, floating=False)
    oc = oc.to(torch.int64)
    if oc.numel() == 0:
        return None
    if int(oc.min()) < 0 or int(oc.max()) >= d:
        raise ValueError(f"outlier_channels must lie in [0, d={d}), got range [{int(oc.min())}, {int(oc.max())}]")
    s = torch.unique(oc.cpu(), sorted=True)
    if s.numel() != oc.numel():
        raise ValueError("outlier_channels must not repeat a channel")
    return s


def check_x(x: Any, name: str = "x") -> torch.Tensor:
    """Float tensor with only finite values (NaN/inf would be quantized silently otherwise)."""
    check_tensor(name, x, floating=True)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains non-finite values (NaN or inf); refusing to quantize them")
    return x


@dataclasses.dataclass
class DitherQTensor:
    """Dithered INT8 storage of one (layer, kv_head, side) stream; ``dither_dequantize`` reads it."""

    codes: torch.Tensor = per_token()  # int8 [S, d]
    scales: torch.Tensor = per_token()  # fp16 [S, d // group]
    slots: torch.Tensor = per_token()  # int64 [S] (Philox counter word 0)
    outliers: torch.Tensor | None = per_token(default=None)  # fp16 [S, n_out] or None
    outlier_channels: torch.Tensor | None = None  # int64 [n_out] sorted, or None
    layer: int = 0
    kv_head: int = 0
    seed: int = 0
    side: int = 0
    group: int = 32
    dithered: bool = True  # False: same layout and scale rule, xi = 0 (RTN; e.g. values)
    dither_layout: str = "w24"  # Philox dither layout (kvlib.core.philox.DITHER_LAYOUTS)


def _xi(qt: DitherQTensor) -> torch.Tensor:
    """The dither of ``qt`` (float32 ``[S, d]`` on the codes' device), regenerated from its counters."""
    d = qt.codes.shape[-1]
    if not qt.dithered:
        return torch.zeros(qt.codes.shape, dtype=torch.float32, device=qt.codes.device)
    return dither(qt.slots, d, layer=qt.layer, kv_head=qt.kv_head, seed=qt.seed, side=qt.side,
                  layout=check_layout(qt.dither_layout)).to(qt.codes.device)


def dither_quantize(
    x: torch.Tensor,
    *,
    layer: int,
    kv_head: int,
    slots: torch.Tensor,
    seed: int,
    group: int = 32,
    outlier_channels: Any = None,
    side: int = 0,
    include_outliers_in_amax: bool = False,
    dithered: bool = True,
    quantize_scale: str = "stored",
    dither_layout: str = "w24",
) -> DitherQTensor:
    """Quantize ``x [S, d]`` of one (layer, kv_head, side) with the WitCert subtractive dither.

    ``include_outliers_in_amax=True`` keeps the bypassed channels in the group amax (the paper's
    controlled experiment: the scale then does not drop). ``dithered=False`` stores the same layout
    with ``xi = 0`` (round to nearest; the read side's RTN-values mode). ``quantize_scale="fp32"``
    reproduces the paper's bug for the contract chapter: codes computed with the fp32 ``amax / 126.5``
    while the fp16 scale is stored (and used at read). ``dither_layout``: ``"w24"`` (the paper's) or
    ``"h10"`` (needs ``d % 8 == 0``) or ``"h8"`` (needs ``d % 16 == 0``); see :mod:`kvlib.core.philox`.
    """
    check_layout(dither_layout)
    check_x(x)
    check_tensor("x", x, ndim=2)
    S, d = x.shape
    check_group("group", group, d)
    check_tensor("slots", slots, ndim=1, floating=False)
    if slots.shape[0] != S:
        raise ValueError(f"slots must have length S={S} (one slot per token of x), got {slots.shape[0]}")
    seed_key(seed)
    oc = check_outlier_channels(outlier_channels, d)
    x32 = x.to(torch.float32)
    mask = None
    if oc is not None:
        mask = torch.zeros(d, dtype=torch.bool, device=x.device)
        mask[oc.to(x.device)] = True
    s16 = group_scales(x32, group, None if include_outliers_in_amax else mask)
    if not bool(torch.isfinite(s16).all()):
        raise ValueError("x has values too large for an fp16 scale (amax / 126.5 > 65504)")
    slots = slots.to(torch.int64)
    if dithered:
        xi = dither(slots, d, layer=layer, kv_head=kv_head, seed=seed, side=side, layout=dither_layout).to(x.device)
    else:
        xi = torch.zeros_like(x32)
    if quantize_scale == "stored":
        codes = quantize_codes(x32, s16, xi, group, zero=mask)
    elif quantize_scale == "fp32":
        a = x32.abs() if mask is None or include_outliers_in_amax else x32.abs().masked_fill(mask, 0.0)
        s32 = a.unflatten(-1, (-1, group)).amax(-1) / SCALE_DIV
        codes = quantize_codes(x32, s32, xi, group, zero=mask)
    else:
        raise ValueError(f"quantize_scale must be 'stored' or 'fp32', got {quantize_scale!r}")
    outliers = None
    if oc is not None:
        outliers = x32[:, oc.to(x.device)].to(torch.float16)
        if not bool(torch.isfinite(outliers).all()):
            raise ValueError("an outlier channel of x overflows fp16")
    return DitherQTensor(codes, s16, slots, outliers, oc, layer, kv_head, seed, side, group, dithered, dither_layout)


def dither_dequantize(qt: DitherQTensor) -> torch.Tensor:
    """fp32 ``[S, d]``: ``s (c - xi)`` with the dither regenerated from the stored counters."""
    if not isinstance(qt, DitherQTensor):
        raise TypeError(f"qt must be a DitherQTensor, got {type(qt).__name__}")
    out = dequantize_codes(qt.codes, qt.scales, _xi(qt), qt.group)
    if qt.outlier_channels is not None and qt.outliers is not None:
        out[:, qt.outlier_channels.to(out.device)] = qt.outliers.to(torch.float32)
    return out


def residual(x: torch.Tensor, qt: DitherQTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact error in scale units and the scale, float64 ``[S, d]``: ``(s (c - xi) - x) / s`` and ``s``.

    float64 holds ``s (c - xi) - x`` exactly for these operands (11-bit scale, 32-bit ``c - xi``,
    fp32 ``x``), so this is the error of the stored value itself, before any fp32 read rounding.
    Outlier channels get ``nan`` (their error is fp16 rounding, not ``s`` units).

    Slack: ``x / s + xi`` is rounded twice in fp32 (``|y| < 128``, each rounding <= 2^-18), so at
    an exact fp32 rounding tie the stored error can exceed ``s/2`` by at most ``2^-17 s``; a reader's
    fp32 ``s (c - xi)`` adds at most another ``2^-17 s``. Checks use ``|err| <= s/2 + 2^-16 s``
    (:data:`BOUND_SLACK`) and report the strict counts beside it.
    """
    xi = _xi(qt).double().cpu()
    s = qt.scales.double().cpu().repeat_interleave(qt.group, -1)
    eps = (s * (qt.codes.double().cpu() - xi) - x.double().cpu()) / s
    if qt.outlier_channels is not None:
        eps[:, qt.outlier_channels] = float("nan")
    return eps, s


def dither_int8_bytes(d: int, group: int = 32, n_out: int = 0) -> int:
    """Bytes per token per head per side: ``d`` int8 codes + ``d/group`` fp16 scales + ``n_out`` fp16."""
    check_group("group", group, d)
    return d * 1 + (d // group) * 2 + n_out * 2


@register_format("dither-int8")
class DitherInt8(KVFormat):
    """WitCert storage (per-token, per-group scale; ``m`` outlier RoPE pairs in fp16)."""

    variance_proxy = "dither"
    kernel = "int8"

    options = ("group", "outlier_channels", "include_outliers_in_amax", "dither_layout")

    def __init__(self, group: int = 32, outlier_channels: Any = None, include_outliers_in_amax: bool = False,
                 dither_layout: str = "w24") -> None:
        self.dither_layout = check_layout(dither_layout)
        self.group = group
        self.outlier_channels = outlier_channels
        self.include_outliers_in_amax = include_outliers_in_amax

    @property
    def max_abs(self) -> float:  # type: ignore[override]
        # fp16 scales amax / 126.5; outlier channels are kept as fp16 values (any channel may be one in a pool's
        # outlier table, so with outliers the fp16 range binds every channel: conservative)
        return 65504.0 if self.outlier_channels is not None else 65504.0 * SCALE_DIV

    def write(self, x: torch.Tensor, **ctx: Any) -> DitherQTensor:
        S = x.shape[0] if isinstance(x, torch.Tensor) and x.ndim else 0
        slots = ctx.get("slots")
        if slots is None:
            slots = torch.arange(S, dtype=torch.int64)
        oc = ctx.get("outlier_channels", self.outlier_channels)
        return dither_quantize(
            x, layer=ctx.get("layer", 0), kv_head=ctx.get("kv_head", 0), slots=slots, seed=ctx.get("seed", 0),
            group=self.group, outlier_channels=oc, side=ctx.get("side", 0),
            include_outliers_in_amax=self.include_outliers_in_amax, dither_layout=self.dither_layout,
        )

    def read(self, packed: DitherQTensor) -> torch.Tensor:
        return dither_dequantize(packed)

    def bytes_per_position(self, d: int) -> float:
        n_out = 0 if self.outlier_channels is None else len(torch.as_tensor(self.outlier_channels))
        return float(dither_int8_bytes(d, self.group, n_out))

    def nbytes(self, packed: DitherQTensor) -> int:
        # the slots tensor is the address, not stored payload (in a paged pool it is the index)
        kept = (packed.codes, packed.scales, packed.outliers)
        return sum(t.numel() * t.element_size() for t in kept if t is not None)
