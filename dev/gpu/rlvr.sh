#!/usr/bin/env bash
# GRPO with bf16 / kv4 / kv4rl rollouts on one H200 (issue 27): `python -m dev.rlvr_runs all`, one device call of
# at most 10 minutes (defaults sized for ~570 s calls). Needs the SmolLM2 GGUF (carry .carry/smol; or the two halves .carry/smolA + .carry/smolB, or a
# stash of dev/gpu/smollm2.sh in /tmp/kvlib_smol) and .whl/gguf-*.whl (accelerate too when it is there).
# Phases: the task setting (committed: kvlib.rl.task.DIFFICULTY, calibrated on the CPU; --calibrate redoes it on
# the GPU), isolated rollout timing (~30 s; skipped when timing.json is committed), then one concurrent process per
# (arm, seed) not yet in data/results/gpu/rlvr/ (RLVR_SEEDS new seeds per arm, default 3), each under an equal
# CUDA memory cap (set_per_process_memory_fraction), its memory estimate printed and its peak logged per iteration.
# Everything the runs write goes into ONE archive $OUT/rlvr.tar.gz (the device returns few files), plus
# $OUT/rlvr_summary.json; unpack with `tar xzf rlvr.tar.gz` and copy rlvr/*.json to data/results/gpu/rlvr/.
# Hard stops: the runs finish by RLVR_BUDGET_S (default 540 s after start; each keeps its final evaluation and last
# checkpoint inside it) and the python is killed at RLVR_KILL_S (default 565 s); archiving follows (~5 s).
# Runs spanning calls: RLVR_CKPT=DIR checkpoints every run in DIR (weights, optimizer, RNGs, history; every
# RLVR_CKPT_EVERY iterations, default 10, and at the deadline), plus calibration/timing/initial evaluation. A following
# call on the same warm machine with RLVR_CKPT=DIR RLVR_RESUME=1 continues every checkpointed run to its own budget
# (timing and the initial evaluation are not repeated; no checkpoint there: FAIL, no fresh runs). E.g.
#   call B: RLVR_CKPT=/tmp/kvlib_rlvr_ckpt bash dev/gpu/rlvr.sh
#   call C: RLVR_CKPT=/tmp/kvlib_rlvr_ckpt RLVR_RESUME=1 bash dev/gpu/rlvr.sh
# Each run's JSON lists its segments (one per call) with the commit of each; set KVLIB_COMMIT (the tree travels
# without .git).
# Extra arguments go to dev.rlvr_runs (e.g. --force, --lr 5e-6). CPU proof of the script: RLVR_DEVICE=cpu with --tiny.
# DAPO dynamic sampling (default off): --dynamic-sampling --target-groups T --max-sampling-rounds R (rounds of
# --prompts prompts; only groups with mixed rewards are trained on); the recommended chain (settings and the
# arithmetic behind them) is in dev/results/README.md, "DAPO dynamic sampling for the next GRPO run".
set -uo pipefail
start=$(date +%s)
OUT=${OUT:-/tmp/rlvr_out}
mkdir -p "$OUT/rlvr"
. dev/gpu/smollm2_env.sh
smollm2_gguf "${RLVR_GGUF:-.carry/smol/SmolLM2-135M-Instruct.Q4_1.gguf}" || exit 2
md5sum "$GGUF"
smollm2_site || exit 2
PY=${PYTHON:-python3}
budget=$(( ${RLVR_BUDGET_S:-540} - ($(date +%s) - start) ))
CK=()
if [ -n "${RLVR_CKPT:-}" ]; then
  CK=(--ckpt-dir "$RLVR_CKPT" --ckpt-every "${RLVR_CKPT_EVERY:-10}")
  [ "${RLVR_RESUME:-0}" = 1 ] && CK+=(--resume)
  echo "checkpoints: $RLVR_CKPT (resume ${RLVR_RESUME:-0}); there now: $(ls "$RLVR_CKPT" 2>/dev/null | tr '\n' ' ')"
elif [ "${RLVR_RESUME:-0}" = 1 ]; then
  echo "FAIL: RLVR_RESUME=1 needs RLVR_CKPT=DIR"; exit 2
fi
timeout -k 5 $(( ${RLVR_KILL_S:-565} - ($(date +%s) - start) )) $PY -m dev.rlvr_runs all --out "$OUT" --gguf "$GGUF" --device "${RLVR_DEVICE:-cuda}" \
  --budget-s "$budget" --n-seeds "${RLVR_SEEDS:-3}" "${CK[@]}" "$@" 2>&1 | tee "$OUT/rlvr/rlvr.log"
rc=${PIPESTATUS[0]}
ls -la "$OUT/rlvr" | tail -n +2
# one archive (JSONs, logs) and a small summary next to it: the device sends back at most 8 files
tar czf "$OUT/rlvr.tar.gz" -C "$OUT" rlvr && rm -rf "$OUT/rlvr"
tar tzvf "$OUT/rlvr.tar.gz" | awk '{print $3, $6}'
$PY - "$OUT" <<'PYEOF' || true
import io, json, sys, tarfile
out = sys.argv[1]
summ = {}
with tarfile.open(f"{out}/rlvr.tar.gz") as t:
    for m in t.getmembers():
        if m.name.endswith(".json") and "_seed" in m.name:
            r = json.load(io.TextIOWrapper(t.extractfile(m)))
            h, ev = r.get("history", {}), r.get("eval", {})
            summ[m.name] = {"status": r.get("status"), "iterations": r.get("iterations_done"),
                            "segments": [(s.get("commit"), s.get("first_iteration"), s.get("iterations"))
                                         for s in r.get("segments", [])],
                            "reward": h.get("reward_mean"), "peak_gib": h.get("max_memory_allocated_gib"),
                            "dyn_kept_rounds": list(zip(h.get("dyn_groups_kept", []), h.get("dyn_sampling_rounds", []))),
                            "held_out": [ev.get("initial", {}).get("accuracy"), ev.get("final", {}).get("accuracy")]}
json.dump(summ, open(f"{out}/rlvr_summary.json", "w"), indent=1)
print(f"summary of {len(summ)} runs in {out}/rlvr_summary.json")
PYEOF
echo "wall $(( $(date +%s) - start )) s, rc=$rc (124: hard stop; the runs' last per-iteration JSONs are partial)"
if [ "$rc" -eq 0 ]; then echo "PASS: rlvr"; else echo "FAIL: rlvr (rc=$rc)"; fi
exit "$rc"
