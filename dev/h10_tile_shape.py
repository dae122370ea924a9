"""Which tile shape suits the h10 kernel on the GPU (positions per step, warps, pipeline stages)
with the wide Philox multiply, timed from CUDA graphs beside SDPA bf16: fewer live registers per thread
(smaller tiles) against fewer loop trips."""

from __future__ import annotations

import datetime
import sys

import torch

from dev.int8_calls import decode as probe_decode
from dev.probe_kit import graphed_ms, h10_problem, sdpa_graph_ms, write_probe
from kvlib.kernels.int8.config import DEFAULT_CONFIG

CONFIGS = ((64, 2, 2), (32, 1, 2), (32, 1, 3), (32, 1, 4), (32, 2, 2), (64, 2, 3), (64, 4, 2), (128, 4, 2),
           (128, 4, 3))


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for B, S in ((32, 16384), (8, 32768)):
        hq, hkv, d = 28, 4, 128
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv, d)
        sd = sdpa_graph_ms(qb.view(B, hq, 1, d), hkv, S)
        for bn, nw, st in CONFIGS:
            for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False))):
                try:
                    ms = graphed_ms(probe_decode, (qb, kp, vp, slots, seq),
                               dict(block_n=bn, num_warps=nw, num_stages=st, **kw))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    ms = None
                    print(f"FAIL {bn} {nw} {st}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(B=B, S=S, wide_mul=DEFAULT_CONFIG.wide_mul, block_n=bn, num_warps=nw, num_stages=st,
                                 name=name,
                                 ms=ms, vs_sdpa=None if ms is None else sd / ms, sdpa_ms=sd))
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_tile_shape.json", "h10_tile_shape", rows, started,
                {"command": "python -m dev.h10_tile_shape", "configs": CONFIGS})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
