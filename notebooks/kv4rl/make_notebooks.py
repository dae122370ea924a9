# ruff: noqa: E501  (notebook cell sources are kept as written)
"""Writes the synthetic notebooks of the kv4rl chapter (run: .venv/bin/python notebooks/kv4rl/make_notebooks.py).

Kept as code so the cells stay reviewable in diffs; the .ipynb files are what the book runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nbformat import NotebookNode

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))  # run as a script: kvlib lives at the repository root

from kvlib.publish.nbbuild import code, md, params, write  # noqa: E402


def representation() -> list[NotebookNode]:
    cells = [
        md(
            """
# The KV4 representation on synthetic keys: rotation, exact merge, bits vs error

**Question.** Three properties carry the KV4-RL design, before any model is involved. (1) Rotating
queries and keys by the same normalised Hadamard matrix leaves unquantised attention scores
unchanged, so keys may be stored rotated. (2) Splitting the positions into a protected region and an
INT4 region and merging the two softmax states with `merge_states` gives exactly single-pass
attention, for any split. (3) What each storage format costs in bits per element and in score error
on keys with outlier channels, with and without rotation. Do our implementations in `kvlib` show
these, and do the byte accounts match the paper's 4.25 / 5.00 / 6.00 / 4.75 / 4.25 bits?

Keys are Gaussian with a few channels scaled up (outlier channels, as in post-RoPE keys of real
models); queries are Gaussian. Score error is the RMS error of `q·k̂/√d` against `q·k/√d`. This is a
synthetic proxy: the KL of a real model under each format is measured by the fidelity probe.
"""
        ),
        params(
            """
profile = "cpu"
n_tokens = 2048  # keys per synthetic head
n_queries = 64
d = 128
n_outliers = 4  # outlier channels per head
outlier_scale = 20.0
n_splits = 20  # random region splits checked for merge exactness
seed = 0
"""
        ),
        code(
            """
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from IPython.display import Markdown, display

from kvlib.publish import Run
from kvlib.formats import get_format
from kvlib.core.hadamard import hadamard
from kvlib.kernels.int4.decode import region_attention_ref
from kvlib.kernels.int4.attention import build_kv4_batch, decode_ref, kv4rl_decode
from kvlib.core.merge import merge_states

run = Run(
    "kv4rl_representation",
    profile=profile,
    params=dict(n_tokens=n_tokens, n_queries=n_queries, d=d, n_outliers=n_outliers,
                outlier_scale=outlier_scale, n_splits=n_splits, seed=seed),
)
g = torch.Generator().manual_seed(seed)
keys = torch.randn(n_tokens, d, generator=g, dtype=torch.float64)
out_ch = torch.randperm(d, generator=g)[:n_outliers]
keys[:, out_ch] *= outlier_scale
queries = torch.randn(n_queries, d, generator=g, dtype=torch.float64)
""",
            hide_input=True,
        ),
        md("## 1. Rotating q and k by H leaves the scores unchanged"),
        code(
            """
s = queries @ keys.T
s_rot = hadamard(queries) @ hadamard(keys).T
rel64 = ((s_rot - s).abs().max() / s.abs().max()).item()
s32 = queries.float() @ keys.float().T
s32_rot = hadamard(queries.float()) @ hadamard(keys.float()).T
rel32 = ((s32_rot - s32).abs().max() / s32.abs().max()).item()
run.glue("rot_rel_err_f64", rel64)
run.glue("rot_rel_err_f32", rel32)
amax_ratio = (keys.abs().amax(-1) / hadamard(keys).abs().amax(-1)).median().item()
run.glue("rot_amax_ratio", amax_ratio)
print(f"max |Δscore| / max |score|: float64 {rel64:.1e}, float32 {rel32:.1e}")
print(f"rotation shrinks the per-vector max |k_i| by a median factor of {amax_ratio:.1f}")
run.claim("kv4rl-hadamard-scores", ours=f"max relative score change {rel64:.0e} (float64), {rel32:.0e} (float32)",
          verdict="reproduced" if rel64 < 1e-12 and rel32 < 1e-5 else "differs",
          why="" if rel64 < 1e-12 else "rounding larger than expected")
""",
            hide_input=True,
        ),
        md(
            """
The identity holds to float64 rounding. Rotation spreads each outlier channel over all 128 coordinates:
the largest coordinate of a key shrinks by the factor printed above, and with it the single affine
step `Δ = (max - min)/15` that a whole-head INT4 group must use.
"""
        ),
        md("## 2. Any split into two regions merges exactly"),
        code(
            """
B, HQ, HKV, N = 4, 8, 2, 512
qb = torch.randn(B, HQ, d, generator=g)
kb = torch.randn(B, HKV, N, d, generator=g)
vb = torch.randn(B, HKV, N, d, generator=g)
lengths = torch.tensor([512, 300, 145, 20])
valid = torch.arange(N)[None, :] < lengths[:, None]
o_ref, lse_ref = region_attention_ref(qb, kb, vb, valid, d ** -0.5)
worst_o = worst_lse = 0.0
for i in range(n_splits):
    frac = torch.rand(B, 1, generator=g)
    region = torch.rand(B, N, generator=g) < frac
    o_a, l_a = region_attention_ref(qb, kb, vb, valid & region, d ** -0.5)
    o_b, l_b = region_attention_ref(qb, kb, vb, valid & ~region, d ** -0.5)
    o, lse = merge_states(o_a, l_a, o_b, l_b)
    worst_o = max(worst_o, (o - o_ref).abs().max().item())
    worst_lse = max(worst_lse, (lse - lse_ref).abs().max().item())
cache = build_kv4_batch(kb, vb, lengths, sink=16, recent=128)
o_rl, lse_rl = kv4rl_decode(qb, cache, backend="torch")  # two regions + merge_states
o_1, lse_1 = decode_ref(qb, cache)  # one pass over the same dequantised values
kv4rl_err = max((o_rl - o_1).abs().max().item(), (lse_rl - lse_1).abs().max().item())
run.glue("merge_worst_o", worst_o)
run.glue("merge_worst_lse", worst_lse)
run.glue("kv4rl_two_region_err", kv4rl_err)
print(f"{n_splits} random splits: max |Δo| = {worst_o:.1e}, max |Δlse| = {worst_lse:.1e} (float32 outputs)")
print(f"KV4-RL regions (sink 16, recent 128) merged vs single pass over the same values: {kv4rl_err:.1e}")
ok = max(worst_o, worst_lse, kv4rl_err) < 1e-5
run.claim("kv4rl-merge-exact", ours=f"max deviation {max(worst_o, worst_lse, kv4rl_err):.0e} over {n_splits} random splits "
          "and the KV4-RL split (float32 outputs of float64 math)",
          verdict="reproduced" if ok else "differs", why="" if ok else "merge deviates beyond float32 rounding")
""",
            hide_input=True,
        ),
        md(
            """
Every random split, including empty regions and the ragged KV4-RL split (a request of 20 tokens
has an empty INT4 region), gives the single-pass output and log-normaliser to float32 rounding.
The merge is the algebraic identity `lse = logaddexp(lse_1, lse_2)`, so this is the expected result.
"""
        ),
        md("## 3. Bits per element against score error"),
        code(
            """
configs = [
    ("kv4", dict(rotate="none")), ("kv4", dict(rotate="k")),
    ("kv4-g32", dict(rotate="none")), ("kv4-g32", dict(rotate="k")),
    ("kv4-g16", dict(rotate="none")), ("kv4-g16", dict(rotate="k")),
    ("nvfp4", dict(rotate="none")), ("nvfp4", dict(rotate="k")),
    ("mxfp4", dict(rotate="none")), ("mxfp4", dict(rotate="k")),
    ("kivi2", dict()),
]
k32 = keys.float()
s_true = (queries.float() @ k32.T) / d ** 0.5
rows = []
for name, opt in configs:
    f = get_format(name, **opt)
    packed = f.write(k32, side=0)
    k_hat = f.read(packed)
    s_hat = (queries.float() @ k_hat.T) / d ** 0.5
    n_q = k32.shape[0] if name != "kivi2" else packed.codes.shape[0]  # KIVI: bits of the quantised part
    rows.append(dict(
        format=name, rotation=opt.get("rotate", "none"),
        bits_layout=f.bytes_per_position(d) * 8 / d,
        bits_measured=(f.nbytes(packed) - (packed.residual.numel() * 2 if name == "kivi2" else 0)) * 8 / (n_q * d),
        key_rel_mse=((k_hat - k32).pow(2).mean() / k32.pow(2).mean()).item(),
        score_rmse=(s_hat - s_true).pow(2).mean().sqrt().item(),
    ))
df = pd.DataFrame(rows)
run.record("formats", rows)
display(df.style.format({"bits_layout": "{:.2f}", "bits_measured": "{:.2f}", "key_rel_mse": "{:.2e}", "score_rmse": "{:.2e}"}))
fig, ax = plt.subplots(figsize=(6.5, 4))
sns.scatterplot(data=df, x="bits_layout", y="score_rmse", hue="format", style="rotation", s=90, ax=ax)
ax.set_yscale("log")
ax.set_xlabel("bits per element (codes + scales)")
ax.set_ylabel("RMS score error  |q·k̂ − q·k| / √d")
ax.set_title(f"synthetic keys, {n_outliers} outlier channels x{outlier_scale:g}")
run.glue_fig("fig_bits_vs_error", fig)
fig
""",
            hide_input=True,
        ),
        code(
            """
def get(name, rot, col):
    return df[(df.format == name) & (df.rotation == rot)][col].item()

bits = {n: get(n, "none", "bits_layout") for n in ["kv4", "kv4-g32", "kv4-g16", "nvfp4", "mxfp4"]}
measured_ok = bool((df.bits_layout - df.bits_measured).abs().max() < 1e-9)
for n, b in bits.items():
    run.glue(f"bits_{n}", b)
krot_gain = get("kv4", "none", "score_rmse") / get("kv4", "k", "score_rmse")
nv_rot = get("nvfp4", "k", "score_rmse") / get("nvfp4", "none", "score_rmse")
nv_vs_kv4 = get("nvfp4", "none", "score_rmse") / get("kv4", "k", "score_rmse")
g32_gain = get("kv4", "k", "score_rmse") / get("kv4-g32", "k", "score_rmse")
g16_gain = get("kv4", "k", "score_rmse") / get("kv4-g16", "k", "score_rmse")
for key, val in dict(krot_gain=krot_gain, nvfp4_rot_ratio=nv_rot, nvfp4_vs_kv4rot=nv_vs_kv4,
                     g32_gain=g32_gain, g16_gain=g16_gain).items():
    run.glue(key, val)
print(f"K rotation lowers whole-head INT4 score error {krot_gain:.1f}x; groups of 32 / 16 (rotated) a further "
      f"{g32_gain:.2f}x / {g16_gain:.2f}x; NVFP4 with/without rotation: {nv_rot:.2f}; "
      f"NVFP4 (no rotation) vs KV4 (K rotation): {nv_vs_kv4:.2f}")

def exact(got, want):
    return "reproduced" if abs(got - want) < 1e-9 and measured_ok else "differs"

run.claim("kv4rl-bits-kv4", ours=f"{bits['kv4']:.2f} bits (layout = allocated bytes)", verdict=exact(bits["kv4"], 4.25),
          why="" if exact(bits["kv4"], 4.25) == "reproduced" else "byte account differs")
ok = exact(bits["kv4-g32"], 5.0) == exact(bits["kv4-g16"], 6.0) == "reproduced"
run.claim("kv4rl-bits-groups", ours=f"{bits['kv4-g32']:.2f} and {bits['kv4-g16']:.2f} bits",
          verdict="reproduced" if ok else "differs", why="" if ok else "byte account differs")
ok = exact(bits["nvfp4"], 4.75) == exact(bits["mxfp4"], 4.25) == "reproduced"
run.claim("kv4rl-bits-fp4", ours=f"NVFP4 {bits['nvfp4']:.2f}, MXFP4 {bits['mxfp4']:.2f} bits",
          verdict="reproduced" if ok else "differs", why="" if ok else "byte account differs")
run.claim("kv4rl-krot", ours=f"synthetic keys: K rotation lowers whole-head INT4 score RMSE {krot_gain:.1f}x",
          verdict="reproduced" if krot_gain > 2 else "differs",
          why="synthetic proxy (score error on outlier-channel keys), not model KL; the fidelity probe measures KL")
run.claim("kv4rl-fp4-kl", ours=f"synthetic: NVFP4 score RMSE with/without K rotation {nv_rot:.2f}x; "
          f"NVFP4 (none) / INT4 (K rot) {nv_vs_kv4:.2f}x",
          verdict="reproduced" if nv_rot > 1 else "differs",
          why="synthetic proxy (score error), not model KL" + ("" if nv_rot > 1 else
              "; on these keys rotation does not hurt NVFP4 (its 16-element scales already isolate outlier channels)"))
""",
            hide_input=True,
        ),
        md(
            """
**Reading the figure.** The byte account of every format equals the bytes its packed tensors
allocate (`bits_layout` = `bits_measured`). Whole-head INT4 without rotation pays for the outlier
channels with a coarse step on every coordinate; K rotation removes most of that error, and finer
groups buy the rest at 5 and 6 bits. NVFP4 and MXFP4 use per-block scales, so outlier channels hurt
them less without rotation. The 2-bit KIVI baseline sits far above at 3 bits (its per-channel key
groups help with outlier channels but 4 levels are coarse).
"""
        ),
        md("## Paper vs this run"),
        code("run.claims_table()", hide_input=True),
        md(
            """
**Verdict.** The two identities the design rests on hold to rounding in our implementation: Hadamard
rotation preserves unquantised scores, and the two-region merge equals single-pass attention for any
split. The byte accounts match the paper's bits per element for KV4, its group variants, NVFP4 and
MXFP4. On synthetic keys with outlier channels, K rotation is what makes whole-head INT4 usable;
whether these score-error orderings carry over to a model's next-token distribution is the
fidelity probe's question.
"""
        ),
        code("run.save()", hide_input=True),
    ]
    return cells


def latency() -> list[NotebookNode]:
    cells = [
        md(
            """
# KV4 and KV4-RL decode latency on the H200

**Question.** Does our Triton INT4 decode attention turn the 3.76x byte reduction of KV4 (4.25 bits
against bf16) into decode speed against torch SDPA bf16, and does KV4-RL (an INT8 side buffer of
sink 16 + recent 128 positions, a second kernel and an exact merge) keep at least 97% of KV4's
speed? Shapes: d = 128, GQA 32:8, batch 32-512, contexts 1k-16k, and two ragged suites.

The numbers come from `python -m kvlib.bench kv4` run on the lent H200 (`data/results/gpu/kv4.json`);
this notebook renders them and runs anywhere. Each method runs inside a CUDA graph. At each shape the KV4
methods are timed in {glue:text}`kv4_rounds` interleaved rounds (the order rotated, the median kept), so the
KV4-RL / KV4 ratios compare runs made under the same clocks and memory state. SDPA is timed once per shape. Note the
paper's speedups are for whole decode steps in an engine, ours for the attention kernel alone.
"""
        ),
        params(
            """
profile = "cpu"
source_profile = "gpu"  # which result file of the benchmark to render
"""
        ),
        code(
            """
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from IPython.display import Markdown, display

from kvlib.publish import Run
from kvlib.publish.provenance import load_result

run = Run("kv4rl_latency", profile=profile, params=dict(source_profile=source_profile))
res = load_result("kv4", source_profile)
if res is None:
    display(Markdown(
        f"**Pending.** `data/results/{source_profile}/kv4.json` does not exist yet: the lead runs "
        "`python -m kvlib.bench kv4` on the H200. Nothing below is a measurement."))
else:
    prov, r = res["provenance"], res["results"]
    print(f"measured on {r['device']} at commit {prov['commit'][:12]}, {prov['started']}")
    print(f"copy bandwidth {r['copy_bandwidth']['bandwidth_GBps']:.0f} GB/s; merge: {r['merge']}")
""",
            hide_input=True,
        ),
        code(
            """
if res is not None:
    fixed = pd.DataFrame(r["fixed"])
    ragged = pd.DataFrame(r["ragged"])
    # the byte bound of KV4-RL / KV4: KV4-RL reads its P = min(S, sink + recent) protected positions as
    # INT8 (d + 2 bytes) instead of INT4 (the format's own byte accounts); a kernel that reads bytes as
    # efficiently in both regions cannot beat S b4 / ((S - P) b4 + P b8)
    from kvlib.formats.base import get_format

    d_ = r["shape"]["d"]
    f4 = get_format("kv4")
    f_rl = get_format("kv4rl", sink=r["shape"]["sink"], recent=r["shape"]["recent"])
    b4 = f4.bytes_per_position(d_)
    cap = r["shape"]["sink"] + r["shape"]["recent"]
    b8 = f_rl.fixed_bytes(d_) / cap

    def byte_bound(S):
        P = min(S, cap)
        return S * b4 / ((S - P) * b4 + P * b8)

    fixed["kv4rl_byte_bound"] = [byte_bound(int(s_)) for s_ in fixed.ctx_max]
    run.glue("kv4rl_byte_bound_1k", byte_bound(1024))
    run.glue("kv4rl_byte_bound_4k", byte_bound(4096))
    run.glue("kv4rl_byte_bound_16k", byte_bound(16384))
    cols = ["batch", "ctx_max", "sdpa_bf16_ms", "kv4_ms", "kv4_intpv_ms", "kv4rl_ms", "kv4_speedup_vs_sdpa",
            "kv4rl_frac_of_kv4", "kv4rl_byte_bound", "kv4_GBps", "sdpa_GBps"]
    display(fixed[cols].round(3))
    run.glue("kv4_rounds", str(int(fixed["rounds"].iloc[0])) if "rounds" in fixed
             else "1 (a file from before the rounds)")
    display(Markdown("Ragged suites (SDPA runs on the padded batch):"))
    display(ragged[["batch", "ctx_mean", "ctx_max"] + [k for k in cols[2:] if k in ragged]].round(3))
    rerun = load_result("dev/kv4_rerun", source_profile)
    rr16 = None
    if rerun is not None:  # the same benchmark run again: how far the ratios move between runs
        rr = pd.DataFrame(rerun["results"]["fixed"])
        both = fixed.merge(rr, on=["batch", "ctx_max"], suffixes=("", "_rerun"))
        rr16 = both[both.ctx_max >= 16384]
        display(Markdown(f"The same benchmark run again (`dev/kv4_rerun.json`, commit "
                         f"`{rerun['provenance']['commit']}`): KV4-RL / KV4 and KV4's time at S = 16k in both runs."))
        display(rr16[["batch", "kv4rl_frac_of_kv4", "kv4rl_frac_of_kv4_rerun", "kv4_ms", "kv4_ms_rerun"]].round(3))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    sns.lineplot(data=fixed, x="ctx_max", y="kv4_speedup_vs_sdpa", hue="batch", marker="o", ax=axes[0], palette="viridis")
    axes[0].axhline(3.0, ls="--", c="k", lw=1, label="goal 3.0x")
    axes[0].axhline(16 / 4.25, ls=":", c="r", lw=1, label="byte limit 3.76x")
    axes[0].set_xscale("log", base=2); axes[0].set_ylabel("KV4 speedup vs SDPA bf16"); axes[0].legend(fontsize=7)
    sns.lineplot(data=fixed, x="ctx_max", y="kv4rl_frac_of_kv4", hue="batch", marker="o", ax=axes[1], palette="viridis")
    axes[1].axhline(0.97, ls="--", c="k", lw=1)
    bb = fixed.drop_duplicates("ctx_max").sort_values("ctx_max")
    axes[1].plot(bb.ctx_max, bb.kv4rl_byte_bound, ls=":", c="r", lw=1.2, label="byte bound")
    axes[1].legend(fontsize=7)
    axes[1].set_xscale("log", base=2); axes[1].set_ylabel("KV4-RL speed / KV4 speed")
    fig.tight_layout()
    run.glue_fig("fig_latency", fig)
    display(fig)
    acc = r["accuracy"]
    display(Markdown("Kernel output against the float64 reference (max / mean |Δ|; the 16k rows use one "
                     "and sixteen splits):"))
    display(pd.Series(acc, name="error").to_frame().map(lambda x: f"{x:.1e}"))
    for s_ in (1, 16):
        run.glue(f"kv4_16k_err_s{s_}", acc.get(f"kv4_16k_splits{s_}_mean_abs_err_o", float("nan")))
    gl = r["goals"]
    for k in ("kv4_speedup_long_ctx_min", "kv4rl_frac_min", "kv4rl_frac_ragged_aggregate"):
        run.glue(k, gl[k])
    best = fixed.kv4_speedup_vs_sdpa.max()
    run.glue("kv4_speedup_max", best)
    run.claim("kv4rl-kv4-kernel-speedup",
              ours=f"attention kernel only: {fixed.kv4_speedup_vs_sdpa.min():.2f}-{best:.2f}x vs SDPA bf16 (fixed shapes)",
              verdict="reproduced" if 1.44 <= best else "differs",
              why="kernel-level, not whole decode step; issue goal 3.0x at long context: "
                  + (f"S = 16k min {gl['kv4_speedup_16k_min']:.2f}x ("
                     + ("met" if gl["kv4_speedup_16k_min"] >= 3.0 else "not met") + "), "
                     if gl.get("kv4_speedup_16k_min") is not None else "")
                  + f"S >= 4k min {gl['kv4_speedup_long_ctx_min']:.2f}x ("
                  + ("met" if gl["kv4_speedup_long_ctx_min"] >= 3.0 else "not met") + ")")
    agg = gl["kv4rl_frac_ragged_aggregate"]
    f16 = fixed[fixed.ctx_max >= 16384].kv4rl_frac_of_kv4
    why = [] if agg >= 0.94 else ["our protected path costs more than the paper's at these shapes"]
    why.append(f"bytes alone cap KV4-RL/KV4 at {byte_bound(1024):.0%} at S=1k, {byte_bound(4096):.0%} at 4k, "
               f"{byte_bound(16384):.1%} at 16k (INT8 side entries are {b8 / b4:.1f}x an INT4 entry), so the 97% "
               "goal is reachable only at long context")
    if len(f16):
        why.append(f"at S = 16k it reads {f16.min():.1%}-{f16.max():.1%}: the issue's 97% goal is "
                   + ("met" if f16.min() >= 0.97 else "not met")
                   + ("" if rr16 is None or not len(rr16) else
                      f" (a second run: {rr16.kv4rl_frac_of_kv4_rerun.min():.1%}-"
                      f"{rr16.kv4rl_frac_of_kv4_rerun.max():.1%})"))
    run.claim("kv4rl-protect-speed", ours=f"{agg:.0%} of KV4 on the ragged suites (sum of times); "
              f"min over all shapes {gl['kv4rl_frac_min']:.0%}",
              verdict="reproduced" if agg >= 0.94 else "differs", why="; ".join(why))
else:
    run.glue("kv4_rounds", "(no GPU result)")
    for s_ in (1, 16):
        run.glue(f"kv4_16k_err_s{s_}", float("nan"))
    for cid in ("kv4rl-kv4-kernel-speedup", "kv4rl-protect-speed"):
        run.claim(cid, ours="pending", verdict="not reproducible here", why="GPU result not yet produced")
""",
            hide_input=True,
        ),
        code(
            """
# why the kernel stops short of SDPA's bandwidth: its main loop compiled for sm_90 (offline count,
# python -m kvlib.bench sass_count) against the bytes it streams and the instructions it must issue
sass = load_result("sass_count", "cpu")
if res is not None and sass is not None and "kv4" in sass["results"]:
    k4 = sass["results"]["kv4"]
    # H200 SXM: 132 SMs x 4 schedulers, one warp instruction (32 threads) per clock each, 1.98 GHz boost
    ISSUE = 132 * 4 * 32 * 1.98e9  # thread instructions per second
    row = fixed[(fixed.batch == 32) & (fixed.ctx_max == 16384)].iloc[0]
    codes = 32 * r["shape"]["hkv"] * 16384 * d_ * 2  # stored 4-bit codes, K and V
    issue_ms = codes * k4["per_element"] / ISSUE * 1e3
    byte_ms = 32 * 16384 * r["shape"]["hkv"] * 2 * b4 / (row.sdpa_GBps * 1e9) * 1e3  # b4: per side (K, V)
    warps = (65536 // (k4["registers"] * 32 * k4["num_warps"])) * k4["num_warps"]
    run.glue("kv4_sass_per_code", k4["per_element"])
    run.glue("kv4_sass_regs", int(k4["registers"]))
    run.glue("kv4_warps_per_sm", int(warps))
    run.glue("kv4_issue_ms", issue_ms)
    run.glue("kv4_byte_ms", byte_ms)
    run.glue("kv4_ms_b32_16k", float(row.kv4_ms))
    run.glue("kv4_issue_share", issue_ms / byte_ms)
    run.glue("kv4_sass_bitops_share", (k4["top_opcodes"].get("LOP3", 0) + k4["top_opcodes"].get("SHF", 0))
             / k4["instructions"])
    display(Markdown(
        f"B=32, S=16k: the loop issues {k4['per_element']:.2f} instructions per stored code at "
        f"{k4['registers']} registers ({warps} warps per SM); at perfect issue that is {issue_ms:.3f} ms, "
        f"reading the bytes at SDPA's measured bandwidth {byte_ms:.3f} ms; measured {row.kv4_ms:.3f} ms."))
else:
    for k in ("kv4_sass_per_code", "kv4_sass_regs", "kv4_warps_per_sm", "kv4_issue_ms", "kv4_byte_ms",
              "kv4_ms_b32_16k", "kv4_issue_share", "kv4_sass_bitops_share"):
        run.glue(k, float("nan"))

# development probes behind the design notes below (dev/results/, each with its provenance envelope)
prep = load_result("dev/kv4_prep_probe_mma", "gpu")
row1k = next((x for x in prep["results"]["rows"] if x["batch"] == 32 and x["ctx"] == 1024), None) if prep else None
run.glue("prep_kv4_ieee_us", row1k["kv4_ieee_ms"] * 1e3 if row1k else float("nan"))
run.glue("prep_kv4_mma_us", row1k["kv4_ms"] * 1e3 if row1k else float("nan"))
run.glue("prep_mismatch_mma", max(x["code_mismatch_mma"] for x in prep["results"]["rows"]) if prep else float("nan"))
run.glue("prep_mismatch_ieee", max(x["code_mismatch_ieee"] for x in prep["results"]["rows"]) if prep else float("nan"))
packed = load_result("dev/kv4_sweep_packed2", "gpu")
rl = packed["results"]["shapes"]["b32_s16k"]["kv4rl"] if packed else None
run.glue("packed_rl_ms", rl["packed_fused"]["ms"] if rl else float("nan"))
run.glue("own_rl_ms", rl["default_fused"]["ms"] if rl else float("nan"))
plans2 = load_result("dev/kv4_sweep_plans2", "gpu")
rl = plans2["results"]["shapes"]["b32_s16k"]["kv4rl"] if plans2 else None
run.glue("last_rl_ms", rl["last_fused"]["ms"] if rl else float("nan"))
run.glue("last_own_rl_ms", rl["default_fused"]["ms"] if rl else float("nan"))
for stem, variant, key in (("kv4_sweep_order", "interleave_fused", "order"), ("kv4_sweep_prot", "prot_prefetch_fused", "pref")):
    sweep = load_result(f"dev/{stem}", "gpu")
    rl = sweep["results"]["shapes"]["b512_s4k"]["kv4rl"] if sweep else None
    run.glue(f"{key}_rl_ms", rl[variant]["ms"] if rl else float("nan"))
    run.glue(f"{key}_own_rl_ms", rl["default_fused"]["ms"] if rl else float("nan"))
pdl = load_result("dev/kv4_sweep_pdl", "gpu")
if pdl:
    sh = pdl["results"]["shapes"]
    # the sweep ran with pdl off by default: its "pdl" variant against its "default"
    ratios = [v["kv4"]["pdl"]["ms"] / v["kv4"]["default"]["ms"] for v in sh.values()]
    run.glue("pdl_mean_ratio", sum(ratios) / len(ratios))
    run.glue("pdl_n_shapes", len(ratios))
    run.glue("pdl_b32_1k_us", sh["b32_s1k"]["kv4"]["pdl"]["ms"] * 1e3)
    run.glue("nopdl_b32_1k_us", sh["b32_s1k"]["kv4"]["default"]["ms"] * 1e3)
else:
    for k in ("pdl_mean_ratio", "pdl_n_shapes", "pdl_b32_1k_us", "nopdl_b32_1k_us"):
        run.glue(k, float("nan"))
dec = load_result("dev/kv4rl_decompose_pipe", "gpu")
dec_old = load_result("dev/kv4rl_decompose_rows8", "gpu")  # the same probe before the edge blocks were pipelined
old_b32 = next((x for x in dec_old["results"] if x["batch"] == 32 and x["ctx"] == 16384), None) if dec_old else None
run.glue("dec_old_structure_us", old_b32["structure_ms"] * 1e3 if old_b32 else float("nan"))
if dec:
    dd = pd.DataFrame(dec["results"])
    b32 = dd[(dd.batch == 32) & (dd.ctx == 16384)].iloc[0]
    run.glue("dec_structure_us", float(b32.structure_ms) * 1e3)
    run.glue("dec_protected_us", float(b32.protected_work_ms) * 1e3)
    display(Markdown("KV4-RL's extra time over KV4, split by timing the same launch with an empty side buffer "
                     "(`dev/results/kv4rl_decompose_pipe.json`, with the edge blocks pipelined, µs):"))
    display(pd.DataFrame({"B": dd.batch, "S": dd.ctx, "KV4": dd.kv4_ms * 1e3, "structure": dd.structure_ms * 1e3,
                          "protected work": dd.protected_work_ms * 1e3, "KV4-RL/KV4": dd.frac}).round(3)
            .set_index(["B", "S"]))
else:
    run.glue("dec_structure_us", float("nan"))
    run.glue("dec_protected_us", float("nan"))
edges = load_result("dev/kv4rl_edges_run1", "gpu")
erows = {(x["batch"], x["ctx"]): x for x in edges["results"] if "batch" in x} if edges else {}
for key, (b_, n_) in (("b32_16k", (32, 16384)), ("b512_4k", (512, 4096)), ("ragged", (320, 16384))):
    x = erows.get((b_, n_))
    run.glue(f"edges_{key}_peel_ms", x["kv4rl_ms"] if x else float("nan"))
    run.glue(f"edges_{key}_pipe_ms", x["kv4rl_pipe_edges_ms"] if x else float("nan"))
    run.glue(f"edges_{key}_frac_peel", x["frac"] if x else float("nan"))
    run.glue(f"edges_{key}_frac_pipe", x["frac_pipe_edges"] if x else float("nan"))
    run.glue(f"edges_{key}_kv4_ratio", x["kv4_pipe_edges_ms"] / x["kv4_ms"] if x else float("nan"))
fold = load_result("dev/kv4rl_fold", "gpu")
frow = next((x for x in fold["results"] if x.get("batch") == 32 and x.get("ctx") == 16384), None) if fold else None
run.glue("fold_rl_ms", frow["kv4rl_fold_ms"] if frow else float("nan"))
run.glue("fold_own_rl_ms", frow["kv4rl_pipe_edges_ms"] if frow else float("nan"))
smerge = load_result("dev/kv4rl_side_merge", "gpu")
srow = next((x for x in smerge["results"] if x.get("batch") == 32 and x.get("ctx") == 16384), None) if smerge else None
run.glue("smerge_rl_ms", srow["kv4rl_side_merge2_ms"] if srow else float("nan"))
run.glue("smerge_own_rl_ms", srow["kv4rl_pipe_edges_ms"] if srow else float("nan"))
side = load_result("dev/kv4rl_side_r64_c100", "gpu")  # the last side-launch run, with the fused-merge pairs
sdrows = {(x["batch"], x["ctx"]): x for x in side["results"] if "batch" in x} if side else {}
sd32, sd8 = sdrows.get((32, 16384)), sdrows.get((8, 32768))
run.glue("side_rl_ms", sd32["kv4rl_side_ms"] if sd32 else float("nan"))
run.glue("side_r64_rl_ms", sd32["kv4rl_side_r64_sb32_c100_ms"] if sd32 else float("nan"))
run.glue("side_own_rl_ms", sd32["kv4rl_ms"] if sd32 else float("nan"))
run.glue("fused_kv4_8_32k_ms", sd8["kv4_fused_ms"] if sd8 else float("nan"))
run.glue("launch_kv4_8_32k_ms", sd8["kv4_ms"] if sd8 else float("nan"))
run.glue("fused_rl_8_32k_ms", sd8["kv4rl_fused_ms"] if sd8 else float("nan"))
run.glue("launch_rl_8_32k_ms", sd8["kv4rl_ms"] if sd8 else float("nan"))
run.glue("fused_rl_32_16k_ms", sd32["kv4rl_fused_ms"] if sd32 else float("nan"))
cap = load_result("dev/kv4rl_edges", "gpu")  # the second edges run, with the register-capped variants
crow = next((x for x in cap["results"] if x.get("batch") == 32 and x.get("ctx") == 16384), None) if cap else None
run.glue("cap_rl_ms", crow["kv4rl_pe_cap168_ctas3_ms"] if crow else float("nan"))
run.glue("cap_own_rl_ms", crow["kv4rl_pipe_edges_ms"] if crow else float("nan"))


def _b32_16k(name):  # the B = 32, S = 16k row of a dev probe file (None when the file is absent)
    res = load_result(f"dev/{name}", "gpu")
    return next((x for x in res["results"] if x.get("batch") == 32 and x.get("ctx") == 16384), None) if res else None


for name, keys in (("kv4rl_edge", {"edgeprog_rl_ms": "kv4rl_edge_ms", "edgeprog_own_rl_ms": "kv4rl_ms"}),
                   ("kv4rl_bias", {"bias_branch_rl_ms": "kv4rl_bias_branch_ms", "bias_table_rl_ms": "kv4rl_bias_table_ms",
                                   "bias_own_rl_ms": "kv4rl_ms"}),
                   ("kv4rl_s2", {"s2_rl_ms": "kv4rl_s2_ms", "s2_own_rl_ms": "kv4rl_ms"})):
    x = _b32_16k(name)
    for key, field in keys.items():
        run.glue(key, x[field] if x else float("nan"))
struct = load_result("dev/kv4rl_structure", "gpu")
st32 = next((x for x in struct["results"] if x["batch"] == 32), None) if struct else None
run.glue("struct_merge_us", (st32["kv4rl_empty_side_ms"] - st32["kv4rl_empty_side_no_merge_ms"]) * 1e3
         if st32 else float("nan"))
st128 = next((x for x in struct["results"] if x["batch"] == 128), None) if struct else None
run.glue("struct_merge128_us", (st128["kv4rl_empty_side_ms"] - st128["kv4rl_empty_side_no_merge_ms"]) * 1e3
         if st128 else float("nan"))
run.glue("struct_rest128_us", (st128["kv4rl_empty_side_no_merge_ms"] - st128["kv4_ms"]) * 1e3
         if st128 else float("nan"))
run.glue("edges_max_do", max((max(x["kv4_max_do"], x["kv4rl_max_do"]) for x in erows.values()), default=float("nan")))
""",
            hide_input=True,
        ),
        md("## Paper vs this run"),
        code("run.claims_table()", hide_input=True),
        md(
            """
**Verdict.** See the table: the kernel-level speedup of KV4 over SDPA bf16 and the share of KV4's
speed that KV4-RL keeps, measured at the shapes above, against the paper's whole-step figures and
the issue's goals (KV4 >= 3.0x at long context, KV4-RL >= 97%).

The 97% goal for KV4-RL has a floor set by bytes, not by the kernel: the side buffer stores its
protected positions in INT8, about twice an INT4 entry, so even a kernel that reads both regions equally
efficiently keeps at most {glue:text}`kv4rl_byte_bound_1k:.0%` of KV4's speed at S = 1k,
{glue:text}`kv4rl_byte_bound_4k:.0%` at 4k and {glue:text}`kv4rl_byte_bound_16k:.1%` at 16k (the dotted line).

**How the work is split.** `default_num_splits` plans one wave of programs: it counts the two CTAs per
SM that the kernel's registers allow and charges each program a fixed cost of about one position block
(prologue, state write, merge), so pairs that already fill the GPU get one split each (no merge
launch for KV4), few pairs get more splits, and a ragged batch is not cut into near-empty programs.
The sweeps behind this choice, and the layouts that lost, are in `dev/results/`
(`kv4_sweep_waves.json`, `kv4_sweep_plans.json`).

**Why KV4-RL keeps less than its byte bound at long context.** Its protected region is one extra
program per (request, kv head) in the same launch, and its states meet KV4's in the split merge. Timing
the same launch with an empty side buffer (`python -m dev.kv4rl_probe --decompose`,
`dev/results/kv4rl_decompose_pipe.json`, table above) shows that at S = 16k most of KV4-RL's
extra time is this structure, not the protected work (B = 32: {glue:text}`dec_structure_us:.1f` µs
against {glue:text}`dec_protected_us:.1f` µs). Of the structure, the merge launch is about
{glue:text}`struct_merge_us:.1f` µs at B = 32 (`kv4rl_structure.json`); at B = 128 it is
{glue:text}`struct_merge128_us:.1f` µs there against {glue:text}`struct_rest128_us:.1f` µs for the rest (an earlier
run, `kv4rl_structure_run1.json`, found no merge share at all at that shape: within its spread). The rest is the
extra programs waiting for slots behind the INT4 programs.

Other layouts were timed on the H200 under CUDA graphs, and each was removed after losing
(`dev/results/`; KV4-RL's time in ms):

| layout | it | the default | shape | file |
|---|---|---|---|---|
| the last INT4 split runs the side slots after its blocks, the side buffer asked into L2 first | {glue:text}`last_rl_ms:.4f` | {glue:text}`last_own_rl_ms:.4f` | B = 32, S = 16k | `kv4_sweep_plans2.json` |
| the first split runs them before its blocks and starts its INT4 loop from their state (no extra program; at one split no merge launch) | {glue:text}`fold_rl_ms:.4f` | {glue:text}`fold_own_rl_ms:.4f` | B = 32, S = 16k | `kv4rl_fold.json` |
| a persistent merge launch started beside the INT4 wave (programmatic dependent launch, two programs per SM) attends over every pair's side slots, then merges | {glue:text}`smerge_rl_ms:.4f` | {glue:text}`smerge_own_rl_ms:.4f` | B = 32, S = 16k | `kv4rl_side_merge.json` |
| a second kernel (programmatic dependent launch) takes the side slots and the main region's two partial blocks, so the INT4 splits run KV4's unmasked loop; four warps / capped at 64 registers with the largest shared-memory carveout | {glue:text}`side_rl_ms:.4f` / {glue:text}`side_r64_rl_ms:.4f` | {glue:text}`side_own_rl_ms:.4f` | B = 32, S = 16k | `kv4rl_side*.json` |
| the main region's two partial blocks run by one more program per pair, so the splits run KV4's unmasked loop over the interior blocks | {glue:text}`edgeprog_rl_ms:.4f` | {glue:text}`edgeprog_own_rl_ms:.4f` | B = 32, S = 16k | `kv4rl_edge.json` |
| the edge mask as a -inf bias folded into the offset multiply-add, set by one branch before the block's arithmetic / read from a table with no branch | {glue:text}`bias_branch_rl_ms:.4f` / {glue:text}`bias_table_rl_ms:.4f` | {glue:text}`bias_own_rl_ms:.4f` | B = 32, S = 16k | `kv4rl_bias.json` |
| two INT4 splits instead of the plan's one (states merged by the merge launch) | {glue:text}`s2_rl_ms:.4f` | {glue:text}`s2_own_rl_ms:.4f` | B = 32, S = 16k | `kv4rl_s2.json` |
| a third CTA per SM for the protected programs (registers capped at 168, the split plan counting three) | {glue:text}`cap_rl_ms:.4f` | {glue:text}`cap_own_rl_ms:.4f` | B = 32, S = 16k | `kv4rl_edges.json` |
| several pairs packed per program into the last wave's idle slots | {glue:text}`packed_rl_ms:.4f` | {glue:text}`own_rl_ms:.4f` | B = 32, S = 16k | `kv4_sweep_packed2.json` |
| the grid ordered so each pair's protected program starts beside its INT4 program | {glue:text}`order_rl_ms:.4f` | {glue:text}`order_own_rl_ms:.4f` | B = 512, S = 4k | `kv4_sweep_order.json` |
| the protected program's side steps loaded one step ahead | {glue:text}`pref_rl_ms:.4f` | {glue:text}`pref_own_rl_ms:.4f` | B = 512, S = 4k | `kv4_sweep_prot.json` |

(The "default" column is each run's own default, so it moves with the defaults of its day.) Two more lost
in earlier sweeps: the slots sliced over the splits and merged in place, and a small standalone protected
kernel on a parallel stream. They show the same thing: a protected pair is a short chain of dependent loads
(five 32-slot steps), and while the INT4 programs saturate memory each step waits on it, so protected work
on an INT4 program's path, or beside the INT4 stream, runs slower, not free. The second kernel of the
table never ran beside the INT4 programs at all: kernel timestamps showed its programs starting only as
INT4 programs retired, whatever its warps, registers or carveout (`dev/results/README.md`).

**The merge inside the decode launch.** When the INT4 region has two or more splits, the last program of
each pair to finish merges the pair's states (an atomic arrival counter per pair, zeroed by the query
preparation; `KV4KernelConfig.fuse_merge`), so no merge launch follows. At B = 8, S = 32k KV4 takes
{glue:text}`fused_kv4_8_32k_ms:.4f` ms with it against {glue:text}`launch_kv4_8_32k_ms:.4f` ms with the merge launch,
KV4-RL {glue:text}`fused_rl_8_32k_ms:.4f` against {glue:text}`launch_rl_8_32k_ms:.4f` (`kv4rl_side_r64_c100.json`). With one
split it does not pay: KV4-RL's two states (its split and its protected region) merged this way took
{glue:text}`fused_rl_32_16k_ms:.4f` ms at B = 32, S = 16k against {glue:text}`side_own_rl_ms:.4f` ms, so there the merge launch
stays; this is the one-split case an earlier sweep had timed and dropped.

**Edge blocks inside the pipeline.** A KV4-RL main region starts after the sinks and ends before the
recent window, so at both ends it cuts a position block in two. Those two partial blocks used to run as
masked steps peeled before and after the software-pipelined loop, where nothing prefetched their loads:
two more dependent rounds to memory in every program. With `pipe_edges` (on by default whenever a side
buffer is given) they run inside the pipelined loop, which masks a block only when it crosses an end (one
uniform branch per block). The output agrees with the peeled kernel's to fp32 rounding (largest change {glue:text}`edges_max_do:.1e`;
the LSE is identical), and
KV4-RL got faster at every shape of `python -m dev.kv4rl_probe --edges`
(`dev/results/kv4rl_edges_run1.json`, three interleaved rounds under CUDA graphs): B = 32,
S = 16k {glue:text}`edges_b32_16k_pipe_ms:.4f` ms against {glue:text}`edges_b32_16k_peel_ms:.4f` ms
(KV4-RL/KV4 {glue:text}`edges_b32_16k_frac_pipe:.3f` against {glue:text}`edges_b32_16k_frac_peel:.3f`);
B = 512, S = 4k {glue:text}`edges_b512_4k_pipe_ms:.3f` ms against {glue:text}`edges_b512_4k_peel_ms:.3f` ms;
the ragged B = 320 batch {glue:text}`edges_ragged_frac_pipe:.3f` of KV4 against
{glue:text}`edges_ragged_frac_peel:.3f`; in the decomposition it took the structure at B = 32, S = 16k from
{glue:text}`dec_old_structure_us:.1f` µs to {glue:text}`dec_structure_us:.1f` µs. KV4's own region starts at 0, so it has at most a
partial last block and keeps the peeled steps by default: with `pipe_edges` it takes
{glue:text}`edges_b32_16k_kv4_ratio:.3f` of its time at B = 32, S = 16k (aligned lengths, no partial block)
but {glue:text}`edges_ragged_kv4_ratio:.3f` on the ragged batch, so ragged KV4 batches should set it.

**Three launches that overlap.** The query preparation, the decode kernel and (when there is more
than one state) the split merge are separate launches. With programmatic dependent launch (Hopper;
`KV4KernelConfig.pdl`, on by default) each launches while the one before finishes and waits, on the
GPU, before reading what it wrote. Measured side by side under CUDA graphs (`kv4_sweep_pdl.json`) it
takes {glue:text}`pdl_mean_ratio:.3f` of the time on mean over the sweep's {glue:text}`pdl_n_shapes` shapes, most at short
context (B = 32, S = 1k: {glue:text}`pdl_b32_1k_us:.1f` µs against {glue:text}`nopdl_b32_1k_us:.1f` µs).

**Query rows.** The GQA group of 4 is padded to 8 query rows per tile (`MIN_ROWS`): fewer registers
and a shorter loop than with 4 rows (offline sm_90 count), and in three sweeps 8 rows tied or beat 4
at every shape (`kv4_sweep_par.json`, `kv4_sweep_packed*.json`).

**The query's preparation.** Before the decode kernel a small launch rotates the query by the
Hadamard matrix and quantises it to INT8. It runs the rotation as tensor-core dots of the query's
exact bf16 pieces with the ±1 matrix, so its codes equal the float reference's (fraction of codes
that differ: {glue:text}`prep_mismatch_mma:.1e`; with the fp32 FMA dot it replaced,
{glue:text}`prep_mismatch_ieee:.1e`), and it is faster: KV4 at B = 32, S = 1k takes
{glue:text}`prep_kv4_mma_us:.1f` µs with it and {glue:text}`prep_kv4_ieee_us:.1f` µs with the FMA dot
(`_kv4_prep_probe`, `kv4_prep_probe_mma.json`). Folding the preparation into the decode kernel itself,
with the butterfly in registers, was slower at every shape (`kv4_sweep_fuse.json`): the butterfly's
layout shuffles cost more than the launch they save.

**Accuracy at long context.** The PV dot accumulates over every position of a split, so its rounding
shows only at long context: with one split over 16k positions (what the plan gives pairs that fill
the GPU) the output's mean error against the float64 reference is {glue:text}`kv4_16k_err_s1:.1e`,
with sixteen splits {glue:text}`kv4_16k_err_s16:.1e` (table above). V codes enter the fp16
tensor-core dot as the exact subnormal `c 2^-24` (their bits are the code itself), and the sum is
scaled back by `2^24` after the loop. The magic-number form `1024 + c` used before made the fp32
accumulator carry about a thousand times the output's scale; its error grew in proportion to the
positions per split, to several percent at 16k with one split
(`python -m dev.kv4_split_accuracy`, `dev/results/kv4_split_accuracy*.json`).

**Where KV4 loses to its byte limit.** At B = 32, S = 16k the INT4 bytes alone, read at SDPA's own
measured bandwidth, would take {glue:text}`kv4_byte_ms:.3f` ms; we measure {glue:text}`kv4_ms_b32_16k:.3f` ms.
The compiled main loop (sm_90, counted offline by `python -m kvlib.bench sass_count`) issues
{glue:text}`kv4_sass_per_code:.2f` instructions per stored 4-bit code ({glue:text}`kv4_sass_bitops_share:.0%`
of them the shifts and logic ops of nibble extraction and V's fp16 subnormal construction), and holds {glue:text}`kv4_sass_regs` registers per thread, so only
{glue:text}`kv4_warps_per_sm` warps share an SM. At perfect issue the loop alone would take
{glue:text}`kv4_issue_ms:.3f` ms, {glue:text}`kv4_issue_share:.0%` of the byte time: with two warps per
scheduler, the dependent chain of each step (shared-memory loads, nibble operations, tensor-core
dots, softmax) is not hidden behind the memory stream. The split's interior blocks already run
without masks; more speed needs fewer instructions per code or more warps per SM.
"""
        ),
        code("run.save()", hide_input=True),
    ]
    return cells


def fidelity_probe() -> list[NotebookNode]:
    cells = [
        md(
            """
# The KV4-RL fidelity probe on SmolLM2: how far does each KV format move the sampler?

**Question.** Forced along the same reference token histories, how far is the next-token
distribution of SmolLM2-135M with a quantised KV cache from the full-precision one? The paper
(App. D.3-D.4) answers with a fidelity probe: 32 prompts, one temperature-1 reference response each,
eight states per response at `round(j(L-1)/7)`, full-vocabulary `KL(p_ref || q)` in float64, mean
and 95% CI by bootstrap over response paths. We run the same probe for: KV4 with rotation none / K /
K+V; affine groups of the whole head (64 channels here), 32 and 16; NVFP4 and MXFP4; three ways to
spend 144 INT8-protected positions (sink 16 + recent 128, all sink, all recent); recent width 16 /
128 / 512; INT8 against bf16 protection. Paper: sink 16 + recent 128 cuts mean KL 7.0x vs KV4 at 4B.

**Protocol** (the paper's storage probe, App. D.4). Prompts are windows of `prompt_len` tokens from the
shipped corpus (code, technical prose, narrative). The context (prompt minus its last token) is
prefilled once in full precision (float32), shared by the sampler and every row, and its K/V are
*stored* in each format; the forced continuation (the last prompt token and the `response_len`
response tokens) then runs through the quantised cache, so every probe state, including `j = 0`,
sees quantised storage, and the response's own K/V are computed from hidden states that already
went through it. Responses have a fixed length (no stop token) so paths batch. Each format is a
vectorised view (`kvlib.analysis.storage_probe.StorageCache`: one quantisation call per layer and side) that
hands attention the same K/V as the library's format cache (tested). KV4-RL rows are forced in one
chunk too: each query attends to the protected and INT4 regions *as its own decode step sees them*
(sinks plus the `recent` newest positions of its own length), through one masked softmax over both
regions, which is the paper's exact regional merge (tested equal to token-by-token decoding).

**Context length.** The protected set must be a real subset of the context for the allocation and
width rows to mean anything. State `j` predicts response token `round(j(L-1)/7)` and sees
`prompt_len + round(j(L-1)/7)` positions: {glue:text}`ctx_min` to {glue:text}`ctx_max` here, so the
144 positions of sink 16 + recent 128 are {glue:text}`share_144_min:.0%`-{glue:text}`share_144_max:.0%`
of the context (at the `ci` profile the contexts are short and protection covers most of them). The
paper's 4B responses average 1.45k tokens after short prompts, so its states see contexts of
similar size, but most of its context was generated through the quantised cache, and here most of
it is a prompt prefilled in full precision (then stored quantised).
"""
        ),
        params(
            """
profile = "cpu"
n_prompts = 32
prompt_len = 896  # tokens per prompt (corpus window)
response_len = 128  # sampled response tokens per prompt (fixed length), forced through each cache
batch = 16  # paths forced together
n_boot = 10000  # bootstrap resamples over paths
seed = 0
"""
        ),
        code(
            """
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

from kvlib.publish import Run
from kvlib.analysis.fidelity import geometric_kl_ratio, kl_mean_ratio, probe_positions
from kvlib.formats import get_format
from kvlib.hf.model import load_model
from kvlib.analysis.storage_probe import batched_probe, corpus_prompts, kv4rl_view, prefill_context, sample_responses

run = Run("kv4rl_fidelity_probe", profile=profile,
          params=dict(n_prompts=n_prompts, prompt_len=prompt_len, response_len=response_len, batch=batch,
                      n_boot=n_boot, seed=seed))
t_start = time.perf_counter()
torch.manual_seed(seed)
model, tok = load_model()
d = model.config.head_dim
prompts = corpus_prompts(tok, n_prompts, prompt_len)
# one full-precision prefill per batch of paths, shared by the sampler and every configuration
contexts = [prefill_context(model, prompts[i:i + batch]) for i in range(0, n_prompts, batch)]
t_prefill = time.perf_counter() - t_start
# all paths sampled together (one decode loop): the prefill batches' K/V joined along the batch
joined = [tuple(torch.cat([c[layer][side] for c in contexts]) for side in (0, 1)) for layer in range(len(contexts[0]))]
responses = sample_responses(model, prompts, joined, response_len, seed=seed)
del joined
t_ref = time.perf_counter() - t_start
run.glue("seconds_prefill", t_prefill)
run.glue("seconds_sample", t_ref - t_prefill)
states = [prompt_len + p for p in probe_positions(response_len, 8)]  # positions attended at each state
run.glue("ctx_min", states[0])
run.glue("ctx_max", states[-1])
run.glue("share_144_min", 144 / states[-1])
run.glue("share_144_max", min(1.0, 144 / states[0]))
print(f"{n_prompts} prompts x {prompt_len} tokens prefilled in {t_prefill:.0f} s; responses of {response_len} tokens "
      f"sampled at T=1 in {t_ref - t_prefill:.0f} s; head dim {d}")
print(f"contexts at the 8 probe states: {states} positions; 144 protected = "
      f"{144 / states[-1]:.0%}-{min(1, 144 / states[0]):.0%} of them")
""",
            hide_input=True,
        ),
        code(
            """
SPECS = {  # label -> (row group, cache spec)
    "repeat (fp32)": ("reference", None),
    "KV4 no rotation": ("rotation", ("kv4", dict(rotate="none"))),
    "KV4 K rotation": ("rotation", ("kv4", dict(rotate="k"))),
    "KV4 K+V rotation": ("rotation", ("kv4", dict(rotate="kv"))),
    "KV4 g32": ("groups", ("kv4-g32", dict(rotate="k"))),
    "KV4 g16": ("groups", ("kv4-g16", dict(rotate="k"))),
    "NVFP4": ("FP4", ("nvfp4", dict(rotate="none"))),
    "NVFP4 K rotation": ("FP4", ("nvfp4", dict(rotate="k"))),
    "MXFP4": ("FP4", ("mxfp4", dict(rotate="none"))),
    "sink 16 + recent 128": ("allocation (144)", kv4rl_view(sink=16, recent=128)),
    "sink 144": ("allocation (144)", kv4rl_view(sink=144, recent=0)),
    "recent 144": ("allocation (144)", kv4rl_view(sink=0, recent=144)),
    "sink 16 + recent 16": ("recent width", kv4rl_view(sink=16, recent=16)),
    "sink 16 + recent 512": ("recent width", kv4rl_view(sink=16, recent=512)),
    "sink 16 + recent 128, bf16": ("protection", kv4rl_view(sink=16, recent=128, protect="bf16")),
}
results = batched_probe(model, prompts, responses, {k: s for k, (_, s) in SPECS.items()}, batch=batch,
                        contexts=contexts, progress=print)
R = {r.name: r for r in results}
rows = []
for name, (group, spec) in SPECS.items():
    mean, lo, hi = R[name].ci(n_resamples=n_boot, seed=seed)
    fmt_name, opts = spec if isinstance(spec, tuple) else ("kv4rl", {})
    bits = get_format(fmt_name, **opts).bytes_per_position(d) * 8 / d if spec is not None else 32.0
    rows.append(dict(config=name, group=group, kl_mean=mean, kl_low=lo, kl_high=hi, top1=R[name].top1.mean(),
                     bits=bits, seconds=R[name].extra["seconds"]))
df = pd.DataFrame(rows)
run.record("probe", rows)
run.record("kl_states", {r.name: r.kl.tolist() for r in results})
t_total = time.perf_counter() - t_start
run.glue("states", int(R["repeat (fp32)"].kl.size))
run.glue("seconds_total", t_total)
display(df.style.format({"kl_mean": "{:.2e}", "kl_low": "{:.2e}", "kl_high": "{:.2e}", "top1": "{:.3f}",
                         "bits": "{:.2f}", "seconds": "{:.1f}"}).hide(axis="index"))
print(f"{R['repeat (fp32)'].kl.size} states; probe + sampling took {t_total:.0f} s")
""",
            hide_input=True,
        ),
        code(
            """
plot = df[df.config != "repeat (fp32)"].iloc[::-1].reset_index(drop=True)
fig, ax = plt.subplots(figsize=(7, 5.5))
colors = dict(zip(plot.group.unique(), plt.cm.tab10.colors))
for i, r in plot.iterrows():
    ax.errorbar(r.kl_mean, i, xerr=[[r.kl_mean - r.kl_low], [r.kl_high - r.kl_mean]], fmt="o",
                color=colors[r.group], capsize=3, label=r.group)
h, lab = ax.get_legend_handles_labels()
uniq = dict(zip(lab, h))
ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="lower right")
ax.set_yticks(range(len(plot)), plot.config)
ax.set_xscale("log")
ax.set_xlabel("mean KL(p_fp32 || q) per state, 95% CI over paths")
ax.set_title(f"SmolLM2-135M, {n_prompts} paths x 8 states, context {prompt_len}+{response_len}")
fig.tight_layout()
run.glue_fig("fig_kl", fig)
fig
""",
            hide_input=True,
        ),
        code(
            """
bits_rows = df[df.config.isin(["KV4 K rotation", "KV4 g32", "KV4 g16", "NVFP4", "MXFP4", "KV4 no rotation"])]
fig2, ax2 = plt.subplots(figsize=(5.5, 3.6))
for _, r in bits_rows.iterrows():
    ax2.errorbar(r.bits, r.kl_mean, yerr=[[r.kl_mean - r.kl_low], [r.kl_high - r.kl_mean]], fmt="o", capsize=3)
    ax2.annotate(r.config, (r.bits, r.kl_mean), textcoords="offset points", xytext=(5, 3), fontsize=7)
ax2.set_yscale("log")
ax2.set_xlabel(f"bits per element (d = {d}, codes + scales)")
ax2.set_ylabel("mean KL per state")
fig2.tight_layout()
run.glue_fig("fig_bits", fig2)
fig2
""",
            hide_input=True,
        ),
        md(
            """
Where along the response does protection help? Mean KL over the paths at each of the eight probe
states (x: positions in the context at that state) for KV4 and three protected variants.
"""
        ),
        code(
            """
fig3, ax3 = plt.subplots(figsize=(5.5, 3.6))
for name in ["KV4 K rotation", "sink 16 + recent 16", "sink 16 + recent 128", "sink 16 + recent 512"]:
    per_state = R[name].kl.reshape(n_prompts, -1).mean(0)
    ax3.plot(states, per_state, "o-", label=name)
ax3.set_yscale("log")
ax3.set_xlabel("context positions at the probe state")
ax3.set_ylabel(f"mean KL over {n_prompts} paths")
ax3.legend(fontsize=8)
fig3.tight_layout()
run.glue_fig("fig_states", fig3)
fig3
""",
            hide_input=True,
        ),
        md("## Reading the rows"),
        code(
            """
def m(name):
    return float(df.set_index("config").loc[name, "kl_mean"])

def ci(name):
    return df.set_index("config").loc[name, ["kl_low", "kl_high"]].astype(float).tolist()

def g(x):
    return f"{x:.2e}"

repeat_max = float(R["repeat (fp32)"].kl.max())
run.glue("repeat_max_kl", repeat_max)
run.claim("kv4rl-probe-zero-kl", ours=f"max KL of the same-process fp32 repeat over {R['repeat (fp32)'].kl.size} states: {repeat_max:g}",
          verdict="reproduced" if repeat_max == 0.0 else "differs",
          why="" if repeat_max == 0.0 else "the repeat is not bit-identical")

# rotation
krot, krot_lo, krot_hi = geometric_kl_ratio(R["KV4 no rotation"], R["KV4 K rotation"], n_resamples=n_boot, seed=seed)
kv, kv_lo, kv_hi = geometric_kl_ratio(R["KV4 K+V rotation"], R["KV4 K rotation"], n_resamples=n_boot, seed=seed)
for k_, v_ in dict(krot_ratio=krot, krot_lo=krot_lo, krot_hi=krot_hi, kv_ratio=kv, kv_lo=kv_lo, kv_hi=kv_hi).items():
    run.glue(k_, v_)
run.claim("kv4rl-krot", ours=f"mean KL {g(m('KV4 no rotation'))} (none) vs {g(m('KV4 K rotation'))} (K); paired geometric "
          f"ratio none/K {krot:.2f} [{krot_lo:.2f}, {krot_hi:.2f}]",
          verdict="reproduced" if krot_lo > 1 else "differs",
          why="" if krot_lo > 1 else "K rotation does not give a clear KL reduction on SmolLM2")
kv_flat = kv_lo <= 1 <= kv_hi
run.claim("kv4rl-kv-rotation-ratio", ours=f"{kv:.2f} [{kv_lo:.2f}, {kv_hi:.2f}] (SmolLM2-135M)",
          verdict="reproduced" if kv_flat else "differs",
          why="" if kv_flat else ("V rotation consistently " + ("lowers" if kv_hi < 1 else "raises") + " KL here"))

# groups
gk = [m("KV4 K rotation"), m("KV4 g32"), m("KV4 g16")]
for k_, v_ in zip(["kl_g64", "kl_g32", "kl_g16"], gk):
    run.glue(k_, v_)
mono = gk[0] > gk[1] > gk[2]
run.claim("kv4rl-groups-kl", ours=f"{g(gk[0])} (g{d}, head) -> {g(gk[1])} (g32) -> {g(gk[2])} (g16)",
          verdict="reproduced" if mono else "differs",
          why=f"head dim {d}: whole head = {d} channels (4.50 bits)" if mono else "KL is not monotone in group size")

# FP4
nv, nvk, kv4k = m("NVFP4"), m("NVFP4 K rotation"), m("KV4 K rotation")
close = 0.5 <= nv / kv4k <= 2
fp4_ok = nvk > nv and close
run.claim("kv4rl-fp4-kl", ours=f"NVFP4 {g(nv)}, NVFP4+Krot {g(nvk)}, INT4+Krot {g(kv4k)}, MXFP4 {g(m('MXFP4'))}",
          verdict="reproduced" if fp4_ok else "differs",
          why="" if fp4_ok else ("NVFP4 not within 2x of INT4+Krot; " if not close else "NVFP4 is within 2x of INT4+Krot, but ")
          + (f"K rotation lowers NVFP4 KL here ({g(nv)} -> {g(nvk)})" if nvk <= nv else ""))

# allocations of 144 positions
sr, s144, r144 = m("sink 16 + recent 128"), m("sink 144"), m("recent 144")
# "cuts mean KL 7.0x": ratio of mean KLs, CI from a paired bootstrap over paths
cut, cut_lo, cut_hi = kl_mean_ratio(R["KV4 K rotation"], R["sink 16 + recent 128"], n_resamples=n_boot, seed=seed)
vs_r, vs_r_lo, vs_r_hi = geometric_kl_ratio(R["recent 144"], R["sink 16 + recent 128"], n_resamples=n_boot, seed=seed)
for k_, v_ in dict(cut_sink_recent=cut, cut_lo=cut_lo, cut_hi=cut_hi, cut_sink144=kv4k / s144, cut_recent144=kv4k / r144,
                   recent144_ratio=vs_r, recent144_lo=vs_r_lo, recent144_hi=vs_r_hi).items():
    run.glue(k_, v_)
best = sr < s144 and sr < r144
near = cut_lo <= 7.0 and cut_hi >= 5.7  # the CI meets the paper's 5.7x (8B) - 7.0x (4B)
run.claim("kv4rl-sink-recent-kl",
          ours=f"{cut:.1f}x [{cut_lo:.1f}, {cut_hi:.1f}] vs KV4 (K rot); sink 144 {kv4k / s144:.1f}x, recent 144 "
          f"{kv4k / r144:.1f}x (paired geometric ratio recent 144 / sink16+recent128 {vs_r:.2f} [{vs_r_lo:.2f}, {vs_r_hi:.2f}])",
          verdict="reproduced" if best and near else "differs",
          why=("sink 16 + recent 128 has the lowest mean of the three allocations; " if best
               else "sink 16 + recent 128 is not the best allocation here; ")
          + ("its cut agrees with the paper's" if near else
             f"but its cut ({cut:.1f}x, 95% CI {cut_lo:.1f}-{cut_hi:.1f}) is " + ("larger" if cut_lo > 7.0 else "smaller")
             + f" than the paper's 5.7-7.0x (contexts {states[0]}-{states[-1]}, 135M model)"))

# recent width
w16, w128, w512 = m("sink 16 + recent 16"), sr, m("sink 16 + recent 512")
mono_w = w16 > w128 > w512
run.claim("kv4rl-recent-width", ours=f"{g(w16)} (16) > {g(w128)} (128) > {g(w512)} (512)" if mono_w
          else f"{g(w16)} (16), {g(w128)} (128), {g(w512)} (512)",
          verdict="reproduced" if mono_w else "differs", why="" if mono_w else "not monotone in width")

# INT8 vs bf16
(a_lo, a_hi), (b_lo, b_hi) = ci("sink 16 + recent 128"), ci("sink 16 + recent 128, bf16")
overlap = a_lo <= b_hi and b_lo <= a_hi
run.claim("kv4rl-int8-vs-bf16", ours=f"INT8 {g(sr)} [{g(a_lo)}, {g(a_hi)}], bf16 {g(m('sink 16 + recent 128, bf16'))} [{g(b_lo)}, {g(b_hi)}]",
          verdict="reproduced" if overlap else "differs", why="" if overlap else "the intervals do not overlap")
print(f"K rotation: none/K geometric ratio {krot:.2f} [{krot_lo:.2f}, {krot_hi:.2f}]; K+V/K {kv:.2f} [{kv_lo:.2f}, {kv_hi:.2f}]")
print(f"sink 16 + recent 128 cuts mean KL {cut:.1f}x vs KV4 (K rotation)")
""",
            hide_input=True,
        ),
        md(
            """
The same-process repeat of the full-precision reference gives a KL of exactly
{glue:text}`repeat_max_kl` at every state: the probe measures the cache format and nothing else. The
paired geometric ratio of KL without rotation to KL with K rotation is {glue:text}`krot_ratio:.2f`
(95% CI {glue:text}`krot_lo:.2f`-{glue:text}`krot_hi:.2f`); K+V against K only is
{glue:text}`kv_ratio:.2f` ({glue:text}`kv_lo:.2f`-{glue:text}`kv_hi:.2f`). Protecting sink 16 +
recent 128 positions in INT8 cuts the mean KL of KV4 by {glue:text}`cut_sink_recent:.1f`x (95% CI
{glue:text}`cut_lo:.1f`-{glue:text}`cut_hi:.1f`); the same 144 positions cut it
{glue:text}`cut_recent144:.1f`x when all are recent and {glue:text}`cut_sink144:.1f`x when all are
sinks (paired geometric ratio recent 144 over sink 16 + recent 128: {glue:text}`recent144_ratio:.2f`,
CI {glue:text}`recent144_lo:.2f`-{glue:text}`recent144_hi:.2f`).
Caveats: a 135M model in float32 rather than Qwen3-4B/8B in bf16; contexts of
{glue:text}`ctx_min`-{glue:text}`ctx_max` positions, of which the 144 protected ones are
{glue:text}`share_144_min:.0%`-{glue:text}`share_144_max:.0%`; corpus windows as prompts (not math
problems) with a long prompt prefilled in full precision and a {glue:text}`ctx_min`-position
context before the first forced token (the paper's prompts are short and most of its context is
generated through the quantised cache); fixed-length responses.
"""
        ),
        md("## Paper vs this run"),
        code("run.claims_table()", hide_input=True),
        code(
            """
reproduced = [c["id"] for c in run.claims if c["verdict"] == "reproduced"]
differs = [f"`{c['id']}` ({c['why']})" for c in run.claims if c["verdict"] != "reproduced"]
run.glue("n_reproduced", len(reproduced))
run.glue("n_claims", len(run.claims))
display(Markdown(
    f"**Verdict.** {len(reproduced)} of {len(run.claims)} fidelity claims hold on SmolLM2-135M at contexts of "
    f"{states[0]}-{states[-1]} positions: " + ", ".join(f"`{c}`" for c in reproduced) + ". "
    + ("Differs: " + "; ".join(differs) + ". " if differs else "")
    + "Each verdict is computed from the numbers above (orderings of means, overlap of bootstrap intervals, "
    "whether a paired ratio's interval excludes 1, whether a factor's interval meets the paper's); the paper's absolute KL "
    "values belong to Qwen3-4B/8B in bf16 and are not expected here, only orderings and factors."))
""",
            hide_input=True,
        ),
        code("run.save()", hide_input=True),
    ]
    return cells


if __name__ == "__main__":
    write(representation(), HERE / "kv4_representation.ipynb")
    write(latency(), HERE / "kv4_latency.ipynb")
    write(fidelity_probe(), HERE / "fidelity_probe.ipynb")
