"""How much does paging cost the KV4 kernel? On the GPU: KV4 / KV4-RL decode over a vLLM-style paged pool
(:func:`kvlib.kernels.int4.paged.kv4_paged_decode`) timed side by side with the contiguous launch
(:func:`kvlib.kernels.int4.launch.kv4_main_decode`) on the same codes, under CUDA graphs in interleaved rounds, at
the kv4 benchmark's long shape with Qwen2.5-7B's heads (B=32, S=16k, Hq=28, Hkv=4, d=128), for several page sizes;
prints ``paged / contiguous`` per page size and the largest output difference between the two. Page size 256 takes
the ``"paged-tiles"`` path (the default ``block_n`` is 256), 16 the ``"paged-rows"`` one (the launch records say so).

``PYTHONPATH=. python -m dev.kv4_paged_vs_contiguous [OUT.json]``; ``--sass`` instead compiles the contiguous and paged
kernels for sm_90 without a GPU (:mod:`kvlib.kernels.offline`) and prints their main-loop instruction
counts per thread per tile at this shape (d = 128, GQA 7, Hkv 4) and their commonest opcodes.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch

from kvlib.bench.kv4 import RECENT, SINK, random_kv4_batch
from kvlib.bench.kv4 import paged_kv4_pool as paged_pool  # noqa: F401 (moved into kvlib; the GPU scripts import it here)
from kvlib.bench.timing import bench_graphed, interleaved
from kvlib.kernels.int4.attention import side_buffer
from kvlib.kernels.int4.decode import kv4_main_decode, kv4_paged_decode, plan_kv4_paged_decode, prepare_query

B, S, HQ, HKV, D = 32, 16384, 28, 4, 128
PAGE_SIZES = (16, 256)


def sass_counts() -> dict:
    """Offline sm_90 loop statistics of the contiguous kernel and both paged paths (default config, bytes mode)."""

    from kvlib.bench.sass_count import KV4_POINTERS
    from kvlib.kernels.int4.config import _KMODES, DEFAULT_CONFIG
    from kvlib.kernels.int4.paged import _kv4_paged_kernel
    from kvlib.kernels.int4.region import _kv4_decode_kernel
    from kvlib.kernels.offline import compile_sm90, disassemble, loop_stats

    cfg, g = DEFAULT_CONFIG, HQ // HKV
    common = dict(HKV=HKV, G=g, GP=max(8, 1 << (g - 1).bit_length()), D=D, BLOCK_N=cfg.block_n,
                  TILE_SUMS=cfg.tile_sums, PROT=False, BLOCK_P=cfg.block_p, INTERP=False)
    kernels = {"contiguous": (_kv4_decode_kernel, common | dict(INT_PV=False, KMODE=_KMODES.index("bytes"),
                                                                 SCALE32=True, EVEN=True, TMA=False), KV4_POINTERS)}
    for name, page in (("paged-tiles", 256), ("paged-rows", 16)):
        kernels[name] = (_kv4_paged_kernel, common | dict(PAGE=page, TILES=page % cfg.block_n == 0),
                         KV4_POINTERS | {"BT": "*i32"})
    out = {}
    for name, (kernel, const, ptrs) in kernels.items():
        cc = compile_sm90(kernel, const, ptrs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        out[name] = loop_stats(disassemble(cc)[1])
        print(f"{name}: {out[name]['instructions']} loop instructions per thread per {cfg.block_n}-position tile; "
              f"top opcodes {out[name]['top_opcodes']}", flush=True)
    return out


def main() -> None:
    if "--sass" in sys.argv:
        sass_counts()
        return
    started = datetime.datetime.now(datetime.UTC)
    lengths = torch.full((B,), S, dtype=torch.int32, device="cuda")
    cache = random_kv4_batch(lengths, S, SINK, RECENT, hkv=HKV, d=D)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    zeros = torch.zeros_like(cache.lengths)
    rows = {}
    for kind in ("kv4", "kv4rl"):
        start, end = cache.main_range() if kind == "kv4rl" else (zeros, cache.lengths)
        side = side_buffer(cache) if kind == "kv4rl" else None
        cargs = (cache.k_codes, cache.k_scale, cache.k_off, cache.v_codes, cache.v_scale, cache.v_off, start, end)
        fns = {"contiguous": lambda cargs=cargs, side=side: kv4_main_decode(prepare_query(q), *cargs, side=side)}
        pools = {bs: paged_pool(cache, bs) for bs in PAGE_SIZES}
        for bs, p in pools.items():
            pargs = (p["k_codes"], p["k_scale"], p["k_off"], p["v_codes"], p["v_scale"], p["v_off"], p["block_table"],
                     start, end)
            fns[f"paged_bs{bs}"] = lambda pargs=pargs, bs=bs, side=side: kv4_paged_decode(
                prepare_query(q), *pargs, block_size=bs, side=side)
        o_c, lse_c = fns["contiguous"]()
        row: dict = {}
        for name, fn in fns.items():
            if name != "contiguous":
                o, lse = fn()
                row[f"{name}_max_abs_do"] = float((o - o_c).abs().max())
                row[f"{name}_max_abs_dlse"] = float((lse - lse_c).abs().max())
                bs = int(name.removeprefix("paged_bs"))
                p = pools[bs]
                lp = plan_kv4_paged_decode(prepare_query(q), p["k_codes"], p["k_scale"], p["k_off"], p["v_codes"],
                                           p["v_scale"], p["v_off"], p["block_table"], start, end, block_size=bs,
                                           side=side)
                lp.run()
                row[f"{name}_launch"] = dict(path=lp.path, splits=lp.splits, merge=lp.merge, regs=lp.kernel.n_regs,
                                             spills=lp.kernel.n_spills)
        graphed = {}

        def timer(fn, name, graphed=graphed):
            def run():
                t = bench_graphed(fn, warmup_ms=10, rep_ms=60)
                graphed[name] = t["graphed"]
                return t["median_ms"]
            return run

        times = interleaved({n: timer(f, n) for n, f in fns.items()}, 3, strict=True)
        for name, (med, per_round) in times.items():
            row[f"{name}_ms"] = med
            row[f"{name}_rounds_ms"] = per_round
        row["graphed"] = graphed
        for bs in PAGE_SIZES:
            row[f"ratio_paged_bs{bs}"] = row[f"paged_bs{bs}_ms"] / row["contiguous_ms"]
            print(f"{kind} B={B} S={S} Hq={HQ} Hkv={HKV} d={D}: contiguous {row['contiguous_ms']:.4f} ms, "
                  f"paged block_size={bs} ({row[f'paged_bs{bs}_launch']['path']}) {row[f'paged_bs{bs}_ms']:.4f} ms, "
                  f"paged/contiguous "
                  f"{row[f'ratio_paged_bs{bs}']:.3f}, max |do| {row[f'paged_bs{bs}_max_abs_do']:.2e}", flush=True)
        rows[kind] = row
    out = dict(started=started.isoformat(), device=torch.cuda.get_device_name(), shape=dict(B=B, S=S, Hq=HQ, Hkv=HKV,
               d=D, sink=SINK, recent=RECENT), rows=rows)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
