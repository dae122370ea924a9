#!/usr/bin/env bash
# Issue 40: the INT8 warp-specialised kernels at d = 64 and their ping-pong variants on a Hopper GPU, never run yet.
# One warm call, < 9.5 min; set KVLIB_COMMIT to the clean tree's commit.
#  1. their GPU tests (junit in $OUT/wspec_d64_tests.xml): d = 64 against the float64 reference (RTN and certified,
#     SmolLM2's 9 / 3 heads and others), the ping-pong configs, the dispatcher only when asked, the SmolLM2-shaped model
#  2. python -m dev.wspec_d64_timing $OUT/wspec_d64_timing.json: side by side with SDPA bf16 under CUDA graphs
# If 1 passes, add 64 to kvlib.kernels.int8.decode.WSPEC_AUTO_HEAD_DIMS; take ping-pong only where 2 says it is faster.
set -u
OUT="${OUT:-/tmp/wspec_d64_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fails=()
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 300 "$PY" -m pytest -q $XDIST tests/test_wspec.py tests/test_wspec_cert.py tests/test_dispatch_wspec.py \
  -k "d64 or pingpong or kernel_matches_the_reference or other_rings" --junitxml="$OUT/wspec_d64_tests.xml" 2>&1 | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || fails+=("tests")
timeout 240 "$PY" -m dev.wspec_d64_timing "$OUT/wspec_d64_timing.json" 2>&1 | tail -20
[ "${PIPESTATUS[0]}" = 0 ] || fails+=("timing")
echo "wspec_d64: ${#fails[@]} failed step(s): ${fails[*]:-none} (commit ${KVLIB_COMMIT:-unknown})"
[ ${#fails[@]} = 0 ]
