"""Tests of kvlib.analysis.tasks: determinism, needle placement, lengths, scoring, generation plumbing."""

from __future__ import annotations

import re

import pytest

from kvlib.analysis.tasks import (
    TASK_KINDS,
    Prefill,
    RetrievalTask,
    approx_token_count,
    count_tokens,
    decode_from_prefill,
    extract_numbers,
    first_number_done,
    make_task,
    make_tasks,
    prefill_exact,
    run_tasks,
    score,
)


class CharTokenizer:
    """A stand-in tokenizer: one token per character, ChatML-like template."""

    chat_template = "chatml"
    name_or_path = "char"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return body + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("kind", TASK_KINDS)
def test_same_seed_same_task_and_slices_differ(kind: str) -> None:
    a = make_task(kind, length=600, seed=3, index=5)
    b = make_task(kind, length=600, seed=3, index=5)
    assert a == b
    assert make_task(kind, length=600, seed=4, index=5).answers != a.answers
    slice0 = make_tasks(kind, 6, length=600, seed=3)
    slice1 = make_tasks(kind, 6, length=600, seed=3, start=6)
    assert slice0[5] == a
    ids0, ids1 = {t.task_id for t in slice0}, {t.task_id for t in slice1}
    assert len(ids0) == 6 and not ids0 & ids1
    assert len({t.answers for t in slice0 + slice1}) == 12


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("length", [512, 2048, 8192])
def test_answers_occur_exactly_once_and_filler_has_no_digits(kind: str, length: int) -> None:
    task = make_task(kind, length=length, seed=1, index=2)
    for ans in task.answers:
        assert len(re.findall(rf"(?<!\d){ans}(?!\d)", task.context)) == 1
        assert task.context.count(ans) == 1
    numbers = extract_numbers(task.context)
    assert sorted(numbers) == sorted(set(numbers))  # needle values are distinct
    n_expected = {"passkey": 1, "kv": 4, "multineedle": 3}[kind]
    assert len(numbers) == n_expected
    if kind == "kv":
        assert task.context.count(task.key) == 1  # the asked key appears once
    if kind == "multineedle":
        assert task.context.count(task.key) == len(task.answers)


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_requested_depth(kind: str, depth: float) -> None:
    task = make_task(kind, length=4096, seed=0, index=1, depth=depth)
    pos = task.context.index(task.answers[0]) / len(task.context)
    assert pos == pytest.approx(depth, abs=0.03)
    assert task.depths[0] == pytest.approx(depth, abs=0.01)


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("length", [512, 1024, 4096, 8192])
def test_lengths_within_tolerance_word_estimate(kind: str, length: int) -> None:
    task = make_task(kind, length=length, seed=2)
    measured = approx_token_count(task.prompt())
    assert measured == task.n_tokens
    assert length - 40 <= measured <= length


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_lengths_and_template_with_tokenizer(kind: str) -> None:
    tok = CharTokenizer()
    task = make_task(kind, length=3000, seed=0, tokenizer=tok)
    prompt = task.prompt(tok)
    assert prompt.startswith("<|im_start|>user\n")
    assert prompt.endswith("<|im_start|>assistant\n" + task.answer_prefix)
    assert count_tokens(prompt, tok) == task.n_tokens == len(prompt)
    assert 3000 - 120 <= task.n_tokens <= 3000  # within one filler sentence
    assert task.tokenizer_name == "char"


def test_depth_is_random_but_in_range_when_not_given() -> None:
    depths = [make_task("passkey", length=1024, index=i).depths[0] for i in range(20)]
    assert all(0.0 <= d <= 1.0 for d in depths)
    assert len({round(d, 3) for d in depths}) > 5


def test_filler_choice_and_options() -> None:
    rep = make_task("kv", length=700, filler="repeat", n_keys=6, digits=7)
    assert "The grass is green." in rep.context
    assert len(extract_numbers(rep.context)) == 6
    assert all(len(a) == 7 for a in rep.answers)
    essay = make_task("passkey", length=700, filler="essay")
    assert "The grass is green." not in essay.context


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"kind": "needle", "length": 512}, ValueError, "kind"),
        ({"kind": "kv", "length": 8}, ValueError, "length"),
        ({"kind": "kv", "length": 40}, ValueError, "too short"),
        ({"kind": "kv", "length": 512.0}, TypeError, "length"),
        ({"kind": "kv", "length": 512, "depth": 1.5}, ValueError, "depth"),
        ({"kind": "kv", "length": 512, "n_keys": 0}, ValueError, "n_keys"),
        ({"kind": "kv", "length": 512, "filler": "lorem"}, ValueError, "filler"),
        ({"kind": "kv", "length": 512, "seed": -1}, ValueError, "seed"),
    ],
)
def test_make_task_rejects_bad_input(kwargs: dict, exc: type, match: str) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(exc, match=match):
        make_task(kind, **kwargs)


# ----------------------------------------------------------------------------- scoring
def _task(answers: tuple[str, ...]) -> RetrievalTask:
    return RetrievalTask(
        kind="passkey" if len(answers) == 1 else "multineedle",
        length=100,
        seed=0,
        index=0,
        instruction="",
        context="",
        question="",
        answer_prefix="",
        answers=answers,
        depths=(0.5,) * len(answers),
        n_tokens=0,
    )


@pytest.mark.parametrize(
    "output,expected",
    [
        (" 71432.", 1),
        (" 71432", 1),
        ("71432. Remember it.", 1),
        (" 71433.", 0),
        (" 714320", 0),
        (" 7143", 0),
        (" unknown", 0),
        ("", 0),
        (" 12345, no wait, 71432", 0),
    ],
)
def test_score_single_answer(output: str, expected: int) -> None:
    assert score(_task(("71432",)), output) == expected


@pytest.mark.parametrize(
    "output,expected",
    [
        (" 111111, 222222, and 333333.", 1),
        (" 333333, 111111, 222222", 1),
        (" 111111, 111111, 222222, 333333", 1),  # repeats are not new answers
        (" 111111, 222222.", 0),
        (" 111111, 999999, 222222, 333333", 0),
        (" none", 0),
    ],
)
def test_score_multi_needle(output: str, expected: int) -> None:
    assert score(_task(("111111", "222222", "333333")), output) == expected


def test_score_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="task"):
        score("71432", "71432")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text"):
        extract_numbers(71432)  # type: ignore[arg-type]


def test_answer_in_context_scores_one_when_echoed() -> None:
    for kind in TASK_KINDS:
        task = make_task(kind, length=512, seed=9)
        assert score(task, " " + ", ".join(task.answers) + ".") == 1


# ----------------------------------------------------------------------------- plumbing
def test_run_tasks_on_tiny_random_model() -> None:
    """Generation plumbing on a tiny random Llama (answers are garbage; records are not)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    class TinyTok(CharTokenizer):
        def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
            ids = torch.tensor([[ord(c) % 120 for c in text]])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(48 + int(i) % 10) for i in ids)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    tok = TinyTok()
    tasks = make_tasks("passkey", 2, length=600, tokenizer=tok)
    recs = run_tasks(model, tok, tasks, max_new_tokens=4)
    assert [r["task_id"] for r in recs] == [t.task_id for t in tasks]
    for r, t in zip(recs, tasks, strict=True):
        assert r["correct"] == score(t, r["output"])
        assert r["answer"] == t.answer and r["n_tokens"] == t.n_tokens
        assert len(r["output"]) == 4  # greedy, no eos in 4 steps of this random model
    # a fresh cache per prompt, inspected after each; same greedy outputs as the default cache
    caches = []

    def factory():
        caches.append(transformers.DynamicCache(config=cfg))
        return caches[-1]

    def inspect(cache):
        return {"cached_tokens": cache.get_seq_length()}

    recs2 = run_tasks(model, tok, tasks, max_new_tokens=4, cache_factory=factory, inspect_cache=inspect)
    assert len(caches) == 2 and caches[0] is not caches[1]
    assert [r["output"] for r in recs2] == [r["output"] for r in recs]
    for r, t in zip(recs2, tasks, strict=True):
        assert r["cached_tokens"] == t.n_tokens + 3  # prompt + all but the last new token
    with pytest.raises(ValueError, match="cache_factory"):
        run_tasks(model, tok, tasks, inspect_cache=inspect)


def test_real_tokenizer_lengths_and_template() -> None:
    """With the shipped SmolLM2 tokenizer: chat template used, prompt length within bounds."""
    from kvlib.hf import model as kvmodel

    if not kvmodel.model_available():
        pytest.skip("shipped model not installed")
    from transformers import AutoTokenizer

    path = kvmodel.model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for kind, length in (("passkey", 512), ("kv", 2048), ("multineedle", 8192)):
        task = make_task(kind, length=length, seed=0, tokenizer=tok)
        prompt = task.prompt(tok)
        assert "<|im_start|>assistant\n" in prompt
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert n == task.n_tokens
        assert length - 40 <= n <= length


# ----------------------------------------------------------------------------- shared exact prefill
def _tiny():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    class TinyTok(CharTokenizer):
        eos_token_id = None

        def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
            ids = torch.tensor([[ord(c) % 120 for c in text]])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(48 + int(i) % 10) if int(i) % 3 else "." for i in ids)

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return transformers.LlamaForCausalLM(cfg).eval(), TinyTok(), transformers


def test_decode_from_prefill_matches_generate_with_full_cache() -> None:
    """Shared prefill + a fresh exact cache reproduces plain greedy generation, row by row."""
    model, tok, transformers = _tiny()
    tasks = make_tasks("passkey", 3, length=600, tokenizer=tok)
    assert len({t.n_tokens for t in tasks}) == 1  # passkey prompts of one length share a batch
    pf = prefill_exact(model, tok, tasks)
    assert isinstance(pf, Prefill) and pf.n_rows == 3 and pf.prompt_len == tasks[0].n_tokens
    assert pf.kv[0][0].shape[-2] == pf.prompt_len - 1  # every prompt token but the last
    outs = decode_from_prefill(model, tok, pf, transformers.DynamicCache(config=model.config), max_new_tokens=5,
                               stop_early=False)
    want = [r["output"] for r in run_tasks(model, tok, tasks, max_new_tokens=5)]
    assert outs == want
    sub = pf.rows([2, 0])
    assert [t.task_id for t in sub.tasks] == [tasks[2].task_id, tasks[0].task_id]
    outs_sub = decode_from_prefill(model, tok, sub, transformers.DynamicCache(config=model.config),
                                   max_new_tokens=5, stop_early=False)
    assert outs_sub == [want[2], want[0]]


def test_stop_early_keeps_the_score() -> None:
    model, tok, transformers = _tiny()
    tasks = make_tasks("passkey", 2, length=600, tokenizer=tok)
    pf = prefill_exact(model, tok, tasks)
    full = decode_from_prefill(model, tok, pf, transformers.DynamicCache(config=model.config), max_new_tokens=12,
                               stop_early=False)
    short = decode_from_prefill(model, tok, pf, transformers.DynamicCache(config=model.config), max_new_tokens=12)
    for t, f, s_ in zip(tasks, full, short, strict=True):
        assert f.startswith(s_)
        assert score(t, f) == score(t, s_)
        assert first_number_done(s_) or s_ == f


def test_prefill_rejects_mixed_lengths_and_bad_input() -> None:
    model, tok, transformers = _tiny()
    a = make_task("passkey", length=600, tokenizer=tok)
    b = make_task("passkey", length=500, tokenizer=tok)
    with pytest.raises(ValueError, match="one token length"):
        prefill_exact(model, tok, [a, b])
    with pytest.raises(ValueError, match="empty"):
        prefill_exact(model, tok, [])
    with pytest.raises(TypeError, match="RetrievalTask"):
        prefill_exact(model, tok, ["x"])
    pf = prefill_exact(model, tok, [a])
    cache = transformers.DynamicCache(config=model.config)
    decode_from_prefill(model, tok, pf, cache, max_new_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        decode_from_prefill(model, tok, pf, cache)
    with pytest.raises(TypeError, match="Prefill"):
        decode_from_prefill(model, tok, [a], transformers.DynamicCache(config=model.config))


@pytest.mark.parametrize(("text", "done"), [(" 123", False), (" 123.", True), ("", False), (" 12 3", True)])
def test_first_number_done(text: str, done: bool) -> None:
    assert first_number_done(text) is done
