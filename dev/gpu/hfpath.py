"""GPU check of the HF path (issue 24): random bf16 decoders decoding on cuda through kvlib.make_cache.

Per model (a SmolLM2-shaped tiny Llama, d=64; a Qwen2.5-7B-shaped 2-layer decoder, 28/4 heads, d=128) and
format (bf16, dither-int8 h8, rtn-int8, kv4, kv4rl): the decode path each layer took, max |logit diff| vs
DynamicCache + SDPA (teacher-forced on the same tokens, relative to the reference logits' std), kv_nbytes
over the bf16 cache's, and one CUDA-graph-captured decode step's time beside DynamicCache's eager step.
Prints PASS/FAIL lines and writes $OUT/hfpath.json. Speed is reported, never asserted.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import kvlib

FORMATS = {"bf16": {}, "dither-int8": {"dither_layout": "h8"}, "rtn-int8": {}, "kv4": {}, "kv4rl": {}}
#: relative logit tolerance (max |diff| / std of the reference logits) per format, a few times the CPU runs'
TOL = {"bf16": 0.02, "dither-int8": 0.1, "rtn-int8": 0.1, "kv4": 0.6, "kv4rl": 0.4}
KERNEL_EXPECTED = {"bf16": ("bf16-triton",), "dither-int8": ("int8-gluon", "int8-h10")}
results: list[dict] = []
fails: list[str] = []


def line(status: str, msg: str) -> None:
    print(f"{status}: {msg}", flush=True)
    if status == "FAIL":
        fails.append(msg)


def models():
    torch.manual_seed(0)
    tiny = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=4096, max_position_embeddings=8192)
    qwen = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=2, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, vocab_size=32768, max_position_embeddings=32768)
    def build(cls, cfg):
        with torch.device("cuda"):  # random weights made on the device (speed does not depend on their values)
            return cls(cfg)

    yield "tiny-llama-d64", build(LlamaForCausalLM, tiny), 4, 256
    yield "qwen2.5-7b-shape-2L", build(Qwen2ForCausalLM, qwen), 8, 2048


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


@torch.no_grad()
def run_model(name: str, model, B: int, S: int, steps: int = 6) -> None:
    model = model.to("cuda", torch.bfloat16).eval()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (B, S), device="cuda")
    # reference: DynamicCache + SDPA, greedy; the formats are teacher-forced on its tokens
    ref_cache = DynamicCache(config=cfg)
    out = model(ids, past_key_values=ref_cache)
    toks, ref_logits = [], [out.logits[:, -1].float()]
    for _ in range(steps):
        nxt = ref_logits[-1].argmax(-1, keepdim=True)
        toks.append(nxt)
        ref_logits.append(model(nxt, past_key_values=ref_cache).logits[:, -1].float())
    std = torch.stack(ref_logits).std().item()
    pos0 = S + steps
    nxt = toks[-1]
    dyn_ms = timed(lambda: model(nxt, past_key_values=ref_cache, position_ids=torch.full((B, 1), pos0,
                                                                                          device="cuda")))
    # DynamicCache grew by the timing steps; only its time is used from here on
    line("INFO", f"{name}: B={B} S={S} DynamicCache eager decode step {dyn_ms:.3f} ms")
    max_len = S + steps + 64
    base_bytes = None
    for fmt, opts in FORMATS.items():
        rec = {"model": name, "format": fmt, "B": B, "S": S}
        try:
            cache = kvlib.make_cache(fmt, cfg, batch_size=B, max_len=max_len, device="cuda", **opts)
            lg = [model(ids, past_key_values=cache).logits[:, -1].float()]
            for t in toks:
                lg.append(model(t, past_key_values=cache).logits[:, -1].float())
            paths = sorted({cache.kernel_path(i) for i in range(cfg.num_hidden_layers)})
            diff = max(float((a - b).abs().max()) for a, b in zip(lg, ref_logits))
            rel = diff / std
            nb = cache.kv_nbytes()
            base_bytes = nb if fmt == "bf16" else base_bytes
            rec.update(kernel_path=paths, max_abs_logit_diff=diff, rel_logit_diff=rel, kv_nbytes=nb,
                       kv_ratio_vs_bf16=nb / base_bytes if base_bytes else None)
            line("INFO", f"{name} {fmt}: kernel_path={paths} max|dlogit|={diff:.4g} ({rel:.3g} std) "
                         f"kv_nbytes={nb} ratio_vs_bf16={rec['kv_ratio_vs_bf16']:.3f}")
            line("PASS" if rel <= TOL[fmt] else "FAIL", f"{name} {fmt}: logits within {TOL[fmt]} std ({rel:.3g})")
            want = KERNEL_EXPECTED.get(fmt) if name.startswith("qwen") else None
            if want:
                line("PASS" if paths and all(p in want for p in paths) else "FAIL",
                     f"{name} {fmt}: decode kernel taken ({paths}, expected one of {want})")
            if fmt == "dither-int8":
                c = cache.certificates()
                ok = c.numel() > 0 and bool(torch.isfinite(c).any())
                rec["certificates_shape"] = list(c.shape)
                rec["certificate_summary"] = cache.certificate_summary()
                line("PASS" if ok else "FAIL", f"{name} {fmt}: kernel certificates on device {list(c.shape)} "
                                               f"summary={rec['certificate_summary']}")
            if any(p == "torch-reference" for p in paths):
                line("INFO", f"{name} {fmt}: reference path, no CUDA graph (host-side reads)")
            else:
                rec.update(graph_step(model, cache, toks[-1], B, S + steps, dyn_ms))
        except Exception as e:  # noqa: BLE001 - report and continue with the next format
            traceback.print_exc()
            rec["error"] = repr(e)
            line("FAIL", f"{name} {fmt}: {e!r}")
        results.append(rec)
        torch.cuda.empty_cache()


def graph_step(model, cache, tok, B: int, pos: int, dyn_ms: float) -> dict:
    """Capture one decode step (static pools: device-side seq_lens) and time its replay."""
    static_ids = tok.clone()
    static_pos = torch.full((B, 1), pos, device="cuda", dtype=torch.long)
    eager_ms = timed(lambda: model(static_ids, position_ids=static_pos, past_key_values=cache), reps=3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            model(static_ids, position_ids=static_pos, past_key_values=cache)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = model(static_ids, position_ids=static_pos, past_key_values=cache).logits
    before = cache.layers[0].table.seq_lens.clone()
    certified = lambda: int((~torch.isnan(cache.certificates())).sum()) if "_cert_buf" in cache.layers[0].__dict__ \
        else -1  # noqa: E731
    c0 = certified()
    g.replay()
    torch.cuda.synchronize()
    advanced = bool((cache.layers[0].table.seq_lens == before + 1).all())
    if c0 >= 0:
        c1 = certified()
        line("PASS" if c1 > c0 else "FAIL", f"graph step records its certificates on the device ({c0} -> {c1})")
    finite = bool(torch.isfinite(static_out).all())
    ms = timed(g.replay, reps=10)
    name = "graph step"
    line("PASS" if advanced and finite else "FAIL",
         f"{name}: captured decode step replays (seq_lens advance on the device: {advanced}, finite: {finite}); "
         f"{ms:.3f} ms vs DynamicCache eager {dyn_ms:.3f} ms (ratio {dyn_ms / ms:.2f}x), kvlib eager {eager_ms:.3f} ms")
    return {"graph_ms": ms, "eager_ms": eager_ms, "dynamic_eager_ms": dyn_ms}


def main() -> int:
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    t0 = time.time()
    print("kernel formats:", kvlib.kernel_formats())
    for name, model, B, S in models():
        run_model(name, model, B, S)
        del model
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "hfpath.json"), "w") as f:
        json.dump({"results": results, "fails": fails, "seconds": time.time() - t0}, f, indent=1, default=str)
    print(f"SUMMARY: {'PASS' if not fails else 'FAIL'} ({len(fails)} failures) in {time.time() - t0:.0f}s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
