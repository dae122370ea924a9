"""WitCert decode on the GPU: kernel vs reference, CUDA-graph replay, latency vs torch SDPA bf16.

``run("gpu")`` (the lead runs ``python -m kvlib.bench witcert_decode`` on the H200):

1. agreement with the float64 reference at the paper's shape (S=4096, batch 2, 28 query / 4 KV
   heads, d=128) for split counts 1, 2, 8, 32: ``max|do|``, ``max|dcert|``;
2. CUDA-graph replay of the certified decode step bit-identical to eager across interleaved
   replays, with a finite certificate emitted at every captured step;
3. latency (median, IQR) of torch SDPA bf16, our bf16 split-KV kernel, INT8 without certificate,
   INT8 + ``A``, INT8 + ``A`` and ``B``, at the paper's shape and at long context (S up to 32k,
   batch up to 64), two operand modes of the tensor-core kernel (:data:`MODES`),
   with the certificate's marginal cost and the byte roofline.

Pools for the latency runs are filled with random codes/scales (speed does not depend on the
values); correctness uses the real write path. Memory stays below ~12 GB; runtime about 1-2 minutes.
On CPU (profiles ci/cpu) it is a wiring check only: tiny shapes, no speed claim.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from kvlib.bench.timing import bench_ms, capture_graph, profile_device

PAPER = dict(B=2, S=4096, hq=28, hkv=4, d=128)
LONG = [(16, 16384), (32, 16384), (64, 16384), (8, 32768), (32, 32768), (64, 32768)]
#: the tensor-core kernel with every operand exact ("exact") or with the cheaper fp16 operands ("fast")
#: (kvlib.bench.decode_grid.INT8_MODES says what each drops), both over the paper's w24 dither layout;
#: "h10": the h10 layout (eight 10-bit dithers per Philox call) read by its own kernel; "h8": the h8 layout
#: (sixteen 8-bit dithers per call) read by the same kernel
#: "h8g": the h8 layout read by the Gluon kernel (kvlib.kernels.int8.gluon: GPU only, no outlier channels,
#: fp16/bf16 queries, so its agreement and replay problems have no bypassed channels and bf16 queries)
MODES = {"exact": dict(impl="tc"), "fast": dict(impl="tc", xi_split=False, pv_terms=2), "h10": dict(impl="h10"),
         "h8": dict(impl="h10"), "h8g": dict(impl="gluon")}
LAYOUT = {"exact": "w24", "fast": "w24", "h10": "h10", "h8": "h8", "h8g": "h8"}
#: the modes timed under CUDA graphs as well (the half-word layouts' kernels)
GRAPHED = ("h10", "h8", "h8g")
SEED = 0x5EED_0000_1234
LAYER = 3


def _decode_int8(*args: Any, **kw: Any):
    """``decode_int8`` with the modes' tuning keywords (:data:`MODES`, the sweep's) in one Int8KernelConfig."""
    from kvlib.kernels.int8.config import config_call
    from kvlib.kernels.int8.decode import decode_int8

    return decode_int8(*args, **config_call(kw))


def real_problem(B: int, S: int, hq: int, hkv: int, d: int, device: str, n_out: int = 8, layout: str = "w24"):
    """A quantised pool from the real write path (K dithered with fp16 outliers, V RTN)."""
    from kvlib.kernels.int8.decode import make_pool_side

    g = torch.Generator().manual_seed(0)
    K = torch.randn(B * S, hkv, d, generator=g)
    K[:, :, :4] *= 8.0  # a few strong channels, bypassed
    V = torch.randn(B * S, hkv, d, generator=g)
    oc = torch.arange(n_out).expand(hkv, n_out).contiguous() if n_out else None
    perm = torch.randperm(B * S, generator=g)
    kp = make_pool_side(K, layer=LAYER, seed=SEED, side=0, slot_ids=perm, outlier_channels=oc, dither_layout=layout)
    vp = make_pool_side(V, layer=LAYER, seed=SEED, side=1, slot_ids=perm, dithered=False)
    move = lambda s: type(s)(s.codes.to(device), s.scales.to(device),  # noqa: E731
                             None if s.outliers is None else s.outliers.to(device),
                             None if s.outlier_channels is None else s.outlier_channels.to(device), s.group,
                             s.dither_layout)
    slots = perm.view(B, S).to(torch.int32).to(device)
    seq = torch.full((B,), S, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, generator=g).to(device)
    return q, move(kp), move(vp), slots, seq


def _agreement(device: str) -> dict:
    from kvlib.kernels.int8.decode import decode_reference

    p = PAPER if device == "cuda" else dict(B=2, S=64, hq=4, hkv=2, d=64)
    q, kp, vp, slots, seq = real_problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], device)
    t0 = time.perf_counter()
    ref = decode_reference(q.cpu(), _cpu(kp), _cpu(vp), slots.cpu(), seq.cpu(), layer=LAYER, seed=SEED)
    out: dict[str, Any] = {"shape": p, "reference_s": time.perf_counter() - t0, "splits": {}}
    refs = {"w24": ref}
    for mode, kw in MODES.items():
        if device != "cuda" and mode != "exact":
            continue
        if LAYOUT[mode] != "w24":  # the same keys and query written through the other dither layout
            gl = kw["impl"] == "gluon"
            q, kp, vp, slots, seq = real_problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], device,
                                                  layout=LAYOUT[mode], n_out=0 if gl else 8)
            if gl:
                q = q.to(torch.bfloat16)
            ref = refs.setdefault(mode if gl else LAYOUT[mode], decode_reference(
                q.cpu(), _cpu(kp), _cpu(vp), slots.cpu(), seq.cpu(), layer=LAYER, seed=SEED, impl="h10"))
        for ns in (1, 2, 8, 32):
            r = _decode_int8(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, num_splits=ns, **kw)
            out["splits"][f"{mode}/{ns}"] = {
                "max_abs_do": float((r.o.double().cpu() - ref.o).abs().max()),
                "max_abs_dlse": float((r.lse.double().cpu() - ref.lse).abs().max()),
                "max_abs_dA": float((r.A.double().cpu() - ref.A).abs().max()),
                "max_abs_dcert": float((r.tv_bound.cpu() - ref.tv_bound).abs().max()),
                "max_abs_dcert_one": float((r.tv_bound_one.cpu() - ref.tv_bound_one).abs().max()),
            }
    out["cert_range"] = [float(refs["w24"].tv_bound.min()), float(refs["w24"].tv_bound.max())]
    for lay in ("h10", "h8", "h8g"):
        if lay in refs:
            out[f"cert_range_{lay}"] = [float(refs[lay].tv_bound.min()), float(refs[lay].tv_bound.max())]
            if lay != "h8g":  # h8g's problem has no bypassed channels and bf16 queries: not the w24 one's keys
                out[f"cert_{lay}_over_w24_max"] = float((refs[lay].tv_bound / refs["w24"].tv_bound).max())
    return out


def _cpu(side):
    return type(side)(side.codes.cpu(), side.scales.cpu(), None if side.outliers is None else side.outliers.cpu(),
                      None if side.outlier_channels is None else side.outlier_channels.cpu(), side.group,
                      side.dither_layout)


def _graph_replay(device: str, layout: str = "w24", impl: str = "auto") -> dict:
    """Capture one certified decode step; interleave eager runs and replays; compare bitwise. ``impl="gluon"``:
    the Gluon kernel's problem (no bypassed channels, bf16 queries)."""
    p = PAPER
    gl = impl == "gluon"
    q, kp, vp, slots, seq = real_problem(p["B"], p["S"], p["hq"], p["hkv"], p["d"], device, layout=layout,
                                          n_out=0 if gl else 8)
    q_static = q.to(torch.bfloat16) if gl else q.clone()
    step = lambda: _decode_int8(q_static, kp, vp, slots, seq, layer=LAYER, seed=SEED, num_splits=8,  # noqa: E731
                               impl=impl)
    eager = step()  # compile outside the capture
    torch.cuda.synchronize()
    graph, static_out = capture_graph(step, warmup_iters=1)
    fields = ("o", "lse", "A", "B", "tv_bound")
    identical = []
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        e = step()
        identical.append(all(torch.equal(getattr(static_out, f), getattr(e, f)) for f in fields)
                         and all(torch.equal(getattr(static_out, f), getattr(eager, f)) for f in fields))
    # a certificate at every captured step: new queries copied into the static buffer
    g = torch.Generator(device="cpu").manual_seed(1)
    certs = []
    for _ in range(8):
        q_static.copy_(torch.randn(q.shape, generator=g).to(device, q_static.dtype))
        graph.replay()
        certs.append(static_out.tv_bound.clone())
    torch.cuda.synchronize()
    c = torch.stack(certs)
    return {"interleaved_replays": len(identical), "bit_identical": all(identical), "per_replay": identical,
            "steps": len(certs), "certs_per_step": int(c[0].numel()),
            "finite_cert_every_step": bool(torch.isfinite(c).all()), "cert_max": float(c.max())}


def random_pools(B: int, S: int, hkv: int, d: int, device: str, group: int = 32):
    """K and V INT8 pools of ``B * S`` slots with random codes and scales (speed does not depend on values)."""
    from kvlib.kernels.int8.decode import PoolSide

    n = B * S
    mk = lambda: PoolSide(  # noqa: E731
        torch.randint(-127, 128, (n, hkv, d), dtype=torch.int8, device=device),
        (torch.rand(n, hkv, d // group, device=device) * 0.02 + 0.005).half(), group=group)
    return mk(), mk()


def _graph_ms(fn, rep_ms: float) -> dict:
    """Median time of ``fn`` replayed from a CUDA graph (no host launch overhead); errors are recorded."""
    try:
        graph, _ = capture_graph(fn, warmup_iters=1)
        return bench_ms(graph.replay, rep_ms=rep_ms).as_dict()
    except Exception as e:  # noqa: BLE001 - keep the eager timings
        return {"median_ms": float("nan"), "error": str(e)[:200]}


def _latency_one(device: str, B: int, S: int, hq: int, hkv: int, d: int, rep_ms: float) -> dict:
    """All timings of one shape (a function scope, so its tensors are freed on return)."""
    from kvlib.kernels.bf16.decode import decode_bf16
    kp, vp = random_pools(B, S, hkv, d, device)
    pools = {lay: dataclasses.replace(kp, dither_layout=lay) for lay in ("w24", "h10", "h8")}  # same codes
    slots = torch.arange(B * S, dtype=torch.int32, device=device).view(B, S)
    seq = torch.full((B,), S, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, device=device)
    qb = q.to(torch.bfloat16)
    kb = (kp.codes.float() * 0.01).to(torch.bfloat16)
    vb = (vp.codes.float() * 0.01).to(torch.bfloat16)
    # torch SDPA over contiguous [B, H_kv, S, d] (its best case: no paging)
    k4 = kb.view(B, S, hkv, d).transpose(1, 2).contiguous()
    v4 = vb.view(B, S, hkv, d).transpose(1, 2).contiguous()
    q4 = qb.view(B, hq, 1, d)
    t: dict[str, Any] = {}
    t["sdpa_bf16"] = bench_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True), rep_ms=rep_ms).as_dict()
    t["ours_bf16"] = bench_ms(lambda: decode_bf16(qb, kb, vb, slots, seq), rep_ms=rep_ms).as_dict()
    for mode, kw in MODES.items():
        base = dict(layer=LAYER, seed=SEED, **kw)
        kpm = pools[LAYOUT[mode]]
        for name, cert, cert_b in (("int8", False, False), ("int8_cert_A", True, False), ("int8_cert_AB", True, True)):
            fn = lambda c=cert, cb=cert_b, kw=base, kpm=kpm: _decode_int8(qb, kpm, vp, slots, seq, cert=c,  # noqa: E731
                                                                         cert_b=cb, **kw)
            t[f"{name}_{mode}"] = bench_ms(fn, rep_ms=rep_ms).as_dict()
        off = t[f"int8_{mode}"]["median_ms"]
        t[f"cert_cost_A_{mode}"] = t[f"int8_cert_A_{mode}"]["median_ms"] / off - 1
        t[f"cert_cost_AB_{mode}"] = t[f"int8_cert_AB_{mode}"]["median_ms"] / off - 1
        t[f"speedup_vs_sdpa_cert_A_{mode}"] = t["sdpa_bf16"]["median_ms"] / t[f"int8_cert_A_{mode}"]["median_ms"]
    # the same steps replayed from CUDA graphs (what a serving loop does): host overhead removed
    t["sdpa_bf16_graph"] = _graph_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True), rep_ms)
    fast = dict(layer=LAYER, seed=SEED, **MODES["fast"])
    t["int8_fast_graph"] = _graph_ms(lambda: _decode_int8(qb, kp, vp, slots, seq, cert=False, **fast), rep_ms)
    t["int8_cert_A_fast_graph"] = _graph_ms(
        lambda: _decode_int8(qb, kp, vp, slots, seq, cert=True, cert_b=False, **fast), rep_ms)
    for m in GRAPHED:
        kw_m, kp_m = dict(layer=LAYER, seed=SEED, **MODES[m]), pools[LAYOUT[m]]
        t[f"int8_{m}_graph"] = _graph_ms(
            lambda kw_m=kw_m, kp_m=kp_m: _decode_int8(qb, kp_m, vp, slots, seq, cert=False, **kw_m), rep_ms)
        t[f"int8_cert_A_{m}_graph"] = _graph_ms(
            lambda kw_m=kw_m, kp_m=kp_m: _decode_int8(qb, kp_m, vp, slots, seq, cert=True, cert_b=False, **kw_m),
            rep_ms)
    h10 = dict(layer=LAYER, seed=SEED, **MODES["h10"])
    t["int8_cert_A_h10_nophilox"] = bench_ms(
        lambda: _decode_int8(qb, pools["h10"], vp, slots, seq, cert=True, cert_b=False, skip_philox=True, **h10),
        rep_ms=rep_ms).as_dict()
    int8_bytes = 2 * B * S * hkv * (d + 2 * d // 32)
    bf16_bytes = 2 * B * S * hkv * d * 2
    gbps = {m: int8_bytes / (t[f"int8_cert_A_{m}"]["median_ms"] * 1e-3) / 1e9 for m in MODES}
    return {"timings": t, "int8_bytes": int8_bytes, "bf16_bytes": bf16_bytes, "int8_GBps_cert_A": gbps,
            "sdpa_GBps": bf16_bytes / (t["sdpa_bf16"]["median_ms"] * 1e-3) / 1e9}


def _latency(device: str, shapes: list[tuple[int, int]], hq: int, hkv: int, d: int, rep_ms: float) -> list[dict]:
    rows = []
    for B, S in shapes:
        row: dict[str, Any] = {"B": B, "S": S, "hq": hq, "hkv": hkv, "d": d}
        try:
            row.update(_latency_one(device, B, S, hq, hkv, d, rep_ms))
        except torch.cuda.OutOfMemoryError as e:  # keep the other shapes
            row["error"] = f"out of memory: {e}"
        torch.cuda.empty_cache()
        rows.append(row)
        timings = row.get("timings", {})
        print(f"   latency B={B} S={S}: " + ", ".join(
            f"{k}={v['median_ms']:.4f}" for k, v in timings.items() if isinstance(v, dict)), flush=True)
    return rows


def run(profile: str) -> dict:
    """Run the benchmark; ``profile`` is ``ci``/``cpu`` (wiring check) or ``gpu`` (the real measurement)."""
    device = profile_device(profile)
    cuda = device == "cuda"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                           "modes": {m: dict(kw) for m, kw in MODES.items()}}
    t0 = time.perf_counter()
    if not cuda:
        import os

        interp = os.environ.get("TRITON_INTERPRET") == "1"
        res["note"] = "CPU wiring check: no speed claim" + ("" if interp else " (kernels fall back to torch)")
        res["agreement"] = _agreement(device)
        return res
    res["agreement"] = _agreement(device)
    print(f"   agreement done ({time.perf_counter() - t0:.1f}s)", flush=True)
    res["cuda_graph"] = _graph_replay(device)
    res["cuda_graph_h10"] = _graph_replay(device, layout="h10")
    res["cuda_graph_h8"] = _graph_replay(device, layout="h8")
    res["cuda_graph_h8g"] = _graph_replay(device, layout="h8", impl="gluon")
    print(f"   graph replay: {res['cuda_graph']['bit_identical']}, h10 {res['cuda_graph_h10']['bit_identical']}, "
          f"h8 {res['cuda_graph_h8']['bit_identical']}, h8g {res['cuda_graph_h8g']['bit_identical']}",
          flush=True)
    shapes = [(PAPER["B"], PAPER["S"])] + LONG
    res["latency"] = _latency(device, shapes, PAPER["hq"], PAPER["hkv"], PAPER["d"], rep_ms=100.0)
    long = [r for r in res["latency"] if r["S"] >= 16384 and "timings" in r]
    if long:
        res["summary"] = {
            "min_speedup_vs_sdpa_S>=16k": {m: min(r["timings"][f"speedup_vs_sdpa_cert_A_{m}"] for r in long)
                                           for m in MODES},
            "max_cert_cost_A": {m: max(r["timings"][f"cert_cost_A_{m}"] for r in res["latency"] if "timings" in r)
                                for m in MODES},
            "median_cert_cost_A": {m: float(torch.tensor([r["timings"][f"cert_cost_A_{m}"] for r in res["latency"]
                                                          if "timings" in r]).median()) for m in MODES},
        }
        for m in GRAPHED:
            graphed = [r for r in res["latency"] if "timings" in r and f"int8_cert_A_{m}_graph" in r["timings"]]
            if graphed:  # CUDA-graph timings: no host launch overhead (eager timings of sub-0.3 ms steps carry it)
                g = lambda r, k: r["timings"][k]["median_ms"]  # noqa: E731
                res["summary"][f"{m}_graph"] = {
                    "min_speedup_vs_sdpa_S>=16k": min(g(r, "sdpa_bf16_graph") / g(r, f"int8_cert_A_{m}_graph")
                                                      for r in graphed if r["S"] >= 16384),
                    "cert_cost_A": [g(r, f"int8_cert_A_{m}_graph") / g(r, f"int8_{m}_graph") - 1 for r in graphed],
                }
    res["runtime_s"] = time.perf_counter() - t0
    if not math.isfinite(res["runtime_s"]):
        raise RuntimeError("bad clock")
    return res
