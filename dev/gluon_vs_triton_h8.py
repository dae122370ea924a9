"""Does the Gluon h8 kernel agree with the reference and beat the Triton one? On the GPU: the Gluon h8 decode kernel
(:mod:`kvlib.kernels.int8.gluon`) against the float64 reference and the Triton h8 kernel (agreement), then timed
beside the Triton h8 kernel and SDPA bf16 under CUDA graphs, three interleaved rounds
(``python -m dev.gluon_vs_triton_h8 [out.json]``)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import sys

import torch

from dev.int8_calls import as_call
from dev.probe_kit import agreement_problem, h10_problem, sdpa_graph_ms, write_probe
from kvlib.bench.timing import bench_graphed, interleaved
from kvlib.bench.witcert_decode import LAYER, SEED

SHAPES = ((8, 32768, 28, 4), (32, 16384, 28, 4), (32, 16384, 32, 8), (64, 32768, 28, 4), (16, 16384, 28, 4),
          (2, 4096, 28, 4))
#: split plans timed, in waves of one-warp programs
WAVES = (0.5, 1.0)
#: (label, config flags (dev.int8_calls.FLAG_FIELDS), one-warp programs resident per SM) timed (the probe files of
#: this folder's README name their own commit's configurations)
CONFIGS = (("ahead", {"AHEAD": True}, 8), ("same_tile", {"AHEAD": False}, 8))


def _graph_ms(fn, flags: dict | None = None) -> float:
    """Median ms of ``fn(config=...)`` replayed from a CUDA graph, the config carrying ``flags``."""
    call = as_call({}, flags)
    return bench_graphed(lambda: fn(**call), warmup_ms=5.0, rep_ms=30.0)["median_ms"]


def agreement(quick: bool = False) -> list[dict]:
    from kvlib.kernels.int8.decode import decode_int8, decode_reference

    rows = []
    for B, S, hq, hkv in ((2, 4096, 28, 4), (3, 1000, 32, 8))[:1 if quick else 2]:
        q, kp, vp, slots, seq = agreement_problem(B, S, hq, hkv, 128, "h8", 0, torch.bfloat16)
        ref = decode_reference(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10")
        tri = decode_int8(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", cert_b=True,
                          **as_call({}, {"VAR_DOT": False}))
        for ns in (1, 7, 64, 200)[:2 if quick else 4]:
            for cert_b in (False, True):
                r = decode_int8(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="gluon", num_splits=ns,
                                cert_b=cert_b)
                cert = r.tv_bound.double().cpu()
                refc = ref.tv_bound if cert_b else ref.tv_bound_one
                row = dict(kind="agreement", B=B, S=S, hq=hq, hkv=hkv, ns=ns, cert_b=cert_b,
                           do=float((r.o.double().cpu() - ref.o).abs().max()),
                           dlse=float((r.lse.double().cpu() - ref.lse).abs().max()),
                           dA=float((r.A.double().cpu() - ref.A).abs().max()),
                           dcert=float((cert - refc).abs().max()), cert_low=float((refc - cert).max()),
                           cert_max=float(refc.max()),
                           do_triton=float((r.o - tri.o).abs().max()), dA_triton=float((r.A - tri.A).abs().max()))
                if cert_b:
                    row["dB"] = float((r.B.double().cpu() - ref.B).abs().max())
                rows.append(row)
                print(row, flush=True)
    return rows


def _same_bits(fn, B: int, S: int, hq: int, hkv: int) -> dict:
    """Whether every configuration of :data:`CONFIGS` gives the first one's outputs bit for bit (o, lse, A, B)."""
    outs = {}
    for label, flags, _ in CONFIGS:
        r = fn(**as_call({}, flags))
        outs[label] = [r.o, r.lse, r.A, r.B]
    base = outs[CONFIGS[0][0]]
    same = {f"{label}_identical": all(torch.equal(x, y) for x, y in zip(base, o, strict=True))
            for label, o in outs.items()}
    return dict(kind="bits", B=B, S=S, hq=hq, hkv=hkv, **same)


def timings(rounds: int = 3) -> list[dict]:
    from kvlib.kernels.int8.decode import decode_int8

    rows = []
    for B, S, hq, hkv in SHAPES:
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv)
        kp = dataclasses.replace(kp, dither_layout="h8")
        sd = sdpa_graph_ms(qb.view(B, hq, 1, 128), hkv, S)
        args = (qb, kp, vp, slots, seq)
        tri = functools.partial(decode_int8, *args, layer=LAYER, seed=SEED, impl="h10")
        glu = functools.partial(decode_int8, *args, layer=LAYER, seed=SEED, impl="gluon")
        var = {"triton_h8_cert": (functools.partial(tri, cert=True, cert_b=False), {})}
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for label, flags, per_sm in CONFIGS:
            for waves in WAVES:
                ns = max(1, min(round(waves * sms * per_sm / (B * hkv)), S // 16))
                var[f"gluon_cert_{label}_ns{ns}"] = (functools.partial(glu, num_splits=ns, cert_b=False), flags)
        for label, flags, per_sm in CONFIGS:
            ns = max(1, round(sms * per_sm / (B * hkv)))
            var[f"gluon_nocert_{label}_ns{ns}"] = (functools.partial(glu, num_splits=ns, cert=False), flags)
        label, flags, per_sm = CONFIGS[0]
        ns = max(1, round(sms * per_sm / (B * hkv)))
        var[f"gluon_certAB_{label}_ns{ns}"] = (functools.partial(glu, num_splits=ns, cert_b=True), flags)
        rows.append(_same_bits(functools.partial(glu, num_splits=ns, cert_b=True), B, S, hq, hkv))
        print(rows[-1], flush=True)
        ms = interleaved({n: functools.partial(_graph_ms, fn, fl) for n, (fn, fl) in var.items()}, rounds)
        for name, (med, per_round) in ms.items():
            rows.append(dict(kind="timing", B=B, S=S, hq=hq, hkv=hkv, name=name, ms=med, sdpa_ms=sd,
                             vs_sdpa=med and sd / med, rounds=per_round))
            print(rows[-1], flush=True)
        del qb, kp, vp, slots, seq, args, tri, glu, var
        torch.cuda.empty_cache()
    return rows


def eager(shapes=((2, 4096), (8, 32768))) -> list[dict]:
    """Host cost of a launch: per shape and kernel (Gluon, Triton h10 on the same h8 codes), the eager median, the
    CUDA-graph median and the host time per call of a tight loop of eager calls (``kind="eager"``)."""
    import time

    from kvlib.bench.timing import bench_ms
    from kvlib.kernels.int8.decode import decode_int8

    rows = []
    for B, S in shapes:
        qb, kp, vp, slots, seq = h10_problem(B, S, 28, 4)
        kp = dataclasses.replace(kp, dither_layout="h8")
        for impl in ("gluon", "h10"):
            fn = functools.partial(decode_int8, qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl=impl, cert=True,
                                   cert_b=False)
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host_ms = (time.perf_counter() - t0) / 200 * 1e3
            torch.cuda.synchronize()
            rows.append(dict(kind="eager", B=B, S=S, impl=impl, eager_ms=bench_ms(fn, rep_ms=50.0).median_ms,
                             graph_ms=_graph_ms(fn), host_ms_per_call=host_ms))
            print(rows[-1], flush=True)
        del qb, kp, vp, slots, seq
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    """``[out.json] [--eager]``: agreement and timings, or (``--eager``) only the host cost of a launch."""
    started = datetime.datetime.now(datetime.UTC)
    if "--eager" in sys.argv:
        sys.argv.remove("--eager")
        rows = eager()
    else:
        rows = agreement(quick=True)
        rows += timings()
    out = sys.argv[1] if len(sys.argv) > 1 else "gluon_vs_triton_h8.json"
    write_probe(out, "gluon_vs_triton_h8", rows, started,
                {"command": "python -m dev.gluon_vs_triton_h8", "shapes": SHAPES})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "[OUT.json] [--eager]")
    main()
