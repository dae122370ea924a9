"""Does the variance dot still pay at other GQA ratios? On the GPU: the radius's variance as one exact tf32 dot per tile
(``VAR_DOT``, the default) against the four-FMA sum, by GQA ratio. At the paper's heads (28 / 4: eight query heads
per program) the dot halved the certificate's cost (:mod:`dev.h10_variance_dot`); at GQA 4 (32 / 8, the decode grid's
heads: four per program) the offline sm_90 count favours the FMA sum (2465 vs 2486 loop instructions). Timed
certified and uncertified, h10 and h8 layouts, three interleaved rounds under CUDA graphs."""

from __future__ import annotations

from dev.probe_kit import run_probe

SHAPES = ((8, 32768, 32, 8), (32, 16384, 32, 8), (8, 32768, 28, 4), (32, 16384, 28, 4))
VARIANTS: dict[str, tuple[dict, dict]] = {}
COSTS: dict[str, tuple[str, str]] = {}
for _lay in ("h10", "h8"):
    VARIANTS[f"{_lay}_dot"] = ({"VAR_DOT": True}, dict(cert=True, layout=_lay))
    VARIANTS[f"{_lay}_fma"] = ({"VAR_DOT": False}, dict(cert=True, layout=_lay))
    VARIANTS[f"{_lay}_nocert"] = ({}, dict(cert=False, layout=_lay))
    COSTS[f"{_lay}_dot"] = (f"{_lay}_dot", f"{_lay}_nocert")
    COSTS[f"{_lay}_fma"] = (f"{_lay}_fma", f"{_lay}_nocert")


def main() -> None:
    run_probe("h10_variance_dot_gqa", VARIANTS, SHAPES, costs=COSTS, agree=True)


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
