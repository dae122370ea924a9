"""Triton write kernel vs torch reference (bit identity), launch grouping invariance, flags."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from kvlib.storage.paged import PagedPool

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from kvlib.kernels.int8.write import write_int8  # noqa: E402

pytestmark = pytest.mark.gpu  # kernel tests: part of the GPU lane (-m gpu)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pools(**kw):
    base = dict(n_layers=2, n_slots=96, n_kv_heads=2, d=64, group=32, side=1, seed=2**40 + 5, device=DEV) | kw
    return PagedPool(**base), PagedPool(**base)


def _x(n, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) * torch.exp(2 * torch.randn(n, h, 1, generator=g))
    x[0, 0, :32] = 0  # an all-zero group (s = 0)
    x[1, 1] *= 1e-5  # subnormal fp16 scales (bump rule)
    return x.to(DEV)


def _same(a: PagedPool, b: PagedPool) -> bool:
    return (
        torch.equal(a.codes, b.codes)
        and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))
        and torch.equal(a.outliers.view(torch.int16), b.outliers.view(torch.int16))
    )


@pytest.mark.parametrize(
    "n_out,include,dithered", [(0, False, True), (4, False, True), (4, True, True), (0, False, False)]
)
@pytest.mark.parametrize("d,group", [(64, 32), (128, 32), (64, 16)])
@pytest.mark.parametrize("use_rint", [False, True])  # True differs from False only on CUDA
def test_triton_bit_identical_to_torch(n_out, include, dithered, d, group, use_rint):
    ref, tri = _pools(d=d, group=group, n_out=n_out, include_outliers_in_amax=include, dithered=dithered)
    if n_out:
        ch = torch.tensor([[1, 33], [7, 8]]) if d == 64 else torch.tensor([[1, 65], [7, 8]])
        ch = ch[:, :n_out] if n_out <= 2 else torch.cat([ch, ch + 2], dim=1)
        for p in (ref, tri):
            p.set_outlier_channels(1, ch)
    x = _x(21, d=d)
    if n_out:
        x[:, :, [1, 7]] *= 300
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:21].to(DEV)
    write_int8(ref, 1, x, slots, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # interpreter's numpy 0/0 on all-zero groups
        write_int8(tri, 1, x, slots, backend="triton", block_s=8, use_rint=use_rint)
    assert _same(ref, tri)
    # and the pool reads back within s/2 of x
    k_hat = ref.read(1, slots)
    s = ref.scales[1][slots].double().repeat_interleave(group, -1)
    if n_out:
        s[:, torch.arange(2)[:, None], ref.outlier_channels[1]] = float("inf")
    assert int(((k_hat.double() - x.double()).abs() > s / 2).sum()) == 0


def test_bytes_independent_of_batch_order_and_launch_grouping():
    a, b = _pools()
    x = _x(30)
    slots = torch.arange(50, 80, device=DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        write_int8(a, 0, x, slots, backend="triton")
        perm = torch.randperm(30, generator=torch.Generator().manual_seed(2)).to(DEV)
        for chunk in perm.split(7):  # shuffled order, five launches of different sizes
            write_int8(b, 0, x[chunk], slots[chunk], backend="triton", block_s=4)
    assert _same(a, b)


def test_nan_is_flagged_not_silent():
    a, _ = _pools()
    x = _x(4)
    x[2, 1, 40] = float("nan")
    slots = torch.arange(4, device=DEV)
    with pytest.raises(ValueError, match="non-finite"):
        write_int8(a, 0, x, slots, backend="triton")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        write_int8(a, 0, x, slots, backend="triton", validate=False)
    assert torch.isinf(a.scales[0, 2, 1, 1]) and torch.isfinite(a.scales[0, 2, 1, 0])
    assert not torch.isfinite(a.read(0, slots)[2, 1, 32:]).any()


@pytest.mark.parametrize(
    "x,slots,exc",
    [
        (torch.randint(0, 3, (4, 2, 64)), torch.arange(4), TypeError),
        (torch.randn(4, 2, 64), torch.arange(3), ValueError),
        (torch.randn(4, 2, 32), torch.arange(4), ValueError),
        (torch.randn(4, 2, 64), torch.tensor([0, 1, 1, 2]), ValueError),
        (torch.randn(4, 2, 64), torch.tensor([0, 1, 2, 96]), ValueError),
    ],
)
def test_bad_write_args(x, slots, exc):
    a, _ = _pools()
    for backend in ("torch", "triton"):
        with pytest.raises(exc):
            write_int8(a, 0, x.to(DEV), slots.to(DEV), backend=backend)


def test_benchmark_wiring():
    from kvlib.bench.witcert_write import call_bytes, run

    assert call_bytes(1, h=1, d=128, group=32, n_out=0, in_bytes=0) == 136
    res = run("ci")
    assert res["rows"] and all(r["torch_ms"] > 0 and r["bytes_per_call"] > 0 for r in res["rows"])
    assert all(r["torch_novalidate_ms"] > 0 for r in res["rows"])  # the like-for-like reference timing
    with pytest.raises(ValueError):
        run("nope")
