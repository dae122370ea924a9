"""Paged pools (kvlib.storage): writes bit-exact against each format's reference, shuffled non-contiguous
pages and ragged rows, and the byte account (format formula x positions allocated + page tables)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvlib.backends import Int4Backend, Int8Backend, PlainBackend
from kvlib.formats.base import get_format
from kvlib.formats.dither_int8 import dither_quantize
from kvlib.hf.cache import kernel_formats, make_cache
from kvlib.storage.blocks import BlockAllocator

D, HKV, L = 32, 2, 2
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel tests' device: on CPU under TRITON_INTERPRET=1
# the kernel tests' head dim: 64 on CUDA (the GPU lane's smallest; Triton's dots there are at least 16 deep, and the
# fma kernel's run d // 4 deep), the small shape under the interpreter
DK = 64 if torch.cuda.is_available() else D


def _cfg(head_dim: int = D) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                       num_key_value_heads=HKV, head_dim=head_dim, vocab_size=64)


def _fill(fmt: str, lens: list[int], device: str = "cpu", d: int = D, **opts):
    """A cache filled the way a benchmark does (cache.update), rows ragged through the keep mask."""
    torch.manual_seed(0)
    cache = make_cache(fmt, _cfg(d), block_size=4, shuffle_blocks=7, **opts)
    b, s = len(lens), max(lens)
    k = (torch.randn(b, HKV, s, d) * 2).to(device)
    v = torch.randn(b, HKV, s, d).to(device)
    keep = (torch.arange(s)[None, :] < torch.tensor(lens)[:, None]).to(device)
    for layer in range(L):
        la = cache.layers[layer]
        la.lazy_initialization(k, v)
        la._write(k, v, keep)
        la.columns = s
    return cache, k, v


def _slots(cache, layer: int, b: int, n: int) -> torch.Tensor:
    return cache.layers[layer].table.slot_table()[b, :n].long()


def test_pages_are_shuffled_and_not_contiguous() -> None:
    cache, _, _ = _fill("bf16", [11, 6])
    bt = cache.layers[0].table.blocks
    assert any(b2 != b1 + 1 for row in bt for b1, b2 in zip(row, row[1:]))
    a = BlockAllocator(8, shuffle=1)
    got = a.alloc(8)
    assert sorted(got) == list(range(8)) and got != list(range(8)) and a.alloc(1) is None


@pytest.mark.parametrize("layout,outliers", [("w24", False), ("h10", False), ("h8", True)])
def test_dither_int8_pool_bit_exact(layout: str, outliers: bool) -> None:
    table = torch.tensor([[[0, 16], [3, 19]]] * L) if outliers else None
    cache, k, v = _fill("dither-int8", [11, 6], dither_layout=layout, outlier_table=table)
    st = cache.backend
    assert isinstance(st, Int8Backend)
    for layer in range(L):
        for b, n in enumerate([11, 6]):
            sl = _slots(cache, layer, b, n)
            for h in range(HKV):
                oc = table[layer, h] if outliers else None
                qk = dither_quantize(k[b, h, :n], layer=layer, kv_head=h, slots=sl, seed=0, group=32,
                                     outlier_channels=oc, side=0, dither_layout=layout)
                qv = dither_quantize(v[b, h, :n], layer=layer, kv_head=h, slots=sl, seed=0, group=32, side=1,
                                     dithered=False, dither_layout=layout)
                assert torch.equal(st.k.codes[layer, sl, h], qk.codes)
                assert torch.equal(st.k.scales[layer, sl, h], qk.scales)
                if outliers:
                    assert torch.equal(st.k.outliers[layer, sl, h], qk.outliers)
                assert torch.equal(st.v.codes[layer, sl, h], qv.codes)
                assert torch.equal(st.v.scales[layer, sl, h], qv.scales)


def test_rtn_int8_pool_bit_exact() -> None:
    cache, k, v = _fill("rtn-int8", [9, 3])
    fmt = get_format("rtn-int8")
    for b, n in enumerate([9, 3]):
        sl = _slots(cache, 1, b, n)
        for h in range(HKV):
            for pool, x in ((cache.backend.k, k), (cache.backend.v, v)):
                p = fmt.write(x[b, h, :n])
                assert torch.equal(pool.codes[1, sl, h], p.codes) and torch.equal(pool.scales[1, sl, h], p.scales)


def test_kv4_pool_bit_exact() -> None:
    cache, k, v = _fill("kv4", [10, 5])
    st = cache.backend
    assert isinstance(st, Int4Backend)
    fmt = get_format("kv4")
    for b, n in enumerate([10, 5]):
        sl = _slots(cache, 0, b, n)
        for h in range(HKV):
            for side, x in ((0, k), (1, v)):
                p = fmt.write(x[b, h, :n], side=side)
                assert torch.equal(st.codes[side][0, sl, h], p.codes)
                assert torch.equal(st.scale[side][0, sl, h], p.scale[:, 0])
                assert torch.equal(st.off[side][0, sl, h], p.offset[:, 0])
    pages = st.pages(0, 0)
    assert pages[0].shape == (st.num_blocks, 4, HKV, D // 2) and pages[1].shape == (st.num_blocks, 4, HKV)


def test_kv4rl_pool_and_side_buffer_bit_exact() -> None:
    lens = [13, 5]
    cache, k, v = _fill("kv4rl", lens, sink=2, recent=4)
    st = cache.backend
    fmt = get_format("kv4rl", sink=2, recent=4)
    for b, n in enumerate(lens):
        for h in range(HKV):
            for side, x in ((0, k), (1, v)):
                ref = fmt.write(x[b, h, :n], side=side, positions=torch.arange(n))
                sl = _slots(cache, 1, b, n)
                assert torch.equal(st.codes[side][1, sl, h], ref.main.codes)
                occ = ref.side_pos >= 0
                assert torch.equal(st.side8[side][1][b, h][occ], ref.side[occ])
                assert torch.equal(st.side_scale[side][1][b, h][occ], ref.side_scale[occ])
    # the dequantised layer equals the format's read
    kk, vv = cache.layers[1].dequantized()
    for b, n in enumerate(lens):
        ref = fmt.read(fmt.write(k[b, 0, :n], side=0, positions=torch.arange(n)))
        assert torch.allclose(kk[b, 0, :n], ref, atol=1e-6)


@pytest.mark.parametrize("fmt,opts", [("bf16", {}), ("fp16", {}), ("dither-int8", {}), ("rtn-int8", {}),
                                      ("kv4", {}), ("kv4rl", {"sink": 2, "recent": 4}),
                                      ("dither-int8", {"outlier_table": torch.tensor([[[0, 16], [3, 19]]] * L)})])
def test_kv_nbytes_is_formula_times_positions_plus_tables(fmt: str, opts: dict) -> None:
    cache, _, _ = _fill(fmt, [11, 6], **opts)
    st = cache.backend
    positions = L * st.n_slots * HKV
    tabs = [(la.table.block_table, la.table.seq_lens) + ((la.table.tok, la.table.wpos) if la.table.token_slots else ())
            for la in cache.layers]  # int32 block tables and lengths (+ per-token slots where codes are slot-bound)
    tables = sum(t.numel() * 4 for ts in tabs for t in ts)
    assert cache.kv_nbytes() == st.bytes_per_position() * positions + st.fixed_bytes() + tables
    kf = get_format(fmt, **{k: v for k, v in opts.items() if k != "outlier_table"})
    if fmt in ("bf16", "fp16", "rtn-int8", "kv4"):
        assert st.bytes_per_position() == 2 * kf.bytes_per_position(D)
    if fmt == "kv4rl":
        # per (layer, head, side, row): the side buffer and the crop stash of crop_window=32 INT8 entries
        assert st.fixed_bytes() == 2 * L * HKV * 2 * (kf.fixed_bytes(D) + 32 * (D + 2))


def test_static_pools_allocate_once() -> None:
    cache = make_cache("bf16", _cfg(), batch_size=2, max_len=10, block_size=4, device="cpu")
    st = cache.backend
    assert isinstance(st, PlainBackend) and st.num_blocks == 2 * 3
    before = cache.kv_nbytes()
    x = torch.randn(2, HKV, 10, D)
    for layer in range(L):
        cache.update(x, x, layer)
    assert cache.kv_nbytes() == before
    with pytest.raises(ValueError, match="max_len"):
        cache.update(x[:, :, :1], x[:, :, :1], 0)


def test_kernel_formats_from_capabilities() -> None:
    ks = kernel_formats()
    assert {"dither-int8", "rtn-int8", "kv4", "kv4rl", "bf16"} <= set(ks)
    assert "kivi2" not in ks and "fp8-e4m3" not in ks


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """float64 attention of ``q [B, Hq, d]`` over ``k, v [B, Hkv, n, d]`` (GQA), row b over its first lens[b]."""
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        kk = k[b, :, :n].double().repeat_interleave(g, 0)
        vv = v[b, :, :n].double().repeat_interleave(g, 0)
        z = torch.einsum("hd,hnd->hn", q[b].double(), kk) * q.shape[-1] ** -0.5
        out[b] = torch.einsum("hn,hnd->hd", z.softmax(-1), vv)
    return out


def test_int8_decode_reference_and_kernel_read_the_shuffled_pool() -> None:
    """A block manager's pool (shuffled pages, ragged rows): the decode reference and the Triton kernel (on CUDA,
    else the CPU interpreter) over the per-token slot table agree with attention over the dequantised layer."""
    from kvlib.kernels.int8.decode import decode_int8, decode_reference

    lens = [11, 6]
    cache, _, _ = _fill("dither-int8", lens, device=DEV, d=DK)
    la, st = cache.layers[1], cache.backend
    torch.manual_seed(5)
    q = torch.randn(2, 4, DK).to(DEV)
    kk, vv = la.dequantized()
    want = _attend(q.cpu(), kk.cpu(), vv.cpu(), lens)
    args = (q, st.k.layer(1), st.v.layer(1), la.table.slot_table(), la.table.seq_lens)
    ref = decode_reference(*args, layer=1, seed=0, impl="fma")
    torch.testing.assert_close(ref.o.double().cpu(), want, atol=1e-5, rtol=0)
    got = decode_int8(*args, layer=1, seed=0, impl="fma", fallback_to_reference=False)
    assert got.path == "fma", got.path
    torch.testing.assert_close(got.o.double().cpu(), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.tv_bound_one.double().cpu(), ref.tv_bound_one.double().cpu(), rtol=1e-3,
                               atol=1e-6)


def test_int4_pages_are_the_paged_kernels_layout() -> None:
    """kv4 / kv4rl pages and side buffer, read by the INT4 helper's paged reference (when it is present)."""
    import kvlib.kernels.int4.decode as k4

    paged_ref = getattr(k4, "kv4_paged_decode_ref", None)
    if paged_ref is None:
        pytest.skip("kvlib.kernels.int4 has no kv4_paged_decode_ref yet")
    from kvlib.core.hadamard import hadamard

    for fmt, opts in (("kv4", {}), ("kv4rl", {"sink": 2, "recent": 4})):
        lens = [13, 7]
        cache, _, _ = _fill(fmt, lens, **opts)
        st, t = cache.backend, cache.layers[1].table
        torch.manual_seed(6)
        qp = k4.prepare_query_ref(torch.randn(2, 4, D), rotate=True)
        start, end = st.main_range(t.seq_lens)
        side = st.side_buffer(1, t.seq_lens) if st.rl else None
        o, _ = paged_ref(qp, *st.pages(1, 0), *st.pages(1, 1), t.block_table, start, end, block_size=4, side=side,
                         sm_scale=D ** -0.5)
        kk, vv = cache.layers[1].dequantized()
        want = _attend(qp.q8.float() * qp.scale.unsqueeze(-1), hadamard(kk.float()), vv, lens)  # rotated basis
        torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefill,steps,crop", [(10, 5, 3), (13, 0, 7), (6, 9, 9), (12, 2, 14)])
def test_kv4rl_crop_restores_the_side_buffer_exactly(prefill: int, steps: int, crop: int) -> None:
    """After a crop the side buffer holds what the format holds for the shorter stream (the crop stash)."""
    torch.manual_seed(2)
    cache = make_cache("kv4rl", _cfg(), sink=2, recent=4, block_size=4)
    n = prefill + steps
    k, v = torch.randn(2, HKV, n, D), torch.randn(2, HKV, n, D)
    for layer in range(L):
        cache.update(k[:, :, :prefill], v[:, :, :prefill], layer)
    for t in range(prefill, n):
        for layer in range(L):
            cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], layer)
    cache.crop(-crop)
    m = n - crop
    fmt = get_format("kv4rl", sink=2, recent=4)
    st = cache.backend
    for layer in range(L):
        for b in range(2):
            for h in range(HKV):
                for side, x in ((0, k), (1, v)):
                    ref = fmt.write(x[b, h, :m], side=side, positions=torch.arange(m))
                    occ = ref.side_pos >= 0
                    assert torch.equal(st.side8[side][layer][b, h][occ], ref.side[occ]), (layer, b, h, side)
                    assert torch.equal(st.side_scale[side][layer][b, h][occ], ref.side_scale[occ])
    assert cache.get_seq_length() == m


def test_kv4rl_crop_past_the_stash_is_refused() -> None:
    cache = make_cache("kv4rl", _cfg(), sink=2, recent=4, crop_window=2)
    x = torch.randn(1, HKV, 12, D)
    for layer in range(L):
        cache.update(x, x, layer)
    with pytest.raises(NotImplementedError, match="crop_window"):
        cache.crop(-5)


@pytest.mark.parametrize("fmt,opts", [("bf16", {}), ("dither-int8", {"dither_layout": "h8"}), ("kv4", {}),
                                      ("kv4rl", {"sink": 2, "recent": 4})])
def test_a_decode_step_write_reads_nothing_back_to_the_host(fmt: str, opts: dict, monkeypatch) -> None:
    """A one-token update of static pools makes no device-to-host read (what a CUDA graph cannot hold):
    every Tensor -> Python conversion raises inside the step."""
    cache = make_cache(fmt, _cfg(DK), batch_size=2, max_len=16, block_size=4, device=DEV, **opts)
    x = torch.randn(2, HKV, 9, DK).to(DEV)
    for layer in range(L):
        cache.update(x, x, layer)
    one = torch.randn(2, HKV, 1, DK).to(DEV)
    if fmt == "dither-int8":
        cache.backend.write_backend = "triton"  # the CUDA path's write kernel (on CPU under the interpreter)

    def refuse(*a, **k):
        raise AssertionError("host read inside a decode-step write")

    for name in ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for layer in range(L):
        cache.update(one, one, layer)
    monkeypatch.undo()
    assert cache.layers[0].table.seq_lens.tolist() == [10, 10]


@pytest.mark.parametrize("chunks", [(13,), (5, 8), (3, 1, 9), (40,), (17, 23)])
def test_kv4rl_chunked_writes_equal_token_by_token_writes(chunks: tuple[int, ...]) -> None:
    """A prefill written in chunks leaves kv4rl's side buffer, crop stash and stash counts exactly as one-token
    writes of the same tokens do (two code paths: the chunk's masked writes and the decode step's)."""
    torch.manual_seed(3)
    n = sum(chunks)
    k, v = torch.randn(3, HKV, n, D), torch.randn(3, HKV, n, D)
    a = make_cache("kv4rl", _cfg(), sink=2, recent=4, block_size=4)
    b = make_cache("kv4rl", _cfg(), sink=2, recent=4, block_size=4)
    t0 = 0
    for c in chunks:
        for layer in range(L):
            a.update(k[:, :, t0:t0 + c], v[:, :, t0:t0 + c], layer)
        t0 += c
    for t in range(n):
        for layer in range(L):
            b.update(k[:, :, t:t + 1], v[:, :, t:t + 1], layer)
    sa, sb = a.backend, b.backend
    u = sa.undo
    for layer in range(L):
        for side in (0, 1):
            assert torch.equal(sa.side8[side][layer], sb.side8[side][layer]), (layer, side)
            assert torch.equal(sa.side_scale[side][layer], sb.side_scale[side][layer])
            for row in range(3):
                # the stash holds the last u positions that left the recent window (past the sink of 2)
                pos = torch.arange(max(2, n - 4 - u), max(2, n - 4)) % u
                assert torch.equal(sa.stash8[side][layer][row, :, pos], sb.stash8[side][layer][row, :, pos])
                assert torch.equal(sa.stash_scale[side][layer][row, :, pos], sb.stash_scale[side][layer][row, :, pos])
