"""Quota-based partial collection on the continuous engine (kvlib.rl.collect): App. B's rules and invariants."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.rl.collect import PartialCollector, async_grpo_iteration, groups_rollout
from kvlib.rl.continuous import ContinuousEngine
from kvlib.rl.loop import GRPOConfig
from kvlib.rl.pool import plan_pool
from kvlib.rl.sampler import learner_logprobs

EOS, PAD, V = 2, 0, 64


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


PROBLEMS = [torch.randint(3, V, (int(n),), generator=torch.Generator().manual_seed(i)).tolist()
            for i, n in enumerate(torch.randint(3, 16, (400,), generator=torch.Generator().manual_seed(0)))]


def _collector(model, *, synchronous=False, beta=1.0, eta=3, T=2, G=3, slots=6, max_new=48, seed=5, fmt="fp32"):
    plan = plan_pool(fmt, model.config, budget_bytes=4_000_000, slots=slots, staging=2, max_context=80, block_size=8)
    eng = ContinuousEngine(model, plan, eos_token_id=EOS, seed=seed, prefill_tokens=64)
    return PartialCollector(eng, lambda gid: PROBLEMS[gid], lambda p: p, T=T, G=G, max_new_tokens=max_new, beta=beta,
                            eta=eta, synchronous=synchronous)


def _record(groups):
    return [(r.rid, tuple(r.tokens), tuple(r.logprobs), r.finish) for g in groups for r in g.responses]


def test_async_equals_sync_when_the_quota_holds_every_group():
    """beta = 0: the pool is the T groups of the quota, so partial collection is the synchronous schedule."""
    model = _tiny()
    a, s = _collector(model, beta=0.0), _collector(model, synchronous=True)
    for _ in range(3):
        ga, gs = a.collect(), s.collect()
        assert _record(ga) == _record(gs)
    keys = ("batch", "context_sum", "admitted", "finished")
    assert [[x[k] for k in keys] for x in a.engine.trace] == [[x[k] for k in keys] for x in s.engine.trace]
    assert all(r.carried_requests == 0 for r in a.records)


def test_partial_collection_invariants_over_updates():
    model = _tiny()
    col = _collector(model, beta=1.0, eta=2)
    trained = []
    for u in range(6):
        groups = col.collect()
        col.check()
        col.engine.check()
        assert col.engine.kv.free_pages == col.engine.plan.pages  # nothing resident between intervals
        assert len(groups) == col.T and all(g.complete and g.trained_at == u for g in groups)
        done_waiting = [g for g in col.live if g.complete]
        # the oldest complete groups train: none left waiting is older than a trained one
        assert all((g.created, g.gid) > (h.created, h.gid) for g in done_waiting for h in groups)
        assert col.records[-1].max_unfinished_age < col.eta  # the age limit held at the stop
        assert len(col.live) <= col.pool_groups
        trained += groups
    # every response ever admitted has finished or waits in a live group (with its prefix, or not yet sampled)
    for g in col.groups:
        for r in g.responses:
            assert r.done or g.trained_at is None
            assert r.admissions > 0 or not r.tokens
    assert sum(r.carried_requests for r in col.records) > 0  # prefixes did cross updates
    assert any(r.carried for g in trained for r in g.responses)
    # a carried request was re-prefilled: its prompt + tokens came back through prefill
    assert sum(r.reprefill_tokens for r in col.records) > 0


def test_recorded_logprobs_survive_an_update_and_new_tokens_use_the_new_weights():
    """A prefix crossing an update keeps its tokens and behaviour log-probs; it is re-prefilled under the new
    weights and its later tokens are scored by them (teacher-forced log-probs of the new model)."""
    model = _tiny()
    old = copy.deepcopy(model)
    col = _collector(model, beta=1.0, eta=4, max_new=48)
    col.collect()
    carried = {r.rid: (list(r.tokens), list(r.logprobs)) for g in col.live for r in g.responses
               if r.tokens and not r.done}
    assert carried, "the first interval must leave prefixes"
    with torch.no_grad():  # the update: weights change in place, the engine's version moves
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    col.engine.weights_changed()
    for _ in range(3):
        col.collect()
    checked = 0
    for g in col.groups:
        for r in g.responses:
            if r.rid not in carried or not r.done:
                continue
            toks, lps = carried[r.rid]
            n = len(toks)
            assert r.tokens[:n] == toks and r.logprobs[:n] == lps  # bit for bit
            assert r.versions[:n] == [0] * n and set(r.versions[n:]) <= {1}
            if len(r.tokens) == n:
                continue
            roll = groups_rollout([type(g)(g.gid, g.problem, g.created, [r])], pad_token_id=PAD)
            with torch.no_grad():
                new_lp = learner_logprobs(model, roll)[0, :len(r.tokens)]
                old_lp = learner_logprobs(old, roll)[0, :len(r.tokens)]
            rec = torch.tensor(r.logprobs)
            torch.testing.assert_close(rec[n:], new_lp[n:], atol=1e-4, rtol=0)  # sampled by the new weights
            torch.testing.assert_close(rec[:n], old_lp[:n], atol=1e-4, rtol=0)  # recorded under the old ones
            assert (rec[:n] - new_lp[:n]).abs().max() > 1e-3  # which differ: the update was real
            checked += 1
    assert checked > 0


def test_async_grpo_iteration_trains_on_collected_groups():
    model = _tiny()
    col = _collector(model, beta=1.0, eta=3, T=2, G=4)
    cfg = GRPOConfig(group_size=4, prompts_per_iteration=2, max_new_tokens=48, beta=0.0, lr=1e-3, tis_cap=2.0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = [p.detach().clone() for p in model.parameters()]
    # reward: responses that end before 10 tokens (so groups mix rewards)
    metrics = [async_grpo_iteration(model, None, opt, None, col, cfg=cfg, generator=torch.Generator().manual_seed(0),
                                    reward_fn=lambda toks, prob: float(len(toks) < 10), pad_token_id=PAD,
                                    eos_token_id=EOS) for _ in range(3)]
    assert col.engine.version == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(m["tis_max"] <= 2.0 + 1e-6 for m in metrics)
    assert max(m["stale_token_fraction"] for m in metrics) > 0  # carried tokens were sampled by older weights
    with pytest.raises(ValueError, match="match the collector"):
        async_grpo_iteration(model, None, opt, None, col, cfg=GRPOConfig(group_size=2, prompts_per_iteration=2),
                             generator=torch.Generator(), reward_fn=lambda *a: 0.0, pad_token_id=PAD)


def test_collector_refuses_bad_arguments():
    model = _tiny()
    eng = _collector(model).engine
    with pytest.raises(ValueError, match="beta"):
        PartialCollector(eng, lambda g: [3], lambda p: p, T=2, G=2, max_new_tokens=4, beta=-1)
    with pytest.raises(ValueError, match="T"):
        PartialCollector(eng, lambda g: [3], lambda p: p, T=0, G=2, max_new_tokens=4)
    with pytest.raises(TypeError, match="engine"):
        PartialCollector(object(), lambda g: [3], lambda p: p, T=1, G=2, max_new_tokens=4)


def test_a_group_whose_responses_end_in_one_step_counts_once():
    """Every response hits its token limit in the same decode step (equal prompts, one admission step): the stop
    rule must count each completed group once, so an interval still hands over T groups."""
    model = _tiny()
    # two staging rows: one group admitted per step, so a group ends while later ones still decode
    plan = plan_pool("fp32", model.config, budget_bytes=4_000_000, slots=8, staging=2, max_context=80, block_size=8)
    eng = ContinuousEngine(model, plan, eos_token_id=EOS, seed=5, prefill_tokens=512)
    same = [[5, 6, 7, 8]] * 50
    col = PartialCollector(eng, lambda gid: same[gid], lambda p: p, T=2, G=2, max_new_tokens=3, beta=1.0, eta=3)
    for _ in range(3):
        groups = col.collect()
        assert len(groups) == 2 and all(g.complete for g in groups)
        col.check()


def test_state_dict_continues_the_collector_exactly():
    """A collector rebuilt from dev.rlvr_async.collector_state() on a fresh engine (another process, after a
    checkpoint) hands over the same groups, tokens and recorded log-probabilities as the one that kept going."""
    from dev.rlvr_async import collector_state, forget_trained, restore_collector

    model = _tiny()
    a = _collector(model, beta=1.0, eta=2)
    for _ in range(2):
        a.collect()
        forget_trained(a)
    st = collector_state(a)
    assert any(r["tokens"] and not r["finish"] for g in st["live"] for r in g["responses"])  # prefixes carried
    b = _collector(model, beta=1.0, eta=2)
    restore_collector(b, st)
    b.check()
    for _ in range(3):
        assert _record(a.collect()) == _record(b.collect())
    assert [r.carried_requests for r in a.records] == [r.carried_requests for r in b.records]
    with pytest.raises(RuntimeError, match="fresh collector"):
        restore_collector(b, st)
    with pytest.raises(ValueError, match="collector was"):
        restore_collector(_collector(model, beta=2.0, eta=2), st)
