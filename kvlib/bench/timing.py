"""The one timing loop: warm-up, L2 flush, median of repeats with spread, and copy bandwidth.

On CUDA it uses ``triton.testing.do_bench`` (CUDA events, L2 flushed between repeats). On the CPU
it times wall clock: a wiring check only, never a speed claim.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass
class Timing:
    median_ms: float
    q25_ms: float
    q75_ms: float
    n: int
    device: str

    def as_dict(self) -> dict:
        return asdict(self)


def bench_ms(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0, device: str | None = None) -> Timing:
    """Time ``fn()``; returns the median and inter-quartile range in milliseconds."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        from triton.testing import do_bench

        q25, med, q75 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.25, 0.5, 0.75])
        # do_bench does not report its repeat count; estimate it from the time budget.
        return Timing(float(med), float(q25), float(q75), max(1, int(rep_ms / max(med, 1e-3))), device)
    fn()  # warm-up (compilation, caches)
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    qs = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return Timing(statistics.median(times), qs[0], qs[2], len(times), device)


def copy_bandwidth(n_bytes: int = 1 << 30, dtype: torch.dtype = torch.bfloat16, device: str | None = None) -> dict:
    """Measured device-to-device copy bandwidth (read + write bytes per second), the roofline reference."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        n_bytes = min(n_bytes, 1 << 24)
    n = n_bytes // torch.tensor([], dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    t = bench_ms(lambda: dst.copy_(src), device=device)
    moved = 2 * n * src.element_size()
    return {"bytes_moved": moved, "timing": t.as_dict(), "bandwidth_GBps": moved / (t.median_ms * 1e-3) / 1e9}


def bandwidth_GBps(bytes_moved: float, ms: float) -> float:
    return bytes_moved / (ms * 1e-3) / 1e9
