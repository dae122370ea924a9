"""The dispatcher's rules for the warp-specialised kernels (issue 28) and, on a Hopper GPU, what they run.

CPU: :func:`kvlib.kernels.int8.decode.wspec_unsupported` and :func:`kvlib.kernels.int4.wspec.wspec4_unsupported`
name each rule a request breaks (the shape rules are checked before the device, so on any machine); an explicit
``impl="wspec"`` / ``backend="wspec"`` that cannot run raises ValueError. GPU (sm_90): ``"auto"`` over pages takes
the new kernels (``DecodeOut.path``), agrees with the float64 reference and with the kernels it replaced, and runs
under CUDA-graph capture with the descriptors built inside the captured call (as the model's step does); the
model's stores report the new path. The byte model of the benchmark (:mod:`kvlib.bench.wspec_decode`) is checked
against the pools' own byte accounts."""

from __future__ import annotations

import pytest
import torch

from kvlib.bench import wspec_decode as WD
from kvlib.kernels.int4.wspec import wspec4_unsupported
from kvlib.kernels.int8.decode import decode_int8, wspec_unsupported
from kvlib.kernels.int8.request import PoolSide

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
gpu = pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) GPU")


def _int8(n=64, h=2, d=128, *, dithered=True, layout="h8", nok=0, group=32, dev="cpu"):
    kc = torch.zeros(n, h, d, dtype=torch.int8, device=dev)
    sc = torch.ones(n, h, d // group, dtype=torch.float16, device=dev)
    ko = koc = None
    if nok:
        koc = torch.arange(nok, device=dev).expand(h, nok).contiguous()
        ko = torch.zeros(n, h, nok, dtype=torch.float16, device=dev)
    k = PoolSide(kc, sc, ko, koc, group=group, dither_layout=layout, dithered=dithered)
    v = PoolSide(kc.clone(), sc.clone(), group=group, dither_layout=layout, dithered=False)
    return k, v


def _why(q=None, k=None, v=None, d=128, **kw):
    kd, vd = _int8(d=d)
    q = torch.zeros(2, 8, d, dtype=torch.bfloat16) if q is None else q
    args = dict(v_dither=False, block_table=torch.zeros(2, 2, dtype=torch.int32), block_size=16) | kw
    return wspec_unsupported(q, k or kd, v or vd, **args)


def test_a_valid_paged_request_is_refused_only_for_its_device() -> None:
    assert "CUDA" in _why()  # every shape rule holds; a CPU tensor is the only reason left


@pytest.mark.parametrize("change,needle", [
    (dict(block_table=None), "block_table"),
    (dict(block_size=12), "block_size"),
    (dict(block_size=48), "block_size"),
    (dict(v_dither=True), "RTN values"),
    (dict(q=torch.zeros(2, 8, 64, dtype=torch.bfloat16)), "head_dim"),
    (dict(q=torch.zeros(2, 18, 128, dtype=torch.bfloat16)), "8 query heads"),
    (dict(q=torch.zeros(2, 8, 128, dtype=torch.float32)), "fp16 or bf16"),
])
def test_each_int8_rule_names_itself(change, needle) -> None:
    assert needle in _why(**change)


def test_int8_pool_rules() -> None:
    k, v = _int8(layout="h10")
    assert "h8" in _why(k=k, v=v)
    k, v = _int8(nok=18)
    assert "16" in _why(k=k, v=v)
    k, v = _int8(nok=4, dithered=False)
    assert "RTN keys" in _why(k=k, v=v)
    k, v = _int8(group=64)
    assert "groups of 32" in _why(k=k, v=v)
    k, v = _int8(n=40)  # 40 slots: not whole pages of 16
    assert "pages" in _why(k=k, v=v)
    k, v = _int8(nok=8)  # m = 4 pairs and RTN keys both take the new kernels
    assert "CUDA" in _why(k=k, v=v)
    k, v = _int8(dithered=False)
    assert "CUDA" in _why(k=k, v=v)


def test_d64_is_taken_only_when_asked_until_enabled(monkeypatch) -> None:
    """d = 64 (SmolLM2, issue 40): every rule holds, but ``"auto"`` refuses it, naming the explicit ``impl="wspec"``
    and :data:`WSPEC_AUTO_HEAD_DIMS`, while that holds 128 only; an explicit request is refused for its device only;
    with 64 added, ``"auto"`` takes it too. Other head dims are refused either way."""
    from kvlib.kernels.int8 import decode as DEC

    assert DEC.WSPEC_AUTO_HEAD_DIMS == (128,)  # opt-in until the GPU lane has run the d = 64 kernels
    why = _why(d=64)
    assert "impl='wspec'" in why and "WSPEC_AUTO_HEAD_DIMS" in why, why
    assert "CUDA" in _why(d=64, auto=False)
    k, v = _int8(d=64, nok=8)
    assert "CUDA" in _why(k=k, v=v, d=64, auto=False)
    for d in (96, 32):
        for auto in (True, False):
            assert "head_dim must be 64 or 128" in _why(d=d, auto=auto)
    monkeypatch.setattr(DEC, "WSPEC_AUTO_HEAD_DIMS", (64, 128))
    assert "CUDA" in _why(d=64)


@pytest.mark.parametrize("enabled", [False, True])
def test_page_rules_agree_with_the_request_rules(enabled, monkeypatch) -> None:
    """:func:`wspec_pages_unsupported` (what a backend asks of its pages before any request) says None exactly where
    :func:`wspec_unsupported` refuses a request over such pages for its device only."""
    from kvlib.kernels.int8 import decode as DEC

    if enabled:
        monkeypatch.setattr(DEC, "WSPEC_AUTO_HEAD_DIMS", (64, 128))
    for d in (64, 128):
        for group in (16, 32):
            for dithered, layout in ((True, "h8"), (True, "h10"), (True, "w24"), (False, "w24"), (False, "h8")):
                k, v = _int8(d=d, group=group, dithered=dithered, layout=layout)
                pages = DEC.wspec_pages_unsupported(d, group, dithered, layout)
                req = _why(k=k, v=v, d=d)
                assert (pages is None) == ("CUDA" in req), (d, group, dithered, layout, pages, req)


@pytest.mark.parametrize("fmt,opts", [("dither-int8", {"dither_layout": "h8"}), ("rtn-int8", {})])
def test_the_backend_lets_d64_pages_through_only_when_enabled(fmt, opts, monkeypatch) -> None:
    """SmolLM2's INT8 pages (3 KV heads, d = 64, groups of 32) on a CUDA device: with h8 keys no Triton kernel reads
    them (``supports`` says why: today's torch reference) until d = 64 is enabled, and then the warp-specialised
    kernel may (it decides on the real query, :meth:`Int8Backend._choose`); RTN pages have a Triton kernel either
    way. Shape rules only: no CUDA tensor is made."""
    from kvlib.backends.int8 import Int8Backend
    from kvlib.formats import get_format
    from kvlib.kernels.int8 import decode as DEC

    f = get_format(fmt, **opts)
    be = Int8Backend(2, 3, 64, 16, 1, torch.device("cpu"), f, f, batch=1)
    cuda = torch.device("cuda")
    before = be.supports((1, 9, 64), cuda)
    if fmt == "dither-int8":
        assert before and "h10" in before, before
    else:
        assert before is None
    assert "no Triton" in be.supports((1, 9, 64), torch.device("cpu"))
    monkeypatch.setattr(DEC, "WSPEC_AUTO_HEAD_DIMS", (64, 128))
    assert be.supports((1, 9, 64), cuda) is None
    assert "no Triton" in be.supports((1, 9, 64), torch.device("cpu"))
    be128 = Int8Backend(2, 3, 128, 16, 1, torch.device("cpu"), f, f, batch=1)
    assert be128.supports((1, 9, 128), cuda) is None  # d = 128: unchanged (the Triton kernels read these pages)


def test_a_tuned_int8_config_keeps_the_old_kernels() -> None:
    from kvlib.kernels.int8.config import Int8KernelConfig

    assert "config" in _why(config=Int8KernelConfig(block_n=32))
    assert "CUDA" in _why(config=Int8KernelConfig())


def test_explicit_wspec_on_cpu_raises() -> None:
    k, v = _int8()
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="wspec"):
        decode_int8(q, k, v, None, torch.full((2,), 16, dtype=torch.int32), layer=0, seed=1, impl="wspec",
                    block_table=torch.zeros(2, 2, dtype=torch.int32), block_size=16)


def _qp(b=2, hq=8, d=128, dev="cpu"):
    from kvlib.kernels.int4.query import prepare_query

    return prepare_query(torch.randn(b, hq, d, device=dev))


def test_int4_rules() -> None:
    qp = _qp()
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.uint8)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    assert "CUDA" in wspec4_unsupported(qp, kc, bt, block_size=16)
    assert "KV4-RL" in wspec4_unsupported(qp, kc, bt, block_size=16, side=object())
    assert "block_size" in wspec4_unsupported(qp, kc, bt, block_size=24)
    assert "head_dim" in wspec4_unsupported(qp, torch.zeros(4, 16, 2, 16, dtype=torch.uint8), bt, block_size=16)
    assert "8 query heads" in wspec4_unsupported(_qp(hq=18), kc, bt, block_size=16)
    assert "contiguous" in wspec4_unsupported(qp, kc.transpose(0, 1), bt, block_size=16)


def test_kv4rl_dispatch_is_opt_in(monkeypatch) -> None:
    """KV4-RL stays on the Triton paged kernel (the backend's ``_choose`` and the family dispatcher) until
    :data:`kvlib.kernels.int4.wspec.DISPATCH_CONFIG_RL` opts in to the same-launch kernel (issue 40); once it does,
    the KV4-RL request is judged by the same shape and device rules as KV4. The device rule is replaced here so the
    decision is taken as on a Hopper GPU."""
    from types import SimpleNamespace

    from kvlib.backends.int4 import Int4Backend
    from kvlib.kernels.int4 import wspec as W

    qp = _qp()
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.uint8)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    assert W.DISPATCH_CONFIG_RL is None
    for kw in ({"side": object()}, {"rl": True}):
        assert "DISPATCH_CONFIG_RL" in wspec4_unsupported(qp, kc, bt, block_size=16, **kw)
    q = torch.randn(2, 8, 128)

    def choose(rl):
        fake = SimpleNamespace(rl=rl, block_size=16, pages=lambda layer, side: (kc, None, None))
        return Int4Backend._choose(fake, q, 0, bt)

    assert choose(True) == "triton" and choose(False) == "triton"  # the CPU: no Hopper
    monkeypatch.setattr(W, "_device_reason", lambda q8: None)
    assert choose(True) == "triton" and choose(False) == "wspec"
    monkeypatch.setattr(W, "DISPATCH_CONFIG_RL", {"rows8": True, "side_fused": True})
    assert choose(True) == "wspec" and choose(False) == "wspec"
    assert wspec4_unsupported(qp, kc, bt, block_size=16, side=object()) is None
    assert "block_size" in wspec4_unsupported(qp, kc, bt, block_size=24, side=object())  # the shape rules still apply


def test_explicit_int4_wspec_on_cpu_raises() -> None:
    from kvlib.kernels.int4.decode import kv4_paged_decode

    qp = _qp()
    z = torch.zeros(2, dtype=torch.int32)
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.uint8)
    sc = torch.ones(4, 16, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="wspec"):
        kv4_paged_decode(qp, kc, sc, sc, kc, sc, sc, torch.zeros(2, 2, dtype=torch.int32), z, z, block_size=16,
                         backend="wspec")


def test_byte_model_matches_the_pool_byte_accounts() -> None:
    from kvlib.storage.paged import bytes_per_token_head

    B, S = 3, 256
    # INT8: the pool's own formula (codes + fp16 scales + fp16 outliers), both sides, no value outliers
    k0 = bytes_per_token_head(d=WD.D, group=WD.GROUP, n_out=0)
    k4 = bytes_per_token_head(d=WD.D, group=WD.GROUP, n_out=WD.NOK)
    assert WD.kernel_bytes("wspec_cert", B, S) == B * WD.HKV * S * 2 * k0
    assert WD.kernel_bytes("gluon_cert_m4", B, S) == B * WD.HKV * S * (k4 + k0)
    # KV4: d/2 bytes of codes and fp16 scale + offset per side
    assert WD.kernel_bytes("wspec4_kv4_p16", B, S) == B * WD.HKV * S * 2 * (WD.D // 2 + 4)
    assert WD.kernel_bytes("sdpa_bf16", B, S) == B * WD.HKV * S * 2 * WD.D * 2
    with pytest.raises(ValueError, match="name"):
        WD.kernel_bytes("mystery", B, S)


def test_summary_ratios() -> None:
    med = {"sdpa_bf16": 2.0, "gluon_cert": 2.0, "gluon_nocert": 1.6, "wspec_cert": 1.0, "wspec_nocert": 0.95,
           "triton_paged_kv4_p256": 0.8, "wspec4_kv4_p256": 0.5, "wspec4_kv4rl_p256": None}
    s = WD.summarise(med, 1, 1024, 1000.0)
    assert s["x_sdpa"]["wspec_cert"] == pytest.approx(2.0)
    assert s["cert_marginal_cost"] == pytest.approx({"gluon": 0.25, "wspec": 1 / 0.95 - 1})
    assert s["speedup_over_old"]["wspec_cert"] == pytest.approx(2.0)
    assert s["speedup_over_old"]["wspec4_kv4_p256"] == pytest.approx(1.6)
    assert "wspec4_kv4rl_p256" not in s["GBps"]  # a failed kernel is left out, not counted as zero
    gb = WD.kernel_bytes("wspec_cert", 1, 1024) / 1e-3 / 1e9
    assert s["GBps"]["wspec_cert"] == pytest.approx(gb)
    assert s["of_copy"]["wspec_cert"] == pytest.approx(gb / 1000.0)


def test_bench_skips_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the skip path is for CPU machines")
    assert "skipped" in WD.run("ci")
    with pytest.raises(RuntimeError, match="CUDA"):
        WD.run("gpu")


# ---------------------------------------------------------------------------------------------- GPU
def _random_int8(B, S, nok, dithered):
    g = torch.Generator(device="cuda").manual_seed(B + S + nok)
    return WD._int8_pools(B, S, nok, dithered, g, "cuda")


@gpu
@pytest.mark.parametrize("nok,dithered,cert", [(0, True, True), (8, True, True), (0, True, False), (0, False, False)])
def test_auto_takes_the_new_int8_kernels_and_agrees(nok, dithered, cert) -> None:
    from kvlib.kernels.int8.reference import decode_reference

    B, S = 3, 1000
    kp, vp, bt = _random_int8(B, 1024, nok, dithered)
    seq = torch.tensor([S, 17, 1024], dtype=torch.int32, device="cuda")
    q = torch.randn(B, 28, 128, device="cuda", dtype=torch.bfloat16)
    kw = dict(layer=3, seed=11, block_table=bt, block_size=WD.INT8_PAGE, cert=cert)
    out = decode_int8(q, kp, vp, None, seq, **kw)
    assert out.path == ("wspec_cert" if dithered else "wspec")
    old = decode_int8(q, kp, vp, None, seq, impl="gluon", **kw)
    ref = decode_reference(q, kp, vp, None, seq, layer=3, seed=11, impl="h10", block_table=bt,
                           block_size=WD.INT8_PAGE)
    vmax = float(vp.codes.abs().max()) * float(vp.scales.float().max())
    # the folded PV: two fp16 roundings of p and s_v c (<= 2^-10 of max |v|); the scores are the Gluon kernel's
    assert float((out.o - ref.o.to(out.o.device)).abs().max()) <= 2**-10 * vmax + 1e-4
    assert float((out.o - old.o).abs().max()) <= 2**-10 * vmax + 1e-4
    if cert:
        assert torch.allclose(out.tv_bound, old.tv_bound, atol=2e-6, rtol=1e-5)
        assert bool((out.tv_bound >= 0).all())


@gpu
def test_int8_auto_under_a_cuda_graph() -> None:
    from kvlib.bench.timing import capture_graph

    kp, vp, bt = _random_int8(2, 2048, 0, True)
    seq = torch.tensor([2048, 900], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 28, 128, device="cuda", dtype=torch.bfloat16)

    def step():  # descriptors and buffers built inside the captured call, as the model's step builds them
        return decode_int8(q, kp, vp, None, seq, layer=1, seed=5, block_table=bt, block_size=WD.INT8_PAGE)
    eager = step()
    graph, out = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    assert out.path == "wspec_cert"
    assert torch.equal(out.o, eager.o) and torch.equal(out.tv_bound, eager.tv_bound)


@gpu
@pytest.mark.parametrize("page", [16, 256])
def test_int4_auto_takes_the_new_kernel_and_agrees(page) -> None:
    from kvlib.bench.kv4 import paged_kv4_pool, random_kv4_batch
    from kvlib.kernels.int4.decode import kv4_paged_decode, kv4_paged_decode_ref
    from kvlib.kernels.int4.query import prepare_query

    lengths = torch.tensor([1024, 300, 17], dtype=torch.int32, device="cuda")
    cache = random_kv4_batch(lengths, 1024, 16, 128, hkv=4, d=128)
    pool = paged_kv4_pool(cache, page)
    pargs = tuple(pool[n] for n in ("k_codes", "k_scale", "k_off", "v_codes", "v_scale", "v_off", "block_table"))
    qp = prepare_query(torch.randn(3, 28, 128, device="cuda"))
    z = torch.zeros_like(lengths)
    assert wspec4_unsupported(qp, pool["k_codes"], pool["block_table"], block_size=page) is None
    o, lse = kv4_paged_decode(qp, *pargs, z, lengths, block_size=page)
    o_t, lse_t = kv4_paged_decode(qp, *pargs, z, lengths, block_size=page, backend="triton")
    o_r, lse_r = kv4_paged_decode_ref(qp, *pargs, z, lengths, block_size=page)
    scale = float(o_r.abs().max())
    assert float((o - o_r.to(o.device)).abs().max()) <= 2e-3 * scale
    assert float((o - o_t).abs().max()) <= 2e-3 * scale
    assert torch.allclose(lse, lse_t, atol=1e-3)


@gpu
@torch.no_grad()
@pytest.mark.parametrize("fmt,opts,want", [("dither-int8", {"dither_layout": "h8"}, "int8-wspec_cert"),
                                           ("rtn-int8", {}, "int8-wspec"), ("kv4", {}, "kv4-wspec")])
def test_a_model_decodes_through_the_new_kernels(fmt, opts, want) -> None:
    """A 2-layer Llama (head_dim 128, 8 / 2 heads) generating through kvlib's cache: the step takes the new kernel
    (kernel_path) and its greedy tokens' logits stay near DynamicCache's."""
    import transformers

    import kvlib

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 40), device="cuda")
    cache = kvlib.make_cache(fmt, model.config, batch_size=2, max_len=64, device="cuda", **opts)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert cache.kernel_path(1) == want, cache.kernel_path(1)
    diff = float((out.logits[0] - ref.logits[0]).abs().max())
    assert diff < 0.5, diff  # the first generated token's logits: only the prompt's quantised K/V differ


@gpu
@torch.no_grad()
@pytest.mark.parametrize("fmt,opts,want", [("dither-int8", {"dither_layout": "h8"}, "int8-wspec_cert"),
                                           ("rtn-int8", {}, "int8-wspec")])
def test_a_smollm2_shaped_model_takes_the_d64_kernels_once_enabled(fmt, opts, want, monkeypatch) -> None:
    """A 2-layer Llama at SmolLM2's attention shape (9 query / 3 KV heads, head_dim 64) generating through kvlib's
    cache: while ``WSPEC_AUTO_HEAD_DIMS`` lacks 64 the step does not take the warp-specialised kernels; with 64 added
    it does (``kernel_path``) and its greedy first-token logits stay near DynamicCache's, as at d = 128."""
    import transformers

    import kvlib
    from kvlib.kernels.int8 import decode as DEC

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 40), device="cuda")
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)

    def run():
        cache = kvlib.make_cache(fmt, model.config, batch_size=2, max_len=64, device="cuda", **opts)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        return cache.kernel_path(1), out

    path, _ = run()
    assert path != want, path
    monkeypatch.setattr(DEC, "WSPEC_AUTO_HEAD_DIMS", (64, 128))
    path, out = run()
    assert path == want, path
    diff = float((out.logits[0] - ref.logits[0]).abs().max())
    assert diff < 0.5, diff  # the first generated token's logits: only the prompt's quantised K/V differ
