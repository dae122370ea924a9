"""Is the certificate's variance cheaper as one exact tf32 dot? On the GPU, after the base-2 exponential probe
(``h10_probe7.json``, run at 2b4d0a4 and removed since: its ``tl.exp`` variants no longer exist): the variance dot
with exact tf32 pieces (now the default) against the four-FMA sum and, at the paper's small shape, fewer split
programs (the default plan gives every program one 64-position tile there, so each pays the certificate's prologue
for one tile). The recorded run (172fac9) also timed the per-group query sums as one joined reduction (``FUSE_Q``),
which lost and was removed."""

from __future__ import annotations

from dev.probe_kit import run_probe

SHAPES = ((2, 4096), (8, 32768), (32, 16384))
SMALL = [(2, 4096)]
VARIANTS = {
    "cert": ({}, dict(cert=True)),
    "nocert": ({}, dict(cert=False)),
    "cert_fma_var": ({"VAR_DOT": False}, dict(cert=True)),
    **{f"cert_ns{n}": ({}, dict(cert=True, num_splits=n, shapes=SMALL)) for n in (8, 16, 32)},
    **{f"nocert_ns{n}": ({}, dict(cert=False, num_splits=n, shapes=SMALL)) for n in (8, 16, 32)},
}
COSTS = {"default": ("cert", "nocert"), "fma_var": ("cert_fma_var", "nocert"),
         **{f"ns{n}": (f"cert_ns{n}", f"nocert_ns{n}") for n in (8, 16, 32)}}


def main() -> None:
    run_probe("h10_variance_dot", VARIANTS, SHAPES, costs=COSTS, agree=True)


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
