"""NVFP4 / MXFP4 probes: exact E2M1 grid, E4M3 / E8M0 scales, NVFP4 global scale, byte account."""

import pytest
import torch

from kvlib.formats import get_format
from kvlib.formats.mxfp4 import mxfp4_quantize
from kvlib.formats.nvfp4 import E2M1_GRID, e2m1_decode, e2m1_encode, fp4_dequantize, nvfp4_quantize

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_e2m1_grid_exact_and_roundtrip():
    assert torch.equal(E2M1_GRID, GRID)
    vals = torch.cat([GRID, -GRID[1:]])
    assert torch.equal(e2m1_decode(e2m1_encode(vals)), vals)
    codes = torch.arange(16, dtype=torch.uint8)
    dec = e2m1_decode(codes)
    assert set(dec.abs().tolist()) == set(GRID.tolist())


def test_e2m1_rounds_to_nearest_and_saturates():
    v = torch.linspace(-8, 8, 4001)
    r = e2m1_decode(e2m1_encode(v))
    full = torch.cat([-GRID.flip(0), GRID])
    nearest = (v.clamp(-6, 6).unsqueeze(-1) - full).abs().min(-1).values
    assert torch.allclose((v.clamp(-6, 6) - r).abs(), nearest, atol=1e-6)
    assert r.abs().max() == 6.0


def test_nvfp4_scales():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 128, generator=g) * torch.logspace(-2, 2, 50).unsqueeze(-1)
    qt = nvfp4_quantize(x)
    assert qt.block_scale.shape == (50, 8) and qt.global_scale.dtype == torch.float32
    bs = qt.block_scale.view(torch.float8_e4m3fn).float()
    assert torch.equal(bs.to(torch.float8_e4m3fn).float(), bs)  # representable in E4M3
    assert torch.allclose(qt.global_scale, x.abs().amax(-1) / (6 * 448))
    xh = fp4_dequantize(qt)
    # values are grid points times the effective block scale
    vals = xh.reshape(50, 8, 16) / (bs * qt.global_scale.unsqueeze(-1)).unsqueeze(-1)
    assert torch.allclose(vals.abs().unsqueeze(-1).sub(GRID).abs().min(-1).values, torch.zeros(()), atol=1e-4)
    rel = (xh - x).abs().amax(-1) / x.abs().amax(-1)
    assert (rel <= 0.25).all()  # half the largest E2M1 gap (1) relative to the block max 6, plus E4M3 rounding


def test_mxfp4_power_of_two_scales():
    x = torch.randn(40, 64) * 3
    qt = mxfp4_quantize(x)
    assert qt.block_scale.shape == (40, 2) and qt.block_scale.dtype == torch.uint8
    e = qt.block_scale.float() - 127
    amax = x.reshape(40, 2, 32).abs().amax(-1)
    assert torch.equal(e, torch.floor(torch.log2(amax)) - 2)
    xh = fp4_dequantize(qt)
    scale = torch.exp2(e).repeat_interleave(32, -1)
    # half the largest E2M1 gap (2/2) inside the grid; saturation of amax/scale in [6, 8) costs up to 2
    assert ((xh - x).abs() <= 2 * scale + 1e-6).all()
    inside = (x / scale).abs() <= 6
    assert ((xh - x).abs()[inside] <= scale[inside] + 1e-6).all()


@pytest.mark.parametrize(("name", "bits"), [("nvfp4", 4.75), ("mxfp4", 4.25)])
def test_bits_per_element(name, bits):
    f = get_format(name)
    assert f.bytes_per_position(128) * 8 / 128 == pytest.approx(bits)
    p = f.write(torch.randn(12, 128))
    assert f.nbytes(p) == pytest.approx(12 * f.bytes_per_position(128))


def test_rotation_option_reads_original_basis():
    x = torch.randn(20, 64)
    for name in ("nvfp4", "mxfp4"):
        f = get_format(name, rotate="k")
        assert (f.read(f.write(x, side=0)) - x).pow(2).mean() < 0.05 * x.pow(2).mean()


def test_bad_inputs():
    with pytest.raises(ValueError, match="block"):
        mxfp4_quantize(torch.randn(3, 48))
    with pytest.raises(ValueError, match="finite"):
        nvfp4_quantize(torch.tensor([[float("inf")] * 16]))
    with pytest.raises(ValueError):
        get_format("nvfp4").write(torch.randn(16))
