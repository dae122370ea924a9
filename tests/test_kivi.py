"""KIVI-style 2-bit baseline: residual window semantics, error bounds, byte account."""

import pytest
import torch

from kvlib.formats import get_format


@pytest.mark.parametrize("side", [0, 1])
def test_residual_window_and_append(side):
    f = get_format("kivi2", group=8, residual=16)
    x = torch.randn(45, 32)
    p = f.write(x[:5], side=side)
    for i in range(5, 45, 7):
        p = f.append(p, x[i : i + 7], side=side)
    assert p.length == 45 and p.codes.shape[0] == 32 and p.residual.shape[0] == 13
    r = f.read(p)
    assert torch.allclose(r[32:], x[32:], atol=1e-2)  # fp16 residual
    # 2-bit error within half a step of the group's scale
    if side == 0:
        step = p.scale.float().repeat_interleave(8, 0)
    else:
        step = p.scale.float().repeat_interleave(8, 1)
    assert ((r[:32] - x[:32]).abs() <= step / 2 + 2e-3).all()  # + fp16 staging of the residual
    # incremental equals one-shot
    assert torch.allclose(r, f.read(f.write(x, side=side)))


def test_bits():
    f = get_format("kivi2")
    assert f.bytes_per_position(128) * 8 / 128 == pytest.approx(3.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple"):
        get_format("kivi2", group=32, residual=40)
    with pytest.raises(ValueError, match="multiple of 4"):
        get_format("kivi2").write(torch.randn(3, 6))
