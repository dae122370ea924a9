"""Development probe on the GPU: the h10 kernel's PV with fewer shared-memory round trips, by tile shape:
``pv_terms=1`` (one fp16 piece of ``p s`` per group) and ``decode_int8_h10.PV_DEQUANT`` (values rounded to fp16
once, one dot per tile), timed from CUDA graphs beside SDPA bf16 at the paper's head shape, each checked on the
GPU against the default (exact-operand) kernel; the certificate must not move."""

from __future__ import annotations

import datetime
import sys

import torch

import kvlib.kernels.decode_int8_h10 as H
from kvlib.bench._h10_probe import h10_problem, write_probe
from kvlib.bench._h10_probe2 import LAYER, SEED, _sdpa_graph_ms, _time

#: name -> (decode_int8 keywords, PV_DEQUANT)
VARIANTS = {
    "default": (dict(), False),
    "pv_terms1": (dict(pv_terms=1), False),
    "dequant": (dict(), True),
    "dequant_nocert": (dict(cert=False), True),
    "nocert": (dict(cert=False), False),
    "dequant_4w": (dict(num_warps=4), True),
    "dequant_4w_bn128": (dict(num_warps=4, block_n=128), True),
}


def _run(fn, name):
    kw, deq = VARIANTS[name]
    H.PV_DEQUANT = deq
    try:
        return fn(dict(impl="h10", cert=True, cert_b=False) | kw)
    finally:
        H.PV_DEQUANT = False


def main() -> None:
    from kvlib.kernels.decode_int8 import decode_int8

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    qb, kp, vp, slots, seq = h10_problem(2, 4096)
    base = decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", cert=True, cert_b=False)
    scale = float(base.o.float().abs().max())
    for name in VARIANTS:
        if "nocert" in name:
            continue
        try:
            out = _run(lambda kw: decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, **kw), name)
            rows.append(dict(kind="agreement", name=name, max_abs_o=scale,
                             max_abs_do=float((out.o.float() - base.o.float()).abs().max()),
                             mean_abs_do=float((out.o.float() - base.o.float()).abs().mean()),
                             max_abs_dcert=float((out.tv_bound.nan_to_num(posinf=9.0)
                                                  - base.tv_bound.nan_to_num(posinf=9.0)).abs().max())))
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            rows.append(dict(kind="agreement", name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(rows[-1], flush=True)
    for B, S in ((8, 32768), (32, 16384)):
        qb, kp, vp, slots, seq = h10_problem(B, S)
        sd = _sdpa_graph_ms(qb.view(B, 28, 1, 128), 4, S)
        for name in VARIANTS:
            try:
                ms = _run(lambda kw, a=(qb, kp, vp, slots, seq): _time(decode_int8, a, kw), name)
            except Exception as e:  # noqa: BLE001
                ms = None
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(kind="timing", B=B, S=S, name=name, ms=ms, sdpa_ms=sd, vs_sdpa=ms and sd / ms))
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe6.json", "h10_probe6", rows, started,
                {"command": "python -m kvlib.bench._h10_probe6",
                 "variants": {k: [v[0], v[1]] for k, v in VARIANTS.items()}})


if __name__ == "__main__":
    main()
