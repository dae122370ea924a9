#!/usr/bin/env bash
# Ran at commit bb9b9f2 (dev/results/wspec2_timing.json). Its warp_tiles and lazy_rescale variants lost and their
# code is gone from the kernel (verdict in dev/results/README.md): run it from that commit to repeat it.
# Second GPU sweep of the warp-specialised RTN INT8 decode (kvlib/kernels/int8/wspec.py, issue 28). It attacks what
# bounds the first run's best variant (block_n 128, ring 2, prmt, folded value scales: 1.21-1.25x SDPA bf16):
#  - ring depth and tile size (block_n 128 with rings 2/3/4, block_n 256 with ring 2), one CTA per SM vs two
#    (maxnreg / shared memory), the planner's splits vs twice as many;
#  - warp_tiles: four one-warp consumers, each taking every fourth tile with its own softmax state (no cross-warp
#    max, P stays in its warp's registers: the two costs the first run's note named), with and without the lazy
#    rescale (rescale only when a head's max grows by > 2^5; exact: the final normalisation uses the max the terms
#    were scaled by); the lazy rescale also on the one-warpgroup consumer;
#  - prefetch: the producer gathers the next tile's scales while it waits for a free stage (the scale loads sat
#    between a stage's TMA issue and its ready arrival);
#  - a TMA probe of the swizzle-0 bug (the config now refuses swizzle 0): a [rows, 128] int8 box TMA-loaded into an
#    unswizzled and a 128-byte-swizzled NVMMA buffer, read back whole and as a column slice, compared with the source
#    and with the hypothesis that Triton's unswizzled layout is 8-row x 16-byte core matrices, column chunks outer.
# Correctness of every variant against the float64 torch reference in parallel processes (GQA 7/1/8, pages of
# 16/64, the planner's splits and 3 splits), then timing of the passing variants beside SDPA bf16 and the old Gluon
# kernel at B=8 and B=32, S=16k, and of the best two (by B=32) at B=64, S=32k (CUDA graphs, interleaved rounds,
# median). Every variant compiles offline for sm_90 without spills (kvlib.kernels.int8.wspec.compile_offline).
# Run from the repo root; < 120 s on the H200; writes $OUT/wspec2.json only.
set -u
OUT="${OUT:-/tmp/wspec2_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export WSPEC_OUT="$OUT"
export WSPEC_TMP="$(mktemp -d)"
SCRIPT="$WSPEC_TMP/wspec2_gpu.py"
cat > "$SCRIPT" <<'PYEOF'
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

from kvlib.kernels.int8 import wspec as W

T0 = time.time()
OUT = os.environ["WSPEC_OUT"]
TMP = os.environ["WSPEC_TMP"]  # the per-variant check files (only wspec2.json goes to $OUT)
DEV = "cuda"
HKV, D = 4, 128
# o: 1e-3 max(1, max |o_ref|): fp16 roundings of 1024 p s_v (or of 1024 p and s_v c) are <= 2^-11 relative per
# term, the keys' products are exact; lse: absolute
TOL_O_REL, TOL_LSE = 1e-3, 1e-3
CHECK_TIMEOUT_S = 70
TIMING_DEADLINE_S = 95  # no new timing shape after this (the lead's budget: < 120 s in all)
VARIANTS = {  # every one compiles offline for sm_90 without spills at GQA 7, 8 (pages of 64) and 1
    "bn128_r2": dict(block_n=128, ring=2, prmt=True, vfold=True),
    "bn128_r2_ns2x": dict(block_n=128, ring=2, prmt=True, vfold=True, ctas_per_sm=4),
    "bn128_r2_1cta": dict(block_n=128, ring=2, prmt=True, vfold=True, maxnreg=168, ctas_per_sm=1),
    "bn128_r2_lazy": dict(block_n=128, ring=2, prmt=True, vfold=True, lazy_rescale=True),
    "bn128_r2_pf": dict(block_n=128, ring=2, prmt=True, vfold=True, prefetch=True),
    "bn128_r3": dict(block_n=128, ring=3, prmt=True, vfold=True),
    "bn128_r3_pf": dict(block_n=128, ring=3, prmt=True, vfold=True, prefetch=True),
    "bn128_r4": dict(block_n=128, ring=4, prmt=True, vfold=True, ctas_per_sm=1),
    "bn128_r4_ns2x": dict(block_n=128, ring=4, prmt=True, vfold=True, ctas_per_sm=2),
    "bn256_r2": dict(block_n=256, ring=2, prmt=True, vfold=True, ctas_per_sm=1, maxnreg=168),
    "bn256_r2_ns2x": dict(block_n=256, ring=2, prmt=True, vfold=True, ctas_per_sm=2, maxnreg=168),
    # warp_tiles: 12 warps (Triton pads the partitions to warpgroups), so one CTA per SM at maxnreg 128-168
    "wt_bn32_r8": dict(block_n=32, ring=8, prmt=True, vfold=True, warp_tiles=True, producer_regs=40,
                       ctas_per_sm=1),
    "wt_bn32_r8_lazy": dict(block_n=32, ring=8, prmt=True, vfold=True, warp_tiles=True, lazy_rescale=True,
                            producer_regs=40, ctas_per_sm=1),
    "wt_bn32_r8_lazy_pf": dict(block_n=32, ring=8, prmt=True, vfold=True, warp_tiles=True, lazy_rescale=True,
                               producer_regs=40, ctas_per_sm=1, prefetch=True),
    "wt_bn32_r8_lazy_ns2x": dict(block_n=32, ring=8, prmt=True, vfold=True, warp_tiles=True, lazy_rescale=True,
                                 producer_regs=40, ctas_per_sm=2),
    "wt_bn64_r6_lazy": dict(block_n=64, ring=6, prmt=True, vfold=True, warp_tiles=True, lazy_rescale=True,
                            producer_regs=40, consumer_regs=200, maxnreg=168, ctas_per_sm=1),
}
CHECKS = [  # (name, B, hq, lens, block_size)
    ("gqa7_bs16", 4, 28, [1, 77, 1000, 2049], 16),
    ("gqa1_bs16", 3, 4, [16, 300, 513], 16),
    ("gqa8_bs64", 3, 32, [5, 640, 1999], 64),
    ("gqa4_ramp_bs16", 2, 16, [3000, 4097], 16),  # keys growing along the row: the running max keeps rising
]


def elapsed():
    return f"[{time.time() - T0:5.1f}s]"


def problem(B, hq, lens, bs, seed, extra_blocks=7, ramp=False):
    """Shuffled pages: every row's blocks are a random subset of the pool, in random order; the block table's rows
    padded to a multiple of 16 entries (as the timing shapes', so both share one binary)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    mb = max(math.ceil(L / bs) for L in lens)
    nb = B * mb + extra_blocks
    x_k = torch.randn(nb * bs, HKV, D, generator=g, device=DEV)
    x_v = torch.randn(nb * bs, HKV, D, generator=g, device=DEV)
    x_k[:, :, 5] *= 8.0  # one heavy channel: unequal group scales
    if ramp:  # pages in order (below), so slot order is position order and the scores grow along each row
        x_k *= torch.linspace(0.2, 3.0, nb * bs, device=DEV)[:, None, None]
    kc, ks = W.rtn_pages(x_k, bs)
    vc, vs = W.rtn_pages(x_v, bs)
    bt = torch.zeros(B, -(-mb // 16) * 16, dtype=torch.int32, device=DEV)
    perm = torch.arange(nb, device=DEV) if ramp else torch.randperm(nb, generator=g, device=DEV)
    bt[:, :mb] = perm[: B * mb].view(B, mb).to(torch.int32)
    q = (1.5 * torch.randn(B, hq, D, generator=g, device=DEV)).to(torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q, kc, ks, vc, vs, bt, seq


def old_decode(q, kc, ks, vc, vs, bt, seq):
    """The existing Gluon kernel (kvlib.kernels.int8.gluon) on the same pages: RTN keys, no certificate."""
    from kvlib.kernels.int8.decode import decode_int8
    from kvlib.kernels.int8.request import PoolSide

    nb, bs, h, d = kc.shape
    mk = lambda c, s: PoolSide(c.view(nb * bs, h, d), s.view(nb * bs, h, d // 32), group=32,  # noqa: E731
                               dither_layout="h8", dithered=False)
    out = decode_int8(q, mk(kc, ks), mk(vc, vs), None, seq, layer=0, seed=0, cert=False, impl="gluon",
                      block_table=bt, block_size=bs)
    assert out.path == "gluon", out.path
    return out.o, out.lse


def check_variant(vname):
    """One variant's correctness checks (run in its own process)."""
    cfg = W.WSpecConfig(**VARIANTS[vname])
    rec = {"config": dict(VARIANTS[vname]), "checks": {}, "ok": False}
    try:
        for ci, (cname, B, hq, lens, bs) in enumerate(CHECKS):
            q, kc, ks, vc, vs, bt, seq = problem(B, hq, lens, bs, seed=100 + ci, ramp="ramp" in cname)
            t = time.time()
            o, lse = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg)
            torch.cuda.synchronize()
            first = time.time() - t
            o3, lse3 = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg, num_splits=3)
            o2, _ = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg)  # run-to-run
            torch.cuda.synchronize()
            ro, rl = W.wspec_reference(q, kc, ks, vc, vs, bt, seq)
            err = lambda a, r: (a.double().cpu() - r).abs().max().item()  # noqa: E731
            c = {"err_o": err(o, ro), "err_lse": err(lse, rl), "err_o_ns3": err(o3, ro), "err_lse_ns3": err(lse3, rl),
                 "deterministic": bool(torch.equal(o, o2)), "first_call_s": first,
                 "num_splits": W.plan(q, kc, ks, vc, vs, bt, seq, config=cfg).num_splits,
                 "states_per_split": cfg.states_per_split,
                 "finite": bool(torch.isfinite(o).all() and torch.isfinite(o3).all())}
            if vname == next(iter(VARIANTS)) and bs == 16:
                c["old_gluon_err_o"] = err(old_decode(q, kc, ks, vc, vs, bt, seq)[0], ro)
            c["tol_o"] = TOL_O_REL * max(1.0, ro.abs().max().item())
            c["ok"] = (c["finite"] and c["deterministic"] and max(c["err_o"], c["err_o_ns3"]) <= c["tol_o"]
                       and max(c["err_lse"], c["err_lse_ns3"]) <= TOL_LSE)
            rec["checks"][cname] = c
            print(f"{elapsed()} {vname:24s} {cname:10s} err_o {c['err_o']:.2e} (ns=3 {c['err_o_ns3']:.2e}) err_lse "
                  f"{c['err_lse']:.2e} (ns=3 {c['err_lse_ns3']:.2e}) det {c['deterministic']} "
                  f"old_gluon_err_o {c.get('old_gluon_err_o', float('nan')):.2e} first {first:.1f}s -> "
                  f"(tol {c['tol_o']:.1e}) -> {'ok' if c['ok'] else 'BAD'}", flush=True)
        rec["ok"] = all(c["ok"] for c in rec["checks"].values())
        try:  # registers/spills of the binaries this process built (informative)
            rec["binaries"] = [{"n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}
                               for dev in W._wspec_stage1.device_caches.values() for k in dev[0].values()]
        except Exception as e:  # noqa: BLE001
            rec["binaries"] = repr(e)[:200]
    except Exception as e:  # noqa: BLE001 - the compile/run error is the result
        rec["error"] = "".join(traceback.format_exception(e))[-4000:]
        print(f"{elapsed()} {vname}: ERROR\n{rec['error']}", flush=True)
    with open(os.path.join(TMP, f"check_{vname}.json"), "w") as f:
        json.dump(rec, f, indent=1, default=str)


# ---- the swizzle-0 probe ----
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402


@gluon.jit
def _tma_probe(desc, OUT, OUT_S, ROWS: gl.constexpr, RBOX: gl.constexpr):
    """TMA ``ROWS // RBOX`` boxes of ``[RBOX, 128]`` int8 (rows 0..ROWS) into one buffer of the descriptor's layout,
    as the kernel fills a stage; read it back whole and as the column slice 32..64 (the kernel's group-1 operand)."""
    buf = gl.allocate_shared_memory(gl.int8, [ROWS, 128], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), ROWS * 128)
    for j in gl.static_range(ROWS // RBOX):
        tma.async_copy_global_to_shared(desc, [j * RBOX, 0], bar.index(0), buf.slice(j * RBOX, RBOX, dim=0))
    mbarrier.wait(bar.index(0), 0)
    L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
    gl.store(OUT + r[:, None] * 128 + c[None, :], buf.load(L))
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    r2 = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L2))
    c2 = gl.arange(0, 32, layout=gl.SliceLayout(0, L2))
    gl.store(OUT_S + r2[:, None] * 32 + c2[None, :], buf.slice(32, 32, dim=1).load(L2))


def tma_probe():
    """Which source element each read-back element is, for swizzle 0 and 128 (control), one box of 16 rows and
    four boxes of 16 rows (a stage of 64): two runs, the source holding its row index, then its column index."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rec = {}
    try:
        for sw in (0, 128):
            lay = gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=8, rank=2)
            for rows in (16, 64):
                got = {}
                for what in ("row", "col"):
                    rr, cc = torch.meshgrid(torch.arange(rows), torch.arange(128), indexing="ij")
                    src = (rr if what == "row" else cc).to(torch.int8).to(DEV).contiguous()
                    desc = TensorDescriptor(src, [rows, 128], [128, 1], [16, 128], lay)
                    out = torch.full((rows, 128), -1, dtype=torch.int8, device=DEV)
                    out_s = torch.full((rows, 32), -1, dtype=torch.int8, device=DEV)
                    _tma_probe[(1,)](desc, out, out_s, ROWS=rows, RBOX=16, num_warps=4)
                    torch.cuda.synchronize()
                    got[what] = (out.long().cpu(), out_s.long().cpu())
                rr, cc = torch.meshgrid(torch.arange(rows), torch.arange(128), indexing="ij")
                full_ok = bool(torch.equal(got["row"][0], rr) and torch.equal(got["col"][0], cc))
                slice_ok = bool(torch.equal(got["row"][1], rr[:, 32:64]) and torch.equal(got["col"][1], cc[:, 32:64]))
                # hypothesis: the reader takes (r, c) at byte (c // 16) * rows * 16 + r * 16 + c % 16 (8 x 16-byte
                # core matrices, column chunks outer) of a buffer the TMA wrote row-major
                off = (cc // 16) * rows * 16 + rr * 16 + cc % 16
                hyp = bool(torch.equal(got["row"][0], off // 128) and torch.equal(got["col"][0], off % 128))
                bad = (got["row"][0] != rr) | (got["col"][0] != cc)
                rec[f"sw{sw}_rows{rows}"] = {
                    "full_ok": full_ok, "slice_ok": slice_ok, "wrong_fraction": bad.float().mean().item(),
                    "core_matrix_hypothesis": hyp,
                    "read_of_row1_from": [[int(got["row"][0][1, c]), int(got["col"][0][1, c])]
                                          for c in range(0, 48, 8)],
                }
                print(f"{elapsed()} tma probe sw{sw} rows{rows}: {rec[f'sw{sw}_rows{rows}']}", flush=True)
    except Exception as e:  # noqa: BLE001
        rec["error"] = "".join(traceback.format_exception(e))[-3000:]
        print(f"{elapsed()} tma probe ERROR\n{rec['error']}", flush=True)
    with open(os.path.join(TMP, "tma_probe.json"), "w") as f:
        json.dump(rec, f, indent=1)


def capture(fn):
    from kvlib.bench.timing import capture_graph

    graph, _ = capture_graph(fn, warmup_iters=2)
    return graph


def time_graphs(graphs, rounds=15, reps=30):
    """Median ms per call of each graph: each round replays every graph ``reps`` times, the order rotated."""
    names = list(graphs)
    per = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graphs[n].replay()
            a.record()
            for _ in range(reps):
                graphs[n].replay()
            b.record()
            b.synchronize()
            per[n].append(a.elapsed_time(b) / reps)
    return {n: statistics.median(v) for n, v in per.items()}, per


def time_shape(B, S, passing):
    """Every passing variant, the old Gluon kernel and SDPA bf16 at B rows of S positions (28 / 4 heads)."""
    key = f"B{B}_S{S}"
    q, kc, ks, vc, vs, bt, seq = problem(B, 28, [S] * B, 16, seed=B, extra_blocks=64)
    graphs, outs, row = {}, {}, {"splits": {}}
    kd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
    vd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
    q4 = q.view(B, 28, 1, D)
    graphs["sdpa_bf16"] = capture(lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, kd, vd, enable_gqa=True))
    graphs["old_gluon"] = capture(lambda: outs.__setitem__("old_gluon",
                                                           old_decode(q, kc, ks, vc, vs, bt, seq)))
    for v in passing:
        cfg = W.WSpecConfig(**VARIANTS[v])
        pl = W.plan(q, kc, ks, vc, vs, bt, seq, config=cfg)
        descs = W.descriptors(kc, vc, pl.box_rows, cfg.swizzle)
        o_s = torch.empty(B, 28, pl.num_splits * cfg.states_per_split, D, device=DEV)
        lse_s = torch.empty(B, 28, pl.num_splits * cfg.states_per_split, device=DEV)

        def fn(cfg=cfg, descs=descs, o_s=o_s, lse_s=lse_s, v=v):
            outs[v] = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg, descs=descs, o_s=o_s,
                                     lse_s=lse_s)
        try:
            graphs[v] = capture(fn)
            row["splits"][v] = pl.num_splits
        except Exception as e:  # noqa: BLE001
            row.setdefault("errors", {})[v] = "".join(traceback.format_exception(e))[-2000:]
            print(f"{elapsed()} {key} {v}: capture failed\n{row['errors'][v]}", flush=True)
    med, per = time_graphs(graphs)
    torch.cuda.synchronize()
    row["median_ms"] = med
    row["rounds_ms"] = per
    kv_bytes = B * HKV * S * 2 * (D + 2 * D // 32)
    bf_bytes = B * HKV * S * 2 * D * 2
    row["GBps"] = {n: (bf_bytes if n == "sdpa_bf16" else kv_bytes) / (m * 1e-3) / 1e9 for n, m in med.items()}
    oo = outs["old_gluon"][0]
    row["max_abs_vs_old"] = {n: (o[0] - oo).abs().max().item() for n, o in outs.items() if n != "old_gluon"}
    print(f"{elapsed()} {key} (splits {row['splits']}):", flush=True)
    for n, m in med.items():
        print(f"   {n:24s} {m:8.4f} ms  {med['sdpa_bf16'] / m:5.2f}x SDPA  {med['old_gluon'] / m:5.2f}x old  "
              f"{row['GBps'][n]:6.0f} GB/s  max|o - old| {row['max_abs_vs_old'].get(n, float('nan')):.1e}",
              flush=True)
    return row


def save(res):
    res["wall_s"] = time.time() - T0
    with open(os.path.join(OUT, "wspec2.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def main():
    import triton

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tolerances": {"o_rel": TOL_O_REL, "lse": TOL_LSE}, "variants": {}, "timing": {}}
    print(f"device {res['device']}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    # every variant's checks in its own process, all at once: compiles run in parallel, a hang is one FAIL
    procs = {v: subprocess.Popen([sys.executable, __file__, "check", v], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for v in VARIANTS}
    probe = subprocess.Popen([sys.executable, __file__, "probe", "-"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    for v, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(5, CHECK_TIMEOUT_S - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\nTIMEOUT after {CHECK_TIMEOUT_S}s (a hang: a barrier never completed?)"
        print(out, end="", flush=True)
        path = os.path.join(TMP, f"check_{v}.json")
        if os.path.exists(path):
            with open(path) as f:
                res["variants"][v] = json.load(f)
        else:
            res["variants"][v] = {"config": VARIANTS[v], "ok": False, "error": out[-4000:], "rc": p.returncode}
            print(f"{elapsed()} {v}: no result (rc {p.returncode})", flush=True)
    passing = [v for v, r in res["variants"].items() if r.get("ok")]
    print(f"{elapsed()} checks done; passing: {passing}", flush=True)
    save(res)  # a hang in the timing below still leaves the checks' results

    def timed(B, S, names):
        key = f"B{B}_S{S}"
        if time.time() - T0 > TIMING_DEADLINE_S:
            res["timing"][key] = {"skipped": "time budget"}
            print(f"{elapsed()} timing {key} skipped (time budget)", flush=True)
            return
        try:
            res["timing"][key] = time_shape(B, S, names)
            save(res)
        except Exception as e:  # noqa: BLE001
            res["timing"][key] = {"error": "".join(traceback.format_exception(e))[-3000:]}
            print(f"{elapsed()} timing {key}: ERROR\n{res['timing'][key]['error']}", flush=True)

    timed(8, 16384, passing)
    timed(32, 16384, passing)
    t32 = res["timing"].get("B32_S16384", {}).get("median_ms", {})
    best = sorted((v for v in passing if v in t32), key=t32.get)[:2]
    res["best2_by_B32"] = best
    if best:
        timed(64, 32768, best)
    if probe is not None:
        try:
            out, _ = probe.communicate(timeout=max(5, CHECK_TIMEOUT_S - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            probe.kill()
            out, _ = probe.communicate()
        print(out, end="", flush=True)
        path = os.path.join(TMP, "tma_probe.json")
        res["swizzle0_probe"] = json.load(open(path)) if os.path.exists(path) else {"error": out[-3000:]}

    save(res)
    print("== wspec2 summary (PASS: agrees with the float64 reference on every check) ==")
    for v, rec in res["variants"].items():
        ratios = "  ".join(f"{k}: {t['median_ms']['sdpa_bf16'] / t['median_ms'][v]:.2f}x SDPA "
                           f"{t['median_ms']['old_gluon'] / t['median_ms'][v]:.2f}x old"
                           for k, t in res["timing"].items() if v in t.get("median_ms", {}))
        why = "" if rec.get("ok") else ("  (error: see above)" if "error" in rec else "  (wrong results)")
        print(f"{'PASS' if rec.get('ok') else 'FAIL'} {v:24s} {ratios}{why}")
    print(f"best two by B=32 (timed at B=64, S=32k): {res.get('best2_by_B32')}")
    for k, r in res.get("swizzle0_probe", {}).items():
        print(f"tma probe {k}: {r}")
    print(f"wall {time.time() - T0:.1f}s")
    return 0 if passing else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "check":
        check_variant(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "probe":
        tma_probe()
        sys.exit(0)
    sys.exit(main())
PYEOF
timeout 115 "$PY" "$SCRIPT"
rc=$?
echo "wspec2.sh exit $rc (0: at least one variant passed; JSON in $OUT/wspec2.json)"
exit $rc
