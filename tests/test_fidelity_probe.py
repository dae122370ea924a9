"""Batched KV4-RL storage probe (kvlib.analysis.storage_probe): exactness of the fast KV4-RL view and zero-KL repeat."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.analysis.fidelity import forced_logits, geometric_kl_ratio
from kvlib.analysis.storage_probe import ProtectedCache, batched_probe, kv4rl_view, prefill_context, sample_responses


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("opts", [dict(sink=2, recent=5), dict(sink=0, recent=7), dict(sink=9, recent=0),
                                  dict(sink=3, recent=4, protect="bf16", rotate="kv")])
def test_protected_view_equals_kv4rl_format(tiny_model, opts):
    """Decode through ProtectedCache == decode through the library's stateful "kv4rl" cache."""
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = forced_logits(tiny_model, ids, 12, ("kv4rl", opts), mode="decode")
    fast = forced_logits(tiny_model, ids, 12, kv4rl_view(**opts), mode="decode")
    assert torch.allclose(ref, fast, atol=1e-4, rtol=0)


def test_protected_view_protects_exactly_the_window(tiny_model):
    cache = ProtectedCache(tiny_model.config, sink=2, recent=3)
    x = torch.randn(1, 2, 10, 32)
    k, _ = cache.layers[0].update(x, x)
    full = ProtectedCache(tiny_model.config, sink=10, recent=0).layers[0].update(x, x)[0]
    int4 = ProtectedCache(tiny_model.config, sink=0, recent=0).layers[0].update(x, x)[0]
    prot = torch.zeros(10, dtype=torch.bool)
    prot[:2] = prot[7:] = True
    assert torch.equal(k[:, :, prot], full[:, :, prot]) and torch.equal(k[:, :, ~prot], int4[:, :, ~prot])
    k2, _ = cache.layers[0].update(x[:, :, :2], x[:, :, :2])  # positions 7, 8 leave the window
    assert torch.equal(k2[:, :, 7:9], int4[:, :, 7:9]) and k2.shape[-2] == 12


def test_batched_probe_repeat_is_zero_and_kv4_is_not(tiny_model):
    prompts = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    ctx = prefill_context(tiny_model, prompts)
    resp = sample_responses(tiny_model, prompts, ctx, 9, seed=0)
    assert resp.shape == (3, 9)
    assert torch.equal(resp, sample_responses(tiny_model, prompts, ctx, 9, seed=0))
    out = {r.name: r for r in batched_probe(tiny_model, prompts, resp, {
        "repeat": None, "kv4": ("kv4", dict(rotate="none")), "rl": kv4rl_view(sink=4, recent=8)}, batch=2)}
    assert out["repeat"].kl.shape == (24,) and np.all(out["repeat"].kl == 0.0)
    assert out["kv4"].kl.mean() > 0 and np.all(np.isfinite(out["rl"].kl))
    assert np.array_equal(out["kv4"].path, np.repeat(np.arange(3), 8))
    mean, lo, hi = out["kv4"].ci(n_resamples=200)
    assert lo <= mean <= hi
    r, rlo, rhi = geometric_kl_ratio(out["rl"], out["kv4"], n_resamples=200)
    assert rlo <= r <= rhi


def test_batched_probe_bad_input(tiny_model):
    with pytest.raises(ValueError, match="prompts"):
        batched_probe(tiny_model, torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long), {})


def test_batched_probe_reuses_contexts(tiny_model):
    prompts = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(3))
    ctxs = [prefill_context(tiny_model, prompts[i:i + 2]) for i in (0, 2)]
    resp = torch.cat([sample_responses(tiny_model, prompts[i:i + 2], c, 5, seed=i) for i, c in zip((0, 2), ctxs)])
    specs = {"kv4": "kv4"}
    a = batched_probe(tiny_model, prompts, resp, specs, batch=2, contexts=ctxs)[0]
    b = batched_probe(tiny_model, prompts, resp, specs, batch=2)[0]
    assert np.allclose(a.kl, b.kl, rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="contexts"):
        batched_probe(tiny_model, prompts, resp, specs, batch=2, contexts=ctxs[:1])


def test_batched_probe_shared_encodings_change_no_bit(tiny_model):
    """Specs that store the shared context alike (KV4-RL views over one main format) reuse its encoding within a
    batch; each spec probed alone (nothing to share) gives the same bits."""
    from kvlib.analysis import storage_probe as sp

    prompts = torch.randint(0, 97, (2, 18), generator=torch.Generator().manual_seed(4))
    resp = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    specs = {"a": kv4rl_view(sink=2, recent=3), "b": kv4rl_view(sink=4, recent=1), "c": kv4rl_view(sink=0, recent=5),
             "bf16": kv4rl_view(sink=2, recent=3, protect="bf16"), "kv4": ("kv4", dict(rotate="k"))}
    seen = []
    real = sp._memo

    def spy(key, x, fn):
        seen.append(key is not None and sp._ENCODINGS is not None
                    and (*key, id(x)) in sp._ENCODINGS and sp._ENCODINGS[(*key, id(x))][0] is x)
        return real(key, x, fn)

    sp._memo = spy
    try:
        together = {r.name: r for r in batched_probe(tiny_model, prompts, resp, specs, batch=2)}
    finally:
        sp._memo = real
    assert any(seen), "no encoding was shared"
    assert sp._ENCODINGS is None and not sp._SHAREABLE
    for name, spec in specs.items():
        alone = batched_probe(tiny_model, prompts, resp, {name: spec}, batch=2)[0]
        assert np.array_equal(alone.kl, together[name].kl) and np.array_equal(alone.top1, together[name].top1), name


# ----------------------------------------------------------------------------- vectorised storage views
def _chunk_then_decode(model, ids, cache, split, chunk):
    """Logits of ``ids [B, N]`` fed as a prefix of ``split`` tokens then the rest (one chunk or token by token)."""
    from kvlib.analysis.storage_probe import probe_attention

    with torch.no_grad(), probe_attention(model):
        rows = [model(ids[:, :split], past_key_values=cache, use_cache=True).logits]
        if chunk:
            rows.append(model(ids[:, split:], past_key_values=cache, use_cache=True).logits)
        else:
            rows += [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits
                     for i in range(split, ids.shape[1])]
    return torch.cat(rows, 1)


@pytest.mark.parametrize("fmt,opts", [("fp32", {}), ("kv4", dict(rotate="none")), ("kv4", dict(rotate="kv")),
                                      ("kv4-g16", {}), ("nvfp4", dict(rotate="k")), ("mxfp4", {})])
def test_storage_view_equals_format_cache(tiny_model, fmt, opts):
    """The vectorised view and the per-stream format cache hand attention the same K/V."""
    from kvlib.analysis.storage_probe import storage_view
    from kvlib.hf.cache import make_cache

    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    ref = _chunk_then_decode(tiny_model, ids, make_cache(fmt, tiny_model.config, prefill="stored", **opts), 20, True)
    fast = _chunk_then_decode(tiny_model, ids, storage_view(fmt, **opts)(tiny_model.config), 20, True)
    assert torch.allclose(ref, fast, atol=1e-5, rtol=0)


@pytest.mark.parametrize("opts", [dict(sink=2, recent=5), dict(sink=0, recent=7), dict(sink=9, recent=0),
                                  dict(sink=3, recent=4, protect="bf16", rotate="kv"), dict(sink=4, recent=64)])
def test_regional_chunk_equals_decode(tiny_model, opts):
    """A chunk of forced tokens under the regional attention == the same tokens decoded one by one
    (each query sees the protected set of its own step), for windows shorter and longer than the chunk."""
    ids = torch.randint(0, 97, (2, 36), generator=torch.Generator().manual_seed(5))
    chunk = _chunk_then_decode(tiny_model, ids, ProtectedCache(tiny_model.config, **opts), 12, True)
    step = _chunk_then_decode(tiny_model, ids, ProtectedCache(tiny_model.config, **opts), 12, False)
    int4 = _chunk_then_decode(tiny_model, ids, ProtectedCache(tiny_model.config, sink=0, recent=0), 12, True)
    err = (chunk[:, 12:] - step[:, 12:]).abs().max()
    effect = (chunk[:, 12:] - int4[:, 12:]).abs().max()
    # equal up to float rounding (a chunk's K differs from a step's in the last bit, which can move a
    # value across a bf16 / INT8 rounding boundary): far below what protection itself changes
    assert err < 1e-4 and err < 0.01 * effect


@pytest.mark.parametrize("sink,recent", [(0, 0), (3, 0), (0, 5), (2, 4), (7, 50)])
def test_protected_region_matches_the_format_rule(sink, recent):
    from kvlib.analysis.storage_probe import protected_region
    from kvlib.formats.kv4rl import protected_mask

    n = 23
    q_pos = torch.arange(9, n)
    m = protected_region(q_pos, n, sink, recent)
    assert m.shape == (q_pos.numel(), n)
    for i, t in enumerate(q_pos.tolist()):
        assert torch.equal(m[i, :t + 1], protected_mask(t + 1, sink, recent))
        assert int(m[i, :t + 1].sum()) == min(t + 1, sink + recent)


def test_storage_view_bad_input(tiny_model):
    from kvlib.analysis.storage_probe import StorageCache, storage_view
    from kvlib.formats import get_format

    with pytest.raises(ValueError, match="fmt"):
        storage_view("kivi2")
    with pytest.raises(ValueError, match="main"):
        StorageCache(tiny_model.config, get_format("kivi2"))
    with pytest.raises(TypeError, match="main"):
        StorageCache(tiny_model.config, "kv4")
    with pytest.raises(ValueError, match="capacity|sink"):
        StorageCache(tiny_model.config, None, sink=-1)
    with pytest.raises(ValueError, match="mode"):
        batched_probe(tiny_model, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), {},
                      mode="fast")


def test_probe_attention_restores_the_model(tiny_model):
    from kvlib.analysis.storage_probe import REGIONAL_ATTN, probe_attention

    before = tiny_model.config._attn_implementation
    with probe_attention(tiny_model):
        assert tiny_model.config._attn_implementation == REGIONAL_ATTN
    assert tiny_model.config._attn_implementation == before


def test_kl_mean_ratio_properties():
    from kvlib.analysis.fidelity import ProbeResult, kl_mean_ratio

    rng = np.random.default_rng(0)
    path = np.repeat(np.arange(10), 8)
    a = ProbeResult("a", rng.gamma(1.0, 1e-2, path.size), np.ones(path.size), path)
    assert kl_mean_ratio(a, a, n_resamples=500) == (1.0, 1.0, 1.0)
    scaled = ProbeResult("s", 7.0 * a.kl, a.top1, path)
    r, lo, hi = kl_mean_ratio(scaled, a, n_resamples=500)
    assert np.allclose([r, lo, hi], 7.0)
    b = ProbeResult("b", rng.gamma(1.0, 1e-3, path.size), a.top1, path)
    r, lo, hi = kl_mean_ratio(a, b, n_resamples=500)
    assert lo <= r <= hi and r == pytest.approx(a.kl.mean() / b.kl.mean())
    with pytest.raises(ValueError, match="same paths"):
        kl_mean_ratio(a, ProbeResult("c", a.kl, a.top1, path[::-1]))
