#!/usr/bin/env bash
# KV against weight quantisation at matched workloads (issue 40 item 3; claim kv4rl-kv-vs-weight-quant, whose rule is
# committed in data/claims/performance.yml before this runs): `python -m kvlib.bench kv_vs_weight --profile gpu`.
#
# Device call (one H200: the late state's bf16 StaticCache is ~71 GB beside 15 GB of weights and a ~40 GB INT8 cache;
# on an 80 GB H100 the late state's groups are skipped as out of memory):
#   run(kind="nvidia-h200", needs_h200=true, timeout_s=600, carry=[".whl"],
#       command="KVLIB_COMMIT=<full commit of a clean tree> bash dev/gpu/kv_vs_weight.sh")
# .whl must hold torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl (built against torch
# 2.11; pure PyTorch/Triton for the three arms used: its C++ extension is not needed) and the quanto wheel the e2e
# peers use; kvlib.bench.peers_hf.ensure_peer_packages installs them into a temporary directory.
# Expected device time: ~9 min (model build ~0.5, two states each: fills ~1.5 incl. kv4rl's, torchao quantise ~0.5,
# compiling the linear layers of 4 arms ~1-2, timing ~1); states/groups not started by KVLIB_KVW_TIME_BUDGET_S
# (default here 470 s) are recorded as skipped, and a hard stop at KVLIB_KVW_TIMEOUT_S (560 s) leaves the rows
# measured so far in $OUT/kv_vs_weight_partial.json. Result: $OUT/kv_vs_weight.json (also data/results/gpu/).
set -uo pipefail
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/kvw_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
[ -n "${KVLIB_COMMIT:-}" ] || { echo "kv_vs_weight: FAIL: set KVLIB_COMMIT (a result records its commit)"; exit 2; }
export KVLIB_KVW_TIME_BUDGET_S=${KVLIB_KVW_TIME_BUDGET_S:-470}
export KVLIB_KVW_PARTIAL="$OUT/kv_vs_weight_partial.json"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
ls -la .whl/ 2>&1 | tail -n +2
# preflight (~30 s): torchao's INT4 and FP8 linear layers within their quantisers' bounds on this GPU
$PY -m pytest -q -p no:cacheprovider tests/test_bench_kv_vs_weight.py -k "int4 or fp8 or int8_weight" > "$OUT/preflight.log" 2>&1
echo "preflight (quantised linear bounds): rc=$?"; tail -n 3 "$OUT/preflight.log" | cut -c1-200
touch "$OUT/.start"
start=$(date +%s)
timeout -s INT -k 15 "${KVLIB_KVW_TIMEOUT_S:-560}" $PY -m kvlib.bench kv_vs_weight --profile gpu > "$OUT/kv_vs_weight.log" 2>&1
rc=$?
echo "wall $(( $(date +%s) - start )) s, rc=$rc (124/130: hard stop)"
tail -n 8 "$OUT/kv_vs_weight.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -n 6 | cut -c1-220
res="$OUT/kv_vs_weight.json"
if [ -f data/results/gpu/kv_vs_weight.json ] && [ data/results/gpu/kv_vs_weight.json -nt "$OUT/.start" ]; then
  cp data/results/gpu/kv_vs_weight.json "$res"
else
  echo "no fresh data/results/gpu/kv_vs_weight.json: printing the partial rows"
  res="$KVLIB_KVW_PARTIAL"
fi
$PY - "$res" <<'PY'
import json, sys
try:
    raw = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    print(f"FAIL: no result JSON ({type(e).__name__}: {e})"); sys.exit(1)
partial = raw.get("partial", False)
r = raw if partial else raw["results"]
print(f"{'phase':5} {'B':>4} {'ctx':>5} {'group':<10} {'arm':<13} {'ms':>8} {'x bf16':>6} {'W GB':>6} {'KV GB':>6} "
      f"{'kv share':>8} status")
for x in r["rows"]:
    f = lambda k, s=1.0, d=2: "-" if x.get(k) is None else f"{x[k] / s:.{d}f}"  # noqa: E731
    print(f"{x['phase']:5} {x['batch']:>4} {x['ctx']:>5} {str(x.get('group')):<10} {x['arm']:<13} {f('step_ms'):>8} "
          f"{f('speedup_vs_bf16'):>6} {f('weight_bytes_read', 1e9):>6} {f('kv_bytes', 1e9):>6} "
          f"{f('kv_share', 1, 3):>8} {x.get('status')} {(x.get('reason') or '')[:90]}")
from kvlib.bench.kv_vs_weight_report import claim_quantities, speedups

print({f"{p}/{a}": round(v["speedup"], 3) for (p, a), v in sorted(speedups(r).items())})
measured, given, why = claim_quantities(r)
print("register quantities:", measured, given, why)
ok = measured is not None and not partial and given["weight_only_phases"] == 2 and given["w8a8_phases"] == 2
print("PASS" if ok else "FAIL", f"(complete: {not partial}; KV4 and a weight arm at both phases: {measured is not None}; "
      f"preconditions {given})")
sys.exit(0 if ok else 1)
PY
