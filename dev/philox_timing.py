"""The dither's price on the GPU (issue 28): the certified Gluon h8 INT8 decode with each key-dither generator
(Philox4x32-10, the default; Philox4x32-8, -7 and -6; Threefry4x32-13 and -20) and with no generator at all
(``skip_philox``: the counter words themselves, a wrong dither; the upper bound on what the dither costs), side by
side with SDPA bf16, CUDA graphs, interleaved rounds, at B = 8 and 32, S = 16k, 28 query / 4 KV heads, d = 128.

First an agreement check per generator: keys quantised with that generator's h8 dither
(:func:`kvlib.core.philox.dither`), the Gluon and the Triton h10 kernels run with ``config.generator`` set to it
and compared with float64 attention over the same dequantised keys (``do_same``), and, as the control that the
check can fail, with float64 attention over the keys dequantised with Philox4x32-10's dither (``do_cross``; for a
generator other than Philox4x32-10 it must be far larger). ``python -m dev.philox_timing [OUT.json] [--quick]``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import sys

import torch

GENERATORS = ("philox4x32-10", "philox4x32-8", "philox4x32-7", "philox4x32-6", "threefry4x32-13", "threefry4x32-20")
SHAPES = ((8, 16384, 28, 4), (32, 16384, 28, 4))
LAYER, SEED = 5, 0x0123_4567_89AB_CDEF


def gen_pool(K: torch.Tensor, slot_ids: torch.Tensor, generator: str, group: int = 32):
    """A dithered h8 key pool side of ``K [T, H_kv, d]`` at ``slot_ids`` whose dither comes from ``generator``
    (the write path's quantiser, :func:`kvlib.formats.dither_int8.quantize_codes`, with that generator's dither)."""
    from kvlib.core.philox import dither
    from kvlib.formats.dither_int8 import group_scales, quantize_codes
    from kvlib.kernels.int8.request import PoolSide

    T, hkv, d = K.shape
    n = int(slot_ids.max()) + 1
    codes = torch.zeros(n, hkv, d, dtype=torch.int8)
    scales = torch.zeros(n, hkv, d // group, dtype=torch.float16)
    for h in range(hkv):
        x = K[:, h].float()
        xi = dither(slot_ids, d, layer=LAYER, kv_head=h, seed=SEED, side=0, layout="h8", generator=generator)
        s16 = group_scales(x, group)
        codes[slot_ids, h] = quantize_codes(x, s16, xi, group)
        scales[slot_ids, h] = s16
    return PoolSide(codes, scales, None, None, group, "h8", True)


def dequant(side, generator: str) -> torch.Tensor:
    """float64 ``[n_slots, H_kv, d]``: ``s (c - xi)`` with ``generator``'s h8 dither at every slot."""
    from kvlib.core.philox import dither

    n, hkv, d = side.codes.shape
    out = torch.empty(n, hkv, d, dtype=torch.float64)
    slots = torch.arange(n)
    for h in range(hkv):
        xi = dither(slots, d, layer=LAYER, kv_head=h, seed=SEED, side=0, layout="h8", generator=generator)
        s = side.scales[:, h].cpu().double().repeat_interleave(side.group, -1)
        out[:, h] = s * (side.codes[:, h].cpu().double() - xi.double())
    return out


def attention64(q, Kh, Vh, slots, seq):
    """float64 GQA attention of ``q [B, hq, d]`` over dequantised ``Kh``/``Vh [n, hkv, d]`` at ``slots``."""
    B, hq, d = q.shape
    gqa = hq // Kh.shape[1]
    o = torch.zeros(B, hq, d, dtype=torch.float64)
    lse = torch.zeros(B, hq, dtype=torch.float64)
    for b in range(B):
        sl = slots[b, : int(seq[b])].long().cpu()
        for h in range(hq):
            z = Kh[sl, h // gqa] @ q[b, h].double().cpu() / math.sqrt(d)
            lse[b, h] = torch.logsumexp(z, 0)
            o[b, h] = torch.softmax(z, 0) @ Vh[sl, h // gqa]
    return o, lse


def agreement(gens=GENERATORS, impls=("gluon", "h10"), *, B=3, S=300, hq=28, hkv=4, dev="cuda") -> list[dict]:
    from kvlib.kernels.int8.config import DEFAULT_CONFIG
    from kvlib.kernels.int8.decode import decode_int8, make_pool_side

    d = 128
    g = torch.Generator().manual_seed(7)
    K = torch.randn(B * S, hkv, d, generator=g)
    K[:, :, 3] *= 20.0  # a massive channel (kept in the scales: no outlier bypass here)
    V = torch.randn(B * S, hkv, d, generator=g)
    slot_ids = torch.randperm(B * S + 5, generator=g)[: B * S]
    vp = make_pool_side(V, layer=LAYER, seed=SEED, side=1, slot_ids=slot_ids, n_slots=int(slot_ids.max()) + 1,
                        dithered=False)
    Vh = (vp.scales.double().repeat_interleave(32, -1) * vp.codes.double())
    slots = slot_ids.view(B, S).to(torch.int32)
    seq = torch.tensor([S, S // 2 + 3, min(17, S)][:B], dtype=torch.int32)  # ragged rows
    q = (3 * torch.randn(B, hq, d, generator=g)).to(torch.bfloat16)
    rows = []
    for gen in gens:
        kp = gen_pool(K, slot_ids, gen)
        o_same, lse_same = attention64(q, dequant(kp, gen), Vh, slots, seq)
        o_x, _ = attention64(q, dequant(kp, "philox4x32-10"), Vh, slots, seq)
        kd = dataclasses.replace(kp, codes=kp.codes.to(dev), scales=kp.scales.to(dev))
        vd = dataclasses.replace(vp, codes=vp.codes.to(dev), scales=vp.scales.to(dev))
        for impl in impls:
            row = dict(kind="agreement", generator=gen, impl=impl, B=B, S=S, hq=hq, hkv=hkv)
            try:
                r = decode_int8(q.to(dev), kd, vd, slots.to(dev), seq.to(dev), layer=LAYER, seed=SEED, impl=impl,
                                cert_b=False, config=DEFAULT_CONFIG.replace(generator=gen))
                o = r.o.double().cpu()
                row |= dict(path=r.path, do_same=float((o - o_same).abs().max()),
                            dlse_same=float((r.lse.double().cpu() - lse_same).abs().max()),
                            do_cross=float((o - o_x).abs().max()), tv_bound_max=float(r.tv_bound.max()))
                row["ok"] = row["path"] == impl and row["do_same"] < 2e-3 and (
                    gen == "philox4x32-10" or row["do_cross"] > 10 * row["do_same"])
            except Exception as e:  # reported, not fatal: the timing still runs
                row |= dict(ok=False, error=f"{type(e).__name__}: {str(e)[-300:]}")
            rows.append(row)
            print(row, flush=True)
    return rows


def timings(shapes=SHAPES, rounds: int = 3, gens=GENERATORS) -> list[dict]:
    from dev.probe_kit import h10_problem, sdpa_graph_ms
    from kvlib.bench.timing import bench_graphed, interleaved
    from kvlib.kernels.int8.config import DEFAULT_CONFIG
    from kvlib.kernels.int8.decode import decode_int8

    def graph_ms(fn) -> float:
        return bench_graphed(fn, warmup_ms=5.0, rep_ms=30.0)["median_ms"]

    rows = []
    for B, S, hq, hkv in shapes:
        qb, kp, vp, slots, seq = h10_problem(B, S, hq, hkv)
        kp = dataclasses.replace(kp, dither_layout="h8")  # random codes: the timing does not depend on the values
        sd = sdpa_graph_ms(qb.view(B, hq, 1, 128), hkv, S)
        step = functools.partial(decode_int8, qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="gluon",
                                 cert=True, cert_b=False)
        var = {f"gluon_cert_{g}": functools.partial(step, config=DEFAULT_CONFIG.replace(generator=g)) for g in gens}
        var["gluon_cert_skip_philox"] = functools.partial(step, config=DEFAULT_CONFIG.replace(skip_philox=True))
        var["sdpa_bf16_same_round"] = functools.partial(
            sdpa_graph_ms, qb.view(B, hq, 1, 128), hkv, S)  # SDPA inside the rotation too (drift check)
        timers = {n: (functools.partial(graph_ms, fn) if not n.startswith("sdpa") else fn) for n, fn in var.items()}
        ms = interleaved(timers, rounds)
        base = ms["gluon_cert_philox4x32-10"][0]
        sd = ms["sdpa_bf16_same_round"][0] or sd  # SDPA's median over the same interleaved rounds
        for name, (med, per_round) in ms.items():
            rows.append(dict(kind="timing", B=B, S=S, hq=hq, hkv=hkv, d=128, name=name, ms=med, sdpa_ms=sd,
                             vs_sdpa=sd / med if med else None, vs_philox10=med / base if med and base else None,
                             rounds=per_round))
            print(rows[-1], flush=True)
        del qb, kp, vp, slots, seq, var, timers
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from dev.probe_kit import write_probe

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick = "--quick" in sys.argv
    started = datetime.datetime.now(datetime.UTC)
    # the Gluon kernel (timed below) at every generator; the Triton h10 kernel at the default and the candidate
    # Philox4x32-8 (the CPU interpreter covers it at every generator: tests/test_philox_generators.py)
    out = args[0] if args else "philox_timing.json"
    params = {"command": "python -m dev.philox_timing", "shapes": SHAPES, "generators": GENERATORS}
    rows = agreement(impls=("gluon",)) + agreement(gens=("philox4x32-10", "philox4x32-8"), impls=("h10",))
    write_probe(out, "philox_timing", rows, started, params)  # after each phase: a timed-out run keeps its rows
    for shape in SHAPES[:1] if quick else SHAPES:
        rows += timings(shapes=(shape,), rounds=2 if quick else 3)
        write_probe(out, "philox_timing", rows, started, params)
    ok = all(r.get("ok") for r in rows if r["kind"] == "agreement")
    t = {(r["B"], r["name"]): r for r in rows if r["kind"] == "timing"}
    f = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    for (B, name), r in sorted(t.items()):
        print(f"B={B:3d} {name:34s} {f(r['ms'], '.4f')} ms  x{f(r['vs_sdpa'], '.3f')} SDPA  "
              f"{f(r['vs_philox10'], '.3f')} of Philox-10")
    print(("PASS" if ok else "FAIL") + " philox agreement (every generator in the Gluon and h10 kernels vs float64)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "[OUT.json] [--quick]")
    main()
