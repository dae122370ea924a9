"""Offline sm_90 compile of the INT8 warp-specialised kernels at d = 64 and d = 128 (issue 40, no GPU needed).

``python -m dev.wspec_d64_offline OUT.json [--d128-only] [--base BASE.json]`` compiles each variant with Triton's
own toolchain (:func:`kvlib.kernels.int8.wspec.compile_offline`,
:func:`kvlib.kernels.int8.wspec_cert.compile_offline`) and
records per variant: registers, stack, spill instructions (``STL``/``LDL``), the main loop's instructions per
thread per tile (:func:`kvlib.kernels.offline.loop_stats`, the longest backward branch: in these kernels it spans
the producer's code too),
HMMA / TMA / ex2 counts, the consumer warpgroups' tile loops (backward branches holding HMMA and no TMA: per thread
per tile), shared memory, and a SHA-256 of the SASS instruction lines (addresses and opcodes, no headers: the d = 128
hashes show whether a change left the validated binaries as they were). Records the commit, the tree's
cleanliness, Triton's version and the time; with ``--base`` whether each d = 128 variant's SASS hash equals the
base run's (another commit's).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile


def _consumer_loops(sass: str) -> tuple[list[int], int]:
    """Instructions of each backward-branch body that holds HMMA and no TMA issue (a consumer warpgroup's tile loop;
    the longest backward branch of a warp-specialised kernel spans the producer's code too), shortest first; and the
    spill instructions (``STL``/``LDL``) inside the two shortest (the consumers' tile loops)."""
    from kvlib.kernels.offline import backward_loops, instructions

    ins = instructions(sass)
    out = [(len(body), lo, hi) for lo, hi, body in backward_loops(sass)
           if any("HMMA" in t for t in body) and not any("UTMALDG" in t for t in body)]
    out.sort()
    spills = [a for a, t in ins if re.search(r"\b(STL|LDL)\b", t)]
    inner = sum(any(lo <= a <= hi for _, lo, hi in out[:2]) for a in spills)
    return [n for n, _, _ in out], inner


def _sass_stats(cc) -> dict:
    from kvlib.kernels.offline import loop_stats, tool

    with tempfile.TemporaryDirectory() as t:
        p = os.path.join(t, "k.cubin")
        with open(p, "wb") as f:
            f.write(cc.asm["cubin"])
        use = subprocess.run([tool("cuobjdump"), "-res-usage", p], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool("cuobjdump"), "-sass", p], capture_output=True, text=True, check=True).stdout
    res = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK)[:=](\d+)", use)}
    body = "\n".join(line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))
    loop = loop_stats(sass)
    cons, cons_spills = _consumer_loops(sass)
    return dict(registers=res.get("reg"), stack_bytes=res.get("stack"),
                consumer_loop_instructions=min(cons) if cons else None, consumer_loops=cons,
                spill_ops_in_consumer_loops=cons_spills,
                spill_ops=len(re.findall(r"\b(STL|LDL)\b", sass)), loop_instructions=loop["instructions"],
                loop_top_opcodes=loop["top_opcodes"], hmma=len(re.findall(r"\bHMMA\b", sass)),
                tma=len(re.findall(r"\bUTMALDG\b", sass)), ex2=sass.count("MUFU.EX2"),
                shared_bytes=cc.metadata.shared, sass_instructions=body.count("\n") + 1,
                sass_sha256=hashlib.sha256(body.encode()).hexdigest())


def variants(d64: bool = True):
    from kvlib.kernels.int8 import wspec as W
    from kvlib.kernels.int8 import wspec_cert as C
    from kvlib.kernels.int8.decode import (
        WSPEC_CERT_CONFIGS,
        WSPEC_CERT_PINGPONG_CONFIG,
        WSPEC_RTN_CONFIG,
        WSPEC_RTN_PINGPONG_CONFIG,
    )

    rtn = W.WSpecConfig(**WSPEC_RTN_CONFIG)
    plain = C.WSpecCertConfig(**WSPEC_CERT_CONFIGS["plain"])
    outl = C.WSpecCertConfig(**WSPEC_CERT_CONFIGS["outliers"])
    pp = W.WSpecConfig(**WSPEC_RTN_PINGPONG_CONFIG)
    cpp = C.WSpecCertConfig(**WSPEC_CERT_PINGPONG_CONFIG)
    dims = (128, 64) if d64 else (128,)
    for d in dims:
        kw = {} if d == 128 else {"d": d}
        # SmolLM2: 9 query / 3 KV heads (GQA 3); the benchmarks' GQA 7; GQA 8 over 64-slot pages
        yield f"rtn_default_d{d}", lambda kw=kw: W.compile_offline(**kw)
        yield f"rtn_dispatch_d{d}", lambda kw=kw: W.compile_offline(rtn, **kw)
        yield f"rtn_dispatch_gqa3_d{d}", lambda kw=kw: W.compile_offline(rtn, gqa=3, **kw)
        yield f"rtn_gqa8_bs64_d{d}", lambda kw=kw: W.compile_offline(gqa=8, block_size=64, **kw)
        yield f"cert_default_d{d}", lambda kw=kw: C.compile_offline(**kw)
        yield f"cert_dispatch_plain_d{d}", lambda kw=kw: C.compile_offline(plain, **kw)
        yield f"cert_dispatch_plain_gqa3_d{d}", lambda kw=kw: C.compile_offline(plain, gqa=3, **kw)
        yield f"cert_dispatch_outliers_m4_d{d}", lambda kw=kw: C.compile_offline(outl, nok=4, **kw)
        yield f"cert_dispatch_outliers_m8_gqa3_d{d}", lambda kw=kw: C.compile_offline(outl, nok=8, gqa=3, **kw)
        yield f"cert_nocert_d{d}", lambda kw=kw: C.compile_offline(plain, cert=False, **kw)
        if d64:  # the ping-pong RTN variant (two consumer warpgroups; opt-in)
            yield f"rtn_pingpong_d{d}", lambda kw=kw: W.compile_offline(pp, **kw)
            yield f"rtn_pingpong_gqa3_d{d}", lambda kw=kw: W.compile_offline(pp, gqa=3, **kw)
            yield f"rtn_pingpong_m128_d{d}", lambda kw=kw: W.compile_offline(
                W.WSpecConfig(**(WSPEC_RTN_PINGPONG_CONFIG | {"maxnreg": 128, "consumer_regs": 128})), **kw)
            yield f"cert_pingpong_d{d}", lambda kw=kw: C.compile_offline(cpp, **kw)
            yield f"cert_pingpong_m4_d{d}", lambda kw=kw: C.compile_offline(cpp, nok=8, **kw)


def main(path: str, d64: bool = True, base: str | None = None) -> None:
    import triton

    os.environ.pop("TRITON_INTERPRET", None)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    out = {"commit": commit, "tree_clean": not dirty, "triton": triton.__version__, "target": "sm_90",
           "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "variants": {}}
    for name, build in variants(d64):
        try:
            out["variants"][name] = _sass_stats(build())
        except Exception as e:  # noqa: BLE001 - recorded: which variant does not build, and why
            out["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
        r = out["variants"][name]
        print(name, {k: r.get(k) for k in ("registers", "stack_bytes", "spill_ops", "loop_instructions",
                                           "consumer_loops", "spill_ops_in_consumer_loops", "error")},
              flush=True)
    if base:  # the d = 128 binaries against a run at another commit (the validated kernels' SASS, unchanged?)
        with open(base) as f:
            ref = json.load(f)
        out["base"] = {"commit": ref["commit"], "tree_clean": ref["tree_clean"], "file": os.path.basename(base)}
        out["same_sass_as_base"] = {n: r.get("sass_sha256") == ref["variants"].get(n, {}).get("sass_sha256")
                                    for n, r in out["variants"].items() if n in ref["variants"]}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], d64="--d128-only" not in args, base=args[args.index("--base") + 1] if "--base" in args else None)
