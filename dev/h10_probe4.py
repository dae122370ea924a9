"""Development probe on the GPU: where the h10 kernel's time goes, by ablation (``Int8KernelConfig.ablate``:
the QK path, the PV path, the slot-table load dropped; Philox skipped), timed from CUDA graphs beside SDPA
bf16 at the paper's head shape. Timing only: an ablated kernel's output is not attention."""

from __future__ import annotations

import datetime
import sys

from dev.h10_probe import write_probe
from dev.h10_probe2 import time_variants

#: name -> (ABLATE mask, skip_philox, cert)
ABLATIONS = {"certA": (0, False, True), "nocert": (0, False, False), "nophilox": (0, True, True),
             "no_qk": (1, False, True), "no_pv": (2, False, True), "no_qk_pv": (3, False, True),
             "no_qk_pv_nophilox": (3, True, True), "affine_slots": (4, False, True),
             "affine_slots_nophilox": (4, True, True), "no_pv_nophilox": (2, True, True),
             "no_qk_nophilox": (1, True, True)}


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows = time_variants({name: ({"ABLATE": mask}, dict(skip_philox=skip, cert=cert))
                          for name, (mask, skip, cert) in ABLATIONS.items()})
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe4.json", "h10_probe4", rows, started,
                {"command": "python -m dev.h10_probe4", "ablations": ABLATIONS})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
