"""Development probe on the GPU: the certificate's marginal cost in the h10 kernel with the exponentials in base 2
(one ``ex2.approx.ftz`` each) against ``tl.exp``, and with the variance as one tf32 dot (``VAR_DOT``).
Kernel-vs-reference agreement of each variant at the paper's shape, then CUDA-graph timings beside SDPA bf16,
interleaved over rounds (the median per variant is what counts: run-to-run spread is ~3%).

Run at 2b4d0a4, where ``decode_int8_h10.EXP2`` still switched the exponent base (the ``tl.exp`` path lost and was
removed, so the ``exp_*`` variants below no longer exist); :mod:`kvlib.bench._h10_probe8` reuses the helpers."""

from __future__ import annotations

import datetime
import statistics
import sys

import torch

from kvlib.bench._h10_probe import _problem, h10_problem, write_probe
from kvlib.bench._h10_probe2 import _sdpa_graph_ms, _time, h10_flags
from kvlib.bench.witcert_decode import LAYER, PAPER, SEED

#: name -> (module flags, decode_int8 keywords)
VARIANTS = {
    "exp_cert": ({"EXP2": False}, dict(cert=True)),
    "exp_nocert": ({"EXP2": False}, dict(cert=False)),
    "exp2_cert": ({"EXP2": True}, dict(cert=True)),
    "exp2_nocert": ({"EXP2": True}, dict(cert=False)),
    "exp2_vardot_cert": ({"EXP2": True, "VAR_DOT": True}, dict(cert=True)),
    "exp2_pvdeq_cert": ({"EXP2": True, "PV_DEQUANT": True}, dict(cert=True)),
    "exp2_pvdeq_nocert": ({"EXP2": True, "PV_DEQUANT": True}, dict(cert=False)),
}
#: certificate cost name -> (variant with it, variant without)
COSTS = {"exp": ("exp_cert", "exp_nocert"), "exp2": ("exp2_cert", "exp2_nocert"),
         "exp2_pvdeq": ("exp2_pvdeq_cert", "exp2_pvdeq_nocert"), "exp2_vardot": ("exp2_vardot_cert", "exp2_nocert")}
SHAPES = ((2, 4096), (8, 32768), (32, 16384))


def agreement(variants: dict) -> list[dict]:
    """max |kernel - float64 reference| of o, lse, A and the one-accumulator certificate per certified variant, at
    the paper's shape with bf16 queries and the default split plan (the binaries the timing runs). A variant's
    ``layout`` keyword (default ``"h10"``) picks the key pool's dither layout."""
    from kvlib.kernels.decode_int8 import decode_int8, decode_reference

    p = PAPER
    problems = {}
    rows = []
    for name, (flags, kw) in variants.items():
        if not kw.get("cert", True):
            continue
        layout = kw.get("layout", "h10")
        if layout not in problems:
            prob = _problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], layout, 8, torch.bfloat16)
            problems[layout] = prob, decode_reference(*prob, layer=LAYER, seed=SEED, impl="h10")
        (q, kp, vp, slots, seq), ref = problems[layout]
        kw = {k: v for k, v in kw.items() if k not in ("cert", "layout", "shapes")}
        with h10_flags(**flags):
            r = decode_int8(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", cert_b=False, **kw)
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


def timing(variants: dict, costs: dict, shapes=SHAPES, rounds: int = 3) -> list[dict]:
    """CUDA-graph medians of each variant over ``rounds`` rotated passes per shape, and each certificate cost
    ``costs[name] = (with, without)`` as the ratio of their medians minus one. A variant whose keywords carry
    ``shapes`` runs only at those; ``layout`` (default ``"h10"``) relabels the random key codes' dither layout
    (timing does not depend on the values)."""
    import dataclasses

    from kvlib.kernels.decode_int8 import decode_int8

    rows = []
    for B, S in shapes:
        names = [n for n, (_, kw) in variants.items() if (B, S) in kw.get("shapes", [(B, S)])]
        qb, kp, vp, slots, seq = h10_problem(B, S)
        sd = _sdpa_graph_ms(qb.view(B, 28, 1, 128), 4, S)
        ms = {n: [] for n in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # a rotated order each round
                flags, kw = variants[name]
                kpl = dataclasses.replace(kp, dither_layout=kw.get("layout", "h10"))
                kw = {k: v for k, v in kw.items() if k not in ("shapes", "layout")}
                with h10_flags(**flags):
                    ms[name].append(_time(decode_int8, (qb, kpl, vp, slots, seq), dict(impl="h10", cert_b=False) | kw))
        for name in names:
            med = statistics.median(ms[name])
            rows.append(dict(kind="timing", B=B, S=S, name=name, ms=med, rounds=ms[name], sdpa_ms=sd, vs_sdpa=sd / med))
            print(rows[-1], flush=True)
        for cname, (w, wo) in costs.items():
            if w in ms and wo in ms:
                rows.append(dict(kind="cert_cost", B=B, S=S, name=cname,
                                 cost=statistics.median(ms[w]) / statistics.median(ms[wo]) - 1))
                print(rows[-1], flush=True)
        del qb, kp, vp, slots, seq
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = agreement(VARIANTS) + timing(VARIANTS, COSTS)
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe7.json", "h10_probe7", rows, started,
                {"command": "python -m kvlib.bench._h10_probe7", "variants": VARIANTS, "shapes": SHAPES})


if __name__ == "__main__":
    main()
