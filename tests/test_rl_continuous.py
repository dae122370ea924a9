"""The continuous-batching engine (kvlib.rl.pool, kvlib.rl.continuous): pages, admission, decode, invariants."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvlib.rl.continuous import ContinuousEngine, Request, default_buckets, sample_tokens, sampler_uniforms
from kvlib.rl.engine import sample_static
from kvlib.rl.pool import PagedKV, plan_pool

EOS, PAD, V = 2, 0, 64


def _tiny(head_dim: int = 32, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    model.config._attn_implementation = "sdpa"
    return model


def _prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def _engine(model, fmt="fp32", *, slots=4, staging=2, budget=4_000_000, max_context=96, block_size=8, opts=None,
            **kw):
    plan = plan_pool(fmt, model.config, budget_bytes=budget, slots=slots, staging=staging, max_context=max_context,
                     block_size=block_size, **(opts or {}))
    return ContinuousEngine(model, plan, eos_token_id=EOS, **kw)


def _run(eng, reqs):
    eng.submit(reqs)
    while not eng.idle:
        eng.step()
        eng.check()  # rows, pages, lengths consistent after every step (no leak, no stale table entry)
    eng.check()
    assert eng.kv.free_pages == eng.plan.pages  # every page back
    return reqs


# -- the pool plan ------------------------------------------------------------------------------------
def test_plan_measures_the_backend_and_lower_bits_admit_more():
    model = _tiny(64)
    budget = 64 * 2**20
    plans = {f: plan_pool(f, model.config, budget_bytes=budget, slots=256, max_context=1024, block_size=16,
                          **({"sink": 4, "recent": 16} if f == "kv4rl" else {}))
             for f in ("bf16", "dither-int8", "kv4", "kv4rl")}
    L, H, d = 2, 2, 64
    assert plans["bf16"].page_bytes == 16 * L * 2 * H * d * 2  # bf16 K and V
    assert plans["kv4"].page_bytes == 16 * L * 2 * H * (d // 2 + 4)  # nibbles + fp16 scale and offset
    assert plans["kv4rl"].row_bytes == 2 * L * H * ((4 + 16) * (d + 2) + (d + 2))  # side buffer + 1-entry stash
    for p in plans.values():
        assert p.allocated_bytes <= budget < p.allocated_bytes + p.page_bytes  # the budget, cut to whole pages
        kv = PagedKV(p, "cpu")
        assert kv.backend.nbytes() + p.table_bytes == p.allocated_bytes
    pos = {f: p.positions for f, p in plans.items()}
    assert pos["bf16"] < pos["dither-int8"] < pos["kv4rl"] < pos["kv4"]
    conc = {f: p.concurrency_at(1024) for f, p in plans.items()}  # requests of 1,024 positions in flight
    assert conc["bf16"] == 64 - 1 and conc["bf16"] < conc["dither-int8"] < conc["kv4rl"] < conc["kv4"] <= 256


def test_plan_refuses_what_it_cannot_do():
    model = _tiny()
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_pool("bf16", model.config, budget_bytes=10_000, slots=4, max_context=512)
    with pytest.raises(ValueError, match="no paged kernel backend"):
        plan_pool("kivi2", model.config, budget_bytes=10**7, slots=4, max_context=64)
    with pytest.raises(TypeError, match="fmt"):
        plan_pool(3, model.config, budget_bytes=10**7, slots=4, max_context=64)
    with pytest.raises(ValueError, match="slots"):
        plan_pool("bf16", model.config, budget_bytes=10**7, slots=0, max_context=64)


# -- decoding -----------------------------------------------------------------------------------------
def test_greedy_equals_generate_under_continuous_refill_and_chunked_prefill():
    """fp32 pages (exact): every request's tokens equal HF generate's, though requests join and leave the batch,
    prefill is cut into chunks of 7 tokens across arrivals, and rows move as others retire."""
    model = _tiny()
    prompts = _prompts(9)
    eng = _engine(model, greedy=True, prefill_tokens=7, slots=3)
    reqs = _run(eng, [Request(i, p, 24) for i, p in enumerate(prompts)])
    assert max(x["batch"] for x in eng.trace) == 3 and any(x["admitted"] for x in eng.trace[3:])
    assert any(p["rows"] > 1 for p in eng.prefills) and max(p["tokens"] for p in eng.prefills) <= 7
    for r in reqs:
        ids = torch.tensor([r.prompt_ids])
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 past_key_values=DynamicCache(config=model.config), max_new_tokens=24,
                                 eos_token_id=EOS, pad_token_id=PAD)[0, ids.shape[1]:].tolist()
        assert r.tokens == ref[:len(r.tokens)] and (r.finish == "eos") == (EOS in ref)


@pytest.mark.parametrize("fmt,opts", [("kv4", {}), ("kv4rl", {"sink": 2, "recent": 6}), ("dither-int8", {})])
def test_quantized_pools_decode_as_the_static_engine(fmt, opts):
    """With one prefill chunk per request, the engine's semantics are the static engine's (float prompt, then each
    step over the pool): same greedy tokens, log-probs equal up to the dither of different slots."""
    model = _tiny()
    prompts = _prompts(6)
    eng = _engine(model, fmt, opts=opts, greedy=True, prefill_tokens=256)
    reqs = _run(eng, [Request(i, p, 20) for i, p in enumerate(prompts)])
    ref = sample_static(model, None, prompts, fmt=fmt, max_new_tokens=20, generator=None, greedy=True,
                        eos_token_id=EOS, pad_token_id=PAD, cache_options=dict(block_size=8, **opts))
    # dithered codes depend on their slot, and the two engines place positions in different slots
    tol = 5e-3 if fmt == "dither-int8" else 1e-5
    for i, r in enumerate(reqs):
        n = int(ref.response_mask[i].sum())
        assert r.tokens == ref.response_ids[i, :n].tolist()
        torch.testing.assert_close(torch.tensor(r.logprobs), ref.sampler_logprobs[i, :n], atol=tol, rtol=0)
    if fmt == "dither-int8":
        assert all(x["cert_n"] == x["batch"] * 2 * 4 for x in eng.trace)  # every (layer, query head, live row)
        assert all(0 <= x["cert_coverage"] <= 1 for x in eng.trace)
    else:
        assert all(math.isnan(x["cert_coverage"]) for x in eng.trace)


def test_a_requests_tokens_do_not_depend_on_its_batch():
    """Sampling draws from Philox at (request id, token index): one slot or four, the same responses."""
    model = _tiny()
    prompts = _prompts(6, seed=3)
    runs = []
    for slots in (1, 4):
        eng = _engine(model, slots=slots, seed=11, prefill_tokens=32)
        runs.append(_run(eng, [Request(i, p, 16) for i, p in enumerate(prompts)]))
    for a, b in zip(*runs):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_sampler_draws_from_the_softmax():
    """Inverse CDF at Philox uniforms: 40,000 draws from a fixed 8-way law pass a chi-square test, and the recorded
    log-prob is log_softmax of the drawn token."""
    from scipy import stats

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0, 1.5, -0.5]])
    n = 40_000
    u = sampler_uniforms(7, torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert 0 < float(u.min()) and float(u.max()) < 1
    tok, lp = sample_tokens(logits.expand(n, -1), u)
    p = torch.softmax(logits[0].double(), 0)
    counts = torch.bincount(tok, minlength=8).double()
    assert stats.chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3
    torch.testing.assert_close(lp, torch.log_softmax(logits[0], 0)[tok])
    assert torch.equal(sampler_uniforms(7, torch.arange(5), torch.zeros(5, dtype=torch.int64)), u[:5])
    assert not torch.equal(sampler_uniforms(8, torch.arange(5), torch.zeros(5, dtype=torch.int64)), u[:5])


def test_preemption_under_a_tight_budget_loses_nothing():
    """A pool of a few pages: decode steps run out, the newest admissions are preempted and re-prefilled later;
    every request ends with the tokens of an unconstrained run."""
    model = _tiny()
    prompts = _prompts(6, lo=10, hi=16)
    loose = _run(_engine(model, greedy=True, prefill_tokens=64), [Request(i, p, 40) for i, p in enumerate(prompts)])
    probe = plan_pool("fp32", model.config, budget_bytes=10**7, slots=4, staging=2, max_context=64, block_size=8)
    budget = probe.table_bytes + 13 * probe.page_bytes  # 12 pages + the null page: 4 requests need up to 28
    eng = _engine(model, greedy=True, prefill_tokens=64, budget=budget, max_context=64, watermark=0.0)
    assert eng.plan.pages == 12
    tight = _run(eng, [Request(i, p, 40) for i, p in enumerate(prompts)])
    assert sum(x["preempted"] for x in eng.trace) > 0 and max(x["pages_used"] for x in eng.trace) <= 12
    assert sum(r.preemptions for r in tight) == sum(x["preempted"] for x in eng.trace)
    for a, b in zip(loose, tight):
        assert a.tokens == b.tokens and a.finish == b.finish
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_decode_step_is_capturable_on_the_kernel_path():
    """Under the Triton interpreter the decode kernels run on CPU tensors: the step then does no host read and no
    data-dependent shape (what a CUDA graph forbids), while the reference path does both; and the step's inputs are
    the same tensors, of a shape set by the bucket only, whatever requests are in flight."""
    hits: list[str] = []

    class Detect(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal"):
                hits.append(name)
            return func(*args, **(kwargs or {}))

    model = _tiny(64)
    # kernel paths (bf16, kv4rl), then kv4rl's reference path, which must trip the detector (it is able to fail)
    for fmt, interpret in (("bf16", True), ("kv4rl", True), ("kv4rl", False)):
        eng = _engine(model, fmt, opts={"sink": 2, "recent": 6} if fmt == "kv4rl" else {}, greedy=True,
                      block_size=16, interpret=interpret, max_context=64)
        eng.submit([Request(i, p, 3) for i, p in enumerate(_prompts(2, hi=8))])
        eng.step()  # prefill, then a first decode step that finds the path
        assert eng.kernel is interpret
        B = eng.bucket(eng.n_dec)
        eng.n_live.fill_(eng.n_dec)
        eng.cache.width = 64
        hits.clear()
        with torch.no_grad(), Detect():
            eng._forward(B, eng.const_mask[:B])
        if interpret:
            assert hits == [], hits
        else:
            assert hits, "the detector must see the reference path's host reads"


def test_step_inputs_are_static_per_bucket():
    model = _tiny()
    eng = _engine(model, slots=8, staging=3, prefill_tokens=64, seed=2)
    eng.submit([Request(i, p, 12) for i, p in enumerate(_prompts(14))])
    seen: dict[int, dict] = {}
    while not eng.idle:
        eng.step()
        if eng.trace:
            B = eng.trace[-1]["bucket"]
            assert B == eng.bucket(eng.trace[-1]["batch"])
            sig = eng.step_inputs(B)
            assert seen.setdefault(B, sig) == sig
            assert all(shape[0] == B for k, (shape, _) in sig.items() if k != "n_live")
    assert len(seen) >= 2  # the batch moved between buckets
    assert default_buckets(8) == [1, 2, 4, 8] and default_buckets(6) == [1, 2, 4, 6]


def test_bad_requests_and_misuse_are_refused():
    model = _tiny()
    eng = _engine(model, max_context=32)
    with pytest.raises(ValueError, match="max_context"):
        eng.submit([Request(0, [3] * 20, 20)])
    with pytest.raises(TypeError, match="Request"):
        eng.submit([[3, 4]])
    with pytest.raises(ValueError, match="empty prompt"):
        eng.submit([Request(0, [], 4)])
    eng.submit([Request(1, [3, 4, 5], 8)])
    eng.step()
    with pytest.raises(RuntimeError, match="drain"):
        eng.weights_changed()
    out = eng.drain()
    assert [r.rid for r in out] == [1] and eng.kv.free_pages == eng.plan.pages
    eng.weights_changed()
    assert eng.version == 1
    other = _tiny(64)
    with pytest.raises(ValueError, match="plan was made"):
        ContinuousEngine(other, eng.plan, eos_token_id=EOS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the decode kernels need a GPU")
@pytest.mark.parametrize("fmt", ["bf16", "kv4rl", "dither-int8"])
def test_graph_replay_equals_eager_steps(fmt):
    """On CUDA the decode step of each bucket is captured after two eager uses and replayed: greedy tokens equal
    the eager engine's while requests join and leave (a replay reading a stale host value would diverge)."""
    model = _tiny(64, torch.bfloat16).cuda()
    out = []
    for graph in (False, True):
        plan = plan_pool(fmt, model.config, budget_bytes=64 * 2**20, slots=8, staging=2, max_context=512)
        eng = ContinuousEngine(model, plan, eos_token_id=EOS, greedy=True, graph=graph, prefill_tokens=64)
        reqs = _run(eng, [Request(i, p, 40) for i, p in enumerate(_prompts(20))])
        assert eng.kernel and eng.graphed is graph and eng.graph_error is None
        out.append([r.tokens for r in reqs])
    assert out[0] == out[1]


def test_real_smollm2_short_rollouts(smol):
    """SmolLM2-135M (fp32) on chat-templated problems: greedy tokens through the engine's bf16 and kv4rl pages equal
    the static engine's; sampled responses' recorded log-probs agree with the fp32 learner to the bf16 pool's
    rounding."""
    from kvlib.rl import task
    from kvlib.rl.collect import Group, groups_rollout
    from kvlib.rl.sampler import learner_logprobs

    model, tok = smol
    probs = task.make_problems("heldout", 2, seed=0, min_steps=1, max_steps=1)
    prompts = [tok(task.format_prompt(tok, p), add_special_tokens=False)["input_ids"] for p in probs]
    for fmt, opts in (("bf16", {}), ("kv4rl", {"sink": 4, "recent": 16})):
        plan = plan_pool(fmt, model.config, budget_bytes=64 * 2**20, slots=2, staging=2, max_context=160,
                         block_size=16, **opts)
        eng = ContinuousEngine(model, plan, eos_token_id=tok.eos_token_id, greedy=True, prefill_tokens=256)
        reqs = _run(eng, [Request(i, p, 6) for i, p in enumerate(prompts)])
        ref = sample_static(model, tok, prompts, fmt=fmt, max_new_tokens=6, generator=None, greedy=True,
                            cache_options=dict(block_size=16, **opts))
        for i, r in enumerate(reqs):
            n = int(ref.response_mask[i].sum())
            assert r.tokens == ref.response_ids[i, :n].tolist()
    eng = ContinuousEngine(model, plan_pool("bf16", model.config, budget_bytes=64 * 2**20, slots=3, staging=3,
                                            max_context=160), eos_token_id=tok.eos_token_id, seed=3)
    reqs = _run(eng, [Request(i, p, 6) for i, p in enumerate(prompts)])
    roll = groups_rollout([Group(0, None, 0, reqs)], pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        lp = learner_logprobs(model, roll)
    m = roll.response_mask.bool()
    assert (lp[m] - roll.sampler_logprobs[m]).abs().max() < 0.05  # bf16 K/V against the fp32 learner


def test_chunked_prefill_reads_each_rows_own_side_buffer():
    """kv4rl: what a later prefill chunk attends for its row's earlier positions (the pool dequantised, the side
    buffer's INT8 values where protected) is what the backend's own reader gives for that row, for a staging row
    whose index differs from its batch position."""
    model = _tiny()
    eng = _engine(model, "kv4rl", opts={"sink": 2, "recent": 4}, slots=2, staging=3, block_size=8)
    kv, st, c = eng.kv, eng.kv.backend, eng.cache
    torch.manual_seed(4)
    n, rows = 13, [3, 4]  # two staging rows, written with different vectors
    for r in rows:
        assert kv.ensure(r, n)
        k, v = torch.randn(n, 2, 32), torch.randn(n, 2, 32)
        pos = torch.arange(n)
        slots = kv.block_table[r, pos // 8].long() * 8 + pos % 8
        la = torch.zeros(kv.plan.rows, dtype=torch.int64)
        la[r] = n
        st.write(1, k, v, slots, torch.full((n,), r), pos, la)
        kv.lens[r] = n
    bt = kv.block_table[torch.tensor(rows)].long()
    p = torch.arange(n)
    c.prior_width, c.prior_slots = n, bt[:, p // 8] * 8 + p % 8
    c.prior_lens, c.rows_phys = torch.tensor([n, n]), torch.tensor(rows)
    got_k, got_v = c.prior_kv(1)
    for i, r in enumerate(rows):
        kv.move(r, 0)  # the backend's reader indexes the side buffer by batch position: read the row as row 0
        want_k, want_v = st.gather_rows(1, c.prior_slots[i:i + 1], torch.tensor([n]))
        torch.testing.assert_close(got_k[i:i + 1], want_k.to(got_k.dtype))
        torch.testing.assert_close(got_v[i:i + 1], want_v.to(got_v.dtype))
        kv.move(0, r)
    assert not torch.allclose(got_k[0], got_k[1])
