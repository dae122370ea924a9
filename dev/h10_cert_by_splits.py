"""Why does the h10 certificate cost more at 8+ splits? Stage 1 against the merge, per split count, on the GPU."""

from __future__ import annotations

import datetime
import sys

from dev.probe_kit import h10_problem, write_probe
from kvlib.bench.timing import bench_ms
from kvlib.bench.witcert_decode import LAYER, SEED


def main() -> None:
    from kvlib.kernels.int8.decode import decode_int8, decode_stage1
    from kvlib.kernels.tl.merge import merge_splits

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for B, S in ((16, 16384), (32, 16384)):
        hq, hkv, d = 28, 4, 128
        args = h10_problem(B, S, hq, hkv, d)
        for ns in (4, 8, 16):
            for name, kw in (("nocert", dict(cert=False)), ("certA", dict(cert=True, cert_b=False)),
                             ("certAB", dict(cert=True, cert_b=True))):
                kw = dict(layer=LAYER, seed=SEED, num_splits=ns, **kw)
                full = bench_ms(lambda kw=kw, args=args: decode_int8(*args, **kw), rep_ms=25.0).median_ms
                st1 = bench_ms(lambda kw=kw, args=args: decode_stage1(*args, **kw), rep_ms=25.0).median_ms
                parts = decode_stage1(*args, **kw)
                mg = bench_ms(lambda parts=parts: merge_splits(*parts), rep_ms=25.0).median_ms
                rows.append(dict(B=B, S=S, ns=ns, name=name, full=full, stage1=st1, merge=mg))
                print(rows[-1], flush=True)
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_cert_by_splits.json", "h10_cert_by_splits", rows, started,
                {"command": "python -m dev.h10_cert_by_splits"})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
