"""Compile a Triton or Gluon kernel for the H200 (sm_90) without a GPU, and count its main loop.

Triton's own toolchain (``ptxas``, ``cuobjdump`` ship with Triton) turns a kernel and its compile-time constants
into a cubin; :func:`count_compiled` finds the main loop in the SASS (the longest backward branch) and reports its
instructions per thread per tile, registers, stack and shared memory. The benchmark topic
:mod:`kvlib.bench.sass_count` and the kernels' own layout checks (``compile_offline``, ``tc_dot_layouts``) use it.
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
#: integer arguments that are multiples of 16 at the benchmark shapes (Triton specialises them so at launch)
DIV16 = {"s_qb", "s_qh", "s_kc_n", "s_kc_h", "s_ks_n", "s_vc_n", "s_vc_h", "s_vs_n", "s_sl_b", "s_os_b", "s_os_h",
         "s_os_s", "s_ls_b", "N"}


def tool(name: str) -> str:
    """Path of one of the NVIDIA tools that ship with Triton (``ptxas``, ``cuobjdump``, ``nvdisasm``)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise RuntimeError(f"{name} not found next to Triton ({path}): this count needs Triton's NVIDIA backend")
    return path


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, text)`` of every instruction of a SASS listing (``cuobjdump -sass``)."""
    return [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]


def backward_loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """Every backward branch of a SASS listing: ``(target, branch address, the body's instruction texts)``."""
    ins = instructions(sass)
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            out.append((lo, addr, [t for a, t in ins if lo <= a <= addr]))
    return out


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers (``@!P0 IMMA.16816.S8`` -> ``IMMA``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loop_stats(sass: str) -> dict[str, Any]:
    """The longest backward-branch body of a SASS listing: instruction count and opcode histogram."""
    loops = [(hi - lo, lo, hi, body) for lo, hi, body in backward_loops(sass)]
    if not loops:
        raise ValueError("no loop found in the SASS")
    body = max(loops, key=lambda x: x[:3])[3]
    ops = collections.Counter(opcode(t) for t in body)
    return {"instructions": len(body), "top_opcodes": dict(ops.most_common(12))}


def compile_sm90(kernel: Any, constexprs: dict[str, Any], pointers: dict[str, str] | None, **options: Any) -> Any:
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
    cc = compile_sm90(kernel, constexprs, pointers, num_warps=num_warps, num_stages=num_stages)
    return count_compiled(cc, num_warps=num_warps, num_stages=num_stages, block_n=block_n)


def disassemble(cc: Any) -> tuple[str, str]:
    """``(resource usage, SASS listing)`` of a compiled kernel ``cc``, from ``cuobjdump``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(cc.asm["cubin"])
        usage = subprocess.run([tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return usage, sass


def count_compiled(cc: Any, *, num_warps: int, num_stages: int, block_n: int, d: int = 128) -> dict[str, Any]:
    """Loop statistics, registers, stack and shared memory of a compiled kernel ``cc`` (``block_n`` positions of
    head dim ``d`` per tile)."""
    usage, sass = disassemble(cc)
    res = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    out = loop_stats(sass)
    per_thread = block_n * d * 2 / (32 * num_warps)  # K and V elements each thread handles per tile
    out.update(registers=res.get("reg"), stack_bytes=res.get("stack"), shared_bytes=res.get("shared"),
               block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, per_element=out["instructions"] / per_thread)
    return out
