"""GPU timing of the INT8 warp-specialised kernels at d = 64 and of their ping-pong variants (issue 40; not yet run).

``python -m dev.wspec_d64_timing OUT.json [--smoke]`` on a Hopper GPU: at each shape one group of CUDA graphs timed
in interleaved rounds (:func:`kvlib.bench.timing.interleaved`), so every ratio is side by side:

* d = 128, the benchmarks' 28 query / 4 KV heads, B = 8 and 32, S = 16k: SDPA bf16; the dispatched RTN and
  certified kernels (``decode_int8(impl="wspec")``, :data:`kvlib.kernels.int8.decode.WSPEC_RTN_CONFIG`,
  ``WSPEC_CERT_CONFIGS["plain"]``) and their ping-pong variants (``WSPEC_RTN_PINGPONG_CONFIG``,
  ``WSPEC_CERT_PINGPONG_CONFIG``: two consumer warpgroups, one CTA per SM);
* d = 64, SmolLM2's 9 query / 3 KV heads, B = 32 and 64, S = 16k: SDPA bf16; the d = 64 kernels as
  ``impl="wspec"`` launches them, their ping-pong variants, and what ``"auto"`` runs today for RTN keys (its
  ``path`` recorded; h8-dithered keys at d = 64 in groups of 32 have no Triton kernel, only the torch reference,
  which is not timed).

Pools of random codes over shuffled pages of 16 (timing does not depend on the values); each row records the median
ms, ``x_sdpa`` and the ping-pong speed-up over the single-consumer kernel. Correctness is the GPU tests' job
(``tests/test_wspec.py``, ``tests/test_wspec_cert.py``, ``tests/test_dispatch_wspec.py``); a kernel that fails to
build or launch is recorded as an error and the rest are still timed. Written with the provenance envelope
(:func:`dev.probe_kit.write_probe`).
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

import torch

PAGE, GROUP, LAYER, SEED = 16, 32, 7, 2**40 + 5
SHAPES = {  # (name, hq, hkv, d, [(B, S), ...])
    "gpu": [("d128", 28, 4, 128, [(8, 16384), (32, 16384)]), ("smollm2_d64", 9, 3, 64, [(32, 16384), (64, 16384)])],
    "smoke": [("d128", 28, 4, 128, [(2, 1024)]), ("smollm2_d64", 9, 3, 64, [(2, 1024)])],
}
ROUNDS = {"gpu": 15, "smoke": 2}
REPS = 20


def pools(B: int, S: int, hkv: int, d: int, dithered: bool, g: torch.Generator):
    """Random INT8 pages (``PoolSide`` of codes and fp16 group scales; h8-dithered or RTN keys) and a shuffled block
    table."""
    from kvlib.kernels.int8.request import PoolSide

    nb = B * S // PAGE + 64
    n = nb * PAGE
    kc = torch.randint(-127, 128, (n, hkv, d), dtype=torch.int8, device="cuda", generator=g)
    vc = torch.randint(-127, 128, (n, hkv, d), dtype=torch.int8, device="cuda", generator=g)
    ks = (0.01 + 0.04 * torch.rand(n, hkv, d // GROUP, device="cuda", generator=g)).half()
    vs = (0.01 + 0.04 * torch.rand(n, hkv, d // GROUP, device="cuda", generator=g)).half()
    # (RTN keys carry the w24 label, as the rtn-int8 backend's pages: the label routes "auto" for RTN pools)
    kp = PoolSide(kc, ks, group=GROUP, dither_layout="h8" if dithered else "w24", dithered=dithered)
    vp = PoolSide(vc, vs, group=GROUP, dither_layout="h8", dithered=False)
    bt = torch.randperm(nb, device="cuda", generator=g)[: B * S // PAGE].view(B, S // PAGE).to(torch.int32)
    return kp, vp, bt


def calls(B: int, S: int, hq: int, hkv: int, d: int, g: torch.Generator) -> tuple[dict, dict]:
    """``name -> step`` for one shape, and ``name -> DecodeOut`` filled by the steps (their ``path``)."""
    from kvlib.kernels.int8 import wspec as W
    from kvlib.kernels.int8 import wspec_cert as C
    from kvlib.kernels.int8.decode import WSPEC_CERT_PINGPONG_CONFIG, WSPEC_RTN_PINGPONG_CONFIG, decode_int8
    from kvlib.kernels.tl.merge import merge_splits

    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    kd = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vd = torch.randn_like(kd)
    rtn, dit = pools(B, S, hkv, d, False, g), pools(B, S, hkv, d, True, g)
    outs: dict[str, Any] = {}
    kw = dict(layer=LAYER, seed=SEED, block_size=PAGE)

    def dec(name, pool, impl, cert):
        kp, vp, bt = pool
        return lambda: outs.__setitem__(name, decode_int8(q, kp, vp, None, seq, impl=impl, cert=cert,
                                                          block_table=bt, **kw))

    def rtn_pp():
        (kp, vp, bt), nb = rtn, rtn[0].codes.shape[0] // PAGE
        pages = [(s.codes.view(nb, PAGE, hkv, d), s.scales.view(nb, PAGE, hkv, d // GROUP)) for s in (kp, vp)]
        o_s, lse_s = W.wspec_stage1(q, *pages[0], *pages[1], bt, seq,
                                    config=W.WSpecConfig(**WSPEC_RTN_PINGPONG_CONFIG))
        return merge_splits(o_s, lse_s, pdl=True)

    def cert_pp():
        kp, vp, bt = dit
        return C.wspec_cert_decode(q, kp, vp, bt, seq, config=C.WSpecCertConfig(**WSPEC_CERT_PINGPONG_CONFIG), **kw)

    out = {"sdpa_bf16": lambda: torch.nn.functional.scaled_dot_product_attention(q.view(B, hq, 1, d), kd, vd,
                                                                                  enable_gqa=True),
           "wspec_rtn": dec("wspec_rtn", rtn, "wspec", False), "wspec_rtn_pingpong": rtn_pp,
           "wspec_cert": dec("wspec_cert", dit, "wspec", True), "wspec_cert_pingpong": cert_pp}
    if d == 64:
        out["auto_rtn_today"] = dec("auto_rtn_today", rtn, "auto", False)
    return out, outs


def main(path: str, profile: str = "gpu") -> None:
    from dev.probe_kit import write_probe
    from kvlib.bench.timing import capture_graph, interleaved, replay_ms

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("dev.wspec_d64_timing needs a Hopper (sm_90) GPU")
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for name, hq, hkv, d, shapes in SHAPES[profile]:
        for B, S in shapes:
            g = torch.Generator(device="cuda").manual_seed(B * 1009 + S + d)
            fns, outs = calls(B, S, hq, hkv, d, g)
            graphs, errors = {}, {}
            for n, fn in fns.items():
                try:
                    graphs[n], _ = capture_graph(fn, warmup_iters=2)
                except Exception as e:  # noqa: BLE001 - recorded; the others are still timed
                    errors[n] = f"{type(e).__name__}: {str(e)[:600]}"

            res = interleaved({n: replay_ms(gr, REPS) for n, gr in graphs.items()}, ROUNDS[profile])
            med = {n: m for n, (m, _) in res.items()}
            sd = med.get("sdpa_bf16")
            row = {"shape": name, "batch": B, "seq": S, "hq": hq, "hkv": hkv, "d": d, "median_ms": med,
                   "x_sdpa": {n: sd / m for n, m in med.items() if sd and m},
                   "pingpong_speedup": {k: med[k] / med[f"{k}_pingpong"] for k in ("wspec_rtn", "wspec_cert")
                                        if med.get(k) and med.get(f"{k}_pingpong")},
                   "paths": {n: getattr(o, "path", None) for n, o in outs.items()}, "errors": errors}
            rows.append(row)
            print(name, B, S, {n: round(x, 3) for n, x in row["x_sdpa"].items()}, errors or "", flush=True)
            del graphs, fns, outs
            torch.cuda.empty_cache()
    write_probe(path, "wspec_d64_timing", rows, started,
                {"profile": profile, "shapes": SHAPES[profile], "rounds": ROUNDS[profile], "reps": REPS,
                 "page": PAGE})


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0)
    main(args[0], "smoke" if "--smoke" in args else "gpu")
