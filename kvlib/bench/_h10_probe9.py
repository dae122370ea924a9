"""Development probe on the GPU: the h10 kernel reading an "h8" dither layout (sixteen 8-bit dithers per Philox
call, half the Philox calls; ``decode_int8_h10.H8_PROBE``) against h10, timed before the layout is built. Timing
only: the pools are random codes, so the h8 variant's output is not checked here."""

from __future__ import annotations

import datetime
import sys

from kvlib.bench._h10_probe import write_probe
from kvlib.bench._h10_probe7 import timing

SHAPES = ((8, 32768), (32, 16384), (2, 4096))
VARIANTS = {
    "h10_cert": ({}, dict(cert=True)),
    "h10_nocert": ({}, dict(cert=False)),
    "h8_cert": ({"H8_PROBE": True}, dict(cert=True)),
    "h8_nocert": ({"H8_PROBE": True}, dict(cert=False)),
    "h8_pvdeq_cert": ({"H8_PROBE": True, "PV_DEQUANT": True}, dict(cert=True)),
    "h10_nophilox_cert": ({}, dict(cert=True, skip_philox=True)),
}
COSTS = {"h10": ("h10_cert", "h10_nocert"), "h8": ("h8_cert", "h8_nocert")}


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = timing(VARIANTS, COSTS, SHAPES)
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe9.json", "h10_probe9", rows, started,
                {"command": "python -m kvlib.bench._h10_probe9", "variants": VARIANTS, "shapes": SHAPES})


if __name__ == "__main__":
    main()
