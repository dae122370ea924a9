"""Warp-specialised RTN INT8 paged decode in Gluon (GPU only; not wired into the dispatcher yet, issue 28).

Contract (split-KV stage 1; stage 2 is :func:`kvlib.kernels.tl.merge.merge_splits`): one query token per row,
``q [B, Hq, d]`` fp16/bf16, ``Hq = GQA * H_kv`` with ``GQA <= 8``; vLLM pages of RTN int8 codes
``k_codes, v_codes [num_blocks, block_size, H_kv, d]`` with per-token, per-group fp16 scales
``k_scales, v_scales [num_blocks, block_size, H_kv, d // 32]`` (``x = s c``, the rtn-int8 format and the
``dithered=False`` :class:`kvlib.storage.paged.PagedPool` layout); an int32 block table ``[B, max_blocks]`` and
``seq_lens [B]``. d = 128 or 64 (SmolLM2; issue 40), groups of 32: ``NG = d / 32`` groups, each its own k-chunk
of ``S = Q K^T`` and its own slice of ``O`` (at d = 64 the 64-byte code rows are inside TMA's 16-byte row rule and
the ring is swizzled at 64 bytes, the row's width, as ``NVMMASharedLayout.get_default_for`` picks; the stage keeps
eight scale rows, of which rows ``g < NG`` per side are used). The d = 64 kernel is opt-in in the dispatcher until
it has run on a GPU (:data:`kvlib.kernels.int8.decode.WSPEC_AUTO_HEAD_DIMS`).

Design (FlashAttention-3 style, one CTA per (row, KV head, split)):

* a **producer partition** (one warp, few registers) walks the block table and streams each tile's K and V codes
  (``block_n`` positions, ``block_n / min(block_size, block_n)`` TMA boxes of ``[rows, d]`` per side: a page of one
  head is a strided 2-D box of the ``[num_blocks * block_size, H_kv * d]`` view, which TMA can address; the 8-byte
  scale rows cannot be, TMA boxes need 16-byte rows) into a ``ring``-deep shared-memory ring, one mbarrier pair per
  stage (``ready``: the TMA transaction bytes landed; ``empty``: the consumers have read the stage);
* the **consumer partition** (the default one, one warpgroup) waits on ``ready``, reads the stage in the
  tensor-core operand layouts (int8 -> fp16 exact: ``|c| <= 127``) and runs ``S = Q K^T`` per group of 32 channels
  (heads as M padded to 16, ``mma_v2``; the group scale multiplies the group's partial scores, so the keys' products
  are exact), the online softmax in base 2, and ``O_g += (1024 p s_v,g) V_g`` per group (one fp16 rounding of
  ``1024 p s``; ``1024`` keeps it out of the subnormals). The TMA of the next ``ring - 1`` tiles runs under this
  tile's math.
* the group scales (8 bytes per position and head: too narrow for a TMA box, whose rows need 16 bytes) either ride
  in the stage (``scales_smem``, the default: the producer gathers them with plain loads, stores them and arrives on
  ``ready``, whose count is then 2; the consumer reads every operand just before its MMA and frees the stage after
  PV), or the consumer loads them itself a tile ahead into registers and frees the stage as soon as the codes are in
  registers (``scales_smem=False``).

Second-round options (issue 28; ``dev/gpu/wspec2.sh`` timed them, ``dev/results/wspec2_timing.json``):

* ``prefetch``: the producer loads the next tile's scales while it waits for a free stage (the best variant, block_n
  128, ring 3: 1.23x SDPA bf16 at B=8 and 1.24x at B=32, S=16k).
* ``swizzle=0`` is refused: on the H200 the unswizzled ring read back wrong codes (the TMA box and Triton's
  unswizzled NVMMA layout disagree; ``dev/gpu/wspec2.sh`` probes how).

Variants that lost, their code removed (measured at commit bb9b9f2, ``dev/results/README.md``, wspec2_timing):
four one-warp consumer partitions each taking every fourth tile with its own softmax state (``warp_tiles``: 12 warps
as Triton pads partitions to warpgroups, one CTA per SM) ran at 0.21-0.27x SDPA; rescaling the running state only
when a head's max grew by more than ``2^5`` (``lazy_rescale``) gave nothing (1.19-1.21x against 1.23x).

Splits are tile-aligned (``ceil(ceil(len / NS) / block_n) * block_n`` positions), so every TMA box stays inside one
page; positions past a split's end read page 0 (the block-table load is masked) and are removed by their score
(``-inf``) and their value scale (0).

:func:`wspec_reference` is the float64 torch reference of the same contract; :func:`plan` picks the splits and
validates every argument (ValueError naming it) without a GPU, so the CPU tests cover it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from kvlib.core.checks import check_tensor

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
#: channels per scale group (the pool's group; the kernel's MMA k-chunk)
GROUP = 32
#: head dims the kernels take (2 or 4 groups; 64- and 128-byte code rows, TMA boxes of whole rows)
HEAD_DIMS = (64, 128)


def check_ring(cfg, max_ring: int) -> None:
    """The fields the warp-specialised kernels' configs share (ValueError naming the field): ``ring`` stages
    (2..``max_ring``), the producer warp's registers, the launch's ``maxnreg`` and ``ctas_per_sm``."""
    if not 2 <= cfg.ring <= max_ring:
        raise ValueError(f"ring must be 2..{max_ring} stages, got {cfg.ring}")
    if cfg.producer_regs % 8 or not 24 <= cfg.producer_regs <= 256:
        raise ValueError(f"producer_regs must be a multiple of 8 in 24..256, got {cfg.producer_regs}")
    if cfg.maxnreg % 8 or not 64 <= cfg.maxnreg <= 255:
        raise ValueError(f"maxnreg must be a multiple of 8 in 64..255, got {cfg.maxnreg}")
    if cfg.ctas_per_sm < 1:
        raise ValueError(f"ctas_per_sm must be >= 1, got {cfg.ctas_per_sm}")


@dataclasses.dataclass(frozen=True)
class WSpecConfig:
    """Compile-time shape of the kernel: ``block_n`` positions per tile, ``ring`` shared-memory stages, the consumer
    partition's warps (one warpgroup), the producer's register budget and the launch's ``maxnreg`` (registers per
    thread over the whole CTA: it sets how many CTAs fit an SM), ``ctas_per_sm`` for the split planner."""

    block_n: int = 64
    ring: int = 3
    consumer_warps: int = 4
    producer_regs: int = 64
    maxnreg: int = 128
    ctas_per_sm: int = 2
    #: scales gathered by the producer into the stage (else loaded by the consumer a tile ahead, into registers:
    #: that variant spilled offline at GQA 8 / 64-slot pages and at ring 3)
    scales_smem: bool = True
    swizzle: int = 128
    #: int8 -> fp16 by ``prmt`` bit tricks (else ``I2F`` conversions)
    prmt: bool = False
    #: (``scales_smem`` only) fp16 P, value scales folded into the value operand (else into P, per group, fp32)
    vfold: bool = False
    #: (``scales_smem`` only) the producer gathers the next tile's scales while it waits for a free stage
    prefetch: bool = False
    #: consumer warpgroups (issue 40's lever for the "no eligible warp" gap; opt-in, not yet run on a GPU): 2 is the
    #: ping-pong variant, warpgroup ``w`` taking tiles ``w, w + 2, ...`` of the split off the one ring with its own
    #: online-softmax state and writing it as split state ``2 split + w`` (the LSE merge combines them, as it does
    #: splits), so one warpgroup's softmax and PV run while the other's MMAs wait on their operands. The second
    #: warpgroup is a worker partition with ``consumer_regs`` registers; a CTA is 12 warps (the producer's padded
    #: to a warpgroup), so ``maxnreg``/``ctas_per_sm`` should leave one CTA per SM (the default ping-pong config
    #: below: 168 registers, one CTA)
    consumers: int = 1
    #: registers per thread of the second consumer warpgroup (``consumers=2``)
    consumer_regs: int = 168

    def __post_init__(self):
        if self.block_n not in (32, 64, 128, 256):
            raise ValueError(f"block_n must be 32, 64, 128 or 256, got {self.block_n}")
        check_ring(self, max_ring=8)
        if self.consumer_warps != 4:  # 8 one-warp consumers spilled offline (152 registers each, the most 13 warps get)
            raise ValueError(f"consumer_warps must be 4 (one warpgroup), got {self.consumer_warps}")
        if self.swizzle not in (32, 64, 128):
            raise ValueError(f"swizzle must be 32, 64 or 128 bytes, got {self.swizzle}" + (
                "; 0 is refused: on the H200 the unswizzled ring read back wrong codes (max |o - ref| 3.4, "
                "dev/results/wspec_timing.json): Triton's unswizzled NVMMA layout is not the row-major image a "
                "SWIZZLE_NONE TMA box of 128-byte rows writes" if self.swizzle == 0 else ""))
        if self.vfold and not self.scales_smem:
            raise ValueError("vfold needs scales_smem=True (the folded scales are read from the stage)")
        if self.prefetch and not self.scales_smem:
            raise ValueError("prefetch needs scales_smem=True (it prefetches the scales the producer gathers)")
        if self.consumers not in (1, 2) or isinstance(self.consumers, bool):
            raise ValueError(f"consumers must be 1 or 2 (ping-pong) warpgroups, got {self.consumers!r}")
        if self.consumers == 2 and not self.scales_smem:
            raise ValueError("consumers=2 needs scales_smem=True (each warpgroup reads its tile's scales from the "
                             "stage; the register-prefetching consumer walks consecutive tiles)")
        if self.consumers == 2 and self.ring % 2:
            # a stage's tiles i, i + ring, ... must all be one warpgroup's: with an odd ring, warpgroup w could wait on
            # tile i's `ready` parity while the other's tile i - ring is not yet loaded, and the completed tile
            # i - 2 ring has the same parity (the wait would pass on a stale stage)
            raise ValueError(f"consumers=2 needs an even ring (each stage serves one warpgroup), got ring={self.ring}")
        if self.consumer_regs % 8 or not 24 <= self.consumer_regs <= 256:
            raise ValueError(f"consumer_regs must be a multiple of 8 in 24..256, got {self.consumer_regs}")

    def states(self, num_splits: int) -> int:
        """Split states per (row, head) the launch writes: one per split and consumer warpgroup."""
        return num_splits * self.consumers

    def smem_bytes(self, d: int = 128) -> int:
        """Shared memory of the ring (K and V codes, the scales where ``scales_smem``) and its barriers."""
        return self.ring * (2 * self.block_n * d + (16 * self.block_n if self.scales_smem else 0) + 16)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated launch: shapes, the split count and the TMA box rows."""

    batch: int
    hq: int
    hkv: int
    gqa: int
    d: int
    block_size: int
    num_blocks: int
    max_blocks: int
    num_splits: int
    box_rows: int


def plan(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, *, config: WSpecConfig | None = None,
         num_splits: int | None = None, sms: int | None = None) -> Plan:
    """Validate a request (ValueError/TypeError naming the argument) and choose its splits: at most ``ctas_per_sm``
    CTAs per SM over ``sms`` SMs (the device's count when None and on CUDA, else 132), at least 4 tiles per split.
    Needs no GPU."""
    cfg = config or WSpecConfig()
    if not isinstance(cfg, WSpecConfig):
        raise TypeError(f"config must be a WSpecConfig, got {type(cfg).__name__}")
    check_tensor("q", q, ndim=3, dtype=(torch.float16, torch.bfloat16))
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes)):
        check_tensor(name, t, ndim=4, dtype=torch.int8)
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        check_tensor(name, t, ndim=4, dtype=torch.float16)
    check_tensor("block_table", block_table, ndim=2, dtype=torch.int32)
    check_tensor("seq_lens", seq_lens, ndim=1, dtype=torch.int32)
    B, hq, d = q.shape
    nb, bs, hkv, dk = k_codes.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be 64 or 128 (whole groups of {GROUP}, 16-byte TMA rows), got {d}")
    if dk != d:
        raise ValueError(f"k_codes: last dim must be q's head_dim {d}, got {dk}")
    if tuple(v_codes.shape) != tuple(k_codes.shape):
        raise ValueError(f"v_codes must have k_codes' shape {tuple(k_codes.shape)}, got {tuple(v_codes.shape)}")
    want = (nb, bs, hkv, d // GROUP)
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be [num_blocks, block_size, H_kv, d/{GROUP}] = {want}, got {tuple(t.shape)}")
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes), ("k_scales", k_scales), ("v_scales", v_scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the TMA descriptor and the scale loads assume it)")
    if bs < 8 or bs & (bs - 1):
        raise ValueError(f"k_codes: block_size must be a power of two >= 8, got {bs}")
    if hq % hkv:
        raise ValueError(f"q: query heads ({hq}) must be a multiple of the KV heads ({hkv})")
    gqa = hq // hkv
    if gqa > 8:
        raise ValueError(f"q: at most 8 query heads per KV head, got {gqa}")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have q's batch {B} rows, got {block_table.shape[0]}")
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must have q's batch {B} entries, got {seq_lens.shape[0]}")
    devs = {t.device for t in (q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(x) for x in devs)}")
    max_blocks = block_table.shape[1]
    max_len = max_blocks * bs
    if num_splits is None:
        if sms is None:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        per_tiles = 4 * cfg.block_n
        # floor: whole waves (B = 32, H_kv = 4 on 132 SMs: 2 splits, 256 CTAs, not 3 and a 45% second wave)
        num_splits = max(1, min(sms * cfg.ctas_per_sm // max(1, B * hkv), math.ceil(max_len / per_tiles)))
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return Plan(B, hq, hkv, gqa, d, bs, nb, max_blocks, num_splits, min(bs, cfg.block_n))


# ----------------------------------------------------------------------------------------------
# the kernel
@gluon.jit
def _producer(k_desc, v_desc, k_bufs, v_bufs, s_bufs, o_bufs, ready, empty, KS, VS, KO, BT_row, kvh, start, end,
              n_tiles, s_ks_n, s_vs_n, s_ko_n, s_ko_h, D: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr,
              RBOX: gl.constexpr, RING: gl.constexpr, SCALES_SMEM: gl.constexpr, PREFETCH: gl.constexpr = False,
              NOK: gl.constexpr = 0, NOKP: gl.constexpr = 1, NG: gl.constexpr = 4):
    """One warp: for each tile wait for its stage to be free, then TMA its K and V boxes (one per page piece); with
    ``SCALES_SMEM`` also gather the tile's group scales ``[4, BN]`` per side into the stage (plain loads and
    stores: an 8-byte scale row is too narrow for a TMA box) and arrive on ``ready`` (count 2: this arrival and the
    TMA transaction).

    ``PREFETCH`` (``SCALES_SMEM``): the scale gather a tile ahead: tile ``i + 1``'s scales are loaded into registers
    right after tile ``i``'s are stored, so their memory latency overlaps the wait for the next free stage instead of
    sitting between a stage's TMA issue and its ``ready`` arrival. ``NOK > 0`` (with PREFETCH:
    :mod:`kvlib.kernels.int8.wspec_cert`, whose producer this is): also the ``NOK`` fp16 key-outlier rows of each
    tile, gathered from ``KO`` into the stage's ``o_bufs [16, BN]`` (``NOKP``: ``NOK`` rounded up to a power of two;
    rows past it are zeroed once, rows ``NOK..NOKP`` masked to 0: the bypass MMA reads 16 rows). ``NG``: scale
    groups per head (``D / 32``); rows ``g >= NG`` of a stage's eight are left unwritten (and unread)."""
    if SCALES_SMEM:
        nn = gl.arange(0, BN, layout=gl.BlockedLayout([1], [32], [1], [0]))
    if NOK > 0:  # a lane's NOKP outlier rows of a position: one contiguous run of 2 NOK bytes (vector loads)
        OB: gl.constexpr = gl.BlockedLayout([NOKP, 1], [1, 32], [1, 1], [0, 1])
        oc = gl.arange(0, NOKP, layout=gl.SliceLayout(1, OB))
        on = gl.arange(0, BN, layout=gl.SliceLayout(0, OB))
        if NOKP < 16:  # rows NOKP..15 of every stage stay 0 (written once, before any arrival)
            OZ: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, 1], [0, 1])
            for st in gl.static_range(RING):
                o_bufs.index(st).store(gl.zeros([16, BN], gl.float16, layout=OZ))
    if PREFETCH:
        k0, k1, k2, k3, v0, v1, v2, v3 = _gather8(KS, VS, BT_row, start + nn, end, kvh, s_ks_n, s_vs_n, PAGE, NG)
    for i in range(n_tiles):
        s = i % RING
        ph = (i // RING) & 1
        # a fresh mbarrier counts as having completed the phase before phase 0: the first RING waits pass at once
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), 2 * BN * D)
        n0 = start + i * BN
        for j in gl.static_range(BN // RBOX):
            n = n0 + j * RBOX
            blk = gl.load(BT_row + n // PAGE, mask=n < end, other=0)
            row = blk * PAGE + n % PAGE
            tma.async_copy_global_to_shared(k_desc, [row, kvh * D], ready.index(s),
                                            k_bufs.index(s).slice(j * RBOX, RBOX, dim=0))
            tma.async_copy_global_to_shared(v_desc, [row, kvh * D], ready.index(s),
                                            v_bufs.index(s).slice(j * RBOX, RBOX, dim=0))
        if PREFETCH:
            s_bufs.index(s * 8 + 0).store(k0)
            s_bufs.index(s * 8 + 1).store(k1)
            if NG == 4:
                s_bufs.index(s * 8 + 2).store(k2)
                s_bufs.index(s * 8 + 3).store(k3)
            s_bufs.index(s * 8 + 4).store(v0)
            s_bufs.index(s * 8 + 5).store(v1)
            if NG == 4:
                s_bufs.index(s * 8 + 6).store(v2)
                s_bufs.index(s * 8 + 7).store(v3)
        elif SCALES_SMEM:
            n = n0 + nn
            m = n < end
            blk = gl.load(BT_row + n // PAGE, mask=m, other=0)
            slot = (blk * PAGE + n % PAGE).to(gl.int64)
            kp = KS + slot * s_ks_n + kvh * NG
            vp = VS + slot * s_vs_n + kvh * NG
            for g in gl.static_range(NG):  # row s * 8 + side * 4 + g of the scale ring
                s_bufs.index(s * 8 + g).store(gl.load(kp + g, mask=m, other=0.0))
                s_bufs.index(s * 8 + 4 + g).store(gl.load(vp + g, mask=m, other=0.0))
        if NOK > 0:  # 2 NOK bytes per position: too narrow for a TMA box below 8 pairs; plain loads, rows >= NOK 0
            n = n0 + on
            m = n < end
            blk = gl.load(BT_row + n // PAGE, mask=m, other=0)
            # a contiguous [n_slots, H_kv, NOK] pool (plan checks it): head stride NOK, slot stride H_kv NOK
            off = (blk * PAGE + n % PAGE).to(gl.int64) * s_ko_n + kvh * NOK
            if NOKP == NOK:
                off = gl.multiple_of(off, NOK)
                o_bufs.index(s).slice(0, NOKP, dim=0).store(gl.load(KO + off[None, :] + oc[:, None],
                                                                    mask=m[None, :], other=0.0))
            else:
                o_bufs.index(s).slice(0, NOKP, dim=0).store(
                    gl.load(KO + off[None, :] + oc[:, None], mask=(oc < NOK)[:, None] & m[None, :], other=0.0))
        if SCALES_SMEM:
            gl.thread_barrier()  # every lane's stores before the one arrival
            mbarrier.arrive(ready.index(s), count=1)
        if PREFETCH:  # the next tile's (all masked past the split: no memory traffic)
            k0, k1, k2, k3, v0, v1, v2, v3 = _gather8(KS, VS, BT_row, n0 + BN + nn, end, kvh, s_ks_n, s_vs_n, PAGE,
                                                      NG)


@gluon.jit
def _gather8(KS, VS, BT_row, n, end, kvh, s_ks_n, s_vs_n, PAGE: gl.constexpr, NG: gl.constexpr = 4):
    """The eight fp16 scale rows (keys' groups 0-3, values' 0-3; 0 past the end) of positions ``n``; with ``NG = 2``
    (d = 64) groups 0-1 of each side, returned again in the places of groups 2-3 (never stored)."""
    m = n < end
    blk = gl.load(BT_row + n // PAGE, mask=m, other=0)
    slot = (blk * PAGE + n % PAGE).to(gl.int64)
    kp = KS + slot * s_ks_n + kvh * NG
    vp = VS + slot * s_vs_n + kvh * NG
    if NG == 2:
        k0 = gl.load(kp, mask=m, other=0.0)
        k1 = gl.load(kp + 1, mask=m, other=0.0)
        v0 = gl.load(vp, mask=m, other=0.0)
        v1 = gl.load(vp + 1, mask=m, other=0.0)
        return k0, k1, k0, k1, v0, v1, v0, v1
    return (gl.load(kp, mask=m, other=0.0), gl.load(kp + 1, mask=m, other=0.0), gl.load(kp + 2, mask=m, other=0.0),
            gl.load(kp + 3, mask=m, other=0.0), gl.load(vp, mask=m, other=0.0), gl.load(vp + 1, mask=m, other=0.0),
            gl.load(vp + 2, mask=m, other=0.0), gl.load(vp + 3, mask=m, other=0.0))


@gluon.jit
def _scales(S, BT_row, n, end, kvh, s_s_n, PAGE: gl.constexpr, NG: gl.constexpr = 4):
    """The four group scales (fp32, 0 past the end) of positions ``n`` (``NG = 2``: groups 0-1, twice)."""
    m = n < end
    blk = gl.load(BT_row + n // PAGE, mask=m, other=0)
    base = S + (blk * PAGE + n % PAGE).to(gl.int64) * s_s_n + kvh * NG
    s0 = gl.load(base, mask=m, other=0.0).to(gl.float32)
    s1 = gl.load(base + 1, mask=m, other=0.0).to(gl.float32)
    if NG == 2:
        return s0, s1, s0, s1
    s2 = gl.load(base + 2, mask=m, other=0.0).to(gl.float32)
    s3 = gl.load(base + 3, mask=m, other=0.0).to(gl.float32)
    return s0, s1, s2, s3


@gluon.jit
def _q_group(Q_row, s_qh, g: gl.constexpr, GQA: gl.constexpr, QA: gl.constexpr):
    h = gl.arange(0, 16, layout=gl.SliceLayout(1, QA))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, QA))
    q = gl.load(Q_row + h[:, None] * s_qh + (g * 32 + c)[None, :], mask=(h < GQA)[:, None], other=0.0)
    return q.to(gl.float32).to(gl.float16)


@gluon.jit
def _i8_to_f16(x, PRMT: gl.constexpr):
    """int8 codes -> exact fp16. ``PRMT``: four codes per register by bit tricks (``c ^ 0x80`` under the fp16
    exponent byte ``0x64`` is ``1152 + c``; one ``prmt`` and one packed subtract per two codes, full-rate integer
    and fp16 pipes) instead of one quarter-rate ``I2F`` per code."""
    if PRMT:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t, k; xor.b32 t, $2, 0x80808080; mov.b32 k, 0x64806480; "
            "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
            "sub.rn.f16x2 $0, $0, k; sub.rn.f16x2 $1, $1, k; }",
            "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
    return x.to(gl.float16)


@gluon.jit
def _k_operand(kb, g: gl.constexpr, KB: gl.constexpr, PRMT: gl.constexpr = False):
    """Group ``g``'s key codes of a stage ``[BN, D]`` as the QK B operand ``[32, BN]`` (exact fp16)."""
    return _i8_to_f16(kb.slice(g * 32, 32, dim=1).permute([1, 0]).load(KB), PRMT)


@gluon.jit
def _v_operand(vb, g: gl.constexpr, KB: gl.constexpr, PRMT: gl.constexpr = False):
    """Group ``g``'s value codes ``[BN, 32]`` as the PV B operand (exact fp16)."""
    return _i8_to_f16(vb.slice(g * 32, 32, dim=1).load(KB), PRMT)


@gluon.jit
def _pv(pa, vs, vb, acc, alpha, MMA: gl.constexpr):
    """``acc alpha + fp16(1024 p s_v) V_g`` (``pa`` is ``1024 p`` in the A operand layout)."""
    ps = (pa * vs[None, :]).to(gl.float16)
    return mma_v2(ps, vb, acc * alpha[:, None])


@gluon.jit
def _pv_fold(p16, vs_row, vb, acc, alpha, KB: gl.constexpr):
    """``acc alpha + fp16(1024 p) fp16(s_v c)``: the group's value scales (one row of the stage's scales) multiply
    the codes in the B operand, one fp16 product per code instead of one fp32 product and rounding per (head,
    position) and group."""
    vsc = vs_row.load(gl.SliceLayout(1, KB))
    return mma_v2(p16, vb * vsc[:, None], acc * alpha[:, None])


@gluon.jit
def _consumer(k_bufs, v_bufs, s_bufs, ready, empty, Q, KS, VS, BT_row, O_S, LSE_S, b, kvh, split, start, end, n_tiles,
              sm_log2, s_qb, s_qh, s_ks_n, s_vs_n, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
              GQA: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr,
              PRMT: gl.constexpr, SCALES_SMEM: gl.constexpr = False, VFOLD: gl.constexpr = False,
              NG: gl.constexpr = 4, C0: gl.constexpr = 0, NC: gl.constexpr = 1):
    """The consumer warpgroup. Without ``SCALES_SMEM`` it gathers the group scales itself, a tile ahead into
    registers, reads the stage's key and value operands into registers and frees the stage before the softmax. With
    ``SCALES_SMEM`` the scales ride in the stage (``s_bufs``; ``KS``, ``VS`` unread): every operand is read from
    shared memory just before its MMA (keys, then per group the values and their scales), and the stage is freed
    after PV; the ring, not registers, holds the next tiles. ``VFOLD``: :func:`_pv_fold`. ``NG``: groups of 32
    channels per head (4 at d = 128, 2 at d = 64: groups 2-3's operands, MMAs and accumulators are compiled out, so
    ``acc2``, ``acc3`` stand in for them unused). ``NC = 2`` (ping-pong): this warpgroup takes tiles ``C0, C0 + 2,
    ...`` and writes split state ``2 split + C0``."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    QA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    KB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    NL: gl.constexpr = gl.SliceLayout(0, MMA)  # positions of the scores
    NA: gl.constexpr = gl.SliceLayout(0, QA)  # positions of the P operand
    HL: gl.constexpr = gl.SliceLayout(1, MMA)  # heads

    Q_row = Q + b * s_qb + kvh * GQA * s_qh
    qa0 = _q_group(Q_row, s_qh, 0, GQA, QA)
    qa1 = _q_group(Q_row, s_qh, 1, GQA, QA)
    if NG == 4:
        qa2 = _q_group(Q_row, s_qh, 2, GQA, QA)
        qa3 = _q_group(Q_row, s_qh, 3, GQA, QA)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=HL)
    l_t = gl.zeros([16, BN], gl.float32, layout=MMA)
    acc0 = gl.zeros([16, 32], gl.float32, layout=MMA)
    acc1 = gl.zeros([16, 32], gl.float32, layout=MMA)
    if NG == 4:
        acc2 = gl.zeros([16, 32], gl.float32, layout=MMA)
        acc3 = gl.zeros([16, 32], gl.float32, layout=MMA)
    else:
        acc2 = acc0  # stand-ins (d = 64): never updated, never stored
        acc3 = acc1

    nl = gl.arange(0, BN, layout=NL)
    if not SCALES_SMEM:
        na = gl.arange(0, BN, layout=NA)
        ks0, ks1, ks2, ks3 = _scales(KS, BT_row, start + nl, end, kvh, s_ks_n, PAGE, NG)
        vs0, vs1, vs2, vs3 = _scales(VS, BT_row, start + na, end, kvh, s_vs_n, PAGE, NG)
    for i in range(C0, n_tiles, NC):
        s = i % RING
        ph = (i // RING) & 1
        n0 = start + i * BN
        mbarrier.wait(ready.index(s), ph)
        kb = k_bufs.index(s)
        vb = v_bufs.index(s)
        if SCALES_SMEM:
            zero = gl.zeros([16, BN], gl.float32, layout=MMA)
            z = (mma_v2(qa0, _k_operand(kb, 0, KB, PRMT), zero)
                 * s_bufs.index(s * 8 + 0).load(NL).to(gl.float32)[None, :])
            z += (mma_v2(qa1, _k_operand(kb, 1, KB, PRMT), zero)
                  * s_bufs.index(s * 8 + 1).load(NL).to(gl.float32)[None, :])
            if NG == 4:
                z += (mma_v2(qa2, _k_operand(kb, 2, KB, PRMT), zero)
                      * s_bufs.index(s * 8 + 2).load(NL).to(gl.float32)[None, :])
                z += (mma_v2(qa3, _k_operand(kb, 3, KB, PRMT), zero)
                      * s_bufs.index(s * 8 + 3).load(NL).to(gl.float32)[None, :])
        else:
            kb0 = _k_operand(kb, 0, KB, PRMT)
            kb1 = _k_operand(kb, 1, KB, PRMT)
            if NG == 4:
                kb2 = _k_operand(kb, 2, KB, PRMT)
                kb3 = _k_operand(kb, 3, KB, PRMT)
            zero = gl.zeros([16, BN], gl.float32, layout=MMA)
            z = mma_v2(qa0, kb0, zero) * ks0[None, :] + mma_v2(qa1, kb1, zero) * ks1[None, :]
            if NG == 4:
                z += mma_v2(qa2, kb2, zero) * ks2[None, :] + mma_v2(qa3, kb3, zero) * ks3[None, :]
            # the values after the scores: one side's operands live at a time (block_n = 128 spilled otherwise)
            vb0 = _v_operand(vb, 0, KB, PRMT)
            vb1 = _v_operand(vb, 1, KB, PRMT)
            if NG == 4:
                vb2 = _v_operand(vb, 2, KB, PRMT)
                vb3 = _v_operand(vb, 3, KB, PRMT)
            # the stage is in registers: order the shared reads before the next TMA write, then free it
            fence_async_shared()
            mbarrier.arrive(empty.index(s), count=1)
        z = gl.where((n0 + nl < end)[None, :], z * sm_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(z, 1))
        p = gl.exp2(z - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_t = l_t * alpha[:, None] + p
        m_i = m_new
        if SCALES_SMEM:
            if VFOLD:  # fp16 P once, the value scale folded into the values (fp16 products, one rounding each)
                p16 = gl.convert_layout((p * 1024.0).to(gl.float16), QA)
                acc0 = _pv_fold(p16, s_bufs.index(s * 8 + 4), _v_operand(vb, 0, KB, PRMT), acc0, alpha, KB)
                acc1 = _pv_fold(p16, s_bufs.index(s * 8 + 5), _v_operand(vb, 1, KB, PRMT), acc1, alpha, KB)
                if NG == 4:
                    acc2 = _pv_fold(p16, s_bufs.index(s * 8 + 6), _v_operand(vb, 2, KB, PRMT), acc2, alpha, KB)
                    acc3 = _pv_fold(p16, s_bufs.index(s * 8 + 7), _v_operand(vb, 3, KB, PRMT), acc3, alpha, KB)
            else:
                pa = gl.convert_layout(p * 1024.0, QA)
                acc0 = _pv(pa, s_bufs.index(s * 8 + 4).load(NA).to(gl.float32), _v_operand(vb, 0, KB, PRMT), acc0,
                           alpha, MMA)
                acc1 = _pv(pa, s_bufs.index(s * 8 + 5).load(NA).to(gl.float32), _v_operand(vb, 1, KB, PRMT), acc1,
                           alpha, MMA)
                if NG == 4:
                    acc2 = _pv(pa, s_bufs.index(s * 8 + 6).load(NA).to(gl.float32), _v_operand(vb, 2, KB, PRMT),
                               acc2, alpha, MMA)
                    acc3 = _pv(pa, s_bufs.index(s * 8 + 7).load(NA).to(gl.float32), _v_operand(vb, 3, KB, PRMT),
                               acc3, alpha, MMA)
            fence_async_shared()
            mbarrier.arrive(empty.index(s), count=1)
        else:
            pa = gl.convert_layout(p * 1024.0, QA)
            acc0 = _pv(pa, vs0, vb0, acc0, alpha, MMA)
            acc1 = _pv(pa, vs1, vb1, acc1, alpha, MMA)
            if NG == 4:
                acc2 = _pv(pa, vs2, vb2, acc2, alpha, MMA)
                acc3 = _pv(pa, vs3, vb3, acc3, alpha, MMA)
            # the next tile's scales (all masked past the split: no memory traffic)
            ks0, ks1, ks2, ks3 = _scales(KS, BT_row, n0 + BN + nl, end, kvh, s_ks_n, PAGE, NG)
            vs0, vs1, vs2, vs3 = _scales(VS, BT_row, n0 + BN + na, end, kvh, s_vs_n, PAGE, NG)

    if NC > 1:
        split = split * NC + C0  # this warpgroup's state
    _epilogue(O_S, LSE_S, b, kvh, split, m_i, l_t, acc0, acc1, acc2, acc3, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
              GQA, MMA, NG)


@gluon.jit
def _epilogue(O_S, LSE_S, b, kvh, split, m_i, l_t, acc0, acc1, acc2, acc3, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
              GQA: gl.constexpr, MMA: gl.constexpr, NG: gl.constexpr = 4):
    """The split's state: ``o = acc / (1024 l)`` (0 for an empty split), ``lse = ln(sum exp)`` (``-inf`` there);
    channels ``32 g ..`` from ``acc_g``, ``g < NG``."""
    HL: gl.constexpr = gl.SliceLayout(1, MMA)
    l_i = gl.sum(l_t, 1)
    ok = l_i > 0.0
    inv = gl.where(ok, (1.0 / 1024.0) / gl.where(ok, l_i, 1.0), 0.0)
    lse = gl.where(ok, (m_i + gl.log2(gl.where(ok, l_i, 1.0))) * LN2, float("-inf"))
    h = gl.arange(0, 16, layout=HL)
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, MMA))
    o_base = O_S + b * s_os_b + (kvh * GQA + h)[:, None] * s_os_h + split * s_os_s + c[None, :]
    hm = (h < GQA)[:, None]
    gl.store(o_base, acc0 * inv[:, None], mask=hm)
    gl.store(o_base + 32, acc1 * inv[:, None], mask=hm)
    if NG == 4:
        gl.store(o_base + 64, acc2 * inv[:, None], mask=hm)
        gl.store(o_base + 96, acc3 * inv[:, None], mask=hm)
    gl.store(LSE_S + b * s_ls_b + (kvh * GQA + h) * s_ls_h + split, lse, mask=h < GQA)


# the split count and the strides that follow it are run-time values: one binary serves every batch size and split
# count (Triton would otherwise specialise a stride of 1 or a multiple of 16 into a new binary)
@gluon.jit(do_not_specialize=["num_splits", "s_bt_b", "s_os_b", "s_os_h", "s_os_s", "s_ls_b", "s_ls_h"])
def _wspec_stage1(
    Q, k_desc, v_desc, KS, VS, BT, SEQ, O_S, LSE_S,
    sm_log2, num_splits, s_qb, s_qh, s_ks_n, s_vs_n, s_bt_b, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    GQA: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr, RBOX: gl.constexpr,
    RING: gl.constexpr, NW: gl.constexpr, PRODUCER_REGS: gl.constexpr, SCALES_SMEM: gl.constexpr = False,
    PREFETCH: gl.constexpr = False, PRMT: gl.constexpr = False, VFOLD: gl.constexpr = False, D: gl.constexpr = 128,
    NC: gl.constexpr = 1, CONSUMER_REGS: gl.constexpr = 168,
):
    NG: gl.constexpr = D // 32  # groups of 32 channels: 4 at d = 128, 2 at d = 64
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(SEQ + b)
    per = gl.cdiv(gl.cdiv(seq_len, num_splits), BN) * BN  # tile-aligned splits: a TMA box never crosses a page
    start = split * per
    end = gl.minimum(start + per, seq_len)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
    BT_row = BT + b * s_bt_b

    k_bufs = gl.allocate_shared_memory(gl.int8, [RING, BN, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.int8, [RING, BN, D], v_desc.layout)
    # the stages' scales, row ``stage * 8 + side * 4 + group`` (SCALES_SMEM; a small placeholder otherwise)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    if SCALES_SMEM:
        s_bufs = gl.allocate_shared_memory(gl.float16, [RING * 8, BN], SL)
    else:
        s_bufs = gl.allocate_shared_memory(gl.float16, [8, 8], SL)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=2 if SCALES_SMEM else 1)
        mbarrier.init(empty.index(i), count=1)

    if NC == 2:  # ping-pong: two consumer warpgroups on alternate tiles of the one ring (WSpecConfig.consumers)
        gl.warp_specialize([
            (_consumer, (k_bufs, v_bufs, s_bufs, ready, empty, Q, 0, 0, BT_row, O_S, LSE_S, b, kvh, split, start,
                         end, n_tiles, sm_log2, s_qb, s_qh, 0, 0, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h, GQA, PAGE, BN,
                         RING, NW, PRMT, SCALES_SMEM, VFOLD, NG, 0, 2)),
            (_consumer, (k_bufs, v_bufs, s_bufs, ready, empty, Q, 0, 0, BT_row, O_S, LSE_S, b, kvh, split, start,
                         end, n_tiles, sm_log2, s_qb, s_qh, 0, 0, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h, GQA, PAGE, BN,
                         RING, NW, PRMT, SCALES_SMEM, VFOLD, NG, 1, 2)),
            (_producer, (k_desc, v_desc, k_bufs, v_bufs, s_bufs, 0, ready, empty, KS, VS, 0, BT_row, kvh, start, end,
                         n_tiles, s_ks_n, s_vs_n, 0, 0, D, PAGE, BN, RBOX, RING, SCALES_SMEM, PREFETCH, 0, 1, NG)),
        ], [NW, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif SCALES_SMEM:
        gl.warp_specialize([
            (_consumer, (k_bufs, v_bufs, s_bufs, ready, empty, Q, 0, 0, BT_row, O_S, LSE_S, b, kvh, split, start,
                         end, n_tiles, sm_log2, s_qb, s_qh, 0, 0, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h, GQA, PAGE, BN,
                         RING, NW, PRMT, SCALES_SMEM, VFOLD, NG)),
            (_producer, (k_desc, v_desc, k_bufs, v_bufs, s_bufs, 0, ready, empty, KS, VS, 0, BT_row, kvh, start, end,
                         n_tiles, s_ks_n, s_vs_n, 0, 0, D, PAGE, BN, RBOX, RING, SCALES_SMEM, PREFETCH, 0, 1, NG)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (k_bufs, v_bufs, 0, ready, empty, Q, KS, VS, BT_row, O_S, LSE_S, b, kvh, split, start, end,
                         n_tiles, sm_log2, s_qb, s_qh, s_ks_n, s_vs_n, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
                         GQA, PAGE, BN, RING, NW, PRMT, False, False, NG)),
            (_producer, (k_desc, v_desc, k_bufs, v_bufs, s_bufs, 0, ready, empty, KS, VS, 0, BT_row, kvh, start, end,
                         n_tiles, s_ks_n, s_vs_n, 0, 0, D, PAGE, BN, RBOX, RING, SCALES_SMEM, False, 0, 1, NG)),
        ], [1], [PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# host side
def smem_layout(box_rows: int, d: int = 128, swizzle: int = 128):
    """The NVMMA shared layout of one TMA box of int8 codes (``[box_rows, d]``), also the ring's: ``swizzle``-byte
    swizzling (0: none; 128 is what ``get_default_for`` picks for 128-byte rows), at most the row's ``d`` bytes (a
    TMA box's inner extent may not exceed its swizzle span's use; at d = 64 ``get_default_for`` picks 64)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(swizzle, d), element_bitwidth=8, rank=2)


def descriptors(k_codes: torch.Tensor, v_codes: torch.Tensor, box_rows: int, swizzle: int = 128):
    """TMA descriptors over the ``[num_blocks * block_size, H_kv * d]`` views of the code pages."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    nb, bs, hkv, d = k_codes.shape
    lay = smem_layout(box_rows, d, swizzle)
    out = []
    for t in (k_codes, v_codes):
        flat = t.view(nb * bs, hkv * d)
        out.append(TensorDescriptor(flat, [nb * bs, hkv * d], [hkv * d, 1], [box_rows, d], lay))
    return out


def wspec_stage1(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, *, sm_scale: float | None = None,
                 config: WSpecConfig | None = None, num_splits: int | None = None, descs=None, o_s=None, lse_s=None):
    """Launch the kernel: per-split states ``o_s [B, Hq, NS, d]`` fp32, ``lse_s [B, Hq, NS]`` (natural log; ``NS`` the
    splits times ``config.consumers``).
    ``descs``, ``o_s``, ``lse_s``: reuse prebuilt descriptors/buffers (a CUDA graph captures no host work)."""
    cfg = config or WSpecConfig()
    pl = plan(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, config=cfg, num_splits=num_splits)
    if not q.is_cuda:
        raise ValueError("q: the warp-specialised kernel needs a CUDA (Hopper) device")
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(pl.d)
    kd, vd = descs if descs is not None else descriptors(k_codes, v_codes, pl.box_rows, cfg.swizzle)
    B, hq, d = pl.batch, pl.hq, pl.d
    ns = cfg.states(pl.num_splits)  # (ping-pong: two states per split)
    if o_s is None:
        o_s = torch.empty(B, hq, ns, d, dtype=torch.float32, device=q.device)
    if lse_s is None:
        lse_s = torch.empty(B, hq, ns, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    ks = k_scales.view(-1, pl.hkv * (d // GROUP))
    vs = v_scales.view(-1, pl.hkv * (d // GROUP))
    _wspec_stage1[(B, pl.hkv, pl.num_splits)](
        q, kd, vd, ks, vs, block_table, seq_lens, o_s, lse_s,
        sm * 1.4426950408889634, pl.num_splits, q.stride(0), q.stride(1), ks.stride(0), vs.stride(0),
        block_table.stride(0),
        o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        GQA=pl.gqa, PAGE=pl.block_size, BN=cfg.block_n, RBOX=pl.box_rows, RING=cfg.ring,
        NW=cfg.consumer_warps, PRODUCER_REGS=cfg.producer_regs, SCALES_SMEM=cfg.scales_smem,
        PRMT=cfg.prmt, VFOLD=cfg.vfold, PREFETCH=cfg.prefetch, D=d, num_warps=4, maxnreg=cfg.maxnreg,
        **({"NC": 2, "CONSUMER_REGS": cfg.consumer_regs} if cfg.consumers == 2 else {}),
    )
    return o_s, lse_s


def wspec_decode(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, **kw):
    """Stage 1 and the exact LSE merge: ``(o [B, Hq, d] fp32, lse [B, Hq])``."""
    from kvlib.kernels.tl.merge import merge_splits

    o_s, lse_s = wspec_stage1(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, **kw)
    m = merge_splits(o_s, lse_s)
    return m.o, m.lse


def wspec_reference(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, *,
                    sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 torch reference: ``softmax(sm q (s_k c_k)^T) (s_v c_v)`` over each row's pages. Returns
    ``(o [B, Hq, d], lse [B, Hq])`` (natural log)."""
    pl = plan(q, k_codes, k_scales, v_codes, v_scales, block_table, seq_lens, num_splits=1)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(pl.d)
    B, hq, d = q.shape
    o = torch.zeros(B, hq, d, dtype=torch.float64)
    lse = torch.zeros(B, hq, dtype=torch.float64)
    bs = pl.block_size

    def deq(c, s):
        return c.double() * s.double().repeat_interleave(GROUP, dim=-1)

    for b in range(B):
        L = int(seq_lens[b])
        pos = torch.arange(L)
        slot = block_table[b].cpu().long()[pos // bs] * bs + pos % bs
        k = deq(k_codes.reshape(-1, pl.hkv, d).cpu()[slot], k_scales.reshape(-1, pl.hkv, d // GROUP).cpu()[slot])
        v = deq(v_codes.reshape(-1, pl.hkv, d).cpu()[slot], v_scales.reshape(-1, pl.hkv, d // GROUP).cpu()[slot])
        kk = k.repeat_interleave(pl.gqa, dim=1)  # [L, Hq, d]
        vv = v.repeat_interleave(pl.gqa, dim=1)
        z = sm * torch.einsum("hd,lhd->hl", q[b].cpu().double(), kk)
        o[b] = torch.einsum("hl,lhd->hd", torch.softmax(z, -1), vv)
        lse[b] = torch.logsumexp(z, -1)
    return o, lse


def rtn_pages(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN int8 pages of ``x [num_blocks * block_size, H_kv, d]``: codes ``[NB, bs, H, d]`` and fp16 scales
    ``[NB, bs, H, d / 32]`` (``s = fp16(amax / 127)``, ``c = clamp(round(x / s), -127, 127)``)."""
    n, h, d = x.shape
    if n % block_size:
        raise ValueError(f"x: {n} slots is not a whole number of pages of {block_size}")
    xg = x.float().unflatten(-1, (d // GROUP, GROUP))
    s = (xg.abs().amax(-1) / 127.0).half()
    sf = s.float()
    c = torch.round(xg / torch.where(sf > 0, sf, 1.0).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return c.reshape(n // block_size, block_size, h, d), s.reshape(n // block_size, block_size, h, d // GROUP)


def compile_offline(config: WSpecConfig | None = None, *, gqa: int = 7, block_size: int = 16, d: int = 128):
    """Compile the kernel for sm_90 without a GPU (Triton's own ptxas): the compiled kernel, whose ``asm`` holds
    the TTGIR/PTX/cubin. Raises the compiler's error where the kernel does not build."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or WSpecConfig()
    if d not in HEAD_DIMS:
        raise ValueError(f"d must be one of {HEAD_DIMS}, got {d!r}")
    rbox = min(block_size, cfg.block_n)
    desc = f"tensordesc<i8[{rbox}, {d}],{smem_layout(rbox, d, cfg.swizzle)!r}>"
    ptrs = {"Q": "*bf16", "k_desc": desc, "v_desc": desc, "KS": "*fp16", "VS": "*fp16", "BT": "*i32", "SEQ": "*i32",
            "O_S": "*fp32", "LSE_S": "*fp32"}
    const = dict(GQA=gqa, PAGE=block_size, BN=cfg.block_n, RBOX=rbox, RING=cfg.ring,
                 NW=cfg.consumer_warps, PRODUCER_REGS=cfg.producer_regs, SCALES_SMEM=cfg.scales_smem,
                 PRMT=cfg.prmt, VFOLD=cfg.vfold, PREFETCH=cfg.prefetch, D=d, NC=cfg.consumers,
                 CONSUMER_REGS=cfg.consumer_regs)
    params = inspect.signature(_wspec_stage1.fn).parameters
    sig = {n: ("constexpr" if n in const else ptrs.get(n) or ("fp32" if n == "sm_log2" else "i32")) for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in ptrs and n not in ("k_desc", "v_desc")}
    return triton.compile(GluonASTSource(_wspec_stage1, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cfg.maxnreg})
