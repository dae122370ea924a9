#!/usr/bin/env bash
# Issue 28, "open GPU-only bug": the tc INT8 kernel's value-dither path (removed at b7182e0, H200 max |do| 3.3).
# Restores it in a scratch kernel (dev/vdither_kernel.py), bisects it against the float64 reference on the GPU
# (dev/vdither.py: dither loaded vs regenerated, stored dither vs torch, values/keys only, stages, warps, block_n,
# d, splits, large slots), then compute-sanitizer memcheck and racecheck on one tiny launch. < 3 min.
# Writes $OUT/vdither.json and $OUT/vdither_{memcheck,racecheck}.log; prints PASS/FAIL lines and a diagnosis.
set -u
OUT=${OUT:-/tmp/vdither_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}:.
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
status=0
timeout 85 $PY -m dev.vdither --json "$OUT/vdither.json" || { echo "FAIL vdither bisect (rc=$?)"; status=1; }

CS=${COMPUTE_SANITIZER_BIN:-$(command -v compute-sanitizer || true)}
[ -z "$CS" ] && for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
  [ -x "$c" ] && CS=$c && break; done
if [ -z "$CS" ]; then
  echo "SKIP compute-sanitizer: not found (PATH, /usr/local/cuda*/bin)"
else
  FILTER=(--kernel-name kns=_tc_vd)  # kns = kernel-name substring: keeps torch's own kernels out
  for tool in memcheck racecheck; do
    log="$OUT/vdither_$tool.log"
    timeout 30 "$CS" --tool "$tool" "${FILTER[@]}" --error-exitcode 9 --print-limit 20 \
      --log-file "$log" $PY -m dev.vdither --sanitize > "$OUT/vdither_${tool}_stdout.txt" 2>&1
    rc=$?
    if [ ${#FILTER[@]} -gt 0 ] && ! grep -q "SUMMARY" "$log" 2>/dev/null; then  # said, then once unfiltered
      echo "$tool: no summary with ${FILTER[*]} (rc=$rc); rerunning without the kernel filter"
      FILTER=()
      timeout 20 "$CS" --tool "$tool" --error-exitcode 9 --print-limit 20 --log-file "$log" \
        $PY -m dev.vdither --sanitize > "$OUT/vdither_${tool}_stdout.txt" 2>&1
      rc=$?
    fi
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$log" 2>/dev/null | head -3 | tr '\n' ' ')
    echo "$tool rc=$rc (9: errors found, 124: timed out) ${summary:-(no summary; see $log)}"
    grep -m3 -E "Invalid|Race|hazard|Error" "$log" 2>/dev/null | sed 's/^/    /'
    tail -n 2 "$OUT/vdither_${tool}_stdout.txt" | sed 's/^/    stdout: /'
  done
fi
if [ $status -eq 0 ]; then echo "PASS vdither (the diagnosis above says whether the bug reproduced)"; fi
exit $status
