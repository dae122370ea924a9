"""Quota-based partial collection (KV4-RL App. B) and the synchronous baseline, on the continuous engine.

Each update trains ``T`` complete prompt groups of ``G`` responses. :class:`PartialCollector` (asynchronous):

* keeps a pool of up to ``floor(T (1 + beta))`` live groups (unfinished, or complete and waiting), topped up with
  fresh groups at the start of every collection interval;
* queues every unfinished response of the live groups: carried prefixes (responses with tokens) first, then the
  fresh ones, each by group creation order, and steps the engine (:class:`~kvlib.rl.continuous.ContinuousEngine`),
  which admits them as slots and pages allow;
* stops once ``T`` complete untrained groups exist and no unfinished group is ``eta`` or more updates old (a group
  that old must complete first, which can extend collection past the quota);
* takes the in-flight responses out of the engine (:meth:`~kvlib.rl.continuous.ContinuousEngine.drain`): they keep
  their tokens and the behaviour log-probabilities recorded when each token was sampled; the next interval re-queues
  them first, and the engine re-prefills prompt + tokens under whatever weights it then holds;
* hands the oldest ``T`` complete groups to the learner; further complete groups wait in the pool.

``synchronous=True`` is the baseline on the same engine: each interval launches ``T`` new groups and runs until all
of them complete (nothing is carried). The queue order, the stop rule and the selection are the ones of the
simulator :func:`kvlib.rollout.partial.simulate_collection`, which models this collector.

:func:`groups_rollout` turns the selected groups into a :class:`~kvlib.rl.sampler.Rollout` (recorded log-probs as
the sampler's), and :func:`async_grpo_iteration` runs one GRPO update on them with
:func:`kvlib.rl.loop.grpo_iteration` (TIS then corrects both the cache's mismatch and, for carried tokens, the
policy lag of ``pi_old`` against the recorded ``q``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlib.core.checks import check_positive_int
from kvlib.rl.continuous import ContinuousEngine, Request
from kvlib.rl.sampler import Rollout


@dataclass
class Group:
    """``G`` responses to one prompt. ``created``: the update index at which it entered the pool."""

    gid: int
    problem: Any
    created: int
    responses: list[Request]
    trained_at: int | None = None

    @property
    def complete(self) -> bool:
        return all(r.done for r in self.responses)


@dataclass
class IntervalRecord:
    """What one collection interval did."""

    update: int
    steps: int = 0
    decode_steps: int = 0
    new_groups: int = 0
    carried_requests: int = 0  # requests with a prefix when the interval began
    reprefill_tokens: int = 0  # tokens of carried prefixes re-prefilled in this interval (prompt + response)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    complete_groups: int = 0  # complete untrained groups at the stop
    trained_mean_age: float = math.nan
    max_unfinished_age: int = -1
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class PartialCollector:
    """Asynchronous quota-based partial collection, or the synchronous baseline (module docstring).

    ``new_problem(gid)`` gives the problem of a new group; ``prompt_ids(problem)`` its prompt token ids;
    ``max_new_tokens`` caps every response. Request ids are ``gid * G + j`` (so two collectors creating the same
    groups sample with the same per-request streams).
    """

    def __init__(self, engine: ContinuousEngine, new_problem: Callable[[int], Any],
                 prompt_ids: Callable[[Any], list[int]], *, T: int, G: int, max_new_tokens: int, beta: float = 1.0,
                 eta: int = 12, synchronous: bool = False) -> None:
        if not isinstance(engine, ContinuousEngine):
            raise TypeError(f"engine must be a ContinuousEngine, got {type(engine).__name__}")
        self.T, self.G = check_positive_int("T", T), check_positive_int("G", G)
        self.max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        if not (isinstance(beta, (int, float)) and beta >= 0):
            raise ValueError(f"beta must be a number >= 0, got {beta!r}")
        self.eta = check_positive_int("eta", eta)
        self.beta, self.synchronous = float(beta), bool(synchronous)
        if not callable(new_problem) or not callable(prompt_ids):
            raise TypeError("new_problem and prompt_ids must be callables")
        self.engine, self.new_problem, self.prompt_ids = engine, new_problem, prompt_ids
        self.pool_groups = T if self.synchronous else int(math.floor(T * (1.0 + self.beta)))
        self.groups: list[Group] = []  # every group ever created, by gid
        self.update = 0
        self.records: list[IntervalRecord] = []

    @property
    def live(self) -> list[Group]:
        return [g for g in self.groups if g.trained_at is None]

    def _new_group(self) -> Group:
        gid = len(self.groups)
        problem = self.new_problem(gid)
        ids = list(self.prompt_ids(problem))
        g = Group(gid, problem, self.update, [Request(gid * self.G + j, ids, self.max_new_tokens, meta=(gid, j))
                                              for j in range(self.G)])
        self.groups.append(g)
        return g

    def _stop(self, complete: int, live: Sequence[Group]) -> bool:
        if self.synchronous:
            return all(g.complete for g in live)
        overdue = any(not g.complete and self.update - g.created >= self.eta for g in live)
        return complete >= self.T and not overdue

    def collect(self, max_steps: int = 10_000_000) -> list[Group]:
        """One collection interval; returns the ``T`` groups to train on (oldest first), marked trained."""
        eng, u = self.engine, self.update
        if eng.in_flight or eng.queue:
            raise RuntimeError("the engine must be empty between collection intervals")
        eng.interval = u
        t0 = time.perf_counter()
        rec = IntervalRecord(update=u)
        if self.synchronous and self.live:
            raise RuntimeError("synchronous collection left unfinished groups")
        n_new = self.T if self.synchronous else max(self.pool_groups - len(self.live), 0)
        for _ in range(n_new):
            self._new_group()
        rec.new_groups = n_new
        live = self.live
        pending = [r for g in live for r in g.responses if not r.done]
        # carried prefixes first, then fresh responses; each by group creation order (the simulator's order)
        gid_of = {id(r): g.gid for g in live for r in g.responses}
        pending.sort(key=lambda r: (not r.tokens, gid_of[id(r)], r.rid))
        rec.carried_requests = sum(1 for r in pending if r.tokens)
        rec.reprefill_tokens = sum(r.context for r in pending if r.tokens)
        eng.submit(pending)
        steps0, trace0, pre0 = eng.n_steps, len(eng.trace), len(eng.prefills)
        # complete groups by id: the responses of one group can end in the same step (count the group once)
        complete = {g.gid for g in live if g.complete}
        while not self._stop(len(complete), live):
            if eng.idle:
                raise RuntimeError("the engine ran dry before the stop rule held")
            for r in eng.step():
                gid = r.meta[0]
                if self.groups[gid].complete:
                    complete.add(gid)
            if eng.n_steps - steps0 > max_steps:
                raise RuntimeError(f"max_steps={max_steps} exceeded")
        # stop: in-flight responses keep their prefixes; the next interval re-queues them first
        for r in eng.drain() + eng.take_queue():
            if r.tokens:
                r.carried += 1
        done = sorted((g for g in live if g.complete), key=lambda g: (g.created, g.gid))
        pick = done[:self.T]
        for g in pick:
            g.trained_at = u
        left = [g for g in self.live if not g.complete]
        rec.steps = eng.n_steps - steps0
        tr = eng.trace[trace0:]
        rec.decode_steps = len(tr)
        rec.decode_tokens = sum(x["batch"] for x in tr)
        rec.preemptions = sum(x["preempted"] for x in tr)
        rec.prefill_tokens = sum(x["tokens"] for x in eng.prefills[pre0:])
        rec.complete_groups = len(done)
        rec.trained_mean_age = float(sum(u - g.created for g in pick) / max(len(pick), 1))
        rec.max_unfinished_age = max((u - g.created for g in left), default=-1)
        rec.seconds = time.perf_counter() - t0
        self.records.append(rec)
        self.update += 1
        return pick

    def check(self) -> None:
        """Every response of a live group has finished or is waiting with its prefix (none lost, none in the
        engine between intervals); trained groups are complete. Raise AssertionError otherwise (tests)."""
        assert not self.engine.in_flight and not self.engine.queue, "the engine holds requests between intervals"
        for g in self.groups:
            if g.trained_at is not None:
                assert g.complete, f"group {g.gid} was trained incomplete"
            for r in g.responses:
                assert len(r.tokens) == len(r.logprobs) == len(r.versions), f"request {r.rid}: ragged record"
                assert r.done or len(r.tokens) < r.max_new_tokens, f"request {r.rid}: over its token limit"
                if r.done:
                    assert r.finish in ("eos", "length"), f"request {r.rid}: finish {r.finish!r}"


def groups_rollout(groups: Sequence[Group], *, pad_token_id: int, tokenizer: Any = None) -> Rollout:
    """The groups' responses as a :class:`~kvlib.rl.sampler.Rollout` (group by group, response by response):
    prompts left-padded, responses right-padded, the recorded behaviour log-probabilities as ``sampler_logprobs``.
    ``info`` holds the policy version of every token (``versions``, -1 on padding)."""
    reqs = [r for g in groups for r in g.responses]
    if not reqs or not all(r.done for r in reqs):
        raise ValueError("groups must be complete (every response finished)")
    P = max(len(r.prompt_ids) for r in reqs)
    L = max(len(r.tokens) for r in reqs)
    n = len(reqs)
    prompt = torch.full((n, P), pad_token_id, dtype=torch.long)
    pmask = torch.zeros(n, P, dtype=torch.long)
    resp = torch.full((n, L), pad_token_id, dtype=torch.long)
    rmask = torch.zeros(n, L, dtype=torch.long)
    logq = torch.zeros(n, L, dtype=torch.float32)
    vers = torch.full((n, L), -1, dtype=torch.long)
    for i, r in enumerate(reqs):
        p, t = len(r.prompt_ids), len(r.tokens)
        prompt[i, P - p:] = torch.tensor(r.prompt_ids)
        pmask[i, P - p:] = 1
        resp[i, :t] = torch.tensor(r.tokens)
        rmask[i, :t] = 1
        logq[i, :t] = torch.tensor(r.logprobs, dtype=torch.float32)
        vers[i, :t] = torch.tensor(r.versions)
    texts = [tokenizer.decode(r.tokens, skip_special_tokens=True) for r in reqs] if tokenizer is not None else []
    return Rollout(prompt_ids=prompt, prompt_mask=pmask, response_ids=resp, response_mask=rmask,
                   sampler_logprobs=logq, seconds=0.0, texts=texts, info={"versions": vers})


def async_grpo_iteration(policy: Any, ref_model: Any | None, optimizer: torch.optim.Optimizer, tokenizer: Any,
                         collector: PartialCollector, *, cfg: Any, generator: torch.Generator,
                         reward_fn: Callable[[Any, Any], float], pad_token_id: int,
                         eos_token_id: int | None = None) -> dict[str, float]:
    """Collect (:meth:`PartialCollector.collect`), then one GRPO update on the ``T`` groups with
    :func:`kvlib.rl.loop.grpo_iteration` (``cfg.prompts_per_iteration == T``, ``cfg.group_size == G``); the
    engine's model receives the new weights (:func:`kvlib.rl.loop.sync_weights`) and its version is bumped.
    Returns the iteration's metrics plus the interval's record and the policy lag of the trained tokens."""
    from dataclasses import asdict

    from kvlib.rl.loop import grpo_iteration

    if cfg.prompts_per_iteration != collector.T or cfg.group_size != collector.G:
        raise ValueError(f"cfg (prompts_per_iteration={cfg.prompts_per_iteration}, group_size={cfg.group_size}) must "
                         f"match the collector (T={collector.T}, G={collector.G})")
    groups = collector.collect()
    rollout = groups_rollout(groups, pad_token_id=pad_token_id, tokenizer=tokenizer)
    rollout.seconds = collector.records[-1].seconds
    dev = next(policy.parameters()).device
    rollout = Rollout(prompt_ids=rollout.prompt_ids.to(dev), prompt_mask=rollout.prompt_mask.to(dev),
                      response_ids=rollout.response_ids.to(dev), response_mask=rollout.response_mask.to(dev),
                      sampler_logprobs=rollout.sampler_logprobs.to(dev), seconds=rollout.seconds,
                      texts=rollout.texts, info=rollout.info)
    eng = collector.engine

    def replay(*args: Any, **kwargs: Any) -> Rollout:
        return rollout

    m = grpo_iteration(policy, ref_model, optimizer, tokenizer, [g.problem for g in groups], cfg=cfg,
                       cache_factory=lambda b: None, generator=generator, rollout_model=eng.model,
                       reward_fn=reward_fn, prompt_fn=lambda tok, p: "", eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, sampler=replay)
    eng.weights_changed()
    vers = rollout.info["versions"]
    valid = vers >= 0
    lag = (eng.version - 1 - vers)[valid].float()
    m.update({f"collect_{k}": float(v) for k, v in asdict(collector.records[-1]).items()
              if isinstance(v, (int, float))})
    m["stale_token_fraction"] = float((lag > 0).float().mean())
    m["policy_lag_max"] = float(lag.max()) if lag.numel() else 0.0
    return m


def collect_frozen(model: Any, plan: Any, new_problem: Callable[[int], Any], prompt_ids: Callable[[Any], list[int]],
                   *, eos_token_id: int, T: int, G: int, max_new_tokens: int, updates: int, synchronous: bool,
                   beta: float = 1.0, eta: int = 12, seed: int = 0, **engine_options: Any) -> PartialCollector:
    """``updates`` collection intervals of a frozen policy on a fresh engine (KV4-RL App. B's trace measurement:
    "the policy remains frozen, including across simulated update boundaries"; carried prefixes are still taken
    out and re-prefilled at each boundary). Returns the collector (its engine holds the trace)."""
    check_positive_int("updates", updates)
    eng = ContinuousEngine(model, plan, eos_token_id=eos_token_id, seed=seed, **engine_options)
    col = PartialCollector(eng, new_problem, prompt_ids, T=T, G=G, max_new_tokens=max_new_tokens, beta=beta, eta=eta,
                           synchronous=synchronous)
    for _ in range(updates):
        col.collect()
    return col
