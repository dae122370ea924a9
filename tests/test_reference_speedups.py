"""CPU reference speed-ups keep every bit: the slot-indexed dither tables, the reference decode on top of them."""

import pytest
import torch

from kvlib.core import philox as ref
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
