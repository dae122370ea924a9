"""Warp-specialised certified INT8 paged decode (h8 dithered keys, WitCert accumulators, fp16 key-outlier bypass) in
Gluon (GPU only; :func:`kvlib.kernels.int8.decode.decode_int8` takes it on Hopper over pages, issue 28).

Contract (split-KV stage 1; stage 2 is :func:`kvlib.kernels.tl.merge.merge_splits`), the certified request of
:func:`kvlib.kernels.int8.decode.decode_int8` over vLLM pages: one query token per row, ``q [B, Hq, d]`` fp16/bf16,
``Hq = GQA * H_kv``, ``GQA <= 8``, ``d`` 128 or 64 (SmolLM2; opt-in in the dispatcher until GPU-validated,
:data:`kvlib.kernels.int8.decode.WSPEC_AUTO_HEAD_DIMS`), groups of 32; a key
:class:`~kvlib.kernels.int8.request.PoolSide` stored with the subtractive h8 dither (``dithered=True``,
``dither_layout="h8"``: ``x = s (c - xi)``, ``xi`` regenerated from Philox4x32-10 words, sixteen 8-bit dithers per
call) and optionally ``m <= 16`` outlier channels kept in fp16 (code 0 there); an RTN value side (``x = s c``, no
value outliers); an int32 block table ``[B, max_blocks]`` over pages of ``block_size`` slots and ``seq_lens [B]``.
Per split it writes ``(o_s, lse_s, A_s, B_s)``, the same state :func:`kvlib.kernels.int8.gluon.launch_g8` writes.

Design: :mod:`kvlib.kernels.int8.wspec`'s (one CTA per (row, KV head, split); a one-warp TMA producer streams each
tile's K and V code boxes into a ``ring``-deep shared-memory ring under mbarrier pairs and gathers the tile's group
scales, with the next tile's scales loaded while it waits for a free stage; the consumer warpgroup computes
``S = Q K^T`` with heads as M padded to 16), with the arithmetic of :mod:`kvlib.kernels.int8.gluon`:

* **keys**: per group of 32 channels, two MMAs on exact fp16 operands, the codes ``c`` and the dither operand
  ``-(4 + b 2^-8)`` (``b`` the h8 byte; one ``prmt`` per two channels), plus ``(4.5 - 2^-9) sum q_hi``, times the
  group scale: ``s (q.c - q.xi)`` with ``xi = (b + 1/2) 2^-8 - 1/2``;
* **the Philox words once per group**: the reduction index of ``Q K^T`` is permuted (the query is loaded with
  channels ``8 t + 4 jj + 2 h + e`` at index ``16 jj + 8 h + 2 t + e``, as the Gluon kernel does) so lane ``t`` of a
  quad holds local channels ``8 t .. 8 t + 7`` of its positions: exactly the bytes of Philox calls ``2 t, 2 t + 1``
  (h8: call ``j`` serves channels ``4 j .. 4 j + 3`` of every group, word ``i`` group ``i``). Each (position, call)
  is computed once in the whole CTA (the warps split the positions), and the four words of a call serve the four
  groups. At d = 64 word ``i`` serves channels ``16 i ..`` (h8: ``c = i d / 4 + 4 j + k``, ``j < 4``), so group
  ``g``'s lane ``t`` needs word ``2 g + t // 2`` of call ``2 (t mod 2) + r``: each lane computes calls ``J mod 4``
  (lanes ``t`` and ``t + 2`` the same ones: 8 Philox calls per position as at d = 128, twice the 4 the layout needs)
  and selects its word per group, one ``SEL`` per word. The key codes are read from the stage in the same register
  layout (8 contiguous bytes per lane), so
  every operand conversion is a relabelling, checked at compile time (``assert_trivial``). The words depend on the
  slots only, so they are computed before the consumer waits for the stage: the Philox ALU work overlaps the TMA;
* **outliers** (``NOK`` channels, <= 16): the query is zeroed there (the codes are 0, the dither cancels with the
  zeroed ``sum q_hi``) and the fp16 outliers enter by two MMAs with the query's fp16 hi + lo; their rows
  (``2 NOK`` bytes per position: under TMA's 16-byte box rows for m < 8 pairs) are gathered by the producer into the
  stage beside the scales;
* **softmax** in base 2 with ``ex2.approx``, on the 8 head rows of the score fragment only (the Gluon kernel's
  ``Z8``: GQA <= 8, rows 8-15 pad M to 16; the row sums are folded over each thread's own positions);
  **PV exact** as the Gluon kernel (``pv="exact"``, the default): ``1024 p s_v`` split into fp16 hi + lo, two MMAs
  per group, fp32 accumulation; or ``pv="fold"`` (the RTN kernel's ``vfold``): fp16 ``1024 p`` once and the value
  scales folded into the value operand, ``|o - o_exact| <= ~2^-10 max |v|``. The P operand crosses the warps (each
  computed its own positions' scores), so each warp scales all of P: the exact PV costs ~1.8x the folded variant's
  consumer instructions (offline sm_90 SASS at 2026-12-02, per (position, KV head): exact 93 warp instructions,
  fold 52, fold without the certificate 48; the Gluon kernel 64.5, the RTN wspec kernel 45);
* **the certificate** (``CERT``): per position the radius ``u = sqrt(sum_g s_g^2 Q2_g sm^2 (1 + 2^-8) / 12)
  (radm + detm (1 + 2^-8)) log2 e`` (+ the outliers' bypass term), ``A += p 2^u``, ``B += p 2^-u``, the same
  expressions in the same order as :func:`kvlib.kernels.int8.gluon._stage1_g8`, so the same rounding analysis and
  the same slack (:func:`kvlib.certify.bound.radius_multiplier` with ``impl="h10"``, ``layout="h8"``) cover it.
  ``cert=False`` compiles the accumulators out (the certificate's marginal cost).

Scores per (head, position) are the Gluon kernel's bit for bit (same MMA instruction, same operands, same order);
the online softmax runs over other tiles and splits, so ``o``, ``lse``, ``A``, ``B`` agree with it and with the
float64 reference to fp32 rounding (the GPU tests use the Gluon kernel's own tolerances).

:func:`plan` validates every argument (ValueError/TypeError naming it) and picks the splits without a GPU;
:func:`wspec_cert_reference` is the float64 torch reference (it calls
:func:`kvlib.kernels.int8.reference.decode_reference`, the family's reference, with the h10/h8 rounding slack).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from kvlib.kernels.int8 import gluon as G
from kvlib.kernels.int8 import wspec as W

XI8_CONST: gl.constexpr = gl.constexpr(4.5 - 2.0**-9)
LOG2E_C: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2_C: gl.constexpr = gl.constexpr(0.6931471805599453)
GROUP = 32
#: outlier rows per stage: the bypass MMA's reduction depth (16, fp16); rows past the request's ``m`` are zero
NOK_PAD = 16
#: shared memory one SM offers its CTAs (H200 / sm_90: 227 KB usable)
SMEM_PER_SM = 227 * 1024


@dataclasses.dataclass(frozen=True)
class WSpecCertConfig:
    """Compile-time shape: ``block_n`` positions per tile, ``ring`` stages, the producer warp's registers, the
    launch's ``maxnreg`` (per thread over the CTA), ``ctas_per_sm`` for the split planner, ``prmt`` int8 -> fp16 by
    byte permutes (else ``I2F``)."""

    block_n: int = 64  # 128 spills (sm_90 offline compile: 264 B of stack at maxnreg 128, 80 B at 168)
    ring: int = 4
    producer_regs: int = 64
    maxnreg: int = 128
    ctas_per_sm: int = 2
    prmt: bool = True
    swizzle: int = 128
    #: ``"exact"``: ``1024 p s_v`` as fp16 hi + lo, two MMAs per group (the Gluon kernel's PV); ``"fold"``: fp16
    #: ``1024 p`` once and the value scales folded into the value operand (the RTN wspec kernel's ``vfold``: two fp16
    #: roundings, each <= 2^-11 relative, so ``|o - o_exact| <= ~2^-10 sum_n p_n |v_n|``); the scores, the softmax
    #: and the certificate are the same either way
    pv: str = "exact"
    #: consumer warpgroups (issue 40, opt-in, not yet run on a GPU): 2 is the ping-pong variant of
    #: :attr:`kvlib.kernels.int8.wspec.WSpecConfig.consumers` (alternate tiles, one state per warpgroup and split,
    #: an even ring, the second warpgroup a worker partition of ``consumer_regs`` registers)
    consumers: int = 1
    consumer_regs: int = 168

    def __post_init__(self):
        if self.block_n not in (32, 64, 128):
            raise ValueError(f"block_n must be 32, 64 or 128, got {self.block_n}")
        W.check_ring(self, max_ring=6)
        if self.swizzle not in (32, 64, 128):  # 0 read back wrong codes on the H200 (wspec.WSpecConfig)
            raise ValueError(f"swizzle must be 32, 64 or 128 bytes, got {self.swizzle}")
        if self.pv not in ("exact", "fold"):
            raise ValueError(f"pv must be 'exact' or 'fold', got {self.pv!r}")
        if self.consumers not in (1, 2) or isinstance(self.consumers, bool):
            raise ValueError(f"consumers must be 1 or 2 (ping-pong) warpgroups, got {self.consumers!r}")
        if self.consumers == 2 and self.ring % 2:  # see WSpecConfig: each stage must serve one warpgroup
            raise ValueError(f"consumers=2 needs an even ring (each stage serves one warpgroup), got ring={self.ring}")
        if self.consumer_regs % 8 or not 24 <= self.consumer_regs <= 256:
            raise ValueError(f"consumer_regs must be a multiple of 8 in 24..256, got {self.consumer_regs}")

    def wspec(self, nok: int = 0) -> W.WSpecConfig:
        """The RTN kernel's config of the same ring (its planner and descriptors are reused), with at most as many
        CTAs per SM as the ring fits (:meth:`ctas_fit`)."""
        return W.WSpecConfig(block_n=self.block_n, ring=self.ring, producer_regs=self.producer_regs,
                             maxnreg=self.maxnreg, ctas_per_sm=min(self.ctas_per_sm, self.ctas_fit(nok)),
                             prmt=self.prmt, vfold=False, swizzle=self.swizzle)

    def ctas_fit(self, nok: int = 0) -> int:
        """CTAs whose ring, P exchange (``[16, block_n]`` fp32) and 1 KB of reduction scratch fit the H200's
        227 KB of shared memory per SM (at least 1): the planner's wave never counts CTAs that cannot be resident."""
        return max(1, SMEM_PER_SM // (self.smem_bytes(nok) + 16 * self.block_n * 4 + 1024))

    def smem_bytes(self, nok: int = 0, d: int = 128) -> int:
        """The ring (K and V codes, 8 scale rows, the outlier rows where ``nok``) and its barriers."""
        return self.ring * (2 * self.block_n * d + 16 * self.block_n
                            + (2 * NOK_PAD * self.block_n if nok else 0) + 16)


@dataclasses.dataclass(frozen=True)
class CertPlan(W.Plan):
    """A validated launch: the RTN kernel's :class:`~kvlib.kernels.int8.wspec.Plan` (shapes, splits, TMA box rows)
    plus the outlier count and the certificate's constants."""

    nok: int
    sm_scale: float
    delta: float
    rad_extra: float
    byp_rel: float
    byp_abs: float
    k0: int
    k1: int


def _bits(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


def consumer_layouts(bn: int, nw: int = 4) -> dict[str, Any]:
    """The consumer's register layouts for ``bn`` positions per tile over ``nw`` warps (the MMA layout's warps split
    the positions in blocks of 8, then registers take the rest: ``gl.to_linear_layout`` of the 4-warp
    ``NVMMADistributedLayout`` B operand has warp bases 8, 16 and register bases 32, 64 on the positions):

    * ``KW`` ``[bn, 32]``: key codes / dither of one group, lane ``(g, t)`` holding local channels ``8 t .. 8 t + 7``
      of positions ``g + 8 w + 8 nw r``;
    * ``W`` ``[bn, 8]``: Philox words, lane ``(g, t)`` computing calls ``2 t, 2 t + 1`` of the same positions;
    * ``QB``: a blocked layout for the prologue's query statistics ``[16, 32]``;
    * ``Z8``: rows 0-7 of the scores' ``[16, bn]`` MMA layout (the GQA <= 8 heads; the softmax and the certificate
      run on these only, as the Gluon kernel's);
    * ``F3``: ``Z8`` as ``[8, bn / 32, 32]``, whose dim-1 slice holds the folded row sums."""
    if bn % (8 * nw) or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two multiple of {8 * nw}, got {bn}")
    wb = [[8 * b, 0] for b in _bits(nw)]  # positions 8, 16 on the warps
    rb = [[8 * nw * b, 0] for b in _bits(bn // (8 * nw))]  # positions 32, 64 in registers

    def lin(reg, lane, shape):
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=wb, block_bases=[], shape=shape)

    return dict(
        KW=lin([[0, 1], [0, 2], [0, 4]] + rb, [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], [bn, 32]),
        W=lin([[0, 1]] + rb, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [bn, 8]),
        QB=gl.BlockedLayout([1, 4], [4, 8], [nw, 1], [1, 0]),
        # rows 0-7 of the scores' MMA layout (the heads; rows 8-15 pad M to 16): a register selection
        Z8=gl.DistributedLinearLayout(
            reg_bases=[[0, 1]] + [[0, 8 * nw * b] for b in _bits(bn // (8 * nw))],
            lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 8 * b] for b in _bits(nw)], block_bases=[], shape=[8, bn]),
        # Z8 reshaped to [8, bn / 32, 32] (n = 32 r + n'): the row sums are folded over r
        F3=gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1]] + [[0, b, 0] for b in _bits(bn // (8 * nw))],
            lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[0, 0, 8 * b] for b in _bits(nw)], block_bases=[], shape=[8, bn // (8 * nw), 8 * nw]),
    )


def _pages(side, bs: int, name: str):
    """A pool side's codes/scales as ``[num_blocks, block_size, H_kv, ...]`` pages (views, no copy)."""
    n = side.codes.shape[0]
    if n % bs:
        raise ValueError(f"{name}.codes: {n} slots is not a whole number of pages of block_size={bs}")
    for what, t in (("codes", side.codes), ("scales", side.scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name}.{what} must be contiguous (the TMA descriptor and the scale loads assume it)")
    return (side.codes.view(n // bs, bs, *side.codes.shape[1:]), side.scales.view(n // bs, bs, *side.scales.shape[1:]))


def plan(q, k_pool, v_pool, block_table, seq_lens, *, block_size: int, layer: int, seed: int,
         sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False,
         config: WSpecCertConfig | None = None, num_splits: int | None = None, sms: int | None = None) -> CertPlan:
    """Validate a certified request (ValueError/TypeError naming the argument) and choose its splits (the RTN
    kernel's planner: :func:`kvlib.kernels.int8.wspec.plan`). Needs no GPU."""
    from kvlib.certify.bound import radius_multiplier, rounding_gamma
    from kvlib.core.checks import check_open_unit
    from kvlib.core.fp16 import FP16_REL, FP16_SUB
    from kvlib.core.philox import seed_key
    from kvlib.kernels.int8.request import as_side

    cfg = config or WSpecCertConfig()
    if not isinstance(cfg, WSpecCertConfig):
        raise TypeError(f"config must be a WSpecCertConfig, got {type(cfg).__name__}")
    k = as_side(k_pool, "k_pool")
    v = as_side(v_pool, "v_pool")
    if not k.dithered or k.dither_layout != "h8":
        raise ValueError(f"k_pool must be stored with the h8 dither (dithered=True, dither_layout='h8'), got "
                         f"dithered={k.dithered}, dither_layout={k.dither_layout!r}")
    if not isinstance(v_dither, bool) or v_dither:
        raise ValueError(f"v_dither must be False: the kernel reads RTN values (got {v_dither!r})")
    if k.group != GROUP or v.group != GROUP:
        raise ValueError(f"k_pool.group and v_pool.group must be {GROUP}, got {k.group}, {v.group}")
    for name, side in (("k_pool", k), ("v_pool", v)):
        if side.scales.dtype != torch.float16:
            raise ValueError(f"{name}.scales must be float16, got {side.scales.dtype}")
    if v.outliers is not None:
        raise ValueError("v_pool.outliers: value outlier channels are not read by this kernel (key outliers only)")
    nok = 0
    if k.outliers is not None:
        nok = k.outliers.shape[-1]
        if nok > NOK_PAD:
            raise ValueError(f"k_pool.outliers: at most {NOK_PAD} outlier channels (8 RoPE pairs), got {nok}")
        if k.outliers.dtype != torch.float16:
            raise ValueError(f"k_pool.outliers must be float16, got {k.outliers.dtype}")
        if not (k.outliers.is_contiguous() and k.outlier_channels.is_contiguous()):
            raise ValueError("k_pool.outliers and k_pool.outlier_channels must be contiguous")
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if tuple(v.codes.shape) != tuple(k.codes.shape):
        raise ValueError(f"v_pool.codes must have k_pool.codes' shape {tuple(k.codes.shape)}, "
                         f"got {tuple(v.codes.shape)}")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    kc, ks = _pages(k, block_size, "k_pool")
    vc, vs = _pages(v, block_size, "v_pool")
    if nok and k.outliers.device != q.device:
        raise ValueError(f"k_pool.outliers must be on q's device {q.device}, got {k.outliers.device}")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < 2**31:
        raise ValueError(f"layer must be an int in [0, 2^31), got {layer!r}")
    k0, k1 = seed_key(seed)
    delta = check_open_unit("delta", delta)
    nok_ = k.outliers.shape[-1] if k.outliers is not None else 0
    base = W.plan(q, kc, ks, vc, vs, block_table, seq_lens, config=cfg.wspec(nok_), num_splits=num_splits, sms=sms)
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(base.d)
    if not math.isfinite(sm) or sm <= 0:
        raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale!r}")
    d = base.d
    # the Gluon kernel's slack: its operands and sums are the h10 kernel's over the h8 layout (decode._stage1)
    rad_extra = (radius_multiplier(1, delta, d, impl="h10", layout="h8")
                 - radius_multiplier(1, delta, d, slack=False))
    return CertPlan(base.batch, base.hq, base.hkv, base.gqa, d, base.block_size, base.num_blocks, base.max_blocks,
                    base.num_splits, base.box_rows, nok, sm, delta, float(rad_extra), FP16_REL + rounding_gamma(d),
                    FP16_SUB, k0, k1)


# ----------------------------------------------------------------------------------------------
# the kernel
@gluon.jit
def _qk_group(kb, g: gl.constexpr, w, qa, q1, s, BN: gl.constexpr, KB: gl.constexpr, KW: gl.constexpr,
              MMA: gl.constexpr, Z8: gl.constexpr, PRMT: gl.constexpr):
    """Group ``g``'s scores ``s_g (q.c + q.(-(4 + b 2^-8)) + (4.5 - 2^-9) sum q_hi)`` of the 8 head rows
    ``[8, BN]`` (layout ``Z8``): the key codes
    read from the stage as 8 contiguous bytes per lane (layout ``KW``), relabelled to the B operand with the permuted
    reduction index (:func:`kvlib.kernels.int8.gluon._to_kb`), then the dither operand from the Philox words ``w``
    (:func:`kvlib.kernels.int8.gluon._bytes_kb`); the operands, the order and the fp32 epilogue of
    :func:`kvlib.kernels.int8.gluon._qk_group`."""
    codes = G._to_kb(W._i8_to_f16(kb.slice(g * 32, 32, dim=1).load(KW), PRMT), BN, KB)
    acc = mma_v2(qa, codes, gl.zeros([16, BN], gl.float32, layout=MMA))
    acc = mma_v2(qa, G._bytes_kb(w, True, BN, KB, KW), acc)
    acc = gl.convert_layout(G._rows8(acc, BN), Z8, assert_trivial=True)
    return (acc + XI8_CONST * q1[:, None]) * s[None, :]


@gluon.jit
def _fold(x, BN: gl.constexpr):
    """``[8, BN]`` scores (``Z8``) summed over positions ``n mod 32`` -> ``[8, 32]``: the MMA layout's
    position bits 32 and 64 are registers, so the sum is within each thread (no shuffle, no shared memory), and
    three accumulators of 2 registers replace three of ``BN / 16`` (what kept block_n = 128 from spilling)."""
    return gl.sum(gl.reshape(x, [8, BN // 32, 32]), 1)


@gluon.jit
def _pad16(x8, BN: gl.constexpr):
    """``[8, BN]`` -> ``[16, BN]`` with rows 8-15 a copy of rows 0-7 (M padding of the PV MMA: those output rows
    are never stored), a register renaming."""
    return gl.reshape(gl.permute(gl.join(x8, x8), [2, 0, 1]), [16, BN])


@gluon.jit
def _pad16v(x8, HL: gl.constexpr):
    """A per-head ``[8]`` vector as the ``[16]`` one of the MMA rows (rows 8-15 a copy), a register renaming."""
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(x8, x8), [1, 0]), [16]), HL, assert_trivial=True)


@gluon.jit
def _pv_exact(pa, vs, vb, acc, alpha):
    """``acc alpha + c^T (1024 p s_v)`` for one group, ``1024 p s_v`` as fp16 hi + lo (the Gluon kernel's
    :func:`kvlib.kernels.int8.gluon._pv_group`): ``pa`` is ``1024 p`` in the A operand layout."""
    ps = pa * vs[None, :]
    hi = ps.to(gl.float16)
    lo = (ps - hi.to(gl.float32)).to(gl.float16)
    acc = mma_v2(hi, vb, acc * alpha[:, None])
    return mma_v2(lo, vb, acc)


@gluon.jit
def _consumer_cert(k_bufs, v_bufs, s_bufs, o_bufs, ready, empty, Q, BT_row, KOC_row, O_S, LSE_S, A_S, B_S,
                   b, kvh, split, start, end, n_tiles, seq_len, sm_scale, log_2_over_delta, rad_extra, byp_rel,
                   byp_abs, layer, seed_lo, seed_hi, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
                   KW: gl.constexpr, W_L: gl.constexpr, QB: gl.constexpr, Z8: gl.constexpr, F3: gl.constexpr,
                   GQA: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr,
                   PRMT: gl.constexpr, CERT: gl.constexpr, CERT_B: gl.constexpr, NOK: gl.constexpr,
                   GEN: gl.constexpr, N_ROUNDS: gl.constexpr, VFOLD: gl.constexpr, NG: gl.constexpr = 4,
                   C0: gl.constexpr = 0, NC: gl.constexpr = 1):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    QA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    KB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    NA: gl.constexpr = gl.SliceLayout(0, QA)  # positions of the P operand
    HL: gl.constexpr = gl.SliceLayout(1, MMA)  # heads

    # the query: A operands with the permuted reduction index, and the certificate's per-head sums
    Q_row = Q + b * s_qb + kvh * GQA * s_qh
    qa0, q10, q20, rr0 = G._q_group(Q_row, s_qh, 0, GQA, QA, QB, MMA, KOC_row, NOK)
    qa1, q11, q21, rr1 = G._q_group(Q_row, s_qh, 1, GQA, QA, QB, MMA, KOC_row, NOK)
    if NG == 4:  # (d = 64: groups 0-1 only; 2-3 compiled out)
        qa2, q12, q22, rr2 = G._q_group(Q_row, s_qh, 2, GQA, QA, QB, MMA, KOC_row, NOK)
        qa3, q13, q23, rr3 = G._q_group(Q_row, s_qh, 3, GQA, QA, QB, MMA, KOC_row, NOK)
    if NOK > 0:  # the outlier channels' query [16 heads, 16 channels] as fp16 hi + lo A operands
        hA = gl.arange(0, 16, layout=gl.SliceLayout(1, QA))
        cA = gl.arange(0, 16, layout=gl.SliceLayout(0, QA))
        kocA = gl.load(KOC_row + cA, mask=cA < NOK, other=0)
        qo = gl.load(Q_row + hA[:, None] * s_qh + kocA[None, :], mask=(hA < GQA)[:, None] & (cA < NOK)[None, :],
                     other=0.0).to(gl.float32)
        qo_hi = qo.to(gl.float16)
        qo_lo = (qo - qo_hi.to(gl.float32)).to(gl.float16)
    H8L: gl.constexpr = gl.SliceLayout(1, Z8)  # per head, heads on lanes g
    NL8: gl.constexpr = gl.SliceLayout(0, Z8)  # per position of the scores
    q10 = gl.convert_layout(G._rows8v(q10), H8L)
    q11 = gl.convert_layout(G._rows8v(q11), H8L)
    if NG == 4:
        q12 = gl.convert_layout(G._rows8v(q12), H8L)
        q13 = gl.convert_layout(G._rows8v(q13), H8L)
    if CERT:
        radm = gl.sqrt(2.0 * (gl.log(gl.maximum(seq_len, 1).to(gl.float32)) + log_2_over_delta)) + rad_extra
        var_c = sm_scale * sm_scale / 12.0 * (1.0 + 2.0**-8)
        if NG == 4:
            rat = (G._rat(rr0, q20) + G._rat(rr1, q21)) + (G._rat(rr2, q22) + G._rat(rr3, q23))
        else:
            rat = G._rat(rr0, q20) + G._rat(rr1, q21)
        detm = (sm_scale * 127.5 * (1.0 + 2.0**-8)) * gl.sqrt(rat) / gl.sqrt(var_c)
        radm_h = gl.convert_layout(G._rows8v((radm + detm * (1.0 + 2.0**-8)) * LOG2E_C), H8L)
        v0 = gl.convert_layout(G._rows8v(q20 * var_c), H8L)
        v1 = gl.convert_layout(G._rows8v(q21 * var_c), H8L)
        if NG == 4:
            v2 = gl.convert_layout(G._rows8v(q22 * var_c), H8L)
            v3 = gl.convert_layout(G._rows8v(q23 * var_c), H8L)
        if NOK > 0:  # |q_o| rounded UP to fp16 (its product with the exact fp16 |k_o| bounds from above), sum |q_o|
            qa_abs = gl.abs(qo)
            qa16 = qa_abs.to(gl.float16)
            qo_abs16 = gl.where(qa16.to(gl.float32) < qa_abs,
                                (qa16.to(gl.int16, bitcast=True) + 1).to(gl.float16, bitcast=True), qa16)
            hB = gl.arange(0, 16, layout=gl.SliceLayout(1, QB))
            cB = gl.arange(0, 16, layout=gl.SliceLayout(0, QB))
            kocB = gl.load(KOC_row + cB, mask=cB < NOK, other=0)
            qoB = gl.load(Q_row + hB[:, None] * s_qh + kocB[None, :], mask=(hB < GQA)[:, None] & (cB < NOK)[None, :],
                          other=0.0).to(gl.float32)
            qo_sum = gl.convert_layout(G._rows8v(gl.convert_layout(gl.sum(gl.abs(qoB), 1), HL)), H8L)

    # the dither's Philox counter (slot, call, kv head, layer << 1 | keys) and key (the seed's halves)
    k0 = seed_lo.to(gl.uint32)
    k1 = seed_hi.to(gl.uint32)
    c3k = ((layer << 1) | 0).to(gl.uint32)
    c2 = kvh.to(gl.uint32)
    cj = gl.arange(0, 8, layout=gl.SliceLayout(0, W_L)).to(gl.uint32)[None, :]
    if NG == 2:  # d = 64: column J of a group's words is call J mod 4 of word 2 g + J // 4 (module docstring)
        lo4 = cj < 4
        cj = cj % 4
    nk = gl.arange(0, BN, layout=gl.SliceLayout(1, W_L))
    if NC > 1:  # ping-pong: this warpgroup's first tile is its C0-th
        sk = G._slot(BT_row, start + C0 * BN + nk, end, PAGE)
    else:
        sk = G._slot(BT_row, start + nk, end, PAGE)

    zs = sm_scale * LOG2E_C
    m_i = gl.full([8], float("-inf"), gl.float32, layout=H8L)
    # the row sums are kept per (head, position mod 32): the fold over a thread's own positions is register-local
    FL: gl.constexpr = gl.SliceLayout(1, F3)
    l_t = gl.zeros([8, 32], gl.float32, layout=FL)
    if CERT:
        a_t = gl.zeros([8, 32], gl.float32, layout=FL)
        if CERT_B:
            b_t = gl.zeros([8, 32], gl.float32, layout=FL)
    acc0 = gl.zeros([16, 32], gl.float32, layout=MMA)
    acc1 = gl.zeros([16, 32], gl.float32, layout=MMA)
    if NG == 4:
        acc2 = gl.zeros([16, 32], gl.float32, layout=MMA)
        acc3 = gl.zeros([16, 32], gl.float32, layout=MMA)
    nl = gl.arange(0, BN, layout=NL8)
    for i in range(C0, n_tiles, NC):
        s = i % RING
        ph = (i // RING) & 1
        n0 = start + i * BN
        # the words depend on the slots only: computed before the wait, under the TMA of this stage
        w0, w1, w2, w3 = G._dither_words(sk, cj, c2, c3k, k0, k1, BN, W_L, GEN, N_ROUNDS)
        if NG == 2:  # group 0: words 0 | 1, group 1: words 2 | 3
            w0 = gl.where(lo4, w0, w1)
            w1 = gl.where(lo4, w2, w3)
        sk = G._slot(BT_row, n0 + NC * BN + nk, end, PAGE)  # this warpgroup's next tile's slots (masked past the split)
        mbarrier.wait(ready.index(s), ph)
        kb = k_bufs.index(s)
        vb = v_bufs.index(s)
        ks0 = s_bufs.index(s * 8 + 0).load(NL8).to(gl.float32)
        ks1 = s_bufs.index(s * 8 + 1).load(NL8).to(gl.float32)
        if NG == 4:
            ks2 = s_bufs.index(s * 8 + 2).load(NL8).to(gl.float32)
            ks3 = s_bufs.index(s * 8 + 3).load(NL8).to(gl.float32)
        z = (_qk_group(kb, 0, w0, qa0, q10, ks0, BN, KB, KW, MMA, Z8, PRMT)
             + _qk_group(kb, 1, w1, qa1, q11, ks1, BN, KB, KW, MMA, Z8, PRMT))
        if NG == 4:
            z += (_qk_group(kb, 2, w2, qa2, q12, ks2, BN, KB, KW, MMA, Z8, PRMT)
                  + _qk_group(kb, 3, w3, qa3, q13, ks3, BN, KB, KW, MMA, Z8, PRMT))
        if NOK > 0:  # the bypass: fp16 outliers [16 rows, BN] as the B operand, the query as hi + lo
            ko = o_bufs.index(s).load(KB)
            zo = mma_v2(qo_hi, ko, gl.zeros([16, BN], gl.float32, layout=MMA))
            zo = mma_v2(qo_lo, ko, zo)
            z += gl.convert_layout(G._rows8(zo, BN), Z8, assert_trivial=True)
        z = gl.where((n0 + nl < end)[None, :], z * zs, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(z, 1))
        p = G._ex2(z - m_new[:, None])
        if CERT:
            if NG == 4:
                var = ((ks0 * ks0)[None, :] * v0[:, None] + (ks1 * ks1)[None, :] * v1[:, None]) + (
                    (ks2 * ks2)[None, :] * v2[:, None] + (ks3 * ks3)[None, :] * v3[:, None])
            else:
                var = (ks0 * ks0)[None, :] * v0[:, None] + (ks1 * ks1)[None, :] * v1[:, None]
            u = gl.sqrt(var) * radm_h[:, None]
            if NOK > 0:  # fp32 accumulation of exact products: its rounding is inside the (1 + 2^-8)
                byp = mma_v2(qo_abs16, gl.abs(ko), gl.zeros([16, BN], gl.float32, layout=MMA))
                byp = gl.convert_layout(G._rows8(byp, BN), Z8, assert_trivial=True)
                u += zs * (byp * (byp_rel * (1.0 + 2.0**-8)) + qo_sum[:, None] * byp_abs)
            pa = p * G._ex2(u)
            if CERT_B:
                pb = p * G._ex2(-u)
        alpha = G._ex2(m_i - m_new)
        alpha_f = gl.convert_layout(alpha, gl.SliceLayout(1, FL), assert_trivial=True)
        l_t = l_t * alpha_f[:, None] + _fold(p, BN)
        if CERT:
            a_t = a_t * alpha_f[:, None] + _fold(pa, BN)
            if CERT_B:
                b_t = b_t * alpha_f[:, None] + _fold(pb, BN)
        m_i = m_new
        alpha = _pad16v(alpha, HL)  # the PV rows (8-15: padding)
        # the P operand crosses the warps (each computed its own positions' scores; each needs all of P)
        if VFOLD:  # fp16 P once, the value scales folded into the values (wspec's vfold)
            p16 = gl.convert_layout(_pad16((p * 1024.0).to(gl.float16), BN), QA)
            acc0 = W._pv_fold(p16, s_bufs.index(s * 8 + 4), W._v_operand(vb, 0, KB, PRMT), acc0, alpha, KB)
            acc1 = W._pv_fold(p16, s_bufs.index(s * 8 + 5), W._v_operand(vb, 1, KB, PRMT), acc1, alpha, KB)
            if NG == 4:
                acc2 = W._pv_fold(p16, s_bufs.index(s * 8 + 6), W._v_operand(vb, 2, KB, PRMT), acc2, alpha, KB)
                acc3 = W._pv_fold(p16, s_bufs.index(s * 8 + 7), W._v_operand(vb, 3, KB, PRMT), acc3, alpha, KB)
        else:
            pp = gl.convert_layout(_pad16(p * 1024.0, BN), QA)
            acc0 = _pv_exact(pp, s_bufs.index(s * 8 + 4).load(NA).to(gl.float32), W._v_operand(vb, 0, KB, PRMT),
                             acc0, alpha)
            acc1 = _pv_exact(pp, s_bufs.index(s * 8 + 5).load(NA).to(gl.float32), W._v_operand(vb, 1, KB, PRMT),
                             acc1, alpha)
            if NG == 4:
                acc2 = _pv_exact(pp, s_bufs.index(s * 8 + 6).load(NA).to(gl.float32),
                                 W._v_operand(vb, 2, KB, PRMT), acc2, alpha)
                acc3 = _pv_exact(pp, s_bufs.index(s * 8 + 7).load(NA).to(gl.float32),
                                 W._v_operand(vb, 3, KB, PRMT), acc3, alpha)
        fence_async_shared()
        mbarrier.arrive(empty.index(s), count=1)

    # the split's state, as the Gluon kernel's epilogue: a NaN sum stays NaN (vacuous certificate), 0 is empty
    l_i = gl.convert_layout(gl.sum(l_t, 1), H8L, assert_trivial=True)
    nonempty = l_i != 0.0
    inv_l = gl.where(nonempty, 1.0 / gl.where(nonempty, l_i, 1.0), 0.0)
    lse = gl.where(nonempty, (m_i + gl.log2(gl.where(nonempty, l_i, 1.0))) * LN2_C, float("-inf"))
    sc = _pad16v(inv_l * (1.0 / 1024.0), HL)
    if NC > 1:
        split = split * NC + C0  # this warpgroup's state
    h = gl.arange(0, 16, layout=HL)
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, MMA))
    o_base = O_S + b * s_os_b + (kvh * GQA + h)[:, None] * s_os_h + split * s_os_s + c[None, :]
    hm = (h < GQA)[:, None]
    gl.store(o_base, acc0 * sc[:, None], mask=hm)
    gl.store(o_base + 32, acc1 * sc[:, None], mask=hm)
    if NG == 4:
        gl.store(o_base + 64, acc2 * sc[:, None], mask=hm)
        gl.store(o_base + 96, acc3 * sc[:, None], mask=hm)
    h8 = gl.arange(0, 8, layout=H8L)
    l_off = b * s_ls_b + (kvh * GQA + h8) * s_ls_h + split
    gl.store(LSE_S + l_off, lse, mask=h8 < GQA)
    if CERT:
        gl.store(A_S + l_off, gl.convert_layout(gl.sum(a_t, 1), H8L, assert_trivial=True) * inv_l, mask=h8 < GQA)
        if CERT_B:
            gl.store(B_S + l_off, gl.convert_layout(gl.sum(b_t, 1), H8L, assert_trivial=True) * inv_l,
                     mask=h8 < GQA)


# the split count, the layer, the seed words and the strides that follow the batch are run-time values: one binary
# serves every batch size, split count, layer and seed
@gluon.jit(do_not_specialize=["num_splits", "layer", "seed_lo", "seed_hi", "s_bt_b", "s_os_b", "s_os_h", "s_os_s",
                              "s_ls_b", "s_ls_h"])
def _wspec_cert_stage1(
    Q, k_desc, v_desc, KS, VS, BT, SEQ, O_S, LSE_S, A_S, B_S, KO, KOC,
    sm_scale, log_2_over_delta, rad_extra, byp_rel, byp_abs, layer, seed_lo, seed_hi, num_splits,
    s_qb, s_qh, s_ks_n, s_vs_n, s_ko_n, s_ko_h, s_bt_b, s_os_b, s_os_h, s_os_s, s_ls_b, s_ls_h,
    KW: gl.constexpr, W_L: gl.constexpr, QB: gl.constexpr, Z8: gl.constexpr, F3: gl.constexpr,
    GQA: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr, RBOX: gl.constexpr, RING: gl.constexpr,
    NW: gl.constexpr, PRODUCER_REGS: gl.constexpr, PRMT: gl.constexpr, CERT: gl.constexpr, CERT_B: gl.constexpr,
    NOK: gl.constexpr = 0, NOKP: gl.constexpr = 1, GEN: gl.constexpr = 0, N_ROUNDS: gl.constexpr = 10,
    VFOLD: gl.constexpr = False, D: gl.constexpr = 128, NC: gl.constexpr = 1, CONSUMER_REGS: gl.constexpr = 168,
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
    KOC_row = KOC + kvh * NOK

    k_bufs = gl.allocate_shared_memory(gl.int8, [RING, BN, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.int8, [RING, BN, D], v_desc.layout)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    s_bufs = gl.allocate_shared_memory(gl.float16, [RING * 8, BN], SL)  # row stage * 8 + side * 4 + group
    OL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    if NOK > 0:
        o_bufs = gl.allocate_shared_memory(gl.float16, [RING, 16, BN], OL)
    else:
        o_bufs = gl.allocate_shared_memory(gl.float16, [1, 8, 8], OL)  # a placeholder, never read
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=2)  # the producer's arrival and the TMA transaction
        mbarrier.init(empty.index(i), count=1)

    if NC == 2:  # ping-pong (WSpecCertConfig.consumers): two consumer warpgroups on alternate tiles
        gl.warp_specialize([
            (_consumer_cert, (k_bufs, v_bufs, s_bufs, o_bufs, ready, empty, Q, BT_row, KOC_row, O_S, LSE_S, A_S, B_S,
                              b, kvh, split, start, end, n_tiles, seq_len, sm_scale, log_2_over_delta, rad_extra,
                              byp_rel, byp_abs, layer, seed_lo, seed_hi, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b,
                              s_ls_h, KW, W_L, QB, Z8, F3, GQA, PAGE, BN, RING, NW, PRMT, CERT, CERT_B, NOK, GEN,
                              N_ROUNDS, VFOLD, NG, 0, 2)),
            (_consumer_cert, (k_bufs, v_bufs, s_bufs, o_bufs, ready, empty, Q, BT_row, KOC_row, O_S, LSE_S, A_S, B_S,
                              b, kvh, split, start, end, n_tiles, seq_len, sm_scale, log_2_over_delta, rad_extra,
                              byp_rel, byp_abs, layer, seed_lo, seed_hi, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b,
                              s_ls_h, KW, W_L, QB, Z8, F3, GQA, PAGE, BN, RING, NW, PRMT, CERT, CERT_B, NOK, GEN,
                              N_ROUNDS, VFOLD, NG, 1, 2)),
            (W._producer, (k_desc, v_desc, k_bufs, v_bufs, s_bufs, o_bufs, ready, empty, KS, VS, KO, BT_row, kvh,
                           start, end, n_tiles, s_ks_n, s_vs_n, s_ko_n, s_ko_h, D, PAGE, BN, RBOX, RING, True, True,
                           NOK, NOKP, NG)),
        ], [NW, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer_cert, (k_bufs, v_bufs, s_bufs, o_bufs, ready, empty, Q, BT_row, KOC_row, O_S, LSE_S, A_S, B_S,
                              b, kvh, split, start, end, n_tiles, seq_len, sm_scale, log_2_over_delta, rad_extra,
                              byp_rel, byp_abs, layer, seed_lo, seed_hi, s_qb, s_qh, s_os_b, s_os_h, s_os_s, s_ls_b,
                              s_ls_h, KW, W_L, QB, Z8, F3, GQA, PAGE, BN, RING, NW, PRMT, CERT, CERT_B, NOK, GEN,
                              N_ROUNDS, VFOLD, NG)),
            (W._producer, (k_desc, v_desc, k_bufs, v_bufs, s_bufs, o_bufs, ready, empty, KS, VS, KO, BT_row, kvh,
                           start, end, n_tiles, s_ks_n, s_vs_n, s_ko_n, s_ko_h, D, PAGE, BN, RBOX, RING, True, True,
                           NOK, NOKP, NG)),
        ], [1], [PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# host side
def _constexprs(pl: CertPlan, cfg: WSpecCertConfig, cert: bool, cert_b: bool) -> dict[str, Any]:
    lay = consumer_layouts(cfg.block_n)
    return dict(KW=lay["KW"], W_L=lay["W"], QB=lay["QB"], Z8=lay["Z8"], F3=lay["F3"], GQA=pl.gqa, PAGE=pl.block_size,
                BN=cfg.block_n, RBOX=pl.box_rows, RING=cfg.ring, NW=4, PRODUCER_REGS=cfg.producer_regs, PRMT=cfg.prmt,
                CERT=cert, CERT_B=cert and cert_b, NOK=pl.nok, NOKP=1 << max(0, pl.nok - 1).bit_length(),
                VFOLD=cfg.pv == "fold", D=pl.d, NC=cfg.consumers, CONSUMER_REGS=cfg.consumer_regs)


def wspec_cert_stage1(q, k_pool, v_pool, block_table, seq_lens, *, block_size: int, layer: int, seed: int,
                      sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False, cert: bool = True,
                      cert_b: bool = True, config: WSpecCertConfig | None = None, num_splits: int | None = None,
                      descs=None, out=None):
    """Launch stage 1: per-split ``(o_s [B, Hq, NS, d] fp32, lse_s [B, Hq, NS], A_s, B_s)`` (``A_s``/``B_s`` None
    when off). ``descs``/``out``: prebuilt TMA descriptors and output buffers (a CUDA graph captures no host work).
    ``cert=False`` compiles the certificate out (keys still dithered)."""
    from kvlib.kernels.int8.request import as_side

    cfg = config or WSpecCertConfig()
    pl = plan(q, k_pool, v_pool, block_table, seq_lens, block_size=block_size, layer=layer, seed=seed,
              sm_scale=sm_scale, delta=delta, v_dither=v_dither, config=cfg, num_splits=num_splits)
    if not q.is_cuda:
        raise ValueError("q: the warp-specialised kernel needs a CUDA (Hopper) device")
    k = as_side(k_pool, "k_pool")
    v = as_side(v_pool, "v_pool")
    kc, ks = _pages(k, block_size, "k_pool")
    vc, vs = _pages(v, block_size, "v_pool")
    kd, vd = descs if descs is not None else W.descriptors(kc, vc, pl.box_rows, cfg.swizzle)
    B, hq, d, ns = pl.batch, pl.hq, pl.d, pl.num_splits * cfg.consumers  # (ping-pong: a state per warpgroup)
    if out is None:
        o_s = torch.empty(B, hq, ns, d, dtype=torch.float32, device=q.device)
        lse_s = torch.empty(B, hq, ns, dtype=torch.float32, device=q.device)
        a_s = torch.empty(B, hq, ns, dtype=torch.float32, device=q.device) if cert else None
        b_s = torch.empty(B, hq, ns, dtype=torch.float32, device=q.device) if cert and cert_b else None
    else:
        o_s, lse_s, a_s, b_s = out
    q = q.contiguous()
    ks2 = ks.view(-1, pl.hkv * (d // GROUP))
    vs2 = vs.view(-1, pl.hkv * (d // GROUP))
    ko = k.outliers if pl.nok else ks2  # placeholders where there are none (never read)
    koc = k.outlier_channels if pl.nok else block_table
    _wspec_cert_stage1[(B, pl.hkv, ns)](
        q, kd, vd, ks2, vs2, block_table, seq_lens, o_s, lse_s, a_s if a_s is not None else lse_s,
        b_s if b_s is not None else lse_s, ko, koc,
        pl.sm_scale, math.log(2.0 / pl.delta), pl.rad_extra, pl.byp_rel, pl.byp_abs, layer, pl.k0, pl.k1, ns,
        q.stride(0), q.stride(1), ks2.stride(0), vs2.stride(0), ko.stride(0), ko.stride(1) if pl.nok else 0,
        block_table.stride(0), o_s.stride(0), o_s.stride(1), o_s.stride(2), lse_s.stride(0), lse_s.stride(1),
        **_constexprs(pl, cfg, cert, cert_b), num_warps=4, maxnreg=cfg.maxnreg,
    )
    return o_s, lse_s, a_s, b_s


def wspec_cert_decode(q, k_pool, v_pool, block_table, seq_lens, **kw):
    """Stage 1 and the exact LSE merge (the certificate's accumulators ride the same weights): a
    :class:`~kvlib.kernels.int8.request.DecodeOut` with ``path="wspec_cert"``."""
    from kvlib.kernels.int8.request import DecodeOut
    from kvlib.kernels.tl.merge import merge_splits

    o_s, lse_s, a_s, b_s = wspec_cert_stage1(q, k_pool, v_pool, block_table, seq_lens, **kw)
    m = merge_splits(o_s, lse_s, a_s, b_s, pdl=True)
    return DecodeOut(m.o, m.lse, m.A, m.B, m.tv_bound, m.tv_bound_one, m.vacuous, path="wspec_cert")


def wspec_cert_reference(q, k_pool, v_pool, block_table, seq_lens, *, block_size: int, layer: int, seed: int,
                         sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False):
    """The float64 torch reference of the same request, validated as the kernel's (:func:`plan`):
    :func:`kvlib.kernels.int8.reference.decode_reference` with the h10/h8 rounding slack the kernel's radius
    carries (``kernel_rounding="h10"``: ``impl="h10"``'s, as the Gluon kernel's tests, also at d = 64, a shape the
    Triton h10 kernel does not read). A :class:`~kvlib.kernels.int8.request.DecodeOut`."""
    from kvlib.kernels.int8.reference import decode_reference

    plan(q, k_pool, v_pool, block_table, seq_lens, block_size=block_size, layer=layer, seed=seed, sm_scale=sm_scale,
         delta=delta, v_dither=v_dither, num_splits=1)
    return decode_reference(q, k_pool, v_pool, None, seq_lens, layer=layer, seed=seed, sm_scale=sm_scale,
                            delta=delta, kernel_rounding="h10", block_table=block_table, block_size=block_size)


def compile_offline(config: WSpecCertConfig | None = None, *, gqa: int = 7, block_size: int = 16, nok: int = 0,
                    cert: bool = True, cert_b: bool = True, d: int = 128):
    """Compile the kernel for sm_90 without a GPU (Triton's own ptxas): the compiled kernel (``asm`` holds the
    TTGIR/PTX/cubin). Raises the compiler's error where the kernel does not build (a layout conversion that is not
    a relabelling fails its ``assert_trivial`` here)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config or WSpecCertConfig()
    if d not in W.HEAD_DIMS:
        raise ValueError(f"d must be one of {W.HEAD_DIMS}, got {d!r}")
    rbox = min(block_size, cfg.block_n)
    desc = f"tensordesc<i8[{rbox}, {d}],{W.smem_layout(rbox, d, cfg.swizzle)!r}>"
    ptrs = {"Q": "*bf16", "k_desc": desc, "v_desc": desc, "KS": "*fp16", "VS": "*fp16", "BT": "*i32", "SEQ": "*i32",
            "O_S": "*fp32", "LSE_S": "*fp32", "A_S": "*fp32", "B_S": "*fp32", "KO": "*fp16", "KOC": "*i64"}
    floats = {"sm_scale", "log_2_over_delta", "rad_extra", "byp_rel", "byp_abs"}
    pl = CertPlan(1, gqa, 1, gqa, d, block_size, 1, 1, 1, rbox, nok, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    const = _constexprs(pl, cfg, cert, cert_b) | dict(GEN=0, N_ROUNDS=10)
    params = inspect.signature(_wspec_cert_stage1.fn).parameters
    sig = {n: ("constexpr" if n in const else ptrs.get(n) or ("fp32" if n in floats else "i32")) for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in ptrs and n not in ("k_desc", "v_desc")}
    return triton.compile(GluonASTSource(_wspec_cert_stage1, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cfg.maxnreg})
