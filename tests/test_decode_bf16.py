"""fp16/bf16 baseline decode kernel (interpreter on CPU) against its float64 reference."""

import pytest
import torch

from kvlib.kernels.bf16.decode import decode_bf16, decode_bf16_reference

# every test here launches a kernel (CPU: the interpreter): the GPU lane runs them all (-m gpu)
pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernel runs under TRITON_INTERPRET=1


@pytest.mark.parametrize(
    "dtype,hq,hkv,ns", [(torch.float16, 4, 2, 1), (torch.float16, 7, 1, 3), (torch.bfloat16, 2, 2, 2)]
)
def test_baseline_matches_reference(dtype, hq, hkv, ns):
    g = torch.Generator().manual_seed(hq + ns)
    B, S, d = 2, 37, 32
    n_slots = B * S + 5
    k = torch.randn(n_slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_slots, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(n_slots, generator=g)[: B * S].view(B, S).to(torch.int32)
    seq = torch.tensor([S, 5], dtype=torch.int32)
    q = torch.randn(B, hq, d, generator=g).to(dtype)
    ref = decode_bf16_reference(q, k, v, slots, seq)
    out = decode_bf16(q.to(DEV), k.to(DEV), v.to(DEV), slots.to(DEV), seq.to(DEV), num_splits=ns, block_n=16)
    assert out.path == "bf16"  # the kernel ran, not the reference
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.o.double().cpu(), ref.o, atol=tol, rtol=tol)
    torch.testing.assert_close(out.lse.double().cpu(), ref.lse, atol=tol, rtol=tol)


def test_fp32_pools_are_read_at_fp32():
    """The fp32 format's pools take this kernel with fp32 dots; they must be IEEE fp32 ("ieee"), not Triton's CUDA
    default tf32 (10-bit mantissa: errors ~2^-11 |q| |k|, which made the fp32 cache a 1.7e-4-off reference on the
    H200, tests/test_gate_fixed.py). fp32 rounding alone stays near 1e-6 here; tf32 would be ~1e-3."""
    g = torch.Generator().manual_seed(3)
    B, S, d, hq, hkv = 2, 64, 64, 4, 2
    k = torch.randn(B * S, hkv, d, generator=g)
    v = torch.randn(B * S, hkv, d, generator=g)
    slots = torch.randperm(B * S, generator=g).view(B, S).to(torch.int32)
    seq = torch.tensor([S, 33], dtype=torch.int32)
    q = 2 * torch.randn(B, hq, d, generator=g)
    ref = decode_bf16_reference(q, k, v, slots, seq)
    out = decode_bf16(q.to(DEV), k.to(DEV), v.to(DEV), slots.to(DEV), seq.to(DEV), num_splits=2, block_n=16)
    assert out.path == "bf16"
    torch.testing.assert_close(out.o.double().cpu(), ref.o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.lse.double().cpu(), ref.lse, atol=2e-5, rtol=2e-5)


def test_baseline_bad_shapes():
    k = torch.zeros(4, 2, 32, dtype=torch.float16)
    sl, n = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        decode_bf16(torch.zeros(1, 3, 32), k, k, sl, n)
    with pytest.raises(TypeError, match="v"):
        decode_bf16(torch.zeros(1, 2, 32), k, k.float(), sl, n)


@pytest.mark.parametrize("dtype,block_size", [(torch.float16, 16), (torch.bfloat16, 8)])
def test_block_table_matches_the_slot_table_and_the_reference(dtype, block_size):
    """vLLM-style pages ``[num_blocks, block_size, H_kv, d]`` flattened to slots, shuffled, ragged lengths."""
    from kvlib.kernels.tl.paging import allocate_blocks

    g = torch.Generator().manual_seed(block_size)
    lens, hq, hkv, d = [29, 3, 40], 4, 2, 32
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    bt, tok = allocate_blocks(lens, block_size, num_blocks=num_blocks, generator=g)
    pages = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    k = pages.flatten(0, 1)  # [n_slots, H_kv, d]
    v = torch.randn(num_blocks * block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    flat = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for b, t in enumerate(tok):
        flat[b, :t.numel()] = t.to(torch.int32)
    ref = decode_bf16_reference(q, k, v, None, seq, block_table=bt, block_size=block_size)
    ref_flat = decode_bf16_reference(q, k, v, flat, seq)
    assert torch.equal(ref.o, ref_flat.o)
    args = (q.to(DEV), k.to(DEV), v.to(DEV))
    paged = decode_bf16(*args, None, seq.to(DEV), block_table=bt.to(DEV), block_size=block_size, num_splits=2,
                        block_n=16)
    same = decode_bf16(*args, flat.to(DEV), seq.to(DEV), num_splits=2, block_n=16)
    assert paged.path == "bf16" and torch.equal(paged.o, same.o) and torch.equal(paged.lse, same.lse)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(paged.o.double().cpu(), ref.o, atol=tol, rtol=tol)
