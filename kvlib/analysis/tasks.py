"""Seeded synthetic retrieval tasks with exact-match scoring (RULER-style, small-model sized).

Three kinds, each a needle of digits hidden in filler text that holds no digit at all, so
the answer occurs in the context exactly once, at a chosen relative depth:

* ``"passkey"``: one pass key (Mohtashami & Jaggi's passkey retrieval);
* ``"kv"``: several ``key -> number`` needles, one key is asked (RULER ``niah_multikey``);
* ``"multineedle"``: several numbers for one key, all must be returned (RULER
  ``niah_multivalue``).

Every task is a pure function of ``(kind, length, seed, index)`` and the options, so disjoint
slices are ``index`` ranges and reruns reproduce the prompts bit for bit. ``length`` is the
length of the whole prompt (chat template and answer prefix included) measured with the
tokenizer passed in, or, with none, approximated by :func:`approx_token_count` (words and
punctuation marks). The prompt uses the tokenizer's chat template when it has one and ends
with an answer prefix in the assistant turn, so a greedy continuation starts with the answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "FILLERS",
    "TASK_KINDS",
    "RetrievalTask",
    "approx_token_count",
    "count_tokens",
    "extract_numbers",
    "build_prompt",
    "generate_answer",
    "generate_answers",
    "make_task",
    "make_tasks",
    "run_tasks",
    "score",
    "Prefill",
    "prefill_exact",
    "decode_from_prefill",
    "first_number_done",
]

TASK_KINDS = ("passkey", "kv", "multineedle")
FILLERS = ("repeat", "essay")
_KIND_CODE = {k: i for i, k in enumerate(TASK_KINDS)}

#: the classic passkey haystack (Mohtashami & Jaggi 2023, "Landmark Attention")
_REPEAT_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

# Vocabulary of the generated "essay" haystack: plain English, no digits, disjoint from the
# key vocabulary below so that a key never occurs in the filler.
_SUBJECTS = (
    "the old farmer",
    "a quiet student",
    "the tall tree",
    "our neighbour",
    "the river",
    "a small village",
    "the painter",
    "the market",
    "a young teacher",
    "the garden",
    "the mountain road",
    "a travelling merchant",
    "the library",
    "the little boat",
    "the morning train",
    "a careful writer",
    "the city council",
    "the baker",
)
_VERBS = (
    "walked past",
    "looked at",
    "waited near",
    "talked about",
    "remembered",
    "carried",
    "watched",
    "followed",
    "cleaned",
    "described",
    "visited",
    "admired",
)
_OBJECTS = (
    "the wooden bridge",
    "a long letter",
    "the empty square",
    "the stone wall",
    "a basket of apples",
    "the open window",
    "the evening sky",
    "a forgotten song",
    "the narrow street",
    "the warm kitchen",
    "a field of wheat",
    "the harbour lights",
)
_TAILS = (
    "before the rain started",
    "in the early morning",
    "without saying a word",
    "as the bells rang",
    "after a long day",
    "while the wind was calm",
    "for the first time",
    "with great patience",
    "near the end of summer",
    "under a grey sky",
)
_KEY_WORDS = (
    "amber",
    "basil",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "glacier",
    "hazel",
    "indigo",
    "jasper",
    "kelp",
    "lilac",
    "maple",
    "nectar",
    "onyx",
    "pepper",
    "quartz",
    "raven",
    "saffron",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
)

_INSTRUCTIONS = {
    "passkey": (
        "There is an important pass key hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about the pass key."
    ),
    "kv": (
        "Some special magic numbers are hidden within the following text. "
        "Make sure to memorize it. I will quiz you about the numbers afterwards."
    ),
    "multineedle": (
        "Some special magic numbers are hidden within the following text. "
        "Make sure to memorize it. I will quiz you about the numbers afterwards."
    ),
}

_APPROX_TOKEN = re.compile(r"\w+|[^\w\s]")
_NUMBER = re.compile(r"\d+")


# ----------------------------------------------------------------------------- token counts
def approx_token_count(text: str) -> int:
    """Tokenizer-free length estimate: words plus punctuation marks (close to BPE on plain
    English; digit-per-token tokenizers count long numbers as more)."""
    return len(_APPROX_TOKEN.findall(text))


def count_tokens(text: str, tokenizer: Any | None = None) -> int:
    """Tokens of ``text`` under ``tokenizer`` (no special tokens added), or the word estimate."""
    if tokenizer is None:
        return approx_token_count(text)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _has_chat_template(tokenizer: Any | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def build_prompt(user: str, answer_prefix: str, tokenizer: Any | None = None) -> str:
    """Chat-templated prompt (user turn, open assistant turn) ending with ``answer_prefix``."""
    if _has_chat_template(tokenizer):
        head = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return f"{head}{answer_prefix}"
    return f"{user}\n\nAnswer: {answer_prefix}"


# ----------------------------------------------------------------------------- task
@dataclass(frozen=True)
class RetrievalTask:
    """One retrieval prompt with its expected answer(s); build it with :func:`make_task`."""

    kind: str
    length: int
    seed: int
    index: int
    instruction: str
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    depths: tuple[float, ...]  # relative depth (0 = start, 1 = end) of each answer's needle
    n_tokens: int  # measured prompt length (tokenizer tokens or the word estimate)
    key: str | None = None
    filler: str = "repeat"
    tokenizer_name: str | None = field(default=None, compare=False)

    @property
    def task_id(self) -> str:
        """Stable identifier, unique per (kind, length, seed, index)."""
        return f"{self.kind}-L{self.length}-s{self.seed}-i{self.index}"

    @property
    def answer(self) -> str:
        """The expected answer as text (numbers joined by ", " for multi-needle)."""
        return ", ".join(self.answers)

    @property
    def max_new_tokens(self) -> int:
        """A generation budget long enough for the answer: digits may be one token each, and
        lists come with separators or bullets (about 8 tokens of slack per number)."""
        return 4 + sum(len(a) + 8 for a in self.answers)

    def user_message(self) -> str:
        return f"{self.instruction}\n\n{self.context}\n\n{self.question}"

    def prompt(self, tokenizer: Any | None = None) -> str:
        """The full prompt text; pass the tokenizer the length was measured with."""
        return build_prompt(self.user_message(), self.answer_prefix, tokenizer)


# ----------------------------------------------------------------------------- generation
def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _filler_sentences(filler: str, n: int, rng: np.random.Generator) -> list[str]:
    if filler == "repeat":
        reps = _REPEAT_FILLER
        return [reps[i % len(reps)] for i in range(n)]
    subj = rng.integers(0, len(_SUBJECTS), n)
    verb = rng.integers(0, len(_VERBS), n)
    obj = rng.integers(0, len(_OBJECTS), n)
    tail = rng.integers(0, len(_TAILS), n)
    out = []
    for s, v, o, t in zip(subj, verb, obj, tail, strict=True):
        text = f"{_SUBJECTS[s]} {_VERBS[v]} {_OBJECTS[o]} {_TAILS[t]}."
        out.append(text[0].upper() + text[1:])
    return out


def _distinct_numbers(rng: np.random.Generator, count: int, digits: int) -> list[str]:
    lo, hi = 10 ** (digits - 1), 10**digits
    values: list[str] = []
    while len(values) < count:
        v = str(int(rng.integers(lo, hi)))
        if v not in values:
            values.append(v)
    return values


def _distinct_keys(rng: np.random.Generator, count: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < count:
        i, j = rng.choice(len(_KEY_WORDS), size=2, replace=False)
        k = f"{_KEY_WORDS[i]}-{_KEY_WORDS[j]}"
        if k not in keys:
            keys.append(k)
    return keys


def _check_depth(depth: float | None) -> float | None:
    if depth is None:
        return None
    try:
        d = float(depth)
    except (TypeError, ValueError):
        raise TypeError(f"depth must be a float in [0, 1] or None, got {depth!r}") from None
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    return d


def make_task(
    kind: str,
    *,
    length: int,
    seed: int = 0,
    index: int = 0,
    tokenizer: Any | None = None,
    depth: float | None = None,
    n_keys: int = 4,
    n_needles: int = 3,
    digits: int | None = None,
    filler: str | None = None,
) -> RetrievalTask:
    """One reproducible retrieval task whose prompt is at most ``length`` tokens long.

    ``depth``: relative position of the (asked) needle, drawn uniformly from [0.05, 0.95]
    when ``None``; other needles go to random distinct positions. ``n_keys`` (kind ``"kv"``)
    is the number of key-value needles, ``n_needles`` (``"multineedle"``) the number of
    values to return. ``digits``: length of each number (default 5 for passkey, 6 else).
    ``filler``: ``"repeat"`` (classic passkey haystack, default for passkey) or
    ``"essay"`` (generated varied sentences, default otherwise). The filler is cut to the
    largest whole number of sentences that keeps the prompt within ``length``.
    """
    if kind not in TASK_KINDS:
        raise ValueError(f"kind must be one of {TASK_KINDS}, got {kind!r}")
    length = _check_int("length", length, 16)
    seed = _check_int("seed", seed, 0)
    index = _check_int("index", index, 0)
    n_keys = _check_int("n_keys", n_keys, 1)
    n_needles = _check_int("n_needles", n_needles, 1)
    depth = _check_depth(depth)
    if digits is None:
        digits = 5 if kind == "passkey" else 6
    digits = _check_int("digits", digits, 2)
    if filler is None:
        filler = "repeat" if kind == "passkey" else "essay"
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")

    rng = np.random.default_rng([seed, _KIND_CODE[kind], length, index])
    main_depth = float(rng.uniform(0.05, 0.95)) if depth is None else depth

    key: str | None = None
    if kind == "passkey":
        answers = _distinct_numbers(rng, 1, digits)
        needles = [f"The pass key is {answers[0]}. Remember it."]
        question = "What is the pass key?"
        prefix = "The pass key is"
        needle_depths = [main_depth]
    elif kind == "kv":
        keys = _distinct_keys(rng, n_keys)
        values = _distinct_numbers(rng, n_keys, digits)
        key, answers = keys[0], [values[0]]
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values, strict=True)]
        question = f"What is the special magic number for {key} mentioned in the provided text?"
        prefix = f"The special magic number for {key} mentioned in the provided text is"
        needle_depths = [main_depth] + [float(x) for x in rng.uniform(0, 1, n_keys - 1)]
    else:  # multineedle
        key = _distinct_keys(rng, 1)[0]
        answers = _distinct_numbers(rng, n_needles, digits)
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in answers]
        question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        prefix = f"The special magic numbers for {key} mentioned in the provided text are"
        needle_depths = [main_depth] + [float(x) for x in rng.uniform(0, 1, n_needles - 1)]

    instruction = _INSTRUCTIONS[kind]
    # enough sentences for any length: every filler sentence is at least ~3 tokens
    pool = _filler_sentences(filler, length // 3 + 8, rng)

    def assemble(n_fill: int) -> tuple[str, list[float]]:
        # needle i goes after round(depth_i * n_fill) filler sentences; ties keep needle order
        slots = [round(d * n_fill) for d in needle_depths]
        order = sorted(range(len(needles)), key=lambda i: (slots[i], i))
        parts: list[str] = []
        cursor = 0
        for i in order:
            parts.extend(pool[cursor : slots[i]])
            cursor = max(cursor, slots[i])
            parts.append(needles[i])
        parts.extend(pool[cursor:n_fill])
        real = [slots[i] / n_fill if n_fill else 0.0 for i in range(len(needles))]
        return " ".join(parts), real

    def measure(n_fill: int) -> int:
        context, _ = assemble(n_fill)
        user = f"{instruction}\n\n{context}\n\n{question}"
        return count_tokens(build_prompt(user, prefix, tokenizer), tokenizer)

    if measure(0) > length:
        raise ValueError(
            f"length={length} is too short for a {kind} prompt "
            f"(needles and instructions alone take {measure(0)} tokens)"
        )
    lo, hi = 0, len(pool)  # invariant: measure(lo) <= length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if measure(mid) <= length:
            lo = mid
        else:
            hi = mid - 1
    context, real_depths = assemble(lo)
    return RetrievalTask(
        kind=kind,
        length=length,
        seed=seed,
        index=index,
        instruction=instruction,
        context=context,
        question=question,
        answer_prefix=prefix,
        answers=tuple(answers),
        depths=tuple(real_depths[: len(answers)]),
        n_tokens=measure(lo),
        key=key,
        filler=filler,
        tokenizer_name=getattr(tokenizer, "name_or_path", None) if tokenizer else None,
    )


def make_tasks(
    kind: str,
    n: int,
    *,
    length: int,
    seed: int = 0,
    start: int = 0,
    **options: Any,
) -> list[RetrievalTask]:
    """``n`` tasks with indices ``start .. start + n - 1``; disjoint index ranges give
    disjoint slices. ``options`` go to :func:`make_task`."""
    n = _check_int("n", n, 0)
    start = _check_int("start", start, 0)
    return [make_task(kind, length=length, seed=seed, index=start + i, **options) for i in range(n)]


# ----------------------------------------------------------------------------- scoring
def extract_numbers(text: str) -> list[str]:
    """Digit runs of ``text`` in order (the extracted answer candidates)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return _NUMBER.findall(text)


def score(task: RetrievalTask, output: str) -> int:
    """Exact-match score (0 or 1) of a model continuation of ``task.prompt()``.

    Single-answer kinds: the first number in ``output`` must equal the answer. Multi-needle:
    the first ``len(task.answers)`` distinct numbers must be exactly the answer set (any
    order); a partial list or a wrong extra number scores 0.
    """
    if not isinstance(task, RetrievalTask):
        raise TypeError(f"task must be a RetrievalTask, got {type(task).__name__}")
    numbers = extract_numbers(output)
    if len(task.answers) == 1:
        return int(bool(numbers) and numbers[0] == task.answers[0])
    distinct = list(dict.fromkeys(numbers))[: len(task.answers)]
    return int(set(distinct) == set(task.answers))


# ----------------------------------------------------------------------------- model runs
def generate_answer(
    model: Any,
    tokenizer: Any,
    task: RetrievalTask,
    *,
    max_new_tokens: int | None = None,
    cache: Any | None = None,
) -> str:
    """Greedy continuation (decoded text) of ``task.prompt(tokenizer)``.

    ``cache``: a fresh transformers ``Cache`` to decode with (e.g. a quantised KV cache from
    ``kvlib.make_cache``); ``None`` uses the model's default cache.
    """
    import torch

    if not isinstance(task, RetrievalTask):
        raise TypeError(f"task must be a RetrievalTask, got {type(task).__name__}")
    device = next(model.parameters()).device
    ids = tokenizer(task.prompt(tokenizer), add_special_tokens=False, return_tensors="pt")
    kwargs: dict[str, Any] = {}
    if cache is not None:
        kwargs["past_key_values"] = cache
    with torch.no_grad():
        out = model.generate(
            input_ids=ids["input_ids"].to(device),
            attention_mask=ids["attention_mask"].to(device),
            max_new_tokens=max_new_tokens or task.max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def _iterate(tasks: Sequence[RetrievalTask], progress: bool) -> Iterable[RetrievalTask]:
    if not progress:
        return tasks
    from tqdm.auto import tqdm

    return tqdm(tasks, desc="prompts")


def generate_answers(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[RetrievalTask],
    *,
    max_new_tokens: int | None = None,
    cache_factory: Callable[[], Any] | None = None,
    progress: bool = False,
) -> list[str]:
    """Greedy continuations of each task's prompt, one prompt at a time (no padding effects).

    ``cache_factory()`` returns a fresh ``Cache`` for each prompt; ``None``: default cache.
    """
    return [
        generate_answer(
            model,
            tokenizer,
            t,
            max_new_tokens=max_new_tokens,
            cache=cache_factory() if cache_factory is not None else None,
        )
        for t in _iterate(tasks, progress)
    ]


def run_tasks(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[RetrievalTask],
    *,
    max_new_tokens: int | None = None,
    cache_factory: Callable[[], Any] | None = None,
    inspect_cache: Callable[[Any], dict[str, Any]] | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Per-sample records (task id, kind, length, depth, answer, output, correct) of a run.

    ``inspect_cache(cache)``, called after each prompt with the cache ``cache_factory`` made,
    returns extra fields for that record (e.g. whether the certificate flagged the request).
    Feed the records to ``pandas.DataFrame``.
    """
    if inspect_cache is not None and cache_factory is None:
        raise ValueError("inspect_cache needs a cache_factory (there is no cache to inspect)")
    records = []
    for t in _iterate(tasks, progress):
        cache = cache_factory() if cache_factory is not None else None
        output = generate_answer(model, tokenizer, t, max_new_tokens=max_new_tokens, cache=cache)
        rec: dict[str, Any] = {
            "task_id": t.task_id,
            "kind": t.kind,
            "length": t.length,
            "n_tokens": t.n_tokens,
            "index": t.index,
            "depth": t.depths[0],
            "answer": t.answer,
            "output": output,
            "correct": score(t, output),
        }
        if inspect_cache is not None:
            rec.update(inspect_cache(cache))
        records.append(rec)
    return records


# ----------------------------------------------------------------------------- shared exact prefill
@dataclass
class Prefill:
    """An exact (full-precision) prefill of a batch of equal-length prompts, shared by KV configurations.

    ``kv[layer] = (keys, values)`` ``[B, H_kv, S - 1, d]`` of every prompt token but the last;
    ``last_ids [B, 1]`` is the last prompt token, fed as the first decode step, so that the first
    answer token already reads the configuration's (compressed) cache.
    """

    tasks: list[RetrievalTask]
    input_ids: Any  # [B, S]
    kv: list[tuple[Any, Any]]
    seconds: float = 0.0
    #: the K/V came from the on-disk store of model computations (:mod:`kvlib.hf.memo`); ``seconds`` is then the
    #: time the prefill took when it was computed
    from_store: bool = False

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])

    def rows(self, idx: Sequence[int]) -> Prefill:
        """The sub-batch of rows ``idx`` (views of the same tensors)."""
        import torch

        sel = torch.as_tensor(list(idx), dtype=torch.long)
        return Prefill([self.tasks[i] for i in idx], self.input_ids[sel],
                       [(k[sel], v[sel]) for k, v in self.kv], self.seconds, self.from_store)


def prefill_exact(model: Any, tokenizer: Any, tasks: Sequence[RetrievalTask]) -> Prefill:
    """Run all prompt tokens but the last through ``model`` with an exact cache, batched.

    The prompts must tokenize to the same length (no padding, so no pad token can enter a
    quantised group or a certificate): e.g. passkey prompts of one ``length``. The K/V are the
    model's own (full precision); a configuration then stores them in its format, as KIVI-style
    systems do (prefill attention in full precision, decode reads the quantised cache).
    """
    import torch
    from transformers import DynamicCache

    tasks = list(tasks)
    if not tasks:
        raise ValueError("tasks must not be empty")
    for t in tasks:
        if not isinstance(t, RetrievalTask):
            raise TypeError(f"tasks must hold RetrievalTask objects, got {type(t).__name__}")
    rows = [[int(i) for i in tokenizer(t.prompt(tokenizer), add_special_tokens=False, return_tensors="pt")
             ["input_ids"][0]] for t in tasks]
    lens = sorted({len(r) for r in rows})
    if len(lens) != 1:
        raise ValueError(f"tasks: prompts must have one token length to share a batch, got lengths {lens}")
    if lens[0] < 2:
        raise ValueError("tasks: prompts need at least two tokens")
    from kvlib.hf.memo import memoized

    device = next(model.parameters()).device
    ids = torch.tensor(rows, dtype=torch.long, device=device)

    def compute() -> dict[str, torch.Tensor]:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            # logits_to_keep=1: nobody reads the prompt's logits, and the LM head over every row was a fifth of the
            # prefill's work (49k-word vocabulary); the K/V do not depend on it
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return {f"{i}.{side}": t for i, layer in enumerate(cache.layers)
                for side, t in (("k", layer.keys), ("v", layer.values))}

    # the model's own K/V of these exact token ids: no kvlib format or kernel enters them, so they are kept on disk
    out, seconds, hit = memoized("prefill_exact", model, {"ids": ids}, (compute,), compute)
    kv = [(out[f"{i}.k"].to(device), out[f"{i}.v"].to(device)) for i in range(len(out) // 2)]
    return Prefill(tasks, ids, kv, seconds, hit)


def first_number_done(text: str) -> bool:
    """True once ``text`` holds a complete first number (digits followed by a non-digit)."""
    return re.search(r"\d\D", text) is not None


def decode_from_prefill(
    model: Any,
    tokenizer: Any,
    prefill: Prefill,
    cache: Any,
    *,
    max_new_tokens: int | None = None,
    stop_early: bool = True,
) -> list[str]:
    """Greedy continuations of a shared prefill through ``cache`` (a fresh, empty ``Cache``).

    The prefill K/V are written into ``cache`` layer by layer (``cache.update``: each format
    quantises them as it stores them); then the last prompt token and every generated token are
    decoded one at a time, reading ``cache``. ``max_new_tokens`` defaults to the longest answer's
    digits plus 3. ``stop_early`` (single-answer tasks only): stop once every row has finished its
    first number or emitted EOS; the score reads only the first number, so scores are unchanged.
    """
    import torch

    if not isinstance(prefill, Prefill):
        raise TypeError(f"prefill must be a Prefill, got {type(prefill).__name__}")
    if cache.get_seq_length() != 0:
        raise ValueError("cache must be empty (a fresh cache per decode)")
    if max_new_tokens is None:
        max_new_tokens = max(sum(len(a) for a in t.answers) + 3 for t in prefill.tasks)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    single = all(len(t.answers) == 1 for t in prefill.tasks)
    eos = getattr(tokenizer, "eos_token_id", None)
    for i, (k, v) in enumerate(prefill.kv):
        cache.update(k, v, i)
    pos = prefill.prompt_len - 1
    tok = prefill.input_ids[:, -1:]
    out: list[list[int]] = [[] for _ in range(prefill.n_rows)]
    done = [False] * prefill.n_rows
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = model(input_ids=tok, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([pos], device=tok.device),
                        position_ids=torch.full_like(tok, pos))
            tok = res.logits[:, -1:].argmax(-1)
            pos += 1
            for r, t in enumerate(tok[:, 0].tolist()):
                if done[r]:
                    continue
                if t == eos:
                    done[r] = True
                    continue
                out[r].append(t)
                if stop_early and single and first_number_done(tokenizer.decode(out[r], skip_special_tokens=True)):
                    done[r] = True
            if all(done):
                break
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]
