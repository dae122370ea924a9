"""Normalised Walsh–Hadamard transform: the fixed rotation KV4 applies to keys (after RoPE) and queries.

``H`` (Sylvester order, scaled by ``1/sqrt(d)``) is symmetric and orthogonal, so ``H = H^T = H^{-1}``:
rotating both ``q`` and ``k`` leaves ``q·k`` unchanged, and applying :func:`hadamard` twice is the identity.
"""

from __future__ import annotations

import math

import torch

from kvlib.core.checks import check_tensor


def _check_pow2(d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"x: the last dim must be a power of two for the Hadamard transform, got {d}")


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh–Hadamard transform of the last dim of ``x`` (O(d log d) butterfly, same dtype).

    Raises ``ValueError`` when the last dim is not a power of two. Low-precision inputs are transformed
    in float32 and cast back, so the only rounding is the final cast.
    """
    check_tensor("x", x, floating=True)
    if x.ndim == 0:
        raise ValueError("x must have at least one dim")
    d = x.shape[-1]
    _check_pow2(d)
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = work.reshape(-1, d)
    h = 1
    if torch.is_grad_enabled() and y.requires_grad:  # out= ops do not record autograd: the plain butterfly
        while h < d:
            y = y.reshape(-1, d // (2 * h), 2, h)
            y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
            h *= 2
        return (y.reshape(x.shape) * (1.0 / math.sqrt(d))).to(x.dtype)
    nxt = torch.empty_like(y)  # ping-pong buffers: each stage writes its sums and differences in place (no stack)
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        out = nxt.view(y.shape)
        torch.add(y[:, :, 0], y[:, :, 1], out=out[:, :, 0])
        torch.sub(y[:, :, 0], y[:, :, 1], out=out[:, :, 1])
        nxt = y if y.data_ptr() != work.data_ptr() else torch.empty_like(out)  # never overwrite the input
        y = out
        h *= 2
    y = y.reshape(x.shape) * (1.0 / math.sqrt(d))
    return y.to(x.dtype)


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The ``d x d`` normalised Hadamard matrix (rows = :func:`hadamard` of the unit vectors)."""
    _check_pow2(d)
    return hadamard(torch.eye(d, dtype=dtype))
