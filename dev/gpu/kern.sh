#!/usr/bin/env bash
# Issue 28 kernel checks on the H200 (< 150 s): run from the repository root, `OUT=... bash dev/gpu/kern.sh`.
#  1. dev/vdither_repro.py: the reduced reproducer of the tc value-dither bug (an mma v2 operand of kWidth 8 at
#     K = 16), K 16/32/64, loaded vs in-kernel joined tile -> $OUT/vdither_repro.json;
#  2. pytest on the GPU: the mended tc value-dither path against the reference (block_n 16/32/64, d 64/128), the
#     offline operand-depth check, the impl choice, the fp32-pool kernel at fp32 (ieee dots), and
#     tests/test_gate_fixed.py::test_fixed_path_on_the_kernel_with_static_pools (the lane's one failure)
#     -> $OUT/kern_pytest.log, $OUT/kern_pytest.xml;
#  3. where ncu exists (PATH, /usr/local/cuda*/bin): one warm launch each of the warp-specialised RTN INT8 kernel
#     (wspec bn128_r3_pf) and the old Gluon kernel at B=32, S=16k, 28/4 heads, d=128, sections SpeedOfLight,
#     MemoryWorkloadAnalysis, WarpStateStats, Occupancy, SchedulerStats -> $OUT/kern_ncu.ncu-rep, _details.csv.
# Everything is tarred into $OUT/kern.tar.gz (the device returns few files). Last line: "kern: PASS|FAIL ...".
set -u
OUT="${OUT:-/tmp/kern_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s]"; }
fails=()

echo "$(el) 1. reproducer"
timeout 30 "$PY" -m dev.vdither_repro "$OUT/vdither_repro.json" 2>&1 | tee "$OUT/vdither_repro.log"
[ "${PIPESTATUS[0]}" = 0 ] || fails+=("repro")

echo "$(el) 2. pytest (GPU)"
par=()
"$PY" -c "import xdist" 2>/dev/null && par=(-n 6)
timeout 60 "$PY" -m pytest -q -p no:cacheprovider "${par[@]}" --junitxml="$OUT/kern_pytest.xml" \
  tests/test_decode_int8.py -k "value_dither or impl_choice or pv_operands or static_pools or fp32_pools" \
  tests/test_gate_fixed.py tests/test_decode_bf16.py > "$OUT/kern_pytest.log" 2>&1
rc=$?
tail -n 15 "$OUT/kern_pytest.log"
[ $rc = 0 ] || fails+=("pytest(rc=$rc)")

echo "$(el) 3. ncu"
NCU=$(command -v ncu || true)
[ -z "$NCU" ] && for c in /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu; do [ -x "$c" ] && NCU=$c && break; done
if [ -z "$NCU" ]; then
  echo "SKIP ncu: not found (PATH, /usr/local/cuda*/bin)"
else
  TGT="$(mktemp -d)/kern_ncu_target.py"
  cat > "$TGT" <<'PYEOF'
# warm (compile) each kernel once, then one more launch each: ncu -s 2 -c 2 profiles the second pair
import math
import torch
from kvlib.kernels.int8 import wspec as W
from kvlib.kernels.int8.decode import decode_int8
from kvlib.kernels.int8.request import PoolSide

B, S, HQ, HKV, D, BS = 32, 16384, 28, 4, 128, 16
g = torch.Generator(device="cuda").manual_seed(0)
nb = B * S // BS + 64
kc, ks = W.rtn_pages(torch.randn(nb * BS, HKV, D, generator=g, device="cuda"), BS)
vc, vs = W.rtn_pages(torch.randn(nb * BS, HKV, D, generator=g, device="cuda"), BS)
mb = S // BS
bt = torch.zeros(B, -(-mb // 16) * 16, dtype=torch.int32, device="cuda")
bt[:, :mb] = torch.randperm(nb, generator=g, device="cuda")[: B * mb].view(B, mb).to(torch.int32)
q = (1.5 * torch.randn(B, HQ, D, generator=g, device="cuda")).to(torch.bfloat16)
seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
cfg = W.WSpecConfig(block_n=128, ring=3, prmt=True, vfold=True, prefetch=True)
mk = lambda c, s: PoolSide(c.view(nb * BS, HKV, D), s.view(nb * BS, HKV, D // 32), group=32,  # noqa: E731
                           dither_layout="h8", dithered=False)
kp, vp = mk(kc, ks), mk(vc, vs)
for _ in range(2):
    o_new, _l = W.wspec_decode(q, kc, ks, vc, vs, bt, seq, config=cfg)
    old = decode_int8(q, kp, vp, None, seq, layer=0, seed=0, cert=False, impl="gluon", block_table=bt, block_size=BS)
    torch.cuda.synchronize()
assert old.path == "gluon", old.path
print(f"ncu target: max |o_wspec - o_gluon| = {(o_new - old.o).abs().max().item():.3g} (the same RTN pages)")
PYEOF
  secs=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
        --section SchedulerStats)
  timeout 55 "$NCU" --clock-control none -k 'regex:_wspec_stage1|_stage1_g8' -s 2 -c 2 "${secs[@]}" -f -o "$OUT/kern_ncu" \
    "$PY" "$TGT" > "$OUT/kern_ncu.log" 2>&1
  rc=$?
  tail -n 4 "$OUT/kern_ncu.log"
  if [ $rc = 0 ] && [ -f "$OUT/kern_ncu.ncu-rep" ]; then
    "$NCU" -i "$OUT/kern_ncu.ncu-rep" --page details --csv > "$OUT/kern_ncu_details.csv" 2>/dev/null
    "$PY" - "$OUT/kern_ncu_details.csv" <<'PYEOF'
import csv, sys
want = ("Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy", "Theoretical Occupancy",
        "Registers Per Thread", "Warp Cycles Per Issued Instruction", "Eligible Warps Per Scheduler",
        "Active Warps Per Scheduler", "No Eligible", "Issue Slots Busy")
rows = {}
for r in csv.DictReader(open(sys.argv[1])):
    if r.get("Metric Name") in want:
        k = r["Kernel Name"].split("(")[0]
        rows.setdefault(k, {})[r["Metric Name"]] = f"{r['Metric Value']} {r.get('Metric Unit', '')}".strip()
for k, m in rows.items():
    print(f"ncu {k}:")
    for name in want:
        if name in m:
            print(f"    {name:36s} {m[name]}")
PYEOF
  else
    fails+=("ncu(rc=$rc)")
    grep -m5 -iE "error|==ERR|warn" "$OUT/kern_ncu.log"
  fi
fi

(cd "$OUT" && tar czf kern.tar.gz --exclude=kern.tar.gz ./*) && echo "$(el) wrote $OUT/kern.tar.gz"
if [ ${#fails[@]} = 0 ]; then echo "kern: PASS $(el)"; else echo "kern: FAIL ${fails[*]} $(el)"; exit 1; fi
