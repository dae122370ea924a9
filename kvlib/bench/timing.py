"""The one timing loop: warm-up, L2 flush, median of repeats with spread, CUDA-graph capture, and
copy bandwidth.

On CUDA it uses ``triton.testing.do_bench`` (CUDA events, L2 flushed between repeats). On the CPU
it times wall clock: a wiring check only, never a speed claim. :func:`bench_graphed` times a call
replayed from a CUDA graph so launch overhead is paid equally by every method.
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


def bench_ms(
    fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0, device: str | None = None
) -> Timing:
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


def _warm_up(fn: Callable[[], object], iters: int) -> None:
    """Run ``fn`` ``iters`` times on a side stream (compiles and autotunes outside any capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(s)


def capture_graph(fn: Callable[[], object], *, warmup_iters: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn`` up, then capture one call in a CUDA graph; returns the graph and ``fn``'s static output.

    Replaying the graph rewrites that output in place. Capture errors propagate (see :func:`graphed`), after
    :func:`_abandon_capture` has undone what a failed capture leaves behind.
    """
    _warm_up(fn, warmup_iters)
    graph = torch.cuda.CUDAGraph()
    # our own pool handle, so that a failed capture's pool can be named and released (graph.pool() needs a capture
    # that ended)
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    except BaseException:
        _abandon_capture(pool, stream)
        raise
    return graph, out


def _abandon_capture(pool, stream: torch.cuda.Stream) -> None:
    """Undo what a failed capture leaves. When the capture was invalidated (an illegal call inside it), torch's
    ``capture_end`` raises at ``cudaStreamEndCapture`` before it ends the allocator's routing to the graph's pool
    and before ``torch.cuda.graph`` restores the stream. The allocator then believes a capture is still underway
    for the rest of the process: ``torch.cuda.empty_cache`` (and the retry after an out-of-memory) releases
    nothing, and every block freed later stays reserved. End that routing, release the pool (the graph never
    will: its capture did not end) and restore the caller's stream. When the capture ended (a Python exception
    raised inside it), the graph owns its pool and releases it when it is freed; nothing to do but the stream."""
    torch.cuda.set_stream(stream)
    dev = torch.cuda.current_device()
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:  # an older torch: nothing to call; the caller's memory log shows the effect
        return
    try:
        end(dev, pool)
    except RuntimeError:  # "not currently recording to mempool_id": capture_end ran, the graph owns the pool
        return
    release(dev, pool)


def allocator_state() -> dict:
    """Device memory as the driver and torch's caching allocator see it (CUDA only; empty dict otherwise):
    ``free`` (``mem_get_info``), ``reserved`` and ``allocated`` bytes; ``cached = reserved - allocated`` that
    ``empty_cache`` did not return is memory a leak or a stuck capture holds."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    res, alloc = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    return {"free": int(free), "total": int(total), "reserved": int(res), "allocated": int(alloc),
            "cached": int(res - alloc)}


def graphed(fn: Callable[[], object], *, warmup_iters: int = 2) -> tuple[Callable[[], object], bool]:
    """``fn`` as a CUDA-graph replay, and whether capture worked; eager ``fn`` without CUDA or if capture fails."""
    if not torch.cuda.is_available():
        return fn, False
    _warm_up(fn, warmup_iters)
    try:
        graph, _ = capture_graph(fn, warmup_iters=0)
        return graph.replay, True
    except Exception:  # noqa: BLE001 - fall back to eager timing, recorded by the caller
        torch.cuda.synchronize()  # capture_graph has released the failed capture's pool and restored the stream
        return fn, False


def bench_graphed(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> dict:
    """:func:`bench_ms` of ``fn`` replayed from a CUDA graph (eager if capture fails): the timing as a
    dict plus ``graphed`` (whether the graph was used)."""
    replay, ok = graphed(fn)
    t = bench_ms(replay, warmup_ms=warmup_ms, rep_ms=rep_ms).as_dict()
    t["graphed"] = ok
    return t


def profile_device(profile: str) -> str:
    """The device a benchmark runs on for ``profile`` (``ci``/``cpu``/``gpu``): ``cuda`` when present.

    Raises ``ValueError`` on an unknown profile and ``RuntimeError`` for ``gpu`` without CUDA.
    """
    if profile not in ("ci", "cpu", "gpu"):
        raise ValueError(f"profile must be ci, cpu or gpu, got {profile!r}")
    cuda = torch.cuda.is_available()
    if profile == "gpu" and not cuda:
        raise RuntimeError("profile 'gpu' needs CUDA; use --profile ci on CPU")
    return "cuda" if cuda else "cpu"


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
    """Bytes moved per call over the call's time in ms, as GB/s (1e9 bytes)."""
    return bytes_moved / (ms * 1e-3) / 1e9


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> Callable[[], float]:
    """A timer for :func:`interleaved`: one untimed replay, then ``reps`` replays between two CUDA events; returns
    milliseconds per replay."""
    def timer() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps
    return timer


def interleaved(timers: dict[str, Callable[[], float]], rounds: int, *,
                strict: bool = False) -> dict[str, tuple[float | None, list]]:
    """Each timer (returning ms) once per round, the order rotated every round, so the drift of clocks and memory
    state between runs falls on every method alike. Returns ``name -> (median over the rounds, per-round values)``.
    A timer that raises re-raises with ``strict`` (a result of record); otherwise (a probe) it is reported and
    counted as ``None``, and its median is over the rounds that ran (``None`` if none did)."""
    names = list(timers)
    ms: dict[str, list] = {n: [] for n in names}
    for r in range(rounds if names else 0):  # nothing to time (every method of a group failed to set up)
        for name in names[r % len(names):] + names[:r % len(names)]:
            try:
                ms[name].append(timers[name]())
            except Exception as e:  # noqa: BLE001 - a probe's failing variant is reported, not fatal
                if strict:
                    raise
                ms[name].append(None)
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return {n: (statistics.median([t for t in v if t is not None]) if any(t is not None for t in v) else None, v)
            for n, v in ms.items()}
