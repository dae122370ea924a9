"""Instruction counts of the INT8 decode kernels' main loops, compiled for the H200 (sm_90) without a GPU.

``python -m kvlib.bench sass_count --profile cpu`` compiles each kernel with Triton's own toolchain
(:mod:`kvlib.kernels.offline`), finds the main loop in the SASS (the longest backward
branch) and records per thread per tile: instructions, instructions per stored K/V element, registers,
spills and an opcode histogram. The shapes are the latency benchmarks' (d = 128, groups of 32, GQA 7,
bf16 queries) and the launch parameters the kernels' defaults. This is how the chapters know *why* a
kernel sits below the memory roofline (issue-bound or not), measured from the binary, not guessed.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvlib.kernels.offline import DIV16, FLOATS, compile_count, compile_sm90, count_compiled

#: pointer arguments of the KV4 decode kernel (:mod:`kvlib.kernels.int4.decode`)
KV4_POINTERS = {"Q8": "*i8", "QH": "*i16", "QW": "*i32", "QS": "*fp32", "QSUM": "*fp32", "KC": "*u8", "KW": "*i16",
                "KS": "*fp16", "KO": "*fp16", "VC": "*u8", "VW": "*i16", "VS": "*fp16", "VO": "*fp16",
                "START": "*i32", "END": "*i32", "K8": "*i8", "K8S": "*fp16", "V8": "*i8", "V8S": "*fp16",
                "COUNT": "*i32", "OUT": "*fp32", "LSE": "*fp32", "CNT": "*i32", "OFIN": "*fp32", "LSEFIN": "*fp32"}
GQA, D, G, NUM_SPLITS = 7, 128, 32, 8


def run(profile: str) -> dict[str, Any]:
    """Counts of the h10 kernel at its defaults (certificate A on/off, Philox skipped), with the Philox products
    as mul.hi + mul.lo instead of one mul.wide, with the variance as four FMAs instead of one tf32 dot, over the h8
    layout (sixteen dithers per Philox call), and the w24
    tensor-core kernel (the benchmarks' "fast" mode). ``profile`` does not change the work: the compile
    targets sm_90 whatever this machine is."""
    from kvlib.kernels.int8.config import DEFAULT_CONFIG as C
    from kvlib.kernels.int8.h10 import _decode_int8_stage1_h10
    from kvlib.kernels.int8.w24 import _decode_int8_stage1_tc

    h10 = dict(GQA=GQA, BLOCK_H=8, BLOCK_N=C.block_n, D=D, G=G, NOK=0, NOK_P=16, NOV=0, NOV_P=1, CERT=True,
               CERT_B=False, Q_SPLIT=False, PV_TERMS=min(C.pv_terms, 2), NUM_SPLITS=NUM_SPLITS, FAST=True,
               TILE_SUMS=C.tile_sums, SKIP_DITHER=False, WIDE_MUL=C.wide_mul,
               VAR_DOT=C.var_dot)  # the default config: what decode_int8 runs
    tc = dict(GQA=GQA, BLOCK_H=16, BLOCK_N=64, D=D, G=G, NOK=0, NOK_P=16, NOV=0, NOV_P=1, CERT=True, CERT_B=False,
              Q_SPLIT=False, XI_SPLIT=False, PV_TERMS=2, NUM_SPLITS=NUM_SPLITS, SKIP_DITHER=False)
    variants = {
        "h10_certA": (_decode_int8_stage1_h10, h10, 2, 2),
        "h10_nocert": (_decode_int8_stage1_h10, h10 | {"CERT": False}, 2, 2),
        "h10_certA_nophilox": (_decode_int8_stage1_h10, h10 | {"SKIP_DITHER": True}, 2, 2),
        "h10_certA_mul_hilo": (_decode_int8_stage1_h10, h10 | {"WIDE_MUL": False}, 2, 2),
        "h10_certA_fma_var": (_decode_int8_stage1_h10, h10 | {"VAR_DOT": False}, 2, 2),
        "h8_certA": (_decode_int8_stage1_h10, h10 | {"H8": True}, 2, 2),
        "w24_tc_certA": (_decode_int8_stage1_tc, tc, 4, 3),
    }
    out: dict[str, Any] = {"target": "sm_90", "shape": {"d": D, "group": G, "gqa": GQA, "query": "bf16"}}
    for name, (kernel, const, nw, ns) in variants.items():
        # the h10 kernel reads value codes as int32 words of four (kvlib.kernels.int8.h10.launch_h10)
        ptrs = {"VC": "*i32"} if name.startswith(("h10", "h8")) else None
        out[name] = compile_count(kernel, const, num_warps=nw, num_stages=ns, block_n=const["BLOCK_N"], pointers=ptrs)
        print(f"   {name}: {out[name]['instructions']} instructions per tile-thread, "
              f"{out[name]['per_element']:.2f} per element, {out[name]['registers']} registers", flush=True)
    out["gluon_h8_certA"] = gluon_count()
    out["gluon_h8_nocert"] = gluon_count(cert=False)
    out["gluon_h8_certA_paged16"] = gluon_count(page=16)  # block-table addressing, vLLM's block size
    for name, extra in (("h10_certA_paged16", {}), ("h8_certA_paged16", {"H8": True})):
        out[name] = compile_count(_decode_int8_stage1_h10, h10 | extra | {"PAGE": 16}, num_warps=2, num_stages=2,
                                  block_n=h10["BLOCK_N"], pointers={"VC": "*i32"})
    print(f"   gluon h8: {out['gluon_h8_certA']['instructions']} instructions per 16-position tile (one warp), "
          f"{out['gluon_h8_certA']['per_position_head']:.1f} warp instructions per (position, KV head), "
          f"{out['gluon_h8_certA']['registers']} registers, {out['gluon_h8_certA']['shared_bytes']} B shared",
          flush=True)
    out["kv4"] = kv4_count()
    print(f"   kv4: {out['kv4']['instructions']} instructions per tile-thread, "
          f"{out['kv4']['per_element']:.2f} per 4-bit code, {out['kv4']['registers']} registers", flush=True)
    a, n = out["h10_certA"]["instructions"], out["h10_nocert"]["instructions"]
    out["h10_cert_share"] = (a - n) / n
    out["h10_philox_share"] = 1 - out["h10_certA_nophilox"]["instructions"] / a
    return out


def kv4_count() -> dict[str, Any]:
    """The KV4 main-region kernel at :data:`~kvlib.kernels.int4.decode.DEFAULT_CONFIG` and the kv4 benchmark's
    shape (d = 128, GQA 32:8, a capacity that is a multiple of the block): its pipelined interior loop, per
    thread per ``block_n``-position tile; ``per_element`` is per stored 4-bit code (K and V)."""
    from kvlib.kernels.int4.config import _KMODES, DEFAULT_CONFIG, MIN_ROWS
    from kvlib.kernels.int4.region import _kv4_decode_kernel

    cfg = DEFAULT_CONFIG
    const = dict(HKV=8, G=4, GP=cfg.rows or max(MIN_ROWS, 4), D=D, BLOCK_N=cfg.block_n, INT_PV=cfg.int_pv,
                 KMODE=_KMODES.index(cfg.k_mode), TILE_SUMS=cfg.tile_sums, SCALE32=True, EVEN=True,
                 PROT=False, BLOCK_P=cfg.block_p, INTERP=False, TMA=False)
    out = compile_count(_kv4_decode_kernel, const, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        block_n=cfg.block_n, pointers=KV4_POINTERS)
    out["config"] = {"block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                     "k_mode": cfg.k_mode}
    return out


def gluon_count(cert: bool = True, gqa: int = GQA, page: int = 0, **constexprs: Any) -> dict[str, Any]:
    """The Gluon h8 kernel (:mod:`kvlib.kernels.int8.gluon`) compiled for sm_90 at the latency benchmarks'
    shape: its loop per thread (one warp) per ``block_n``-position tile, registers, stack and shared memory
    (none: every operand is loaded in its tensor-core layout, every conversion checked trivial at compile time),
    with the defaults decode_int8 launches (``Int8KernelConfig.ahead``). ``page > 0``: the vLLM-style block-table
    addressing with pages of ``page`` slots (:mod:`kvlib.kernels.tl.paging`). ``constexprs``: the kernel's other
    compile-time switches (e.g. ``K_DITHER=False``, RTN keys)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvlib.kernels.int8 import gluon as G
    from kvlib.kernels.int8.config import DEFAULT_CONFIG

    ptrs = {"Q": "*bf16", "KC": "*i32", "KS": "*fp16", "VC": "*i32", "VS": "*fp16", "SLOTS": "*i32", "SEQ": "*i32",
            "O_S": "*fp32", "LSE_S": "*fp32", "A_S": "*fp32", "B_S": "*fp32", "KO": "*fp16", "KOC": "*i64",
            "VO": "*fp16", "VOC": "*i64"}
    block_n = G.BLOCK_N
    const = dict(GQA=gqa, NUM_SPLITS=NUM_SPLITS, CERT=cert, CERT_B=False, AHEAD=DEFAULT_CONFIG.ahead,
                 PAGE=page) | constexprs
    params = inspect.signature(G._stage1_g8.fn).parameters
    const = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty} | const
    sig = {n: ("constexpr" if n in const else ptrs.get(n) or ("fp32" if n in FLOATS else "i32")) for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in ptrs or n in DIV16}
    cc = triton.compile(GluonASTSource(G._stage1_g8, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 1})
    out = count_compiled(cc, num_warps=1, num_stages=1, block_n=block_n)
    out["per_position_head"] = out["instructions"] / block_n  # one warp: warp instructions per (position, KV head)
    return out


def pdl_check() -> dict[str, list]:
    """Compile the KV4 path's three kernels for sm_90 with programmatic dependent launch on
    (``KV4KernelConfig.pdl``): per kernel, the PTX's ``griddepcontrol.wait`` and ``launch_dependents``
    counts and whether the launch attribute is set (the preparation only triggers, the merge only waits)."""
    from kvlib.kernels.int4.config import _KMODES, DEFAULT_CONFIG
    from kvlib.kernels.int4.query import _prep_query_kernel
    from kvlib.kernels.int4.region import _kv4_decode_kernel
    from kvlib.kernels.tl.merge import _merge_splits_kernel

    def one(kernel, constexprs, ptrs, num_warps, num_stages, pdl):
        cc = compile_sm90(kernel, constexprs, ptrs, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
        ptx = cc.asm["ptx"]
        return [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"),
                bool(cc.metadata.launch_pdl)]

    cfg = DEFAULT_CONFIG
    const = dict(HKV=8, G=4, GP=8, D=D, BLOCK_N=cfg.block_n, INT_PV=cfg.int_pv, KMODE=_KMODES.index(cfg.k_mode),
                 TILE_SUMS=cfg.tile_sums, SCALE32=True, EVEN=True, PROT=True, BLOCK_P=cfg.block_p, INTERP=False,
                 TMA=False, PDL=True)
    merge_ptrs = {k: "*fp32" for k in ("O_S", "LSE_S", "A_S", "B_S", "OUT", "LSE", "A", "B", "TV", "TV1", "VAC")}
    return {
        "prepare_query": one(_prep_query_kernel, dict(D=D, R=16, ROTATE=True, PIECES=1, INTERP=False, PDL=True),
                             {"Q": "*bf16", "H": "*bf16", "Q8": "*i8", "QS": "*fp32", "QSUM": "*fp32", "ARR": "*i32"},
                             4, 2, False),
        "decode": one(_kv4_decode_kernel, const, KV4_POINTERS, cfg.num_warps, cfg.num_stages, True),
        "merge": one(_merge_splits_kernel, dict(NS=2, NS_P=2, D=D, CERT=False, CERT_B=False, PDL=True), merge_ptrs,
                     4, 2, True),
    }
