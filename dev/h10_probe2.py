"""Development probe of the h10 kernel's switches on the GPU: per-tile vs per-position softmax/certificate sums
(``TILE_SUMS``), one wide multiply per Philox product (``WIDE_MUL``) and the variance by a tf32 dot
(``VAR_DOT``), timed from CUDA graphs beside SDPA bf16."""

from __future__ import annotations

import datetime
import functools
import sys

import torch

from dev.h10_probe import h10_problem, write_probe
from dev.int8_calls import as_call
from dev.int8_calls import decode as probe_decode
from kvlib.bench.timing import bench_graphed, interleaved
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


def _time_flagged(flags: dict, args: tuple, call: dict) -> float:
    """:func:`_time` of the decode step ``args`` with ``call``'s keywords and the variant's ``flags`` in its config
    (:func:`dev.int8_calls.as_call`; compile and capture included)."""
    return _time(probe_decode, args, as_call(call, flags))


def time_variants(variants: dict[str, tuple[dict, dict]], shapes=((8, 32768), (32, 16384)),
                  rounds: int = 1) -> list[dict]:
    """The h10 decode step for each variant ``name -> (config flags, decode_int8 keywords)`` beside SDPA bf16, at
    the paper's heads (28 query / 4 KV, d = 128) and each ``(B, S)``: CUDA-graph medians, one row per variant
    and shape (``kind="timing"``); a variant that fails is reported with ``ms=None``, not fatal.

    ``rounds > 1`` times every variant once per round in a rotated order and keeps the median (run-to-run spread
    is ~3%; interleaving keeps drift out of the comparison). Two keywords are the probe's, not decode_int8's:
    ``layout`` relabels the random key codes' dither layout (timing does not depend on the values) and
    ``shapes`` restricts a variant to those ``(B, S)``. A shape may name its heads, ``(B, S, hq, hkv)`` (default
    28 / 4, the paper's)."""
    import dataclasses

    rows = []
    for shape in shapes:
        B, S = shape[:2]
        hq, hkv = shape[2:4] if len(shape) > 2 else (28, 4)
        names = [n for n, (_, kw) in variants.items() if tuple(shape) in map(tuple, kw.get("shapes", [shape]))]
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv)
        sd = _sdpa_graph_ms(qb.view(B, hq, 1, 128), hkv, S)
        timers = {}
        for name in names:
            flags, kw = variants[name]
            kpl = dataclasses.replace(kp, dither_layout=kw.get("layout", kp.dither_layout))
            call = dict(impl="h10", cert=True, cert_b=False) | {k: v for k, v in kw.items()
                                                                if k not in ("layout", "shapes")}
            timers[name] = functools.partial(_time_flagged, flags, (qb, kpl, vp, slots, seq), call)
        ms = interleaved(timers, rounds)
        for name in names:
            med, per_round = ms[name]
            rows.append(dict(kind="timing", B=B, S=S, hq=hq, hkv=hkv, name=name, flags=variants[name][0],
                             kw=variants[name][1],
                             ms=med, sdpa_ms=sd, vs_sdpa=med and sd / med, **({"rounds": per_round} if rounds > 1
                                                                              else {})))
            print(rows[-1], flush=True)
        del qb, kp, vp, slots, seq
        torch.cuda.empty_cache()
    return rows


def cert_costs(rows: list[dict], costs: dict[str, tuple[str, str]]) -> list[dict]:
    """``kind="cert_cost"`` rows: per shape, ``costs[name] = (with, without)`` as the ratio of the two variants'
    medians minus one (where both were timed)."""
    t = {(r["B"], r["S"], r.get("hq", 28), r["name"]): r["ms"] for r in rows if r.get("kind") == "timing"}
    out = []
    for B, S, hq in dict.fromkeys(k[:3] for k in t):
        for name, (w, wo) in costs.items():
            if t.get((B, S, hq, w)) and t.get((B, S, hq, wo)):
                out.append(dict(kind="cert_cost", B=B, S=S, hq=hq, name=name,
                                cost=t[(B, S, hq, w)] / t[(B, S, hq, wo)] - 1))
                print(out[-1], flush=True)
    return out


def run_probe(name: str, variants: dict[str, tuple[dict, dict]], shapes, *, costs: dict | None = None,
              agree: bool = False, rounds: int = 3) -> None:
    """A timing probe's whole run: optional agreement rows, interleaved timings, certificate costs, written with
    the provenance envelope to ``argv[1]`` (default ``<name>.json``)."""
    started = datetime.datetime.now(datetime.UTC)
    timed = time_variants(variants, shapes, rounds=rounds)
    rows = (agreement(variants) if agree else []) + timed + cert_costs(timed, costs or {})
    write_probe(sys.argv[1] if len(sys.argv) > 1 else f"{name}.json", name, rows, started,
                {"command": f"python -m dev.{name}", "variants": variants, "shapes": shapes})


def agreement(variants: dict[str, tuple[dict, dict]]) -> list[dict]:
    """max |kernel - float64 reference| of o, lse, A and the one-accumulator certificate per certified variant, at
    the paper's shape with bf16 queries and the default split plan (the binaries the timing runs at that shape).
    A variant's ``layout`` keyword (default ``"h10"``) picks the key pool's dither layout."""
    from dev.h10_probe import _problem
    from kvlib.bench.witcert_decode import PAPER
    from kvlib.kernels.int8.decode import decode_int8, decode_reference

    p = PAPER
    problems: dict[str, tuple] = {}
    rows = []
    for name, (flags, kw) in variants.items():
        if not kw.get("cert", True) or "shapes" in kw:
            continue
        layout = kw.get("layout", "h10")
        if layout not in problems:
            prob = _problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], layout, 8, torch.bfloat16)
            problems[layout] = prob, decode_reference(*prob, layer=LAYER, seed=SEED, impl="h10")
        (q, kp, vp, slots, seq), ref = problems[layout]
        call = {k: v for k, v in kw.items() if k not in ("cert", "layout", "shapes")}
        r = decode_int8(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", cert_b=False,
                        **as_call(call, flags))
        cert = r.tv_bound.double().cpu()
        rows.append(dict(kind="agreement", name=name, layout=layout,
                         do=float((r.o.double().cpu() - ref.o).abs().max()),
                         dlse=float((r.lse.double().cpu() - ref.lse).abs().max()),
                         dA=float((r.A.double().cpu() - ref.A).abs().max()),
                         # one accumulator (cert_b=False): the reference's 1 - 1/A^2
                         dcert=float((cert - ref.tv_bound_one).abs().max()),
                         cert_low=float((ref.tv_bound_one - cert).max()),
                         cert_max=float(ref.tv_bound_one.max())))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for B, S in ((32, 16384), (8, 32768)):
        hq, hkv, d = 28, 4, 128
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv, d)
        sd = _sdpa_graph_ms(qb.view(B, hq, 1, d), hkv, S)
        for ts, wide, vd in ((True, False, False), (False, False, False), (True, True, False), (True, False, True),
                             (True, True, True)):
            sw = dict(tile_sums=ts, wide_mul=wide, var_dot=vd)
            for bn, nw in ((64, 2),):  # (128, 4) was slower at every shape of the earlier probes
                for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False)),
                                 ("certAB", dict(cert=True, cert_b=True))):
                    ms = _time(probe_decode, (qb, kp, vp, slots, seq), dict(block_n=bn, num_warps=nw, **sw, **kw))
                    rows.append(dict(B=B, S=S, tile_sums=ts, wide_mul=wide, var_dot=vd, block_n=bn, num_warps=nw,
                                     name=name, ms=ms, vs_sdpa=sd / ms))
                    print(rows[-1], flush=True)
        for cap in (168, 128):  # occupancy against spills, at the recorded run's switches
            sw = dict(tile_sums=True, wide_mul=False, var_dot=False, maxnreg=cap)
            for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False))):
                ms = _time(probe_decode, (qb, kp, vp, slots, seq), dict(block_n=64, num_warps=2, **sw, **kw))
                rows.append(dict(B=B, S=S, maxnreg=cap, block_n=64, num_warps=2, name=name, ms=ms, vs_sdpa=sd / ms))
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe2.json", "h10_probe2", rows, started,
                {"command": "python -m dev.h10_probe2"})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
