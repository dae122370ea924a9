#!/usr/bin/env bash
# One warm device call (session 16): GRPO runs (dev/gpu/rlvr.sh) with the GPU test lane, the fused-write checks and
# the value-dither diagnosis beside them (started only once rlvr's isolated rollout timing is written, so that timing
# runs alone), then the fused-write timing, which needs the device to
# itself. Everything but rlvr's own archive goes into $OUT/lane.tar.gz (the device returns at most 8 files).
set -u
OUT=${OUT:-/tmp/batch_out}; mkdir -p "$OUT/lane"
t0=$(date +%s)
(OUT="$OUT" bash dev/gpu/rlvr.sh > "$OUT/lane/rlvr_console.log" 2>&1; echo "rlvr rc=$?" >> "$OUT/lane/rlvr_console.log") &
rpid=$!
for _ in $(seq 1 150); do [ -f "$OUT/rlvr/timing.json" ] && break; kill -0 $rpid 2>/dev/null || break; sleep 1; done
echo "side jobs start at $(( $(date +%s) - t0 )) s (timing.json: $([ -f "$OUT/rlvr/timing.json" ] && echo yes || echo no))"
(mkdir -p "$OUT/lane/t"; OUT="$OUT/lane/t" bash dev/gpu/test-gpu.sh > "$OUT/lane/test_gpu.log" 2>&1) &
(mkdir -p "$OUT/lane/w"; OUT="$OUT/lane/w" WRITEFUSE_SECTIONS=bit,capture bash dev/gpu/writefuse.sh > "$OUT/lane/writefuse.log" 2>&1) &
(mkdir -p "$OUT/lane/v"; OUT="$OUT/lane/v" bash dev/gpu/vdither.sh > "$OUT/lane/vdither.log" 2>&1) &
wait
echo "rlvr and side jobs done at $(( $(date +%s) - t0 )) s"
(mkdir -p "$OUT/lane/w2"; OUT="$OUT/lane/w2" WRITEFUSE_SECTIONS=timing timeout 150 bash dev/gpu/writefuse.sh \
  > "$OUT/lane/writefuse_timing.log" 2>&1)
echo "all done at $(( $(date +%s) - t0 )) s"
tar czf "$OUT/lane.tar.gz" -C "$OUT" lane && rm -rf "$OUT/lane"
for f in rlvr_console test_gpu writefuse vdither writefuse_timing; do
  echo "== $f"; tar xzf "$OUT/lane.tar.gz" -O "lane/$f.log" 2>/dev/null | grep -E "PASS|FAIL|TIMEOUT|DIAGNOSIS|SUMMARY|x SDPA|ratio|passed|failed" | tail -n 14 | cut -c1-220
done
