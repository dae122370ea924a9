"""The on-the-fly arithmetic task: deterministic splits, true answers, a robust boxed-answer reward."""

import re

import pytest
import torch

from kvlib.rl import task


def _evaluate(question: str) -> int:
    """Re-derive the answer from the question text alone (independent of the generator's arithmetic)."""
    value = int(re.match(r"Start with (-?\d+)\.", question).group(1))
    for op, a in re.findall(r"(Add|Subtract|Multiply the result by) (\d+)\.", question):
        a = int(a)
        value = value + a if op == "Add" else value - a if op == "Subtract" else value * a
    return value


def test_problems_deterministic_true_and_split_disjoint():
    a = task.make_problems("train", 50, seed=3)
    assert a == task.make_problems("train", 50, seed=3)
    assert a != task.make_problems("train", 50, seed=4)
    held = task.make_problems("heldout", 50, seed=3)
    assert not {p.question for p in a} & {p.question for p in held}
    assert all(task.split_of(p.question) == "heldout" for p in held)
    for p in a + held:
        assert p.answer == _evaluate(p.question)
        assert task.DIFFICULTY["min_steps"] <= p.steps <= task.DIFFICULTY["max_steps"]
        assert len(re.findall(r"(Add|Subtract|Multiply)", p.question)) == p.steps
        assert abs(p.answer) <= task.DIFFICULTY["max_abs"]
    assert len({p.uid for p in a}) == 50


def test_worked_solutions_earn_reward_and_wrong_ones_do_not():
    for p in task.make_problems("train", 40, seed=5, min_steps=1, max_steps=12):
        sol = task.worked_solution(p)
        assert task.reward(sol, p.answer) == 1.0
        assert sol.count("Step ") == p.steps
        assert task.reward(sol.replace(f"boxed{{{p.answer}}}", f"boxed{{{p.answer + 1}}}"), p.answer) == 0.0
    with pytest.raises(ValueError, match="ops"):
        task.worked_solution(task.Problem(uid="x", question="q", answer=1, steps=1))


def test_problems_bad_input():
    with pytest.raises(ValueError, match="split"):
        task.make_problems("test", 1)
    with pytest.raises(ValueError, match="min_steps"):
        task.make_problems("train", 1, min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="cannot draw"):  # only a handful of distinct 1-step chains exist
        task.make_problems("heldout", 500, min_steps=1, max_steps=1, max_operand=2, max_abs=3)


@pytest.mark.parametrize("text,answer,want", [
    ("so the answer is \\boxed{42}.", 42, 1.0),
    ("\\boxed{ -17 }", -17, 1.0),
    ("\\boxed{$1,234$}", 1234, 1.0),
    ("\\boxed{\\text{12}}", 12, 1.0),
    ("\\boxed{x = 12}", 12, 1.0),
    ("\\boxed{12.0}", 12, 1.0),
    ("\\boxed{\u22125}", -5, 1.0),
    ("\\boxed {7}", 7, 1.0),
    ("first \\boxed{3}, then corrected: \\boxed{5}", 5, 1.0),   # the last box counts
    ("first \\boxed{5}, then \\boxed{3}", 5, 0.0),
    ("\\boxed{{9}}", 9, 1.0),                                   # nested braces balanced
    ("the answer is 42", 42, 0.0),                              # no box
    ("\\boxed{42", 42, 0.0),                                    # unclosed
    ("\\boxed{}", 0, 0.0),
    ("\\boxed{12.5}", 12, 0.0),
    ("\\boxed{4 2}", 42, 0.0),
    ("\\boxed{- 5}", -5, 1.0),
    ("\\boxed{42 apples}", 42, 0.0),
    ("\\boxed{1/2}", 0, 0.0),
])
def test_reward_parser(text, answer, want):
    assert task.reward(text, answer) == want


def test_last_boxed_skips_unclosed_final_box():
    assert task.last_boxed("\\boxed{8} and \\boxed{9") == "8"
    assert task.last_boxed("\\fbox{3}") == "3"
    with pytest.raises(TypeError):
        task.reward("\\boxed{1}", "1")


def test_chat_prompt_and_short_real_rollout(smol):
    """The one SmolLM2 test: chat template wraps the problem; a short real rollout through sample()."""
    from transformers import DynamicCache

    from kvlib.rl.sampler import learner_logprobs, sample

    model, tok = smol
    p = task.make_problems("heldout", 1, seed=0, min_steps=1, max_steps=1)[0]
    bare = task.format_prompt(tok, p)
    assert p.question in bare and task.INSTRUCTION in bare
    assert bare.rstrip().endswith("assistant")  # generation prompt appended
    prompt = task.prompt_fn()(tok, p)  # the runs' prompt: worked examples as earlier turns, same ending
    shots = task.fewshot_examples(task.DEFAULT_SHOTS)
    assert prompt.endswith(bare[bare.index(p.question) - len("<|im_start|>user\n"):])
    assert all(task.worked_solution(ex) in prompt for ex in shots)
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) > 700  # the probe's context regime
    r = sample(model, tok, [prompt], cache_factory=lambda b: DynamicCache(config=model.config), max_new_tokens=6,
               generator=torch.Generator().manual_seed(0))
    assert r.response_ids.shape[1] <= 6 and len(r.texts) == 1
    with torch.no_grad():
        lp = learner_logprobs(model, r)
    m = r.response_mask.bool()
    assert (lp[m] - r.sampler_logprobs[m]).abs().max() < 1e-4


def test_ops_restrict_the_chain_and_bad_ops_raise():
    probs = task.make_problems("train", 60, seed=2, min_steps=1, max_steps=2, max_operand=9, max_abs=999, ops="add")
    assert all(op == "add" for p in probs for op, _ in p.ops)
    assert all("Subtract" not in p.question and "Multiply" not in p.question for p in probs)
    assert all(task.reward(task.worked_solution(p), p.answer) == 1.0 for p in probs)
    mixed = task.make_problems("train", 60, seed=2, min_steps=1, max_steps=2, max_operand=9, max_abs=999,
                               ops="add,sub")
    assert {op for p in mixed for op, _ in p.ops} == {"add", "sub"}
    with pytest.raises(ValueError, match="ops"):
        task.make_problems("train", 1, ops="div")
