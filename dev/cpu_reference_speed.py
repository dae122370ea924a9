"""CPU reference path against DynamicCache: decode time per format on SmolLM2-135M (issue 37, item 10).

Batch 4, a 256-token prompt, 32 decoded tokens (the issue's shape; the real-model notebooks decode at batch 2-25
over prompts of 256-2048 tokens). Each format and DynamicCache are timed interleaved, ``--reps`` rounds, and the
ratio of medians is printed (the machine is shared: only side-by-side ratios mean anything). The process's CPU
time is the measure (one thread): other jobs on a shared machine stretch the wall clock, not it.
Before/after: run it with ``PYTHONPATH`` pointing at each checkout in turn (the script itself imports kvlib only).

    python dev/cpu_reference_speed.py [--formats a,b] [--reps 3] [--profile out.txt]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode_time(model, ids, make, n_new: int, profiler=None) -> float:
    cache = make()
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        if profiler is not None:  # the decode steps only
            profiler.start()
        t0 = time.process_time()
        for _ in range(n_new):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        return time.process_time() - t0


def main() -> None:
    from transformers import DynamicCache

    from kvlib.hf.cache import make_cache
    from kvlib.hf.gate import make_gated_cache
    from kvlib.hf.model import load_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp32,bf16,rtn-int8,dither-int8,sr-int8,fp8-e4m3,kv4,kv4rl,kivi2,gated")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default=None, help="pyinstrument one decode of the first format into this file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, _ = load_model()
    ids = torch.randint(100, 20000, (a.batch, a.prompt), generator=torch.Generator().manual_seed(0))

    def maker(f: str):
        if f == "dynamic":
            return lambda: DynamicCache(config=model.config)
        if f == "gated":
            return lambda: make_gated_cache("dither-int8", model.config)
        return lambda: make_cache(f, model.config)

    fmts = a.formats.split(",")
    if a.profile:
        from pyinstrument import Profiler

        decode_time(model, ids, maker(fmts[0]), 2)
        p = Profiler(interval=0.002)
        decode_time(model, ids, maker(fmts[0]), a.new, profiler=p)
        p.stop()
        with open(a.profile, "w") as fh:
            fh.write(p.output_text(unicode=False, color=False, show_all=False))
        return
    decode_time(model, ids, maker("dynamic"), 2)  # warm-up
    times: dict[str, list[float]] = {f: [] for f in ["dynamic", *fmts]}
    for _ in range(a.reps):
        for f in times:
            times[f].append(decode_time(model, ids, maker(f), a.new))
    base = statistics.median(times["dynamic"])
    print(f"batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, {a.reps} interleaved rounds, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'cache':<14}{'decode cpu s':>13}{'vs Dynamic':>12}")
    for f, ts in times.items():
        m = statistics.median(ts)
        print(f"{f:<14}{m:>13.3f}{m / base:>11.2f}x")


if __name__ == "__main__":
    main()
