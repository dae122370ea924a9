"""KV concentration measured on the continuous engine's traces, beside the closed forms and the simulator.

:class:`kvlib.rl.continuous.ContinuousEngine` records one row per decode call (active batch, the context each
active response attended, pages in use, ...). For two schedules of the same policy on the same prompts (the
synchronous baseline and quota-based partial collection, :mod:`kvlib.rl.collect`) this module computes what
Prop. 4.1 talks about, over the measured intervals (after a warm-up, as App. B discards the first rounds):

* the mean active batch ``B_bar`` and resident volume ``V_bar = kappa * mean_t sum_i l_i(t)`` per decode call;
* the mean context per occupied slot-step ``sum_t sum_i l_i(t) / sum_t B_t`` (Eq. A10: the same for every schedule
  of one response set, scheduling moves work between calls, it does not change it) and the step-averaged mean
  context ``mean_t (sum_i l_i(t) / B_t)`` (Eqs. A4 and A9: the quantity that differs between schedules);
* ``C_KV = V_bar_async / V_bar_sync``, with a percentile bootstrap over collection intervals (each interval's
  decode calls resampled together, independently per schedule).

The decode work of a response in the engine: its first token comes from the prefill's logits, so a response of
``L`` tokens takes ``L - 1`` decode calls with contexts ``P + 1, ..., P + L - 1``. In the closed forms' terms
(``L`` decode steps at contexts ``P, ..., P + L - 1``) that is the length ``L' = L - 1`` at prompt ``P' = P + 1``:
:func:`decode_law` builds that law from the realised responses, :func:`closed_forms` evaluates Prop. 4.1 on it, and
:func:`simulate_like` runs :func:`kvlib.rollout.partial.simulate_collection` with the engine's pages, slots and
quota on it (responses with ``L' = 0`` take no decode call; the simulator draws from the law conditioned on
``L' >= 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlib.rollout.laws import LengthLaw
from kvlib.rollout.partial import CacheFormat, PagePool, simulate_collection
from kvlib.rollout.theory import concentration


def _frame(trace: Sequence[dict[str, Any]], warmup: int) -> dict[str, np.ndarray]:
    if not trace:
        raise ValueError("trace is empty: no decode call was recorded")
    keys = ("interval", "batch", "context_sum", "carried_context_sum", "pages_used", "seconds")
    cols = {k: np.array([row[k] for row in trace], dtype=np.float64) for k in keys}
    keep = cols["interval"] >= warmup
    if not keep.any():
        raise ValueError(f"no decode call after warmup={warmup} intervals")
    return {k: v[keep] for k, v in cols.items()}


def trace_summary(trace: Sequence[dict[str, Any]], *, warmup: int = 0, kappa: float = 1.0) -> dict[str, float]:
    """Averages over the decode calls of intervals ``>= warmup`` (unsmoothed, every call weighted equally)."""
    f = _frame(trace, warmup)
    n_int = len(np.unique(f["interval"]))
    return {
        "decode_calls": float(f["batch"].size),
        "intervals": float(n_int),
        "decode_calls_per_interval": float(f["batch"].size / n_int),
        "decode_tokens": float(f["batch"].sum()),
        "mean_batch": float(f["batch"].mean()),
        "mean_context": float(f["context_sum"].sum() / f["batch"].sum()),  # per occupied slot-step (Eq. A10)
        "mean_context_step": float((f["context_sum"] / f["batch"]).mean()),  # per decode call (Eqs. A4, A9)
        "mean_volume": float(kappa * f["context_sum"].mean()),
        "carried_fraction": float(f["carried_context_sum"].sum() / max(f["context_sum"].sum(), 1.0)),
        "mean_pages": float(f["pages_used"].mean()),
        "mean_step_seconds": float(f["seconds"].mean()),
    }


def concentration_ratio(async_trace: Sequence[dict[str, Any]], sync_trace: Sequence[dict[str, Any]], *,
                        warmup: int = 0, reps: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """``C_KV = V_bar_async / V_bar_sync`` and the batch ratio, with percentile CIs from resampling each schedule's
    measured intervals (whole intervals: decode calls within one are not independent)."""
    fa, fs = _frame(async_trace, warmup), _frame(sync_trace, warmup)

    def per_interval(f):
        ids = np.unique(f["interval"])
        return np.array([[f["context_sum"][f["interval"] == i].sum(), f["batch"][f["interval"] == i].sum(),
                          (f["interval"] == i).sum()] for i in ids])

    a, s = per_interval(fa), per_interval(fs)

    def ratios(xa, xs):
        va, vs = xa[..., 0].sum(-1) / xa[..., 2].sum(-1), xs[..., 0].sum(-1) / xs[..., 2].sum(-1)
        ba, bsync = xa[..., 1].sum(-1) / xa[..., 2].sum(-1), xs[..., 1].sum(-1) / xs[..., 2].sum(-1)
        return va / vs, ba / bsync

    c, b = ratios(a, s)
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a), size=(reps, len(a)))
    is_ = rng.integers(0, len(s), size=(reps, len(s)))
    cb, bb = ratios(a[ia], s[is_])
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    return {"c_kv": float(c), "c_kv_ci": tuple(float(x) for x in np.quantile(cb, q)), "batch_ratio": float(b),
            "batch_ratio_ci": tuple(float(x) for x in np.quantile(bb, q)), "intervals": (len(a), len(s)),
            "reps": reps, "level": level}


def decode_law(lengths: Sequence[int], name: str = "engine") -> LengthLaw:
    """The empirical law of decode calls per response, ``L - 1`` for responses of ``L`` tokens (module docstring)."""
    x = np.asarray(lengths, dtype=np.int64) - 1
    if x.size == 0 or (x < 0).any():
        raise ValueError("lengths must be a non-empty sequence of response lengths >= 1")
    vals, counts = np.unique(x, return_counts=True)
    return LengthLaw.from_arrays(vals, counts / counts.sum(), name=name)


def closed_forms(lengths: Sequence[int], prompt_lengths: Sequence[int], B: int) -> dict[str, float]:
    """Prop. 4.1 at ``B`` slots (sync waves of ``B``) for the realised decode law, ``P' = mean prompt + 1``
    (prompt and length independent: Eq. A10 then reduces to the mean prompt)."""
    law = decode_law(lengths)
    P = float(np.mean(prompt_lengths)) + 1.0
    c = concentration(law, B, P=P)
    return {"B": B, "P": P, "mu": c.mu, "sigma2": c.sigma2, "slot_mean_context": c.slot_mean_context,
            "async_mean_context": c.async_mean_context,
            "sync_mean_context": c.sync_mean_context, "sync_occupancy": c.sync_occupancy,
            "async_mean_batch": float(B), "c_kv": c.concentration_factor}


def simulate_like(lengths: Sequence[int], prompt_lengths: Sequence[int], *, pages: int, page_size: int,
                  slots: int, T: int, G: int, beta: float, eta: int, updates: int, warmup: int,
                  watermark: float = 0.01, seed: int = 0) -> dict[str, Any]:
    """:func:`kvlib.rollout.partial.simulate_collection` on the realised decode law (``L' >= 1``), with the engine's
    pages, slots and quota, both schedules; returns their summaries and ``C_KV``."""
    law = decode_law(lengths)
    keep = law.lengths >= 1
    cond = LengthLaw.from_arrays(law.lengths[keep], law.probs[keep] / law.probs[keep].sum(), name="engine L'>=1")
    pool = PagePool(CacheFormat("engine", 16.0), pages_bf16=pages, page_size=page_size, kappa_bf16=1.0,
                    max_requests=slots)
    P = int(round(float(np.mean(prompt_lengths)))) + 1
    out: dict[str, Any] = {"P": P, "law_mean": cond.mean, "dropped_zero_fraction": float(law.probs[~keep].sum())}
    for name, sync in (("async", False), ("sync", True)):
        res = simulate_collection(cond, pool=pool, P=P, T=T, G=G, beta=beta, eta=eta, updates=updates,
                                  warmup=warmup, synchronous=sync, seed=seed, watermark=watermark)
        s = res.summary()
        keep = res.trace["update"] >= warmup
        step_ctx = float((res.trace["context_sum"][keep] / res.trace["batch"][keep]).mean())
        out[name] = {"mean_batch": s["mean_batch"], "mean_context": s["mean_context"], "mean_context_step": step_ctx,
                     "mean_volume": s["mean_resident_positions"], "decode_calls_per_interval": s["steps_per_update"],
                     "carried_fraction": s["carried_fraction"]}
    out["c_kv"] = out["async"]["mean_volume"] / out["sync"]["mean_volume"]
    return out
