"""KV concentration from engine traces (kvlib.rollout.engine_trace), and the trace's own accounting."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.rl.collect import collect_frozen
from kvlib.rl.pool import plan_pool
from kvlib.rollout import engine_trace as et
from kvlib.rollout.theory import concentration


def _row(interval, batch, ctx):
    return {"interval": interval, "batch": batch, "context_sum": ctx, "carried_context_sum": 0, "pages_used": 1,
            "seconds": 0.0}


def test_summary_and_ratio_on_a_known_trace():
    sync = [_row(0, 4, 40), _row(0, 2, 30), _row(1, 4, 40), _row(1, 2, 30)]
    asyn = [_row(0, 4, 80), _row(1, 4, 60)]
    s = et.trace_summary(sync, kappa=2.0)
    assert s["mean_batch"] == 3.0 and s["mean_volume"] == 70.0 and s["mean_context"] == 70 / 6
    assert s["mean_context_step"] == (10 + 15) / 2
    r = et.concentration_ratio(asyn, sync, reps=200)
    assert r["c_kv"] == pytest.approx(70 / 35) and r["batch_ratio"] == pytest.approx(4 / 3)
    lo, hi = r["c_kv_ci"]
    assert lo <= r["c_kv"] <= hi and hi - lo > 0  # the async intervals differ: the bootstrap sees it
    same = et.concentration_ratio(sync, sync, reps=200)
    assert same["c_kv"] == 1.0 and same["c_kv_ci"] == (1.0, 1.0)
    assert et.trace_summary(sync, warmup=1)["decode_calls"] == 2
    with pytest.raises(ValueError, match="warmup"):
        et.trace_summary(sync, warmup=2)
    with pytest.raises(ValueError, match="empty"):
        et.trace_summary([])


def test_decode_law_and_closed_forms():
    law = et.decode_law([1, 3, 3, 5])
    assert law.lengths.tolist() == [0, 2, 4] and law.probs.tolist() == [0.25, 0.5, 0.25]
    cf = et.closed_forms([3, 5, 7, 3], [10, 20, 30, 20], B=8)
    want = concentration(et.decode_law([3, 5, 7, 3]), 8, P=21.0)
    assert cf["c_kv"] == want.concentration_factor and cf["P"] == 21.0
    assert et.closed_forms([6] * 10, [10] * 10, B=4)["c_kv"] == 1.0  # one length: nothing to concentrate
    with pytest.raises(ValueError, match="lengths"):
        et.decode_law([0, 3])


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    m.config._attn_implementation = "sdpa"
    return m


def _problem(gid):
    g = torch.Generator().manual_seed(gid)
    return torch.randint(3, 32, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()


@pytest.mark.parametrize("synchronous,budget", [(True, 4_000_000), (False, 4_000_000), (False, 30_000)])
def test_trace_accounts_for_every_decode_call(synchronous, budget):
    """Summed over decode calls, the trace's resident context is exactly sum_i sum_g (P_i + g) over the tokens g
    that decode calls sampled (the paper's Q(P, L) accounting; the tokens sampled from a prefill's logits, first
    ones and those after a re-prefill, take no decode call), with carried prefixes and, at the small budget,
    preemptions."""
    model = _tiny()
    probe = plan_pool("fp32", model.config, budget_bytes=10**7, slots=8, staging=2, max_context=64, block_size=8)
    budget = budget if budget > 10**6 else probe.table_bytes + 13 * probe.page_bytes
    plan = plan_pool("fp32", model.config, budget_bytes=budget, slots=8, staging=2, max_context=64, block_size=8)
    col = collect_frozen(model, plan, _problem, lambda p: p, eos_token_id=2, T=2, G=4, max_new_tokens=48, updates=4,
                         synchronous=synchronous, beta=1.0, eta=3, seed=1, prefill_tokens=64)
    tr = col.engine.trace
    want = calls = 0
    for g in col.groups:
        for r in g.responses:
            dec = [i for i in range(len(r.tokens)) if i not in r.prefill_sampled]
            want += sum(len(r.prompt_ids) + i for i in dec)
            calls += len(dec)
    assert sum(x["context_sum"] for x in tr) == want
    assert sum(x["batch"] for x in tr) == calls
    if not synchronous:
        assert any(len(r.prefill_sampled) > 1 for g in col.groups for r in g.responses)  # re-prefilled prefixes
    if budget < 10**6:
        assert sum(x["preempted"] for x in tr) > 0


def test_simulator_on_the_engine_law_runs_both_schedules():
    lengths = np.r_[np.full(30, 5), np.full(10, 40)]
    out = et.simulate_like(lengths, [10] * 40, pages=400, page_size=8, slots=8, T=2, G=4, beta=1.0, eta=3,
                           updates=8, warmup=2)
    assert out["P"] == 11 and out["c_kv"] > 1.0
    assert out["async"]["mean_batch"] > out["sync"]["mean_batch"]
    assert out["sync"]["carried_fraction"] == 0.0
