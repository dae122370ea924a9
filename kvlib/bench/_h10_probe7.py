"""Development probe on the GPU: the certificate's marginal cost in the h10 kernel with the exponentials in base 2
(one ``ex2.approx.ftz`` each, ``decode_int8_h10.EXP2``) against ``tl.exp``, and with the variance as one tf32 dot
(``VAR_DOT``). Kernel-vs-reference agreement of each variant at the paper's shape, then CUDA-graph timings
beside SDPA bf16, interleaved over rounds (the median per variant is what counts: run-to-run spread is ~3%)."""

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
SHAPES = ((2, 4096), (8, 32768), (32, 16384))


def agreement() -> list[dict]:
    from kvlib.kernels.decode_int8 import decode_int8, decode_reference

    p = PAPER
    # bf16 queries and the default split plan: the same binaries as the timing at the paper's shape
    q, kp, vp, slots, seq = _problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], "h10", 8, torch.bfloat16)
    ref = decode_reference(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10")
    rows = []
    for name, (flags, kw) in VARIANTS.items():
        if not kw["cert"]:
            continue
        for ns in (None,):
            with h10_flags(**flags):
                r = decode_int8(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, num_splits=ns, impl="h10", cert_b=False)
            rows.append(dict(kind="agreement", name=name, ns=ns,
                             do=float((r.o.double().cpu() - ref.o).abs().max()),
                             dlse=float((r.lse.double().cpu() - ref.lse).abs().max()),
                             dA=float((r.A.double().cpu() - ref.A).abs().max()),
                             # one accumulator (cert_b=False): the reference's 1 - 1/A^2
                             dcert=float((r.tv_bound.double().cpu() - ref.tv_bound_one).abs().max()),
                             cert_low=float((ref.tv_bound_one - r.tv_bound.double().cpu()).max()),
                             cert_max=float(ref.tv_bound_one.max())))
            print(rows[-1], flush=True)
    return rows


def timing(rounds: int = 3) -> list[dict]:
    from kvlib.kernels.decode_int8 import decode_int8

    rows = []
    names = list(VARIANTS)
    for B, S in SHAPES:
        qb, kp, vp, slots, seq = h10_problem(B, S)
        sd = _sdpa_graph_ms(qb.view(B, 28, 1, 128), 4, S)
        ms = {n: [] for n in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # a rotated order each round
                flags, kw = VARIANTS[name]
                with h10_flags(**flags):
                    ms[name].append(_time(decode_int8, (qb, kp, vp, slots, seq), dict(impl="h10", cert_b=False) | kw))
        for name in names:
            med = statistics.median(ms[name])
            rows.append(dict(kind="timing", B=B, S=S, name=name, ms=med, rounds=ms[name], sdpa_ms=sd, vs_sdpa=sd / med))
            print(rows[-1], flush=True)
        for base in ("exp", "exp2"):
            c, n = statistics.median(ms[f"{base}_cert"]), statistics.median(ms[f"{base}_nocert"])
            rows.append(dict(kind="cert_cost", B=B, S=S, name=base, cost=c / n - 1))
            print(rows[-1], flush=True)
        c, n = statistics.median(ms["exp2_pvdeq_cert"]), statistics.median(ms["exp2_pvdeq_nocert"])
        rows.append(dict(kind="cert_cost", B=B, S=S, name="exp2_pvdeq", cost=c / n - 1))
        print(rows[-1], flush=True)
        n = statistics.median(ms["exp2_nocert"])
        rows.append(dict(kind="cert_cost", B=B, S=S, name="exp2_vardot",
                         cost=statistics.median(ms["exp2_vardot_cert"]) / n - 1))
        print(rows[-1], flush=True)
        del qb, kp, vp, slots, seq
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = agreement() + timing()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe7.json", "h10_probe7", rows, started,
                {"command": "python -m kvlib.bench._h10_probe7", "variants": VARIANTS, "shapes": SHAPES})


if __name__ == "__main__":
    main()
