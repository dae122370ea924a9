#!/usr/bin/env bash
# GPU check for the INT4 kernel family (kern4): kv4_paged_decode timed beside the contiguous kv4_main_decode
# at B=32, S=16k, Hq=28, Hkv=4, d=128 (CUDA graphs, interleaved rounds; prints paged/contiguous per page size),
# then the KV4 kernel tests on CUDA (every kernel test, the gpu-marked ones included).
# Run from the repo root; results in $OUT/. Under 4 minutes (70 s + 150 s limits).
set -u
OUT="${OUT:-/tmp/kern4_out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
unset TRITON_INTERPRET
status=0

timeout 70 "$PY" -m dev.kv4_paged_probe "$OUT/kern4_paged_timing.json" 2>&1 | tee "$OUT/kern4_paged_timing.log"
probe_rc=${PIPESTATUS[0]}
[ "$probe_rc" -eq 0 ] || status=1

timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py -rs --junitxml="$OUT/kern4_tests.xml" \
  2>&1 | tee "$OUT/kern4_tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] || status=1

echo "kern4 summary: tests/test_kv4_kernels.py on CUDA rc=$tests_rc ($([ "$tests_rc" -eq 0 ] && echo PASS || echo FAIL));" \
  "paged vs contiguous timing rc=$probe_rc ($([ "$probe_rc" -eq 0 ] && echo PASS || echo FAIL))"
[ "$status" -eq 0 ] && echo "PASS kern4" || echo "FAIL kern4"
exit "$status"
