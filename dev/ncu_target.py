"""Development target for Nsight Compute on the GPU: a few launches of one decode kernel at one shape, nothing
else, so ``ncu -k <kernel> -s 2 -c 1`` profiles a warm launch.

``python -m dev.ncu_target {gluon,gluon_nocert,sdpa,h10,wspec_cert,wspec_rtn,wspec4,kv4_paged} B S [hq hkv]``
(the last four over vLLM pages, as :mod:`kvlib.bench.wspec_decode` builds them: INT8 pages of 16, INT4 of
256); the ncu command lines are in
``dev/results/README.md`` (the ncu rows)."""

from __future__ import annotations

import dataclasses
import sys

import torch

from dev.probe_kit import h10_problem
from kvlib.bench.witcert_decode import LAYER, SEED

KINDS = ("gluon", "gluon_nocert", "sdpa", "h10", "wspec_cert", "wspec_rtn", "wspec4", "kv4_paged")


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
    elif kind in ("wspec_cert", "wspec_rtn"):
        from kvlib.bench.wspec_decode import INT8_PAGE, _int8_pools
        from kvlib.kernels.int8.decode import decode_int8

        g = torch.Generator(device="cuda").manual_seed(0)
        kp, vp, bt = _int8_pools(B, S, 0, kind == "wspec_cert", g, "cuda")
        qb = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
        seq = torch.full((B,), S, dtype=torch.int32, device="cuda")

        def fn():
            return decode_int8(qb, kp, vp, None, seq, layer=LAYER, seed=SEED, impl="wspec", block_table=bt,
                               block_size=INT8_PAGE, cert=kind == "wspec_cert")
    elif kind in ("wspec4", "kv4_paged"):
        from kvlib.bench.kv4 import RECENT, SINK, paged_kv4_pool, random_kv4_batch
        from kvlib.kernels.int4.decode import kv4_paged_decode, prepare_query

        lengths = torch.full((B,), S, dtype=torch.int32, device="cuda")
        cache = random_kv4_batch(lengths, S, SINK, RECENT, hkv=hkv, d=128)
        pool = paged_kv4_pool(cache, 256)
        pargs = tuple(pool[n] for n in ("k_codes", "k_scale", "k_off", "v_codes", "v_scale", "v_off", "block_table"))
        qb = torch.randn(B, hq, 128, device="cuda", dtype=torch.bfloat16)
        zeros = torch.zeros_like(lengths)

        def fn():
            return kv4_paged_decode(prepare_query(qb, pdl=True), *pargs, zeros, lengths, block_size=256,
                                    backend="wspec" if kind == "wspec4" else "triton")
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

    help_if_asked(__doc__, "{" + ",".join(KINDS) + "} B S [hq hkv]")
    main(sys.argv[1:])
