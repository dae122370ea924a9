"""Development probe of the h10 INT8 decode kernel on the GPU (agreement + a launch-parameter sweep).

``python -m dev.h10_probe [out.json]``: prints one line per measurement and writes JSON. Kept
beside the other diagnosis scripts: it is how the kernel's first GPU numbers were taken; the
book's numbers come from :mod:`kvlib.bench.witcert_decode`.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch

from kvlib.bench.timing import bench_ms
from kvlib.bench.witcert_decode import LAYER, PAPER, SEED
from kvlib.publish.provenance import provenance, write_json_atomic


def _problem(B, S, hq, hkv, d, layout, n_out=8, qdtype=torch.float32):
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


def agreement() -> list[dict]:
    from kvlib.kernels.int8.decode import decode_int8, decode_reference

    rows = []
    p = PAPER
    for qdtype in (torch.float32, torch.bfloat16):
        for n_out in (8, 0):
            q, kp, vp, slots, seq = _problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], "h10", n_out, qdtype)
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


def _pools(B, S, hkv, d, layout):
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
    kp, vp = _pools(B, S, hkv, d, "h10")
    return qb, kp, vp, slots, seq


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
    kp24, vp = _pools(B, S, hkv, d, "w24")
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


def write_probe(path: str, name: str, results: object, started: datetime.datetime, params: dict) -> None:
    """The probe's output with the project's provenance envelope (commit, device, packages, params, time)."""
    write_json_atomic(Path(path), {"name": name, "profile": "gpu", "provenance": provenance(params, started),
                                   "results": results})


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "h10_probe.json"
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "agreement": agreement()}
    res["timing"] = timing()
    best = [r["best"] for r in res["timing"] if "best" in r]
    res["timing_paper"] = timing(B=2, S=4096, rep_ms=20.0, cfgs=best)
    res["timing_64_32k"] = timing(B=64, S=32768, rep_ms=40.0, cfgs=best)
    res["seconds"] = time.time() - t0
    write_probe(out, "h10_probe", res, started, {"command": "python -m dev.h10_probe"})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
