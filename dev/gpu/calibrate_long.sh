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
GGUF=${CAL_GGUF:-.carry/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$GGUF" ]; then  # reassemble from halves (64 MiB per carry), as dev/gpu/rlvr_async.sh does
  STASH=/tmp/kvlib_smol; mkdir -p "$STASH"
  [ -f .carry/smolA/part00 ] && cp .carry/smolA/part00 "$STASH/"
  [ -f .carry/smolB/part01 ] && cp .carry/smolB/part01 "$STASH/"
  if [ -f "$STASH/part00" ] && [ -f "$STASH/part01" ]; then
    GGUF=/tmp/kvlib_smol/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$GGUF" ] || cat "$STASH/part00" "$STASH/part01" > "$GGUF"
  else
    echo "FAIL: no GGUF (.carry/smol/SmolLM2-135M-Instruct.Q4_1.gguf or the halves .carry/smolA, .carry/smolB)"; exit 2
  fi
fi
SITE=/tmp/site; mkdir -p "$SITE"
for w in .whl/gguf-*.whl .whl/accelerate-*.whl; do
  [ -f "$w" ] && { python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w" || exit 2; }
done
export PYTHONPATH="$PWD:$SITE" KVLIB_CACHE_DIR=/tmp/kvlib_cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export KVLIB_RL_SITE=/tmp/kvlib_rl_site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
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
