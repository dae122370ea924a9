"""GRPO runs of issue 27 on one GPU call: ``python -m dev.rlvr_runs all --out DIR --gguf PATH`` (the experiment
driver; the library keeps the learner, the sampler and the task, :mod:`kvlib.rl`).

Phases of ``all`` (one process; the device call is bounded by ``--budget-s``):

1. *task*: the committed setting :data:`kvlib.rl.task.DIFFICULTY`, calibrated on the CPU with the real model
   (:data:`kvlib.rl.task.CPU_CALIBRATION`); ``--calibrate`` instead runs one temperature-1 bf16 rollout of
   held-out problems by chain length and picks the step range whose accuracy is nearest :data:`TARGET_ACC`.
   A committed ``calibration.json`` in ``--results`` is reused, so that later calls train on the same task.
2. *timing* (isolated, sequential): every arm decodes the same prompts for the same number of steps
   (``min_new_tokens = max_new_tokens``) from the initial policy, one warm-up then ``--timing-reps``
   interleaved repetitions; the rollout speedup over bf16 comes from here (sum of times), not from the
   training runs, whose rollouts share the GPU.
3. *train*: one process per (arm, seed) not already in ``--results``, all concurrent on the GPU, each under an
   equal CUDA allocator cap (``set_per_process_memory_fraction``; the sum fits the GPU) with its memory estimate
   from the shapes printed at start (:func:`memory_estimate`) and ``torch.cuda.max_memory_allocated`` logged per
   iteration; each stops before ``--budget-s`` runs out (keeping time for its final evaluation) and writes
   ``DIR/rlvr/<arm>_seed<k>.json`` after every iteration (``partial: true`` until it completes). Why all nine at
   once: at 135M a process is launch-bound and leaves the GPU mostly idle, so concurrent processes add
   throughput (first H200 run: 9 processes each did an iteration every 8-22 s with 256-token responses); running
   seeds one after another in a process would divide each run's iterations by three.

Every arm shares the learner (fp32 master weights, forward under bf16 autocast), the bf16 rollout copy
of the weights, the task, the GRPOConfig and the bf16 greedy evaluator; only the rollout cache format
differs: ``kvlib.make_cache(arm, ...)`` decoded by :func:`kvlib.rl.engine.sample_static` on the kernel
path (CUDA graphs), with the path recorded.

*Runs spanning calls*: with ``--ckpt-dir DIR`` each run checkpoints into ``DIR/<arm>_seed<k>/`` (``state.pt``:
fp32 weights, AdamW state, the run's generator (which also drives the problem stream), the global torch / CUDA /
Python RNGs, the run record with its history; written to a temporary file and renamed) every ``--ckpt-every``
iterations and at its deadline, and ``all`` keeps calibration, timing and the initial evaluation there too.
``all --resume`` (a later process, e.g. the next device call on the same machine) continues every unfinished run
found there from its checkpoint, bit-compatibly where the kernels are deterministic (tests/test_rl_resume.py),
without repeating timing or the initial evaluation; with no checkpoint it fails rather than start fresh runs under
the same seeds. Each run's JSON lists its ``segments`` (one per process: commit, first iteration, iterations).

The learner scores pi_ref and the update on the shared-prefix path (:func:`kvlib.rl.sampler.learner_logprobs`):
every prompt carries the same worked examples, so the ~830-token common prefix runs once per micro-batch and
each row only its ~140-token suffix; the per-iteration ``learner_tokens`` vs ``learner_full_path_tokens`` say
what that saved.

``--dynamic-sampling --target-groups T --max-sampling-rounds R`` (default off) turns on DAPO's dynamic sampling in
every run (:class:`kvlib.rl.loop.GRPOConfig`): rounds of ``--prompts`` problems from the run's own stream, only groups
with mixed rewards trained on; the history records rounds, groups sampled / informative / kept, and rollout seconds
of all rounds.

``--device cpu --tiny`` runs the same code on a tiny random Llama (2 layers, SmolLM2's tokenizer and
chat template): a wiring check, no numbers to read.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
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

from kvlib.rl.memory import memory_estimate  # the estimate lives with the engine's memory plan

ARMS = ("bf16", "kv4", "kv4rl")
#: the pooled temperature-1 accuracy the calibration aims the task at (groups of 8 then mostly mixed)
TARGET_ACC = 0.35
CAL_STEPS = (1, 2, 3, 4, 5, 6, 8)
RESULTS = Path("data/results/gpu/rlvr")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ model
def install_gguf(path: str | None) -> None:
    """Make ``path`` the shipped GGUF that :func:`kvlib.hf.model.model_path` finds (a package dir on sys.path)."""
    if not path:
        return
    src = Path(path).resolve()
    if not src.is_file():
        raise ValueError(f"--gguf: {path} is not a file")
    from kvlib.hf.model import MODELS

    _, pkg, fname = MODELS["smollm2-135m"]
    site = Path(os.environ.get("KVLIB_RL_SITE", "/tmp/kvlib_rl_site"))
    (site / pkg).mkdir(parents=True, exist_ok=True)
    (site / pkg / "__init__.py").touch()
    dst = site / pkg / fname
    if not dst.exists():
        dst.symlink_to(src)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))


def tiny_config(tok: Any):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


def load_policy(device: str, tiny: bool) -> tuple[Any, Any]:
    """``(fp32 model on device, tokenizer)``: SmolLM2-135M from the GGUF (dequantised), or the tiny random Llama."""
    from kvlib.hf.model import load_model

    base, tok = load_model(dtype=torch.float32, device="cpu")
    if tiny:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config(tok))
    else:
        import copy

        model = copy.deepcopy(base)  # load_model's object is cached per process: never train it in place
    model = model.to(device=device, dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    return model, tok


# ------------------------------------------------------------------------------------------------ config
def grpo_config(args: argparse.Namespace):
    from kvlib.rl.loop import GRPOConfig

    return GRPOConfig(group_size=args.group, prompts_per_iteration=args.prompts, max_new_tokens=args.max_new_tokens,
                      lr=args.lr, beta=args.beta, tis_cap=args.tis_cap, micro_batch=args.micro_batch,
                      score_micro_batch=args.score_micro_batch,
                      learner_autocast=None if args.device == "cpu" else "bfloat16", reuse_old_logp=True,
                      shared_prefix={"auto": None, "on": True, "off": False}[args.shared_prefix],
                      dynamic_sampling=args.dynamic_sampling,
                      target_groups=args.target_groups if args.dynamic_sampling else None,
                      max_sampling_rounds=args.max_sampling_rounds if args.dynamic_sampling else 4)


def prompt_function(args: argparse.Namespace, difficulty: dict):
    """The runs' prompt: ``args.shots`` worked examples drawn at the task's own difficulty."""
    from kvlib.rl import task

    return task.prompt_fn(shots=args.shots, **difficulty)


def problems(split: str, n: int, difficulty: dict, seed: int) -> list:
    from kvlib.rl import task

    return task.make_problems(split, n, seed=seed, **difficulty)


def _write(path: Path, obj: dict) -> None:
    from kvlib.publish.provenance import _jsonable

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(obj), indent=1))
    os.replace(tmp, path)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# ------------------------------------------------------------------------------------------------ calibrate
def choose_difficulty(by_steps: dict[int, dict], target: float = TARGET_ACC) -> dict:
    """The contiguous step range (1-3 levels) whose pooled accuracy is nearest ``target`` (ties: longer
    chains, then wider ranges); returns the task difficulty and the rule's inputs."""
    levels = sorted(by_steps)
    best = None
    for i in range(len(levels)):
        for j in range(i, min(i + 3, len(levels))):
            rng = levels[i:j + 1]
            n = sum(by_steps[s]["n"] for s in rng)
            acc = sum(by_steps[s]["acc"] * by_steps[s]["n"] for s in rng) / max(n, 1)
            key = (abs(acc - target), -rng[0], -len(rng))
            if best is None or key < best[0]:
                best = (key, rng, acc)
    _, rng, acc = best
    from kvlib.rl import task

    d = dict(task.DIFFICULTY)
    d.update(min_steps=rng[0], max_steps=rng[-1])
    return {"difficulty": d, "pooled_accuracy": acc, "target": target}


def calibrate(model16: Any, tok: Any, args: argparse.Namespace) -> dict:
    from kvlib.rl import task
    from kvlib.rl.engine import sample_static

    base = {k: v for k, v in task.DIFFICULTY.items() if k not in ("min_steps", "max_steps")}
    probs = [p for s in CAL_STEPS for p in task.make_problems("heldout", args.cal_per_steps, seed=500 + s,
                                                               min_steps=s, max_steps=s, **base)]
    prompt = prompt_function(args, task.DIFFICULTY)
    r = sample_static(model16, tok, [prompt(tok, p) for p in probs], fmt="bf16", max_new_tokens=args.max_new_tokens,
                      generator=torch.Generator().manual_seed(0))
    ended = (r.response_ids == tok.eos_token_id).any(dim=1).tolist()
    by: dict[int, dict] = {}
    for p, text, n, e in zip(probs, r.texts, r.lengths.tolist(), ended, strict=True):
        d = by.setdefault(p.steps, {"n": 0, "acc": 0.0, "len": 0.0, "ended": 0.0})
        d["n"] += 1
        d["acc"] += task.reward(text, p.answer)
        d["len"] += n
        d["ended"] += float(e)
    for d in by.values():
        for k in ("acc", "len", "ended"):
            d[k] /= d["n"]
    out = choose_difficulty(by)
    out.update(by_steps=by, seconds=r.seconds, info=r.info,
               prompt_tokens_mean=float(r.prompt_mask.sum(1).float().mean()), example=r.texts[len(r.texts) // 2][:1200],
               max_new_tokens=args.max_new_tokens, shots=args.shots)
    for s, d in sorted(by.items()):
        log(f"  calibration steps {s}: acc {d['acc']:.2f} length {d['len']:.0f} ended {d['ended']:.2f}")
    log(f"calibration: difficulty {out['difficulty']} (pooled acc {out['pooled_accuracy']:.2f}), {r.seconds:.1f} s, "
        f"paths {r.info['decode_paths']}")
    return out


# ------------------------------------------------------------------------------------------------ timing
def timing(model16: Any, tok: Any, difficulty: dict, args: argparse.Namespace, arms: tuple[str, ...]) -> dict:
    """Isolated rollout timing: every arm, same prompts, same number of decode steps (module docstring)."""
    from kvlib.rl.engine import sample_static

    prompt = prompt_function(args, difficulty)
    probs = problems("train", args.prompts, difficulty, seed=4242)
    prompts = [prompt(tok, p) for p in probs for _ in range(args.group)]
    T = args.max_new_tokens
    reps: dict[str, list[dict]] = {a: [] for a in arms}
    for rep in range(args.timing_reps + 1):  # rep 0: warm-up (compilation, autotuning)
        for arm in arms:
            r = sample_static(model16, tok, prompts, fmt=arm, max_new_tokens=T, min_new_tokens=T,
                              generator=torch.Generator().manual_seed(rep))
            row = {"rep": rep, "seconds": r.seconds, **{k: r.info[k] for k in (
                "prefill_seconds", "capture_seconds", "decode_seconds", "steps", "graphed", "kernel", "decode_paths",
                "prefill_path", "kv_nbytes", "batch", "prompt_width")}}
            reps[arm].append(row)
            log(f"  timing rep {rep} {arm}: {r.seconds:.3f} s (decode {r.info['decode_seconds']:.3f} s, "
                f"{r.info['steps']} steps, graphed {r.info['graphed']}, paths {r.info['decode_paths']})")
    summary = {}
    for arm in arms:
        timed = [x for x in reps[arm] if x["rep"] > 0]
        summary[arm] = {"sum_seconds": sum(x["seconds"] for x in timed),
                        "sum_decode_seconds": sum(x["decode_seconds"] for x in timed),
                        "ms_per_step": 1e3 * sum(x["decode_seconds"] for x in timed) / sum(x["steps"] for x in timed)}
    if "bf16" in summary:
        for arm in arms:
            summary[arm]["speedup_vs_bf16"] = summary["bf16"]["sum_seconds"] / summary[arm]["sum_seconds"]
            summary[arm]["decode_speedup_vs_bf16"] = (summary["bf16"]["sum_decode_seconds"]
                                                      / summary[arm]["sum_decode_seconds"])
    return {"reps": reps, "summary": summary, "batch": len(prompts), "steps": T,
            "note": "isolated: one arm at a time on an otherwise idle GPU, same prompts and lengths; "
                    "sum of times over the timed repetitions (rep 0 is a warm-up)"}


# ------------------------------------------------------------------------------------------------ train
def evaluate_greedy(model16: Any, tok: Any, held: list, args: argparse.Namespace, difficulty: dict) -> dict:
    """The common evaluator: greedy, bf16 weights, bf16 passthrough cache, for every arm."""
    from kvlib.rl import task
    from kvlib.rl.engine import sample_static

    prompt = prompt_function(args, difficulty)
    correct, lengths, seconds = [], [], 0.0
    for s in range(0, len(held), args.eval_batch):
        part = held[s:s + args.eval_batch]
        r = sample_static(model16, tok, [prompt(tok, p) for p in part], fmt="bf16", greedy=True,
                          max_new_tokens=args.max_new_tokens, generator=torch.Generator().manual_seed(0))
        correct += [int(task.reward(t, p.answer) > 0) for t, p in zip(r.texts, part, strict=True)]
        lengths += r.lengths.tolist()
        seconds += r.seconds
    return {"accuracy": sum(correct) / max(len(correct), 1), "correct": correct, "uids": [p.uid for p in held],
            "response_length_mean": sum(lengths) / max(len(lengths), 1), "seconds": seconds, "n": len(held)}


# ------------------------------------------------------------------------------------------------ checkpoints
CKPT_STATE = "state.pt"
CKPT_META = "meta.json"


def run_dir(ckpt_dir: str | Path, arm: str, seed: int) -> Path:
    return Path(ckpt_dir) / f"{arm}_seed{seed}"


def rng_state(device: str) -> dict:
    """Every RNG a run draws from: the run's own generator is saved by the caller; these are the globals."""
    import random

    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device == "cuda":
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict, device: str) -> None:
    import random

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if device == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(d: Path, *, policy: Any, opt: Any, gen: torch.Generator, rng: dict, rec: dict,
                    extra: dict | None = None) -> float:
    """Write ``d/state.pt`` (weights, optimizer, RNGs, the run record, ``extra`` entries) and ``d/meta.json``
    atomically (temporary file + ``os.replace``: a kill mid-write leaves the previous checkpoint); returns seconds."""
    from kvlib.publish.provenance import _jsonable

    t0 = time.time()
    d.mkdir(parents=True, exist_ok=True)
    state = {"policy": policy.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(), "rng": rng,
             "iterations_done": rec["iterations_done"], "record": json.dumps(_jsonable(rec)), **(extra or {})}
    tmp = d / (CKPT_STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, d / CKPT_STATE)
    _write(d / CKPT_META, {"arm": rec["arm"], "seed": rec["seed"], "iterations_done": rec["iterations_done"],
                           "iterations_planned": rec["iterations_planned"], "status": rec["status"],
                           "segments": len(rec.get("segments", []))})
    return time.time() - t0


def checkpointed_runs(ckpt_dir: str | Path) -> list[dict]:
    """The runs with a checkpoint in ``ckpt_dir`` (their meta.json), sorted by arm then seed."""
    out = []
    for m in sorted(Path(ckpt_dir).glob(f"*/{CKPT_META}")):
        if (m.parent / CKPT_STATE).is_file():
            out.append(json.loads(m.read_text()))
    return sorted(out, key=lambda r: (ARMS.index(r["arm"]) if r["arm"] in ARMS else 99, r["seed"]))


def _dyn_note(m: dict) -> str:
    """The log's dynamic-sampling clause (empty when the option is off)."""
    if "dyn_groups_kept" not in m:
        return ""
    cap = "" if m["dyn_target_reached"] else " (CAP HIT: trained on fewer)"
    skip = " (NO UPDATE: none informative)" if m["dyn_update_skipped"] else ""
    return (f"; dynamic sampling: {m['dyn_groups_kept']:.0f}/{m['dyn_target_groups']:.0f} informative groups kept of "
            f"{m['dyn_groups_sampled']:.0f} sampled in {m['dyn_sampling_rounds']:.0f} rounds{cap}{skip}")


def train(args: argparse.Namespace) -> int:
    from kvlib.publish.provenance import git_commit, provenance
    from kvlib.rl.engine import sample_static
    from kvlib.rl.loop import frozen_copy, grpo_iteration, sync_weights

    started = _dt.datetime.now(_dt.UTC)
    t_start = time.time()
    deadline = args.deadline or (t_start + args.budget_s)
    cal = json.loads(Path(args.calibration).read_text())
    difficulty = cal["difficulty"]
    torch.manual_seed(args.seed)
    policy, tok = load_policy(args.device, args.tiny)
    cfg = grpo_config(args)
    ref = frozen_copy(policy)
    policy.requires_grad_(True)
    roll16 = frozen_copy(policy).to(torch.bfloat16)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    train_pool = problems("train", args.train_pool, difficulty, seed=0)
    held = problems("heldout", args.heldout, difficulty, seed=1)
    prompt = prompt_function(args, difficulty)
    # memory: an explicit per-process budget (all runs share one GPU), the estimate from the shapes, and
    # activation checkpointing of the decoder layers when the estimate without it does not fit
    widths = [len(tok(prompt(tok, p), add_special_tokens=False)["input_ids"]) for p in held[:32]]
    from kvlib.rl.sampler import _encode, shared_prefix_length

    pid, pmask = _encode(tok, [prompt(tok, p) for p in held[:32]], 0, torch.device("cpu"))
    pre = shared_prefix_length(pid, pmask) if cfg.shared_prefix is not False else 0
    est_kw = dict(rollout_batch=cfg.prompts_per_iteration * cfg.group_size, prompt_tokens=max(widths),
                  max_new_tokens=cfg.max_new_tokens, micro_batch=cfg.micro_batch or cfg.prompts_per_iteration
                  * cfg.group_size, eval_batch=min(args.eval_batch, args.heldout), shared_prefix_tokens=pre)
    n_params = sum(p.numel() for p in policy.parameters())
    est = memory_estimate(policy.config, n_params, **est_kw)
    cap = args.mem_cap_gib
    if args.grad_ckpt == "on" or (args.grad_ckpt == "auto" and cap is not None and est["total_gib"] > 0.7 * cap):
        est = memory_estimate(policy.config, n_params, grad_ckpt=True, **est_kw)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.train()  # HF checkpoints layers only in training mode (Llama has no dropout: same numerics)
    if args.device == "cuda" and cap is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
    log(f"{args.arm} seed {args.seed}: memory estimate {est['total_gib']:.2f} GiB (weights "
        f"{est['weights'] / 2**30:.2f}, rollout {est['rollout'] / 2**30:.2f}, learner {est['learner'] / 2**30:.2f}; "
        f"grad checkpointing {est['grad_ckpt']}), cap {cap} GiB, prompt tokens <= {max(widths)}, shared prefix "
        f"{pre} tokens, learner micro-batch {cfg.micro_batch} ({est['learner_tokens_per_micro_batch']} tokens)")
    sampler = functools.partial(sample_static, fmt=args.arm)
    gen = torch.Generator().manual_seed(args.seed)
    params = {k: v for k, v in vars(args).items() if k not in ("func",)}
    path = Path(args.out) / "rlvr" / f"{args.arm}_seed{args.seed}.json"
    rec: dict[str, Any] = {
        "arm": args.arm, "seed": args.seed, "status": "running", "partial": True, "reason": None,
        "iterations_planned": args.iterations, "iterations_done": 0, "config": asdict(cfg),
        "difficulty": difficulty, "model": "tiny random Llama (wiring check)" if args.tiny else
        "SmolLM2-135M-Instruct (shipped Q4_1 GGUF, dequantised), fp32 master weights",
        "learner": "fp32 master weights, forward under bf16 autocast" if cfg.learner_autocast else "fp32",
        "rollout": f"bf16 copy of the weights, kvlib.make_cache({args.arm!r}) static pools, kvlib.rl.engine",
        "evaluator": "greedy, bf16 weights, bf16 passthrough cache (the same for every arm)",
        "timing_note": "rollout_seconds here are measured while the other runs share the GPU; the speedup comes "
                       "from timing.json (isolated)",
        "history": {}, "rollout_info": [], "eval": {}, "device": _device_name(args.device),
        "memory": {"estimate": est, "cap_gib": cap, "prompt_tokens_max": max(widths)}, "segments": []}
    ckdir = run_dir(args.ckpt_dir, args.arm, args.seed) if args.ckpt_dir else None
    if args.resume:
        # continue the checkpointed run bit-compatibly: weights, optimizer, every RNG, history, record
        if ckdir is None or not (ckdir / CKPT_STATE).is_file():
            raise ValueError(f"--resume: no checkpoint {ckdir and ckdir / CKPT_STATE} (refusing to start afresh "
                             f"under the same seed)")
        st = torch.load(ckdir / CKPT_STATE, map_location="cpu", weights_only=False)
        policy.load_state_dict(st["policy"])
        opt.load_state_dict(st["optimizer"])
        gen.set_state(st["generator"])
        set_rng_state(st["rng"], args.device)
        old = json.loads(st["record"])
        # a checkpoint from before a GRPOConfig field existed ran with that field's default
        old["config"] = {**{k: v for k, v in asdict(type(cfg)()).items() if k not in old["config"]}, **old["config"]}
        if (old["arm"], old["seed"]) != (args.arm, args.seed) or old["config"] != rec["config"]:
            raise ValueError(f"--resume: {ckdir} holds {old['arm']} seed {old['seed']} with config {old['config']}, "
                             f"not this run's {args.arm} seed {args.seed} {rec['config']}")
        for k in ("history", "rollout_info", "eval", "segments", "iterations_done", "reason"):
            rec[k] = old.get(k, rec[k])
        rec["segments_provenance"] = old.get("segments_provenance", []) + [old.get("provenance")]
        rec["iterations_planned"] = args.iterations
        sync_weights(policy, roll16)  # the rollout copy is the policy cast to bf16, as after every update
        del st
        log(f"{args.arm} seed {args.seed}: resumed from {ckdir} at iteration {rec['iterations_done']} "
            f"(segment {len(rec['segments']) + 1})")
    start_it = rec["iterations_done"]
    seg = {"segment": len(rec["segments"]), "commit": git_commit(), "started": started.isoformat(),
           "device": _device_name(args.device), "first_iteration": start_it, "iterations": 0, "resumed": args.resume}
    rec["segments"].append(seg)
    ck_reserve = args.ckpt_reserve_s if ckdir else 0.0

    def save() -> None:
        rec["provenance"] = provenance(params, started)
        _write(path, rec)

    def checkpoint(rng: dict | None = None) -> None:
        nonlocal ck_reserve
        sec = save_checkpoint(ckdir, policy=policy, opt=opt, gen=gen, rng=rng or rng_state(args.device), rec=rec)
        ck_reserve = max(ck_reserve, 2 * sec + 2)
        seg["checkpoint_seconds"] = sec
        log(f"{args.arm} seed {args.seed}: checkpoint at iteration {rec['iterations_done']} in {sec:.1f} s -> {ckdir}")

    if args.resume:
        reserve = args.eval_reserve_s
    elif args.initial_eval:  # the parent evaluated the (shared) initial policy once, with the same evaluator
        rec["eval"]["initial"] = json.loads(Path(args.initial_eval).read_text())
        reserve = args.eval_reserve_s
    else:
        e0 = time.time()
        rec["eval"]["initial"] = evaluate_greedy(roll16, tok, held, args, difficulty)
        reserve = 1.5 * (time.time() - e0) + 5
    if rec["eval"]["initial"]["uids"] != [p.uid for p in held]:
        raise ValueError("--initial-eval: its held-out problems are not this run's")
    log(f"{args.arm} seed {args.seed}: initial held-out accuracy {rec['eval']['initial']['accuracy']:.3f}; "
        f"final-evaluation reserve {reserve:.0f} s")
    save()
    last = 0.0
    rec["reason"] = None
    for it in range(start_it, args.iterations):
        if time.time() + 1.3 * last + reserve + ck_reserve > deadline:
            rec["reason"] = f"time budget: stopped after {it} of {args.iterations} iterations"
            break
        if args.segment_iterations is not None and it - start_it >= args.segment_iterations:
            rec["reason"] = f"--segment-iterations {args.segment_iterations}: stopped after {it} iterations"
            break
        ti = time.time()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        def draw(n: int) -> list:  # the run's problem stream (also the later rounds of dynamic sampling)
            return [train_pool[i] for i in torch.randperm(len(train_pool), generator=gen)[:n].tolist()]

        m = grpo_iteration(policy, ref, opt, tok, draw(cfg.prompts_per_iteration), cfg=cfg, cache_factory=None,
                           generator=gen, rollout_model=roll16, prompt_fn=lambda t, p: prompt(t, p), sampler=sampler,
                           more_problems=draw if cfg.dynamic_sampling else None)
        info = grpo_iteration.last_rollout_info
        if not all(math.isfinite(v) for v in m.values()):
            rec["reason"] = f"non-finite metric at iteration {it}"
            rec["history_nonfinite"] = m
            break
        h = rec["history"]
        h.setdefault("iteration", []).append(it)
        for k, v in m.items():
            h.setdefault(k, []).append(v)
        for k in ("prefill_seconds", "capture_seconds", "decode_seconds"):
            h.setdefault(f"rollout_{k}", []).append(info[k])
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
        h.setdefault("max_memory_allocated_gib", []).append(peak)
        rec["rollout_info"].append({**{k: info[k] for k in ("decode_paths", "prefill_path", "kernel", "graphed",
                                                             "steps")},
                                    "learner": grpo_iteration.last_learner_info,
                                    **({"rounds": len(info["rounds"])} if "rounds" in info else {})})
        rec["iterations_done"] = it + 1
        seg["iterations"] = it + 1 - start_it
        last = time.time() - ti
        log(f"{args.arm} s{args.seed} it {it}: reward {m['reward_mean']:.3f} len {m['response_length_mean']:.0f} "
            f"refKL {m['ref_kl_k3']:.2e} sKL {m['sampler_learner_kl_k3']:.2e} rollout {m['rollout_seconds']:.2f}s "
            f"iter {last:.2f}s peak {peak if peak is None else round(peak, 2)} GiB graphed {info['graphed']} "
            f"{info['decode_paths']} learner {m['learner_tokens']:.0f} tokens "
            f"(full path {m['learner_full_path_tokens']:.0f}) {m['learner_calls']:.0f} calls{_dyn_note(m)}")
        save()
        if ckdir and args.ckpt_every and (it + 1 - start_it) % args.ckpt_every == 0 and it + 1 < args.iterations:
            checkpoint()
    sync_weights(policy, roll16)
    rng = rng_state(args.device)  # the state a continuation starts from (the evaluator below draws nothing of it)
    rec["status"] = "complete" if rec["iterations_done"] == args.iterations else "partial"
    rec["partial"] = rec["status"] != "complete"
    rec["eval"]["final"] = evaluate_greedy(roll16, tok, held, args, difficulty)
    rec["eval"].setdefault("segment_final", []).append({"segment": seg["segment"], "iterations": rec["iterations_done"],
                                                        "accuracy": rec["eval"]["final"]["accuracy"]})
    rec["seconds"] = time.time() - t_start
    seg["seconds"] = rec["seconds"]
    rec["n_segments"] = len(rec["segments"])
    rec["resumable"] = bool(ckdir) and rec["status"] != "complete"
    if ckdir:
        checkpoint(rng)
    save()
    log(f"{args.arm} seed {args.seed}: {rec['status']} after {rec['iterations_done']} iterations; held-out "
        f"{rec['eval']['initial']['accuracy']:.3f} -> {rec['eval']['final']['accuracy']:.3f}")
    return 0


# ------------------------------------------------------------------------------------------------ all
def _forward_args(args: argparse.Namespace) -> list[str]:
    keys = ("device", "max_new_tokens", "group", "prompts", "lr", "beta", "tis_cap", "micro_batch",
            "score_micro_batch", "shots", "target_groups", "max_sampling_rounds",
            "iterations", "train_pool", "heldout", "eval_batch", "shared_prefix", "ckpt_dir", "ckpt_every",
            "ckpt_reserve_s", "segment_iterations")
    out = ["--tiny"] if args.tiny else []
    for k in keys:
        v = getattr(args, k)
        out += [f"--{k.replace('_', '-')}", "none" if v is None else str(v)]
    if args.gguf:
        out += ["--gguf", args.gguf]
    if args.resume:
        out.append("--resume")
    if args.dynamic_sampling:
        out.append("--dynamic-sampling")
    return out


def run_all(args: argparse.Namespace) -> int:
    from kvlib.publish.provenance import provenance

    started = _dt.datetime.now(_dt.UTC)
    t0 = time.time()
    deadline = t0 + args.budget_s
    out = Path(args.out) / "rlvr"
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results)
    arms = tuple(a for a in args.arms.split(",") if a)
    bad = sorted(set(arms) - set(ARMS))
    if bad:
        raise ValueError(f"--arms: unknown arm(s) {bad}; arms are {ARMS}")
    fails: list[str] = []
    ck = Path(args.ckpt_dir) if args.ckpt_dir else None
    if args.resume:
        found = checkpointed_runs(ck) if ck is not None and ck.is_dir() else []
        if not found:
            print(f"FAIL: --resume: no checkpointed run in {ck} (nothing to continue; not starting fresh runs under "
                  f"the same seeds)")
            print("SUMMARY: FAIL (1)")
            return 2
        log(f"resume: {len(found)} checkpointed runs in {ck}: " + ", ".join(
            f"{m['arm']} s{m['seed']} ({m['status']}, {m['iterations_done']} it, {m['segments']} segments)"
            for m in found))
    model, tok = load_policy(args.device, args.tiny)
    model16 = model.to(torch.bfloat16)
    cal_path = results / "calibration.json"
    if args.resume:  # the checkpointed runs' own task
        cal = json.loads((ck / "calibration.json").read_text())
        log(f"calibration: the checkpoint's ({ck / 'calibration.json'}): difficulty {cal['difficulty']}")
    elif args.calibrate:
        cal = calibrate(model16, tok, args)
        cal["provenance"] = provenance({k: v for k, v in vars(args).items() if k != "func"}, started)
        cal["device"] = _device_name(args.device)
    elif cal_path.is_file():
        cal = json.loads(cal_path.read_text())
        log(f"calibration: reusing {cal_path}: difficulty {cal['difficulty']}")
    else:  # the committed setting, calibrated on the CPU with the real model (kvlib.rl.task docstring)
        from kvlib.rl import task

        c = task.CPU_CALIBRATION
        cal = {"difficulty": dict(task.DIFFICULTY), "source": "CPU calibration (kvlib.rl.task.CPU_CALIBRATION)",
               "pooled_accuracy": c["accuracy"], "target": TARGET_ACC, "prompt_tokens_mean": c["prompt_tokens_mean"],
               "cpu_calibration": c, "shots": task.DEFAULT_SHOTS}
        if args.shots != task.DEFAULT_SHOTS or args.max_new_tokens < c["max_new_tokens"]:
            log(f"WARNING: --shots {args.shots} / --max-new-tokens {args.max_new_tokens} differ from the CPU "
                f"calibration's {task.DEFAULT_SHOTS} / {c['max_new_tokens']}: its accuracy does not apply")
        log(f"calibration: the committed setting {cal['difficulty']}")
    if "provenance" not in cal:  # the file this call writes says which call wrote it, also when nothing was measured
        cal["provenance"] = provenance({k: v for k, v in vars(args).items() if k != "func"}, started)
    _write(out / "calibration.json", cal)
    if ck is not None:
        _write(ck / "calibration.json", cal)
    if ck is not None and (ck / "timing.json").is_file() and (args.resume or not args.force):
        tm = json.loads((ck / "timing.json").read_text())
        _write(out / "timing.json", tm)
        log(f"timing: measured in an earlier call ({ck / 'timing.json'}), not repeated; copied to {out}")
    elif (results / "timing.json").is_file() and not args.force:
        log("timing: already in results (use --force to measure again)")
    else:
        tm = timing(model16, tok, cal["difficulty"], args, arms)
        tm["device"] = _device_name(args.device)
        tm["provenance"] = provenance({k: v for k, v in vars(args).items() if k != "func"}, started)
        _write(out / "timing.json", tm)
        if ck is not None:
            _write(ck / "timing.json", tm)
        for arm, s in tm["summary"].items():
            log(f"timing {arm}: sum {s['sum_seconds']:.2f} s, {s['ms_per_step']:.3f} ms/step, "
                f"speedup vs bf16 {s.get('speedup_vs_bf16', float('nan')):.2f}x")
            paths = {p for r in tm["reps"][arm] for p in r["decode_paths"]}
            if args.device == "cuda" and not all(r["kernel"] and r["graphed"] for r in tm["reps"][arm]):
                fails.append(f"timing {arm}: not every rollout was graphed on the kernel path ({sorted(paths)})")
    held = problems("heldout", args.heldout, cal["difficulty"], seed=1)
    if ck is not None and (ck / "initial_eval.json").is_file() and (args.resume or not args.force):
        ev0 = json.loads((ck / "initial_eval.json").read_text())
        eval_s = ev0["wall_seconds"]
        if ev0["uids"] != [p.uid for p in held]:
            raise ValueError(f"{ck / 'initial_eval.json'}: its held-out problems are not this call's")
        log(f"initial policy: evaluated in an earlier call ({ck / 'initial_eval.json'}), not repeated: held-out "
            f"accuracy {ev0['accuracy']:.3f} ({eval_s:.1f} s then)")
    else:
        e0 = time.time()
        ev0 = evaluate_greedy(model16, tok, held, args, cal["difficulty"])
        eval_s = time.time() - e0
        ev0["wall_seconds"] = eval_s
        ev0["provenance"] = provenance({k: v for k, v in vars(args).items() if k != "func"}, started)
        log(f"initial policy, held-out accuracy {ev0['accuracy']:.3f} (greedy bf16 evaluator, {eval_s:.1f} s)")
    _write(out / "initial_eval.json", ev0)
    if ck is not None:
        _write(ck / "initial_eval.json", ev0)
    del model, model16
    if args.device == "cuda":
        torch.cuda.empty_cache()
    # runs: per arm, the lowest seeds that have no result yet (later calls add seeds)
    runs = []
    if args.resume:  # every checkpointed run not yet complete, whatever --arms / --n-seeds say
        runs = [(m["arm"], m["seed"]) for m in found if m["status"] != "complete"]
        done = [(m["arm"], m["seed"]) for m in found if m["status"] == "complete"]
        if done:
            log(f"resume: already complete, not continued: {done}")
    else:
        for arm in arms:
            have = ({int(p.stem.split("_seed")[1]) for p in results.glob(f"{arm}_seed*.json")}
                    if not args.force else set())
            seeds = [s for s in range(1000) if s not in have][:args.n_seeds]
            runs += [(arm, s) for s in seeds]
        clash = [r for r in runs if ck is not None and (run_dir(ck, *r) / CKPT_STATE).is_file()]
        if clash and not args.force:
            print(f"FAIL: checkpoints of {clash} already in {ck}: continue them with --resume (or --force to restart)")
            print("SUMMARY: FAIL (1)")
            return 2
    cap = args.mem_cap_gib
    if cap is None and args.device == "cuda" and runs:
        # the runs share the GPU: each gets an equal allocator cap, after ~1 GiB per process of CUDA context
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        cap = round((0.88 * total - len(runs)) / len(runs), 2)
    log(f"training runs (concurrent): {runs}; {deadline - time.time():.0f} s left; per-process memory cap {cap} GiB")
    # the final evaluations of all runs overlap at the end: reserve for them together
    reserve = 1.3 * eval_s * max(len(runs), 1) + 10
    procs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    for arm, seed in runs:
        logf = open(out / f"{arm}_seed{seed}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "dev.rlvr_runs", "train", "--arm", arm, "--seed", str(seed), "--out", args.out,
               "--deadline", str(deadline - args.train_margin_s), "--calibration", str(out / "calibration.json"),
               "--initial-eval", str(out / "initial_eval.json"), "--eval-reserve-s", str(reserve),
               "--mem-cap-gib", "none" if cap is None else str(cap), "--grad-ckpt", args.grad_ckpt,
               *_forward_args(args)]
        procs.append((arm, seed, subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env), logf))
    for arm, seed, p, logf in procs:
        try:
            rc = p.wait(timeout=max(1.0, deadline + args.exit_grace_s - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()  # our own child, by its handle; its last per-iteration JSON stays (partial)
            rc = p.wait()
            fails.append(f"{arm} seed {seed}: killed at the budget (its JSON is the last iteration's, partial)")
        logf.close()
        if rc not in (0, -9):
            fails.append(f"{arm} seed {seed}: exit code {rc} (see {arm}_seed{seed}.log)")
            tail = (out / f"{arm}_seed{seed}.log").read_text().splitlines()[-15:]
            print("\n".join(f"    {ln}" for ln in tail))
    for arm, seed in runs:
        f = out / f"{arm}_seed{seed}.json"
        if not f.is_file():
            fails.append(f"{arm} seed {seed}: no result JSON")
            continue
        r = json.loads(f.read_text())
        h = r["history"]
        rw = h.get("reward_mean", [])
        paths = sorted({p for x in r["rollout_info"] for p in x["decode_paths"]})
        graphed = all(x["graphed"] for x in r["rollout_info"]) if r["rollout_info"] else False
        ev = r["eval"]
        log(f"{arm} seed {seed}: {r['status']} {r['iterations_done']} it; reward first/last "
            f"{rw[:1]} / {rw[-1:]}; held-out {ev.get('initial', {}).get('accuracy')} -> "
            f"{ev.get('final', {}).get('accuracy')}; paths {paths} graphed {graphed}")
        if args.device == "cuda" and (not graphed or any(p in ("torch-reference", "none") for p in paths)):
            fails.append(f"{arm} seed {seed}: rollouts not all graphed on the kernel path ({paths})")
        if r["iterations_done"] == 0:
            fails.append(f"{arm} seed {seed}: no iteration finished")
    log(f"wall {time.time() - t0:.0f} s")
    for f in fails:
        print("FAIL:", f)
    print("SUMMARY:", "PASS" if not fails else f"FAIL ({len(fails)})")
    return 1 if fails else 0


def _none_or(kind):
    return lambda s: None if s.lower() == "none" else kind(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("all", "train"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/rlvr_out"))
    ap.add_argument("--gguf", default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf (else the installed one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama (wiring check)")
    ap.add_argument("--results", default=str(RESULTS), help="committed results: existing runs are skipped")
    ap.add_argument("--force", action="store_true", help="redo calibration, timing and runs that have results")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--n-seeds", type=int, default=3, help="new seeds per arm in this call")
    ap.add_argument("--budget-s", type=float, default=555.0, help="wall budget of `all` from its start")
    ap.add_argument("--train-margin-s", type=float, default=15.0, help="runs must be done this long before it")
    ap.add_argument("--exit-grace-s", type=float, default=10.0, help="past the budget, then a run is killed")
    ap.add_argument("--iterations", type=int, default=200, help="upper bound; the budget usually ends runs first")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="2-step solutions are ~45 tokens")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--dynamic-sampling", action="store_true",
                    help="DAPO dynamic sampling: rounds of --prompts prompts, keep only groups with mixed rewards "
                         "until --target-groups are kept or --max-sampling-rounds are spent (default off)")
    ap.add_argument("--target-groups", type=_none_or(int), default=None,
                    help="informative groups per update with --dynamic-sampling (none: --prompts)")
    ap.add_argument("--max-sampling-rounds", type=int, default=4, help="cap on rounds with --dynamic-sampling")
    ap.add_argument("--beta", type=float, default=1e-3)
    ap.add_argument("--tis-cap", type=_none_or(float), default=2.0)
    ap.add_argument("--micro-batch", type=_none_or(int), default=16,
                    help="learner (update) micro-batch: with the shared prompt prefix run once a row costs only its "
                         "suffix (~140 tokens); 16 rows keep the estimate (printed) under 70%% of the cap of 9 runs, "
                         "so no gradient checkpointing (which would force the full path)")
    ap.add_argument("--score-micro-batch", type=_none_or(int), default=64,
                    help="micro-batch of the no-grad pi_ref / pi_old scoring (no activations kept)")
    ap.add_argument("--shared-prefix", choices=("auto", "on", "off"), default="auto",
                    help="learner scoring with the prompts' common prefix run once (auto: when >= 32 tokens)")
    ap.add_argument("--ckpt-dir", type=_none_or(str), default=None,
                    help="checkpoint runs here (weights, optimizer, RNGs, history)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N iterations (and at the end)")
    ap.add_argument("--ckpt-reserve-s", type=float, default=20.0,
                    help="train: time kept for the last checkpoint (raised to 2x the measured write)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the runs checkpointed in --ckpt-dir (all: every one found there; none: FAIL)")
    ap.add_argument("--segment-iterations", type=_none_or(int), default=None,
                    help="train: stop this process after N iterations (a checkpointed run continues with --resume)")
    ap.add_argument("--shots", type=int, default=10, help="worked examples (kvlib.rl.task.DEFAULT_SHOTS)")
    ap.add_argument("--train-pool", type=int, default=1024)
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--eval-batch", type=int, default=128)
    ap.add_argument("--calibrate", action="store_true", help="run the GPU calibration (default: the committed setting)")
    ap.add_argument("--cal-per-steps", type=int, default=16)
    ap.add_argument("--timing-reps", type=int, default=2, help="timed repetitions after a warm-up (~30 s in all)")
    ap.add_argument("--arm", choices=ARMS, help="train: the rollout cache format")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=None, help="train: absolute time.time() to finish by")
    ap.add_argument("--calibration", default=None, help="train: calibration.json")
    ap.add_argument("--initial-eval", default=None, help="train: the initial policy's evaluation (from `all`)")
    ap.add_argument("--mem-cap-gib", type=_none_or(float), default=None,
                    help="train: per-process CUDA memory cap (set_per_process_memory_fraction); `all` sets it")
    ap.add_argument("--grad-ckpt", choices=("auto", "on", "off"), default="auto",
                    help="train: activation checkpointing (auto: when the estimate exceeds 70%% of the cap)")
    ap.add_argument("--eval-reserve-s", type=float, default=30.0, help="train: time kept for the final evaluation")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device")
    install_gguf(args.gguf)
    if args.phase == "train":
        if args.arm is None or args.calibration is None:
            raise ValueError("train needs --arm and --calibration")
        return train(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
