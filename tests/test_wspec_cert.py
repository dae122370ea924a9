"""The warp-specialised certified INT8 decode (:mod:`kvlib.kernels.int8.wspec_cert`).

On the CPU: its config and planner's argument validation, the certificate constants it launches with (the Gluon
kernel's), its float64 reference against the Triton h10 kernel under the interpreter, its register layouts against
Triton's own linear layouts, and (offline, no GPU) that it compiles for sm_90. On a GPU (``dev/gpu/wspec_cert.sh``):
agreement of ``o``, ``lse``, ``A``, ``B`` and the bounds with the float64 reference and with the existing Gluon
kernel (shuffled ragged pages, GQA 1/4/7/8, m = 0 and 4 outlier pairs, several split counts), split invariance,
soundness on a fixed seed, and the vacuous certificate of a non-finite scale; at d = 64 (SmolLM2's 9 query / 3 KV
heads and others, issue 40) against the float64 reference and soundness, the kernel itself and through
``decode_int8(impl="wspec")``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kvlib.kernels.int8 import wspec_cert as C
from kvlib.kernels.int8.request import PoolSide

SEED = 2**33 + 777
LAYER = 3
D = 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels run on a GPU only")
# the Gluon kernel's own tolerances against the float64 reference (tests/test_decode_gluon.py)
TOL = dict(atol=2e-5, rtol=1e-4)
FIELDS = ("o", "lse", "A", "B", "tv_bound", "tv_bound_one")


def _problem(lens, bs, *, hq, hkv, m=0, qdtype=torch.bfloat16, seed=0, extra_blocks=5, dev=DEV, d=D):
    """Shuffled pages (a toy block manager's), ragged lengths, a massive key channel; ``m`` RoPE pairs
    ``(c, c + d / 2)`` per head kept in fp16. ``(q, k_pool, v_pool, block_table, seq_lens, token_slots, K)``."""
    from kvlib.kernels.int8.request import make_pool_side
    from kvlib.kernels.tl.paging import allocate_blocks

    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in lens) + extra_blocks
    table, tok = allocate_blocks(lens, bs, num_blocks=num_blocks, generator=g)
    slot_ids = torch.cat(tok)
    T = slot_ids.numel()
    K = torch.randn(T, hkv, d, generator=g)
    K[:, :, 9] *= 12.0
    V = torch.randn(T, hkv, d, generator=g)
    koc = None
    if m:
        half = d // 2
        koc = torch.stack([torch.tensor(sorted(x for i in range(m) for x in ((9 + 13 * i + 5 * h) % half,
                                                                            (9 + 13 * i + 5 * h) % half + half)))
                           for h in range(hkv)])
    kp = make_pool_side(K, layer=LAYER, seed=SEED, side=0, n_slots=num_blocks * bs, slot_ids=slot_ids,
                        outlier_channels=koc, dither_layout="h8")
    vp = make_pool_side(V, layer=LAYER, seed=SEED, side=1, n_slots=num_blocks * bs, slot_ids=slot_ids,
                        dithered=False)
    q = (2 * torch.randn(len(lens), hq, d, generator=g)).to(qdtype)
    mv = lambda s: dataclasses.replace(s, codes=s.codes.to(dev), scales=s.scales.to(dev),  # noqa: E731
                                       outliers=None if s.outliers is None else s.outliers.to(dev),
                                       outlier_channels=None if s.outlier_channels is None
                                       else s.outlier_channels.to(dev))
    return (q.to(dev), mv(kp), mv(vp), table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev), tok, K)


def _kw(bs, **extra):
    return dict(block_size=bs, layer=LAYER, seed=SEED) | extra


# ---- CPU: validation
@pytest.mark.parametrize("kw, name", [
    ({"block_n": 48}, "block_n"), ({"block_n": 256}, "block_n"), ({"ring": 1}, "ring"), ({"ring": 7}, "ring"),
    ({"producer_regs": 20}, "producer_regs"), ({"maxnreg": 130}, "maxnreg"), ({"ctas_per_sm": 0}, "ctas_per_sm"),
    ({"swizzle": 0}, "swizzle"), ({"pv": "round"}, "pv"), ({"consumers": 3}, "consumers"),
    ({"consumers": 2, "ring": 3}, "even ring"), ({"consumer_regs": 20}, "consumer_regs"),
])
def test_config_names_the_bad_field(kw, name):
    with pytest.raises(ValueError, match=name):
        C.WSpecCertConfig(**kw)


def _bad_cases():
    def side(which, **ch):
        return lambda a: a.__setitem__(which, dataclasses.replace(a[which], **ch))

    def rtn_values_outliers(a):
        n, h, _ = a[2].codes.shape
        a[2] = dataclasses.replace(a[2], outliers=torch.zeros(n, h, 2, dtype=torch.float16),
                                   outlier_channels=torch.tensor([[0, 1]] * h))

    def too_many_outliers(a):
        n, h, _ = a[1].codes.shape
        a[1] = dataclasses.replace(a[1], outliers=torch.zeros(n, h, 18, dtype=torch.float16),
                                   outlier_channels=torch.arange(18).repeat(h, 1))

    return [
        (side(1, dithered=False), {}, "k_pool"),
        (side(1, dither_layout="h10"), {}, "k_pool"),
        (lambda a: None, {"v_dither": True}, "v_dither"),
        (side(1, scales=None), {}, "k_pool"),
        (lambda a: a.__setitem__(1, dataclasses.replace(a[1], scales=a[1].scales.float())), {}, "k_pool.scales"),
        (rtn_values_outliers, {}, "v_pool.outliers"),
        (too_many_outliers, {}, "k_pool.outliers"),
        (lambda a: None, {"block_size": 12}, "block_size"),
        (lambda a: None, {"block_size": 32}, "block_size"),  # 5 pages of 16 slots are not whole pages of 32
        (lambda a: None, {"block_size": 16.0}, "block_size"),
        (lambda a: None, {"layer": -1}, "layer"),
        (lambda a: None, {"layer": 2**31}, "layer"),
        (lambda a: None, {"seed": -3}, "seed"),
        (lambda a: None, {"delta": 1.0}, "delta"),
        (lambda a: None, {"sm_scale": -1.0}, "sm_scale"),
        (lambda a: None, {"num_splits": 0}, "num_splits"),
        (lambda a: None, {"config": {"block_n": 64}}, "config"),
        (lambda a: a.__setitem__(0, a[0].float()), {}, "q"),
        (lambda a: a.__setitem__(0, torch.cat([a[0]] * 5, 1)), {}, "at most 8"),  # GQA 10
        (lambda a: a.__setitem__(3, a[3].long()), {}, "block_table"),
        (lambda a: a.__setitem__(4, a[4][:1]), {}, "seq_lens"),
    ]


@pytest.mark.parametrize("mutate, extra, name", _bad_cases())
def test_plan_names_the_bad_argument(mutate, extra, name):
    q, kp, vp, bt, seq, _, _ = _problem([5, 40], 16, hq=8, hkv=2, dev="cpu")
    args = [q, kp, vp, bt, seq]
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=name):
        C.plan(*args, **(_kw(16) | extra))


def test_plan_carries_the_gluon_kernels_certificate_constants():
    """The radius slack, the bypass allowances and the Philox key are the ones :func:`decode_int8` launches the Gluon
    kernel with (its ``rad_extra``: ``radius_multiplier`` with ``impl="h10"`` over the h8 layout)."""
    from kvlib.certify.bound import radius_multiplier, rounding_gamma
    from kvlib.core.fp16 import FP16_REL, FP16_SUB
    from kvlib.core.philox import seed_key

    q, kp, vp, bt, seq, _, _ = _problem([5, 40], 16, hq=8, hkv=2, m=4, dev="cpu")
    pl = C.plan(q, kp, vp, bt, seq, **_kw(16, delta=0.05))
    want = radius_multiplier(1, 0.05, D, impl="h10", layout="h8") - radius_multiplier(1, 0.05, D, slack=False)
    assert pl.rad_extra == want and pl.rad_extra > 0
    assert (pl.byp_rel, pl.byp_abs) == (FP16_REL + rounding_gamma(D), FP16_SUB)
    assert (pl.k0, pl.k1) == seed_key(SEED) and pl.nok == 8 and pl.gqa == 4
    assert pl.sm_scale == 1.0 / math.sqrt(D)


def test_plan_at_d64_carries_the_constants_of_d64():
    """SmolLM2's shape (9 query / 3 KV heads, d = 64, m = 4 pairs): the radius slack, the bypass allowance and the
    softmax scale are those of d = 64 (the same functions as the Gluon kernel's constants, at the request's d)."""
    from kvlib.certify.bound import radius_multiplier, rounding_gamma
    from kvlib.core.fp16 import FP16_REL

    q, kp, vp, bt, seq, _, _ = _problem([5, 40], 16, hq=9, hkv=3, m=4, dev="cpu", d=64)
    pl = C.plan(q, kp, vp, bt, seq, **_kw(16, delta=0.05))
    want = radius_multiplier(1, 0.05, 64, impl="h10", layout="h8") - radius_multiplier(1, 0.05, 64, slack=False)
    assert (pl.d, pl.gqa, pl.hkv, pl.nok) == (64, 3, 3, 8)
    assert pl.rad_extra == want and pl.byp_rel == FP16_REL + rounding_gamma(64) and pl.sm_scale == 0.125
    q96, kp96, vp96, bt96, seq96, _, _ = _problem([5, 40], 16, hq=8, hkv=2, dev="cpu", d=96)
    with pytest.raises(ValueError, match="head_dim"):
        C.plan(q96, kp96, vp96, bt96, seq96, **_kw(16))
    with pytest.raises(ValueError, match="d must be"):
        C.compile_offline(d=32)


@pytest.mark.parametrize("d", [128, 64])
def test_each_lane_selects_the_words_of_its_channels(d):
    """The consumer's dither operand of group ``g`` holds, in column ``J`` (lane ``t = J // 2`` of a quad, channels
    ``4 J .. 4 J + 3`` of the group), byte ``b`` of word ``i`` of Philox call ``j``: at d = 128 ``i = g``,
    ``j = J``; at d = 64 (the kernel's ``cj % 4`` and ``cj < 4`` select) ``i = 2 g + J // 4``, ``j = J mod 4``.
    Each must be the channel :func:`kvlib.core.philox.h8_channel_map` (the h8 layout the pools are written with)
    gives that call, word and byte: ``32 g + 4 J + b``."""
    from kvlib.core.philox import h8_channel_map

    cmap = h8_channel_map(d)  # [call, word, byte] -> channel
    for g in range(d // 32):
        for J in range(8):
            i, j = (g, J) if d == 128 else (2 * g + (0 if J < 4 else 1), J % 4)
            for b in range(4):
                assert int(cmap[j, i, b]) == 32 * g + 4 * J + b, (g, J, b)


def test_plan_splits_follow_the_rtn_planner():
    from kvlib.kernels.int8 import wspec as W

    q, kp, vp, bt, seq, _, _ = _problem([5, 40], 16, hq=8, hkv=2, dev="cpu")
    big = torch.zeros(2, 1024, dtype=torch.int32)
    cfg = C.WSpecCertConfig()
    got = C.plan(q, kp, vp, big, seq, **_kw(16), sms=132, config=cfg).num_splits
    # one wave of 2 CTAs per SM over (2 rows x 2 heads), at most one split per 4 tiles of 64 of the 16384 slots
    assert got == min(132 * cfg.ctas_per_sm // 4, 1024 * 16 // (4 * 64)) == 64
    nb = kp.codes.shape[0] // 16
    pages = lambda s: (s.codes.view(nb, 16, 2, D), s.scales.view(nb, 16, 2, D // 32))  # noqa: E731
    assert got == W.plan(q, *pages(kp), *pages(vp), big, seq, config=cfg.wspec(), sms=132).num_splits
    assert C.plan(q, kp, vp, bt, seq, **_kw(16), num_splits=5).num_splits == 5


def test_planner_counts_only_the_ctas_the_ring_lets_reside():
    """128-position tiles over 3 stages with outlier rows (~121 KB) leave one CTA per SM: the planner's wave counts
    one, not the config's two (a second, partial wave otherwise); without outliers two fit."""
    big = C.WSpecCertConfig(block_n=128, ring=3)
    assert big.ctas_fit(0) == 2 and big.ctas_fit(8) == 1 and C.WSpecCertConfig().ctas_fit(8) == 2
    q, kp, vp, bt, seq, _, _ = _problem([5, 40], 16, hq=8, hkv=2, m=4, dev="cpu")
    wide = torch.zeros(2, 4096, dtype=torch.int32)
    assert C.plan(q, kp, vp, wide, seq, **_kw(16), sms=132, config=big).num_splits == 132 // 4
    q, kp, vp, bt, seq, _, _ = _problem([5, 40], 16, hq=8, hkv=2, dev="cpu")
    assert C.plan(q, kp, vp, wide, seq, **_kw(16), sms=132, config=big).num_splits == 2 * 132 // 4


def test_shared_memory_fits_two_ctas_per_sm():
    """The default ring (64-position tiles, 4 stages) with 16 outlier rows per stage stays under half of the H200's
    228 KB of shared memory per SM, so the planner's two CTAs per SM fit."""
    cfg = C.WSpecCertConfig()
    assert cfg.smem_bytes() == 4 * (2 * 64 * 128 + 16 * 64 + 16)
    assert cfg.smem_bytes(nok=8) + 16 * 64 * 4 < 228 * 1024 // 2  # + the P exchange's scratch


def test_launch_refuses_cpu_tensors():
    q, kp, vp, bt, seq, _, _ = _problem([5, 40], 16, hq=8, hkv=2, dev="cpu")
    with pytest.raises(ValueError, match="CUDA"):
        C.wspec_cert_stage1(q, kp, vp, bt, seq, **_kw(16))


# ---- CPU: the reference and the layouts
@pytest.mark.parametrize("m", [0, 2])
def test_d64_reference_is_the_family_reference_and_sound(m):
    """At d = 64 with groups of 32 (SmolLM2's 9 / 3 heads; no Triton h10 kernel reads this shape) the reference's
    ``o``, ``lse`` and weights are the family reference's (``impl="fma"``, the same float64 attention) bit for bit;
    its certificate (h10 slack at d = 64) is finite and bounds the true TV of every row (exact keys) on a fixed seed;
    ``impl="h10"`` itself refuses the shape."""
    from _paged import slot_table
    from _soundness import assert_rows_within_certificate

    from kvlib.kernels.int8.reference import decode_reference

    q, kp, vp, bt, seq, tok, K = _problem([48, 130, 7], 16, hq=9, hkv=3, m=m, dev="cpu", d=64)
    ref, probs = decode_reference(q, kp, vp, None, seq, layer=LAYER, seed=SEED, kernel_rounding="h10",
                                  block_table=bt, block_size=16, return_probs=True)
    assert torch.equal(ref.o, C.wspec_cert_reference(q, kp, vp, bt, seq, **_kw(16)).o)
    fam, fprobs = decode_reference(q, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="fma", block_table=bt,
                                   block_size=16, return_probs=True)
    assert torch.equal(ref.o, fam.o) and torch.equal(ref.lse, fam.lse)
    assert all(torch.equal(a, b) for a, b in zip(probs, fprobs, strict=True))
    assert torch.isfinite(ref.tv_bound).all() and bool((ref.tv_bound > 0).all())
    assert_rows_within_certificate(q, K, torch.cat(tok), slot_table(tok, "cpu"), seq, probs, ref.tv_bound)
    with pytest.raises(ValueError, match="h10"):
        decode_reference(q, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="h10", block_table=bt, block_size=16)
    with pytest.raises(ValueError, match="kernel_rounding"):
        decode_reference(q, kp, vp, None, seq, layer=LAYER, seed=SEED, kernel_rounding="tc", block_table=bt,
                         block_size=16)


@pytest.mark.skipif(DEV == "cuda", reason="the interpreter check (the GPU lane runs the kernels themselves)")
def test_reference_matches_the_triton_h10_kernel_on_pages():
    """The reference (validated as the kernel's request) against the existing Triton kernel of the same h8 pool under
    the interpreter: the output and the certificate agree to the Gluon kernel's tolerances, with a key-outlier pair
    and shuffled ragged pages; and it is the family reference exactly."""
    from kvlib.kernels.int8.decode import Int8KernelConfig, decode_int8
    from kvlib.kernels.int8.reference import decode_reference

    q, kp, vp, bt, seq, _, _ = _problem([9, 40], 16, hq=4, hkv=1, m=1, dev="cpu")
    ref = C.wspec_cert_reference(q, kp, vp, bt, seq, **_kw(16))
    fam = decode_reference(q, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="h10", block_table=bt, block_size=16)
    for f in FIELDS:
        assert torch.equal(getattr(ref, f), getattr(fam, f)), f
    out = decode_int8(q, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="h10", block_table=bt, block_size=16,
                      num_splits=2, config=Int8KernelConfig(block_n=16))
    assert out.path == "h10"
    for f in FIELDS:
        torch.testing.assert_close(getattr(out, f).double(), getattr(ref, f).double(), **TOL)


def _linear(layout, shape):
    from triton._C.libtriton import gluon_ir, ir

    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    return builder.to_linear_layout(layout._to_ir(builder), shape)


@pytest.mark.parametrize("bn", [32, 64, 128])
def test_layouts_are_the_tensor_core_operands_relabelled(bn):
    """The key-code / dither layout ``KW`` is Triton's 4-warp mma_v2 B operand with the reduction index permuted
    (``16 jj + 8 h + 2 t + e`` <- local channel ``8 t + 4 jj + 2 h + e``), the Philox-word layout ``W`` has the same
    positions per lane and warp, ``Z8`` is the scores' layout less its padding rows and ``F3`` that reshaped: what
    the kernel's ``assert_trivial``
    conversions rely on, checked against Triton's own linear layouts."""
    from triton.experimental.gluon import language as gl

    lay = C.consumer_layouts(bn)
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    kb = _linear(gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2), [32, bn])
    perm = lambda c: 16 * ((c >> 2) & 1) + 8 * ((c >> 1) & 1) + 2 * (c >> 3) + (c & 1)  # noqa: E731
    kw = lay["KW"]
    # KW's bases ([position, channel]) mapped through the permutation are KB's ([reduction index, position])
    to_kb = lambda base: [perm(base[1]) if base[1] else 0, base[0]]  # noqa: E731
    assert [to_kb(b) for b in kw.reg_bases] == kb.reg_bases
    assert [to_kb(b) for b in kw.lane_bases] == kb.lane_bases
    assert [to_kb(b) for b in kw.warp_bases] == kb.warp_bases
    # the words: call bit 0 in registers, bits 1-2 on the quad's lanes, positions as KW's
    w = lay["W"]
    assert w.reg_bases[0] == [0, 1] and w.lane_bases[:2] == [[0, 2], [0, 4]]
    assert w.reg_bases[1:] == kw.reg_bases[3:] and w.lane_bases[2:] == kw.lane_bases[2:]
    assert w.warp_bases == kw.warp_bases
    # Z8: the scores' C layout without its row-8 register (the padding rows); F3: Z8 with n = 32 r + n'
    c = _linear(mma, [16, bn])
    z8, f3 = lay["Z8"], lay["F3"]
    assert [b for b in c.reg_bases if b != [8, 0]] == z8.reg_bases and [8, 0] in c.reg_bases
    assert c.lane_bases == z8.lane_bases and c.warp_bases == z8.warp_bases
    unflat = lambda b: [b[0], b[1] // 32, b[1] % 32]  # noqa: E731
    assert [unflat(b) for b in z8.reg_bases] == f3.reg_bases
    assert [unflat(b) for b in z8.lane_bases] == f3.lane_bases
    assert [unflat(b) for b in z8.warp_bases] == f3.warp_bases


@pytest.mark.skipif(os.environ.get("KVLIB_SKIP_SASS") == "1", reason="offline compile disabled")
def test_compiles_for_sm90():
    """Both PV variants (exact, the default; folded), with 3-4 outlier pairs, with the certificate compiled out, at GQA
    1, 7 and 8, pages of 16 and 64, 64- and 128-position tiles, and at d = 64 (SmolLM2's GQA 3, m = 4 pairs): each
    builds for sm_90 with Triton's own toolchain (every ``assert_trivial`` conversion holds), with HMMA and ex2 in
    the consumer and TMA in the producer. The folded variants do not spill (at most one word with outliers); the
    exact ones sit at the 128-register cap and spill a few words in their loop (1-13 local loads/stores at
    2026-12-02), which the GPU timing prices. The ping-pong variant (two consumer warpgroups,
    WSPEC_CERT_PINGPONG_CONFIG) builds too; it spills a few words outside its tile loops at d = 128
    (dev/results/wspec_d64_offline.json), so its spills are not bounded here."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's NVIDIA toolchain is not installed")
    prog = r"""
import json, os, re, subprocess, tempfile
from kvlib.kernels.int8 import wspec_cert as C
from kvlib.kernels.offline import tool as _tool
out = []
fold = C.WSpecCertConfig(pv="fold")
fold128 = C.WSpecCertConfig(pv="fold", block_n=128, ring=3, producer_regs=40)
from kvlib.kernels.int8.decode import WSPEC_CERT_PINGPONG_CONFIG
pp = C.WSpecCertConfig(**WSPEC_CERT_PINGPONG_CONFIG)
for kw in ({}, {"nok": 8}, {"cert": False}, {"gqa": 1, "nok": 8}, {"gqa": 8, "block_size": 64, "cert_b": False},
           {"config": fold}, {"config": fold, "cert": False}, {"config": fold, "nok": 6, "gqa": 1},
           {"config": fold128}, {"config": fold128, "nok": 8}, {"d": 64, "gqa": 3, "nok": 8},
           {"config": fold128, "d": 64, "gqa": 3}, {"config": fold, "d": 64, "gqa": 3, "nok": 8},
           {"config": pp}, {"config": pp, "d": 64, "gqa": 3, "nok": 8}):
    cc = C.compile_offline(**kw)
    with tempfile.TemporaryDirectory() as t:
        p = os.path.join(t, "k.cubin"); open(p, "wb").write(cc.asm["cubin"])
        use = subprocess.run([_tool("cuobjdump"), "-res-usage", p], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", p], capture_output=True, text=True).stdout
    res = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK)[:=](\d+)", use)}
    res["spill_ops"] = sass.count("STL") + sass.count("LDL")
    cfg = kw.get("config", C.WSpecCertConfig())
    out.append(dict(fold=cfg.pv == "fold" and cfg.consumers == 1, nok=kw.get("nok", 0), kw=str(kw), **res,
                    hmma=sass.count("HMMA"),
                    tma=sass.count("UTMALDG"), mufu=sass.count("MUFU.EX2")))
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rec in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert rec["hmma"] > 0 and rec["tma"] > 0 and rec["mufu"] > 0, rec
        if rec["fold"]:  # the folded PV: no spill without outliers, at most one spilled word with them
            assert rec["spill_ops"] <= (2 if rec["nok"] else 0), rec


# ---- GPU: the kernel against the reference and the existing Gluon kernel
SHAPES = [  # (lens, block_size, hq, hkv): GQA 7, 1, 8 and 4, ragged rows cut mid-tile and mid-page
    ([1, 77, 300, 1000], 16, 28, 4),
    ([16, 300, 513], 16, 4, 4),
    ([5, 640, 1999], 64, 32, 4),
    ([70, 9, 33, 200], 32, 8, 2),
]


def _old_gluon(q, kp, vp, bt, seq, bs, **kw):
    from kvlib.kernels.int8.decode import decode_int8

    out = decode_int8(q, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="gluon", block_table=bt, block_size=bs,
                      num_splits=3, **kw)
    assert out.path == "gluon"
    return out


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa7", "gqa1", "gqa8_bs64", "gqa4_bs32"])
@pytest.mark.parametrize("m", [0, 4])
@pytest.mark.parametrize("ns", [None, 3, 7])
def test_kernel_matches_the_reference_and_the_gluon_kernel(shape, m, ns):
    lens, bs, hq, hkv = shape
    q, kp, vp, bt, seq, _, _ = _problem(lens, bs, hq=hq, hkv=hkv, m=m, seed=len(lens) + m)
    out = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs), num_splits=ns)
    assert out.path == "wspec_cert"
    ref = C.wspec_cert_reference(q, kp, vp, bt, seq, **_kw(bs))
    old = _old_gluon(q, kp, vp, bt, seq, bs)
    for f in FIELDS:
        got = getattr(out, f).double().cpu()
        assert torch.isfinite(got).all(), f
        torch.testing.assert_close(got, getattr(ref, f).double().cpu(), **TOL, msg=lambda s, f=f: f"{f} vs ref: {s}")
        # both kernels are within TOL of the reference (their own tests): within 2 TOL of each other
        torch.testing.assert_close(got, getattr(old, f).double().cpu(), atol=2 * TOL["atol"], rtol=2 * TOL["rtol"],
                                   msg=lambda s, f=f: f"{f} vs gluon: {s}")
    again = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs), num_splits=ns)
    assert torch.equal(out.o, again.o) and torch.equal(out.tv_bound, again.tv_bound)  # run to run


@gpu
@pytest.mark.parametrize("m", [0, 4])
def test_one_accumulator_and_certificate_off(m):
    lens, bs, hq, hkv = SHAPES[0]
    q, kp, vp, bt, seq, _, _ = _problem(lens, bs, hq=hq, hkv=hkv, m=m)
    ref = C.wspec_cert_reference(q, kp, vp, bt, seq, **_kw(bs))
    one = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs), cert_b=False)
    assert one.B is None
    for f in ("o", "lse", "A", "tv_bound_one"):
        torch.testing.assert_close(getattr(one, f).double().cpu(), getattr(ref, f).double().cpu(), **TOL)
    off = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs), cert=False)
    assert off.A is None and off.tv_bound is None
    full = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs))
    assert torch.equal(off.o, full.o) and torch.equal(off.lse, full.lse)  # the certificate does not touch o


@gpu
def test_certificate_is_the_same_whichever_way_the_row_is_split():
    q, kp, vp, bt, seq, _, _ = _problem([2000, 700], 16, hq=7, hkv=1, m=4)
    outs = [C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(16), num_splits=ns) for ns in (1, 2, 8, 32)]
    for o in outs[1:]:
        torch.testing.assert_close(o.tv_bound, outs[0].tv_bound, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(o.o, outs[0].o, atol=1e-5, rtol=1e-5)


@gpu
@pytest.mark.parametrize("m", [0, 4])
def test_certificate_bounds_the_true_tv_on_a_fixed_seed_batch(m):
    from _paged import slot_table
    from _soundness import assert_rows_within_certificate

    from kvlib.kernels.int8.reference import decode_reference

    q, kp, vp, bt, seq, tok, K = _problem([48, 130, 7], 16, hq=8, hkv=2, m=m)
    out = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(16), num_splits=2)
    _, probs = decode_reference(q, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="h10", block_table=bt,
                                block_size=16, return_probs=True)
    assert_rows_within_certificate(q, K, torch.cat(tok), slot_table(tok, DEV), seq, probs, out.tv_bound)


@gpu
def test_nonfinite_scale_gives_a_vacuous_certificate():
    q, kp, vp, bt, seq, tok, _ = _problem([60, 50], 16, hq=4, hkv=2)
    bad = kp.scales.clone()
    bad[int(tok[0][5]), 0, 1] = math.nan
    out = C.wspec_cert_decode(q, dataclasses.replace(kp, scales=bad), vp, bt, seq, **_kw(16), num_splits=2)
    assert torch.isinf(out.tv_bound[0, :2]).all() and out.vacuous[0, :2].all()
    assert torch.isfinite(out.tv_bound[1]).all()


@gpu
@pytest.mark.parametrize("cfg", [dict(block_n=32, ring=6), dict(block_n=64, ring=3),
                                 dict(block_n=128, ring=3, maxnreg=168, ctas_per_sm=1), dict(prmt=False),
                                 dict(pv="fold"), dict(pv="fold", block_n=128, ring=3, producer_regs=40),
                                 dict(pv="fold", block_n=128, ring=4, producer_regs=40, consumers=2, maxnreg=168,
                                      ctas_per_sm=1)])
@pytest.mark.parametrize("m", [0, 4])
def test_other_rings_match_the_reference(cfg, m):
    """Other tiles, rings and int8 conversions, and the ping-pong variant (two consumer warpgroups on alternate
    tiles, a state each): the same tolerances. The folded PV (``pv="fold"``) rounds
    ``1024 p`` and ``s_v c`` to fp16 (each <= 2^-11 relative), so its ``o`` is within ``2^-10 max |v|`` (+ fp32
    slack) of the exact one; its scores, softmax and certificate are the exact variant's."""
    lens, bs, hq, hkv = SHAPES[0]
    q, kp, vp, bt, seq, _, _ = _problem(lens, bs, hq=hq, hkv=hkv, m=m)
    ref = C.wspec_cert_reference(q, kp, vp, bt, seq, **_kw(bs))
    out = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs), config=C.WSpecCertConfig(**cfg))
    for f in FIELDS:
        tol = TOL
        if f == "o" and cfg.get("pv") == "fold":
            vmax = (vp.codes.double().abs() * vp.scales.double().repeat_interleave(32, -1)).max().item()
            tol = dict(atol=2.0**-10 * (1 + 2.0**-10) * vmax + TOL["atol"], rtol=0)
        torch.testing.assert_close(getattr(out, f).double().cpu(), getattr(ref, f).double().cpu(), **tol)


# ---- GPU: d = 64 (issue 40). (lens, block_size, hq, hkv): SmolLM2's 9 / 3 heads, GQA 7, 8 and 1, ragged rows
SHAPES_D64 = [
    ([1, 77, 300, 1000], 16, 9, 3),
    ([16, 300, 513], 16, 28, 4),
    ([5, 640, 1999], 64, 16, 2),
    ([70, 9, 33, 200], 32, 3, 3),
]


@gpu
@pytest.mark.parametrize("shape", SHAPES_D64, ids=["smollm2", "gqa7", "gqa8_bs64", "gqa1_bs32"])
@pytest.mark.parametrize("m", [0, 4])
@pytest.mark.parametrize("cfg", [{}, "dispatched", "pingpong"], ids=["exact", "dispatched", "pingpong"])
@pytest.mark.parametrize("ns", [None, 3])
def test_d64_matches_the_reference(shape, m, cfg, ns):
    """d = 64: ``o``, ``lse``, ``A``, ``B`` and the bounds against the float64 reference at the d = 128 kernel's
    tolerances, with the exact PV (the default config) and with the config the dispatcher launches (the folded PV:
    ``o`` within ``2^-10 (1 + 2^-10) max |v|``, as :func:`test_other_rings_match_the_reference`); run to run the
    same bits."""
    from kvlib.kernels.int8.decode import WSPEC_CERT_CONFIGS, WSPEC_CERT_PINGPONG_CONFIG

    lens, bs, hq, hkv = shape
    q, kp, vp, bt, seq, _, _ = _problem(lens, bs, hq=hq, hkv=hkv, m=m, seed=len(lens) + m, d=64)
    if cfg == "dispatched":
        cfg = WSPEC_CERT_CONFIGS["outliers" if m else "plain"]
    elif cfg == "pingpong":  # two consumer warpgroups (issue 40, opt-in): the folded PV's tolerance
        cfg = WSPEC_CERT_PINGPONG_CONFIG
    config = C.WSpecCertConfig(**cfg)
    out = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs), num_splits=ns, config=config)
    ref = C.wspec_cert_reference(q, kp, vp, bt, seq, **_kw(bs))
    for f in FIELDS:
        got = getattr(out, f).double().cpu()
        assert torch.isfinite(got).all(), f
        tol = TOL
        if f == "o" and config.pv == "fold":
            vmax = (vp.codes.double().abs() * vp.scales.double().repeat_interleave(32, -1)).max().item()
            tol = dict(atol=2.0**-10 * (1 + 2.0**-10) * vmax + TOL["atol"], rtol=0)
        torch.testing.assert_close(got, getattr(ref, f).double().cpu(), **tol, msg=lambda s, f=f: f"{f}: {s}")
    again = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs), num_splits=ns, config=config)
    assert torch.equal(out.o, again.o) and torch.equal(out.tv_bound, again.tv_bound)


@gpu
@pytest.mark.parametrize("m", [0, 4])
def test_d64_certificate_bounds_the_true_tv_on_a_fixed_seed_batch(m):
    from _paged import slot_table
    from _soundness import assert_rows_within_certificate

    from kvlib.kernels.int8.reference import decode_reference

    q, kp, vp, bt, seq, tok, K = _problem([48, 130, 7], 16, hq=9, hkv=3, m=m, d=64)
    out = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(16), num_splits=2)
    _, probs = decode_reference(q, kp, vp, None, seq, layer=LAYER, seed=SEED, kernel_rounding="h10", block_table=bt,
                                block_size=16, return_probs=True)
    assert_rows_within_certificate(q, K, torch.cat(tok), slot_table(tok, DEV), seq, probs, out.tv_bound)


@gpu
@pytest.mark.parametrize("m", [0, 4])
def test_d64_through_the_dispatcher_only_when_asked(m, monkeypatch):
    """``decode_int8(impl="wspec")`` runs the d = 64 kernel (``path``) and agrees with the reference; ``"auto"``
    answers as before (h8 keys at d = 64 in groups of 32: no Triton kernel, ValueError) until
    ``WSPEC_AUTO_HEAD_DIMS`` holds 64, and then takes the new kernel."""
    from kvlib.kernels.int8 import decode as DEC
    from kvlib.kernels.int8.decode import decode_int8

    lens, bs, hq, hkv = SHAPES_D64[0]
    q, kp, vp, bt, seq, _, _ = _problem(lens, bs, hq=hq, hkv=hkv, m=m, d=64)
    kw = dict(layer=LAYER, seed=SEED, block_table=bt, block_size=bs)
    asked = decode_int8(q, kp, vp, None, seq, impl="wspec", **kw)
    assert asked.path == "wspec_cert"
    ref = C.wspec_cert_reference(q, kp, vp, bt, seq, **_kw(bs))
    vmax = (vp.codes.double().abs() * vp.scales.double().repeat_interleave(32, -1)).max().item()
    torch.testing.assert_close(asked.o.double().cpu(), ref.o.double().cpu(), rtol=0,
                               atol=2.0**-10 * (1 + 2.0**-10) * vmax + TOL["atol"])
    torch.testing.assert_close(asked.tv_bound.double().cpu(), ref.tv_bound.double().cpu(), **TOL)
    with pytest.raises(ValueError, match="h10"):  # today's answer at this shape: no Triton kernel reads it
        decode_int8(q, kp, vp, None, seq, **kw)
    monkeypatch.setattr(DEC, "WSPEC_AUTO_HEAD_DIMS", (64, 128))
    assert decode_int8(q, kp, vp, None, seq, **kw).path == "wspec_cert"


@gpu
def test_pool_side_objects_are_accepted_as_the_gluon_kernel_reads_them():
    """PoolSide views of a (codes, scales) pool: the kernel reads the same memory (no copy) the Gluon kernel reads."""
    lens, bs, hq, hkv = SHAPES[3]
    q, kp, vp, bt, seq, _, _ = _problem(lens, bs, hq=hq, hkv=hkv)
    plain = PoolSide(kp.codes, kp.scales, group=32, dither_layout="h8", dithered=True)
    a = C.wspec_cert_decode(q, plain, vp, bt, seq, **_kw(bs))
    b = C.wspec_cert_decode(q, kp, vp, bt, seq, **_kw(bs))
    assert torch.equal(a.o, b.o) and torch.equal(a.tv_bound, b.tv_bound)


def test_gpu_script_parses_and_its_variants_are_valid_configs():
    """``dev/gpu/wspec_cert.sh`` runs once on the lead's device budget: its embedded Python must parse, and every timed
    variant must be a config the kernel accepts (a typo would cost the device call)."""
    import ast
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "dev" / "gpu" / "wspec_cert.sh").read_text()
    body = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF", text, re.S).group(1)
    tree = ast.parse(body)
    node = next(n for n in ast.walk(tree)
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "VARIANTS")
    variants = eval(compile(ast.Expression(node.value), "VARIANTS", "eval"), {"__builtins__": {}, "dict": dict})
    assert len(variants) >= 6
    for cfg, cert, m in variants.values():
        C.WSpecCertConfig(**cfg)
        assert isinstance(cert, bool) and m in (0, 4)
    assert "tests/test_wspec_cert.py" in text and '"$OUT/' in text
