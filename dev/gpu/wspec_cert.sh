#!/usr/bin/env bash
# GPU check and timing of the warp-specialised certified INT8 decode (kvlib/kernels/int8/wspec_cert.py, issue 28):
# h8-dithered keys (the dither regenerated from Philox words, once per (position, call)), the WitCert accumulators,
# m outlier RoPE pairs in fp16.
#  1. the GPU tests of tests/test_wspec_cert.py (float64 reference and the existing Gluon kernel on shuffled ragged
#     pages, GQA 1/4/7/8, m = 0 and 4 pairs, split counts; split invariance, soundness, the vacuous NaN case), over
#     pytest-xdist workers where importable;
#  2. timing at B=8 and 32, S=16k, 28/4 heads, d=128 (CUDA graphs, interleaved rounds, medians): the new kernel
#     (the Gluon kernel's exact PV and the cheaper folded PV, each also with the certificate compiled out: its marginal
#     cost; with m=4 pairs; 128-position tiles)
#     against the existing certified Gluon kernel (m=0 and m=4), the RTN warp-specialised kernel (wspec bn128_r3_pf)
#     and SDPA bf16; with the largest |o|, |tv_bound| differences of each certified kernel from the Gluon kernel.
# Run from the repo root; < 4 min on the H200; writes $OUT/wspec_cert.json and $OUT/wspec_cert_tests.xml.
set -u
OUT="${OUT:-/tmp/wspec_cert_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "${WSPEC_CERT_WORKERS:-8}"); fi
timeout 140 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests/test_wspec_cert.py \
  --junitxml="$OUT/wspec_cert_tests.xml" -rf 2>&1 | tail -40
test_rc=${PIPESTATUS[0]}
echo "[wspec_cert] tests rc $test_rc after $(( $(date +%s) - T0 ))s"
export WSPEC_CERT_OUT="$OUT" WSPEC_CERT_TEST_RC="$test_rc" WSPEC_CERT_T0="$T0"
SCRIPT="$(mktemp -d)/wspec_cert_timing.py"
cat > "$SCRIPT" <<'PYEOF'
import json
import os
import statistics
import time
import traceback
import xml.etree.ElementTree as ET

import torch

from kvlib.kernels.int8 import wspec as W
from kvlib.kernels.int8 import wspec_cert as C
from kvlib.kernels.int8.request import PoolSide

T0 = float(os.environ["WSPEC_CERT_T0"])
OUT = os.environ["WSPEC_CERT_OUT"]
DEADLINE_S = 225  # no new timing shape past this many seconds since the script began (the lead's 4-minute budget)
DEV = "cuda"
HQ, HKV, D, BS, S = 28, 4, 128, 16, 16384
LAYER, SEED = 7, 2**40 + 5
VARIANTS = {  # name: (config, cert, m pairs); "exact": the Gluon kernel's PV, "fold": fp16 P, scales folded into V
    "exact": (dict(), True, 0),
    "exact_nocert": (dict(), False, 0),
    "exact_m4": (dict(), True, 4),
    "fold": (dict(pv="fold"), True, 0),
    "fold_nocert": (dict(pv="fold"), False, 0),
    "fold_m4": (dict(pv="fold"), True, 4),
    "fold_bn128_r3": (dict(pv="fold", block_n=128, ring=3, producer_regs=40), True, 0),
    # with outlier rows the ring (~121 KB) leaves one CTA per SM
    "fold_bn128_r3_m4": (dict(pv="fold", block_n=128, ring=3, producer_regs=40, ctas_per_sm=1), True, 4),
}
MARGINAL = (("exact", "exact_nocert"), ("fold", "fold_nocert"))  # the certificate's marginal cost
RTN = dict(block_n=128, ring=3, prmt=True, vfold=True, prefetch=True)  # wspec2's best (1.23x SDPA)


def elapsed():
    return f"[{time.time() - T0:5.1f}s]"


def tests_summary():
    path = os.path.join(OUT, "wspec_cert_tests.xml")
    rec = {"rc": int(os.environ.get("WSPEC_CERT_TEST_RC", "-1"))}
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


def pools(B, m, g):
    """Random codes (the kernels' speed does not depend on the values), shuffled pages of 16 slots."""
    nb = B * S // BS + 64
    n = nb * BS
    kc = torch.randint(-127, 128, (n, HKV, D), dtype=torch.int8, device=DEV, generator=g)
    vc = torch.randint(-127, 128, (n, HKV, D), dtype=torch.int8, device=DEV, generator=g)
    ks = (0.01 + 0.04 * torch.rand(n, HKV, D // 32, device=DEV, generator=g)).half()
    vs = (0.01 + 0.04 * torch.rand(n, HKV, D // 32, device=DEV, generator=g)).half()
    ko = koc = None
    if m:
        koc = torch.stack([torch.tensor(sorted([c for i in range(m) for c in (3 + 11 * i + h, 3 + 11 * i + h + 64)]))
                           for h in range(HKV)]).to(DEV)
        ko = torch.randn(n, HKV, 2 * m, device=DEV, generator=g).half()
        for h in range(HKV):  # code 0 at the outlier channels (the pool's rule)
            kc[:, h, koc[h]] = 0
    kp = PoolSide(kc, ks, ko, koc, group=32, dither_layout="h8", dithered=True)
    vp = PoolSide(vc, vs, group=32, dither_layout="h8", dithered=False)
    bt = torch.randperm(nb, device=DEV, generator=g)[: B * S // BS].view(B, S // BS).to(torch.int32)
    q = torch.randn(B, HQ, D, device=DEV, generator=g).to(torch.bfloat16)
    seq = torch.full((B,), S, dtype=torch.int32, device=DEV)
    return q, kp, vp, bt, seq


def capture(fn):
    from kvlib.bench.timing import capture_graph

    graph, _ = capture_graph(fn, warmup_iters=2)
    return graph


def time_graphs(graphs, rounds=15, reps=30):
    """Median ms per call of each graph: each round replays every graph ``reps`` times, the order rotated (as
    dev/gpu/wspec.sh)."""
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


def time_shape(B):
    from kvlib.kernels.int8.decode import decode_int8

    g = torch.Generator(device=DEV).manual_seed(B)
    probs = {m: pools(B, m, g) for m in (0, 4)}
    graphs, outs, row = {}, {}, {"splits": {}, "errors": {}}
    q = probs[0][0]
    kd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
    vd = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
    q4 = q.view(B, HQ, 1, D)
    graphs["sdpa_bf16"] = capture(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kd, vd,
                                                                                         enable_gqa=True))
    for m in (0, 4):
        qq, kp, vp, bt, seq = probs[m]
        name = "gluon_cert" + ("_m4" if m else "")

        def old(qq=qq, kp=kp, vp=vp, bt=bt, seq=seq, name=name):
            out = decode_int8(qq, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="gluon", block_table=bt,
                              block_size=BS)
            outs[name] = (out.o, out.tv_bound)
        try:
            graphs[name] = capture(old)
        except Exception as e:  # noqa: BLE001
            row["errors"][name] = "".join(traceback.format_exception(e))[-1500:]
    qq, kp, vp, bt, seq = probs[0]
    nb = kp.codes.shape[0] // BS
    pages = lambda s: (s.codes.view(nb, BS, HKV, D), s.scales.view(nb, BS, HKV, D // 32))  # noqa: E731
    rcfg = W.WSpecConfig(**RTN)
    try:
        pl = W.plan(qq, *pages(kp), *pages(vp), bt, seq, config=rcfg)
        descs = W.descriptors(pages(kp)[0], pages(vp)[0], pl.box_rows, rcfg.swizzle)
        o_s = torch.empty(B, HQ, pl.num_splits, D, device=DEV)
        lse_s = torch.empty(B, HQ, pl.num_splits, device=DEV)
        graphs["wspec_rtn"] = capture(lambda: W.wspec_decode(qq, *pages(kp), *pages(vp), bt, seq, config=rcfg,
                                                             descs=descs, o_s=o_s, lse_s=lse_s))
        row["splits"]["wspec_rtn"] = pl.num_splits
    except Exception as e:  # noqa: BLE001
        row["errors"]["wspec_rtn"] = "".join(traceback.format_exception(e))[-1500:]
    for v, (ckw, cert, m) in VARIANTS.items():
        qq, kp, vp, bt, seq = probs[m]
        cfg = C.WSpecCertConfig(**ckw)
        try:
            kw = dict(block_size=BS, layer=LAYER, seed=SEED, cert=cert, config=cfg)
            pl = C.plan(qq, kp, vp, bt, seq, block_size=BS, layer=LAYER, seed=SEED, config=cfg)
            descs = W.descriptors(kp.codes.view(nb, BS, HKV, D), vp.codes.view(nb, BS, HKV, D), pl.box_rows,
                                  cfg.swizzle)
            ns = pl.num_splits
            buf = (torch.empty(B, HQ, ns, D, device=DEV), torch.empty(B, HQ, ns, device=DEV),
                   torch.empty(B, HQ, ns, device=DEV) if cert else None,
                   torch.empty(B, HQ, ns, device=DEV) if cert else None)

            def fn(qq=qq, kp=kp, vp=vp, bt=bt, seq=seq, kw=kw, descs=descs, buf=buf, v=v):
                out = C.wspec_cert_decode(qq, kp, vp, bt, seq, descs=descs, out=buf, **kw)
                outs[v] = (out.o, out.tv_bound)
            graphs[v] = capture(fn)
            row["splits"][v] = ns
        except Exception as e:  # noqa: BLE001
            row["errors"][v] = "".join(traceback.format_exception(e))[-1500:]
            print(f"{elapsed()} B={B} {v}: ERROR\n{row['errors'][v]}", flush=True)
    med, per = time_graphs(graphs)
    torch.cuda.synchronize()
    row["median_ms"] = med
    row["rounds_ms"] = per
    int8_bytes = B * HKV * S * 2 * (D + 2 * D // 32)
    bf_bytes = B * HKV * S * 2 * D * 2
    row["GBps"] = {n: (bf_bytes if n == "sdpa_bf16" else int8_bytes) / (t * 1e-3) / 1e9 for n, t in med.items()}
    row["x_sdpa"] = {n: med["sdpa_bf16"] / t for n, t in med.items()}
    # agreement with the Gluon kernel on the timed pools (same codes, same dither): informative, the tests gate
    row["vs_gluon"] = {}
    for v, (_, cert, m) in VARIANTS.items():
        ref = outs.get("gluon_cert" + ("_m4" if m else ""))
        if v in outs and ref is not None:
            o, tv = outs[v]
            row["vs_gluon"][v] = {"max_abs_o": (o - ref[0]).abs().max().item(),
                                  "max_abs_tv": (tv - ref[1]).abs().max().item() if cert else None}
    row["cert_marginal_cost"] = {a: med[a] / med[b] - 1.0 for a, b in MARGINAL if a in med and b in med}
    print(f"{elapsed()} B={B} S={S} (splits {row['splits']}):", flush=True)
    for n, t in med.items():
        print(f"   {n:24s} {t:8.4f} ms  {row['x_sdpa'][n]:5.2f}x SDPA  {row['GBps'][n]:6.0f} GB/s  "
              f"{row['vs_gluon'].get(n, '')}", flush=True)
    return row


def save(res):
    res["wall_s"] = time.time() - T0
    with open(os.path.join(OUT, "wspec_cert.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def main():
    import triton

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": dict(HQ=HQ, HKV=HKV, D=D, bs=BS, S=S), "variants": {k: list(v) for k, v in VARIANTS.items()},
           "rtn_config": RTN, "tests": tests_summary(), "timing": {}}
    t = res["tests"]
    print(f"{elapsed()} tests: {t}", flush=True)
    save(res)
    for B in (8, 32):
        if time.time() - T0 > DEADLINE_S:
            res["timing"][f"B{B}"] = {"skipped": "time budget"}
            print(f"{elapsed()} B={B} skipped (time budget)", flush=True)
            continue
        try:
            res["timing"][f"B{B}"] = time_shape(B)
        except Exception as e:  # noqa: BLE001
            res["timing"][f"B{B}"] = {"error": "".join(traceback.format_exception(e))[-3000:]}
            print(f"{elapsed()} B={B}: ERROR\n{res['timing'][f'B{B}']['error']}", flush=True)
        save(res)
    ok = t.get("rc") == 0 and t.get("tests", 0) > 0 and not t.get("failures") and not t.get("errors")
    print("== wspec_cert summary ==")
    print(f"{'PASS' if ok else 'FAIL'} tests: {t.get('tests')} run, {t.get('failures')} failed, {t.get('errors')} "
          f"errors, {t.get('skipped')} skipped (rc {t.get('rc')})")
    for f in t.get("failed", [])[:10]:
        print(f"   {f}")
    for k, row in res["timing"].items():
        if "median_ms" not in row:
            print(f"{k}: {row}")
            continue
        x = row["x_sdpa"]
        print(f"{k}: " + "  ".join(f"{n} {x[n]:.2f}x" for n in x)
              + "".join(f"  cert cost ({a}) {100 * c:+.1f}%" for a, c in row["cert_marginal_cost"].items())
              + (f"  errors: {list(row['errors'])}" if row.get("errors") else ""))
    print(f"wall {time.time() - T0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
PYEOF
timeout $(( 235 - ($(date +%s) - T0) )) "$PY" "$SCRIPT"
rc=$?
echo "wspec_cert.sh exit $rc (0: every GPU test passed; JSON in $OUT/wspec_cert.json)"
exit $rc
