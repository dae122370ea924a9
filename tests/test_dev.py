"""dev/ (probes and sweeps, not installed): every module imports as ``dev.<name>``, and ``--help`` describes a
probe without running it."""

from __future__ import annotations

import importlib
import os
import re
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


@pytest.mark.parametrize(("name", "words"), [("h10_tile_shape", "tile shape"), ("kv4_sweep", "--family"),
                                             ("calibrate_long_gpu", "--deadline-s")])
def test_dev_help_describes_and_runs_nothing(name, words, tmp_path):
    env = os.environ | {"PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", f"dev.{name}", "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"python -m dev.{name}" in r.stdout and words in r.stdout
    assert not list(tmp_path.iterdir())  # nothing written: --help is not taken for an output path


# how code, tests, notebooks and the GPU scripts name a dev module (dev/results/README.md, a record of past runs,
# keeps the names its files were written under)
_DEV_REFS = re.compile(r"(?:python3? -m |from |import |:mod:`|`)dev\.(\w+)|from dev import (\w+)|\bdev/(\w+)\.py\b")


def test_every_named_dev_module_exists():
    """A renamed or deleted probe leaves no caller, script, test, docstring or notebook naming it."""
    texts = [p for pat in ("kvlib/**/*.py", "tests/**/*.py", "notebooks/**/*.md", "dev/*.py", "dev/gpu/*")
             for p in ROOT.glob(pat)] + [ROOT / "dev" / "README.md"]
    named = {}
    for path in texts:
        for m in _DEV_REFS.finditer(path.read_text()):
            named.setdefault(next(g for g in m.groups() if g), set()).add(str(path.relative_to(ROOT)))
    assert {"kv4_sweep", "cli", "vdither"} <= set(named)  # the patterns see the references that exist
    missing = {name: sorted(where) for name, where in named.items() if name not in MODULES}
    assert not missing, f"dev modules named but absent: {missing}"
