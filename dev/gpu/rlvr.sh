#!/usr/bin/env bash
# GRPO with bf16 / kv4 / kv4rl rollouts on one H200 (issue 27): `python -m kvlib.rl.run all`, one device call of
# at most 6 minutes. Needs the SmolLM2 GGUF (carry .carry/smol; or the two halves .carry/smolA + .carry/smolB, or a
# stash of dev/gpu/smollm2.sh in /tmp/kvlib_smol) and .whl/gguf-*.whl (accelerate too when it is there).
# Phases: the task setting (committed: kvlib.rl.task.DIFFICULTY, calibrated on the CPU; --calibrate redoes it on
# the GPU), isolated rollout timing (~30 s; skipped when timing.json is committed), then one concurrent process per
# (arm, seed) not yet in data/results/gpu/rlvr/ (RLVR_SEEDS new seeds per arm, default 3), each under an equal
# CUDA memory cap (set_per_process_memory_fraction), its memory estimate printed and its peak logged per iteration.
# Everything the runs write goes into ONE archive $OUT/rlvr.tar.gz (the device returns few files), plus
# $OUT/rlvr_summary.json; unpack with `tar xzf rlvr.tar.gz` and copy rlvr/*.json to data/results/gpu/rlvr/.
# Hard stops: the runs finish by RLVR_BUDGET_S (default 330 s after start) and the python is killed at 350 s.
# Extra arguments go to kvlib.rl.run (e.g. --force, --lr 5e-6). CPU proof of the script: RLVR_DEVICE=cpu with --tiny.
set -uo pipefail
start=$(date +%s)
OUT=${OUT:-/tmp/rlvr_out}
mkdir -p "$OUT/rlvr"
GGUF=${RLVR_GGUF:-.carry/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$GGUF" ]; then  # reassemble from halves (64 MiB per carry)
  STASH=/tmp/kvlib_smol; mkdir -p "$STASH"
  [ -f .carry/smolA/part00 ] && cp .carry/smolA/part00 "$STASH/"
  [ -f .carry/smolB/part01 ] && cp .carry/smolB/part01 "$STASH/"
  if [ -f "$STASH/part00" ] && [ -f "$STASH/part01" ]; then
    GGUF=/tmp/kvlib_smol/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$STASH/part00" "$STASH/part01" > "$GGUF"
  else
    echo "FAIL: no GGUF (.carry/smol/SmolLM2-135M-Instruct.Q4_1.gguf or the halves .carry/smolA, .carry/smolB)"; exit 2
  fi
fi
md5sum "$GGUF"
SITE=/tmp/site; mkdir -p "$SITE"
for w in .whl/gguf-*.whl .whl/accelerate-*.whl; do
  [ -f "$w" ] && { python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w" || exit 2; }
done
export PYTHONPATH="$PWD:$SITE" KVLIB_CACHE_DIR=/tmp/kvlib_cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export KVLIB_RL_SITE=/tmp/kvlib_rl_site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
PY=${PYTHON:-python3}
budget=$(( ${RLVR_BUDGET_S:-330} - ($(date +%s) - start) ))
timeout -k 5 $(( ${RLVR_KILL_S:-350} - ($(date +%s) - start) )) $PY -m kvlib.rl.run all --out "$OUT" --gguf "$GGUF" --device "${RLVR_DEVICE:-cuda}" \
  --budget-s "$budget" --n-seeds "${RLVR_SEEDS:-3}" "$@" 2>&1 | tee "$OUT/rlvr/rlvr.log"
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
                            "reward": h.get("reward_mean"), "peak_gib": h.get("max_memory_allocated_gib"),
                            "held_out": [ev.get("initial", {}).get("accuracy"), ev.get("final", {}).get("accuracy")]}
json.dump(summ, open(f"{out}/rlvr_summary.json", "w"), indent=1)
print(f"summary of {len(summ)} runs in {out}/rlvr_summary.json")
PYEOF
echo "wall $(( $(date +%s) - start )) s, rc=$rc (124: hard stop; the runs' last per-iteration JSONs are partial)"
if [ "$rc" -eq 0 ]; then echo "PASS: rlvr"; else echo "FAIL: rlvr (rc=$rc)"; fi
exit "$rc"
