"""The long running-sum task (kvlib.rl.longtask): deterministic, disjoint splits, long worked solutions."""

import pytest

from kvlib.rl import longtask, task


def test_problems_are_deterministic_disjoint_and_correct():
    a = longtask.make_sum_problems("train", 20, seed=3)
    assert a == longtask.make_sum_problems("train", 20, seed=3)
    b = longtask.make_sum_problems("heldout", 20, seed=3)
    assert not {p.question for p in a} & {p.question for p in b}
    lists = longtask.make_sum_problems("train", 10, seed=3, kind="list", min_steps=6, max_steps=9)
    for p in a + b + lists:
        nums = [x for _, x in p.ops]
        assert p.answer == p.start + sum(nums) and p.steps == len(nums)
        if p in lists:
            assert p.start == 0 and 6 <= p.steps <= 9 and all(x != y for x, y in zip(nums, nums[1:]))
            assert all(1 <= x <= 9 for x in nums) and ", ".join(map(str, nums)) in p.question
        else:
            d = longtask.LONG_DIFFICULTY
            assert p.steps == d["min_steps"] and len(set(nums)) == 1
            assert d["min_operand"] <= nums[0] <= d["max_operand"] and 0 <= p.start <= 10 * d["max_operand"]
            assert f"Start with {p.start}. Add {nums[0]} to it {p.steps} times" in p.question
            assert task.split_of(p.question) == ("train" if p in a else "heldout")
        for style in longtask.STYLES:
            sol = longtask.sum_solution(p, style)
            assert sol.startswith(longtask.anchor(p).strip()) and sol.count("\nStep ") == p.steps
            assert longtask.sum_reward(sol, p) == 1.0 and longtask.step_accuracy(sol, p) == (p.steps, p.steps)
            bad = sol.replace(f"{{{p.answer}}}", f"{{{p.answer + 1}}}")
            assert longtask.sum_reward(bad, p) == 0.0
    lines = longtask.sum_solution(a[0]).split("\n")
    lines[3] = lines[3][:-1] + "1."  # step 3 writes a wrong sum (a trailing digit appended)
    assert longtask.step_accuracy("\n".join(lines), a[0]) == (a[0].steps - 1, a[0].steps)
    with pytest.raises(ValueError, match="kind"):
        longtask.make_sum_problems("train", 1, kind="mul")
    with pytest.raises(ValueError, match="split"):
        longtask.make_sum_problems("test", 1)
    with pytest.raises(ValueError, match="max_operand"):
        longtask.make_sum_problems("train", 1, kind="list", max_operand=1)
    with pytest.raises(ValueError, match="max_operand"):
        longtask.make_sum_problems("train", 1, kind="repeat", max_operand=0, min_operand=1)
    with pytest.raises(ValueError, match="max_start"):
        longtask.make_sum_problems("train", 1, kind="list", max_start=9)
    with pytest.raises(ValueError, match="max_start"):
        longtask.make_sum_problems("train", 1, kind="repeat", max_start=-1)
    # a running count (add 1) with three-digit starts: every answer is start + steps, starts within the bound, and
    # the default draws are unchanged by the new argument (max_start=None keeps the old start range and rng tag)
    cnt = longtask.make_sum_problems("heldout", 40, seed=777, kind="repeat", min_steps=14, max_steps=18,
                                     min_operand=1, max_operand=1, max_start=999)
    assert all(p.answer == p.start + p.steps and 0 <= p.start <= 999 and 14 <= p.steps <= 18 for p in cnt)
    assert len({p.question for p in cnt}) == 40
    # known answers drawn by the code before max_start existed (HEAD 0b44874): the recorded calibrations stay valid
    old = longtask.make_sum_problems("train", 2, seed=3, kind="repeat", min_steps=16, max_steps=16, min_operand=1,
                                     max_operand=5)
    assert [(p.start, p.ops[0][1], p.answer) for p in old] == [(31, 4, 95), (48, 2, 80)]
    with pytest.raises(ValueError, match="min_steps"):
        longtask.make_sum_problems("train", 1, min_steps=5, max_steps=4)


def test_the_calibration_record_matches_the_task(smol):
    """The recorded token counts of a correct response (LONG_CPU_CALIBRATION) are the tokenizer's on the held-out
    questions, a correct response in the ``counted`` style is 300+ tokens, and the prompt ends in the anchor line
    the response continues."""
    _, tok = smol
    probs = longtask.make_sum_problems("heldout", 16, seed=777)
    cal = longtask.LONG_CPU_CALIBRATION
    for style, key in (("short", "correct_response_tokens_mean"), ("counted", "correct_response_tokens_counted_mean")):
        lens = [len(tok(longtask.sum_solution(p, style)[len(longtask.anchor(p)):] + "<|im_end|>",
                        add_special_tokens=False)["input_ids"]) for p in probs]
        assert abs(sum(lens) / len(lens) - cal[key]) < 0.05
    assert cal["correct_response_tokens_counted_mean"] >= 300
    assert cal["chosen"] in cal["candidates"] and cal["candidates"][cal["chosen"]]["n"] == cal["n"]
    assert cal["targets_met"] == {"accuracy 10-40%": 0.1 <= cal["accuracy"] <= 0.4,
                                  "mean tokens >= 300": cal["response_tokens_mean"] >= 300}
    prompt = longtask.sum_prompt_fn()(tok, probs[0])
    assert prompt.endswith("<|im_start|>assistant\n" + longtask.anchor(probs[0])) and probs[0].question in prompt
    assert abs(len(tok(prompt, add_special_tokens=False)["input_ids"]) - cal["prompt_tokens_mean"]) < 40


def test_count_kind_solution_reward_and_step_accuracy() -> None:
    """The ``count`` kind: the answer is the number of listed items; the worked solution numbers each item on its
    own line and earns reward 1; a skipped item spoils both the box and the lines after it."""
    ps = longtask.make_sum_problems("heldout", 6, seed=777, kind="count", min_steps=5, max_steps=9)
    for p in ps:
        items = [x for _, x in p.ops]
        assert p.answer == len(items) == p.steps and all(10 <= x <= 99 for x in items)
        assert all(a != b for a, b in zip(items, items[1:], strict=False))
        assert p.question.endswith(", ".join(map(str, items)) + ".")
        sol = longtask.sum_solution(p)
        assert sol.startswith(longtask.anchor(p).strip()) and longtask.sum_reward(sol, p) == 1.0
        assert longtask.step_accuracy(sol, p) == (p.steps, p.steps)
    p = ps[0]
    lines = longtask.sum_solution(p).split("\n")
    skipped = "\n".join(lines[:2] + [f"{i}. {x}" for i, (_, x) in enumerate(p.ops[3:], 3)]
                        + [f"There are \\boxed{{{p.answer - 1}}} numbers."])
    assert longtask.sum_reward(skipped, p) == 0.0
    assert longtask.step_accuracy(skipped, p) == (2, p.steps)
    with pytest.raises(ValueError, match="max_start"):
        longtask.make_sum_problems("train", 1, kind="count", max_start=9)
