"""GRPO runs of issue 41 on the continuous engine: ``python -m dev.rlvr_async run --out DIR --ckpt-dir DIR``.

Every arm (bf16 / kv4 / kv4rl rollout pools) trains the same policy on the long-response task
(:mod:`kvlib.rl.longtask`, its difficulty read from :data:`kvlib.rl.longtask.LONG_DIFFICULTY` at run time) with
asynchronous quota-based partial collection (:class:`kvlib.rl.collect.PartialCollector`, KV4-RL App. B: quota
``T x G``, oversubscription ``beta``, age limit ``eta``) on :class:`kvlib.rl.continuous.ContinuousEngine`, whose pool
is ONE fixed KV byte budget (``--kv-budget-gib``) cut into pages of each arm's format (:func:`kvlib.rl.pool.plan_pool`):
a lower-bit format admits more. Only the pool's format differs between arms: the learner (fp32 master weights,
bf16 autocast on CUDA), the bf16 rollout copy of the weights, the GRPOConfig, the problem stream of a seed, the
engine's sampler stream (Philox keyed by the seed: common random numbers across arms) and the evaluator.

Phases:

* ``plan``: the device memory plan (:func:`kvlib.rl.memory.memory_plan`) and each arm's pool under the fixed budget,
  printed; refuses (ValueError, exit 2) a budget whose pool cannot hold the quota ``T x G`` (or
  ``--min-in-flight``) responses of the planned context, or a task whose held-out set cannot be drawn. ``run``
  prints and checks the same plan first.
* ``run``: every (arm, seed) advances from its checkpoint towards the SAME target iteration ``--iterations``: whole
  iterations only (one starts only when its expected time, 1.3x the run's slowest so far, fits before the deadline;
  the clock never cuts one), checkpointed every ``--ckpt-every`` iterations and when it stops (atomically: a
  temporary file and ``os.replace``), resumed bit for bit where the kernels are deterministic (CPU:
  tests/test_rlvr_async.py). A run that reached the target gets its final held-out evaluation (the next call does
  it when no time is left). With ``--gpus K`` (K > 1) one worker process per GPU takes the seeds ``s % K == i``, all
  arms of a seed on one GPU, each run alone on its GPU while it iterates; within a worker the unfinished run with
  the fewest iterations goes next, up to the next multiple of ``--chunk``, so a worker's runs stay within a chunk of
  each other. Every ``--eval-every`` iterations (a milestone) a run is evaluated, its time reserved before the
  iteration that reaches it: should the device time end before every run reaches the target, the arms are compared
  at the last milestone every run passed (the fallback stated with the rules). Each call writes every run's record as
  of its last checkpoint (``record.json`` beside ``state.pt``) into ``--out``, also runs it did not touch.
* ``summary``: the per-run records in ``--out`` turned into the measures the pre-registered rules judge
  (data/claims/rlvr.yml, ``kv4rl-rlvr-async-*``): cumulative rollout and full-iteration time summed over the same
  iterations and seeds (not a mean of ratios), the iteration-time breakdown, per-seed held-out accuracy at the
  target and its paired differences with t intervals.

Per iteration the record (``history``) holds: ``rollout_seconds`` (the collection interval, engine steps synced),
``learner_seconds`` (pi_ref scoring, the update, the weight push to the rollout copy, as in :mod:`kvlib.rl.loop`),
``rest_seconds`` (the iteration's wall minus both: the groups made a batch, rewards, advantages, staleness
statistics), ``iteration_seconds``, ``end_context_mean`` (prompt + response tokens of the trained responses),
``response_length_mean``, ``ref_kl_k3``, the reward, TIS and staleness statistics of
:func:`kvlib.rl.collect.async_grpo_iteration`, and from the engine trace of the interval
(:func:`kvlib.rollout.engine_trace.trace_summary`): mean active batch, mean and max in flight, mean context per
occupied slot-step, the resident KV bytes per decode call (``kappa`` x context, mean) and the page bytes in use (mean
and max). C_KV = V_async / V_sync needs a synchronous counterpart, so it is measured after the target iteration
(``--ckv-updates`` intervals of each schedule with the final weights frozen, same prompts: App. B's method,
:func:`kvlib.rl.collect.collect_frozen`, :func:`kvlib.rollout.engine_trace.concentration_ratio`) for the seeds in
``--ckv-seeds``.

``--device cpu --tiny`` runs the same code on a tiny random Llama (SmolLM2's tokenizer and chat template): a wiring
check and the tests' subject, no numbers to read.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dev.rlvr_runs import (
    CKPT_STATE,
    _device_name,
    _write,
    install_gguf,
    load_policy,
    log,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

ARMS = ("bf16", "kv4", "kv4rl")
RESULTS = Path("data/results/gpu/rlvr_async")
GIB = 2**30
#: the --tiny wiring check's reward: a random-weight model never solves the task, so every group would have equal
#: rewards and no update would move the weights; a response with an even number of characters scores 1 instead
#: (groups then mix rewards, the weights move, and a resumed run has something to reproduce)
TINY_REWARD = "1 when the decoded response has an even number of characters (--tiny only)"
#: what every iteration records (tests check each is present and finite)
RECORD_FIELDS = (
    "rollout_seconds", "learner_seconds", "rest_seconds", "iteration_seconds", "response_length_mean", "ref_kl_k3",
    "reward_mean", "tis_max", "stale_token_fraction", "policy_lag_max", "kv_resident_bytes_mean",
    "page_bytes_used_mean", "page_bytes_used_max", "in_flight_mean", "in_flight_max", "context_mean",
    "end_context_mean", "decode_calls", "engine_fresh",
)


# ------------------------------------------------------------------------------------------------ task
def difficulty(args: argparse.Namespace) -> dict:
    """The long task's setting: :data:`LONG_DIFFICULTY` as it is when this runs, with ``--difficulty`` overrides
    (the tiny wiring check shortens it; a real run records any override)."""
    from kvlib.rl import longtask

    d = dict(longtask.LONG_DIFFICULTY)
    d.update(json.loads(args.difficulty) if args.difficulty else {})
    return d


def shots(args: argparse.Namespace) -> int:
    from kvlib.rl import longtask

    return longtask.LONG_SHOTS if args.shots is None else args.shots


class Task:
    """The problems, prompts and rewards of one call: a pure function of the arguments (every process and every
    call rebuilds the same)."""

    def __init__(self, args: argparse.Namespace, tok: Any) -> None:
        from kvlib.rl import longtask

        self.difficulty = difficulty(args)
        self.tiny = bool(args.tiny)
        self.shots = shots(args)
        self.tok = tok
        self.prompt = longtask.sum_prompt_fn(shots=self.shots, **self.difficulty)
        # make_sum_problems refuses (ValueError) a count the difficulty cannot give distinct problems for
        self.train = longtask.make_sum_problems("train", args.train_pool, seed=0, **self.difficulty)
        self.held = longtask.make_sum_problems("heldout", args.heldout, seed=1, **self.difficulty)
        self._ids: dict[str, list[int]] = {}

    def prompt_ids(self, problem: Any) -> list[int]:
        if problem.uid not in self._ids:
            self._ids[problem.uid] = self.tok(self.prompt(self.tok, problem), add_special_tokens=False)["input_ids"]
        return self._ids[problem.uid]

    def stream(self, seed: int):
        """``new_problem(gid)`` of a seed: epoch ``gid // P`` of a seeded permutation of the P train problems (a
        pure function of ``gid``, as a resumed collector needs)."""
        n = len(self.train)
        perms: dict[int, list[int]] = {}

        def new_problem(gid: int) -> Any:
            e = gid // n
            if e not in perms:
                perms[e] = torch.randperm(n, generator=torch.Generator().manual_seed(1_000_003 * seed + e)).tolist()
            return self.train[perms[e][gid % n]]

        return new_problem

    def max_prompt(self, problems: list | None = None) -> int:
        return max(len(self.prompt_ids(p)) for p in (problems or self.train + self.held))

    def reward(self, text: str, problem: Any) -> float:
        from kvlib.rl import longtask

        if self.tiny:  # see TINY_REWARD
            return float(len(text) % 2 == 0)
        return longtask.sum_reward(text, problem)


# ------------------------------------------------------------------------------------------------ collector state
# (here, not on kvlib.rl.collect.PartialCollector: kept with the one driver that checkpoints a collector)
def forget_trained(col: Any) -> None:
    """Drop the responses of a :class:`kvlib.rl.collect.PartialCollector`'s trained groups (the learner has
    them): a long run then keeps only its live groups in memory. The groups stay (as trained, complete
    placeholders), so group ids keep counting."""
    for g in col.groups:
        if g.trained_at is not None:
            g.responses = []


def collector_state(col: Any) -> dict[str, Any]:
    """What another process needs to continue this collector exactly (between intervals only): the update
    index, every group's creation and training update, the live groups' responses (tokens, behaviour
    log-probabilities, policy versions, counters), the interval records and the engine's policy version and
    counters. ``new_problem`` must be a pure function of the group id: :func:`restore_collector` calls it again
    for the live groups."""
    from dataclasses import asdict

    eng = col.engine
    if eng.in_flight or eng.queue:
        raise RuntimeError("collector_state: the engine must be empty (between collection intervals)")
    live = []
    for g in col.live:
        live.append({"gid": g.gid, "created": g.created, "responses": [
            {"rid": r.rid, "prompt_ids": list(r.prompt_ids), "max_new_tokens": r.max_new_tokens,
             "tokens": list(r.tokens), "logprobs": list(r.logprobs), "versions": list(r.versions),
             "finish": r.finish, "meta": list(r.meta) if isinstance(r.meta, tuple) else r.meta,
             "admissions": r.admissions, "preemptions": r.preemptions, "carried": r.carried,
             "prefill_sampled": list(r.prefill_sampled)} for r in g.responses]})
    return {"T": col.T, "G": col.G, "beta": col.beta, "eta": col.eta, "synchronous": col.synchronous,
            "max_new_tokens": col.max_new_tokens, "update": col.update,
            "groups": [(g.gid, g.created, g.trained_at) for g in col.groups], "live": live,
            "records": [asdict(r) for r in col.records],
            "engine": {"version": eng.version, "n_steps": eng.n_steps, "interval": eng.interval,
                       "admit_seq": eng._admit_seq}}


def restore_collector(col: Any, state: dict[str, Any]) -> None:
    """Continue from :func:`collector_state` (this collector must be fresh: no group yet, same T, G, beta, eta,
    mode and token limit). Trained groups come back as complete placeholders (see :func:`forget_trained`)."""
    from kvlib.rl.collect import Group, IntervalRecord
    from kvlib.rl.continuous import Request

    if col.groups or col.update:
        raise RuntimeError("restore_collector needs a fresh collector")
    mine = {"T": col.T, "G": col.G, "beta": col.beta, "eta": col.eta, "synchronous": col.synchronous,
            "max_new_tokens": col.max_new_tokens}
    theirs = {k: state[k] for k in mine}
    if theirs != mine:
        raise ValueError(f"state: the collector was {theirs}, this one is {mine}")
    live = {d["gid"]: d for d in state["live"]}
    for gid, created, trained_at in state["groups"]:
        if gid != len(col.groups):
            raise ValueError(f"state: group ids must count from 0, got {gid} at {len(col.groups)}")
        if gid not in live:
            if trained_at is None:
                raise ValueError(f"state: group {gid} is untrained but has no responses")
            col.groups.append(Group(gid, None, created, [], trained_at=trained_at))
            continue
        reqs = []
        for d in live[gid]["responses"]:
            meta = tuple(d["meta"]) if isinstance(d["meta"], list) else d["meta"]
            reqs.append(Request(d["rid"], list(d["prompt_ids"]), d["max_new_tokens"], tokens=list(d["tokens"]),
                                logprobs=list(d["logprobs"]), versions=list(d["versions"]), finish=d["finish"],
                                meta=meta, admissions=d["admissions"], preemptions=d["preemptions"],
                                carried=d["carried"], prefill_sampled=list(d["prefill_sampled"])))
        col.groups.append(Group(gid, col.new_problem(gid), created, reqs, trained_at=trained_at))
    col.update = int(state["update"])
    col.records = [IntervalRecord(**r) for r in state["records"]]
    eng, e = col.engine, state["engine"]
    if eng.in_flight or eng.queue or eng.n_steps:
        raise RuntimeError("restore_collector needs a fresh engine")
    eng.version, eng.n_steps, eng.interval, eng._admit_seq = (int(e["version"]), int(e["n_steps"]),
                                                               int(e["interval"]), int(e["admit_seq"]))


# ------------------------------------------------------------------------------------------------ plan
def plans(args: argparse.Namespace, config: Any, n_params: int, prompt_tokens: int) -> dict:
    """The device memory plan and every arm's pool under the one fixed KV budget; ValueError when a pool cannot hold
    the quota (or ``--min-in-flight``) at the planned context, or the budget exceeds what the device leaves."""
    from kvlib.rl.memory import memory_plan
    from kvlib.rl.pool import plan_pool

    context = prompt_tokens + args.max_new_tokens
    device_bytes = int(args.device_gib * GIB)
    mp = memory_plan("bf16", config, n_params, slots=args.slots, prompt_tokens=prompt_tokens,
                     max_new_tokens=args.max_new_tokens, micro_batch=args.micro_batch, device_bytes=device_bytes,
                     staging=args.staging, prefill_tokens=args.prefill_tokens)
    budget = int(args.kv_budget_gib * GIB)
    lines = [mp.describe(), f"fixed KV budget {budget / GIB:.3f} GiB for every arm (the device leaves "
                            f"{mp.pool.budget_bytes / GIB:.3f} GiB for pages at {args.slots} slots)"]
    if budget > mp.pool.budget_bytes:
        raise ValueError(f"--kv-budget-gib={args.kv_budget_gib}: more than the {mp.pool.budget_bytes / GIB:.3f} GiB "
                         f"the memory plan leaves for KV pages on a {args.device_gib} GiB device")
    quota = args.T * args.G
    live = int(math.floor(args.T * (1 + args.beta))) * args.G
    need = max(quota, args.min_in_flight)
    if live < args.min_in_flight:
        raise ValueError(f"--min-in-flight={args.min_in_flight}: the pool of live groups holds only "
                         f"floor(T (1 + beta)) x G = {live} responses")
    pools, fails = {}, []
    for arm in args.arm_list:
        p = plan_pool(arm, config, budget_bytes=budget, slots=args.slots, staging=args.staging, max_context=context)
        c = p.concurrency_at(context)
        pools[arm] = p
        lines.append(f"  {p.describe()}\n    => {c} responses of {context} positions in flight at once "
                     f"({p.requests_at(context)} by pages, {p.slots} slots); quota T x G = {quota}, live "
                     f"floor(T (1 + beta)) x G = {live}")
        if c < need:
            fails.append(f"{arm}: {c} responses of {context} positions (needs {need}: the quota T x G = {quota}"
                         + (f", --min-in-flight {args.min_in_flight}" if args.min_in_flight > quota else "") + ")")
    text = "\n".join(lines)
    print(text, flush=True)
    if fails:
        raise ValueError(f"--kv-budget-gib={args.kv_budget_gib}: the pool cannot hold the quota at the planned "
                         f"context: {'; '.join(fails)}")
    return {"memory_plan": mp.as_dict(), "pools": {a: p.as_dict() for a, p in pools.items()}, "context": context,
            "prompt_tokens": prompt_tokens, "text": text, "pool_plans": pools}


# ------------------------------------------------------------------------------------------------ evaluator
def evaluate(model16: Any, tok: Any, task: Task, args: argparse.Namespace) -> dict:
    """The common evaluator: greedy decoding of the held-out problems, bf16 weights, bf16 cache (static engine),
    the same for every arm."""
    from kvlib.rl.engine import sample_static

    correct, lengths, t0 = [], [], time.perf_counter()
    for s in range(0, len(task.held), args.eval_batch):
        part = task.held[s:s + args.eval_batch]
        r = sample_static(model16, tok, [task.prompt_ids(p) for p in part], fmt="bf16", greedy=True,
                          max_new_tokens=args.max_new_tokens, generator=torch.Generator().manual_seed(0),
                          eos_token_id=tok.eos_token_id)
        correct += [int(task.reward(t, p) > 0) for t, p in zip(r.texts, part, strict=True)]
        lengths += r.lengths.tolist()
    return {"accuracy": sum(correct) / max(len(correct), 1), "correct": correct, "uids": [p.uid for p in task.held],
            "n": len(correct), "response_length_mean": sum(lengths) / max(len(lengths), 1),
            "seconds": time.perf_counter() - t0,
            "evaluator": "greedy, bf16 weights, bf16 static cache (kvlib.rl.engine.sample_static), every arm"}


# ------------------------------------------------------------------------------------------------ one run
def grpo_config(args: argparse.Namespace):
    from kvlib.rl.loop import GRPOConfig

    return GRPOConfig(group_size=args.G, prompts_per_iteration=args.T, max_new_tokens=args.max_new_tokens, lr=args.lr,
                      beta=args.kl_beta, tis_cap=args.tis_cap, micro_batch=args.micro_batch,
                      score_micro_batch=args.score_micro_batch,
                      learner_autocast=None if args.device == "cpu" else "bfloat16", reuse_old_logp=True)


def run_dir(ckpt: str | Path, arm: str, seed: int) -> Path:
    return Path(ckpt) / f"{arm}_seed{seed}"


class Run:
    """One (arm, seed): its policy, reference, optimizer, engine and collector, loaded from its checkpoint or
    fresh, advanced by whole iterations, checkpointed."""

    def __init__(self, arm: str, seed: int, args: argparse.Namespace, base: Any, tok: Any, task: Task,
                 plan: dict, initial_eval: dict) -> None:
        from kvlib.rl.collect import PartialCollector
        from kvlib.rl.continuous import ContinuousEngine
        from kvlib.rl.loop import frozen_copy, sync_weights

        self.arm, self.seed, self.args, self.tok, self.task = arm, seed, args, tok, task
        self.cfg = grpo_config(args)
        torch.manual_seed(seed)
        self.policy = frozen_copy(base)  # the shared initial weights; trained in place from here
        self.policy.requires_grad_(True)
        self.ref = frozen_copy(base)
        self.roll16 = frozen_copy(base).to(torch.bfloat16)
        self.opt = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=self.cfg.lr,
                                     weight_decay=self.cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(seed)
        self.ckdir = run_dir(args.ckpt_dir, arm, seed)
        self.path = Path(args.out) / "rlvr_async" / f"{arm}_seed{seed}.json"
        pool = plan["pool_plans"][arm]
        self.pool, self.kappa = pool, pool.kappa
        self.engine = ContinuousEngine(self.roll16, pool, eos_token_id=tok.eos_token_id, seed=seed,
                                       prefill_tokens=args.prefill_tokens)
        self.collector = PartialCollector(self.engine, task.stream(seed), task.prompt_ids, T=args.T, G=args.G,
                                          max_new_tokens=args.max_new_tokens, beta=args.beta, eta=args.eta)
        self.rec: dict[str, Any] = {
            "arm": arm, "seed": seed, "status": "running", "iterations_planned": args.iterations,
            "iterations_done": 0, "config": asdict(self.cfg), "difficulty": task.difficulty, "shots": task.shots,
            "collection": {"T": args.T, "G": args.G, "beta": args.beta, "eta": args.eta, "mode": "asynchronous"},
            "pool": {k: v for k, v in plan["pools"][arm].items()}, "context_planned": plan["context"],
            "kv_budget_bytes": int(args.kv_budget_gib * GIB),
            "model": "tiny random Llama (wiring check)" if args.tiny else
            "SmolLM2-135M-Instruct (shipped Q4_1 GGUF, dequantised), fp32 master weights",
            "rollout": f"bf16 copy of the weights, kvlib.rl.continuous.ContinuousEngine over {arm} pages",
            "reward": TINY_REWARD if args.tiny else "exact match of the last box (kvlib.rl.longtask.sum_reward)",
            "history": {}, "eval": {"initial": initial_eval, "curve": []}, "segments": [], "device": None}
        self.fresh_engine = True
        if (self.ckdir / CKPT_STATE).is_file():
            st = torch.load(self.ckdir / CKPT_STATE, map_location="cpu", weights_only=False)
            old = json.loads(st["record"])
            if (old["arm"], old["seed"], old["config"]) != (arm, seed, self.rec["config"]) or \
                    old["collection"] != self.rec["collection"] or old["difficulty"] != task.difficulty:
                raise ValueError(f"{self.ckdir}: its run ({old['arm']} seed {old['seed']}, {old['config']}, "
                                 f"{old['collection']}, {old['difficulty']}) is not this call's")
            self.policy.load_state_dict(st["policy"])
            self.opt.load_state_dict(st["optimizer"])
            self.gen.set_state(st["generator"])
            set_rng_state(st["rng"], args.device)
            sync_weights(self.policy, self.roll16)  # the rollout copy is the policy cast to bf16, as after an update
            restore_collector(self.collector, st["collector"])
            if old["iterations_done"] > args.iterations:
                raise ValueError(f"{self.ckdir}: {old['iterations_done']} iterations done, past the target "
                                 f"--iterations={args.iterations} (every arm must stop at the same one)")
            if old["iterations_done"] < args.iterations and "final" in old["eval"]:  # the target was raised
                old["eval"]["curve"].append({"iteration": old["iterations_done"], **old["eval"].pop("final")})
                old["status"] = "running"
            old["iterations_planned"] = args.iterations
            self.rec = old
            log(f"{arm} seed {seed}: resumed from {self.ckdir} at iteration {old['iterations_done']}")
        self.rec["device"] = _device_name(args.device)

    @property
    def done(self) -> int:
        return self.rec["iterations_done"]

    @property
    def slowest(self) -> float | None:
        t = self.rec["history"].get("iteration_seconds")
        return max(t) if t else None

    def begin_segment(self) -> dict:
        from kvlib.publish.provenance import git_commit

        seg = {"segment": len(self.rec["segments"]), "commit": git_commit(), "device": _device_name(self.args.device),
               "started": _dt.datetime.now(_dt.UTC).isoformat(), "first_iteration": self.done, "iterations": 0}
        self.rec["segments"].append(seg)
        return seg

    def iterate(self) -> dict:
        """One GRPO iteration: collect the quota, update, record."""
        from kvlib.rl.collect import async_grpo_iteration
        from kvlib.rollout.engine_trace import trace_summary

        eng, cuda = self.engine, self.args.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        m = async_grpo_iteration(self.policy, self.ref, self.opt, self.tok, self.collector, cfg=self.cfg,
                                 generator=self.gen, reward_fn=self.task.reward, pad_token_id=self.tok.pad_token_id
                                 if self.tok.pad_token_id is not None else self.tok.eos_token_id,
                                 eos_token_id=self.tok.eos_token_id)
        if cuda:
            torch.cuda.synchronize()
        full = time.perf_counter() - t0
        rollout = self.collector.records[-1].seconds
        tr = eng.trace
        u = self.collector.update - 1
        ends = [r.context for g in self.collector.groups if g.trained_at == u for r in g.responses]
        m.update(rollout_seconds=rollout, rest_seconds=full - rollout - m["learner_seconds"], iteration_seconds=full,
                 end_context_mean=sum(ends) / len(ends),
                 engine_fresh=float(self.fresh_engine), decode_calls=float(len(tr)),
                 max_memory_allocated_gib=torch.cuda.max_memory_allocated() / GIB if cuda else 0.0)
        if tr:
            s = trace_summary(tr, kappa=self.kappa)
            m.update(kv_resident_bytes_mean=s["mean_volume"], context_mean=s["mean_context"],
                     in_flight_mean=s["mean_batch"], in_flight_max=float(max(x["batch"] for x in tr)),
                     page_bytes_used_mean=float(sum(x["page_bytes_used"] for x in tr) / len(tr)),
                     page_bytes_used_max=float(max(x["page_bytes_used"] for x in tr)),
                     graphed_fraction=sum(x["graphed"] for x in tr) / len(tr))
        else:  # the quota was already complete among the waiting groups: the interval decoded nothing
            m.update(kv_resident_bytes_mean=0.0, context_mean=0.0, in_flight_mean=0.0, in_flight_max=0.0,
                     page_bytes_used_mean=0.0, page_bytes_used_max=0.0, graphed_fraction=0.0)
        # the interval's rows are summarised: drop them (the collector counts from the engine's list per interval)
        eng.trace.clear()
        eng.prefills.clear()
        forget_trained(self.collector)
        self.fresh_engine = False
        bad = {k: v for k, v in m.items() if not math.isfinite(v)}
        if bad:
            raise FloatingPointError(f"{self.arm} seed {self.seed} iteration {self.done}: non-finite {bad}")
        h = self.rec["history"]
        h.setdefault("iteration", []).append(self.done)
        for k, v in m.items():
            h.setdefault(k, []).append(float(v))
        self.rec["iterations_done"] += 1
        self.rec["decode_paths"] = sorted(eng.paths)
        self.rec["graph_error"] = eng.graph_error
        return m

    def evaluate(self, tag: str) -> dict:
        from kvlib.rl.loop import sync_weights

        sync_weights(self.policy, self.roll16)
        ev = evaluate(self.roll16, self.tok, self.task, self.args)
        if tag == "final":
            self.rec["eval"]["final"] = ev
            self.rec["status"] = "complete"
        else:
            self.rec["eval"]["curve"].append({"iteration": self.done, **ev})
        return ev

    def free_engine(self) -> None:
        """Release the engine (and its KV pool) once the run is complete and checkpointed."""
        self.collector = self.engine = None
        gc.collect()
        if self.args.device == "cuda":
            torch.cuda.empty_cache()

    def save(self, started: _dt.datetime, checkpoint: bool, record: bool = False) -> float:
        from kvlib.publish.provenance import provenance

        self.rec["provenance"] = provenance({k: v for k, v in vars(self.args).items() if k != "arm_list"}, started)
        sec = 0.0
        if checkpoint:
            sec = save_checkpoint(self.ckdir, policy=self.policy, opt=self.opt, gen=self.gen,
                                  rng=rng_state(self.args.device), rec=self.rec,
                                  extra={"collector": collector_state(self.collector)})
            _write(self.ckdir / "record.json", self.rec)  # what every later call reports for this run
        if record:
            _write(self.ckdir / "record.json", self.rec)
        _write(self.path, self.rec)
        return sec

    def measure_ckv(self) -> dict:
        """C_KV with the final weights frozen: ``--ckv-updates`` intervals of each schedule on fresh engines over
        the same pool and the seed's prompts (App. B's trace measurement)."""
        from kvlib.rl.collect import collect_frozen
        from kvlib.rollout.engine_trace import concentration_ratio, trace_summary

        a = self.args
        out = {}
        for name, sync in (("async", False), ("sync", True)):
            col = collect_frozen(self.roll16, self.pool, self.task.stream(10_000 + self.seed),
                                 self.task.prompt_ids, eos_token_id=self.tok.eos_token_id, T=a.T, G=a.G,
                                 max_new_tokens=a.max_new_tokens, updates=a.ckv_updates, synchronous=sync, beta=a.beta,
                                 eta=a.eta, seed=self.seed, prefill_tokens=a.prefill_tokens)
            out[name] = col.engine.trace
            del col
            gc.collect()
        warm = 1 if a.ckv_updates > 2 else 0
        r = concentration_ratio(out["async"], out["sync"], warmup=warm)
        r.update({f"{k}_summary": trace_summary(v, warmup=warm, kappa=self.kappa) for k, v in out.items()},
                 updates=a.ckv_updates, warmup=warm, iteration=self.done)
        return r


# ------------------------------------------------------------------------------------------------ worker
def load_base(args: argparse.Namespace) -> tuple[Any, Any]:
    return load_policy(args.device, args.tiny)


def shared_setup(args: argparse.Namespace, started: _dt.datetime) -> tuple[Any, Any, Task, dict, dict]:
    """Model, tokenizer, task, plan (printed, checked) and the initial policy's evaluation (once per experiment:
    every arm and seed starts from the same weights; kept in the checkpoint folder)."""
    from kvlib.publish.provenance import provenance

    base, tok = load_base(args)
    task = Task(args, tok)
    n_params = sum(p.numel() for p in base.parameters())
    plan = plans(args, base.config, n_params, task.max_prompt())
    ck = Path(args.ckpt_dir)
    f = ck / "initial_eval.json"
    if f.is_file():
        ev0 = json.loads(f.read_text())
        if ev0["uids"] != [p.uid for p in task.held]:
            raise ValueError(f"{f}: its held-out problems are not this call's")
    else:
        from kvlib.rl.loop import frozen_copy

        ev0 = evaluate(frozen_copy(base).to(torch.bfloat16), tok, task, args)
        ev0["provenance"] = provenance({k: v for k, v in vars(args).items() if k != "arm_list"}, started)
        _write(f, ev0)
        log(f"initial policy: held-out accuracy {ev0['accuracy']:.3f} on {ev0['n']} problems ({ev0['seconds']:.1f} s)")
    _write(Path(args.out) / "rlvr_async" / "initial_eval.json", ev0)
    _write(Path(args.out) / "rlvr_async" / "plan.json", {k: v for k, v in plan.items() if k != "pool_plans"}
           | {"provenance": provenance({k: v for k, v in vars(args).items() if k != "arm_list"}, started)})
    return base, tok, task, plan, ev0


def work(args: argparse.Namespace, runs: list[tuple[str, int]], deadline: float) -> int:
    """Advance ``runs`` (this process's) towards the target, fewest iterations first, ``--chunk`` at a time, each
    iteration started only when it fits before ``deadline``; returns the number of runs not complete."""
    started = _dt.datetime.now(_dt.UTC)
    base, tok, task, plan, ev0 = shared_setup(args, started)
    eval_est = 1.5 * ev0["seconds"] + 5
    first_est = args.first_iteration_s
    state = {r: _meta(args, *r) for r in runs}
    blocked: set = set()
    calls: dict = {}  # iterations each run made in this call (--segment-iterations)
    while True:
        todo = [r for r in runs if (state[r]["status"] != "complete" or state[r]["iterations_done"] < args.iterations)
                and r not in blocked]
        if not todo:
            break
        arm, seed = min(todo, key=lambda r: (state[r]["iterations_done"], ARMS.index(r[0]), r[1]))
        # to the next multiple of --chunk: the runs of a worker stay within one chunk of each other, at milestones
        cap = args.chunk - state[(arm, seed)]["iterations_done"] % args.chunk
        if args.segment_iterations is not None:
            cap = min(cap, args.segment_iterations - calls.get((arm, seed), 0))
        if cap <= 0:
            blocked.add((arm, seed))  # its --segment-iterations in this call are spent
            continue
        run = Run(arm, seed, args, base, tok, task, plan, ev0)
        seg = run.begin_segment()
        ck_est = 0.0
        n = 0
        while run.done < args.iterations and n < cap:
            est = 1.3 * (run.slowest or first_est)
            milestone = args.eval_every and (run.done + 1) % args.eval_every == 0 and run.done + 1 < args.iterations
            if time.time() + est + ck_est + (eval_est if milestone else 0) + 2 > deadline:
                break
            m = run.iterate()
            n += 1
            seg["iterations"] = n
            log(f"{arm} s{seed} it {run.done - 1}: reward {m['reward_mean']:.3f} len {m['response_length_mean']:.0f} "
                f"refKL {m['ref_kl_k3']:.2e} rollout {m['rollout_seconds']:.2f}s learner {m['learner_seconds']:.2f}s "
                f"rest {m['rest_seconds']:.2f}s in flight {m['in_flight_mean']:.0f}/{m['in_flight_max']:.0f} "
                f"KV {m['kv_resident_bytes_mean'] / GIB:.3f} GiB stale {m['stale_token_fraction']:.2f}")
            last_ck = run.done % args.ckpt_every == 0
            if last_ck:
                ck_est = max(ck_est, 2 * run.save(started, checkpoint=True) + 1)
            else:
                run.save(started, checkpoint=False)
            if milestone:  # its time was reserved above
                run.evaluate("curve")
        if run.done >= args.iterations and "final" not in run.rec["eval"] and time.time() + eval_est < deadline:
            ev = run.evaluate("final")
            log(f"{arm} seed {seed}: complete at iteration {run.done}; held-out {ev0['accuracy']:.3f} -> "
                f"{ev['accuracy']:.3f}")
        run.rec["status"] = "complete" if "final" in run.rec["eval"] else (
            "evaluating" if run.done >= args.iterations else "running")
        ck_sec = run.save(started, checkpoint=True)
        seg["checkpoint_seconds"] = ck_sec
        run.save(started, checkpoint=False)
        if run.rec["status"] == "complete" and "ckv" not in run.rec and args.ckv_updates and \
                seed in args.ckv_seed_list:
            # two collections per interval at most, each about one rollout
            if time.time() + 2.6 * max(run.rec["history"]["rollout_seconds"]) * args.ckv_updates + 5 < deadline:
                run.free_engine()  # its pool: the measurement allocates its own, one schedule at a time
                run.rec["ckv"] = run.measure_ckv()
                run.save(started, checkpoint=False, record=True)
                log(f"{arm} seed {seed}: C_KV {run.rec['ckv']['c_kv']:.3f} {run.rec['ckv']['c_kv_ci']}")
            else:
                log(f"{arm} seed {seed}: no time left for the C_KV measurement in this call (not repeated later)")
        state[(arm, seed)] = {"status": run.rec["status"], "iterations_done": run.done}
        calls[(arm, seed)] = calls.get((arm, seed), 0) + n
        if n == 0 and run.rec["status"] != "complete":
            blocked.add((arm, seed))  # no time left for its next step in this call
        del run
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    left = [r for r in runs if state[r]["status"] != "complete" or state[r]["iterations_done"] < args.iterations]
    for arm, seed in left:
        log(f"{arm} seed {seed}: {state[(arm, seed)]['status']} at iteration {state[(arm, seed)]['iterations_done']} "
            f"of {args.iterations} (continues from its checkpoint in the next call)")
    return len(left)


def _meta(args: argparse.Namespace, arm: str, seed: int) -> dict:
    f = run_dir(args.ckpt_dir, arm, seed) / "meta.json"
    if f.is_file() and (f.parent / CKPT_STATE).is_file():
        return json.loads(f.read_text())
    return {"status": "running", "iterations_done": 0}


def run_all(args: argparse.Namespace) -> int:
    """``run``: the plan, then every (arm, seed) advanced (in this process, or one worker per GPU)."""
    deadline = args.deadline or (time.time() + args.budget_s)
    runs = [(a, s) for s in args.seed_list for a in args.arm_list]
    if args.gpus <= 1:
        left = work(args, runs, deadline)
    else:
        started = _dt.datetime.now(_dt.UTC)
        shared_setup(args, started)  # plan and initial evaluation once, before the workers (on GPU 0)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        procs = []
        for i in range(args.gpus):
            mine = [f"{a}:{s}" for a, s in runs if s % args.gpus == i]
            if not mine:
                continue
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i), "OMP_NUM_THREADS": "2"}
            logf = open(Path(args.out) / "rlvr_async" / f"worker{i}.log", "w")  # noqa: SIM115 - closed below
            cmd = [sys.executable, "-m", "dev.rlvr_async", "worker", *args.forward, "--runs", ",".join(mine),
                   "--deadline", str(deadline)]
            procs.append((i, subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env), logf))
        left = 0
        for i, p, logf in procs:
            try:
                rc = p.wait(timeout=max(1.0, deadline + args.exit_grace_s - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()  # our own child; its runs keep their last checkpoint
                rc = p.wait()
            logf.close()
            tail = (Path(args.out) / "rlvr_async" / f"worker{i}.log").read_text().splitlines()[-4:]
            log(f"worker {i}: exit {rc}\n" + "\n".join(f"    {ln}" for ln in tail))
            left += rc if rc >= 0 else 99
    # every run's record as of its last checkpoint (also those this call did not touch), so that each call's results
    # and summary cover the whole experiment; iterations after a checkpoint are redone by the next call
    for a, s in runs:
        f = run_dir(args.ckpt_dir, a, s) / "record.json"
        if f.is_file():
            _write(Path(args.out) / "rlvr_async" / f"{a}_seed{s}.json", json.loads(f.read_text()))
    done = [m for m in (_meta(args, a, s) for a, s in runs)
            if m["status"] == "complete" and m["iterations_done"] == args.iterations]
    log(f"{len(done)} of {len(runs)} runs complete at iteration {args.iterations}")
    print("SUMMARY:", "PASS (all complete)" if len(done) == len(runs) else
          f"PARTIAL ({len(runs) - len(done)} runs continue in the next call)")
    return 0 if len(done) == len(runs) else 3


# ------------------------------------------------------------------------------------------------ summary
def eval_at(rec: dict, n: int) -> dict | None:
    """A run's held-out evaluation at iteration ``n``: its final one when it stopped there, else its milestone
    evaluation at ``n`` (``--eval-every``), else None."""
    ev = rec["eval"]
    if rec["iterations_done"] == n and "final" in ev:
        return ev["final"]
    return next((e for e in ev.get("curve", []) if e["iteration"] == n), None)


def summarize(folder: str | Path, iterations: int | None = None) -> dict:
    """The measures of the pre-registered rules from the run records in ``folder`` (``DIR/rlvr_async/*.json`` or
    the folder itself): per arm, cumulative rollout / learner / rest / full-iteration seconds summed over
    iterations ``[0, N)`` of every seed that reached ``N`` (N: ``iterations``, default the common target), the
    speedups over bf16 as ratios of those sums over the seeds every arm completed, with a percentile bootstrap
    over seeds (resampled as pairs); per seed the held-out accuracy at N under the common evaluator and the paired
    differences against bf16 (mean, t interval)."""
    import numpy as np
    from scipy import stats

    f = Path(folder)
    f = f / "rlvr_async" if (f / "rlvr_async").is_dir() else f
    recs = [json.loads(p.read_text()) for p in sorted(f.glob("*_seed*.json"))]
    runs = {(r["arm"], r["seed"]): r for r in recs}
    N = iterations or min((r["iterations_planned"] for r in recs), default=0)
    evals = {k: e for k, r in runs.items() if (e := eval_at(r, N)) is not None}
    ok = {k: r for k, r in runs.items() if r["iterations_done"] >= N and k in evals}
    arms = [a for a in ARMS if any(k[0] == a for k in ok)]
    seeds = sorted(set.intersection(*[{s for (a, s) in ok if a == arm} for arm in arms])) if arms else []
    keys = ("rollout_seconds", "learner_seconds", "rest_seconds", "iteration_seconds")
    per = {arm: {s: {k: float(sum(ok[(arm, s)]["history"][k][:N])) for k in keys} for s in seeds} for arm in arms}
    out: dict[str, Any] = {"iterations": N, "seeds": seeds, "arms": {}, "incomplete": sorted(
        f"{a} s{s} ({r['iterations_done']} it, {r['status']})" for (a, s), r in runs.items() if (a, s) not in ok)}
    rng = np.random.default_rng(0)
    boot = rng.integers(0, len(seeds), size=(4000, len(seeds))) if seeds else None
    for arm in arms:
        tot = {k: sum(per[arm][s][k] for s in seeds) for k in keys}
        row: dict[str, Any] = {f"cumulative_{k}": v for k, v in tot.items()}
        row.update({f"share_{k.split('_')[0]}": tot[k] / tot["iteration_seconds"] for k in keys[:3]}
                   if tot["iteration_seconds"] else {})
        acc = {s: 100 * evals[(arm, s)]["accuracy"] for s in seeds}
        row["heldout_accuracy_pp"] = acc
        row["ckv"] = {s: ok[(arm, s)]["ckv"]["c_kv"] for s in seeds if "ckv" in ok[(arm, s)]}
        if "bf16" in per and arm != "bf16" and seeds:
            for k, name in (("rollout_seconds", "rollout"), ("iteration_seconds", "full_iteration")):
                b = np.array([per["bf16"][s][k] for s in seeds])
                a = np.array([per[arm][s][k] for s in seeds])
                row[f"{name}_speedup"] = float(b.sum() / a.sum())
                bs = b[boot].sum(1) / a[boot].sum(1)
                row[f"{name}_speedup_ci95"] = (float(np.quantile(bs, 0.025)), float(np.quantile(bs, 0.975)))
            d = np.array([acc[s] - 100 * evals[("bf16", s)]["accuracy"] for s in seeds])
            row["minus_bf16_pp"] = {"diffs": d.tolist(), "mean": float(d.mean())}
            if len(d) >= 2:
                ci = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=d.std(ddof=1) / math.sqrt(len(d))) \
                    if d.std(ddof=1) > 0 else (float(d.mean()), float(d.mean()))
                row["minus_bf16_pp"]["ci95"] = (float(ci[0]), float(ci[1]))
        late = range(N - max(1, N // 4), N)
        row["learner_share_late"] = (sum(ok[(arm, s)]["history"]["learner_seconds"][i] for s in seeds for i in late)
                                     / max(sum(ok[(arm, s)]["history"]["iteration_seconds"][i] for s in seeds
                                               for i in late), 1e-300)) if seeds else math.nan
        row["end_context_mean"] = float(np.mean([x for s in seeds for x in ok[(arm, s)]["history"]
                                                 ["end_context_mean"][:N]])) if seeds else math.nan
        for k in ("in_flight_mean", "context_mean"):  # over every decode call of the run, seeds pooled
            calls = [(c, x) for s in seeds for c, x in zip(ok[(arm, s)]["history"]["decode_calls"][:N],
                                                             ok[(arm, s)]["history"][k][:N], strict=True)]
            w = sum(c for c, _ in calls)
            row[k] = sum(c * x for c, x in calls) / w if w else math.nan
        row["heldout_gain_pp"] = float(np.mean([acc[s] - 100 * ok[(arm, s)]["eval"]["initial"]["accuracy"]
                                                for s in seeds])) if seeds else math.nan
        out["arms"][arm] = row
    if "kv4" in out["arms"] and "kv4rl" in out["arms"] and len(seeds) >= 2:
        d = np.array([out["arms"]["kv4"]["heldout_accuracy_pp"][s] - out["arms"]["kv4rl"]["heldout_accuracy_pp"][s]
                      for s in seeds])
        sd = d.std(ddof=1)
        ci = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=sd / math.sqrt(len(d))) if sd > 0 else \
            (d.mean(), d.mean())
        out["kv4_minus_kv4rl_pp"] = {"diffs": d.tolist(), "mean": float(d.mean()), "ci95": (float(ci[0]),
                                                                                           float(ci[1]))}
    out["measures"] = claim_measures(out, {k: evals[k] for k in ok})
    return out


#: the claims of data/claims/rlvr.yml these runs judge (registered before the runs; the chapter judges them with
#: :func:`claim_measures`'s values)
CLAIMS = ("kv4rl-rlvr-async-rollout-speedup", "kv4rl-rlvr-full-iteration-speedup", "kv4rl-rlvr-iteration-breakdown",
          "kv4rl-rlvr-async-accuracy-parity", "kv4rl-rlvr-async-kv4-deficit")


def claim_measures(s: dict, evals: dict) -> dict[str, dict]:
    """``{claim id: {"measured", "n", "given"}}`` for :func:`kvlib.publish.verdicts.judge`, from :func:`summarize`'s
    numbers and the evaluations at N of the runs it compared; ``measured`` None where an arm is missing (the verdict
    then says not measured)."""
    arms, n = s["arms"], len(s["seeds"])
    b, r, k = arms.get("bf16", {}), arms.get("kv4rl", {}), arms.get("kv4", {})
    regime = {"bf16_in_flight_mean": b.get("in_flight_mean", math.nan),
              "bf16_end_context_mean": b.get("end_context_mean", math.nan)}
    held = min((e.get("n", 0) for e in evals.values()), default=0)
    learned = {"heldout_problems": held, "bf16_heldout_gain_pp": b.get("heldout_gain_pp", math.nan)}
    ci = (lambda a: (a.get("minus_bf16_pp") or {}).get("ci95"))
    return {
        "kv4rl-rlvr-async-rollout-speedup": {"measured": r.get("rollout_speedup_ci95"), "n": n, "given": regime},
        "kv4rl-rlvr-full-iteration-speedup": {"measured": r.get("full_iteration_speedup_ci95"), "n": n,
                                              "given": regime},
        "kv4rl-rlvr-iteration-breakdown": {
            "measured": {"bf16_rollout_share": b["share_rollout"], "kv4rl_learner_share_late": r["learner_share_late"]}
            if "share_rollout" in b and "learner_share_late" in r else None, "n": n, "given": regime},
        "kv4rl-rlvr-async-accuracy-parity": {"measured": ci(r), "n": n, "given": learned},
        "kv4rl-rlvr-async-kv4-deficit": {
            "measured": {"kv4_minus_bf16": ci(k), "kv4_minus_kv4rl": s["kv4_minus_kv4rl_pp"]["ci95"]}
            if ci(k) and "kv4_minus_kv4rl_pp" in s else None, "n": n, "given": learned},
    }


# ------------------------------------------------------------------------------------------------ CLI
def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"--seeds: distinct non-negative integers or ranges a-b, got {text!r}")
    return out


def _none_or(kind):
    return lambda s: None if s.lower() == "none" else kind(s)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("plan", "run", "worker", "summary"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/rlvr_async_out"))
    ap.add_argument("--ckpt-dir", default="/tmp/kvlib_rlvr_async_ckpt", help="checkpoints (kept between calls)")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama (wiring check)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0-7", help="seeds, e.g. 0-7 (dev/results/rlvr_power.json: 8)")
    ap.add_argument("--iterations", type=int, default=150, help="the target iteration N of every run")
    ap.add_argument("--T", type=int, default=32, help="quota: complete groups per update")
    ap.add_argument("--G", type=int, default=8, help="responses per group")
    ap.add_argument("--beta", type=float, default=3.0, help="oversubscription: floor(T (1 + beta)) live groups")
    ap.add_argument("--eta", type=int, default=4, help="age limit (updates) of an unfinished group")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--kv-budget-gib", type=float, default=16.0, help="the one KV byte budget of every arm")
    ap.add_argument("--device-gib", type=float, default=None, help="device memory for the plan (default: the GPU's)")
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--staging", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--min-in-flight", type=int, default=512, help="the plan refuses pools that hold fewer")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--kl-beta", type=float, default=1e-3)
    ap.add_argument("--tis-cap", type=_none_or(float), default=2.0)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--score-micro-batch", type=_none_or(int), default=128)
    ap.add_argument("--shots", type=int, default=None, help="worked examples (default kvlib.rl.longtask.LONG_SHOTS)")
    ap.add_argument("--difficulty", default=None, help="JSON overrides of LONG_DIFFICULTY (recorded)")
    ap.add_argument("--train-pool", type=int, default=128)
    ap.add_argument("--heldout", type=int, default=512)
    ap.add_argument("--eval-batch", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=0, help="learning-curve evaluations (0: initial and final)")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--deadline", type=float, default=None, help="absolute time.time() to stop iterating by")
    ap.add_argument("--exit-grace-s", type=float, default=20.0)
    ap.add_argument("--first-iteration-s", type=float, default=30.0, help="expected time of a run's first iteration")
    ap.add_argument("--chunk", type=int, default=25, help="iterations of one run before the next run's turn")
    ap.add_argument("--ckpt-every", type=int, default=10, help="also at every stop (a SmolLM2 checkpoint is ~1.6 GB)")
    ap.add_argument("--segment-iterations", type=_none_or(int), default=None,
                    help="at most this many iterations per run in this call (tests; a later call continues)")
    ap.add_argument("--gpus", type=int, default=1, help="worker processes, one per GPU")
    ap.add_argument("--ckv-updates", type=int, default=6, help="frozen-policy intervals per schedule for C_KV")
    ap.add_argument("--ckv-seeds", default="0", help="seeds whose runs measure C_KV at the end")
    ap.add_argument("--runs", default=None, help="worker: arm:seed,...")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.arm_list = tuple(a for a in args.arms.split(",") if a)
    bad = sorted(set(args.arm_list) - set(ARMS))
    if bad or not args.arm_list:
        raise ValueError(f"--arms: unknown arm(s) {bad}; arms are {ARMS}")
    args.seed_list = _seeds(args.seeds)
    args.ckv_seed_list = _seeds(args.ckv_seeds) if args.ckv_seeds else []
    for name in ("iterations", "T", "G", "eta", "max_new_tokens", "slots", "staging", "prefill_tokens", "train_pool",
                 "heldout", "eval_batch", "chunk", "ckpt_every", "gpus", "micro_batch"):
        v = getattr(args, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
    if args.G < 2:
        raise ValueError(f"--G must be >= 2 (a group's advantages need two responses), got {args.G}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device")
    if args.device_gib is None:
        args.device_gib = torch.cuda.get_device_properties(0).total_memory / GIB if args.device == "cuda" else 141.0
    install_gguf(args.gguf)
    # what a worker process is started with: this call's arguments less the phase
    args.forward = argv[:argv.index(args.phase)] + argv[argv.index(args.phase) + 1:]
    if args.phase == "summary":
        print(json.dumps(summarize(args.out, args.iterations), indent=1))
        return 0
    if args.phase == "plan":
        base, tok = load_base(args)
        try:
            task = Task(args, tok)
            plans(args, base.config, sum(p.numel() for p in base.parameters()), task.max_prompt())
        except ValueError as e:
            print(f"FAIL: {e}")
            return 2
        print("PASS: plan")
        return 0
    if args.phase == "worker":
        runs = [(r.split(":")[0], int(r.split(":")[1])) for r in args.runs.split(",")]
        return min(work(args, runs, args.deadline or time.time() + args.budget_s), 99)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
