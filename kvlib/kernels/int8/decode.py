"""Split-KV decode attention over the dithered INT8 paged pool, with the WitCert certificate.

Flash-decoding structure (as SGLang's ``decode_attention.py``):

* stage 1, one program per (batch row, KV head, split): loads each KV tile ONCE for all query
  heads of the GQA group, regenerates the key dither (one Philox4x32-10 call per four channels,
  its four words spread over the four bytes of one int32 code word), dequantises, computes scores,
  the online softmax and the output, and beside them the certificate accumulators
  ``A_s = sum p e^{u}/l`` and ``B_s = sum p e^{-u}/l`` with the radius from one ``tl.dot`` of
  ``q^2`` with ``s^2`` per tile (plus the fp16 outlier term); writes ``(o_s, lse_s, A_s, B_s)``;
* stage 2, one program per (batch row, query head): :func:`kvlib.kernels.tl.merge.merge_splits`
  merges the splits with LSE weights, ``A`` and ``B`` riding the same weights as the output, and
  finishes the bounds. It is the Triton twin of folding :func:`kvlib.core.merge.merge_states`
  (:func:`kvlib.kernels.tl.merge.merge_splits_ref`; a test binds them).

The certificate can be switched off (``cert=False``, a constexpr) to measure its marginal cost.

Layout read (the storage contract of :mod:`kvlib.formats.dither_int8` / :mod:`kvlib.storage.paged`), per
side (K or V) of one layer: ``codes`` int8 ``[n_slots, H_kv, d]``, ``scales`` fp16
``[n_slots, H_kv, d // G]``, optional ``outliers`` fp16 ``[n_slots, H_kv, m]`` with
``outlier_channels`` int64 ``[H_kv, m]`` (code 0 there). Requests are rows of a slot table
``slots [B, max_len]`` with lengths ``seq_lens [B]``.

:func:`decode_reference` (torch, float64) is the reference; on CPU the kernel runs under
``TRITON_INTERPRET=1`` (set before triton is imported) and otherwise falls back to the reference.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvlib.certify.bound import (
    FP16_REL,
    FP16_SUB,
    TC_RADIUS_INFLATE,
    bounds_from_AB,
    certificate_from_scores,
    radius_multiplier,
    rounding_gamma,
    score_radius,
    variance_proxy,
)
from kvlib.core.checks import check_group, check_open_unit, check_tensor
from kvlib.core.philox import check_layout, dither, seed_key
from kvlib.kernels.backend import triton_available
from kvlib.kernels.tl.cert import abs_up_fp16, split_fp16, union_radius
from kvlib.kernels.tl.merge import merge_splits, split_range
from kvlib.kernels.tl.philox import philox4x32


# ----------------------------------------------------------------------------------------------
# storage view
@dataclass
class PoolSide:
    """One side (K or V) of one layer's INT8 pool (see the module docstring for shapes)."""

    codes: torch.Tensor
    scales: torch.Tensor
    outliers: torch.Tensor | None = None
    outlier_channels: torch.Tensor | None = None
    group: int = 32
    dither_layout: str = "w24"  # Philox dither layout of the stored codes (kvlib.core.philox.DITHER_LAYOUTS)


def as_side(x: Any, name: str) -> PoolSide:
    """Accept a :class:`PoolSide` or any object with ``codes``/``scales`` (and optional outliers)."""
    if isinstance(x, PoolSide):
        side = x
    elif hasattr(x, "codes") and hasattr(x, "scales"):
        group = getattr(x, "group", None)
        if group is None and x.scales.ndim == 3 and x.scales.shape[-1]:
            group = x.codes.shape[-1] // x.scales.shape[-1]  # e.g. kvlib.storage.paged.LayerView
        side = PoolSide(x.codes, x.scales, getattr(x, "outliers", None), getattr(x, "outlier_channels", None),
                        int(group or 32), getattr(x, "dither_layout", "w24"))
    else:
        raise TypeError(f"{name} must be a PoolSide (codes, scales, outliers, outlier_channels), "
                        f"got {type(x).__name__}")
    check_layout(side.dither_layout)
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
            side = PoolSide(side.codes, side.scales, None, None, side.group, side.dither_layout)
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


def _check_request(q: torch.Tensor, k: PoolSide, v: PoolSide, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
    check_tensor("q", q, ndim=3, floating=True)
    n_slots, hkv, d = k.codes.shape
    if tuple(v.codes.shape) != (n_slots, hkv, d) or v.group != k.group:
        raise ValueError(f"v_pool must match k_pool's shape {(n_slots, hkv, d)} and group, got {tuple(v.codes.shape)}")
    B, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"q's head dim {dq} must equal the pool's d={d}")
    if hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of KV heads ({hkv}) (GQA)")
    check_tensor("slots", slots, ndim=2, floating=False)
    check_tensor("seq_lens", seq_lens, ndim=1, floating=False)
    if slots.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(f"slots [B, max_len] and seq_lens [B] must have B={B} rows, "
                         f"got {tuple(slots.shape)}, {tuple(seq_lens.shape)}")
    if d % 4 != 0 or k.group % 4 != 0:
        raise ValueError(f"d={d} and group={k.group} must be multiples of 4 (one Philox call per four channels)")


def resolve_impl(impl: str, d: int, group: int, v_dither: bool = False, layout: str = "w24") -> str:
    """``"tc"``/``"fma"`` as asked; ``"auto"`` is ``tc`` where its rules hold (``d`` and ``group``
    powers of two, ``group >= 16`` for the 16-deep tensor-core dot, RTN values), else ``fma``.

    Dithered values go to ``fma``: the tc kernel's value-dither path matched the reference under the
    CPU interpreter but not on the H200 (2026-11-29), so it was removed rather than shipped unexplained.

    ``layout`` is the key pool's dither layout. ``"h10"`` or ``"h8"``: ``"auto"``/``"h10"`` give ``"h10"`` (the
    kernel reads both half-word layouts; it needs ``group == d // 4``, ``group`` in (32, 64), ``d >= 128``;
    other shapes raise), ``"fma"`` stays ``"fma"`` for :func:`decode_reference` only (the Triton fma kernel
    reads ``w24``), ``"tc"`` raises. ``"w24"``: ``"h10"`` raises, the rest as above.
    """
    if check_layout(layout) in ("h10", "h8"):
        if impl == "gluon":
            if layout != "h8":
                raise ValueError(f"impl='gluon' reads the h8 dither layout only, got dither_layout={layout!r}")
            return "gluon"
        if impl in ("auto", "h10"):
            if group != d // 4 or group not in (32, 64):
                raise ValueError(f"impl='h10' (dither_layout={layout!r}) needs group == d // 4 with group in (32, 64), "
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
    ok = pow2(d) and pow2(group) and group >= 16 and not v_dither
    if impl == "auto":
        return "tc" if ok else "fma"
    if impl == "tc" and not ok:
        raise ValueError(f"impl='tc' needs d and group powers of two with group >= 16 and RTN values "
                         f"(v_dither=False), got d={d}, group={group}, v_dither={v_dither}")
    if impl not in ("tc", "fma"):
        raise ValueError(f"impl must be 'auto', 'tc' or 'fma', got {impl!r}")
    return impl


# ----------------------------------------------------------------------------------------------
# torch reference
def dequant_rows(side: PoolSide, slots: torch.Tensor, *, layer: int, kv_head: int, seed: int, side_id: int,
                 dithered: bool = True) -> torch.Tensor:
    """float64 ``[L, d]`` of one KV head at ``slots``: ``s (c - xi)`` (``s c`` for RTN), outliers substituted."""
    codes = side.codes[slots, kv_head].to(torch.float64)
    s = side.scales[slots, kv_head].to(torch.float64).repeat_interleave(side.group, dim=-1)
    d = codes.shape[-1]
    if dithered:
        xi = dither(slots.to(torch.int64).cpu(), d, layer=layer, kv_head=kv_head, seed=seed, side=side_id,
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
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor, seq_lens: torch.Tensor, *,
    layer: int, seed: int, sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False,
    return_probs: bool = False, impl: str = "auto",
) -> DecodeOut | tuple[DecodeOut, list[torch.Tensor]]:
    """float64 torch reference of :func:`decode_int8` (same radius, same certificate).

    ``impl`` picks the rounding slack of the kernel being mirrored (:func:`resolve_impl`, with the key
    pool's ``dither_layout``; an h10 pool takes ``"h10"`` or, for any shape, ``"fma"``).
    """
    k = as_side(k_pool, "k_pool")
    v = as_side(v_pool, "v_pool")
    _check_request(q, k, v, slots, seq_lens)
    delta = check_open_unit("delta", delta)
    impl = resolve_impl(impl, q.shape[-1], k.group, v_dither, k.dither_layout)
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
            kh = dequant_rows(k, sl, layer=layer, kv_head=h, seed=seed, side_id=0)
            vh = dequant_rows(v, sl, layer=layer, kv_head=h, seed=seed, side_id=1, dithered=v_dither)
            qh = q[b, h * gqa:(h + 1) * gqa].to(torch.float64).cpu()
            z = sm * qh @ kh.T  # [gqa, L]
            p = torch.softmax(z, -1)
            o[b, h * gqa:(h + 1) * gqa] = p @ vh
            lse[b, h * gqa:(h + 1) * gqa] = torch.logsumexp(z, -1)
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
            pb[h * gqa:(h + 1) * gqa] = p
        probs.append(pb)
    two, one, vac = bounds_from_AB(A, Bv)
    res = DecodeOut(o, lse, A, Bv, two, one, vac)
    return (res, probs) if return_probs else res


def _side_cpu(side: PoolSide) -> PoolSide:
    mv = lambda t: None if t is None else t.cpu()  # noqa: E731
    return PoolSide(side.codes.cpu(), side.scales.cpu(), mv(side.outliers), mv(side.outlier_channels), side.group,
                    side.dither_layout)


# ----------------------------------------------------------------------------------------------
# Triton kernels
def _patch_interpreter_index() -> None:
    """Let the CPU interpreter run loops with run-time bounds under numpy >= 2.4.

    Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with ``int()``,
    which numpy 2.4 refuses for arrays with ndim > 0; only the interpreter is touched.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter as _interp

    orig = _interp._patch_lang_tensor
    if getattr(orig, "_kvlib_index", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._kvlib_index = True
    _interp._patch_lang_tensor = patched


_patch_interpreter_index()

@triton.jit
def _byte(w, J: tl.constexpr):
    """Signed byte ``J`` (little endian: channel 4g + J) of int32 code words."""
    return (w << (24 - 8 * J)) >> 24


@triton.jit
def _xi(w):
    """WitCert dither ``(w >> 8) 2^-24 + 2^-25 - 1/2`` exact in fp32 (same as philox_tl.word_to_xi)."""
    n = 2 * (w.to(tl.uint32) >> 8).to(tl.int32) + (1 - (1 << 24))
    return n.to(tl.float32) * 2.9802322387695312e-08


@triton.jit(do_not_specialize=["layer", "seed_lo", "seed_hi"])
def _decode_int8_stage1(
    Q, KW, KS, KO, KOC, VW, VS, VO, VOC, SLOTS, SEQ,
    O_S, LSE_S, A_S, B_S,
    sm_scale, byp_rel, byp_abs, log_2_over_delta, rad_extra, layer, seed_lo, seed_hi,
    s_qb, s_qh,
    s_kw_n, s_kw_h, s_ks_n, s_ks_h, s_ko_n, s_ko_h,
    s_vw_n, s_vw_h, s_vs_n, s_vs_h, s_vo_n, s_vo_h,
    s_sl_b,
    s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    NOK: tl.constexpr, NOK_P: tl.constexpr, NOV: tl.constexpr, NOV_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, CERT: tl.constexpr, CERT_B: tl.constexpr, V_DITHER: tl.constexpr,
    K_PREC: tl.constexpr, V_PREC: tl.constexpr, JOIN: tl.constexpr, VAR_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    D4: tl.constexpr = D // 4
    seq_len, start, end = split_range(SEQ, b, split, NUM_SPLITS)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    offs_g = tl.arange(0, D4)
    sgrp = offs_g // (G // 4)  # scale index of each word
    q_base = Q + b * s_qb + heads[:, None] * s_qh + 4 * offs_g[None, :]
    q0 = tl.load(q_base + 0, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(q_base + 1, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_base + 2, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(q_base + 3, mask=mask_h[:, None], other=0.0).to(tl.float32)
    if NOK > 0:
        offs_ok = tl.arange(0, NOK_P)
        mask_ok = offs_ok < NOK
        koc = tl.load(KOC + kvh * NOK + offs_ok, mask=mask_ok, other=-1).to(tl.int32)
        q_ko = tl.load(Q + b * s_qb + heads[:, None] * s_qh + koc[None, :],
                       mask=mask_h[:, None] & mask_ok[None, :], other=0.0).to(tl.float32)
        # outlier channels are not dithered: their codes are 0 and their q leaves the dithered dot
        q0 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 0).to(tl.int32), 0) > 0)[None, :], 0.0, q0)
        q1 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 1).to(tl.int32), 0) > 0)[None, :], 0.0, q1)
        q2 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 2).to(tl.int32), 0) > 0)[None, :], 0.0, q2)
        q3 = tl.where((tl.sum((koc[:, None] == 4 * offs_g[None, :] + 3).to(tl.int32), 0) > 0)[None, :], 0.0, q3)
    if JOIN:
        offs_d = tl.arange(0, D)
        qn = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        qn = qn.to(tl.float32)
        if NOK > 0:
            qn = tl.where((tl.sum((koc[:, None] == offs_d[None, :]).to(tl.int32), 0) > 0)[None, :], 0.0, qn)
    if NOV > 0:
        offs_ov = tl.arange(0, NOV_P)
        mask_ov = offs_ov < NOV
        voc = tl.load(VOC + kvh * NOV + offs_ov, mask=mask_ov, other=-1).to(tl.int32)
        vkeep0 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 0).to(tl.int32), 0) == 0
        vkeep1 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 1).to(tl.int32), 0) == 0
        vkeep2 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 2).to(tl.int32), 0) == 0
        vkeep3 = tl.sum((voc[:, None] == 4 * offs_g[None, :] + 3).to(tl.int32), 0) == 0
        acc_vo = tl.zeros([BLOCK_H, NOV_P], dtype=tl.float32)
        if JOIN:
            vkeep = tl.sum((voc[:, None] == offs_d[None, :]).to(tl.int32), 0) == 0
    if CERT:
        qsq = q0 * q0 + q1 * q1 + q2 * q2 + q3 * q3  # [BLOCK_H, D4]: sum of q^2 over each word's 4 channels
        NG: tl.constexpr = D // G
        offs_ng = tl.arange(0, NG)
        # [BLOCK_H, NG]: sum of q^2 over each scale group (outlier channels already zeroed)
        q2g = tl.sum(tl.where(sgrp[None, None, :] == offs_ng[None, :, None], qsq[:, None, :], 0.0), 2)
        # sqrt(2 ln(2N/delta)) + slack, N = this row's length (kvlib.certify.bound.radius_multiplier)
        radm = union_radius(seq_len, log_2_over_delta, rad_extra)
        var_c = sm_scale * sm_scale / 12.0
        if NOK > 0:
            q_ko_abs = tl.abs(q_ko)
            q_ko_sum = tl.sum(q_ko_abs, 1)
        a_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        if CERT_B:
            b_i = tl.zeros([BLOCK_H], dtype=tl.float32)

    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    c3k = ((layer << 1) | 0).to(tl.uint32)
    c3v = ((layer << 1) | 1).to(tl.uint32)
    c2 = kvh.to(tl.uint32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, D4], dtype=tl.float32)
    if JOIN:
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(SLOTS + b * s_sl_b + offs_n, mask=mask_n, other=0).to(tl.int64)
        # ---- keys: one int32 word = 4 channels = one Philox call
        kw = tl.load(KW + slot[:, None] * s_kw_n + kvh * s_kw_h + offs_g[None, :], mask=mask_n[:, None], other=0)
        ks = tl.load(KS + slot[:, None] * s_ks_n + kvh * s_ks_h + sgrp[None, :], mask=mask_n[:, None],
                     other=0.0).to(tl.float32)
        c0 = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, D4], dtype=tl.uint32)
        c1 = offs_g.to(tl.uint32)[None, :] + tl.zeros([BLOCK_N, D4], dtype=tl.uint32)
        w0, w1, w2, w3 = philox4x32(c0, c1, c2 + tl.zeros_like(c0), c3k + tl.zeros_like(c0), k0, k1)
        kh0 = ks * (_byte(kw, 0).to(tl.float32) - _xi(w0))
        kh1 = ks * (_byte(kw, 1).to(tl.float32) - _xi(w1))
        kh2 = ks * (_byte(kw, 2).to(tl.float32) - _xi(w2))
        kh3 = ks * (_byte(kw, 3).to(tl.float32) - _xi(w3))
        if JOIN:  # one [BLOCK_N, D] tile in natural channel order: byte J of word g is channel 4g + J
            kh = tl.reshape(tl.join(tl.join(kh0, kh2), tl.join(kh1, kh3)), (BLOCK_N, D))
            qk = tl.dot(qn, tl.trans(kh), input_precision=K_PREC)
        else:
            qk = tl.dot(q0, tl.trans(kh0), input_precision=K_PREC)
            qk += tl.dot(q1, tl.trans(kh1), input_precision=K_PREC)
            qk += tl.dot(q2, tl.trans(kh2), input_precision=K_PREC)
            qk += tl.dot(q3, tl.trans(kh3), input_precision=K_PREC)
        if NOK > 0:
            ko = tl.load(KO + slot[:, None] * s_ko_n + kvh * s_ko_h + offs_ok[None, :],
                         mask=mask_n[:, None] & mask_ok[None, :], other=0.0).to(tl.float32)
            qk += tl.sum(q_ko[:, None, :] * ko[None, :, :], 2)
        qk = tl.where(mask_n[None, :], qk * sm_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if CERT:
            if VAR_DOT:  # one tl.dot of q^2 with s^2 over the words of the tile
                var = tl.dot(qsq, tl.trans(ks * ks), input_precision="ieee")
            else:  # the same sum over the D // G scale groups: NG broadcast FMAs, no layout change
                var = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
                for gi in tl.static_range(NG):
                    s_g = tl.load(KS + slot * s_ks_n + kvh * s_ks_h + gi, mask=mask_n, other=0.0).to(tl.float32)
                    q2_g = tl.sum(tl.where(offs_ng[None, :] == gi, q2g, 0.0), 1)
                    var += q2_g[:, None] * (s_g * s_g)[None, :]
            var = var * var_c  # [BLOCK_H, BLOCK_N]
            u = tl.sqrt(var) * radm
            if NOK > 0:
                u += sm_scale * (tl.sum(q_ko_abs[:, None, :] * tl.abs(ko)[None, :, :], 2) * byp_rel
                                 + q_ko_sum[:, None] * byp_abs)
            a_i = a_i * alpha + tl.sum(p * tl.exp(u), 1)
            if CERT_B:
                b_i = b_i * alpha + tl.sum(p * tl.exp(-u), 1)

        # ---- values
        vw = tl.load(VW + slot[:, None] * s_vw_n + kvh * s_vw_h + offs_g[None, :], mask=mask_n[:, None], other=0)
        vs = tl.load(VS + slot[:, None] * s_vs_n + kvh * s_vs_h + sgrp[None, :], mask=mask_n[:, None],
                     other=0.0).to(tl.float32)
        if V_DITHER:
            x0, x1, x2, x3 = philox4x32(c0, c1, c2 + tl.zeros_like(c0), c3v + tl.zeros_like(c0), k0, k1)
            vh0 = vs * (_byte(vw, 0).to(tl.float32) - _xi(x0))
            vh1 = vs * (_byte(vw, 1).to(tl.float32) - _xi(x1))
            vh2 = vs * (_byte(vw, 2).to(tl.float32) - _xi(x2))
            vh3 = vs * (_byte(vw, 3).to(tl.float32) - _xi(x3))
        else:
            vh0 = vs * _byte(vw, 0).to(tl.float32)
            vh1 = vs * _byte(vw, 1).to(tl.float32)
            vh2 = vs * _byte(vw, 2).to(tl.float32)
            vh3 = vs * _byte(vw, 3).to(tl.float32)
        if NOV > 0 and not JOIN:
            vh0 = tl.where(vkeep0[None, :], vh0, 0.0)
            vh1 = tl.where(vkeep1[None, :], vh1, 0.0)
            vh2 = tl.where(vkeep2[None, :], vh2, 0.0)
            vh3 = tl.where(vkeep3[None, :], vh3, 0.0)
        if NOV > 0:
            vo = tl.load(VO + slot[:, None] * s_vo_n + kvh * s_vo_h + offs_ov[None, :],
                         mask=mask_n[:, None] & mask_ov[None, :], other=0.0).to(tl.float32)
            acc_vo = acc_vo * alpha[:, None] + tl.sum(p[:, :, None] * vo[None, :, :], 1)
        if JOIN:
            vh = tl.reshape(tl.join(tl.join(vh0, vh2), tl.join(vh1, vh3)), (BLOCK_N, D))
            if NOV > 0:
                vh = tl.where(vkeep[None, :], vh, 0.0)
            if V_PREC == "fp16":
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vh.to(tl.float16), out_dtype=tl.float32)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, vh, input_precision=V_PREC)
        elif V_PREC == "fp16":
            pv = p.to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(pv, vh0.to(tl.float16), out_dtype=tl.float32)
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, vh1.to(tl.float16), out_dtype=tl.float32)
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, vh2.to(tl.float16), out_dtype=tl.float32)
            acc3 = acc3 * alpha[:, None] + tl.dot(pv, vh3.to(tl.float16), out_dtype=tl.float32)
        else:
            acc0 = acc0 * alpha[:, None] + tl.dot(p, vh0, input_precision=V_PREC)
            acc1 = acc1 * alpha[:, None] + tl.dot(p, vh1, input_precision=V_PREC)
            acc2 = acc2 * alpha[:, None] + tl.dot(p, vh2, input_precision=V_PREC)
            acc3 = acc3 * alpha[:, None] + tl.dot(p, vh3, input_precision=V_PREC)

    nonempty = l_i != 0.0  # NaN (non-finite keys) must stay NaN, not look empty
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_base = O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + 4 * offs_g[None, :]
    if JOIN:
        o_nat = O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + offs_d[None, :]
        if NOV > 0:
            tl.store(o_nat, acc * inv_l[:, None], mask=mask_h[:, None] & vkeep[None, :])
            tl.store(O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + voc[None, :],
                     acc_vo * inv_l[:, None], mask=mask_h[:, None] & mask_ov[None, :])
        else:
            tl.store(o_nat, acc * inv_l[:, None], mask=mask_h[:, None])
    elif NOV > 0:
        tl.store(o_base + 0, acc0 * inv_l[:, None], mask=mask_h[:, None] & vkeep0[None, :])
        tl.store(o_base + 1, acc1 * inv_l[:, None], mask=mask_h[:, None] & vkeep1[None, :])
        tl.store(o_base + 2, acc2 * inv_l[:, None], mask=mask_h[:, None] & vkeep2[None, :])
        tl.store(o_base + 3, acc3 * inv_l[:, None], mask=mask_h[:, None] & vkeep3[None, :])
        tl.store(O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + voc[None, :],
                 acc_vo * inv_l[:, None], mask=mask_h[:, None] & mask_ov[None, :])
    else:
        tl.store(o_base + 0, acc0 * inv_l[:, None], mask=mask_h[:, None])
        tl.store(o_base + 1, acc1 * inv_l[:, None], mask=mask_h[:, None])
        tl.store(o_base + 2, acc2 * inv_l[:, None], mask=mask_h[:, None])
        tl.store(o_base + 3, acc3 * inv_l[:, None], mask=mask_h[:, None])
    l_off = b * s_ls_b + heads * s_ls_h + split
    tl.store(LSE_S + l_off, lse, mask=mask_h)
    if CERT:
        tl.store(A_S + l_off, a_i * inv_l, mask=mask_h)
        if CERT_B:
            tl.store(B_S + l_off, b_i * inv_l, mask=mask_h)


@triton.jit(do_not_specialize=["layer", "seed_lo", "seed_hi"])
def _decode_int8_stage1_tc(
    Q, KC, KS, KO, KOC, VC, VS, VO, VOC, SLOTS, SEQ,
    O_S, LSE_S, A_S, B_S,
    sm_scale, byp_rel, byp_abs, log_2_over_delta, rad_extra, layer, seed_lo, seed_hi,
    s_qb, s_qh,
    s_kc_n, s_kc_h, s_ks_n, s_ks_h, s_ko_n, s_ko_h,
    s_vc_n, s_vc_h, s_vs_n, s_vs_h, s_vo_n, s_vo_h,
    s_sl_b,
    s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    NOK: tl.constexpr, NOK_P: tl.constexpr, NOV: tl.constexpr, NOV_P: tl.constexpr,
    CERT: tl.constexpr, CERT_B: tl.constexpr,
    Q_SPLIT: tl.constexpr, XI_SPLIT: tl.constexpr, PV_TERMS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SKIP_DITHER: tl.constexpr = False,
):
    """Tensor-core stage 1 (see :func:`decode_stage1`, ``impl="tc"``).

    Scores group by group (``NG = D // G`` unrolled 2-D dots, no cross-thread reductions):
    ``z = sm * sum_g s_g (q_g . c_g - q_g . fp16(xi_g))`` with the int8 codes exact in fp16, the
    query exact in fp16 (fp32 queries: hi + lo, two dots) and the dither as fp16 (``XI_SPLIT``: plus
    its fp16 remainder, a third dot; either way the rounding, ``<= 2^-13``, is inside the radius,
    :func:`kvlib.certify.bound.rounding_slack` ``"tc"``); what the query split leaves
    (``r = q - hi - lo``) enters the radius as ``sm * 127.5 sum_c |r_c| s_c``.
    PV: ``v = s c`` is exact as an fp16 pair ``v_hi + v_lo`` (11 + 7 significant bits), ``1024 p``
    as ``p_hi + p_lo``; ``PV_TERMS`` = 3 (``p_hi v_hi + p_hi v_lo + p_lo v_hi``), 2 or 1.
    The group's query slice is re-read per tile (an L1 hit) because Triton cannot index a list of
    hoisted tensors by the unrolled group number.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    NG: tl.constexpr = D // G
    G4: tl.constexpr = G // 4
    seq_len, start, end = split_range(SEQ, b, split, NUM_SPLITS)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    offs_c = tl.arange(0, G)
    offs_j = tl.arange(0, G4)
    offs_d = tl.arange(0, D)
    q_row = Q + b * s_qb + heads[:, None] * s_qh
    if NOK > 0:  # NOK_P >= 16: the bypass dots run on the tensor cores too
        offs_ok = tl.arange(0, NOK_P)
        mask_ok = offs_ok < NOK
        koc = tl.load(KOC + kvh * NOK + offs_ok, mask=mask_ok, other=-1).to(tl.int32)
        q_ko = tl.load(q_row + koc[None, :], mask=mask_h[:, None] & mask_ok[None, :], other=0.0).to(tl.float32)
        # stored outliers are fp16: q_ko as hi + lo fp16 leaves <= 2^-22 |q|, inside byp_rel's fp32 allowance
        qo_hi, qo_lo = split_fp16(q_ko)
    if CERT:
        radm = union_radius(seq_len, log_2_over_delta, rad_extra)
        # per-group sums of q^2 and of the split residual |r|, [BLOCK_H, 16] (columns >= NG are 0), once;
        # every term is >= 0, so the (1 + 2^-8) below keeps the fp32 sums upper bounds
        offs_16 = tl.arange(0, 16)
        qf = tl.load(q_row + offs_d[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32)
        if NOK > 0:
            qf = tl.where((tl.sum((offs_d[:, None] == koc[None, :]).to(tl.int32), 1) > 0)[None, :], 0.0, qf)
        rf = qf - qf.to(tl.float16).to(tl.float32)
        if Q_SPLIT:
            rf = rf - rf.to(tl.float16).to(tl.float32)
        onehot = (tl.arange(0, NG)[:, None] == offs_16[None, :]).to(tl.float32)[None, :, :]  # [1, NG, 16]
        q2pad = tl.sum(tl.sum(tl.reshape(qf * qf, (BLOCK_H, NG, G)), 2)[:, :, None] * onehot, 1)
        rpad = tl.sum(tl.sum(tl.reshape(tl.abs(rf), (BLOCK_H, NG, G)), 2)[:, :, None] * onehot, 1)
        var_c = sm_scale * sm_scale / 12.0 * (1.0 + 2.0**-8)
        # what the query split left, sm 127.5 sum_g R_g s_g (127.5 >= |c - xi|), is bounded by Cauchy-Schwarz
        # as detm * sqrt(var): one multiplier per row, no per-tile work (0 for fp16-exact queries)
        rr = tl.sum(tl.where(q2pad > 0, rpad * rpad / tl.where(q2pad > 0, q2pad, 1.0),
                             tl.where(rpad > 0, float("inf"), 0.0)), 1)
        detm = (sm_scale * 127.5 * (1.0 + 2.0**-8)) * tl.sqrt(rr) / tl.sqrt(var_c)
        radm_h = radm + detm * (1.0 + 2.0**-8)  # [BLOCK_H]
        if NOK > 0:  # |q_o| rounded UP to fp16: the product with the exact fp16 |k_o| is then an upper bound
            q_ko_abs16 = abs_up_fp16(q_ko)
            q_ko_sum = tl.sum(tl.abs(q_ko), 1)
        a_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        if CERT_B:
            b_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if NOV > 0:
        offs_ov = tl.arange(0, NOV_P)
        mask_ov = offs_ov < NOV
        voc = tl.load(VOC + kvh * NOV + offs_ov, mask=mask_ov, other=-1).to(tl.int32)
        acc_vo = tl.zeros([BLOCK_H, NOV_P], dtype=tl.float32)

    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    c3k = ((layer << 1) | 0).to(tl.uint32)
    c2 = kvh.to(tl.uint32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(SLOTS + b * s_sl_b + offs_n, mask=mask_n, other=0).to(tl.int64)
        cs = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, G4], dtype=tl.uint32)
        qk = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        if CERT:
            var = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for g in tl.static_range(NG):
            # ---- this group's query slice (outlier channels zeroed: their codes are 0, their dither unused)
            qg = tl.load(q_row + g * G + offs_c[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32)
            if NOK > 0:
                is_ok = tl.sum((g * G + offs_c[:, None] == koc[None, :]).to(tl.int32), 1) > 0
                qg = tl.where(is_ok[None, :], 0.0, qg)
            q_hi = qg.to(tl.float16)
            if Q_SPLIT:
                q_lo = (qg - q_hi.to(tl.float32)).to(tl.float16)  # the difference is exact in fp32
            # ---- keys [BLOCK_N, G]: codes exact in fp16, dither regenerated (one Philox call per 4 channels)
            kc = tl.load(KC + slot[:, None] * s_kc_n + kvh * s_kc_h + g * G + offs_c[None, :],
                         mask=mask_n[:, None], other=0)
            s_g = tl.load(KS + slot * s_ks_n + kvh * s_ks_h + g, mask=mask_n, other=0.0).to(tl.float32)
            if SKIP_DITHER:  # timing only (the Philox cost on the roofline): a wrong dither, never a result
                w0 = cs
                w1 = cs
                w2 = cs
                w3 = cs
            else:
                cg = (g * G4 + offs_j).to(tl.uint32)[None, :] + tl.zeros_like(cs)
                w0, w1, w2, w3 = philox4x32(cs, cg, c2 + tl.zeros_like(cs), c3k + tl.zeros_like(cs), k0, k1)
            # join(join(x0, x2), join(x1, x3))[..., i, j] = x_{2i+j}: channel 4 j' + 2i + j in natural order
            xi = tl.reshape(tl.join(tl.join(_xi(w0), _xi(w2)), tl.join(_xi(w1), _xi(w3))), (BLOCK_N, G))
            xi16 = xi.to(tl.float16)
            kT = tl.trans(kc.to(tl.float16))
            xT = tl.trans(xi16)
            t = tl.dot(q_hi, kT)
            t = tl.dot(-q_hi, xT, t)
            if XI_SPLIT:  # xi - fp16(xi) is exact in fp32 and <= 2^-13: its fp16 rounding leaves <= 2^-25
                t = tl.dot(-q_hi, tl.trans((xi - xi16.to(tl.float32)).to(tl.float16)), t)
            if Q_SPLIT:
                t = tl.dot(q_lo, kT, t)
                t = tl.dot(-q_lo, xT, t)
            qk += t * s_g[None, :]
            if CERT:  # var = sum_g Q2_g s_g^2 (the group's q^2 sum is cheaper here than a hoisted column)
                var += tl.sum(qg * qg, 1)[:, None] * (s_g * s_g)[None, :]
        if NOK > 0:
            ko = tl.load(KO + slot[:, None] * s_ko_n + kvh * s_ko_h + offs_ok[None, :],
                         mask=mask_n[:, None] & mask_ok[None, :], other=0.0)
            koT = tl.trans(ko.to(tl.float16))
            qk = tl.dot(qo_hi, koT, qk)
            qk = tl.dot(qo_lo, koT, qk)
        qk = tl.where(mask_n[None, :], qk * sm_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if CERT:
            u = tl.sqrt(var * var_c) * radm_h[:, None]
            if NOK > 0:  # fp32 accumulation of exact products: its rounding is inside the (1 + 2^-8)
                byp = tl.dot(q_ko_abs16, tl.trans(tl.abs(ko)).to(tl.float16))
                u += sm_scale * (byp * (byp_rel * (1.0 + 2.0**-8)) + q_ko_sum[:, None] * byp_abs)
            a_i = a_i * alpha + tl.sum(p * tl.exp(u), 1)
            if CERT_B:
                b_i = b_i * alpha + tl.sum(p * tl.exp(-u), 1)

        # ---- values [BLOCK_N, D] (RTN): v = s c exactly as v_hi + v_lo
        vc = tl.load(VC + slot[:, None] * s_vc_n + kvh * s_vc_h + offs_d[None, :], mask=mask_n[:, None], other=0)
        vs = tl.load(VS + slot[:, None] * s_vs_n + kvh * s_vs_h + (offs_d // G)[None, :], mask=mask_n[:, None],
                     other=0.0).to(tl.float32)
        v = vs * vc.to(tl.float32)
        if NOV > 0:
            vo = tl.load(VO + slot[:, None] * s_vo_n + kvh * s_vo_h + offs_ov[None, :],
                         mask=mask_n[:, None] & mask_ov[None, :], other=0.0).to(tl.float32)
            acc_vo = acc_vo * alpha[:, None] + tl.sum(p[:, :, None] * vo[None, :, :], 1)
        v_hi = v.to(tl.float16)
        pp = p * 1024.0  # keeps small weights out of fp16's subnormal range; undone at the end
        p_hi = pp.to(tl.float16)
        acc = acc * alpha[:, None]
        acc = tl.dot(p_hi, v_hi, acc)
        if PV_TERMS >= 2:
            acc = tl.dot(p_hi, (v - v_hi.to(tl.float32)).to(tl.float16), acc)
        if PV_TERMS >= 3:
            acc = tl.dot((pp - p_hi.to(tl.float32)).to(tl.float16), v_hi, acc)

    nonempty = l_i != 0.0  # NaN (non-finite keys) must stay NaN, not look empty
    inv_l = tl.where(nonempty, 1.0 / tl.where(nonempty, l_i, 1.0), 0.0)
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_nat = O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + offs_d[None, :]
    if NOV > 0:
        vkeep = tl.sum((voc[:, None] == offs_d[None, :]).to(tl.int32), 0) == 0
        tl.store(o_nat, acc * (inv_l * (1.0 / 1024.0))[:, None], mask=mask_h[:, None] & vkeep[None, :])
        tl.store(O_S + b * s_os_b + heads[:, None] * s_os_h + split * s_os_s + voc[None, :],
                 acc_vo * inv_l[:, None], mask=mask_h[:, None] & mask_ov[None, :])
    else:
        tl.store(o_nat, acc * (inv_l * (1.0 / 1024.0))[:, None], mask=mask_h[:, None])
    l_off = b * s_ls_b + heads * s_ls_h + split
    tl.store(LSE_S + l_off, lse, mask=mask_h)
    if CERT:
        tl.store(A_S + l_off, a_i * inv_l, mask=mask_h)
        if CERT_B:
            tl.store(B_S + l_off, b_i * inv_l, mask=mask_h)

def default_num_splits(batch: int, hkv: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice, never more splits than tiles (power of two)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, math.ceil(2 * sms / max(1, batch * hkv)))
    tiles = max(1, math.ceil(max_len / block_n))
    ns = min(want, tiles, 64)
    return 1 << (ns - 1).bit_length() if ns > 1 else 1


def decode_stage1(
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor, seq_lens: torch.Tensor, *,
    layer: int, seed: int, sm_scale: float | None = None, delta: float = 1e-2, num_splits: int | None = None,
    cert: bool = True, cert_b: bool = True, v_dither: bool = False, block_n: int = 64,
    k_precision: str = "ieee", v_precision: str = "ieee", num_warps: int | None = None,
    num_stages: int | None = None,
    join: bool = False, var_dot: bool = True, impl: str = "auto", pv_terms: int = 3, xi_split: bool = True,
    skip_philox: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Stage 1 only: per-split ``(o_s [B,Hq,NS,d], lse_s, A_s, B_s [B,Hq,NS])`` (A_s/B_s None when off).

    ``impl``: ``"tc"`` (tensor-core dots, :func:`_decode_int8_stage1_tc`), ``"fma"`` (fp32 dots with
    ``k_precision``/``v_precision``/``join``/``var_dot``), ``"h10"`` (the half-word layouts' Triton kernel,
    :mod:`kvlib.kernels.int8.h10`), ``"gluon"`` (the h8 layout's Gluon kernel, GPU only,
    :mod:`kvlib.kernels.int8.gluon`: d = 128, no outlier channels) or ``"auto"``: ``tc`` for w24 pools where
    the shape allows, ``h10`` for half-word pools, and for an h8 pool on a GPU the Gluon kernel wherever it runs.
    ``skip_philox`` (tc only) replaces the key dither by garbage: a timing probe of the Philox cost,
    never a result.
    """
    k = as_side(k_pool, "k_pool")
    v = as_side(v_pool, "v_pool")
    _check_request(q, k, v, slots, seq_lens)
    delta = check_open_unit("delta", delta)
    if not isinstance(layer, int) or not 0 <= layer < 2**31:
        raise ValueError(f"layer must be an int in [0, 2^31), got {layer!r}")
    k0, k1 = seed_key(seed)
    if not triton_available(q.device):
        raise RuntimeError("Triton decode needs CUDA or TRITON_INTERPRET=1 set before triton is imported")
    if k_precision not in ("ieee", "tf32", "tf32x3") or v_precision not in ("ieee", "tf32", "tf32x3", "fp16"):
        raise ValueError(f"k_precision/v_precision not supported: {k_precision!r}, {v_precision!r}")
    B, hq, d = q.shape
    n_slots, hkv, _ = k.codes.shape
    gqa = hq // hkv
    d4 = d // 4
    if d4 & (d4 - 1):
        raise ValueError(f"d // 4 must be a power of two for the kernel, got d={d}")
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    asked = impl
    impl = resolve_impl(impl, d, k.group, v_dither, k.dither_layout)
    if impl == "gluon" or (asked == "auto" and impl == "h10" and k.dither_layout == "h8"):
        from kvlib.kernels.int8.gluon import gluon_num_splits, gluon_unsupported, launch_g8

        why = gluon_unsupported(q, k, v, v_dither)
        if impl == "gluon" and why:
            raise ValueError(why)
        impl = "h10" if why else "gluon"  # "auto" takes the Gluon kernel wherever it runs
    ns = num_splits or (gluon_num_splits(B, hkv, slots.shape[1], q.device) if impl == "gluon"
                        else default_num_splits(B, hkv, slots.shape[1], block_n, q.device))
    if not isinstance(ns, int) or ns < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    dev = q.device
    q = q.contiguous()
    slots = slots.contiguous()
    kw = k.codes.contiguous().view(torch.int32)
    vw = v.codes.contiguous().view(torch.int32)
    ks = k.scales.contiguous()
    vs = v.scales.contiguous()
    if num_stages is None:  # the H200 sweeps' best (dev.int8_sweep, _h10_probe): 3 for tc, 2 otherwise
        num_stages = 3 if impl == "tc" else 2
    if num_warps is None:  # h10: two warps per 64-position tile (H200 probe); the others four
        num_warps = 2 if impl == "h10" else 4
    if pv_terms not in (1, 2, 3):
        raise ValueError(f"pv_terms must be 1, 2 or 3, got {pv_terms!r}")
    layout = k.dither_layout if impl in ("h10", "gluon") else "w24"
    # the Gluon kernel's operands and sums are the h10 kernel's over the h8 layout: the same rounding slack
    rad_extra = (radius_multiplier(1, delta, d, impl="h10" if impl == "gluon" else impl, layout=layout)
                 - radius_multiplier(1, delta, d, slack=False))
    o_s = torch.empty(B, hq, ns, d, dtype=torch.float32, device=dev)
    lse_s = torch.empty(B, hq, ns, dtype=torch.float32, device=dev)
    a_s = torch.empty(B, hq, ns, dtype=torch.float32, device=dev) if cert else lse_s
    b_s = torch.empty(B, hq, ns, dtype=torch.float32, device=dev) if cert and cert_b else lse_s
    nok = k.outliers.shape[-1] if k.outliers is not None else 0
    nov = v.outliers.shape[-1] if v.outliers is not None else 0
    ko = k.outliers.contiguous() if nok else ks
    koc = k.outlier_channels.contiguous() if nok else slots
    vo = v.outliers.contiguous() if nov else vs
    voc = v.outlier_channels.contiguous() if nov else slots
    block_h = max(16, triton.next_power_of_2(gqa))
    if impl not in ("h10", "gluon") and k.dither_layout != "w24":
        raise ValueError(f"the Triton {impl!r} kernel reads the w24 dither layout only; an h10 or h8 pool needs "
                         "impl='h10'")
    if impl == "gluon":
        launch_g8(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, sm=sm, delta=delta, rad_extra=rad_extra,
                  layer=layer, k0=k0, k1=k1, ns=ns, cert=cert, cert_b=cert_b)
        return o_s, lse_s, (a_s if cert else None), (b_s if cert and cert_b else None)
    if impl == "h10":
        from kvlib.kernels.int8.h10 import launch_h10

        if v_dither:
            raise ValueError("impl='h10' reads RTN values only (v_dither=False)")
        launch_h10(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, sm=sm, byp_rel=FP16_REL + rounding_gamma(d),
                   byp_abs=FP16_SUB, delta=delta, rad_extra=rad_extra, layer=layer, k0=k0, k1=k1, ns=ns, cert=cert,
                   cert_b=cert_b, block_n=block_n, num_warps=num_warps, num_stages=num_stages, pv_terms=pv_terms,
                   skip_philox=skip_philox)
        return o_s, lse_s, (a_s if cert else None), (b_s if cert and cert_b else None)
    if impl == "tc":
        kc = k.codes.contiguous()
        vc = v.codes.contiguous()
        _decode_int8_stage1_tc[(B, hkv, ns)](
            q, kc, ks, ko, koc, vc, vs, vo, voc, slots, seq_lens,
            o_s, lse_s, a_s, b_s,
            sm, FP16_REL + rounding_gamma(d), FP16_SUB, math.log(2.0 / delta), rad_extra, layer, k0, k1,
            q.stride(0), q.stride(1),
            kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), ko.stride(0), ko.stride(1) if nok else 0,
            vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1), vo.stride(0), vo.stride(1) if nov else 0,
            slots.stride(0),
            o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
            GQA=gqa, BLOCK_H=block_h, BLOCK_N=block_n, D=d, G=k.group,
            NOK=nok, NOK_P=max(16, triton.next_power_of_2(max(nok, 1))), NOV=nov,
            NOV_P=triton.next_power_of_2(max(nov, 1)),
            CERT=cert, CERT_B=cert and cert_b, Q_SPLIT=q.dtype == torch.float32,
            XI_SPLIT=xi_split, PV_TERMS=pv_terms, NUM_SPLITS=ns, SKIP_DITHER=skip_philox,
            num_warps=num_warps, num_stages=num_stages,
        )
        return o_s, lse_s, (a_s if cert else None), (b_s if cert and cert_b else None)
    _decode_int8_stage1[(B, hkv, ns)](
        q, kw, ks, ko, koc, vw, vs, vo, voc, slots, seq_lens,
        o_s, lse_s, a_s, b_s,
        sm, FP16_REL + rounding_gamma(d), FP16_SUB, math.log(2.0 / delta), rad_extra, layer, k0, k1,
        q.stride(0), q.stride(1),
        kw.stride(0), kw.stride(1), ks.stride(0), ks.stride(1), ko.stride(0), ko.stride(1) if nok else 0,
        vw.stride(0), vw.stride(1), vs.stride(0), vs.stride(1), vo.stride(0), vo.stride(1) if nov else 0,
        slots.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=gqa, BLOCK_H=block_h, BLOCK_N=block_n, D=d, G=k.group,
        NOK=nok, NOK_P=triton.next_power_of_2(max(nok, 1)), NOV=nov, NOV_P=triton.next_power_of_2(max(nov, 1)),
        NUM_SPLITS=ns, CERT=cert, CERT_B=cert and cert_b, V_DITHER=v_dither,
        K_PREC=k_precision, V_PREC=v_precision, JOIN=join, VAR_DOT=var_dot, num_warps=num_warps, num_stages=num_stages,
    )
    return o_s, lse_s, (a_s if cert else None), (b_s if cert and cert_b else None)


def decode_int8(
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor, seq_lens: torch.Tensor, *,
    layer: int, seed: int, sm_scale: float | None = None, delta: float = 1e-2, num_splits: int | None = None,
    cert: bool = True, cert_b: bool = True, v_dither: bool = False, block_n: int = 64,
    k_precision: str = "ieee", v_precision: str = "ieee", num_warps: int | None = None,
    num_stages: int | None = None,
    join: bool = False, var_dot: bool = True, impl: str = "auto", pv_terms: int = 3, xi_split: bool = True,
    skip_philox: bool = False, fallback_to_reference: bool = True,
) -> DecodeOut:
    """Certified decode attention over the dithered INT8 pool (one query token per batch row).

    ``q`` ``[B, Hq, d]``; pools per :class:`PoolSide`; ``slots [B, max_len]`` and ``seq_lens [B]``
    (each ``>= 1``). ``delta`` is the per-row failure probability (pass
    :func:`kvlib.certify.bound.request_delta` for the request-level allocation). ``v_dither``: values
    were written with dither (else RTN). ``cert=False`` skips the certificate (constexpr switch);
    ``cert_b=False`` keeps only ``A`` (one-accumulator bound). No host synchronisation: CUDA-graph safe.
    On CPU without ``TRITON_INTERPRET=1`` it falls back to :func:`decode_reference` (or raises).
    """
    if not triton_available(q.device if isinstance(q, torch.Tensor) else torch.device("cpu")):
        if not fallback_to_reference:
            raise RuntimeError("Triton decode needs CUDA or TRITON_INTERPRET=1 set before triton is imported")
        return decode_reference(q, k_pool, v_pool, slots, seq_lens, layer=layer, seed=seed, sm_scale=sm_scale,
                                delta=delta, v_dither=v_dither, impl=impl)
    o_s, lse_s, a_s, b_s = decode_stage1(
        q, k_pool, v_pool, slots, seq_lens, layer=layer, seed=seed, sm_scale=sm_scale, delta=delta,
        num_splits=num_splits, cert=cert, cert_b=cert_b, v_dither=v_dither, block_n=block_n,
        k_precision=k_precision, v_precision=v_precision, num_warps=num_warps, num_stages=num_stages, join=join,
        var_dot=var_dot, impl=impl, pv_terms=pv_terms, xi_split=xi_split, skip_philox=skip_philox)
    # a programmatic dependent launch on sm_90: the merge launches while stage 1 drains and waits for its results
    # (griddepcontrol.wait), so the results are the same; its saving was not timed on its own
    o, lse, A, Bv, two, one, vac = merge_splits(o_s, lse_s, a_s, b_s, pdl=True)
    return DecodeOut(o, lse, A, Bv, two, one, vac)


def make_pool_side(
    x: torch.Tensor, *, layer: int, seed: int, side: int, group: int = 32, n_slots: int | None = None,
    slot_ids: torch.Tensor | None = None, outlier_channels: torch.Tensor | None = None, dithered: bool = True,
    dither_layout: str = "w24",
) -> PoolSide:
    """Quantise ``x [T, H_kv, d]`` into a fresh pool side, token ``t`` at slot ``slot_ids[t]``.

    Keys/dithered values go through :func:`kvlib.formats.dither_int8.dither_quantize` (the write path);
    ``dithered=False`` stores round-to-nearest codes with the same scales (RTN values).
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
                    outlier_channels.to(dev, torch.int64) if m else None, group, dither_layout)
