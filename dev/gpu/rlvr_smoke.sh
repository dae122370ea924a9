#!/usr/bin/env bash
# GRPO loop smoke on one H200 with SmolLM2-135M (kvlib.rl, issue 27): a bf16 calibration rollout (response
# length / accuracy by chain length), 3 GRPO iterations (bf16 rollout copy + DynamicCache, fp32 learner),
# then the sampler-learner KL of one rollout per cache format that kvlib.make_cache can build today.
# Expected well under 3 minutes; parts past --budget-s (150 s) are skipped and say so. JSON to $OUT/rlvr_smoke.json.
set -uo pipefail
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/rlvr_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
start=$(date +%s)
$PY -m kvlib.rl.smoke --out "$OUT" --iterations 3 --max-new-tokens 384 --budget-s 150 2>&1 | tee "$OUT/rlvr_smoke.log"
rc=${PIPESTATUS[0]}
echo "wall $(( $(date +%s) - start )) s, rc=$rc"
if [ "$rc" -eq 0 ] && [ -f "$OUT/rlvr_smoke.json" ]; then echo "PASS: rlvr smoke"; else echo "FAIL: rlvr smoke (rc=$rc)"; fi
exit "$rc"
