"""Rollouts through generate with a cache factory: sampler log-probs agree with a teacher-forced learner."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvlib.rl.sampler import learner_logprobs, sample

EOS, PAD = 2, 0


def _tiny(vocab=64, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).eval()


def _dyn(model):
    return lambda batch: DynamicCache(config=model.config)


PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 3, 4]]  # unequal lengths: left padding and position ids matter


def test_sampler_and_learner_logprobs_agree_fp32():
    model = _tiny()
    r = sample(model, None, PROMPTS, cache_factory=_dyn(model), max_new_tokens=24,
               generator=torch.Generator().manual_seed(1), eos_token_id=EOS, pad_token_id=PAD)
    with torch.no_grad():
        lp = learner_logprobs(model, r)
    m = r.response_mask.bool()
    assert m.sum() > 0
    assert (lp[m] - r.sampler_logprobs[m]).abs().max() < 1e-5
    assert (r.sampler_logprobs[m] < 0).all()
    # one forward per micro-batch gives the same numbers
    with torch.no_grad():
        torch.testing.assert_close(learner_logprobs(model, r, micro_batch=2), lp, rtol=0, atol=1e-6)


def test_sample_is_seeded_and_leaves_global_rng_alone():
    model = _tiny()
    kw = dict(cache_factory=_dyn(model), max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    state = torch.random.get_rng_state()
    a = sample(model, None, PROMPTS, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = sample(model, None, PROMPTS, generator=torch.Generator().manual_seed(7), **kw)
    c = sample(model, None, PROMPTS, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_response_mask_stops_after_first_eos():
    model = _tiny(vocab=6)  # near-uniform over 6 tokens: EOS comes early in most rows
    r = sample(model, None, [[1, 3]] * 8, cache_factory=_dyn(model), max_new_tokens=20,
               generator=torch.Generator().manual_seed(0), eos_token_id=EOS, pad_token_id=PAD)
    ended = 0
    for ids, m, lq in zip(r.response_ids, r.response_mask, r.sampler_logprobs, strict=True):
        hits = (ids == EOS).nonzero().flatten()
        if len(hits):
            ended += 1
            first = int(hits[0])
            assert m[:first + 1].all() and not m[first + 1:].any()
            assert (lq[first + 1:] == 0).all() and lq[first] < 0
        else:
            assert m.all()
    assert ended >= 2  # the case under test occurred
    assert torch.equal(r.lengths, r.response_mask.sum(1))


def test_cache_factory_gets_batch_and_processors_are_refused():
    model = _tiny()
    seen = []

    def factory(batch):
        seen.append(batch)
        return DynamicCache(config=model.config)

    sample(model, None, PROMPTS, cache_factory=factory, max_new_tokens=2, generator=None,
           eos_token_id=EOS, pad_token_id=PAD)
    assert seen == [3]
    model.generation_config.repetition_penalty = 1.5  # a processor that reshapes the scores
    with pytest.raises(RuntimeError, match="logits processor"):
        sample(model, None, PROMPTS, cache_factory=factory, max_new_tokens=4, generator=None,
               eos_token_id=EOS, pad_token_id=PAD)


def test_sample_bad_input():
    model = _tiny()
    kw = dict(cache_factory=_dyn(model), generator=None, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample(model, None, PROMPTS, max_new_tokens=0, **kw)
    with pytest.raises(ValueError, match="tokenizer"):
        sample(model, None, ["text"], max_new_tokens=2, **kw)
    with pytest.raises(TypeError, match="prompts"):
        sample(model, None, [[1], "x"], max_new_tokens=2, **kw)
    with pytest.raises(TypeError, match="generator"):
        sample(model, None, PROMPTS, max_new_tokens=2, cache_factory=_dyn(model), generator=7, eos_token_id=EOS)


def test_chunked_learner_logprobs_match_full_logits_values_and_grads():
    """The chunked, checkpointed LM head gives the full-vocabulary log-softmax of the response positions,
    and the same gradients."""
    model = _tiny()
    r = sample(model, None, PROMPTS, cache_factory=_dyn(model), max_new_tokens=10,
               generator=torch.Generator().manual_seed(2), eos_token_id=EOS, pad_token_id=PAD)
    ids = torch.cat([r.prompt_ids, r.response_ids], 1)
    attn = torch.cat([r.prompt_mask, torch.ones_like(r.response_ids)], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    steps = r.response_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -(steps + 1):-1]
    ref = torch.log_softmax(logits.float(), -1).gather(-1, r.response_ids[..., None]).squeeze(-1)
    ref = ref.masked_fill(~r.response_mask.bool(), 0.0)
    g_ref = torch.autograd.grad(ref.sum(), model.lm_head.weight)[0]
    lp = learner_logprobs(model, r, micro_batch=2, chunk_tokens=3)  # chunks of 1 position per 2 rows
    torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=1e-5)
    g = torch.autograd.grad(lp.sum(), model.lm_head.weight)[0]
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="chunk_tokens"):
        learner_logprobs(model, r, chunk_tokens=0)
