"""The one split-KV merge: the Triton kernel (interpreter on CPU) against its torch reference, the fold
of ``merge_states``, and the known answer (splitting the keys of one softmax changes nothing)."""

import math

import pytest
import torch

from kvlib.certify.bound import bounds_from_AB
from kvlib.kernels.tl.merge import merge_splits, merge_splits_ref

pytestmark = pytest.mark.gpu  # kernel tests: part of the GPU lane (-m gpu)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernel runs under TRITON_INTERPRET=1


def _close(a, b, atol):
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    assert (a[fin] - b[fin]).abs().max() <= atol


def _states(lead=(2, 3), ns=5, d=16, seed=2):
    g = torch.Generator().manual_seed(seed)
    o_s = torch.randn(*lead, ns, d, generator=g)
    lse_s = torch.randn(*lead, ns, generator=g)
    a_s = 1.0 + torch.rand(*lead, ns, generator=g)  # A >= 1, B <= 1 as for real accumulators
    b_s = torch.rand(*lead, ns, generator=g)
    return o_s.to(DEV), lse_s.to(DEV), a_s.to(DEV), b_s.to(DEV)


@pytest.mark.parametrize(("lead", "ns"), [((2, 3), 5), ((7,), 5), ((7,), 1)])
def test_kernel_is_the_merge_states_fold(lead, ns):
    o_s, lse_s, _, _ = _states(lead, ns)
    lse_s[0, ..., 1:] = float("-inf")  # empty splits
    lse_s[-1, ..., :] = float("-inf")  # all splits empty
    o_s[0, ..., 1:, :] = float("nan")  # whatever an empty split holds contributes nothing
    out = merge_splits(o_s, lse_s, backend="triton")
    ref = merge_splits_ref(o_s, lse_s)
    assert out.A is None and ref.A is None and out.tv_bound is None
    _close(out.lse, ref.lse, 1e-5)
    _close(out.o, ref.o, 1e-5)
    assert torch.isneginf(out.lse[-1]).all() and (out.o[-1] == 0).all()


@pytest.mark.parametrize("with_b", [True, False])
def test_kernel_accumulators_and_bounds_match_reference(with_b):
    o_s, lse_s, a_s, b_s = _states()
    lse_s[0, 0, 2:] = float("-inf")
    a_s[1, 2, 0] = float("nan")  # a non-finite accumulator makes the bound vacuous
    b = b_s if with_b else None
    out = merge_splits(o_s, lse_s, a_s, b, backend="triton")
    ref = merge_splits_ref(o_s, lse_s, a_s, b)
    assert (out.B is None) == (ref.B is None) == (not with_b)
    for x, y in zip(out[:4], ref[:4]):
        if y is not None:
            _close(x, y, 1e-5)
    _close(out.tv_bound, ref.tv_bound, 1e-5)
    _close(out.tv_bound_one, ref.tv_bound_one, 1e-5)
    assert torch.equal(out.vacuous, ref.vacuous) and bool(out.vacuous[1, 2]) and int(out.vacuous.sum()) == 1
    two, one, _ = bounds_from_AB(ref.A, ref.B if with_b else 1.0 / ref.A)
    _close(ref.tv_bound, two.float(), 1e-6)
    _close(ref.tv_bound_one, one.float(), 1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_splitting_one_softmax_is_exact(backend):
    # known answer: attention over S keys equals the merge of attention over any partition of them,
    # and the softmax average of a per-key quantity (the certificate's A) merges the same way
    g = torch.Generator().manual_seed(0)
    rows, S, d = 6, 40, 8
    scores = 3 * torch.randn(rows, S, generator=g, dtype=torch.float64)
    v = torch.randn(rows, S, d, generator=g, dtype=torch.float64)
    a = torch.rand(rows, S, generator=g, dtype=torch.float64) + 1
    p = scores.softmax(-1)
    cuts = [0, 3, 4, 17, 40]  # unequal splits, one of a single key
    o_s, lse_s, a_s = [], [], []
    for lo, hi in zip(cuts, cuts[1:]):
        ps = scores[:, lo:hi].softmax(-1)
        o_s.append(torch.einsum("rs,rsd->rd", ps, v[:, lo:hi]))
        lse_s.append(scores[:, lo:hi].logsumexp(-1))
        a_s.append((ps * a[:, lo:hi]).sum(-1))
    o_s, lse_s, a_s = torch.stack(o_s, 1), torch.stack(lse_s, 1), torch.stack(a_s, 1)
    tol = 1e-5 if backend == "triton" else 1e-12
    if backend == "triton":  # the kernel computes in fp32
        o_s, lse_s, a_s = o_s.float().to(DEV), lse_s.float().to(DEV), a_s.float().to(DEV)
    out = merge_splits(o_s, lse_s, a_s, backend=backend)
    _close(out.o.double().cpu(), torch.einsum("rs,rsd->rd", p, v), tol)
    _close(out.lse.double().cpu(), scores.logsumexp(-1), tol)
    _close(out.A.double().cpu(), (p * a).sum(-1), tol)


def test_bad_shapes_are_named():
    o_s, lse_s, a_s, _ = _states()
    with pytest.raises(ValueError, match="lse_s"):
        merge_splits_ref(o_s, lse_s[..., :2])
    with pytest.raises(ValueError, match="A_s"):
        merge_splits(o_s, lse_s, a_s[..., :2], backend="torch")
    with pytest.raises(ValueError, match="B_s"):
        merge_splits_ref(o_s, lse_s, None, a_s)


def test_empty_side_contributes_nothing_whatever_its_output_holds():
    """merge_states' contract: a side with lse = -inf adds nothing, even when its output is NaN (0/0 of an empty
    softmax) or inf; a NaN from a non-empty side propagates."""
    from kvlib.core.merge import merge_states

    o_b, lse_b = torch.randn(3, 8), torch.randn(3)
    for junk in (math.nan, math.inf):
        o_a = torch.full((3, 8), junk)
        lse_a = torch.full((3,), -math.inf)
        for o, lse in (merge_states(o_a, lse_a, o_b, lse_b), merge_states(o_b, lse_b, o_a, lse_a)):
            assert torch.equal(lse, lse_b)
            torch.testing.assert_close(o, o_b, rtol=0, atol=0)
    o, _ = merge_states(torch.full((3, 8), math.nan), torch.zeros(3), o_b, lse_b)
    assert torch.isnan(o).all()
