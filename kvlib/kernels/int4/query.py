"""Query preparation for the KV4 kernels: rotate by the Hadamard (keys are stored rotated) and quantise to INT8.

Shared by the main region, the protected region and the paged launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from kvlib.core.checks import check_tensor
from kvlib.core.hadamard import hadamard, hadamard_matrix
from kvlib.kernels.backend import pdl_supported, use_triton


@dataclass
class QueryInt8:
    """INT8 query ``q8 [B, Hq, d]`` with per-row fp32 ``scale`` and ``qsum = scale * Σ q8`` (``[B, Hq]``)."""

    q8: torch.Tensor
    scale: torch.Tensor
    qsum: torch.Tensor
    #: ``[B * Hq]`` int32 zeros for the decode kernel's fused merge (:func:`prepare_query` zeroes them in its own
    #: launch; the decode kernel leaves them at zero, so a prepared query may be decoded again)
    arrivals: torch.Tensor | None = None


def prepare_query_ref(q: torch.Tensor, rotate: bool = True) -> QueryInt8:
    """Torch reference: ``hadamard`` (if ``rotate``), symmetric INT8 per row, ``floor(x/s + 1/2)``."""
    qf = hadamard(q.float()) if rotate else q.float()
    scale = qf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = torch.floor(qf / safe.unsqueeze(-1) + 0.5).clamp_(-127, 127).to(torch.int8)
    return QueryInt8(q8, scale, scale * q8.float().sum(-1))


@triton.jit
def _prep_query_kernel(Q, H, Q8, QS, QSUM, ARR, n_rows, D: tl.constexpr, R: tl.constexpr, ROTATE: tl.constexpr,
                       PIECES: tl.constexpr = 0, INTERP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Rotate and quantise ``R`` query rows. ``PIECES = 0``: one fp32 (IEEE, FMA) dot with the normalised
    Hadamard ``H``; ``PIECES = 1..3``: ``H`` is the +-1 Hadamard in bf16 (exact) and the rows enter
    tensor-core dots as 1-3 bf16 pieces (hi, mid, lo: exact for bf16 / fp16 / fp32 inputs, so only the fp32
    accumulation rounds), scaled by ``1/sqrt(D)`` after. PDL: let the decode kernel launch now (it waits
    for this kernel's stores before it reads the query). ``ARR``: the decode kernel's arrival counters, zeroed
    here (one per query row, at least one per kv head)."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    rok = rows < n_rows
    cols = tl.arange(0, D)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    q = tl.load(Q + offs, mask=rok[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        h = tl.load(H + cols[:, None] * D + cols[None, :])
        if PIECES == 0:
            q = tl.dot(q, h, input_precision="ieee")
        else:
            if INTERP:  # the CPU interpreter's bf16 dot is wrong: the same exact pieces in an fp32 dot
                h = h.to(tl.float32)
            hi = q.to(tl.bfloat16)
            acc = tl.dot(hi.to(tl.float32) if INTERP else hi, h)
            if PIECES > 1:
                r = q - hi.to(tl.float32)
                mid = r.to(tl.bfloat16)
                acc = tl.dot(mid.to(tl.float32) if INTERP else mid, h, acc)
                if PIECES > 2:
                    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
                    acc = tl.dot(lo.to(tl.float32) if INTERP else lo, h, acc)
            q = acc * (D**-0.5)
    amax = tl.max(tl.abs(q), axis=1)
    scale = amax / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    qi = tl.floor(tl.math.div_rn(q, safe[:, None]) + 0.5)  # IEEE division: the GPU's plain / is approximate
    qi = tl.minimum(tl.maximum(qi, -127.0), 127.0)
    tl.store(Q8 + offs, qi.to(tl.int8), mask=rok[:, None])
    tl.store(QS + rows, scale, mask=rok)
    tl.store(QSUM + rows, scale * tl.sum(qi, axis=1), mask=rok)
    tl.store(ARR + rows, tl.zeros([R], tl.int32), mask=rok)


@functools.lru_cache(maxsize=8)
def _hmat(d: int, device: str) -> torch.Tensor:
    return hadamard_matrix(d, torch.float32).to(device).contiguous()


@functools.lru_cache(maxsize=8)
def _hmat_pm1(d: int, device: str) -> torch.Tensor:
    """The unnormalised (+-1) Sylvester Hadamard in bf16: exact."""
    return (hadamard_matrix(d, torch.float64) * d**0.5).round().to(torch.bfloat16).to(device).contiguous()


#: bf16 pieces that hold a query element exactly
_PIECES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def prepare_query(q: torch.Tensor, rotate: bool = True, backend: str = "auto", precision: str = "mma",
                  pdl: bool = False) -> QueryInt8:
    """Rotate ``q [B, Hq, d]`` by the normalised Hadamard (keys are stored rotated) and quantise to INT8.

    ``precision`` (GPU): ``"mma"``: tensor-core dots of the exact bf16 pieces of ``q`` with the +-1
    Hadamard; ``"ieee"``: one fp32 FMA dot with the normalised Hadamard (slower). ``pdl`` (GPU): let a
    decode kernel launched with programmatic dependent launch start early (``KV4KernelConfig.pdl``; ignored
    before sm_90 and off the GPU)."""
    if precision not in ("mma", "ieee"):
        raise ValueError(f"precision must be 'mma' or 'ieee', got {precision!r}")
    check_tensor("q", q, ndim=3, floating=True)
    if not use_triton(q, backend):
        return prepare_query_ref(q, rotate)
    b, hq, d = q.shape
    qc = q.contiguous()
    q8 = torch.empty(b, hq, d, dtype=torch.int8, device=q.device)
    qs = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    qsum = torch.empty_like(qs)
    arrivals = torch.empty(b * hq, dtype=torch.int32, device=q.device)  # zeroed by the kernel (no memset launch)
    r = 16
    n = b * hq
    mma = precision == "mma" and q.dtype in _PIECES
    h = _hmat_pm1(d, str(q.device)) if mma else _hmat(d, str(q.device))
    _prep_query_kernel[(triton.cdiv(n, r),)](qc, h, q8, qs, qsum, arrivals, n, D=d, R=r, ROTATE=rotate,
                                             PIECES=_PIECES[q.dtype] if mma else 0, INTERP=not q.is_cuda,
                                             PDL=pdl and pdl_supported(q))
    return QueryInt8(q8, qs, qsum, arrivals)
