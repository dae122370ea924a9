"""Where the Triton kernels run: CUDA, or the CPU interpreter when ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import torch


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels can run on ``device`` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor, backend: str = "auto") -> bool:
    """Triton on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1``; else the torch reference.

    ``backend="torch"`` forces the reference, ``"triton"`` forces the kernel (error if impossible).
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    ok = triton_available(t.device)
    if backend == "triton" and not ok:
        raise RuntimeError("backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1 set before importing triton")
    return ok


def pdl_supported(t: torch.Tensor) -> bool:
    """True when programmatic dependent launch applies to kernels on ``t``'s device: CUDA on Hopper or
    newer (``griddepcontrol`` needs sm_90); elsewhere the flag is ignored."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9
