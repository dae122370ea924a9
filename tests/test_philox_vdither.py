"""The scratch restoration of the tc kernel's value-dither path (dev/vdither_kernel.py, issue 28's GPU-only bug):
under the CPU interpreter the removed code, the loaded-dither and stored-dither variants and the values-only /
keys-only cases all agree with the float64 reference, and the in-kernel dither equals the torch one bit for bit.
(On the H200 the removed code did not: the bisection there is dev/gpu/vdither.sh.)"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; the GPU diagnosis is dev/gpu/vdither.sh")
def test_scratch_value_dither_path_matches_reference_under_the_interpreter():
    from dev.vdither import cases, diagnose, run_case

    rows = [run_case(name, dev="cpu", **kw) for name, kw in cases(cpu=True)]
    for r in rows:
        assert "error" not in r and r["ok"], r
    by = {r["name"]: r for r in rows}
    assert by["stored_dither"]["dxi"] == 0.0
    assert by["removed_code"]["do"] < 1e-5
    assert any("AGREES" in line for line in diagnose(rows))
