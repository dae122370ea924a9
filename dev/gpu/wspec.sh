#!/usr/bin/env bash
# GPU check of the warp-specialised RTN INT8 decode (kvlib/kernels/int8/wspec.py, issue 28): for each variant
# (block_n, ring depth, maxnreg) it compiles, checks against the float64 torch reference on shuffled ragged pages
# (GQA 7, 1 and 8; block_size 16 and 64; max |o - ref|, max |lse - ref|), then times it against the existing Gluon
# kernel (RTN keys, no certificate) and SDPA bf16 at B=8 and B=32, S=16k (CUDA graphs, interleaved rounds,
# median) and prints the ratios side by side. A variant that fails prints its error text (compile or run).
# Run from the repo root; < 4 min on the H200; writes $OUT/wspec.json; prints PASS/FAIL per variant.
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
import sys
import time
import traceback

import torch

from kvlib.kernels.int8 import wspec as W

T0 = time.time()
OUT = os.environ["WSPEC_OUT"]
DEV = "cuda"
HKV, D = 4, 128
TOL_O, TOL_LSE = 2e-3, 1e-3  # fp16(1024 p s_v) rounding: |err| <= 2^-11 |v| per term; keys exact in the MMA
VARIANTS = {  # all four compile offline for sm_90 without spills (kvlib.kernels.int8.wspec.compile_offline)
    "bn32_r4": W.WSpecConfig(block_n=32, ring=4, maxnreg=128),
    "bn64_r2": W.WSpecConfig(block_n=64, ring=2, maxnreg=128),
    "bn64_r3_168": W.WSpecConfig(block_n=64, ring=3, maxnreg=168, ctas_per_sm=1),  # 168 x 256 threads: 1 CTA/SM
    "bn64_r2_cps4": W.WSpecConfig(block_n=64, ring=2, maxnreg=128, ctas_per_sm=4),  # twice the splits
}
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}, "timing": {}}
import triton  # noqa: E402

res["triton"] = triton.__version__
print(f"device {res['device']}  torch {torch.__version__}  triton {triton.__version__}", flush=True)


def elapsed():
    return f"[{time.time() - T0:5.1f}s]"


def problem(B, hq, lens, bs, seed, extra_blocks=7):
    """Shuffled pages: every row's blocks are a random subset of the pool, in random order."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    mb = max(math.ceil(L / bs) for L in lens)
    nb = B * mb + extra_blocks
    x_k = torch.randn(nb * bs, HKV, D, generator=g, device=DEV)
    x_v = torch.randn(nb * bs, HKV, D, generator=g, device=DEV)
    x_k[:, :, 5] *= 8.0  # one heavy channel: unequal group scales
    kc, ks = W.rtn_pages(x_k, bs)
    vc, vs = W.rtn_pages(x_v, bs)
    perm = torch.randperm(nb, generator=g, device=DEV)[: B * mb].view(B, mb).to(torch.int32)
    q = (1.5 * torch.randn(B, hq, D, generator=g, device=DEV)).to(torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32)
    cu = lambda t: t.to(DEV).contiguous()  # noqa: E731
    return tuple(cu(t) for t in (q, kc, ks, vc, vs, perm, seq))


def old_sides(kc, ks, vc, vs):
    from kvlib.kernels.int8.request import PoolSide

    nb, bs, h, d = kc.shape
    mk = lambda c, s: PoolSide(c.view(nb * bs, h, d), s.view(nb * bs, h, d // 32), group=32,  # noqa: E731
                               dither_layout="h8", dithered=False)
    return mk(kc, ks), mk(vc, vs)


def old_decode(q, kc, ks, vc, vs, bt, seq, ns=None):
    from kvlib.kernels.int8.decode import decode_int8

    kp, vp = old_sides(kc, ks, vc, vs)
    out = decode_int8(q, kp, vp, None, seq, layer=0, seed=0, cert=False, impl="gluon", block_table=bt,
                      block_size=kc.shape[1], num_splits=ns)
    assert out.path == "gluon", out.path
    return out.o, out.lse


CHECKS = [  # (name, B, hq, lens, block_size)
    ("gqa7_bs16", 4, 28, [1, 77, 1000, 2049], 16),
    ("gqa1_bs16", 3, 4, [16, 300, 513], 16),
    ("gqa8_bs64", 3, 32, [5, 640, 1999], 64),
]
for vname, cfg in VARIANTS.items():
    rec = {"config": cfg.__dict__, "checks": {}, "ok": False}
    res["variants"][vname] = rec
    try:
        for ci, (cname, B, hq, lens, bs) in enumerate(CHECKS):
            q, kc, ks, vc, vs, bt, seq = problem(B, hq, lens, bs, seed=100 + ci)
            t = time.time()
            o, lse = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg)
            torch.cuda.synchronize()
            o_ns, _ = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg, num_splits=3)  # another split count
            torch.cuda.synchronize()
            ro, rl = W.wspec_reference(q, kc, ks, vc, vs, bt, seq)
            e_o = (o.double().cpu() - ro).abs().max().item()
            e_l = (lse.double().cpu() - rl).abs().max().item()
            e_ns = (o_ns.double().cpu() - ro).abs().max().item()
            c = {"err_o": e_o, "err_lse": e_l, "err_o_ns3": e_ns, "first_call_s": time.time() - t,
                 "finite": bool(torch.isfinite(o).all())}
            if hq // HKV <= 8 and bs == 16:
                oo, ol = old_decode(q, kc, ks, vc, vs, bt, seq)
                c["old_gluon_err_o"] = (oo.double().cpu() - ro).abs().max().item()
            c["ok"] = c["finite"] and e_o <= TOL_O and e_ns <= TOL_O and e_l <= TOL_LSE
            rec["checks"][cname] = c
            print(f"{elapsed()} {vname:14s} {cname:10s} err_o {e_o:.2e} (ns=3 {e_ns:.2e}) err_lse {e_l:.2e} "
                  f"old_gluon_err_o {c.get('old_gluon_err_o', float('nan')):.2e} -> {'ok' if c['ok'] else 'BAD'}",
                  flush=True)
        rec["ok"] = all(c["ok"] for c in rec["checks"].values())
        try:
            cc = W._wspec_stage1.device_caches  # registers/spills of the compiled binaries, when exposed
            kerns = [k for dev in cc.values() for k in dev[0].values()]
            rec["binaries"] = [{"n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}
                               for k in kerns]
        except Exception as e:  # noqa: BLE001 - informative only
            rec["binaries"] = repr(e)[:200]
    except Exception as e:  # noqa: BLE001 - record the compile/run error and go on with the other variants
        rec["error"] = "".join(traceback.format_exception(e))[-4000:]
        print(f"{elapsed()} {vname}: ERROR\n{rec['error']}", flush=True)


# ---- timing
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


SHAPES = [(8, 16384), (32, 16384)]
if time.time() - T0 > 150:
    SHAPES = SHAPES[:1]
    print("compile/check took long: timing B=8 only", flush=True)
for B, S in SHAPES:
    key = f"B{B}_S{S}"
    try:
        q, kc, ks, vc, vs, bt, seq = problem(B, 28, [S] * B, 16, seed=B, extra_blocks=64)
        graphs, outs = {}, {}
        # SDPA bf16 over dense K/V (the baseline every chapter uses), GQA
        kd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
        vd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
        q4 = q.view(B, 28, 1, D)
        graphs["sdpa_bf16"] = capture(lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, kd, vd, enable_gqa=True))
        graphs["old_gluon"] = capture(lambda: outs.__setitem__("old_gluon", old_decode(q, kc, ks, vc, vs, bt, seq)))
        for vname, cfg in VARIANTS.items():
            if not res["variants"][vname]["ok"]:
                continue
            pl = W.plan(q, kc, ks, vc, vs, bt, seq, config=cfg)
            descs = W.descriptors(kc, vc, pl.box_rows)
            o_s = torch.empty(B, 28, pl.num_splits, D, device=DEV)
            lse_s = torch.empty(B, 28, pl.num_splits, device=DEV)

            def fn(cfg=cfg, descs=descs, o_s=o_s, lse_s=lse_s, vname=vname):
                outs[vname] = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg, descs=descs, o_s=o_s,
                                             lse_s=lse_s)
            graphs[vname] = capture(fn)
            res["timing"].setdefault(key, {}).setdefault("splits", {})[vname] = pl.num_splits
        med, per = time_graphs(graphs)
        torch.cuda.synchronize()
        row = res["timing"].setdefault(key, {})
        row["median_ms"] = med
        row["rounds_ms"] = per
        kv_bytes = B * HKV * S * 2 * (D + 2 * D // 32)
        bf_bytes = B * HKV * S * 2 * D * 2
        row["GBps"] = {n: (bf_bytes if n == "sdpa_bf16" else kv_bytes) / (m * 1e-3) / 1e9 for n, m in med.items()}
        # agreement at the timing shape: every variant against the existing Gluon kernel
        oo = outs["old_gluon"][0]
        row["max_abs_vs_old"] = {n: (o[0] - oo).abs().max().item() for n, o in outs.items() if n != "old_gluon"}
        print(f"{elapsed()} {key}: ms / x SDPA / x old gluon / GB/s", flush=True)
        for n, m in med.items():
            print(f"   {n:14s} {m:8.4f} ms  {med['sdpa_bf16'] / m:5.2f}x SDPA  {med['old_gluon'] / m:5.2f}x old  "
                  f"{row['GBps'][n]:7.0f} GB/s  max|o - old| {row['max_abs_vs_old'].get(n, float('nan')):.1e}",
                  flush=True)
        del kd, vd, graphs
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        res["timing"][key] = {"error": "".join(traceback.format_exception(e))[-3000:]}
        print(f"{elapsed()} timing {key}: ERROR\n{res['timing'][key]['error']}", flush=True)

res["wall_s"] = time.time() - T0
with open(os.path.join(OUT, "wspec.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
print("== wspec summary ==")
for vname, rec in res["variants"].items():
    ratios = "  ".join(f"{k}: {v['median_ms']['sdpa_bf16'] / v['median_ms'][vname]:.2f}x SDPA "
                       f"{v['median_ms']['old_gluon'] / v['median_ms'][vname]:.2f}x old"
                       for k, v in res["timing"].items() if vname in v.get("median_ms", {}))
    print(f"{'PASS' if rec['ok'] else 'FAIL'} {vname:14s} {ratios}")
sys.exit(0 if any(r["ok"] for r in res["variants"].values()) else 1)
PYEOF
timeout 230 "$PY" "$SCRIPT"
rc=$?
echo "wspec.sh exit $rc (0: at least one variant passed; JSON in $OUT/wspec.json)"
exit $rc
