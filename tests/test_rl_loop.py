"""A GRPO iteration end to end on the CPU: a tiny random model, a trivial task, two iterations."""

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvlib.rl.loop import GRPOConfig, run_grpo

EOS, PAD, TARGET = 2, 0, 5


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper next-token distributions, so a perturbed cache moves them visibly
        model.lm_head.weight.mul_(30.0)
    return model


class NoisyCache(DynamicCache):
    """A cache that perturbs the keys it stores: a stand-in for a lossy rollout cache (sampler != learner)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        noise = 2.0 * torch.randn(key_states.shape, generator=self.gen, dtype=key_states.dtype)
        return super().update(key_states + noise, value_states, layer_idx, *args, **kwargs)


def _noisy(model):
    def factory(batch):
        c = NoisyCache(config=model.config)
        c.gen = torch.Generator().manual_seed(batch)
        return c
    return factory


def _reward(response_ids, problem):  # trivial verifiable task: did the response emit the target token?
    return 1.0 if TARGET in response_ids else 0.0


def _prompt(tokenizer, problem):
    return [1, problem]


@pytest.mark.parametrize("micro_batch", [None, 3])
def test_two_grpo_iterations_train_and_record(micro_batch):
    model = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = GRPOConfig(group_size=4, prompts_per_iteration=4, max_new_tokens=8, lr=1e-2, tis_cap=1.5, beta=0.05,
                     micro_batch=micro_batch)
    hist = run_grpo(model, None, [3, 4, 6, 7, 8, 9], cfg=cfg, cache_factory=_noisy(model), iterations=2, seed=0,
                    reward_fn=_reward, prompt_fn=_prompt, eos_token_id=EOS, pad_token_id=PAD)
    assert hist["iteration"] == [0, 1]
    for key in ("reward_mean", "response_length_mean", "ref_kl_k3", "sampler_learner_kl_k1",
                "sampler_learner_kl_k3", "rollout_seconds", "loss", "tis_max", "tis_mean"):
        assert len(hist[key]) == 2 and all(math.isfinite(v) for v in hist[key]), key
    assert all(v <= cfg.tis_cap + 1e-6 for v in hist["tis_max"])
    assert max(hist["tis_truncated"]) > 0  # the noisy cache made the cap bite: the bound was tested
    assert min(hist["sampler_learner_kl_k3"]) > 0
    assert hist["ref_kl_k3"][0] == pytest.approx(0.0, abs=1e-7)  # pi_old == pi_ref before the first step
    assert hist["ref_kl_k3"][1] > 0
    assert all(1 <= v <= cfg.max_new_tokens for v in hist["response_length_mean"])
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    assert hist["config"][0]["tis_cap"] == 1.5 and hist["seed"] == [0]


def test_micro_batches_give_the_same_update(monkeypatch):
    """Token-mean over the whole mini-batch: splitting it into micro-batches must not change the step.

    Only the summation order differs between the two runs, so the tolerances follow from float64's unit
    roundoff u = 1.1e-16. Each gradient entry sums at most n ~ 4e3 contributions (16 rows x 8 tokens x 30
    per-token terms), each below the gradient norm (~25), so two orders differ by at most
    delta <= n u sum|t| ~ 4e3 * 1.1e-16 * 1e5 ~ 5e-8. Plain SGD moves a parameter by lr * g, so the two runs'
    parameters differ by at most lr * delta = 5e-11. (AdamW's first step, lr * g / (|g| + eps), amplifies delta
    by up to 1 / eps where g ~ 0: that, in float32, is what made an fp32 AdamW version of this test flaky.)
    A wrong micro-batch weight moves a parameter by about lr * |g| * (its relative error), far outside 5e-11.
    """
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(
        params, lr=lr, weight_decay=weight_decay))
    out = []
    for mb in (None, 5):
        model = _tiny().to(torch.float64)
        cfg = GRPOConfig(group_size=4, prompts_per_iteration=4, max_new_tokens=8, lr=1e-3, beta=0.05, micro_batch=mb)
        hist = run_grpo(model, None, [3, 4, 6, 7, 8, 9], cfg=cfg, cache_factory=_noisy(model), iterations=1, seed=0,
                        reward_fn=_reward, prompt_fn=_prompt, eos_token_id=EOS, pad_token_id=PAD)
        assert hist["grad_norm"][0] > 0
        out.append((hist, [p.detach().clone() for p in model.parameters()]))
    (h0, p0), (h1, p1) = out
    # the reported loss is a float32-weighted mean of per-micro-batch statistics (kvlib.rl.loop): float32's u
    assert h0["loss"][0] == pytest.approx(h1["loss"][0], rel=1e-5, abs=1e-7)
    assert h0["grad_norm"][0] == pytest.approx(h1["grad_norm"][0], rel=5e-8 / h0["grad_norm"][0])
    for a, b in zip(p0, p1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * 5e-8)
    # the step was not a no-op, which would make the comparison vacuous
    assert any(float((a - b).abs().max()) > 1e-6 for a, b in zip(p0, _tiny().parameters(), strict=True))


def test_config_bad_input():
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(tis_cap=0.9)
    with pytest.raises(ValueError, match="dual_clip"):
        GRPOConfig(dual_clip=1.0)


def test_bf16_rollout_copy_and_autocast_learner():
    """The arms' set-up: bf16 rollout weights refreshed after each step, learner over fp32 master weights."""
    from kvlib.rl.loop import frozen_copy, sync_weights

    model = _tiny()
    copy16 = frozen_copy(model).to(torch.bfloat16)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    sync_weights(model, copy16)
    for a, b in zip(model.state_dict().values(), copy16.state_dict().values(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b)
    cfg = GRPOConfig(group_size=4, prompts_per_iteration=4, max_new_tokens=8, lr=1e-2, beta=0.05,
                     learner_autocast="bfloat16")
    dyn = lambda batch: DynamicCache(config=model.config)  # noqa: E731
    hist = run_grpo(model, None, [3, 4, 6, 7, 8, 9], cfg=cfg, cache_factory=dyn, iterations=2, seed=0,
                    reward_fn=_reward, prompt_fn=_prompt, eos_token_id=EOS, pad_token_id=PAD,
                    rollout_dtype=torch.bfloat16)
    assert all(math.isfinite(v) for v in hist["loss"])
    assert next(model.parameters()).dtype == torch.float32
    assert min(hist["sampler_learner_kl_k3"]) > 0  # bf16 sampler vs bf16-autocast learner: not bit-equal paths
    with pytest.raises(ValueError, match="learner_autocast"):
        GRPOConfig(learner_autocast="fp8")


def test_evaluate_avg_and_pass_at_k():
    from kvlib.rl.loop import evaluate

    model = _tiny()
    dyn = lambda batch: DynamicCache(config=model.config)  # noqa: E731
    kw = dict(max_new_tokens=6, cache_factory=dyn, prompt_fn=_prompt, eos_token_id=EOS, pad_token_id=PAD,
              batch_size=5)
    # a reward that ignores the response: problem 3 always right, 4 never -> avg@k = pass@k = 1/2
    res = evaluate(model, None, [3, 4], k=4, generator=torch.Generator().manual_seed(0),
                   reward_fn=lambda resp, p: float(p == 3), **kw)
    assert res["correct"] == [4, 0] and res["avg_at_k"] == 0.5 and res["pass_at_k"] == 0.5
    res = evaluate(model, None, [3, 4, 6], k=3, generator=torch.Generator().manual_seed(0), reward_fn=_reward, **kw)
    assert all(0 <= c <= 3 for c in res["correct"])
    assert res["avg_at_k"] == pytest.approx(sum(res["correct"]) / 9)
    assert res["pass_at_k"] >= res["avg_at_k"]
