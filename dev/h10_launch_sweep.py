"""Does the h10 INT8 decode kernel agree with the float64 reference on the GPU, and which launch parameters are
best? (Agreement, then a launch-parameter sweep.)

``python -m dev.h10_launch_sweep [out.json]``: prints one line per measurement and writes JSON. Kept
beside the other diagnosis scripts: it is how the kernel's first GPU numbers were taken; the
book's numbers come from :mod:`kvlib.bench.witcert_decode`.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch

from dev.probe_kit import agreement_problem, random_pools, write_probe
from kvlib.bench.timing import bench_ms
from kvlib.bench.witcert_decode import LAYER, PAPER, SEED


def agreement() -> list[dict]:
    from kvlib.kernels.int8.decode import decode_int8, decode_reference

    rows = []
    p = PAPER
    for qdtype in (torch.float32, torch.bfloat16):
        for n_out in (8, 0):
            q, kp, vp, slots, seq = agreement_problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], "h10", n_out, qdtype)
            ref = decode_reference(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10")
            for ns in (1, 2, 8, 32):
                r = decode_int8(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, num_splits=ns, impl="h10")
                row = dict(q=str(qdtype), n_out=n_out, ns=ns,
                           do=float((r.o.double().cpu() - ref.o).abs().max()),
                           dlse=float((r.lse.double().cpu() - ref.lse).abs().max()),
                           dA=float((r.A.double().cpu() - ref.A).abs().max()),
                           dcert=float((r.tv_bound.double().cpu() - ref.tv_bound).abs().max()),
                           cert_max=float(ref.tv_bound.max()))
                rows.append(row)
                print("agree", row, flush=True)
    return rows


def _sdpa_ms(q4, B, S, hkv, d, rep_ms):
    k4 = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.bfloat16)
    v4 = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.bfloat16)
    f = torch.nn.functional.scaled_dot_product_attention
    return bench_ms(lambda: f(q4, k4, v4, enable_gqa=True), rep_ms=rep_ms).median_ms


def timing(B=32, S=16384, hq=28, hkv=4, d=128, rep_ms=40.0, cfgs=None) -> list[dict]:
    from dev.int8_calls import decode as decode_int8  # tuning keywords -> Int8KernelConfig

    rows = []
    slots = torch.arange(B * S, dtype=torch.int32, device="cuda").view(B, S)
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    q = torch.randn(B, hq, d, device="cuda")
    qb = q.to(torch.bfloat16)
    sd = _sdpa_ms(qb.view(B, hq, 1, d), B, S, hkv, d, rep_ms)
    rows.append(dict(B=B, S=S, name="sdpa_bf16", ms=sd))
    print("time", rows[-1], flush=True)
    kp24, vp = random_pools(B, S, hkv, d, "w24")
    t = bench_ms(lambda: decode_int8(qb, kp24, vp, slots, seq, layer=LAYER, seed=SEED, cert=True, cert_b=False,
                                     impl="tc", xi_split=False, pv_terms=2), rep_ms=rep_ms).median_ms
    rows.append(dict(B=B, S=S, name="tc_w24_certA_fast", ms=t, vs_sdpa=sd / t))
    print("time", rows[-1], flush=True)
    kp = type(kp24)(kp24.codes, kp24.scales, group=32, dither_layout="h10")
    def one(name, qq, cfg, **kw):
        c = dict(cfg)
        try:
            ms = bench_ms(lambda: decode_int8(qq, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", **kw, **c),
                          rep_ms=rep_ms).median_ms
        except Exception as e:  # noqa: BLE001 - a config may not fit
            ms = float("nan")
            print("fail", cfg, name, str(e)[:300], flush=True)
        rows.append(dict(B=B, S=S, name=name, ms=ms, vs_sdpa=sd / ms, **cfg))
        print("time", rows[-1], flush=True)
        return ms

    # (the recorded run also swept a SWAP module switch the kernel had stopped reading; dev/results/README.md)
    cfgs = cfgs or [dict(block_n=bn, num_warps=nw, num_stages=st)
                    for bn, nw in ((32, 1), (64, 1), (64, 2), (128, 2), (128, 4), (32, 2)) for st in (2, 3)]
    best = min(cfgs, key=lambda c: one("certA_bf16", qb, c, cert=True, cert_b=False))
    one("nocert_bf16", qb, best, cert=False)
    one("certAB_bf16", qb, best, cert=True, cert_b=True)
    one("certA_nophilox_bf16", qb, best, cert=True, cert_b=False, skip_philox=True)
    one("certA_fp32", q, best, cert=True, cert_b=False)
    rows.append(dict(best=best))
    return rows


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "h10_launch_sweep.json"
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "agreement": agreement()}
    res["timing"] = timing()
    best = [r["best"] for r in res["timing"] if "best" in r]
    res["timing_paper"] = timing(B=2, S=4096, rep_ms=20.0, cfgs=best)
    res["timing_64_32k"] = timing(B=64, S=32768, rep_ms=40.0, cfgs=best)
    res["seconds"] = time.time() - t0
    write_probe(out, "h10_launch_sweep", res, started, {"command": "python -m dev.h10_launch_sweep"})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
