"""Decode latency and achieved bandwidth of every KV format over (batch, context), in ONE GPU run.

Formats (methods), all at d=128 and GQA 32 query / 8 KV heads, one layer, one query token per row:

* ``sdpa_bf16``: torch SDPA bf16, default backend, contiguous ``[B, H_kv, S, d]`` (its best case);
* ``triton_bf16``: our bf16 split-KV Triton kernel (:mod:`kvlib.kernels.bf16.decode`), paged;
* ``int8_cert`` / ``int8_nocert``: dithered INT8 decode (:mod:`kvlib.kernels.int8.decode`, tensor-core
  kernel) with the certificate (A and B accumulators) and with it switched off, ``fast`` operands
  (dither as one fp16 operand, P as one fp16 operand against the exact v pair); ``int8_cert_exact``:
  every operand exact (:data:`INT8_MODES`);
* ``int8_nophilox``: the certified kernel with its key dither replaced by garbage
  (``skip_philox=True``, a timing probe only), so the Philox cost is measured directly. (An earlier
  ``int8_philox2`` variant, values dithered too, ran the tensor-core kernel's value-dither path, which
  later failed its H200 check; it was dropped.)
* ``int8_h10_cert`` / ``int8_h10_nocert`` / ``int8_h10_nophilox``: the same pools read through the
  h10 dither layout (eight 10-bit dithers per Philox call) by its own kernel
  (:mod:`kvlib.kernels.int8.h10`, certificate with A only, as the w24 ``int8_cert`` is timed with
  A and B: see ``int8_h10_certAB``), where the shape allows it (``d = 4 * 32``); ``int8_h8_cert`` /
  ``int8_h8_nocert``: the same through the h8 layout (sixteen 8-bit dithers per call, the same kernel);
  ``int8_h8g_cert`` / ``int8_h8g_nocert``: the h8 codes read by the Gluon kernel
  (:mod:`kvlib.kernels.int8.gluon`, GPU only: on CPU a note says so);
* ``kv4`` / ``kv4rl``: KV4 INT4 decode and KV4-RL (INT4 main region + INT8 sink/recent side
  buffer merged with ``merge_states``), :mod:`kvlib.kernels.int4.attention`.

Bytes moved per call are the K+V payload from each format's own byte account
(``bytes_per_position`` / ``fixed_bytes`` / ``side_count`` of :func:`method_format`);
slot tables, queries and outputs are not counted (under 1% at S >= 1k). Achieved bandwidth is set
against the copy bandwidth measured in the same run. Codes and scales are random (speed does not
depend on their values). On CUDA every method is captured in a CUDA graph (eager if capture fails,
recorded) so launch overhead is paid equally, then timed by :func:`kvlib.bench.timing.bench_graphed`.

On CPU (profiles ci/cpu) the same code runs at tiny shapes (Triton interpreter when
``TRITON_INTERPRET=1``, else the torch references): a wiring check, never a speed claim.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlib.bench.timing import bandwidth_GBps, bench_graphed, copy_bandwidth, profile_device

LAYER = 3
SEED = 0x5EED_0000_1234
SINK, RECENT = 16, 128
INT8_GROUP = 32
#: both modes are the tensor-core kernel; "exact" keeps every operand exact (max|do| ~1e-6 against the
#: float64 reference), "fast" drops the dither's fp16 remainder and the P lo-part (max|do| ~1e-4); the
#: certificate is sound in both (the radius covers the fp16 dither)
INT8_MODES = {"exact": dict(impl="tc"), "fast": dict(impl="tc", xi_split=False, pv_terms=2)}
#: keyword names a decode_int8 "skip Philox" switch could carry (none exists as of writing)
SKIP_PHILOX_ARGS = ("skip_philox", "k_dither", "philox", "dither")

ALL_METHODS = ("sdpa_bf16", "triton_bf16", "int8_cert", "int8_nocert", "int8_cert_exact",
               "int8_nophilox", "int8_h10_cert", "int8_h10_certAB", "int8_h10_nocert", "int8_h10_nophilox",
               "int8_h8_cert", "int8_h8_nocert", "int8_h8g_cert", "int8_h8g_nocert", "kv4", "kv4rl")
#: which format's byte account each method reads (a benchmark fact: the pools each method builds)
METHOD_FORMAT = {"sdpa_bf16": "bf16", "triton_bf16": "bf16", "kv4": "kv4", "kv4rl": "kv4rl",
                 **{m: "dither-int8" for m in ALL_METHODS if m.startswith("int8")}}
#: the options the grid builds each format's pools with
FORMAT_OPTIONS = {"dither-int8": dict(group=INT8_GROUP), "kv4rl": dict(sink=SINK, recent=RECENT)}


@dataclass(frozen=True)
class HeadShape:
    """Attention head layout of one decode call."""

    hq: int = 32
    hkv: int = 8
    d: int = 128

    def __post_init__(self) -> None:
        for name in ("hq", "hkv", "d"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.hq % self.hkv:
            raise ValueError(f"hq={self.hq} must be a multiple of hkv={self.hkv}")


GPU_SHAPE = HeadShape(32, 8, 128)
CPU_SHAPE = HeadShape(4, 1, 32)


# ------------------------------------------------------------------------------------------------
# byte account (from the formats' / pools' own functions)
def method_format(method: str) -> Any:
    """The format object (with the grid's :data:`FORMAT_OPTIONS`) whose byte account ``method`` reads."""
    from kvlib.formats.base import get_format

    if method not in METHOD_FORMAT:
        raise ValueError(f"method must be one of {sorted(METHOD_FORMAT)}, got {method!r}")
    name = METHOD_FORMAT[method]
    return get_format(name, **FORMAT_OPTIONS.get(name, {}))


def side_count(lengths: torch.Tensor, sink: int = SINK, recent: int = RECENT) -> torch.Tensor:
    """Positions of each request held by the KV4-RL side buffer (sinks plus the recent window)."""
    from kvlib.formats.base import get_format

    return get_format("kv4rl", sink=sink, recent=recent).side_count(lengths)


def call_bytes(method: str, lengths: torch.Tensor, shape: HeadShape) -> float:
    """K+V payload bytes one decode call of ``method`` reads for requests of ``lengths`` positions: the main
    region at ``bytes_per_position``, side-buffer positions (if the format has one) at ``fixed_bytes / capacity``."""
    f = method_format(method)
    n = float(lengths.double().sum())
    heads_sides = 2 * shape.hkv
    side = float(f.side_count(lengths).double().sum())
    side_bpp = f.fixed_bytes(shape.d) / f.capacity if f.capacity else 0.0
    return heads_sides * ((n - side) * f.bytes_per_position(shape.d) + side * side_bpp)


# ------------------------------------------------------------------------------------------------
# helpers
def skip_philox_kw() -> dict[str, Any] | None:
    """The tuning switch that makes ``decode_int8`` skip Philox (a field of its ``Int8KernelConfig``), if one
    exists; else None."""
    from kvlib.kernels.int8.config import CONFIG_FIELDS

    for name in SKIP_PHILOX_ARGS:
        if name in CONFIG_FIELDS:
            return {name: name == "skip_philox"}  # skip_philox=True, or dither/philox=False
    return None


def _slot_table(lengths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Contiguous slots per request (request b owns ``[off_b, off_b + len_b)``), padded with slot 0."""
    n = lengths.long()
    off = torch.cumsum(n, 0) - n
    m = int(n.max())
    ar = torch.arange(m, device=lengths.device)
    slots = torch.where(ar[None, :] < n[:, None], off[:, None] + ar[None, :], torch.zeros((), dtype=torch.long,
                                                                                          device=lengths.device))
    return slots.to(torch.int32), int(n.sum())


def _sdpa_buckets(lengths: torch.Tensor, n_buckets: int) -> list[torch.Tensor]:
    """Request indices grouped by length (sorted, equal counts): SDPA pads only within a bucket."""
    order = torch.argsort(lengths.long())
    return [c for c in torch.tensor_split(order, min(n_buckets, lengths.numel())) if c.numel()]


# ------------------------------------------------------------------------------------------------
# one state = one batch of requests with given lengths: build each format's inputs in turn, time, free
def time_state(
    lengths: Sequence[int] | torch.Tensor, *, methods: Sequence[str] = ALL_METHODS, shape: HeadShape = GPU_SHAPE,
    device: str | None = None, rep_ms: float = 40.0, warmup_ms: float = 10.0, sdpa_buckets: int = 8, seed: int = 0,
) -> dict[str, Any]:
    """Time every method on one decode state (``lengths[b]`` positions for request b).

    Returns ``{"batch", "ctx_mean", "ctx_max", "methods": {name: {median_ms, q25_ms, q75_ms, ..., bytes,
    GBps}}, "notes": [...]}``. Uniform lengths give the fixed-shape case (SDPA unpadded); ragged lengths
    give SDPA over ``sdpa_buckets`` length-sorted buckets padded to each bucket's maximum
    (``bytes_padded`` records what it actually reads). Inputs of one format live only while it is timed.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"methods {unknown} unknown; available: {ALL_METHODS}")
    lengths = torch.as_tensor(lengths, dtype=torch.int32).to(device)
    if lengths.ndim != 1 or lengths.numel() == 0 or int(lengths.min()) < 1:
        raise ValueError("lengths must be a non-empty 1-D sequence of positive ints")
    b = int(lengths.numel())
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, shape.hq, shape.d, device=device, generator=g)
    uniform = bool((lengths == lengths[0]).all())
    out: dict[str, Any] = {"batch": b, "ctx_mean": float(lengths.float().mean()), "ctx_max": int(lengths.max()),
                           "ctx_sum": int(lengths.long().sum()), "uniform": uniform, "methods": {}, "notes": []}
    timed: dict[str, dict] = out["methods"]

    def record(name: str, fn: Callable[[], object], **extra: Any) -> None:
        try:
            t = bench_graphed(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
        except Exception as e:  # noqa: BLE001 - one method failing must not lose the others
            out["notes"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            if device == "cuda":
                torch.cuda.synchronize()
            return
        t["bytes"] = call_bytes(name, lengths.cpu(), shape)
        t["GBps"] = bandwidth_GBps(t["bytes"], t["median_ms"])
        t.update(extra)
        timed[name] = t

    def free() -> None:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    want = set(methods)
    if "sdpa_bf16" in want:
        _sdpa(record, q, lengths, shape, sdpa_buckets, uniform)
        free()
    if want & {"triton_bf16"}:
        _triton_bf16(record, q, lengths, shape)
        free()
    if want & {m for m in ALL_METHODS if m.startswith("int8")}:
        _int8(record, q, lengths, shape, want, out["notes"])
        free()
    if want & {"kv4", "kv4rl"}:
        _kv4(record, q, lengths, shape, want)
        free()
    return out


def _sdpa(record, q, lengths, shape: HeadShape, n_buckets: int, uniform: bool) -> None:
    import warnings

    import torch.nn.functional as F

    warnings.filterwarnings("ignore", message=".*(kernel not used|require query, key and value|runtime disabled).*")
    groups = [torch.arange(lengths.numel(), device=q.device)] if uniform else _sdpa_buckets(lengths, n_buckets)
    parts = []
    padded = 0
    for idx in groups:
        n = int(lengths[idx].max())
        padded += idx.numel() * n
        k = torch.randn(idx.numel(), shape.hkv, n, shape.d, device=q.device, dtype=torch.bfloat16)
        parts.append((q[idx].to(torch.bfloat16).unsqueeze(2), k, torch.randn_like(k)))

    def fn():
        return [F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True) for qq, kk, vv in parts]

    from kvlib.formats.base import get_format

    record("sdpa_bf16", fn, n_calls=len(parts),
           bytes_padded=2 * shape.hkv * padded * get_format("bf16").bytes_per_position(shape.d))


def _triton_bf16(record, q, lengths, shape: HeadShape) -> None:
    from kvlib.kernels.bf16.decode import decode_bf16

    slots, n = _slot_table(lengths)
    k = torch.randn(n, shape.hkv, shape.d, device=q.device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qb = q.to(torch.bfloat16)
    record("triton_bf16", lambda: decode_bf16(qb, k, v, slots, lengths))


def _int8(record, q, lengths, shape: HeadShape, want: set[str], notes: list[str]) -> None:
    from kvlib.kernels.int8.config import config_call
    from kvlib.kernels.int8.decode import PoolSide, decode_int8

    slots, n = _slot_table(lengths)
    dev = q.device

    def side() -> PoolSide:
        return PoolSide(torch.randint(-127, 128, (n, shape.hkv, shape.d), dtype=torch.int8, device=dev),
                        (torch.rand(n, shape.hkv, shape.d // INT8_GROUP, device=dev) * 0.02 + 0.005).half(),
                        group=INT8_GROUP)

    kp, vp = side(), side()
    base = dict(layer=LAYER, seed=SEED)

    qb = q.to(torch.bfloat16)  # the query a bf16 model hands over (SDPA gets the same)

    def call(mode: str, **kw: Any) -> Callable[[], object]:
        call = config_call(INT8_MODES[mode] | kw)  # the mode's tuning names in one Int8KernelConfig
        return lambda: decode_int8(qb, kp, vp, slots, lengths, **base, **call)

    variants = {"int8_cert": call("fast", cert=True), "int8_nocert": call("fast", cert=False),
                "int8_cert_exact": call("exact", cert=True)}
    skip = skip_philox_kw()
    if skip is not None:
        variants["int8_nophilox"] = call("fast", cert=True, **skip)
    elif "int8_nophilox" in want:
        notes.append("int8_nophilox: decode_int8 exposes no switch that skips Philox "
                     f"(looked for {SKIP_PHILOX_ARGS})")
    if shape.d == 4 * INT8_GROUP:
        import dataclasses

        kp10 = dataclasses.replace(kp, dither_layout="h10")
        # impl="h10" named: "auto" would take the Gluon kernel for the h8 pool on a GPU (this grid times the Triton one)
        h10 = lambda **kw: (lambda: decode_int8(qb, kp10, vp, slots, lengths, impl="h10", **base,  # noqa: E731
                                                **config_call(kw)))
        variants |= {"int8_h10_cert": h10(cert=True, cert_b=False), "int8_h10_certAB": h10(cert=True, cert_b=True),
                     "int8_h10_nocert": h10(cert=False),
                     "int8_h10_nophilox": h10(cert=True, cert_b=False, skip_philox=True)}
        kp8 = dataclasses.replace(kp, dither_layout="h8")
        h8 = lambda **kw: (lambda: decode_int8(qb, kp8, vp, slots, lengths, impl="h10", **base, **kw))  # noqa: E731
        variants |= {"int8_h8_cert": h8(cert=True, cert_b=False), "int8_h8_nocert": h8(cert=False)}
        from kvlib.kernels.int8.gluon import gluon_unsupported

        why = gluon_unsupported(qb, kp8, vp)
        if why is None:  # the same h8 codes read by the Gluon kernel (GPU only)
            g8 = lambda **kw: (lambda: decode_int8(qb, kp8, vp, slots, lengths, impl="gluon", **base, **kw))  # noqa: E731
            variants |= {"int8_h8g_cert": g8(cert=True, cert_b=False), "int8_h8g_nocert": g8(cert=False)}
        elif want & {"int8_h8g_cert", "int8_h8g_nocert"}:
            notes.append(f"int8_h8g_*: {why}")
    elif want & {m for m in ALL_METHODS if m.startswith(("int8_h10", "int8_h8"))}:
        notes.append(f"int8_h10_*, int8_h8_*: the h10 kernel needs d = 4 * {INT8_GROUP}, got d={shape.d}")
    for name, fn in variants.items():
        if name in want:
            record(name, fn)


def _kv4(record, q, lengths, shape: HeadShape, want: set[str]) -> None:
    from kvlib.bench.kv4 import random_kv4_batch
    from kvlib.core.merge import merge_states
    from kvlib.kernels.int4.attention import kv4_decode, kv4rl_decode

    cache = random_kv4_batch(lengths.to(q.device), int(lengths.max()), SINK, RECENT, hkv=shape.hkv, d=shape.d)
    qb = q.to(torch.bfloat16)
    if "kv4" in want:
        record("kv4", lambda: kv4_decode(qb, cache))
    if "kv4rl" in want:
        record("kv4rl", lambda: kv4rl_decode(qb, cache, merge=merge_states))


# ------------------------------------------------------------------------------------------------
def derived(row: dict[str, Any]) -> dict[str, float]:
    """Ratios of one state: speedups vs SDPA bf16, certificate cost, KV4-RL/KV4, Philox share."""
    m = {k: v["median_ms"] for k, v in row["methods"].items()}
    out: dict[str, float] = {}
    if "sdpa_bf16" in m:
        for k, v in m.items():
            out[f"speedup_{k}"] = m["sdpa_bf16"] / v
    if "int8_cert" in m and "int8_nocert" in m:
        out["cert_cost"] = m["int8_cert"] / m["int8_nocert"] - 1.0
    if "kv4" in m and "kv4rl" in m:
        out["kv4rl_frac_of_kv4"] = m["kv4"] / m["kv4rl"]
    if "int8_nophilox" in m and "int8_cert" in m:
        out["philox_share_skip"] = 1.0 - m["int8_nophilox"] / m["int8_cert"]
    if "int8_h10_cert" in m and "int8_h10_nocert" in m:
        out["h10_cert_cost"] = m["int8_h10_cert"] / m["int8_h10_nocert"] - 1.0
    if "int8_h10_certAB" in m and "int8_h10_nocert" in m:
        out["h10_cert_cost_AB"] = m["int8_h10_certAB"] / m["int8_h10_nocert"] - 1.0
    if "int8_h10_nophilox" in m and "int8_h10_cert" in m:
        out["h10_philox_share_skip"] = 1.0 - m["int8_h10_nophilox"] / m["int8_h10_cert"]
    if "int8_h10_certAB" in m and "int8_cert" in m:
        out["h10_vs_w24_certAB"] = m["int8_cert"] / m["int8_h10_certAB"]
    if "int8_h8_cert" in m and "int8_h8_nocert" in m:
        out["h8_cert_cost"] = m["int8_h8_cert"] / m["int8_h8_nocert"] - 1.0
    if "int8_h8_cert" in m and "int8_h10_cert" in m:
        out["h8_over_h10"] = m["int8_h10_cert"] / m["int8_h8_cert"]
    if "int8_h8g_cert" in m and "int8_h8g_nocert" in m:
        out["h8g_cert_cost"] = m["int8_h8g_cert"] / m["int8_h8g_nocert"] - 1.0
    if "int8_h8g_cert" in m and "int8_h8_cert" in m:
        out["h8g_over_h8"] = m["int8_h8_cert"] / m["int8_h8g_cert"]
    return out


def grid_config(profile: str) -> dict[str, Any]:
    """Shapes and timing budget of each profile."""
    if profile == "gpu":
        return dict(shape=GPU_SHAPE, batches=(1, 8, 32, 128, 512), ctxs=(1024, 4096, 16384, 32768),
                    budget_bytes=30e9, rep_ms=40.0, warmup_ms=10.0, time_budget_s=400.0)
    return dict(shape=CPU_SHAPE, batches=(1, 2), ctxs=(40, 96), budget_bytes=1e8, rep_ms=1.0, warmup_ms=0.0,
                time_budget_s=600.0)


def run(profile: str, *, methods: Sequence[str] = ALL_METHODS, batches: Sequence[int] | None = None,
        ctxs: Sequence[int] | None = None) -> dict[str, Any]:
    """The grid. ``profile`` ``gpu`` measures on CUDA; ``ci``/``cpu`` run the wiring at tiny shapes."""
    device = profile_device(profile)
    cuda = device == "cuda"
    cfg = grid_config(profile if cuda else "ci")
    batches = tuple(batches or cfg["batches"])
    ctxs = tuple(ctxs or cfg["ctxs"])
    shape: HeadShape = cfg["shape"]
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "note": "" if cuda else ("CPU wiring check, no speed claim ("
                                 + ("Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1"
                                    else "torch reference fallbacks") + ")"),
        "shape": vars(shape) | {"sink": SINK, "recent": RECENT, "int8_group": INT8_GROUP},
        "int8_modes": INT8_MODES, "int8_skip_philox_switch": skip_philox_kw(),
        "budget_bytes": cfg["budget_bytes"], "rep_ms": cfg["rep_ms"],
        "copy": copy_bandwidth(device=device, **({} if cuda else {"n_bytes": 1 << 22})),
        "rows": [], "skipped": [],
    }
    for b in batches:
        for s in ctxs:
            lengths = torch.full((b,), s, dtype=torch.int32)
            peak = max(call_bytes("sdpa_bf16", lengths, shape), call_bytes("kv4", lengths, shape) * 1.2)
            if peak > cfg["budget_bytes"]:
                res["skipped"].append({"batch": b, "ctx": s, "bytes": peak, "why": "memory budget"})
                continue
            if time.perf_counter() - t0 > cfg["time_budget_s"]:  # a guard; a normal GPU run ends well before
                res["skipped"].append({"batch": b, "ctx": s, "bytes": peak, "why": "time budget"})
                continue
            row = time_state(lengths, methods=methods, shape=shape, device=device, rep_ms=cfg["rep_ms"],
                             warmup_ms=cfg["warmup_ms"])
            row["ctx"] = s
            row["ratios"] = derived(row)
            res["rows"].append(row)
            print(f"   grid B={b} S={s}: " + ", ".join(f"{k}={v['median_ms']:.4f}"
                                                       for k, v in row["methods"].items()), flush=True)
    res["summary"] = summarize(res)
    res["runtime_s"] = time.perf_counter() - t0
    return res


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """The goals as ratios from this run (min over the long-context shapes, medians alongside)."""
    import statistics

    rows = res["rows"]
    long = [r for r in rows if r["ctx"] >= 16384]
    big = [r for r in long if r["batch"] >= 8]

    def stat(rs, key, f=min):
        vals = [r["ratios"][key] for r in rs if key in r["ratios"]]
        return f(vals) if vals else None

    copy = res["copy"]["bandwidth_GBps"]
    frac = {}
    for r in rows:
        for k, v in r["methods"].items():
            frac[k] = max(frac.get(k, 0.0), v["GBps"] / copy)
    return {
        "int8_cert_speedup_S16k_min": stat(long, "speedup_int8_cert"),
        "int8_cert_speedup_S16k_B8_min": stat(big, "speedup_int8_cert"),
        "int8_cert_speedup_S16k_median": stat(long, "speedup_int8_cert", statistics.median),
        "kv4_speedup_S16k_min": stat(long, "speedup_kv4"),
        "kv4_speedup_S16k_B8_min": stat(big, "speedup_kv4"),
        "kv4_speedup_S16k_median": stat(long, "speedup_kv4", statistics.median),
        "kv4rl_frac_min": stat(rows, "kv4rl_frac_of_kv4"),
        "kv4rl_frac_median": stat(rows, "kv4rl_frac_of_kv4", statistics.median),
        "cert_cost_max": stat(rows, "cert_cost", max),
        "cert_cost_median": stat(rows, "cert_cost", statistics.median),
        "philox_share_skip_median": stat(rows, "philox_share_skip", statistics.median),
        "max_frac_of_copy": frac,
        "goals": {"int8_cert_speedup": 1.5, "kv4_speedup": 3.0, "kv4rl_frac": 0.97, "cert_cost": 0.03},
    }
