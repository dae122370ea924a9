"""What does KV4's query preparation (Hadamard rotation + INT8 quantisation, its own launch before the decode kernel)
cost? Timed on the GPU from CUDA graphs at the kv4 benchmark's shapes: the whole decode, the decode kernel alone
(query prepared outside the graph), the preparation alone with the fp32 (``ieee``) rotation dot and with bf16 pieces
on tensor cores (``mma``), and how often they give different INT8 codes from the float reference."""

from __future__ import annotations

import datetime
import sys

import torch

from dev.probe_kit import write_probe
from kvlib.bench.kv4 import HQ, D, graphed_ms, random_kv4_batch
from kvlib.kernels.int4.attention import kv4_decode
from kvlib.kernels.int4.decode import prepare_query, prepare_query_ref

SHAPES = ((32, 1024), (32, 4096), (32, 16384), (128, 4096), (128, 16384), (512, 4096))


def _row(b: int, n: int) -> dict:
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    cache = random_kv4_batch(lengths, n)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    qp = prepare_query(q)
    ref, a, m = prepare_query_ref(q), prepare_query(q, precision="ieee"), prepare_query(q, precision="mma")
    return dict(
        batch=b, ctx=n,
        kv4_ms=graphed_ms(lambda: kv4_decode(q, cache))[0],
        kernel_only_ms=graphed_ms(lambda: kv4_decode(q, cache, qp=qp))[0],
        prep_ieee_ms=graphed_ms(lambda: prepare_query(q, precision="ieee"))[0],
        prep_mma_ms=graphed_ms(lambda: prepare_query(q, precision="mma"))[0],
        kv4_ieee_ms=graphed_ms(lambda: kv4_decode(q, cache, qp=prepare_query(q, precision="ieee")))[0],
        code_mismatch_ieee=float((a.q8 != ref.q8).float().mean()),
        code_mismatch_mma=float((m.q8 != ref.q8).float().mean()),
        code_maxdiff_mma=int((m.q8.int() - ref.q8.int()).abs().max()),
        scale_max_rel_diff_mma=float(((m.scale - ref.scale).abs() / ref.scale.abs().clamp_min(1e-30)).max()),
    )


def main(argv: list[str] | None = None) -> int:
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for b, n in SHAPES:
        r = _row(b, n)
        rows.append(r)
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
              flush=True)
    args = sys.argv[1:] if argv is None else argv
    write_probe(args[0] if args else "kv4_query_prep_cost.json", "kv4_query_prep_cost", {"rows": rows}, started,
                {"shapes": SHAPES})
    return 0


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    raise SystemExit(main())
