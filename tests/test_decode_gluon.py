"""The Gluon h8 decode kernel (GPU only: Gluon has no CPU interpreter). On CPU: its requirements and the dispatch;
on a GPU: agreement with the float64 reference, split invariance, soundness, the vacuous certificate. Its sm_90
compile (no shared memory, no spills) is checked offline in ``tests/test_sass_count.py``."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from _soundness import assert_rows_within_certificate

from kvlib.kernels.int8.decode import Int8KernelConfig, decode_int8, decode_reference, make_pool_side, resolve_impl
from kvlib.kernels.int8.gluon import gluon_unsupported

# every test here launches a kernel (CPU: the interpreter): the GPU lane runs them all (-m gpu)
pytestmark = pytest.mark.gpu
SEED = 2**33 + 4242
DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels run on a GPU only")


def _setup(B=3, hq=7, hkv=1, S=70, *, qdtype=torch.bfloat16, layer=5, k_out=False, v_out=False, k_dither=True,
           layout="h8"):
    g = torch.Generator().manual_seed(hq * 10 + hkv + S)
    T = B * S
    K = torch.randn(T, hkv, 128, generator=g)
    K[:, :, 9] *= 6
    V = torch.randn(T, hkv, 128, generator=g)
    n_slots = T + 7
    slot_ids = torch.randperm(n_slots, generator=g)[:T]
    # k_out RoPE pairs (c, c + 64) per head (the rotate-half pairing), the massive channel 9 among them
    pairs = lambda h: sorted(x for i in range(int(k_out)) for x in ((9 + 13 * i + 5 * h) % 64,  # noqa: E731
                                                                     (9 + 13 * i + 5 * h) % 64 + 64))
    koc = torch.stack([torch.tensor(pairs(h)) for h in range(hkv)]) if k_out else None
    voc = torch.stack([torch.tensor([0, 3, 70]) for _ in range(hkv)]) if v_out else None
    kp = make_pool_side(K, layer=layer, seed=SEED, side=0, n_slots=n_slots, slot_ids=slot_ids, outlier_channels=koc,
                        dither_layout=layout, dithered=k_dither)
    vp = make_pool_side(V, layer=layer, seed=SEED, side=1, n_slots=n_slots, slot_ids=slot_ids, dithered=False,
                        outlier_channels=voc)
    slots = slot_ids.view(B, S).to(torch.int32)
    seq = torch.tensor([S - 9 * b for b in range(B)], dtype=torch.int32)  # ragged rows, tiles cut mid-way
    q = (2 * torch.randn(B, hq, 128, generator=g)).to(qdtype)
    mv = lambda s: dataclasses.replace(s, codes=s.codes.to(DEV), scales=s.scales.to(DEV),  # noqa: E731
                                       outliers=None if s.outliers is None else s.outliers.to(DEV),
                                       outlier_channels=None if s.outlier_channels is None
                                       else s.outlier_channels.to(DEV))
    return q.to(DEV), mv(kp), mv(vp), slots.to(DEV), seq.to(DEV), dict(layer=layer, seed=SEED), (K, slot_ids)


def test_requirements_are_named():
    q, kp, vp, *_ = _setup(hq=9, hkv=1, k_out=True, qdtype=torch.float32)
    n = kp.codes.shape[0]
    kp17 = dataclasses.replace(kp, dither_layout="h10", outliers=torch.zeros(n, 1, 18).half(),
                               outlier_channels=torch.arange(18)[None])  # 9 pairs: one more than the kernel's 8
    why = gluon_unsupported(q.cpu(), kp17, vp, v_dither=True)
    for part in ("a CUDA device", "an h8 key pool", "at most 8 query heads", "fp16/bf16",
                 "at most 16 outlier channels", "RTN values"):
        assert part in why
    q, kp, vp, *_ = _setup(hq=4, hkv=2)
    assert gluon_unsupported(q, kp, vp) == (None if DEV == "cuda" else "impl='gluon' needs a CUDA device")


def test_impl_gluon_is_for_the_h8_layout_only():
    assert resolve_impl("gluon", 128, 32, False, "h8") == "gluon"
    for layout in ("h10", "w24"):
        with pytest.raises(ValueError, match="gluon"):
            resolve_impl("gluon", 128, 32, False, layout)


@pytest.mark.skipif(DEV == "cuda", reason="the CPU side of the dispatch")
def test_on_cpu_explicit_gluon_raises_and_auto_runs_the_triton_kernel():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2, S=40)
    with pytest.raises(ValueError, match="CUDA"):
        decode_int8(q, kp, vp, slots, seq, impl="gluon", fallback_to_reference=False, **kw)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=Int8KernelConfig(block_n=16),
                      **kw)  # auto: h10 under the interpreter
    assert out.path == "h10"
    torch.testing.assert_close(out.tv_bound.double(), ref.tv_bound, atol=3e-6, rtol=2e-5)


@gpu
@pytest.mark.parametrize("hq,hkv,qdtype", [(7, 1, torch.bfloat16), (4, 2, torch.float16), (8, 1, torch.bfloat16)])
@pytest.mark.parametrize("ns", [1, 3, 64])
def test_kernel_matches_reference(hq, hkv, qdtype, ns):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=hq, hkv=hkv, qdtype=qdtype)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    out = decode_int8(q, kp, vp, slots, seq, impl="gluon", num_splits=ns, **kw)
    assert out.path == "gluon"
    for f in ("o", "lse", "A", "B", "tv_bound", "tv_bound_one"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f).cpu(), atol=2e-5, rtol=1e-4)


@gpu
def test_auto_takes_the_gluon_kernel_for_an_h8_pool():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2)
    a = decode_int8(q, kp, vp, slots, seq, num_splits=5, **kw)
    b = decode_int8(q, kp, vp, slots, seq, num_splits=5, impl="gluon", **kw)
    assert a.path == b.path == "gluon"
    assert torch.equal(a.o, b.o) and torch.equal(a.tv_bound, b.tv_bound)


@gpu
def test_certificate_is_the_same_whichever_way_the_row_is_split():
    q, kp, vp, slots, seq, kw, _ = _setup(S=200)
    outs = [decode_int8(q, kp, vp, slots, seq, impl="gluon", num_splits=ns, **kw) for ns in (1, 2, 8, 32)]
    for o in outs[1:]:
        torch.testing.assert_close(o.tv_bound, outs[0].tv_bound, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(o.o, outs[0].o, atol=1e-5, rtol=1e-5)


@gpu
def test_certificate_bounds_the_true_tv_on_a_fixed_seed_batch():
    q, kp, vp, slots, seq, kw, (K, slot_ids) = _setup(hq=4, hkv=2, S=48)
    out = decode_int8(q, kp, vp, slots, seq, impl="gluon", num_splits=2, **kw)
    _, probs = decode_reference(q, kp, vp, slots, seq, return_probs=True, impl="h10", **kw)
    assert_rows_within_certificate(q, K, slot_ids, slots, seq, probs, out.tv_bound)


@gpu
def test_nonfinite_scale_gives_a_vacuous_certificate():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2)
    bad = kp.scales.clone()
    bad[int(slots[0, 5]), 0, 1] = math.nan
    out = decode_int8(q, dataclasses.replace(kp, scales=bad), vp, slots, seq, impl="gluon", num_splits=2, **kw)
    assert torch.isinf(out.tv_bound[0, :2]).all() and out.vacuous[0, :2].all()
    assert torch.isfinite(out.tv_bound[1]).all()


@gpu
@pytest.mark.parametrize("hq,hkv", [(1, 1), (2, 1), (3, 1), (5, 1), (8, 1), (12, 2)])  # GQA 1-8 (6 at 12/2)
@pytest.mark.parametrize("block_size", [16, 32])
def test_block_table_matches_the_slot_table_and_the_reference(hq, hkv, block_size):
    """vLLM-style paging (shuffled pages, ragged lengths) in the Gluon kernel: the same bits as its per-token slot
    table, and the float64 reference's agreement."""
    from _paged import paged_problem, slot_table

    q, kp, vp, bt, seq, tok, _ = paged_problem([70, 9, 33, 16], block_size, hq=hq, hkv=hkv, d=128, dev=DEV,
                                               layout="h8", seed=SEED, layer=5, qdtype=torch.bfloat16)
    kw = dict(layer=5, seed=SEED, impl="gluon", num_splits=3)
    paged = decode_int8(q, kp, vp, None, seq, block_table=bt, block_size=block_size, **kw)
    flat = decode_int8(q, kp, vp, slot_table(tok, DEV), seq, **kw)
    assert paged.path == flat.path == "gluon"
    for f in ("o", "lse", "A", "B", "tv_bound"):
        assert torch.equal(getattr(paged, f), getattr(flat, f)), f
    ref = decode_reference(q, kp, vp, None, seq, block_table=bt, block_size=block_size, layer=5, seed=SEED,
                           impl="h10")
    for f in ("o", "lse", "A", "B", "tv_bound", "tv_bound_one"):
        torch.testing.assert_close(getattr(paged, f).double().cpu(), getattr(ref, f).cpu(), atol=2e-5, rtol=1e-4)


def test_combinations_without_a_gluon_kernel_say_which_path_ran():
    """More than 8 outlier pairs (d = 128): ``auto`` runs the Triton h10 kernel and says so, explicit ``gluon`` raises
    naming what is missing; an h8 pool at d = 64 with groups of 32 has no INT8 kernel: ``auto`` raises (never a
    silent reference)."""
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2, S=40, k_out=9)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=Int8KernelConfig(block_n=16), **kw)
    assert out.path == "h10"
    with pytest.raises(ValueError, match="at most 16 outlier channels"):
        decode_int8(q, kp, vp, slots, seq, impl="gluon", fallback_to_reference=False, **kw)
    g = torch.Generator().manual_seed(1)
    K, V = torch.randn(8, 1, 64, generator=g), torch.randn(8, 1, 64, generator=g)
    kp64 = make_pool_side(K, layer=5, seed=SEED, side=0, dither_layout="h8")
    vp64 = make_pool_side(V, layer=5, seed=SEED, side=1, dithered=False)
    q64 = torch.randn(1, 2, 64, generator=g).to(torch.bfloat16)
    sl, n = torch.arange(8, dtype=torch.int32)[None], torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match="group"):
        decode_int8(q64.to(DEV), dataclasses.replace(kp64, codes=kp64.codes.to(DEV), scales=kp64.scales.to(DEV)),
                    dataclasses.replace(vp64, codes=vp64.codes.to(DEV), scales=vp64.scales.to(DEV)), sl.to(DEV),
                    n.to(DEV), **kw)


# ---- RTN keys (dithered=False, as rtn-int8): the constexpr K_DITHER=False, no Philox, no dither MMA, no certificate
def test_rtn_keys_lift_the_layout_requirement():
    q, kp, vp, *_ = _setup(hq=4, hkv=2, k_dither=False, layout="w24")
    why = gluon_unsupported(q, kp, vp)
    assert why is None or "h8" not in why


@gpu
@pytest.mark.parametrize("layout,impl", [("h8", "auto"), ("h8", "gluon"), ("w24", "gluon")])
@pytest.mark.parametrize("hq,hkv", [(7, 1), (4, 2)])
def test_rtn_keys_match_the_reference(layout, impl, hq, hkv):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=hq, hkv=hkv, k_dither=False, layout=layout)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    assert ref.A is None
    out = decode_int8(q, kp, vp, slots, seq, impl=impl, num_splits=3, cert=False, **kw)
    assert out.path == "gluon" and out.A is None
    for f in ("o", "lse"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f).cpu(), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="cert"):
        decode_int8(q, kp, vp, slots, seq, impl=impl, **kw)


# ---- outlier channels (m RoPE pairs bypassed in fp16, as the h10 kernel and the reference): SmolLM2 needs m >= 4
@gpu
@pytest.mark.parametrize("m,v_out", [(1, False), (4, False), (4, True), (8, True)])
@pytest.mark.parametrize("hq,hkv,qdtype", [(7, 1, torch.bfloat16), (4, 2, torch.float16)])
def test_outlier_channels_match_the_reference(m, v_out, hq, hkv, qdtype):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=hq, hkv=hkv, qdtype=qdtype, k_out=m, v_out=v_out)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    out = decode_int8(q, kp, vp, slots, seq, impl="gluon", num_splits=3, **kw)
    auto = decode_int8(q, kp, vp, slots, seq, num_splits=3, **kw)
    assert out.path == "gluon"
    # auto takes the key-outlier variant (no spills, the test below); value outliers spill: the h10 kernel
    assert auto.path == ("h10" if v_out else "gluon")
    if not v_out:
        assert torch.equal(out.o, auto.o)
    for f in ("o", "lse", "A", "B", "tv_bound", "tv_bound_one"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f).cpu(), atol=2e-5, rtol=1e-4)
    # the bypass matters: the same codes without it give other scores
    plain = decode_reference(q, dataclasses.replace(kp, outliers=None, outlier_channels=None), vp, slots, seq,
                             impl="h10", **kw)
    assert (plain.lse - ref.lse).abs().max() > 1e-3


@gpu
def test_outlier_channels_certificate_bounds_the_true_tv_and_pages_agree():
    from _paged import paged_problem, slot_table

    q, kp, vp, slots, seq, kw, (K, slot_ids) = _setup(hq=4, hkv=2, S=48, k_out=4)
    out = decode_int8(q, kp, vp, slots, seq, impl="gluon", num_splits=2, **kw)
    _, probs = decode_reference(q, kp, vp, slots, seq, return_probs=True, impl="h10", **kw)
    assert_rows_within_certificate(q, K, slot_ids, slots, seq, probs, out.tv_bound)
    q, kp, vp, bt, seq, tok, _ = paged_problem([70, 9, 33], 16, hq=7, hkv=1, d=128, dev=DEV, layout="h8", seed=SEED,
                                               layer=5, qdtype=torch.bfloat16, k_out=True, v_out=True)
    kw = dict(layer=5, seed=SEED, impl="gluon", num_splits=3)
    paged = decode_int8(q, kp, vp, None, seq, block_table=bt, block_size=16, **kw)
    flat = decode_int8(q, kp, vp, slot_table(tok, DEV), seq, **kw)
    assert paged.path == "gluon" and torch.equal(paged.o, flat.o) and torch.equal(paged.tv_bound, flat.tv_bound)
    ref = decode_reference(q, kp, vp, None, seq, block_table=bt, block_size=16, layer=5, seed=SEED, impl="h10")
    for f in ("o", "lse", "A", "B", "tv_bound"):
        torch.testing.assert_close(getattr(paged, f).double().cpu(), getattr(ref, f).cpu(), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("KVLIB_SKIP_SASS") == "1", reason="offline compile disabled")
def test_outlier_and_rtn_key_variants_compile_for_sm90_without_spills():
    """The sm_90 binaries of the certified key-outlier variants (4 and 8 pairs; slot and block tables; GQA 1 and 8;
    one- and two-accumulator certificates) and the RTN-key variant: still no shared memory and no spills (compiled
    offline, no GPU needed), so ``auto`` takes them (:func:`kvlib.kernels.int8.gluon.gluon_auto_ok`)."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's NVIDIA toolchain is not installed")
    prog = ("import json; from kvlib.bench.sass_count import gluon_count as c; "
            "print(json.dumps([c(NOK=8), c(NOK=8, page=16, CERT_B=True), c(NOK=16, gqa=8), c(NOK=8, gqa=1),"
            " c(cert=False, K_DITHER=False)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=900,
                          check=True)
    for out in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert out["shared_bytes"] == 0 and out["stack_bytes"] == 0 and 0 < out["registers"] <= 255
        assert out["top_opcodes"].get("HMMA", 0) > 0


@gpu
@pytest.mark.parametrize("layer", [0, 1, 16])
@pytest.mark.parametrize("impl", ["gluon", "h10"])
def test_layer_and_seed_words_equal_to_one_are_run_time_values(layer, impl):
    """Triton turns an integer argument equal to 1 into a compile-time constant unless told not to; the layer
    index and the seed words are Philox counter inputs, so layer 1 (or a seed word of 1) must compile and match
    the reference like any other (a real model's second layer is layer 1)."""
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=1, layer=layer)
    for seed in (SEED, 1, 2**32 + 1):
        kw = dict(layer=layer, seed=seed)
        kps = make_pool_side(_setup_keys(layer, seed), layer=layer, seed=seed, side=0, dither_layout="h8")
        n = kps.codes.shape[0]
        sl = torch.arange(n, dtype=torch.int32).view(1, n).to(DEV)
        sq = torch.tensor([n], dtype=torch.int32, device=DEV)
        mv = lambda s: dataclasses.replace(s, codes=s.codes.to(DEV), scales=s.scales.to(DEV))  # noqa: E731
        kd = mv(kps)
        vd = mv(make_pool_side(_setup_keys(layer, seed + 1), layer=layer, seed=seed, side=1, dithered=False))
        qq = q[:1]
        ref = decode_reference(qq, kd, vd, sl, sq, impl="h10", **kw)
        out = decode_int8(qq, kd, vd, sl, sq, impl=impl, **kw)
        assert out.path == impl
        torch.testing.assert_close(out.tv_bound_one.double().cpu(), ref.tv_bound_one.cpu(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out.o.double().cpu(), ref.o.cpu(), atol=2e-5, rtol=1e-4)


def _setup_keys(layer: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(layer * 7 + seed % 1000)
    return torch.randn(40, 1, 128, generator=g)
