"""KV4 / KV4-RL decode over a vLLM-style paged pool: the INT4 region read through a block table.

Layout (one layer; the HF cache builds exactly these tensors):

- ``k_codes``, ``v_codes``: uint8 ``[num_blocks, block_size, H_kv, d // 2]``, two codes per byte, even channel
  low (:func:`kvlib.formats.kv4.pack_nibbles`); keys Hadamard-rotated before quantisation;
- ``k_scale``, ``k_off``, ``v_scale``, ``v_off``: fp16 ``[num_blocks, block_size, H_kv]`` (whole-head affine);
- ``block_table`` int32 ``[B, max_blocks]``: position ``p`` of request ``b`` lives in page
  ``block_table[b, p // block_size]``, slot ``p % block_size``; ``start``, ``end`` int32 ``[B]``: the INT4 region
  ``[start_b, end_b)`` in positions (entries of the table past ``end_b`` are never read);
- ``side`` (KV4-RL): the per-sequence :class:`~kvlib.kernels.int4.launch.SideBuffer`, as in the contiguous path.

The kernel is the contiguous one's bytes-mode step (INT8 query x INT4 codes for QK, fp16 ``p Δ_v`` x the codes as
subnormal fp16 for PV, the same split plan, protected program and fused merge) reading rows through the table
(:func:`kvlib.kernels.int4.region._main_region` and ``_main_step`` with ``PAGE``), on one of two paths
(``KV4Launch.path``):

- ``"paged-tiles"`` when ``block_size % block_n == 0``: each ``block_n``-position tile lies inside one page, so
  one table entry per tile gives a scalar base, and the rows are addressed as the contiguous kernel addresses them
  (loop-invariant 32-bit row offsets, ``H_kv`` rows apart; the same 16-byte code copies);
- ``"paged-rows"`` otherwise (pages smaller than a tile, e.g. vLLM's 16): each row looks up its page (an int32
  table gather per position, cached), so any ``block_size`` works, at the cost of a 64-bit address per row.

The scales of consecutive positions are ``H_kv`` fp16 apart (no int32 position pairs as in the contiguous layout,
no TMA); with ``H_kv`` even both paths read each as the int32 word of its head pair and keep its half (one
``prmt``), so every load in the loop is an asynchronous copy of the software pipeliner. (The first version read
them as 16-bit gathers, which stay synchronous loads inside the loop, and took about 2x the contiguous kernel's
time at B=32, S=16k, Hq=28, Hkv=4, d=128, at block_size 16 and 256 alike, per-row lookups or not: the gathers are
the likely cause; ``dev/gpu/kern4.sh`` times the paths side by side.) Offline sm_90 loop counts per thread per
256-position tile at d=128, 8 query rows (``python -m dev.kv4_paged_vs_contiguous --sass``): contiguous 1,033;
paged-tiles 1,177 (the head-pair selection, 64 ``prmt``; twice the scale words, 16 more shared-memory reads;
64-bit bases); paged-rows 1,190 (plus the per-row table values from shared memory and a 64-bit address per row;
1,214 before the in-page offset was made loop-invariant); the 16-bit-gather version 1,137
(rows, page 16) and 1,186 (page 256), 8 of them synchronous global loads.

**Recommended page size for INT4 pools: a multiple of ``block_n``** (256 with
:data:`~kvlib.kernels.int4.config.DEFAULT_CONFIG`), so the kernel takes the tile path; with smaller pages pass a
``config`` whose ``block_n`` divides ``block_size`` (at least 16) or accept the per-row path. ``k_mode``,
``int_pv`` and ``tma`` other than the defaults are refused rather than ignored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvlib.core.checks import check_tensor
from kvlib.core.merge import merge_states
from kvlib.kernels.backend import pdl_supported, use_triton
from kvlib.kernels.int4.config import DEFAULT_CONFIG, KV4KernelConfig
from kvlib.kernels.int4.launch import (
    KV4Launch,
    SideBuffer,
    _check_kv,
    _check_side,
    _launch_options,
    _outputs,
    _side_args,
    _tile_rows,
    _words,
    default_num_splits,
)
from kvlib.kernels.int4.protected import _protected_region, protected_decode_ref
from kvlib.kernels.int4.query import QueryInt8
from kvlib.kernels.int4.reference import kv4_main_decode_ref
from kvlib.kernels.int4.region import _last_merges, _main_region
from kvlib.kernels.int4.tl_helpers import LOG2E


@triton.jit(do_not_specialize=["C", "SPLITS"])
def _kv4_paged_kernel(
    Q8, QH, QS, QSUM, BT, KC, KS, KO, VW, VS, VO, START, END,
    K8, K8S, V8, V8S, COUNT, OUT, LSE, CNT, OFIN, LSEFIN,
    sm_scale_log2, MAXB, C, SPLITS,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, TILE_SUMS: tl.constexpr, PROT: tl.constexpr, BLOCK_P: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr = False, FUSE: tl.constexpr = False, NS_P: tl.constexpr = 1,
    TILES: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(B, Hkv, SPLITS + PROT)``, as :func:`kvlib.kernels.int4.region._kv4_decode_kernel`: INT4 splits over
    the paged pool (the contiguous kernel's bytes-mode region with ``PAGE``; ``QW``, ``KW``, ``VC`` are not read
    there, so ``QH`` and ``KC`` stand in), the protected region as the last program of each pair, and with ``FUSE``
    the merge."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    NS = SPLITS + PROT
    if PROT:
        if sp == SPLITS:
            _protected_region(b, h, Q8, QS, K8, K8S, V8, V8S, COUNT, OUT, LSE, sm_scale_log2, C, SPLITS, NS,
                              HKV, G, GP, D, BLOCK_P, INTERP)
        else:
            _main_region(b, h, sp, Q8, QH, QH, QS, QSUM, KC, KC, KS, KO, KC, VW, VS, VO, START, END, OUT, LSE,
                         sm_scale_log2, MAXB, HKV, G, GP, D, BLOCK_N, SPLITS, NS, INT_PV=False, KMODE=1,
                         TILE_SUMS=TILE_SUMS, SCALE32=True, EVEN=True, INTERP=INTERP, BT=BT, PAGE=PAGE, TILES=TILES)
    else:
        _main_region(b, h, sp, Q8, QH, QH, QS, QSUM, KC, KC, KS, KO, KC, VW, VS, VO, START, END, OUT, LSE,
                     sm_scale_log2, MAXB, HKV, G, GP, D, BLOCK_N, SPLITS, NS, INT_PV=False, KMODE=1,
                     TILE_SUMS=TILE_SUMS, SCALE32=True, EVEN=True, INTERP=INTERP, BT=BT, PAGE=PAGE, TILES=TILES)
    if FUSE:
        _last_merges(b, h, CNT, OUT, LSE, OFIN, LSEFIN, NS, HKV, G, GP, D, NS_P)


def _check_paged(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, block_size,
                 side) -> tuple[int, int, int, int]:
    """Shapes of the paged layout; returns ``(hkv, max_blocks, side slots C, d)``."""
    check_tensor("qp.q8", qp.q8, ndim=3, dtype=torch.int8)
    b, hq, d = qp.q8.shape
    check_tensor("k_codes", k_codes, ndim=4, dtype=torch.uint8)
    nb, page, hkv, half = k_codes.shape
    if v_codes.shape != k_codes.shape or 2 * half != d:
        raise ValueError(f"k_codes/v_codes must both be [num_blocks, block_size, H_kv, d/2={d // 2}], got "
                         f"{tuple(k_codes.shape)} and {tuple(v_codes.shape)}")
    if not isinstance(block_size, int) or block_size != page:
        raise ValueError(f"block_size must be the pool's page size {page} (k_codes.shape[1]), got {block_size!r}")
    _check_kv(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, start, end, (nb, page, hkv))
    check_tensor("block_table", block_table, ndim=2, dtype=torch.int32)
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B={b}, max_blocks], got {tuple(block_table.shape)}")
    if hq % hkv or hq // hkv > 16:
        raise ValueError(f"query heads {hq} must be a multiple (at most 16x) of kv heads {hkv}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 (64 and 128 on the GPU), got {d}")
    c = _check_side(side, b, hkv, d) if side is not None else 0
    return hkv, block_table.shape[1], c, d


def _gather_pages(t: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Pool ``t [num_blocks, block_size, H_kv, ...]`` gathered per request into ``[B, H_kv, max_blocks *
    block_size, ...]`` (table entries outside ``[0, num_blocks)`` read page 0: such positions lie outside
    every region)."""
    idx = torch.where((block_table >= 0) & (block_table < t.shape[0]), block_table, 0).long()
    g = t[idx]  # [B, max_blocks, block_size, H_kv, ...]
    g = g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])
    return g.transpose(1, 2).contiguous()


def kv4_paged_decode_ref(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, *,
    block_size: int, side: SideBuffer | None = None, sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch reference: the pages gathered into the contiguous layout, then
    :func:`~kvlib.kernels.int4.reference.kv4_main_decode_ref` (merged with the side buffer's exact attention)."""
    _check_paged(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, block_size, side)
    d = qp.q8.shape[-1]
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    kc, ks, ko, vc, vs, vo = (_gather_pages(t, block_table) for t in (k_codes, k_scale, k_off, v_codes, v_scale, v_off))
    pos = torch.arange(kc.shape[2], device=kc.device)
    inside = ((pos[None, :] >= start[:, None].long()) & (pos[None, :] < end[:, None].long()))[:, None, :]
    # positions outside the region may hold any bits (NaN scales in a fresh page): zero them so that 0 x NaN
    # cannot reach the output (the kernel selects them away)
    ks, ko, vs, vo = (torch.where(inside, t, torch.zeros_like(t)) for t in (ks, ko, vs, vo))
    o, lse = kv4_main_decode_ref(qp, kc, ks, ko, vc, vs, vo, start, end, sm_scale)
    if side is None:
        return o, lse
    return merge_states(o, lse, *protected_decode_ref(qp, *side, sm_scale=sm_scale))


def plan_kv4_paged_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, *,
    block_size: int, side: SideBuffer | None = None, config: KV4KernelConfig | None = None,
    sm_scale: float | None = None, backend: str = "auto",
) -> KV4Launch:  # fmt: skip
    """The launch :func:`kv4_paged_decode` makes, planned but not run (a :class:`KV4Launch`, ``path="paged-rows"``)."""
    cfg = config or DEFAULT_CONFIG
    hkv, maxb, c, d = _check_paged(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end,
                                   block_size, side)
    if not use_triton(qp.q8, backend):
        raise ValueError("plan_kv4_paged_decode plans the Triton launch: it needs a CUDA tensor or TRITON_INTERPRET=1")
    for name, bad in (("k_mode", cfg.k_mode != "bytes"), ("int_pv", cfg.int_pv), ("tma", cfg.tma)):
        if bad:
            raise ValueError(f"the paged KV4 kernel reads bytes-mode keys with fp16 PV through per-row page lookups "
                             f"only; config.{name}={getattr(cfg, name)!r} is not supported there")
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes), ("k_scale", k_scale), ("k_off", k_off),
                    ("v_scale", v_scale), ("v_off", v_off), ("block_table", block_table)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    b, hq, _ = qp.q8.shape
    g = hq // hkv
    gp = _tile_rows(cfg, g, qp.q8.is_cuda, d)
    dev = qp.q8.device
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    splits = cfg.num_splits or default_num_splits(b, hkv, maxb * block_size, cfg.block_n, dev, cfg.ctas_per_sm,
                                                  cfg.overhead_blocks)
    prot = side is not None
    ns = splits + int(prot)
    q8 = qp.q8.contiguous()
    start32, end32 = start.to(torch.int32), end.to(torch.int32)
    k8, k8s, v8, v8s, cnt = _side_args(side, q8, k_scale, start32)
    pdl = cfg.pdl and pdl_supported(qp.q8)
    fuse, o_s, lse_s, counters, o, lse = _outputs(cfg, qp, b, hq, hkv, d, ns, gp, splits, start32)
    args = (q8, _words(q8, torch.int16), qp.scale, qp.qsum, block_table, k_codes, k_scale, k_off,
            _words(v_codes, torch.int16), v_scale, v_off, start32, end32, k8, k8s, v8, v8s, cnt,
            o_s, lse_s, counters, o, lse, sm_scale * LOG2E, maxb, max(c, 1), splits)
    tiles = block_size % cfg.block_n == 0  # every tile inside one page: one table entry per tile
    meta = dict(HKV=hkv, G=g, GP=gp, D=d, BLOCK_N=cfg.block_n, PAGE=block_size, TILE_SUMS=bool(cfg.tile_sums),
                TILES=tiles,
                PROT=prot, BLOCK_P=cfg.block_p, INTERP=not qp.q8.is_cuda, PDL=pdl, FUSE=fuse,
                NS_P=triton.next_power_of_2(ns) if fuse else 1, **_launch_options(cfg, pdl))
    return KV4Launch(path="paged-tiles" if tiles else "paged-rows", grid=(b, hkv, ns), splits=splits, states=ns,
                     k_mode="bytes", rows=gp,
                     tma=False, pipe_edges=False, fuse=fuse, pdl=pdl, backend=backend, o_s=o_s, lse_s=lse_s, o=o,
                     lse=lse, fn=_kv4_paged_kernel, args=args, meta=meta)


def kv4_paged_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, *,
    block_size: int, side: SideBuffer | None = None, config: KV4KernelConfig | None = None,
    sm_scale: float | None = None, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KV4 (and with ``side`` KV4-RL) decode of the prepared query over a paged pool; see the module docstring.

    Returns ``(o [B, Hq, d] fp32, lse [B, Hq] natural log)``; an empty range (and empty side buffer) gives
    ``lse = -inf``, ``o = 0``. On CPU without the interpreter (or ``backend="torch"``) the torch reference
    :func:`kv4_paged_decode_ref` runs; :func:`plan_kv4_paged_decode` gives the kernel launch as a record.
    """
    args = (qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end)
    if not use_triton(qp.q8, backend):
        return kv4_paged_decode_ref(*args, block_size=block_size, side=side, sm_scale=sm_scale)
    return plan_kv4_paged_decode(*args, block_size=block_size, side=side, config=config, sm_scale=sm_scale,
                                 backend=backend).run()
