"""Torch references of the KV4 decode: plain attention over a masked region and over the dequantised INT4 cache."""

from __future__ import annotations

import torch

from kvlib.kernels.int4.query import QueryInt8


def _unpack(c: torch.Tensor) -> torch.Tensor:
    return torch.stack((c & 15, c >> 4), dim=-1).reshape(*c.shape[:-1], 2 * c.shape[-1]).float()


def region_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention of ``q [B, Hq, d]`` over ``k, v [B, Hkv, N, d]`` restricted to ``mask [B, N]`` (GQA).

    Returns ``(o, lse)`` in float64-accumulated float32; an empty region gives ``lse = -inf``, ``o = 0``.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), kk) * sm_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    o = torch.einsum("bhn,bhnd->bhd", w, vv)
    return o.float(), lse.float()


def kv4_main_decode_ref(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    start: torch.Tensor, end: torch.Tensor, sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch reference: exact attention of the dequantised query over the dequantised INT4 region."""
    d = qp.q8.shape[-1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    q = qp.q8.float() * qp.scale.unsqueeze(-1)
    k = _unpack(k_codes) * k_scale.float().unsqueeze(-1) + k_off.float().unsqueeze(-1)
    v = _unpack(v_codes) * v_scale.float().unsqueeze(-1) + v_off.float().unsqueeze(-1)
    p = torch.arange(k_codes.shape[2], device=k_codes.device)
    mask = (p[None, :] >= start[:, None].long()) & (p[None, :] < end[:, None].long())
    return region_attention_ref(q, k, v, mask, sm_scale)
