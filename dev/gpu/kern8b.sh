#!/usr/bin/env bash
# GPU lane of kern8b (issue 24 items 1 and 4 in the INT8 kernels): (1) the Gluon, INT8 and h10 kernel tests on CUDA
# (RTN-key mode, d = 64 with groups of 16, outlier channels in the Gluon kernel), (2) a CUDA-graph
# timing of the Gluon kernel with m = 0 and m = 4 outlier pairs against the Triton h10 kernel, RTN-key mode, at
# B=32, S=16k, Hq=28, Hkv=4, d=128 (and h10 vs tc at d=64, Hq=9, Hkv=3). Each part runs on its own (a failure does not stop the next) and prints
# PASS/FAIL; the whole run stays under 3 minutes. Writes $OUT/kern8b_timing.json and $OUT/kern8b_tests.log.
set -u
OUT="${OUT:-/tmp/kern8b_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

echo "== part 1: kernel tests on the GPU =="
timeout 105 "$PY" -m pytest -q -n 8 -m "gpu or not gpu" tests/test_decode_gluon.py tests/test_decode_int8.py \
  tests/test_decode_h10.py -p no:cacheprovider 2>&1 | tee "$OUT/kern8b_tests.log" | tail -40
TESTS_RC=${PIPESTATUS[0]}
[ "$TESTS_RC" = 0 ] && TESTS=PASS || TESTS="FAIL (rc=$TESTS_RC; 124 = timed out)"
echo "part 1 (tests): $TESTS  [$(( $(date +%s) - start )) s]"

echo "== part 2: CUDA-graph timing, B=32 S=16k Hq=28 Hkv=4 d=128 =="
timeout 65 "$PY" - "$OUT/kern8b_timing.json" <<'PYEOF'
import json
import sys

import torch

from kvlib.bench.timing import bench_graphed
from kvlib.kernels.int8.decode import PoolSide, decode_int8

B, S, HQ, HKV, D, G = 32, 16384, 28, 4, 128, 32
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)


def side(m, dithered=True, layout="h8", hkv=HKV, d=D, g=G):
    n = B * S
    codes = torch.randint(-127, 128, (n, hkv, d), dtype=torch.int8, device=dev, generator=gen)
    scales = (0.01 + 0.02 * torch.rand(n, hkv, d // g, device=dev, generator=gen)).half()
    if not m:
        return PoolSide(codes, scales, group=g, dither_layout=layout, dithered=dithered)
    # m RoPE pairs (c, c + 64) per head; their codes are 0 in a real pool (the kernel never reads them)
    oc = torch.stack([torch.tensor(sorted([c for i in range(m) for c in (3 + 7 * i, 67 + 7 * i)])) for _ in range(HKV)])
    codes[:, torch.arange(HKV)[:, None], oc] = 0
    outs = torch.randn(n, HKV, 2 * m, device=dev, generator=gen).half()
    return PoolSide(codes, scales, outs, oc.to(dev), group=G, dither_layout=layout, dithered=dithered)


q = torch.randn(B, HQ, D, device=dev, generator=gen).to(torch.bfloat16)
slots = torch.arange(B * S, dtype=torch.int32, device=dev).view(B, S)
seq = torch.full((B,), S, dtype=torch.int32, device=dev)
v = side(0, dithered=False)
pools = {0: side(0), 4: side(4)}
rtn_k = side(0, dithered=False)
cases = {  # name: (key pool, impl, cert)
    "gluon_m0": (pools[0], "gluon", True),
    "gluon_m4": (pools[4], "gluon", True),
    "h10_m0": (pools[0], "h10", True),
    "h10_m4": (pools[4], "h10", True),
    "auto_m4": (pools[4], "auto", True),
    "gluon_rtn_keys": (rtn_k, "gluon", False),
    "h10_rtn_keys": (rtn_k, "h10", False),
    "gluon_m0_nocert": (pools[0], "gluon", False),
}
# SmolLM2's heads (d = 64, groups of 16, 9 query / 3 KV heads): the h10 kernel over h8 keys against the w24 tc one
q64 = torch.randn(B, 9, 64, device=dev, generator=gen).to(torch.bfloat16)
v64 = side(0, dithered=False, hkv=3, d=64, g=16)
k64 = {"h8": side(0, hkv=3, d=64, g=16), "w24": side(0, layout="w24", hkv=3, d=64, g=16)}
cases["d64_h10"] = (k64["h8"], "h10", True, q64, v64)
cases["d64_tc"] = (k64["w24"], "tc", True, q64, v64)
res = {}
for name, case in cases.items():
    kp, impl, cert = case[:3]
    qq, vv = case[3:] if len(case) > 3 else (q, v)
    try:
        path = decode_int8(qq, kp, vv, slots, seq, layer=3, seed=7, impl=impl, cert=cert, cert_b=False).path
        t = bench_graphed(lambda kp=kp, impl=impl, cert=cert, qq=qq, vv=vv: decode_int8(
            qq, kp, vv, slots, seq, layer=3, seed=7, impl=impl, cert=cert, cert_b=False), warmup_ms=10, rep_ms=60)
        res[name] = dict(path=path, ms=t["median_ms"], q25=t["q25_ms"], q75=t["q75_ms"], graphed=t["graphed"])
        print(f"  {name:16} path={path:6} {t['median_ms'] * 1e3:8.1f} us  graphed={t['graphed']}", flush=True)
    except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the others still run
        res[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"  {name:16} FAIL {res[name]['error']}", flush=True)


def ratio(a, b):
    if "ms" in res.get(a, {}) and "ms" in res.get(b, {}):
        r = res[a]["ms"] / res[b]["ms"]
        print(f"  {a} / {b} = {r:.3f}")
        return r
    print(f"  {a} / {b}: n/a (one of them did not run)")
    return None


ratios = {f"{a}/{b}": ratio(a, b) for a, b in [("gluon_m4", "gluon_m0"), ("gluon_m4", "h10_m4"), ("gluon_m0", "h10_m0"),
                                              ("h10_m4", "h10_m0"), ("gluon_rtn_keys", "gluon_m0_nocert"),
                                              ("gluon_rtn_keys", "h10_rtn_keys"), ("d64_h10", "d64_tc")]}
json.dump(dict(shape=dict(B=B, S=S, Hq=HQ, Hkv=HKV, d=D, group=G, qdtype="bf16", cert_b=False), results=res,
               ratios=ratios, device=torch.cuda.get_device_name()), open(sys.argv[1], "w"), indent=1)
core = ("gluon_m0", "gluon_m4", "h10_m0", "h10_m4", "gluon_rtn_keys", "d64_h10")
sys.exit(0 if all("ms" in res[k] for k in core) else 1)
PYEOF
TIME_RC=$?
[ "$TIME_RC" = 0 ] && TIMING=PASS || TIMING="FAIL (rc=$TIME_RC; 124 = timed out)"
echo "part 2 (timing): $TIMING  [$(( $(date +%s) - start )) s]"

echo "== kern8b summary =="
echo "tests:  $TESTS"
echo "timing: $TIMING (PASS: gluon m=0/m=4, h10 m=0/m=4, Gluon RTN keys and h10 at d=64 all ran; ratios above)"
[ "$TESTS_RC" = 0 ] && [ "$TIME_RC" = 0 ] && echo "PASS" || echo "FAIL"
