#!/usr/bin/env bash
# GPU check for the INT4 kernel family (kern4):
# 1. dev.kv4_paged_vs_contiguous: at B=32, S=16k, Hq=28, Hkv=4, d=128 (CUDA graphs, interleaved rounds), KV4 and KV4-RL:
#    contiguous kv4_main_decode beside kv4_paged_decode at block_size 256 (path "paged-tiles": one page-table entry
#    per 256-position tile) and 16 (path "paged-rows": one per position); prints each path and paged/contiguous;
#    JSON in $OUT/kern4_paged_timing.json;
# 2. tests/test_kv4_kernels.py on CUDA with pytest-xdist (-n 8; every kernel test, the gpu-marked ones included).
# Run from the repo root. Under 3 minutes (limits 70 s + 100 s).
set -u
OUT="${OUT:-/tmp/kern4_out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
unset TRITON_INTERPRET

timeout 70 "$PY" -m dev.kv4_paged_vs_contiguous "$OUT/kern4_paged_timing.json" 2>&1 | tee "$OUT/kern4_paged_timing.log"
probe_rc=${PIPESTATUS[0]}

timeout 100 "$PY" -m pytest -q -n 8 -p no:cacheprovider -rs --junitxml="$OUT/kern4_tests.xml" tests/test_kv4_kernels.py \
  > "$OUT/kern4_tests.log" 2>&1
tests_rc=$?
tail -n 15 "$OUT/kern4_tests.log"
grep -h "^FAILED\|^ERROR" "$OUT/kern4_tests.log" | head -40

echo "kern4 summary: contiguous vs paged-tiles (bs 256) vs paged-rows (bs 16) timing rc=$probe_rc" \
  "($([ "$probe_rc" -eq 0 ] && echo PASS || echo FAIL)); tests/test_kv4_kernels.py -n 8 on CUDA rc=$tests_rc" \
  "($([ "$tests_rc" -eq 0 ] && echo PASS || echo FAIL))"
if [ "$probe_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]; then echo "PASS kern4"; exit 0; fi
echo "FAIL kern4"
exit 1
