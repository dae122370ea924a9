"""What a user's model, inputs and environment can do to kvlib's caches (issue 37): each is handled, or refused
at the call that takes it with an error naming the argument."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hf_helpers import prompt, tiny_model

import kvlib
from kvlib.hf.gate import make_gated_cache

torch.set_num_threads(1)


# -- item 8: validation names the argument -----------------------------------------------------------

@pytest.mark.parametrize("fmt,opts,exc,match", [
    ("fp32", dict(tau=-1), ValueError, "tau"),
    ("fp32", dict(tau=math.nan), ValueError, "tau"),
    ("fp32", dict(tau="0.2"), TypeError, "tau"),
    ("fp32", dict(tau="abc"), TypeError, "tau"),
    ("fp32", dict(tau=True), TypeError, "tau"),
    ("fp32", dict(key_options=5), TypeError, "key_options"),
    ("fp32", dict(value_options=[1]), TypeError, "value_options"),
    ("fp32", dict(dtype="float32"), TypeError, "dtype"),
    ("fp32", dict(outlier_sides=(3,)), ValueError, "outlier_sides"),
    ("kv4", dict(group=0), ValueError, "group must be >= 1"),
    ("kivi2", dict(group=48), ValueError, "group=48, residual=128"),
    ("dither-int8", dict(outlier_table=torch.zeros(2, 2, 2)), TypeError, "outlier_table.*integer"),
    ("dither-int8", dict(outlier_table=torch.ones(2, 2, 2, dtype=torch.int64)), ValueError, "outlier_table.*repeat"),
    ("dither-int8", dict(outlier_table=torch.full((2, 2, 2), 40)), ValueError, "outlier_table.*head_dim"),
])
def test_make_cache_names_the_argument(fmt, opts, exc, match):
    with pytest.raises(exc, match=match):
        kvlib.make_cache(fmt, tiny_model().config, **opts)


@pytest.mark.parametrize("opts,exc,match", [
    (dict(tau=True), TypeError, "tau"), (dict(tau="0.2"), TypeError, "tau"), (dict(gate="no"), TypeError, "gate"),
    (dict(gate=0), TypeError, "gate"),
])
def test_make_gated_cache_names_the_argument(opts, exc, match):
    with pytest.raises(exc, match=match):
        make_gated_cache("dither-int8", tiny_model().config, **opts)


def test_tau_inf_is_a_threshold():
    assert kvlib.make_cache("fp32", tiny_model().config, tau=math.inf).tau == math.inf


# -- item 7: devices ----------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("static", [False, True])
def test_missing_device_refused(device, static):
    kw = dict(batch_size=1, max_len=32) if static else {}
    with pytest.raises(ValueError, match=r"device='cuda(:0)?'"):
        kvlib.make_cache("fp32", tiny_model().config, device=device, **kw)


def test_device_honoured_without_batch_size():
    """device= without batch_size is checked against where the model's K/V arrive (not silently ignored)."""
    model = tiny_model()
    cache = kvlib.make_cache("fp32", model.config, device="meta")
    with pytest.raises(ValueError, match="device=meta"):
        model(prompt(1, 4), past_key_values=cache, use_cache=True)


# -- item 1: a config that is not the model's own --------------------------------------------------

def _fresh_llama():
    """A tiny Llama of its own (the config is switched by make_cache: other tests' models stay untouched)."""
    from hf_helpers import tiny_model as tm

    m = tm.__wrapped__("llama", 32, torch.float32, 0)
    return m


@pytest.mark.parametrize("how", ["deepcopy", "to_dict"])
@pytest.mark.parametrize("fmt", ["fp32", "rtn-int8"])
def test_copied_config_switches_the_models_attention(how, fmt):
    import torch.nn.functional as F
    from transformers import DynamicCache, LlamaConfig

    model = _fresh_llama()
    rows = [prompt(1, n, seed=40 + n) for n in (9, 6)]
    ids = torch.cat([F.pad(r, (9 - r.shape[1], 0), value=0) for r in rows])
    mask = torch.cat([F.pad(torch.ones_like(r), (9 - r.shape[1], 0), value=0) for r in rows])
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, past_key_values=kvlib.make_cache(fmt, model.config), **kw)
    model = _fresh_llama()  # untouched by the first make_cache
    want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    cfg = copy.deepcopy(model.config) if how == "deepcopy" else LlamaConfig(**model.config.to_dict())
    cache = kvlib.make_cache(fmt, cfg)
    with pytest.warns(UserWarning, match="not the one this model's attention reads"):
        out = model.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(out, ref), "a copied config gave other tokens than model.config"
    if fmt == "fp32":
        assert torch.equal(out, want)
    assert model.config._attn_implementation == "kvlib"
    assert cache.kernel_path(0) in ("torch-reference", "bf16-triton", "int8-torch", "int8-gluon")


def test_unconsumed_tag_is_refused():
    """Where the model attended over the new tokens without kvlib's attention anyway, the next update refuses."""
    from kvlib.hf import attention

    model = _fresh_llama()
    cache = kvlib.make_cache("fp32", model.config)
    real = attention.kvlib_attention

    def bypass(module, query, key, value, mask, **kw):  # an implementation that ignores the tag
        return attention._delegate(module)(module, query, key, value, mask, **kw)

    attention.kvlib_attention = bypass
    from transformers import AttentionInterface

    AttentionInterface.register("kvlib", bypass)
    try:
        with pytest.raises(RuntimeError, match="model's own config"):
            model(prompt(1, 5), past_key_values=cache, use_cache=True)
    finally:
        attention.kvlib_attention = real
        AttentionInterface.register("kvlib", real)


# -- item 9: the gate's shadow is in the byte account -------------------------------------------------

@pytest.mark.parametrize("shadow", ["device", "host"])
def test_kv_nbytes_counts_the_shadow(shadow):
    model = tiny_model()
    ids = prompt(2, 20, seed=70)
    plain = kvlib.make_cache("dither-int8", model.config, block_size=32)
    gated = make_gated_cache("dither-int8", model.config, shadow=shadow)
    for c in (plain, gated):
        model(ids, past_key_values=c, use_cache=True)
    b = gated.nbytes_breakdown()
    shadow_bytes = sum(t.numel() * t.element_size() for pair in gated._sh for t in pair if t is not None)
    # fp16 K and V of every allocated slot of every layer
    slots = gated.store.n_slots
    assert b["shadow"] == shadow_bytes == 2 * gated.n_layers * slots * gated.n_kv * gated.head_dim * 2 > 0
    assert gated.kv_nbytes() == b["pools"] + b["page_tables"] + b["shadow"]
    assert b["pools"] + b["page_tables"] == plain.kv_nbytes()  # the same pools as the plain cache
    assert plain.nbytes_breakdown()["shadow"] == 0


# -- item 3: one bad row never aborts the batch --------------------------------------------------------

def _corrupt_key(model, row: int, pos: int, value: float):
    """A forward hook on layer 0's k_proj that sets row ``row``'s key at prompt position ``pos`` to ``value``
    (the prefill only)."""
    def hook(mod, args, out):
        if out.shape[1] > pos:
            out = out.clone()
            out[row, pos, :8] = value
            return out
        return None

    return model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)


@pytest.mark.parametrize("value", [math.nan, math.inf, 1e7])
@pytest.mark.parametrize("fmt", ["dither-int8", "rtn-int8", "kv4", "kv4rl", "fp16", "fp32"])
def test_bad_row_is_isolated_and_flagged(fmt, value):
    model = tiny_model()
    ids = prompt(3, 10, seed=80)
    kw = dict(max_new_tokens=6, do_sample=False)
    clean_cache = kvlib.make_cache(fmt, model.config)
    clean = model.generate(ids, past_key_values=clean_cache, **kw)
    cache = kvlib.make_cache(fmt, model.config)
    h = _corrupt_key(model, row=1, pos=4, value=value)
    try:
        out = model.generate(ids, past_key_values=cache, **kw)
    finally:
        h.remove()
    fits = fmt == "fp32" and math.isfinite(value)  # fp32 stores 1e7 as it is
    assert torch.equal(out[[0, 2]], clean[[0, 2]]), "a bad row changed the other rows"
    assert cache.row_flags().tolist() == [False, not fits, False]
    assert not clean_cache.row_flags().any()
    s = cache.certificate_summary()
    assert s["flagged_rows"] == (0 if fits else 1)
    if fmt == "dither-int8":  # the flagged row's certificates in the layer that lost the vector: vacuous, counted
        c = cache.certificates()  # [L, Hq, B, steps]
        # (NaN and inf reach the next layer's keys through row 1's own float prompt attention: flagged there too)
        assert torch.isinf(c[0, :, 1]).all() and torch.isfinite(c[:, :, [0, 2]]).all()
        frac = float(torch.isinf(c).double().mean())
        assert s["overflow_fraction"] == pytest.approx(frac) and frac >= 1 / (3 * c.shape[0])


def test_flags_follow_the_rows():
    model = tiny_model()
    cache = kvlib.make_cache("rtn-int8", model.config)
    h = _corrupt_key(model, row=0, pos=2, value=math.nan)
    try:
        model(prompt(2, 6, seed=81), past_key_values=cache, use_cache=True)
    finally:
        h.remove()
    assert cache.row_flags().tolist() == [True, False]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.row_flags().tolist() == [False, True]
    cache.batch_repeat_interleave(2)
    assert cache.row_flags().tolist() == [False, False, True, True]


def test_representable_bounds_follow_the_formats():
    """Just inside a format's range it stores a vector and reads back finite values; just outside, representable
    says no (as it does for NaN and inf)."""
    from kvlib.formats.base import get_format

    for name in ("dither-int8", "rtn-int8", "fp8-e4m3", "kv4", "kv4rl", "kivi2", "fp16", "bf16", "fp32"):
        f = get_format(name)
        for side in (0, 1):
            assert not f.representable(torch.tensor([[math.nan] * 32]), side).any()
            assert not f.representable(torch.tensor([[math.inf] + [0.0] * 31]), side).any()
            lim = f.max_abs
            if math.isinf(lim):
                assert f.representable(torch.full((1, 32), 1e30), side).all()
                continue
            # keys that are Hadamard-rotated spread one spike over the head: lim * sqrt(d) in the spike's channel
            # reaches lim in every rotated channel
            spread = 32 ** 0.5 if name.startswith("kv4") and side == 0 else 1.0
            x = torch.zeros(2, 32, dtype=torch.float64)
            x[0, 0], x[1, 0] = lim * spread * 0.999, lim * spread * 1.01
            assert f.representable(x, side).tolist() == [True, False], (name, side)
            inside = x[:1].float()
            n = torch.arange(1)
            back = f.read(f.write(inside, layer=0, kv_head=0, side=side, positions=n, slots=n, seed=0))
            assert torch.isfinite(back).all(), (name, side)


# -- item 2: sliding windows --------------------------------------------------------------------------

def _windowed_mistral(window: int = 6):
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                        initializer_range=0.02, tie_word_embeddings=False, pad_token_id=0, sliding_window=window)
    torch.manual_seed(1020)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("fmt,tol", [("dither-int8", 0.05), ("rtn-int8", 0.05), ("fp32", 1e-4), ("kv4", 0.5)])
def test_sliding_window_is_honoured(fmt, tol):
    """Teacher-forced against the model's own windowed attention (a DynamicCache), past the window: within the
    format's contract tolerance (hf_helpers.LOSSY_TOL; dither-int8 drifted to 0.56 std when the window was
    ignored)."""
    from hf_helpers import forced_logits, rel_err
    from transformers import DynamicCache

    model = _windowed_mistral()
    ids, fed = prompt(2, 10, seed=90), prompt(2, 10, seed=91)
    ref = forced_logits(model, DynamicCache(config=model.config), ids, fed)
    cache = kvlib.make_cache(fmt, model.config)
    got = forced_logits(model, cache, ids, fed)
    err = rel_err(got, ref)
    assert err <= tol, f"{fmt}: {err:.3g} std from the windowed model"


def test_sliding_window_certificate_covers_the_window(monkeypatch):
    """The dither certificate is computed over exactly the positions the window lets through."""
    from kvlib.storage.pools import Int8Store

    model = _windowed_mistral(window=6)
    seen = []
    real = Int8Store.reference_certificates

    def spy(self, layer, q, table, sm, delta):
        seen.append((table.slot_table().clone(), table.seq_lens.clone()))
        return real(self, layer, q, table, sm, delta)

    monkeypatch.setattr(Int8Store, "reference_certificates", spy)
    cache = kvlib.make_cache("dither-int8", model.config)
    ids = prompt(2, 10, seed=92)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert len(seen) == 2  # one decode step, two layers
    for layer, (slots, lens) in enumerate(seen):
        full = cache.layers[layer].table.slot_table()[:, :11]
        assert lens.tolist() == [6, 6]
        assert torch.equal(slots[:, :6], full[:, 5:11]), "the certified positions are not the window's"
    s = cache.certificate_summary()
    assert s["n"] == 2 * 4 * 2 and 0 < s["max_finite"] < 1


def test_gated_cache_refuses_sliding_windows():
    with pytest.raises(ValueError, match="sliding-window"):
        make_gated_cache("dither-int8", _windowed_mistral().config)


def test_sliding_window_left_padded():
    import torch.nn.functional as F
    from hf_helpers import forced_logits, rel_err
    from transformers import DynamicCache

    model = _windowed_mistral()
    rows = [prompt(1, n, seed=93 + n) for n in (12, 7)]
    ids = torch.cat([F.pad(r, (12 - r.shape[1], 0), value=0) for r in rows])
    mask = torch.cat([F.pad(torch.ones_like(r), (12 - r.shape[1], 0), value=0) for r in rows])
    fed = prompt(2, 8, seed=95)
    ref = forced_logits(model, DynamicCache(config=model.config), ids, fed, mask)
    for fmt, tol in (("fp32", 1e-4), ("dither-int8", 0.05)):
        got = forced_logits(model, kvlib.make_cache(fmt, model.config), ids, fed, mask)
        assert rel_err(got, ref) <= tol, fmt
