"""Where the Triton kernels run: CUDA, or the CPU interpreter when ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton launches go to its CPU interpreter (``TRITON_INTERPRET=1``, set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter() -> bool:
    """Let the CPU interpreter run loops with run-time bounds under numpy >= 2.4 (idempotent).

    Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with ``int()``, which
    numpy 2.4 refuses for arrays with ndim > 0; only the interpreter is touched. The launch paths that may
    run under the interpreter call this before launching (:func:`triton_available` does, for the CPU);
    returns whether the patch is in place.
    """
    if not interpreting():
        return False
    import numpy as np
    from triton.runtime import interpreter as _interp

    orig = _interp._patch_lang_tensor
    if getattr(orig, "_kvlib_index", False):
        return True

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._kvlib_index = True
    _interp._patch_lang_tensor = patched
    return True


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels can run on ``device`` (CUDA, or CPU under TRITON_INTERPRET=1).

    On the CPU path it readies the interpreter (:func:`patch_interpreter`): every kernel launch path asks here
    (directly or through :func:`use_triton`) before it launches."""
    if device.type == "cuda":
        return True
    return patch_interpreter()


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
