"""Philox4x32-10 and the WitCert dither as Triton device functions (twin of :mod:`kvlib.core.philox`).

The ONE Triton-side place where the dither counter is built and where a word becomes ``xi``; the
write kernel (:mod:`kvlib.kernels.int8.write`) and the read-side decode kernel import these.

Arithmetic is uint32 with ``tl.umulhi`` and wrapping ``*``/``+``; every constant is materialised
as a uint32 tensor first, so no operand is silently promoted to int64 (the divergence the paper
hit "at round two"). Bit identity with the int64 torch reference and with Triton's own
``tl.philox`` is tested in ``tests/test_philox.py``. Triton's ``tl.philox(seed, c0, c1, c2, c3)``
with 32-bit counters is exactly Random123 philox4x32 with key ``(seed & 0xFFFFFFFF, seed >> 32)``
(same round function, key bumped between rounds), so the cross-check needs no adaptation.

Both dither layouts of :mod:`kvlib.core.philox` are here: :func:`dither_tile` (``"w24"``, the paper's,
one 24-bit dither per word) and :func:`dither_tile_h10` (``"h10"``, one 10-bit dither per 16-bit
half word, eight per Philox call). A kernel picks one with a constexpr branch (a string default on
a ``constexpr`` parameter of a device function does not compile on the GPU with triton 3.6, so the
two are separate functions rather than one with ``LAYOUT="w24"``). Each takes ``GEN``/``N_ROUNDS``
(:func:`generator_constexprs`) for a generator other than Philox4x32-10 (issue 28; the default path is unchanged).
"""

from __future__ import annotations

import triton
import triton.language as tl

PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)


@triton.jit
def _scalar(v):
    """Make a scalar argument a tensor: Triton passes an int argument equal to 1 as a Python int."""
    return v + tl.zeros((), tl.int64)


#: one ``mul.wide.u32`` per Philox product, by the round's multiplier (0: ``PHILOX_M0``, 1: ``PHILOX_M1``)
_MULHILO_ASM: tl.constexpr = tl.constexpr((
    "{ .reg .b64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }",
    "{ .reg .b64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }",
))


@triton.jit
def _mulhilo(a, M: tl.constexpr):
    """``(hi, lo)`` of ``a`` times multiplier ``M`` of Philox (uint32) from one ``mul.wide.u32`` (one IMAD.WIDE on
    sm_90)."""
    return tl.inline_asm_elementwise(_MULHILO_ASM[M], "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32), is_pure=True,
                                     pack=1)


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1, N_ROUNDS: tl.constexpr = 10, WIDE: tl.constexpr = False):
    """Random123 philox4x32-N on uint32 blocks (counter c0..c3, key k0, k1); returns 4 words.

    ``WIDE`` (GPU only: inline PTX) takes each round's two 32x32 products from one ``mul.wide.u32`` each:
    ptxas turns ``umulhi`` and ``*`` of the same operands into two instructions, the wide form into one,
    which matters where Philox is a quarter of a kernel's instructions."""
    # blocks or 0-d tensors (pass scalar kernel arguments through _scalar first)
    c0 = c0.to(tl.uint32)
    c1 = c1.to(tl.uint32)
    c2 = c2.to(tl.uint32)
    c3 = c3.to(tl.uint32)
    k0 = k0.to(tl.uint32)
    k1 = k1.to(tl.uint32)
    m0 = tl.full((), PHILOX_M0, tl.uint32)
    m1 = tl.full((), PHILOX_M1, tl.uint32)
    w0 = tl.full((), PHILOX_W0, tl.uint32)
    w1 = tl.full((), PHILOX_W1, tl.uint32)
    for r in tl.static_range(N_ROUNDS):
        if r > 0:
            k0 = k0 + w0
            k1 = k1 + w1
        if WIDE:
            hi0, lo0 = _mulhilo(c0, 0)
            hi1, lo1 = _mulhilo(c2, 1)
            c0 = hi1 ^ c1 ^ k0
            c2 = hi0 ^ c3 ^ k1
            c1 = lo1
            c3 = lo0
        else:  # (the order the GPU results were measured with)
            _c0 = c0
            _c2 = c2
            c0 = tl.umulhi(m1, _c2) ^ c1 ^ k0
            c2 = tl.umulhi(m0, _c0) ^ c3 ^ k1
            c1 = m1 * _c2
            c3 = m0 * _c0
    return c0, c1, c2, c3


@triton.jit
def _rotl(x, R: tl.constexpr):
    return (x << R) | (x >> (32 - R))


@triton.jit
def _tf_mix(a, b, R: tl.constexpr):
    """One Threefry MIX: ``a += b; b = rotl(b, R) ^ a``."""
    a = a + b
    return a, _rotl(b, R) ^ a


@triton.jit
def _tf_round(x0, x1, x2, x3, RND: tl.constexpr):
    """Threefry4x32 round ``RND`` (rotation constants R_32x4 of Random123's threefry.h, ``RND mod 8``): even rounds mix
    (0, 1) and (2, 3), odd rounds (0, 3) and (2, 1)."""
    RA: tl.constexpr = (10, 11, 13, 23, 6, 17, 25, 18)[RND % 8]
    RB: tl.constexpr = (26, 21, 27, 5, 20, 11, 10, 20)[RND % 8]
    if RND % 2 == 0:
        x0, x1 = _tf_mix(x0, x1, RA)
        x2, x3 = _tf_mix(x2, x3, RB)
    else:
        x0, x3 = _tf_mix(x0, x3, RA)
        x2, x1 = _tf_mix(x2, x1, RB)
    return x0, x1, x2, x3


@triton.jit
def _tf_inject(x0, x1, x2, x3, ks0, ks1, ks2, ks3, ks4, S: tl.constexpr):
    """Threefry key injection ``S``: word ``i`` gets ``ks[(S + i) mod 5]``, word 3 also ``S``."""
    ks = (ks0, ks1, ks2, ks3, ks4)
    return x0 + ks[S % 5], x1 + ks[(S + 1) % 5], x2 + ks[(S + 2) % 5], x3 + ks[(S + 3) % 5] + S


@triton.jit
def threefry4x32(c0, c1, c2, c3, k0, k1, k2, k3, N_ROUNDS: tl.constexpr = 20):
    """Random123 threefry4x32-N on uint32 blocks (counter c0..c3, key k0..k3); returns 4 words. Add, rotate,
    xor only; the rotation table and key schedule of :func:`kvlib.core.philox.threefry4x32`."""
    x0 = c0.to(tl.uint32)
    x1 = c1.to(tl.uint32)
    x2 = c2.to(tl.uint32)
    x3 = c3.to(tl.uint32)
    ks0 = k0.to(tl.uint32)
    ks1 = k1.to(tl.uint32)
    ks2 = k2.to(tl.uint32)
    ks3 = k3.to(tl.uint32)
    ks4 = ks0 ^ ks1 ^ ks2 ^ ks3 ^ tl.full((), 0x1BD11BDA, tl.uint32)
    x0 = x0 + ks0
    x1 = x1 + ks1
    x2 = x2 + ks2
    x3 = x3 + ks3
    for r in tl.static_range(N_ROUNDS):
        x0, x1, x2, x3 = _tf_round(x0, x1, x2, x3, r)
        if r % 4 == 3:  # key injection s = (r + 1) / 4: word i gets ks[(s + i) % 5], word 3 also s
            x0, x1, x2, x3 = _tf_inject(x0, x1, x2, x3, ks0, ks1, ks2, ks3, ks4, (r + 1) // 4)
    return x0, x1, x2, x3


#: generator families as kernel constexprs (``GEN``): the names of :data:`kvlib.core.philox.GENERATORS`
GEN_PHILOX: tl.constexpr = tl.constexpr(0)
GEN_THREEFRY: tl.constexpr = tl.constexpr(1)
GEN_NONE: tl.constexpr = tl.constexpr(2)  # timing only: the counter words themselves (no generator)


def generator_constexprs(generator: str) -> dict[str, int]:
    """``{"GEN": family code, "N_ROUNDS": rounds}`` of a generator name (:data:`kvlib.core.philox.GENERATORS`)
    for a kernel launch; ``"none"`` is the timing-only no-generator code (a wrong dither, never a result)."""
    from kvlib.core.philox import GENERATORS, check_generator

    if generator == "none":
        return {"GEN": 2, "N_ROUNDS": 0}
    family, rounds = GENERATORS[check_generator(generator)]
    return {"GEN": 0 if family == "philox" else 1, "N_ROUNDS": rounds}


@triton.jit
def counter_words(c0, c1, c2, c3, k0, k1, GEN: tl.constexpr = 0, N_ROUNDS: tl.constexpr = 10,
                  WIDE: tl.constexpr = False):
    """The four words of the dither's generator (``GEN``: 0 Philox4x32, 1 Threefry4x32 with key
    ``(k0, k1, 0, 0)``, 2 none: the counter itself, timing only) at ``N_ROUNDS`` rounds."""
    if GEN == 0:
        w0, w1, w2, w3 = philox4x32(c0, c1, c2, c3, k0, k1, N_ROUNDS, WIDE)
    elif GEN == 1:
        z = tl.zeros((), tl.uint32)
        w0, w1, w2, w3 = threefry4x32(c0, c1, c2, c3, k0, k1, z, z, N_ROUNDS)
    else:
        w0 = c0.to(tl.uint32)
        w1 = c1.to(tl.uint32)
        w2 = c2.to(tl.uint32)
        w3 = c3.to(tl.uint32)
    return w0, w1, w2, w3


@triton.jit
def word_to_xi(w):
    """``xi = (w >> 8) 2^-24 + 2^-25 - 1/2`` in float32, exact (odd integer times 2^-25)."""
    n = 2 * (w.to(tl.uint32) >> 8).to(tl.int32) + (1 - (1 << 24))
    return n.to(tl.float32) * 2.9802322387695312e-08  # 2^-25


@triton.jit
def dither_words(slot, grp, kv_head, layer, side, k0, k1, GEN: tl.constexpr = 0, N_ROUNDS: tl.constexpr = 10):
    """The four words of counter ``(slot, grp, kv_head, (layer << 1) | side)``: Philox4x32-10, or the generator
    ``GEN``/``N_ROUNDS`` (:func:`generator_constexprs` of a :data:`kvlib.core.philox.GENERATORS` name)."""
    c3 = (_scalar(layer).to(tl.uint32) << 1) | _scalar(side).to(tl.uint32)
    if GEN == 0 and N_ROUNDS == 10:  # the validated path, unchanged
        w0, w1, w2, w3 = philox4x32(slot, grp, _scalar(kv_head), c3, _scalar(k0), _scalar(k1))
    else:
        w0, w1, w2, w3 = counter_words(slot, grp, _scalar(kv_head) + tl.zeros_like(slot), c3 + tl.zeros_like(slot),
                                       _scalar(k0), _scalar(k1), GEN, N_ROUNDS)
    return w0, w1, w2, w3


@triton.jit
def half_to_xi(v):
    """h10 dither of a 16-bit half ``v``: ``((v >> 6) + 1/2) 2^-10 - 1/2`` in float32, exact."""
    n = 2 * ((v.to(tl.uint32) >> 6) & 0x3FF).to(tl.int32) + (1 - (1 << 10))
    return n.to(tl.float32) * 0.00048828125  # 2^-11


@triton.jit
def _word_blocks(b0, b1, b2, b3, BS: tl.constexpr, D: tl.constexpr):
    """Word ``i``'s dithers ``b_i [BS, D/4]`` as the contiguous channel block ``[i D/4, (i+1) D/4)`` of ``[BS, D]``
    (the h10 and h8 layouts)."""
    # join(join(b0, b2), join(b1, b3))[s, k, a, b] = b_{2a + b}[s, k]; move k last: channel (2a + b) D/4 + k
    xi = tl.permute(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (0, 2, 3, 1))
    return tl.reshape(xi, (BS, D))


@triton.jit
def dither_tile_h10(slot, kv_head, layer, side, k0, k1, D: tl.constexpr, GEN: tl.constexpr = 0,
                    N_ROUNDS: tl.constexpr = 10):
    """h10 dither float32 ``[BLOCK_S, D]``: one Philox call per eight channels (``D // 8`` calls per
    slot, each computed once), word ``i`` half ``h`` of call ``j`` -> channel ``i (D/4) + 2j + h``
    (D % 8 == 0, D // 8 a power of 2).
    """
    BS: tl.constexpr = slot.shape[0]
    j = tl.arange(0, D // 8)
    s2 = slot[:, None].to(tl.uint32) + tl.zeros((1, D // 8), tl.uint32)
    j2 = j[None, :].to(tl.uint32) + tl.zeros_like(s2)
    w0, w1, w2, w3 = dither_words(s2, j2, kv_head, layer, side, k0, k1, GEN, N_ROUNDS)
    # word i -> its contiguous block of D/4 channels: join(lo, hi)[s, j, h] is channel 2j + h
    b0 = tl.reshape(tl.join(half_to_xi(w0 & 0xFFFF), half_to_xi(w0 >> 16)), (BS, D // 4))
    b1 = tl.reshape(tl.join(half_to_xi(w1 & 0xFFFF), half_to_xi(w1 >> 16)), (BS, D // 4))
    b2 = tl.reshape(tl.join(half_to_xi(w2 & 0xFFFF), half_to_xi(w2 >> 16)), (BS, D // 4))
    b3 = tl.reshape(tl.join(half_to_xi(w3 & 0xFFFF), half_to_xi(w3 >> 16)), (BS, D // 4))
    return _word_blocks(b0, b1, b2, b3, BS, D)


@triton.jit
def byte_to_xi(b):
    """h8 dither of a byte ``b``: ``(b + 1/2) 2^-8 - 1/2`` in float32, exact."""
    n = 2 * (b.to(tl.uint32) & 0xFF).to(tl.int32) + (1 - (1 << 8))
    return n.to(tl.float32) * 0.001953125  # 2^-9


@triton.jit
def _bytes_xi(w, BS: tl.constexpr, C: tl.constexpr):
    """``[BS, C]`` words -> ``[BS, 4 C]`` h8 dithers, element ``4j + k`` from byte ``k`` of word ``j``."""
    lo = tl.join(byte_to_xi(w), byte_to_xi(w >> 8))  # [BS, C, 2]: bytes 0, 1
    hi = tl.join(byte_to_xi(w >> 16), byte_to_xi(w >> 24))
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BS, 4 * C))  # [s, j, pair, k] -> 4j + 2 pair + k


@triton.jit
def dither_tile_h8(slot, kv_head, layer, side, k0, k1, D: tl.constexpr, GEN: tl.constexpr = 0,
                   N_ROUNDS: tl.constexpr = 10):
    """h8 dither float32 ``[BLOCK_S, D]``: one Philox call per sixteen channels (``D // 16`` calls per slot),
    word ``i`` byte ``k`` of call ``j`` -> channel ``i (D/4) + 4j + k`` (D % 16 == 0, D // 16 a power of 2)."""
    BS: tl.constexpr = slot.shape[0]
    j = tl.arange(0, D // 16)
    s2 = slot[:, None].to(tl.uint32) + tl.zeros((1, D // 16), tl.uint32)
    j2 = j[None, :].to(tl.uint32) + tl.zeros_like(s2)
    w0, w1, w2, w3 = dither_words(s2, j2, kv_head, layer, side, k0, k1, GEN, N_ROUNDS)
    b0 = _bytes_xi(w0, BS, D // 16)
    b1 = _bytes_xi(w1, BS, D // 16)
    b2 = _bytes_xi(w2, BS, D // 16)
    b3 = _bytes_xi(w3, BS, D // 16)
    return _word_blocks(b0, b1, b2, b3, BS, D)


@triton.jit
def dither_tile(slot, kv_head, layer, side, k0, k1, D: tl.constexpr, GEN: tl.constexpr = 0,
                N_ROUNDS: tl.constexpr = 10):
    """Dither float32 ``[BLOCK_S, D]`` for a block of slots ``[BLOCK_S]`` (layout ``w24``): one Philox
    call per four channels, its words spread over channels ``4g .. 4g+3`` (D % 4 == 0, D // 4 a power of 2).
    """
    grp = tl.arange(0, D // 4)
    s2 = slot[:, None].to(tl.uint32) + tl.zeros((1, D // 4), tl.uint32)
    g2 = grp[None, :].to(tl.uint32) + tl.zeros_like(s2)
    w0, w1, w2, w3 = dither_words(s2, g2, kv_head, layer, side, k0, k1, GEN, N_ROUNDS)
    # join(join(w0, w2), join(w1, w3))[s, g, i, j] = w_{2i + j}: channel 4g + 2i + j
    w = tl.join(tl.join(w0, w2), tl.join(w1, w3))
    w = tl.reshape(w, (slot.shape[0], D))
    return word_to_xi(w)
