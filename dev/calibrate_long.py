"""CPU calibration of the long running-sum task (kvlib.rl.longtask) with the real SmolLM2-135M.

For each step count in ``--steps``: ``--questions`` held-out problems (seed 777), ``--samples`` responses each at
temperature 1 (no top-k/top-p) from SmolLM2-135M-Instruct (shipped GGUF, dequantised, fp32, CPU), with the runs'
prompt (:func:`kvlib.rl.longtask.sum_prompt_fn`: ``--shots`` worked examples at the same step count, chat
template). Prints and writes one JSON record per step count: accuracy (exact match on the last box) with its
Wilson 95% interval, the 95% interval of a question-clustered bootstrap (samples of one question are not
independent), the per-step accuracy (:func:`kvlib.rl.longtask.step_accuracy`), mean response tokens, the
fraction that ended (EOS), prompt tokens, three example responses.

CPU cost: the few-shot prefix shared by every prompt is prefilled once per step count and its ``DynamicCache``
copied per question (repeated ``--samples`` times), so a question costs only its suffix and the decode.

    PYTHONPATH=. python -m dev.calibrate_long --steps 12 16 20 --questions 8 --samples 4 --out cal.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, c - h), min(1.0, c + h))


def cluster_bootstrap(per_question: list[list[float]], reps: int = 10_000, seed: int = 0) -> tuple[float, float]:
    import numpy as np

    a = np.array([np.mean(q) for q in per_question])
    rng = np.random.default_rng(seed)
    m = a[rng.integers(0, len(a), size=(reps, len(a)))].mean(axis=1)
    return (float(np.quantile(m, 0.025)), float(np.quantile(m, 0.975)))


def calibrate(model, tok, steps: int, *, questions: int, samples: int, max_new_tokens: int, shots: int,
              max_operand: int, seed: int, anchor: bool = True, style: str = "short", kind: str = "repeat",
              min_operand: int = 2, max_start: int | None = None) -> dict:
    from transformers import DynamicCache

    from kvlib.rl import longtask

    diff = dict(kind=kind, min_steps=steps, max_steps=steps, max_operand=max_operand, min_operand=min_operand,
                max_start=max_start)
    probs = longtask.make_sum_problems("heldout", questions, seed=777, **diff)
    pf = longtask.sum_prompt_fn(shots=shots, anchored=anchor, style=style, **diff)
    ids = [tok(pf(tok, p), add_special_tokens=False)["input_ids"] for p in probs]
    n = 0
    while all(len(x) > n and x[n] == ids[0][n] for x in ids):
        n += 1
    n -= 1  # every suffix keeps at least one token
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    with torch.no_grad():
        prefix = DynamicCache()
        model(input_ids=torch.tensor([ids[0][:n]]), past_key_values=prefix, use_cache=True)
    eos = tok.eos_token_id
    per_q, res = [], []
    for qi, (p, x) in enumerate(zip(probs, ids, strict=True)):
        c = copy.deepcopy(prefix)
        c.batch_repeat_interleave(samples)
        out: list[list[int]] = [[] for _ in range(samples)]
        done = torch.zeros(samples, dtype=torch.bool)
        with torch.no_grad():
            lg = model(input_ids=torch.tensor([x[n:]]).repeat(samples, 1), past_key_values=c,
                       use_cache=True).logits[:, -1]
            for _ in range(max_new_tokens):
                nt = torch.multinomial(torch.softmax(lg.float(), -1), 1, generator=gen).squeeze(1)
                for i in range(samples):
                    if not done[i]:
                        out[i].append(int(nt[i]))
                done |= nt == eos
                if done.all():
                    break
                lg = model(input_ids=nt[:, None], past_key_values=c, use_cache=True).logits[:, -1]
        rs = []
        for o in out:
            txt = tok.decode(o, skip_special_tokens=True)
            r = longtask.sum_reward(txt, p)
            rs.append(r)
            good, steps_ = longtask.step_accuracy(txt, p)
            res.append({"r": r, "len": len(o), "ended": eos in o, "text": txt, "steps_ok": good, "steps": steps_})
        per_q.append(rs)
        print(f"  steps {steps}: question {qi + 1}/{len(probs)} rewards {rs} ({time.time() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    k, m = int(sum(r["r"] for r in res)), len(res)
    step_rate = sum(r["steps_ok"] for r in res) / sum(r["steps"] for r in res)
    return {"steps": steps, "min_operand": min_operand, "max_operand": max_operand, "max_start": max_start,
            "shots": shots, "anchor": anchor,
            "style": style, "kind": kind,
            "step_accuracy": step_rate, "step_accuracy_pow_steps": step_rate ** steps, "questions": len(probs),
            "samples": samples, "n": m, "correct": k, "accuracy": k / m, "wilson95": wilson(k, m),
            "cluster_bootstrap95": cluster_bootstrap(per_q), "max_new_tokens": max_new_tokens,
            "response_tokens_mean": sum(r["len"] for r in res) / m, "ended": sum(r["ended"] for r in res) / m,
            "prompt_tokens_mean": sum(map(len, ids)) / len(ids), "shared_prefix_tokens": n,
            "seconds": time.time() - t0, "examples": [r["text"] for r in res[:3]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.calibrate_long", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[12, 16, 20], help="step counts (difficulty) to measure")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="responses per question")
    ap.add_argument("--max-new-tokens", type=int, default=640)
    ap.add_argument("--shots", type=int, default=2)
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--min-operand", type=int, default=2)
    ap.add_argument("--max-start", type=int, default=None, help="starts in 0..MAX_START (default 10 x max operand)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-anchor", action="store_true", help="do not start the assistant turn with 'Start: s.'")
    ap.add_argument("--kind", default="repeat", help="running-sum kind (kvlib.rl.longtask.KINDS)")
    ap.add_argument("--style", default="short", help="line format of the solutions (kvlib.rl.longtask.STYLES)")
    ap.add_argument("--out", default="calibrate_long.json")
    args = ap.parse_args(argv)
    from kvlib.hf.model import load_model
    from kvlib.publish.provenance import provenance, write_json_atomic

    started = __import__("datetime").datetime.now(__import__("datetime").timezone.utc)
    model, tok = load_model(dtype=torch.float32, device="cpu")
    model.config._attn_implementation = "sdpa"
    rows = []
    for s in args.steps:
        rec = calibrate(model, tok, s, questions=args.questions, samples=args.samples,
                        max_new_tokens=args.max_new_tokens, shots=args.shots, max_operand=args.max_operand,
                        seed=args.seed, anchor=not args.no_anchor, style=args.style, kind=args.kind,
                        min_operand=args.min_operand, max_start=args.max_start)
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "examples"}), flush=True)
    out = {"provenance": provenance(vars(args), started), "model": "SmolLM2-135M-Instruct GGUF, fp32, CPU",
           "rows": rows}
    write_json_atomic(Path(args.out), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
