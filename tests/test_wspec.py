"""The warp-specialised RTN INT8 decode (:mod:`kvlib.kernels.int8.wspec`) on the CPU: its launch planner's argument
validation, its float64 reference against the INT8 family's reference, and (offline, no GPU) that it compiles for
sm_90 without spills, at d = 128 and 64. On a GPU (the ``make test-gpu`` lane): the kernel against its float64
reference at d = 128 and at d = 64 (SmolLM2's 9 query / 3 KV heads and others), default and dispatched configs
(``dev/gpu/wspec.sh`` timed and checked the d = 128 variants)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvlib.kernels.int8 import wspec as W

HKV, D = 4, 128
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
gpu = pytest.mark.skipif(not HOPPER, reason="the warp-specialised kernels need a Hopper (sm_90) GPU")


def _problem(B=2, hq=8, lens=(5, 40), bs=16, seed=0, extra=3, d=D, hkv=HKV, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    mb = max(-(-L // bs) for L in lens)
    nb = B * mb + extra
    kc, ks = W.rtn_pages(torch.randn(nb * bs, hkv, d, generator=g), bs)
    vc, vs = W.rtn_pages(torch.randn(nb * bs, hkv, d, generator=g), bs)
    bt = torch.randperm(nb, generator=g)[: B * mb].view(B, mb).to(torch.int32)
    q = torch.randn(B, hq, d, generator=g).to(torch.bfloat16)
    out = q, kc, ks, vc, vs, bt, torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(dev) for t in out)


def test_rtn_pages_round_trip_within_half_a_step():
    x = torch.randn(32, HKV, D)
    c, s = W.rtn_pages(x, 16)
    assert c.shape == (2, 16, HKV, D) and s.shape == (2, 16, HKV, D // 32) and c.dtype == torch.int8
    back = c.reshape(32, HKV, D).float() * s.reshape(32, HKV, D // 32).float().repeat_interleave(32, -1)
    step = s.reshape(32, HKV, D // 32).float().repeat_interleave(32, -1)
    assert ((back - x).abs() <= 0.5 * step * (1 + 1e-3) + 1e-6).all()


@pytest.mark.parametrize("d", [128, 64])
def test_reference_matches_the_int8_family_reference(d):
    """The same pages read through :func:`kvlib.kernels.int8.reference.decode_reference` (RTN keys and values,
    block-table addressing) give the same output and log-sum-exp, at d = 128 and 64."""
    from kvlib.kernels.int8.reference import decode_reference
    from kvlib.kernels.int8.request import PoolSide

    q, kc, ks, vc, vs, bt, seq = _problem(B=3, hq=28, lens=(1, 17, 70), d=d)
    o, lse = W.wspec_reference(q, kc, ks, vc, vs, bt, seq)
    nb, bs = kc.shape[:2]
    side = lambda c, s: PoolSide(c.view(nb * bs, HKV, d), s.view(nb * bs, HKV, d // 32), group=32,  # noqa: E731
                                 dither_layout="h8", dithered=False)
    # (d = 64, groups of 32: a shape only the torch reference's fma rounding names; RTN o and lse do not depend on it)
    ref = decode_reference(q, side(kc, ks), side(vc, vs), None, seq, layer=0, seed=0, block_table=bt, block_size=bs,
                           impl="auto" if d == 128 else "fma")
    torch.testing.assert_close(o, ref.o.double(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref.lse.double(), atol=1e-10, rtol=1e-10)


def test_plan_splits_and_box_rows():
    q, kc, ks, vc, vs, bt, seq = _problem(B=2, hq=28, lens=(5, 40))
    p = W.plan(q, kc, ks, vc, vs, bt, seq, sms=132)
    assert (p.gqa, p.block_size, p.box_rows) == (7, 16, 16)
    assert p.num_splits == 1  # max_len 48 < 4 tiles of 64
    big = torch.zeros(2, 1024, dtype=torch.int32)
    p = W.plan(q, kc, ks, vc, vs, big, seq, sms=132)
    assert p.num_splits == 33  # 132 * 2 // 8 CTAs per (row, head), under 16384 / 256
    q32 = torch.zeros(32, 28, D, dtype=torch.bfloat16)
    p = W.plan(q32, kc, ks, vc, vs, torch.zeros(32, 1024, dtype=torch.int32), torch.ones(32, dtype=torch.int32),
               sms=132)
    assert p.num_splits == 2  # one wave of 256 CTAs on 264 slots, not 3 splits and a second wave
    assert W.plan(q, kc, ks, vc, vs, bt, seq, num_splits=5).num_splits == 5
    q64 = _problem(B=1, hq=4, lens=(64,), bs=64)
    assert W.plan(*q64, config=W.WSpecConfig(block_n=32)).box_rows == 32


@pytest.mark.parametrize("mutate, name", [
    (lambda a: a.__setitem__(0, a[0].float()), "q"),
    (lambda a: a.__setitem__(0, a[0][..., :64]), "q"),
    (lambda a: a.__setitem__(0, a[0][:, :7]), "q"),
    (lambda a: a.__setitem__(1, a[1].to(torch.int16)), "k_codes"),
    (lambda a: a.__setitem__(3, a[3][:, :8]), "v_codes"),
    (lambda a: a.__setitem__(2, a[2][..., :2]), "k_scales"),
    (lambda a: a.__setitem__(4, a[4].float()), "v_scales"),
    (lambda a: a.__setitem__(5, a[5].long()), "block_table"),
    (lambda a: a.__setitem__(5, a[5][:1]), "block_table"),
    (lambda a: a.__setitem__(6, a[6][:1]), "seq_lens"),
])
def test_plan_names_the_bad_argument(mutate, name):
    args = list(_problem(B=2, hq=8, lens=(5, 40)))
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=name):
        W.plan(*args)


def test_plan_takes_d64_and_names_other_head_dims():
    """d = 64 (SmolLM2: 9 query / 3 KV heads) plans; 96 and 32 are refused naming the head dim; at d = 64 the scales
    must be two groups per head."""
    q, kc, ks, vc, vs, bt, seq = _problem(B=2, hq=9, hkv=3, lens=(5, 40), d=64)
    p = W.plan(q, kc, ks, vc, vs, bt, seq)
    assert (p.d, p.gqa, p.hkv) == (64, 3, 3) and ks.shape[-1] == 2
    for d in (96, 32):
        args = _problem(B=2, hq=8, lens=(5, 40), d=d)
        with pytest.raises(ValueError, match="head_dim"):
            W.plan(*args)
    with pytest.raises(ValueError, match="k_scales"):
        W.plan(q, kc, ks.repeat(1, 1, 1, 2), vc, vs, bt, seq)
    with pytest.raises(ValueError, match="d must be"):
        W.compile_offline(d=96)


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("rows", [8, 16, 64])
def test_ring_layout_is_tritons_default_for_the_row(d, rows):
    """The ring's (and the TMA box's) shared layout is what Triton picks for ``[rows, d]`` int8 boxes: 128-byte
    swizzling for 128-byte rows, 64-byte for d = 64's rows (the swizzle span a row fills)."""
    from triton.experimental.gluon import language as gl

    assert W.smem_layout(rows, d) == gl.NVMMASharedLayout.get_default_for([rows, d], gl.int8)
    assert W.smem_layout(rows, d).swizzle_byte_width == d


def test_plan_rejects_gqa_above_8_and_bad_splits():
    q, kc, ks, vc, vs, bt, seq = _problem(B=2, hq=36, lens=(5, 40))
    with pytest.raises(ValueError, match="at most 8"):
        W.plan(q, kc, ks, vc, vs, bt, seq)
    q = q[:, :8]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_splits"):
            W.plan(q, kc, ks, vc, vs, bt, seq, num_splits=bad)
    with pytest.raises(TypeError, match="config"):
        W.plan(q, kc, ks, vc, vs, bt, seq, config={"block_n": 64})


@pytest.mark.parametrize("kw, name", [
    ({"block_n": 48}, "block_n"), ({"ring": 1}, "ring"), ({"consumer_warps": 8}, "consumer_warps"),
    ({"producer_regs": 20}, "producer_regs"), ({"maxnreg": 130}, "maxnreg"), ({"ctas_per_sm": 0}, "ctas_per_sm"),
    ({"swizzle": 16}, "swizzle"), ({"swizzle": 0}, "swizzle"), ({"vfold": True, "scales_smem": False}, "vfold"),
    ({"block_n": 16}, "block_n"), ({"ring": 9}, "ring"), ({"prefetch": True, "scales_smem": False}, "prefetch"),
    ({"consumers": 3}, "consumers"), ({"consumers": 0}, "consumers"), ({"consumers": True}, "consumers"),
    ({"consumers": 2, "scales_smem": False}, "consumers"), ({"consumer_regs": 100}, "consumer_regs"),
    ({"consumers": 2, "ring": 3}, "even ring"),
])
def test_config_names_the_bad_field(kw, name):
    with pytest.raises(ValueError, match=name):
        W.WSpecConfig(**kw)


def test_pingpong_writes_two_states_per_split():
    """The ping-pong config (two consumer warpgroups) is valid, writes one split state per warpgroup (the merge
    combines them), and is not what the dispatcher launches."""
    from kvlib.kernels.int8.decode import WSPEC_RTN_CONFIG, WSPEC_RTN_PINGPONG_CONFIG

    pp = W.WSpecConfig(**WSPEC_RTN_PINGPONG_CONFIG)
    assert pp.consumers == 2 and pp.states(5) == 10 and W.WSpecConfig().states(5) == 5
    assert W.WSpecConfig(**WSPEC_RTN_CONFIG).consumers == 1


def test_shared_memory():
    """The ring's bytes are the codes of both sides, the scales and the barriers."""
    assert W.WSpecConfig(block_n=32, ring=8, prmt=True, vfold=True).smem_bytes() == 8 * (2 * 32 * 128 + 16 * 32 + 16)
    assert W.WSpecConfig(block_n=128, ring=3).smem_bytes() == 104496  # two CTAs fit 228 KB; ring 4 (139328) one


def test_launch_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA"):
        W.wspec_stage1(*_problem())


@pytest.mark.skipif(os.environ.get("KVLIB_SKIP_SASS") == "1", reason="offline compile disabled")
def test_compiles_for_sm90_without_spills():
    """The default variant (also GQA 8 over 64-slot pages), the dispatcher's (prefetching, prmt, value fold) and the
    ping-pong one (two consumer warpgroups), at d = 128 and at d = 64 (SmolLM2's GQA 3), build for sm_90 with
    Triton's own toolchain: a producer partition issuing TMA copies, HMMA in the consumers, no local-memory spills."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's NVIDIA toolchain is not installed")
    prog = r"""
import json, os, re, subprocess, tempfile
from kvlib.kernels.int8 import wspec as W
from kvlib.kernels.offline import tool as _tool
out = []
from kvlib.kernels.int8.decode import WSPEC_RTN_CONFIG
from kvlib.kernels.int8.decode import WSPEC_RTN_PINGPONG_CONFIG as PP
for kw in ({}, {"gqa": 8, "block_size": 64}, {"config": W.WSpecConfig(**WSPEC_RTN_CONFIG)}, {"d": 64},
           {"config": W.WSpecConfig(**WSPEC_RTN_CONFIG), "d": 64, "gqa": 3}, {"config": W.WSpecConfig(**PP)},
           {"config": W.WSpecConfig(**PP), "d": 64, "gqa": 3}):
    cc = W.compile_offline(**kw)
    with tempfile.TemporaryDirectory() as t:
        p = os.path.join(t, "k.cubin"); open(p, "wb").write(cc.asm["cubin"])
        use = subprocess.run([_tool("cuobjdump"), "-res-usage", p], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", p], capture_output=True, text=True).stdout
    r = dict(re.findall(r"(STACK|LOCAL):(\d+)", use))
    out.append({"stack": int(r["STACK"]), "hmma": len(re.findall(r"\bHMMA\b", sass)),
                "tma": len(re.findall(r"\bUTMALDG\b", sass)), "shared": cc.metadata.shared, "d": kw.get("d", 128)})
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=600,
                          check=True)
    import json

    for r in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert r["stack"] == 0 and r["hmma"] > 0 and r["tma"] > 0
        assert r["shared"] >= W.WSpecConfig().smem_bytes(r["d"]) - 16 * W.WSpecConfig().ring


# ---- GPU: the kernel against its float64 reference
# (lens, block_size, hq, hkv, d): SmolLM2 (9 / 3 heads, d 64), GQA 7 / 8 / 1 at d 64 and the benchmarks' d 128; ragged
# rows cut mid-tile and mid-page, pages of 16-64 slots
GPU_SHAPES = [
    ([1, 77, 300, 1000], 16, 9, 3, 64),
    ([16, 300, 513], 16, 28, 4, 64),
    ([5, 640, 1999], 64, 16, 2, 64),
    ([70, 9, 33, 200], 32, 3, 3, 64),
    ([1, 77, 300, 1000], 16, 28, 4, 128),
    ([70, 9, 33, 200], 32, 9, 3, 128),
]


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["smollm2", "gqa7_d64", "gqa8_bs64_d64", "gqa1_bs32_d64",
                                                    "gqa7_d128", "gqa3_bs32_d128"])
@pytest.mark.parametrize("variant", ["default", "dispatched", "pingpong"])
@pytest.mark.parametrize("ns", [None, 3])
def test_kernel_matches_the_reference(shape, variant, ns):
    """``o`` and ``lse`` against :func:`wspec_reference` (float64). The scores are exact fp16 x int8 products summed
    in fp32 (the certified kernel's tolerance ``atol 2e-5, rtol 1e-4`` on ``lse``); PV rounds ``1024 p s_v`` to fp16
    once (``<= 2^-11`` relative, so ``|o - ref| <= 2^-11 max |v|``), the dispatched ``vfold`` rounds ``1024 p`` and
    ``s_v c`` (``<= 2^-10 (1 + 2^-10) max |v|``), as does the ping-pong variant (two consumer warpgroups, each its
    own online softmax over alternate tiles, merged as splits); plus the fp32 slack of the certified kernel's
    tolerance. Run to run the same bits."""
    from kvlib.kernels.int8.decode import WSPEC_RTN_CONFIG, WSPEC_RTN_PINGPONG_CONFIG

    lens, bs, hq, hkv, d = shape
    q, kc, ks, vc, vs, bt, seq = _problem(B=len(lens), hq=hq, hkv=hkv, lens=lens, bs=bs, d=d, seed=len(lens) + d,
                                          dev="cuda")
    dispatched = variant != "default"
    cfg = W.WSpecConfig(**{"default": {}, "dispatched": WSPEC_RTN_CONFIG,
                           "pingpong": WSPEC_RTN_PINGPONG_CONFIG}[variant])
    o, lse = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg, num_splits=ns)
    ro, rl = W.wspec_reference(q, kc, ks, vc, vs, bt, seq)
    vmax = (vc.double().abs() * vs.double().repeat_interleave(32, -1)).max().item()
    rel = 2.0**-10 * (1 + 2.0**-10) if dispatched else 2.0**-11
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double().cpu(), ro, atol=rel * vmax + 2e-5, rtol=0)
    torch.testing.assert_close(lse.double().cpu(), rl, atol=2e-5, rtol=1e-4)
    o2, _ = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg, num_splits=ns)
    assert torch.equal(o, o2)
