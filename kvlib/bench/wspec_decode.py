"""The warp-specialised decode kernels beside the ones they replace, in one run (issue 28).

At each shape (28 query / 4 KV heads, d = 128, the paper's long contexts), one group of CUDA graphs timed in
interleaved rounds (:func:`kvlib.bench.timing.interleaved`), so every ratio is measured side by side:

* ``sdpa_bf16``: torch SDPA over a bf16 cache, the baseline of every ``x_sdpa``;
* INT8 over vLLM pages of 16 slots: the certified Gluon kernel (``gluon_cert``, with ``m = 4`` outlier RoPE pairs
  ``gluon_cert_m4``, without the certificate ``gluon_nocert``) and RTN keys through it (``gluon_rtn``); the
  warp-specialised kernels as :func:`kvlib.kernels.int8.decode.decode_int8` dispatches them (``impl="wspec"``:
  ``wspec_cert``, ``wspec_cert_m4``, ``wspec_nocert``; RTN keys ``wspec_rtn``);
* INT4 (KV4 and KV4-RL, 16 sink + 128 recent positions in the side buffer): the Triton kernels over the contiguous
  cache (``triton_kv4``, ``triton_kv4rl``, the kv4 benchmark's calls) and over pages of 256 and 16
  (``triton_paged*``), the warp-specialised kernel over the same pages (``wspec4*``; KV4-RL through its side
  region, which the dispatcher does not take).

Each row records the median ms, ``x_sdpa``, the bytes each kernel must read (codes, scales, outliers; the
roofline's numerator) as achieved GB/s and as a fraction of the copy bandwidth measured in the same run, the
certificate's marginal cost (certified over uncertified time, each kernel against itself) and KV4-RL's speed as a
share of KV4's. Agreement of each new kernel with the old one on the timed pools is recorded as well (the GPU tests
gate correctness: ``tests/test_wspec_cert.py``, ``tests/test_wspec_int4.py``, ``tests/test_dispatch_wspec.py``).
Random codes: the kernels' time does not depend on the values. GPU only (profile ``gpu``); elsewhere the topic
records that it was skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

HQ, HKV, D = 28, 4, 128
GROUP = 32
LAYER, SEED = 7, 2**40 + 5
NOK = 8  # m = 4 outlier RoPE pairs: 8 fp16 key channels
SHAPES = {"gpu": ((8, 16384), (32, 16384), (8, 32768), (32, 32768)), "smoke": ((2, 1024),)}
ROUNDS = {"gpu": 15, "smoke": 2}
REPS = 20  # replays per timed call
INT8_PAGE = 16
INT4_PAGES = (256, 16)
#: (certified, uncertified) pairs whose time ratio is the certificate's marginal cost
CERT_PAIRS = {"gluon": ("gluon_cert", "gluon_nocert"), "wspec": ("wspec_cert", "wspec_nocert")}
#: new kernel -> the old one it replaces (speed-up = old time / new time)
REPLACES = {"wspec_cert": "gluon_cert", "wspec_cert_m4": "gluon_cert_m4", "wspec_nocert": "gluon_nocert",
            "wspec_rtn": "gluon_rtn", "wspec4_kv4_p256": "triton_paged_kv4_p256",
            "wspec4_kv4_p16": "triton_paged_kv4_p16", "wspec4_kv4rl_p256": "triton_paged_kv4rl_p256"}


def kernel_bytes(name: str, batch: int, seq: int, *, hkv: int = HKV, d: int = D, nok: int = NOK) -> int:
    """Bytes a decode step must read from memory for ``name``'s cache (both sides, every position of every row):
    bf16 ``4 d``; INT8 ``2 d`` codes + ``2 (d / 32)`` fp16 scales per side (+ ``2 nok`` outlier bytes for the keys of
    an ``_m4`` kernel); INT4 ``d`` bytes of codes + 8 of fp16 scale and offset (KV4-RL's side buffer, 144 INT8
    positions, is left out: under 1% at S >= 16k). The query, the block table and the split states are ignored."""
    if name.startswith("sdpa"):
        per = 4 * d
    elif name.startswith(("triton_kv4", "triton_paged_kv4", "wspec4")):
        per = d + 8
    elif name.startswith(("gluon", "wspec")):
        per = 2 * (d + 2 * d // GROUP) + (2 * nok if name.endswith("_m4") else 0)
    else:
        raise ValueError(f"name: no byte model for kernel {name!r}")
    return batch * hkv * seq * per


def summarise(med: dict[str, float | None], batch: int, seq: int, copy_GBps: float) -> dict[str, Any]:
    """The derived columns of one shape from its medians (ms): ``x_sdpa``, achieved GB/s and its fraction of the
    copy bandwidth, the certificate's marginal cost, each new kernel's speed-up over the one it replaces, and
    KV4-RL's speed as a share of KV4's (per kernel family). Kernels that failed (None) are left out."""
    ok = {n: t for n, t in med.items() if t is not None and t > 0}
    sdpa = ok.get("sdpa_bf16")
    gbps = {n: kernel_bytes(n, batch, seq) / (t * 1e-3) / 1e9 for n, t in ok.items()}
    return {
        "x_sdpa": {n: sdpa / t for n, t in ok.items()} if sdpa else {},
        "GBps": gbps,
        "of_copy": {n: g / copy_GBps for n, g in gbps.items()},
        "cert_marginal_cost": {k: ok[a] / ok[b] - 1.0 for k, (a, b) in CERT_PAIRS.items() if a in ok and b in ok},
        "speedup_over_old": {n: ok[o] / ok[n] for n, o in REPLACES.items() if n in ok and o in ok},
        "kv4rl_share_of_kv4": {k: ok[a] / ok[b] for k, (a, b) in {
            "triton": ("triton_kv4", "triton_kv4rl"), "triton_paged_p256": ("triton_paged_kv4_p256",
                                                                            "triton_paged_kv4rl_p256"),
            "wspec4_p256": ("wspec4_kv4_p256", "wspec4_kv4rl_p256")}.items() if a in ok and b in ok},
    }


def _int8_pools(B: int, S: int, nok: int, dithered: bool, g: torch.Generator, dev: str):
    from kvlib.kernels.int8.request import PoolSide

    nb = B * S // INT8_PAGE + 64
    n = nb * INT8_PAGE
    kc = torch.randint(-127, 128, (n, HKV, D), dtype=torch.int8, device=dev, generator=g)
    vc = torch.randint(-127, 128, (n, HKV, D), dtype=torch.int8, device=dev, generator=g)
    ks = (0.01 + 0.04 * torch.rand(n, HKV, D // GROUP, device=dev, generator=g)).half()
    vs = (0.01 + 0.04 * torch.rand(n, HKV, D // GROUP, device=dev, generator=g)).half()
    ko = koc = None
    if nok:  # m RoPE pairs (c, c + d/2) per head, code 0 there (the pool's rule)
        koc = torch.stack([torch.tensor(sorted(c for i in range(nok // 2) for c in (3 + 11 * i + h, 3 + 11 * i + h
                                                                                    + D // 2)))
                           for h in range(HKV)]).to(dev)
        ko = torch.randn(n, HKV, nok, device=dev, generator=g).half()
        for h in range(HKV):
            kc[:, h, koc[h]] = 0
    kp = PoolSide(kc, ks, ko, koc, group=GROUP, dither_layout="h8", dithered=dithered)
    vp = PoolSide(vc, vs, group=GROUP, dither_layout="h8", dithered=False)
    bt = torch.randperm(nb, device=dev, generator=g)[: B * S // INT8_PAGE].view(B, S // INT8_PAGE).to(torch.int32)
    return kp, vp, bt


def _shape(B: int, S: int, profile: str, copy_GBps: float) -> dict[str, Any]:
    from kvlib.bench.kv4 import RECENT, SINK, paged_kv4_pool, random_kv4_batch
    from kvlib.bench.timing import capture_graph, interleaved, replay_ms
    from kvlib.kernels.int4 import wspec as W4
    from kvlib.kernels.int4.attention import kv4_decode, kv4rl_decode, side_buffer
    from kvlib.kernels.int4.decode import kv4_paged_decode, prepare_query
    from kvlib.kernels.int8.decode import decode_int8

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(B * 100003 + S)
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    seq = torch.full((B,), S, dtype=torch.int32, device=dev)
    calls: dict[str, Callable[[], Any]] = {}
    outs: dict[str, Any] = {}
    errors: dict[str, str] = {}

    kd = torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16, generator=g)
    vd = torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16, generator=g)
    calls["sdpa_bf16"] = lambda: torch.nn.functional.scaled_dot_product_attention(q.view(B, HQ, 1, D), kd, vd,
                                                                                  enable_gqa=True)
    pools = {"dither": _int8_pools(B, S, 0, True, g, dev), "dither_m4": _int8_pools(B, S, NOK, True, g, dev),
             "rtn": _int8_pools(B, S, 0, False, g, dev)}
    int8 = {  # name: (pool, impl, cert)
        "gluon_cert": ("dither", "gluon", True), "gluon_nocert": ("dither", "gluon", False),
        "gluon_cert_m4": ("dither_m4", "gluon", True), "gluon_rtn": ("rtn", "gluon", False),
        "wspec_cert": ("dither", "wspec", True), "wspec_nocert": ("dither", "wspec", False),
        "wspec_cert_m4": ("dither_m4", "wspec", True), "wspec_rtn": ("rtn", "wspec", False),
    }
    for name, (pool, impl, cert) in int8.items():
        kp, vp, bt = pools[pool]
        calls[name] = (lambda kp=kp, vp=vp, bt=bt, impl=impl, cert=cert, name=name: outs.__setitem__(
            name, decode_int8(q, kp, vp, None, seq, layer=LAYER, seed=SEED, impl=impl, cert=cert, block_table=bt,
                              block_size=INT8_PAGE)))

    cache = random_kv4_batch(seq, S, SINK, RECENT, hkv=HKV, d=D)
    zeros = torch.zeros_like(cache.lengths)
    side = side_buffer(cache)
    main = cache.main_range()
    calls["triton_kv4"] = lambda: kv4_decode(q, cache)
    calls["triton_kv4rl"] = lambda: kv4rl_decode(q, cache)
    wcfg = W4.WSpec4Config(**W4.DISPATCH_CONFIG)
    for page in INT4_PAGES:
        pool = paged_kv4_pool(cache, page)
        pargs = tuple(pool[n] for n in ("k_codes", "k_scale", "k_off", "v_codes", "v_scale", "v_off", "block_table"))
        variants = {f"triton_paged_kv4_p{page}": ("triton", zeros, cache.lengths, None),
                    f"wspec4_kv4_p{page}": ("wspec", zeros, cache.lengths, None)}
        if page == INT4_PAGES[0]:
            variants |= {f"triton_paged_kv4rl_p{page}": ("triton", *main, side),
                         f"wspec4_kv4rl_p{page}": ("wspec_side", *main, side)}
        for name, (backend, start, end, sd) in variants.items():
            def fn(pargs=pargs, backend=backend, start=start, end=end, sd=sd, name=name, page=page):
                qp = prepare_query(q, pdl=True)
                if backend == "wspec_side":  # KV4-RL on the new kernel: not a dispatcher path, called directly
                    r = W4.wspec4_decode(qp, *pargs, start, end, block_size=page, side=sd, config=wcfg)
                else:
                    r = kv4_paged_decode(qp, *pargs, start, end, block_size=page, side=sd, backend=backend)
                outs[name] = r
            calls[name] = fn

    graphs = {}
    for name, fn in calls.items():
        try:
            graphs[name], _ = capture_graph(fn, warmup_iters=2)
        except Exception as e:  # noqa: BLE001 - a kernel that fails is recorded; the rest are still timed
            errors[name] = f"{type(e).__name__}: {str(e)[:800]}"
            print(f"   FAIL {name}: {errors[name][:300]}", flush=True)

    res = interleaved({n: replay_ms(gr, REPS) for n, gr in graphs.items()}, ROUNDS[profile])
    med = {n: m for n, (m, _) in res.items()}
    row: dict[str, Any] = {"batch": B, "seq": S, "median_ms": med, "rounds_ms": {n: v for n, (_, v) in res.items()},
                           "bytes": {n: kernel_bytes(n, B, S) for n in med}, "errors": errors}
    row |= summarise(med, B, S, copy_GBps)
    agree = {}
    for new, old in REPLACES.items():
        if new in outs and old in outs:
            a, b = outs[new], outs[old]
            o_new, o_old = (a.o, b.o) if hasattr(a, "o") else (a[0], b[0])
            agree[new] = {"vs": old, "max_abs_o": (o_new.float() - o_old.float()).abs().max().item()}
            if hasattr(a, "tv_bound") and a.tv_bound is not None and b.tv_bound is not None:
                agree[new]["max_abs_tv_bound"] = (a.tv_bound - b.tv_bound).abs().max().item()
    row["agreement"] = agree
    row["paths"] = {n: getattr(o, "path", None) for n, o in outs.items() if hasattr(o, "path")}
    return row


def run(profile: str) -> dict[str, Any]:
    """Every shape of ``profile`` (``gpu``; ``smoke`` is a seconds-scale check of the harness on a GPU)."""
    if profile not in ("ci", "cpu", "gpu", "smoke"):
        raise ValueError(f"profile must be ci, cpu, gpu or smoke, got {profile!r}")
    if not torch.cuda.is_available():
        if profile == "gpu":
            raise RuntimeError("profile 'gpu' needs CUDA")
        return {"skipped": "no CUDA: the warp-specialised kernels run only on a Hopper GPU (profile gpu)"}
    if torch.cuda.get_device_capability()[0] != 9:
        raise RuntimeError(f"the warp-specialised kernels need a Hopper (sm_90) GPU, got "
                           f"{torch.cuda.get_device_name()}")
    from kvlib.bench.timing import copy_bandwidth
    from kvlib.kernels.int4.wspec import DISPATCH_CONFIG
    from kvlib.kernels.int8.decode import WSPEC_CERT_CONFIGS, WSPEC_RTN_CONFIG

    prof = "smoke" if profile != "gpu" else "gpu"
    copy = copy_bandwidth()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "shape": {"hq": HQ, "hkv": HKV, "d": D, "group": GROUP, "int8_page": INT8_PAGE, "int4_pages": INT4_PAGES,
                  "outlier_channels_m4": NOK},
        "configs": {"wspec_cert": WSPEC_CERT_CONFIGS, "wspec_rtn": WSPEC_RTN_CONFIG, "wspec4": DISPATCH_CONFIG},
        "rounds": ROUNDS[prof], "reps": REPS, "copy_bandwidth": copy, "shapes": {},
    }
    for B, S in SHAPES[prof]:
        t0 = time.time()
        out["shapes"][f"B{B}_S{S}"] = _shape(B, S, prof, copy["bandwidth_GBps"])
        torch.cuda.empty_cache()
        r = out["shapes"][f"B{B}_S{S}"]
        print(f"   B={B} S={S} ({time.time() - t0:.0f} s): " + "  ".join(
            f"{n} {x:.2f}x" for n, x in r["x_sdpa"].items()), flush=True)
    return out


if __name__ == "__main__":  # python -m kvlib.bench.wspec_decode: the smoke profile, printed
    import json

    print(json.dumps(run("smoke"), indent=1, default=str)[:4000])
