"""Instruction counts of the INT8 decode kernels' main loops, compiled for the H200 (sm_90) without a GPU.

``python -m kvlib.bench sass_count --profile cpu`` compiles each kernel with Triton's own toolchain
(``ptxas``, ``cuobjdump`` ship with Triton), finds the main loop in the SASS (the longest backward
branch) and records per thread per tile: instructions, instructions per stored K/V element, registers,
spills and an opcode histogram. The shapes are the latency benchmarks' (d = 128, groups of 32, GQA 7,
bf16 queries) and the launch parameters the kernels' defaults. This is how the chapters know *why* a
kernel sits below the memory roofline (issue-bound or not), measured from the binary, not guessed.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any

#: pointer arguments of the INT8 decode kernels and their element types
POINTERS = {"Q": "*fp16", "KC": "*i8", "KS": "*fp16", "KO": "*fp16", "KOC": "*i64", "VC": "*i8", "VS": "*fp16",
            "VO": "*fp16", "VOC": "*i64", "SLOTS": "*i32", "SEQ": "*i32", "O_S": "*fp32", "LSE_S": "*fp32",
            "A_S": "*fp32", "B_S": "*fp32"}
FLOATS = {"sm_scale", "byp_rel", "byp_abs", "log_2_over_delta", "rad_extra", "sm_scale_log2"}
#: pointer arguments of the KV4 decode kernel (:mod:`kvlib.kernels.int4.decode`)
KV4_POINTERS = {"Q8": "*i8", "QH": "*i16", "QW": "*i32", "QS": "*fp32", "QSUM": "*fp32", "KC": "*u8", "KW": "*i16",
                "KS": "*fp16", "KO": "*fp16", "VC": "*u8", "VW": "*i16", "VS": "*fp16", "VO": "*fp16",
                "START": "*i32", "END": "*i32", "K8": "*i8", "K8S": "*fp16", "V8": "*i8", "V8S": "*fp16",
                "COUNT": "*i32", "OUT": "*fp32", "LSE": "*fp32", "CNT": "*i32", "OFIN": "*fp32", "LSEFIN": "*fp32"}
#: integer arguments that are multiples of 16 at the benchmark shapes (Triton specialises them so at launch)
DIV16 = {"s_qb", "s_qh", "s_kc_n", "s_kc_h", "s_ks_n", "s_vc_n", "s_vc_h", "s_vs_n", "s_sl_b", "s_os_b", "s_os_h",
         "s_os_s", "s_ls_b", "N"}
GQA, D, G, NUM_SPLITS = 7, 128, 32, 8


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise RuntimeError(f"{name} not found next to Triton ({path}): this count needs Triton's NVIDIA backend")
    return path


def loop_stats(sass: str) -> dict[str, Any]:
    """The longest backward-branch body of a SASS listing: instruction count and opcode histogram."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((addr - int(m.group(1), 16), int(m.group(1), 16), addr))
    if not loops:
        raise ValueError("no loop found in the SASS")
    _, lo, hi = max(loops)
    body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if lo <= a <= hi]
    ops = collections.Counter(op.split(".")[0] for op in body)
    return {"instructions": len(body), "top_opcodes": dict(ops.most_common(12))}


def _compile(kernel: Any, constexprs: dict[str, Any], pointers: dict[str, str] | None, **options: Any) -> Any:
    """``kernel`` compiled for sm_90 without a GPU (pointer types from :data:`POINTERS` and ``pointers``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = POINTERS | (pointers or {})
    params = inspect.signature(kernel.fn).parameters
    # a constexpr left to its default must still be a constant: typed "i32" it would become a runtime
    # argument, and every branch on it would be compiled in (a different kernel from the one launched)
    constexprs = {n: p.default for n, p in params.items()
                  if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty} | constexprs
    sig = {}
    for name in params:
        sig[name] = ("constexpr" if name in constexprs else ptrs.get(name)
                     or ("fp32" if name in FLOATS else "i32"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in ptrs or n in DIV16}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def compile_count(kernel: Any, constexprs: dict[str, Any], *, num_warps: int, num_stages: int,
                  block_n: int, pointers: dict[str, str] | None = None) -> dict[str, Any]:
    """Compile ``kernel`` for sm_90 and count its main loop (per thread per ``block_n``-position tile)."""
    cc = _compile(kernel, constexprs, pointers, num_warps=num_warps, num_stages=num_stages)
    return _count(cc, num_warps=num_warps, num_stages=num_stages, block_n=block_n)


def _count(cc: Any, *, num_warps: int, num_stages: int, block_n: int) -> dict[str, Any]:
    """Loop statistics, registers, stack and shared memory of a compiled kernel ``cc``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(cc.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    out = loop_stats(sass)
    per_thread = block_n * D * 2 / (32 * num_warps)  # K and V elements each thread handles per tile
    out.update(registers=res.get("reg"), stack_bytes=res.get("stack"), shared_bytes=res.get("shared"),
               block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, per_element=out["instructions"] / per_thread)
    return out


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
    from kvlib.kernels.int4.decode import _KMODES, DEFAULT_CONFIG, MIN_ROWS, _kv4_decode_kernel

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
    out = _count(cc, num_warps=1, num_stages=1, block_n=block_n)
    out["per_position_head"] = out["instructions"] / block_n  # one warp: warp instructions per (position, KV head)
    return out


def pdl_check() -> dict[str, list]:
    """Compile the KV4 path's three kernels for sm_90 with programmatic dependent launch on
    (``KV4KernelConfig.pdl``): per kernel, the PTX's ``griddepcontrol.wait`` and ``launch_dependents``
    counts and whether the launch attribute is set (the preparation only triggers, the merge only waits)."""
    from kvlib.kernels.int4.decode import _KMODES, DEFAULT_CONFIG, _kv4_decode_kernel, _prep_query_kernel
    from kvlib.kernels.tl.merge import _merge_splits_kernel

    def one(kernel, constexprs, ptrs, num_warps, num_stages, pdl):
        cc = _compile(kernel, constexprs, ptrs, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
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
