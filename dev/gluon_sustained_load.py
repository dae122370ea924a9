"""Does sustained load change the certified Gluon step's speed against SDPA bf16?
Both steps replayed from CUDA graphs in interleaved rounds (B=64, S=32k, 28/4 heads): cold, then after 60 s of
continuous replays of each, with the SM clock, temperature, power draw and active throttle reasons read from
``nvidia-smi`` after every timing (``python -m dev.gluon_sustained_load [out.json]``)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import subprocess
import sys
import time

import torch

from dev.probe_kit import write_probe
from kvlib.bench.timing import bench_ms, capture_graph, interleaved
from kvlib.bench.witcert_decode import LAYER, SEED, random_pools

SMI_FIELDS = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"


def smi() -> str:
    """One ``nvidia-smi`` reading of :data:`SMI_FIELDS` (csv)."""
    return subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def main(B: int = 64, S: int = 32768, hq: int = 28, hkv: int = 4, d: int = 128, load_s: float = 60.0) -> None:
    from kvlib.kernels.int8.decode import decode_int8

    started = datetime.datetime.now(datetime.UTC)
    kp, vp = random_pools(B, S, hkv, d, "cuda")
    kp = dataclasses.replace(kp, dither_layout="h8")
    slots = torch.arange(B * S, dtype=torch.int32, device="cuda").view(B, S)
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    qb = torch.randn(B, hq, d, device="cuda").to(torch.bfloat16)
    k4 = (kp.codes.float() * 0.01).to(torch.bfloat16).view(B, S, hkv, d).transpose(1, 2).contiguous()
    v4 = (vp.codes.float() * 0.01).to(torch.bfloat16).view(B, S, hkv, d).transpose(1, 2).contiguous()
    q4 = qb.view(B, hq, 1, d)
    fns = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True),
           "h8g_cert": lambda: decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="gluon", cert=True,
                                           cert_b=False)}
    graphs = {k: capture_graph(f, warmup_iters=2)[0] for k, f in fns.items()}
    rows: list[dict] = []

    def rounds(phase: str, n: int = 3) -> None:
        def timed(k: str) -> float:  # one row per timing, with the clocks and power right after it
            rows.append(dict(phase=phase, name=k, ms=bench_ms(graphs[k].replay, rep_ms=100.0).median_ms, smi=smi()))
            print(rows[-1], flush=True)
            return rows[-1]["ms"]

        interleaved({k: functools.partial(timed, k) for k in graphs}, n, strict=True)

    def load(k: str) -> None:
        t0 = time.time()
        while time.time() - t0 < load_s:
            for _ in range(200):
                graphs[k].replay()
            torch.cuda.synchronize()

    rounds("cold")
    load("h8g_cert")
    rounds("after 60 s of h8g")
    load("sdpa")
    rounds("after 60 s of sdpa")
    out = sys.argv[1] if len(sys.argv) > 1 else "gluon_sustained_load.json"
    write_probe(out, "gluon_sustained_load", rows, started,
                {"command": "python -m dev.gluon_sustained_load", "B": B, "S": S, "hq": hq, "hkv": hkv, "d": d,
                 "smi_fields": SMI_FIELDS, "load_s": load_s})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
