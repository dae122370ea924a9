"""GPU smoke of the GRPO loop with SmolLM2-135M (``python -m kvlib.rl.smoke --out DIR``).

Three parts, each timed, all in one JSON (``DIR/rlvr_smoke.json``):

1. *Calibration*: one bf16 rollout of held-out problems across chain lengths, to measure response
   lengths, truncation and accuracy by number of steps (the task's difficulty is set from this).
2. *GRPO*: a few iterations with a bf16 rollout copy and a ``DynamicCache`` (the bf16 arm as it
   runs today), learner over fp32 master weights.
3. *Mismatch by arm*: one rollout per cache format available in :func:`kvlib.make_cache`
   (float-simulated today), sampler-learner KL against the same fp32 learner. Skipped formats say why.

Prints PASS/FAIL lines; exits 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvlib.rl import grpo
from kvlib.rl import task as rl_task
from kvlib.rl.loop import GRPOConfig, frozen_copy, run_grpo
from kvlib.rl.sampler import learner_logprobs, sample


def _dynamic(model: Any):
    from transformers import DynamicCache

    return lambda batch: DynamicCache(config=model.config)


def _kvlib_cache(fmt: str, model: Any):
    from kvlib import make_cache

    return lambda batch: make_cache(fmt, model.config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per GRPO iteration")
    ap.add_argument("--arm-prompts", type=int, default=16)
    ap.add_argument("--per-steps", type=int, default=12, help="calibration problems per chain length")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip later parts past this wall time")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from kvlib.hf.model import load_model

    base, tok = load_model(dtype=torch.float32, device=device)
    policy = frozen_copy(base)  # load_model's object is cached per process: never train it in place
    policy.requires_grad_(True)
    roll16 = frozen_copy(policy).to(torch.bfloat16)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                              "max_new_tokens": args.max_new_tokens, "difficulty": rl_task.DIFFICULTY}
    fails: list[str] = []
    prompt = rl_task.prompt_fn()  # the runs' prompt: DEFAULT_SHOTS worked examples

    # 1. calibration: lengths and accuracy by chain length, bf16 weights, DynamicCache
    probs = [p for s in range(2, 15, 2) for p in rl_task.make_problems("heldout", args.per_steps, seed=s, min_steps=s,
                                                                         max_steps=s)]
    prompts = [prompt(tok, p) for p in probs]
    r = sample(roll16, tok, prompts, cache_factory=_dynamic(roll16), max_new_tokens=args.max_new_tokens,
               generator=torch.Generator().manual_seed(0))
    rewards = [rl_task.reward(t, p.answer) for t, p in zip(r.texts, probs, strict=True)]
    lengths = r.lengths.tolist()
    ended = (r.response_ids == tok.eos_token_id).any(dim=1).tolist()
    by_steps = {}
    for p, rew, n, e in zip(probs, rewards, lengths, ended, strict=True):
        d = by_steps.setdefault(p.steps, {"n": 0, "acc": 0.0, "len": 0.0, "ended": 0.0})
        d["n"] += 1
        d["acc"] += rew
        d["len"] += n
        d["ended"] += float(e)
    for d in by_steps.values():
        for k in ("acc", "len", "ended"):
            d[k] /= d["n"]
    prompt_tokens = r.prompt_mask.sum(1).float()
    result["calibration"] = {"by_steps": by_steps, "seconds": r.seconds, "responses": len(probs),
                             "prompt_tokens_mean": float(prompt_tokens.mean()),
                             "example": r.texts[len(probs) // 2][:1500]}
    print(f"calibration: {len(probs)} responses in {r.seconds:.1f} s; prompt tokens {prompt_tokens.mean():.0f}")
    for s, d in sorted(by_steps.items()):
        print(f"  steps {s:2d}: acc {d['acc']:.2f}  mean length {d['len']:.0f}  finished {d['ended']:.2f}")

    # 2. GRPO iterations: the bf16 arm as it runs today
    if time.perf_counter() - t0 < args.budget_s:
        cfg = GRPOConfig(group_size=args.group_size, prompts_per_iteration=args.prompts,
                         max_new_tokens=args.max_new_tokens, lr=1e-6, micro_batch=16)
        before = [p.detach().clone() for p in policy.parameters()]
        train = rl_task.make_problems("train", 256, seed=0)
        hist = run_grpo(policy, tok, train, cfg=cfg, cache_factory=_dynamic(policy), iterations=args.iterations,
                        seed=0, rollout_dtype=torch.bfloat16,
                        callback=lambda i, m: print(f"  it {i}: reward {m['reward_mean']:.3f} len "
                                                    f"{m['response_length_mean']:.0f} refKL {m['ref_kl_k3']:.2e} "
                                                    f"samplerKL {m['sampler_learner_kl_k3']:.2e} tis_max "
                                                    f"{m['tis_max']:.2f} rollout {m['rollout_seconds']:.1f}s "
                                                    f"learner {m['learner_seconds']:.1f}s"))
        changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, policy.parameters(), strict=True))
        result["grpo"] = hist
        finite = all(math.isfinite(v) for k, vs in hist.items() if k not in ("config", "seed") for v in vs)
        # an update is expected only when some group had reward variance (else every advantage is 0 and,
        # with pi == pi_ref, so is the KL gradient)
        informative = max(hist["informative_group_fraction"]) > 0
        if not informative:
            print("WARN: no group had reward variance: no update expected; retune the difficulty")
        for ok, what in ((finite, "all GRPO metrics finite"),
                         (changed == informative, f"parameters changed iff some group was informative ({changed})"),
                         (max(hist["tis_max"]) <= cfg.tis_cap + 1e-6, f"TIS weights <= C={cfg.tis_cap}")):
            print(("PASS: " if ok else "FAIL: ") + what)
            if not ok:
                fails.append(what)
    else:
        print("SKIP: GRPO iterations (time budget)")

    # 3. sampler-learner mismatch by cache format, same fp32 learner, same prompts
    arms: dict[str, Any] = {}
    probs = rl_task.make_problems("heldout", args.arm_prompts, seed=99)
    prompts = [prompt(tok, p) for p in probs]
    for name in ("bf16-dynamic", "bf16", "kv4", "kv4rl"):
        if time.perf_counter() - t0 > args.budget_s:
            arms[name] = {"skipped": "time budget"}
            continue
        try:
            factory = _dynamic(roll16) if name == "bf16-dynamic" else _kvlib_cache(name, roll16)
            r = sample(roll16, tok, prompts, cache_factory=factory, max_new_tokens=args.max_new_tokens,
                       generator=torch.Generator().manual_seed(1))
        except Exception as e:  # noqa: BLE001 -- a format that cannot run yet is reported, not hidden
            arms[name] = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"SKIP: arm {name}: {arms[name]['skipped']}")
            continue
        with torch.no_grad():
            old = learner_logprobs(policy, r, micro_batch=16)
        m = r.response_mask
        arms[name] = {"kl_k3": float(grpo.token_mean(grpo.kl_k3(r.sampler_logprobs, old), m)),
                      "kl_k1": float(grpo.token_mean(r.sampler_logprobs - old, m)),
                      "tis_truncated_c2": float(((old - r.sampler_logprobs).exp()[m.bool()] > 2).float().mean()),
                      "length_mean": float(r.lengths.float().mean()), "seconds": r.seconds}
        print(f"  arm {name:12s}: sampler-learner KL k3 {arms[name]['kl_k3']:.2e} k1 {arms[name]['kl_k1']:.2e} "
              f"TIS>2 {arms[name]['tis_truncated_c2']:.3f} length {arms[name]['length_mean']:.0f} "
              f"rollout {r.seconds:.1f}s")
    result["arms"] = arms
    result["seconds_total"] = time.perf_counter() - t0
    (out / "rlvr_smoke.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wall {result['seconds_total']:.0f} s; {'FAIL' if fails else 'PASS'} overall")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
