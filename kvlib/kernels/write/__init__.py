"""Fused pool-write kernels: one launch quantises a step's new K/V and stores it into the paged pools.

* :func:`kvlib.kernels.write.int4.write_int4` (kv4, kv4rl): Hadamard rotation of the keys, head-wise affine
  INT4 packing of K and V into their pages, and for kv4rl the INT8 sink/recent side buffer with its crop stash,
  in one launch (one program per (token, KV head)).
* :func:`kvlib.kernels.int8.write.write_int8_kv` (dither-int8 in each layout with outlier channels; rtn-int8 with
  ``rule="rtn"``): K and V of a layer in one launch (:func:`kvlib.kernels.int8.write.write_int8`: one side).
* :mod:`kvlib.kernels.write.addressing`: a decode step's rows, positions, slots and lengths after the write from
  the block table and ``seq_lens`` in one launch (:meth:`kvlib.storage.blocks.PageTable.step_addresses`).

Each reproduces the bytes of the torch write path of :mod:`kvlib.backends` bit for bit *on the device it
runs on*: where the torch reference divides a tensor by a Python scalar, PyTorch's CUDA kernel multiplies by
the fp32 reciprocal (``a * (1/b)``, ATen's ``div_true_kernel_cuda``) while its CPU kernel divides (IEEE), so
the kernels take the same choice (``RECIP``: on for CUDA tensors, off under the CPU interpreter). Divisions by
tensors are IEEE (``tl.math.div_rn``) on both. No kernel here reads anything back to the host, so a decode step
that writes through them captures in a CUDA graph.
"""

from __future__ import annotations

import numpy as np


def recip32(c: float) -> float:
    """``1/c`` as PyTorch's CUDA scalar division computes it: ``1.0f / float(c)`` in fp32 (exact as a Python
    float, so Triton materialises it as that fp32 constant)."""
    return float(np.float32(1.0) / np.float32(c))
