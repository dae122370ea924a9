"""Development probe of the h10 kernel's switches on the GPU: per-tile vs per-position softmax/certificate sums
(``TILE_SUMS``), one wide multiply per Philox product (``WIDE_MUL``) and the variance by a tf32 dot
(``VAR_DOT``), timed from CUDA graphs beside SDPA bf16."""

from __future__ import annotations

import contextlib
import datetime
import sys

import torch

import kvlib.kernels.decode_int8_h10 as H
from kvlib.bench._h10_probe import h10_problem, write_probe
from kvlib.bench.timing import bench_graphed
from kvlib.bench.witcert_decode import LAYER, SEED


def _time(fn, args, kw) -> float:
    """Median ms of ``fn(*args, layer=, seed=, **kw)``, replayed from a CUDA graph."""
    # replayed from a CUDA graph: eager timings of sub-0.3 ms steps carry the host's launch overhead
    return bench_graphed(lambda: fn(*args, layer=LAYER, seed=SEED, **kw), warmup_ms=5.0, rep_ms=30.0)["median_ms"]


def _sdpa_graph_ms(q4, hkv: int, S: int) -> float:
    """torch SDPA bf16 over contiguous random K/V, replayed from a CUDA graph."""
    k4 = torch.randn(q4.shape[0], hkv, S, q4.shape[-1], device="cuda", dtype=torch.bfloat16)
    v4 = torch.randn_like(k4)
    f = torch.nn.functional.scaled_dot_product_attention
    return bench_graphed(lambda: f(q4, k4, v4, enable_gqa=True), warmup_ms=5.0, rep_ms=30.0)["median_ms"]


@contextlib.contextmanager
def h10_flags(**flags):
    """Set module flags of :mod:`kvlib.kernels.decode_int8_h10` (``ABLATE``, ``PV_DEQUANT``, ...) for a call."""
    saved = {k: getattr(H, k) for k in flags}
    for k, v in flags.items():
        setattr(H, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(H, k, v)


def time_variants(variants: dict[str, tuple[dict, dict]], shapes=((8, 32768), (32, 16384))) -> list[dict]:
    """The h10 decode step for each variant ``name -> (module flags, decode_int8 keywords)`` beside SDPA bf16, at
    the paper's heads (28 query / 4 KV, d = 128) and each ``(B, S)``: CUDA-graph medians, one row per variant
    and shape (``kind="timing"``); a variant that fails is reported with ``ms=None``, not fatal."""
    from kvlib.kernels.decode_int8 import decode_int8

    rows = []
    for B, S in shapes:
        qb, kp, vp, slots, seq = h10_problem(B, S)
        sd = _sdpa_graph_ms(qb.view(B, 28, 1, 128), 4, S)
        for name, (flags, kw) in variants.items():
            try:
                with h10_flags(**flags):
                    ms = _time(decode_int8, (qb, kp, vp, slots, seq), dict(impl="h10", cert=True, cert_b=False) | kw)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                ms = None
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(kind="timing", B=B, S=S, name=name, flags=flags, kw=kw, ms=ms, sdpa_ms=sd,
                             vs_sdpa=ms and sd / ms))
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from kvlib.kernels.decode_int8 import decode_int8

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for B, S in ((32, 16384), (8, 32768)):
        hq, hkv, d = 28, 4, 128
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv, d)
        sd = _sdpa_graph_ms(qb.view(B, hq, 1, d), hkv, S)
        for ts, wide, vd in ((True, False, False), (False, False, False), (True, True, False), (True, False, True),
                             (True, True, True)):
            H.TILE_SUMS, H.WIDE_MUL, H.VAR_DOT = ts, wide, vd
            for bn, nw in ((64, 2),):  # (128, 4) was slower at every shape of the earlier probes
                for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False)),
                                 ("certAB", dict(cert=True, cert_b=True))):
                    ms = _time(decode_int8, (qb, kp, vp, slots, seq), dict(block_n=bn, num_warps=nw, **kw))
                    rows.append(dict(B=B, S=S, tile_sums=ts, wide_mul=wide, var_dot=vd, block_n=bn, num_warps=nw,
                                     name=name, ms=ms, vs_sdpa=sd / ms))
                    print(rows[-1], flush=True)
        H.TILE_SUMS, H.WIDE_MUL, H.VAR_DOT = True, False, False
        for cap in (168, 128):  # occupancy against spills, at the default switches
            H.MAXNREG = cap
            for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False))):
                ms = _time(decode_int8, (qb, kp, vp, slots, seq), dict(block_n=64, num_warps=2, **kw))
                rows.append(dict(B=B, S=S, maxnreg=cap, block_n=64, num_warps=2, name=name, ms=ms, vs_sdpa=sd / ms))
                print(rows[-1], flush=True)
        H.MAXNREG = None
        torch.cuda.empty_cache()
    H.TILE_SUMS, H.WIDE_MUL, H.VAR_DOT = True, False, False
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe2.json", "h10_probe2", rows, started,
                {"command": "python -m kvlib.bench._h10_probe2"})


if __name__ == "__main__":
    main()
