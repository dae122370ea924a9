#!/usr/bin/env bash
# Issue 28, the chapters' run: the warp-specialised kernels beside the old ones, where the time goes, and the
# dispatcher on the GPU. One warm H200 call, < 9.5 min; set KVLIB_COMMIT to the clean tree's commit.
#  1. python -m kvlib.bench wspec_decode --profile gpu  -> data/results/gpu/wspec_decode.json (copied to $OUT)
#  2. ncu (SpeedOfLight, MemoryWorkloadAnalysis, ComputeWorkloadAnalysis, SchedulerStats, WarpStateStats,
#     LaunchStats, Occupancy) of one warm launch each of the dispatched certified INT8 kernel (wspec_cert), the old
#     Gluon kernel, the KV4 wspec4 kernel and the Triton paged KV4 kernel at B=32, S=16k, 28/4 heads, d=128,
#     summarised by dev.ncu_summary -> $OUT/wspec_ncu.json (the CSVs in $OUT/wspec_ncu.tar.gz)
#  3. the GPU tests of tests/test_dispatch_wspec.py (junit in $OUT)
set -u
OUT="${OUT:-/tmp/wspec_final_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
el() { echo "[$(( $(date +%s) - T0 ))s]"; }
left() { echo $(( ${WSPEC_FINAL_BUDGET_S:-555} - ($(date +%s) - T0) )); }
fails=()

echo "$(el) 1. bench wspec_decode"
timeout 300 "$PY" -m kvlib.bench wspec_decode --profile gpu 2>&1 | tail -30
[ "${PIPESTATUS[0]}" = 0 ] || fails+=("bench")
cp data/results/gpu/wspec_decode.json "$OUT/" 2>/dev/null || fails+=("bench-file")

echo "$(el) 2. ncu"
NCU=$(command -v ncu || true)
[ -z "$NCU" ] && for c in /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu; do [ -x "$c" ] && NCU=$c && break; done
NDIR="$OUT/ncu"
mkdir -p "$NDIR"
labels=()
if [ -z "$NCU" ]; then
  echo "SKIP ncu: not found"; fails+=("ncu-missing")
else
  secs=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
        --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy)
  for pair in wspec_cert:_wspec_cert_stage1 gluon:_stage1_g8 wspec4:_wspec4_stage1 kv4_paged:_kv4_paged_kernel; do
    kind=${pair%%:*}; kern=${pair#*:}
    if [ "$(left)" -lt 150 ]; then echo "SKIP ncu $kind (time)"; continue; fi
    timeout 45 "$NCU" --clock-control none -k "regex:$kern" -s 2 -c 1 "${secs[@]}" -f -o "$NDIR/$kind" \
      "$PY" -m dev.ncu_target "$kind" 32 16384 > "$NDIR/$kind.log" 2>&1
    rc=$?
    if [ $rc = 0 ] && [ -f "$NDIR/$kind.ncu-rep" ]; then
      "$NCU" -i "$NDIR/$kind.ncu-rep" --page details --csv > "$NDIR/${kind}_details.csv" 2>/dev/null
      labels+=("$kind=$NDIR/$kind")
      echo "$(el)    ncu $kind ok"
    else
      echo "$(el)    ncu $kind rc=$rc"; tail -n 5 "$NDIR/$kind.log"; fails+=("ncu-$kind")
    fi
  done
  if [ ${#labels[@]} -gt 0 ]; then
    "$PY" -m dev.ncu_summary "$OUT/wspec_ncu.json" "${labels[@]}" --commit "${KVLIB_COMMIT:-unknown}" \
      --started "$STARTED" --command "bash dev/gpu/wspec_final.sh (ncu step: python -m dev.ncu_target KIND 32 16384)" \
      --tool "ncu ($("$NCU" --version | tail -1); --clock-control none; sections ${secs[*]//--section /})" \
      || fails+=("ncu-summary")
  fi
  tar -czf "$OUT/wspec_ncu.tar.gz" -C "$NDIR" $(cd "$NDIR" && ls *.csv *.log 2>/dev/null) 2>/dev/null
  rm -rf "$NDIR"
fi

echo "$(el) 3. GPU tests of the dispatcher"
t=$(left); [ "$t" -gt 150 ] && t=150
if [ "$t" -gt 30 ]; then
  timeout "$t" "$PY" -m pytest -q -p no:cacheprovider -n 8 tests/test_dispatch_wspec.py \
    --junitxml="$OUT/dispatch_tests.xml" -rf 2>&1 | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || fails+=("tests")
else
  fails+=("tests-skipped")
fi
echo "wspec_final: $([ ${#fails[@]} = 0 ] && echo PASS || echo "FAIL ${fails[*]}") after $(( $(date +%s) - T0 ))s"
