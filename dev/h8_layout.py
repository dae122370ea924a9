"""Is the h8 dither layout worth building? On the GPU, end to end (sixteen 8-bit dithers per Philox call, written by
the write path, read by the h10 kernel) against h10: agreement with the float64 reference at the paper's shape,
then CUDA-graph timings with and without the certificate (:mod:`dev.probe_kit` helpers)."""

from __future__ import annotations

from dev.probe_kit import run_probe

SHAPES = ((8, 32768), (32, 16384), (64, 32768), (2, 4096))
VARIANTS = {
    "h10_cert": ({}, dict(cert=True)),
    "h10_nocert": ({}, dict(cert=False)),
    "h8_cert": ({}, dict(cert=True, layout="h8")),
    "h8_nocert": ({}, dict(cert=False, layout="h8")),
    "h8_pvdeq_cert": ({"PV_DEQUANT": True}, dict(cert=True, layout="h8")),
}
COSTS = {"h10": ("h10_cert", "h10_nocert"), "h8": ("h8_cert", "h8_nocert")}


def main() -> None:
    run_probe("h8_layout", VARIANTS, SHAPES, costs=COSTS, agree=True)


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
