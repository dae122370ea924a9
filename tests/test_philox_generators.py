"""The dither's generators (issue 28): Threefry4x32 known answers (Random123 kat_vectors), the Triton device
functions equal to the torch reference at every round count, the config field and its refusals, the h10 kernel
with each generator against float64 attention, and the Gluon kernel's sm_90 compile per generator (offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kvlib.core.philox import (
    DEFAULT_GENERATOR,
    GENERATORS,
    check_generator,
    dither,
    generator_words,
    philox4x32_10,
    threefry4x32,
)
from kvlib.kernels.tl.philox import counter_words, dither_tile, dither_tile_h8, dither_tile_h10, generator_constexprs

# the kernel tests run under the interpreter on CPU and on CUDA in the GPU lane (-m gpu)
pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
TF_KAT = json.loads((ROOT / "data" / "kat" / "threefry.json").read_text())["vectors"]


def _h(v: list[str]) -> torch.Tensor:
    return torch.tensor([int(s, 16) for s in v], dtype=torch.int64)


@pytest.mark.parametrize("vec", TF_KAT, ids=lambda v: f"r{v['rounds']}-{v['counter'][0]}")
def test_threefry_known_answers_torch(vec):
    out = threefry4x32(_h(vec["counter"]), _h(vec["key"]), rounds=vec["rounds"])
    assert out.tolist() == _h(vec["output"]).tolist()


def test_threefry_known_answers_triton():
    from kvlib.kernels.tl.philox_kat import threefry_kat_rows

    rows = threefry_kat_rows(TF_KAT, "cuda" if torch.cuda.is_available() else "cpu")
    assert len(rows) == len(TF_KAT) and all(r["torch"] and r["triton"] for r in rows)


def test_generator_words_are_the_named_generators():
    g = torch.Generator().manual_seed(2)
    ctr = torch.randint(0, 2**32, (64, 4), generator=g, dtype=torch.int64)
    key = torch.randint(0, 2**32, (2,), generator=g, dtype=torch.int64)
    for name, (family, rounds) in GENERATORS.items():
        w = generator_words(ctr, key, name)
        want = (philox4x32_10(ctr, key, rounds=rounds) if family == "philox"
                else threefry4x32(ctr, torch.cat([key, torch.zeros(2, dtype=torch.int64)]), rounds=rounds))
        assert torch.equal(w, want), name
    # the default dither is the paper's, unchanged; another generator gives another dither
    slots = torch.arange(40)
    base = dither(slots, 128, layer=2, kv_head=1, seed=9, layout="h8")
    assert torch.equal(base, dither(slots, 128, layer=2, kv_head=1, seed=9, layout="h8", generator=DEFAULT_GENERATOR))
    for name in GENERATORS:
        if name != DEFAULT_GENERATOR:
            other = dither(slots, 128, layer=2, kv_head=1, seed=9, layout="h8", generator=name)
            assert (other != base).float().mean() > 0.9, name


def test_refusals_name_the_argument():
    from kvlib.kernels.int8.config import DEFAULT_CONFIG, Int8KernelConfig

    for bad in ("philox", "philox4x32-5", 10, None):
        with pytest.raises(ValueError, match="generator"):
            check_generator(bad)
        with pytest.raises(ValueError, match="generator"):
            Int8KernelConfig(generator=bad)
        with pytest.raises(ValueError, match="generator"):
            dither(torch.arange(4), 16, layer=0, kv_head=0, seed=1, layout="h8", generator=bad)
    assert DEFAULT_CONFIG.generator == "philox4x32-10"
    with pytest.raises(ValueError, match="key"):
        threefry4x32(torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    from kvlib.core.philox import GENERATOR_OPTIONS, NOT_OPTIONS

    assert set(GENERATOR_OPTIONS) | set(NOT_OPTIONS) == set(GENERATORS) and DEFAULT_GENERATOR in GENERATOR_OPTIONS
    for name in NOT_OPTIONS:
        assert check_generator(name) == name
        with pytest.raises(ValueError, match="study point"):
            check_generator(name, options_only=True)
    assert generator_constexprs("none") == {"GEN": 2, "N_ROUNDS": 0}
    assert generator_constexprs("threefry4x32-13") == {"GEN": 1, "N_ROUNDS": 13}


@triton.jit
def _words_kernel(c_ptr, o_ptr, k0, k1, GEN: tl.constexpr, N_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w0, w1, w2, w3 = counter_words(tl.load(c_ptr + 4 * i), tl.load(c_ptr + 4 * i + 1), tl.load(c_ptr + 4 * i + 2),
                                   tl.load(c_ptr + 4 * i + 3), k0 + tl.zeros((), tl.uint32),
                                   k1 + tl.zeros((), tl.uint32), GEN, N_ROUNDS)
    tl.store(o_ptr + 4 * i, w0.to(tl.int64))
    tl.store(o_ptr + 4 * i + 1, w1.to(tl.int64))
    tl.store(o_ptr + 4 * i + 2, w2.to(tl.int64))
    tl.store(o_ptr + 4 * i + 3, w3.to(tl.int64))


@pytest.mark.parametrize("name", [*GENERATORS, "none"])
def test_triton_words_equal_torch(name):
    """Triton's counter_words = the torch reference, bit for bit, at every generator (the reduced-round Philox
    and the Threefry variants have no published vectors at our counters: this equality is their reference)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    ctr = torch.randint(0, 2**32, (128, 4), generator=g, dtype=torch.int64)
    ctr[:3] = torch.tensor([[0, 0, 0, 0], [2**32 - 1] * 4, [1 << 20, 7, 3, 11]])
    key = (0x89ABCDEF, 0x01234567)
    out = torch.empty_like(ctr, device=dev)
    _words_kernel[(2,)](ctr.to(dev), out, *key, BLOCK=64, **generator_constexprs(name))
    want = ctr if name == "none" else generator_words(ctr, torch.tensor(key), name)
    assert torch.equal(out.cpu(), want)


def _w24_request():
    """A small w24 request on the lane's device (CUDA, else the CPU under the interpreter)."""
    from kvlib.kernels.int8.decode import make_pool_side

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    K, V = torch.randn(20, 1, 64, generator=g).to(dev), torch.randn(20, 1, 64, generator=g).to(dev)
    kp = make_pool_side(K, layer=0, seed=1, side=0)
    vp = make_pool_side(V, layer=0, seed=1, side=1, dithered=False)
    q = torch.randn(1, 2, 64, generator=g).to(dev)
    slots = torch.arange(20, dtype=torch.int32, device=dev)[None]
    return q, kp, vp, slots, torch.tensor([20], dtype=torch.int32, device=dev)


def test_w24_kernels_refuse_another_generator():
    from kvlib.kernels.int8.config import DEFAULT_CONFIG
    from kvlib.kernels.int8.decode import decode_int8

    with pytest.raises(ValueError, match="generator"):
        decode_int8(*_w24_request(), layer=0, seed=1, impl="fma",
                    config=DEFAULT_CONFIG.replace(generator="philox4x32-7"))


def test_reference_fallback_refuses_another_generator(monkeypatch):
    """Where no Triton backend runs, decode_int8 falls back to the torch reference, which regenerates
    Philox4x32-10 only: another generator is refused there too, not read with the wrong dither."""
    import kvlib.kernels.int8.decode as dec
    from kvlib.kernels.int8.config import DEFAULT_CONFIG

    req = _w24_request()
    monkeypatch.setattr(dec, "triton_available", lambda device: False)
    assert dec.decode_int8(*req, layer=0, seed=1, impl="fma").path == "reference"  # the fallback this covers
    with pytest.raises(ValueError, match="generator"):
        dec.decode_int8(*req, layer=0, seed=1, impl="fma", config=DEFAULT_CONFIG.replace(generator="philox4x32-7"))


def test_h10_kernel_with_each_generator_matches_float64():
    """Keys written with each generator's h8 dither, read by the h10 kernel with config.generator set to it: equal
    to float64 attention over those keys to fp32 rounding, and far from the one over Philox4x32-10's dither (the
    control that the check can fail)."""
    from dev.philox_timing import agreement

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = agreement(impls=("h10",), B=2, S=40, hq=4, hkv=2, dev=dev)
    assert len(rows) == len(GENERATORS)
    for r in rows:
        assert r["path"] == "h10" and r["do_same"] < 2e-5, r
        if r["generator"] != DEFAULT_GENERATOR:
            assert r["do_cross"] > 1e3 * r["do_same"], r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels run on a GPU only")
def test_gluon_kernel_with_each_generator_matches_float64():
    """The certified Gluon h8 kernel with config.generator = each generator, on keys written with it (GPU)."""
    from dev.philox_timing import agreement

    for r in agreement(impls=("gluon",), B=3, S=200, hq=28, hkv=4, dev="cuda"):
        assert r.get("ok") and r["path"] == "gluon", r


@pytest.mark.skipif(os.environ.get("KVLIB_SKIP_SASS") == "1", reason="offline compile disabled")
def test_gluon_kernel_compiles_with_each_generator_for_sm90():
    """The certified Gluon h8 kernel compiled offline for sm_90 with each generator (and none): no shared memory,
    no spills, and the loop's instruction count ordered by the generator's work (none < Philox-6 < -7 < -8 < -10)."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton's NVIDIA toolchain is not installed")
    prog = ("import json; from kvlib.bench.sass_count import gluon_count as c; from kvlib.kernels.tl.philox import "
            "generator_constexprs as g; names = ['none', 'philox4x32-6', 'philox4x32-7', 'philox4x32-8', "
            "'philox4x32-10', 'threefry4x32-13']; print(json.dumps({n: c(**g(n)) for n in names}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=900,
                          check=True, cwd=ROOT)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["shared_bytes"] == 0 and r["stack_bytes"] == 0 and 0 < r["registers"] <= 255, name
    n = {k: v["instructions"] for k, v in out.items()}
    assert n["none"] < n["philox4x32-6"] < n["philox4x32-7"] < n["philox4x32-8"] < n["philox4x32-10"]


@triton.jit
def _tiles_kernel(s_ptr, o_ptr, kv_head, layer, side, k0, k1, BS: tl.constexpr, D: tl.constexpr, LAYOUT: tl.constexpr,
                  GEN: tl.constexpr, N_ROUNDS: tl.constexpr):
    r = tl.arange(0, BS)
    if LAYOUT == 0:
        xi = dither_tile(tl.load(s_ptr + r), kv_head, layer, side, k0, k1, D, GEN, N_ROUNDS)
    elif LAYOUT == 1:
        xi = dither_tile_h10(tl.load(s_ptr + r), kv_head, layer, side, k0, k1, D, GEN, N_ROUNDS)
    else:
        xi = dither_tile_h8(tl.load(s_ptr + r), kv_head, layer, side, k0, k1, D, GEN, N_ROUNDS)
    tl.store(o_ptr + r[:, None] * D + tl.arange(0, D)[None, :], xi)


@pytest.mark.parametrize("name", ["philox4x32-8", "threefry4x32-13"])
@pytest.mark.parametrize("layout", ["w24", "h10", "h8"])
def test_dither_tiles_with_a_generator_match_torch(layout, name):
    """The write path's Triton dither tiles with ``GEN``/``N_ROUNDS`` (what a write kernel passes for a generator)
    equal the torch dither of that generator, bit for bit."""
    from kvlib.core.philox import seed_key

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    slots = torch.tensor([0, 5, 2**32 - 1, 123456], dtype=torch.int64)
    d = 64
    k0, k1 = seed_key(2**40 + 77)
    out = torch.empty(4, d, device=dev)
    for kv_head, layer, side in ((3, 17, 1), (1, 1, 0)):
        _tiles_kernel[(1,)](slots.to(dev), out, kv_head, layer, side, k0, k1, BS=4, D=d,
                            LAYOUT=("w24", "h10", "h8").index(layout), **generator_constexprs(name))
        want = dither(slots, d, layer=layer, kv_head=kv_head, seed=2**40 + 77, side=side, layout=layout,
                      generator=name)
        assert torch.equal(out.cpu(), want)
        assert not torch.equal(want, dither(slots, d, layer=layer, kv_head=kv_head, seed=2**40 + 77, side=side,
                                            layout=layout))
