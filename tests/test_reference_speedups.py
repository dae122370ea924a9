"""CPU reference speed-ups keep every bit: the slot-indexed dither tables, the reference decode on top of them."""

import pytest
import torch

from kvlib.core import dither_tables as ref
from kvlib.core.philox import dither
from kvlib.kernels.int8.decode import decode_reference, make_pool_side

SEED = 2**33 + 12345


@pytest.fixture(autouse=True)
def _fresh_tables():
    ref.clear_dither_cache()
    yield
    ref.clear_dither_cache()


@pytest.mark.parametrize("layout,d", [("w24", 64), ("w24", 36), ("h10", 64), ("h8", 32)])
def test_cached_dither_equals_dither(layout, d):
    g = torch.Generator().manual_seed(d)
    for n in (5, 700, 1500):  # the table grows across calls (chunks of slots), then serves lookups
        slots = torch.randint(0, n, (n // 2 + 1,), generator=g)
        for side in (0, 1):
            got = ref.cached_dither(slots, d, layer=3, kv_head=2, seed=SEED, side=side, layout=layout)
            want = dither(slots, d, layer=3, kv_head=2, seed=SEED, side=side, layout=layout)
            assert torch.equal(got, want)
    # other streams never share a table
    a = ref.cached_dither(torch.arange(4), d, layer=0, kv_head=0, seed=0, layout=layout)
    b = ref.cached_dither(torch.arange(4), d, layer=0, kv_head=1, seed=0, layout=layout)
    assert torch.equal(b, dither(torch.arange(4), d, layer=0, kv_head=1, seed=0, layout=layout))
    assert not torch.equal(a, b)


def test_cached_dither_eviction_and_large_slots(monkeypatch):
    monkeypatch.setattr(ref, "XI_CACHE_BYTES", 3 * 512 * 64 * 4)  # room for three tables of one chunk
    for h in range(6):
        s = torch.arange(0, 300, 7)
        want = dither(s, 64, layer=1, kv_head=h, seed=7)
        assert torch.equal(ref.cached_dither(s, 64, layer=1, kv_head=h, seed=7), want)
    assert len(ref._XI_TABLES) == 3 and ref._xi_bytes == 3 * 512 * 64 * 4
    big = torch.tensor([0, ref.XI_TABLE_MAX_SLOTS + 5])  # beyond the table limit: computed directly, no table
    want = dither(big, 64, layer=9, kv_head=0, seed=7)
    assert torch.equal(ref.cached_dither(big, 64, layer=9, kv_head=0, seed=7), want)
    assert (64, 9, 0) not in {k[:3] for k in ref._XI_TABLES}
    with pytest.raises(ValueError, match="seed"):
        ref.cached_dither(torch.arange(3), 64, layer=0, kv_head=0, seed=-1)


def test_pool_read_unchanged_by_tables(monkeypatch):
    from kvlib.storage.paged import PagedPool

    pool = PagedPool(side=0, n_out=2, dithered=True, n_layers=2, n_slots=64, n_kv_heads=2, d=64, group=32, seed=SEED,
                     device=torch.device("cpu"), dither_layout="w24", include_outliers_in_amax=False)
    pool.set_outlier_channels(1, torch.tensor([[3, 35], [8, 40]]))
    g = torch.Generator().manual_seed(1)
    pool.codes[1] = torch.randint(-127, 128, pool.codes[1].shape, generator=g, dtype=torch.int8)
    pool.scales[1] = torch.rand(pool.scales[1].shape, generator=g).half()
    pool.outliers[1] = torch.randn(pool.outliers[1].shape, generator=g).half()
    slots = torch.randperm(64, generator=g)[:40]
    fast = pool.read(1, slots)
    monkeypatch.setattr(ref, "XI_TABLE_MAX_SLOTS", 0)
    assert torch.equal(fast, pool.read(1, slots))


@pytest.mark.parametrize("k_out", [False, True])
def test_decode_reference_unchanged_by_tables(monkeypatch, k_out):
    g = torch.Generator().manual_seed(5)
    B, hq, hkv, d, S = 2, 6, 3, 64, 48
    K, V = torch.randn(B * S, hkv, d, generator=g), torch.randn(B * S, hkv, d, generator=g)
    K[:, :, 5] *= 30
    n_slots = B * S + 11
    ids = torch.randperm(n_slots, generator=g)[:B * S]
    oc = torch.stack([torch.tensor([4, 5, 36, 37]) + h for h in range(hkv)]) if k_out else None
    kp = make_pool_side(K, layer=2, seed=SEED, side=0, n_slots=n_slots, slot_ids=ids, outlier_channels=oc)
    vp = make_pool_side(V, layer=2, seed=SEED, side=1, n_slots=n_slots, slot_ids=ids, dithered=False)
    q = 2 * torch.randn(B, hq, d, generator=g)
    slots, seq = ids.view(B, S).to(torch.int32), torch.tensor([S, S - 7], dtype=torch.int32)
    kw = dict(layer=2, seed=SEED, delta=1e-3)
    fast = [decode_reference(q, kp, vp, slots, seq, impl=impl, **kw) for impl in ("fma", "tc")]
    fast2 = [decode_reference(q, kp, vp, slots, seq, impl=impl, **kw) for impl in ("fma", "tc")]  # from the tables
    monkeypatch.setattr(ref, "XI_TABLE_MAX_SLOTS", 0)  # every dither computed directly: the reference as it was
    ref.clear_dither_cache()
    slow = [decode_reference(q, kp, vp, slots, seq, impl=impl, **kw) for impl in ("fma", "tc")]
    assert not ref._XI_TABLES
    for a, a2, b in zip(fast, fast2, slow):
        for f in ("o", "lse", "A", "B", "tv_bound", "tv_bound_one"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
            assert torch.equal(getattr(a2, f), getattr(b, f)), f


def _pools(k_out: bool, seed: int = 5, layout: str = "w24"):
    g = torch.Generator().manual_seed(seed)
    B, hq, hkv, d, S = 3, 6, 3, 64, 48
    K, V = torch.randn(B * S, hkv, d, generator=g), torch.randn(B * S, hkv, d, generator=g)
    K[:, :, 5] *= 30
    n_slots = B * S + 11
    ids = torch.randperm(n_slots, generator=g)[:B * S]
    oc = torch.stack([torch.tensor([4, 5, 36, 37]) + h for h in range(hkv)]) if k_out else None
    kp = make_pool_side(K, layer=2, seed=SEED, side=0, n_slots=n_slots, slot_ids=ids, outlier_channels=oc,
                        dither_layout=layout)
    vp = make_pool_side(V, layer=2, seed=SEED, side=1, n_slots=n_slots, slot_ids=ids, dithered=False,
                        dither_layout=layout)
    q = 2 * torch.randn(B, hq, d, generator=g)
    slots, seq = ids.view(B, S).to(torch.int32), torch.tensor([S, S - 7, 3], dtype=torch.int32)
    return q, kp, vp, slots, seq


@pytest.mark.parametrize("impl", ["fma", "tc"])
@pytest.mark.parametrize("k_out", [False, True])
def test_batched_reference_is_the_reference(impl, k_out):
    """Every row and head in one batch (pads masked) gives decode_reference's output and certificate, to float64
    summation order."""
    from kvlib.kernels.int8.reference import decode_reference_batched

    q, kp, vp, slots, seq = _pools(k_out)
    kw = dict(layer=2, seed=SEED, delta=1e-3, impl=impl)
    want = decode_reference(q, kp, vp, slots, seq, **kw)
    o, cert = decode_reference_batched(q, kp, vp, slots, seq, **kw)
    torch.testing.assert_close(o, want.o, rtol=1e-12, atol=1e-13)
    # 1 - 1/A^2 with A - 1 small: relative error ~ eps / (A - 1), far below 1e-9 here
    torch.testing.assert_close(cert, want.tv_bound_one, rtol=1e-9, atol=0)


@pytest.mark.parametrize("layout", ["w24", "h10"])
@pytest.mark.parametrize("k_out", [False, True])
def test_fp32_reference_stays_inside_the_fma_slack(layout, k_out):
    """precision="float32" (the CPU cache path) computes the scores as the fp32 kernel does; their distance from
    the exact (float64) scores is within the rounding part of the fma radius, sqrt(12 d) rounding_slack(d, "fma")
    varsigma_t, which is what makes its certificate sound for what it computes."""
    import math

    from kvlib.certify.bound import rounding_slack, variance_proxy
    from kvlib.kernels.int8.reference import decode_reference_batched

    q, kp, vp, slots, seq = _pools(k_out, seed=6, layout=layout)
    kw = dict(layer=2, seed=SEED, delta=1e-3, impl="fma", return_scores=True)
    o64, c64, z64 = decode_reference_batched(q, kp, vp, slots, seq, **kw)
    o32, c32, z32 = decode_reference_batched(q, kp, vp, slots, seq, precision="float32", **kw)
    B, hq, d = q.shape
    hkv, gqa = kp.codes.shape[1], hq // kp.codes.shape[1]
    slack = math.sqrt(12 * d) * rounding_slack(d, "fma", layout)
    for b in range(B):
        n = int(seq[b])
        for h in range(hkv):
            sl = slots[b, :n].long()
            oc = kp.outlier_channels[h] if k_out else None
            var = variance_proxy(q[b, h * gqa:(h + 1) * gqa], kp.scales[sl, h], sm_scale=d ** -0.5, group=kp.group,
                                 outlier_channels=oc)
            gap = (z32[b, h * gqa:(h + 1) * gqa, :n] - z64[b, h * gqa:(h + 1) * gqa, :n]).abs()
            assert bool((gap <= slack * var.sqrt() + 1e-12).all()), (b, h, float((gap / var.sqrt()).max()))
            assert torch.isinf(z32[b, :, n:]).all()
    torch.testing.assert_close(o32.double(), o64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c32, c64, rtol=1e-3, atol=1e-6)  # the same certificate up to fp32 score rounding
    with pytest.raises(ValueError, match="fma"):
        decode_reference_batched(q, kp, vp, slots, seq, layer=2, seed=SEED, impl="tc", precision="float32")


@pytest.mark.parametrize("n_out", [0, 2])
def test_batched_cpu_write_stores_dither_quantize_bytes(n_out):
    """The CPU write of every head at once (slot-indexed dither tables) stores dither_quantize's bytes per head."""
    from kvlib.formats.dither_int8 import dither_quantize
    from kvlib.kernels.int8.write import write_int8
    from kvlib.storage.paged import PagedPool

    pool = PagedPool(side=0, n_out=n_out, dithered=True, n_layers=2, n_slots=96, n_kv_heads=3, d=64, group=32,
                     seed=SEED, device=torch.device("cpu"), dither_layout="w24", include_outliers_in_amax=False)
    oc = torch.tensor([[3, 40], [8, 9], [0, 63]])[:, :n_out]
    if n_out:
        pool.set_outlier_channels(1, oc)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 3, 64, generator=g) * torch.rand(20, 3, 1, generator=g) * 10
    slots = torch.randperm(96, generator=g)[:20]
    write_int8(pool, 1, x, slots, backend="torch")
    v = pool.layer(1)
    for h in range(3):
        qt = dither_quantize(x[:, h], layer=1, kv_head=h, slots=slots, seed=SEED, group=32,
                             outlier_channels=oc[h] if n_out else None, side=0)
        assert torch.equal(v.codes[slots, h], qt.codes) and torch.equal(v.scales[slots, h], qt.scales)
        if n_out:
            assert torch.equal(v.outliers[slots, h], qt.outliers)
