"""Offline sm_90 compile of the warp-specialised KV4 kernel and its KV4-RL variant with the side region in the
same launch (``WSpec4Config.side_fused``, :func:`kvlib.kernels.int4.wspec._wspec4rl_stage1`), no GPU.

``PYTHONPATH=. python -m dev.wspec4rl_sass [OUT.json]``: per variant the registers, stack, spill instructions
(``STL``/``LDL``), the SHA-256 of the SASS listing, and every loop of the SASS (backward branches) classified by
what it holds: the producer's (``UTMALDG``), the INT4 consumer's (``IMMA`` without global loads: it reads the ring)
and the side region's (``IMMA`` with ``LDG``: it reads the INT8 side buffer). Instruction counts are per thread per
loop trip (a 128-position tile for the INT4 loop, ``block_p`` = 32 side slots for the side loop).

Run it against the parent commit's kvlib too (``git archive <commit> kvlib | tar -x -C DIR``; ``PYTHONPATH=DIR``):
the KV4 variants' SASS hashes must be equal (the validated kernel keeps its binary)."""

from __future__ import annotations

import hashlib
import json
import re
import sys

from kvlib.kernels.int4 import wspec as W
from kvlib.kernels.offline import disassemble

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
}


def loops(sass: str) -> list[dict]:
    """Every backward branch's body ``[target, branch]``: size, and what it holds."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if lo <= a <= addr]
            ops = [op.split(".")[0] for op in body]
            kind = ("producer" if "UTMALDG" in ops else
                    "side" if "IMMA" in ops and "LDG" in ops else
                    "int4" if "IMMA" in ops else "other")
            out.append({"kind": kind, "instructions": len(body), "imma": ops.count("IMMA"), "hmma": ops.count("HMMA"),
                        "ldg": ops.count("LDG"), "lds": ops.count("LDS") + ops.count("LDSM"),
                        "mufu": ops.count("MUFU")})
    return out


def count(cfg: dict, kw: dict) -> dict:
    cc = W.compile_offline(W.WSpec4Config(**cfg), **kw)
    usage, sass = disassemble(cc)
    res = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}
    ls = loops(sass)
    best = {k: max((lp for lp in ls if lp["kind"] == k), key=lambda lp: lp["instructions"], default=None)
            for k in ("int4", "side", "producer")}
    return {"config": cfg, "compile": kw, **res, "spill_ops": sass.count("STL") + sass.count("LDL"),
            "sass_sha256": hashlib.sha256(sass.encode()).hexdigest(), "total_instructions": len(
                re.findall(r"^\s*/\*[0-9a-f]{4,}\*/", sass, re.M)),
            "loops": {k: v for k, v in best.items() if v is not None}}


def main() -> None:
    import triton

    only_kv4 = "--kv4-only" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = {"target": "sm_90", "triton": triton.__version__, "variants": {}}
    for name, (cfg, kw) in (KV4 | ({} if only_kv4 else RL)).items():
        r = count(cfg, kw)
        out["variants"][name] = r
        lp = r["loops"]
        print(f"{name}: reg {r.get('reg')} stack {r.get('stack', 0)} spills {r['spill_ops']} "
              f"int4 loop {lp.get('int4', {}).get('instructions')} side loop {lp.get('side', {}).get('instructions')}"
              f" sha {r['sass_sha256'][:12]}", flush=True)
    if args:
        with open(args[0], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
