"""Exact fallback driven by the certificate: whole KV head, or block by block.

* Head level (:func:`fallback_heads`): where a query head's certificate exceeds ``tau`` (vacuous
  ``+inf`` included), its KV head is paged in from the fp16 copy and every query head of that GQA
  group is recomputed; the recomputed rows carry the deterministic certificate of the fp16 copy
  (radius ``sm_scale * sum_c |q_c| (|k_c| 2^-11/(1-2^-11) + 2^-25)``).
* Block level (:func:`block_fallback`): per row, blocks ``j`` are ranked once by their share of the
  excess ``A - 1``, ``sum_{t in j} p_tilde_t (e^{u_t} - 1)`` (= ``mass_j (e^{u_j} - 1)`` when the
  block shares one radius); blocks are paged in that order, the certificate is recomputed exactly
  after each (scores of paged tokens exact, their radius that of the fp16 copy), and paging stops
  at the first certificate ``<= tau``. Bytes moved are reported against whole-head fallback.

All of it is torch (float64 where it matters); the fp16 copy is where the caller keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvlib.certify.bound import bounds_from_AB, certificate_from_scores
from kvlib.core.checks import check_positive_int, check_tensor
from kvlib.core.fp16 import FP16_REL, FP16_SUB

FP16_BYTES = 2


def fp16_radius(q: torch.Tensor, k16: torch.Tensor, *, sm_scale: float) -> torch.Tensor:
    """Deterministic score radius ``[..., S]`` of keys held in fp16 (``q [..., d]``, ``k16 [..., S, d]``)."""
    qa = q.to(torch.float64).abs()
    ka = k16.to(torch.float64).abs()
    return sm_scale * ((ka * FP16_REL + FP16_SUB) @ qa.unsqueeze(-1)).squeeze(-1)


@dataclass
class HeadFallbackReport:
    """What head-level fallback did: rows over ``tau``, KV heads paged, bytes moved."""

    tau: float
    rows_over: int
    rows_total: int
    kv_heads_paged: int
    kv_heads_total: int
    bytes_moved: int
    bytes_int8_read: int
    effective_bits: float  # (int8 bytes read + fp16 bytes paged) * 8 / elements (K and V)
    paged: torch.Tensor = field(repr=False)  # bool [B, H_kv]


def fallback_heads(
    out, q: torch.Tensor, k16: torch.Tensor, v16: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, *,
    tau: float = 0.2, sm_scale: float | None = None, int8_bytes_per_token_head: int = 272,
):
    """Recompute the GQA groups whose certificate exceeds ``tau`` from the fp16 copy ``k16``/``v16``.

    ``out`` is a :class:`kvlib.kernels.int8.decode.DecodeOut` with ``tv_bound``; ``k16``/``v16``
    ``[n_slots, H_kv, d]`` fp16 (any device). Returns ``(new_out, report)``; ``new_out.tv_bound`` of
    recomputed rows is the fp16 copy's own deterministic certificate.
    ``int8_bytes_per_token_head`` is the K+V byte cost of the INT8 read (272 B at d=128, G=32).
    """
    if out.tv_bound is None:
        raise ValueError("out must carry a certificate (decode with cert=True)")
    check_tensor("q", q, ndim=3, floating=True)
    check_tensor("k16", k16, ndim=3, floating=True)
    if not (isinstance(tau, (int, float)) and tau >= 0):
        raise ValueError(f"tau must be a non-negative number, got {tau!r}")
    B, hq, d = q.shape
    hkv = k16.shape[1]
    gqa = hq // hkv
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    over = ~(out.tv_bound <= tau)  # NaN/inf count as over
    paged = over.view(B, hkv, gqa).any(-1)
    o = out.o.clone()
    lse = out.lse.clone()
    A = out.A.clone().to(torch.float64)
    Bv = (out.B if out.B is not None else 1.0 / out.A).clone().to(torch.float64)
    moved = 0
    elems = 0
    for b in range(B):
        L = int(seq_lens[b])
        elems += 2 * L * hkv * d
        sl = slots[b, :L].long().to(k16.device)
        for h in range(hkv):
            if not bool(paged[b, h]):
                continue
            kk = k16[sl, h].to(q.device, torch.float64)
            vv = v16[sl, h].to(q.device, torch.float64)
            moved += 2 * L * d * FP16_BYTES
            qh = q[b, h * gqa:(h + 1) * gqa].to(torch.float64)
            z = sm * qh @ kk.T
            rows = slice(h * gqa, (h + 1) * gqa)
            o[b, rows] = (torch.softmax(z, -1) @ vv).to(o.dtype)
            lse[b, rows] = torch.logsumexp(z, -1).to(lse.dtype)
            c = certificate_from_scores(z, fp16_radius(qh, kk, sm_scale=sm))
            A[b, rows], Bv[b, rows] = c.A, c.B
    two, one, vac = bounds_from_AB(A, Bv)
    read = sum(int(seq_lens[b]) for b in range(B)) * hkv * int8_bytes_per_token_head
    rep = HeadFallbackReport(
        tau=float(tau), rows_over=int(over.sum()), rows_total=int(over.numel()), kv_heads_paged=int(paged.sum()),
        kv_heads_total=int(paged.numel()), bytes_moved=moved, bytes_int8_read=read,
        effective_bits=(read + moved) * 8 / max(elems, 1), paged=paged)
    # out's own class (DecodeOut), so this module needs nothing from the kernels above it
    return type(out)(o, lse, A, Bv, two, one, vac), rep


@dataclass
class BlockFallbackResult:
    """One row's block-level fallback: blocks paged in order, the certificate after each, bytes."""

    tau: float
    block_size: int
    order: list[int]  # blocks in paging priority
    blocks_paged: int
    trajectory: list[float]  # certificate before paging and after each paged block
    bytes_moved: int
    bytes_whole_head: int
    exact: torch.Tensor = field(repr=False)  # bool [S]: tokens whose scores are now exact

    @property
    def cert_before(self) -> float:
        return self.trajectory[0]

    @property
    def cert_after(self) -> float:
        return self.trajectory[self.blocks_paged]

    @property
    def traffic_ratio(self) -> float:
        """Whole-head bytes over block bytes (inf when no block was needed)."""
        return self.bytes_whole_head / self.bytes_moved if self.bytes_moved else math.inf


def block_excess(z_hat: torch.Tensor, u: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block's share ``sum_{t in j} p_tilde_t (e^{u_t} - 1)`` of the excess ``A - 1``, ``[n_blocks]``."""
    p = torch.softmax(z_hat.to(torch.float64), -1)
    e = p * torch.expm1(u.to(torch.float64))
    S = e.shape[-1]
    nb = -(-S // block_size)
    e = torch.nn.functional.pad(e, (0, nb * block_size - S))
    return e.view(nb, block_size).sum(-1)


def block_fallback(
    z_hat: torch.Tensor, z_exact: torch.Tensor, u: torch.Tensor, *, tau: float = 0.2, block_size: int = 256,
    u_paged: torch.Tensor | None = None, bytes_per_token: int = 2 * 128 * FP16_BYTES, max_blocks: int | None = None,
) -> BlockFallbackResult:
    """Block-level fallback for one row: page blocks by decreasing excess until the certificate ``<= tau``.

    ``z_hat`` computed scores ``[S]``, ``z_exact`` scores from the fp16 copy ``[S]``, ``u`` radii
    ``[S]``; ``u_paged`` the radius of paged tokens (default 0; :func:`fp16_radius` for the fp16
    copy's own rounding). ``bytes_per_token``: fp16 K+V bytes of one token of the head (512 at d=128).
    """
    for name, t in (("z_hat", z_hat), ("z_exact", z_exact), ("u", u)):
        check_tensor(name, t, ndim=1, floating=True)
    S = z_hat.shape[0]
    if z_exact.shape[0] != S or u.shape[0] != S:
        raise ValueError(f"z_hat, z_exact and u must all have length S={S}")
    check_positive_int("block_size", block_size)
    if not (isinstance(tau, (int, float)) and tau >= 0):
        raise ValueError(f"tau must be a non-negative number, got {tau!r}")
    zh, ze, uu = (t.to(torch.float64) for t in (z_hat, z_exact, u))
    up = torch.zeros_like(uu) if u_paged is None else u_paged.to(torch.float64)
    nb = -(-S // block_size)
    exc = block_excess(zh, uu, block_size)
    exc = torch.where(torch.isnan(exc), torch.full_like(exc, math.inf), exc)  # non-finite blocks first
    order = torch.argsort(exc, descending=True, stable=True).tolist()
    exact = torch.zeros(S, dtype=torch.bool)
    limit = nb if max_blocks is None else min(nb, max_blocks)

    def cert_now() -> float:
        z = torch.where(exact, ze, zh)
        r = torch.where(exact, up, uu)
        return float(certificate_from_scores(z, r).tv_bound)

    traj = [cert_now()]
    paged = 0
    while not traj[-1] <= tau and paged < limit:
        j = order[paged]
        exact[j * block_size:min((j + 1) * block_size, S)] = True
        paged += 1
        traj.append(cert_now())
    moved = int(exact.sum()) * bytes_per_token
    return BlockFallbackResult(float(tau), block_size, order, paged, traj, moved, S * bytes_per_token, exact)
