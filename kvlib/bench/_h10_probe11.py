"""Development probe on the GPU: launch shape of the h10 kernel over the h8 layout (its instruction mix differs
from h10's, whose defaults were tuned on h10: 64 positions, 2 warps, 2 stages), certified, under CUDA graphs."""

from __future__ import annotations

import datetime
import sys

from kvlib.bench._h10_probe import write_probe
from kvlib.bench._h10_probe2 import time_variants

SHAPES = ((8, 32768), (32, 16384))
CONFIGS = {"64x2s2": (64, 2, 2), "64x2s3": (64, 2, 3), "64x4s2": (64, 4, 2), "64x4s3": (64, 4, 3),
           "128x4s2": (128, 4, 2), "32x1s2": (32, 1, 2)}
VARIANTS = {f"h8_{k}": ({}, dict(cert=True, layout="h8", block_n=bn, num_warps=nw, num_stages=ns))
            for k, (bn, nw, ns) in CONFIGS.items()}
VARIANTS["h10_64x2s2"] = ({}, dict(cert=True))


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = time_variants(VARIANTS, SHAPES, rounds=3)
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe11.json", "h10_probe11", rows, started,
                {"command": "python -m kvlib.bench._h10_probe11", "variants": VARIANTS, "shapes": SHAPES})


if __name__ == "__main__":
    main()
