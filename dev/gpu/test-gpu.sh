#!/usr/bin/env bash
# The GPU lane: every kernel test on a CUDA device, with Triton compiling for it (no interpreter).
#
#   bash dev/gpu/test-gpu.sh          # from anywhere; `make test-gpu` runs exactly this
#   bash dev/gpu/test-gpu.sh -k h10   # extra arguments go to pytest (-k, -x, --lf, ...)
#
# Runs where the package is not installed and no venv exists: $PYTHON (default python3) with PYTHONPATH set
# to the repository root. Needs torch, triton, numpy, scipy and pytest importable by that python (the H200
# image has them). Fails at once, saying why, without CUDA or without one of those packages.
# TEST_GPU_TIMEOUT_S (default 360, 0 = none) stops pytest cleanly past that many seconds (a device call is
# short). TEST_GPU_WORKERS (default 8, 0 = one process) spreads the tests over that many pytest-xdist workers
# where xdist is importable and the arguments name no -n of their own: one process cannot fit a device call (at
# bb9b9f2 the 575 tests that finished took 837 s of test time in all; 6 workers, beside a GRPO job, ran them in
# 172 s). Prints one line "test-gpu: PASS|FAIL|TIMEOUT ..."; with $OUT set, also writes $OUT/test-gpu.json
# (counts, failed tests with their first error line, skipped tests with their reasons) and $OUT/test-gpu.xml.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

PY=${PYTHON:-python3}
LIMIT=${TEST_GPU_TIMEOUT_S:-360}
WORKERS=${TEST_GPU_WORKERS:-8}
# every test file that launches a kernel (tests/test_gpu_lane.py checks that none is missing)
TESTS=(tests/test_decode_*.py tests/test_dither*.py tests/test_kv4_kernels.py tests/test_merge_tl.py
       tests/test_philox*.py tests/test_fallback.py tests/test_sass_count.py tests/test_bench_wiring.py
       tests/test_format_capabilities.py tests/test_hf_cache.py tests/test_pools.py tests/test_write_kernels.py
       tests/test_gate_fixed.py tests/test_wspec*.py tests/test_dispatch_wspec.py tests/test_reference_speedups.py
       tests/test_rl_continuous.py tests/test_bench_kv_vs_weight.py)

# TEST_GPU_SHARD=k/n runs the k-th of n shards of those files (dev/gpu/shard.py, balanced by size): when the whole
# lane does not fit one device call, shards 1..n in consecutive calls on the same machine run it whole
SHARD=${TEST_GPU_SHARD:-}
tag=""
if [ -n "$SHARD" ]; then
  "$PY" dev/gpu/shard.py "$SHARD" > /dev/null || exit 2  # a malformed k/n says so and stops here
  mapfile -t TESTS < <("$PY" dev/gpu/shard.py "$SHARD" "${TESTS[@]}")
  [ "${#TESTS[@]}" -gt 0 ] || { echo "test-gpu: FAIL: shard $SHARD holds no test file" >&2; exit 2; }
  tag="-shard${SHARD//\//of}"
  echo "test-gpu: shard $SHARD: ${TESTS[*]}"
fi

unset TRITON_INTERPRET  # tests/conftest.py sets it only where CUDA is absent; an inherited 1 would hide the GPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # absolute: tests that chdir keep it

"$PY" - <<'EOF' || exit 2
import importlib.util
import sys

missing = [m for m in ("torch", "triton", "numpy", "scipy", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"test-gpu: FAIL: {', '.join(missing)} not importable by {sys.executable}; install them there "
             "(or carry wheels) and run again")
import torch

if not torch.cuda.is_available():
    sys.exit(f"test-gpu: FAIL: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False). "
             "This lane runs the kernels compiled for a GPU; on a CPU machine run `make test`.")
import triton

print(f"test-gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
      f"python {sys.version.split()[0]}", flush=True)
EOF

par=()
if printf '%s\n' "$@" | grep -qE '^(-n|--numprocesses)'; then
  how="workers as the arguments say"
elif [ "$WORKERS" = 0 ]; then
  how="one process (TEST_GPU_WORKERS=0)"
elif ! "$PY" -c "import xdist" 2>/dev/null; then
  how="one process (pytest-xdist not importable: the lane may not fit TEST_GPU_TIMEOUT_S)"
else
  par=(-n "$WORKERS")
  how="$WORKERS pytest-xdist workers"
fi
echo "test-gpu: $how, limit ${LIMIT} s"
junit=$(mktemp -t test-gpu.XXXXXX.xml)
tmo=()
[ "$LIMIT" != 0 ] && tmo=(timeout -s INT -k 20 "$LIMIT")
# -m "gpu or not gpu": the GPU-only tests (marker gpu) and all the rest, whatever addopts may deselect
${tmo[@]+"${tmo[@]}"} "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" --durations=10 \
    --junitxml="$junit" ${par[@]+"${par[@]}"} "${TESTS[@]}" "$@"
rc=$?

"$PY" - "$junit" "$rc" "$LIMIT" "${OUT:-}" "$tag" "$SHARD" <<'EOF'
import json
import os
import sys
import xml.etree.ElementTree as ET

junit, rc, limit, out, tag, shard = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
res = {"returncode": rc, "timed_out": rc == 124, "limit_s": float(limit), "shard": shard or None, "failed": {},
       "skipped": {}}
try:
    cases = list(ET.parse(junit).getroot().iter("testcase"))
except (OSError, ET.ParseError) as e:
    cases = []
    res["junit_error"] = str(e)
for c in cases:
    tid = f"{c.get('classname', '').replace('.', '/')}.py::{c.get('name')}"
    for tag, key in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
        el = c.find(tag)
        if el is not None:
            res[key][tid] = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else tag
            break
res["total"] = len(cases)
res["passed"] = len(cases) - len(res["failed"]) - len(res["skipped"])
verdict = "TIMEOUT" if rc == 124 else ("PASS" if rc == 0 and not res["failed"] else "FAIL")
res["verdict"] = verdict
if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"test-gpu{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(junit, "rb") as src, open(os.path.join(out, f"test-gpu{tag}.xml"), "wb") as dst:
        dst.write(src.read())
for tid, msg in res["failed"].items():
    print(f"test-gpu: failed {tid}: {msg}")
extra = f" (stopped at {limit} s; TEST_GPU_TIMEOUT_S=0 for no limit)" if rc == 124 else ""
where = f" shard {shard}" if shard else ""
print(f"test-gpu{where}: {verdict}: {res['passed']} passed, {len(res['failed'])} failed, {len(res['skipped'])} skipped "
      f"of {res['total']}{extra}")
EOF
rm -f "$junit"
exit "$rc"
