"""Development probe of the h10 kernel's tile shape on the GPU (positions per step, warps, pipeline stages)
with the wide Philox multiply, timed from CUDA graphs beside SDPA bf16: fewer live registers per thread
(smaller tiles) against fewer loop trips."""

from __future__ import annotations

import datetime
import sys

import torch

from dev.h10_probe import h10_problem, write_probe
from dev.h10_probe2 import _sdpa_graph_ms, _time
from dev.int8_calls import decode as probe_decode
from kvlib.kernels.int8.config import DEFAULT_CONFIG

CONFIGS = ((64, 2, 2), (32, 1, 2), (32, 1, 3), (32, 1, 4), (32, 2, 2), (64, 2, 3), (64, 4, 2), (128, 4, 2),
           (128, 4, 3))


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for B, S in ((32, 16384), (8, 32768)):
        hq, hkv, d = 28, 4, 128
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv, d)
        sd = _sdpa_graph_ms(qb.view(B, hq, 1, d), hkv, S)
        for bn, nw, st in CONFIGS:
            for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False))):
                try:
                    ms = _time(probe_decode, (qb, kp, vp, slots, seq),
                               dict(block_n=bn, num_warps=nw, num_stages=st, **kw))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    ms = None
                    print(f"FAIL {bn} {nw} {st}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(B=B, S=S, wide_mul=DEFAULT_CONFIG.wide_mul, block_n=bn, num_warps=nw, num_stages=st,
                                 name=name,
                                 ms=ms, vs_sdpa=None if ms is None else sd / ms, sdpa_ms=sd))
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe3.json", "h10_probe3", rows, started,
                {"command": "python -m dev.h10_probe3", "configs": CONFIGS})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
