"""The HF cache over kvlib's paged pools, on tiny random Llama/Qwen2 decoders (CPU: the torch reference
paths; the kernels' agreement with those references is bound in the kernel tests and dev/gpu/hfpath.sh)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import kvlib
from kvlib.hf.cache import KVFormatCache, make_cache

#: max |logit - DynamicCache logit| allowed over 4 greedy steps of the tiny models (logits of order 1):
#: the formats' reconstruction error passed through two layers; fp32 is exact (same SDPA, same tensors)
TOL = {"fp32": 0.0, "bf16": 2e-2, "fp16": 5e-3, "dither-int8": 2e-2, "rtn-int8": 2e-2, "kv4": 0.25,
       "kv4rl": 0.25, "fp8-e4m3": 5e-2, "sr-int8": 2e-2, "kivi2": 0.25, "nvfp4": 0.25, "mxfp4": 0.25,
       "kv4-g32": 0.25}


def _model(kind: str = "llama", layers: int = 2, head_dim: int = 32):
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=head_dim, vocab_size=96, max_position_embeddings=256)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()


@pytest.fixture(scope="module")
def llama():
    return _model("llama")


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(1)
    return torch.randint(0, 96, (2, 9))


def _generate(model, ids, cache, n=4, **kw):
    kw.setdefault("attention_mask", torch.ones_like(ids))
    return model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, **kw)


@torch.no_grad()
@pytest.mark.parametrize("fmt", sorted(TOL))
def test_logits_follow_dynamic_cache_within_tolerance(llama, prompt, fmt) -> None:
    ref = _generate(llama, prompt, DynamicCache(config=llama.config))
    cache = make_cache(fmt, llama.config)
    out = _generate(llama, prompt, cache)
    diff = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert diff <= TOL[fmt], (fmt, diff)
    assert cache.kernel_path(0) == "torch-reference"  # CPU: the reference path, and it says so
    assert cache.get_seq_length() == prompt.shape[1] + 3
    if fmt in ("fp32", "bf16", "fp16"):
        assert torch.equal(ref.sequences, out.sequences)  # greedy equality for the passthrough formats


@torch.no_grad()
def test_qwen2_and_left_padding(prompt) -> None:
    model = _model("qwen2")
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # row 1 left-padded by three
    ids = prompt.clone()
    ids[1, :3] = 0
    ref = _generate(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    cache = make_cache("fp32", model.config)
    out = _generate(model, ids, cache, attention_mask=mask)
    assert torch.equal(ref.sequences, out.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits)) <= 1e-5
    assert cache.layers[0].table.lens == [9 + 3, 6 + 3]  # pads are not stored
    dith = _generate(model, ids, make_cache("dither-int8", model.config), attention_mask=mask)
    assert max(float((a - b).abs().max()) for a, b in zip(ref.logits, dith.logits)) <= TOL["dither-int8"]


@torch.no_grad()
def test_other_caches_on_the_same_model_are_untouched(prompt) -> None:
    model = _model()
    before = _generate(model, prompt, DynamicCache(config=model.config))
    make_cache("dither-int8", model.config)
    assert model.config._attn_implementation == "kvlib"
    after = _generate(model, prompt, DynamicCache(config=model.config))
    assert torch.equal(before.sequences, after.sequences)
    assert all(torch.equal(a, b) for a, b in zip(before.logits, after.logits))


@torch.no_grad()
def test_another_attention_gets_the_whole_pool(prompt) -> None:
    """With another implementation switched on, the cache hands it the dequantised pool (never new tokens only)."""
    model = _model()
    ref = DynamicCache(config=model.config)
    want = [model(prompt, past_key_values=ref).logits, model(prompt[:, :1], past_key_values=ref).logits]
    cache = make_cache("fp32", model.config)
    got = [model(prompt, past_key_values=cache).logits]
    model.config._attn_implementation = "sdpa"
    got.append(model(prompt[:, :1], past_key_values=cache).logits)
    assert cache.kernel_path(0) == "dequantized-for:sdpa"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@torch.no_grad()
def test_dithered_certificates_are_the_kernel_references_and_sound() -> None:
    from kvlib.kernels.int8.decode import decode_reference

    torch.manual_seed(3)
    model = _model()
    cfg = model.config
    cache = make_cache("dither-int8", cfg)
    b, s, d = 2, 20, 32
    k = torch.randn(b, 2, s, d)
    v = torch.randn(b, 2, s, d)
    for layer in range(2):
        cache.update(k, v, layer)
    q = torch.randn(b, 4, 1, d)
    la = cache.layers[1]
    o = la.decode_kernel(q, d ** -0.5)
    cert = cache.certificates()
    assert cert.shape == (2, 4, b, 1) or cert.shape[-1] == 0
    c1 = la._certs[-1]  # [B, Hq]
    st = cache.store
    # the CPU path computes as the fp32 (fma) kernel does, with that kernel's radius: the float64 reference's
    # certificate and output to fp32 score rounding (tests/test_reference_speedups.py bounds that rounding)
    ref = decode_reference(q[:, :, 0], st.k.layer(1), st.v.layer(1), la.table.slot_table(), la.table.seq_lens,
                           layer=1, seed=0, sm_scale=d ** -0.5, delta=cache.delta_loc, impl="fma")
    torch.testing.assert_close(c1.double(), ref.tv_bound_one.double(), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(o.double(), ref.o.double(), rtol=1e-5, atol=1e-5)
    # soundness: TV between the exact-key and stored-key softmax stays under the certificate
    kh, _ = la.dequantized()
    for h in range(4):
        z = torch.einsum("bd,bsd->bs", q[:, h, 0].double(), k[:, h // 2].double()) * d ** -0.5
        zh = torch.einsum("bd,bsd->bs", q[:, h, 0].double(), kh[:, h // 2].double()) * d ** -0.5
        tv = 0.5 * (z.softmax(-1) - zh.softmax(-1)).abs().sum(-1)
        assert (tv <= c1[:, h].double()).all()
    summ = cache.certificate_summary()
    assert summ["n"] == 0 or 0.0 <= summ["coverage"] <= 1.0


@torch.no_grad()
def test_generate_fills_certificates_by_default(llama, prompt) -> None:
    cache = make_cache("dither-int8", llama.config, dither_layout="h8")
    _generate(llama, prompt, cache, n=3)
    c = cache.certificates()
    assert c.shape == (2, 4, 2, 2)  # [L, Hq, B, steps]: two decode steps after the prefill
    assert torch.isfinite(c).all() and (c >= 0).all()
    assert cache.certificate_summary()["n"] == c.numel()
    sampled = make_cache("dither-int8", llama.config, stride=2)
    _generate(llama, prompt, sampled, n=4)
    assert sampled.certificates().shape == (2, 4, 2, 2)  # decode calls 1 and 3 of 3
    with pytest.raises(TypeError, match="keep_records"):
        make_cache("dither-int8", llama.config, keep_records=True)


def test_errors_name_the_option_at_make_cache(llama) -> None:
    cfg = llama.config
    with pytest.raises(ValueError, match="available formats"):
        make_cache("int3-magic", cfg)
    with pytest.raises(ValueError, match="value_format"):
        make_cache("fp32", cfg, value_format="nope")
    with pytest.raises(TypeError, match="format"):
        make_cache(8, cfg)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group"):
        make_cache("dither-int8", cfg, group=24)  # does not divide head_dim 32
    with pytest.raises(TypeError, match="seed"):
        make_cache("dither-int8", cfg, seed="x")
    with pytest.raises(ValueError, match="delta_req"):
        make_cache("dither-int8", cfg, delta_req=2.0)
    with pytest.raises(ValueError, match="block-int8"):
        make_cache("block-int8", cfg)
    with pytest.raises(TypeError, match="telemetry"):  # an option of the old host-side telemetry: unknown now
        make_cache("fp32", cfg, telemetry=True)
    with pytest.raises(ValueError, match="outlier_table"):
        make_cache("dither-int8", cfg, outlier_table=torch.zeros(3, 2, 4, dtype=torch.int64))


@torch.no_grad()
def test_a_config_of_another_model_errors_at_the_first_update(prompt) -> None:
    small, big = _model(layers=1), _model(layers=2)
    cache = make_cache("rtn-int8", small.config)
    big.config._attn_implementation = "kvlib"
    with pytest.raises(ValueError, match="layers"):
        big(prompt, past_key_values=cache)
    other = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16)
    cache = make_cache("bf16", other)
    with pytest.raises(ValueError, match="head_dim"):
        cache.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 3, 32), 0)


def test_edits_of_layer_keys_are_refused(llama, prompt) -> None:
    cache = make_cache("kv4", llama.config)
    with torch.no_grad():
        llama(prompt, past_key_values=cache)
    la = cache.layers[0]
    assert la.keys.shape == (2, 2, 9, 32)  # a dequantised view
    with pytest.raises(NotImplementedError, match="press"):
        la.keys = la.keys[:, :, :4]
    la.values[:, :, :2] *= 0.5  # in place on the view: cannot reach the pool, refused at the next update
    with pytest.raises(NotImplementedError, match="in place"):
        with torch.no_grad():
            llama(prompt[:, :1], past_key_values=cache)


@torch.no_grad()
def test_crop_and_beam_reorders(llama, prompt) -> None:
    ref = DynamicCache(config=llama.config)
    llama(prompt, past_key_values=ref)
    for fmt in ("fp32", "rtn-int8"):
        cache = make_cache(fmt, llama.config)
        llama(prompt, past_key_values=cache)
        cache.crop(-3)
        assert cache.get_seq_length() == 6
        cache.reorder_cache(torch.tensor([1, 1]))
        k_want = ref.layers[0].keys[[1, 1], :, :6]
        got = cache.layers[0].keys
        tol = 0 if fmt == "fp32" else 0.1
        torch.testing.assert_close(got, k_want, rtol=0, atol=tol)
    dith = make_cache("dither-int8", llama.config)
    llama(prompt, past_key_values=dith)
    before = dith.layers[1].keys
    dith.reorder_cache(torch.tensor([1, 0]))  # dithered codes are bound to their slots: tables move, pages stay
    dith.reorder_cache(torch.tensor([1, 1]))  # a repeat shares the prefix slots and writes fresh pages
    assert torch.equal(dith.layers[1].keys, before[[0, 0]])
    t = dith.layers[1].table
    llama(torch.tensor([[5], [7]]), past_key_values=dith)
    s0, s1 = t.slot_table()[:, 9].tolist()
    assert s0 != s1 and t.slot_table()[0, :9].tolist() == t.slot_table()[1, :9].tolist()
    rl = make_cache("kv4rl", llama.config)
    llama(prompt, past_key_values=rl)
    rl.crop(-1)  # restored from the crop stash (tests/test_pools.py binds it to the format)
    assert rl.get_seq_length() == 8
    kivi = make_cache("kivi2", llama.config)
    llama(prompt, past_key_values=kivi)
    with pytest.raises(NotImplementedError, match="stateful"):
        kivi.crop(-1)


@torch.no_grad()
def test_beam_search(llama, prompt) -> None:
    kw = dict(num_beams=2, num_return_sequences=2)
    ref = _generate(llama, prompt, DynamicCache(config=llama.config), n=3, **kw)
    out = _generate(llama, prompt, make_cache("fp32", llama.config), n=3, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    dith = _generate(llama, prompt, make_cache("dither-int8", llama.config), n=3, **kw)
    assert dith.sequences.shape == ref.sequences.shape


@torch.no_grad()
def test_static_dithered_pool_reuses_cropped_slots(llama, prompt) -> None:
    """Assisted decoding crops every step: a row that shares no slots rewinds its write index, so static pools
    do not run out (a row sharing its prefix keeps it: a live slot's dither is never reused)."""
    cache = make_cache("dither-int8", llama.config, batch_size=2, max_len=12, device="cpu")
    llama(prompt, past_key_values=cache)
    for _ in range(5):
        llama(torch.tensor([[1, 2], [3, 4]]), past_key_values=cache)
        cache.crop(-2)
    assert cache.get_seq_length() == 9 and cache.layers[0].table.wlens == [9, 9]


@torch.no_grad()
def test_static_cache_decodes_like_the_growing_one(llama, prompt) -> None:
    a = _generate(llama, prompt, make_cache("kv4rl", llama.config, sink=2, recent=4))
    b = _generate(llama, prompt, make_cache("kv4rl", llama.config, sink=2, recent=4, batch_size=2, max_len=16,
                                            device="cpu"))
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_public_names() -> None:
    assert "kv4" in kvlib.kernel_formats()
    assert isinstance(make_cache("bf16", _model().config), KVFormatCache)


@torch.no_grad()
def test_smollm2_decodes_through_the_pool(smol) -> None:
    model, tok = smol
    ids = tok("The river ran past the old mill.", return_tensors="pt").input_ids[:, :8]
    ref = _generate(model, ids, DynamicCache(config=model.config), n=3)
    cache = make_cache("dither-int8", model.config)
    out = _generate(model, ids, cache, n=3)
    diff = max(float((x - y).abs().max()) for x, y in zip(ref.logits, out.logits))
    assert diff < 1.0, diff  # logits of order 10: INT8 keys move them by a few hundredths per layer
    assert cache.certificates().shape[-1] == 2


#: the decode kernels each format's pools take (kernel_path); "torch-reference" is none of them
_INT8_KERNELS = ("int8-tc", "int8-fma", "int8-h10", "int8-gluon", "int8-wspec", "int8-wspec_cert")
KERNEL_PATHS = {"bf16": ("bf16-triton",), "dither-int8": _INT8_KERNELS, "rtn-int8": _INT8_KERNELS,
                "kv4": ("kv4-triton", "kv4-wspec"), "kv4rl": ("kv4rl-triton",)}


@torch.no_grad()
@pytest.mark.parametrize("fmt,tol", [("bf16", 2e-2), ("dither-int8", 2e-2), ("rtn-int8", 2e-2), ("kv4", 0.25),
                                     ("kv4rl", 0.25)])
def test_kernel_path_through_the_model_matches_the_reference_path(prompt, fmt, tol) -> None:
    """The decode kernels (Triton on CUDA, else under the CPU interpreter) inside generate: logits vs DynamicCache
    and vs the CPU reference path within the format's tolerance, and kernel_path says the kernel ran."""
    cuda = torch.cuda.is_available()
    hd = 64 if cuda else 32  # the paged KV4 kernel takes d >= 64 on CUDA; the interpreter keeps the small shape
    model = _model(head_dim=hd)
    ids = prompt[:1, :6]
    ref = _generate(model, ids, DynamicCache(config=model.config), n=2)
    plain = _generate(model, ids, make_cache(fmt, model.config), n=2)  # CPU tensors: the torch reference path
    dev = "cuda" if cuda else "cpu"
    model = model.to(dev)
    cache = make_cache(fmt, model.config)
    cache._ensure_store(torch.zeros(1, 2, 1, hd, device=dev))
    cache.store.interpret = True
    out = _generate(model, ids.to(dev), cache, n=2)
    assert cache.kernel_path(1) in KERNEL_PATHS[fmt], cache.kernel_path(1)
    for other in (ref, plain):
        assert max(float((a - b.cpu()).abs().max()) for a, b in zip(other.logits, out.logits)) <= tol


@torch.no_grad()
def test_static_pools_record_certificates_by_position(llama, prompt) -> None:
    cache = make_cache("dither-int8", llama.config, batch_size=2, max_len=16, device="cpu")
    _generate(llama, prompt, cache, n=3)
    c = cache.certificates()
    assert c.shape == (2, 4, 2, 16)
    done = ~torch.isnan(c)
    assert done[..., 9:11].all() and not done[..., :9].any() and not done[..., 11:].any()  # steps at 9 and 10
    assert cache.certificate_summary()["n"] == int(done.sum())
