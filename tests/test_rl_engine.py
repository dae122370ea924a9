"""The static-pool rollout engine (kvlib.rl.engine) against HF generate, and the run entry's pure pieces."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from dev.rlvr_runs import choose_difficulty
from kvlib.rl.engine import sample_static
from kvlib.rl.sampler import learner_logprobs

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 3, 4]]  # unequal lengths: left padding and position ids matter


def _tiny(dtype=torch.float32, head_dim=None):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=head_dim,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    model.config._attn_implementation = "sdpa"
    return model


def test_greedy_matches_generate_with_a_dynamic_cache():
    # a bf16 model: the bf16 passthrough pool and a DynamicCache then hold the same K/V values
    model = _tiny(torch.bfloat16)
    r = sample_static(model, None, PROMPTS, fmt="bf16", max_new_tokens=12, generator=None, greedy=True,
                      eos_token_id=EOS, pad_token_id=PAD)
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                             do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)[:, width:]
    for row in range(len(PROMPTS)):
        n = int(r.response_mask[row].sum())
        assert r.response_ids[row, :n].tolist() == ref[row, :n].tolist()
    assert r.info["fmt"] == "bf16" and r.info["steps"] == r.response_ids.shape[1]
    assert not r.info["graphed"]  # CPU: eager steps


def test_sampler_logprobs_agree_with_the_learner_and_are_seeded():
    model = _tiny()
    kw = dict(fmt="bf16", max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    r = sample_static(model, None, PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
    r2 = sample_static(model, None, PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(r.response_ids, r2.response_ids)
    with torch.no_grad():
        lp = learner_logprobs(model, r)
    m = r.response_mask.bool()
    assert m.sum() > 0 and (r.sampler_logprobs[m] < 0).all()
    # the pool rounds K/V to bf16; the learner attends in fp32: close, not equal
    assert (lp[m] - r.sampler_logprobs[m]).abs().max() < 0.05
    assert r.info["prefill_path"] == ["sdpa-prefill"]


def test_min_new_tokens_fixes_the_length():
    model = _tiny()
    r = sample_static(model, None, PROMPTS, fmt="bf16", max_new_tokens=6, min_new_tokens=6,
                      generator=torch.Generator().manual_seed(0), eos_token_id=EOS, pad_token_id=PAD)
    assert r.response_ids.shape == (3, 6) and r.info["steps"] == 6


def test_no_silent_fallback_to_the_reference():
    model = _tiny()
    # RTN-int8 keys have no decode kernel: with require_kernel the engine refuses instead of falling back
    with pytest.raises(RuntimeError, match="torch reference"):
        sample_static(model, None, PROMPTS, fmt="rtn-int8", max_new_tokens=4, generator=None,
                      eos_token_id=EOS, pad_token_id=PAD, require_kernel=True)
    r = sample_static(model, None, PROMPTS, fmt="rtn-int8", max_new_tokens=4, generator=None,
                      eos_token_id=EOS, pad_token_id=PAD, require_kernel=False)
    assert "torch-reference" in r.info["decode_paths"] and not r.info["kernel"]


def test_engine_bad_input():
    model = _tiny()
    kw = dict(generator=None, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(TypeError, match="fmt"):
        sample_static(model, None, PROMPTS, fmt=3, max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_static(model, None, PROMPTS, fmt="bf16", max_new_tokens=0, **kw)
    with pytest.raises(ValueError, match="min_new_tokens"):
        sample_static(model, None, PROMPTS, fmt="bf16", max_new_tokens=4, min_new_tokens=5, **kw)
    with pytest.raises(ValueError, match="graph"):
        sample_static(model, None, PROMPTS, fmt="bf16", max_new_tokens=4, graph=True, **kw)
    with pytest.raises(ValueError, match="unknown format"):
        sample_static(model, None, PROMPTS, fmt="nope", max_new_tokens=4, **kw)


def test_choose_difficulty_hand_case():
    by = {1: {"n": 10, "acc": 0.9}, 2: {"n": 10, "acc": 0.5}, 3: {"n": 10, "acc": 0.2}, 4: {"n": 10, "acc": 0.0}}
    got = choose_difficulty(by, target=0.35)
    # candidates: {2,3} pools to 0.35 exactly (|0| off); {1,2,3}: 0.533; {2}: 0.5; {3}: 0.2; {2,3,4}: 0.233
    assert (got["difficulty"]["min_steps"], got["difficulty"]["max_steps"]) == (2, 3)
    assert got["pooled_accuracy"] == pytest.approx(0.35)
    got = choose_difficulty(by, target=0.0)  # {4} alone; ties broken toward longer chains
    assert (got["difficulty"]["min_steps"], got["difficulty"]["max_steps"]) == (4, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the decode kernels need a GPU")
@pytest.mark.parametrize("fmt", ["bf16", "kv4", "kv4rl"])
def test_graph_replay_equals_eager_on_the_kernel_path(fmt):
    model = _tiny(torch.bfloat16, head_dim=64).cuda()  # the INT4 kernels need d >= 64 on CUDA
    kw = dict(fmt=fmt, max_new_tokens=24, generator=None, greedy=True, eos_token_id=EOS, pad_token_id=PAD)
    eager = sample_static(model, None, PROMPTS, graph=False, **kw)
    graphed = sample_static(model, None, PROMPTS, graph=True, **kw)
    assert graphed.info["graphed"] and graphed.info["kernel"], graphed.info
    assert not any(p in ("torch-reference", "none") for p in graphed.info["decode_paths"])
    assert torch.equal(eager.response_ids, graphed.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, graphed.sampler_logprobs, rtol=0, atol=1e-5)
