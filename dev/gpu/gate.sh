#!/usr/bin/env bash
# GPU check of the certificate gate (kvlib.gate) on the kernel path: shadow on device and in pinned host memory,
# head and block levels, and the fixed-shape path (max_repairs_per_step); exactness at tau=0 against the fp32 cache;
# the no-repair step's cost beside the raw cache.
# Runs from the repo root in < 4 min; prints PASS/FAIL; writes $OUT/gate.json.
set -euo pipefail
OUT="${OUT:-/tmp}"
PY="${PY:-python}"
PYTHONPATH="$PWD" OUT="$OUT" "$PY" - <<'PY'
import json, os, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from kvlib.hf.cache import make_cache
from kvlib.gate import make_gated_cache

dev = "cuda"
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, vocab_size=512, max_position_embeddings=4096)
model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
ids = torch.randint(0, 512, (4, 1024), device=dev)

@torch.no_grad()
def run(cache, steps=8):
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1].float()]
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for t in range(steps):
        out = model(input_ids=torch.full((ids.shape[0], 1), 7 + t, device=dev), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
    torch.cuda.synchronize()
    return torch.stack(logits, 1), (time.perf_counter() - t0) / steps

res, ok = {}, True
ref, _ = run(make_cache("bf16", cfg))
raw, t_raw = run(make_cache("dither-int8", cfg, dither_layout="h8", block_size=32))
for shadow in ("device", "host"):
    for level in ("head", "block") + (("fixed",) if shadow == "device" else ()):
        # "fixed": the fixed-shape (capturable) path, its budget covering every (row, KV head) group
        budget = dict(max_repairs_per_step=ids.shape[0] * cfg.num_key_value_heads) if level == "fixed" else {}
        g = make_gated_cache("dither-int8", cfg, tau=0.0, level="head" if level == "fixed" else level, shadow=shadow,
                             shadow_dtype=torch.bfloat16, dither_layout="h8", **budget)
        got, t = run(g)
        s = g.gate_summary()
        err, err_raw = float((got - ref).abs().max()), float((raw - ref).abs().max())
        path = g.kernel_path(1)
        good = path.startswith("int8") and s["heads_repaired"] == s["heads_total"] and s["bytes_moved"] > 0 \
            and err <= max(0.5 * err_raw, 5e-2) and s["unrepaired"] == 0
        ok &= good
        res[f"{shadow}-{level}-tau0"] = dict(path=path, err_vs_bf16=err, raw_err=err_raw, s_per_step=t, **s,
                                            ok=bool(good))
        print(f"{shadow:6s} {level:5s} tau=0: path={path} err={err:.3g} (raw {err_raw:.3g}) "
              f"moved={s['bytes_moved'] / 2**20:.1f} MiB step={t * 1e3:.1f} ms {'ok' if good else 'FAIL'}")
    g = make_gated_cache("dither-int8", cfg, tau=1.0, shadow=shadow, dither_layout="h8")
    got, t = run(g)
    same = torch.equal(got, raw)
    ok &= same
    res[f"{shadow}-no-repair"] = dict(s_per_step=t, raw_s_per_step=t_raw, ratio=t / t_raw, equal_to_raw=same)
    print(f"{shadow:6s} tau=1 (no repair): equal to raw={same}, step {t * 1e3:.2f} ms vs raw {t_raw * 1e3:.2f} ms "
          f"(ratio {t / t_raw:.2f})")
json.dump(res, open(os.path.join(os.environ["OUT"], "gate.json"), "w"), indent=1, default=str)
print("PASS" if ok else "FAIL")
PY
