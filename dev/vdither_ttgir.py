"""Offline sm_90 compile (no GPU) of the scratch value-dither kernel (:mod:`dev.vdither_kernel`) in each bisection
case of :mod:`dev.vdither`: which cases convert an **fp32** tile into a dot-operand layout (TTGIR ``ttg.local_load``
to ``tensor<..xf32, #ttg.dot_op<{opIdx = i, ..., kWidth = k}>>``). The removed path's value tile ``s (c - xi)`` is
converted to the PV dot's B operand *before* its fp16 rounding (Triton hoisted the conversion over ``mulf`` and
``truncf``), as an fp32 tensor with the fp16 operand's ``kWidth = 8``; the shipped RTN path converts fp16 tiles.
``deep_operands``: the mma v2 operands whose layout is deeper than the dot (kWidth 8 at K = 16), the GPU's failing
set (the fp32-conversion lead above did not match it: block64 converts fp32 and is right, scale_then_dither does
not and is wrong). ``python -m dev.vdither_ttgir [OUT.json]`` (default dev/results/philox_vdither_ttgir.json)."""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

BASE = dict(GQA=2, BLOCK_H=16, BLOCK_N=16, D=64, G=32, NOK=2, NOK_P=16, NOV=0, NOV_P=1, CERT=True, CERT_B=True,
            Q_SPLIT=True, XI_SPLIT=True, PV_TERMS=3, NUM_SPLITS=2, V_DITHER=True)
CASES = {  # dev.vdither's cases at its base launch (block_n 16, 4 warps, 3 stages), shape d = 64
    "removed_code": ({}, 4, 3), "stages1": ({}, 4, 1), "stages2": ({}, 4, 2), "warps8": ({}, 8, 3),
    "block64": ({"BLOCK_N": 64}, 4, 3), "loaded_dither": ({"VD_MODE": 1}, 4, 3),
    "stored_dither": ({"VD_MODE": 2}, 4, 3), "scale_then_dither": ({"V_ORDER": 1}, 4, 3),
    "separate_dither_dot": ({"V_ORDER": 2}, 4, 3), "keys_only": ({"V_DITHER": False}, 4, 3),
    "values_only": ({"CERT": False, "CERT_B": False, "K_DITHER": False}, 4, 3),
}
PAT = re.compile(r"local_load [^\n]*-> tensor<(\d+)x(\d+)xf32, "
                 r"#ttg\.dot_op<\{opIdx = (\d), parent = #\w+, kWidth = (\d+)")
#: every dot operand: rows, cols, element type, opIdx, parent, kWidth
OPS = re.compile(r"-> tensor<(\d+)x(\d+)x(\w+), #ttg\.dot_op<\{opIdx = (\d), parent = #(\w+), kWidth = (\d+)")
MMA = re.compile(r"#(mma\w*) = #ttg\.nvidia_mma<\{versionMajor = (\d)")


def deep_operands(ir: str) -> list[dict]:
    """mma v2 dot operands of K >= 16 whose layout is deeper than the dot (``4 kWidth > K``): the H200 bisection's
    failing cases are exactly those with one (kWidth 8 at K = BLOCK_N = 16); the K = 2 bypass operands, present
    in passing and failing cases alike, are left out."""
    ver = dict(MMA.findall(ir))
    out = []
    for a, b, t, i, par, k in set(OPS.findall(ir)):
        kdim = int(b) if i == "0" else int(a)
        if ver.get(par) == "2" and kdim >= 16 and 4 * int(k) > kdim:
            out.append(dict(shape=[int(a), int(b)], dtype=t, opIdx=int(i), kWidth=int(k), K=kdim))
    return sorted(out, key=lambda x: (x["opIdx"], x["shape"], x["dtype"]))


def main() -> None:
    from dev.vdither_kernel import _tc_vd
    from kvlib.kernels.offline import compile_sm90
    from kvlib.publish.provenance import provenance, write_json_atomic

    started = datetime.datetime.now(datetime.UTC)
    res = {}
    for name, (kw, warps, stages) in CASES.items():
        cc = compile_sm90(_tc_vd, BASE | kw, {"Q": "*fp32", "VXI": "*fp32", "DBG": "*fp32"}, num_warps=warps,
                      num_stages=stages)
        loads = [dict(shape=[int(a), int(b)], opIdx=int(i), kWidth=int(k))
                 for a, b, i, k in PAT.findall(cc.asm["ttgir"])]
        res[name] = {"fp32_dot_operand_loads": loads,
                     "fp32_value_tile_to_B_operand": any(x["opIdx"] == 1 for x in loads),
                     "deep_operands": deep_operands(cc.asm["ttgir"]), "shared_bytes": cc.metadata.shared}
        print(f"{name:20s} deep mma v2 operands (4 kWidth > K): {res[name]['deep_operands']}", flush=True)
    from dev.vdither_kernel import _mini_pv

    for mode in (0, 1):  # the minimal PV kernel of dev.vdither's mini_pv cases
        for d in (64, 128):
            cc = compile_sm90(_mini_pv, dict(BN=16, D=d, MODE=mode),
                          {"P": "*fp16", "C": "*i8", "X": "*fp32", "S": "*fp32", "OUT": "*fp32"}, num_warps=4,
                          num_stages=1)
            loads = [dict(shape=[int(a), int(b)], opIdx=int(i), kWidth=int(k))
                     for a, b, i, k in PAT.findall(cc.asm["ttgir"])]
            res[f"mini_pv_mode{mode}_d{d}"] = {"fp32_dot_operand_loads": loads,
                                               "fp32_value_tile_to_B_operand": any(x["opIdx"] == 1 for x in loads),
                                               "deep_operands": deep_operands(cc.asm["ttgir"])}
            print(f"mini_pv_mode{mode}_d{d}  deep: {res[f'mini_pv_mode{mode}_d{d}']['deep_operands']}", flush=True)
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dev/results/philox_vdither_ttgir.json")
    write_json_atomic(out, {"name": "philox_vdither_ttgir", "profile": "cpu (offline sm_90 compile)",
                            "provenance": provenance({"command": "python -m dev.vdither_ttgir"}, started),
                            "results": res})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "[OUT.json]")
    main()
