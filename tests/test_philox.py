"""Philox4x32: Random123 known answers, torch reference vs Triton device function vs tl.philox."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvlib.core.philox import dither, dither_counter, mulhilo32, philox4x32_10, seed_key, word_to_xi

KAT = json.loads((Path(__file__).resolve().parents[1] / "data" / "kat" / "philox.json").read_text())["vectors"]


def _h(v: list[str]) -> torch.Tensor:
    return torch.tensor([int(s, 16) for s in v], dtype=torch.int64)


@pytest.mark.parametrize("vec", KAT, ids=lambda v: f"r{v['rounds']}-{v['counter'][0]}")
def test_known_answers_torch(vec):
    out = philox4x32_10(_h(vec["counter"]), _h(vec["key"]), rounds=vec["rounds"])
    assert out.tolist() == _h(vec["output"]).tolist()


def test_mulhilo_matches_python_ints():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 2**32, (2000,), generator=g, dtype=torch.int64)
    b = torch.randint(0, 2**32, (2000,), generator=g, dtype=torch.int64)
    a[:2] = 2**32 - 1
    b[:2] = 2**32 - 1
    hi, lo = mulhilo32(a, b)
    for ai, bi, h, lw in zip(a.tolist(), b.tolist(), hi.tolist(), lo.tolist(), strict=True):
        assert (h << 32) | lw == ai * bi


def test_word_to_xi_exact_and_symmetric():
    w = torch.tensor([0, 255, 256, 2**31, 2**32 - 1, 0x12345678], dtype=torch.int64)
    xi = word_to_xi(w).double()
    expect = torch.tensor([((v >> 8) * 2.0**-24 + 2.0**-25 - 0.5) for v in w.tolist()], dtype=torch.float64)
    assert torch.equal(xi, expect)
    assert xi.min() >= -0.5 and xi.max() < 0.5
    # the 24-bit grid is symmetric about 0: word w and its bitwise complement give opposite dithers
    assert torch.equal(word_to_xi(w), -word_to_xi(0xFFFFFFFF - w))


def test_counter_layout_and_key():
    ctr = dither_counter(torch.tensor([7, 9]), 10, layer=3, kv_head=5, side=1)
    assert ctr.shape == (2, 3, 4)
    assert ctr[1, 2].tolist() == [9, 2, 5, (3 << 1) | 1]
    assert seed_key(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)


def test_dither_selects_word_c_mod_4():
    slots = torch.tensor([0, 11])
    xi = dither(slots, 8, layer=2, kv_head=1, seed=99, side=0)
    w = philox4x32_10(dither_counter(slots, 8, layer=2, kv_head=1, side=0), torch.tensor(seed_key(99)))
    for c in range(8):
        assert torch.equal(xi[:, c], word_to_xi(w[:, c // 4, c % 4]))


def test_stream_uniqueness_over_pool():
    """No two (layer, kv_head, slot, channel, side) share a counter+word; the words are distinct too."""
    L, H, N, d = 3, 2, 64, 64
    ctrs, xis = [], []
    for layer in range(L):
        for h in range(H):
            for side in (0, 1):
                c = dither_counter(torch.arange(N), d, layer=layer, kv_head=h, side=side)
                ctrs.append(c.reshape(-1, 4))
                xis.append(dither(torch.arange(N), d, layer=layer, kv_head=h, seed=5, side=side).flatten())
    ctr = torch.cat(ctrs)
    assert torch.unique(ctr, dim=0).shape[0] == ctr.shape[0]  # distinct calls, 4 words each -> distinct words
    allxi = torch.cat(xis)
    # 24-bit values: birthday collisions expected ~ n^2 / 2^25; require nothing beyond that
    n = allxi.numel()
    assert n - torch.unique(allxi).numel() < 5 * n * n / 2**25 + 10


@pytest.mark.parametrize("bad", [dict(layer=-1), dict(kv_head=2**32), dict(side=2)])
def test_bad_counter_args(bad):
    kw = dict(layer=0, kv_head=0, side=0) | bad
    with pytest.raises((ValueError, TypeError)):
        dither_counter(torch.arange(3), 8, **kw)


def test_bad_philox_args():
    with pytest.raises(TypeError):
        philox4x32_10(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):
        philox4x32_10(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):
        philox4x32_10(torch.full((4,), 2**32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):
        seed_key(-1)


# --- Triton ------------------------------------------------------------------------------------

triton = pytest.importorskip("triton")
tl = triton.language
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from kvlib.kernels.tl.philox import dither_tile  # noqa: E402
from kvlib.kernels.tl.philox_kat import philox_kernel as _philox_kernel  # noqa: E402
from kvlib.kernels.tl.philox_kat import tl_philox_kernel as _tl_philox_kernel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _dither_kernel(s_ptr, o_ptr, kv_head, layer, side, k0, k1, BS: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, BS)
    xi = dither_tile(tl.load(s_ptr + r), kv_head, layer, side, k0, k1, D)
    tl.store(o_ptr + r[:, None] * D + tl.arange(0, D)[None, :], xi)


def _run_triton(ctr: torch.Tensor, key: torch.Tensor, rounds: int = 10, wide: bool = False) -> torch.Tensor:
    n = ctr.shape[0]
    out = torch.empty(n, 4, dtype=torch.int64, device=DEV)
    _philox_kernel[(1,)](ctr.contiguous().to(DEV), key.contiguous().to(DEV), out, N_ROUNDS=rounds, BLOCK=n, WIDE=wide)
    return out.cpu()


@pytest.mark.gpu  # inline PTX: compiled for a CUDA device only (never interpreted); `make test-gpu` runs it
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="inline PTX: needs Triton compiling for a CUDA device")
def test_wide_multiply_philox_is_bit_identical():
    g = torch.Generator().manual_seed(5)
    ctr = torch.randint(0, 2**32, (256, 4), generator=g, dtype=torch.int64)
    key = torch.randint(0, 2**32, (256, 2), generator=g, dtype=torch.int64)
    assert torch.equal(_run_triton(ctr, key, wide=True), philox4x32_10(ctr, key))


def test_known_answers_triton():
    for r in (7, 10):
        vecs = [v for v in KAT if v["rounds"] == r]
        vecs = vecs + vecs[:1]  # pad to 4 (power of two)
        ctr = torch.stack([_h(v["counter"]) for v in vecs])
        key = torch.stack([_h(v["key"]) for v in vecs])
        assert _run_triton(ctr, key, r).tolist() == torch.stack([_h(v["output"]) for v in vecs]).tolist()


def test_triton_matches_torch_and_tl_philox_random():
    g = torch.Generator().manual_seed(3)
    ctr = torch.randint(0, 2**32, (256, 4), generator=g, dtype=torch.int64)
    seed = 0xFEDCBA9876543210
    key = torch.tensor(seed_key(seed), dtype=torch.int64).expand(256, 2)
    ours = _run_triton(ctr, key)
    assert torch.equal(ours, philox4x32_10(ctr, key))
    # tl.philox(seed, c0..c3) with 32-bit counters is Random123 philox4x32-10 with key (seed_lo, seed_hi)
    theirs = torch.empty(256, 4, dtype=torch.int64, device=DEV)
    _tl_philox_kernel[(1,)](ctr.to(DEV), theirs, seed, BLOCK=256)
    assert torch.equal(ours, theirs.cpu())


@pytest.mark.parametrize("d", [64, 128])
def test_dither_tile_matches_reference(d):
    slots = torch.tensor([0, 5, 2**32 - 1, 123456, 7, 8, 9, 10], dtype=torch.int64)
    seed = 2**63 + 12345
    k0, k1 = seed_key(seed)
    out = torch.empty(8, d, device=DEV)
    for kv_head, layer, side in ((3, 17, 1), (1, 1, 0), (0, 0, 1)):  # 1 and 0 arrive specialised
        _dither_kernel[(1,)](slots.to(DEV), out, kv_head, layer, side, k0, k1, BS=8, D=d)
        assert torch.equal(out.cpu(), dither(slots, d, layer=layer, kv_head=kv_head, seed=seed, side=side))
