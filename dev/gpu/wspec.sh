#!/usr/bin/env bash
# GPU check of the warp-specialised RTN INT8 decode (kvlib/kernels/int8/wspec.py, issue 28). For each variant
# (scales in registers or in the shared-memory ring, block_n, ring depth, swizzle) it compiles and checks against
# the float64 torch reference on shuffled ragged pages (GQA 7, 1 and 8; block_size 16 and 64; the planner's split
# count and 3 splits; max |o - ref|, max |lse - ref|), each variant in its own process, all in parallel (a hang or
# crash is that variant's FAIL, with its error text). Then it times every passing variant against the existing
# Gluon kernel (same pages, RTN keys, no certificate) and SDPA bf16 (dense K/V) at B=8 and B=32, S=16k (CUDA
# graphs, interleaved rounds, median) and prints ms, the ratios side by side and GB/s.
# Run from the repo root; < 4 min on the H200; writes $OUT/wspec.json (and one JSON per variant's check).
set -u
OUT="${OUT:-/tmp/wspec_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export WSPEC_OUT="$OUT"
SCRIPT="$(mktemp -d)/wspec_gpu.py"
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
DEV = "cuda"
HKV, D = 4, 128
# o: 1e-3 max(1, max |o_ref|): fp16 roundings of 1024 p s_v (or of 1024 p and s_v c) are <= 2^-11 relative per
# term, the keys' products are exact; lse: absolute
TOL_O_REL, TOL_LSE = 1e-3, 1e-3
CHECK_TIMEOUT_S = 110
VARIANTS = {  # every one compiles offline for sm_90 without spills at GQA 7 (kvlib.kernels.int8.wspec.compile_offline)
    "reg_bn64_r2": dict(block_n=64, ring=2, scales_smem=False, producer_regs=40),
    "smem_bn64_r3": dict(block_n=64, ring=3),
    "smem_bn64_r3_prmt": dict(block_n=64, ring=3, prmt=True),
    "smem_bn64_r3_prmt_vf": dict(block_n=64, ring=3, prmt=True, vfold=True),
    "smem_bn128_r2_prmt_vf": dict(block_n=128, ring=2, prmt=True, vfold=True),
    # swizzle 0 gave wrong results on the H200 (2026-12-01) and is now refused by WSpecConfig (dev/gpu/wspec2.sh
    # probes why)
}
CHECKS = [  # (name, B, hq, lens, block_size)
    ("gqa7_bs16", 4, 28, [1, 77, 1000, 2049], 16),
    ("gqa1_bs16", 3, 4, [16, 300, 513], 16),
    ("gqa8_bs64", 3, 32, [5, 640, 1999], 64),
]


def elapsed():
    return f"[{time.time() - T0:5.1f}s]"


def problem(B, hq, lens, bs, seed, extra_blocks=7):
    """Shuffled pages: every row's blocks are a random subset of the pool, in random order; the block table's rows
    padded to a multiple of 16 entries (as the timing shapes', so both share one binary)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    mb = max(math.ceil(L / bs) for L in lens)
    nb = B * mb + extra_blocks
    x_k = torch.randn(nb * bs, HKV, D, generator=g, device=DEV)
    x_v = torch.randn(nb * bs, HKV, D, generator=g, device=DEV)
    x_k[:, :, 5] *= 8.0  # one heavy channel: unequal group scales
    kc, ks = W.rtn_pages(x_k, bs)
    vc, vs = W.rtn_pages(x_v, bs)
    bt = torch.zeros(B, -(-mb // 16) * 16, dtype=torch.int32, device=DEV)
    bt[:, :mb] = torch.randperm(nb, generator=g, device=DEV)[: B * mb].view(B, mb).to(torch.int32)
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
            q, kc, ks, vc, vs, bt, seq = problem(B, hq, lens, bs, seed=100 + ci)
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
    with open(os.path.join(OUT, f"check_{vname}.json"), "w") as f:
        json.dump(rec, f, indent=1, default=str)


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
        o_s = torch.empty(B, 28, pl.num_splits, D, device=DEV)
        lse_s = torch.empty(B, 28, pl.num_splits, device=DEV)

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
    with open(os.path.join(OUT, "wspec.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def main():
    import triton

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tolerances": {"o_rel": TOL_O_REL, "lse": TOL_LSE}, "variants": {}, "timing": {}}
    print(f"device {res['device']}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    # every variant's checks in its own process, all at once: compiles run in parallel, a hang is one FAIL
    procs = {v: subprocess.Popen([sys.executable, __file__, "check", v], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for v in VARIANTS}
    for v, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(5, CHECK_TIMEOUT_S - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\nTIMEOUT after {CHECK_TIMEOUT_S}s (a hang: a barrier never completed?)"
        print(out, end="", flush=True)
        path = os.path.join(OUT, f"check_{v}.json")
        if os.path.exists(path):
            with open(path) as f:
                res["variants"][v] = json.load(f)
        else:
            res["variants"][v] = {"config": VARIANTS[v], "ok": False, "error": out[-4000:], "rc": p.returncode}
            print(f"{elapsed()} {v}: no result (rc {p.returncode})", flush=True)
    passing = [v for v, r in res["variants"].items() if r.get("ok")]
    print(f"{elapsed()} checks done; passing: {passing}", flush=True)
    save(res)  # a hang in the timing below still leaves the checks' results

    shapes = [(8, 16384), (32, 16384)]
    for B, S in shapes:
        key = f"B{B}_S{S}"
        if time.time() - T0 > 200:
            res["timing"][key] = {"skipped": "time budget"}
            print(f"{elapsed()} timing {key} skipped (time budget)", flush=True)
            continue
        try:
            res["timing"][key] = time_shape(B, S, passing)
            save(res)
        except Exception as e:  # noqa: BLE001
            res["timing"][key] = {"error": "".join(traceback.format_exception(e))[-3000:]}
            print(f"{elapsed()} timing {key}: ERROR\n{res['timing'][key]['error']}", flush=True)

    save(res)
    print("== wspec summary (PASS: agrees with the float64 reference on every check) ==")
    for v, rec in res["variants"].items():
        ratios = "  ".join(f"{k}: {t['median_ms']['sdpa_bf16'] / t['median_ms'][v]:.2f}x SDPA "
                           f"{t['median_ms']['old_gluon'] / t['median_ms'][v]:.2f}x old"
                           for k, t in res["timing"].items() if v in t.get("median_ms", {}))
        why = "" if rec.get("ok") else ("  (error: see above)" if "error" in rec else "  (wrong results)")
        print(f"{'PASS' if rec.get('ok') else 'FAIL'} {v:24s} {ratios}{why}")
    return 0 if passing else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "check":
        check_variant(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
PYEOF
timeout 235 "$PY" "$SCRIPT"
rc=$?
echo "wspec.sh exit $rc (0: at least one variant passed; JSON in $OUT/wspec.json)"
exit $rc
