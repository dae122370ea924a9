"""float64 torch reference of the INT8 decode kernels: the same radius and certificate, exactly computed.

:func:`decode_reference` mirrors :func:`kvlib.kernels.int8.decode.decode_int8`; ``impl`` picks the rounding
slack of the kernel being mirrored.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlib.certify.bound import (
    TC_RADIUS_INFLATE,
    bounds_from_AB,
    bypass_radius,
    certificate_from_scores,
    radius_multiplier,
    score_radius,
    variance_proxy,
)
from kvlib.core.checks import check_open_unit
from kvlib.core.dither_tables import cached_dither, clear_dither_cache  # noqa: F401 (re-exported)
from kvlib.kernels.int8.request import DecodeOut, PoolSide, as_side, check_request, key_layout, resolve_impl
from kvlib.kernels.tl.paging import slots_from_block_table


# The dither tables (the dither of a stream kept by slot): kvlib.core.dither_tables, shared with the formats' and
# the pools' CPU writes
# torch reference
def dequant_rows(side: PoolSide, slots: torch.Tensor, *, layer: int, kv_head: int, seed: int, side_id: int,
                 dithered: bool = True) -> torch.Tensor:
    """float64 ``[L, d]`` of one KV head at ``slots``: ``s (c - xi)`` (``s c`` for RTN), outliers substituted."""
    codes = side.codes[slots, kv_head].to(torch.float64)
    s = side.scales[slots, kv_head].to(torch.float64).repeat_interleave(side.group, dim=-1)
    d = codes.shape[-1]
    if dithered:
        xi = cached_dither(slots, d, layer=layer, kv_head=kv_head, seed=seed, side=side_id,
                           layout=side.dither_layout)
        x = s * (codes - xi.to(codes.device, torch.float64))
    else:
        x = s * codes
    if side.outliers is not None:
        oc = side.outlier_channels[kv_head].to(torch.int64)
        x[:, oc] = side.outliers[slots, kv_head].to(torch.float64)
    return x


def _query_residual_mult(q: torch.Tensor, sm: float, group: int, outlier_channels: torch.Tensor | None,
                         impl: str = "tc") -> torch.Tensor:
    """The tensor-core kernels' multiplier ``detm`` (per row, float64) for what their fp16 query split leaves.

    ``tc``: fp32 queries are split ``hi + lo`` (two fp16 dots), fp16/bf16 ones rounded once; the residual
    ``r`` costs at most ``sm 127.5 sum_g R_g s_g`` (``R_g = sum_{c in g} |r_c|``, ``127.5 >= |c - xi|``),
    which Cauchy-Schwarz bounds by ``detm * sqrt(var)`` with
    ``detm = sm 127.5 i sqrt(sum_g R_g^2 / Q2_g) / sqrt(sm^2 i / 12)``, ``Q2_g = sum_{c in g} q_c^2``,
    ``i`` = :data:`kvlib.certify.bound.TC_RADIUS_INFLATE`.
    ``h10``: the codes meet ``hi + lo`` but the dither only ``hi``; with ``r1 = q - fp16(q)`` and
    ``r2 = r1 - fp16(r1)`` (``r2 = r1`` for fp16/bf16 queries) a channel errs by at most
    ``127 |r2_c| + |xi| |r1_c| <= 127.5 (|r2_c| + |r1_c| / 255)``, which replaces ``|r_c|`` in ``R_g``.
    """
    qf = q.float()
    if outlier_channels is not None:
        qf = qf.clone()
        qf[:, outlier_channels.to(torch.int64)] = 0.0
    r1 = qf - qf.half().float()
    r2 = r1 - r1.half().float() if q.dtype == torch.float32 else r1
    r = r2.abs().double() + (r1.abs().double() / 255.0 if impl == "h10" else 0.0)
    rg = r.reshape(r.shape[0], -1, group).sum(-1)  # [gqa, NG]
    q2 = qf.double().pow(2).reshape(qf.shape[0], -1, group).sum(-1)
    ratio = torch.where(q2 > 0, rg.pow(2) / torch.where(q2 > 0, q2, torch.ones_like(q2)),
                        torch.where(rg > 0, torch.full_like(rg, math.inf), torch.zeros_like(rg)))
    var_c = sm * sm / 12.0 * TC_RADIUS_INFLATE
    return sm * 127.5 * TC_RADIUS_INFLATE * ratio.sum(-1).sqrt() / math.sqrt(var_c)


def decode_reference(
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor | None, seq_lens: torch.Tensor, *,
    layer: int, seed: int, sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False,
    return_probs: bool = False, impl: str = "auto", block_table: torch.Tensor | None = None,
    block_size: int | None = None, kernel_rounding: str | None = None,
) -> DecodeOut | tuple[DecodeOut, list[torch.Tensor]]:
    """float64 torch reference of :func:`decode_int8` (same radius, same certificate).

    ``impl`` picks the rounding slack of the kernel being mirrored (:func:`resolve_impl`, with the key
    pool's ``dither_layout``; an h10 pool takes ``"h10"`` or, for any shape, ``"fma"``). Requests address the
    pool by ``slots`` or by ``block_table`` + ``block_size`` (:mod:`kvlib.kernels.tl.paging`). A key pool stored
    without dither (``dithered=False``, RTN keys) is read as ``s c`` and gives no certificate (the fields are None).
    ``kernel_rounding="h10"`` (in place of ``impl``): the h10 rounding slack for a kernel that reads shapes the
    Triton h10 kernel does not (:mod:`kvlib.kernels.int8.wspec_cert` at d = 64 with groups of 32: its operands and
    sums are the Gluon kernel's, whose slack is h10's at the request's ``d``); h8 or h10 keys, RTN values.
    """
    k = as_side(k_pool, "k_pool")
    v = as_side(v_pool, "v_pool")
    check_request(q, k, v, slots, seq_lens, block_table, block_size)
    if block_table is not None:
        slots = slots_from_block_table(block_table, block_size)
    delta = check_open_unit("delta", delta)
    if kernel_rounding is not None:
        if kernel_rounding != "h10":
            raise ValueError(f"kernel_rounding must be 'h10' or None, got {kernel_rounding!r}")
        if k.dither_layout not in ("h10", "h8") or v_dither:
            raise ValueError(f"kernel_rounding='h10' needs h10/h8 keys and RTN values, got "
                             f"dither_layout={k.dither_layout!r}, v_dither={v_dither!r}")
        impl = "h10"
    else:
        impl = resolve_impl(impl, q.shape[-1], k.group, v_dither, key_layout(k, impl))
    k, v, q, slots, seq_lens = _side_cpu(k), _side_cpu(v), q.cpu(), slots.cpu(), seq_lens.cpu()
    B, hq, d = q.shape
    hkv = k.codes.shape[1]
    gqa = hq // hkv
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    o = torch.zeros(B, hq, d, dtype=torch.float64)
    lse = torch.zeros(B, hq, dtype=torch.float64)
    A = torch.zeros(B, hq, dtype=torch.float64)
    Bv = torch.zeros(B, hq, dtype=torch.float64)
    probs = []
    for b in range(B):
        L = int(seq_lens[b])
        sl = slots[b, :L].to(torch.int64).cpu()
        pb = torch.zeros(hq, L, dtype=torch.float64)
        for h in range(hkv):
            kh = dequant_rows(k, sl, layer=layer, kv_head=h, seed=seed, side_id=0, dithered=k.dithered)
            vh = dequant_rows(v, sl, layer=layer, kv_head=h, seed=seed, side_id=1, dithered=v_dither)
            qh = q[b, h * gqa:(h + 1) * gqa].to(torch.float64).cpu()
            z = sm * qh @ kh.T  # [gqa, L]
            p = torch.softmax(z, -1)
            o[b, h * gqa:(h + 1) * gqa] = p @ vh
            lse[b, h * gqa:(h + 1) * gqa] = torch.logsumexp(z, -1)
            pb[h * gqa:(h + 1) * gqa] = p
            if not k.dithered:  # RTN keys: no variance proxy, no certificate
                continue
            oc = k.outlier_channels[h].cpu() if k.outliers is not None else None
            out = k.outliers[sl, h].cpu() if k.outliers is not None else None
            u = score_radius(qh, k.scales[sl, h].cpu(), sm_scale=sm, n=L, delta=delta, group=k.group,
                             outlier_channels=oc, outliers=out, impl=impl, layout=k.dither_layout)
            if impl in ("tc", "h10"):
                var = variance_proxy(qh, k.scales[sl, h].cpu(), sm_scale=sm, group=k.group, outlier_channels=oc)
                detm = _query_residual_mult(q[b, h * gqa:(h + 1) * gqa], sm, k.group, oc, impl)
                u = u + (var * TC_RADIUS_INFLATE).sqrt() * (detm * TC_RADIUS_INFLATE).unsqueeze(-1)
            c = certificate_from_scores(z, u)
            A[b, h * gqa:(h + 1) * gqa] = c.A
            Bv[b, h * gqa:(h + 1) * gqa] = c.B
        probs.append(pb)
    if k.dithered:
        two, one, vac = bounds_from_AB(A, Bv)
        res = DecodeOut(o, lse, A, Bv, two, one, vac)
    else:
        res = DecodeOut(o, lse)
    return (res, probs) if return_probs else res


def _side_cpu(side: PoolSide) -> PoolSide:
    mv = lambda t: None if t is None else t.cpu()  # noqa: E731
    return PoolSide(side.codes.cpu(), side.scales.cpu(), mv(side.outliers), mv(side.outlier_channels), side.group,
                    side.dither_layout, side.dithered)


# batched torch reference: the CPU decode path of the HF cache
def _dequant_batched(side: PoolSide, sl: torch.Tensor, *, layer: int, seed: int, side_id: int, dithered: bool,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[H, B, L, d]`` (head-major: every (head, row) block contiguous for the matmuls) in ``dtype`` of every KV
    head at slots ``sl [B, L]``: ``s (c - xi)`` (``s c`` for RTN), outliers substituted. In float64 the values of
    :func:`dequant_rows` (every operation exact there); in float32 the fp32 kernel's dequantisation (one rounding
    for ``c - xi``, one for the product)."""
    b, n = sl.shape
    hkv, d = side.codes.shape[1], side.codes.shape[2]
    flat = sl.reshape(-1)
    ng = side.scales.shape[-1]
    x = torch.empty(hkv, b * n, d, dtype=dtype)
    for h in range(hkv):  # whole rows of one head at a time, each step in place
        xh = x[h]
        xh.copy_(side.codes[:, h].index_select(0, flat))
        if dithered:
            xh.sub_(cached_dither(flat, d, layer=layer, kv_head=h, seed=seed, side=side_id,
                                  layout=side.dither_layout).to(dtype))
        xh.view(b * n, ng, -1).mul_(side.scales[:, h].index_select(0, flat).to(dtype).unsqueeze(-1))
        if side.outliers is not None:
            oc = side.outlier_channels[h].to(torch.int64)
            xh[:, oc] = side.outliers[:, h].index_select(0, flat).to(dtype)
    return x.view(hkv, b, n, d)


def _query_residual_mult_batched(q: torch.Tensor, sm: float, group: int, outlier_channels: torch.Tensor | None,
                                 impl: str) -> torch.Tensor:
    """:func:`_query_residual_mult` of ``q [..., Hkv, gqa, d]`` with per-head outlier channels ``[Hkv, m]``."""
    qf = q.float()
    if outlier_channels is not None:
        keep = torch.ones(outlier_channels.shape[0], q.shape[-1], dtype=torch.bool)
        keep.scatter_(-1, outlier_channels.to(torch.int64), False)
        qf = qf * keep[:, None, :]
    r1 = qf - qf.half().float()
    r2 = r1 - r1.half().float() if q.dtype == torch.float32 else r1
    r = r2.abs().double() + (r1.abs().double() / 255.0 if impl == "h10" else 0.0)
    rg = r.unflatten(-1, (-1, group)).sum(-1)
    q2 = qf.double().pow(2).unflatten(-1, (-1, group)).sum(-1)
    ratio = torch.where(q2 > 0, rg.pow(2) / torch.where(q2 > 0, q2, torch.ones_like(q2)),
                        torch.where(rg > 0, torch.full_like(rg, math.inf), torch.zeros_like(rg)))
    var_c = sm * sm / 12.0 * TC_RADIUS_INFLATE
    return sm * 127.5 * TC_RADIUS_INFLATE * ratio.sum(-1).sqrt() / math.sqrt(var_c)


#: arithmetic of :func:`decode_reference_batched`
PRECISIONS = ("float64", "float32")


def decode_reference_batched(
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor, seq_lens: torch.Tensor, *, layer: int,
    seed: int, sm_scale: float | None = None, delta: float = 1e-2, impl: str = "auto", precision: str = "float64",
    return_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`decode_reference` (RTN values) of every row and KV head in one batch of tensor operations:
    ``(o [B, Hq, d], tv_bound_one [B, Hq] or None for RTN keys)``; with ``return_scores`` also the computed
    scores ``z [B, Hq, L]`` (float64, ``-inf`` past each row's length). Rows shorter than the longest are padded
    and masked (exact zeros in every sum).

    ``precision="float64"``: :func:`decode_reference`'s values up to float64 summation order
    (``tests/test_reference_speedups.py`` binds the two). ``"float32"``: the fp32 kernel's arithmetic (``impl``
    must be ``"fma"`` or ``"auto"``, which then means ``"fma"``): keys dequantised and dotted with the query in
    fp32, which is exactly the rounding the ``fma`` radius's slack covers (:func:`kvlib.certify.bound.
    rounding_slack`), so the certificate bounds the attention this path computes; softmax, radius and
    certificate in float64, ``p @ V`` in fp32. The HF cache's CPU decode path takes it: the per-row loop of the
    reference cost a dozen small tensor operations per (row, head), and float64 doubled every large one."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    k = as_side(k_pool, "k_pool")
    v = as_side(v_pool, "v_pool")
    if precision == "float32":
        if impl not in ("auto", "fma"):
            raise ValueError(f"precision='float32' computes the fp32 kernel's arithmetic, whose radius is impl='fma'; "
                             f"got impl={impl!r}")
        impl = "fma"
    impl = resolve_impl(impl, q.shape[-1], k.group, False, key_layout(k, impl))
    delta = check_open_unit("delta", delta)
    k, v, q, slots, seq_lens = _side_cpu(k), _side_cpu(v), q.cpu(), slots.cpu(), seq_lens.cpu()
    ft = torch.float64 if precision == "float64" else torch.float32
    B, hq, d = q.shape
    hkv = k.codes.shape[1]
    gqa = hq // hkv
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    lens = seq_lens.to(torch.int64)
    n = max(int(lens.max()), 1) if lens.numel() else 1
    valid = torch.arange(n)[None, :] < lens[:, None]  # [B, L]
    sl = torch.where(valid, slots[:, :n].to(torch.int64), torch.zeros((), dtype=torch.int64))
    kh = _dequant_batched(k, sl, layer=layer, seed=seed, side_id=0, dithered=k.dithered, dtype=ft)  # [H, B, L, d]
    vh = _dequant_batched(v, sl, layer=layer, seed=seed, side_id=1, dithered=False, dtype=ft)
    qh = q.to(ft).view(B, hkv, gqa, d).transpose(0, 1)  # [H, B, gqa, d]
    vm = valid[:, None, None, :]  # [B, 1, 1, L]
    # fp32: the dot alone in fp32 (what the fma slack covers), then sm in float64
    z = sm * (kh @ qh.transpose(-1, -2)).permute(1, 0, 3, 2).to(torch.float64)  # [B, H, gqa, L]
    zm = torch.where(vm, z, torch.full_like(z, -math.inf))
    p = torch.softmax(zm, -1)
    o = (p.to(ft).transpose(0, 1) @ vh).transpose(0, 1).reshape(B, hq, d)
    if not k.dithered:
        return (o, None, zm.reshape(B, hq, n)) if return_scores else (o, None)
    q64 = q.to(torch.float64).view(B, hkv, gqa, d)
    oc = k.outlier_channels.to(torch.int64) if k.outliers is not None else None  # [H, m]
    heads = torch.arange(hkv)[None, :, None]
    scales = k.scales[sl[:, None, :], heads].unsqueeze(2)  # [B, H, 1, L, ng]
    var = variance_proxy(q64, scales, sm_scale=sm, group=k.group, outlier_channels=None if oc is None else oc[:, None])
    inflate = TC_RADIUS_INFLATE if impl in ("tc", "h10") else 1.0
    mult = radius_multiplier(lens.clamp(min=1), delta, d, impl=impl, layout=k.dither_layout)  # [B]
    u = (var * inflate).sqrt() * mult.view(B, 1, 1, 1)
    if oc is not None:
        outs = k.outliers[sl[:, None, :], heads].unsqueeze(2)  # [B, H, 1, L, m]
        u = u + bypass_radius(q64, outs, oc[:, None], sm_scale=sm, inflate=inflate)
    if impl in ("tc", "h10"):
        detm = _query_residual_mult_batched(q.view(B, hkv, gqa, d), sm, k.group, oc, impl)  # [B, H, gqa]
        u = u + (var * TC_RADIUS_INFLATE).sqrt() * (detm * TC_RADIUS_INFLATE).unsqueeze(-1)
    # certificate_from_scores over each row's own positions (pads: -inf scores, contributing exact zeros)
    lse = torch.logsumexp(zm, -1)
    A = torch.exp(torch.logsumexp(zm + u, -1) - lse)
    Bv = torch.exp(torch.logsumexp(zm - u, -1) - lse)
    bad = (~torch.isfinite(z) & vm).any(-1) | (torch.isnan(u) & vm).any(-1)
    A = torch.where(bad, torch.full_like(A, math.nan), A)
    _, one, _ = bounds_from_AB(A, Bv)
    one = one.reshape(B, hq)
    return (o, one, zm.reshape(B, hq, n)) if return_scores else (o, one)
