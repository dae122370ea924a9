"""The INT8 pool as the decode kernels read it, the request checks, and which kernel serves a request.

Layout read (the storage contract of :mod:`kvlib.formats.dither_int8` / :mod:`kvlib.storage.paged`), per
side (K or V) of one layer: ``codes`` int8 ``[n_slots, H_kv, d]``, ``scales`` fp16
``[n_slots, H_kv, d // G]``, optional ``outliers`` fp16 ``[n_slots, H_kv, m]`` with
``outlier_channels`` int64 ``[H_kv, m]`` (code 0 there). Requests are rows of a slot table
``slots [B, max_len]``, or (vLLM's paged layout) of a block table ``block_table [B, max_blocks]`` over pages of
``block_size`` slots (:mod:`kvlib.kernels.tl.paging`), with lengths ``seq_lens [B]``.

A key side stored without dither (``dithered=False``: ``xi = 0``, round-to-nearest codes, the pool rule of
:mod:`kvlib.storage.paged`; e.g. rtn-int8) is read in RTN-key mode: the kernels regenerate no dither and, with no
variance proxy to certify against, compute no certificate (``cert`` must be False).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvlib.core.checks import check_group, check_tensor
from kvlib.core.philox import check_layout
from kvlib.kernels.tl.paging import request_table


@dataclass
class PoolSide:
    """One side (K or V) of one layer's INT8 pool (see the module docstring for shapes)."""

    codes: torch.Tensor
    scales: torch.Tensor
    outliers: torch.Tensor | None = None
    outlier_channels: torch.Tensor | None = None
    group: int = 32
    dither_layout: str = "w24"  # Philox dither layout of the stored codes (kvlib.core.philox.DITHER_LAYOUTS)
    #: codes stored with the Philox dither subtracted on read (False: RTN codes, ``xi = 0``; keys then decode in
    #: RTN-key mode, without a certificate)
    dithered: bool = True


def as_side(x: Any, name: str) -> PoolSide:
    """Accept a :class:`PoolSide` or any object with ``codes``/``scales`` (and optional outliers)."""
    if isinstance(x, PoolSide):
        side = x
    elif hasattr(x, "codes") and hasattr(x, "scales"):
        group = getattr(x, "group", None)
        if group is None and x.scales.ndim == 3 and x.scales.shape[-1]:
            group = x.codes.shape[-1] // x.scales.shape[-1]  # e.g. kvlib.storage.paged.LayerView
        side = PoolSide(x.codes, x.scales, getattr(x, "outliers", None), getattr(x, "outlier_channels", None),
                        int(group or 32), getattr(x, "dither_layout", "w24"), bool(getattr(x, "dithered", True)))
    else:
        raise TypeError(f"{name} must be a PoolSide (codes, scales, outliers, outlier_channels), "
                        f"got {type(x).__name__}")
    check_layout(side.dither_layout)
    if not isinstance(side.dithered, bool):
        raise TypeError(f"{name}.dithered must be a bool, got {type(side.dithered).__name__}")
    check_tensor(f"{name}.codes", side.codes, ndim=3, dtype=torch.int8)
    n_slots, hkv, d = side.codes.shape
    check_group(f"{name}.group", side.group, d)
    check_tensor(f"{name}.scales", side.scales, ndim=3, dtype=(torch.float16, torch.float32))
    if tuple(side.scales.shape) != (n_slots, hkv, d // side.group):
        raise ValueError(f"{name}.scales must have shape {(n_slots, hkv, d // side.group)}, "
                         f"got {tuple(side.scales.shape)}")
    if (side.outliers is None) != (side.outlier_channels is None):
        raise ValueError(f"{name}.outliers and {name}.outlier_channels must be given together")
    if side.outliers is not None:
        check_tensor(f"{name}.outlier_channels", side.outlier_channels, ndim=2, floating=False)
        m = side.outlier_channels.shape[1]
        if tuple(side.outlier_channels.shape) != (hkv, m):
            raise ValueError(f"{name}.outlier_channels must have shape [H_kv={hkv}, m], "
                             f"got {tuple(side.outlier_channels.shape)}")
        check_tensor(f"{name}.outliers", side.outliers, ndim=3, floating=True)
        if tuple(side.outliers.shape) != (n_slots, hkv, m):
            raise ValueError(f"{name}.outliers must have shape {(n_slots, hkv, m)}, got {tuple(side.outliers.shape)}")
        if m == 0:
            side = dataclasses.replace(side, outliers=None, outlier_channels=None)
    return side


@dataclass
class DecodeOut:
    """Decode result per (batch row, query head); certificate fields are None when switched off."""

    o: torch.Tensor  # [B, Hq, d] fp32
    lse: torch.Tensor  # [B, Hq] natural log
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    tv_bound: torch.Tensor | None = None  # 1 - B/A (or 1 - 1/A^2 when B is off), +inf vacuous
    tv_bound_one: torch.Tensor | None = None  # 1 - 1/A^2, +inf vacuous
    vacuous: torch.Tensor | None = None
    #: what computed it: "reference" (the float64 torch reference) or the stage-1 kernel ("tc", "fma", "h10",
    #: "gluon", "bf16"), so a caller and a test can tell a kernel run from a fallback
    path: str = "reference"


def check_request(q: torch.Tensor, k: PoolSide, v: PoolSide, slots: torch.Tensor | None, seq_lens: torch.Tensor,
                  block_table: torch.Tensor | None = None,
                  block_size: int | None = None) -> tuple[torch.Tensor, int, int]:
    """Validate a decode request; returns ``(table, page, max_len)`` (:func:`kvlib.kernels.tl.paging.request_table`:
    the slot table with ``page = 0``, or the block table with ``page = block_size``)."""
    check_tensor("q", q, ndim=3, floating=True)
    n_slots, hkv, d = k.codes.shape
    if tuple(v.codes.shape) != (n_slots, hkv, d) or v.group != k.group:
        raise ValueError(f"v_pool must match k_pool's shape {(n_slots, hkv, d)} and group, got {tuple(v.codes.shape)}")
    B, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"q's head dim {dq} must equal the pool's d={d}")
    if hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of KV heads ({hkv}) (GQA)")
    table = request_table(slots, block_table, block_size, B)
    check_tensor("seq_lens", seq_lens, ndim=1, floating=False)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens [B] must have B={B} rows, got {tuple(seq_lens.shape)}")
    if d % 4 != 0 or k.group % 4 != 0:
        raise ValueError(f"d={d} and group={k.group} must be multiples of 4 (one Philox call per four channels)")
    return table


def key_layout(k: PoolSide, impl: str) -> str:
    """The dither layout the dispatch routes on: the key pool's; for RTN keys (``dithered=False``, no dither to
    read, so every kernel reads them) the layout of the kernel asked for (``"auto"``: the pool's label)."""
    if k.dithered or impl == "auto":
        return k.dither_layout
    return "h8" if impl in ("h10", "gluon") else "w24"


def check_key_cert(k: PoolSide, cert: bool) -> None:
    """RTN keys have no variance proxy, so no certificate: ``cert`` must be False (a ValueError naming it)."""
    if not k.dithered and cert:
        raise ValueError("cert must be False for a key pool stored without dither (k_pool.dithered=False, RTN keys: "
                         "no variance proxy, so no certificate)")


def resolve_impl(impl: str, d: int, group: int, v_dither: bool = False, layout: str = "w24") -> str:
    """``"tc"``/``"fma"`` as asked; ``"auto"`` is ``tc`` where its rules hold (``d`` and ``group``
    powers of two, ``group >= 16`` for the 16-deep tensor-core dot, RTN values), else ``fma``.

    ``"auto"`` sends dithered values to ``fma``; ``impl="tc"`` reads them too (its value-dither path was mended
    at issue 28, dev/results/README.md "value-dither bug"; ``"auto"`` moves to it once the GPU lane has run it).

    ``layout`` is the key pool's dither layout. ``"h10"`` or ``"h8"``: ``"auto"``/``"h10"`` give ``"h10"`` (the
    kernel reads both half-word layouts; it needs ``group == d // 4``, ``group`` in (16, 32, 64), ``d >= 64``;
    other shapes raise), ``"fma"`` stays ``"fma"`` for :func:`decode_reference` only (the Triton fma kernel
    reads ``w24``), ``"tc"`` raises. ``"w24"``: ``"h10"`` raises, the rest as above.
    """
    if check_layout(layout) in ("h10", "h8"):
        if impl == "gluon":
            if layout != "h8":
                raise ValueError(f"impl='gluon' reads the h8 dither layout only, got dither_layout={layout!r}")
            return "gluon"
        if impl in ("auto", "h10"):
            if group != d // 4 or group not in (16, 32, 64):
                raise ValueError(f"impl='h10' (dither_layout={layout!r}) needs group == d // 4 with group in "
                                 f"(16, 32, 64), "
                                 f"got d={d}, group={group}; other {layout} shapes have only the "
                                 f"torch reference (decode_reference with impl='fma')")
            return "h10"
        if impl == "fma":
            return "fma"
        if impl == "tc":
            raise ValueError(f"impl='tc' reads the w24 dither layout only, got dither_layout={layout!r} "
                             "(use impl='h10' or 'auto')")
        raise ValueError(f"impl must be 'auto', 'h10', 'gluon' (h8) or 'fma' for dither_layout={layout!r}, "
                         f"got {impl!r}")
    if impl in ("h10", "gluon"):
        raise ValueError(f"impl={impl!r} reads the half-word dither layouts only, got dither_layout='w24'")
    pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    ok = pow2(d) and pow2(group) and group >= 16
    if impl == "auto":
        return "tc" if ok and not v_dither else "fma"
    if impl == "tc" and not ok:
        raise ValueError(f"impl='tc' needs d and group powers of two with group >= 16, got d={d}, group={group}")
    if impl not in ("tc", "fma"):
        raise ValueError(f"impl must be 'auto', 'tc' or 'fma', got {impl!r}")
    return impl



def make_pool_side(
    x: torch.Tensor, *, layer: int, seed: int, side: int, group: int = 32, n_slots: int | None = None,
    slot_ids: torch.Tensor | None = None, outlier_channels: torch.Tensor | None = None, dithered: bool = True,
    dither_layout: str = "w24",
) -> PoolSide:
    """Quantise ``x [T, H_kv, d]`` into a fresh pool side, token ``t`` at slot ``slot_ids[t]``.

    Keys/dithered values go through :func:`kvlib.formats.dither_int8.dither_quantize` (the write path);
    ``dithered=False`` stores round-to-nearest codes with the same scales (RTN values, or RTN keys: the side
    records it, and the kernels read such keys in RTN-key mode).
    ``outlier_channels`` ``[H_kv, m]`` bypass in fp16. ``dither_layout`` (``"w24"``/``"h10"``) is the
    Philox dither layout, recorded on the returned side. For tests, notebooks and benchmarks.
    """
    from kvlib.formats.dither_int8 import dither_quantize, group_scales, quantize_codes

    check_tensor("x", x, ndim=3, floating=True)
    T, hkv, d = x.shape
    slot_ids = torch.arange(T) if slot_ids is None else slot_ids.to(torch.int64).cpu()
    n_slots = n_slots or int(slot_ids.max()) + 1
    codes = torch.zeros(n_slots, hkv, d, dtype=torch.int8)
    scales = torch.zeros(n_slots, hkv, d // group, dtype=torch.float16)
    m = 0 if outlier_channels is None else outlier_channels.shape[-1]
    outs = torch.zeros(n_slots, hkv, m, dtype=torch.float16) if m else None
    for h in range(hkv):
        oc = outlier_channels[h] if m else None
        if dithered:
            qt = dither_quantize(x[:, h].float().cpu(), layer=layer, kv_head=h, slots=slot_ids, seed=seed,
                                 group=group, outlier_channels=oc, side=side, dither_layout=dither_layout)
            codes[slot_ids, h] = qt.codes
            scales[slot_ids, h] = qt.scales
            if m:
                outs[slot_ids, h] = qt.outliers.to(torch.float16)
        else:
            x32 = x[:, h].float().cpu()
            mask = None
            if m:
                mask = torch.zeros(d, dtype=torch.bool)
                mask[oc] = True
            s16 = group_scales(x32, group, mask)
            codes[slot_ids, h] = quantize_codes(x32, s16, torch.zeros_like(x32), group, zero=mask)
            scales[slot_ids, h] = s16
            if m:
                outs[slot_ids, h] = x32[:, oc].to(torch.float16)
    dev = x.device
    return PoolSide(codes.to(dev), scales.to(dev), outs.to(dev) if m else None,
                    outlier_channels.to(dev, torch.int64) if m else None, group, dither_layout, dithered)
