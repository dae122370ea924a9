"""Known-answer checks of the Triton Philox against Random123's ``kat_vectors``: our ``philox4x32`` helper
(any round count) and Triton's own ``tl.philox`` (10 rounds), each in a one-program kernel, beside the torch
reference ``kvlib.core.philox.philox4x32_10``. tests/test_philox.py runs the same kernels."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvlib.core.philox import philox4x32_10
from kvlib.core.philox import threefry4x32 as threefry4x32_torch
from kvlib.kernels.tl.philox import philox4x32, threefry4x32


@triton.jit
def philox_kernel(c_ptr, k_ptr, o_ptr, N_ROUNDS: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr = False):
    """Our ``philox4x32`` on BLOCK (counter, key) rows: counters ``[BLOCK, 4]``, keys ``[BLOCK, 2]`` in, the
    four words out as int64 ``[BLOCK, 4]``."""
    i = tl.arange(0, BLOCK)
    args = (tl.load(c_ptr + 4 * i), tl.load(c_ptr + 4 * i + 1), tl.load(c_ptr + 4 * i + 2), tl.load(c_ptr + 4 * i + 3),
            tl.load(k_ptr + 2 * i), tl.load(k_ptr + 2 * i + 1))
    w0, w1, w2, w3 = philox4x32(*args, N_ROUNDS, WIDE)
    tl.store(o_ptr + 4 * i, w0.to(tl.int64))
    tl.store(o_ptr + 4 * i + 1, w1.to(tl.int64))
    tl.store(o_ptr + 4 * i + 2, w2.to(tl.int64))
    tl.store(o_ptr + 4 * i + 3, w3.to(tl.int64))


@triton.jit
def tl_philox_kernel(c_ptr, o_ptr, seed, BLOCK: tl.constexpr):
    """Triton's own ``tl.philox`` (10 rounds, key ``(seed & 0xffffffff, seed >> 32)``) on the same layout."""
    i = tl.arange(0, BLOCK)
    c0 = tl.load(c_ptr + 4 * i).to(tl.uint32)
    c1 = tl.load(c_ptr + 4 * i + 1).to(tl.uint32)
    c2 = tl.load(c_ptr + 4 * i + 2).to(tl.uint32)
    c3 = tl.load(c_ptr + 4 * i + 3).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    tl.store(o_ptr + 4 * i, w0.to(tl.int64))
    tl.store(o_ptr + 4 * i + 1, w1.to(tl.int64))
    tl.store(o_ptr + 4 * i + 2, w2.to(tl.int64))
    tl.store(o_ptr + 4 * i + 3, w3.to(tl.int64))


@triton.jit
def threefry_kernel(c_ptr, k_ptr, o_ptr, N_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    """Our ``threefry4x32`` on BLOCK (counter, key) rows: counters ``[BLOCK, 4]``, keys ``[BLOCK, 4]`` in, the four
    words out as int64 ``[BLOCK, 4]``."""
    i = tl.arange(0, BLOCK)
    w0, w1, w2, w3 = threefry4x32(tl.load(c_ptr + 4 * i), tl.load(c_ptr + 4 * i + 1), tl.load(c_ptr + 4 * i + 2),
                                  tl.load(c_ptr + 4 * i + 3), tl.load(k_ptr + 4 * i), tl.load(k_ptr + 4 * i + 1),
                                  tl.load(k_ptr + 4 * i + 2), tl.load(k_ptr + 4 * i + 3), N_ROUNDS)
    tl.store(o_ptr + 4 * i, w0.to(tl.int64))
    tl.store(o_ptr + 4 * i + 1, w1.to(tl.int64))
    tl.store(o_ptr + 4 * i + 2, w2.to(tl.int64))
    tl.store(o_ptr + 4 * i + 3, w3.to(tl.int64))


def threefry_kat_rows(vectors: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """One row per Threefry4x32 known-answer vector (hex ``counter``, ``key`` of four words, ``output``, ``rounds``):
    whether the torch reference and our Triton ``threefry4x32`` reproduce it."""
    rows = []
    for v in vectors:
        ctr, key, want = _words(v["counter"]), _words(v["key"]), _words(v["output"])
        out = torch.empty(1, 4, dtype=torch.int64, device=device)
        threefry_kernel[(1,)](ctr[None].to(device), key[None].to(device), out, N_ROUNDS=v["rounds"], BLOCK=1)
        rows.append({"rounds": v["rounds"], "counter": " ".join(v["counter"]), "key": " ".join(v["key"]),
                     "expected": " ".join(v["output"]),
                     "torch": bool(torch.equal(threefry4x32_torch(ctr, key, rounds=v["rounds"]), want)),
                     "triton": bool(torch.equal(out[0].cpu(), want))})
    return rows


def _words(v: list[str]) -> torch.Tensor:
    return torch.tensor([int(s, 16) for s in v], dtype=torch.int64)


def kat_rows(vectors: list[dict[str, Any]], device: str, triton_label: str) -> list[dict[str, Any]]:
    """One row per known-answer vector (hex ``counter``, ``key``, ``output``, ``rounds``): whether the torch
    reference, our Triton helper (column ``triton_label``) and, at 10 rounds, ``tl.philox`` reproduce it."""
    rows = []
    for v in vectors:
        ctr, key, want = _words(v["counter"]), _words(v["key"]), _words(v["output"])
        ours = philox4x32_10(ctr, key, rounds=v["rounds"])
        out = torch.empty(1, 4, dtype=torch.int64, device=device)
        philox_kernel[(1,)](ctr[None].to(device), key[None].to(device), out, N_ROUNDS=v["rounds"], BLOCK=1)
        row = {"rounds": v["rounds"], "counter": " ".join(v["counter"]), "key": " ".join(v["key"]),
               "expected": " ".join(v["output"]), "torch": bool(torch.equal(ours, want)),
               triton_label: bool(torch.equal(out[0].cpu(), want))}
        if v["rounds"] == 10:  # tl.philox is 10 rounds with key (seed & 0xffffffff, seed >> 32)
            o2 = torch.empty(1, 4, dtype=torch.int64, device=device)
            tl_philox_kernel[(1,)](ctr[None].to(device), o2, int(key[0]) | (int(key[1]) << 32), BLOCK=1)
            row["tl.philox"] = bool(torch.equal(o2[0].cpu(), want))
        rows.append(row)
    return rows
