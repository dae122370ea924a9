#!/usr/bin/env bash
# Issue 24's HF path on the GPU: models decoding through kvlib.make_cache (see dev/gpu/hfpath.py).
# Runs from the repo root; prints PASS/FAIL lines and a SUMMARY; writes $OUT/hfpath.json. Under 4 minutes.
set -uo pipefail
export OUT="${OUT:-.}"
export PYTHONPATH="${PYTHONPATH:-}:$(pwd)"
PY="${PYTHON:-python}"
timeout 230 "$PY" dev/gpu/hfpath.py
rc=$?
[ $rc -eq 124 ] && echo "FAIL: dev/gpu/hfpath.py ran past 230 s"
exit $rc
