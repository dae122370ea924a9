"""KV against weight quantisation at matched workloads (KV4-RL abstract, first claim; Sec. 4.2, Fig. A2).

The paper replays fixed (batch, context) decode states of its Qwen3-8B checkpoints and finds that KV cache
quantisation speeds up the decode step far more than weight-only or weight-activation quantisation (KV4 1.44x early,
1.97x late; FP8 W8A8 at most 1.06x). Here: the 28-layer **Qwen2.5-7B-shaped decoder with random bf16 weights**
(:func:`kvlib.bench.e2e.build_model`; speed does not depend on weight values; every row says so), at the replay
topic's states (:func:`kvlib.bench.replay.fixed_states`, same laws and seeds: our model of the paper's early and
late 8B checkpoint shapes; its Table A3 is not in the text we hold), one decode step of the whole model timed per arm:

* ``bf16``: bf16 weights and a bf16 ``StaticCache`` + SDPA, the step in a CUDA graph (the reference of the KV arms);
* ``bf16-compiled``: the same with every ``nn.Linear`` through ``torch.compile`` (the reference of the weight arms,
  which run their linear layers compiled too, torchao's intended path; at ``ci`` nothing is compiled and the
  weight arms' reference is ``bf16``);
* weight arms from torchao (``.whl/torchao-*.whl`` through :func:`kvlib.bench.peers_hf.ensure_peer_packages`),
  every ``nn.Linear`` quantised (the 196 projections and the output head; the embedding stays bf16), the same bf16
  StaticCache as ``bf16`` (one cache object: the KV workload is the same bytes): ``w8-int8wo`` (Int8WeightOnlyConfig,
  per-row symmetric INT8), ``w4-int4wo`` (Int4WeightOnlyConfig, groups of 128, tile-packed for PyTorch's tinygemm
  ``_weight_int4pack_mm``; CUDA sm80+), ``w8a8-fp8`` (Float8DynamicActivationFloat8WeightConfig, per-row FP8 e4m3
  weights and dynamic per-token activations through ``torch._scaled_mm``; CUDA sm89+). An arm this device cannot run
  is a row ``skipped: needs CUDA ...``, never dropped;
* KV arms from kvlib, bf16 weights, through ``kvlib.make_cache`` (:func:`kvlib.bench.e2e.make_method_cache`):
  ``kv8-rtn`` (rtn-int8), ``kv8-dither`` (dither-int8, certified), ``kv4``, ``kv4rl``.

Side by side: per state, one memory group for ``bf16``, ``bf16-compiled`` and the weight arms (their shared cache),
and one group per KV arm with ``bf16`` again (in :data:`PASSES`: the weight group and KV4 at every state first);
the arms of a group are timed in interleaved rounds (:func:`kvlib.bench.timing.interleaved`), and each arm's ratio
is against its reference *of the same group*.
Per arm: step time (median of rounds), tokens/s (= B / step), weight bytes (all, and read per step = all but the
embedding table), KV bytes (measured from the cache's tensors), and what a step reads (weights read + every KV byte
of the B sequences; ``kv_share`` = KV / that; ``byte_ratio_vs_bf16`` = the reference's bytes read / the arm's, the
speedup at the byte limit). The register's rule for the claim is ``kv4rl-kv-vs-weight-quant`` in
``data/claims/performance.yml``; :mod:`kvlib.bench.kv_vs_weight_report` forms its quantities.

``python -m kvlib.bench kv_vs_weight --profile gpu`` (the late state's bf16 cache is ~70 GB: an H200);
``ci``/``cpu``: a tiny Qwen2 config on the CPU at the replay topic's tiny laws, a wiring check (no speed claim).
"""

from __future__ import annotations

import copy
import gc
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlib.bench.timing import interleaved, profile_device

#: the model description every row carries (and the tiny config's at ci, which is not these shapes)
MODEL_DESC = "random bf16 weights, Qwen2.5-7B shapes (28 layers, hidden 3584, 28 q / 4 kv heads, d 128)"
TINY_DESC = "random bf16 weights, tiny Qwen2 config (CPU wiring check, not Qwen2.5-7B shapes)"

BF16, BF16C = "bf16", "bf16-compiled"
WEIGHT_ARMS = ("w8-int8wo", "w4-int4wo", "w8a8-fp8")
KV_ARMS = ("kv8-rtn", "kv8-dither", "kv4", "kv4rl")
ARMS = (BF16, BF16C) + WEIGHT_ARMS + KV_ARMS
#: the order the KV groups run in: the register's KV4 first, then the INT8 peer of the paper's KV8, then the rest
KV_ORDER = ("kv4", "kv8-rtn", "kv4rl", "kv8-dither")
#: KV arm -> the method of kvlib.bench.e2e (its make_cache format and options)
KV_METHOD = {"kv8-rtn": "rtn-int8", "kv8-dither": "dither-int8", "kv4": "kv4", "kv4rl": "kv4rl"}
#: what each arm quantises, in words (the rows say it)
WHAT = {BF16: "bf16 weights, bf16 KV", BF16C: "bf16 weights (linear layers compiled), bf16 KV",
        "w8-int8wo": "INT8 weights (per-row symmetric), bf16 activations, bf16 KV",
        "w4-int4wo": "INT4 weights (groups of 128, asymmetric), bf16 activations, bf16 KV",
        "w8a8-fp8": "FP8 e4m3 weights (per row) and activations (dynamic, per token), bf16 KV",
        "kv8-rtn": "bf16 weights, INT8 KV (round to nearest)", "kv8-dither": "bf16 weights, INT8 KV (dithered, "
        "certified)", "kv4": "bf16 weights, INT4 KV (head-wise affine)", "kv4rl": "bf16 weights, INT4 KV with INT8 "
        "sink/recent side buffer"}
#: the device capability each torchao arm needs (None: any device), and the kernel it reaches
NEEDS = {"w8-int8wo": (None, "inductor-fused INT8 dequant + mm (eager: int8->bf16 cast + mm)"),
         "w4-int4wo": ((8, 0), "aten._weight_int4pack_mm (tinygemm)"),
         "w8a8-fp8": ((8, 9), "torch._scaled_mm (FP8 rowwise)")}

#: the ci config: d = 128 as the 7B shapes (the dimension every kvlib kernel takes on the GPU lane), every linear
#: dimension a multiple of 128 (torchao's INT4 groups) and 16 (FP8 _scaled_mm)
TINY_KVW = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                num_key_value_heads=1, head_dim=128, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_theta=1e4, tie_word_embeddings=False)


@dataclass
class Profile:
    model: dict
    desc: str
    phases: tuple
    n_states: int  # states per phase drawn from the replay topic's collector
    pick: str  # "median": the state of median resident volume B * ctx; "all": every state
    rounds: int
    steps: int
    chunk: int
    compile_linears: bool
    time_budget_s: float
    arms: tuple[str, ...] = field(default=ARMS)


def _profiles() -> dict[str, Profile]:
    from kvlib.bench.e2e import QWEN25_7B
    from kvlib.bench.replay import CI_PHASES, GPU_PHASES

    gpu = Profile(QWEN25_7B, MODEL_DESC, GPU_PHASES, n_states=5, pick="median", rounds=5, steps=4, chunk=4096,
                  compile_linears=True, time_budget_s=480.0)
    ci = Profile(TINY_KVW, TINY_DESC, CI_PHASES, n_states=5, pick="median", rounds=2, steps=1, chunk=16,
                 compile_linears=False, time_budget_s=120.0)
    return {"gpu": gpu, "ci": ci, "cpu": ci}


class ArmUnavailable(RuntimeError):
    """An arm cannot run here (missing package, device capability); the row records why."""


# ------------------------------------------------------------------------------------------------ states
def replay_states(prof: Profile) -> list[dict[str, Any]]:
    """``(phase, state, batch, ctx)`` of each timed state: the replay topic's fixed states (its laws and seeds,
    ``seed = 17 * phase index``), all of them or the one of median resident volume per phase."""
    from kvlib.bench.replay import fixed_states

    out = []
    for i, ph in enumerate(prof.phases):
        sts = fixed_states(ph, prof.n_states, seed=17 * i)
        if prof.pick == "median":
            order = sorted(sts, key=lambda s: (s["batch"] * s["ctx"], s["state"]))
            sts = [order[(len(order) - 1) // 2]]
        elif prof.pick != "all":
            raise ValueError(f"pick must be 'median' or 'all', got {prof.pick!r}")
        out += [{"phase": ph.name, "state": s["state"], "batch": s["batch"], "ctx": s["ctx"],
                 "resident_tokens": s["batch"] * s["ctx"]} for s in sts]
    return out


# ------------------------------------------------------------------------------------------------ bytes
def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's quantised weights) is the sum of its inner tensors
    (``__tensor_flatten__``: codes, scales, zero points), a plain tensor its elements."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(x) for x in (getattr(t, n) for n in names) if x is not None)
    return t.numel() * t.element_size()


def model_weight_bytes(model) -> dict[str, int]:
    """Parameter bytes of ``model`` (quantised weights counted by what they hold): all, the embedding table, and
    what one decode step reads (all but the embedding table: a step reads B of its rows)."""
    total = sum(tensor_bytes(p) for p in model.parameters())
    emb = tensor_bytes(model.get_input_embeddings().weight)
    return {"total": int(total), "embedding": int(emb), "read_per_step": int(total - emb)}


def static_kv_bytes(cfg, batch: int, positions: int) -> int:
    """bf16 K+V bytes of a StaticCache of ``positions`` per sequence (every layer)."""
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * positions * cfg.head_dim * 2


# ------------------------------------------------------------------------------------------------ weight arms
def torchao_status() -> str | None:
    """``None`` if torchao imports (from the environment, else ``.whl/torchao-*.whl``), else why not."""
    try:
        from kvlib.bench.peers_hf import ensure_peer_packages

        ensure_peer_packages()
    except Exception as e:  # noqa: BLE001 - the reason is what the rows record
        return f"installing the .whl wheels failed: {type(e).__name__}: {str(e)[:160]}"
    try:
        import torchao  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torchao not importable ({type(e).__name__}: {str(e)[:160]}); put torchao-0.18.0-*.whl in .whl/"
    return None


def quant_config(arm: str):
    """The torchao config of a weight arm (the arm is checked before torchao is imported: a bad name is refused
    where torchao is absent too)."""
    if arm not in WEIGHT_ARMS:
        raise ValueError(f"arm must be one of {WEIGHT_ARMS}, got {arm!r}")
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if arm == "w8-int8wo":
        return Int8WeightOnlyConfig(granularity=PerRow())
    if arm == "w4-int4wo":
        return Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    if arm == "w8a8-fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    raise ValueError(f"arm must be one of {WEIGHT_ARMS}, got {arm!r}")


def arm_capability_reason(arm: str, device: str) -> str | None:
    """Why ``arm`` cannot run on ``device`` (None: it can)."""
    need, kernel = NEEDS[arm]
    if need is None:
        return None
    if device != "cuda":
        return f"skipped: needs CUDA (sm{need[0]}{need[1]}+, {kernel})"
    cap = torch.cuda.get_device_capability()
    if tuple(cap) < need:
        return f"skipped: needs CUDA sm{need[0]}{need[1]}+ ({kernel}); this device is sm{cap[0]}{cap[1]}"
    return None


def quantize_linears(module: torch.nn.Module, arm: str) -> torch.nn.Module:
    """``module`` (changed in place) with every ``nn.Linear`` weight quantised by torchao for ``arm``. Raises
    ArmUnavailable when torchao left a linear layer unquantised (it skips shapes its kernel cannot take)."""
    from torchao.quantization import quantize_

    quantize_(module, quant_config(arm))
    plain = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)
             and type(m.weight) in (torch.Tensor, torch.nn.Parameter)]
    if plain:
        raise ArmUnavailable(f"{arm}: torchao left {len(plain)} linear layer(s) unquantised (e.g. {plain[0]}: "
                             "a shape its kernel cannot take)")
    return module


def quantized_model(model, arm: str):
    """A copy of ``model`` with its linear layers quantised for ``arm`` (the embedding and norms stay bf16)."""
    q = copy.deepcopy(model)
    return quantize_linears(q, arm)


# ------------------------------------------------------------------------------------------------ compiled linears
_COMPILED: dict[str, Callable] = {}


def _linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)


#: torch.compile mode of the compiled linear layers (env KVLIB_KVW_COMPILE_MODE): "default" (torchao's inductor
#: settings, set by quantize_: coordinate-descent tuning) or "max-autotune-no-cudagraphs" (Triton mm templates, which
#: can fuse the INT8 weight's cast into the mm's loads; longer to compile). The step is graphed by us either way.
COMPILE_MODE = "default"


def compile_mode() -> str:
    return os.environ.get("KVLIB_KVW_COMPILE_MODE") or COMPILE_MODE


def compiled_linear() -> Callable:
    """``F.linear`` through ``torch.compile`` (inductor, :func:`compile_mode`): one compiled graph per weight shape,
    type and batch, reused by every layer of that shape. The recompile limit is raised to fit every arm's shapes."""
    if "f" not in _COMPILED:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 512))
        _COMPILED["f"] = torch.compile(_linear, mode=compile_mode(), dynamic=False)
    return _COMPILED["f"]


def _linear_forward(self, x):
    return compiled_linear()(x, self.weight, self.bias)


def compile_linears(model) -> int:
    """Route every ``nn.Linear`` of ``model`` through :func:`compiled_linear`; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(_linear_forward, m)
            n += 1
    return n


def uncompile_linears(model) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and "forward" in vars(m):
            del m.forward


# ------------------------------------------------------------------------------------------------ one state
def _row(arm: str, st: dict, prof: Profile, device: str, **kw) -> dict:
    return {"arm": arm, "what": WHAT[arm], "model": prof.desc, "device": device, "phase": st["phase"],
            "state": st["state"], "batch": st["batch"], "ctx": st["ctx"], **kw}


def _dev_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def _compile_during(stepper, model) -> None:
    """Make ``stepper`` run ``model`` with its linear layers compiled for the duration of each step (warm-up and
    capture included, so a captured graph replays the compiled kernels)."""
    f = stepper._forward

    def g(attn):
        compile_linears(model)
        try:
            return f(attn)
        finally:
            uncompile_linears(model)

    stepper._forward = g


def _time(steppers: dict[str, Any], rows: dict[str, dict], prof: Profile, device: str) -> None:
    """Interleaved rounds of the arms in ``steppers``; fills step_ms / tokens_per_s / graphed in ``rows``."""
    from kvlib.bench.e2e import _sync

    timers = {}
    for arm, st in steppers.items():
        try:
            t0 = time.perf_counter()
            timers[arm] = st.timer(st.attn)
            _sync(device)
            rows[arm]["setup_s"] = time.perf_counter() - t0  # warm-up, compile and capture
        except Exception as e:  # noqa: BLE001 - one arm failing must not stop the others
            rows[arm].update(status="error", reason=f"{arm}: decode step failed: {type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:240]}")
            e = None  # noqa: F841 - its traceback holds the group's frames
    res = interleaved(timers, prof.rounds)
    group = sorted(timers)
    for arm in timers:
        ms, per_round = res[arm]
        st = steppers[arm]
        if ms is None:
            rows[arm].update(status="error", reason="every timed round failed")
            continue
        rows[arm].update(status="ok", step_ms=ms, step_ms_rounds=per_round, tokens_per_s=rows[arm]["batch"]
                         / (ms * 1e-3), graphed=st.graphed, capture_errors=list(st.capture_errors),
                         steps_per_round=st.steps_used.get(st.attn), interleaved_with=[a for a in group if a != arm])
        if st.kvlib:
            rows[arm]["kernel_path"] = str(st.cache.kernel_path(0))


#: the run's passes over the states, most important first: the weight group and KV4 (the register's claim) at every
#: state, then the other KV arms; a pass not started by the deadline leaves skip rows, not a missing claim
PASSES = (("weights", "kv4"), ("kv8-rtn", "kv4rl", "kv8-dither"))


def group_arms(group: str) -> tuple[str, ...]:
    """The arms timed in ``group`` ("weights" or a KV arm; bf16 is in every group)."""
    if group == "weights":
        return (BF16, BF16C) + WEIGHT_ARMS
    if group in KV_ARMS:
        return (BF16, group)
    raise ValueError(f"group must be 'weights' or one of {KV_ARMS}, got {group!r}")


def run_state(model, st: dict, prof: Profile, device: str, arms: tuple[str, ...], deadline: float,
              torchao_why: str | None, groups: tuple[str, ...] = ("weights",) + KV_ORDER) -> list[dict]:
    """``groups`` at one state: the weight group (bf16, bf16-compiled, weight arms on one bf16 StaticCache) and one
    group per KV arm with bf16 again. Rows carry ``group`` and ``reference`` (the arm their ratio is against)."""
    for g in groups:
        group_arms(g)
    from kvlib.bench.e2e import GRAPH_PEER, HEADROOM, Stepper, _cleanup, cache_bytes, fill, make_method_cache

    cfg, dtype = model.config, torch.bfloat16
    b, s = st["batch"], st["ctx"]
    wbytes = model_weight_bytes(model)
    out: list[dict] = []
    ref_w = BF16C if prof.compile_linears else BF16

    def finish(rows: dict[str, dict], wb: dict[str, dict], ref: str, group: str) -> None:
        for arm, r in rows.items():
            r["group"] = group
            r["reference"] = None if arm == ref else ref
            w = wb.get(arm, wbytes)
            r["weight_bytes"], r["weight_bytes_read"] = w["total"], w["read_per_step"]
            if r.get("kv_bytes") is not None:
                r["step_read_bytes"] = w["read_per_step"] + r["kv_bytes"]
                r["kv_share"] = r["kv_bytes"] / r["step_read_bytes"]
        for arm, r in rows.items():  # once every row has its bytes
            rr = rows.get(ref, {})
            if arm != ref and r.get("step_read_bytes") and rr.get("step_read_bytes"):
                # the speedup a step would get if it ran at the byte limit (reads only: no writes, no compute)
                r["byte_ratio_vs_bf16"] = rr["step_read_bytes"] / r["step_read_bytes"]
            if arm != ref and r.get("status") == "ok" and rr.get("status") == "ok":
                r["speedup_vs_bf16"] = rr["step_ms"] / r["step_ms"]
                r["reference_step_ms"] = rr["step_ms"]
        out.extend(rows.values())

    # -- the bf16 cache: the reference of every group, and the weight arms' cache
    _cleanup(device)
    bf_cache = make_method_cache(GRAPH_PEER, cfg, batch=b, ctx=s, device=device, dtype=dtype)
    fill(bf_cache, cfg, batch=b, ctx=s, chunk=prof.chunk, device=device, dtype=dtype)
    bf_kv = cache_bytes(bf_cache)

    def bf16_stepper(m=model, compiled: bool = False):
        stp = Stepper(GRAPH_PEER, m, bf_cache, batch=b, ctx=s, device=device, steps=prof.steps)
        if compiled:
            _compile_during(stp, m)
        return stp

    # -- group W: bf16, bf16-compiled and the weight arms
    rows: dict[str, dict] = {}
    steppers: dict[str, Any] = {}
    wb: dict[str, dict] = {}
    models = []
    for arm in (BF16, BF16C) + WEIGHT_ARMS if "weights" in groups else ():
        if arm not in arms:
            continue
        row = rows[arm] = _row(arm, st, prof, _dev_name(device), kv_bytes=bf_kv)
        if arm == BF16C and not prof.compile_linears:
            row.update(status="skipped", reason="skipped: linear layers are compiled only at the gpu profile "
                       "(ci: the weight arms run eager against bf16)")
            continue
        if time.perf_counter() > deadline:
            row.update(status="skipped", reason="skipped: time budget spent before this group")
            continue
        if arm in (BF16, BF16C):
            steppers[arm] = bf16_stepper(compiled=arm == BF16C)
            continue
        why = torchao_why or arm_capability_reason(arm, device)
        if why is not None:
            row.update(status="skipped" if why.startswith("skipped") else "unavailable", reason=why)
            continue
        try:
            t0 = time.perf_counter()
            qm = quantized_model(model, arm)
            row["quantize_s"] = time.perf_counter() - t0
            row["kernel"] = NEEDS[arm][1]
            models.append(qm)
            wb[arm] = model_weight_bytes(qm)
            steppers[arm] = bf16_stepper(qm, compiled=prof.compile_linears)
            row["linear_layers"] = "compiled (torch.compile, inductor)" if prof.compile_linears else "eager"
        except ArmUnavailable as e:
            row.update(status="unavailable", reason=str(e))
        except Exception as e:  # noqa: BLE001
            row.update(status="error", reason=f"{arm}: quantising failed: {type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0][:240]}")
            e = None  # noqa: F841
    if BF16C in rows and rows[BF16C].get("status") is None:
        rows[BF16C]["linear_layers"] = "compiled (torch.compile, inductor)"
    if BF16 in rows:
        rows[BF16]["linear_layers"] = "eager"
    _time({a: steppers[a] for a in steppers}, rows, prof, device)
    finish(rows, wb, ref_w, "weights")
    for stp in steppers.values():
        stp.close()
    steppers.clear()
    models.clear()
    _cleanup(device)

    # -- one group per KV arm, bf16 beside it; the claim's KV4 first (a run cut short keeps what matters most)
    for arm in KV_ORDER:
        if arm not in arms or arm not in groups:
            continue
        rows = {BF16: _row(BF16, st, prof, _dev_name(device), kv_bytes=bf_kv, linear_layers="eager"),
                arm: _row(arm, st, prof, _dev_name(device), linear_layers="eager")}
        if time.perf_counter() > deadline:
            rows[arm].update(status="skipped", reason="skipped: time budget spent before this group")
            out.append(dict(rows[arm], group=arm, reference=BF16, weight_bytes=wbytes["total"],
                            weight_bytes_read=wbytes["read_per_step"]))
            continue
        steppers = {BF16: bf16_stepper()}
        try:
            cache = make_method_cache(KV_METHOD[arm], cfg, batch=b, ctx=s, device=device, dtype=dtype)
            t0 = time.perf_counter()
            fill(cache, cfg, batch=b, ctx=s, chunk=prof.chunk, device=device, dtype=dtype)
            rows[arm]["fill_s"] = time.perf_counter() - t0
            rows[arm]["kv_bytes"] = cache_bytes(cache)
            rows[arm]["positions"] = s + HEADROOM
            steppers[arm] = Stepper(KV_METHOD[arm], model, cache, batch=b, ctx=s, device=device, steps=prof.steps)
            cache = None
        except torch.cuda.OutOfMemoryError as e:
            rows[arm].update(status="oom", reason=f"skipped: out of memory while filling: {str(e)[:160]}")
            cache = e = None
        except Exception as e:  # noqa: BLE001
            rows[arm].update(status="unavailable", reason=f"{arm}: {type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:240]}")
            cache = e = None
        _time(steppers, rows, prof, device)
        finish(rows, {}, BF16, arm)
        for stp in steppers.values():
            stp.close()
        steppers.clear()
        _cleanup(device)
    rows_bf16_positions = s + 1
    for r in out:
        r.setdefault("positions", rows_bf16_positions)
    bf_cache = None  # noqa: F841 - released before the next state
    _cleanup(device)
    return out


# ------------------------------------------------------------------------------------------------ run
def run(profile: str, *, arms: tuple[str, ...] = ARMS, time_budget_s: float | None = None,
        pick: str | None = None) -> dict:
    """The benchmark; JSON-able result (see the module docstring). ``arms`` (env ``KVLIB_KVW_ARMS``, comma-separated;
    must include bf16); ``time_budget_s`` (env ``KVLIB_KVW_TIME_BUDGET_S``): states and groups not started by then
    are recorded as skipped; ``pick`` (env ``KVLIB_KVW_PICK``): ``median`` (one state per phase) or ``all`` (every
    replay state). Env ``KVLIB_KVW_COMPILE`` = 0/1 overrides the profile's compiled linear layers, and
    ``KVLIB_KVW_COMPILE_MODE`` their torch.compile mode; ``KVLIB_KVW_PARTIAL``: a file for the rows after each
    state."""
    device = profile_device(profile)
    if os.environ.get("KVLIB_KVW_ARMS") and arms == ARMS:  # `python -m kvlib.bench` passes only the profile
        arms = tuple(a.strip() for a in os.environ["KVLIB_KVW_ARMS"].split(",") if a.strip())
    profs = _profiles()
    prof = profs[profile]
    unknown = set(arms) - set(ARMS)
    if unknown or BF16 not in arms:
        raise ValueError(f"arms must be among {ARMS} and include {BF16!r}, got {arms!r}")
    if time_budget_s is None:
        time_budget_s = float(os.environ.get("KVLIB_KVW_TIME_BUDGET_S") or prof.time_budget_s)
    if time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be positive, got {time_budget_s!r}")
    pick = pick or os.environ.get("KVLIB_KVW_PICK") or prof.pick
    if pick not in ("median", "all"):
        raise ValueError(f"pick must be 'median' or 'all', got {pick!r}")
    compiled = prof.compile_linears
    if os.environ.get("KVLIB_KVW_COMPILE") in ("0", "1"):  # 0: weight arms eager against eager bf16
        compiled = os.environ["KVLIB_KVW_COMPILE"] == "1"
    prof = Profile(**{**vars(prof), "pick": pick, "arms": tuple(arms), "compile_linears": compiled})
    t0 = time.perf_counter()
    from kvlib.bench.e2e import _cleanup, build_model

    states = replay_states(prof)
    torchao_why = torchao_status() if any(a in WEIGHT_ARMS for a in arms) else None
    versions = {"torch": torch.__version__}
    if torchao_why is None:
        import torchao

        versions["torchao"] = torchao.__version__
    model = build_model(prof.model, device, torch.bfloat16)
    rows: list[dict] = []
    deadline = t0 + time_budget_s
    for groups in PASSES:
        for st in states:
            if time.perf_counter() > deadline:
                rows += [dict(_row(a, st, prof, _dev_name(device), status="skipped",
                                   reason=f"skipped: time budget of {time_budget_s:.0f} s spent"), group=g)
                         for g in groups for a in group_arms(g) if a in arms and (a != BF16 or g == "weights")]
                continue
            print(f"   kv_vs_weight {st['phase']} #{st['state']} B={st['batch']} ctx={st['ctx']}: {groups}", flush=True)
            rows += run_state(model, st, prof, device, tuple(arms), deadline, torchao_why, groups)
            _save_partial(rows)
    result = {
        "device": _dev_name(device), "profile": profile, "speed_claim": device == "cuda",
        "model": {"class": "Qwen2ForCausalLM", "description": prof.desc, **prof.model},
        "weights": "random bf16 (speed does not depend on weight values); built directly on the device",
        "arms": list(arms), "what": {a: WHAT[a] for a in arms},
        "states": states, "state_source": (f"kvlib.bench.replay.fixed_states of {[p.name for p in prof.phases]} "
                                           f"(seed 17 x phase index), {prof.n_states} per phase, pick={pick!r}"),
        "quantisation": {"library": "torchao", "status": torchao_why or "ok", "versions": versions,
                         "linear_layers": "every nn.Linear (q/k/v/o, gate/up/down, lm_head); embedding bf16",
                         "configs": {"w8-int8wo": "Int8WeightOnlyConfig(granularity=PerRow())",
                                     "w4-int4wo": "Int4WeightOnlyConfig(group_size=128, "
                                                  "int4_packing_format='tile_packed_to_4d')",
                                     "w8a8-fp8": "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())"},
                         "compiled": prof.compile_linears,
                         "compile_mode": compile_mode() if prof.compile_linears else None},
        "timing": (f"per state: a group of bf16, bf16-compiled and the weight arms on one bf16 StaticCache, and "
                   f"one group per KV arm with bf16, in passes {PASSES} over the states; {prof.rounds} interleaved "
                   f"rounds of {prof.steps} steps, median; "
                   "CUDA graph of the whole step on CUDA (eager where capture fails: graphed false); each ratio is "
                   "against the reference arm of its own group"),
        "bytes": ("weight_bytes: every parameter as held (quantised: codes + scales + zero points); "
                  "weight_bytes_read: all but the embedding table; kv_bytes: measured from the cache's tensors; "
                  "step_read_bytes = weight_bytes_read + kv_bytes"),
        "rows": rows, "time_budget_s": time_budget_s, "wall_s": time.perf_counter() - t0,
    }
    del model
    gc.collect()
    _cleanup(device)
    return result


def _save_partial(rows: list[dict]) -> None:
    """Rows so far to ``$KVLIB_KVW_PARTIAL`` (if set) after each state: a run its caller kills still leaves them."""
    path = os.environ.get("KVLIB_KVW_PARTIAL")
    if path:
        import json

        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"partial": True, "rows": rows}, fh, default=str)
        os.replace(tmp, path)
