"""Which of the h10 kernel's switches pay on the GPU? per-tile vs per-position softmax/certificate sums
(``TILE_SUMS``), one wide multiply per Philox product (``WIDE_MUL``) and the variance by a tf32 dot
(``VAR_DOT``), timed from CUDA graphs beside SDPA bf16."""

from __future__ import annotations

import datetime
import sys

import torch

from dev.int8_calls import decode as probe_decode
from dev.probe_kit import graphed_ms, h10_problem, sdpa_graph_ms, write_probe


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for B, S in ((32, 16384), (8, 32768)):
        hq, hkv, d = 28, 4, 128
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv, d)
        sd = sdpa_graph_ms(qb.view(B, hq, 1, d), hkv, S)
        for ts, wide, vd in ((True, False, False), (False, False, False), (True, True, False), (True, False, True),
                             (True, True, True)):
            sw = dict(tile_sums=ts, wide_mul=wide, var_dot=vd)
            for bn, nw in ((64, 2),):  # (128, 4) was slower at every shape of the earlier probes
                for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False)),
                                 ("certAB", dict(cert=True, cert_b=True))):
                    ms = graphed_ms(probe_decode, (qb, kp, vp, slots, seq), dict(block_n=bn, num_warps=nw, **sw, **kw))
                    rows.append(dict(B=B, S=S, tile_sums=ts, wide_mul=wide, var_dot=vd, block_n=bn, num_warps=nw,
                                     name=name, ms=ms, vs_sdpa=sd / ms))
                    print(rows[-1], flush=True)
        for cap in (168, 128):  # occupancy against spills, at the recorded run's switches
            sw = dict(tile_sums=True, wide_mul=False, var_dot=False, maxnreg=cap)
            for name, kw in (("certA", dict(cert=True, cert_b=False)), ("nocert", dict(cert=False))):
                ms = graphed_ms(probe_decode, (qb, kp, vp, slots, seq), dict(block_n=64, num_warps=2, **sw, **kw))
                rows.append(dict(B=B, S=S, maxnreg=cap, block_n=64, num_warps=2, name=name, ms=ms, vs_sdpa=sd / ms))
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_switches.json", "h10_switches", rows, started,
                {"command": "python -m dev.h10_switches"})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
