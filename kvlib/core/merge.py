"""The one softmax-state merge: splits, regions, blocks and fallback all combine through it."""

from __future__ import annotations

import torch


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states over disjoint key sets.

    ``o_*`` are normalised outputs ``[..., d]`` (or any softmax-weighted average, such as the
    certificate's ``A``: pass it with a trailing dim of 1), ``lse_*`` natural-log sums ``[...]``.
    Returns ``(o, lse)`` with ``lse = logaddexp(lse_a, lse_b)`` and
    ``o = e^{lse_a - lse} o_a + e^{lse_b - lse} o_b``. An empty side has ``lse = -inf`` and
    contributes nothing, whatever its ``o`` holds.
    """
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    if lse_a.shape != lse_b.shape or lse_a.shape != o_a.shape[:-1]:
        raise ValueError(
            f"lse_a/lse_b must have shape {tuple(o_a.shape[:-1])}, got {tuple(lse_a.shape)} and {tuple(lse_b.shape)}"
        )
    lse = torch.logaddexp(lse_a, lse_b)
    # Both sides empty: keep lse=-inf and a zero output instead of NaN from (-inf) - (-inf).
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.where(torch.isneginf(lse_a), torch.zeros_like(lse_a), torch.exp(lse_a - safe))
    w_b = torch.where(torch.isneginf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_b - safe))
    # An empty side's o may be 0/0 = NaN; select it away rather than multiply it by 0.
    # NaN from a non-empty side (non-finite keys) propagates on purpose.
    part_a = torch.where(
        torch.isneginf(lse_a).unsqueeze(-1), torch.zeros_like(o_a), w_a.unsqueeze(-1).to(o_a.dtype) * o_a
    )
    part_b = torch.where(
        torch.isneginf(lse_b).unsqueeze(-1), torch.zeros_like(o_b), w_b.unsqueeze(-1).to(o_b.dtype) * o_b
    )
    return part_a + part_b, lse
