"""Triton split-KV INT8 decode (under TRITON_INTERPRET=1 on CPU) against its float64 torch reference."""

import dataclasses
import math

import pytest
import torch
from _soundness import assert_rows_within_certificate

from kvlib.certify.bound import coverage
from kvlib.kernels.int8.decode import (
    Int8KernelConfig,
    PoolSide,
    decode_reference,
    decode_stage1,
    make_pool_side,
)
from kvlib.kernels.int8.decode import decode_int8 as _decode_int8
from kvlib.kernels.tl.merge import merge_splits, merge_splits_ref

# every test here launches a kernel (CPU: the interpreter): the GPU lane runs them all (-m gpu)
pytestmark = pytest.mark.gpu
SEED = 2**33 + 12345  # both key words non-trivial
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run under TRITON_INTERPRET=1
C16 = Int8KernelConfig(block_n=16)


def decode_int8(*args, **kw):
    """The kernel, never the reference: no fallback, and the result must name the stage-1 kernel that ran."""
    out = _decode_int8(*args, fallback_to_reference=False, **kw)
    assert out.path in ("tc", "fma", "h10", "gluon"), out.path
    if kw.get("impl", "auto") != "auto":
        assert out.path == kw["impl"]
    return out


def _dev(side):
    mv = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return dataclasses.replace(side, codes=side.codes.to(DEV), scales=side.scales.to(DEV), outliers=mv(side.outliers),
                               outlier_channels=mv(side.outlier_channels))


def _setup(B=2, hq=4, hkv=2, d=64, S=40, *, k_out=True, v_out=False, v_dither=False, layer=1, seed=SEED,
           k_dither=True):
    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + d)
    T = B * S
    K = torch.randn(T, hkv, d, generator=g)
    K[:, :, 7] *= 25  # a massive channel, bypassed below
    V = torch.randn(T, hkv, d, generator=g)
    n_slots = T + 9
    slot_ids = torch.randperm(n_slots, generator=g)[:T]  # scattered slots, as in a paged pool
    koc = torch.stack([torch.tensor([6, 7]) + 16 * h for h in range(hkv)]) if k_out else None
    voc = torch.stack([torch.tensor([0, 1, 33]) for _ in range(hkv)]) if v_out else None
    kp = make_pool_side(K, layer=layer, seed=seed, side=0, n_slots=n_slots, slot_ids=slot_ids, outlier_channels=koc,
                        dithered=k_dither)
    vp = make_pool_side(V, layer=layer, seed=seed, side=1, n_slots=n_slots, slot_ids=slot_ids,
                        outlier_channels=voc, dithered=v_dither)
    slots = slot_ids.view(B, S).to(torch.int32)
    seq = torch.tensor([S - 3 * b for b in range(B)], dtype=torch.int32)
    q = 2 * torch.randn(B, hq, d, generator=g)
    kw = dict(layer=layer, seed=seed, v_dither=v_dither)
    return q.to(DEV), _dev(kp), _dev(vp), slots.to(DEV), seq.to(DEV), kw, (K, slot_ids)


def _assert_close(out, ref, atol=2e-6):
    # the GPU's fast exp/division carry a few ulp more than the interpreter's numpy
    atol, rtol = (atol, 1e-5) if DEV == "cpu" else (5 * atol, 1e-4)
    for f in ("o", "lse", "A", "B", "tv_bound", "tv_bound_one"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f), atol=atol, rtol=rtol)


@pytest.mark.parametrize("impl", ["tc", "fma"])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (7, 1)])
def test_kernel_matches_reference_across_gqa(hq, hkv, impl):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=hq, hkv=hkv)
    ref = decode_reference(q, kp, vp, slots, seq, impl=impl, **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, impl=impl, **kw)
    _assert_close(out, ref)


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_core_kernel_across_query_dtypes_and_group_sizes(qdtype):
    for d, group in ((64, 32), (64, 16), (128, 64)):
        q, kp, vp, slots, seq, kw, (K, slot_ids) = _setup(d=d, hq=4, hkv=2, S=24, k_out=False)
        if group != 32:
            kp = _dev(make_pool_side(K, layer=kw["layer"], seed=kw["seed"], side=0, group=group,
                                     n_slots=kp.codes.shape[0], slot_ids=slot_ids))
            vp = PoolSide(vp.codes, vp.scales.repeat_interleave(32, -1)[..., ::group], group=group)
        q = q.to(qdtype)
        ref = decode_reference(q, kp, vp, slots, seq, impl="tc", **kw)
        out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, impl="tc", **kw)
        _assert_close(out, ref)


def test_tensor_core_cheaper_variants_stay_sound_and_close():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2)
    ref = decode_reference(q, kp, vp, slots, seq, impl="tc", **kw)
    for xi_split, pv_terms, tol in ((False, 3, 2e-4), (True, 2, 2e-3), (True, 1, 1e-2)):
        out = decode_int8(q, kp, vp, slots, seq, num_splits=2, impl="tc",
                          config=C16.replace(xi_split=xi_split, pv_terms=pv_terms), **kw)
        assert (out.o.double().cpu() - ref.o).abs().max() < tol
        # the radius covers the fp16 dither either way: the certificate still matches the reference's
        torch.testing.assert_close(out.tv_bound.double().cpu(), ref.tv_bound, atol=1e-4, rtol=1e-3)


def test_impl_choice_and_errors():
    from kvlib.kernels.int8.decode import resolve_impl

    assert resolve_impl("auto", 128, 32) == "tc" and resolve_impl("auto", 96, 32) == "fma"
    assert resolve_impl("auto", 64, 8) == "fma"
    assert resolve_impl("auto", 128, 32, v_dither=True) == "fma"  # auto: dithered values take the fma kernel
    assert resolve_impl("tc", 128, 32, v_dither=True) == "tc"  # asked for: the mended tc value-dither path
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("tc", 64, 8)
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("cuda", 64, 32)
    q, kp, vp, slots, seq, kw, _ = _setup()
    with pytest.raises(ValueError, match="pv_terms"):
        decode_int8(q, kp, vp, slots, seq, config=Int8KernelConfig(pv_terms=4), **kw)
    with pytest.raises(TypeError, match="config"):
        decode_int8(q, kp, vp, slots, seq, config={"block_n": 16}, **kw)


# ---- the tc kernel's value-dither path (issue 28): removed at b7182e0 after the H200 gave max |do| 3.3 at
# block_n 16 while the interpreter was right; mended as the RTN dots plus dots of s xi (w24.py says why)
@pytest.mark.parametrize("block_n,d,k_dither,v_out", [(16, 64, True, False), (16, 64, False, True),
                                                      (64, 64, True, True), (16, 128, True, False),
                                                      (32, 128, True, True)])
def test_tensor_core_value_dither_matches_reference(block_n, d, k_dither, v_out):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=7, hkv=1, d=d, S=40, v_out=v_out, v_dither=True, k_dither=k_dither)
    cert = dict(cert=False) if not k_dither else {}
    ref = decode_reference(q, kp, vp, slots, seq, impl="tc", **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=Int8KernelConfig(block_n=block_n), impl="tc",
                      **cert, **kw)
    assert out.path == "tc"
    if k_dither:
        _assert_close(out, ref)
    else:
        for f in ("o", "lse"):
            torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f),
                                       atol=2e-6 if DEV == "cpu" else 1e-5, rtol=1e-5 if DEV == "cpu" else 1e-4)
    # the dither is really read: the same codes as RTN values give another output
    rtn = decode_reference(q, kp, dataclasses.replace(vp, dithered=False), slots, seq, impl="tc",
                           **(kw | dict(v_dither=False)))
    assert (rtn.o - ref.o).abs().max() > 1e-3


def test_tensor_core_pv_operands_fit_their_depth_offline():
    """What the H200 got wrong, checked without a GPU: an sm_90 mma v2 dot operand whose layout is deeper than the
    dot (4 kWidth > K). The removed value-dither tile had kWidth 8 at K = block_n = 16; the mended kernel must not,
    and the reduced reproducer (dev/vdither_repro.py) must still be flagged (the check can fail)."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's NVIDIA toolchain is not installed")
    prog = """if True:
        import json, re, triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from kvlib.kernels.int8.w24 import tc_dot_layouts
        from dev.vdither_repro import _pv
        res = {}
        for bn, d, nov in ((16, 64, 0), (16, 128, 3), (64, 128, 0)):
            res[f"tc_bn{bn}_d{d}_nov{nov}"] = [o for o in tc_dot_layouts(block_n=bn, d=d, nov=nov)
                                              if o[4] == 2 and o[6] == bn and 4 * o[5] > o[6]]
        src = ASTSource(_pv, {"P": "*fp16", "C": "*i8", "X": "*fp32", "OUT": "*fp32", "K": "constexpr",
                              "JOIN": "constexpr"}, {"K": 16, "JOIN": True},
                        {(i,): [["tt.divisibility", 16]] for i in range(4)})
        ir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ttgir"]
        res["repro"] = [int(k) for k in re.findall(r"dot_op<[{]opIdx = 1, parent = #mma[^,]*, kWidth = ([0-9]+)", ir)]
        print(json.dumps(res))
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=900,
                          check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(res.pop("repro")) == 8  # the known-bad form: kWidth 8 at K = 16
    assert res == {k: [] for k in res}, res


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_kernel_matches_reference_across_splits(num_splits):
    q, kp, vp, slots, seq, kw, _ = _setup(v_out=True, v_dither=True)
    ref = decode_reference(q, kp, vp, slots, seq, **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=num_splits, config=C16, **kw)
    _assert_close(out, ref)


def test_stage2_is_the_merge_states_fold_and_splitting_is_exact():
    q, kp, vp, slots, seq, kw, _ = _setup()
    outs = []
    for ns in (1, 4):
        o_s, lse_s, a_s, b_s = decode_stage1(q, kp, vp, slots, seq, num_splits=ns, config=C16, **kw)
        o, lse, A, B = merge_splits(o_s, lse_s, a_s, b_s)[:4]
        o_r, lse_r, A_r, B_r = merge_splits_ref(o_s, lse_s, a_s, b_s)[:4]
        for x, y in ((o, o_r), (lse, lse_r), (A, A_r), (B, B_r)):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
        outs.append((o, lse, A, B))
    for x, y in zip(*outs):  # any split gives the same output, LSE and certificate
        torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)


def test_certificate_switch_leaves_attention_unchanged():
    q, kp, vp, slots, seq, kw, _ = _setup()
    on = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, **kw)
    off = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, cert=False, **kw)
    one = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, cert_b=False, **kw)
    assert off.A is None and off.tv_bound is None
    assert torch.equal(on.o, off.o) and torch.equal(on.lse, off.lse)
    assert one.B is None
    torch.testing.assert_close(one.tv_bound, on.tv_bound_one)
    assert (on.tv_bound <= on.tv_bound_one + 1e-7).all()


def test_kernel_certificate_is_sound_on_a_fixed_seed_batch():
    q, kp, vp, slots, seq, kw, (K, slot_ids) = _setup(hq=4, hkv=2, S=48)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, **kw)
    _, probs = decode_reference(q, kp, vp, slots, seq, return_probs=True, **kw)
    assert_rows_within_certificate(q, K, slot_ids, slots, seq, probs, out.tv_bound)


def test_nonfinite_scale_gives_vacuous_certificate_counted_over_threshold():
    q, kp, vp, slots, seq, kw, _ = _setup()
    bad = kp.scales.clone()
    bad[int(slots[0, 5]), 0, 0] = math.nan
    kp_bad = PoolSide(kp.codes, bad, kp.outliers, kp.outlier_channels, kp.group)
    out = decode_int8(q, kp_bad, vp, slots, seq, num_splits=2, config=C16, **kw)
    assert torch.isinf(out.tv_bound[0, :2]).all() and out.vacuous[0, :2].all()  # both heads of KV head 0
    assert torch.isfinite(out.tv_bound[1]).all()
    assert coverage(out.tv_bound, tau=1e9) == pytest.approx(1 - 2 / out.tv_bound.numel())
    bad_o = kp.outliers.clone()
    bad_o[int(slots[1, 0]), 1, 0] = math.inf
    out = decode_int8(q, PoolSide(kp.codes, kp.scales, bad_o, kp.outlier_channels), vp, slots, seq,
                      num_splits=2, config=C16, **kw)
    assert torch.isinf(out.tv_bound[1, 2:]).all()


def test_bad_inputs_raise_clear_errors():
    q, kp, vp, slots, seq, kw, _ = _setup()
    with pytest.raises(ValueError, match="delta"):
        decode_int8(q, kp, vp, slots, seq, delta=1.0, **kw)
    with pytest.raises(ValueError, match="delta"):
        decode_int8(q, kp, vp, slots, seq, delta=0.0, **kw)
    with pytest.raises(ValueError, match="multiple"):
        decode_int8(q[:, :3], kp, vp, slots, seq, **kw)
    with pytest.raises(ValueError, match="q"):
        decode_int8(q[0], kp, vp, slots, seq, **kw)
    with pytest.raises(ValueError, match="slots"):
        decode_int8(q, kp, vp, slots[:1], seq, **kw)
    with pytest.raises(TypeError, match="k_pool.codes"):
        decode_int8(q, PoolSide(kp.codes.float(), kp.scales), vp, slots, seq, **kw)
    with pytest.raises(ValueError, match="k_pool.scales"):
        decode_int8(q, PoolSide(kp.codes, kp.scales[..., :1]), vp, slots, seq, **kw)
    with pytest.raises(TypeError, match="k_pool"):
        decode_int8(q, object(), vp, slots, seq, **kw)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_joined_tile_layout_matches_reference(num_splits):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=7, hkv=1, v_out=True, v_dither=True)
    ref = decode_reference(q, kp, vp, slots, seq, impl="fma", **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=num_splits, config=C16.replace(join=True), impl="fma", **kw)
    _assert_close(out, ref)


def test_variance_by_dot_and_by_group_fmas_agree():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2)
    ref = decode_reference(q, kp, vp, slots, seq, impl="fma", **kw)
    for var_dot in (False, True):
        _assert_close(decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16.replace(var_dot=var_dot), impl="fma",
                                  **kw), ref)


def test_accumulator_overflow_is_vacuous():
    q, kp, vp, slots, seq, kw, _ = _setup()
    big = kp.scales.clone()
    big[int(slots[0, 3]), 1] = 60000.0  # radius far beyond ln(fp32 max): A overflows to +inf
    out = decode_int8(q, PoolSide(kp.codes, big, kp.outliers, kp.outlier_channels), vp, slots, seq,
                      num_splits=2, config=C16, **kw)
    assert torch.isinf(out.tv_bound[0, 2:]).all() and out.vacuous[0, 2:].all()
    assert torch.isfinite(out.tv_bound[0, :2]).all() and torch.isfinite(out.tv_bound[1]).all()


# ---- vLLM-style paged addressing: block_table [B, max_blocks] + block_size instead of the per-token slot table
@pytest.mark.parametrize("impl,block_size", [("tc", 16), ("tc", 8), ("fma", 32), ("fma", 16)])
def test_block_table_matches_the_slot_table_and_the_reference(impl, block_size):
    from _paged import paged_problem, slot_table

    lens = [37, 5, 64, 50]  # ragged; 64 fills its pages exactly, 5 uses a part of one
    q, kp, vp, bt, seq, tok, _ = paged_problem(lens, block_size, hq=4, hkv=2, d=64, dev=DEV, k_out=True,
                                               v_out=impl == "fma", v_dither=impl == "fma", seed=SEED, layer=1)
    kw = dict(layer=1, seed=SEED, v_dither=impl == "fma", impl=impl, num_splits=3, config=C16)
    paged = decode_int8(q, kp, vp, None, seq, block_table=bt, block_size=block_size, **kw)
    flat = decode_int8(q, kp, vp, slot_table(tok, DEV), seq, **kw)
    for f in ("o", "lse", "A", "B", "tv_bound"):  # the same slots in the same order: the same bits
        assert torch.equal(getattr(paged, f), getattr(flat, f)), f
    ref = decode_reference(q, kp, vp, None, seq, block_table=bt, block_size=block_size, layer=1, seed=SEED,
                           v_dither=impl == "fma", impl=impl)
    ref_flat = decode_reference(q, kp, vp, slot_table(tok, DEV), seq, layer=1, seed=SEED, v_dither=impl == "fma",
                                impl=impl)
    assert torch.equal(ref.o, ref_flat.o) and torch.equal(ref.tv_bound, ref_flat.tv_bound)
    _assert_close(paged, ref)


def test_block_table_bad_inputs_raise_naming_the_argument():
    from _paged import paged_problem, slot_table

    q, kp, vp, bt, seq, tok, _ = paged_problem([20, 9], 8, hq=2, hkv=1, d=64, dev=DEV, seed=SEED, layer=1)
    kw = dict(layer=1, seed=SEED)
    with pytest.raises(ValueError, match="exactly one"):
        decode_int8(q, kp, vp, slot_table(tok, DEV), seq, block_table=bt, block_size=8, **kw)
    with pytest.raises(ValueError, match="block_size"):
        decode_int8(q, kp, vp, None, seq, block_table=bt, **kw)
    with pytest.raises(ValueError, match="block_size"):
        decode_int8(q, kp, vp, slot_table(tok, DEV), seq, block_size=8, **kw)
    with pytest.raises(TypeError, match="block_table"):
        decode_int8(q, kp, vp, None, seq, block_table=bt.float(), block_size=8, **kw)
    with pytest.raises(ValueError, match="block_table"):
        decode_int8(q, kp, vp, None, seq, block_table=bt[:1], block_size=8, **kw)


# ---- RTN keys (a pool written with dithered=False, as rtn-int8 is): no dither read, no certificate
@pytest.mark.parametrize("impl,v_out,v_dither", [("tc", False, False), ("tc", True, False), ("fma", True, True),
                                                 ("auto", False, False)])
def test_rtn_keys_match_the_reference(impl, v_out, v_dither):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=7, hkv=1, v_out=v_out, v_dither=v_dither, k_dither=False)
    assert not kp.dithered
    ref = decode_reference(q, kp, vp, slots, seq, impl=impl, **kw)
    assert ref.A is None and ref.tv_bound is None  # no variance proxy: the reference certifies nothing either
    out = decode_int8(q, kp, vp, slots, seq, num_splits=3, config=C16, impl=impl, cert=False, **kw)
    assert out.path == ("tc" if impl == "auto" else impl)
    assert out.A is None and out.tv_bound is None
    for f in ("o", "lse"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f), atol=2e-6 if DEV == "cpu" else 1e-5,
                                   rtol=1e-5 if DEV == "cpu" else 1e-4)
    # the same codes read as dithered keys give other scores: the mode is really switched
    dith = decode_reference(q, dataclasses.replace(kp, dithered=True), vp, slots, seq, impl=impl, **kw)
    assert (dith.lse - ref.lse).abs().max() > 1e-3


def test_rtn_keys_refuse_a_certificate():
    q, kp, vp, slots, seq, kw, _ = _setup(k_dither=False)
    for impl in ("tc", "fma", "auto"):
        with pytest.raises(ValueError, match="cert"):
            decode_int8(q, kp, vp, slots, seq, impl=impl, **kw)  # cert=True by default
        with pytest.raises(ValueError, match="cert"):
            decode_stage1(q, kp, vp, slots, seq, impl=impl, **kw)
    with pytest.raises(ValueError, match="cert"):  # the CPU fallback refuses it as well
        _decode_int8(q.cpu(), kp, vp, slots.cpu(), seq.cpu(), **kw)
    with pytest.raises(TypeError, match="k_pool.dithered"):
        decode_int8(q, dataclasses.replace(kp, dithered=0), vp, slots, seq, cert=False, **kw)


def test_a_paged_pool_view_says_whether_its_keys_are_dithered():
    """A kvlib.storage.paged pool built with dithered=False says so on its layer views, and the kernel reads it."""
    from kvlib.kernels.int8.request import as_side
    from kvlib.storage.paged import PagedPool

    for dithered in (False, True):
        pool = PagedPool(n_layers=1, n_slots=8, n_kv_heads=1, d=64, dithered=dithered)
        assert as_side(pool.layer(0), "k_pool").dithered is dithered
