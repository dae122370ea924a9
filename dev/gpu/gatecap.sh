#!/usr/bin/env bash
# GPU check of the capturable gate (kvlib.gate, max_repairs_per_step=k: the fixed-shape repair path).
# A small random Qwen2 (bf16, dither-int8 h8 on static pools) decodes through the INT8 kernel; a gated decode step is
# captured in a CUDA graph and replayed, and each replay's logits and the gate's device counters are compared with an
# identical cache stepped eagerly (same tokens, same positions): tau=0 with the budget covering every group (all
# repaired), and tau=0 with k=1 (overflow: counted). The eager repair path's capture must be refused by name.
# Then one shape (B=8, S=4096) is timed: ungated graph, gated graph, gated fixed eager, gated eager (nonzero) path.
# Runs from the repo root in < 3 min; prints PASS/FAIL; writes $OUT/gatecap.json.
set -euo pipefail
OUT="${OUT:-/tmp}"
PY="${PY:-python}"
PYTHONPATH="$PWD" OUT="$OUT" "$PY" - <<'PY'
import json, os, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from kvlib.hf.cache import make_cache
from kvlib.gate import make_gated_cache

dev, bf16 = "cuda", torch.bfloat16
NO_MASK = {"full_attention": None, "sliding_attention": None}  # one query over valid positions: no mask
torch.manual_seed(0)
cfg = Qwen2Config(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=128, vocab_size=4096, max_position_embeddings=8192)
model = Qwen2ForCausalLM(cfg).to(dev, bf16).eval()
L, HKV = cfg.num_hidden_layers, cfg.num_key_value_heads
res, ok = {"config": dict(layers=L, heads=16, kv_heads=HKV, head_dim=128, format="dither-int8", layout="h8")}, True


def build(B, max_len, tau=0.2, k=None, gated=True):
    opts = dict(batch_size=B, max_len=max_len, device=dev, dtype=bf16, dither_layout="h8")
    if not gated:
        return make_cache("dither-int8", cfg, block_size=32, **opts)
    return make_gated_cache("dither-int8", cfg, tau=tau, max_repairs_per_step=k, **opts)


class Stepper:
    """A cache after a prefill of ``prompt``, and its decode step over static input buffers."""

    def __init__(self, cache, prompt):
        self.cache, self.B, self.P = cache, prompt.shape[0], prompt.shape[1]
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        self.ids = torch.zeros(self.B, 1, dtype=torch.long, device=dev)
        self.pos = torch.tensor([self.P], device=dev)
        self.pos_ids = self.pos.view(1, 1).expand(self.B, 1)

    def set(self, tok, t):
        self.ids.copy_(tok)
        self.pos.fill_(self.P + t)

    def fwd(self):
        with torch.no_grad():
            return model(input_ids=self.ids, past_key_values=self.cache, cache_position=self.pos,
                         position_ids=self.pos_ids, attention_mask=NO_MASK, use_cache=True, logits_to_keep=1).logits

    def capture(self, toks):
        """Warm up on a side stream with toks[0], toks[1] (eager steps 0, 1), capture step 2 (recorded, not run)."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for t in range(2):
                self.set(toks[t], t)
                self.fwd()
        torch.cuda.current_stream().wait_stream(s)
        self.set(toks[2], 2)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self.fwd()
        return g, out


def counters(c):
    s = c.gate_summary()
    return {k: s[k] for k in ("n_certs", "n_over", "repair_events", "unrepaired", "bytes_moved", "bytes_padding",
                              "heads_repaired", "steps")}


# -- replay vs eager --------------------------------------------------------------------------------------------
B, P, T = 4, 1000, 8
prompt = torch.randint(0, cfg.vocab_size, (B, P), device=dev, generator=torch.Generator(dev).manual_seed(1))
toks = [torch.randint(0, cfg.vocab_size, (B, 1), device=dev, generator=torch.Generator(dev).manual_seed(10 + t))
        for t in range(T)]
import warnings
for name, k in (("fits", B * HKV), ("overflow", 1)):
    eager, graphed = Stepper(build(B, P + 64, tau=0.0, k=k), prompt), Stepper(build(B, P + 64, tau=0.0, k=k), prompt)
    want = []
    for t in range(T):
        eager.set(toks[t], t)
        want.append(eager.fwd().float().clone())
    try:
        g, out = graphed.capture(toks)
        got = []
        for t in range(2, T):
            graphed.set(toks[t], t)
            g.replay()
            got.append(out.float().clone())
        torch.cuda.synchronize()
        diff = max(float((a - b).abs().max()) for a, b in zip(got, want[2:]))
        bitwise = all(torch.equal(a, b) for a, b in zip(got, want[2:]))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            ce, cg = counters(eager.cache), counters(graphed.cache)
        scale = float(torch.stack(want).std())
        n_steps = T * L
        expect_unrep = 0 if name == "fits" else n_steps * (B * HKV - 1)
        good = (diff <= 1e-3 * scale and ce == cg and ce["unrepaired"] == expect_unrep
                and ce["repair_events"] == n_steps * min(k, B * HKV) and ce["steps"] == T
                and graphed.cache.kernel_path(1).startswith("int8"))
        res[f"replay-{name}"] = dict(k=k, max_abs_diff=diff, logits_std=scale, bitwise_equal=bitwise, eager=ce, graph=cg,
                                     path=graphed.cache.kernel_path(1), ok=bool(good))
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        good = False
        res[f"replay-{name}"] = dict(k=k, error=f"{type(e).__name__}: {str(e)[:300]}", ok=False)
    ok &= good
    print(f"replay {name:8s} k={k:2d}: {res[f'replay-{name}']}", flush=True)
    del eager, graphed

# the eager repair path refuses capture, naming the option
st = Stepper(build(B, P + 64, tau=0.0, k=None), prompt)
try:
    st.capture(toks)
    refused, msg = False, "captured"
except RuntimeError as e:
    refused, msg = "max_repairs_per_step" in str(e), str(e)[:200]
torch.cuda.synchronize()
res["eager-path-capture-refused"] = dict(ok=refused, message=msg)
ok &= refused
print(f"eager path capture refused by name: {refused}", flush=True)
del st

# -- timing at one shape -------------------------------------------------------------------------------------------
B, P, N = 8, 4096, 30
prompt = torch.randint(0, cfg.vocab_size, (B, P), device=dev, generator=torch.Generator(dev).manual_seed(2))
toks = [torch.randint(0, cfg.vocab_size, (B, 1), device=dev) for _ in range(3)]
ML = P + 3 + 2 * N + 32


def timed(fn):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / N * 1e3


def advance(st, f):
    def run():
        st.pos.add_(1)
        return f()
    return run


times = {}
for name, kw in (("ungated-graph", dict(gated=False)), ("gated-fixed-graph", dict(k=8)),
                 ("gated-fixed-eager", dict(k=8)), ("gated-eager-path", dict(k=None)),
                 ("gated-fixed-graph-tau0-all", dict(k=B * HKV, tau=0.0))):  # worst case: every group repaired
    st = Stepper(build(B, ML, **kw), prompt)
    try:
        if name.endswith("graph"):
            g, _ = st.capture(toks)
            times[name] = timed(advance(st, g.replay))
        else:
            times[name] = timed(advance(st, st.fwd))
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        times[name] = float("nan")
        res[f"time-{name}-error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if kw.get("gated", True):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            res[f"time-{name}-counters"] = counters(st.cache)
    print(f"{name:27s}: {times[name]:.3f} ms/step", flush=True)
    del st
    torch.cuda.empty_cache()
res["timing"] = dict(B=B, S=P, steps=N, tau=0.2, k=8, ms_per_step=times, note="tau0-all: tau=0, k=B*kv_heads",
                     graph_speedup_vs_eager_path=times["gated-eager-path"] / times["gated-fixed-graph"],
                     gated_graph_vs_ungated_graph=times["gated-fixed-graph"] / times["ungated-graph"])
ok &= times["gated-fixed-graph"] == times["gated-fixed-graph"]  # captured and timed (not NaN)
print(json.dumps(res["timing"], indent=1))
res["ok"] = bool(ok)
json.dump(res, open(os.path.join(os.environ["OUT"], "gatecap.json"), "w"), indent=1, default=str)
print("PASS" if ok else "FAIL")
PY
