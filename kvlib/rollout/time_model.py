"""A rollout-time MODEL: decode replay speed times the concurrency a smaller cache admits.

This is a model, not a measurement. For one GPU of a TP2 replica of Qwen3-8B (the paper's 8B
setting) and one training phase (a response-length law), it runs the quota-based collector
:func:`kvlib.rollout.partial.simulate_collection` once per cache format, with the page pool re-cut
for that format's bytes per position ``kappa``, and prices every decode step of the trace:

``tau_f(B_t, C_t) = W / BW + F B_t / FLOPS + n_calls * a_f(B_t, C_t)``

* ``W``, ``F``: bf16 linear-layer weight bytes and FLOPs per token per GPU (:func:`linear_params`;
  for Qwen3-4B it gives the paper's 4.022272 GB), streamed at the copy bandwidth ``BW`` and run at
  ``FLOPS`` (datasheet dense bf16, 989.5 TFLOP/s, as the paper's workload figure);
* ``a_f``: the time of one attention call at our benchmark shape (one layer, 8 KV heads), either
  fitted to the decode replay (:func:`fit_attention`, ``a + c C``) or the byte roofline
  (:func:`roofline_attention`); ``n_calls = layers * kv_heads_per_gpu / 8`` = 18 for 8B under TP2;
* ``B_t``, ``C_t``: active requests and the sum of their contexts at step ``t`` of the trace;
* plus, once per run, prefill of fresh prompts and re-prefill of carried/preempted prefixes
  (tokens counted by the collector) priced as linear-layer FLOPs only: ``F tokens / FLOPS``.

Not modelled: prefill attention, sampling, scheduling, reward evaluation, learner time, and any
change of the generated responses under quantisation (the law is fixed).
Speedups: ``exec`` = same BF16 trace priced for both formats (what replay measures); ``total`` =
each format priced on its own trace (adds the capacity effect); ``capacity = total / exec``. Traces of
different formats decode slightly different token counts over the same updates (work carried across
updates), so ``total`` compares time per decoded token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlib.rollout.laws import LengthLaw
from kvlib.rollout.partial import HEAD_DIM, CacheFormat, simulate_collection

#: benchmark method -> registered storage format (byte account)
METHOD_FORMAT = {"sdpa_bf16": "bf16", "int8_cert": "dither-int8", "kv4": "kv4", "kv4rl": "kv4rl"}
PAPER_FLOPS = 989.5e12  # dense bf16, H200 datasheet (the paper's workload figure)
CALL_KV_HEADS = 8  # KV heads per benchmark call (decode_grid.GPU_SHAPE)


@dataclass(frozen=True)
class ModelShape:
    """Transformer dimensions that set weight bytes, FLOPs per token and attention calls per step."""

    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 128
    tp: int = 2


QWEN3_8B = ModelShape(hidden=4096, intermediate=12288, layers=36, q_heads=32, kv_heads=8, vocab=151_936)
QWEN3_4B = ModelShape(hidden=2560, intermediate=9728, layers=36, q_heads=32, kv_heads=8, vocab=151_936)


def linear_params(m: ModelShape) -> int:
    """Parameters of the linear projections (q, k, v, o, gate/up/down) and the output head."""
    qd, kvd = m.q_heads * m.head_dim, m.kv_heads * m.head_dim
    per_layer = m.hidden * qd + 2 * m.hidden * kvd + qd * m.hidden + 3 * m.hidden * m.intermediate
    return m.layers * per_layer + m.vocab * m.hidden


def weight_bytes_per_gpu(m: ModelShape) -> float:
    """bf16 linear weights per GPU under tensor parallelism (also FLOPs per token per GPU: 2 per weight)."""
    return 2.0 * linear_params(m) / m.tp


def attention_calls_per_step(m: ModelShape, call_kv_heads: int = CALL_KV_HEADS) -> float:
    """Benchmark-shaped attention calls per decode step per GPU: layers * (kv_heads / tp) / call_kv_heads."""
    return m.layers * (m.kv_heads / m.tp) / call_kv_heads


def cache_format(name: str, d: int = HEAD_DIM) -> CacheFormat:
    """The collector's :class:`CacheFormat` built from a registered format's own byte account."""
    from kvlib.formats.base import get_format

    f = get_format(name)
    if f.capacity:  # a fixed side buffer of `capacity` positions per request (KV4-RL)
        return CacheFormat(name, f.bits_per_element(d), f.capacity, 8.0 * f.fixed_bytes(d) / f.capacity / d)
    return CacheFormat(name, f.bits_per_element(d))


def roofline_attention(fmt: str, bw_GBps: float, d: int = HEAD_DIM,
                       kv_heads: int = CALL_KV_HEADS) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``a(B, C)`` in ms = bytes of one call (format's byte account) / ``bw_GBps``; contexts >= side capacity."""
    from kvlib.formats.base import get_format

    if bw_GBps <= 0:
        raise ValueError(f"bw_GBps must be positive, got {bw_GBps}")
    f = get_format(fmt)
    bpp = f.bytes_per_position(d)
    side_cap = f.capacity
    side_bpp = f.fixed_bytes(d) / side_cap if side_cap else 0.0

    def a(B: np.ndarray, C: np.ndarray) -> np.ndarray:
        B, C = np.asarray(B, float), np.asarray(C, float)
        side = B * side_cap
        return 2 * kv_heads * ((C - side) * bpp + side * side_bpp) / (bw_GBps * 1e9) * 1e3

    return a


def fit_attention(batch: Sequence[float], ctx_sum: Sequence[float], ms: Sequence[float]
                  ) -> tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], dict[str, float]]:
    """Least-squares ``a + c C`` (ms, C = sum of contexts) over measured states; returns ``(a(B, C), fit)``."""
    import statsmodels.api as sm

    C, y = np.asarray(ctx_sum, float), np.asarray(ms, float)
    if C.shape != y.shape or C.size < 2 or np.ptp(C) == 0:
        raise ValueError("fit_attention needs at least two states with different context sums")
    res = sm.OLS(y, sm.add_constant(C)).fit()
    a0, c = (float(v) for v in res.params)

    def a(B: np.ndarray, Cq: np.ndarray) -> np.ndarray:
        return a0 + c * np.asarray(Cq, float)

    return a, {"intercept_ms": a0, "ms_per_Mpos": c * 1e6, "r2": float(res.rsquared), "n": int(C.size)}


def step_ms(B: np.ndarray, C: np.ndarray, attn: Callable, *, model: ModelShape = QWEN3_8B, bw_GBps: float,
            flops: float = PAPER_FLOPS, weights: bool = True) -> np.ndarray:
    """Model time of each decode step (ms): weights + linear FLOPs (if ``weights``) + attention calls."""
    B, C = np.asarray(B, float), np.asarray(C, float)
    t = attention_calls_per_step(model) * attn(B, C)
    if weights:
        w = weight_bytes_per_gpu(model)
        t = t + w / (bw_GBps * 1e9) * 1e3 + w * B / flops * 1e3
    return t


def prefill_ms(tokens: float, model: ModelShape = QWEN3_8B, flops: float = PAPER_FLOPS) -> float:
    """Prefill time (ms) of ``tokens`` priced as linear-layer FLOPs per GPU (compute bound, no attention)."""
    return float(tokens) * weight_bytes_per_gpu(model) / flops * 1e3


def collector_trace(law: LengthLaw, fmt: str, *, P: int = 256, updates: int = 8, warmup: int = 3, seed: int = 0,
                    **kw: Any) -> dict[str, Any]:
    """Kept decode steps (after ``warmup`` updates) of the collector under ``fmt``'s page pool."""
    res = simulate_collection(law, fmt=cache_format(fmt), P=P, updates=updates, warmup=warmup, seed=seed, **kw)
    keep = res.trace["update"] >= warmup
    up = {k: v[warmup:] for k, v in res.updates.items()}
    prefill = float(up["reprefill_tokens"].sum() + up["new_groups"].sum() * res.params["G"] * P)
    return {"batch": res.trace["batch"][keep], "ctx_sum": res.trace["context_sum"][keep],
            "prefill_tokens": prefill, "tokens": float(res.trace["batch"][keep].sum()), "summary": res.summary(),
            "updates": updates - warmup}


def rollout_model(law: LengthLaw, attention: Mapping[str, Callable], *, bw_GBps: float, model: ModelShape = QWEN3_8B,
                  P: int = 256, updates: int = 8, warmup: int = 3, seed: int = 0, flops: float = PAPER_FLOPS,
                  traces: Mapping[str, dict] | None = None) -> dict[str, Any]:
    """Model rollout time per format for one law; ``attention`` maps format name -> ``a(B, C)`` (ms).

    Must contain ``"bf16"``. Returns per format: decode time (s) on its own trace and on the BF16
    trace, with and without the weight term, speedups ``exec``/``total``/``capacity`` and trace means.
    """
    if "bf16" not in attention:
        raise ValueError("attention must include the 'bf16' reference")
    traces = dict(traces or {})
    for f in attention:
        if f not in traces:
            traces[f] = collector_trace(law, f, P=P, updates=updates, warmup=warmup, seed=seed)
    ref = traces["bf16"]
    out: dict[str, Any] = {}
    for f, a in attention.items():
        tr = traces[f]
        row: dict[str, Any] = {}
        for label, w in (("", True), ("_attn_only", False)):
            own = float(step_ms(tr["batch"], tr["ctx_sum"], a, model=model, bw_GBps=bw_GBps, flops=flops,
                                weights=w).sum())
            on_ref = float(step_ms(ref["batch"], ref["ctx_sum"], a, model=model, bw_GBps=bw_GBps, flops=flops,
                                   weights=w).sum())
            if w:  # prefill and re-prefill: linear FLOPs of the counted tokens
                own += prefill_ms(tr["prefill_tokens"], model, flops)
                on_ref += prefill_ms(ref["prefill_tokens"], model, flops)
            row[f"time_s{label}"] = own / 1e3
            row[f"time_on_bf16_trace_s{label}"] = on_ref / 1e3
            row[f"ms_per_token{label}"] = own / tr["tokens"]
            row[f"ms_per_token_on_bf16_trace{label}"] = on_ref / ref["tokens"]
        row.update(steps=int(tr["batch"].size), tokens=tr["tokens"], mean_batch=float(tr["batch"].mean()),
                   prefill_tokens=tr["prefill_tokens"],
                   mean_context=float(tr["ctx_sum"].sum() / tr["batch"].sum()),
                   page_limited_fraction=tr["summary"]["page_limited_fraction"],
                   preemptions_per_update=tr["summary"]["preemptions_per_update"])
        out[f] = row
    b = out["bf16"]
    for row in out.values():
        for label in ("", "_attn_only"):
            row[f"speedup_exec{label}"] = b[f"time_s{label}"] / row[f"time_on_bf16_trace_s{label}"]
            row[f"speedup_total{label}"] = b[f"ms_per_token{label}"] / row[f"ms_per_token{label}"]
            row[f"capacity_factor{label}"] = row[f"speedup_total{label}"] / row[f"speedup_exec{label}"]
    return out


def cumulative_speedup(per_phase: Sequence[Mapping[str, Any]], fmt: str, own_trace: bool = True) -> float:
    """``sum_phases T_bf16 / sum_phases T_fmt`` over phases of equal BF16 decoded tokens (the paper sums times).

    ``own_trace``: each format on its own trace (per-token time scaled to the BF16 token count), else
    on the BF16 trace (execution only).
    """
    num = sum(p["bf16"]["time_s"] for p in per_phase)
    if own_trace:
        den = sum(p[fmt]["ms_per_token"] * p["bf16"]["tokens"] / 1e3 for p in per_phase)
    else:
        den = sum(p[fmt]["time_on_bf16_trace_s"] for p in per_phase)
    if den <= 0:
        raise ValueError("model times must be positive")
    return float(num / den)
