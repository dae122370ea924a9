"""Development probe on the GPU: the h10 kernel's opt-in loop variants (``decode_int8_h10.PREFETCH_META``: slots and
scales one tile ahead; ``PV_DIRECT``: PV with the probabilities as the A operand, position slices per warp) by
tile shape, timed from CUDA graphs beside SDPA bf16 at the paper's head shape, each checked against the default
kernel's output and certificate on the GPU (its fast bit-trick paths)."""

from __future__ import annotations

import datetime
import sys

import torch

import kvlib.kernels.decode_int8_h10 as H
from kvlib.bench._h10_probe import h10_problem, write_probe
from kvlib.bench._h10_probe2 import LAYER, SEED, _sdpa_graph_ms, _time

#: (num_warps, block_n, PREFETCH_META, PV_DIRECT)
COMBOS = tuple((nw, bn, pre, pvd) for nw, bn in ((2, 64), (4, 64)) for pre in (False, True) for pvd in (0, 1, 2)) + (
    (4, 128, False, 0), (4, 128, True, 2))


def _run(fn, combo):
    nw, bn, pre, pvd = combo
    H.PREFETCH_META, H.PV_DIRECT = pre, pvd
    try:
        return fn(dict(impl="h10", cert=True, cert_b=False, num_warps=nw, block_n=bn))
    finally:
        H.PREFETCH_META, H.PV_DIRECT = False, 0


def main() -> None:
    from kvlib.kernels.decode_int8 import decode_int8

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    qb, kp, vp, slots, seq = h10_problem(2, 4096)
    base = decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", cert=True, cert_b=False)
    for combo in COMBOS:
        try:
            out = _run(lambda kw: decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, **kw), combo)
            rows.append(dict(kind="agreement", combo=combo,
                             max_abs_do=float((out.o.float() - base.o.float()).abs().max()),
                             max_abs_dcert=float((out.tv_bound.nan_to_num(posinf=9.0)
                                                  - base.tv_bound.nan_to_num(posinf=9.0)).abs().max())))
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            rows.append(dict(kind="agreement", combo=combo, error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(rows[-1], flush=True)
    for B, S in ((8, 32768), (32, 16384)):
        qb, kp, vp, slots, seq = h10_problem(B, S)
        sd = _sdpa_graph_ms(qb.view(B, 28, 1, 128), 4, S)
        for combo in COMBOS:
            try:
                ms = _run(lambda kw, a=(qb, kp, vp, slots, seq): _time(decode_int8, a, kw), combo)
            except Exception as e:  # noqa: BLE001
                ms = None
                print(f"FAIL {combo}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(kind="timing", B=B, S=S, combo=combo, ms=ms, sdpa_ms=sd, vs_sdpa=ms and sd / ms))
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe5.json", "h10_probe5", rows, started,
                {"command": "python -m kvlib.bench._h10_probe5", "combos": COMBOS,
                 "combo_fields": ["num_warps", "block_n", "PREFETCH_META", "PV_DIRECT"]})


if __name__ == "__main__":
    main()
