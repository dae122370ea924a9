"""The pieces the GPU probes share: the provenance writer, the INT8 decode problems, and the interleaved
CUDA-graph timing loop with its agreement and certificate-cost rows.

A timing probe of the INT8 kernels is mostly a table of variants, ``name -> (config flags, decode_int8 keywords)``,
handed to :func:`run_probe` (for example :mod:`dev.h8_layout`); the others take the problems and timers here.
"""

from __future__ import annotations

import datetime
import functools
import sys
from pathlib import Path

import torch

from dev.int8_calls import as_call
from dev.int8_calls import decode as probe_decode
from kvlib.bench.timing import bench_graphed, interleaved
from kvlib.bench.witcert_decode import LAYER, SEED
from kvlib.publish.provenance import provenance, write_json_atomic


def write_probe(path: str, name: str, results: object, started: datetime.datetime, params: dict) -> None:
    """The probe's output with the project's provenance envelope (commit, device, packages, params, time)."""
    write_json_atomic(Path(path), {"name": name, "profile": "gpu", "provenance": provenance(params, started),
                                   "results": results})


def agreement_problem(B, S, hq, hkv, d, layout, n_out=8, qdtype=torch.float32):
    """``(q, k_pool, v_pool, slots, seq_lens)`` on the GPU from seeded Gaussian K and V (four heavy channels,
    ``n_out`` key outlier channels, shuffled slots, one ragged row): the inputs of an agreement check against the
    float64 reference."""
    from kvlib.kernels.int8.decode import make_pool_side

    g = torch.Generator().manual_seed(0)
    K = torch.randn(B * S, hkv, d, generator=g)
    K[:, :, :4] *= 8.0
    V = torch.randn(B * S, hkv, d, generator=g)
    oc = torch.arange(n_out).expand(hkv, n_out).contiguous() if n_out else None
    perm = torch.randperm(B * S, generator=g)
    kp = make_pool_side(K.cuda(), layer=LAYER, seed=SEED, side=0, slot_ids=perm, outlier_channels=oc,
                        dither_layout=layout)
    vp = make_pool_side(V.cuda(), layer=LAYER, seed=SEED, side=1, slot_ids=perm, dithered=False)
    slots = perm.view(B, S).to(torch.int32).cuda()
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    seq[0] = S - 37  # a ragged row
    q = torch.randn(B, hq, d, generator=g).to(qdtype).cuda()
    return q, kp, vp, slots, seq


def random_pools(B, S, hkv, d, layout):
    """``(k_pool with dither layout `layout`, v_pool w24)`` of random int8 codes and scales (timing only)."""
    from kvlib.kernels.int8.decode import PoolSide

    n = B * S
    mk = lambda lay: PoolSide(  # noqa: E731
        torch.randint(-127, 128, (n, hkv, d), dtype=torch.int8, device="cuda"),
        (torch.rand(n, hkv, d // 32, device="cuda") * 0.02 + 0.005).half(), group=32, dither_layout=lay)
    return mk(layout), mk("w24")


def h10_problem(B: int, S: int, hq: int = 28, hkv: int = 4, d: int = 128) -> tuple:
    """``(q bf16, k_pool h10, v_pool, slots, seq_lens)`` of a full batch (random codes; timing does not depend
    on values): the decode arguments the timing probes share."""
    slots = torch.arange(B * S, dtype=torch.int32, device="cuda").view(B, S)
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    qb = torch.randn(B, hq, d, device="cuda").to(torch.bfloat16)
    kp, vp = random_pools(B, S, hkv, d, "h10")
    return qb, kp, vp, slots, seq


def graphed_ms(fn, args, kw) -> float:
    """Median ms of ``fn(*args, layer=, seed=, **kw)``, replayed from a CUDA graph."""
    # replayed from a CUDA graph: eager timings of sub-0.3 ms steps carry the host's launch overhead
    return bench_graphed(lambda: fn(*args, layer=LAYER, seed=SEED, **kw), warmup_ms=5.0, rep_ms=30.0)["median_ms"]


def sdpa_graph_ms(q4, hkv: int, S: int) -> float:
    """torch SDPA bf16 over contiguous random K/V, replayed from a CUDA graph."""
    k4 = torch.randn(q4.shape[0], hkv, S, q4.shape[-1], device="cuda", dtype=torch.bfloat16)
    v4 = torch.randn_like(k4)
    f = torch.nn.functional.scaled_dot_product_attention
    return bench_graphed(lambda: f(q4, k4, v4, enable_gqa=True), warmup_ms=5.0, rep_ms=30.0)["median_ms"]


def _graphed_flagged(flags: dict, args: tuple, call: dict) -> float:
    """:func:`graphed_ms` of the decode step ``args`` with ``call``'s keywords and the variant's ``flags`` in its config
    (:func:`dev.int8_calls.as_call`; compile and capture included)."""
    return graphed_ms(probe_decode, args, as_call(call, flags))


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
        sd = sdpa_graph_ms(qb.view(B, hq, 1, 128), hkv, S)
        timers = {}
        for name in names:
            flags, kw = variants[name]
            kpl = dataclasses.replace(kp, dither_layout=kw.get("layout", kp.dither_layout))
            call = dict(impl="h10", cert=True, cert_b=False) | {k: v for k, v in kw.items()
                                                                if k not in ("layout", "shapes")}
            timers[name] = functools.partial(_graphed_flagged, flags, (qb, kpl, vp, slots, seq), call)
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
            prob = agreement_problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], layout, 8, torch.bfloat16)
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
