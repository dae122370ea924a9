#!/usr/bin/env bash
# Issue 41: GRPO with bf16 / kv4 / kv4rl rollout pools on the continuous engine (asynchronous partial collection, the
# long task, ONE KV byte budget), every (arm, seed) trained to the same iteration: `python -m dev.rlvr_async run`.
#
#   KVLIB_COMMIT=<full commit of a clean tree> bash dev/gpu/rlvr_async.sh [extra dev.rlvr_async arguments]
#
# One device call of at most 10 minutes advances every unfinished run from its checkpoint (RLVR_ASYNC_CKPT, default
# /tmp/kvlib_rlvr_async_ckpt on the machine's disk: a later call must come on the SAME warm machine, within its
# 30 s warm window; checkpoints are far too large to travel back) by whole iterations until RLVR_ASYNC_BUDGET_S
# (default 540 s after start; an iteration starts only if 1.3x the run's slowest one fits), then the python is
# killed at RLVR_ASYNC_KILL_S (default 565 s; its runs keep their last checkpoint). Exit 0 once every run reached
# --iterations and has its final evaluation, 3 while runs continue in the next call, 2 when the memory plan refuses.
# One worker per GPU (RLVR_ASYNC_GPUS, default every GPU nvidia-smi lists): the seeds s % K == i on GPU i, all arms of
# a seed there, one run at a time (its iteration times are its own). The plan (memory, pools, quota) is printed and
# checked before anything trains.
# Needs the SmolLM2 GGUF (carry .carry/smol, or the halves .carry/smolA + .carry/smolB) and .whl/gguf-*.whl.
# Back come $OUT/rlvr_async.tar.gz (per-run JSONs with every iteration's record, plan.json, initial_eval.json, logs:
# unpack with `tar xzf` and copy rlvr_async/*.json to data/results/gpu/rlvr_async/) and $OUT/rlvr_async_summary.json
# (dev.rlvr_async summarize: cumulative times, speedups, paired accuracy differences, the rules' measures).
set -uo pipefail
start=$(date +%s)
OUT=${OUT:-/tmp/rlvr_async_out}
mkdir -p "$OUT/rlvr_async"
[ -n "${KVLIB_COMMIT:-}" ] || { echo "rlvr_async: FAIL: set KVLIB_COMMIT (a result records its commit)"; exit 2; }
. dev/gpu/smollm2_env.sh
smollm2_gguf "${RLVR_GGUF:-.carry/smol/SmolLM2-135M-Instruct.Q4_1.gguf}" || exit 2
smollm2_site || exit 2
GPUS=${RLVR_ASYNC_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$GPUS" -ge 1 ] || GPUS=1
CK=${RLVR_ASYNC_CKPT:-/tmp/kvlib_rlvr_async_ckpt}
mkdir -p "$CK"
echo "checkpoints in $CK: $(ls "$CK" 2>/dev/null | tr '\n' ' ')"
PY=${PYTHON:-python3}
budget=$(( ${RLVR_ASYNC_BUDGET_S:-540} - ($(date +%s) - start) ))
timeout -k 5 $(( ${RLVR_ASYNC_KILL_S:-565} - ($(date +%s) - start) )) $PY -m dev.rlvr_async run --out "$OUT" \
  --ckpt-dir "$CK" --gguf "$GGUF" --gpus "$GPUS" --budget-s "$budget" "$@" 2>&1 | tee "$OUT/rlvr_async/run.log"
rc=${PIPESTATUS[0]}
$PY -m dev.rlvr_async summary --out "$OUT" "$@" > "$OUT/rlvr_async_summary.json" 2> "$OUT/rlvr_async/summary.err" \
  || echo "summary: failed (see summary.err in the archive)"
tar czf "$OUT/rlvr_async.tar.gz" -C "$OUT" rlvr_async && rm -rf "$OUT/rlvr_async"
tar tzvf "$OUT/rlvr_async.tar.gz" | awk '{print $3, $6}'
echo "wall $(( $(date +%s) - start )) s, rc=$rc (0: all runs complete; 3: continue with the next call on this machine; 124: hard stop)"
case "$rc" in
  0) echo "PASS: rlvr_async (all runs at the target iteration)";;
  3) echo "PARTIAL: rlvr_async (runs continue from their checkpoints in the next call)";;
  *) echo "FAIL: rlvr_async (rc=$rc)";;
esac
exit "$rc"
