"""Does the h10 kernel's PV get faster with fewer shared-memory round trips? By tile shape, on the GPU:
``pv_terms=1`` (one fp16 piece of ``p s`` per group) and ``Int8KernelConfig.pv_dequant`` (values rounded to fp16
once, one dot per tile), timed from CUDA graphs beside SDPA bf16 at the paper's head shape, each checked on the
GPU against the default (exact-operand) kernel; the certificate must not move."""

from __future__ import annotations

import datetime
import sys

from dev.int8_calls import as_call
from dev.probe_kit import h10_problem, time_variants, write_probe
from kvlib.bench.witcert_decode import LAYER, SEED

#: name -> (config flags (dev.int8_calls.FLAG_FIELDS), decode_int8 keywords)
VARIANTS = {
    "default": ({}, {}),
    "pv_terms1": ({}, dict(pv_terms=1)),
    "dequant": ({"PV_DEQUANT": True}, {}),
    "dequant_nocert": ({"PV_DEQUANT": True}, dict(cert=False)),
    "nocert": ({}, dict(cert=False)),
    "dequant_4w": ({"PV_DEQUANT": True}, dict(num_warps=4)),
    "dequant_4w_bn128": ({"PV_DEQUANT": True}, dict(num_warps=4, block_n=128)),
}


def main() -> None:
    from kvlib.kernels.int8.decode import decode_int8

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    qb, kp, vp, slots, seq = h10_problem(2, 4096)
    base = decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", cert=True, cert_b=False)
    scale = float(base.o.float().abs().max())
    for name, (flags, kw) in VARIANTS.items():
        if "nocert" in name:
            continue
        try:
            out = decode_int8(qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="h10", cert=True,
                              cert_b=False, **as_call(kw, flags))
            do = (out.o.float() - base.o.float()).abs()
            rows.append(dict(kind="agreement", name=name, max_abs_o=scale, max_abs_do=float(do.max()),
                             mean_abs_do=float(do.mean()),
                             max_abs_dcert=float((out.tv_bound.nan_to_num(posinf=9.0)
                                                  - base.tv_bound.nan_to_num(posinf=9.0)).abs().max())))
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            rows.append(dict(kind="agreement", name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(rows[-1], flush=True)
    rows += time_variants(VARIANTS)
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "h10_pv_roundtrips.json", "h10_pv_roundtrips", rows, started,
                {"command": "python -m dev.h10_pv_roundtrips", "variants": VARIANTS})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
