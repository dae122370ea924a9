"""The dither's counter-based generators as Gluon device functions (twin of :mod:`kvlib.kernels.tl.philox`).

:func:`counter_words` is what :mod:`kvlib.kernels.int8.gluon` calls for a generator other than its validated
Philox4x32-10 path: Philox4x32 at ``N_ROUNDS`` rounds (each product from one ``mul.wide.u32``, as the Gluon kernel's
own ``_philox``), Threefry4x32 with key ``(k0, k1, 0, 0)`` (add, rotate, xor), or ``GEN=2``: the counter words
themselves (timing only, a wrong dither). Same codes and arithmetic as the Triton twin, so the torch reference
:func:`kvlib.core.philox.generator_words` is the reference of both. Gluon has no interpreter: GPU only (the
sm_90 compile is checked offline, ``tests/test_philox_generators.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _mulhilo(a, M: gl.constexpr):
    if M == 0:
        return gl.inline_asm_elementwise(
            "{ .reg .b64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }",
            "=r,=r,r", [a], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }",
            "=r,=r,r", [a], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def philox4x32(c0, c1, c2, c3, k0, k1, N_ROUNDS: gl.constexpr):
    """Random123 philox4x32-N (uint32 tensors of one layout)."""
    for r in gl.static_range(N_ROUNDS):
        if r > 0:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        hi0, lo0 = _mulhilo(c0, 0)
        hi1, lo1 = _mulhilo(c2, 1)
        c0 = hi1 ^ c1 ^ k0
        c2 = hi0 ^ c3 ^ k1
        c1 = lo1
        c3 = lo0
    return c0, c1, c2, c3


@gluon.jit
def _rotl(x, R: gl.constexpr):
    return (x << R) | (x >> (32 - R))


@gluon.jit
def _tf_mix(a, b, R: gl.constexpr):
    """One Threefry MIX: ``a += b; b = rotl(b, R) ^ a``."""
    a = a + b
    return a, _rotl(b, R) ^ a


@gluon.jit
def _tf_round(x0, x1, x2, x3, RND: gl.constexpr):
    """Threefry4x32 round ``RND`` (rotation constants R_32x4 of Random123's threefry.h, ``RND mod 8``): even rounds mix
    (0, 1) and (2, 3), odd rounds (0, 3) and (2, 1)."""
    RA: gl.constexpr = (10, 11, 13, 23, 6, 17, 25, 18)[RND % 8]
    RB: gl.constexpr = (26, 21, 27, 5, 20, 11, 10, 20)[RND % 8]
    if RND % 2 == 0:
        x0, x1 = _tf_mix(x0, x1, RA)
        x2, x3 = _tf_mix(x2, x3, RB)
    else:
        x0, x3 = _tf_mix(x0, x3, RA)
        x2, x1 = _tf_mix(x2, x1, RB)
    return x0, x1, x2, x3


@gluon.jit
def _tf_inject(x0, x1, x2, x3, ks0, ks1, ks2, ks3, ks4, S: gl.constexpr):
    """Threefry key injection ``S``: word ``i`` gets ``ks[(S + i) mod 5]``, word 3 also ``S``."""
    ks = (ks0, ks1, ks2, ks3, ks4)
    return x0 + ks[S % 5], x1 + ks[(S + 1) % 5], x2 + ks[(S + 2) % 5], x3 + ks[(S + 3) % 5] + S


@gluon.jit
def threefry4x32(x0, x1, x2, x3, k0, k1, N_ROUNDS: gl.constexpr):
    """Random123 threefry4x32-N with key ``(k0, k1, 0, 0)`` (uint32 tensors of one layout; k0, k1 scalars)."""
    ks0 = k0
    ks1 = k1
    ks4 = k0 ^ k1 ^ 0x1BD11BDA
    x0 = x0 + ks0
    x1 = x1 + ks1
    for r in gl.static_range(N_ROUNDS):
        x0, x1, x2, x3 = _tf_round(x0, x1, x2, x3, r)
        if r % 4 == 3:  # key injection s = (r + 1) / 4: word i gets ks[(s + i) % 5] (ks2 = ks3 = 0), word 3 also s
            x0, x1, x2, x3 = _tf_inject(x0, x1, x2, x3, ks0, ks1, 0, 0, ks4, (r + 1) // 4)
    return x0, x1, x2, x3


@gluon.jit
def counter_words(c0, c1, c2, c3, k0, k1, GEN: gl.constexpr, N_ROUNDS: gl.constexpr):
    """``GEN`` 0: Philox4x32-``N_ROUNDS``; 1: Threefry4x32-``N_ROUNDS``; 2: the counter (timing only)."""
    if GEN == 0:
        w0, w1, w2, w3 = philox4x32(c0, c1, c2, c3, k0, k1, N_ROUNDS)
    elif GEN == 1:
        w0, w1, w2, w3 = threefry4x32(c0, c1, c2, c3, k0, k1, N_ROUNDS)
    else:
        w0 = c0
        w1 = c1
        w2 = c2
        w3 = c3
    return w0, w1, w2, w3
