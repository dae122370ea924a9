"""Fused pool writes (kvlib.kernels.write, kvlib.kernels.int8.write): the bytes the torch write path stores, bit
for bit, on shuffled ragged pages (CPU interpreter, small shapes), no host read inside a decode-step write, the
path taken reported, and bad inputs refused with errors naming the argument."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvlib.core.hadamard import hadamard
from kvlib.formats.kv4 import int4_quantize_unchecked
from kvlib.hf.cache import make_cache
from kvlib.kernels.int8.write import write_int8, write_int8_kv
from kvlib.kernels.write.int4 import SideWrite, write_int4
from kvlib.storage.paged import PagedPool

HKV, HQ, L = 2, 4, 2
# CUDA where present (the GPU lane, dev/gpu/test-gpu.sh), else the CPU under TRITON_INTERPRET=1 (tests/conftest.py)
DEV = "cuda" if torch.cuda.is_available() else "cpu"

FORMATS = [
    ("dither-int8", {"dither_layout": "w24"}),
    ("dither-int8", {"dither_layout": "h10"}),
    ("dither-int8", {"dither_layout": "h8", "outliers": True}),
    ("dither-int8", {"dither_layout": "w24", "outliers": True, "outlier_sides": (0, 1)}),  # V outliers too
    ("rtn-int8", {}),
    ("kv4", {}),
    ("kv4rl", {"sink": 2, "recent": 4}),
]


def _cfg(d: int) -> LlamaConfig:
    # GQA: 4 query heads on 2 KV heads
    return LlamaConfig(hidden_size=HQ * d, intermediate_size=64, num_hidden_layers=L, num_attention_heads=HQ,
                       num_key_value_heads=HKV, head_dim=d, vocab_size=32)


def _opts(opts: dict, d: int) -> dict:
    o = dict(opts)
    if o.pop("outliers", False):
        # two RoPE pairs per head (rotate-half: c, c + d/2), different per (layer, head)
        o["outlier_table"] = torch.tensor([[[0, 3, d // 2, d // 2 + 3], [1, 5, d // 2 + 1, d // 2 + 5]]] * L)
    return o


def _store_tensors(st) -> list[torch.Tensor]:
    ts = list(st._tensors())
    if getattr(st, "rl", False):
        ts += [t for grp in (st.side8, st.side_scale, st.stash8, st.stash_scale) for lay in grp for t in lay]
    return ts


def _run(fmt: str, opts: dict, d: int, backend: str, lens: list[int], steps: int, max_len: int | None = None):
    """Prefill ragged rows (keep mask: the chunk write), then ``steps`` one-token decode steps (cache.update)."""
    torch.manual_seed(1)
    kw = dict(batch_size=len(lens), max_len=max_len) if max_len else {}
    cache = make_cache(fmt, _cfg(d), block_size=4, shuffle_blocks=5, device=DEV, **kw, **_opts(opts, d))
    b, s = len(lens), max(lens)
    k = torch.randn(b, HKV, s, d, device=DEV) * 3
    v = torch.randn(b, HKV, s, d, device=DEV)
    k[0, 0, 0] = 0.0  # an all-zero token (zero scale)
    v[-1, 1, 0] = 2.5  # a constant one (zero range)
    keep = (torch.arange(s)[None, :] < torch.tensor(lens)[:, None]).to(DEV)
    paths = []
    for layer in range(L):
        la = cache.layers[layer]
        la.lazy_initialization(k, v)
        cache.backend.write_backend = backend
        la._write(k, v, keep)
        la.columns = s
        paths.append(cache.backend.write_path)
    for _ in range(steps):
        one_k = (torch.randn(b, HKV, 1, d, device=DEV) * 2).to(torch.bfloat16)  # what a bf16 model hands over
        one_v = torch.randn(b, HKV, 1, d, device=DEV).to(torch.bfloat16)
        for layer in range(L):
            cache.update(one_k, one_v, layer)
        paths.append(cache.backend.write_path)
    return cache, paths


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmt,opts", FORMATS, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.values())))
def test_fused_write_equals_the_torch_write_bit_for_bit(fmt: str, opts: dict, d: int) -> None:
    lens = [9, 3, 6]
    ref, ref_paths = _run(fmt, opts, d, "torch", lens, steps=6)
    got, got_paths = _run(fmt, opts, d, "triton", lens, steps=6)
    fam = "int8" if "int8" in fmt else fmt
    assert all(p.startswith(f"{fam}-torch") for p in ref_paths), ref_paths
    assert all(p.startswith(f"{fam}-triton") for p in got_paths), got_paths
    assert got_paths[-1] == f"{fam}-triton"  # a decode step: the whole write fused (kv4rl's side buffer too)
    assert any(b2 != b1 + 1 for row in got.layers[0].table.blocks for b1, b2 in zip(row, row[1:]))  # shuffled
    a, b = _store_tensors(ref.backend), _store_tensors(got.backend)
    assert len(a) == len(b) and len(a) >= 4
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), (i, x.dtype, (x != y).sum())
    if fmt == "kv4rl":
        assert ref.backend.valid == got.backend.valid


def test_kv4_kernel_equals_the_reference_quantizer_on_raw_slots() -> None:
    """The launcher alone: shuffled distinct slots, strided (non-contiguous) inputs, both sides."""
    torch.manual_seed(2)
    n, h, d, ns = 5, 3, 64, 17
    base = torch.randn(h, n, d, device=DEV) * 4
    k = base.transpose(0, 1)  # [n, h, d], stride(0) = d: a transposed view, as HF hands K over
    v = torch.randn(n, h, d, device=DEV).half()
    slots = torch.randperm(ns)[:n].to(DEV)
    pages = [_pages(ns, h, d) for _ in range(2)]
    write_int4(k, v, slots, pages[0], pages[1], validate=True)
    for side, x in enumerate((hadamard(k.float()), v.float())):
        want = int4_quantize_unchecked(x)
        for t, w in zip(pages[side], want):
            assert torch.equal(t[slots], w)
    untouched = torch.ones(ns, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert not pages[0][0][untouched].any() and not pages[1][1][untouched].any()


@pytest.mark.parametrize("fmt,opts", FORMATS + [("bf16", {})],
                         ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.values())))
def test_a_fused_decode_step_write_reads_nothing_back_to_the_host(fmt: str, opts: dict, monkeypatch) -> None:
    """Static pools, fused write: every Tensor -> Python conversion raises inside the decode step's update
    (what a CUDA graph cannot hold; the GPU script checks the same with torch.cuda.set_sync_debug_mode)."""
    d = 64
    cache = make_cache(fmt, _cfg(d), batch_size=2, max_len=16, block_size=4, device=DEV, **_opts(opts, d))
    x = torch.randn(2, HKV, 7, d, device=DEV)
    for layer in range(L):
        cache.update(x, x, layer)
    if fmt != "bf16":
        cache.backend.write_backend = "triton"
    one = torch.randn(2, HKV, 1, d, device=DEV)

    def refuse(*a, **k):
        raise AssertionError("host read inside a decode-step write")

    for name in ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a device-to-host sync raises
    try:
        for layer in range(L):
            cache.update(one, one, layer)
    finally:
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    monkeypatch.undo()
    assert cache.layers[0].table.seq_lens.tolist() == [8, 8]
    if fmt != "bf16":
        assert cache.backend.write_path.endswith("-triton"), cache.backend.write_path


def test_the_torch_write_path_of_rtn_int8_does_read_the_host() -> None:
    """The mock above can fail: rtn-int8's torch path checks its scales on the host (bool(tensor))."""
    d = 64
    cache = make_cache("rtn-int8", _cfg(d), batch_size=2, max_len=16, block_size=4, device=DEV)
    x = torch.randn(2, HKV, 3, d, device=DEV)
    cache.update(x, x, 0)
    cache.backend.write_backend = "torch"
    calls = []
    orig = torch.Tensor.__bool__

    def spy(self):
        calls.append(1)
        return orig(self)

    torch.Tensor.__bool__ = spy
    try:
        cache.update(x[:, :, :1], x[:, :, :1], 0)
    finally:
        torch.Tensor.__bool__ = orig
    assert calls


def test_write_path_auto_and_explicit_choices() -> None:
    d = 64
    cache = make_cache("kv4", _cfg(d), block_size=4, device=DEV)
    x = torch.randn(1, HKV, 2, d, device=DEV)
    cache.update(x, x, 0)
    # auto: fused on CUDA; on a plain CPU the torch path, and it says so
    assert cache.backend.write_path == ("kv4-triton" if DEV == "cuda" else "kv4-torch")
    cache.backend.interpret = True  # the decode kernels under the interpreter: the fused write too
    cache.update(x[:, :, :1], x[:, :, :1], 0)
    assert cache.backend.write_path == "kv4-triton"
    cache.backend.write_backend = "fast"
    with pytest.raises(ValueError, match="write_backend"):
        cache.update(x[:, :, :1], x[:, :, :1], 0)


def test_fused_write_refuses_shapes_it_cannot_take() -> None:
    cache = make_cache("rtn-int8", _cfg(48), block_size=4, group=16, device=DEV)  # d // group = 3: not the kernel's
    x = torch.randn(1, HKV, 2, 48, device=DEV)
    cache._ensure_backend(x)
    cache.backend.write_backend = "triton"
    with pytest.raises(ValueError, match="powers of two"):
        cache.update(x, x, 0)
    cache.backend.write_backend = "auto"
    cache.backend.interpret = True
    cache.update(x, x, 1)
    assert cache.backend.write_path.startswith("int8-torch:")  # auto takes the torch path and says why


def _pages(ns: int, h: int, d: int):
    return (torch.zeros(ns, h, d // 2, dtype=torch.uint8, device=DEV),
            torch.zeros(ns, h, dtype=torch.float16, device=DEV), torch.zeros(ns, h, dtype=torch.float16, device=DEV))


def test_write_int4_bad_inputs_name_the_argument() -> None:
    n, h, d, ns = 2, 2, 32, 8
    k, v = torch.randn(n, h, d, device=DEV), torch.randn(n, h, d, device=DEV)
    sl = torch.tensor([1, 4], device=DEV)
    pk, pv = _pages(ns, h, d), _pages(ns, h, d)
    with pytest.raises(ValueError, match="k and v"):
        write_int4(k, v[:, :1], sl, pk, pv)
    with pytest.raises(ValueError, match="head_dim"):
        write_int4(k[..., :24], v[..., :24], sl, pk, pv)
    with pytest.raises(ValueError, match="slots"):
        write_int4(k, v, sl[:1], pk, pv)
    with pytest.raises(TypeError, match="slots"):
        write_int4(k, v, sl.float(), pk, pv)
    with pytest.raises(ValueError, match=r"k_pages\[0\]"):
        write_int4(k, v, sl, _pages(ns, h + 1, d), pv)
    with pytest.raises(TypeError, match=r"v_pages\[1\]"):
        write_int4(k, v, sl, pk, (pv[0], pv[1].float(), pv[2]))
    with pytest.raises(ValueError, match="slots must lie"):
        write_int4(k, v, torch.tensor([1, ns], device=DEV), pk, pv, validate=True)
    with pytest.raises(ValueError, match="distinct"):
        write_int4(k, v, torch.tensor([3, 3], device=DEV), pk, pv, validate=True)
    z8 = torch.zeros(2, h, 3, d, dtype=torch.int8, device=DEV)
    zs = torch.ones(2, h, 3, dtype=torch.float16, device=DEV)
    rows, pos, la = (torch.tensor(t, device=DEV) for t in ([0, 1], [5, 6], [6, 7]))
    side = SideWrite(rows, pos, la, 1, 2, (z8, z8), (zs, zs), (z8, z8), (zs, zs))
    write_int4(k, v, sl, pk, pv, side=side)  # well-formed: accepted
    bad = SideWrite(rows, pos, la, 1, 3, (z8, z8), (zs, zs), (z8, z8), (zs, zs))
    with pytest.raises(ValueError, match=r"side.buf8\[0\]"):
        write_int4(k, v, sl, pk, pv, side=bad)
    with pytest.raises(ValueError, match="side.rows"):
        write_int4(k, v, sl, pk, pv, side=SideWrite(rows[:1], *list(vars(side).values())[1:]))


def test_write_int8_rtn_rule_bad_inputs() -> None:
    pool = PagedPool(n_layers=1, n_slots=8, n_kv_heads=2, d=32, dithered=True, device=DEV)
    x = torch.randn(2, 2, 32, device=DEV)
    sl = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="rule"):
        write_int8(pool, 0, x, sl, backend="triton", rule="fast")
    with pytest.raises(ValueError, match="rule='rtn'"):
        write_int8(pool, 0, x, sl, backend="triton", rule="rtn")
    with pytest.raises(ValueError, match="x must have shape"):
        write_int8(pool, 0, x[:, :1], sl, backend="triton")


def test_write_int8_kv_bad_inputs_name_the_argument() -> None:
    kw = dict(n_layers=1, n_slots=8, n_kv_heads=2, d=32, device=DEV)
    kp, vp = PagedPool(side=0, **kw), PagedPool(side=1, dithered=False, **kw)
    x = torch.randn(2, 2, 32, device=DEV)
    sl = torch.tensor([0, 5], device=DEV)
    write_int8_kv(kp, vp, 0, x, x, sl)  # well-formed: accepted
    with pytest.raises(ValueError, match="group"):
        write_int8_kv(kp, PagedPool(side=1, group=16, **kw), 0, x, x, sl)
    with pytest.raises(ValueError, match="kpool: rule='rtn'"):
        write_int8_kv(kp, vp, 0, x, x, sl, rule="rtn")
    with pytest.raises(ValueError, match="slots must have length"):
        write_int8_kv(kp, vp, 0, x, x, sl[:1])
    with pytest.raises(ValueError, match="layer"):
        write_int8_kv(kp, vp, 1, x, x, sl)


@pytest.mark.parametrize("fmt", ["kv4", "dither-int8"])  # block-table slots; token-slot mode (slot-bound pages)
def test_step_addresses_kernel_equals_the_torch_addressing(fmt: str) -> None:
    """kvlib.backends.step_addresses: one launch == PageTable.step_addresses (rows, pos, write_slots, pos + 1, and the
    token-slot record)."""
    from kvlib.backends import step_addresses

    lens = [9, 3, 6]
    tabs = []
    for backend in ("torch", "triton"):
        cache, _ = _run(fmt, {}, 64, "torch", lens, steps=0)
        t = cache.layers[0].table
        t.reserve([1] * len(lens))
        got = step_addresses(t, backend)
        tabs.append((got, t.tok.clone() if t.token_slots else None, t))
    (a, tok_a, ta), (b, tok_b, tb) = tabs
    assert ta.token_slots == (fmt == "dither-int8")
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y)
    assert torch.equal(a[1], ta.seq_lens.long()) and torch.equal(a[3], a[1] + 1)
    assert torch.equal(a[2], ta.slots(a[0], ta.wpos.long() if ta.token_slots else a[1]))
    if tok_a is not None:
        assert torch.equal(tok_a, tok_b)
    with pytest.raises(ValueError, match="backend"):
        step_addresses(ta, "fast")


@pytest.mark.parametrize("fmt,want", [("bf16", "plain-torch"), ("sr-int8", "reference-torch"),
                                      ("kivi2", "reference-torch")])
def test_stores_without_a_fused_write_say_so(fmt: str, want: str) -> None:
    cache = make_cache(fmt, _cfg(64), block_size=4, device=DEV)
    x = torch.randn(1, HKV, 3, 64, device=DEV)
    cache.update(x, x, 0)
    assert cache.backend.write_path == want


def test_the_side_buffer_rules_have_one_source() -> None:
    """The fused write kernel compiles the format's own functions (issue 38: no restatement of the ring rule), and
    those functions give the same answers on ints and tensors as the torch helpers built on them."""
    from kvlib.formats import kv4rl
    from kvlib.kernels.write import int4 as w

    assert w._ring_index.fn.__code__ is kv4rl.ring_index.__code__
    assert w._is_protected.fn.__code__ is kv4rl.is_protected.__code__
    sink, recent, n = 4, 6, 23
    p = torch.arange(n)
    slots = kv4rl.ring_slot(p, sink, recent)
    for i in range(n):
        assert bool(kv4rl.is_protected(i, n, sink, recent)) == bool(kv4rl.protected_mask(n, sink, recent)[i])
        want = i if i < sink else sink + (i - sink) % recent  # the rule as the paper's App. states it
        assert int(slots[i]) == want
        if i >= sink:
            assert kv4rl.ring_index(i, sink, recent) == want
    # the protected positions of a stream occupy distinct slots (no two live entries share one)
    live = slots[kv4rl.protected_mask(n, sink, recent)]
    assert live.unique().numel() == live.numel() == sink + recent
