#!/usr/bin/env bash
# Regenerate GPU benchmark topics from the current kernels in one device call (issue 40, item 2). Each topic runs
# in its own process under a timeout, in the order given (most important first); a topic whose expected seconds no
# longer fit before the deadline is skipped, and the line says so. The fresh data/results/gpu/*.json come back as
# $OUT/results.tgz, the logs as $OUT/logs.tgz.
#
#   KVLIB_COMMIT=<full commit of a clean tree> bash dev/gpu/refresh.sh DEADLINE_S topic:expected_s ...
set -uo pipefail
OUT=${OUT:-/tmp/refresh_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
[ -n "${KVLIB_COMMIT:-}" ] || { echo "refresh: FAIL: set KVLIB_COMMIT (a result records its commit)"; exit 2; }
deadline=$(( $(date +%s) + ${1:?deadline seconds} )); shift
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
touch "$OUT/.start"
for spec in "$@"; do
  t=${spec%%:*}; need=${spec##*:}
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt "$need" ]; then echo "refresh: $t SKIPPED (expects ~${need} s, ${left} s left)"; continue; fi
  s=$(date +%s)
  timeout -s INT -k 15 "$left" python3 -m kvlib.bench --profile gpu "$t" > "$OUT/$t.log" 2>&1
  rc=$?
  echo "refresh: $t rc=$rc $(( $(date +%s) - s )) s"
  [ "$rc" -ne 0 ] && tail -n 6 "$OUT/$t.log" | tr '\r' '\n' | tail -n 6 | cut -c1-220
done
(cd data/results/gpu && find . -maxdepth 1 -name '*.json' -newer "$OUT/.start" | tar czf "$OUT/results.tgz" -T -)
(cd "$OUT" && tar czf logs.tgz ./*.log 2>/dev/null; rm -f ./*.log)
tar tzf "$OUT/results.tgz"
