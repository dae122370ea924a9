"""Outlier RoPE-pair selection for the WitCert bypass: a fixed per-(layer, kv_head) channel set.

RoPE rotates channel pairs together, so a massive activation lives in a pair; bypassing whole
pairs (stored in fp16, excluded from the group amax) removes it from the scale. The set is chosen
once by energy ``sum_t (k_{t,i}^2 + k_{t,j}^2)`` on a calibration prefix and then held fixed
(the paper: top-8 pairs from the first half of a sequence match the second half, Jaccard 0.94).
"""

from __future__ import annotations

import torch

from kvlib.core.checks import check_tensor


def rope_pairs(d: int, style: str = "half") -> torch.Tensor:
    """int64 ``[d // 2, 2]`` channel pairs: ``(i, i + d/2)`` for rotate-half (HF Llama/Qwen) or
    ``(2i, 2i + 1)`` for interleaved RoPE."""
    if d % 2:
        raise ValueError(f"d must be even for RoPE pairs, got {d}")
    i = torch.arange(d // 2)
    if style == "half":
        return torch.stack([i, i + d // 2], dim=-1)
    if style == "interleaved":
        return torch.stack([2 * i, 2 * i + 1], dim=-1)
    raise ValueError(f"style must be 'half' or 'interleaved', got {style!r}")


def select_outlier_pairs(k_calib: torch.Tensor, m: int, style: str = "half") -> torch.Tensor:
    """The ``2m`` channels (sorted ascending) of the ``m`` highest-energy RoPE pairs.

    ``k_calib`` is ``[S, d]`` (one head) or ``[S, H, d]`` (returns ``[H, 2m]``).
    """
    check_tensor("k_calib", k_calib, ndim=(2, 3), floating=True)
    if not isinstance(m, int) or m < 0:
        raise ValueError(f"m must be a non-negative int, got {m!r}")
    d = k_calib.shape[-1]
    if 2 * m > d:
        raise ValueError(f"m={m} pairs need 2m <= d={d}")
    pairs = rope_pairs(d, style).to(k_calib.device)
    e = k_calib.to(torch.float32).pow(2).sum(0)  # [d] or [H, d]
    pe = e[..., pairs].sum(-1)  # [d/2] or [H, d/2]
    top = pe.topk(m, dim=-1).indices  # [m] or [H, m]
    ch = pairs[top].flatten(-2)  # [2m] or [H, 2m]
    return ch.sort(dim=-1).values.to(torch.int64)


def inject_massive_pairs(
    x: torch.Tensor, m: int, magnitude: float, style: str = "half", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy of ``x [S, d]`` with ``m`` random RoPE pairs multiplied by ``magnitude`` (the paper's
    controlled experiment); returns ``(x_injected, channels)`` with the 2m channels sorted."""
    check_tensor("x", x, ndim=2, floating=True)
    d = x.shape[-1]
    g = torch.Generator().manual_seed(seed)
    which = torch.randperm(d // 2, generator=g)[:m]
    ch = rope_pairs(d, style)[which].flatten().sort().values
    out = x.clone()
    out[:, ch] = out[:, ch] * magnitude
    return out, ch
