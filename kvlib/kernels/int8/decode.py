"""Certified split-KV decode attention over the dithered INT8 paged pool: the dispatcher and public API.

Flash-decoding structure (as SGLang's ``decode_attention.py``): stage 1, one program per (batch row, KV head,
split), loads each KV tile once for all query heads of the GQA group and writes the split's
``(o_s, lse_s, A_s, B_s)`` with the WitCert certificate accumulators; stage 2,
:func:`kvlib.kernels.tl.merge.merge_splits`, merges the splits with LSE weights (``A`` and ``B`` riding the same
weights as the output) and finishes the bounds. Stage-1 kernels, by the key pool's dither layout:

* ``w24``: :mod:`kvlib.kernels.int8.w24`, ``impl="tc"`` (tensor cores) or ``"fma"`` (fp32 dots);
* ``h10`` / ``h8``: :mod:`kvlib.kernels.int8.h10` (Triton, ``impl="h10"``);
* ``h8`` on a GPU: :mod:`kvlib.kernels.int8.gluon` (``impl="gluon"``);
* on Hopper over vLLM pages (``block_table``), h8-dithered or RTN keys, ``d = 128``: the warp-specialised kernels
  :mod:`kvlib.kernels.int8.wspec_cert` and :mod:`kvlib.kernels.int8.wspec` (``impl="wspec"``; ``"auto"`` takes them
  wherever :func:`wspec_unsupported` says they apply).

Tuning is one :class:`~kvlib.kernels.int8.config.Int8KernelConfig` (``config=``). The result says which
kernel ran (:attr:`DecodeOut.path`). The storage view and request checks are
:mod:`kvlib.kernels.int8.request`; the float64 torch reference is :mod:`kvlib.kernels.int8.reference`. On CPU
the kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlib.certify.bound import radius_multiplier, rounding_gamma
from kvlib.core.checks import check_open_unit
from kvlib.core.fp16 import FP16_REL, FP16_SUB
from kvlib.core.philox import DEFAULT_GENERATOR, seed_key
from kvlib.kernels.backend import triton_available
from kvlib.kernels.int8.config import DEFAULT_CONFIG, Int8KernelConfig, check_config
from kvlib.kernels.int8.reference import decode_reference, dequant_rows
from kvlib.kernels.int8.request import (
    DecodeOut,
    PoolSide,
    as_side,
    check_key_cert,
    check_request,
    key_layout,
    make_pool_side,
    resolve_impl,
)
from kvlib.kernels.tl.merge import merge_splits

__all__ = [
    "DEFAULT_CONFIG", "DecodeOut", "Int8KernelConfig", "PoolSide", "as_side", "decode_int8", "decode_reference",
    "decode_stage1", "default_num_splits", "dequant_rows", "launch_decode", "make_pool_side", "resolve_impl",
    "stage1_path",
]


def default_num_splits(batch: int, hkv: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice, never more splits than tiles (power of two)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, math.ceil(2 * sms / max(1, batch * hkv)))
    tiles = max(1, math.ceil(max_len / block_n))
    ns = min(want, tiles, 64)
    return 1 << (ns - 1).bit_length() if ns > 1 else 1


def stage1_path(q: torch.Tensor, k: PoolSide, v: PoolSide, *, impl: str = "auto", v_dither: bool = False,
                cert: bool = True) -> str:
    """The stage-1 kernel :func:`decode_stage1` runs for this request: ``"tc"``, ``"fma"``, ``"h10"`` or
    ``"gluon"``. ``"auto"`` takes the Gluon kernel for an h8 pool wherever it runs and compiles without spills
    (:func:`kvlib.kernels.int8.gluon.gluon_auto_ok`: not with value outliers), else ``"h10"``; an explicit
    ``impl="gluon"`` that cannot run raises, naming what is missing. RTN keys (``k.dithered=False``) route as the
    pool's layout label says under ``"auto"``; any kernel may be asked for by name (:func:`key_layout`)."""
    asked = impl
    layout = key_layout(k, impl)
    impl = resolve_impl(impl, q.shape[-1], k.group, v_dither, layout)
    if impl == "gluon" or (asked == "auto" and impl == "h10" and layout == "h8"):
        from kvlib.kernels.int8.gluon import gluon_auto_ok, gluon_unsupported

        why = gluon_unsupported(q, k, v, v_dither)
        if impl == "gluon" and why:
            raise ValueError(why)
        impl = "gluon" if impl == "gluon" or (not why and gluon_auto_ok(k, v, cert)) else "h10"
    if impl not in ("h10", "gluon") and layout != "w24":
        raise ValueError(f"the Triton {impl!r} kernel reads the w24 dither layout only; an h10 or h8 pool needs "
                         "impl='h10'")
    if impl == "h10" and v_dither:
        raise ValueError("impl='h10' reads RTN values only (v_dither=False)")
    return impl


#: the warp-specialised kernels' configurations the dispatcher takes (``impl="auto"``/``"wspec"``), chosen from the
#: H200 timings of 2026-12-02 (dev/results/wspec_cert_timing.json: B = 8 and 32, S = 16k, 28 / 4 heads, pages of
#: 16, CUDA graphs): certified, the folded PV with 128-position tiles and a 3-deep ring without outlier channels
#: (1.00-1.02x SDPA bf16, against 0.86-0.87x for the Gluon kernel), the 64-position default ring with them (its
#: 128-position ring leaves one CTA per SM: 0.62-0.66x); RTN keys, wspec2's best (``bn128_r3_pf``, 1.23-1.24x)
WSPEC_CERT_CONFIGS = {"plain": {"pv": "fold", "block_n": 128, "ring": 3, "producer_regs": 40},
                      "outliers": {"pv": "fold"}}
WSPEC_RTN_CONFIG = {"block_n": 128, "ring": 3, "prmt": True, "vfold": True, "prefetch": True}
#: head dims ``impl="auto"`` (and so the INT8 backend) sends to the warp-specialised kernels. The kernels also take
#: d = 64 (SmolLM2, issue 40: offline sm_90 builds without spills, dev/results/wspec_d64_offline.json) but have not
#: run at d = 64 on a GPU: until ``make test-gpu`` passes their d = 64 tests (tests/test_wspec.py,
#: tests/test_wspec_cert.py), only ``impl="wspec"`` takes it; then add 64 here
WSPEC_AUTO_HEAD_DIMS = (128,)
#: the ping-pong variant of the RTN kernel (two consumer warpgroups on alternate tiles, issue 40; opt-in, never
#: dispatched): WSPEC_RTN_CONFIG's tile and operand options, a 4-deep ring (a stage per warpgroup and two in flight),
#: 168 registers for both warpgroups and one 12-warp CTA per SM (offline sm_90: no spills,
#: dev/results/wspec_d64_offline.json); to be timed against WSPEC_RTN_CONFIG on a GPU before it is taken anywhere
WSPEC_RTN_PINGPONG_CONFIG = WSPEC_RTN_CONFIG | {"ring": 4, "consumers": 2, "maxnreg": 168, "consumer_regs": 168,
                                                 "ctas_per_sm": 1}
#: the certified kernel's ping-pong variant (the same scheme over WSPEC_CERT_CONFIGS["plain"]; opt-in, never
#: dispatched). Offline sm_90 at d = 128 it spills a few words outside the consumers' tile loops (16 spill
#: instructions, 118 with m = 4 pairs, none inside the loops); none at d = 64
WSPEC_CERT_PINGPONG_CONFIG = WSPEC_CERT_CONFIGS["plain"] | {"ring": 4, "consumers": 2, "maxnreg": 168,
                                                            "consumer_regs": 168, "ctas_per_sm": 1}


def wspec_pages_unsupported(d: int, group: int, dithered: bool, dither_layout: str) -> str | None:
    """The pool-shape rules of :func:`wspec_unsupported` that ``"auto"`` applies before it sees a request (None where
    the warp-specialised kernels may take such pages): ``d`` in :data:`WSPEC_AUTO_HEAD_DIMS`, groups of 32, RTN or
    h8-dithered keys. A backend asks this where the Triton kernels refuse its pages (h8 keys at d = 64 in groups of
    32: the h10 kernel needs ``group == d / 4``), so that the warp-specialised kernels, not the torch reference,
    take them once d = 64 is enabled."""
    if d not in WSPEC_AUTO_HEAD_DIMS:
        return f"head_dim {d}: not in WSPEC_AUTO_HEAD_DIMS = {WSPEC_AUTO_HEAD_DIMS}"
    if group != 32:
        return f"groups of 32 channels only, got {group}"
    if dithered and dither_layout != "h8":
        return f"dithered keys must use the h8 layout, got {dither_layout!r}"
    return None


def wspec_unsupported(q: torch.Tensor, k: PoolSide, v: PoolSide, *, v_dither: bool, block_table, block_size,
                      config: Int8KernelConfig | None = None, auto: bool = True) -> str | None:
    """Why the warp-specialised kernels (:mod:`kvlib.kernels.int8.wspec_cert` for h8-dithered keys,
    :mod:`kvlib.kernels.int8.wspec` for RTN keys) cannot take this request, or None where they can: a Hopper GPU
    (TMA, mbarrier, ``warp_specialize``), vLLM pages (``block_table``, ``block_size`` a power of two >= 8),
    ``d`` 64 or 128 (``auto``: only the head dims of :data:`WSPEC_AUTO_HEAD_DIMS`; ``auto=False`` is an explicit
    ``impl="wspec"``), groups of 32 with fp16 scales, ``GQA <= 8``, RTN values without outliers, at most 16 key
    outlier channels (dithered keys; none with RTN keys), the default kernel config (a tuned
    :class:`Int8KernelConfig` asks for the Triton/Gluon kernels it tunes)."""
    from kvlib.kernels.int8.wspec import HEAD_DIMS

    if block_table is None or block_size is None:
        return "the warp-specialised kernels read vLLM pages: pass block_table and block_size (slots=None)"
    if config is not None and check_config(config) != DEFAULT_CONFIG:
        return "config: a tuned Int8KernelConfig is read by the Triton and Gluon kernels only"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q must be fp16 or bf16, got {q.dtype}"
    d, hkv = q.shape[-1], k.codes.shape[1]
    if d not in HEAD_DIMS:
        return f"head_dim must be 64 or 128, got {d}"
    if auto and d not in WSPEC_AUTO_HEAD_DIMS:
        return (f"head_dim {d}: the warp-specialised kernels take it only when asked (impl='wspec') until it has "
                f"run on a GPU (WSPEC_AUTO_HEAD_DIMS = {WSPEC_AUTO_HEAD_DIMS})")
    if q.shape[1] % hkv or q.shape[1] // hkv > 8:
        return f"at most 8 query heads per KV head, got {q.shape[1]} query / {hkv} KV heads"
    if k.group != 32 or v.group != 32:
        return f"groups of 32 channels only, got {k.group} / {v.group}"
    if k.scales.dtype != torch.float16 or v.scales.dtype != torch.float16:
        return "fp16 group scales only"
    if v_dither or v.outliers is not None:
        return "RTN values without outlier channels only"
    if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 8
            or block_size & (block_size - 1)):
        return f"block_size must be a power of two >= 8, got {block_size!r}"
    if k.codes.shape[0] % block_size:
        return f"the pool's {k.codes.shape[0]} slots are not whole pages of {block_size}"
    if k.dithered:
        if k.dither_layout != "h8":
            return f"dithered keys must use the h8 layout, got {k.dither_layout!r}"
        if k.outliers is not None and (k.outliers.shape[-1] > 16 or k.outliers.dtype != torch.float16):
            return f"at most 16 fp16 key outlier channels, got {k.outliers.shape[-1]} of {k.outliers.dtype}"
    elif k.outliers is not None:
        return "RTN keys without outlier channels only"
    if not q.is_cuda:  # last, so that the shape rules above are checked (and tested) on any device
        return "the warp-specialised kernels need a CUDA tensor"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the warp-specialised kernels need a Hopper (sm_90) GPU: TMA, mbarrier and warp_specialize"
    return None


def _stage1_wspec(q, k, v, block_table, seq_lens, *, block_size, layer, seed, sm, delta, cert, cert_b, num_splits):
    """Stage 1 on the warp-specialised kernels (the configurations above): ``(o_s, lse_s, A_s, B_s, path)``."""
    if not k.dithered:
        from kvlib.kernels.int8 import wspec as W

        nb = k.codes.shape[0] // block_size
        pages = [(s.codes.view(nb, block_size, *s.codes.shape[1:]), s.scales.view(nb, block_size, *s.scales.shape[1:]))
                 for s in (k, v)]
        o_s, lse_s = W.wspec_stage1(q, *pages[0], *pages[1], block_table, seq_lens, sm_scale=sm,
                                    config=W.WSpecConfig(**WSPEC_RTN_CONFIG), num_splits=num_splits)
        return o_s, lse_s, None, None, "wspec"
    from kvlib.kernels.int8 import wspec_cert as C

    cfg = C.WSpecCertConfig(**WSPEC_CERT_CONFIGS["outliers" if k.outliers is not None else "plain"])
    o_s, lse_s, a_s, b_s = C.wspec_cert_stage1(q, k, v, block_table, seq_lens, block_size=block_size, layer=layer,
                                               seed=seed, sm_scale=sm, delta=delta, cert=cert, cert_b=cert_b,
                                               config=cfg, num_splits=num_splits)
    return o_s, lse_s, a_s, b_s, "wspec_cert"


def decode_stage1(
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor | None, seq_lens: torch.Tensor, *,
    layer: int, seed: int, sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False,
    cert: bool = True, cert_b: bool = True, impl: str = "auto", num_splits: int | None = None,
    config: Int8KernelConfig | None = None, block_table: torch.Tensor | None = None, block_size: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Stage 1 only: per-split ``(o_s [B,Hq,NS,d], lse_s, A_s, B_s [B,Hq,NS])`` (A_s/B_s None when off).

    ``impl``: ``"tc"``, ``"fma"``, ``"h10"``, ``"gluon"`` or ``"auto"`` (:func:`stage1_path`). ``config``: the
    kernels' tuning (:class:`Int8KernelConfig`, default :data:`DEFAULT_CONFIG`). Requests address the pool by
    ``slots [B, max_len]`` or, vLLM-style, by ``block_table [B, max_blocks]`` int32 over pages of ``block_size``
    slots (pass ``slots=None``; :mod:`kvlib.kernels.tl.paging`).
    """
    o_s, lse_s, a_s, b_s, _ = _stage1(q, k_pool, v_pool, slots, seq_lens, layer=layer, seed=seed, sm_scale=sm_scale,
                                      delta=delta, v_dither=v_dither, cert=cert, cert_b=cert_b, impl=impl,
                                      num_splits=num_splits, config=config, block_table=block_table,
                                      block_size=block_size)
    return o_s, lse_s, a_s, b_s


def _stage1(q, k_pool, v_pool, slots, seq_lens, *, layer, seed, sm_scale, delta, v_dither, cert, cert_b, impl,
            num_splits, config, block_table, block_size):
    cfg = check_config(config)
    k = as_side(k_pool, "k_pool")
    v = as_side(v_pool, "v_pool")
    check_key_cert(k, cert)
    slots, page, max_len = check_request(q, k, v, slots, seq_lens, block_table, block_size)
    delta = check_open_unit("delta", delta)
    if not isinstance(layer, int) or not 0 <= layer < 2**31:
        raise ValueError(f"layer must be an int in [0, 2^31), got {layer!r}")
    k0, k1 = seed_key(seed)
    if not triton_available(q.device):
        raise RuntimeError("Triton decode needs CUDA or TRITON_INTERPRET=1 set before triton is imported")
    B, hq, d = q.shape
    hkv = k.codes.shape[1]
    d4 = d // 4
    if d4 & (d4 - 1):
        raise ValueError(f"d // 4 must be a power of two for the kernel, got d={d}")
    sm = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    if impl in ("auto", "wspec"):
        why = wspec_unsupported(q, k, v, v_dither=v_dither, block_table=block_table, block_size=block_size,
                                config=cfg, auto=impl == "auto")
        if impl == "wspec" and why:
            raise ValueError(f"impl='wspec': {why}")
        if not why:
            return _stage1_wspec(q, k, v, block_table, seq_lens, block_size=block_size, layer=layer, seed=seed,
                                 sm=sm, delta=delta, cert=cert, cert_b=cert_b, num_splits=num_splits)
    path = stage1_path(q, k, v, impl=impl, v_dither=v_dither, cert=cert)
    if path == "gluon":
        from kvlib.kernels.int8.gluon import gluon_num_splits

        ns = num_splits or gluon_num_splits(B, hkv, max_len, q.device, cfg.programs_per_sm)
    else:
        ns = num_splits or default_num_splits(B, hkv, max_len, cfg.block_n, q.device)
    if not isinstance(ns, int) or ns < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    dev = q.device
    q = q.contiguous()
    slots = slots.contiguous()
    layout = key_layout(k, impl) if path in ("h10", "gluon") else "w24"
    # the Gluon kernel's operands and sums are the h10 kernel's over the h8 layout: the same rounding slack
    rad_extra = (radius_multiplier(1, delta, d, impl="h10" if path == "gluon" else path, layout=layout)
                 - radius_multiplier(1, delta, d, slack=False))
    o_s = torch.empty(B, hq, ns, d, dtype=torch.float32, device=dev)
    lse_s = torch.empty(B, hq, ns, dtype=torch.float32, device=dev)
    a_s = torch.empty(B, hq, ns, dtype=torch.float32, device=dev) if cert else lse_s
    b_s = torch.empty(B, hq, ns, dtype=torch.float32, device=dev) if cert and cert_b else lse_s
    common = dict(delta=delta, rad_extra=rad_extra, layer=layer, k0=k0, k1=k1, ns=ns, cert=cert, cert_b=cert_b,
                  page=page)
    if cfg.generator != DEFAULT_GENERATOR and path not in ("h10", "gluon"):
        raise ValueError(f"config.generator={cfg.generator!r} is read by the h10 and Gluon kernels only; the {path!r} "
                         "kernel regenerates Philox4x32-10")
    if path == "gluon":
        from kvlib.kernels.int8.gluon import launch_g8

        launch_g8(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, sm=sm, ahead=cfg.ahead,
                  byp_rel=FP16_REL + rounding_gamma(d), byp_abs=FP16_SUB,
                  generator="none" if cfg.skip_philox else cfg.generator, **common)
    elif path == "h10":
        from kvlib.kernels.int8.h10 import launch_h10

        launch_h10(q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, sm=sm, byp_rel=FP16_REL + rounding_gamma(d),
                   byp_abs=FP16_SUB, config=cfg, **common)
    else:
        from kvlib.kernels.int8.w24 import launch_w24

        launch_w24(path, q, k, v, slots, seq_lens, o_s, lse_s, a_s, b_s, sm=sm, v_dither=v_dither, config=cfg,
                   **common)
    return o_s, lse_s, (a_s if cert else None), (b_s if cert and cert_b else None), path


def decode_int8(
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor | None, seq_lens: torch.Tensor, *,
    layer: int, seed: int, sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False,
    cert: bool = True, cert_b: bool = True, impl: str = "auto", num_splits: int | None = None,
    config: Int8KernelConfig | None = None, block_table: torch.Tensor | None = None, block_size: int | None = None,
    fallback_to_reference: bool = True,
) -> DecodeOut:
    """Certified decode attention over the dithered INT8 pool (one query token per batch row).

    ``q`` ``[B, Hq, d]``; pools per :class:`PoolSide`; ``slots [B, max_len]`` and ``seq_lens [B]``
    (each ``>= 1``). ``delta`` is the per-row failure probability (pass
    :func:`kvlib.certify.bound.request_delta` for the request-level allocation). ``v_dither``: values
    were written with dither (else RTN). Keys stored without dither (``k_pool.dithered=False``, e.g. rtn-int8) are
    read in RTN-key mode (no dither regenerated); they have no certificate, so ``cert`` must be False (else
    ValueError). ``cert=False`` skips the certificate (constexpr switch);
    ``cert_b=False`` keeps only ``A`` (one-accumulator bound). ``impl`` and ``num_splits``: see
    :func:`decode_stage1`; ``config``: the kernels' tuning; ``block_table`` + ``block_size`` (with
    ``slots=None``): vLLM-style paged addressing. No host synchronisation: CUDA-graph safe.
    Where no Triton backend runs (CPU without ``TRITON_INTERPRET=1``) it returns :func:`decode_reference`
    (``fallback_to_reference``, else raises). ``DecodeOut.path`` names what ran (``"reference"`` or the kernel).
    """
    cfg = check_config(config)
    check_key_cert(as_side(k_pool, "k_pool"), cert)
    if not triton_available(q.device if isinstance(q, torch.Tensor) else torch.device("cpu")):
        if not fallback_to_reference:
            raise RuntimeError("Triton decode needs CUDA or TRITON_INTERPRET=1 set before triton is imported")
        if impl == "wspec":
            raise ValueError("impl='wspec': the warp-specialised kernels need a CUDA tensor (Hopper)")
        if cfg.generator != DEFAULT_GENERATOR:  # refused on every device, as the w24 kernels refuse it in _stage1
            raise ValueError(f"config.generator={cfg.generator!r}: the torch reference that runs here (no Triton "
                             "backend for this device) regenerates Philox4x32-10 only")
        return decode_reference(q, k_pool, v_pool, slots, seq_lens, layer=layer, seed=seed, sm_scale=sm_scale,
                                delta=delta, v_dither=v_dither, impl=impl, block_table=block_table,
                                block_size=block_size)
    return launch_decode(q, k_pool, v_pool, slots, seq_lens, layer=layer, seed=seed, sm_scale=sm_scale, delta=delta,
                         v_dither=v_dither, cert=cert, cert_b=cert_b, impl=impl, num_splits=num_splits, config=config,
                         block_table=block_table, block_size=block_size)


def launch_decode(
    q: torch.Tensor, k_pool: Any, v_pool: Any, slots: torch.Tensor | None, seq_lens: torch.Tensor, *,
    layer: int, seed: int, sm_scale: float | None = None, delta: float = 1e-2, v_dither: bool = False,
    cert: bool = True, cert_b: bool = True, impl: str = "auto", num_splits: int | None = None,
    config: Int8KernelConfig | None = None, block_table: torch.Tensor | None = None, block_size: int | None = None,
) -> DecodeOut:
    """The kernels of :func:`decode_int8` without its CPU fallback: stage 1 (``impl`` as asked, checked against the
    request; ``"auto"`` chooses) and the merge, on CUDA or under the interpreter (RuntimeError elsewhere). A caller
    that chose ``impl`` itself (:class:`kvlib.backends.int8.Int8Backend`) launches it here."""
    o_s, lse_s, a_s, b_s, path = _stage1(
        q, k_pool, v_pool, slots, seq_lens, layer=layer, seed=seed, sm_scale=sm_scale, delta=delta,
        v_dither=v_dither, cert=cert, cert_b=cert_b, impl=impl, num_splits=num_splits, config=config,
        block_table=block_table, block_size=block_size)
    # a programmatic dependent launch on sm_90: the merge launches while stage 1 drains and waits for its results
    # (griddepcontrol.wait), so the results are the same; its saving was not timed on its own
    o, lse, A, Bv, two, one, vac = merge_splits(o_s, lse_s, a_s, b_s, pdl=True)
    return DecodeOut(o, lse, A, Bv, two, one, vac, path=path)
