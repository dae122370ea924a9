"""DAPO dynamic sampling in the GRPO iteration (kvlib.rl.loop, GRPOConfig.dynamic_sampling), on a tiny random Llama.

Rewards are hand-made per problem (the response does not matter): a problem is *informative* when its group
gets mixed rewards (alternating 1/0), else all zero, so which groups the filter must keep is known in advance.
"""

import copy

import pytest
import torch
from test_rl_loop import EOS, PAD, _noisy, _tiny

from kvlib.rl import grpo
from kvlib.rl.loop import GRPOConfig, frozen_copy, grpo_iteration
from kvlib.rl.sampler import Rollout, learner_logprobs

G = 4


class Problem:
    def __init__(self, uid: int, informative: bool):
        self.uid, self.informative, self.calls = uid, informative, 0


def _reward(response, p):
    p.calls += 1
    return float(p.informative and p.calls % 2 == 0)


def _prompt(tokenizer, p):
    return [1] + [3 + (p.uid % 10)] * (1 + p.uid % 3)  # prompts of different lengths: rounds pad differently


def _setup(rounds_informative, **cfg_kw):
    """Problems for each round (True = informative), a recording sampler, and the pieces of one iteration."""
    model = _tiny()
    ref = frozen_copy(model)
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = GRPOConfig(group_size=G, prompts_per_iteration=len(rounds_informative[0]), max_new_tokens=6, beta=0.05,
                     lr=1e-2, **cfg_kw)
    uid = iter(range(1000))
    rounds = [[Problem(next(uid), f) for f in r] for r in rounds_informative]
    extra = iter(rounds[1:])
    seen: list[Rollout] = []
    from kvlib.rl.sampler import sample

    def sampler(model, tok, prompts, **kw):
        r = sample(model, tok, prompts, cache_factory=_noisy(model), **kw)
        seen.append(r)
        return r

    def more(n):
        return next(extra)

    kw = dict(cfg=cfg, cache_factory=None, generator=torch.Generator().manual_seed(0), reward_fn=_reward,
              prompt_fn=_prompt, eos_token_id=EOS, pad_token_id=PAD, sampler=sampler, more_problems=more)
    return model, ref, opt, cfg, rounds, seen, kw


def test_filter_keeps_exactly_the_informative_groups_and_stops_at_the_target():
    # round 1: only group 1 informative; round 2: groups 0, 2, 3 -> target 3 reached with 1 + {0, 2}; group 3 of
    # round 2 is dropped (the batch is trimmed to the target); round 3 is never sampled
    model, ref, opt, cfg, rounds, seen, kw = _setup([[False, True, False, False], [True, False, True, True],
                                                      [True, True, True, True]],
                                                     dynamic_sampling=True, target_groups=3, max_sampling_rounds=5)
    m = grpo_iteration(model, ref, opt, None, rounds[0], **kw)
    assert len(seen) == 2 and all(p.calls == 0 for p in rounds[2])
    assert m["dyn_sampling_rounds"] == 2 and m["dyn_groups_sampled"] == 8 and m["dyn_groups_informative"] == 4
    assert m["dyn_groups_kept"] == 3 and m["dyn_target_reached"] == 1 and m["dyn_update_skipped"] == 0
    assert m["rollout_seconds"] == pytest.approx(sum(r.seconds for r in seen))  # discarded rounds included
    assert m["informative_group_fraction"] == 0.5  # over everything sampled, not over the kept batch
    assert m["reward_mean"] == pytest.approx(4 * 2 / 32) and m["dyn_reward_mean_kept"] == 0.5
    # the update's tokens are exactly the kept rows' (round 1 group 1, round 2 groups 0 and 2)
    kept = [(0, 1), (1, 0), (1, 2)]
    assert m["n_tokens"] == sum(float(seen[r].response_mask[G * k:G * k + G].sum()) for r, k in kept)
    info = grpo_iteration.last_rollout_info
    assert len(info["rounds"]) == 2


def test_cap_trains_on_the_kept_groups_and_says_so():
    model, ref, opt, cfg, rounds, seen, kw = _setup([[False, True, False, False], [False, False, True, False]],
                                                     dynamic_sampling=True, target_groups=4, max_sampling_rounds=2)
    before = [p.detach().clone() for p in model.parameters()]
    m = grpo_iteration(model, ref, opt, None, rounds[0], **kw)
    assert m["dyn_sampling_rounds"] == 2 and m["dyn_groups_kept"] == 2 and m["dyn_target_reached"] == 0
    assert m["n_tokens"] == float(seen[0].response_mask[G:2 * G].sum() + seen[1].response_mask[2 * G:3 * G].sum())
    assert m["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_nothing_informative_within_the_cap_takes_no_step():
    model, ref, opt, cfg, rounds, seen, kw = _setup([[False, False], [False, False]],
                                                     dynamic_sampling=True, target_groups=2, max_sampling_rounds=2)
    before = copy.deepcopy(model.state_dict())
    m = grpo_iteration(model, ref, opt, None, rounds[0], **kw)
    assert m["dyn_groups_kept"] == 0 and m["dyn_update_skipped"] == 1 and m["grad_norm"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert m["rollout_seconds"] == pytest.approx(seen[0].seconds + seen[1].seconds)


def test_loss_on_the_kept_groups_equals_grpo_loss_on_that_batch():
    """Independent reference: each kept group scored on its own round's rollout (no cross-round padding),
    advantages from group_advantages of its rewards, grpo_loss token sums over N_tok of the kept batch."""
    model, ref, opt, cfg, rounds, seen, kw = _setup([[True, False, False], [False, True, True]],
                                                     dynamic_sampling=True, target_groups=3, max_sampling_rounds=3)
    policy0 = copy.deepcopy(model)
    m = grpo_iteration(model, ref, opt, None, rounds[0], **kw)
    assert m["dyn_groups_kept"] == 3
    kept = [(0, 0), (1, 1), (1, 2)]
    num_pol = num_kl = 0.0
    n_tok = 0.0
    for r, k in kept:
        rows = torch.arange(G * k, G * k + G)
        ro = seen[r]
        sub = Rollout(prompt_ids=ro.prompt_ids[rows], prompt_mask=ro.prompt_mask[rows],
                      response_ids=ro.response_ids[rows], response_mask=ro.response_mask[rows],
                      sampler_logprobs=ro.sampler_logprobs[rows], seconds=0.0)
        with torch.no_grad():
            logp = learner_logprobs(policy0, sub)
            ref_logp = learner_logprobs(ref, sub)
        rewards = torch.tensor([float(j % 2 == 1) for j in range(G)])  # the hand-made pattern: 0, 1, 0, 1
        adv = grpo.group_advantages(rewards, G, delta=cfg.delta)
        _, st = grpo.grpo_loss(logp, logp, ref_logp, sub.sampler_logprobs, adv, sub.response_mask,
                               eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
                               tis_cap=cfg.tis_cap, beta=cfg.beta)
        t = float(sub.response_mask.sum())
        num_pol += st["policy_loss"] * t
        num_kl += st["kl_ref_k3"] * t
        n_tok += t
    assert m["n_tokens"] == n_tok
    assert m["policy_loss"] == pytest.approx(num_pol / n_tok, rel=1e-4, abs=1e-6)
    assert m["kl_ref_k3"] == pytest.approx(num_kl / n_tok, rel=1e-4, abs=1e-9)
    assert m["loss"] == pytest.approx((num_pol + cfg.beta * num_kl) / n_tok, rel=1e-4, abs=1e-6)
    assert m["policy_loss"] != 0  # mixed groups: a real policy term was compared


def _plain_vs_dynamic(dynamic: bool):
    model, ref, opt, cfg, rounds, seen, kw = _setup([[True, True, True]], dynamic_sampling=dynamic)
    hist = [grpo_iteration(model, ref, opt, None, rounds[0], **kw)]
    return hist, [p.detach().clone() for p in model.parameters()]


def test_all_informative_first_round_is_the_plain_iteration_bit_for_bit():
    """Every group informative at once and target = prompts: dynamic sampling must be plain GRPO exactly."""
    (h0,), p0 = _plain_vs_dynamic(False)
    (h1,), p1 = _plain_vs_dynamic(True)
    assert h1["dyn_sampling_rounds"] == 1 and h1["dyn_groups_kept"] == 3
    assert not any(k.startswith("dyn_") for k in h0)  # off: the history has exactly the old keys
    for k, v in h0.items():
        if not k.endswith("seconds"):
            assert h1[k] == v, k
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))


def test_off_is_deterministic_and_ignores_more_problems():
    """Option off: the same seed gives the same history, with or without a more_problems callable."""
    runs = []
    for give_more in (True, False):
        model, ref, opt, cfg, rounds, seen, kw = _setup([[False, True, False], [True, True, True]])
        if not give_more:
            kw.pop("more_problems")
        m = grpo_iteration(model, ref, opt, None, rounds[0], **kw)
        assert len(seen) == 1 and all(p.calls == 0 for p in rounds[1])
        runs.append(({k: v for k, v in m.items() if not k.endswith("seconds")},
                     [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_bad_config():
    with pytest.raises(ValueError, match="target_groups"):
        GRPOConfig(target_groups=3)
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        GRPOConfig(dynamic_sampling=True, max_sampling_rounds=0)
    with pytest.raises(ValueError, match="target_groups"):
        GRPOConfig(dynamic_sampling=True, target_groups=0)
    model, ref, opt, cfg, rounds, seen, kw = _setup([[True, False]], dynamic_sampling=True)
    kw.pop("more_problems")
    with pytest.raises(ValueError, match="more_problems"):
        grpo_iteration(model, ref, opt, None, rounds[0], **kw)
