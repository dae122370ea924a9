"""Development check on the GPU: KV4 kernel error against the float64 reference of the dequantised cache, by
split count, at long context (fewer splits mean longer fp32 accumulations in the PV dot; this check found
the error of the former ``1024 + c`` V codes, ``dev/results/kv4_split_accuracy.json``).

``PYTHONPATH=. python -m dev.kv4_split_accuracy OUT.json``
"""

from __future__ import annotations

import datetime
import sys

import torch

from dev.probe_kit import write_probe
from kvlib.bench.kv4 import HKV, HQ, D
from kvlib.kernels.int4.attention import build_kv4_batch
from kvlib.kernels.int4.decode import DEFAULT_CONFIG, kv4_main_decode, kv4_main_decode_ref, prepare_query


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, temp in ((16384, 1.0), (16384, 4.0), (32768, 1.0)):
        b = 2
        k = torch.randn(b, HKV, n, D, device="cuda", generator=g)
        v = torch.randn(b, HKV, n, D, device="cuda", generator=g) + 1.0  # a mean offset, as real values have
        q = torch.randn(b, HQ, D, device="cuda", generator=g) * temp  # temp 4: peaked attention
        c = build_kv4_batch(k, v, torch.full((b,), n, device="cuda"))
        qp = prepare_query(q)
        args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, *c.main_range())
        o_ref, lse_ref = kv4_main_decode_ref(*args)
        for s in (1, 2, 4, 8, 16):
            o, lse = kv4_main_decode(*args, config=DEFAULT_CONFIG.replace(num_splits=s))
            rows.append(dict(n=n, q_scale=temp, splits=s, max_err_o=float((o - o_ref).abs().max()),
                             mean_err_o=float((o - o_ref).abs().mean()), max_err_lse=float((lse - lse_ref).abs().max()),
                             o_abs_mean=float(o_ref.abs().mean())))
            print(rows[-1], flush=True)
    out = sys.argv[1] if len(sys.argv) > 1 else "kv4_split_accuracy.json"
    write_probe(out, "kv4_split_accuracy", rows, started, {"command": "python -m dev.kv4_split_accuracy",
                                                           "config": str(DEFAULT_CONFIG)})
    worst = max(r["max_err_o"] for r in rows if r["splits"] == 16)
    if worst > 5e-2:  # broken, not merely inaccurate: stop a chained GPU run before the benchmarks
        sys.exit(f"KV4 output error {worst:.2e} at 16 splits: the kernel is wrong")


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
