"""Which launch shape suits the h10 kernel over the h8 layout (its instruction mix differs
from h10's, whose defaults were tuned on h10: 64 positions, 2 warps, 2 stages), certified, under CUDA graphs."""

from __future__ import annotations

from dev.probe_kit import run_probe

SHAPES = ((8, 32768), (32, 16384))
CONFIGS = {"64x2s2": (64, 2, 2), "64x2s3": (64, 2, 3), "64x4s2": (64, 4, 2), "64x4s3": (64, 4, 3),
           "128x4s2": (128, 4, 2), "32x1s2": (32, 1, 2)}
VARIANTS = {f"h8_{k}": ({}, dict(cert=True, layout="h8", block_n=bn, num_warps=nw, num_stages=ns))
            for k, (bn, nw, ns) in CONFIGS.items()}
VARIANTS["h10_64x2s2"] = ({}, dict(cert=True))


def main() -> None:
    run_probe("h8_launch_shape", VARIANTS, SHAPES)


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
