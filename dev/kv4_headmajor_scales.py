"""Offline evidence for the head-major KV4 scale layout (a design note in dev/results/README.md, issue 40; nothing
of it is built in kvlib). No GPU.

``PYTHONPATH=. python -m dev.kv4_headmajor_scales [OUT.json]``:

1. Gluon's host-side TMA descriptor checks (``TensorDescriptor.__post_init__``: 16-byte base, 16-byte strides
   but the last, a contiguous last dimension) and the CUDA box rule (the innermost box extent times the element
   size a multiple of 16 bytes) on one head's scale run of a page, in today's layout ``[num_blocks, block_size,
   H_kv]`` fp16 (four tensors) and in the head-major one ``[num_blocks, H_kv, 4, block_size]`` (``k_scale,
   k_off, v_scale, v_off`` of a head and page as four contiguous rows), at pages of 8/16/256 and H_kv 1/4/8;
2. the producer loop of today's warp-specialised KV4 kernel (offline sm_90 SASS): what the per-tile scale gathers
   cost there (global loads, shared stores, barriers), which one TMA box per page piece would replace."""

from __future__ import annotations

import json
import re
import sys

import torch


def descriptor_ok(view: torch.Tensor, box: list[int]) -> str:
    """``"ok"`` or why a TMA descriptor over ``view`` with box ``box`` is refused (Gluon's host checks, then the
    CUDA innermost-box rule Gluon leaves to the driver)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    try:
        layout = gl.NVMMASharedLayout.get_default_for(box, gl.float16)
        TensorDescriptor(view, list(view.shape), list(view.stride()), box, layout)
    except (AssertionError, ValueError) as e:
        return f"refused: {e}"
    if box[-1] * view.element_size() % 16:
        return f"refused: innermost box {box[-1]} x {view.element_size()} bytes is not a multiple of 16"
    return "ok"


def layouts() -> list[dict]:
    out = []
    for bs in (8, 16, 256):
        for hkv in (1, 4, 8):
            nb, rbox = 4, min(bs, 128)
            today = torch.zeros(nb, bs, hkv, dtype=torch.float16)
            # one head's run of a page: positions are the stride-H_kv dimension; as a 2-D view [nb * bs, H_kv] the
            # head is the last (contiguous) dimension, so its box is [rbox, 1]
            t = descriptor_ok(today.view(nb * bs, hkv), [rbox, 1])
            if hkv == 1:  # one head: the positions are contiguous already, a box along them is legal
                t += "; as [num_blocks, block_size] (H_kv = 1): " + descriptor_ok(today.view(nb, bs), [1, rbox])
            head = torch.zeros(nb, hkv, 4, bs, dtype=torch.float16)
            h = descriptor_ok(head.view(nb * hkv * 4, bs), [4, rbox])
            out.append({"block_size": bs, "hkv": hkv, "box_rows": rbox, "today_one_head": t, "head_major": h})
    return out


def producer_loop() -> dict:
    from dev.wspec4rl_sass import loops
    from kvlib.kernels.int4 import wspec as W
    from kvlib.kernels.offline import disassemble

    out = {}
    for name, bs in (("p16", 16), ("p256", 256)):
        sass = disassemble(W.compile_offline(W.WSpec4Config(**W.DISPATCH_CONFIG), block_size=bs))[1]
        prod = max((lp for lp in loops(sass) if lp["kind"] == "producer"), key=lambda lp: lp["instructions"])
        out[name] = {"instructions": prod["instructions"], "ops": _count_in_producer(sass)}
    return out


def _count_in_producer(sass: str) -> dict:
    """Global loads, TMA copies, shared stores and barriers in the producer's loop (the scale rows stored into the
    stage, the warp barrier before its arrival)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    best = None
    for addr, text in ins:
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins
                    if int(m.group(1), 16) <= a <= addr]
            if "UTMALDG" in body and "IMMA" not in body and (best is None or len(body) > len(best)):
                best = body
    return {op: best.count(op) for op in ("STS", "BAR", "WARPSYNC", "LDG", "UTMALDG", "SYNCS")} if best else {}


def main() -> None:
    import datetime as dt
    import pathlib

    started = dt.datetime.now(dt.UTC)
    res = {"descriptors": layouts(), "producer_loop": producer_loop()}
    for r in res["descriptors"]:
        print(r, flush=True)
    print(res["producer_loop"], flush=True)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        from kvlib.publish.provenance import provenance, write_json_atomic

        res["provenance"] = provenance({"argv": sys.argv[1:]}, started)
        write_json_atomic(pathlib.Path(args[0]), res)
    else:
        print(json.dumps(res)[:200])


if __name__ == "__main__":
    main()
