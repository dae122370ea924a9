"""KV4 affine INT4: packing, error bound, byte account, rotation semantics, registry."""

import pytest
import torch

from kvlib.core.hadamard import hadamard
from kvlib.formats import available_formats, get_format
from kvlib.formats.kv4 import int4_dequantize, int4_quantize, pack_nibbles, unpack_nibbles


def _keys(n=200, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, [3, 17]] *= 25.0  # outlier channels, as in real keys
    return x


def test_pack_roundtrip():
    c = torch.randint(0, 16, (7, 3, 64), dtype=torch.uint8)
    p = pack_nibbles(c)
    assert p.shape == (7, 3, 32) and p.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(p), c)
    assert torch.equal(p[..., 0] & 15, c[..., 0])


@pytest.mark.parametrize("group", [None, 32, 16])
def test_error_within_half_step(group):
    x = _keys()
    qt = int4_quantize(x, group)
    assert qt.codes.dtype == torch.uint8 and qt.codes.shape == (200, 64)
    assert qt.scale.dtype == torch.float16 and qt.offset.dtype == torch.float16
    g = 128 if group is None else group
    assert qt.scale.shape == (200, 128 // g)
    step = qt.scale.float().repeat_interleave(g, -1)
    err = (x - int4_dequantize(qt)).abs()
    assert (err <= step / 2 + 1e-6 * x.abs().amax()).all()


def test_constant_and_extreme_vectors_exact():
    x = torch.stack([torch.full((64,), 0.3), torch.zeros(64), torch.linspace(-1, 1, 64)])
    xh = int4_dequantize(int4_quantize(x))
    assert torch.allclose(xh[:2], x[:2], atol=1e-3)
    assert xh[2].min() <= -1 + 1e-3 and xh[2].max() >= 1 - 2e-3


def test_score_after_reduction_identity():
    """q·k̂ = Δ (q·c) + m Σq: what the integer QK path relies on."""
    q, x = torch.randn(128, dtype=torch.float64), _keys(10)
    qt = int4_quantize(x)
    c = unpack_nibbles(qt.codes).double()
    lhs = int4_dequantize(qt).double() @ q
    rhs = qt.scale.double()[:, 0] * (c @ q) + qt.offset.double()[:, 0] * q.sum()
    assert torch.allclose(lhs, rhs, atol=1e-9 * lhs.abs().max())


@pytest.mark.parametrize(("name", "bits"), [("kv4", 4.25), ("kv4-g32", 5.0), ("kv4-g16", 6.0)])
def test_bits_per_element(name, bits):
    f = get_format(name)
    assert f.bytes_per_position(128) * 8 / 128 == pytest.approx(bits)
    assert f.bytes_per_position(64) * 8 / 64 == pytest.approx(
        4 + 32 / min(64, 128 if name == "kv4" else int(name[-2:]))
    )
    packed = f.write(_keys(40))
    assert f.nbytes(packed) == pytest.approx(40 * f.bytes_per_position(128))


def test_registered():
    assert {"kv4", "kv4-g32", "kv4-g16", "kv4rl", "nvfp4", "mxfp4", "kivi2"} <= set(available_formats())


def test_rotation_k_stores_rotated_keys_and_reads_original_basis():
    x = _keys()
    f = get_format("kv4", rotate="k")
    pk, pv = f.write(x, side=0), f.write(x, side=1)
    assert pk.rotated and not pv.rotated
    assert torch.allclose(int4_dequantize(pk), hadamard(f.read(pk)), atol=1e-4)
    # rotation spreads the outlier channels: much smaller error for keys with outliers
    err_rot = (f.read(pk) - x).pow(2).mean()
    err_none = (get_format("kv4", rotate="none").read(get_format("kv4", rotate="none").write(x)) - x).pow(2).mean()
    assert err_rot < err_none / 4


def test_append_concatenates():
    f = get_format("kv4")
    x = _keys(30)
    p = f.append(f.write(x[:10]), x[10:])
    assert torch.allclose(f.read(p), f.read(f.write(x)))


def test_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        int4_quantize(torch.randn(3, 7))
    with pytest.raises(ValueError, match="group"):
        int4_quantize(torch.randn(3, 64), group=24)
    with pytest.raises(TypeError):
        int4_quantize(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="finite"):
        int4_quantize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="rotate"):
        get_format("kv4", rotate="q")
    with pytest.raises(ValueError, match="side"):
        get_format("kv4").write(torch.randn(3, 8), side=2)
    with pytest.raises(TypeError):
        int4_dequantize(torch.zeros(3))


@pytest.mark.parametrize("group", [None, 32])
def test_error_within_half_step_far_from_zero(group):
    """Values on a large common offset (an fp16 ulp of the offset, 0.5 at 1000, far above the step): the offset
    rounds down to fp16, so no element falls below it and every error stays within half a step."""
    g = torch.Generator().manual_seed(11)
    x = 1000.0 + 0.05 * torch.randn(50, 128, generator=g)
    qt = int4_quantize(x, group)
    step = qt.scale.float().repeat_interleave(128 if group is None else group, -1)
    err = (x - int4_dequantize(qt)).abs()
    assert (err <= step / 2 + 1e-6 * x.abs().amax()).all(), float((err - step / 2).max())
