# Sourced (not run) by the GPU scripts that load the real SmolLM2-135M: rlvr.sh, rlvr_async.sh, calibrate_long.sh.
# The GGUF (98 MB) travels as two halves, .carry/smolA/part00 and .carry/smolB/part01 (64 MiB per carry), over
# two calls on one warm machine (dev/gpu/smollm2.sh stash); /tmp/kvlib_smol keeps the first half between them.

# smollm2_gguf PATH: GGUF=PATH if that file exists, else the halves reassembled (written to a temporary name and
# renamed, so an interrupted call never leaves a truncated model to reuse); returns 2, saying why, if neither.
smollm2_gguf() {
  GGUF=$1
  [ -f "$GGUF" ] && return 0
  local stash=/tmp/kvlib_smol
  mkdir -p "$stash"
  [ -f .carry/smolA/part00 ] && cp .carry/smolA/part00 "$stash/"
  [ -f .carry/smolB/part01 ] && cp .carry/smolB/part01 "$stash/"
  if [ -f "$stash/part00" ] && [ -f "$stash/part01" ]; then
    GGUF=$stash/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$GGUF" ] || { cat "$stash/part00" "$stash/part01" > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"; }
    return 0
  fi
  echo "FAIL: no GGUF ($1 or the halves .carry/smolA, .carry/smolB)"
  return 2
}

# smollm2_site: the carried gguf / accelerate wheels into /tmp/site and the offline environment every such run
# needs (repository and site on PYTHONPATH, no hub, the GPU compiling for itself); returns 2 if a wheel fails.
smollm2_site() {
  SITE=/tmp/site
  mkdir -p "$SITE"
  local w
  for w in .whl/gguf-*.whl .whl/accelerate-*.whl; do
    [ -f "$w" ] && { python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w" || return 2; }
  done
  export PYTHONPATH="$PWD:$SITE" KVLIB_CACHE_DIR=/tmp/kvlib_cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export KVLIB_RL_SITE=/tmp/kvlib_rl_site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
  unset TRITON_INTERPRET
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
}
