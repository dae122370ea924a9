"""The one split-KV merge (flash-decoding stage 2) in Triton, with its torch reference beside it.

Every split-KV decode kernel (:mod:`~kvlib.kernels.int8.decode`, :mod:`~kvlib.kernels.bf16.decode`,
:mod:`~kvlib.kernels.int4.decode`) writes per-split states ``o_s [..., NS, d]``, ``lse_s [..., NS]``
and combines them here in one launch: LSE weights, empty splits (``lse = -inf``) contributing
nothing. WitCert's certificate accumulators ``A_s``/``B_s`` ``[..., NS]`` (softmax-weighted averages)
ride the same weights, and the bounds are finished in the same kernel (``+inf`` where vacuous), so a
certified decode costs no extra launch. The reference :func:`merge_splits_ref` is a fold of
:func:`kvlib.core.merge.merge_states` over the split axis (a test binds the two).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvlib.certify.bound import bounds_from_AB
from kvlib.core.checks import check_tensor
from kvlib.core.merge import merge_states
from kvlib.kernels.backend import pdl_supported, use_triton


class MergedSplits(NamedTuple):
    """Merged state ``o [..., d]``, ``lse [...]``; with accumulators also ``A``, ``B`` and the bounds
    ``tv_bound`` (two accumulators, or one when ``B`` is absent), ``tv_bound_one``, ``vacuous``."""

    o: torch.Tensor
    lse: torch.Tensor
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    tv_bound: torch.Tensor | None = None
    tv_bound_one: torch.Tensor | None = None
    vacuous: torch.Tensor | None = None


def _check(o_s: torch.Tensor, lse_s: torch.Tensor, A_s: torch.Tensor | None, B_s: torch.Tensor | None) -> None:
    check_tensor("o_s", o_s, floating=True)
    check_tensor("lse_s", lse_s, floating=True)
    if o_s.ndim < 2 or lse_s.shape != o_s.shape[:-1]:
        raise ValueError(f"o_s must be [..., NS, d] and lse_s [..., NS], got {tuple(o_s.shape)} and "
                         f"{tuple(lse_s.shape)}")
    if B_s is not None and A_s is None:
        raise ValueError("B_s needs A_s (B is the second certificate accumulator)")
    for name, x in (("A_s", A_s), ("B_s", B_s)):
        if x is not None and x.shape != lse_s.shape:
            raise ValueError(f"{name} must have lse_s's shape {tuple(lse_s.shape)}, got {tuple(x.shape)}")


def merge_splits_ref(o_s: torch.Tensor, lse_s: torch.Tensor, A_s: torch.Tensor | None = None,
                     B_s: torch.Tensor | None = None) -> MergedSplits:
    """Fold :func:`kvlib.core.merge.merge_states` over the split axis; ``A_s``/``B_s`` ride as extra channels.

    Without ``B_s`` the bound uses ``B = 1/A`` (the one-accumulator bound ``1 - 1/A^2``), as the kernel.
    """
    _check(o_s, lse_s, A_s, B_s)
    parts = [o_s] + [x.unsqueeze(-1) for x in (A_s, B_s) if x is not None]
    cat = torch.cat(parts, -1)
    o, lse = cat[..., 0, :], lse_s[..., 0]
    for s in range(1, lse_s.shape[-1]):
        o, lse = merge_states(o, lse, cat[..., s, :], lse_s[..., s])
    # a row with no nonempty state merges to o = 0 (and A = B = 0), as in the kernel, whatever one state held
    o = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(o), o)
    d = o_s.shape[-1]
    if A_s is None:
        return MergedSplits(o[..., :d], lse)
    A = o[..., d]
    B = o[..., d + 1] if B_s is not None else None
    two, one, vac = bounds_from_AB(A, B if B is not None else 1.0 / A)
    return MergedSplits(o[..., :d], lse, A, B, two.to(A.dtype), one.to(A.dtype), vac)



@triton.jit
def split_range(SEQ, b, split, NUM_SPLITS: tl.constexpr):
    """``(seq_len, start, end)`` of split ``split`` of batch row ``b``: ``ceil(len / NUM_SPLITS)`` positions
    per split, the one partition every split-KV stage 1 uses and :func:`merge_splits` folds back."""
    seq_len = tl.load(SEQ + b).to(tl.int32)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    return seq_len, start, tl.minimum(start + split_len, seq_len)

@triton.jit
def not_finite_or_nan(x):
    """True for NaN and +-inf (fp32 overflow of an accumulator)."""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def merge_weights(lse_s, AXIS: tl.constexpr):
    """The LSE-merge weights over the state axis ``AXIS`` of ``lse_s`` (natural log): ``(w, den, lse, empty)`` with
    ``w = exp(lse_s - max)`` (0 for an empty state, ``lse = -inf``), ``den`` their sum (1 where every state is
    empty), the merged ``lse`` (``-inf`` there) and the empty-state mask. A merged quantity is
    ``sum(where(empty, 0, w x)) / den``: selecting the empty states away keeps their ``x`` (maybe 0/0) out. The
    one algebra of :func:`merge_splits` and of the KV4 decode kernel's fused merge."""
    m = tl.max(lse_s, AXIS)
    nonempty = m > float("-inf")  # a row whose states are all empty merges to o = 0, lse = -inf
    m_safe = tl.where(nonempty, m, 0.0)
    empty = lse_s == float("-inf")
    w = tl.where(empty, 0.0, tl.exp(lse_s - tl.expand_dims(m_safe, AXIS)))
    den = tl.where(nonempty, tl.sum(w, AXIS), 1.0)
    return w, den, tl.where(nonempty, m_safe + tl.log(den), float("-inf")), empty


@triton.jit
def _merge_splits_kernel(
    O_S, LSE_S, A_S, B_S, OUT, LSE, A, B, TV, TV1, VAC,
    NS: tl.constexpr, NS_P: tl.constexpr, D: tl.constexpr, CERT: tl.constexpr, CERT_B: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One program per merged row (contiguous ``[rows, NS, D]`` / ``[rows, NS]`` inputs). PDL (programmatic
    dependent launch): launched before the kernel that writes the states has finished; wait for it here."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NS_P)
    mask_s = s < NS
    lse_s = tl.load(LSE_S + row * NS + s, mask=mask_s, other=float("-inf"))
    w, den, lse, empty = merge_weights(lse_s, 0)
    cols = tl.arange(0, D)
    o_s = tl.load(O_S + (row * NS + s)[:, None] * D + cols[None, :], mask=mask_s[:, None], other=0.0)
    o = tl.sum(tl.where(empty[:, None], 0.0, w[:, None] * o_s), 0) / den
    tl.store(OUT + row * D + cols, o)
    tl.store(LSE + row, lse)
    if CERT:
        a_s = tl.load(A_S + row * NS + s, mask=mask_s, other=0.0)
        a = tl.sum(tl.where(empty, 0.0, w * a_s), 0) / den
        tl.store(A + row, a)
        if CERT_B:
            b_s = tl.load(B_S + row * NS + s, mask=mask_s, other=0.0)
            bb = tl.sum(tl.where(empty, 0.0, w * b_s), 0) / den
            tl.store(B + row, bb)
        else:
            bb = 1.0 / a  # 1 - B/A becomes 1 - 1/A^2
        # vacuous: NaN (non-finite inputs), overflow (inf), or nonsense; `not (x <= y)` catches NaN
        vac = (not_finite_or_nan(a)) | (not_finite_or_nan(bb)) | (a <= 0.0)
        one = tl.maximum(1.0 - 1.0 / (a * a), 0.0)
        two = tl.maximum(1.0 - bb / a, 0.0)
        tl.store(TV + row, tl.where(vac, float("inf"), two))
        tl.store(TV1 + row, tl.where(vac, float("inf"), one))
        tl.store(VAC + row, vac.to(tl.int8))


def merge_splits(o_s: torch.Tensor, lse_s: torch.Tensor, A_s: torch.Tensor | None = None,
                 B_s: torch.Tensor | None = None, *, backend: str = "auto", pdl: bool = False) -> MergedSplits:
    """N-way merge of split-KV states in one launch (fp32 outputs); the same algebra as
    :func:`merge_splits_ref`, which runs instead when Triton cannot (or ``backend="torch"``).

    No host synchronisation: CUDA-graph safe. ``pdl`` (GPU): a programmatic dependent launch, which may
    start while the kernel before it (that wrote the states) is finishing; the kernel waits for it first.
    """
    if not use_triton(o_s, backend):
        return merge_splits_ref(o_s, lse_s, A_s, B_s)
    _check(o_s, lse_s, A_s, B_s)
    *lead, ns, d = o_s.shape
    rows = math.prod(lead)
    dev = o_s.device

    def new(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=dev)

    o, lse = new(*lead, d), new(*lead)
    cert, cert_b = A_s is not None, B_s is not None
    A = new(*lead) if cert else None
    B = new(*lead) if cert_b else None
    tv, tv1, vac = (new(*lead), new(*lead), new(*lead, dtype=torch.int8)) if cert else (None, None, None)
    _merge_splits_kernel[(rows,)](
        o_s.contiguous(), lse_s.contiguous(),
        A_s.contiguous() if cert else lse_s, B_s.contiguous() if cert_b else lse_s,
        o, lse, A if cert else lse, B if cert_b else lse, tv if cert else lse, tv1 if cert else lse,
        vac if cert else lse,
        NS=ns, NS_P=triton.next_power_of_2(ns), D=d, CERT=cert, CERT_B=cert_b, PDL=pdl and pdl_supported(o_s),
        **({"launch_pdl": True} if pdl and pdl_supported(o_s) else {}),
    )  # fmt: skip
    return MergedSplits(o, lse, A, B, tv, tv1, vac.view(torch.bool) if cert else None)
