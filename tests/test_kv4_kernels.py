"""KV4 / KV4-RL decode: Triton kernels vs torch references, and the exact regional merge.

Every kernel test runs on CUDA when a GPU is present (``device`` fixture) and otherwise on the CPU under the
Triton interpreter with small shapes; tests marked ``gpu`` need the GPU (real shapes, CUDA graphs, compiled
kernels)."""

import pytest
import torch

from kvlib.core.merge import merge_states
from kvlib.formats import get_format
from kvlib.kernels.int4.attention import (
    build_kv4_batch,
    decode_ref,
    dequantized_kv,
    kv4_decode,
    kv4rl_decode,
    side_buffer,
)
from kvlib.kernels.int4.decode import (
    DEFAULT_CONFIG,
    KV4KernelConfig,
    KV4Launch,
    SideBuffer,
    default_num_splits,
    kv4_main_decode,
    kv4_main_decode_ref,
    pipe_edges_applies,
    plan_kv4_decode,
    prepare_query,
    prepare_query_ref,
    region_attention_ref,
    tma_applies,
    tma_refusal,
)
from kvlib.kernels.int4.protected import protected_decode, protected_decode_ref

#: where the kernels run: CUDA when present (conftest.py leaves TRITON_INTERPRET unset then), else the interpreter
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gpu(f):
    """Mark a test that needs the GPU itself (``-m gpu`` selects them; skipped without CUDA)."""
    return pytest.mark.gpu(pytest.mark.skipif(DEV.type != "cuda", reason="needs a CUDA device")(f))


# small shapes for the interpreter; on the GPU d = 64, the smallest head dim the INT8 tensor-core dots take
B, HQ, HKV, N = 3, 4, 2, 90
D = 64 if DEV.type == "cuda" else 32
LENGTHS = torch.tensor([90, 30, 5])


@pytest.fixture
def device() -> torch.device:
    return DEV


def _qkv(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, D, generator=g)
    k = torch.randn(B, HKV, N, D, generator=g)
    k[..., 3] *= 10
    v = torch.randn(B, HKV, N, D, generator=g)
    return q.to(device), k.to(device), v.to(device)


def _close(a, b, atol):
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    assert (a[fin] - b[fin]).abs().max() <= atol


@pytest.mark.parametrize("precision", ["mma", "ieee"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prepare_query_kernel_matches_reference(precision, dtype, device):
    """The rotation as bf16 pieces (exact for each input dtype) against +-1 Hadamard, or one fp32 dot:
    codes within one step of the reference (ties), scales to fp32 rounding."""
    q, _, _ = _qkv(0, device)
    q = q.to(dtype)
    a, b = prepare_query(q, backend="triton", precision=precision), prepare_query_ref(q)
    assert (a.q8.int() - b.q8.int()).abs().max() <= 1
    assert torch.allclose(a.scale, b.scale, rtol=1e-5)
    assert torch.allclose(a.qsum, b.qsum, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("int_pv", [False, True])
def test_main_kernel_matches_reference_ragged(int_pv, device):
    q, k, v = _qkv(0, device)
    c = build_kv4_batch(k, v, LENGTHS.to(device))
    qp = prepare_query_ref(q)
    # the last request: an empty region
    start, end = torch.tensor([0, 10, 5], device=device), torch.tensor([90, 60, 5], device=device)
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, end)
    # int PV re-quantises p per block row: its error grows with block_n (bound checked at 64)
    o, lse = kv4_main_decode(*args, int_pv=int_pv, num_splits=3, block_n=64 if int_pv else None, backend="triton")
    o_ref, lse_ref = kv4_main_decode_ref(*args)
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 5e-2 if int_pv else 2e-3)
    assert torch.isneginf(lse[2]).all() and (o[2] == 0).all()


VARIANTS = [
    dict(k_mode="bytes"),
    dict(k_mode="planes"),  # falls back to bytes below d = 128; exercised at d = 128 below
    dict(k_mode="trans", tile_sums=False),
    dict(rows=16, tile_sums=False),
    dict(block_n=16, num_splits=8),  # more splits than blocks: empty splits merge away
    dict(block_n=32, num_splits=1),
    dict(block_n=16, num_splits=3, pipe_edges=True),
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_kernel_variants_match_reference(kw, device):
    q, k, v = _qkv(8, device)
    c = build_kv4_batch(k, v, LENGTHS.to(device))
    qp = prepare_query_ref(q)
    start, end = torch.tensor([3, 10, 0], device=device), torch.tensor([88, 11, 5], device=device)
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, end)
    o, lse = kv4_main_decode(*args, config=DEFAULT_CONFIG.replace(**kw), backend="triton")
    o_ref, lse_ref = kv4_main_decode_ref(*args)
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-3)


@pytest.mark.parametrize(("k_mode", "n"), [("planes", 48), ("bytes", 45)])
def test_kernel_d128_word_paths(k_mode, n, device):
    """d = 128 (the int16/int32 word paths at full width); odd N takes the 16-bit scale loads."""
    g = torch.Generator().manual_seed(9)
    b, hkv, d = 2, 1, 128
    q = torch.randn(b, 4, d, generator=g).to(device)
    k, v = torch.randn(b, hkv, n, d, generator=g).to(device), torch.randn(b, hkv, n, d, generator=g).to(device)
    c = build_kv4_batch(k, v, torch.tensor([n, 7], device=device))
    qp = prepare_query_ref(q)
    start = torch.tensor([0, 2], device=device)
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, c.lengths)
    o, lse = kv4_main_decode(*args, config=KV4KernelConfig(block_n=32, k_mode=k_mode), backend="triton")
    o_ref, lse_ref = kv4_main_decode_ref(*args)
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-3)


@pytest.mark.parametrize("group", [1, 3, 12])
def test_query_rows_cover_any_group(group, device):
    """The default tile's query rows: at least MIN_ROWS, the group rounded up to a power of two above it
    (12 -> 16); KV4-RL (protected region included) matches the reference for each group size."""
    g = torch.Generator().manual_seed(13)
    hkv, n, d = 2, 40, D
    q = torch.randn(2, hkv * group, d, generator=g).to(device)
    k, v = torch.randn(2, hkv, n, d, generator=g).to(device), torch.randn(2, hkv, n, d, generator=g).to(device)
    cache = build_kv4_batch(k, v, torch.tensor([40, 9], device=device), sink=2, recent=8)
    o, lse = kv4rl_decode(q, cache, backend="triton", config=DEFAULT_CONFIG.replace(block_n=16))
    o_ref, lse_ref = decode_ref(q, cache)
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-2)
    with pytest.raises(ValueError, match="rows"):
        kv4rl_decode(q, cache, backend="triton", config=DEFAULT_CONFIG.replace(rows=4 if group > 4 else 3))


@pytest.mark.parametrize("pipe_edges", [False, True], ids=["peeled", "pipe_edges"])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_fused_kv4rl_split_counts_match_reference(splits, pipe_edges, device):
    """The protected region's extra program meets any number of INT4 splits in the merge."""
    q, k, v = _qkv(11, device)
    cache = build_kv4_batch(k, v, torch.tensor([90, 17, 0], device=device), sink=4, recent=16)
    cfg = DEFAULT_CONFIG.replace(block_n=16, num_splits=splits, pipe_edges=pipe_edges)
    o, lse = kv4rl_decode(q, cache, backend="triton", config=cfg)
    o_ref, lse_ref = decode_ref(q, cache)
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-2)  # bf16 PV operands on the protected region


def test_fused_kv4rl_matches_two_launches_and_reference(device):
    q, k, v = _qkv(10, device)
    lengths = torch.tensor([90, 17, 0], device=device)  # long, shorter than sink + recent, empty
    cache = build_kv4_batch(k, v, lengths, sink=4, recent=16)
    o_f, lse_f = kv4rl_decode(q, cache, backend="triton")
    o_2, lse_2 = kv4rl_decode(q, cache, backend="triton", fused=False)
    o_ref, lse_ref = decode_ref(q, cache)
    _close(lse_f, lse_2, 1e-5)
    _close(o_f, o_2, 1e-5)
    _close(lse_f, lse_ref, 1e-4)
    _close(o_f, o_ref, 2e-2)  # bf16 PV operands on the protected region
    assert torch.isneginf(lse_f[2]).all() and (o_f[2] == 0).all()


@pytest.mark.parametrize("with_side", [False, True], ids=["kv4", "kv4rl"])
@pytest.mark.parametrize("splits", [1, 3])
def test_fused_merge_matches_merge_launch_and_resets_counters(splits, with_side, device):
    """The last program of each pair merges the states in the decode launch: the same output as the merge
    launch (fp32 rounding), the prepared query's counters back at zero after each call (so it decodes again
    identically), and a query prepared without counters gives the same result."""
    import dataclasses

    from kvlib.kernels.int4.decode import fuse_merge_applies

    q, k, v = _qkv(12, device)
    cache = build_kv4_batch(k, v, torch.tensor([90, 17, 0], device=device), sink=4, recent=16)
    decode = kv4rl_decode if with_side else kv4_decode
    base = DEFAULT_CONFIG.replace(block_n=16, num_splits=splits, fuse_merge=False)
    fused_cfg = base.replace(fuse_merge=True)
    ns = splits + int(with_side)
    assert fuse_merge_applies(fused_cfg, ns, 8, D) == (ns > 1)
    qp = prepare_query(q, backend="triton")
    assert qp.arrivals is not None and qp.arrivals.shape == (B * HQ,) and not qp.arrivals.any()
    o_l, lse_l = decode(q, cache, qp=qp, backend="triton", config=base)
    qp.arrivals.fill_(0)
    o_f, lse_f = decode(q, cache, qp=qp, backend="triton", config=fused_cfg)
    assert not qp.arrivals.any()
    o_f2, lse_f2 = decode(q, cache, qp=qp, backend="triton", config=fused_cfg)
    assert not qp.arrivals.any()
    o_f3, lse_f3 = decode(q, cache, qp=dataclasses.replace(qp, arrivals=None), backend="triton", config=fused_cfg)
    assert torch.equal(o_f, o_f2) and torch.equal(lse_f, lse_f2)
    assert torch.equal(o_f, o_f3) and torch.equal(lse_f, lse_f3)
    _close(lse_f, lse_l, 1e-5)
    _close(o_f, o_l, 1e-5)
    assert torch.isneginf(lse_f[2]).all() and (o_f[2] == 0).all()


def test_fused_merge_declines_tiles_too_wide():
    cfg = DEFAULT_CONFIG.replace(fuse_merge=True)
    from kvlib.kernels.int4.decode import fuse_merge_applies

    assert fuse_merge_applies(cfg, 2, 8, 128)
    assert not fuse_merge_applies(cfg, 1, 8, 128)  # one state: nothing to merge
    assert not fuse_merge_applies(cfg, 17, 8, 128)  # 8 x 32 x 128 fp32 over 128 threads: too many registers
    assert not fuse_merge_applies(cfg.replace(fuse_merge=False), 2, 8, 128)
    auto = DEFAULT_CONFIG
    assert auto.fuse_merge is None
    assert fuse_merge_applies(auto, 3, 8, 128, splits=2)  # two INT4 splits (and a protected state)
    assert not fuse_merge_applies(auto, 2, 8, 128, splits=1)  # one split and the protected state: a merge launch


def test_side_buffer_argument_checks(device):
    q, k, v = _qkv(0, device)
    c = build_kv4_batch(k, v, LENGTHS.to(device), sink=4, recent=16)
    qp = prepare_query_ref(q)
    side = side_buffer(c)
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, *c.main_range())
    with pytest.raises(ValueError, match="k8/v8"):
        kv4_main_decode(*args, side=SideBuffer(side.k8[:, :, :, :8], *side[1:]))
    with pytest.raises(ValueError, match="count"):
        kv4_main_decode(*args, side=side._replace(count=side.count[:2]))
    with pytest.raises(ValueError, match="k_mode"):
        kv4_main_decode(*args, config=KV4KernelConfig(k_mode="nibbles"), backend="triton")
    with pytest.raises(ValueError, match="rows"):
        kv4_main_decode(*args, config=KV4KernelConfig(rows=3), backend="triton")


def test_default_num_splits_bounds():
    cpu = torch.device("cpu")
    assert default_num_splits(4, 2, 100, 128, cpu) == 1
    assert default_num_splits(4, 2, 1000, 128, cpu) == 2


def test_protected_kernel_matches_reference(device):
    q, k, v = _qkv(1, device)
    c = build_kv4_batch(k, v, LENGTHS.to(device), sink=4, recent=16)
    qp = prepare_query_ref(q)
    count = c.side_count()
    o, lse = protected_decode(qp, c.k8, c.k8_scale, c.v8, c.v8_scale, count, backend="triton")
    o_ref, lse_ref = protected_decode_ref(qp, c.k8, c.k8_scale, c.v8, c.v8_scale, count)
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-2)  # bf16 PV operands


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_kv4_and_kv4rl_decode_match_single_pass(backend, device):
    q, k, v = _qkv(3, device)
    for cache, fn, tol in (
        (build_kv4_batch(k, v, LENGTHS.to(device)), kv4_decode, 2e-3),
        (build_kv4_batch(k, v, LENGTHS.to(device), sink=4, recent=16), kv4rl_decode, 2e-2),
    ):
        o, lse = fn(q, cache, backend=backend)
        o_ref, lse_ref = decode_ref(q, cache)
        _close(lse, lse_ref, 1e-4)
        _close(o, o_ref, tol if backend == "triton" else 1e-5)


def test_side_buffer_matches_format_written_token_by_token():
    _, k, v = _qkv(4)
    c = build_kv4_batch(k, v, LENGTHS, sink=4, recent=16)
    f = get_format("kv4rl", sink=4, recent=16)
    for b, n in enumerate(LENGTHS.tolist()):
        for h in range(HKV):
            p = f.write(k[b, h, :1], side=0)
            for t in range(1, n):
                p = f.append(p, k[b, h, t : t + 1], side=0)
            assert torch.equal(p.side_pos, c.side_pos[b])
            occ = p.side_pos >= 0
            assert torch.equal(p.side[occ], c.k8[b, h][occ])
            assert torch.equal(p.main.codes, c.k_codes[b, h, :n])


def _attend(q, k, v, mask):
    return region_attention_ref(q, k, v, mask, D**-0.5)


@pytest.mark.parametrize("seed", range(4))
def test_any_split_into_two_regions_merges_exactly(seed):
    q, k, v = _qkv(seed)
    g = torch.Generator().manual_seed(100 + seed)
    valid = torch.arange(N)[None, :] < LENGTHS[:, None]
    region = torch.rand(B, N, generator=g) < torch.rand(B, 1, generator=g)
    o_a, lse_a = _attend(q, k, v, valid & region)
    o_b, lse_b = _attend(q, k, v, valid & ~region)
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    o_ref, lse_ref = _attend(q, k, v, valid)
    assert torch.allclose(lse, lse_ref, atol=1e-5)
    assert torch.allclose(o, o_ref, atol=1e-5)


def test_kv4rl_regions_disjoint_and_covering():
    _, k, v = _qkv(5)
    c = build_kv4_batch(k, v, LENGTHS, sink=4, recent=16)
    start, end = c.main_range()
    for b, n in enumerate(LENGTHS.tolist()):
        main = set(range(int(start[b]), int(end[b])))
        prot = set(c.side_pos[b][c.side_pos[b] >= 0].tolist())
        assert not main & prot and main | prot == set(range(n))
        assert len(prot) == int(c.side_count()[b])


def test_kv4rl_improves_fidelity_over_kv4():
    q, k, v = _qkv(6)
    o_ref, _ = region_attention_ref(q, k, v, torch.arange(N)[None, :] < LENGTHS[:, None], D**-0.5)
    o4, _ = kv4_decode(q, build_kv4_batch(k, v, LENGTHS), backend="torch")
    orl, _ = kv4rl_decode(q, build_kv4_batch(k, v, LENGTHS, sink=4, recent=16), backend="torch")
    assert (orl - o_ref).pow(2).mean() < (o4 - o_ref).pow(2).mean()


def test_dequantized_kv_protected_positions_are_int8():
    _, k, v = _qkv(7)
    c = build_kv4_batch(k, v, LENGTHS, sink=4, recent=16)
    kd, vd = dequantized_kv(c)
    assert (vd[0, :, 89] - v[0, :, 89]).abs().max() < 0.05


def test_bad_inputs():
    q, k, v = _qkv()
    c = build_kv4_batch(k, v, LENGTHS)
    with pytest.raises(ValueError, match="q must be"):
        kv4_decode(q[:, :, :16], c)
    with pytest.raises(ValueError, match="side buffer"):
        kv4rl_decode(q, c)
    with pytest.raises(ValueError, match="lengths"):
        build_kv4_batch(k, v, torch.tensor([91, 1, 1]))
    with pytest.raises(ValueError, match="power of two"):
        build_kv4_batch(k[..., :24], v[..., :24], LENGTHS)
    with pytest.raises(ValueError, match="backend"):
        kv4_decode(q, c, backend="cuda")


@pytest.mark.skipif(DEV.type == "cuda", reason="the sweep's tiny mode is its CPU-interpreter wiring")
def test_sweep_tiny_wiring():
    """The GPU tuning sweep's code path at tiny shapes under the interpreter (times mean nothing)."""
    from dev.kv4_sweep import FAMILIES, TINY_SHAPES, Sweep, compile_variants

    for family, variants in FAMILIES.items():  # every family's configs are valid KV4KernelConfig copies
        assert variants(True)[0][0] == "default", family
    sw = Sweep(tiny=True)
    ok = sw.check(compile_variants(tiny=True)[:1])
    assert [name for name, _ in ok] == ["default"]
    assert sw.results["check"]["default_oddN"]["pass"]
    res = sw.shape(TINY_SHAPES[0], ok)
    assert res["best"]["kv4_ms"] > 0 and set(res["kv4rl"]) >= {"best_fused", "best_two_launch"}


TMA_KW = [dict(), dict(k_mode="trans", block_n=64), dict(block_n=128, num_splits=1), dict(block_n=64, pipe_edges=True)]


@pytest.mark.parametrize("kw", TMA_KW, ids=["bytes", "trans", "one_split", "pipe_edges"])
@pytest.mark.parametrize("with_side", [False, True], ids=["kv4", "kv4rl"])
def test_tma_descriptor_path_matches_reference(kw, with_side, device):
    """TMA loads (N a multiple of 8; the copy engine's zero fill past N replaces the masks), over enough blocks
    that a split's pipelined loop cycles through every shared-memory stage (the second stage is where a box
    that is not a multiple of 128 bytes lands misaligned)."""
    n = 256
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, HQ, D, generator=g).to(device)
    k, v = torch.randn(B, HKV, n, D, generator=g).to(device), torch.randn(B, HKV, n, D, generator=g).to(device)
    c = build_kv4_batch(k, v, torch.tensor([256, 141, 7], device=device), sink=4, recent=16)
    cfg = DEFAULT_CONFIG.replace(tma=True, **kw)
    assert tma_applies(cfg, n, D) and not tma_applies(cfg, 90, D) and not tma_applies(cfg.replace(int_pv=True), n, D)
    qp = prepare_query_ref(q)
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, *c.main_range())
    side = side_buffer(c) if with_side else None
    lp = plan_kv4_decode(*args, config=cfg, side=side, backend="triton")
    assert lp.tma and lp.tma_note == ""
    o, lse = lp.run()
    o_ref, lse_ref = kv4_main_decode(*args, side=side, backend="torch")
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-2 if with_side else 2e-3)  # bf16 PV operands on the protected region


def test_tma_refusals_are_named_on_the_launch_record(device):
    """Shapes the descriptors cannot serve run the pointer loads, and the launch record says why: block_n 16/32
    (fp16 scale boxes of 32/64 bytes would put the next pipeline stage off TMA's 128-byte shared-memory alignment:
    the first H200 run's 'misaligned address'), N not a multiple of 8, integer PV; without ``tma`` no note."""
    base = DEFAULT_CONFIG.replace(tma=True)
    for bn in (16, 32):
        assert "128-byte" in tma_refusal(base.replace(block_n=bn), 256, 64)
    assert tma_refusal(base.replace(block_n=64), 256, 64) is None and tma_refusal(base, 256, 128) is None
    assert "N % 8" in tma_refusal(base, 90, 64) and "fp16 PV" in tma_refusal(base.replace(int_pv=True), 256, 64)
    assert "d % 32" in tma_refusal(base, 256, 48) and tma_refusal(DEFAULT_CONFIG, 90, 48) is None
    q, k, v = _qkv(4, device)
    c = build_kv4_batch(k, v, LENGTHS.to(device))
    args = (prepare_query_ref(q), c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off,
            torch.zeros_like(c.lengths), c.lengths)
    lp = plan_kv4_decode(*args, config=base.replace(block_n=32), backend="triton")
    assert not lp.tma and "N % 8" in lp.tma_note  # N = 90 is refused first
    assert plan_kv4_decode(*args, config=DEFAULT_CONFIG, backend="triton").tma_note == ""


@gpu
@pytest.mark.parametrize("kw", [dict(), dict(block_n=64), dict(block_n=64, k_mode="trans")],
                         ids=["bn256", "bn64", "bn64_trans"])
@pytest.mark.parametrize("with_side", [False, True], ids=["kv4", "kv4rl"])
def test_tma_at_a_real_shape_on_gpu(with_side, kw):
    """TMA at Qwen2.5-7B's attention shape (d = 128, 28/4 heads, ragged lengths to 4k), where the benchmarks use
    it: kernel against reference and against the pointer-load kernel."""
    g = torch.Generator(device="cuda").manual_seed(8)
    lengths = torch.tensor([4096, 1, 3000, 777, 2048, 129, 4000, 64], device="cuda")
    b, n, d = lengths.shape[0], 4096, 128
    q = torch.randn(b, 28, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, 4, n, d, device="cuda", generator=g)
    v = torch.randn(b, 4, n, d, device="cuda", generator=g)
    c = build_kv4_batch(k, v, lengths, sink=4, recent=64) if with_side else build_kv4_batch(k, v, lengths)
    main = c.main_range() if with_side else (torch.zeros_like(c.lengths), c.lengths)
    side = side_buffer(c) if with_side else None
    qp = prepare_query(q)
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, *main)
    cfg = DEFAULT_CONFIG.replace(tma=True, **kw)
    lp = plan_kv4_decode(*args, side=side, config=cfg)
    assert lp.tma, lp.tma_note
    o, lse = lp.run()
    o_p, lse_p = kv4_main_decode(*args, side=side, config=cfg.replace(tma=False))
    o_ref, lse_ref = kv4_main_decode(*args, side=side, backend="torch")
    _close(lse, lse_ref, 1e-3)
    _close(o, o_ref, 2e-2 if with_side else 5e-3)
    _close(lse, lse_p, 1e-4)
    _close(o, o_p, 1e-3)


@pytest.mark.parametrize("pipe_edges", [False, True], ids=["peeled", "pipe_edges"])
@pytest.mark.parametrize(("block_n", "splits", "k_mode"), [(16, 1, "bytes"), (16, 3, "bytes"), (32, 2, "trans"),
                                                            (64, 4, "bytes")])
def test_edge_and_interior_blocks_cover_each_position_once(block_n, splits, k_mode, pipe_edges, device):
    """Ranges starting and ending off and on block boundaries, empty and one-block splits: the unmasked
    interior loop plus the masked head/tail steps (or, with ``pipe_edges``, the loop masking its edge blocks
    itself) give the reference (no position dropped or counted twice)."""
    q, k, v = _qkv(21, device)
    c = build_kv4_batch(k, v, torch.full((B,), N, device=device))
    qp = prepare_query_ref(q)
    g = torch.Generator().manual_seed(block_n + splits)
    for _ in range(3):
        start = torch.randint(0, N, (B,), generator=g)
        end = torch.minimum(start + torch.randint(0, N, (B,), generator=g), torch.tensor(N))
        start[0], end[0] = block_n, 3 * block_n  # aligned at both ends: interior only
        args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start.to(device), end.to(device))
        cfg = DEFAULT_CONFIG.replace(block_n=block_n, num_splits=splits, k_mode=k_mode,
                                     tile_sums=k_mode != "trans", pipe_edges=pipe_edges)
        o, lse = kv4_main_decode(*args, config=cfg, backend="triton")
        o_ref, lse_ref = kv4_main_decode_ref(*args)
        _close(lse, lse_ref, 1e-4)
        _close(o, o_ref, 2e-3)


def test_pipe_edges_default_follows_the_side_buffer():
    """By default only KV4-RL launches (unaligned at both ends of the main region) pipeline their edge blocks;
    an explicit setting wins either way."""
    assert pipe_edges_applies(DEFAULT_CONFIG, side=True) and not pipe_edges_applies(DEFAULT_CONFIG, side=False)
    for flag in (False, True):
        cfg = DEFAULT_CONFIG.replace(pipe_edges=flag)
        assert pipe_edges_applies(cfg, side=True) is flag and pipe_edges_applies(cfg, side=False) is flag


def test_wave_model_split_plans(monkeypatch):
    """The GPU branch of the split plan (132 SMs, as an H200): one wave when the pairs fill it, splits when
    they do not, and the per-program overhead keeps a large ragged batch from near-empty splits."""
    from kvlib.kernels.int4 import launch

    monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)  # a device object only: nothing runs on it
    plan = lambda b, n, **kw: default_num_splits(b, 8, n, 256, gpu, **kw)  # noqa: E731
    assert plan(32, 16384, ctas_per_sm=2, overhead_blocks=1) == 1  # 256 pairs <= 264 resident
    assert plan(8, 32768, ctas_per_sm=2, overhead_blocks=1) == 4  # 64 pairs: 4 splits fill one wave
    assert plan(320, 16384, ctas_per_sm=2, overhead_blocks=1) == 1  # 2560 pairs: ten waves already
    assert plan(320, 16384, ctas_per_sm=2, overhead_blocks=0) > 4  # without the overhead it splits them
    assert plan(32, 16384, ctas_per_sm=3, overhead_blocks=0) == 3  # the earlier plan: 768 programs, two waves
    assert plan(8, 32768, ctas_per_sm=3, overhead_blocks=0) == 6  # 48 of 64 x 6 = 384 <= 396
    for b in (1, 4, 32, 512):
        for n in (512, 4096, 65536):
            s = plan(b, n, ctas_per_sm=2, overhead_blocks=1)
            assert 1 <= s <= 32 and (s == 1 or 2 * s <= -(-n // 256))


def test_pdl_is_ignored_off_hopper():
    """KV4KernelConfig.pdl is on by default, but only sm_90+ CUDA launches use it (the CPU path runs plainly)."""
    from kvlib.kernels.backend import pdl_supported

    assert DEFAULT_CONFIG.pdl
    assert not pdl_supported(torch.zeros(1))


@pytest.mark.parametrize("with_side", [False, True], ids=["kv4", "kv4rl"])
def test_launch_record_says_what_ran(with_side, device):
    """plan_kv4_decode gives the launch kv4_main_decode makes: the same output bit for bit, and the choices made
    (states, merge, path) as fields, not module globals."""
    q, k, v = _qkv(14, device)
    c = build_kv4_batch(k, v, torch.tensor([90, 17, 0], device=device), sink=4, recent=16)
    qp = prepare_query(q, backend="triton")
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, *c.main_range())
    side = side_buffer(c) if with_side else None
    cfg = DEFAULT_CONFIG.replace(block_n=16, num_splits=3)
    lp = plan_kv4_decode(*args, side=side, config=cfg, backend="triton")
    assert isinstance(lp, KV4Launch) and lp.path == "contiguous" and lp.splits == 3
    assert lp.states == 3 + int(with_side) and lp.grid == (B, HKV, lp.states) and lp.merge == "fused"
    assert lp.pipe_edges is with_side and lp.k_mode == "bytes" and lp.rows == 8
    o, lse = lp.run()
    o2, lse2 = kv4_main_decode(*args, side=side, config=cfg, backend="triton")
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert plan_kv4_decode(*args, side=side, config=cfg.replace(num_splits=1), backend="triton").merge == (
        "launch" if with_side else "none")
    with pytest.raises(ValueError, match="Triton"):
        plan_kv4_decode(*args, side=side, config=cfg, backend="torch")


@gpu
@pytest.mark.parametrize("with_side", [False, True], ids=["kv4", "kv4rl"])
def test_default_config_at_a_real_shape_on_gpu(with_side):
    """Qwen2.5-7B's attention shape (28 query / 4 kv heads, d = 128), ragged lengths to 4k, the tuned default
    (block_n 256, PDL, the split plan, fused merge where planned): kernel against reference, a CUDA-graph replay
    bit-identical to the eager call, and the compiled kernel on the launch record without spills."""
    from kvlib.bench.timing import capture_graph

    g = torch.Generator(device="cuda").manual_seed(3)
    lengths = torch.tensor([4096, 1, 3000, 777, 2048, 129, 4000, 64], device="cuda")
    b, n, d = lengths.shape[0], 4096, 128
    q = torch.randn(b, 28, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, 4, n, d, device="cuda", generator=g)
    v = torch.randn(b, 4, n, d, device="cuda", generator=g)
    c = build_kv4_batch(k, v, lengths, sink=4, recent=64) if with_side else build_kv4_batch(k, v, lengths)
    decode = kv4rl_decode if with_side else kv4_decode
    o, lse = decode(q, c)
    o_ref, lse_ref = decode_ref(q, c)
    _close(lse, lse_ref, 1e-3)
    _close(o, o_ref, 2e-2 if with_side else 5e-3)
    graph, (og, lg) = capture_graph(lambda: decode(q, c))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, o) and torch.equal(lg, lse)
    qp = prepare_query(q)
    main = c.main_range() if with_side else (torch.zeros_like(c.lengths), c.lengths)
    lp = plan_kv4_decode(qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, *main,
                         side=side_buffer(c) if with_side else None)
    lp.run()
    assert 0 < lp.kernel.n_regs <= 255 and lp.kernel.n_spills == 0


# ---------------------------------------------------------------------------------------------
# Paged pool (vLLM layout): pages [num_blocks, block_size, H_kv, ...], a block table per request
# ---------------------------------------------------------------------------------------------


def _paged_pool(c, block_size: int, seed: int, spare: int = 3) -> dict:
    """The contiguous batch ``c`` scattered into a pool as a block manager would: each request takes
    ``ceil(len / block_size)`` pages from a shuffled free list, so its pages are neither contiguous nor in order;
    slots past a request's length, spare pages and unused table entries (-1) hold garbage (random codes, NaN
    scales) that must never reach the output."""
    from kvlib.kernels.int4.decode import kv4_paged_decode  # noqa: F401 (importable where notebooks look)

    g = torch.Generator().manual_seed(seed)
    b, hkv, _, half = c.k_codes.shape
    dev = c.k_codes.device
    lengths = c.lengths.tolist()
    need = [-(-n // block_size) for n in lengths]
    nb, maxb = sum(need) + spare, max(need) + 1  # a spare table column, never read
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((b, maxb), -1, dtype=torch.int32)
    pool = {"k_codes": torch.randint(0, 256, (nb, block_size, hkv, half), generator=g, dtype=torch.uint8),
            "v_codes": torch.randint(0, 256, (nb, block_size, hkv, half), generator=g, dtype=torch.uint8)}
    for name in ("k_scale", "k_off", "v_scale", "v_off"):
        pool[name] = torch.full((nb, block_size, hkv), float("nan"), dtype=torch.float16)
    pool = {k: t.to(dev) for k, t in pool.items()}
    for r, n in enumerate(lengths):
        for j in range(need[r]):
            page = perm.pop()
            table[r, j] = page
            lo, hi = j * block_size, min((j + 1) * block_size, n)
            for name, t in pool.items():
                t[page, : hi - lo] = getattr(c, name)[r, :, lo:hi].transpose(0, 1)
    pool["block_table"] = table.to(dev)
    return pool


def _paged_args(qp, pool, start, end):
    return (qp, pool["k_codes"], pool["k_scale"], pool["k_off"], pool["v_codes"], pool["v_scale"], pool["v_off"],
            pool["block_table"], start, end)


PAGED = [  # (block_size, config): tiles spanning pages (per-row lookups), tiles inside pages, one split and several
    (16, dict(block_n=32, num_splits=3)),
    (8, dict(block_n=16, num_splits=1)),
    (64, dict(block_n=16, num_splits=2, tile_sums=False)),
    (32, dict(block_n=32, num_splits=2)),
]


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize(("block_size", "kw"), PAGED, ids=["bs16_bn32", "bs8_bn16", "bs64_bn16", "bs32_bn32"])
@pytest.mark.parametrize("with_side", [False, True], ids=["kv4", "kv4rl"])
def test_paged_decode_matches_reference_and_contiguous(with_side, block_size, kw, group, device):
    """A shuffled, non-contiguous pool with ragged lengths (one empty request), KV4 over whole requests or
    KV4-RL's main region with its sink/recent side buffer: the paged kernel against the paged reference and
    against the contiguous kernel on the same codes; the launch record names the paged path."""
    from kvlib.kernels.int4.decode import kv4_paged_decode, kv4_paged_decode_ref, plan_kv4_paged_decode

    g = torch.Generator().manual_seed(40 + group)
    hkv, n = 2, 90
    q = torch.randn(4, hkv * group, D, generator=g).to(device)
    k, v = torch.randn(4, hkv, n, D, generator=g).to(device), torch.randn(4, hkv, n, D, generator=g).to(device)
    lengths = torch.tensor([90, 33, 0, 7], device=device)
    c = build_kv4_batch(k, v, lengths, sink=4, recent=16) if with_side else build_kv4_batch(k, v, lengths)
    start, end = c.main_range() if with_side else (torch.zeros_like(c.lengths), c.lengths)
    side = side_buffer(c) if with_side else None
    pool = _paged_pool(c, block_size, seed=block_size + group)
    qp = prepare_query(q, backend="triton")
    cfg = DEFAULT_CONFIG.replace(**kw)
    args = _paged_args(qp, pool, start, end)
    o, lse = kv4_paged_decode(*args, block_size=block_size, side=side, config=cfg, backend="triton")
    o_ref, lse_ref = kv4_paged_decode_ref(*args, block_size=block_size, side=side)
    tol = 2e-2 if with_side else 2e-3  # bf16 PV operands on the protected region
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, tol)
    assert torch.isneginf(lse[2]).all() and (o[2] == 0).all()
    # the same codes in the contiguous layout, by the contiguous kernel and its reference
    cargs = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, end)
    o_c, lse_c = kv4_main_decode(*cargs, side=side, config=cfg, backend="triton")
    _close(lse, lse_c, 1e-5)
    _close(o, o_c, 1e-5)
    o_cr, lse_cr = kv4_main_decode(*cargs, side=side, backend="torch")
    _close(lse_ref, lse_cr, 1e-5)
    _close(o_ref, o_cr, 1e-5)
    lp = plan_kv4_paged_decode(*args, block_size=block_size, side=side, config=cfg, backend="triton")
    assert lp.path == ("paged-tiles" if block_size % kw["block_n"] == 0 else "paged-rows")
    assert lp.splits == kw["num_splits"] and lp.states == lp.splits + int(with_side)


@pytest.mark.skipif(DEV.type == "cuda", reason="the interpreter's d = 64 case; the GPU runs every test at d = 64")
def test_paged_decode_head_dim_64(device):
    from kvlib.kernels.int4.decode import kv4_paged_decode, kv4_paged_decode_ref

    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 8, 64, generator=g)
    k, v = torch.randn(2, 2, 40, 64, generator=g), torch.randn(2, 2, 40, 64, generator=g)
    c = build_kv4_batch(k, v, torch.tensor([40, 19]), sink=2, recent=8)
    pool = _paged_pool(c, 16, seed=1)
    qp = prepare_query_ref(q)
    args = _paged_args(qp, pool, *c.main_range())
    cfg = DEFAULT_CONFIG.replace(block_n=16)
    o, lse = kv4_paged_decode(*args, block_size=16, side=side_buffer(c), config=cfg, backend="triton")
    o_ref, lse_ref = kv4_paged_decode_ref(*args, block_size=16, side=side_buffer(c))
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-2)


@pytest.mark.parametrize(("block_size", "block_n"), [(16, 32), (32, 32)], ids=["rows", "tiles"])
def test_paged_decode_odd_kv_heads(block_size, block_n, device):
    """Three kv heads: no head pairs to read the scales as int32 words, so both paths read them one by one."""
    from kvlib.kernels.int4.decode import kv4_paged_decode_ref, plan_kv4_paged_decode

    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, D, generator=g).to(device)
    k, v = torch.randn(2, 3, 70, D, generator=g).to(device), torch.randn(2, 3, 70, D, generator=g).to(device)
    c = build_kv4_batch(k, v, torch.tensor([70, 45], device=device), sink=4, recent=8)
    pool = _paged_pool(c, block_size, seed=2)
    qp = prepare_query(q, backend="triton")
    args = _paged_args(qp, pool, *c.main_range())
    cfg = DEFAULT_CONFIG.replace(block_n=block_n, num_splits=2)
    lp = plan_kv4_paged_decode(*args, block_size=block_size, side=side_buffer(c), config=cfg, backend="triton")
    assert lp.path == ("paged-tiles" if block_size % block_n == 0 else "paged-rows")
    o, lse = lp.run()
    o_ref, lse_ref = kv4_paged_decode_ref(*args, block_size=block_size, side=side_buffer(c))
    _close(lse, lse_ref, 1e-4)
    _close(o, o_ref, 2e-2)  # bf16 PV operands on the protected region


def test_paged_decode_refuses_what_it_does_not_run(device):
    """Options the paged kernel does not implement are errors naming the option, not silent fallbacks; so are a
    block_size that disagrees with the pool and a block table of another dtype or batch."""
    from kvlib.kernels.int4.decode import kv4_paged_decode

    q, k, v = _qkv(2, device)
    c = build_kv4_batch(k, v, LENGTHS.to(device))
    pool = _paged_pool(c, 16, seed=3)
    qp = prepare_query_ref(q)
    args = _paged_args(qp, pool, torch.zeros_like(c.lengths), c.lengths)
    for kw, name in ((dict(k_mode="trans"), "k_mode"), (dict(int_pv=True), "int_pv"), (dict(tma=True), "tma")):
        with pytest.raises(ValueError, match=name):
            kv4_paged_decode(*args, block_size=16, config=DEFAULT_CONFIG.replace(**kw), backend="triton")
    with pytest.raises(ValueError, match="block_size"):
        kv4_paged_decode(*args, block_size=32, backend="triton")
    bad = list(args)
    bad[7] = pool["block_table"].long()
    with pytest.raises(TypeError, match="block_table"):
        kv4_paged_decode(*bad, block_size=16, backend="triton")
    bad[7] = pool["block_table"][:2]
    with pytest.raises(ValueError, match="block_table"):
        kv4_paged_decode(*bad, block_size=16, backend="torch")


@gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("with_side", [False, True], ids=["kv4", "kv4rl"])
def test_paged_decode_at_a_real_shape_on_gpu(with_side, block_size):
    """Qwen2.5-7B's attention shape, ragged lengths to 4k, the default config (block_n 256: with 16-position pages
    a tile spans 16 of them), a shuffled pool: kernel against the paged reference and the contiguous kernel."""
    from kvlib.kernels.int4.decode import kv4_paged_decode_ref, plan_kv4_paged_decode

    g = torch.Generator(device="cuda").manual_seed(5)
    lengths = torch.tensor([4096, 1, 3000, 777, 2048, 129, 4000, 0], device="cuda")
    b, n, d = lengths.shape[0], 4096, 128
    q = torch.randn(b, 28, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, 4, n, d, device="cuda", generator=g)
    v = torch.randn(b, 4, n, d, device="cuda", generator=g)
    c = build_kv4_batch(k, v, lengths, sink=4, recent=64) if with_side else build_kv4_batch(k, v, lengths)
    start, end = c.main_range() if with_side else (torch.zeros_like(c.lengths), c.lengths)
    side = side_buffer(c) if with_side else None
    pool = _paged_pool(c, block_size, seed=9)
    qp = prepare_query(q)
    args = _paged_args(qp, pool, start, end)
    lp = plan_kv4_paged_decode(*args, block_size=block_size, side=side)
    assert lp.path == ("paged-tiles" if block_size == 256 else "paged-rows")  # the default block_n is 256
    o, lse = lp.run()
    o_ref, lse_ref = kv4_paged_decode_ref(*args, block_size=block_size, side=side)
    _close(lse, lse_ref, 1e-3)
    _close(o, o_ref, 2e-2 if with_side else 5e-3)
    o_c, lse_c = kv4_main_decode(qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, end,
                                 side=side)
    _close(lse, lse_c, 1e-4)
    _close(o, o_c, 1e-3)


def test_int4_family_imports_one_way():
    """The INT4 kernel modules import each other without a cycle (issue 25: decode <-> protected was one), read
    from their sources (module-level and function-level imports alike)."""
    import ast
    import pathlib

    import kvlib.kernels.int4 as pkg

    root = pathlib.Path(pkg.__file__).parent
    deps = {}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        deps[path.stem] = {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                           and n.module and n.module.startswith("kvlib.kernels.int4.")}
    assert deps["protected"] and "decode" not in deps["protected"]
    done: set = set()

    def visit(m, stack):
        assert m not in stack, f"import cycle: {' -> '.join([*stack, m])}"
        if m not in done:
            for d in deps.get(m, ()):
                visit(d, [*stack, m])
            done.add(m)

    for m in deps:
        visit(m, [])
