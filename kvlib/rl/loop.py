"""One GRPO iteration (rollout -> rewards -> advantages -> loss -> optimizer step), a run, an evaluator.

Synchronous and on-policy up to numerics: each iteration samples ``prompts_per_iteration x
group_size`` responses from the current policy through ``cache_factory`` (the only thing that
differs between the bf16 / kv4 / kv4rl arms), scores them under the *learner* (pi_old, same
weights, learner precision) and the frozen initial policy (pi_ref), and takes
``updates_per_iteration`` optimizer steps on the :func:`kvlib.rl.grpo.grpo_loss` of mini-batches
of that rollout. The paper's partial (asynchronous) collection is out of scope here: with one
update per rollout, pi_old and the sampler share weights and every bit of ``pi_old / q`` is the
cache's numerical mismatch, which is the quantity under study.

Metrics per iteration go into a ``history`` dict of lists (one key per metric), ready to plot:
reward, response length, reference KL, sampler-learner KL, TIS statistics, rollout seconds.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvlib.rl import grpo
from kvlib.rl import task as rl_task
from kvlib.rl.sampler import Rollout, learner_logprobs, sample

#: where each GRPOConfig default comes from (Table A1's values are not in our text of the paper)
DEFAULT_SOURCES: dict[str, str] = {
    "dual_clip": "KV4-RL appendix training setup: 'dual clipping ... coefficient 3.0'",
    "temperature": "KV4-RL Section 3: temperature 1, no top-k/top-p (fixed, not configurable)",
    "eps_low": "PPO/DAPO default 0.2 (assumed; Table A1 not in our text)",
    "eps_high": "DAPO clip-higher 0.28 (assumed; Table A1 not in our text)",
    "tis_cap": "Yao et al. 2025 TIS default C=2 (assumed; Table A1 not in our text)",
    "beta": "verl GRPO kl_loss_coef 1e-3 with low_var_kl (assumed)",
    "delta": "verl/Eq. 3.1 stabiliser 1e-6",
    "group_size": "small-scale choice (8 responses per prompt)",
    "lr": "small-scale choice for a 135M policy; tune on the GPU smoke",
}


@dataclass
class GRPOConfig:
    """Hyper-parameters of one arm; every arm of a comparison shares them (only the cache differs)."""

    group_size: int = 8
    prompts_per_iteration: int = 16
    max_new_tokens: int = 384
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float = 3.0
    tis_cap: float | None = 2.0
    beta: float = 1e-3
    delta: float = 1e-6
    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    updates_per_iteration: int = 1
    micro_batch: int | None = None
    #: None: learner forwards in the policy's own dtype (fp32 master weights -> fp32 learner);
    #: "bfloat16": learner forwards under torch.autocast(bf16) over fp32 master weights. Same for every arm.
    learner_autocast: str | None = None
    #: with one update per rollout, pi_old's log-probs are the update's own forward, detached (TRL does the
    #: same for num_iterations == 1): one learner forward fewer. Bit-equal to a separate no-grad forward only
    #: where the kernels are deterministic, so off by default.
    reuse_old_logp: bool = False
    #: learner scoring with the prompts' common token prefix run once per micro-batch
    #: (:func:`kvlib.rl.sampler.learner_logprobs`): None picks it when the prefix has >= 32 tokens, False never
    shared_prefix: bool | None = None
    #: micro-batch of the no-grad scoring passes (pi_old, pi_ref); None: ``micro_batch``. They keep no
    #: activations, so with the shared prefix the whole rollout can go in one call.
    score_micro_batch: int | None = None
    #: DAPO dynamic sampling (Yu et al. 2025): sample rounds of ``prompts_per_iteration`` prompts x
    #: ``group_size`` and keep only groups whose rewards are not all equal, until ``target_groups`` (None:
    #: ``prompts_per_iteration``) are kept or ``max_sampling_rounds`` rounds are spent; the update then uses
    #: the kept groups only (fewer when the cap is hit, never padded with uninformative ones). Off by default:
    #: off, the iteration is the plain one (Eq. 3.1: zero-advantage groups stay in the batch).
    dynamic_sampling: bool = False
    target_groups: int | None = None
    max_sampling_rounds: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size must be an int >= 2, got {self.group_size!r}")
        if not isinstance(self.prompts_per_iteration, int) or self.prompts_per_iteration < 1:
            raise ValueError(f"prompts_per_iteration must be an int >= 1, got {self.prompts_per_iteration!r}")
        if not isinstance(self.updates_per_iteration, int) or self.updates_per_iteration < 1:
            raise ValueError(f"updates_per_iteration must be an int >= 1, got {self.updates_per_iteration!r}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1 or None, got {self.tis_cap!r}")
        if self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip!r}")
        if self.learner_autocast not in (None, "bfloat16"):
            raise ValueError(f"learner_autocast must be None or 'bfloat16', got {self.learner_autocast!r}")
        if self.reuse_old_logp and self.updates_per_iteration != 1:
            raise ValueError("reuse_old_logp needs updates_per_iteration == 1 (later updates move pi_theta off pi_old)")
        if not isinstance(self.dynamic_sampling, bool):
            raise ValueError(f"dynamic_sampling must be a bool, got {self.dynamic_sampling!r}")
        if self.target_groups is not None and (not isinstance(self.target_groups, int) or self.target_groups < 1):
            raise ValueError(f"target_groups must be None or an int >= 1, got {self.target_groups!r}")
        if not isinstance(self.max_sampling_rounds, int) or self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be an int >= 1, got {self.max_sampling_rounds!r}")
        if self.target_groups is not None and not self.dynamic_sampling:
            raise ValueError("target_groups applies only with dynamic_sampling=True")
        if self.beta < 0 or self.lr <= 0:
            raise ValueError(f"need beta >= 0 and lr > 0, got beta={self.beta!r}, lr={self.lr!r}")


def _default_reward(response: Any, problem: Any) -> float:
    return rl_task.reward(response, problem.answer)


_PROMPT = rl_task.prompt_fn()  # DEFAULT_SHOTS worked examples, fixed for every run and arm


def _default_prompt(tokenizer: Any, problem: Any) -> str:
    return _PROMPT(tokenizer, problem)


def _subset(r: Rollout, idx: torch.Tensor) -> Rollout:
    return Rollout(prompt_ids=r.prompt_ids[idx], prompt_mask=r.prompt_mask[idx], response_ids=r.response_ids[idx],
                   response_mask=r.response_mask[idx], sampler_logprobs=r.sampler_logprobs[idx], seconds=r.seconds)


def _concat(parts: Sequence[Rollout], seconds: float) -> Rollout:
    """Rows of several rollouts in one batch: prompts left-padded, responses right-padded to the widest
    (padding is masked, and the learner's position ids come from the masks, so a row scores the same)."""
    if len(parts) == 1:
        r = parts[0]
        return Rollout(prompt_ids=r.prompt_ids, prompt_mask=r.prompt_mask, response_ids=r.response_ids,
                       response_mask=r.response_mask, sampler_logprobs=r.sampler_logprobs, seconds=seconds,
                       texts=list(r.texts), info=dict(r.info))
    pw = max(r.prompt_ids.shape[1] for r in parts)
    tw = max(r.response_ids.shape[1] for r in parts)

    def left(x: torch.Tensor, w: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (w - x.shape[1], 0))

    def right(x: torch.Tensor, w: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, w - x.shape[1]))

    return Rollout(prompt_ids=torch.cat([left(r.prompt_ids, pw) for r in parts]),
                   prompt_mask=torch.cat([left(r.prompt_mask, pw) for r in parts]),
                   response_ids=torch.cat([right(r.response_ids, tw) for r in parts]),
                   response_mask=torch.cat([right(r.response_mask, tw) for r in parts]),
                   sampler_logprobs=torch.cat([right(r.sampler_logprobs, tw) for r in parts]), seconds=seconds,
                   texts=[t for r in parts for t in r.texts], info=dict(parts[0].info))


def _merge_info(infos: Sequence[dict]) -> dict:
    """The engine's info over several rollouts: seconds summed, flags all-of, paths united, each round listed."""
    if not infos or not infos[0]:
        return {"rounds": list(infos)}
    out = dict(infos[-1])
    for k in ("prefill_seconds", "capture_seconds", "decode_seconds", "steps"):
        if all(k in x for x in infos):
            out[k] = sum(x[k] for x in infos)
    for k in ("kernel", "graphed"):
        if all(k in x for x in infos):
            out[k] = all(x[k] for x in infos)
    if all("decode_paths" in x for x in infos):
        out["decode_paths"] = sorted({p for x in infos for p in x["decode_paths"]})
    out["rounds"] = list(infos)
    return out


def _dynamic_sampling(draw: Callable[[Sequence[Any]], tuple[Rollout, torch.Tensor]], problems: Sequence[Any],
                      more_problems: Callable[[int], Sequence[Any]], cfg: GRPOConfig, eos_id: int | None):
    """DAPO dynamic sampling (Yu et al. 2025, Section 3.2 and Algorithm 1): sample rounds of
    ``cfg.prompts_per_iteration`` groups, keep the groups whose rewards are not all equal (in sampling
    order), stop once ``target`` are kept (later informative groups of that round are dropped, as DAPO trims
    the batch to its size) or after ``cfg.max_sampling_rounds`` rounds. Every round decodes through the
    same ``draw`` (the arm's cache); the time of all of them is the iteration's rollout time.

    Returns ``(kept rollout, kept rewards, dyn metrics, all rewards, all lengths, all finished flags)``. With
    nothing kept, the "kept" batch is the last round (scored for the KL metrics, not trained on:
    ``dyn_update_skipped`` is 1 and no optimizer step is taken).
    """
    g = cfg.group_size
    target = cfg.target_groups or cfg.prompts_per_iteration
    kept_parts: list[Rollout] = []
    kept_rewards: list[torch.Tensor] = []
    all_rw, all_len, all_fin, infos = [], [], [], []
    n_kept = n_sampled = n_informative = rounds = 0
    seconds = 0.0
    probs = problems
    last = None
    while rounds < cfg.max_sampling_rounds and n_kept < target:
        if rounds:
            probs = more_problems(cfg.prompts_per_iteration)
            if len(probs) != cfg.prompts_per_iteration:
                raise ValueError(f"more_problems({cfg.prompts_per_iteration}) returned {len(probs)} problems")
        r, rw = draw(probs)
        rounds += 1
        seconds += r.seconds
        infos.append(dict(r.info))
        all_rw.append(rw)
        all_len.append(r.lengths.float())
        all_fin.append((r.response_ids == eos_id).any(dim=1).float())
        inf = grpo.informative_groups(rw, g)
        n_sampled += inf.numel()
        n_informative += int(inf.sum())
        take = inf.nonzero().flatten()[:target - n_kept].tolist()
        if take:
            rows = torch.tensor([i * g + j for i in take for j in range(g)], device=r.response_ids.device)
            part = _subset(r, rows)
            part.texts = [r.texts[i] for i in rows.tolist()] if r.texts else []
            kept_parts.append(part)
            kept_rewards.append(rw[rows])
            n_kept += len(take)
        last = (r, rw)
    if kept_parts:
        rollout, rewards = _concat(kept_parts, seconds), torch.cat(kept_rewards)
    else:
        rollout, rewards = _concat([last[0]], seconds), last[1]
    grpo_iteration.last_rollout_info = _merge_info(infos)
    dyn = {"dyn_sampling_rounds": float(rounds), "dyn_groups_sampled": float(n_sampled),
           "dyn_groups_informative": float(n_informative), "dyn_groups_kept": float(n_kept),
           "dyn_target_groups": float(target), "dyn_target_reached": float(n_kept >= target),
           "dyn_update_skipped": float(n_kept == 0),
           "dyn_reward_mean_kept": float(rewards.mean()) if n_kept else 0.0}  # 0 (not NaN) when nothing kept
    return rollout, rewards, dyn, torch.cat(all_rw), torch.cat(all_len), torch.cat(all_fin)


def _autocast(model: Any, cfg: GRPOConfig) -> Any:
    if cfg.learner_autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.device.type, dtype=getattr(torch, cfg.learner_autocast))


def sync_weights(src: Any, dst: Any) -> None:
    """Copy ``src``'s parameters and buffers into ``dst`` (cast to ``dst``'s dtype): the weight push
    from learner to rollout engine after each update (KV4-RL appendix: "the updated weights are copied
    into the rollout engine")."""
    with torch.no_grad():
        for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
            if a.shape != b.shape:
                raise ValueError(f"sync_weights: {name} has shape {tuple(a.shape)} vs {tuple(b.shape)}")
            b.copy_(a)


def grpo_iteration(policy: Any, ref_model: Any | None, optimizer: torch.optim.Optimizer, tokenizer: Any,
                   problems: Sequence[Any], *, cfg: GRPOConfig, cache_factory: Callable[[int], Any],
                   generator: torch.Generator, rollout_model: Any | None = None,
                   reward_fn: Callable[[Any, Any], float] = _default_reward,
                   prompt_fn: Callable[[Any, Any], Any] = _default_prompt,
                   eos_token_id: int | None = None, pad_token_id: int | None = None,
                   sampler: Callable[..., Rollout] | None = None,
                   more_problems: Callable[[int], Sequence[Any]] | None = None) -> dict[str, float]:
    """One GRPO iteration on ``problems`` (``cfg.prompts_per_iteration`` of them); returns its metrics.

    ``prompt_fn(tokenizer, problem)`` gives a prompt (text, or a list of token ids);
    ``reward_fn(response, problem)`` scores a response (decoded text when there is a tokenizer,
    else its list of token ids, EOS included). ``ref_model`` may be None only when ``cfg.beta == 0``.
    ``rollout_model`` (default: ``policy``) samples; it must hold the policy's current weights
    (e.g. a bf16 copy kept by :func:`sync_weights`, as :func:`run_grpo` does with ``rollout_dtype``).
    ``sampler(model, tokenizer, prompts, max_new_tokens=, generator=, eos_token_id=, pad_token_id=)``
    replaces :func:`~kvlib.rl.sampler.sample` (e.g. :func:`kvlib.rl.engine.sample_static` bound to a
    format); ``cache_factory`` is then unused.

    With ``cfg.dynamic_sampling`` (DAPO), ``problems`` is the first sampling round and ``more_problems(n)``
    gives the ``n`` problems of each further round (:func:`_dynamic_sampling`); the metrics then add the
    ``dyn_*`` counts, and ``rollout_seconds`` is the sum over every round, discarded ones included.
    """
    if len(problems) != cfg.prompts_per_iteration:
        raise ValueError(f"problems must hold cfg.prompts_per_iteration={cfg.prompts_per_iteration} items, "
                         f"got {len(problems)}")
    if ref_model is None and cfg.beta > 0:
        raise ValueError("ref_model is required when cfg.beta > 0")
    if cfg.dynamic_sampling and more_problems is None:
        raise ValueError("cfg.dynamic_sampling needs more_problems (the problems of later sampling rounds)")
    t_start = time.perf_counter()
    g = cfg.group_size
    sampler_model = policy if rollout_model is None else rollout_model

    def draw(probs: Sequence[Any]) -> tuple[Rollout, torch.Tensor]:
        prompts = [prompt_fn(tokenizer, p) for p in probs for _ in range(g)]
        if sampler is None:
            r = sample(sampler_model, tokenizer, prompts, cache_factory=cache_factory,
                       max_new_tokens=cfg.max_new_tokens, generator=generator, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id)
        else:
            r = sampler(sampler_model, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens, generator=generator,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        resp: list[Any] = r.texts or [x[m.bool()].tolist() for x, m in
                                      zip(r.response_ids.cpu(), r.response_mask.cpu(), strict=True)]
        rw = torch.tensor([reward_fn(x, probs[i // g]) for i, x in enumerate(resp)], dtype=torch.float32,
                          device=r.response_ids.device)
        return r, rw

    eos_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    dyn: dict[str, float] = {}
    if not cfg.dynamic_sampling:
        rollout, rewards = draw(problems)
        grpo_iteration.last_rollout_info = dict(rollout.info)
        all_rewards, all_lengths = rewards, rollout.lengths.float()
        all_finished = (rollout.response_ids == eos_id).any(dim=1).float()
    else:
        rollout, rewards, dyn, all_rewards, all_lengths, all_finished = _dynamic_sampling(
            draw, problems, more_problems, cfg, eos_id)
    train = not dyn or dyn["dyn_groups_kept"] > 0  # dynamic sampling that kept nothing: no update
    advantages = grpo.group_advantages(rewards, g, delta=cfg.delta)
    mask = rollout.response_mask
    t_learn = time.perf_counter()
    linfo: list[dict] = []

    def score(model: Any, r: Rollout, micro_batch: int | None) -> torch.Tensor:
        linfo.append({})
        return learner_logprobs(model, r, micro_batch=micro_batch, shared_prefix=cfg.shared_prefix, info=linfo[-1])

    with torch.no_grad(), _autocast(policy, cfg):
        smb = cfg.score_micro_batch or cfg.micro_batch
        old_logp = None if cfg.reuse_old_logp else score(policy, rollout, smb)
        ref_logp = score(ref_model, rollout, smb) if cfg.beta > 0 else None
    n_tok_total = mask.sum()
    if old_logp is None:  # filled micro-batch by micro-batch from the update's own forward (reuse_old_logp)
        old_logp = torch.zeros_like(rollout.sampler_logprobs)

    batch = rollout.response_ids.shape[0]
    order = torch.randperm(batch, generator=generator).to(rollout.response_ids.device)
    chunks = order.chunk(cfg.updates_per_iteration)
    stats_sum: dict[str, float] = {}
    grad_norms = []
    tis_max = 0.0
    for chunk in chunks:
        sub_tokens = mask[chunk].sum().clamp(min=1)
        mb = cfg.micro_batch or chunk.numel()
        optimizer.zero_grad(set_to_none=True)
        for s in range(0, chunk.numel(), mb):
            idx = chunk[s:s + mb]
            sub = _subset(rollout, idx)
            with _autocast(policy, cfg), torch.set_grad_enabled(train):
                logp = score(policy, sub, None)
            if cfg.reuse_old_logp:
                old_logp[idx] = logp.detach()
            loss, st = grpo.grpo_loss(logp, old_logp[idx], None if ref_logp is None else ref_logp[idx],
                                      rollout.sampler_logprobs[idx], advantages[idx], mask[idx],
                                      eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
                                      tis_cap=cfg.tis_cap, beta=cfg.beta)
            # token_mean over the micro-batch, rescaled so the mini-batch loss is sum / N_tok(mini-batch)
            weight = mask[idx].sum() / sub_tokens
            if train:
                (loss * weight).backward()
            w = float(mask[idx].sum() / n_tok_total)
            for k, v in st.items():
                if k == "tis_max":
                    tis_max = max(tis_max, v)
                else:
                    stats_sum[k] = stats_sum.get(k, 0.0) + w * v
        if not train:
            grad_norms.append(0.0)
            continue
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sampler_learner_k1 = float(grpo.token_mean(rollout.sampler_logprobs - old_logp, mask))
    sampler_learner_k3 = float(grpo.token_mean(grpo.kl_k3(rollout.sampler_logprobs, old_logp), mask))
    ref_kl = float(grpo.token_mean(grpo.kl_k3(old_logp, ref_logp), mask)) if ref_logp is not None else 0.0
    if rollout_model is not None and rollout_model is not policy:
        sync_weights(policy, rollout_model)
    if policy.device.type == "cuda":
        torch.cuda.synchronize(policy.device)
    t_end = time.perf_counter()
    # reward, lengths and the informative fraction are over every sampled response (with dynamic sampling the
    # discarded rounds too): the policy's own rates, comparable with the plain iteration; n_tokens is the update's
    metrics = {
        "reward_mean": float(all_rewards.mean()),
        "response_length_mean": float(all_lengths.mean()),
        "response_length_max": float(all_lengths.max()),
        "truncated_fraction": float(1.0 - all_finished.mean()),
        "n_tokens": float(n_tok_total),
        "informative_group_fraction": float(grpo.informative_groups(all_rewards, g).float().mean()),
        "ref_kl_k3": ref_kl,
        "sampler_learner_kl_k1": sampler_learner_k1,
        "sampler_learner_kl_k3": sampler_learner_k3,
        "tis_max": tis_max,
        "grad_norm": max(grad_norms),
        "rollout_seconds": rollout.seconds,
        "learner_seconds": t_end - t_learn,
        "iteration_seconds": t_end - t_start,
    }
    metrics.update({k: v for k, v in stats_sum.items()})
    metrics.update(dyn)
    # what the learner forwarded (tokens through the decoder, all scoring passes) vs the full-sequence path
    paths = [p for x in linfo for p in x["paths"]]
    metrics["learner_tokens"] = float(sum(x["tokens"] for x in linfo))
    metrics["learner_full_path_tokens"] = float(sum(x["full_tokens"] for x in linfo))
    metrics["learner_shared_prefix_fraction"] = sum(p == "shared-prefix" for p in paths) / max(len(paths), 1)
    metrics["learner_calls"] = float(len(paths))
    grpo_iteration.last_learner_info = {"paths": sorted(set(paths)),
                                        "reasons": sorted({r for x in linfo for r in x["reasons"]}),
                                        "prefix_tokens": sorted({t for x in linfo for t in x["prefix_tokens"]})}
    return metrics


def frozen_copy(model: Any) -> Any:
    """A deep copy with gradients off, in eval mode: the fixed initial policy pi_ref."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def run_grpo(policy: Any, tokenizer: Any, train_problems: Sequence[Any], *, cfg: GRPOConfig,
             cache_factory: Callable[[int], Any], iterations: int, seed: int,
             reward_fn: Callable[[Any, Any], float] = _default_reward,
             prompt_fn: Callable[[Any, Any], Any] = _default_prompt,
             eos_token_id: int | None = None, pad_token_id: int | None = None,
             rollout_dtype: torch.dtype | None = None,
             callback: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, list[Any]]:
    """``iterations`` GRPO iterations of ``policy`` (trained in place; copy first if it is shared).

    Each iteration draws ``cfg.prompts_per_iteration`` problems from ``train_problems`` without
    replacement (seeded by ``seed``). With ``rollout_dtype`` (e.g. ``torch.bfloat16``) rollouts are
    drawn by a copy of the policy in that dtype, refreshed after every update, while the learner keeps
    the policy's own (fp32 master) weights. Returns the history: ``{"iteration": [...], metric: [...]}``
    plus ``"config"`` (the GRPOConfig as a dict) and ``"seed"``.
    """
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    if len(train_problems) < cfg.prompts_per_iteration:
        raise ValueError(f"train_problems ({len(train_problems)}) fewer than cfg.prompts_per_iteration")
    ref = frozen_copy(policy) if cfg.beta > 0 else None
    policy.requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    rollout_model = None
    if rollout_dtype is not None:
        rollout_model = frozen_copy(policy).to(dtype=rollout_dtype)
    gen = torch.Generator().manual_seed(seed)
    history: dict[str, list[Any]] = {"iteration": []}
    for it in range(iterations):
        pick = torch.randperm(len(train_problems), generator=gen)[:cfg.prompts_per_iteration].tolist()
        m = grpo_iteration(policy, ref, optimizer, tokenizer, [train_problems[i] for i in pick], cfg=cfg,
                           cache_factory=cache_factory, generator=gen, rollout_model=rollout_model,
                           reward_fn=reward_fn, prompt_fn=prompt_fn,
                           eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        if not all(math.isfinite(v) for v in m.values()):
            raise FloatingPointError(f"non-finite metric at iteration {it}: {m}")
        history["iteration"].append(it)
        for k, v in m.items():
            history.setdefault(k, []).append(v)
        if callback is not None:
            callback(it, m)
    history["config"] = [asdict(cfg)]
    history["seed"] = [seed]
    return history


def evaluate(model: Any, tokenizer: Any, problems: Sequence[Any], *, k: int = 1, max_new_tokens: int,
             cache_factory: Callable[[int], Any], generator: torch.Generator, batch_size: int = 32,
             reward_fn: Callable[[Any, Any], float] = _default_reward,
             prompt_fn: Callable[[Any, Any], Any] = _default_prompt,
             eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """avg@k and pass@k on ``problems`` (KV4-RL appendix evaluation), sampled at temperature 1.

    The paper's common evaluator is bf16: pass a bf16 copy of the policy and a bf16 cache factory
    for every arm, so that the arms are scored by one evaluator. Returns the per-problem correct
    counts too (for paired bootstrap CIs across arms on the same problems).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    prompts = [(i, prompt_fn(tokenizer, p)) for i, p in enumerate(problems) for _ in range(k)]
    correct = [0] * len(problems)
    for s in range(0, len(prompts), batch_size):
        part = prompts[s:s + batch_size]
        r = sample(model, tokenizer, [p for _, p in part], cache_factory=cache_factory,
                   max_new_tokens=max_new_tokens, generator=generator, eos_token_id=eos_token_id,
                   pad_token_id=pad_token_id)
        responses = r.texts or [x[m.bool()].tolist() for x, m in
                                zip(r.response_ids.cpu(), r.response_mask.cpu(), strict=True)]
        for (i, _), resp in zip(part, responses, strict=True):
            correct[i] += int(reward_fn(resp, problems[i]) > 0)
    n = max(len(problems), 1)
    return {"avg_at_k": sum(correct) / (n * k), "pass_at_k": sum(c > 0 for c in correct) / n, "k": k,
            "correct": correct}
