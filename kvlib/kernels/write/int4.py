"""Fused kv4 / kv4rl pool write: rotate, quantise and pack K and V (and kv4rl's INT8 side buffer) in one launch.

One program per (token ``n``, KV head ``h``) reads ``k[n, h], v[n, h]`` (``[d]``, any float dtype), and writes:

* keys: :func:`kvlib.core.hadamard.hadamard` (the same Sylvester butterfly, the same fp32 adds in the same
  order, then ``* fp32(1/sqrt(d))``), then :func:`kvlib.formats.kv4.int4_quantize_unchecked` (one affine group
  per (token, head): ``m = fp16_down(min)``, ``delta = fp16_up((max - m) / 15)``, codes
  ``clamp(rne((x - m) / delta), 0, 15)`` packed two per byte, channel ``2i`` in the low nibble);
* values: the same quantisation without the rotation;
* kv4rl (``side`` given, a decode step: one token per row): the rotated key and the value as per-vector
  symmetric INT8 (:func:`kvlib.formats.kv4rl.int8_quantize_unchecked`) into side slot
  :func:`kvlib.formats.kv4rl.ring_slot` (the format's own :func:`~kvlib.formats.kv4rl.is_protected` and
  :func:`~kvlib.formats.kv4rl.ring_index`, jitted here: the rule has one source), after moving the entry
  leaving the ring (position ``pos - recent``) to the crop stash at ``(pos - recent) % U``:
  :meth:`kvlib.backends.int4.Int4Backend.write`'s ``one_per_row`` branch.

``tests/test_write_kernels.py`` binds it to the torch path bit for bit (interpreter) and
``dev/gpu/writefuse.sh`` on the GPU.
"""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import torch
import triton
import triton.language as tl

from kvlib.core.checks import check_tensor
from kvlib.formats import kv4rl
from kvlib.kernels.tl.rounding import rne
from kvlib.kernels.write import recip32


def _jit_rule(fn):
    """``fn`` (a format's operators-only rule) as a Triton function, from its own code object. Its globals gain
    ``triton.language`` only because the interpreter (``TRITON_INTERPRET=1``) finds the language to patch there."""
    f = types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl}, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__doc__, f.__module__, f.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__
    return triton.jit(f)


# kv4rl's side-buffer rules, from the format's file: the kernel compiles the format's source, no restatement
_is_protected = _jit_rule(kv4rl.is_protected)
_ring_index = _jit_rule(kv4rl.ring_index)


@triton.jit
def _f16_step(t, UP: tl.constexpr):
    """``torch.nextafter(t, +-inf)`` of fp16 ``t`` (not NaN): bit arithmetic on the sign-magnitude code."""
    b = t.to(tl.int16, bitcast=True).to(tl.int32)
    zero = (b & 0x7FFF) == 0
    neg = b < 0
    if UP:
        nb = tl.where(zero, 1, tl.where(neg, b - 1, b + 1))
    else:
        nb = tl.where(zero, -32767, tl.where(neg, b + 1, b - 1))  # -32767 = 0x8001, the negative least subnormal
    return nb.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _f16_round(v, UP: tl.constexpr):
    """:func:`kvlib.formats.kv4.fp16_round`: fp32 ``v`` to fp16 towards ``+inf`` (UP) or ``-inf``."""
    t = v.to(tl.float16)
    tf = t.to(tl.float32)
    if UP:
        bad = tf < v
    else:
        bad = tf > v
    return tl.where(bad, _f16_step(t, UP), t)


@triton.jit
def _sdiv(x, C: tl.constexpr, INV: tl.constexpr, RECIP: tl.constexpr):
    """``x / C`` for a Python-scalar divisor as torch computes it on the tensor's device (module docstring)."""
    if RECIP:
        return x * INV
    else:
        return tl.math.div_rn(x, C)


@triton.jit
def _stage(y, D: tl.constexpr, HH: tl.constexpr):
    """One butterfly stage: the pair ``(a, b)`` of channels ``(i, i + HH)`` in each block of ``2 HH`` becomes
    ``(a + b, a - b)``."""
    t = tl.permute(tl.reshape(y, (D // (2 * HH), 2, HH)), (0, 2, 1))  # [blocks, HH, 2]: (a, b) pairs last
    a, b = tl.split(t)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (D,))


@triton.jit
def _hadamard(y, D: tl.constexpr, SCALE: tl.constexpr):
    """:func:`kvlib.core.hadamard.hadamard` of ``y [D]`` fp32 (``2 <= D <= 512``): the stages in its order."""
    for i in tl.static_range(9):  # stages of half-width 1, 2, 4, ..., D / 2
        if D >= 2 << i:
            y = _stage(y, D, 1 << i)
    return y * SCALE


@triton.jit
def _int4_put(y, c_ptr, s_ptr, o_ptr, idx, D: tl.constexpr, RECIP: tl.constexpr, INV15: tl.constexpr):
    """:func:`kvlib.formats.kv4.int4_quantize_unchecked` of ``y [D]`` fp32, stored at row ``idx`` (slot * H + h)."""
    lo = tl.min(y, 0)
    hi = tl.max(y, 0)
    m = _f16_round(lo, False)
    mf = m.to(tl.float32)
    delta = _f16_round(_sdiv(hi - mf, 15.0, INV15, RECIP), True)
    df = delta.to(tl.float32)
    safe = tl.where(df > 0, df, 1.0)
    c = tl.minimum(tl.maximum(rne(tl.math.div_rn(y - mf, safe)), 0.0), 15.0).to(tl.int32)
    lo_c, hi_c = tl.split(tl.reshape(c, (D // 2, 2)))  # channel 2i low nibble, 2i + 1 high
    tl.store(c_ptr + idx * (D // 2) + tl.arange(0, D // 2), (lo_c | (hi_c << 4)).to(tl.uint8))
    tl.store(s_ptr + idx, delta)
    tl.store(o_ptr + idx, m)


@triton.jit
def _side_put(x, s8_ptr, ss_ptr, st_ptr, sts_ptr, base, ring, j, keep, ev_ok, D: tl.constexpr, C: tl.constexpr,
              U: tl.constexpr, RECIP: tl.constexpr, INV127: tl.constexpr):
    """One (row, head) of kv4rl's side buffer: stash the entry leaving the ring, then write ``x``'s INT8."""
    ch = tl.arange(0, D)
    old = tl.load(s8_ptr + (base * C + ring) * D + ch)
    olds = tl.load(ss_ptr + base * C + ring)
    tl.store(st_ptr + (base * U + j) * D + ch, old, mask=(ch < D) & ev_ok)
    tl.store(sts_ptr + base * U + j, olds, mask=ev_ok)
    tl.debug_barrier()  # the old entry is read before it is overwritten, by every thread
    scale = _f16_round(_sdiv(tl.max(tl.abs(x), 0), 127.0, INV127, RECIP), True)
    sf = scale.to(tl.float32)
    safe = tl.where(sf > 0, sf, 1.0)
    c8 = tl.minimum(tl.maximum(rne(tl.math.div_rn(x, safe)), -127.0), 127.0).to(tl.int8)
    tl.store(s8_ptr + (base * C + ring) * D + ch, c8, mask=(ch < D) & keep)
    tl.store(ss_ptr + base * C + ring, scale, mask=keep)


@triton.jit
def _write_int4_kernel(
    k_ptr, v_ptr, slot_ptr, skn, skh, svn, svh,
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr,
    rows_ptr, pos_ptr, lens_ptr, k8_ptr, k8s_ptr, v8_ptr, v8s_ptr, kst_ptr, ksts_ptr, vst_ptr, vsts_ptr,
    H: tl.constexpr, D: tl.constexpr, HSCALE: tl.constexpr,
    RECIP: tl.constexpr, INV15: tl.constexpr, INV127: tl.constexpr,
    SIDE: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, RW: tl.constexpr, C: tl.constexpr,
    U: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    ch = tl.arange(0, D)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    k = tl.load(k_ptr + n.to(tl.int64) * skn + h * skh + ch).to(tl.float32)
    v = tl.load(v_ptr + n.to(tl.int64) * svn + h * svh + ch).to(tl.float32)
    kr = _hadamard(k, D, HSCALE)  # keys stored rotated (rotate="k")
    _int4_put(kr, kc_ptr, ks_ptr, ko_ptr, slot * H + h, D, RECIP, INV15)
    _int4_put(v, vc_ptr, vs_ptr, vo_ptr, slot * H + h, D, RECIP, INV15)
    if SIDE:
        r = tl.load(rows_ptr + n).to(tl.int64)
        p = tl.load(pos_ptr + n).to(tl.int64)
        la = tl.load(lens_ptr + r).to(tl.int64)
        keep = _is_protected(p, la, SINK, RECENT)
        ring = tl.where(p < SINK, p, _ring_index(p, SINK, RW))  # RW = max(recent, 1)
        ring = tl.where(keep, ring, 0)  # a position not kept touches no slot (its stores are masked)
        ev = p - RECENT  # the position leaving the ring, in the same ring slot
        ev_ok = (ev >= SINK) & (RECENT > 0)
        j = tl.where(ev_ok, ev % U, 0)  # ev >= 0 where used: C's % is the floor mod there
        base = r * H + h
        _side_put(kr, k8_ptr, k8s_ptr, kst_ptr, ksts_ptr, base, ring, j, keep, ev_ok, D, C, U, RECIP, INV127)
        _side_put(v, v8_ptr, v8s_ptr, vst_ptr, vsts_ptr, base, ring, j, keep, ev_ok, D, C, U, RECIP, INV127)


@dataclasses.dataclass
class SideWrite:
    """kv4rl's per-sequence side buffer of one layer (:class:`kvlib.kernels.int4.decode.SideBuffer`'s layout)
    and a decode step's addressing: ``rows, pos [N]`` (one token per row), ``lens_after [B]`` (lengths after
    the write). ``buf8[side] [B, H, C, d]`` int8, ``buf_scale[side] [B, H, C]`` fp16; the crop stash
    ``stash8[side] [B, H, U, d]``, ``stash_scale[side] [B, H, U]``."""

    rows: torch.Tensor
    pos: torch.Tensor
    lens_after: torch.Tensor
    sink: int
    recent: int
    buf8: tuple[torch.Tensor, torch.Tensor]
    buf_scale: tuple[torch.Tensor, torch.Tensor]
    stash8: tuple[torch.Tensor, torch.Tensor]
    stash_scale: tuple[torch.Tensor, torch.Tensor]


def _check_pages(name: str, pages, n_heads: int, d: int, device: torch.device) -> None:
    if not isinstance(pages, (tuple, list)) or len(pages) != 3:
        raise TypeError(f"{name} must be a (codes, scale, offset) tuple")
    codes, scale, off = pages
    check_tensor(f"{name}[0] (codes)", codes, ndim=3, dtype=torch.uint8)
    if tuple(codes.shape[1:]) != (n_heads, d // 2):
        raise ValueError(f"{name}[0] (codes) must have shape [n_slots, {n_heads}, {d // 2}], got {tuple(codes.shape)}")
    for i, t in ((1, scale), (2, off)):
        check_tensor(f"{name}[{i}]", t, ndim=2, dtype=torch.float16)
        if tuple(t.shape) != (codes.shape[0], n_heads):
            raise ValueError(f"{name}[{i}] must have shape [{codes.shape[0]}, {n_heads}], got {tuple(t.shape)}")
    for i, t in enumerate(pages):
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous (the kernel addresses slot * H + h)")
        if t.device != device:
            raise ValueError(f"{name}[{i}] must be on {device}, got {t.device}")


def _check_side(side: SideWrite, n: int, n_heads: int, d: int, device: torch.device) -> None:
    if not isinstance(side, SideWrite):
        raise TypeError(f"side must be a SideWrite, got {type(side).__name__}")
    for name in ("rows", "pos"):
        t = getattr(side, name)
        check_tensor(f"side.{name}", t, ndim=1, floating=False)
        if t.shape[0] != n:
            raise ValueError(f"side.{name} must have length N={n}, got {t.shape[0]}")
    check_tensor("side.lens_after", side.lens_after, ndim=1, floating=False)
    for name in ("sink", "recent"):
        val = getattr(side, name)
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ValueError(f"side.{name} must be a non-negative int, got {val!r}")
    b = side.lens_after.shape[0]
    cap = side.sink + side.recent
    u = side.stash8[0].shape[2] if side.stash8[0].ndim == 4 else -1
    for grp, shape, dt in (("buf8", (b, n_heads, cap, d), torch.int8), ("buf_scale", (b, n_heads, cap), torch.float16),
                           ("stash8", (b, n_heads, u, d), torch.int8), ("stash_scale", (b, n_heads, u), torch.float16)):
        for s, t in enumerate(getattr(side, grp)):
            check_tensor(f"side.{grp}[{s}]", t, dtype=dt)
            if tuple(t.shape) != shape:
                raise ValueError(f"side.{grp}[{s}] must have shape {list(shape)}, got {tuple(t.shape)}")
            if not t.is_contiguous() or t.device != device:
                raise ValueError(f"side.{grp}[{s}] must be contiguous and on {device}")
    if u < 1:
        raise ValueError(f"side.stash8: the crop stash needs at least one entry, got {u}")
    for name in ("rows", "pos", "lens_after"):
        if getattr(side, name).device != device:
            raise ValueError(f"side.{name} must be on {device}")


def interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_write_int4_kernel, InterpretedFunction)


def write_int4(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pages, v_pages, *,
               side: SideWrite | None = None, validate: bool = False) -> None:
    """Write ``k, v [N, H, d]`` (float) at ``slots [N]`` into one layer's kv4 pages in one launch.

    ``k_pages``, ``v_pages``: ``(codes uint8 [n_slots, H, d//2], scale fp16 [n_slots, H], offset fp16
    [n_slots, H])`` (a layer of :class:`kvlib.backends.int4.Int4Backend`, slot = block * block_size + offset).
    ``side``: kv4rl's side buffer and the step's rows/positions (one token per row; see :class:`SideWrite`).
    Shape and dtype checks never touch the device; ``validate=True`` adds the ones that read it back (slot
    range, distinct slots), for tests and CPU callers. ``d`` must be a power of two >= 2.
    """
    check_tensor("k", k, ndim=3, floating=True)
    check_tensor("v", v, ndim=3, floating=True)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    n, h, d = k.shape
    if d < 2 or d > 512 or d & (d - 1):
        raise ValueError(f"k: head_dim must be a power of two in [2, 512] for the fused kv4 write, got {d}")
    check_tensor("slots", slots, ndim=1, floating=False)
    if slots.shape[0] != n:
        raise ValueError(f"slots must have length N={n} (one slot per token), got {slots.shape[0]}")
    dev = k.device
    if v.device != dev or slots.device != dev:
        raise ValueError(f"k, v and slots must be on one device, got {k.device}, {v.device}, {slots.device}")
    _check_pages("k_pages", k_pages, h, d, dev)
    _check_pages("v_pages", v_pages, h, d, dev)
    if k_pages[0].shape[0] != v_pages[0].shape[0]:
        raise ValueError("k_pages and v_pages must have the same number of slots")
    if side is not None:
        _check_side(side, n, h, d, dev)
    if not dev.type == "cuda" and not interpreting():
        raise RuntimeError("write_int4 on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
    if validate and n:
        if int(slots.min()) < 0 or int(slots.max()) >= k_pages[0].shape[0]:
            raise ValueError(f"slots must lie in [0, n_slots={k_pages[0].shape[0]})")
        if torch.unique(slots).numel() != n:
            raise ValueError("slots must be distinct within one write (two tokens cannot share a slot)")
        if side is not None and torch.unique(side.rows).numel() != n:
            raise ValueError("side.rows must be distinct (the side-buffer write takes one token per row)")
    if n == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if side is None:
        z = slots  # unused pointer arguments (SIDE=False compiles their loads away)
        sargs = (z,) * 11
        sink = recent = 0
        cap = u = 1
    else:
        sargs = (side.rows, side.pos, side.lens_after, side.buf8[0], side.buf_scale[0], side.buf8[1],
                 side.buf_scale[1], side.stash8[0], side.stash_scale[0], side.stash8[1], side.stash_scale[1])
        sink, recent = side.sink, side.recent
        cap, u = sink + recent, side.stash8[0].shape[2]
    _write_int4_kernel[(n, h)](
        k, v, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_pages, *v_pages, *sargs,
        H=h, D=d, HSCALE=float(np.float32(1.0 / math.sqrt(d))),
        RECIP=dev.type == "cuda", INV15=recip32(15.0), INV127=recip32(127.0),
        SIDE=side is not None, SINK=sink, RECENT=recent, RW=max(recent, 1), C=max(cap, 1), U=u, num_warps=1,
        enable_fp_fusion=False,  # no fma: the rotated key's `* 1/sqrt(d)` must round before `- m`, as in torch
    )
