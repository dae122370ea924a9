"""KV4-RL side buffer: ring semantics over long sequences, disjoint regions, byte account."""

import pytest
import torch

from kvlib.formats import get_format
from kvlib.formats.kv4rl import int8_dequantize, int8_quantize, protected_mask


@pytest.mark.parametrize(("sink", "recent"), [(4, 8), (0, 6), (10, 0), (3, 1)])
def test_ring_semantics_long_stream(sink, recent):
    f = get_format("kv4rl", sink=sink, recent=recent)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=g)
    p = None
    n = 0
    steps = [1, 3, 1, 17, 2, 1, 40, 1, 1, 5] * 4
    for s in steps:
        p = f.append(p, x[n : n + s], side=0) if p is not None else f.write(x[:s], side=0)
        n += s
        prot = p.protected_positions()
        expect = torch.cat([torch.arange(min(sink, n)), torch.arange(min(max(sink, n - recent), n), n)])
        assert torch.equal(prot, expect)  # sinks never evicted, recent window exact
        assert prot.unique().numel() == prot.numel()  # no position twice
        mask = protected_mask(n, sink, recent)
        assert torch.equal(mask.nonzero().flatten(), expect)
        main = (~mask).nonzero().flatten()
        assert torch.equal(torch.sort(torch.cat([prot, main])).values, torch.arange(n))  # disjoint and covering
    assert p.main.codes.shape[0] == n  # every position has its INT4 entry


def test_read_uses_side_values_for_protected_positions():
    f, f4 = get_format("kv4rl", sink=2, recent=5), get_format("kv4")
    x = torch.randn(30, 64)
    p = f.write(x, side=0, positions=torch.arange(30))
    r = f.read(p)
    mask = protected_mask(30, 2, 5)
    assert torch.allclose(r[~mask], f4.read(f4.write(x, side=0))[~mask])
    assert (r[mask] - x[mask]).abs().max() < (r[~mask] - x[~mask]).abs().max() / 4


def test_int8_bound():
    x = torch.randn(100, 64) * 5
    c, s = int8_quantize(x)
    assert c.dtype == torch.int8 and s.dtype == torch.float16
    assert ((int8_dequantize(c, s) - x).abs() <= s.float().unsqueeze(-1) / 2 + 1e-6).all()


def test_bf16_protection():
    f = get_format("kv4rl", sink=2, recent=4, protect="bf16")
    x = torch.randn(20, 32)
    r = f.read(f.write(x, side=1))
    m = protected_mask(20, 2, 4)
    assert torch.allclose(r[m], x[m].bfloat16().float())


def test_bytes():
    f = get_format("kv4rl")
    assert f.bytes_per_position(128) * 8 / 128 == pytest.approx(4.25)
    assert f.fixed_bytes(128) == 144 * 130


def test_bad_inputs():
    with pytest.raises(ValueError, match="capacity"):
        get_format("kv4rl", sink=16, recent=128, capacity=100)
    with pytest.raises(ValueError, match="recent"):
        get_format("kv4rl", recent=-1)
    with pytest.raises(ValueError, match="protect"):
        get_format("kv4rl", protect="fp8")
    f = get_format("kv4rl", sink=2, recent=4)
    p = f.write(torch.randn(5, 16))
    with pytest.raises(ValueError, match="consecutive"):
        f.append(p, torch.randn(2, 16), positions=torch.tensor([7, 8]))
