"""A long-response task: running sums, one line per number, a boxed total (issue 39).

The chapter's task (:mod:`kvlib.rl.task`) has ~35-token answers after a ~870-token prompt: the KV cache matters
there only through the prompt. KV4-RL's regime is long responses (1.4k-5.5k tokens) whose own context grows past
the protected window. Here a problem lists ``steps`` numbers and the response adds them one at a time::

    Add these numbers one at a time, starting from 0: 7, 3, 9, 4. What is the total?

    Start: 0.
    Step 1: 0 + 7 = 7.
    Step 2: 7 + 3 = 10.
    ...
    The final number is \\boxed{23}.

Each line is ~19 SmolLM2 tokens (digits are single tokens), so the response grows linearly with the difficulty
(the number of steps): 16 steps give ~320 tokens. Each step copies the next number from the prompt (an
induction-style lookup across the whole context) and adds it, so an error anywhere spoils the box: accuracy falls
geometrically with the steps, and the difficulty can be set where the initial policy scores 10-40%.

The problems reuse the chapter task's machinery (:class:`kvlib.rl.task.Problem` with ``add`` ops from ``start=0``,
its worked solution, prompt template, disjoint SHA-256 splits and exact-match reward on the last box). The CPU
calibration behind :data:`LONG_DIFFICULTY` is :data:`LONG_CPU_CALIBRATION` (``dev/rl/calibrate_long.py``).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from kvlib.core.checks import check_positive_int
from kvlib.rl import task as base

QUESTION = "Add these numbers one at a time, starting from 0: {numbers}. What is the total?"
#: the calibrated setting (see LONG_CPU_CALIBRATION); min_steps == max_steps: the difficulty is the step count
LONG_DIFFICULTY: dict[str, int] = {"min_steps": 16, "max_steps": 16, "max_operand": 9}
#: worked examples in the prompt (at the task's own difficulty): two keep the prompt near 1k tokens at 16 steps
LONG_SHOTS = 2
#: filled from dev/rl/calibrate_long.py's output (numbers as it printed them; see the module docstring)
LONG_CPU_CALIBRATION: dict[str, Any] = {}


def make_sum_problems(split: str, n: int, seed: int = 0, *, min_steps: int = LONG_DIFFICULTY["min_steps"],
                      max_steps: int = LONG_DIFFICULTY["max_steps"],
                      max_operand: int = LONG_DIFFICULTY["max_operand"]) -> list[base.Problem]:
    """``n`` running-sum problems of ``split`` (``"train"``/``"heldout"``, disjoint by the SHA-256 of the question),
    a pure function of the arguments. Operands are drawn from ``1..max_operand``, never the same twice in a row
    (so the next number is unambiguous to look up after the previous one)."""
    if split not in base.SPLITS:
        raise ValueError(f"split must be one of {base.SPLITS}, got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    check_positive_int("min_steps", min_steps)
    if not isinstance(max_steps, int) or max_steps < min_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps!r}, {max_steps!r}")
    if not isinstance(max_operand, int) or max_operand < 2:
        raise ValueError(f"max_operand must be an int >= 2, got {max_operand!r}")
    rng = random.Random(f"kvlib.rl.longtask:{seed}:{min_steps}:{max_steps}:{max_operand}")
    out: list[base.Problem] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise ValueError(f"cannot draw {n} distinct {split} problems at this difficulty")
        steps = rng.randint(min_steps, max_steps)
        nums: list[int] = []
        while len(nums) < steps:
            a = rng.randint(1, max_operand)
            if not nums or a != nums[-1]:
                nums.append(a)
        q = QUESTION.format(numbers=", ".join(map(str, nums)))
        if q in seen or base.split_of(q) != split:
            continue
        seen.add(q)
        uid = hashlib.sha256(q.encode()).hexdigest()[:12]
        out.append(base.Problem(uid=uid, question=q, answer=sum(nums), steps=steps, start=0,
                                ops=tuple(("add", a) for a in nums)))
    return out


def sum_prompt_fn(shots: int = LONG_SHOTS, seed: int = 12345, **difficulty: int) -> Any:
    """``(tokenizer, problem) -> prompt text``: ``shots`` worked examples at ``difficulty`` (default
    :data:`LONG_DIFFICULTY`) as earlier chat turns, then the problem (:func:`kvlib.rl.task.format_prompt`)."""
    diff = {**LONG_DIFFICULTY, **difficulty}
    examples = make_sum_problems("train", shots, seed=seed, **diff) if shots else []

    def fn(tokenizer: Any, problem: base.Problem | str) -> str:
        return base.format_prompt(tokenizer, problem, shots=examples)

    return fn


def sum_reward(response: str, problem: base.Problem) -> float:
    """1.0 when the last box of ``response`` holds the total, else 0.0 (:func:`kvlib.rl.task.reward`)."""
    return base.reward(response, problem.answer)
