"""GPU diagnosis of the tensor-core INT8 decode kernel's value paths (V dither, V outliers).

``PYTHONPATH=. python -m dev.int8_diag`` prints max|do| and max|dcert| against the float64
reference for each combination of value dither and value outliers, for both kernels. A diagnosis aid.
"""

from __future__ import annotations

import sys


def main() -> None:
    sys.path.insert(0, "tests")
    from test_decode_int8 import _setup

    from dev.int8_calls import decode as decode_int8  # tuning keywords -> Int8KernelConfig
    from kvlib.kernels.int8.decode import decode_reference

    for v_out in (False, True):
        for v_dither in (False, True):
            for k_out in (False, True):
                q, kp, vp, slots, seq, kw, _ = _setup(v_out=v_out, v_dither=v_dither, k_out=k_out)
                for impl in ("tc", "fma"):
                    ref = decode_reference(q, kp, vp, slots, seq, impl=impl, **kw)
                    out = decode_int8(q, kp, vp, slots, seq, num_splits=2, block_n=16, impl=impl, **kw)
                    do = (out.o.double().cpu() - ref.o).abs()
                    bad = (do > 1e-4).nonzero()[:6].tolist()
                    print(f"v_out={v_out} v_dither={v_dither} k_out={k_out} {impl}: max|do|={do.max():.2e} "
                          f"dlse={(out.lse.double().cpu() - ref.lse).abs().max():.2e} "
                          f"dcert={(out.tv_bound.double().cpu() - ref.tv_bound).abs().max():.2e} bad={bad}",
                          flush=True)


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "")
    main()
