"""The h10-layout certified INT8 decode kernel (TRITON_INTERPRET=1 on CPU) against its float64 reference."""

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl
from _soundness import assert_rows_within_certificate

from kvlib.certify.bound import rounding_slack
from kvlib.kernels.int8.decode import DEFAULT_CONFIG, Int8KernelConfig, PoolSide, decode_reference, make_pool_side
from kvlib.kernels.int8.decode import decode_int8 as _decode_int8
from kvlib.kernels.int8.h10 import _s2_operand, _v_operand

# every test here launches a kernel (CPU: the interpreter): the GPU lane runs them all (-m gpu)
pytestmark = pytest.mark.gpu
SEED = 2**33 + 777
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run under TRITON_INTERPRET=1
C16 = Int8KernelConfig(block_n=16)


def decode_int8(*args, **kw):
    """The h10 kernel, never the reference: no fallback, and the result must say the h10 kernel ran."""
    out = _decode_int8(*args, fallback_to_reference=False, **kw)
    assert out.path == "h10", out.path
    return out


def _dev(side: PoolSide) -> PoolSide:
    mv = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return dataclasses.replace(side, codes=side.codes.to(DEV), scales=side.scales.to(DEV),
                               outliers=mv(side.outliers), outlier_channels=mv(side.outlier_channels))


def _setup(B=2, hq=7, hkv=1, S=40, *, k_out=True, v_out=False, qdtype=torch.float32, layer=2, d=128, group=32,
           layout="h10", k_dither=True):
    g = torch.Generator().manual_seed(hq * 10 + hkv + S)
    T = B * S
    K = torch.randn(T, hkv, d, generator=g)
    K[:, :, 9] *= 25  # a massive channel, bypassed below
    V = torch.randn(T, hkv, d, generator=g)
    n_slots = T + 5
    slot_ids = torch.randperm(n_slots, generator=g)[:T]
    koc = torch.stack([torch.tensor([8, 9]) + (32 * h) % d for h in range(hkv)]) if k_out else None
    voc = torch.stack([torch.tensor([0, 3, d - 58]) for _ in range(hkv)]) if v_out else None
    kp = make_pool_side(K, layer=layer, seed=SEED, side=0, n_slots=n_slots, slot_ids=slot_ids, outlier_channels=koc,
                        dither_layout=layout, group=group, dithered=k_dither)
    vp = make_pool_side(V, layer=layer, seed=SEED, side=1, n_slots=n_slots, slot_ids=slot_ids,
                        outlier_channels=voc, dithered=False, group=group)
    slots = slot_ids.view(B, S).to(torch.int32)
    seq = torch.tensor([S - 5 * b for b in range(B)], dtype=torch.int32)
    q = (2 * torch.randn(B, hq, d, generator=g)).to(qdtype)
    kw = dict(layer=layer, seed=SEED)
    return q.to(DEV), _dev(kp), _dev(vp), slots.to(DEV), seq.to(DEV), kw, (K, slot_ids)


def _assert_close(out, ref, atol=3e-6):
    atol, rtol = (atol, 2e-5) if DEV == "cpu" else (5 * atol, 1e-4)
    for f in ("o", "lse", "A", "B", "tv_bound", "tv_bound_one"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f), atol=atol, rtol=rtol)


@pytest.mark.parametrize("hq,hkv,qdtype,k_out,v_out", [
    (7, 1, torch.float32, True, False),  # the paper's GQA 7: eight heads per tile, one padded
    (4, 2, torch.bfloat16, False, True),  # GQA 4: the N dimension narrower than a fragment
    (2, 2, torch.float16, True, True),
])
def test_kernel_matches_reference(hq, hkv, qdtype, k_out, v_out):
    q, kp, vp, slots, seq, kw, _ = _setup(hq=hq, hkv=hkv, qdtype=qdtype, k_out=k_out, v_out=v_out)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=3, config=C16, **kw)  # auto -> h10 for an h10 pool
    _assert_close(out, ref)


@pytest.mark.parametrize("block_n,num_warps", [(32, 2), (64, 2), (64, 4)])
def test_kernel_matches_reference_at_wider_tiles(block_n, num_warps):
    # rows of 88 and 83 positions end inside a tile: the slots and scales loaded one tile ahead read nothing
    # past the row
    q, kp, vp, slots, seq, kw, _ = _setup(hq=7, hkv=1, S=88, v_out=True)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    cfg = Int8KernelConfig(block_n=block_n, num_warps=num_warps)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=1, config=cfg, **kw)
    _assert_close(out, ref)


@pytest.mark.parametrize("v_out", [False, True])
def test_dequantised_pv_is_within_fp16_rounding_and_leaves_the_certificate(v_out):
    """PV_DEQUANT: values rounded to fp16 once (``s c``) and ``1024 p`` as one fp16 piece. Softmax and
    certificate are untouched; the output moves by at most the two roundings (2^-11 relative each) of the
    values the output averages."""
    q, kp, vp, slots, seq, kw, _ = _setup(hq=7, hkv=1, S=88, v_out=v_out)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=Int8KernelConfig(block_n=32, pv_dequant=True), **kw)
    for f in ("lse", "A", "tv_bound", "tv_bound_one"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f), atol=3e-6, rtol=2e-5)
    vmax = float((vp.codes.abs().amax(-1).double() * vp.scales.double().amax(-1)).max())
    err = (out.o.double().cpu() - ref.o).abs().max()
    assert err <= 2 * 2.0**-11 * vmax + 1e-6, (float(err), vmax)
    assert err > 0 or DEV != "cpu"  # not the exact path by accident


def test_certificate_is_the_same_whichever_way_the_row_is_split():
    q, kp, vp, slots, seq, kw, _ = _setup(S=64)
    outs = [decode_int8(q, kp, vp, slots, seq, num_splits=ns, config=C16, **kw) for ns in (1, 4)]
    torch.testing.assert_close(outs[0].tv_bound, outs[1].tv_bound, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0].o, outs[1].o, atol=1e-5, rtol=1e-5)


def test_certificate_bounds_the_true_tv_on_a_fixed_seed_batch():
    q, kp, vp, slots, seq, kw, (K, slot_ids) = _setup(hq=4, hkv=2, S=48)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, **kw)
    _, probs = decode_reference(q, kp, vp, slots, seq, return_probs=True, impl="h10", **kw)
    assert_rows_within_certificate(q, K, slot_ids, slots, seq, probs, out.tv_bound)


def test_nonfinite_scale_gives_a_vacuous_certificate():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2)
    bad = kp.scales.clone()
    bad[int(slots[0, 5]), 0, 1] = math.nan
    out = decode_int8(q, dataclasses.replace(kp, scales=bad), vp, slots, seq, num_splits=2, config=C16, **kw)
    assert torch.isinf(out.tv_bound[0, :2]).all() and out.vacuous[0, :2].all()
    assert torch.isfinite(out.tv_bound[1]).all()


def test_h10_slack_carries_the_larger_dither_mean():
    # the 10-bit grid's mean (2^-11) dominates; the kernel's rounding term is the tc one, doubled
    assert rounding_slack(128, "h10", "h10") > rounding_slack(128, "tc", "w24")
    assert rounding_slack(128, "h10", "h10") >= 2.0**-11


def test_bad_inputs_raise_clear_errors():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=2, hkv=1)
    with pytest.raises(ValueError, match="v_dither"):
        _decode_int8(q, kp, vp, slots, seq, v_dither=True, fallback_to_reference=False, **kw)
    with pytest.raises(ValueError, match="h10"):
        _decode_int8(q, kp, vp, slots, seq, impl="tc", **kw)
    with pytest.raises(ValueError, match="h10"):  # the Triton fma kernel reads w24 only
        _decode_int8(q, kp, vp, slots, seq, impl="fma", fallback_to_reference=False, **kw)
    q64, kp64, vp64, slots64, seq64, kw64, _ = _setup(hq=2, hkv=1, d=64, k_out=False)
    with pytest.raises(ValueError, match="group"):
        _decode_int8(q64, kp64, vp64, slots64, seq64, **kw64)


def test_variance_dot_matches_the_fma_sum():
    q, kp, vp, slots, seq, kw, _ = _setup(hq=4, hkv=2, S=48)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    assert DEFAULT_CONFIG.var_dot  # the default
    dot = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, **kw)
    fma = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16.replace(var_dot=False), **kw)
    for out in (dot, fma):
        torch.testing.assert_close(out.tv_bound.double().cpu(), ref.tv_bound, rtol=1e-5, atol=1e-6)
    assert torch.equal(dot.o, fma.o) and torch.equal(dot.lse, fma.lse)  # the radius only


@triton.jit
def _operands_kernel(KS, V, A_OUT, B_OUT, BN: tl.constexpr, BH: tl.constexpr):
    r = tl.arange(0, BN)
    ks = tl.load(KS + r[:, None] * 4 + tl.arange(0, 4)[None, :])
    h = tl.arange(0, BH)
    v0 = tl.load(V + h)
    v1 = tl.load(V + BH + h)
    v2 = tl.load(V + 2 * BH + h)
    v3 = tl.load(V + 3 * BH + h)
    tl.store(A_OUT + r[:, None] * 16 + tl.arange(0, 16)[None, :], _s2_operand(ks))
    tl.store(B_OUT + tl.arange(0, 16)[:, None] * BH + h[None, :], _v_operand(v0, v1, v2, v3))


def test_variance_dot_operands_are_exact_tf32_pieces():
    """The tensor cores read tf32 (the low 13 fp32 mantissa bits ignored): every A entry must already be a tf32
    value, its pieces must sum to s^2 exactly, and the B pieces to v exactly (hi a tf32 value), so the dot with
    lo truncated is within 2^-20 of the exact variance."""
    g = torch.Generator().manual_seed(3)
    ks = (torch.rand(16, 4, generator=g) * 0.5 + 1e-3).half()
    ks[0] = torch.tensor([6.1e-5, 1e-4, 65504.0 ** 0.5, 3.0e-3]).half()  # near fp16's normal floor and sqrt(max)
    v = torch.rand(4, 8, generator=g, dtype=torch.float32) * 10 + 1e-6
    a_dev = torch.empty(16, 16, device=DEV)
    b_dev = torch.empty(16, 8, device=DEV)
    _operands_kernel[(1,)](ks.to(DEV), v.to(DEV), a_dev, b_dev, BN=16, BH=8)  # Triton reads the tensors' device
    a_out, b_out = a_dev.cpu(), b_dev.cpu()
    bits = a_out.view(torch.int32) & 0x1FFF
    assert (bits == 0).all()
    s2 = ks.double().square()
    pieces = a_out.double().view(16, 4, 4)
    assert torch.equal(pieces[..., 0] + pieces[..., 1], s2) and torch.equal(pieces[..., 2] + pieces[..., 3], s2)
    assert torch.equal(pieces[..., 0], pieces[..., 2]) and torch.equal(pieces[..., 1], pieces[..., 3])
    bp = b_out.double().view(4, 4, 8)
    assert ((b_out.view(4, 4, 8)[:, :2].contiguous().view(torch.int32) & 0x1FFF) == 0).all()  # hi: tf32
    assert torch.equal(bp[:, 0] + bp[:, 2], v.double()) and torch.equal(bp[:, 1] + bp[:, 3], v.double())
    trunc = (b_out.view(torch.int32) & -8192).view(torch.float32).double()  # what the tensor cores read
    var = a_out.double() @ trunc
    exact = s2 @ v.double()
    assert ((exact - var) >= 0).all() and ((exact - var) <= exact * 2.0**-20).all()


@pytest.mark.parametrize("layout,block_size,qdtype", [("h10", 16, torch.float32), ("h8", 16, torch.bfloat16),
                                                      ("h8", 32, torch.float16)])
def test_block_table_matches_the_slot_table_and_the_reference(layout, block_size, qdtype):
    """vLLM-style paging (shuffled pages, ragged lengths): the kernel computes each slot from the block table; the
    same bits as the per-token table, and the reference's agreement."""
    from _paged import paged_problem, slot_table

    lens = [45, 16, 7]
    q, kp, vp, bt, seq, tok, _ = paged_problem(lens, block_size, hq=7, hkv=1, d=128, dev=DEV, layout=layout,
                                               k_out=True, v_out=True, seed=SEED, layer=2, qdtype=qdtype)
    kw = dict(layer=2, seed=SEED, impl="h10", num_splits=2, config=C16)
    paged = decode_int8(q, kp, vp, None, seq, block_table=bt, block_size=block_size, **kw)
    flat = decode_int8(q, kp, vp, slot_table(tok, DEV), seq, **kw)
    for f in ("o", "lse", "A", "B", "tv_bound"):
        assert torch.equal(getattr(paged, f), getattr(flat, f)), f
    ref = decode_reference(q, kp, vp, None, seq, block_table=bt, block_size=block_size, layer=2, seed=SEED,
                           impl="h10")
    tol = 3e-6 if layout == "h10" else 5e-6  # the h8 dither term is larger (tests/test_dither_h8.py)
    _assert_close(paged, ref, atol=tol)


@pytest.mark.parametrize("hq,hkv", [(3, 1), (5, 1), (6, 1), (8, 1), (16, 2)])
def test_kernel_matches_reference_across_gqa_ratios(hq, hkv):
    """GQA 3, 5, 6, 8 (1, 2, 4, 7 above): the heads fill part of the padded N dimension."""
    q, kp, vp, slots, seq, kw, _ = _setup(hq=hq, hkv=hkv, S=24, qdtype=torch.bfloat16)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    _assert_close(decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, **kw), ref)


@pytest.mark.parametrize("layout,hq,hkv,qdtype", [("h10", 7, 1, torch.float32), ("h8", 4, 2, torch.bfloat16),
                                                  ("h8", 9, 3, torch.float16)])
def test_head_dim_64_with_groups_of_16(layout, hq, hkv, qdtype):
    """SmolLM2's d = 64 as d = 4 G with G = 16 (the tensor cores' smallest reduction depth): Philox word i still
    feeds group i (h10: 8 calls per position, h8: 4), with outlier channels on both sides."""
    q, kp, vp, slots, seq, kw, _ = _setup(hq=hq, hkv=hkv, d=64, group=16, layout=layout, qdtype=qdtype, v_out=True)
    ref = decode_reference(q, kp, vp, slots, seq, impl="h10", **kw)
    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, config=C16, **kw)
    _assert_close(out, ref, atol=3e-6 if layout == "h10" else 5e-6)
    assert bool((out.tv_bound.cpu() < 1).all())  # a real certificate, not a vacuous one


# ---- RTN keys (dithered=False, as rtn-int8): the constexpr K_DITHER=False, no Philox, no certificate
@pytest.mark.parametrize("layout,impl,d,group", [("h10", "auto", 128, 32), ("h8", "auto", 128, 32),
                                                 ("w24", "h10", 128, 32), ("h8", "h10", 64, 16)])
def test_rtn_keys_match_the_reference(layout, impl, d, group):
    """The layout label of an RTN key pool says nothing about its codes (no dither): "auto" routes on it, and the h10
    kernel may be asked for by name whatever it says."""
    q, kp, vp, slots, seq, kw, _ = _setup(hq=7, hkv=1, d=d, group=group, layout=layout, k_dither=False, v_out=True)
    ref = decode_reference(q, kp, vp, slots, seq, impl=impl, **kw)
    assert ref.A is None
    out = _decode_int8(q, kp, vp, slots, seq, num_splits=3, config=C16, impl=impl, cert=False,
                       fallback_to_reference=False, **kw)
    assert out.path == "h10" and out.A is None and out.tv_bound is None
    atol, rtol = (3e-6, 2e-5) if DEV == "cpu" else (1.5e-5, 1e-4)
    for f in ("o", "lse"):
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f), atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="cert"):
        _decode_int8(q, kp, vp, slots, seq, impl=impl, fallback_to_reference=False, **kw)
