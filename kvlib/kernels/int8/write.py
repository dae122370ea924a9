"""WitCert write kernel: quantize + dither + pack a batch of new tokens into the paged pool.

One launch writes ``x [N, H_kv, d]`` (N new tokens, all KV heads of one layer and side) into the
slots ``slots [N]`` of a :class:`kvlib.storage.paged.PagedPool`, following the storage contract in
:mod:`kvlib.storage.paged`. :func:`write_int8_reference` is the torch reference beside it (it calls
:func:`kvlib.formats.dither_int8.dither_quantize` per head); ``tests/test_dither_write.py`` binds
the two bit for bit. The dither layout is the pool's (``pool.dither_layout``, a constexpr of the
kernel: ``"w24"`` or ``"h10"``, see :mod:`kvlib.core.philox`).

Bit identity rests on doing the same IEEE fp32 operations in the same order: ``x / s`` with
``tl.math.div_rn`` (Triton's plain ``/`` is an approximate division on the GPU); ``amax / 126.5`` as torch
does a division by a Python scalar on the device (IEEE ``div_rn`` on the CPU, ``amax * fp32(1/126.5)`` on
CUDA, see :mod:`kvlib.kernels.write`),
fp32 -> fp16 conversion round-to-nearest-even, ``+ xi`` in fp32, and round half to even
(libdevice ``rint`` on the GPU; under the CPU interpreter, which lacks libdevice, the same rounding
spelled with ``floor``, exact for |y| < 2^23).

CPU tensors: ``backend="auto"`` uses the torch reference on CPU and the Triton kernel on CUDA;
``backend="triton"`` on CPU needs ``TRITON_INTERPRET=1`` set before triton was imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvlib.core.checks import check_tensor
from kvlib.core.philox import check_layout_d, seed_key
from kvlib.formats.dither_int8 import check_x, dither_quantize
from kvlib.kernels.tl.philox import dither_tile, dither_tile_h8, dither_tile_h10
from kvlib.kernels.tl.rounding import rne
from kvlib.kernels.write import recip32
from kvlib.storage.paged import PagedPool


@triton.jit
def _write_int8_kernel(
    x_ptr, slot_ptr, codes_ptr, scales_ptr, out_ptr, och_ptr,
    N, stride_xn, stride_xh,
    layer, side, k0, k1,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    NOUT: tl.constexpr, NOUT_P2: tl.constexpr, INCLUDE_OUT: tl.constexpr, DITHER: tl.constexpr,
    USE_RINT: tl.constexpr, BLOCK_S: tl.constexpr, LAYOUT: tl.constexpr,
    QDIV: tl.constexpr, QBUMP: tl.constexpr, RECIP: tl.constexpr, INV_QDIV: tl.constexpr,
):
    _quantize_side(tl.program_id(0), tl.program_id(1), x_ptr, slot_ptr, codes_ptr, scales_ptr, out_ptr, och_ptr,
                   N, stride_xn, stride_xh, layer, side, k0, k1, H, D, G, NOUT, NOUT_P2, INCLUDE_OUT, DITHER,
                   USE_RINT, BLOCK_S, LAYOUT, QDIV, QBUMP, RECIP, INV_QDIV)


@triton.jit
def _write_int8_kv_kernel(
    k_ptr, v_ptr, slot_ptr, kc_ptr, ks_ptr, ko_ptr, koc_ptr, vc_ptr, vs_ptr, vo_ptr, voc_ptr,
    N, skn, skh, svn, svh,
    layer, side_k, side_v, k0, k1,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    NOUT_K: tl.constexpr, NOUT_P2_K: tl.constexpr, DITHER_K: tl.constexpr,
    NOUT_V: tl.constexpr, NOUT_P2_V: tl.constexpr, DITHER_V: tl.constexpr, INCLUDE_OUT: tl.constexpr,
    USE_RINT: tl.constexpr, BLOCK_S: tl.constexpr, LAYOUT: tl.constexpr,
    QDIV: tl.constexpr, QBUMP: tl.constexpr, RECIP: tl.constexpr, INV_QDIV: tl.constexpr,
):
    """K and V of one layer in one launch: grid axis 2 picks the side (a decode step's write: one launch)."""
    if tl.program_id(2) == 0:
        _quantize_side(tl.program_id(0), tl.program_id(1), k_ptr, slot_ptr, kc_ptr, ks_ptr, ko_ptr, koc_ptr,
                       N, skn, skh, layer, side_k, k0, k1, H, D, G, NOUT_K, NOUT_P2_K, INCLUDE_OUT, DITHER_K,
                       USE_RINT, BLOCK_S, LAYOUT, QDIV, QBUMP, RECIP, INV_QDIV)
    else:
        _quantize_side(tl.program_id(0), tl.program_id(1), v_ptr, slot_ptr, vc_ptr, vs_ptr, vo_ptr, voc_ptr,
                       N, svn, svh, layer, side_v, k0, k1, H, D, G, NOUT_V, NOUT_P2_V, INCLUDE_OUT, DITHER_V,
                       USE_RINT, BLOCK_S, LAYOUT, QDIV, QBUMP, RECIP, INV_QDIV)


@triton.jit
def _quantize_side(
    pid_n, h, x_ptr, slot_ptr, codes_ptr, scales_ptr, out_ptr, och_ptr,
    N, stride_xn, stride_xh,
    layer, side, k0, k1,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    NOUT: tl.constexpr, NOUT_P2: tl.constexpr, INCLUDE_OUT: tl.constexpr, DITHER: tl.constexpr,
    USE_RINT: tl.constexpr, BLOCK_S: tl.constexpr, LAYOUT: tl.constexpr,
    QDIV: tl.constexpr, QBUMP: tl.constexpr, RECIP: tl.constexpr, INV_QDIV: tl.constexpr,
):
    """Tokens ``pid_n * BLOCK_S ..`` of head ``h`` of one side into its pool (the storage contract)."""
    NG: tl.constexpr = D // G
    n = pid_n * BLOCK_S + tl.arange(0, BLOCK_S)
    n_ok = n < N
    n3 = n[:, None, None]
    ok3 = n_ok[:, None, None]
    # channels as [1, NG, G] so the group amax and the scale broadcast need no reshape
    ch = tl.arange(0, NG)[None, :, None] * G + tl.arange(0, G)[None, None, :]
    slot = tl.load(slot_ptr + n, mask=n_ok, other=0).to(tl.int64)
    slot3 = slot[:, None, None]
    x = tl.load(x_ptr + n3 * stride_xn + h * stride_xh + ch, mask=ok3, other=0.0).to(tl.float32)

    # NaN counts as inf in the amax: the group's scale becomes inf, non-finite at read (never silent)
    a = tl.where(x != x, float("inf"), tl.abs(x))
    if NOUT > 0:
        j = tl.arange(0, NOUT_P2)
        och = tl.load(och_ptr + h * NOUT + j, mask=j < NOUT, other=-1)
        is_out = tl.max((ch[:, :, :, None] == och[None, None, None, :]).to(tl.int32), axis=3) > 0  # [1, NG, G]
        if not INCLUDE_OUT:
            a = tl.where(is_out, 0.0, a)
    amax = tl.max(a, axis=2)  # [BLOCK_S, NG]
    # amax / QDIV as torch computes a division by a Python scalar on this device (kvlib.kernels.write)
    if RECIP:
        s16 = (amax * INV_QDIV).to(tl.float16)
    else:
        s16 = tl.math.div_rn(amax, QDIV).to(tl.float16)
    low = s16.to(tl.float32) * QBUMP < amax  # subnormal scales only: bump to the next fp16 up
    s16 = tl.where(low, (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), s16)
    s32 = s16.to(tl.float32)[:, :, None]

    y = tl.math.div_rn(x, s32)
    if DITHER:
        if LAYOUT == "h10":
            xi = dither_tile_h10(slot, h, layer, side, k0, k1, D)
        elif LAYOUT == "h8":
            xi = dither_tile_h8(slot, h, layer, side, k0, k1, D)
        else:
            xi = dither_tile(slot, h, layer, side, k0, k1, D)
        y = y + tl.reshape(xi, (BLOCK_S, NG, G))
    if USE_RINT:
        r = libdevice.rint(y)  # one cvt.rni on the GPU
    else:
        r = rne(y)  # same rounding spelled with floor (the CPU interpreter has no libdevice)
    c = tl.minimum(tl.maximum(r, -127.0), 127.0)
    zero = (s32 == 0.0) | (y != y)
    if NOUT > 0:
        zero = zero | is_out
    c = tl.where(zero, 0.0, c).to(tl.int8)

    tl.store(codes_ptr + slot3 * (H * D) + h * D + ch, c, mask=ok3)
    g = tl.arange(0, NG)
    tl.store(scales_ptr + slot[:, None] * (H * NG) + h * NG + g[None, :], s16, mask=n_ok[:, None])
    if NOUT > 0:
        j_ok = j < NOUT
        xo = tl.load(x_ptr + n[:, None] * stride_xn + h * stride_xh + och[None, :],
                     mask=n_ok[:, None] & j_ok[None, :], other=0.0)
        tl.store(out_ptr + slot[:, None] * (H * NOUT) + h * NOUT + j[None, :], xo.to(tl.float32).to(tl.float16),
                 mask=n_ok[:, None] & j_ok[None, :])


def _check_write_args(pool: PagedPool, layer: int, x: torch.Tensor, slots: torch.Tensor, validate: bool) -> None:
    if not isinstance(pool, PagedPool):
        raise TypeError(f"pool must be a PagedPool, got {type(pool).__name__}")
    check_tensor("x", x, ndim=3, floating=True)
    if tuple(x.shape[1:]) != (pool.n_kv_heads, pool.d):
        raise ValueError(f"x must have shape [N, {pool.n_kv_heads}, {pool.d}], got {tuple(x.shape)}")
    check_tensor("slots", slots, ndim=1, floating=False)
    if slots.shape[0] != x.shape[0]:
        raise ValueError(f"slots must have length N={x.shape[0]} (one slot per token), got {slots.shape[0]}")
    if not 0 <= layer < pool.n_layers:
        raise ValueError(f"layer must lie in [0, {pool.n_layers}), got {layer}")
    if x.device != pool.device or slots.device != pool.device:
        raise ValueError(f"x and slots must be on the pool's device {pool.device}")
    if validate:
        check_x(x)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= pool.n_slots):
            raise ValueError(f"slots must lie in [0, n_slots={pool.n_slots})")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots must be distinct within one write (two tokens cannot share a slot)")


def write_int8_reference(pool: PagedPool, layer: int, x: torch.Tensor, slots: torch.Tensor,
                         validate: bool = True) -> None:
    """Torch reference of the write kernel: :func:`dither_quantize` per head, stored by slot. ``validate=False``
    skips the host-side checks that synchronise (as the Triton path's does: a like-for-like timing). CPU slots take
    :func:`_write_int8_heads` (every head at once, the dither from the slot-indexed tables): the same bytes."""
    _check_write_args(pool, layer, x, slots, validate=validate)
    v = pool.layer(layer)
    slots = slots.to(torch.int64)
    if slots.device.type == "cpu" and x.device.type == "cpu":
        _write_int8_heads(pool, layer, x, slots)
        return
    for h in range(pool.n_kv_heads):
        oc = v.outlier_channels[h] if pool.n_out else None
        qt = dither_quantize(
            x[:, h], layer=layer, kv_head=h, slots=slots, seed=pool.seed, group=pool.group,
            outlier_channels=oc, side=pool.side, include_outliers_in_amax=pool.include_outliers_in_amax,
            dithered=pool.dithered, dither_layout=pool.dither_layout,
        )
        v.codes[slots, h] = qt.codes
        v.scales[slots, h] = qt.scales
        if pool.n_out:
            v.outliers[slots, h] = qt.outliers


def _write_int8_heads(pool: PagedPool, layer: int, x: torch.Tensor, slots: torch.Tensor) -> None:
    """:func:`dither_quantize` of every head of ``x [N, H, d]`` in one pass (CPU): its elementwise arithmetic on
    ``[N, H, d]`` with the dither of :func:`kvlib.core.dither_tables.cached_dither`, bit for bit
    ``dither(slots, ...)``; so the stored bytes are the per-head loop's (``tests/test_reference_speedups.py``)."""
    from kvlib.core.dither_tables import cached_dither
    from kvlib.formats.dither_int8 import group_scales, quantize_codes

    n, h, d = x.shape
    v = pool.layer(layer)
    check_x(x)
    x32 = x.to(torch.float32)
    mask = None
    if pool.n_out:
        oc = v.outlier_channels.to(torch.int64)  # [H, m]
        mask = torch.zeros(h, d, dtype=torch.bool).scatter_(-1, oc, True)
    s16 = group_scales(x32, pool.group, None if pool.include_outliers_in_amax else mask)
    if not bool(torch.isfinite(s16).all()):
        raise ValueError("x has values too large for an fp16 scale (amax / 126.5 > 65504)")
    if pool.dithered:
        xi = torch.stack([cached_dither(slots, d, layer=layer, kv_head=i, seed=pool.seed, side=pool.side,
                                        layout=pool.dither_layout) for i in range(h)], 1)
    else:
        xi = torch.zeros_like(x32)
    v.codes[slots] = quantize_codes(x32, s16, xi, pool.group, zero=mask)
    v.scales[slots] = s16
    if pool.n_out:
        outs = torch.gather(x32, -1, oc.unsqueeze(0).expand(n, -1, -1)).to(torch.float16)
        if not bool(torch.isfinite(outs).all()):
            raise ValueError("an outlier channel of x overflows fp16")
        v.outliers[slots] = outs


def write_rtn_reference(pool: PagedPool, layer: int, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Torch reference of ``rule="rtn"``: :meth:`kvlib.formats.rtn_int8.RtnInt8.write` (every head at once: its
    scales are per token and group), stored by slot."""
    from kvlib.formats.rtn_int8 import RtnInt8

    _check_write_args(pool, layer, x, slots, validate=True)
    n, h, d = x.shape
    p = RtnInt8(pool.group).write(x.reshape(n * h, d).float())
    v = pool.layer(layer)
    slots = slots.to(torch.int64)
    v.codes[slots] = p.codes.reshape(n, h, d)
    v.scales[slots] = p.scales.reshape(n, h, -1)


def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_write_int8_kernel, InterpretedFunction)


def write_int8_kv(
    kpool: PagedPool,
    vpool: PagedPool,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    *,
    rule: str = "witcert",
    validate: bool = False,
    block_s: int = 16,
    num_warps: int = 4,
) -> None:
    """:func:`write_int8` of ``k`` into ``kpool`` and ``v`` into ``vpool`` (same slots) in ONE launch (Triton; CUDA,
    or CPU tensors under TRITON_INTERPRET=1): the bytes two :func:`write_int8` calls store. The pools must share
    heads, head dim, group, seed, dither layout and the outlier-in-amax setting (as an
    :class:`kvlib.storage.pools.Int8Store`'s do); each keeps its own side, dither flag and outliers."""
    if rule not in ("witcert", "rtn"):
        raise ValueError(f"rule must be 'witcert' or 'rtn', got {rule!r}")
    for name, pool, x in (("kpool", kpool, k), ("vpool", vpool, v)):
        _check_write_args(pool, layer, x, slots, validate)
        if rule == "rtn" and (pool.dithered or pool.n_out):
            raise ValueError(f"{name}: rule='rtn' needs a pool built with dithered=False and n_out=0")
    for attr in ("n_kv_heads", "d", "group", "seed", "dither_layout", "include_outliers_in_amax", "n_slots"):
        if getattr(kpool, attr) != getattr(vpool, attr):
            raise ValueError(f"kpool and vpool must share {attr}, got {getattr(kpool, attr)!r} and "
                             f"{getattr(vpool, attr)!r}")
    if not k.is_cuda and not _interpreting():
        raise RuntimeError("write_int8_kv on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
    d, G = kpool.d, kpool.group
    if d & (d - 1) or d % 4 or (d // G) & (d // G - 1):
        raise ValueError(f"the Triton write kernel needs d and d // group powers of two, got d={d}, group={G}")
    check_layout_d(kpool.dither_layout, d)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    N, H = k.shape[0], kpool.n_kv_heads
    if N == 0:
        return
    k0, k1 = seed_key(kpool.seed)
    kv, vv = kpool.layer(layer), vpool.layer(layer)
    qdiv = 127.0 if rule == "rtn" else 126.5
    p2 = [max(triton.next_power_of_2(p.n_out), 1) if p.n_out else 1 for p in (kpool, vpool)]
    _write_int8_kv_kernel[(triton.cdiv(N, block_s), H, 2)](
        k, v, slots, kv.codes, kv.scales, kv.outliers, kv.outlier_channels, vv.codes, vv.scales, vv.outliers,
        vv.outlier_channels, N, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layer, kpool.side, vpool.side, k0, k1,
        H=H, D=d, G=G, NOUT_K=kpool.n_out, NOUT_P2_K=p2[0], DITHER_K=kpool.dithered,
        NOUT_V=vpool.n_out, NOUT_P2_V=p2[1], DITHER_V=vpool.dithered, INCLUDE_OUT=kpool.include_outliers_in_amax,
        USE_RINT=False, BLOCK_S=block_s, LAYOUT=kpool.dither_layout, num_warps=num_warps,
        QDIV=qdiv, QBUMP=qdiv + 0.5, RECIP=k.is_cuda, INV_QDIV=recip32(qdiv),
    )


def write_int8(
    pool: PagedPool,
    layer: int,
    x: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = True,
    block_s: int = 16,
    num_warps: int = 4,
    dither: bool | None = None,
    use_rint: bool = False,
    rule: str = "witcert",
) -> None:
    """Write ``x [N, H_kv, d]`` into ``pool`` at ``slots [N]`` for ``layer`` in one launch.

    ``validate=False`` skips the host-side checks that synchronise (NaN, slot range, duplicate
    slots); NaN then shows up as a NaN scale in the pool. ``backend``: ``"auto"`` (Triton on CUDA,
    torch reference on CPU), ``"triton"``, or ``"torch"``. ``dither=False`` overrides the pool's
    setting (benchmark ablation only: the stored codes then break the pool's contract).
    ``use_rint=True`` rounds with libdevice ``rint`` on CUDA instead of the floor-based spelling
    (same rounding, fewer instructions; the floor path is the one verified bit-identical on the H200).
    ``rule``: ``"witcert"`` (the storage contract: ``s = fp16(amax / 126.5)``, bumped where ``127 s < amax``)
    or ``"rtn"`` (:class:`kvlib.formats.rtn_int8.RtnInt8`: ``fp16(amax / 127)``, bumped where
    ``127.5 s < amax``, round to nearest; the pool must be ``dithered=False`` without outliers). The scale
    division is done as torch does it on the tensors' device (:mod:`kvlib.kernels.write`), so the stored
    bytes equal the torch path's there.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if rule not in ("witcert", "rtn"):
        raise ValueError(f"rule must be 'witcert' or 'rtn', got {rule!r}")
    if rule == "rtn" and (pool.dithered or pool.n_out):
        raise ValueError("rule='rtn' needs a pool built with dithered=False and n_out=0 (rtn-int8's layout)")
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        if rule == "rtn":
            write_rtn_reference(pool, layer, x, slots)
        else:
            write_int8_reference(pool, layer, x, slots, validate=validate)
        return
    _check_write_args(pool, layer, x, slots, validate)
    if not x.is_cuda and not _interpreting():
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
    d, G = pool.d, pool.group
    if d & (d - 1) or d % 4 or (d // G) & (d // G - 1):
        raise ValueError(f"the Triton write kernel needs d and d // group powers of two, got d={d}, group={G}")
    check_layout_d(pool.dither_layout, d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    k0, k1 = seed_key(pool.seed)
    v = pool.layer(layer)
    N, H = x.shape[0], pool.n_kv_heads
    if N == 0:
        return
    nout = pool.n_out
    qdiv = 127.0 if rule == "rtn" else 126.5
    grid = (triton.cdiv(N, block_s), H)
    _write_int8_kernel[grid](
        x, slots, v.codes, v.scales, v.outliers, v.outlier_channels,
        N, x.stride(0), x.stride(1),
        layer, pool.side, k0, k1,
        H=H, D=d, G=G, NOUT=nout, NOUT_P2=max(triton.next_power_of_2(nout), 1) if nout else 1,
        INCLUDE_OUT=pool.include_outliers_in_amax, DITHER=pool.dithered if dither is None else dither,
        USE_RINT=bool(use_rint and x.is_cuda and not _interpreting()), BLOCK_S=block_s,
        LAYOUT=pool.dither_layout, num_warps=num_warps,
        QDIV=qdiv, QBUMP=qdiv + 0.5, RECIP=x.is_cuda, INV_QDIV=recip32(qdiv),
    )
