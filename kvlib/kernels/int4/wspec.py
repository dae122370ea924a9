"""Warp-specialised KV4 / KV4-RL paged decode in Gluon (GPU only; KV4 requests reach it through
:func:`kvlib.kernels.int4.decode.kv4_paged_decode`, see :data:`DISPATCH_CONFIG`; issue 28).

Contract: the request of :func:`kvlib.kernels.int4.paged.kv4_paged_decode`, the same arguments and the same result.
A query prepared by :func:`kvlib.kernels.int4.query.prepare_query` (INT8 ``q8 [B, Hq, d]``, per-row ``scale``,
``qsum``; the Hadamard rotation happens there, not here), ``Hq = GQA * H_kv`` with ``GQA <= 8``, ``d`` 128 or 64;
the paged INT4 pool ``k_codes, v_codes`` uint8 ``[num_blocks, block_size, H_kv, d / 2]`` (two codes per byte, even
channel low), fp16 ``k_scale, k_off, v_scale, v_off [num_blocks, block_size, H_kv]`` (whole-head affine), an int32
``block_table [B, max_blocks]`` and the INT4 region ``[start_b, end_b)`` per request; for KV4-RL a
:class:`~kvlib.kernels.int4.launch.SideBuffer`. Returns ``(o [B, Hq, d] fp32, lse [B, Hq])``.

Design (:mod:`kvlib.kernels.int8.wspec`'s, one CTA per (request, KV head, split)):

* a **producer partition** (one warp) walks the block table and streams each tile's K and V code boxes by TMA into
  a ``ring``-deep shared-memory ring under mbarrier pairs (a page of one head is a ``[rows, d / 2]``-byte strided
  box of the ``[num_blocks * block_size, H_kv * d / 2]`` view: 64-byte rows at d = 128, inside TMA's 16-byte row
  rule; the V box is read as int16 words, four codes each, as the Triton kernel reads V). The four fp16
  scale/offset rows (2 bytes per position and head, ``H_kv`` apart: too narrow and too strided for a TMA box) are
  gathered with plain loads a tile ahead (while the producer waits for a free stage) and stored into the stage;
  the producer's arrival plus the TMA transaction complete ``ready`` (count 2);
* the **consumer partition** (the default one, one warpgroup) computes the Triton kernel's arithmetic
  (:func:`kvlib.kernels.int4.region._main_step` with ``PAGE``, bytes mode, fp16 PV), operand for operand:
  QK as two INT8 tensor-core MMAs (even channels x low nibbles, odd channels x high nibbles, int32 accumulate:
  exact), then ``s = float(s_int) (a_q s_k) + c_q m_k`` with ``a_q = s_q sm log2 e``, ``c_q = s_q sum q8 sm log2 e``
  (the same expression; the offline sm_90 PTX of both kernels computes it as the same ``mul``, ``mul``,
  ``fma.rn`` after the same ``mma ... s32.s8.s8.s32``, so each score should be the Triton kernel's bit for bit: not
  yet checked on a GPU); the online softmax in base 2 with the sums kept per (head, position) tile; PV as fp16
  ``p s_v`` x the V codes as the exact subnormal fp16 ``c 2^-24`` (one ``and`` per two codes), four nibble planes
  (channels ``4 i + j``), fp32 accumulate, ``2^24`` and the offsets' sum ``sum p m_v`` applied at the end. The TMA
  of the next ``ring - 1`` tiles runs under this tile's math.

Per score the arithmetic is the Triton kernel's; the tiles (``block_n``) and splits differ, so the online softmax
folds in another order and ``p`` is rounded to fp16 against another running max: ``lse`` agrees with the Triton
kernel to fp32 rounding, ``o`` to the fp16 rounding of ``p s_v`` (the tests use the Triton kernel's own tolerances
against the reference).

Options (:class:`WSpec4Config`, timed side by side by ``dev/gpu/wspec_int4.sh``): ``block_n``/``ring``/``maxnreg``/
``producer_regs``/``ctas_per_sm`` (two CTAs per SM at 128 registers; three at 80 with a 32-register producer, no
spills offline); ``pdl`` (programmatic dependent launch, as the Triton KV4 kernel); ``rows8`` (the scores, softmax and
sums on the 8 head rows of the fragment, the certified INT8 kernels' ``Z8`` selection: 646 -> 514 consumer loop
instructions per warp per 128-position tile, offline sm_90 SASS at 2026-12-02).

Tiles are aligned to ``block_n`` in absolute positions and splits take whole tiles (as the Triton kernel's blocks),
so every TMA box (``min(block_size, block_n)`` rows, ``block_size`` a power of two) lies inside one page. A box
wholly outside ``[start, end)`` reads page 0 (its table load is masked; a KV4-RL region starts past the sinks, and
table entries outside the region may be -1); positions outside the region get score ``-inf`` and value scale and
offset 0 (their scale loads are masked), so whatever a fresh page holds (NaN scales) never reaches the output.

**KV4-RL**: the side region (INT8 sinks and recent positions) is the existing protected-region body
:func:`kvlib.kernels.int4.protected._protected_region`, launched by a two-line Triton wrapper that writes its state
into the last slot of this kernel's split states, and one :func:`kvlib.kernels.tl.merge.merge_splits` combines them
all. Reuse rather than a second implementation: the side region is at most ``sink + recent`` slots (144 at the
chapter's default, under 1% of a 16k row), its arithmetic (INT8 QK, bf16 PV) is already tested against its
reference, and a Gluon copy would be a second body to keep equal to it. The price is one more launch than the
Triton KV4-RL (which runs the region as an extra program of its own launch); ``dev/gpu/wspec_int4.sh`` measures it.

``WSpec4Config(side_fused=True)`` (issue 40, opt-in: :data:`DISPATCH_CONFIG_RL`) puts the side region in the same
launch: :func:`_wspec4rl_stage1` is stage 1 with the side buffer's pointers; split 0's consumer runs
:func:`_side_region4` before its own tiles, while the producer fills the ring, and gives up
``ceil(C side_cost / block_n)`` INT4 tiles for it (:func:`split_tiles`; ``side_cost`` 8/3 INT4 positions per side
slot, from the offline loop counts; with ``side_cost = 0`` the split plan is stage 1's and the last split, which
``cdiv`` leaves the fewest tiles, runs it). The side state goes to the slot after the INT4 splits, merged by the
same LSE merge. :func:`_side_region4` is
the protected region's arithmetic operand for operand (16 query rows; INT8 QK by ``mma.sync ... s8.s8.s32``,
``s = float(s_int) (a_q s_k)``, masked past the count; base-2 online softmax with per-row sums per ``block_p``
slots; PV as ``bf16(p)`` x ``bf16(float(v8) s_v)`` in fp32 by ``mma.sync ... bf16.bf16.f32``; ``o = acc / l``), so
the side state agrees with the Triton one to fp32 summation order and the merged result keeps the KV4-RL
tolerances. Stage 1 itself is a separate kernel, so its binary stays as validated (the offline SASS hashes of the
KV4 variants are unchanged: ``dev/wspec4rl_sass.py``). Not yet run on a GPU.

:func:`plan` validates every argument (ValueError/TypeError naming it; it calls the paged launcher's own checks)
and picks the splits without a GPU; :func:`wspec4_reference` validates as :func:`plan` and calls the family's torch
reference :func:`kvlib.kernels.int4.paged.kv4_paged_decode_ref`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from kvlib.kernels.int4.launch import SideBuffer
from kvlib.kernels.int4.protected import _protected_region
from kvlib.kernels.int4.query import QueryInt8
from kvlib.kernels.int4.tl_helpers import _PLANE_F16_ASM, LOG2E
from kvlib.kernels.int8 import gluon as G8
from kvlib.kernels.int8 import wspec_cert as WC
from kvlib.kernels.int8.wspec import Plan, check_ring

LN2_G: gl.constexpr = gl.constexpr(0.6931471805599453)
#: 2^24: the V planes enter PV as the subnormal fp16 ``c 2^-24`` (:func:`kvlib.kernels.int4.tl_helpers._plane_f16`)
V_UNSUB_G: gl.constexpr = gl.constexpr(16777216.0)
#: fewest query rows of the protected region's tile (:data:`kvlib.kernels.int4.config.MIN_ROWS`, as the fused launch)
_MIN_ROWS = 8


@dataclasses.dataclass(frozen=True)
class WSpec4Config:
    """Compile-time shape: ``block_n`` positions per tile, ``ring`` shared-memory stages, the producer warp's
    registers, the launch's ``maxnreg`` (per thread over the CTA: how many CTAs fit an SM), ``ctas_per_sm`` for the
    split planner, ``block_p`` side slots per step of the KV4-RL protected region."""

    block_n: int = 128
    ring: int = 4
    producer_regs: int = 64
    maxnreg: int = 128
    ctas_per_sm: int = 2
    block_p: int = 32
    #: programmatic dependent launch (sm_90): stage 1 may launch while the kernel before it finishes (it waits,
    #: ``griddepcontrol.wait``, before anything else, as the Triton KV4 kernel does) and lets the split merge launch
    #: at once (which waits for stage 1 to complete before it reads the states)
    pdl: bool = False
    #: the softmax on the 8 head rows of the score fragment only (GQA <= 8; rows 8-15 pad the MMA's M to 16), as the
    #: certified INT8 kernels do (:func:`kvlib.kernels.int8.wspec_cert.consumer_layouts`' ``Z8``): half the
    #: per-score work of the 16-row tile; the PV operand is the 8 rows duplicated
    rows8: bool = False
    #: KV4-RL: the side region in the same launch (:func:`_wspec4rl_stage1`: one split's consumer runs the INT8
    #: side slots before its tiles, the Triton protected region's arithmetic, and writes the side state);
    #: False: the side state is a second (Triton) launch before stage 1 (:func:`side_state`). No effect without a
    #: side buffer. Not dispatched until a GPU run of tests/test_wspec_int4.py validates it (DISPATCH_CONFIG_RL)
    side_fused: bool = False
    #: with ``side_fused``: INT4 positions' worth of work per side slot, so that the split that runs the side
    #: region (split 0) takes ``side_tiles`` fewer INT4 tiles (:func:`side_tiles`, :func:`split_tiles`). 8/3 from
    #: the offline sm_90 loops at d = 128 (dev/results/wspec4rl_sass.json: 461 instructions per 32 side slots, 690
    #: per 128-position INT4 tile, 2.67 per slot); 0: the plain split plan, the last split runs the side region
    side_cost: float = 8 / 3

    def __post_init__(self):
        for name in ("pdl", "rows8", "side_fused"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("block_n", "ring", "producer_regs", "maxnreg", "ctas_per_sm", "block_p"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if self.block_n not in (32, 64, 128, 256):
            raise ValueError(f"block_n must be 32, 64, 128 or 256 (a TMA box has at most 256 rows), got {self.block_n}")
        check_ring(self, max_ring=8)
        if (isinstance(self.side_cost, bool) or not isinstance(self.side_cost, (int, float))
                or not math.isfinite(self.side_cost) or not 0 <= self.side_cost <= 64):
            raise ValueError(f"side_cost must be a number in [0, 64], got {self.side_cost!r}")
        if self.block_p not in (16, 32, 64):
            raise ValueError(f"block_p must be 16, 32 or 64, got {self.block_p}")

    def smem_bytes(self, d: int = 128) -> int:
        """Shared memory of the ring (K and V codes, four fp16 scale rows, two mbarriers per stage)."""
        return self.ring * (self.block_n * d + 8 * self.block_n + 16)


#: what :func:`kvlib.kernels.int4.decode.kv4_paged_decode` (``backend="auto"`` with no Triton config, or
#: ``"wspec"``) launches: the 8-row softmax, 128-position tiles, a 4-deep ring, no PDL. H200 timings of 2026-12-02
#: (dev/results/wspec_int4_timing.json: B = 8 and 32, S = 16k and 32k, 28 / 4 heads, pages of 256, CUDA graphs):
#: KV4 0.91-0.95 of the Triton paged kernel's time at every shape, the fastest of the ten variants at three of
#: four shapes. KV4-RL is not dispatched here: with its side region it took 1.00-1.18x the Triton paged kernel's
#: time (the side state is one launch more than the fused Triton kernel), so ``"auto"`` keeps Triton for it.
DISPATCH_CONFIG = {"rows8": True}

#: what ``"auto"`` would launch for KV4-RL (a side buffer); None: KV4-RL stays on the Triton paged kernel. The
#: candidate is ``{"rows8": True, "side_fused": True}`` (the side region in the same launch, issue 40): it compiles
#: for sm_90 without spills (dev/results/wspec4rl_sass.json) but has not run on a GPU, so it is opt-in until
#: ``tests/test_wspec_int4.py -k side_fused`` passes on one and ``dev/gpu/wspec_int4.sh`` times it against the
#: Triton paged kernel. The backend (:meth:`kvlib.backends.int4.Int4Backend._choose`) and
#: :func:`kvlib.kernels.int4.decode.kv4_paged_decode` read it at call time.
DISPATCH_CONFIG_RL: dict | None = None


def _device_reason(q8: torch.Tensor) -> str | None:
    """Why ``q8``'s device cannot run the warp-specialised kernel (None on a Hopper GPU)."""
    if not q8.is_cuda:
        return "the warp-specialised kernel needs a CUDA tensor"
    if torch.cuda.get_device_capability(q8.device)[0] != 9:
        return "the warp-specialised kernel needs a Hopper (sm_90) GPU: TMA, mbarrier and warp_specialize"
    return None


def wspec4_unsupported(qp, k_codes, block_table, *, block_size, side=None, rl: bool = False) -> str | None:
    """Why ``"auto"`` does not send this paged request to the warp-specialised kernel (None where it does): KV4, or
    KV4-RL (a ``side`` buffer, or ``rl``: the backend asks before it has one) only where
    :data:`DISPATCH_CONFIG_RL` opts in; ``d`` 64 or 128, ``GQA <= 8``, pages of a power of two >= 8 slots,
    contiguous codes, on a Hopper (sm_90) GPU. The shape rules come first, so they are checked the same way on any
    device."""
    if (side is not None or rl) and DISPATCH_CONFIG_RL is None:
        return ("KV4-RL (a side buffer): the side region in the same launch awaits its GPU validation, the fused "
                "Triton paged kernel runs it (DISPATCH_CONFIG_RL is None)")
    q8 = getattr(qp, "q8", None)
    if not isinstance(q8, torch.Tensor) or q8.ndim != 3:
        return "qp must be a prepared query (kvlib.kernels.int4.query.prepare_query)"
    if not isinstance(k_codes, torch.Tensor) or k_codes.ndim != 4:
        return "k_codes must be [num_blocks, block_size, H_kv, d // 2] pages"
    d, hkv = 2 * k_codes.shape[-1], k_codes.shape[2]
    if d not in (64, 128):
        return f"head_dim must be 64 or 128, got {d}"
    if q8.shape[1] % hkv or q8.shape[1] // hkv > 8:
        return f"at most 8 query heads per KV head, got {q8.shape[1]} query / {hkv} KV heads"
    if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 8
            or block_size & (block_size - 1)):
        return f"block_size must be a power of two >= 8, got {block_size!r}"
    if not (k_codes.is_contiguous() and isinstance(block_table, torch.Tensor) and block_table.is_contiguous()):
        return "k_codes and block_table must be contiguous"
    return _device_reason(q8)


@dataclasses.dataclass(frozen=True)
class Plan4(Plan):
    """A validated launch: the RTN kernel's :class:`~kvlib.kernels.int8.wspec.Plan` (``num_splits``: the INT4
    splits; the side region's state comes after them) plus the side slots, the states per (request, KV head) and the
    softmax scale."""

    side_slots: int
    states: int
    sm_scale: float


def plan(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, *, block_size: int,
         side: SideBuffer | None = None, config: WSpec4Config | None = None, sm_scale: float | None = None,
         num_splits: int | None = None, sms: int | None = None) -> Plan4:
    """Validate a request (ValueError/TypeError naming the argument; the paged launcher's checks, then this kernel's
    limits) and choose its splits: one wave of at most ``ctas_per_sm`` CTAs per SM over ``sms`` SMs (the device's
    count when None and on CUDA, else 132), at least 4 tiles per split. Needs no GPU."""
    from kvlib.kernels.int4.paged import _check_paged

    cfg = config if config is not None else WSpec4Config()
    if not isinstance(cfg, WSpec4Config):
        raise TypeError(f"config must be a WSpec4Config, got {type(cfg).__name__}")
    if not isinstance(qp, QueryInt8):
        raise TypeError(f"qp must be a QueryInt8 (kvlib.kernels.int4.query.prepare_query), got {type(qp).__name__}")
    if side is not None and not isinstance(side, SideBuffer):
        raise TypeError(f"side must be a SideBuffer or None, got {type(side).__name__}")
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    hkv, maxb, c, d = _check_paged(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end,
                                   block_size, side)
    B, hq, _ = qp.q8.shape
    gqa = hq // hkv
    if d not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 (16-byte TMA rows of d / 2 code bytes), got {d}")
    if gqa > 8:
        raise ValueError(f"qp: at most 8 query heads per KV head (heads are the MMA's M, padded to 16), got {gqa}")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8 (TMA boxes inside one page), got {block_size}")
    for name, t in (("qp.scale", qp.scale), ("qp.qsum", qp.qsum)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (B, hq):
            raise ValueError(f"{name} must be a float32 [B={B}, Hq={hq}] tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    tensors = {"qp.q8": qp.q8, "qp.scale": qp.scale, "qp.qsum": qp.qsum, "k_codes": k_codes, "k_scale": k_scale,
               "k_off": k_off, "v_codes": v_codes, "v_scale": v_scale, "v_off": v_off, "block_table": block_table,
               "start": start, "end": end}
    if side is not None:
        tensors |= {f"side.{n}": getattr(side, n) for n in SideBuffer._fields}
    for name in ("qp.scale", "qp.qsum", "k_codes", "k_scale", "k_off", "v_codes", "v_scale", "v_off", "block_table"):
        if not tensors[name].is_contiguous():
            raise ValueError(f"{name} must be contiguous (the TMA descriptors and the row gathers assume it)")
    devs = {str(t.device) for t in tensors.values()}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(devs)}")
    sm = d**-0.5 if sm_scale is None else sm_scale
    if isinstance(sm, bool) or not isinstance(sm, (int, float)) or not math.isfinite(sm) or sm <= 0:
        raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale!r}")
    max_len = maxb * block_size
    if num_splits is None:
        if sms is None:
            sms = torch.cuda.get_device_properties(qp.q8.device).multi_processor_count if qp.q8.is_cuda else 132
        # floor: whole waves (B = 32, H_kv = 4 on 132 SMs: 2 splits, 256 CTAs, not 3 and a 45% second wave)
        num_splits = max(1, min(sms * cfg.ctas_per_sm // max(1, B * hkv), math.ceil(max_len / (4 * cfg.block_n))))
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return Plan4(B, hq, hkv, gqa, d, block_size, k_codes.shape[0], maxb, num_splits, min(block_size, cfg.block_n),
                 side_slots=c, states=num_splits + int(side is not None), sm_scale=float(sm))


# ----------------------------------------------------------------------------------------------
# the kernel
@gluon.jit
def _gather4(KS, KO, VS, VO, BT_row, n, start, end, kvh, HKV: gl.constexpr, PAGE: gl.constexpr):
    """The four fp16 scale/offset values (0 outside ``[start, end)``) of positions ``n``: row ``(page * PAGE +
    slot) * HKV + kvh`` of the ``[num_blocks, PAGE, HKV]`` tensors."""
    m = (n >= start) & (n < end)
    blk = gl.load(BT_row + n // PAGE, mask=m, other=0)
    idx = (blk.to(gl.int64) * PAGE + n % PAGE) * HKV + kvh
    return (gl.load(KS + idx, mask=m, other=0.0), gl.load(KO + idx, mask=m, other=0.0),
            gl.load(VS + idx, mask=m, other=0.0), gl.load(VO + idx, mask=m, other=0.0))


@gluon.jit
def _producer4(k_desc, v_desc, k_bufs, v_bufs, s_bufs, ready, empty, KS, KO, VS, VO, BT_row, kvh, start, end, t0,
               n_tiles, HKV: gl.constexpr, HALF: gl.constexpr, QW: gl.constexpr, PAGE: gl.constexpr,
               BN: gl.constexpr, RBOX: gl.constexpr, RING: gl.constexpr):
    """One warp: :func:`kvlib.kernels.int8.wspec._producer` (``PREFETCH``) over the INT4 pool. Per tile: wait for its
    stage to be free, TMA its K byte boxes and V word boxes (one per page piece), store the four scale rows gathered
    while waiting, arrive on ``ready``; then gather the next tile's."""
    nn = gl.arange(0, BN, layout=gl.BlockedLayout([1], [32], [1], [0]))
    ks, ko, vs, vo = _gather4(KS, KO, VS, VO, BT_row, t0 * BN + nn, start, end, kvh, HKV, PAGE)
    for i in range(n_tiles):
        s = i % RING
        ph = (i // RING) & 1
        # a fresh mbarrier counts as having completed the phase before phase 0: the first RING waits pass at once
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), BN * HALF + BN * QW * 2)
        n0 = (t0 + i) * BN
        for j in gl.static_range(BN // RBOX):
            n = n0 + j * RBOX
            # a box wholly outside the region reads page 0 (its table entry may be -1)
            blk = gl.load(BT_row + n // PAGE, mask=(n + RBOX > start) & (n < end), other=0)
            row = blk * PAGE + n % PAGE
            tma.async_copy_global_to_shared(k_desc, [row, kvh * HALF], ready.index(s),
                                            k_bufs.index(s).slice(j * RBOX, RBOX, dim=0))
            tma.async_copy_global_to_shared(v_desc, [row, kvh * QW], ready.index(s),
                                            v_bufs.index(s).slice(j * RBOX, RBOX, dim=0))
        s_bufs.index(s * 4 + 0).store(ks)
        s_bufs.index(s * 4 + 1).store(ko)
        s_bufs.index(s * 4 + 2).store(vs)
        s_bufs.index(s * 4 + 3).store(vo)
        gl.thread_barrier()  # every lane's stores before the one arrival
        mbarrier.arrive(ready.index(s), count=1)
        # the next tile's (all masked past the split: no memory traffic)
        ks, ko, vs, vo = _gather4(KS, KO, VS, VO, BT_row, n0 + BN + nn, start, end, kvh, HKV, PAGE)


@gluon.jit
def _gdc(asm: gl.constexpr):
    """A grid-dependency-control instruction (:mod:`triton.language.extra.cuda.gdc`'s form: a dummy output)."""
    gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _nib_lo(x):
    """Low nibbles of uint8 codes (held as int8) as int8: one ``and`` per four codes
    (:func:`kvlib.kernels.int4.tl_helpers._nibbles_i8`)."""
    return gl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [x], dtype=gl.int8, is_pure=True,
                                     pack=4)


@gluon.jit
def _nib_hi(x):
    """High nibbles as int8 (:func:`kvlib.kernels.int4.tl_helpers._nibbles_i8` with ``HIGH``)."""
    return gl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r", [x],
                                     dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _plane(w, J: gl.constexpr):
    """Nibble ``J`` (channel ``4 i + J``) of int16 words of four codes as the exact subnormal fp16 ``c 2^-24``: one
    ``and`` (and a shift for J > 0) per two codes (:func:`kvlib.kernels.int4.tl_helpers._plane_f16`, the same PTX)."""
    return gl.inline_asm_elementwise(_PLANE_F16_ASM[J], "=r,r", [w], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _consumer4(k_bufs, v_bufs, s_bufs, ready, empty, Q8, QS, QSUM, O_S, LSE_S, b, kvh, split, start, end, t0,
               n_tiles, sm_scale_log2, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
               GQA: gl.constexpr, HQ: gl.constexpr, HALF: gl.constexpr, QW: gl.constexpr, BN: gl.constexpr,
               RING: gl.constexpr, NW: gl.constexpr, R8: gl.constexpr = False, Z8: gl.constexpr = None):
    """The consumer warpgroup: per stage, QK (two INT8 MMAs), the online softmax, PV (four fp16 MMAs over the
    nibble planes), then free the stage; the split's state at the end.

    ``R8`` (``WSpec4Config.rows8``): the scores, the softmax and its sums on rows 0-7 of the MMA fragment only
    (layout ``Z8``: the C layout less its row-8 register, a register selection checked by ``assert_trivial``); the
    PV operand is the 8 rows duplicated; the same arithmetic per score and per term."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    QA8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)  # int8 operands
    KB8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)  # fp16 operands
    VB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    HL: gl.constexpr = gl.SliceLayout(1, MMA)  # heads
    # the softmax's tiles: the MMA layout's 16 rows, or (R8) its rows 0-7
    RN: gl.constexpr = 8 if R8 else 16
    SL: gl.constexpr = Z8 if R8 else MMA
    NL: gl.constexpr = gl.SliceLayout(0, SL)  # positions of the scores
    RL: gl.constexpr = gl.SliceLayout(1, SL)  # heads of the scores

    # the query: even / odd channels as the two QK A operands (heads as M, zero rows past GQA)
    hA = gl.arange(0, 16, layout=gl.SliceLayout(1, QA8))
    cA = gl.arange(0, HALF, layout=gl.SliceLayout(0, QA8))
    q_ptr = Q8 + b * s_qb + (kvh * GQA + hA)[:, None] * s_qh + 2 * cA[None, :]
    q0 = gl.load(q_ptr, mask=(hA < GQA)[:, None], other=0)
    q1 = gl.load(q_ptr + 1, mask=(hA < GQA)[:, None], other=0)
    hr = gl.arange(0, RN, layout=RL)
    qrow = b * HQ + kvh * GQA + hr
    a_q = gl.load(QS + qrow, mask=hr < GQA, other=0.0) * sm_scale_log2
    c_q = gl.load(QSUM + qrow, mask=hr < GQA, other=0.0) * sm_scale_log2

    m_i = gl.full([RN], float("-inf"), gl.float32, layout=RL)
    l_t = gl.zeros([RN, BN], gl.float32, layout=SL)  # the softmax sums per (head, position): one reduction at the end
    am_t = gl.zeros([RN, BN], gl.float32, layout=SL)  # sum p m_v, likewise
    acc0 = gl.zeros([16, QW], gl.float32, layout=MMA)  # channels 4 i + 0
    acc1 = gl.zeros([16, QW], gl.float32, layout=MMA)
    acc2 = gl.zeros([16, QW], gl.float32, layout=MMA)
    acc3 = gl.zeros([16, QW], gl.float32, layout=MMA)
    nl = gl.arange(0, BN, layout=NL)
    for i in range(n_tiles):
        s = i % RING
        ph = (i // RING) & 1
        n0 = (t0 + i) * BN
        mbarrier.wait(ready.index(s), ph)
        # QK: the key bytes [HALF, BN] as the B operand, low and high nibbles (exact int32, as the Triton dots)
        kt = k_bufs.index(s).permute([1, 0]).load(KB8)
        zero = gl.zeros([16, BN], gl.int32, layout=MMA)
        s_int = mma_v2(q0, _nib_lo(kt), zero)
        s_int = mma_v2(q1, _nib_hi(kt), s_int)
        if R8:
            s_int = gl.convert_layout(G8._rows8(s_int, BN), Z8, assert_trivial=True)
        ks = s_bufs.index(s * 4 + 0).load(NL).to(gl.float32)
        ko = s_bufs.index(s * 4 + 1).load(NL).to(gl.float32)
        z = s_int.to(gl.float32) * (a_q[:, None] * ks[None, :]) + c_q[:, None] * ko[None, :]
        pos = n0 + nl
        z = gl.where(((pos >= start) & (pos < end))[None, :], z, float("-inf"))
        # a tile always holds a position of the region, so m_new is finite
        m_new = gl.maximum(m_i, gl.max(z, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(z - m_new[:, None])
        vs = s_bufs.index(s * 4 + 2).load(NL).to(gl.float32)
        vo = s_bufs.index(s * 4 + 3).load(NL).to(gl.float32)
        p16 = (p * vs[None, :]).to(gl.float16)  # fp16(p s_v), the Triton kernel's operand
        if R8:  # rows 8-15 a copy (never stored)
            p16 = gl.convert_layout(WC._pad16(p16, BN), PA)
            alpha16 = WC._pad16v(alpha, HL)
        else:
            p16 = gl.convert_layout(p16, PA)
            alpha16 = alpha
        vw = v_bufs.index(s).load(VB)  # [BN, QW] int16 words, channels 4 i .. 4 i + 3
        acc0 = mma_v2(p16, _plane(vw, 0), acc0 * alpha16[:, None])
        acc1 = mma_v2(p16, _plane(vw, 1), acc1 * alpha16[:, None])
        acc2 = mma_v2(p16, _plane(vw, 2), acc2 * alpha16[:, None])
        acc3 = mma_v2(p16, _plane(vw, 3), acc3 * alpha16[:, None])
        # the stage's reads are done: order them before the next TMA write, then free it
        fence_async_shared()
        mbarrier.arrive(empty.index(s), count=1)
        l_t = l_t * alpha[:, None] + p
        am_t = am_t * alpha[:, None] + p * vo[None, :]
        m_i = m_new

    # the split's state, as the Triton kernel's epilogue: o = (2^24 acc + sum p m_v) / l, 0 for an empty split
    l_i = gl.sum(l_t, 1)
    am = gl.sum(am_t, 1)
    ok = l_i > 0.0
    inv = gl.where(ok, 1.0 / gl.where(ok, l_i, 1.0), 0.0)
    if R8:  # the MMA layout's 16 rows again (rows 8-15 a copy)
        inv = WC._pad16v(inv, HL)
        am = WC._pad16v(am, HL)
    lse = gl.where(ok, (m_i + gl.log2(gl.where(ok, l_i, 1.0))) * LN2_G, float("-inf"))
    if R8:
        h = gl.arange(0, 16, layout=HL)
    else:
        h = hr
    c4 = 4 * gl.arange(0, QW, layout=gl.SliceLayout(0, MMA))
    o_base = O_S + b * s_os_b + (kvh * GQA + h)[:, None] * s_os_h + split * s_os_s + c4[None, :]
    hm = (h < GQA)[:, None]
    gl.store(o_base, (acc0 * V_UNSUB_G + am[:, None]) * inv[:, None], mask=hm)
    gl.store(o_base + 1, (acc1 * V_UNSUB_G + am[:, None]) * inv[:, None], mask=hm)
    gl.store(o_base + 2, (acc2 * V_UNSUB_G + am[:, None]) * inv[:, None], mask=hm)
    gl.store(o_base + 3, (acc3 * V_UNSUB_G + am[:, None]) * inv[:, None], mask=hm)
    gl.store(LSE_S + b * s_ls_b + (kvh * GQA + hr) * s_ls_h + split, lse, mask=hr < GQA)


@gluon.jit
def _side_loads(K8, K8S, V8, V8S, slot0, n0, cnt, kc, kn, nl, vn, vc, D: gl.constexpr):
    """Side slots ``[n0, n0 + BP)`` (masked at ``cnt``: none read past it): the key codes ``[D, BP]`` straight into
    the QK B operand (four consecutive channels of one slot per 32-bit load), their scales along the scores'
    positions, the value codes ``[BP, D]`` in 16-byte row pieces and their scales."""
    k = gl.load(K8 + (slot0 + n0 + kn)[None, :] * D + kc[:, None], mask=(n0 + kn < cnt)[None, :], other=0)
    nm = n0 + nl < cnt
    ks = gl.load(K8S + slot0 + n0 + nl, mask=nm, other=0.0)
    vm = n0 + vn < cnt
    v8 = gl.load(V8 + (slot0 + n0 + vn)[:, None] * D + vc[None, :], mask=vm[:, None], other=0)
    vs = gl.load(V8S + slot0 + n0 + vn, mask=vm, other=0.0)
    return k, ks, v8, vs


@gluon.jit
def _side_region4(Q8, QS, K8, K8S, V8, V8S, COUNT, O_S, LSE_S, b, kvh, slot, C, sm_scale_log2, s_qb, s_qh,
                  s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h, GQA: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                  D: gl.constexpr, BP: gl.constexpr, NW: gl.constexpr):
    """The KV4-RL side slots ``0..count_b-1`` of (request ``b``, KV head ``kvh``) in the consumer warpgroup, state
    to slot ``slot``: :func:`kvlib.kernels.int4.protected._protected_region` operand for operand (16 query rows,
    zeros past ``GQA``; per ``BP`` slots ``s = float(q8 . k8) (a_q s_k)``, masked at the count, the online softmax
    in base 2 with per-row sums, ``acc = bf16(p) x bf16(float(v8) s_v) + alpha acc`` in fp32; ``o = acc / l``).
    Where ``BP * D <= 4096`` (``block_p`` 32 at d = 128, 64 at d = 64) the next step's codes and scales are loaded
    before this step's math (registers, no shared-memory ring); larger steps would spill at 128 registers."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    QA8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)  # int8 operands
    KB8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)  # bf16 operands
    VB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # the value rows in 16-byte pieces (D / 16 threads per row), dequantised there, then moved to the operand
    VL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (D // 16), D // 16], [NW, 1], [1, 0])
    HL: gl.constexpr = gl.SliceLayout(1, MMA)
    NL: gl.constexpr = gl.SliceLayout(0, MMA)
    cnt = gl.minimum(gl.load(COUNT + b), C)
    hA = gl.arange(0, 16, layout=gl.SliceLayout(1, QA8))
    cA = gl.arange(0, D, layout=gl.SliceLayout(0, QA8))
    q = gl.load(Q8 + b * s_qb + (kvh * GQA + hA)[:, None] * s_qh + cA[None, :], mask=(hA < GQA)[:, None], other=0)
    hr = gl.arange(0, 16, layout=HL)
    a_q = gl.load(QS + b * HQ + kvh * GQA + hr, mask=hr < GQA, other=0.0) * sm_scale_log2
    slot0 = (b * HKV + kvh).to(gl.int64) * C
    kc = gl.arange(0, D, layout=gl.SliceLayout(1, KB8))
    kn = gl.arange(0, BP, layout=gl.SliceLayout(0, KB8))
    vn = gl.arange(0, BP, layout=gl.SliceLayout(1, VL))
    vc = gl.arange(0, D, layout=gl.SliceLayout(0, VL))
    nl = gl.arange(0, BP, layout=NL)
    m_i = gl.full([16], float("-inf"), gl.float32, layout=HL)
    l_i = gl.zeros([16], gl.float32, layout=HL)
    acc = gl.zeros([16, D], gl.float32, layout=MMA)
    PF: gl.constexpr = BP * D <= 4096
    if PF:
        k, ks, v8, vs = _side_loads(K8, K8S, V8, V8S, slot0, 0, cnt, kc, kn, nl, vn, vc, D)
    for n0 in range(0, cnt, BP):
        if PF:
            k_n, ks_n, v8_n, vs_n = _side_loads(K8, K8S, V8, V8S, slot0, n0 + BP, cnt, kc, kn, nl, vn, vc, D)
        else:
            k, ks, v8, vs = _side_loads(K8, K8S, V8, V8S, slot0, n0, cnt, kc, kn, nl, vn, vc, D)
        s = mma_v2(q, k, gl.zeros([16, BP], gl.int32, layout=MMA)).to(gl.float32) * (
            a_q[:, None] * ks.to(gl.float32)[None, :])
        s = gl.where((n0 + nl < cnt)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        v = gl.convert_layout((v8.to(gl.float32) * vs.to(gl.float32)[:, None]).to(gl.bfloat16), VB)
        acc = mma_v2(gl.convert_layout(p.to(gl.bfloat16), PA), v, acc * alpha[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        if PF:
            k, ks, v8, vs = k_n, ks_n, v8_n, vs_n
    ok = l_i > 0.0
    inv = gl.where(ok, 1.0 / gl.where(ok, l_i, 1.0), 0.0)
    cols = gl.arange(0, D, layout=NL)
    hm = (hr < GQA)[:, None]
    gl.store(O_S + b * s_os_b + (kvh * GQA + hr)[:, None] * s_os_h + slot * s_os_s + cols[None, :],
             acc * inv[:, None], mask=hm)
    lse = gl.where(ok, (m_i + gl.log2(gl.where(ok, l_i, 1.0))) * LN2_G, float("-inf"))
    gl.store(LSE_S + b * s_ls_b + (kvh * GQA + hr) * s_ls_h + slot, lse, mask=hr < GQA)


@gluon.jit
def _consumer4rl(k_bufs, v_bufs, s_bufs, ready, empty, Q8, QS, QSUM, O_S, LSE_S, b, kvh, split, start, end, t0,
                 n_tiles, sm_scale_log2, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
                 K8, K8S, V8, V8S, COUNT, C, num_splits, side_split,
                 GQA: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, HALF: gl.constexpr,
                 QW: gl.constexpr, BN: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr, BP: gl.constexpr,
                 R8: gl.constexpr = False, Z8: gl.constexpr = None):
    """:func:`_consumer4` of a KV4-RL launch: split ``side_split`` (0, which :func:`split_tiles` gives fewer tiles;
    or with no rebalance the last, which ``cdiv`` gives the remainder) first runs the side region
    (:func:`_side_region4`, state ``num_splits``) while the producer fills the ring, then its INT4 tiles,
    unchanged."""
    if split == side_split:
        _side_region4(Q8, QS, K8, K8S, V8, V8S, COUNT, O_S, LSE_S, b, kvh, num_splits, C, sm_scale_log2, s_qb, s_qh,
                      s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h, GQA, HQ, HKV, D, BP, NW)
    _consumer4(k_bufs, v_bufs, s_bufs, ready, empty, Q8, QS, QSUM, O_S, LSE_S, b, kvh, split, start, end, t0,
               n_tiles, sm_scale_log2, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
               GQA, HQ, HALF, QW, BN, RING, NW, R8, Z8)


# the split count and the strides that follow the batch are run-time values: one binary serves every batch size and
# split count (Triton would otherwise specialise a stride of 1 or a multiple of 16 into a new binary)
@gluon.jit(do_not_specialize=["num_splits", "s_bt_b", "s_os_b", "s_os_h", "s_os_s", "s_ls_b", "s_ls_h"])
def _wspec4_stage1(
    Q8, QS, QSUM, k_desc, v_desc, KS, KO, VS, VO, BT, START, END, O_S, LSE_S,
    sm_scale_log2, num_splits, max_len, s_qb, s_qh, s_bt_b, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr,
    RBOX: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr, PRODUCER_REGS: gl.constexpr, PDL: gl.constexpr = False,
    ROWS8: gl.constexpr = False, Z8: gl.constexpr = None,
):
    if PDL:  # as kvlib.kernels.int4.paged._kv4_paged_kernel: wait for the kernel before, then release the next
        _gdc("griddepcontrol.wait; // dummy $0")
        _gdc("griddepcontrol.launch_dependents; // dummy $0")
    HALF: gl.constexpr = D // 2  # code bytes per (position, head)
    QW: gl.constexpr = D // 4  # int16 words of four codes
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    # the Triton kernel's split plan (kvlib.kernels.int4.region._main_region): whole aligned tiles per split
    start = gl.load(START + b)
    end = gl.maximum(gl.minimum(gl.load(END + b), max_len), start)  # within the table
    first = start // BN
    nblk = gl.where(end > start, gl.cdiv(end, BN) - first, 0)
    bps = gl.cdiv(nblk, num_splits)
    t0 = first + split * bps
    n_tiles = gl.maximum(gl.minimum(t0 + bps, first + nblk) - t0, 0)
    BT_row = BT + b * s_bt_b

    k_bufs = gl.allocate_shared_memory(gl.int8, [RING, BN, HALF], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.int16, [RING, BN, QW], v_desc.layout)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    s_bufs = gl.allocate_shared_memory(gl.float16, [RING * 4, BN], SL)  # row stage * 4 + (s_k, m_k, s_v, m_v)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=2)  # the producer's arrival and the TMA transaction
        mbarrier.init(empty.index(i), count=1)

    gl.warp_specialize([
        (_consumer4, (k_bufs, v_bufs, s_bufs, ready, empty, Q8, QS, QSUM, O_S, LSE_S, b, kvh, split, start, end, t0,
                      n_tiles, sm_scale_log2, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
                      GQA, GQA * HKV, HALF, QW, BN, RING, NW, ROWS8, Z8)),
        (_producer4, (k_desc, v_desc, k_bufs, v_bufs, s_bufs, ready, empty, KS, KO, VS, VO, BT_row, kvh, start,
                      end, t0, n_tiles, HKV, HALF, QW, PAGE, BN, RBOX, RING)),
    ], [1], [PRODUCER_REGS])


@gluon.jit(do_not_specialize=["num_splits", "C", "side_w", "side_split", "s_bt_b", "s_os_b", "s_os_h", "s_os_s",
                              "s_ls_b", "s_ls_h"])
def _wspec4rl_stage1(
    Q8, QS, QSUM, k_desc, v_desc, KS, KO, VS, VO, BT, START, END, O_S, LSE_S, K8, K8S, V8, V8S, COUNT,
    sm_scale_log2, num_splits, max_len, C, side_w, side_split, s_qb, s_qh, s_bt_b, s_os_b, s_os_h, s_os_s, s_ls_b,
    s_ls_h,
    GQA: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr,
    RBOX: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr, PRODUCER_REGS: gl.constexpr, PDL: gl.constexpr = False,
    ROWS8: gl.constexpr = False, Z8: gl.constexpr = None, BP: gl.constexpr = 32,
):
    """:func:`_wspec4_stage1` with the KV4-RL side region in the same launch (``WSpec4Config.side_fused``): the
    INT8 side buffer ``K8, V8 [B, H_kv, C, d]``, ``K8S, V8S [B, H_kv, C]``, ``COUNT [B]`` is read by the last
    split's consumer (:func:`_consumer4rl`), its state is ``num_splits`` of the ``num_splits + 1``. The grid, the
    ring and the producer are stage 1's; the split plan is :func:`split_tiles`' (stage 1's with ``side_w = 0``). A
    separate kernel so that stage 1's binary stays as it was validated."""
    if PDL:
        _gdc("griddepcontrol.wait; // dummy $0")
        _gdc("griddepcontrol.launch_dependents; // dummy $0")
    HALF: gl.constexpr = D // 2
    QW: gl.constexpr = D // 4
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    start = gl.load(START + b)
    end = gl.maximum(gl.minimum(gl.load(END + b), max_len), start)
    first = start // BN
    nblk = gl.where(end > start, gl.cdiv(end, BN) - first, 0)
    # split_tiles: the side region counts as side_w tiles at the head of split 0
    bps = gl.cdiv(nblk + side_w, num_splits)
    lo = gl.maximum(split * bps - side_w, 0)
    t0 = first + lo
    n_tiles = gl.maximum(gl.minimum((split + 1) * bps - side_w, nblk) - lo, 0)
    BT_row = BT + b * s_bt_b

    k_bufs = gl.allocate_shared_memory(gl.int8, [RING, BN, HALF], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.int16, [RING, BN, QW], v_desc.layout)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    s_bufs = gl.allocate_shared_memory(gl.float16, [RING * 4, BN], SL)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=2)
        mbarrier.init(empty.index(i), count=1)

    gl.warp_specialize([
        (_consumer4rl, (k_bufs, v_bufs, s_bufs, ready, empty, Q8, QS, QSUM, O_S, LSE_S, b, kvh, split, start, end,
                        t0, n_tiles, sm_scale_log2, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
                        K8, K8S, V8, V8S, COUNT, C, num_splits, side_split,
                        GQA, GQA * HKV, HKV, D, HALF, QW, BN, RING, NW, BP, ROWS8, Z8)),
        (_producer4, (k_desc, v_desc, k_bufs, v_bufs, s_bufs, ready, empty, KS, KO, VS, VO, BT_row, kvh, start,
                      end, t0, n_tiles, HKV, HALF, QW, PAGE, BN, RBOX, RING)),
    ], [1], [PRODUCER_REGS])


@triton.jit(do_not_specialize=["C", "SPLIT", "NS"])
def _side_state(Q8, QS, K8, K8S, V8, V8S, COUNT, OUT, LSE, sm_scale_log2, C, SPLIT, NS, HKV: tl.constexpr,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, INTERP: tl.constexpr):
    """Grid ``(B, Hkv)``: the existing protected-region body, its state written as state ``SPLIT`` of ``NS``
    (the slot after the INT4 splits of ``OUT [B, Hq, NS, D]``, ``LSE [B, Hq, NS]``)."""
    _protected_region(tl.program_id(0), tl.program_id(1), Q8, QS, K8, K8S, V8, V8S, COUNT, OUT, LSE, sm_scale_log2,
                      C, SPLIT, NS, HKV, G, GP, D, BLOCK_P, INTERP)


# ----------------------------------------------------------------------------------------------
# host side
def smem_layouts(box_rows: int, d: int = 128):
    """The NVMMA shared layouts of one K box (``[box_rows, d / 2]`` bytes) and one V box (``[box_rows, d / 4]``
    int16 words), also the ring's: the swizzle Triton picks for the row width (64 bytes at d = 128: 64-byte
    swizzling; 32 at d = 64; the int8 kernel's unswizzled ring read back wrong codes on the H200, so none is
    unswizzled)."""
    k = gl.NVMMASharedLayout.get_default_for([box_rows, d // 2], gl.int8)
    v = gl.NVMMASharedLayout.get_default_for([box_rows, d // 4], gl.int16)
    return k, v


def descriptors(k_codes: torch.Tensor, v_codes: torch.Tensor, box_rows: int):
    """TMA descriptors over the ``[num_blocks * block_size, H_kv * d / 2]`` byte view of the K pages (as int8: the
    nibbles are bit operations) and the ``[num_blocks * block_size, H_kv * d / 4]`` int16 view of the V pages."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    nb, bs, hkv, half = k_codes.shape
    kl, vl = smem_layouts(box_rows, 2 * half)
    kf = k_codes.view(torch.int8).view(nb * bs, hkv * half)
    vf = v_codes.view(torch.int16).view(nb * bs, hkv * half // 2)
    return (TensorDescriptor(kf, [nb * bs, hkv * half], [hkv * half, 1], [box_rows, half], kl),
            TensorDescriptor(vf, [nb * bs, hkv * half // 2], [hkv * half // 2, 1], [box_rows, half // 2], vl))


def _constexprs(pl: Plan4, cfg: WSpec4Config) -> dict:
    return dict(GQA=pl.gqa, HKV=pl.hkv, D=pl.d, PAGE=pl.block_size, BN=cfg.block_n, RBOX=pl.box_rows, RING=cfg.ring,
                NW=4, PRODUCER_REGS=cfg.producer_regs, PDL=cfg.pdl, ROWS8=cfg.rows8,
                Z8=WC.consumer_layouts(cfg.block_n)["Z8"] if cfg.rows8 else None)


def wspec4_stage1(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, *, block_size: int,
                  side: SideBuffer | None = None, config: WSpec4Config | None = None, sm_scale: float | None = None,
                  num_splits: int | None = None, descs=None, out=None):
    """Launch stage 1 (and with ``side`` the protected region's state after the INT4 splits): per-split
    ``o_s [B, Hq, NS, d]`` fp32, ``lse_s [B, Hq, NS]`` (natural log; ``NS`` the splits + 1 with ``side``).
    ``descs``, ``out``: prebuilt TMA descriptors and ``(o_s, lse_s)`` (a CUDA graph captures no host work)."""
    cfg = config if config is not None else WSpec4Config()
    pl = plan(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, block_size=block_size,
              side=side, config=cfg, sm_scale=sm_scale, num_splits=num_splits)
    if not qp.q8.is_cuda:
        raise ValueError("qp: the warp-specialised kernel needs a CUDA (Hopper) device")
    kd, vd = descs if descs is not None else descriptors(k_codes, v_codes, pl.box_rows)
    B, hq, d, ns = pl.batch, pl.hq, pl.d, pl.states
    if out is None:
        o_s = torch.empty(B, hq, ns, d, dtype=torch.float32, device=qp.q8.device)
        lse_s = torch.empty(B, hq, ns, dtype=torch.float32, device=qp.q8.device)
    else:
        o_s, lse_s = out
    q8 = qp.q8.contiguous()
    start32, end32 = start.to(torch.int32), end.to(torch.int32)
    sml2 = pl.sm_scale * LOG2E
    if side is not None and cfg.side_fused:
        k8, k8s, v8, v8s = (t.contiguous() for t in side[:4])
        w = side_tiles(cfg, pl.side_slots)
        _wspec4rl_stage1[(B, pl.hkv, pl.num_splits)](
            q8, qp.scale, qp.qsum, kd, vd, k_scale, k_off, v_scale, v_off, block_table, start32, end32, o_s, lse_s,
            k8, k8s, v8, v8s, side.count.to(torch.int32), sml2, pl.num_splits, pl.max_blocks * pl.block_size,
            pl.side_slots, w, 0 if w else pl.num_splits - 1, q8.stride(0), q8.stride(1), block_table.stride(0),
            o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1), **_constexprs(pl, cfg),
            BP=cfg.block_p, num_warps=4, maxnreg=cfg.maxnreg, **({"launch_pdl": True} if cfg.pdl else {}),
        )
        return o_s, lse_s
    if side is not None:
        _launch_side(qp, side, o_s, lse_s, pl, cfg, sml2)
    _wspec4_stage1[(B, pl.hkv, pl.num_splits)](
        q8, qp.scale, qp.qsum, kd, vd, k_scale, k_off, v_scale, v_off, block_table, start32, end32, o_s, lse_s,
        sml2, pl.num_splits, pl.max_blocks * pl.block_size, q8.stride(0), q8.stride(1), block_table.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        **_constexprs(pl, cfg), num_warps=4, maxnreg=cfg.maxnreg, **({"launch_pdl": True} if cfg.pdl else {}),
    )
    return o_s, lse_s


def side_tiles(config: WSpec4Config, side_slots: int) -> int:
    """INT4 tiles the side-owning split gives up: ``ceil(side_slots * side_cost / block_n)``, 0 with
    ``side_cost = 0``."""
    if not isinstance(side_slots, int) or isinstance(side_slots, bool) or side_slots < 0:
        raise ValueError(f"side_slots must be a non-negative int, got {side_slots!r}")
    return math.ceil(side_slots * config.side_cost / config.block_n)


def split_tiles(nblk: int, num_splits: int, side_w: int) -> list[tuple[int, int]]:
    """The same-launch kernel's split plan (its in-kernel arithmetic, mirrored for the host and the tests): the
    ``(first tile, tiles)`` of each split over ``nblk`` tiles, the side region counted as ``side_w`` tiles at the
    head of split 0; ``side_w = 0`` is stage 1's plan (``cdiv(nblk, num_splits)`` tiles per split)."""
    bps = -(-(nblk + side_w) // num_splits)
    out = []
    for split in range(num_splits):
        lo = max(split * bps - side_w, 0)
        out.append((lo, max(min((split + 1) * bps - side_w, nblk) - lo, 0)))
    return out


def _launch_side(qp, side: SideBuffer, o_s, lse_s, pl: Plan4, cfg: WSpec4Config, sml2: float) -> None:
    """The protected region's state into slot ``pl.num_splits`` of ``o_s``/``lse_s`` (contiguous: the region body
    addresses ``(row * NS + slot) * d``)."""
    if not (o_s.is_contiguous() and lse_s.is_contiguous()):
        raise ValueError("out: the split states must be contiguous with a side buffer")
    k8, k8s, v8, v8s = (t.contiguous() for t in side[:4])
    _side_state[(pl.batch, pl.hkv)](
        qp.q8.contiguous(), qp.scale, k8, k8s, v8, v8s, side.count.to(torch.int32), o_s, lse_s, sml2,
        pl.side_slots, pl.num_splits, pl.states, HKV=pl.hkv, G=pl.gqa,
        GP=max(_MIN_ROWS, triton.next_power_of_2(pl.gqa)), D=pl.d, BLOCK_P=cfg.block_p,
        INTERP=not qp.q8.is_cuda, num_warps=4)


def side_state(qp, side: SideBuffer, o_s, lse_s, *, split: int, config: WSpec4Config | None = None,
               sm_scale: float | None = None) -> None:
    """Write the protected region's state alone into state ``split`` of ``o_s [B, Hq, NS, d]``, ``lse_s``: what
    :func:`wspec4_stage1` launches beside the INT4 splits; runs on the CPU under ``TRITON_INTERPRET=1`` (the tests
    check its indexing against :func:`kvlib.kernels.int4.protected.protected_decode_ref` there)."""
    from kvlib.kernels.int4.launch import _check_side

    cfg = config if config is not None else WSpec4Config()
    B, hq, d = qp.q8.shape
    hkv = side.k8.shape[1]
    c = _check_side(side, B, hkv, d)
    ns = o_s.shape[2]
    if not 0 <= split < ns:
        raise ValueError(f"split must be in [0, {ns}), got {split}")
    sm = d**-0.5 if sm_scale is None else float(sm_scale)
    pl = Plan4(B, hq, hkv, hq // hkv, d, 0, 0, 0, split, 0, side_slots=c, states=ns, sm_scale=sm)
    _launch_side(qp, side, o_s, lse_s, pl, cfg, sm * LOG2E)


def wspec4_decode(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, **kw):
    """Stage 1 and the exact LSE merge (:func:`kvlib.kernels.tl.merge.merge_splits`): ``(o [B, Hq, d] fp32,
    lse [B, Hq])``, the result of :func:`kvlib.kernels.int4.paged.kv4_paged_decode`."""
    from kvlib.kernels.tl.merge import merge_splits

    o_s, lse_s = wspec4_stage1(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, **kw)
    m = merge_splits(o_s, lse_s, pdl=True)
    return m.o, m.lse


def wspec4_decode_q(q, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, **kw):
    """:func:`wspec4_decode` of the raw query ``q [B, Hq, d]``: rotated and quantised first by the family's
    :func:`kvlib.kernels.int4.query.prepare_query` (keys are stored rotated)."""
    from kvlib.kernels.int4.query import prepare_query

    return wspec4_decode(prepare_query(q), k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end,
                         **kw)


def wspec4_reference(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, *,
                     block_size: int, side: SideBuffer | None = None, sm_scale: float | None = None):
    """The torch reference of the same request, validated as the kernel's (:func:`plan`):
    :func:`kvlib.kernels.int4.paged.kv4_paged_decode_ref` (the paged pool gathered, exact attention of the
    dequantised query over the dequantised INT4 region, merged with the side buffer's)."""
    from kvlib.kernels.int4.paged import kv4_paged_decode_ref

    plan(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end, block_size=block_size,
         side=side, sm_scale=sm_scale, num_splits=1)
    return kv4_paged_decode_ref(qp, k_codes, k_scale, k_off, v_codes, v_scale, v_off, block_table, start, end,
                                block_size=block_size, side=side, sm_scale=sm_scale)


def compile_offline(config: WSpec4Config | None = None, *, gqa: int = 7, hkv: int = 4, d: int = 128,
                    block_size: int = 16, side: bool = False):
    """Compile the kernel for sm_90 without a GPU (Triton's own ptxas): the compiled kernel, whose ``asm`` holds
    the TTGIR/PTX/cubin. Raises the compiler's error where the kernel does not build. ``side``: the KV4-RL kernel
    with the side region in the same launch (:func:`_wspec4rl_stage1`, ``config.side_fused``'s)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config if config is not None else WSpec4Config()
    rbox = min(block_size, cfg.block_n)
    kl, vl = smem_layouts(rbox, d)
    ptrs = {"Q8": "*i8", "QS": "*fp32", "QSUM": "*fp32", "k_desc": f"tensordesc<i8[{rbox}, {d // 2}],{kl!r}>",
            "v_desc": f"tensordesc<i16[{rbox}, {d // 4}],{vl!r}>", "KS": "*fp16", "KO": "*fp16", "VS": "*fp16",
            "VO": "*fp16", "BT": "*i32", "START": "*i32", "END": "*i32", "O_S": "*fp32", "LSE_S": "*fp32",
            "K8": "*i8", "K8S": "*fp16", "V8": "*i8", "V8S": "*fp16", "COUNT": "*i32"}
    pl = Plan4(1, gqa * hkv, hkv, gqa, d, block_size, 1, 1, 1, rbox, side_slots=0, states=1, sm_scale=d**-0.5)
    const = _constexprs(pl, cfg)
    kernel = _wspec4rl_stage1 if side else _wspec4_stage1
    if side:
        const["BP"] = cfg.block_p
    params = inspect.signature(kernel.fn).parameters
    sig = {n: ("constexpr" if n in const else ptrs.get(n) or ("fp32" if n == "sm_scale_log2" else "i32"))
           for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in ptrs and n not in ("k_desc", "v_desc")}
    return triton.compile(GluonASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cfg.maxnreg})
