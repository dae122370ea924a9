"""Development probe on the GPU, after probe 7 (:mod:`kvlib.bench._h10_probe7`): the variance dot with exact tf32
pieces (now the default) against the four-FMA sum, the certificate's per-group query sums as one reduction
(``FUSE_Q``), and, at the paper's small shape, fewer split programs (the default plan gives every program one
64-position tile there, so each pays the certificate's prologue for one tile)."""

from __future__ import annotations

import datetime
import sys

from kvlib.bench._h10_probe import write_probe
from kvlib.bench._h10_probe7 import SHAPES, agreement, timing

SMALL = [(2, 4096)]
VARIANTS = {
    "cert": ({}, dict(cert=True)),
    "nocert": ({}, dict(cert=False)),
    "cert_fma_var": ({"VAR_DOT": False}, dict(cert=True)),
    "cert_fuse_q": ({"FUSE_Q": True}, dict(cert=True)),
    **{f"cert_ns{n}": ({}, dict(cert=True, num_splits=n, shapes=SMALL)) for n in (8, 16, 32)},
    **{f"nocert_ns{n}": ({}, dict(cert=False, num_splits=n, shapes=SMALL)) for n in (8, 16, 32)},
}
COSTS = {"default": ("cert", "nocert"), "fma_var": ("cert_fma_var", "nocert"), "fuse_q": ("cert_fuse_q", "nocert"),
         **{f"ns{n}": (f"cert_ns{n}", f"nocert_ns{n}") for n in (8, 16, 32)}}


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = agreement({k: v for k, v in VARIANTS.items() if "shapes" not in v[1]}) + timing(VARIANTS, COSTS, SHAPES)
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe8.json", "h10_probe8", rows, started,
                {"command": "python -m kvlib.bench._h10_probe8", "variants": VARIANTS, "shapes": SHAPES})


if __name__ == "__main__":
    main()
