"""The warp-specialised KV4 / KV4-RL paged decode (:mod:`kvlib.kernels.int4.wspec`).

On the CPU: its config and planner's argument validation, the split plan, its reference (the family's paged
reference, against the Triton paged kernel under the interpreter), the KV4-RL side state it launches (the existing
protected-region body, under the interpreter, against its reference), and (offline, no GPU) that it compiles for
sm_90 with Triton's own toolchain at several shapes, without spills, with INT8 and fp16 MMAs and TMA. On a GPU
(``dev/gpu/wspec_int4.sh``): agreement with the reference and with the Triton paged kernel (KV4 and KV4-RL, shuffled
pages holding NaN garbage outside the regions, ragged lengths, GQA 1/4/7/8, pages of 16/64/256, split counts, other
rings, d = 64), run-to-run and CUDA-graph bit-identity."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from kvlib.kernels.int4 import wspec as W
from kvlib.kernels.int4.attention import build_kv4_batch, side_buffer
from kvlib.kernels.int4.launch import SideBuffer
from kvlib.kernels.int4.query import prepare_query, prepare_query_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels run on a GPU only")
NAMES = ("k_codes", "k_scale", "k_off", "v_codes", "v_scale", "v_off")


def _close(a, b, atol):
    """The Triton KV4 tests' comparison (tests/test_kv4_kernels.py): the same non-finite entries, then max |a - b|."""
    a, b = a.double().cpu(), b.double().cpu()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    if fin.any():
        assert (a[fin] - b[fin]).abs().max().item() <= atol, (a[fin] - b[fin]).abs().max().item()


def _problem(lens, block_size, *, hq, hkv, d=128, rl=False, seed=0, dev=DEV, sink=4, recent=16):
    """A KV4 (or KV4-RL: ``rl``) batch moved into a pool as a block manager would: each request takes
    ``ceil(len / block_size)`` pages from a shuffled free list; slots past a request's length and spare pages hold
    garbage (random codes, NaN scales), unused table entries are -1. ``(q, pool dict, start, end, side)``."""
    g = torch.Generator().manual_seed(seed)
    b, n = len(lens), max(max(lens), 1)
    lengths = torch.tensor(lens)
    k, v = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    k[..., 5] *= 8.0  # a massive channel (rotated by the Hadamard before quantisation)
    c = build_kv4_batch(k, v, lengths, sink=sink, recent=recent) if rl else build_kv4_batch(k, v, lengths)
    need = [-(-x // block_size) for x in lens]
    nb, maxb = sum(need) + 3, max(need) + 1
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((b, maxb), -1, dtype=torch.int32)
    pool = {"k_codes": torch.randint(0, 256, (nb, block_size, hkv, d // 2), generator=g, dtype=torch.uint8),
            "v_codes": torch.randint(0, 256, (nb, block_size, hkv, d // 2), generator=g, dtype=torch.uint8)}
    for name in ("k_scale", "k_off", "v_scale", "v_off"):
        pool[name] = torch.full((nb, block_size, hkv), float("nan"), dtype=torch.float16)
    for r, x in enumerate(lens):
        for j in range(need[r]):
            page = perm.pop()
            table[r, j] = page
            lo, hi = j * block_size, min((j + 1) * block_size, x)
            for name, t in pool.items():
                t[page, : hi - lo] = getattr(c, name)[r, :, lo:hi].transpose(0, 1)
    pool = {k_: t.to(dev) for k_, t in pool.items()} | {"block_table": table.to(dev)}
    start, end = c.main_range() if rl else (torch.zeros_like(c.lengths), c.lengths)
    side = None
    if rl:
        side = SideBuffer(*(t.to(dev) for t in side_buffer(c)))
    q = (torch.randn(b, hq, d, generator=g) * 2).to(torch.bfloat16).to(dev)
    return q, pool, start.to(dev), end.to(dev), side


def _args(qp, pool, start, end):
    return (qp, *(pool[n] for n in NAMES), pool["block_table"], start, end)


# ---- CPU: validation
@pytest.mark.parametrize("kw, name", [
    ({"block_n": 48}, "block_n"), ({"block_n": 512}, "block_n"), ({"ring": 1}, "ring"), ({"ring": 9}, "ring"),
    ({"producer_regs": 20}, "producer_regs"), ({"maxnreg": 130}, "maxnreg"), ({"ctas_per_sm": 0}, "ctas_per_sm"),
    ({"block_p": 8}, "block_p"), ({"ring": 2.0}, "ring"), ({"pdl": 1}, "pdl"), ({"rows8": None}, "rows8"),
    ({"side_fused": 1}, "side_fused"), ({"side_cost": -1.0}, "side_cost"), ({"side_cost": True}, "side_cost"),
    ({"side_cost": float("nan")}, "side_cost"), ({"side_cost": "1"}, "side_cost"),
])
def test_config_names_the_bad_field(kw, name):
    with pytest.raises((ValueError, TypeError), match=name):
        W.WSpec4Config(**kw)


def _bad_cases():
    def put(name, fn):
        return lambda a, p, kw: p.__setitem__(name, fn(p[name]))

    def qp_(fn):
        return lambda a, p, kw: a.__setitem__(0, fn(a[0]))

    def kw_(**extra):
        return lambda a, p, kw: kw.update(extra)

    from kvlib.kernels.int4.query import QueryInt8

    return [
        (kw_(block_size=32), "block_size"),
        (kw_(block_size=16.0), "block_size"),
        (kw_(config={"block_n": 64}), "config"),
        (kw_(num_splits=0), "num_splits"),
        (kw_(num_splits=True), "num_splits"),
        (kw_(sm_scale=-1.0), "sm_scale"),
        (kw_(sm_scale=float("nan")), "sm_scale"),
        (kw_(side=(1, 2)), "side"),
        (put("k_codes", lambda t: t.view(torch.int8)), "k_codes"),
        (put("v_scale", lambda t: t.float()), "v_scale"),
        (put("k_off", lambda t: t[:, :, :1]), "k_off"),
        (put("block_table", lambda t: t.long()), "block_table"),
        (put("block_table", lambda t: t[:1]), "block_table"),
        (put("v_codes", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)), "v_codes"),
        (qp_(lambda qp: (qp.q8, qp.scale)), "qp"),
        (qp_(lambda qp: QueryInt8(torch.cat([qp.q8] * 3, 1), torch.cat([qp.scale] * 3, 1),
                                  torch.cat([qp.qsum] * 3, 1))), "at most 8"),  # GQA 12
        (qp_(lambda qp: QueryInt8(qp.q8, qp.scale.double(), qp.qsum)), "qp.scale"),
        (qp_(lambda qp: QueryInt8(qp.q8, qp.scale, qp.qsum[:, :1])), "qp.qsum"),
    ]


@pytest.mark.parametrize("mutate, name", _bad_cases())
def test_plan_names_the_bad_argument(mutate, name):
    q, pool, start, end, _ = _problem([5, 40], 16, hq=8, hkv=2, dev="cpu")
    qp = prepare_query_ref(q)
    pool = dict(pool)
    args = list(_args(qp, pool, start, end))
    kw = {"block_size": 16}
    mutate(args, pool, kw)
    args[1:8] = [pool[n] for n in NAMES] + [pool["block_table"]]
    with pytest.raises((ValueError, TypeError), match=name):
        W.plan(*args, **kw)


def test_plan_refuses_head_dims_and_pages_the_kernel_does_not_take():
    q, pool, start, end, _ = _problem([5, 40], 16, hq=4, hkv=2, d=32, dev="cpu")
    with pytest.raises(ValueError, match="head_dim"):
        W.plan(*_args(prepare_query_ref(q), pool, start, end), block_size=16)
    q, pool, start, end, _ = _problem([5, 40], 12, hq=4, hkv=2, dev="cpu")
    with pytest.raises(ValueError, match="block_size"):
        W.plan(*_args(prepare_query_ref(q), pool, start, end), block_size=12)


def test_plan_splits_take_one_wave():
    """One wave of 2 CTAs per SM over (B x H_kv) pairs, at most one split per 4 tiles of the table's capacity; the
    side region adds one state per pair; a given count is kept."""
    q, pool, start, end, side = _problem([5, 40], 16, hq=8, hkv=2, rl=True, dev="cpu")
    qp = prepare_query_ref(q)
    cfg = W.WSpec4Config()
    big = dict(pool, block_table=torch.zeros(2, 1024, dtype=torch.int32))
    pl = W.plan(*_args(qp, big, start, end), block_size=16, sms=132, side=side)
    assert pl.num_splits == min(132 * cfg.ctas_per_sm // 4, 1024 * 16 // (4 * 128)) == 32
    assert pl.states == 33 and pl.side_slots == side.k8.shape[2] and pl.box_rows == 16 and pl.gqa == 4
    small = W.plan(*_args(qp, pool, start, end), block_size=16, sms=132)
    assert small.num_splits == 1 and small.states == 1  # a 4-page table: under 4 tiles of 128
    assert W.plan(*_args(qp, pool, start, end), block_size=16, num_splits=5).num_splits == 5


def test_smem_fits_two_ctas_per_sm():
    cfg = W.WSpec4Config()
    assert cfg.smem_bytes() == 4 * (128 * 128 + 8 * 128 + 16)
    assert 2 * (cfg.smem_bytes() + 16 * 128 * 2 + 1024) < 227 * 1024  # + the P exchange's fp16 scratch


@pytest.mark.parametrize("fused", [False, True], ids=["kv4", "kv4rl_fused"])
def test_launch_refuses_cpu_tensors(fused):
    q, pool, start, end, side = _problem([5, 40], 16, hq=8, hkv=2, rl=fused, dev="cpu")
    with pytest.raises(ValueError, match="CUDA"):
        W.wspec4_stage1(*_args(prepare_query_ref(q), pool, start, end), block_size=16, side=side,
                        config=W.WSpec4Config(side_fused=fused))


def test_side_fused_plan_keeps_the_split_plan_and_checks_the_side_buffer():
    """The same-launch side region changes no split: the INT4 splits and the one side state of the two-launch path
    (the side state is written by one split's consumer into slot ``num_splits``); a bad side buffer is refused
    by name before any launch."""
    q, pool, start, end, side = _problem([5, 40], 16, hq=8, hkv=2, rl=True, dev="cpu")
    qp = prepare_query_ref(q)
    big = dict(pool, block_table=torch.zeros(2, 1024, dtype=torch.int32))
    for ns in (None, 3):
        two = W.plan(*_args(qp, big, start, end), block_size=16, sms=132, side=side, num_splits=ns)
        one = W.plan(*_args(qp, big, start, end), block_size=16, sms=132, side=side, num_splits=ns,
                     config=W.WSpec4Config(side_fused=True))
        assert one == two and one.states == one.num_splits + 1
    for bad, name in ((side._replace(k8_scale=side.k8_scale.float()), "k8_scale"),
                      (side._replace(v8=side.v8[:, :, :, :32]), "k8/v8"),
                      (side._replace(count=side.count[:1]), "count")):
        with pytest.raises((ValueError, TypeError), match=name):
            W.plan(*_args(qp, pool, start, end), block_size=16, side=bad, config=W.WSpec4Config(side_fused=True))


def test_same_launch_split_plan_partitions_the_tiles():
    """:func:`split_tiles` (the same-launch kernel's in-kernel split arithmetic, mirrored): the splits cover the
    region's tiles exactly once, in order; none takes more than ``cdiv(nblk + side_w, splits)``; split 0 (which runs
    the side region) takes ``side_w`` fewer where it can; ``side_w = 0`` is stage 1's plan. :func:`side_tiles` is
    ``ceil(slots * side_cost / block_n)``."""
    for nblk in (0, 1, 2, 5, 17, 128, 131):
        for ns in (1, 2, 3, 8, 32):
            for w in (0, 1, 3, 40):
                plan_ = W.split_tiles(nblk, ns, w)
                bps = -(-(nblk + w) // ns)
                assert len(plan_) == ns
                covered = [t for lo, n in plan_ for t in range(lo, lo + n)]
                assert covered == list(range(nblk)), (nblk, ns, w, plan_)
                assert all(n <= bps for _, n in plan_)
                assert plan_[0][1] == max(0, min(bps - w, nblk))
                if w == 0:  # stage 1's: split s from tile s * cdiv(nblk, ns) (an empty split's start is unused)
                    b0 = -(-nblk // ns)
                    want = [(s_ * b0, max(0, min(b0, nblk - s_ * b0))) for s_ in range(ns)]
                    assert [(lo if n else None, n) for lo, n in plan_] == [(lo if n else None, n) for lo, n in want]
    cfg = W.WSpec4Config(side_fused=True)
    assert W.side_tiles(cfg, 144) == 3 and W.side_tiles(cfg, 0) == 0  # ceil(144 * 8/3 / 128)
    assert W.side_tiles(W.WSpec4Config(side_fused=True, side_cost=0), 144) == 0
    assert W.side_tiles(W.WSpec4Config(side_fused=True, block_n=32), 20) == 2
    with pytest.raises(ValueError, match="side_slots"):
        W.side_tiles(cfg, -1)


# ---- CPU: the reference and the side state under the interpreter
@pytest.mark.skipif(DEV == "cuda", reason="the interpreter check (the GPU tests run the kernels themselves)")
@pytest.mark.parametrize("rl", [False, True], ids=["kv4", "kv4rl"])
def test_reference_is_the_family_reference_and_matches_the_triton_kernel(rl):
    """:func:`wspec4_reference` is :func:`kv4_paged_decode_ref` exactly, and the Triton paged kernel (under the
    interpreter) agrees with it to that kernel's own tolerances, on a pool with NaN garbage outside the regions."""
    from kvlib.kernels.int4.config import DEFAULT_CONFIG
    from kvlib.kernels.int4.paged import kv4_paged_decode, kv4_paged_decode_ref

    q, pool, start, end, side = _problem([37, 9], 16, hq=2, hkv=1, d=64, rl=rl, seed=3, sink=2, recent=8)
    qp = prepare_query(q, backend="triton")
    args = _args(qp, pool, start, end)
    ref = W.wspec4_reference(*args, block_size=16, side=side)
    fam = kv4_paged_decode_ref(*args, block_size=16, side=side)
    assert torch.equal(ref[0], fam[0]) and torch.equal(ref[1], fam[1])
    o, lse = kv4_paged_decode(*args, block_size=16, side=side, config=DEFAULT_CONFIG.replace(block_n=16, num_splits=2),
                              backend="triton")
    _close(lse, ref[1], 1e-4)
    _close(o, ref[0], 2e-2 if rl else 2e-3)
    assert torch.isfinite(ref[0]).all() and torch.isfinite(ref[1]).all()


@pytest.mark.skipif(DEV == "cuda", reason="the interpreter check (the GPU tests run the kernels themselves)")
def test_side_state_is_the_protected_region_in_its_slot():
    """The KV4-RL side state the launcher writes (the existing protected-region body through :func:`side_state`)
    lands in state ``split`` of the split buffers and equals the protected region's reference; other slots are
    untouched."""
    from kvlib.kernels.int4.protected import protected_decode_ref

    q, pool, start, end, side = _problem([37, 20, 3], 16, hq=6, hkv=2, d=64, rl=True, seed=5, sink=2, recent=8)
    qp = prepare_query(q, backend="triton")
    o_s = torch.full((3, 6, 4, 64), 7.0)
    lse_s = torch.full((3, 6, 4), 7.0)
    W.side_state(qp, side, o_s, lse_s, split=2)
    o_r, lse_r = protected_decode_ref(qp, *side)
    _close(lse_s[:, :, 2], lse_r, 1e-4)
    _close(o_s[:, :, 2], o_r, 2e-2)  # bf16 PV operands, as the fused launch's tolerance
    keep = torch.ones(4, dtype=torch.bool)
    keep[2] = False
    assert (o_s[:, :, keep] == 7.0).all() and (lse_s[:, :, keep] == 7.0).all()


# ---- CPU: offline sm_90 compilation
OFFLINE = [  # compile_offline keyword sets: GQA 7/1/8/4, pages 16/256/64/8, d 128/64, other tiles and rings
    {}, {"gqa": 1}, {"gqa": 8, "block_size": 256}, {"gqa": 4, "d": 64}, {"cfg": {"block_n": 64, "ring": 6}},
    {"cfg": {"block_n": 32, "ring": 8}, "block_size": 8},
    {"cfg": {"block_n": 256, "ring": 2, "maxnreg": 168, "ctas_per_sm": 1}, "block_size": 64},
    {"cfg": {"block_n": 128, "ring": 3, "maxnreg": 80, "producer_regs": 32, "ctas_per_sm": 3}},  # 3 CTAs per SM
    {"cfg": {"block_n": 64, "ring": 4, "maxnreg": 80, "producer_regs": 32, "ctas_per_sm": 3}, "gqa": 8},
    {"cfg": {"pdl": True}},
    {"cfg": {"rows8": True}}, {"cfg": {"rows8": True}, "gqa": 1, "d": 64},  # the 8-row softmax (Z8 selection)
    {"cfg": {"rows8": True, "block_n": 128, "ring": 3, "maxnreg": 80, "producer_regs": 32, "ctas_per_sm": 3},
     "gqa": 8, "block_size": 256},
    # KV4-RL with the side region in the same launch (_wspec4rl_stage1): the dispatch candidate, d = 64, three CTAs
    # per SM at 80 registers, GQA 1 with 64-slot side steps and PDL
    {"cfg": {"rows8": True, "side_fused": True}, "side": True},
    {"cfg": {"rows8": True, "side_fused": True, "block_n": 32, "ring": 8}, "gqa": 4, "d": 64, "block_size": 8,
     "side": True},
    {"cfg": {"rows8": True, "side_fused": True, "block_n": 128, "ring": 3, "maxnreg": 80, "producer_regs": 32,
             "ctas_per_sm": 3}, "gqa": 8, "block_size": 256, "side": True},
    {"cfg": {"side_fused": True, "block_p": 64, "pdl": True}, "gqa": 1, "side": True},
]


@pytest.mark.skipif(os.environ.get("KVLIB_SKIP_SASS") == "1", reason="offline compile disabled")
def test_compiles_for_sm90():
    """Each variant builds for sm_90 with Triton's own toolchain (the layouts of every shared-memory load, MMA
    operand and conversion accepted by the compiler), with IMMA (QK) and HMMA (PV) in the consumer, TMA in the
    producer, no spills, and one TMA copy per K and V box (``block_n / min(block_size, block_n)`` of each per tile,
    unrolled once in the loop); the same-launch KV4-RL variants (``side``) also hold the side region's bf16 PV MMA
    (``mma ... bf16.bf16.f32``), which the KV4 kernel never has."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's NVIDIA toolchain is not installed")
    prog = r"""
import json, os, re, subprocess, sys, tempfile
from kvlib.kernels.int4 import wspec as W
from kvlib.kernels.offline import tool as _tool
out = []
for kw in json.loads(sys.argv[1]):
    cfg = W.WSpec4Config(**kw.pop("cfg", {}))
    cc = W.compile_offline(cfg, **kw)
    with tempfile.TemporaryDirectory() as t:
        p = os.path.join(t, "k.cubin"); open(p, "wb").write(cc.asm["cubin"])
        use = subprocess.run([_tool("cuobjdump"), "-res-usage", p], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", p], capture_output=True, text=True).stdout
    res = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK)[:=](\d+)", use)}
    res["spill_ops"] = sass.count("STL") + sass.count("LDL")
    out.append(dict(kw=kw, bn=cfg.block_n, maxnreg=cfg.maxnreg, **res, imma=sass.count("IMMA"),
                    hmma=sass.count("HMMA"), tma=sass.count("UTMALDG"), ex2=sass.count("MUFU.EX2"),
                    bf16=cc.asm["ptx"].count("bf16.bf16.f32")))
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", prog, json.dumps(OFFLINE)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(recs) == len(OFFLINE)
    for rec in recs:
        assert rec["imma"] > 0 and rec["hmma"] > 0 and rec["ex2"] > 0, rec
        assert rec["spill_ops"] == 0 and rec.get("stack", 0) == 0, rec
        assert rec["reg"] <= rec["maxnreg"], rec
        boxes = rec["bn"] // min(rec["kw"].get("block_size", 16), rec["bn"])
        assert rec["tma"] == 2 * boxes, rec
        assert (rec["bf16"] > 0) == rec["kw"].get("side", False), rec


def test_gpu_script_parses_and_its_variants_are_valid_configs():
    """``dev/gpu/wspec_int4.sh`` runs once on the lead's device budget: its embedded Python must parse, and every
    timed variant must be a config the kernel accepts (a typo would cost the device call)."""
    import ast
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "dev" / "gpu" / "wspec_int4.sh").read_text()
    body = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF", text, re.S).group(1)
    tree = ast.parse(body)
    node = next(n for n in ast.walk(tree)
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "VARIANTS")
    variants = eval(compile(ast.Expression(node.value), "VARIANTS", "eval"), {"__builtins__": {}, "dict": dict})
    assert len(variants) >= 2
    for cfg in variants.values():
        W.WSpec4Config(**cfg)
    assert "tests/test_wspec_int4.py" in text and '"$OUT/' in text


# ---- GPU: the kernel against the reference and the Triton paged kernel
SHAPES = [  # (lens, block_size, hq, hkv): GQA 7, 1, 8, 4; ragged rows cut mid-tile and mid-page; one empty row
    ([1, 77, 300, 1000], 16, 28, 4),
    ([16, 300, 0, 513], 64, 4, 4),
    ([5, 640, 1999], 256, 32, 4),
    ([70, 9, 33, 200], 32, 8, 2),
]
SHAPE_IDS = ["gqa7_bs16", "gqa1_bs64", "gqa8_bs256", "gqa4_bs32"]


def _triton(args, bs, side):
    from kvlib.kernels.int4.paged import kv4_paged_decode

    return kv4_paged_decode(*args, block_size=bs, side=side, backend="triton")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("rl", [False, True], ids=["kv4", "kv4rl"])
@pytest.mark.parametrize("ns", [None, 1, 3, 7])
@pytest.mark.parametrize("rows8", [False, True], ids=["rows16", "rows8"])
def test_kernel_matches_the_reference_and_the_triton_kernel(shape, rl, ns, rows8):
    """The Triton paged kernel's tolerances against the reference (lse 1e-4; o 2e-3, 2e-2 with the side region's
    bf16 PV), and within twice those of the Triton kernel itself; an empty row gives ``o = 0``, ``lse = -inf``;
    two runs are bit-identical."""
    lens, bs, hq, hkv = shape
    q, pool, start, end, side = _problem(lens, bs, hq=hq, hkv=hkv, rl=rl, seed=len(lens) + rl)
    qp = prepare_query(q)
    args = _args(qp, pool, start, end)
    cfg = W.WSpec4Config(rows8=rows8)
    o, lse = W.wspec4_decode(*args, block_size=bs, side=side, num_splits=ns, config=cfg)
    o_r, lse_r = W.wspec4_reference(*args, block_size=bs, side=side)
    o_t, lse_t = _triton(args, bs, side)
    tol = 2e-2 if rl else 2e-3
    _close(lse, lse_r, 1e-4)
    _close(o, o_r, tol)
    _close(lse, lse_t, 2e-4)
    _close(o, o_t, 2 * tol)
    for r, n in enumerate(lens):
        if n == 0:
            assert torch.isneginf(lse[r]).all() and (o[r] == 0).all()
    o2, lse2 = W.wspec4_decode(*args, block_size=bs, side=side, num_splits=ns, config=cfg)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@gpu
@pytest.mark.parametrize("cfg", [dict(block_n=64, ring=6), dict(block_n=32, ring=8), dict(block_n=128, ring=2),
                                 dict(block_n=256, ring=2, maxnreg=168, ctas_per_sm=1), dict(producer_regs=40),
                                 dict(block_n=128, ring=3, maxnreg=80, producer_regs=32, ctas_per_sm=3),
                                 dict(block_n=64, ring=4, maxnreg=80, producer_regs=32, ctas_per_sm=3),
                                 dict(pdl=True), dict(rows8=True), dict(rows8=True, pdl=True),
                                 dict(block_n=128, ring=3, maxnreg=80, producer_regs=32, ctas_per_sm=3, rows8=True),
                                 dict(block_n=64, ring=6, rows8=True)])
@pytest.mark.parametrize("rl", [False, True], ids=["kv4", "kv4rl"])
def test_other_rings_match_the_reference(cfg, rl):
    lens, bs, hq, hkv = SHAPES[0]
    q, pool, start, end, side = _problem(lens, bs, hq=hq, hkv=hkv, rl=rl, seed=9)
    qp = prepare_query(q, pdl=cfg.get("pdl", False))
    args = _args(qp, pool, start, end)
    o, lse = W.wspec4_decode(*args, block_size=bs, side=side, config=W.WSpec4Config(**cfg))
    o_r, lse_r = W.wspec4_reference(*args, block_size=bs, side=side)
    _close(lse, lse_r, 1e-4)
    _close(o, o_r, 2e-2 if rl else 2e-3)


@gpu
@pytest.mark.parametrize("rl", [False, True], ids=["kv4", "kv4rl"])
@pytest.mark.parametrize("bs", [8, 16, 128])
@pytest.mark.parametrize("rows8", [False, True])
def test_head_dim_64(rl, bs, rows8):
    q, pool, start, end, side = _problem([300, 45, 1], bs, hq=8, hkv=2, d=64, rl=rl, seed=bs)
    qp = prepare_query(q)
    args = _args(qp, pool, start, end)
    o, lse = W.wspec4_decode(*args, block_size=bs, side=side, num_splits=3, config=W.WSpec4Config(rows8=rows8))
    o_r, lse_r = W.wspec4_reference(*args, block_size=bs, side=side)
    _close(lse, lse_r, 1e-4)
    _close(o, o_r, 2e-2 if rl else 2e-3)


@gpu
def test_split_counts_agree():
    """The same request split 1, 2, 8 and 32 ways (most of the 32 splits of the short row are empty): ``lse`` agrees
    to fp32 rounding; ``o`` to the fp16 rounding of ``p s_v``, whose reference max moves with the split (the Triton
    kernel's tolerance)."""
    q, pool, start, end, side = _problem([4000, 700], 16, hq=7, hkv=1, rl=True, seed=2)
    args = _args(prepare_query(q), pool, start, end)
    outs = [W.wspec4_decode(*args, block_size=16, side=side, num_splits=ns) for ns in (1, 2, 8, 32)]
    for o, lse in outs[1:]:
        torch.testing.assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5)
        _close(o, outs[0][0], 2e-3)


@gpu
@pytest.mark.parametrize("rl", [False, True], ids=["kv4", "kv4rl"])
def test_graph_replay_is_bit_identical(rl):
    """Prebuilt descriptors and buffers under a CUDA graph: the replay writes what the eager call returned."""
    from kvlib.bench.timing import capture_graph
    from kvlib.kernels.tl.merge import merge_splits

    lens, bs, hq, hkv = SHAPES[0]
    q, pool, start, end, side = _problem(lens, bs, hq=hq, hkv=hkv, rl=rl, seed=4)
    qp = prepare_query(q)
    args = _args(qp, pool, start, end)
    pl = W.plan(*args, block_size=bs, side=side)
    descs = W.descriptors(pool["k_codes"], pool["v_codes"], pl.box_rows)
    out = (torch.empty(pl.batch, pl.hq, pl.states, pl.d, device=DEV), torch.empty(pl.batch, pl.hq, pl.states,
                                                                                  device=DEV))

    def run():
        o_s, lse_s = W.wspec4_stage1(*args, block_size=bs, side=side, descs=descs, out=out)
        m = merge_splits(o_s, lse_s, pdl=True)
        return m.o, m.lse

    o, lse = run()
    graph, (og, lg) = capture_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, o) and torch.equal(lg, lse)


# ---- GPU: KV4-RL with the side region in the same launch (WSpec4Config.side_fused; issue 40). Opt-in
# (DISPATCH_CONFIG_RL is None) until these pass on a Hopper GPU: `pytest tests/test_wspec_int4.py -k side_fused`.
FUSED = W.WSpec4Config(rows8=True, side_fused=True)  # the dispatch candidate
SIDES = [  # (sink, recent): the chapter's side of 20; 2 slots; a region past a page (20 > 16); past a 128-tile
    # (130); a 128-slot side (four block_p steps); short rows are all side (an empty INT4 region)
    (4, 16), (1, 1), (20, 8), (130, 16), (4, 124),
]


def _fused_checks(args, bs, side, ns, cfg, *, states=True):
    """The same-launch path against the reference and the Triton paged kernel at the existing KV4-RL tolerances
    (lse 1e-4; o 2e-2 for the side region's bf16 PV; twice those against the Triton kernel), bit-identical on a
    rerun. With ``states``, stage 1's split states against the two-launch path's (``side_fused=False``, same
    split count):

    * the side state (slot ``num_splits``), to the fp32 summation order of ``l`` (the Triton and Gluon row sums
      add a step's ``block_p`` terms in different trees; the ``bf16(p)``, ``bf16(v)`` operands and the MMAs are
      the same: |d l| / l <= C 2^-24 <= 1e-5 for C <= 146 slots, so lse within 2e-5 and o, below 5, within 1e-4);
    * where the split plan is stage 1's (``side_cost = 0``; otherwise split 0 gives tiles to the side region) the
      INT4 states of the same consumer function, inlined in both kernels (offline, their loops hold the same
      FFMA/FMUL/FADD/MUFU/MMA counts: dev/results/wspec4rl_sass.json): ``lse`` bit for bit, ``o`` within 1e-5 (a
      different FMA contraction of the epilogue's ``(2^24 acc + sum p m_v) / l``, terms below 10, moves it by a
      few fp32 ulps of those terms)."""
    o, lse = W.wspec4_decode(*args, block_size=bs, side=side, num_splits=ns, config=cfg)
    o_r, lse_r = W.wspec4_reference(*args, block_size=bs, side=side)
    o_t, lse_t = _triton(args, bs, side)
    _close(lse, lse_r, 1e-4)
    _close(o, o_r, 2e-2)
    _close(lse, lse_t, 2e-4)
    _close(o, o_t, 4e-2)
    o2, lse2 = W.wspec4_decode(*args, block_size=bs, side=side, num_splits=ns, config=cfg)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    if states:
        pl = W.plan(*args, block_size=bs, side=side, num_splits=ns, config=cfg)
        f_o, f_l = W.wspec4_stage1(*args, block_size=bs, side=side, num_splits=pl.num_splits, config=cfg)
        two = dataclasses.replace(cfg, side_fused=False)
        t_o, t_l = W.wspec4_stage1(*args, block_size=bs, side=side, num_splits=pl.num_splits, config=two)
        k = pl.num_splits
        if W.side_tiles(cfg, pl.side_slots) == 0:
            assert torch.equal(f_l[:, :, :k], t_l[:, :, :k])
            _close(f_o[:, :, :k], t_o[:, :, :k], 1e-5)
        _close(f_l[:, :, k], t_l[:, :, k], 2e-5)
        _close(f_o[:, :, k], t_o[:, :, k], 1e-4)
    return o, lse


# the 16-row softmax with stage 1's split plan (side_cost 0: the INT4 states are compared with the two-launch
# path's), the dispatch candidate (8 rows, split 0 gives up tiles to the side region)
PLANS = [dict(rows8=False, side_cost=0), dict(rows8=True)]
PLAN_IDS = ["rows16_plain", "rows8_rebalanced"]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("ns", [None, 1, 3, 7])
@pytest.mark.parametrize("ckw", PLANS, ids=PLAN_IDS)
def test_side_fused_matches_the_reference_the_triton_kernel_and_the_two_launches(shape, ns, ckw):
    lens, bs, hq, hkv = shape
    q, pool, start, end, side = _problem(lens, bs, hq=hq, hkv=hkv, rl=True, seed=len(lens) + 1)
    o, lse = _fused_checks(_args(prepare_query(q), pool, start, end), bs, side, ns,
                           W.WSpec4Config(side_fused=True, **ckw))
    for r, n in enumerate(lens):
        if n == 0:
            assert torch.isneginf(lse[r]).all() and (o[r] == 0).all()


@gpu
@pytest.mark.parametrize("sink, recent", SIDES)
@pytest.mark.parametrize("bs", [16, 256])
@pytest.mark.parametrize("ckw", PLANS, ids=PLAN_IDS)
def test_side_fused_side_sizes_and_regions_past_the_sinks(sink, recent, bs, ckw):
    q, pool, start, end, side = _problem([1, 77, 300, 1000, 0], bs, hq=28, hkv=4, rl=True, seed=sink + recent,
                                         sink=sink, recent=recent)
    _fused_checks(_args(prepare_query(q), pool, start, end), bs, side, None, W.WSpec4Config(side_fused=True, **ckw))


@gpu
@pytest.mark.parametrize("bs", [8, 16, 128])
@pytest.mark.parametrize("ckw", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_side_fused_head_dim_64(bs, ckw, gqa):
    q, pool, start, end, side = _problem([300, 45, 1], bs, hq=2 * gqa, hkv=2, d=64, rl=True, seed=bs + gqa)
    _fused_checks(_args(prepare_query(q), pool, start, end), bs, side, 3, W.WSpec4Config(side_fused=True, **ckw))


@gpu
@pytest.mark.parametrize("cfg", [dict(block_n=64, ring=6), dict(block_n=32, ring=8), dict(block_n=128, ring=2),
                                 dict(block_n=256, ring=2, maxnreg=168, ctas_per_sm=1), dict(producer_regs=40),
                                 dict(block_n=128, ring=3, maxnreg=80, producer_regs=32, ctas_per_sm=3, rows8=True),
                                 dict(pdl=True, rows8=True), dict(block_p=16), dict(block_p=64, rows8=True),
                                 dict(rows8=True, side_cost=16.0), dict(rows8=True, side_cost=0)])
def test_side_fused_other_configs(cfg):
    lens, bs, hq, hkv = SHAPES[0]
    q, pool, start, end, side = _problem(lens, bs, hq=hq, hkv=hkv, rl=True, seed=9, sink=4, recent=124)
    qp = prepare_query(q, pdl=cfg.get("pdl", False))
    _fused_checks(_args(qp, pool, start, end), bs, side, None, W.WSpec4Config(side_fused=True, **cfg))


@gpu
def test_side_fused_split_counts_agree():
    """As :func:`test_split_counts_agree`: the INT4 tiles move between splits, split 0 giving up three to the side
    region (1, 2, 8, 32 splits, most of the 32 empty for the short row), the merged result does not."""
    q, pool, start, end, side = _problem([4000, 700], 16, hq=7, hkv=1, rl=True, seed=2)
    args = _args(prepare_query(q), pool, start, end)
    outs = [W.wspec4_decode(*args, block_size=16, side=side, num_splits=ns, config=FUSED) for ns in (1, 2, 8, 32)]
    for o, lse in outs[1:]:
        torch.testing.assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5)
        _close(o, outs[0][0], 2e-3)


@gpu
def test_side_fused_graph_replay_is_bit_identical():
    from kvlib.bench.timing import capture_graph
    from kvlib.kernels.tl.merge import merge_splits

    lens, bs, hq, hkv = SHAPES[0]
    q, pool, start, end, side = _problem(lens, bs, hq=hq, hkv=hkv, rl=True, seed=4)
    args = _args(prepare_query(q), pool, start, end)
    pl = W.plan(*args, block_size=bs, side=side, config=FUSED)
    descs = W.descriptors(pool["k_codes"], pool["v_codes"], pl.box_rows)
    out = (torch.empty(pl.batch, pl.hq, pl.states, pl.d, device=DEV), torch.empty(pl.batch, pl.hq, pl.states,
                                                                                  device=DEV))

    def run():
        o_s, lse_s = W.wspec4_stage1(*args, block_size=bs, side=side, descs=descs, out=out, config=FUSED)
        m = merge_splits(o_s, lse_s, pdl=True)
        return m.o, m.lse

    o, lse = run()
    graph, (og, lg) = capture_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, o) and torch.equal(lg, lse)


@gpu
def test_side_fused_dispatch_is_opt_in(monkeypatch):
    """``"auto"`` sends KV4-RL to the Triton paged kernel while :data:`DISPATCH_CONFIG_RL` is None (bit for bit its
    result), and to the same-launch kernel once it opts in (bit for bit :func:`wspec4_decode`'s result)."""
    from kvlib.kernels.int4.decode import kv4_paged_decode

    lens, bs, hq, hkv = SHAPES[0]
    q, pool, start, end, side = _problem(lens, bs, hq=hq, hkv=hkv, rl=True, seed=6)
    args = _args(prepare_query(q), pool, start, end)
    o_t, lse_t = _triton(args, bs, side)
    assert W.DISPATCH_CONFIG_RL is None
    o, lse = kv4_paged_decode(*args, block_size=bs, side=side)
    assert torch.equal(o, o_t) and torch.equal(lse, lse_t)
    monkeypatch.setattr(W, "DISPATCH_CONFIG_RL", {"rows8": True, "side_fused": True})
    o, lse = kv4_paged_decode(*args, block_size=bs, side=side)
    o_w, lse_w = W.wspec4_decode(*args, block_size=bs, side=side, config=FUSED)
    assert torch.equal(o, o_w) and torch.equal(lse, lse_w)
