"""What does KV4-RL cost over KV4, and where does it go? On the GPU: KV4-RL (its protected region one extra program per
request and kv head) timed from CUDA graphs beside KV4 at the kv4 benchmark's fixed shapes, with an accuracy check
against the torch reference. (It first compared that layout with the protected region run by the last INT4 split,
since removed: dev/results/kv4_prot_last.json.) ``--block-p``: side slots per protected step; ``--decompose``:
KV4-RL's extra time split into its structure (extra programs, merge launch: timed with an empty side buffer) and its
protected work; ``--edges``: the main region's unaligned edge blocks peeled or pipelined
(``KV4KernelConfig.pipe_edges``); ``--fuse``: the variants of :data:`FUSE_VARIANTS` (split plans, the merge inside
the decode launch: ``KV4KernelConfig`` fields) beside the defaults."""

from __future__ import annotations

import datetime
import sys

import torch

from dev.probe_kit import write_probe
from kvlib.bench.kv4 import HKV, HQ, RECENT, SINK, D, graphed_ms, random_kv4_batch
from kvlib.bench.timing import interleaved
from kvlib.kernels.int4.attention import build_kv4_batch, decode_ref, kv4_decode, kv4rl_decode
from kvlib.kernels.int4.decode import DEFAULT_CONFIG

SHAPES = ((32, 1024), (32, 4096), (32, 16384), (128, 1024), (128, 16384), (512, 1024), (512, 4096))
#: variants of the fused KV4-RL launch timed against KV4 (``--block-p``: side slots per protected step)
MODES = {"own": {}}
BLOCK_P = {"own_bp32": dict(block_p=32), "own_bp64": dict(block_p=64), "own_bp128": dict(block_p=128),
           "own_bp256": dict(block_p=256)}


def _shape_row(b: int, n: int, variants: dict) -> dict:
    """KV4 and KV4-RL in both protected-region modes at batch ``b``, context ``n`` (CUDA-graph medians)."""
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    cache = random_kv4_batch(lengths, n)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    kv4_ms = graphed_ms(lambda: kv4_decode(q, cache))[0]
    row = dict(batch=b, ctx=n, kv4_ms=kv4_ms)
    for mode, kw in variants.items():
        cfg = DEFAULT_CONFIG.replace(**kw)
        ms = graphed_ms(lambda cfg=cfg: kv4rl_decode(q, cache, config=cfg))[0]
        row[f"kv4rl_{mode}_ms"] = ms
        row[f"frac_{mode}"] = kv4_ms / ms
    return row


def _empty_side_problem(b: int, n: int) -> tuple:
    """``(q, cache, launch)`` at batch ``b``, context ``n``: ``launch()`` is the KV4-RL decode launch with an empty
    side buffer (its extra programs and merge, no protected work); ``launch(side=False)`` the KV4 launch over the
    same main region (its unaligned edges, no protected path)."""
    from kvlib.kernels.int4.attention import side_buffer
    from kvlib.kernels.int4.decode import kv4_main_decode, plan_kv4_decode, prepare_query

    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    c = random_kv4_batch(lengths, n)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    empty = side_buffer(c)._replace(count=torch.zeros(b, dtype=torch.int32, device="cuda"))
    start, end = c.main_range()

    def launch(side: bool = True, part: str = "all"):
        """``part="all"``: the whole decode; timing only (wrong results): ``"no_merge"`` the decode launch with
        its state 0 taken for the output (no merge launch), ``"no_prot"`` the same launch without its protected
        programs (the kernel compiled with the protected path; the merge in the launch off, as no program
        arrives for the protected state)."""
        qp = prepare_query(q, rotate=True)
        args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, end)
        cfg = None if side else DEFAULT_CONFIG.replace(pipe_edges=True)  # KV4-RL's edges
        if part == "all":
            return kv4_main_decode(*args, side=empty if side else None, config=cfg)
        if part == "no_prot":
            cfg = (cfg or DEFAULT_CONFIG).replace(fuse_merge=False)
        lp = plan_kv4_decode(*args, side=empty if side else None, config=cfg)
        lp.launch(grid=(b, lp.grid[1], lp.splits) if part == "no_prot" else None)
        return (lp.o, lp.lse) if lp.fuse else (lp.o_s[:, :, 0], lp.lse_s[:, :, 0])

    return q, c, launch


def _decompose_row(b: int, n: int) -> dict:
    """KV4, KV4-RL with an empty side buffer (its extra programs and merge launch, no protected work) and
    KV4-RL, at the default configuration: what the structure costs and what the protected work costs."""
    q, cache, structure_only = _empty_side_problem(b, n)
    row = dict(batch=b, ctx=n, kv4_ms=graphed_ms(lambda: kv4_decode(q, cache))[0],
               kv4rl_empty_side_ms=graphed_ms(structure_only)[0],
               kv4rl_ms=graphed_ms(lambda: kv4rl_decode(q, cache))[0])
    row["structure_ms"] = row["kv4rl_empty_side_ms"] - row["kv4_ms"]
    row["protected_work_ms"] = row["kv4rl_ms"] - row["kv4rl_empty_side_ms"]
    row["frac"] = row["kv4_ms"] / row["kv4rl_ms"]
    return row


EDGE_SHAPES = ((32, 1024, None), (32, 4096, None), (32, 16384, None), (128, 16384, None), (8, 32768, None),
               (512, 4096, None), (320, 16384, 4000.0))


#: KV4-RL variants timed beside the edges pair; the runs of record timed a third CTA per SM (registers capped at
#: 168; dev/results/kv4rl_edges.json) and ``fold_side``, the side slots' state computed by split 0 and carried into its
#: INT4 loop with no extra program and no merge at one split (dev/results/kv4rl_fold.json, c42c10d): both lost and were
#: removed, as was ``side_merge``, the side slots attended by a persistent merge launch meant to overlap the INT4
#: wave (dev/results/kv4rl_side_merge.json, 8379906)
EDGE_EXTRA: dict = {}


def _edges_row(b: int, n: int, mean: float | None, rounds: int = 3) -> dict:
    """KV4 and KV4-RL with the edge blocks peeled (the default) and inside the pipelined loop (``pipe_edges``),
    timed in ``rounds`` interleaved rounds (rotated order, median per variant): a KV4-RL main region is
    unaligned at both ends, so its first and last blocks run outside the software pipeline by default. Also the
    largest output change of ``pipe_edges`` against the default (the same arithmetic per block)."""
    from dev.kv4_sweep import _lengths

    shape = dict(b=b, n=n) if mean is None else dict(b=b, n=n, mean=mean, seed=2)
    lengths = _lengths(shape, "cuda")
    cache = random_kv4_batch(lengths, int(lengths.max()))
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    pe = DEFAULT_CONFIG.replace(pipe_edges=True)
    pe_peel = DEFAULT_CONFIG.replace(pipe_edges=False)
    fns = {"kv4": lambda: kv4_decode(q, cache, config=pe_peel),
           "kv4_pipe_edges": lambda: kv4_decode(q, cache, config=pe),
           "kv4rl": lambda: kv4rl_decode(q, cache, config=pe_peel),
           "kv4rl_pipe_edges": lambda: kv4rl_decode(q, cache, config=pe)}
    for key, cfg in EDGE_EXTRA.items():
        fns[key] = lambda cfg=cfg: kv4rl_decode(q, cache, config=cfg)
    row: dict = dict(batch=b, ctx=n, ctx_mean=float(lengths.float().mean()))
    for key, (f0, f1) in (("kv4", ("kv4", "kv4_pipe_edges")), ("kv4rl", ("kv4rl", "kv4rl_pipe_edges"))):
        (o0, l0), (o1, l1) = fns[f0](), fns[f1]()
        row[f"{key}_max_do"] = float((o1 - o0).abs().max())
        row[f"{key}_max_dlse"] = float((l1 - l0).abs().max())
    times = interleaved({k: (lambda f=f: graphed_ms(f)[0]) for k, f in fns.items()}, rounds, strict=True)
    for k, (med, per_round) in times.items():
        row[f"{k}_ms"] = med
        row[f"{k}_rounds_ms"] = per_round
    row["frac"] = row["kv4_ms"] / row["kv4rl_ms"]
    row["frac_pipe_edges"] = row["kv4_ms"] / row["kv4rl_pipe_edges_ms"]
    row["frac_both_pipe_edges"] = row["kv4_pipe_edges_ms"] / row["kv4rl_pipe_edges_ms"]
    for key in EDGE_EXTRA:
        row[f"frac_{key}"] = row["kv4_ms"] / row[f"{key}_ms"]
    return row


#: ``--fuse``: KV4 and KV4-RL variants timed beside the defaults (``KV4KernelConfig`` fields): here KV4-RL forced to two
#: splits (merge launch, fused) and its one split fused. The runs of record also timed, each slower and removed:
#: ``fuse_merge=True`` for KV4 and KV4-RL (kept as the default at two or more splits; dev/results/kv4rl_fuse*.json);
#: KV4-RL's side launch (``side_launch`` with ``side_warps``/``side_block``/``side_maxnreg``/``num_stages`` and
#: ``carveout`` variants; dev/results/kv4rl_side*.json, code at ee8fef6..fd69296); an edge program (``edge_program``:
#: the main region's partial blocks in one more program per pair, the splits on KV4's unmasked interior loop;
#: dev/results/kv4rl_edge.json, code at 55fcf8e); and the edge mask as a -inf bias folded into the offset multiply-add
#: (``pipe_bias`` 1: from one branch before the arithmetic, 2: from a table, no branch; dev/results/kv4rl_bias.json,
#: code at 032f913)
FUSE_VARIANTS = {
    "kv4rl_s2": ("kv4rl", dict(num_splits=2)),
    "kv4rl_s2_fused": ("kv4rl", dict(num_splits=2, fuse_merge=True)),
    "kv4rl_s1_fused": ("kv4rl", dict(fuse_merge=True)),
}


def _fuse_row(b: int, n: int, mean: float | None, rounds: int = 3) -> dict:
    """KV4 and KV4-RL at the default configuration beside :data:`FUSE_VARIANTS` in ``rounds`` interleaved
    rounds; also each variant's largest output change against its default and whether CUDA-graph replays of it are
    bit-identical to its eager call."""
    from dev.kv4_sweep import _lengths
    from kvlib.bench.timing import capture_graph

    shape = dict(b=b, n=n) if mean is None else dict(b=b, n=n, mean=mean, seed=2)
    lengths = _lengths(shape, "cuda")
    cache = random_kv4_batch(lengths, int(lengths.max()))
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    decode = {"kv4": kv4_decode, "kv4rl": kv4rl_decode}
    fns = {"kv4": lambda: kv4_decode(q, cache), "kv4rl": lambda: kv4rl_decode(q, cache)}
    for key, (base, kw) in FUSE_VARIANTS.items():
        cfg = DEFAULT_CONFIG.replace(**kw)
        fns[key] = lambda f=decode[base], cfg=cfg: f(q, cache, config=cfg)
    row: dict = dict(batch=b, ctx=n, ctx_mean=float(lengths.float().mean()))
    from kvlib.kernels.int4.attention import side_buffer
    from kvlib.kernels.int4.decode import plan_kv4_decode, prepare_query

    for key, (base, kw) in FUSE_VARIANTS.items():
        (o0, l0), (o1, l1) = fns[base](), fns[key]()
        # the launch fns[key] made, planned again on the same inputs: its compiled kernel's registers and smem
        main = cache.main_range() if base == "kv4rl" else (torch.zeros_like(cache.lengths), cache.lengths)
        lp = plan_kv4_decode(prepare_query(q), cache.k_codes, cache.k_scale, cache.k_off, cache.v_codes,
                             cache.v_scale, cache.v_off, *main, side=side_buffer(cache) if base == "kv4rl" else None,
                             config=DEFAULT_CONFIG.replace(**kw))
        lp.run()
        row[f"{key}_decode_regs_smem"] = [lp.kernel.n_regs, lp.kernel.metadata.shared]
        row[f"{key}_max_do"] = float((o1 - o0).abs().max())
        row[f"{key}_max_dlse"] = float((l1 - l0).abs().max())
        graph, (og, lg) = capture_graph(fns[key])
        same = True
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            same &= bool(torch.equal(og, o1) and torch.equal(lg, l1))
        row[f"{key}_graph_bit_identical"] = same
        del graph
    times = interleaved({k: (lambda f=f: graphed_ms(f)[0]) for k, f in fns.items()}, rounds, strict=True)
    for k, (med, per_round) in times.items():
        row[f"{k}_ms"] = med
        row[f"{k}_rounds_ms"] = per_round
    row["frac"] = row["kv4_ms"] / row["kv4rl_ms"]
    for key, (base, _) in FUSE_VARIANTS.items():
        if base == "kv4rl":
            row[f"frac_{key}"] = row["kv4_ms"] / row[f"{key}_ms"]
    return row


def _structure_row(b: int, n: int) -> dict:
    """Where KV4-RL's structure goes (empty side buffer, so no protected work), on one cache: KV4 over KV4-RL's main
    region (its edges alone), the decode launch without its protected programs (``launch(part="no_prot")``) and
    with them (each with its split merge replaced by a view of the first state: timing only), the split merge
    alone on states of the same shape, beside KV4 and the whole KV4-RL launch with the empty buffer."""
    from kvlib.kernels.tl.merge import merge_splits

    q, cache, launch = _empty_side_problem(b, n)
    row = dict(batch=b, ctx=n, kv4_ms=graphed_ms(lambda: kv4_decode(q, cache))[0],
               kv4rl_empty_side_ms=graphed_ms(launch)[0])
    row["kv4_main_region_ms"] = graphed_ms(lambda: launch(side=False))[0]
    row["kv4rl_empty_side_no_merge_ms"] = graphed_ms(lambda: launch(part="no_merge"))[0]
    row["kv4rl_compiled_only_ms"] = graphed_ms(lambda: launch(part="no_prot"))[0]
    o_s = torch.randn(b, HQ, 2, D, device="cuda")
    lse_s = torch.randn(b, HQ, 2, device="cuda")
    row["merge_alone_ms"] = graphed_ms(lambda: merge_splits(o_s, lse_s))[0]
    return row


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    rows: list[dict] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.tensor([768, 1, 300, 129, 145, 144, 16, 17], device="cuda")
    b, n = lengths.shape[0], int(lengths.max())
    k = torch.randn(b, HKV, n, D, device="cuda", generator=g)
    v = torch.randn(b, HKV, n, D, device="cuda", generator=g)
    q = torch.randn(b, HQ, D, device="cuda", generator=g)
    cache = build_kv4_batch(k, v, lengths, sink=SINK, recent=RECENT)
    from kvlib.kernels.int4.decode import prepare_query

    o_r, lse_r = decode_ref(q, cache, qp=prepare_query(q))
    modes = {"--structure": (_structure_row, ((32, 16384), (128, 16384), (512, 4096)), "kv4rl_structure.json"),
             "--edges": (_edges_row, EDGE_SHAPES, "kv4rl_edges.json"),
             "--fuse": (_fuse_row, EDGE_SHAPES, "kv4rl_fuse.json"),
             "--decompose": (_decompose_row, ((32, 4096), (32, 16384), (128, 16384), (8, 32768), (512, 4096)),
                             "kv4rl_decompose.json")}
    for flag, (make_row, mode_shapes, default_out) in modes.items():
        if flag not in sys.argv:
            continue
        for args in mode_shapes:
            rows.append(make_row(*args))
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items() if "rounds" not in k},
                  flush=True)
            torch.cuda.empty_cache()
        checks = {"--edges": {"pipe_edges": dict(pipe_edges=True)},
                  "--fuse": {k: kw for k, (base, kw) in FUSE_VARIANTS.items() if base == "kv4rl"}}
        for name, kw in checks.get(flag, {}).items():
            o, lse = kv4rl_decode(q, cache, config=DEFAULT_CONFIG.replace(**kw))
            rows.append(dict(check=name, err_o=float((o - o_r).abs().max()), err_lse=float((lse - lse_r).abs().max())))
            print(rows[-1], flush=True)
        out = next((a for a in sys.argv[1:] if not a.startswith("--")), default_out)
        write_probe(out, "kv4rl_overhead", rows, started,
                    {"command": "python -m dev.kv4rl_overhead " + " ".join(sys.argv[1:]),
                     "config": str(DEFAULT_CONFIG), "shapes": mode_shapes})
        return
    variants = BLOCK_P if "--block-p" in sys.argv else MODES
    shapes = ((32, 1024), (32, 4096), (32, 16384), (128, 16384)) if "--block-p" in sys.argv else SHAPES
    for mode, kw in variants.items():
        o, lse = kv4rl_decode(q, cache, config=DEFAULT_CONFIG.replace(**kw))
        rows.append(dict(check=mode, err_o=float((o - o_r).abs().max()), err_lse=float((lse - lse_r).abs().max())))
        print(rows[-1], flush=True)
    for b, n in shapes:
        rows.append(_shape_row(b, n, variants))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    out = next((a for a in sys.argv[1:] if not a.startswith("--")), "kv4rl_overhead.json")
    write_probe(out, "kv4rl_overhead", rows, started,
                {"command": "python -m dev.kv4rl_overhead " + " ".join(sys.argv[1:]), "shapes": shapes,
                 "variants": variants})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "[OUT.json] [--block-p | --structure | --edges | --fuse | --decompose]")
    main()
