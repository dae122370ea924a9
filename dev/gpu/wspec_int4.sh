#!/usr/bin/env bash
# GPU check and timing of the warp-specialised KV4 / KV4-RL paged decode (kvlib/kernels/int4/wspec.py, issue 28).
#  1. the GPU tests of tests/test_wspec_int4.py (the float64-accumulated torch reference and the Triton paged kernel
#     on shuffled pages with NaN garbage outside the regions, ragged rows, GQA 1/4/7/8, pages of 16/32/64/256, split
#     counts, other rings, d = 64, CUDA-graph replay), over pytest-xdist workers where importable;
#  2. timing at B=8 and 32, S=16k and 32k, 28/4 heads, d=128 (CUDA graphs, interleaved rounds, medians; the query
#     preparation, with pdl=True as kv4_decode calls it, inside every decode's graph): the new kernel (rings,
#     occupancies, PDL, the 8-row softmax: ten variants for KV4, five for KV4-RL) against the Triton
#     KV4 / KV4-RL kernels (kv4_decode / kv4rl_decode over the contiguous cache, the calls of the kv4 benchmark,
#     and kv4_paged_decode over the same pool as the new kernel) and SDPA bf16; prints x SDPA, new / Triton and KV4-RL / KV4 measured side by side, and the
#     largest |o| difference of the new kernel from the Triton paged kernel on the timed pools.
#  The KV4-RL variants ending "_fused" run the side region in the same launch (WSpec4Config.side_fused, issue 40).
# Run from the repo root; < 5 min on the H200; writes $OUT/wspec_int4.json and $OUT/wspec_int4_tests.xml.
set -u
OUT="${OUT:-/tmp/wspec_int4_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "${WSPEC_INT4_WORKERS:-8}"); fi
timeout 180 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests/test_wspec_int4.py \
  --junitxml="$OUT/wspec_int4_tests.xml" -rf 2>&1 | tail -40
test_rc=${PIPESTATUS[0]}
echo "[wspec_int4] tests rc $test_rc after $(( $(date +%s) - T0 ))s"
export WSPEC_INT4_OUT="$OUT" WSPEC_INT4_TEST_RC="$test_rc" WSPEC_INT4_T0="$T0"
SCRIPT="$(mktemp -d)/wspec_int4_timing.py"
cat > "$SCRIPT" <<'PYEOF'
import json
import os
import statistics
import time
import traceback
import xml.etree.ElementTree as ET

import torch

from kvlib.kernels.int4 import wspec as W

T0 = float(os.environ["WSPEC_INT4_T0"])
OUT = os.environ["WSPEC_INT4_OUT"]
DEADLINE_S = 270  # no new timing shape past this many seconds since the script began (the lead's 5-minute budget)
DEV = "cuda"
HQ, HKV, D, BS = 28, 4, 128, 256  # pages of 256: the tiles path of the Triton paged kernel (its recommended size)
SHAPES = ((8, 16384), (32, 16384), (8, 32768), (32, 32768))
VARIANTS = {  # name: WSpec4Config fields
    "bn128_r4": dict(),
    "bn64_r6": dict(block_n=64, ring=6),
    "bn128_r3": dict(block_n=128, ring=3),
    # three CTAs per SM (80 registers per thread over the CTA; a 32-register producer leaves the consumers 128:
    # no spills offline at 2026-12-02)
    "bn128_r3_3cta": dict(block_n=128, ring=3, maxnreg=80, producer_regs=32, ctas_per_sm=3),
    "bn64_r4_3cta": dict(block_n=64, ring=4, maxnreg=80, producer_regs=32, ctas_per_sm=3),
    # programmatic dependent launch: stage 1 after the query preparation, the merge after stage 1
    "bn128_r4_pdl": dict(pdl=True),
    "bn128_r3_3cta_pdl": dict(block_n=128, ring=3, maxnreg=80, producer_regs=32, ctas_per_sm=3, pdl=True),
    # the softmax on the 8 head rows only (20% fewer consumer loop instructions offline)
    "bn128_r4_r8": dict(rows8=True),
    "bn128_r4_r8_pdl": dict(rows8=True, pdl=True),
    "bn128_r3_3cta_r8_pdl": dict(block_n=128, ring=3, maxnreg=80, producer_regs=32, ctas_per_sm=3, rows8=True,
                                 pdl=True),
    # KV4-RL only (issue 40): the side region in the same launch, by split 0's consumer (a KV4 request runs
    # the variant without "_fused", the same kernel); KV4-RL / KV4 is taken against that one
    "bn128_r4_r8_fused": dict(rows8=True, side_fused=True),
    "bn128_r4_r8_pdl_fused": dict(rows8=True, pdl=True, side_fused=True),
    # the same without the rebalance (side_cost 0: stage 1's split plan, the last split runs the side region)
    "bn128_r4_r8_pdl_fused_c0": dict(rows8=True, pdl=True, side_fused=True, side_cost=0),
    "bn128_r3_3cta_r8_pdl_fused": dict(block_n=128, ring=3, maxnreg=80, producer_regs=32, ctas_per_sm=3,
                                       rows8=True, pdl=True, side_fused=True),
}
RL_VARIANTS = ("bn128_r4", "bn128_r3_3cta", "bn128_r4_pdl", "bn128_r4_r8_pdl",
               "bn128_r3_3cta_r8_pdl", "bn128_r4_r8_fused", "bn128_r4_r8_pdl_fused",
               "bn128_r3_3cta_r8_pdl_fused", "bn128_r4_r8_pdl_fused_c0")  # KV4-RL timed with these


def elapsed():
    return f"[{time.time() - T0:5.1f}s]"


def tests_summary():
    path = os.path.join(OUT, "wspec_int4_tests.xml")
    rec = {"rc": int(os.environ.get("WSPEC_INT4_TEST_RC", "-1"))}
    try:
        root = ET.parse(path).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        for k in ("tests", "failures", "errors", "skipped"):
            rec[k] = sum(int(s.get(k, 0)) for s in suites)
        rec["failed"] = []
        for s in suites:
            for c in s.iter("testcase"):
                bad = c.find("failure") if c.find("failure") is not None else c.find("error")
                if bad is not None:
                    rec["failed"].append(f"{c.get('classname')}::{c.get('name')}: {bad.get('message', '')[:300]}")
    except Exception as e:  # noqa: BLE001
        rec["error"] = repr(e)[:300]
    return rec


def capture(fn):
    from kvlib.bench.timing import capture_graph

    graph, _ = capture_graph(fn, warmup_iters=2)
    return graph


def time_graphs(graphs, rounds=15, reps=20):
    """Median ms per call of each graph: each round replays every graph ``reps`` times, the order rotated (as
    dev/gpu/wspec_cert.sh)."""
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


def time_shape(B, S):
    from dev.kv4_paged_vs_contiguous import paged_pool
    from kvlib.bench.kv4 import RECENT, SINK, random_kv4_batch
    from kvlib.kernels.int4.attention import kv4_decode, kv4rl_decode, side_buffer
    from kvlib.kernels.int4.decode import kv4_paged_decode, prepare_query

    torch.manual_seed(B + S)
    lengths = torch.full((B,), S, dtype=torch.int32, device=DEV)
    cache = random_kv4_batch(lengths, S, SINK, RECENT, hkv=HKV, d=D)
    pool = paged_pool(cache, BS)
    q = torch.randn(B, HQ, D, device=DEV, dtype=torch.bfloat16)
    zeros = torch.zeros_like(cache.lengths)
    ranges = {"kv4": (zeros, cache.lengths), "kv4rl": cache.main_range()}
    sides = {"kv4": None, "kv4rl": side_buffer(cache)}
    pargs = tuple(pool[n] for n in ("k_codes", "k_scale", "k_off", "v_codes", "v_scale", "v_off", "block_table"))
    graphs, outs, row = {}, {}, {"splits": {}, "errors": {}}
    kd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
    vd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
    q4 = q.view(B, HQ, 1, D)
    graphs["sdpa_bf16"] = capture(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kd, vd,
                                                                                         enable_gqa=True))
    for kind in ("kv4", "kv4rl"):
        start, end = ranges[kind]
        side = sides[kind]

        def contig(kind=kind):  # the kv4 benchmark's own calls (kvlib.bench.kv4): contiguous cache, tuned default
            return kv4_decode(q, cache) if kind == "kv4" else kv4rl_decode(q, cache)

        def paged(start=start, end=end, side=side, kind=kind):
            outs[f"triton_paged_{kind}"] = kv4_paged_decode(prepare_query(q, pdl=True), *pargs, start, end,
                                                            block_size=BS, side=side)
        for name, fn in ((f"triton_{kind}", contig), (f"triton_paged_{kind}", paged)):
            try:
                graphs[name] = capture(fn)
            except Exception as e:  # noqa: BLE001
                row["errors"][name] = "".join(traceback.format_exception(e))[-1500:]
        for v, ckw in VARIANTS.items():
            if (kind == "kv4rl" and v not in RL_VARIANTS) or (kind == "kv4" and ckw.get("side_fused")):
                continue
            name = f"wspec4_{kind}_{v}"
            cfg = W.WSpec4Config(**ckw)
            try:
                qp0 = prepare_query(q, pdl=True)
                pl = W.plan(qp0, *pargs, start, end, block_size=BS, side=side, config=cfg)
                descs = W.descriptors(pool["k_codes"], pool["v_codes"], pl.box_rows)
                buf = (torch.empty(B, HQ, pl.states, D, device=DEV), torch.empty(B, HQ, pl.states, device=DEV))

                def fn(start=start, end=end, side=side, cfg=cfg, descs=descs, buf=buf, name=name):
                    from kvlib.kernels.tl.merge import merge_splits

                    o_s, lse_s = W.wspec4_stage1(prepare_query(q, pdl=True), *pargs, start, end, block_size=BS,
                                                 side=side, config=cfg, descs=descs, out=buf)
                    m = merge_splits(o_s, lse_s, pdl=True)
                    outs[name] = (m.o, m.lse)
                graphs[name] = capture(fn)
                row["splits"][name] = pl.num_splits
            except Exception as e:  # noqa: BLE001
                row["errors"][name] = "".join(traceback.format_exception(e))[-1500:]
                print(f"{elapsed()} B={B} S={S} {name}: ERROR\n{row['errors'][name]}", flush=True)
    med, per = time_graphs(graphs)
    torch.cuda.synchronize()
    row["median_ms"] = med
    row["rounds_ms"] = per
    kv4_bytes = B * HKV * S * 2 * (D // 2 + 4)  # codes + fp16 scale and offset, both sides
    bf_bytes = B * HKV * S * 2 * D * 2
    row["GBps"] = {n: (bf_bytes if n == "sdpa_bf16" else kv4_bytes) / (t * 1e-3) / 1e9 for n, t in med.items()}
    row["x_sdpa"] = {n: med["sdpa_bf16"] / t for n, t in med.items()}
    row["new_over_triton"] = {}  # time ratios < 1: the new kernel is faster (vs the contiguous Triton call)
    row["new_over_triton_paged"] = {}  # the same against the Triton paged kernel over the same pool
    row["rl_over_kv4_speed"] = {}  # KV4-RL's speed as a share of KV4's (the goal: >= 0.97)
    for n in med:
        for kind in ("kv4", "kv4rl"):
            if n.startswith(f"wspec4_{kind}_") and f"triton_{kind}" in med:
                row["new_over_triton"][n] = med[n] / med[f"triton_{kind}"]
            if n.startswith(f"wspec4_{kind}_") and f"triton_paged_{kind}" in med:
                row["new_over_triton_paged"][n] = med[n] / med[f"triton_paged_{kind}"]
    for v in RL_VARIANTS:
        a, b = f"wspec4_kv4_{v.split('_fused')[0]}", f"wspec4_kv4rl_{v}"
        if a in med and b in med:
            row["rl_over_kv4_speed"][v] = med[a] / med[b]
    if "triton_kv4" in med and "triton_kv4rl" in med:
        row["rl_over_kv4_speed"]["triton"] = med["triton_kv4"] / med["triton_kv4rl"]
    # agreement with the Triton paged kernel on the timed pools (informative: the tests gate)
    row["max_abs_do_vs_triton_paged"] = {}
    for n, (o, _) in outs.items():
        if n.startswith("wspec4_"):
            kind = n.split("_")[1]
            ref = outs.get(f"triton_paged_{kind}")
            if ref is not None:
                row["max_abs_do_vs_triton_paged"][n] = (o - ref[0]).abs().max().item()
    print(f"{elapsed()} B={B} S={S} (splits {row['splits']}):", flush=True)
    for n, t in med.items():
        print(f"   {n:26s} {t:8.4f} ms  {row['x_sdpa'][n]:5.2f}x SDPA  {row['GBps'][n]:6.0f} GB/s  "
              f"{row['new_over_triton'].get(n, '')}", flush=True)
    return row


def save(res):
    res["wall_s"] = time.time() - T0
    with open(os.path.join(OUT, "wspec_int4.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def main():
    import triton

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": dict(HQ=HQ, HKV=HKV, D=D, bs=BS), "variants": VARIANTS, "tests": tests_summary(), "timing": {}}
    t = res["tests"]
    print(f"{elapsed()} tests: {t}", flush=True)
    save(res)
    for B, S in SHAPES:
        key = f"B{B}_S{S}"
        if time.time() - T0 > DEADLINE_S:
            res["timing"][key] = {"skipped": "time budget"}
            print(f"{elapsed()} {key} skipped (time budget)", flush=True)
            continue
        try:
            res["timing"][key] = time_shape(B, S)
        except Exception as e:  # noqa: BLE001
            res["timing"][key] = {"error": "".join(traceback.format_exception(e))[-3000:]}
            print(f"{elapsed()} {key}: ERROR\n{res['timing'][key]['error']}", flush=True)
        save(res)
        torch.cuda.empty_cache()
    ok = t.get("rc") == 0 and t.get("tests", 0) > 0 and not t.get("failures") and not t.get("errors")
    print("== wspec_int4 summary ==")
    print(f"{'PASS' if ok else 'FAIL'} tests: {t.get('tests')} run, {t.get('failures')} failed, {t.get('errors')} "
          f"errors, {t.get('skipped')} skipped (rc {t.get('rc')})")
    for f in t.get("failed", [])[:10]:
        print(f"   {f}")
    for k, row in res["timing"].items():
        if "median_ms" not in row:
            print(f"{k}: {row}")
            continue
        x = row["x_sdpa"]
        print(f"{k}: " + "  ".join(f"{n} {x[n]:.2f}x" for n in x))
        print("   new/triton time: " + "  ".join(f"{n} {r:.3f}" for n, r in row["new_over_triton"].items()))
        print("   new/triton paged time: " + "  ".join(f"{n} {r:.3f}" for n, r in row["new_over_triton_paged"].items())
              + "   KV4-RL/KV4 speed: " + "  ".join(f"{n} {r:.3f}" for n, r in row["rl_over_kv4_speed"].items())
              + (f"  errors: {list(row['errors'])}" if row.get("errors") else ""))
    print(f"wall {time.time() - T0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
PYEOF
timeout $(( 235 - ($(date +%s) - T0) )) "$PY" "$SCRIPT"
rc=$?
echo "wspec_int4.sh exit $rc (0: every GPU test passed; JSON in $OUT/wspec_int4.json)"
exit $rc
