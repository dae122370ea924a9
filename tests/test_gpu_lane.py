"""The GPU lane (``make test-gpu`` = ``dev/gpu/test-gpu.sh``): it covers every test file that launches a kernel,
installs nothing, and refuses to run without CUDA."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "dev" / "gpu" / "test-gpu.sh"


def lane_files() -> set[str]:
    m = re.search(r"^TESTS=\((.*?)\)", SCRIPT.read_text(), re.S | re.M)
    assert m, "dev/gpu/test-gpu.sh has no TESTS=(...) list"
    return {str(p.relative_to(ROOT)) for pat in m.group(1).split() for p in ROOT.glob(pat)}


def test_lane_covers_every_test_file_that_launches_a_kernel():
    lane = lane_files()
    launches = re.compile(r"kvlib\.kernels|^\s*(import|from) triton|importorskip\(\"triton\"\)|pytest\.mark\.gpu", re.M)
    kernel_tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                    if launches.search(p.read_text())}
    assert {"tests/test_philox.py", "tests/test_kv4_kernels.py", "tests/test_decode_int8.py"} <= kernel_tests
    assert kernel_tests <= lane, f"kernel tests missing from the GPU lane: {sorted(kernel_tests - lane)}"


def test_make_target_runs_the_script_and_installs_nothing():
    mk = (ROOT / "Makefile").read_text()
    m = re.search(r"^test-gpu:(.*)\n((?:\t.*\n)+)", mk, re.M)
    assert m, "Makefile has no test-gpu target"
    assert m.group(1).strip() == "", "test-gpu must not depend on the venv install"
    assert "bash dev/gpu/test-gpu.sh" in m.group(2)
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(mk.startswith("gpu:") for mk in markers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_lane_refuses_without_cuda():
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHON": sys.executable}
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "test-gpu: FAIL: no CUDA device" in r.stderr + r.stdout


def _lane_files() -> list[str]:
    import glob

    m = re.search(r"^TESTS=\((.*?)\)", SCRIPT.read_text(), re.M | re.S)
    return sorted({f for pat in m.group(1).split() for f in glob.glob(pat, root_dir=ROOT)})


def test_shards_partition_the_lane():
    """TEST_GPU_SHARD=k/n: shards 1..n together hold every lane file exactly once (so running them all runs the
    lane whole), none is empty at n = 2 or 3, and a malformed spec is refused naming the variable."""
    sys.path.insert(0, str(ROOT / "dev" / "gpu"))
    try:
        import shard
    finally:
        sys.path.pop(0)
    files = _lane_files()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for n in (1, 2, 3):
            groups = shard.shards(files, n)
            flat = [f for g in groups for f in g]
            assert sorted(flat) == files and len(flat) == len(set(flat)) and all(groups)
            assert groups == shard.shards(list(reversed(files)), n)  # deterministic, whatever the order given
    finally:
        os.chdir(cwd)
    for bad in ("2", "0/2", "3/2", "a/b"):
        with pytest.raises(ValueError, match="TEST_GPU_SHARD"):
            shard.parse(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_a_shard_names_its_files_then_refuses_without_cuda():
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHON": sys.executable, "TEST_GPU_SHARD": "2/2"}
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "test-gpu: FAIL: no CUDA device" in r.stderr + r.stdout
    assert "test-gpu: shard 2/2: tests/" in r.stdout
    bad = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env | {"TEST_GPU_SHARD": "3/2"}, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "TEST_GPU_SHARD must have 1 <= k <= n" in bad.stderr


def test_smollm2_env_reassembles_the_carried_halves(tmp_path):
    """dev/gpu/smollm2_env.sh (sourced by rlvr.sh, rlvr_async.sh, calibrate_long.sh): a GGUF that exists is used as
    is; else the two carried halves are joined in order; with neither the script stops with 2, saying why."""
    env_sh = ROOT / "dev" / "gpu" / "smollm2_env.sh"
    stash = tmp_path / "stash"
    script = (f'. "{env_sh}"; '
              f'smollm2_gguf "$1"; rc=$?; echo "rc=$rc GGUF=$GGUF"; [ $rc = 0 ] && cat "$GGUF"; exit 0')
    (tmp_path / ".carry" / "smolA").mkdir(parents=True)
    (tmp_path / ".carry" / "smolB").mkdir(parents=True)
    (tmp_path / ".carry" / "smolA" / "part00").write_bytes(b"first-")
    (tmp_path / ".carry" / "smolB" / "part01").write_bytes(b"second")
    text = env_sh.read_text().replace("/tmp/kvlib_smol", str(stash))  # keep the test off the machine's stash
    (tmp_path / "env.sh").write_text(text)
    script = script.replace(str(env_sh), str(tmp_path / "env.sh"))

    def run(arg):
        return subprocess.run(["bash", "-c", script, "x", arg], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60).stdout

    out = run("missing.gguf")
    assert f"rc=0 GGUF={stash}/SmolLM2-135M-Instruct.Q4_1.gguf" in out and out.rstrip().endswith("first-second")
    (tmp_path / "model.gguf").write_bytes(b"whole")
    assert run("model.gguf").rstrip().endswith("rc=0 GGUF=model.gguf\nwhole")
    for p in (tmp_path / ".carry", stash):
        subprocess.run(["rm", "-r", str(p)], check=True)
    out = run("missing.gguf")
    assert "FAIL: no GGUF (missing.gguf" in out and "rc=2" in out
