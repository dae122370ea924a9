"""Offline sm_90 compile of the warp-specialised KV4 kernel and its KV4-RL variant with the side region in the
same launch (``WSpec4Config.side_fused``, :func:`kvlib.kernels.int4.wspec._wspec4rl_stage1`), no GPU.

``PYTHONPATH=. python -m dev.wspec4rl_sass [OUT.json]``: per variant the registers, stack, spill instructions
(``STL``/``LDL``), the SHA-256 of the SASS listing, and every loop of the SASS (backward branches) classified by
what it holds: the producer's (``UTMALDG``, no ``IMMA``), the INT4 consumer's (``IMMA`` without global loads: it
reads the ring) and the side region's (``IMMA`` with ``LDG``: it reads the INT8 side buffer). Instruction counts
are per thread per loop trip (a 128-position tile for the INT4 loop, ``block_p`` = 32 side slots for the side
loop).

``--base COMMIT`` also compiles the KV4 variants from that commit's kvlib (``git archive``, in a subprocess):
their SASS hashes must be equal (the validated kernel keeps its binary): ``kv4_sass_unchanged``."""

from __future__ import annotations

import hashlib
import json
import re
import sys

from kvlib.kernels.int4 import wspec as W
from kvlib.kernels.offline import backward_loops, disassemble, opcode

KV4 = {  # name: (config, compile_offline keywords)
    "kv4_rows8_d128_gqa7_p16": ({"rows8": True}, {}),
    "kv4_rows16_d128_gqa7_p16": ({}, {}),
    "kv4_rows8_d64_gqa4_p16": ({"rows8": True}, {"gqa": 4, "d": 64}),
    "kv4_rows8_d128_gqa8_p256": ({"rows8": True}, {"gqa": 8, "block_size": 256}),
}
RL = {name.replace("kv4_", "kv4rl_fused_"): (cfg | {"side_fused": True}, kw | {"side": True})
      for name, (cfg, kw) in KV4.items()} | {
    "kv4rl_fused_rows8_d128_gqa1_p16": ({"rows8": True, "side_fused": True}, {"gqa": 1, "side": True}),
    "kv4rl_fused_rows8_bp16_d128_gqa7_p16": ({"rows8": True, "side_fused": True, "block_p": 16}, {"side": True}),
    # 64-slot side steps: no prefetch at d = 128 (it would spill), prefetch at d = 64
    "kv4rl_fused_rows8_bp64_d128_gqa7_p16": ({"rows8": True, "side_fused": True, "block_p": 64}, {"side": True}),
    "kv4rl_fused_rows8_bp64_d64_gqa4_p16": ({"rows8": True, "side_fused": True, "block_p": 64},
                                           {"side": True, "gqa": 4, "d": 64}),
    # three CTAs per SM at 80 registers
    "kv4rl_fused_rows8_3cta_d128_gqa7_p16": ({"rows8": True, "side_fused": True, "ring": 3, "maxnreg": 80,
                                              "producer_regs": 32, "ctas_per_sm": 3}, {"side": True}),
}


def loops(sass: str) -> list[dict]:
    """Every backward branch's body ``[target, branch]``: size, and what it holds."""
    out = []
    for _, _, body in backward_loops(sass):
        ops = [opcode(t) for t in body]
        kind = ("producer" if "UTMALDG" in ops and "IMMA" not in ops else
                "other" if "UTMALDG" in ops else  # a branch around both partitions' code
                "side" if "IMMA" in ops and "LDG" in ops else
                "int4" if "IMMA" in ops else "other")
        out.append({"kind": kind, "instructions": len(body), "imma": ops.count("IMMA"), "hmma": ops.count("HMMA"),
                    "ldg": ops.count("LDG"), "lds": ops.count("LDS") + ops.count("LDSM"),
                    "mufu": ops.count("MUFU"),
                    "fp": {op: ops.count(op) for op in ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP")}})
    return out


def count(cfg: dict, kw: dict) -> dict:
    cc = W.compile_offline(W.WSpec4Config(**cfg), **kw)
    usage, sass = disassemble(cc)
    res = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}
    ls = loops(sass)
    best = {k: max((lp for lp in ls if lp["kind"] == k), key=lambda lp: lp["instructions"], default=None)
            for k in ("int4", "side", "producer")}
    return {"config": cfg, "compile": kw, **res, "smem_bytes": cc.metadata.shared,
            "spill_ops": sass.count("STL") + sass.count("LDL"),
            "sass_sha256": hashlib.sha256(sass.encode()).hexdigest(), "total_instructions": len(
                re.findall(r"^\s*/\*[0-9a-f]{4,}\*/", sass, re.M)),
            "loops": {k: v for k, v in best.items() if v is not None}}


def triton_side(gqa: int = 7, d: int = 128, block_p: int = 32) -> dict:
    """The Triton protected-region body's loop (:func:`kvlib.kernels.int4.protected._protected_region` in its
    standalone kernel, the body the Triton paged KV4-RL kernel runs as its extra program), for comparison with
    :func:`kvlib.kernels.int4.wspec._side_region4`'s."""
    from kvlib.kernels.int4.protected import _protected_kernel
    from kvlib.kernels.offline import compile_sm90

    ptrs = {"Q8": "*i8", "QS": "*fp32", "K8": "*i8", "KS": "*fp16", "V8": "*i8", "VS": "*fp16", "COUNT": "*i32",
            "OUT": "*fp32", "LSE": "*fp32"}
    const = dict(HKV=4, G=gqa, GP=max(8, 1 << (gqa - 1).bit_length()), D=d, BLOCK_N=block_p, INTERP=False)
    cc = compile_sm90(_protected_kernel, const, ptrs, num_warps=4, num_stages=3)
    usage, sass = disassemble(cc)
    ls = [lp for lp in loops(sass) if lp["imma"]]
    return {"const": const, "num_warps": 4, "num_stages": 3, "reg": int(re.search(r"REG:(\d+)", usage).group(1)),
            "side_loop": max(ls, key=lambda lp: lp["instructions"])}


def base_counts(commit: str) -> dict:
    """The KV4 variants compiled from ``commit``'s kvlib (``git archive``), in a subprocess whose ``kvlib`` is that
    one: ``{name: record}``."""
    import os
    import pathlib
    import shutil
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        arch = subprocess.run(["git", "archive", commit, "kvlib"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=arch, check=True)
        shutil.copy(__file__, os.path.join(tmp, "sass_tool.py"))
        out = os.path.join(tmp, "base.json")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": tmp}
        subprocess.run([sys.executable, "sass_tool.py", "--kv4-only", out], cwd=tmp, env=env, check=True)
        return json.loads(pathlib.Path(out).read_text())["variants"]


def main() -> None:
    """``[OUT.json] [--kv4-only] [--base COMMIT]``: with ``--base``, the KV4 variants of ``COMMIT`` too, and whether
    each SASS listing is the same (``kv4_sass_unchanged``)."""
    import datetime as dt
    import pathlib

    import triton

    started = dt.datetime.now(dt.UTC)
    only_kv4 = "--kv4-only" in sys.argv
    base = sys.argv[sys.argv.index("--base") + 1] if "--base" in sys.argv else None
    args = [a for a in sys.argv[1:] if not a.startswith("--") and a != base]
    out = {"target": "sm_90", "triton": triton.__version__, "variants": {}}
    for name, (cfg, kw) in (KV4 | ({} if only_kv4 else RL)).items():
        r = count(cfg, kw)
        out["variants"][name] = r
        lp = r["loops"]
        print(f"{name}: reg {r.get('reg')} stack {r.get('stack', 0)} spills {r['spill_ops']} "
              f"int4 loop {lp.get('int4', {}).get('instructions')} side loop {lp.get('side', {}).get('instructions')}"
              f" sha {r['sass_sha256'][:12]}", flush=True)
    if not only_kv4:
        out["triton_side_d128_gqa7"] = triton_side()
        out["triton_side_d64_gqa4"] = triton_side(4, 64)
        print("Triton protected-region loop:", out["triton_side_d128_gqa7"]["side_loop"],
              out["triton_side_d64_gqa4"]["side_loop"], flush=True)
    if base:
        old = base_counts(base)
        out["base"] = {"commit": base, "variants": old}
        out["kv4_sass_unchanged"] = {n: old[n]["sass_sha256"] == out["variants"][n]["sass_sha256"] for n in KV4}
        print("KV4 SASS unchanged against", base, out["kv4_sass_unchanged"], flush=True)
    # the INT4 loop of each same-launch variant against its KV4 kernel's: the same floating-point instructions
    # (the tests expect the INT4 states of both paths to agree to the epilogue's rounding)
    out["int4_loop_same_fp_ops"] = {
        n: out["variants"][n]["loops"]["int4"]["fp"] == out["variants"][k]["loops"]["int4"]["fp"]
        for n in out["variants"] if n.startswith("kv4rl_fused_")
        and (k := n.replace("kv4rl_fused_", "kv4_")) in out["variants"]}
    print("INT4 loop FP instructions equal to the KV4 kernel's:", out["int4_loop_same_fp_ops"], flush=True)
    if args:
        if only_kv4:  # the --base subprocess: no provenance needed, a plain file
            pathlib.Path(args[0]).write_text(json.dumps(out))
            return
        from kvlib.publish.provenance import provenance, write_json_atomic

        out["provenance"] = provenance({"argv": sys.argv[1:]}, started)
        write_json_atomic(pathlib.Path(args[0]), out)


if __name__ == "__main__":
    main()
