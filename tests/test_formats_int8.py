"""Comparison formats behind KVFormat: registry, error bounds, byte accounts from layout and tensors."""

from __future__ import annotations

import pytest
import torch

from kvlib.core.outliers import inject_massive_pairs, rope_pairs, select_outlier_pairs
from kvlib.formats import available_formats, get_format

NAMES = ["dither-int8", "rtn-int8", "sr-int8", "fp8-e4m3", "block-int8"]


def test_registered():
    assert set(NAMES) <= set(available_formats())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("d", [64, 128])
def test_bytes_from_layout_match_tensors(name, d):
    f = get_format(name)
    S = 512  # two full 256-token blocks
    p = f.write(torch.randn(S, d), slots=torch.arange(S))
    assert f.nbytes(p) / S == pytest.approx(f.bytes_per_position(d))


def _scale(x, qmax, group=32):
    return (x.abs().unflatten(-1, (-1, group)).amax(-1) / qmax).half().float().repeat_interleave(group, -1)


def test_error_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) * 3
    rtn = get_format("rtn-int8")
    e = (rtn.read(rtn.write(x)) - x).abs()
    assert bool((e <= _scale(x, 127.0) / 2 * (1 + 1e-5)).all())
    sr = get_format("sr-int8")
    e = (sr.read(sr.write(x, seed=1)) - x).abs()
    assert bool((e <= _scale(x, 127.0) * (1 + 1e-5)).all())
    fp8 = get_format("fp8-e4m3")
    e = (fp8.read(fp8.write(x)) - x).abs()
    assert bool((e <= x.abs() * 2**-4 + _scale(x, 448.0) * 2**-9).all())  # e4m3: 3 mantissa bits
    blk = get_format("block-int8")
    p = blk.write(x)
    s = p.scales.float().repeat_interleave(256, 0)[:256]
    assert bool(((blk.read(p) - x).abs() <= s / 2 * (1 + 1e-5)).all())


def test_rtn_is_deterministic_sr_unbiased():
    x = torch.full((4096, 32), 0.3)
    x[:, 0] = 127.0 * 0.5  # scale ~ 0.5: x/s = 0.6 for the other channels
    sr = get_format("sr-int8")
    r = sr.read(sr.write(x, slots=torch.arange(4096)))
    assert abs(float(r[:, 1:].mean()) - 0.3) < 0.01
    rtn = get_format("rtn-int8")
    assert torch.unique(rtn.read(rtn.write(x))[:, 1:]).numel() == 1


@pytest.mark.parametrize("name", ["rtn-int8", "sr-int8", "fp8-e4m3", "block-int8"])
def test_bad_input(name):
    f = get_format(name)
    with pytest.raises(TypeError):
        f.write(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError):
        f.write(torch.full((4, 64), float("nan")))


def test_block_int8_no_append():
    f = get_format("block-int8")
    p = f.write(torch.randn(4, 64))
    with pytest.raises(NotImplementedError):
        f.append(p, torch.randn(2, 64))


def test_outlier_selection_by_energy():
    x = torch.randn(200, 64)
    xi, ch = inject_massive_pairs(x, 4, 50.0, seed=3)
    assert select_outlier_pairs(xi, 4).tolist() == ch.tolist()
    both = select_outlier_pairs(torch.stack([xi, x], dim=1), 4)
    assert both.shape == (2, 8) and both[0].tolist() == ch.tolist()
    assert rope_pairs(8, "interleaved").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError):
        select_outlier_pairs(x, 40)
