"""The KV4 decode launcher: input checks, the split plan, TMA descriptors, and :class:`KV4Launch`, the record of
one planned launch (what :func:`kv4_main_decode` runs and a probe may inspect or launch itself)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import triton

from kvlib.core.checks import check_tensor
from kvlib.kernels.backend import pdl_supported, use_triton
from kvlib.kernels.int4.config import _KMODES, DEFAULT_CONFIG, MIN_ROWS, KV4KernelConfig
from kvlib.kernels.int4.protected import protected_decode_ref
from kvlib.kernels.int4.query import QueryInt8
from kvlib.kernels.int4.reference import kv4_main_decode_ref
from kvlib.kernels.int4.region import _kv4_decode_kernel
from kvlib.kernels.int4.tl_helpers import LOG2E
from kvlib.kernels.tl.merge import merge_splits


class SideBuffer(NamedTuple):
    """KV4-RL protected region of a batch: int8 ``k8``/``v8 [B, Hkv, C, d]`` (keys rotated), fp16
    per-slot scales ``[B, Hkv, C]``, and the occupied prefix length ``count [B]``."""

    k8: torch.Tensor
    k8_scale: torch.Tensor
    v8: torch.Tensor
    v8_scale: torch.Tensor
    count: torch.Tensor


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(b: int, hkv: int, max_len: int, block_n: int, device: torch.device,
                       ctas_per_sm: int = 2, overhead_blocks: float = 1.0) -> int:
    """Split-KV programs per (request, kv head), from a wave model: with ``R = SMs x ctas_per_sm``
    programs resident, ``P = b x hkv`` pairs and ``s`` splits of ``blocks`` position blocks, the time
    goes as ``ceil(P s / R) x (blocks / s + overhead_blocks)`` (waves x work per program, each program
    paying a fixed prologue/epilogue worth ``overhead_blocks`` blocks); the smallest ``s`` (at most 32,
    at least two blocks per split) minimising it is taken. ``max_len`` is the capacity: with ragged
    lengths most programs are shorter than it, and the overhead term keeps the plan from splitting
    short requests into many near-empty programs. CPU: 2 when there is more than one block (to
    exercise the merge)."""
    blocks = triton.cdiv(max(max_len, 1), block_n)
    if device.type != "cuda":
        return 2 if blocks > 1 else 1
    resident = _sm_count(device.index or 0) * max(ctas_per_sm, 1)
    pairs = b * hkv
    best, best_cost = 1, float("inf")
    for s in range(1, max(1, min(32, blocks // 2)) + 1):
        cost = -(-pairs * s // resident) * (blocks / s + overhead_blocks)
        if overhead_blocks == 0:
            cost += 0.01 * s * blocks  # the model before the overhead term: a small per-split merge cost
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = s, cost
    return best


def _check_side(side: SideBuffer, b: int, hkv: int, d: int) -> int:
    check_tensor("k8", side.k8, ndim=4, dtype=torch.int8)
    check_tensor("v8", side.v8, ndim=4, dtype=torch.int8)
    if side.k8.shape != side.v8.shape or side.k8.shape[:2] != (b, hkv) or side.k8.shape[3] != d:
        raise ValueError(f"k8/v8 must both be [B={b}, Hkv={hkv}, C, d={d}], got {tuple(side.k8.shape)} and "
                         f"{tuple(side.v8.shape)}")
    c = side.k8.shape[2]
    for name, t in (("k8_scale", side.k8_scale), ("v8_scale", side.v8_scale)):
        check_tensor(name, t, ndim=3, dtype=torch.float16)
        if t.shape != (b, hkv, c):
            raise ValueError(f"{name} must be [{b}, {hkv}, {c}], got {tuple(t.shape)}")
    check_tensor("count", side.count, ndim=1, floating=False)
    if side.count.shape[0] != b:
        raise ValueError(f"count must have one entry per request ({b}), got {side.count.shape[0]}")
    return c


def _words(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` viewed as wider words along its last dim (the kernel's packed reads); ``x`` itself if it
    does not divide (the modes that need the view are then not chosen)."""
    size = torch.tensor([], dtype=dtype).element_size()
    return x.view(dtype) if x.shape[-1] % size == 0 else x


#: smallest shared-memory alignment of a TMA destination (CUDA programming guide, "alignment requirements for
#: multi-dimensional TMA"): Triton 3.6 packs a pipelined load's stages back to back, so every box must be a
#: multiple of it or the second stage starts misaligned (``CUDA error: misaligned address``; the fp16 scale box of
#: ``block_n = 32`` positions is 64 bytes: tests/test_kv4_kernels.py, first H200 run)
TMA_SMEM_ALIGN = 128


def tma_refusal(config: KV4KernelConfig, n: int, d: int) -> str | None:
    """Why ``config.tma`` cannot take effect at capacity ``n`` and head dim ``d`` (``None``: it can, or it is off).

    The step reading descriptors is the bytes or transposed one with fp16 PV; global rows must be 16-byte strided
    (``n`` a multiple of 8 for the fp16 scales, ``d / 2`` bytes of codes a multiple of 16); a box dimension is at
    most 256; and every box (``2 block_n`` bytes of scales, ``block_n d / 2`` of codes) a multiple of
    :data:`TMA_SMEM_ALIGN` bytes, i.e. ``block_n`` a multiple of 64."""
    if not config.tma:
        return None
    if config.k_mode == "planes" or config.int_pv:
        return "tma reads bytes/trans key codes with fp16 PV only"
    if n % 8:
        return f"tma needs N % 8 == 0 (16-byte fp16 scale rows), got N={n}"
    if d % 32:
        return f"tma needs d % 32 == 0 (16-byte code rows), got d={d}"
    if config.block_n > 256:
        return f"tma boxes are at most 256 rows, got block_n={config.block_n}"
    if (2 * config.block_n) % TMA_SMEM_ALIGN:
        return (f"tma needs block_n % 64 == 0: a {2 * config.block_n}-byte fp16 scale box would leave the next "
                f"pipeline stage off the {TMA_SMEM_ALIGN}-byte shared-memory alignment TMA requires")
    return None


def tma_applies(config: KV4KernelConfig, n: int, d: int) -> bool:
    """Whether ``config.tma`` takes effect at capacity ``n`` and head dim ``d`` (see :func:`tma_refusal`; the launch
    record's ``tma_note`` says why not)."""
    return bool(config.tma) and tma_refusal(config, n, d) is None


def pipe_edges_applies(config: KV4KernelConfig, side: bool) -> bool:
    """Whether a launch runs its partial edge blocks inside the pipelined loop: ``config.pipe_edges``, or when it
    is ``None``, exactly when a side buffer is given (a KV4-RL main region is unaligned at both ends; KV4's starts
    at 0)."""
    return side if config.pipe_edges is None else bool(config.pipe_edges)


def fuse_merge_applies(config: KV4KernelConfig, ns: int, rows: int, d: int, splits: int | None = None) -> bool:
    """Whether a launch with ``ns`` states per pair (``splits`` of them INT4 splits; default all) merges them in its
    own last program: ``config.fuse_merge`` (``None``: two or more INT4 splits), more than one state, and the
    ``rows x next_pow2(ns) x d`` fp32 tile at most 64 values per thread."""
    splits = ns if splits is None else splits
    wanted = splits >= 2 if config.fuse_merge is None else bool(config.fuse_merge)
    return wanted and ns > 1 and rows * triton.next_power_of_2(ns) * d <= 64 * 32 * config.num_warps


def _tma_descriptors(kc, vw, ks, ko, vs, vo, block_n: int) -> tuple:
    """Host TMA descriptors over the ``[B*Hkv, N, ...]`` views of the code words and scales (one
    ``block_n``-row box each); the kernel indexes them by ``b * Hkv + h``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def rows(t):
        v = t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])
        return TensorDescriptor.from_tensor(v, [1, block_n, v.shape[2]])

    def scales(t):
        v = t.view(t.shape[0] * t.shape[1], t.shape[2])
        return TensorDescriptor.from_tensor(v, [1, block_n])

    return rows(kc), rows(vw), scales(ks), scales(ko), scales(vs), scales(vo)


@dataclass
class KV4Launch:
    """One planned launch of a KV4 decode kernel: every choice the launcher made, the kernel's arguments and
    outputs, and after :meth:`launch` the compiled kernel (``kernel.n_regs``, ``kernel.metadata.shared``).

    :func:`kv4_main_decode` is ``plan_kv4_decode(...).run()``; a probe that times a part of the launch calls
    :meth:`launch` itself (with another ``grid``, or without the merge) instead of flipping module state.
    """

    #: "contiguous" (``[B, Hkv, N, ...]`` rows), "paged-tiles" (one page-table entry per tile) or "paged-rows"
    #: (one per position)
    path: str
    grid: tuple[int, int, int]
    splits: int  #: INT4 split programs per (request, kv head)
    states: int  #: states per pair: the splits plus the protected region's
    k_mode: str  #: the key-code layout the kernel reads (``config.k_mode`` after the fallbacks)
    rows: int  #: query rows per tile
    tma: bool
    pipe_edges: bool
    fuse: bool  #: the split merge runs in the decode launch
    pdl: bool
    backend: str
    o_s: torch.Tensor = field(repr=False)
    lse_s: torch.Tensor = field(repr=False)
    o: torch.Tensor = field(repr=False)
    lse: torch.Tensor = field(repr=False)
    fn: object = field(repr=False)  #: the ``@triton.jit`` kernel
    args: tuple = field(repr=False)
    meta: dict = field(repr=False)  #: constexprs and launch options
    kernel: object = field(default=None, repr=False)  #: the compiled kernel, after :meth:`launch`
    tma_note: str = ""  #: why ``config.tma`` was not taken (:func:`tma_refusal`); empty when taken or not asked

    @property
    def merge(self) -> str:
        """How the states are combined: ``"none"`` (one state), ``"fused"`` or ``"launch"`` (``merge_splits``)."""
        return "none" if self.states == 1 else "fused" if self.fuse else "launch"

    def launch(self, grid: tuple[int, int, int] | None = None):
        """Launch the decode kernel alone (states into ``o_s``/``lse_s``, or merged into ``o``/``lse`` when fused);
        returns the compiled kernel."""
        self.kernel = self.fn[grid or self.grid](*self.args, **self.meta)
        return self.kernel

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o, lse)`` from what :meth:`launch` wrote: the one state, the fused merge's output, or a merge launch."""
        if self.states == 1:
            return self.o_s[:, :, 0], self.lse_s[:, :, 0]
        if self.fuse:
            return self.o, self.lse
        return merge_splits(self.o_s, self.lse_s, backend=self.backend, pdl=self.pdl)[:2]

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`launch`, then :meth:`result`."""
        self.launch()
        return self.result()


def _config(config: KV4KernelConfig | None, **over) -> KV4KernelConfig:
    cfg = config or DEFAULT_CONFIG
    return cfg.replace(**{k: v for k, v in over.items() if v is not None})


def _check_kv(qp: QueryInt8, k_codes, k_scale, k_off, v_codes, v_scale, v_off, start, end, scale_shape) -> None:
    """Dtypes and shapes shared by the contiguous and paged layouts (``scale_shape``: the scales' shape)."""
    check_tensor("qp.q8", qp.q8, ndim=3, dtype=torch.int8)
    b, hq, d = qp.q8.shape
    check_tensor("k_codes", k_codes, ndim=4, dtype=torch.uint8)
    check_tensor("v_codes", v_codes, ndim=4, dtype=torch.uint8)
    for name, t in (("k_scale", k_scale), ("k_off", k_off), ("v_scale", v_scale), ("v_off", v_off)):
        check_tensor(name, t, ndim=3, dtype=torch.float16)
        if tuple(t.shape) != tuple(scale_shape):
            raise ValueError(f"{name} must be {list(scale_shape)}, got {tuple(t.shape)}")
    for name, t in (("start", start), ("end", end)):
        check_tensor(name, t, ndim=1, floating=False)
        if t.shape[0] != b:
            raise ValueError(f"{name} must have one entry per request ({b}), got {t.shape[0]}")


def _tile_rows(cfg: KV4KernelConfig, g: int, on_gpu: bool, d: int) -> int:
    """Query rows per tile; refuses groups above 16 and (on the GPU) d < 64."""
    if g > 16:
        raise ValueError(f"GQA group {g} > 16 is not supported by the kernel")
    if cfg.k_mode not in _KMODES:
        raise ValueError(f"k_mode must be one of {_KMODES}, got {cfg.k_mode!r}")
    gp = cfg.rows or max(MIN_ROWS, triton.next_power_of_2(g))
    if gp < g or gp & (gp - 1):
        raise ValueError(f"rows={cfg.rows} must be a power of two >= the GQA group {g}")
    if on_gpu and d < 64:
        raise ValueError(f"the KV4 kernel needs d >= 64 on the GPU (INT8 tensor-core dots take K >= 32), got d={d}")
    return gp


def _side_args(side: SideBuffer | None, q8: torch.Tensor, filler: torch.Tensor, start32: torch.Tensor) -> tuple:
    """The side buffer's kernel arguments, or same-dtype placeholders (one signature) without one."""
    if side is None:
        return q8, filler, q8, filler, start32
    k8, k8s, v8, v8s = (t.contiguous() for t in side[:4])
    return k8, k8s, v8, v8s, side.count.to(torch.int32)


def _outputs(cfg: KV4KernelConfig, qp: QueryInt8, b: int, hq: int, hkv: int, d: int, ns: int, gp: int, splits: int,
             start32: torch.Tensor) -> tuple:
    """``(fuse, o_s, lse_s, counters, o, lse)``: the split states and, when the merge is fused, its counters and
    final outputs (the states themselves stand in otherwise: unused)."""
    dev = qp.q8.device
    o_s = torch.empty(b, hq, ns, d, dtype=torch.float32, device=dev)
    lse_s = torch.empty(b, hq, ns, dtype=torch.float32, device=dev)
    fuse = fuse_merge_applies(cfg, ns, gp, d, splits)
    if not fuse:
        return fuse, o_s, lse_s, start32, o_s, lse_s
    # from the query preparation (zeroed there), else zeros here (a memset launch)
    ok = qp.arrivals is not None and qp.arrivals.numel() >= b * hkv
    counters = qp.arrivals if ok else torch.zeros(b * hkv, dtype=torch.int32, device=dev)
    o = torch.empty(b, hq, d, dtype=torch.float32, device=dev)
    lse = torch.empty(b, hq, dtype=torch.float32, device=dev)
    return fuse, o_s, lse_s, counters, o, lse


def _launch_options(cfg: KV4KernelConfig, pdl: bool) -> dict:
    return dict(**({"launch_pdl": True} if pdl else {}), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}))


def plan_kv4_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    start: torch.Tensor, end: torch.Tensor, *,
    side: SideBuffer | None = None, config: KV4KernelConfig | None = None, sm_scale: float | None = None,
    backend: str = "auto",
) -> KV4Launch:  # fmt: skip
    """The launch :func:`kv4_main_decode` makes on the Triton path, planned but not run (see :class:`KV4Launch`)."""
    cfg = config or DEFAULT_CONFIG
    b, hq, d = qp.q8.shape
    check_tensor("k_codes", k_codes, ndim=4, dtype=torch.uint8)
    _, hkv, n, half = k_codes.shape
    if k_codes.shape[0] != b or 2 * half != d or v_codes.shape != k_codes.shape:
        raise ValueError(f"k_codes/v_codes must be [B={b}, Hkv, N, d/2={d // 2}], got {tuple(k_codes.shape)}")
    _check_kv(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, start, end, (b, hkv, n))
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    c = _check_side(side, b, hkv, d) if side is not None else 0
    if not use_triton(qp.q8, backend):
        raise ValueError("plan_kv4_decode plans the Triton launch: it needs a CUDA tensor or TRITON_INTERPRET=1")
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    g = hq // hkv
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes), ("k_scale", k_scale), ("k_off", k_off),
                    ("v_scale", v_scale), ("v_off", v_off)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    dev = qp.q8.device
    q8 = qp.q8.contiguous()
    gp = _tile_rows(cfg, g, qp.q8.is_cuda, d)
    k_mode = cfg.k_mode
    if k_mode == "trans" and cfg.int_pv:
        k_mode = "bytes"  # the transposed step has fp16 PV only
    if k_mode == "planes" and (d < 128 or n % 2):
        k_mode = "bytes"  # INT8 dots need K >= 32 (d/4 >= 32); int16 views need even sizes
    splits = cfg.num_splits or default_num_splits(b, hkv, n, cfg.block_n, dev, cfg.ctas_per_sm, cfg.overhead_blocks)
    prot = side is not None
    ns = splits + int(prot)
    start32, end32 = start.to(torch.int32), end.to(torch.int32)
    k8, k8s, v8, v8s, cnt = _side_args(side, q8, k_scale, start32)
    kc, kw, ks, ko, vc, vw, vs, vo = (k_codes, _words(k_codes, torch.int16), k_scale, k_off, v_codes,
                                      _words(v_codes, torch.int16), v_scale, v_off)
    tma_note = tma_refusal(cfg.replace(k_mode=k_mode), n, d) or ""
    tma = bool(cfg.tma) and not tma_note
    if tma:
        kc, vw, ks, ko, vs, vo = _tma_descriptors(kc, vw, ks, ko, vs, vo, cfg.block_n)
    pdl = cfg.pdl and pdl_supported(qp.q8)
    pipe = pipe_edges_applies(cfg, prot)
    fuse, o_s, lse_s, counters, o, lse = _outputs(cfg, qp, b, hq, hkv, d, ns, gp, splits, start32)
    args = (q8, _words(q8, torch.int16), _words(q8, torch.int32), qp.scale, qp.qsum,
            kc, kw, ks, ko, vc, vw, vs, vo, start32, end32, k8, k8s, v8, v8s, cnt,
            o_s, lse_s, counters, o, lse, sm_scale * LOG2E, n, max(c, 1), splits)
    meta = dict(
        HKV=hkv, G=g, GP=gp, D=d, BLOCK_N=cfg.block_n, INT_PV=bool(cfg.int_pv),
        KMODE=_KMODES.index(k_mode), TILE_SUMS=bool(cfg.tile_sums), SCALE32=n % 2 == 0,
        EVEN=n % cfg.block_n == 0, PROT=prot, BLOCK_P=cfg.block_p,
        INTERP=not qp.q8.is_cuda, TMA=tma,
        PDL=pdl, PIPE_EDGES=pipe, FUSE=fuse, NS_P=triton.next_power_of_2(ns) if fuse else 1,
        **_launch_options(cfg, pdl),
    )  # fmt: skip
    return KV4Launch(path="contiguous", grid=(b, hkv, ns), splits=splits, states=ns, k_mode=k_mode, rows=gp, tma=tma,
                     pipe_edges=pipe, fuse=fuse, pdl=pdl, backend=backend, o_s=o_s, lse_s=lse_s, o=o, lse=lse,
                     fn=_kv4_decode_kernel, args=args, meta=meta, tma_note=tma_note)


def kv4_main_decode(
    qp: QueryInt8,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_off: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_off: torch.Tensor,
    start: torch.Tensor, end: torch.Tensor,
    sm_scale: float | None = None, int_pv: bool | None = None, num_splits: int | None = None,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    maxnreg: int | None = None, backend: str = "auto", *,
    side: SideBuffer | None = None, config: KV4KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Decode attention of the prepared query over positions ``[start_b, end_b)`` of the INT4 cache
    and, with ``side`` (KV4-RL), also over the side buffer's occupied slots, in one launch.

    Returns ``(o [B, Hq, d] fp32, lse [B, Hq] natural log)``; an empty range gives ``lse = -inf``,
    ``o = 0``. The split states (and the protected region's state) are combined by one
    :func:`~kvlib.kernels.tl.merge.merge_splits` launch (a fold of :func:`kvlib.core.merge.merge_states`), or inside
    the decode launch by each pair's last program (``config.fuse_merge``).
    Launch parameters come from ``config`` (default :data:`DEFAULT_CONFIG`); the explicit keyword
    arguments, when given, override it. :func:`plan_kv4_decode` gives the same launch as a :class:`KV4Launch`
    record (the choices made, the compiled kernel after it ran).
    """
    cfg = _config(config, int_pv=int_pv, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                  num_stages=num_stages, maxnreg=maxnreg)
    args = (qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, start, end)
    if use_triton(qp.q8, backend):
        return plan_kv4_decode(*args, side=side, config=cfg, sm_scale=sm_scale, backend=backend).run()
    b, _, d = qp.q8.shape
    check_tensor("k_codes", k_codes, ndim=4, dtype=torch.uint8)
    if k_codes.shape[0] != b or 2 * k_codes.shape[3] != d or v_codes.shape != k_codes.shape:
        raise ValueError(f"k_codes/v_codes must be [B={b}, Hkv, N, d/2={d // 2}], got {tuple(k_codes.shape)}")
    _check_kv(*args, (b, k_codes.shape[1], k_codes.shape[2]))
    if qp.q8.shape[1] % k_codes.shape[1]:
        raise ValueError(f"query heads {qp.q8.shape[1]} must be a multiple of kv heads {k_codes.shape[1]}")
    if side is not None:
        _check_side(side, b, k_codes.shape[1], d)
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    o, lse = kv4_main_decode_ref(*args, sm_scale)
    if side is None:
        return o, lse
    from kvlib.core.merge import merge_states

    return merge_states(o, lse, *protected_decode_ref(qp, *side, sm_scale=sm_scale))
