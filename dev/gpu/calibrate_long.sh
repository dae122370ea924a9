#!/usr/bin/env bash
# Issue 39 item 4 / issue 41: calibrate the long task on the GPU in one device call: `python -m dev.calibrate_long_gpu`
# over its declared grid (dev/results/README.md, "GPU calibration of the long task: grid and rule"), SmolLM2-135M in
# bf16, temperature 1, kvlib's continuous engine; the selection rule runs on the rows.
#
#   KVLIB_COMMIT=<full commit of a clean tree> bash dev/gpu/calibrate_long.sh [extra dev.calibrate_long_gpu arguments]
#
# No candidate starts after CAL_DEADLINE_S (default 470 s after start) unless it fits; the python is killed at
# CAL_KILL_S (default 530 s). The JSON is rewritten after every candidate, so a killed run keeps what it measured.
# Needs the SmolLM2 GGUF (carry .carry/smol, or the halves .carry/smolA + .carry/smolB) and .whl/gguf-*.whl.
# Back come $OUT/calibrate_long_gpu.json (copy to dev/results/calibrate_long/gpu_grid.json) and $OUT/calibrate.log.
set -uo pipefail
start=$(date +%s)
OUT=${OUT:-/tmp/calibrate_long_out}
mkdir -p "$OUT"
[ -n "${KVLIB_COMMIT:-}" ] || { echo "calibrate_long: FAIL: set KVLIB_COMMIT (a result records its commit)"; exit 2; }
. dev/gpu/smollm2_env.sh
smollm2_gguf "${CAL_GGUF:-.carry/smol/SmolLM2-135M-Instruct.Q4_1.gguf}" || exit 2
smollm2_site || exit 2
PY=${PYTHON:-python3}
deadline=$(( ${CAL_DEADLINE_S:-470} - ($(date +%s) - start) ))
timeout -k 5 $(( ${CAL_KILL_S:-530} - ($(date +%s) - start) )) $PY -m dev.calibrate_long_gpu \
  --out "$OUT/calibrate_long_gpu.json" --gguf "$GGUF" --device cuda --deadline-s "$deadline" "$@" \
  2>&1 | tee "$OUT/calibrate.log"
rc=${PIPESTATUS[0]}
echo "wall $(( $(date +%s) - start )) s, rc=$rc"
if [ -f "$OUT/calibrate_long_gpu.json" ]; then
  $PY - "$OUT/calibrate_long_gpu.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if r.get("skipped") or r.get("error"):
        print(f"{r['name']:48s} {'SKIPPED' if r.get('skipped') else 'ERROR'} ({r.get('skipped') or r.get('error')})")
        continue
    print(f"{r['name']:48s} acc {r['accuracy']:.3f} [{r['wilson95'][0]:.3f}, {r['wilson95'][1]:.3f}] n {r['n']} "
          f"tokens {r['response_tokens_mean']:.0f} held-out {r['space']['heldout']}"
          f"{'' if r['space']['exact'] else '+'} step {r['step_accuracy']:.3f} {r['seconds']:.0f} s "
          f"{r['sampler']['engine']}; greedy {r['greedy_correct']}/{r['greedy_n']}")
s = d["selection"]
print(f"selection: chosen {s['chosen']!r}, nearest {s['nearest']!r}; continuous engine error: "
      f"{d.get('continuous_engine_error')}")
PY
fi
case "$rc" in
  0) echo "PASS: calibrate_long";;
  *) echo "FAIL: calibrate_long (rc=$rc; the JSON keeps the candidates measured before the stop)";;
esac
exit "$rc"
