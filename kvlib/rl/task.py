"""A verifiable task generated on the fly: multi-step integer arithmetic with a boxed final answer.

A problem is a chain ``start, op_1 a_1, ..., op_n a_n`` ("Start with 7. Add 5. Multiply the result
by 3. ...") whose exact integer result is the answer; the reward is 1 when the *last* ``\\boxed{}``
of the response parses to that integer, else 0 (verl's boxed-answer scoring picks the last box
too). No dataset is downloaded: :func:`make_problems` is a deterministic function of
``(split, seed, index, difficulty)``.

Splits are disjoint by construction: a candidate chain belongs to the held-out split when the
SHA-256 of its canonical text falls in the held-out bucket (1 in 8), so the same chain can never be
in both, whatever the seeds.

How long responses must be. The fidelity chapter's probe (data/results/cpu/kv4rl_fidelity_probe.json,
SmolLM2-135M, fp32 reference, 32 paths x 8 states at contexts 896-1023) measures a mean next-token
KL of 4.75e-2 for KV4 (K rotation) against 3.4e-3 for KV4-RL (sink 16 + recent 128), a 14x
[10, 20] gap; by probe position KV4's KL rises from 2.8e-2 (context 896) to 5.9e-2 (1023), while
KV4-RL stays at 2-5e-3. That is the only context range the probe covers, so it is where a
mismatch is known to be measurable at this model size. Two consequences for the task:

- KV4-RL keeps the first 16 and the last 128 positions in INT8, so below ~144 cached tokens it
  *is* an INT8 cache: kv4rl vs kv4 can only separate on contexts well past 144 tokens.
- A bare chat-templated problem is ~60-120 tokens, so a bare prompt never leaves the protected window's
  neighbourhood. The prompt therefore carries :data:`DEFAULT_SHOTS` = 10 worked examples *at the task's
  own difficulty* as earlier chat turns (:func:`format_prompt`, the model's chat template): ~870 prompt
  tokens, so generation runs at contexts ~870-970, at and just below the probe's, and every cached position
  between the 16 sinks and the last 128 is INT4 under kv4rl, all of them under kv4.

Calibration (issue 27, CPU, the real model). The first GPU run (6-12-step chains with add/sub/mul, 3 long
examples) scored ~0 at temperature 1 (calibration 0.0-0.06 by chain length, n=16 each; bf16 training
reward 0.000-0.016 over 13 iterations; the samples ignored the format and rambled): GRPO cannot learn
from all-zero groups. :data:`CPU_CALIBRATION` holds the measurements behind :data:`DIFFICULTY`
(:mod:`kvlib.rl.calibrate`): SmolLM2-135M-Instruct (shipped Q4_1 GGUF, dequantised, fp32 on the CPU),
temperature 1, no top-k/top-p, 10 same-difficulty examples, 4 samples per held-out question, exact
match on the last box. Accuracy (n samples; SE ~0.09 at n=32):

- 1 step, add/sub: 0.69 (n=16, max_new_tokens 48);
- 2 steps, add/sub: 0.09 (n=32, max_new_tokens 48: half were cut off at 48 tokens);
- 1-2 steps, add only: 0.53 (n=32, max_new_tokens 80); 2 steps, add only: 0.59 (n=32);
- **1-2 steps, add/sub: 0.375** (n=32, max_new_tokens 80, every response ended, 33 tokens mean,
  prompts 871 tokens): the chosen setting, nearest the 0.35 target, so that most groups of 8 mix
  right and wrong answers.

The GPU rollouts are bf16 copies of the same weights (not fp32), so their starting accuracy can differ
a little; the runs' first iterations show it. Responses are short (~35 tokens), so ``max_new_tokens`` 96
leaves room for KV4's expected length changes (the paper reports shorter KV4 responses) and for
rambling at temperature 1. What this task does not test: long reasoning. The KV cache matters here
through the ~870-token few-shot context every response attends to, not through long responses.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: the instruction the paper appends to every problem (KV4-RL, appendix training setup)
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SYSTEM = "You are a careful assistant who solves arithmetic problems one step at a time."
#: the GPU runs' task: 1-2-step add/sub chains of one-digit operands (calibrated on the CPU: module docstring)
DIFFICULTY: dict[str, Any] = {"min_steps": 1, "max_steps": 2, "max_operand": 9, "max_abs": 999, "ops": "add,sub"}
DIFFICULTY_OPS: str = DIFFICULTY["ops"]
#: worked examples in every prompt (see module docstring: they set the cached context to ~870 tokens)
DEFAULT_SHOTS = 10
#: the CPU measurement behind DIFFICULTY (module docstring): ``python -m kvlib.rl.calibrate NAME 10 N 4 MAX_NEW
#: '<difficulty json>'``, 4 samples per held-out question (seed 777), numbers as it printed them
CPU_CALIBRATION: dict[str, Any] = {
    "model": "SmolLM2-135M-Instruct Q4_1 GGUF dequantised, fp32, CPU", "temperature": 1.0, "shots": DEFAULT_SHOTS,
    "split": "heldout", "problem_seed": 777, "samples_per_question": 4, "tool": "python -m kvlib.rl.calibrate",
    "candidates": {
        "1 step, add,sub": {"accuracy": 0.6875, "n": 16, "max_new_tokens": 48, "response_tokens_mean": 35.1,
                            "ended": 1.0, "prompt_tokens_mean": 803.8},
        "2 steps, add,sub": {"accuracy": 0.09375, "n": 32, "max_new_tokens": 48, "response_tokens_mean": 47.4,
                             "ended": 0.53, "prompt_tokens_mean": 1001.3},
        "1-2 steps, add": {"accuracy": 0.53125, "n": 32, "max_new_tokens": 80, "response_tokens_mean": 37.4,
                           "ended": 1.0, "prompt_tokens_mean": 951.5},
        "2 steps, add": {"accuracy": 0.59375, "n": 32, "max_new_tokens": 80, "response_tokens_mean": 51.0,
                         "ended": 1.0, "prompt_tokens_mean": 1009.1},
        "1-2 steps, add,sub": {"accuracy": 0.375, "n": 32, "max_new_tokens": 80, "response_tokens_mean": 33.3,
                               "ended": 1.0, "prompt_tokens_mean": 871.0},
    },
    "chosen": "1-2 steps, add,sub",
    "accuracy": 0.375, "n": 32, "max_new_tokens": 80, "prompt_tokens_mean": 871.0, "response_tokens_mean": 33.3,
}
SPLITS = ("train", "heldout")
_HELDOUT_BUCKETS = 8  # 1 in 8 candidate chains is held out


@dataclass(frozen=True)
class Problem:
    """One chain: ``question`` (plain text, no template), exact integer ``answer``, and a stable ``uid``."""

    uid: str
    question: str
    answer: int
    steps: int
    start: int = 0
    ops: tuple[tuple[str, int], ...] = ()


_OPS = {"add": "Add {a}.", "sub": "Subtract {a}.", "mul": "Multiply the result by {a}."}


def _chain(rng: random.Random, n_steps: int, max_operand: int, max_abs: int,
           allowed: tuple[str, ...] = ("add", "sub", "mul")) -> tuple[str, int, int, tuple[tuple[str, int], ...]]:
    value = rng.randint(1, max_operand + 1)
    start = value
    ops_done: list[tuple[str, int]] = []
    parts = [f"Start with {value}."]
    for _ in range(n_steps):
        a = rng.randint(1, max_operand)
        ops = [o for o in ("add", "sub") if o in allowed]
        ops += ["mul"] if "mul" in allowed and a > 1 and abs(value * a) <= max_abs else []
        op = rng.choice(ops or ["add"])
        if op == "add" and abs(value + a) > max_abs and "sub" in allowed:
            op = "sub"
        elif op == "sub" and abs(value - a) > max_abs and "add" in allowed:
            op = "add"
        value = value + a if op == "add" else value - a if op == "sub" else value * a
        parts.append(_OPS[op].format(a=a))
        ops_done.append((op, a))
    parts.append("What is the final number?")
    return " ".join(parts), value, start, tuple(ops_done)


def split_of(question: str) -> str:
    """The split a chain belongs to, from the SHA-256 of its text (so the splits cannot overlap)."""
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
    return "heldout" if h % _HELDOUT_BUCKETS == 0 else "train"


def make_problems(split: str, n: int, seed: int = 0, *, min_steps: int = DIFFICULTY["min_steps"],
                  max_steps: int = DIFFICULTY["max_steps"], max_operand: int = DIFFICULTY["max_operand"],
                  max_abs: int = DIFFICULTY["max_abs"], ops: str = DIFFICULTY_OPS) -> list[Problem]:
    """``n`` problems of ``split`` ("train" or "heldout"), a pure function of the arguments.

    Candidates are drawn from one stream seeded by ``(seed, difficulty)`` and kept when
    :func:`split_of` says they belong to ``split`` (duplicates dropped). ``ops``: the operations a
    chain may use, comma-separated from ``add,sub,mul``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not (isinstance(min_steps, int) and isinstance(max_steps, int) and 1 <= min_steps <= max_steps):
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps!r}, {max_steps!r}")
    if max_operand < 2 or max_abs < max_operand + 1:
        raise ValueError(f"need max_operand >= 2 and max_abs > max_operand, got {max_operand!r}, {max_abs!r}")
    if not isinstance(ops, str) or not ops or set(ops.split(",")) - set(_OPS):
        raise ValueError(f"ops must name operations from {sorted(_OPS)}, comma-separated, got {ops!r}")
    allowed = tuple(ops.split(","))
    tag = "" if allowed == ("add", "sub", "mul") else f":{ops}"  # the default keeps its old problem stream
    rng = random.Random(f"kvlib.rl.task:{seed}:{min_steps}:{max_steps}:{max_operand}:{max_abs}{tag}")

    def draw() -> tuple[str, int, int, int, tuple[tuple[str, int], ...]]:
        steps = rng.randint(min_steps, max_steps)
        q, ans, start, done = _chain(rng, steps, max_operand, max_abs, allowed)
        return q, ans, steps, start, done

    return distinct_problems(split, n, draw)


def distinct_problems(split: str, n: int, draw: Callable[[], tuple[str, int, int, int, tuple[tuple[str, int], ...]]],
                      ) -> list[Problem]:
    """``n`` distinct problems of ``split``, drawn by ``draw() -> (question, answer, steps, start, ops)`` and kept
    when the question is new and :func:`split_of` puts it in ``split`` (the tasks' shared rejection loop)."""
    out: list[Problem] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise ValueError(f"cannot draw {n} distinct {split} problems at this difficulty")
        q, ans, steps, start, ops = draw()
        if q in seen or split_of(q) != split:
            continue
        seen.add(q)
        uid = hashlib.sha256(q.encode()).hexdigest()[:12]
        out.append(Problem(uid=uid, question=q, answer=ans, steps=steps, start=start, ops=ops))
    return out


_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}


def worked_solution(problem: Problem) -> str:
    """A step-by-step solution in the format the reward expects (one line per step, then a box)."""
    if not problem.ops:
        raise ValueError("problem has no recorded ops (make it with make_problems)")
    value = problem.start
    lines = [f"Start: {value}."]
    for i, (op, a) in enumerate(problem.ops, 1):
        new = value + a if op == "add" else value - a if op == "sub" else value * a
        lines.append(f"Step {i}: {value} {_SYMBOL[op]} {a} = {new}.")
        value = new
    if value != problem.answer:
        raise ValueError(f"recorded ops give {value}, not the answer {problem.answer}")
    lines.append(f"The final number is \\boxed{{{value}}}.")
    return "\n".join(lines)


def fewshot_examples(n: int, seed: int = 12345, **difficulty: int) -> list[Problem]:
    """``n`` train-split problems to show as worked examples (a seed of their own, away from the run seeds)."""
    return make_problems("train", n, seed=seed, **difficulty)


def format_prompt(tokenizer: Any, problem: Problem | str, *, shots: Sequence[Problem] = (),
                  system: str | None = SYSTEM) -> str:
    """The chat-templated prompt text (generation prompt appended) for one problem.

    ``shots``: worked examples given as earlier user/assistant turns. They teach the line format and
    the box (a 135M model rarely finds it alone) and lengthen the cached context: three 6-12-step
    examples put every generated token past ~825 cached positions, the regime where the fidelity
    probe measured KV4's mismatch (module docstring).
    """
    question = problem.question if isinstance(problem, Problem) else problem
    if not isinstance(question, str):
        raise TypeError(f"problem must be a Problem or str, got {type(problem).__name__}")
    messages = [{"role": "system", "content": system}] if system else []
    for ex in shots:
        messages += [{"role": "user", "content": f"{ex.question} {INSTRUCTION}"},
                     {"role": "assistant", "content": worked_solution(ex)}]
    messages.append({"role": "user", "content": f"{question} {INSTRUCTION}"})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent/unclosed."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


_NUMBER = re.compile(r"^[+-]?\d+(?:\.0*)?$")


def parse_answer(content: str | None) -> int | None:
    """An integer from a box's content, tolerant of formatting: ``$``, ``\\text{}``, thousands commas,
    spaces, a trailing period, ``x = 12``, ``12.0``, unicode minus; None if it is not one integer."""
    if content is None:
        return None
    s = content.strip()
    s = re.sub(r"\\(?:text|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", s)
    for old, new in (("$", ""), ("\u2212", "-"), ("\\!", ""), ("\\,", ""), ("{", ""), ("}", "")):
        s = s.replace(old, new)
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    s = re.sub(r"^([+-])\s+", r"\1", s)  # "- 5"; spaces between digits stay (and fail: "4 2" is not 42)
    if not _NUMBER.match(s):
        return None
    return int(float(s)) if "." in s else int(s)


def reward(response: str, answer: int) -> float:
    """Exact-match reward: 1.0 when the last box of ``response`` parses to ``answer``, else 0.0."""
    if not isinstance(answer, int):
        raise TypeError(f"answer must be an int, got {type(answer).__name__}")
    got = parse_answer(last_boxed(response))
    return 1.0 if got is not None and got == answer else 0.0


def prompt_fn(shots: int = DEFAULT_SHOTS, seed: int = 12345, **difficulty: Any) -> Any:
    """``(tokenizer, problem) -> prompt`` with ``shots`` fixed worked examples (drawn at ``difficulty``,
    default :data:`DIFFICULTY`): the loop's default."""
    examples = fewshot_examples(shots, seed, **difficulty) if shots else []

    def fn(tokenizer: Any, problem: Problem | str) -> str:
        return format_prompt(tokenizer, problem, shots=examples)

    return fn
