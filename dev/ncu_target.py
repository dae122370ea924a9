"""Development target for Nsight Compute on the GPU: a few launches of one decode kernel at one shape, nothing
else, so ``ncu -k <kernel> -s 2 -c 1`` profiles a warm launch.

``python -m dev.ncu_target {gluon,gluon_nocert,sdpa,h10} B S [hq hkv]``; the ncu command lines are in
``dev/results/README.md`` (the ncu rows)."""

from __future__ import annotations

import dataclasses
import sys

import torch

from dev.h10_probe import h10_problem
from kvlib.bench.witcert_decode import LAYER, SEED

KINDS = ("gluon", "gluon_nocert", "sdpa", "h10")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in KINDS:
        raise SystemExit(f"usage: python -m dev.ncu_target {{{','.join(KINDS)}}} B S [hq hkv]")
    kind, B, S = argv[0], int(argv[1]), int(argv[2])
    hq, hkv = (int(argv[3]), int(argv[4])) if len(argv) >= 5 else (28, 4)
    if kind == "sdpa":
        q = torch.randn(B, hq, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, hkv, S, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)

        def fn():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    else:
        from kvlib.kernels.int8.decode import decode_int8

        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv)
        kp = dataclasses.replace(kp, dither_layout="h8")
        impl = "h10" if kind == "h10" else "gluon"

        def fn():
            return decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl=impl,
                               cert=kind != "gluon_nocert", cert_b=False)
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "{gluon,gluon_nocert,sdpa,h10} B S [hq hkv]")
    main(sys.argv[1:])
