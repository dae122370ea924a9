"""Shared-prefix learner scoring equals the full-sequence path: log-probs and the GRPO loss's gradient."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.rl import grpo
from kvlib.rl.sampler import Rollout, learner_logprobs, shared_prefix_length

PAD = 0


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    m = LlamaForCausalLM(cfg).eval()
    m.config._attn_implementation = "sdpa"
    return m


def _rollout(prefix_len=40, seed=3):
    """Prompts = one shared prefix + a different tail (1-6 tokens), left-padded; responses with EOS masks."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 80, (prefix_len,), generator=g).tolist()
    tails = [torch.randint(3, 80, (int(k),), generator=g).tolist() for k in (1, 6, 3, 2, 5, 4)]
    seqs = [prefix + t for t in tails]
    W, B, T = max(map(len, seqs)), len(seqs), 7
    ids = torch.full((B, W), PAD)
    mask = torch.zeros((B, W), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, W - len(s):] = torch.tensor(s)
        mask[i, W - len(s):] = 1
    resp = torch.randint(3, 80, (B, T), generator=g)
    lens = torch.tensor([7, 3, 5, 7, 1, 6])
    rmask = (torch.arange(T)[None] < lens[:, None]).long()
    q = -torch.rand(B, T, generator=g).masked_fill(~rmask.bool(), 0.0)
    return Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=rmask, sampler_logprobs=q,
                   seconds=0.0)


def test_shared_prefix_length():
    r = _rollout(prefix_len=40)
    assert shared_prefix_length(r.prompt_ids, r.prompt_mask) == 40  # shortest prompt has 41 tokens: cap 40
    ids = r.prompt_ids.clone()
    W = ids.shape[1]
    ids[2, W - 43 + 10] = 79 if ids[2, W - 43 + 10] != 79 else 78  # row 2 (tail 3) differs at token 10
    assert shared_prefix_length(ids, r.prompt_mask) == 10
    with pytest.raises(ValueError, match="prompt_mask"):
        shared_prefix_length(ids, r.prompt_mask[:, 1:])


@pytest.mark.parametrize("micro_batch", [None, 4])
def test_shared_prefix_logprobs_equal_full(micro_batch):
    model, r = _tiny(), _rollout()
    info_s, info_f = {}, {}
    with torch.no_grad():
        full = learner_logprobs(model, r, micro_batch=micro_batch, shared_prefix=False, info=info_f)
        shared = learner_logprobs(model, r, micro_batch=micro_batch, shared_prefix=True, info=info_s)
    assert set(info_s["paths"]) == {"shared-prefix"} and set(info_f["paths"]) == {"full"}
    assert info_s["tokens"] < info_f["tokens"]
    m = r.response_mask.bool()
    assert (shared[m] - full[m]).abs().max() <= 1e-5
    assert (shared[~m] == 0).all()
    # auto picks the shared path for a long prefix and the full one (saying why) for a short one
    auto = {}
    with torch.no_grad():
        learner_logprobs(model, r, micro_batch=micro_batch, info=auto)
        short = {}
        learner_logprobs(model, r, micro_batch=micro_batch, min_prefix=41, info=short)
    assert set(auto["paths"]) == {"shared-prefix"}
    assert set(short["paths"]) == {"full"} and "min_prefix" in short["reasons"][0]
    with pytest.raises(ValueError, match="shared_prefix=True"):
        learner_logprobs(model, r, shared_prefix=True, min_prefix=41)


def _loss_grads(model, r, adv, shared):
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        old = learner_logprobs(model, r, shared_prefix=False)
    logp = learner_logprobs(model, r, micro_batch=4, shared_prefix=shared)
    loss, _ = grpo.grpo_loss(logp, old + 0.05 * r.sampler_logprobs, old - 0.1, r.sampler_logprobs, adv,
                             r.response_mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0, tis_cap=2.0, beta=1e-3)
    loss.backward()
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    params = dict(model.named_parameters())
    return float(loss.detach()), {n: params[n].grad.clone() for n in names}


def test_shared_prefix_grpo_gradient_equals_full():
    model, r = _tiny(), _rollout()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    lf, gf = _loss_grads(model, r, adv, False)
    ls, gs = _loss_grads(model, r, adv, True)
    assert abs(lf - ls) <= 1e-6
    for n in gf:
        assert gf[n].abs().max() > 0, n  # the prefix's own layers (k/v of layer 0) get gradient from every row
        torch.testing.assert_close(gs[n], gf[n], rtol=1e-4, atol=1e-7, msg=n)
