"""Decode replay: batch/context states drawn from the rollout simulators, replayed for each KV format.

As KV4-RL Sec. 4.2 / App. (fixed-workload decode replay): states are held fixed across formats, so
the replay measures execution speedup at matched concurrency, not the admission gained by a
smaller cache (that is :mod:`kvlib.rollout.time_model`).

Two training phases, each a response-length law (our assumption, matching the concentration
chapter's sweep): lognormal, sigma 0.8, truncated at 16,384 tokens, prompt P = 256, with median
1,200 tokens ("early": mean ~1.6k, short responses) and 4,800 tokens ("late": mean ~5.5k, close to
the paper's 5.5k mean over the final 50 8B iterations).

* fixed states: the quota-based collector under the paper's 8B BF16 page pool
  (:func:`kvlib.rollout.partial.simulate_collection`) is split into ``n_states`` equal-step phases;
  each gives one state ``(B_j, l_j)`` = (mean active batch, mean context) replayed with uniform context;
* ragged states: ``B_j`` requests from the continuous-refill simulator
  (:func:`kvlib.rollout.sim.simulate_async`) at a steady-state step, each with its own context.

Aggregation: ``S_q = sum_j tau_bf16,j / sum_j tau_q,j`` over the states of a (phase, kind), as the
paper's ragged replay; for fixed states also ``n / sum_j (tau_q,j / tau_bf16,j)``, the speedup over
phases of equal baseline time (our reading of the paper's equal-baseline-time phases; its Eq. A2 is
not in the text we hold). The BF16 reference is torch SDPA (ragged: over length-sorted buckets,
padded within a bucket); ratios against our paged bf16 Triton kernel are reported beside it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlib.bench.decode_grid import CPU_SHAPE, GPU_SHAPE, HeadShape, time_state
from kvlib.bench.timing import copy_bandwidth, profile_device

REPLAY_METHODS = ("sdpa_bf16", "triton_bf16", "int8_cert", "int8_nocert", "int8_h10_cert", "kv4", "kv4rl")
REFERENCES = ("sdpa_bf16", "triton_bf16")


@dataclass(frozen=True)
class Phase:
    """A training phase: lognormal response-length law and the collector that sets concurrency."""

    name: str
    median: float
    sigma: float = 0.8
    max_len: int = 16_384
    P: int = 256
    T: int = 64
    G: int = 8
    updates: int = 5
    warmup: int = 2

    def law(self):
        from kvlib.rollout.laws import lognormal_law

        return lognormal_law(self.median, self.sigma, self.max_len)


GPU_PHASES = (Phase("early", 1200.0), Phase("late", 4800.0))
CI_PHASES = (Phase("early", 12.0, max_len=48, P=8, T=1, G=3, updates=3, warmup=1),
             Phase("late", 36.0, max_len=96, P=8, T=1, G=3, updates=3, warmup=1))


def aggregate_speedup(tau_ref: Sequence[float], tau_q: Sequence[float]) -> float:
    """``sum tau_ref / sum tau_q`` over states (weights each state by its reference duration)."""
    a, b = np.asarray(tau_ref, dtype=float), np.asarray(tau_q, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"tau_ref and tau_q must be equal-length non-empty 1-D, got {a.shape} and {b.shape}")
    if not (np.all(a > 0) and np.all(b > 0) and np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("times must be positive and finite")
    return float(a.sum() / b.sum())


def equal_time_speedup(tau_ref: Sequence[float], tau_q: Sequence[float]) -> float:
    """Speedup over phases of equal reference time: ``n / sum_j (tau_q,j / tau_ref,j)``."""
    a, b = np.asarray(tau_ref, dtype=float), np.asarray(tau_q, dtype=float)
    aggregate_speedup(a, b)  # same validation
    return float(a.size / (b / a).sum())


def fixed_states(phase: Phase, n_states: int, seed: int = 0, model: str = "8B") -> list[dict[str, Any]]:
    """``n_states`` (batch, uniform context) states of the BF16-pool collector, one per equal-step phase."""
    from kvlib.rollout.partial import simulate_collection

    res = simulate_collection(phase.law(), fmt="bf16", model=model, P=phase.P, T=phase.T, G=phase.G,
                              updates=phase.updates, warmup=phase.warmup, seed=seed)
    keep = res.trace["update"] >= phase.warmup
    b, c = res.trace["batch"][keep], res.trace["context_sum"][keep]
    out = []
    for j, (bb, cc) in enumerate(zip(np.array_split(b, n_states), np.array_split(c, n_states), strict=True)):
        out.append({"state": j, "batch": int(round(bb.mean())), "ctx": int(round(cc.sum() / bb.sum())),
                    "steps": int(bb.size)})
    return out


def ragged_lengths(phase: Phase, batch: int, seed: int = 0) -> np.ndarray:
    """Contexts of ``batch`` continuous-refill requests at a steady-state step (``P + age`` each)."""
    from kvlib.rollout.sim import simulate_async

    n_steps = 3 * (phase.max_len + phase.P)
    tr = simulate_async(phase.law(), batch, n_steps, P=phase.P, seed=seed)
    t = n_steps - 1
    active = (tr.starts <= t) & (t < tr.starts + tr.lengths)
    ctx = (tr.prompts[active] + (t - tr.starts[active])).astype(np.int64)
    if ctx.size != batch:
        raise RuntimeError(f"expected {batch} active requests at the last step, found {ctx.size}")
    return ctx


def states(phase: Phase, n_states: int, seed: int = 0) -> list[dict[str, Any]]:
    """Fixed and ragged states of one phase (each with its ``lengths`` vector)."""
    out = []
    for s in fixed_states(phase, n_states, seed):
        out.append({**s, "kind": "fixed", "lengths": [s["ctx"]] * s["batch"]})
        lens = ragged_lengths(phase, s["batch"], seed=seed + 1000 + s["state"])
        out.append({**s, "kind": "ragged", "ctx": int(round(lens.mean())), "lengths": lens.tolist()})
    return out


def aggregate(rows: list[dict[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """Speedups per (phase, kind, reference, method) from the timed states."""
    out = []
    keys = sorted({(r["phase"], r["kind"]) for r in rows})
    for phase, kind in keys:
        rs = [r for r in rows if r["phase"] == phase and r["kind"] == kind]
        for ref in REFERENCES:
            for m in methods:
                if m == ref:
                    continue
                ok = [r for r in rs if ref in r["timed"]["methods"] and m in r["timed"]["methods"]]
                if not ok:
                    continue
                ta = [r["timed"]["methods"][ref]["median_ms"] for r in ok]
                tq = [r["timed"]["methods"][m]["median_ms"] for r in ok]
                out.append({"phase": phase, "kind": kind, "reference": ref, "method": m, "n_states": len(ok),
                            "speedup_sum": aggregate_speedup(ta, tq), "speedup_equal_time": equal_time_speedup(ta, tq),
                            "ref_ms_sum": float(sum(ta)), "ms_sum": float(sum(tq))})
    return out


def run(profile: str, *, methods: Sequence[str] = REPLAY_METHODS, n_states: int | None = None,
        phases: Sequence[Phase] | None = None) -> dict[str, Any]:
    """The replay. ``gpu`` measures on CUDA; ``ci``/``cpu`` replay tiny laws as a wiring check."""
    device = profile_device(profile)
    cuda = device == "cuda"
    phases = tuple(phases or (GPU_PHASES if cuda else CI_PHASES))
    n_states = n_states or (5 if cuda else 1)
    shape: HeadShape = GPU_SHAPE if cuda else CPU_SHAPE
    rep_ms, warmup_ms = (40.0, 10.0) if cuda else (1.0, 0.0)
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "note": "" if cuda else "CPU wiring check at tiny laws, no speed claim",
        "shape": vars(shape), "methods": list(methods), "n_states": n_states,
        "phases": [vars(p) | {"law": f"lognormal(median={p.median}, sigma={p.sigma}, max_len={p.max_len})"}
                   for p in phases],
        "copy": copy_bandwidth(device=device, **({} if cuda else {"n_bytes": 1 << 22})),
        "rows": [],
    }
    time_budget_s = 110.0 if cuda else 600.0  # a guard; a normal GPU run ends well before
    res["skipped"] = []
    for i, ph in enumerate(phases):
        for st in states(ph, n_states, seed=17 * i):
            if time.perf_counter() - t0 > time_budget_s:
                res["skipped"].append({"phase": ph.name, "kind": st["kind"], "state": st["state"],
                                       "why": "time budget"})
                continue
            timed = time_state(st["lengths"], methods=methods, shape=shape, device=device, rep_ms=rep_ms,
                               warmup_ms=warmup_ms, seed=i)
            row = {k: v for k, v in st.items() if k != "lengths"}
            row.update(phase=ph.name, timed=timed)
            lens = np.asarray(st["lengths"])
            row["ctx_quantiles"] = np.quantile(lens, [0.0, 0.1, 0.5, 0.9, 1.0]).tolist()
            res["rows"].append(row)
            print(f"   replay {ph.name}/{st['kind']} #{st['state']} B={st['batch']} ctx={st['ctx']}: "
                  + ", ".join(f"{k}={v['median_ms']:.4f}" for k, v in timed["methods"].items()), flush=True)
    res["speedups"] = aggregate(res["rows"], methods)
    res["runtime_s"] = time.perf_counter() - t0
    return res
