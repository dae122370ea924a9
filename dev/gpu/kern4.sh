#!/usr/bin/env bash
# GPU check for the INT4 kernel family (kern4):
# 1. dev.kv4_paged_probe: kv4_paged_decode timed beside the contiguous kv4_main_decode at B=32, S=16k, Hq=28,
#    Hkv=4, d=128 (CUDA graphs, interleaved rounds; prints paged/contiguous per page size; JSON in $OUT);
# 2. tests/test_kv4_kernels.py on CUDA (every kernel test, the gpu-marked ones included), in parallel shards:
#    the run is bound by Triton compiles (one per kernel variant), which a single process does one at a time.
# Run from the repo root. Under 4 minutes (limits 100 s + 120 s).
set -u
OUT="${OUT:-/tmp/kern4_out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
unset TRITON_INTERPRET
SHARDS="${SHARDS:-8}"

timeout 100 "$PY" -m dev.kv4_paged_probe "$OUT/kern4_paged_timing.json" 2>&1 | tee "$OUT/kern4_paged_timing.log"
probe_rc=${PIPESTATUS[0]}

tmp=$(mktemp -d)
"$PY" -m pytest -q -p no:cacheprovider --collect-only tests/test_kv4_kernels.py 2>/dev/null | grep '::' > "$tmp/ids"
n_ids=$(wc -l < "$tmp/ids")
awk -v n="$SHARDS" -v d="$tmp" '{ print > (d "/shard" (NR % n)) }' "$tmp/ids"
pids=()
for f in "$tmp"/shard*; do
  i=${f##*shard}
  mapfile -t ids < "$f"
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/kern4_tests_$i.xml" "${ids[@]}" \
    > "$OUT/kern4_tests_$i.log" 2>&1 &
  pids+=($!)
done
tests_rc=0
for p in "${pids[@]}"; do wait "$p" || tests_rc=1; done
for f in "$OUT"/kern4_tests_*.log; do tail -n 4 "$f"; done
grep -h "^FAILED\|^ERROR" "$OUT"/kern4_tests_*.log | head -40
[ "$n_ids" -gt 0 ] || tests_rc=1
rm -rf "$tmp"

echo "kern4 summary: paged vs contiguous timing rc=$probe_rc ($([ "$probe_rc" -eq 0 ] && echo PASS || echo FAIL));" \
  "tests/test_kv4_kernels.py on CUDA, $n_ids tests in $SHARDS shards: $([ "$tests_rc" -eq 0 ] && echo PASS || echo FAIL)"
if [ "$probe_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]; then echo "PASS kern4"; exit 0; fi
echo "FAIL kern4"
exit 1
