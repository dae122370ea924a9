"""dev/ (probes and sweeps, not installed): every module imports as ``dev.<name>``, and ``--help`` describes a
probe without running it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "dev").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_dev_module_imports(name):
    mod = importlib.import_module(f"dev.{name}")
    assert (mod.__doc__ or "").strip(), f"dev.{name} has no docstring saying what it is for"


@pytest.mark.parametrize(("name", "words"), [("h10_tile_shape", "tile shape"), ("kv4_sweep", "--family")])
def test_dev_help_describes_and_runs_nothing(name, words, tmp_path):
    env = os.environ | {"PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", f"dev.{name}", "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"python -m dev.{name}" in r.stdout and words in r.stdout
    assert not list(tmp_path.iterdir())  # nothing written: --help is not taken for an output path
