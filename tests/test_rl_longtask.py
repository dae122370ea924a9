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
            assert p.steps == longtask.LONG_DIFFICULTY["min_steps"] and len(set(nums)) == 1 and 2 <= nums[0] <= 9
            assert 0 <= p.start <= 90
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
        longtask.make_sum_problems("train", 1, max_operand=1)
    with pytest.raises(ValueError, match="min_steps"):
        longtask.make_sum_problems("train", 1, min_steps=5, max_steps=4)


def test_a_correct_response_is_long_in_smollm2_tokens(smol):
    """The worked solution at the calibrated difficulty (what a correct response looks like) is >= 300 SmolLM2
    tokens, and the prompt ends in the anchor line the response continues."""
    _, tok = smol
    probs = longtask.make_sum_problems("heldout", 8, seed=777)
    lens = []
    for p in probs:
        sol = longtask.sum_solution(p)
        lens.append(len(tok(sol[len(longtask.anchor(p)):] + "<|im_end|>", add_special_tokens=False)["input_ids"]))
    assert min(lens) >= 300
    prompt = longtask.sum_prompt_fn()(tok, probs[0])
    assert prompt.endswith("<|im_start|>assistant\n" + longtask.anchor(probs[0])) and probs[0].question in prompt
