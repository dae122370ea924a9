"""Development probe on the GPU: where the h10 kernel's time goes, by ablation (``decode_int8_h10.ABLATE``:
the QK path, the PV path, the slot-table load dropped; Philox skipped), timed from CUDA graphs beside SDPA
bf16 at the paper's head shape. Timing only: an ablated kernel's output is not attention."""

from __future__ import annotations

import datetime
import sys

import torch

import kvlib.kernels.decode_int8_h10 as H
from kvlib.bench._h10_probe import h10_problem, write_probe
from kvlib.bench._h10_probe2 import _sdpa_graph_ms, _time

#: (name, ABLATE mask, skip_philox, cert)
VARIANTS = (("certA", 0, False, True), ("nocert", 0, False, False), ("nophilox", 0, True, True),
            ("no_qk", 1, False, True), ("no_pv", 2, False, True), ("no_qk_pv", 3, False, True),
            ("no_qk_pv_nophilox", 3, True, True), ("affine_slots", 4, False, True),
            ("affine_slots_nophilox", 4, True, True), ("no_pv_nophilox", 2, True, True),
            ("no_qk_nophilox", 1, True, True))


def main() -> None:
    from kvlib.kernels.decode_int8 import decode_int8

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for B, S in ((8, 32768), (32, 16384)):
        hq, hkv, d = 28, 4, 128
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv, d)
        sd = _sdpa_graph_ms(qb.view(B, hq, 1, d), hkv, S)
        for name, mask, skip, cert in VARIANTS:
            H.ABLATE = mask
            try:
                ms = _time(decode_int8, (qb, kp, vp, slots, seq),
                           dict(impl="h10", cert=cert, cert_b=False, skip_philox=skip))
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                ms = None
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            finally:
                H.ABLATE = 0
            rows.append(dict(B=B, S=S, name=name, ablate=mask, skip_philox=skip, cert=cert, ms=ms, sdpa_ms=sd,
                             vs_sdpa=None if ms is None else sd / ms))
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_probe4.json", "h10_probe4", rows, started,
                {"command": "python -m kvlib.bench._h10_probe4", "variants": VARIANTS})


if __name__ == "__main__":
    main()
