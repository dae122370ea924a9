"""A long-response task: running sums, one line per addition, a boxed total (issue 39).

The chapter's task (:mod:`kvlib.rl.task`) has ~35-token answers after a ~870-token prompt: the KV cache matters
there only through the prompt. KV4-RL's regime is long responses (1.4k-5.5k tokens) whose own context grows past
the protected window. Here the response adds one number per line and boxes the total; the difficulty is the
number of steps (lines), and each line is ~17 SmolLM2 tokens (digits are single tokens), so a correct 16-step
response is ~275 tokens (~340 with the ``counted`` line style). Three kinds of problem:

* ``repeat`` (the one chosen): ``Start with 7. Add 4 to it 16 times, one line per addition. What is the final
  number?`` -> ``Step 1: 7 + 4 = 11.`` ... ``The final number is \\boxed{71}.`` Each step is one addition whose
  operands are the previous line's result and a constant: a slip anywhere (a sum, a skipped step, the box) spoils
  the answer;
* ``list``: add ``steps`` listed numbers from 0. Each step must also look its number up by position in the prompt;
  SmolLM2-135M at temperature 1 does not (CPU calibration: ~1% of steps right at 10 steps), so this kind is kept for
  larger models only.
* ``count``: number each of ``steps`` listed two-digit items on its own line (``1. 47``) and box how many there are;
  the answer needs copying, not sums (CPU calibration: most responses end within a few lines at 135M).

The prompt gives ``shots`` worked examples at the same difficulty as earlier chat turns and starts the assistant
turn with the solution's first line (``Start: s.``, :func:`anchor`). The anchor was added when, under an earlier
prompt, the 135M model left the line format within its first tokens; a clean rerun under today's prompt, whose
worked examples begin with that line, found the format kept with or without it (both 0 correct). The problems
reuse the chapter task's machinery
(:class:`kvlib.rl.task.Problem`, disjoint SHA-256 splits, exact-match reward on the last box). The CPU calibration
behind :data:`LONG_DIFFICULTY` is :data:`LONG_CPU_CALIBRATION` (``python -m dev.calibrate_long``): at 135M and
temperature 1 it finds no setting with both 10-40% accuracy and 300-token responses; it says what it found.
"""

from __future__ import annotations

import random
from typing import Any

from kvlib.core.checks import check_positive_int
from kvlib.rl import task as base

QUESTIONS = {
    "list": "Add these numbers one at a time, starting from 0: {numbers}. What is the total?",
    "repeat": "Start with {start}. Add {a} to it {n} times, one line per addition. What is the final number?",
    "count": "Write these numbers one per line, each after its position in the list, then say how many there are: "
             "{numbers}.",
}
KINDS = tuple(QUESTIONS)
#: the setting chosen on the CPU (see LONG_CPU_CALIBRATION: it misses both of issue 39's targets, said there)
LONG_DIFFICULTY: dict[str, Any] = {"kind": "repeat", "min_steps": 16, "max_steps": 16, "min_operand": 1,
                                   "max_operand": 5}
#: the line style of the chosen setting (STYLES)
LONG_STYLE = "short"
#: worked examples in the prompt (at the task's own difficulty): two keep the prompt near 750 tokens at 16 steps
LONG_SHOTS = 2
#: ``python -m dev.calibrate_long`` on the CPU (files and commits in dev/results/README.md), numbers as it printed
#: them (rounded). SmolLM2-135M-Instruct, shipped GGUF dequantised, fp32; temperature 1, no top-k/top-p; held-out
#: questions of seed 777, 4 samples each; the prompt anchored (the assistant turn starts with ``Start: s.``).
#: Issue 39 asks for responses averaging >= 300 tokens at a difficulty where the initial policy scores 10-40%. No
#: variant tried reaches both: accuracy stays at 0-8% from 8 to 16 steps, and the only variant averaging 300+ tokens
#: (``counted`` lines) scored 0 of 32. The misses are temperature-1 slips of a 135M model, one per response or so:
#: a skipped step number, a sum off by a few (``26 + 2 = 30`` in three samples of one question), a missing box, the
#: format left early. A second pass tried a running count (add 1 from three-digit starts: 0 of 32, 328 tokens; the
#: model slips on ``448 + 1`` and counts on from the wrong number) and the ``count`` kind (number 48 listed items and
#: box how many: 3 of 32, but 75 tokens: most responses end after a line or two). The rule declared before the
#: first pass's last run: the ``counted`` style unless it scores 0 of 32, else the ``short`` one, the only 16-step
#: variant with a correct sample; the second pass's rules (declared before each run) kept it. The GPU issue
#: recalibrates at n in the hundreds.
LONG_CPU_CALIBRATION: dict[str, Any] = {
    "model": "SmolLM2-135M-Instruct Q4_1 GGUF dequantised, fp32, CPU", "temperature": 1.0, "shots": LONG_SHOTS,
    "split": "heldout", "problem_seed": 777, "samples_per_question": 4, "tool": "python -m dev.calibrate_long",
    "candidates": {  # accuracy, n, Wilson 95% interval, mean sampled response tokens
        "list, 16 steps, 1-9, no anchor": {"accuracy": 0.0, "n": 12, "wilson95": (0.0, 0.243), "tokens": 222.2},
        "list, 16 steps, 1-9": {"accuracy": 0.0, "n": 8, "wilson95": (0.0, 0.324), "tokens": 201.6},
        "list, 10 steps, 1-9, verbose": {"accuracy": 0.0, "n": 12, "wilson95": (0.0, 0.243), "tokens": 238.8},
        "repeat, 16 steps, 2-9, starts 0-9": {"accuracy": 0.0, "n": 12, "wilson95": (0.0, 0.243), "tokens": 175.4},
        "repeat, 10 steps, 1-5, verbose": {"accuracy": 0.0, "n": 12, "wilson95": (0.0, 0.243), "tokens": 244.4},
        "repeat, 16 steps, 1-5, 4 shots": {"accuracy": 0.083, "n": 12, "wilson95": (0.015, 0.354), "tokens": 236.1},
        "repeat, 16 steps, 1-5": {"accuracy": 0.031, "n": 32, "wilson95": (0.006, 0.157), "tokens": 233.7},
        "repeat, 16 steps, 1-5, counted": {"accuracy": 0.0, "n": 32, "wilson95": (0.0, 0.107), "tokens": 312.2},
        "repeat, 12 steps, 1-5, counted": {"accuracy": 0.0625, "n": 16, "wilson95": (0.011, 0.283), "tokens": 210.9},
        "repeat, 8 steps, 1-5": {"accuracy": 0.0625, "n": 16, "wilson95": (0.011, 0.283), "tokens": 129.1},
        "repeat, 8 steps, 1-5, counted": {"accuracy": 0.0625, "n": 16, "wilson95": (0.011, 0.283), "tokens": 180.9},
        # the two candidates of a second pass, each under a rule declared before it ran (dev/results/README.md)
        "repeat, 16 steps, add 1, starts 0-999, counted": {"accuracy": 0.0, "n": 32, "wilson95": (0.0, 0.107),
                                                          "tokens": 327.5},
        "count, 48 items": {"accuracy": 0.094, "n": 32, "wilson95": (0.032, 0.242), "tokens": 75.2},
    },
    "chosen": "repeat, 16 steps, 1-5",
    "accuracy": 0.03125, "n": 32, "wilson95": (0.006, 0.157), "question_cluster_bootstrap95": (0.0, 0.094),
    "response_tokens_mean": 233.7, "ended": 0.875, "prompt_tokens_mean": 744.5,
    #: SmolLM2 tokens of a correct response (the worked solution after the anchor, EOS included), 16 held-out
    #: questions: what a response averages once the policy solves the task
    "correct_response_tokens_mean": 274.3, "correct_response_tokens_counted_mean": 338.3,
    "targets_met": {"accuracy 10-40%": False, "mean tokens >= 300": False},
}


def _draw(rng: random.Random, kind: str, steps: int, min_operand: int, max_operand: int,
          max_start: int | None = None) -> tuple[str, int, tuple[tuple[str, int], ...]]:
    if kind == "count":  # two-digit items, never the same twice in a row; the answer is how many
        items: list[int] = []
        while len(items) < steps:
            x = rng.randint(10, 99)
            if not items or x != items[-1]:
                items.append(x)
        return QUESTIONS[kind].format(numbers=", ".join(map(str, items))), 0, tuple(("item", x) for x in items)
    if kind == "list":
        nums: list[int] = []
        while len(nums) < steps:  # never the same number twice in a row: the next one is unambiguous to look up
            a = rng.randint(min_operand, max_operand)
            if not nums or a != nums[-1]:
                nums.append(a)
        return QUESTIONS[kind].format(numbers=", ".join(map(str, nums))), 0, tuple(("add", a) for a in nums)
    start = rng.randint(0, 10 * max_operand if max_start is None else max_start)
    a = rng.randint(min_operand, max_operand)
    return QUESTIONS[kind].format(start=start, a=a, n=steps), start, (("add", a),) * steps


def make_sum_problems(split: str, n: int, seed: int = 0, *, kind: str = LONG_DIFFICULTY["kind"],
                      min_steps: int = LONG_DIFFICULTY["min_steps"], max_steps: int = LONG_DIFFICULTY["max_steps"],
                      max_operand: int = LONG_DIFFICULTY["max_operand"],
                      min_operand: int = LONG_DIFFICULTY["min_operand"],
                      max_start: int | None = LONG_DIFFICULTY.get("max_start")) -> list[base.Problem]:
    """``n`` running-sum problems of ``split`` (``"train"``/``"heldout"``, disjoint by the SHA-256 of the question),
    a pure function of the arguments. ``kind="list"``: add ``steps`` listed numbers in ``min_operand..max_operand``
    from 0; ``kind="repeat"``: add one number in ``min_operand..max_operand`` ``steps`` times to a start in
    ``0..10 max_operand`` (operands 1..5: 255 distinct questions per step count, ~1/8 of them held out; a long
    run cycles through them), or ``0..max_start`` when given."""
    if split not in base.SPLITS:
        raise ValueError(f"split must be one of {base.SPLITS}, got {split!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    check_positive_int("min_steps", min_steps)
    if not isinstance(max_steps, int) or max_steps < min_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps!r}, {max_steps!r}")
    low = 2 if kind == "list" else 1  # a list needs two values (no number twice in a row); repeat may add 1
    if not isinstance(max_operand, int) or max_operand < low:
        raise ValueError(f"max_operand must be an int >= {low} for kind {kind!r}, got {max_operand!r}")
    if not isinstance(min_operand, int) or not 1 <= min_operand <= max_operand:
        raise ValueError(f"min_operand must be an int in [1, max_operand], got {min_operand!r}")
    if kind == "count" and max_start is not None:
        raise ValueError("max_start applies to kind 'repeat' only (a count has no start)")
    tag = "" if kind == "list" else f":{kind}"
    tag += "" if min_operand == 2 else f":{min_operand}"
    if max_start is not None:
        if kind == "list":
            raise ValueError("max_start applies to kind 'repeat' only (a list sums from 0)")
        if not isinstance(max_start, int) or max_start < 0:
            raise ValueError(f"max_start must be an int >= 0, got {max_start!r}")
        tag += f":start{max_start}"  # absent from the tag by default: earlier settings draw the same problems
    rng = random.Random(f"kvlib.rl.longtask:{seed}:{min_steps}:{max_steps}:{max_operand}{tag}")

    def draw() -> tuple[str, int, int, int, tuple[tuple[str, int], ...]]:
        q, start, ops = _draw(rng, kind, rng.randint(min_steps, max_steps), min_operand, max_operand, max_start)
        answer = len(ops) if kind == "count" else start + sum(a for _, a in ops)
        return q, answer, len(ops), start, ops

    return base.distinct_problems(split, n, draw)


def _is_count(problem: base.Problem) -> bool:
    return bool(problem.ops) and problem.ops[0][0] == "item"


def anchor(problem: base.Problem) -> str:
    """The first line of the problem's worked solution (``Start: s.``; a count's first item, ``1. x``), placed at
    the start of the assistant turn by ``sum_prompt_fn(anchored=True)``."""
    if _is_count(problem):
        return f"1. {problem.ops[0][1]}\n"
    return f"Start: {problem.start}.\n"


#: line formats of a worked solution: ``short`` writes the sum only; ``counted`` also the step count (three more
#: tokens a line, all predictable copies); ``verbose`` restates the running total and the number it takes next before
#: adding (more tokens per step, but digits: more chances for a temperature-1 slip)
STYLES = {
    "short": "Step {i}: {total} + {a} = {new}.",
    "counted": "Step {i} of {n}: {total} + {a} = {new}.",
    "verbose": "Step {i}: the total so far is {total} and the next number is {a}, so {total} + {a} = {new}.",
}


def sum_solution(problem: base.Problem, style: str = LONG_STYLE) -> str:
    """The worked solution of a running-sum problem: its :func:`anchor` line, one line per addition, the boxed
    total."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {sorted(STYLES)}, got {style!r}")
    if _is_count(problem):  # one line per item, ``i. x``, the count boxed (the line style does not apply)
        lines = [f"{i}. {x}" for i, (_, x) in enumerate(problem.ops, 1)]
        if len(lines) != problem.answer:
            raise ValueError(f"{len(lines)} items recorded, not the answer {problem.answer}")
        return "\n".join(lines + [f"There are \\boxed{{{len(lines)}}} numbers."])
    total, lines = problem.start, [anchor(problem).strip()]
    for i, (op, a) in enumerate(problem.ops, 1):
        if op != "add":
            raise ValueError(f"a running-sum problem adds only, got {op!r}")
        lines.append(STYLES[style].format(i=i, n=len(problem.ops), total=total, a=a, new=total + a))
        total += a
    if total != problem.answer:
        raise ValueError(f"recorded numbers sum to {total}, not the answer {problem.answer}")
    lines.append(f"The final number is \\boxed{{{total}}}.")
    return "\n".join(lines)


def step_accuracy(response: str, problem: base.Problem) -> tuple[int, int]:
    """``(correct steps, steps)`` of a response: step ``i`` is correct when its line (either style) adds the
    ``i``-th number to the true running total and writes the right sum (``Step i: total + a = new``). A calibration
    diagnostic: the final accuracy at ``n`` steps is roughly the per-step rate to the power ``n``."""
    import re

    nums = [a for _, a in problem.ops]
    if _is_count(problem):  # item i is right when line i reads ``i. x_i``
        good = sum(bool(re.search(rf"(?m)^{i}\. {x}$", response)) for i, x in enumerate(nums, 1))
        return good, len(nums)
    good, total = 0, problem.start
    for i, a in enumerate(nums, 1):
        m = re.search(rf"Step {i}(?: of \d+)?:[^\n]*?(-?\d+) \+ (-?\d+) = (-?\d+)", response)
        if m and (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (total, a, total + a):
            good += 1
        total += a
    return good, len(nums)


def sum_prompt_fn(shots: int = LONG_SHOTS, seed: int = 12345, *, anchored: bool = True, style: str = LONG_STYLE,
                  system: str | None = base.SYSTEM, **difficulty: Any) -> Any:
    """``(tokenizer, problem) -> prompt text``: ``shots`` worked examples at ``difficulty`` (default
    :data:`LONG_DIFFICULTY`) as earlier chat turns, then the problem (:func:`kvlib.rl.task.format_prompt`).

    ``anchored``: the assistant turn starts with the solution's first line (:func:`anchor`), as part of the prompt.
    It fixes the first line of the format for the sampler (see the module docstring for what the calibration found
    with and without it). The response (what is sampled, rewarded and trained) follows the anchor."""
    diff = {**LONG_DIFFICULTY, **difficulty}
    examples = make_sum_problems("train", shots, seed=seed, **diff) if shots else []

    if style not in STYLES:
        raise ValueError(f"style must be one of {sorted(STYLES)}, got {style!r}")
    turns = [{"role": "system", "content": system}] if system else []
    for ex in examples:  # the chapter task's chat layout (kvlib.rl.task.format_prompt), this task's solutions
        turns += [{"role": "user", "content": f"{ex.question} {base.INSTRUCTION}"},
                  {"role": "assistant", "content": sum_solution(ex, style)}]

    def fn(tokenizer: Any, problem: base.Problem | str) -> str:
        question = problem.question if isinstance(problem, base.Problem) else problem
        if not isinstance(question, str):
            raise TypeError(f"problem must be a Problem or str, got {type(problem).__name__}")
        msgs = turns + [{"role": "user", "content": f"{question} {base.INSTRUCTION}"}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return text + anchor(problem) if anchored and isinstance(problem, base.Problem) else text

    return fn


def sum_reward(response: str, problem: base.Problem) -> float:
    """1.0 when the last box of ``response`` holds the total, else 0.0 (:func:`kvlib.rl.task.reward`)."""
    return base.reward(response, problem.answer)
