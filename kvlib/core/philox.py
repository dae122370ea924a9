"""Philox4x32-10 (Random123) in plain torch, and the WitCert dither built on it.

This module is the ONE place (torch side) where the dither counter is built and where a Philox
word becomes a dither value; the Triton twin is :mod:`kvlib.kernels.tl.philox`. Both the write
path and the read path import these functions, so the stream regenerated at read time is the one
used at write time by construction.

Arithmetic is on int64 tensors holding uint32 values with explicit ``& 0xFFFFFFFF`` masking. A
32x32 product does not fit in int64, so :func:`mulhilo32` splits one factor into 16-bit halves
(each partial product < 2^48) and recombines with carries (the paper's "int64 with explicit
masking", which removes any doubt about unsigned-multiply semantics).

Dither contract (see :mod:`kvlib.storage.paged` for the whole storage contract): for (layer, kv_head,
slot, channel c, side) the counter is ``(slot, c // 4, kv_head, (layer << 1) | side)``, the key is
``(seed & 0xFFFFFFFF, seed >> 32)``, the word is ``philox(counter, key)[c % 4]`` and
``xi = (w >> 8) * 2^-24 + 2^-25 - 1/2``, exact in float32 (computed as the odd integer
``2 (w >> 8) + 1 - 2^24`` times ``2^-25``; both factors are exact in fp32). That is layout
``"w24"`` (the paper's: four dithers per Philox call).

Layout ``"h10"`` (eight dithers per call, the spec's "16-bit halves" made fp16-exact): the counter
is ``(slot, j, kv_head, (layer << 1) | side)`` with ``j < d // 8``; word ``i`` half ``h`` (low half
first) serves channel ``c = i (d/4) + 2j + h``; of the 16-bit half ``v`` the top ten bits give
``xi = ((v >> 6) + 1/2) 2^-10 - 1/2``. So word ``i`` covers the contiguous channels
``[i d/4, (i+1) d/4)`` (one scale group of 32 at ``d = 128``) and ``1 + (v >> 6) 2^-10`` is an
exact fp16 number a kernel builds with two integer instructions per two channels. The dither is
uniform on a 1024-point grid: the subtractive-dither error is then uniform on a shifted 1024-point
grid, i.e. a symmetric discrete uniform (strictly sub-Gaussian, proxy below ``s^2/12``) plus a mean
of at most ``2^-11 s`` (:data:`DITHER_BIAS`), which the radius carries.

Layout ``"h8"`` (sixteen dithers per call: half the Philox work of ``"h10"``): the counter is
``(slot, j, kv_head, (layer << 1) | side)`` with ``j < d // 16``; word ``i`` byte ``k`` (low byte first) serves
channel ``c = i (d/4) + 4j + k`` and ``xi = (b + 1/2) 2^-8 - 1/2``. ``4 + b 2^-8`` is an exact fp16 number whose
low mantissa byte is ``b``, so a kernel builds two channels' ``-(4 + b 2^-8)`` with one byte permute. The grid
has 256 points: the error is a symmetric discrete uniform (proxy below ``s^2/12``) plus a mean of at most
``2^-9 s``, which the radius carries (about 1% more radius than h10 at ``d = 128``).
"""

from __future__ import annotations

import torch

from kvlib.core.checks import check_tensor

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53  # multiplier applied to counter word 0
PHILOX_M1 = 0xCD9E8D57  # multiplier applied to counter word 2
PHILOX_W0 = 0x9E3779B9  # key bump (golden ratio)
PHILOX_W1 = 0xBB67AE85  # key bump (sqrt(3) - 1)
XI_BITS = 24  # the dither uses the top 24 bits of a word
#: dither layouts: "w24" (one 24-bit dither per word, the paper's), "h10" (one 10-bit dither per half word) and
#: "h8" (one 8-bit dither per byte)
DITHER_LAYOUTS = ("w24", "h10", "h8")
#: largest mean of the subtractive-dither error per channel, in units of the scale (half the grid step)
DITHER_BIAS = {"w24": 2.0**-25, "h10": 2.0**-11, "h8": 2.0**-9}
#: channels one Philox call serves in each layout (h10 and h8 need ``d`` a multiple of it)
CALL_CHANNELS = {"w24": 4, "h10": 8, "h8": 16}


#: counter-based generators a dither may draw its words from: name -> (family, rounds). Every one maps the same
#: 128-bit counter ``(slot, j, kv_head, (layer << 1) | side)`` and the 64-bit seed to four 32-bit words, so a
#: layout's channel map is the generator's. Philox4x32-10 (the paper's) is the default; the others are study
#: options (issue 28: dev/results/philox_*.json says which passed the checks that make one an option). Random123's
#: own notes (include/Random123/philox.h, threefry.h): Philox4x32 has no known statistical flaw at 8 rounds or more
#: ("a cloud remains over Philox4x32 with 7 rounds": p ~ 1e-7 in very long SimpPoker tests), Threefry4x32 none at 12
#: or more; their defaults (10, 20) add a safety margin.
GENERATORS = {
    "philox4x32-10": ("philox", 10),
    "philox4x32-8": ("philox", 8),
    "philox4x32-7": ("philox", 7),
    "philox4x32-6": ("philox", 6),
    "threefry4x32-13": ("threefry", 13),
    "threefry4x32-20": ("threefry", 20),
}
DEFAULT_GENERATOR = "philox4x32-10"
#: the generators a stored pool may use (issue 28's rule: Random123 known answers or Triton = torch equality, the
#: certificate sound on the chapter's key laws, the stream battery passed: dev/results/philox_study.json); the rest
#: of :data:`GENERATORS` are study points (timing probes), each with the reason it is not an option
GENERATOR_OPTIONS = ("philox4x32-10", "philox4x32-8", "threefry4x32-13", "threefry4x32-20")
NOT_OPTIONS = {
    "philox4x32-7": "passes the three checks here, but Random123 (philox.h): 'a cloud remains over Philox4x32 with 7 "
                    "rounds' (p ~ 1e-7 in very long SimpPoker tests); no known flaw at 8 or more",
    "philox4x32-6": "fails the stream battery: avalanche of the call index and layer/side counter words "
                    "(p ~ 1e-231, dev/results/philox_study.json)",
}
#: Threefry4x32 rotation constants (Random123 threefry.h, R_32x4_r_0 / R_32x4_r_1 for r = 0..7)
THREEFRY_R32X4 = ((10, 26), (11, 21), (13, 27), (23, 5), (6, 20), (17, 11), (25, 10), (18, 20))
THREEFRY_PARITY32 = 0x1BD11BDA  # SKEIN_KS_PARITY32


def check_generator(generator: object, *, options_only: bool = False) -> str:
    """The generator name, or a ValueError naming ``generator``; ``options_only``: one of
    :data:`GENERATOR_OPTIONS` (what a stored pool may use), the error saying why a study point is not."""
    if generator not in GENERATORS:
        raise ValueError(f"generator must be one of {tuple(GENERATORS)}, got {generator!r}")
    if options_only and generator not in GENERATOR_OPTIONS:
        raise ValueError(f"generator {generator!r} is a study point, not an option ({NOT_OPTIONS[generator]}); "
                         f"options: {GENERATOR_OPTIONS}")
    return generator  # type: ignore[return-value]


def check_layout(layout: object) -> str:
    """The dither layout name, or a ValueError naming ``dither_layout``."""
    if layout not in DITHER_LAYOUTS:
        raise ValueError(f"dither_layout must be one of {DITHER_LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def check_layout_d(layout: object, d: object) -> str:
    """:func:`check_layout`, and ``d`` a multiple of the channels one call serves (h10: 8, h8: 16), or a
    ValueError naming both."""
    layout = check_layout(layout)
    per = CALL_CHANNELS[layout]
    if layout != "w24" and (not isinstance(d, int) or d < per or d % per):
        raise ValueError(f"dither_layout={layout!r} needs d a multiple of {per}, got d={d!r}")
    return layout


def mulhilo32(a: torch.Tensor | int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product of uint32 values held in int64 tensors."""
    b_lo = b & 0xFFFF
    b_hi = (b >> 16) & 0xFFFF
    p_lo = a * b_lo  # < 2^48
    p_hi = a * b_hi  # < 2^48, weight 2^16
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49: low 48 bits of the product plus the carry
    lo = t & MASK32
    hi = ((p_hi >> 16) + (t >> 32)) & MASK32
    return hi, lo


def _round(c0, c1, c2, c3, k0, k1):
    hi0, lo0 = mulhilo32(PHILOX_M0, c0)
    hi1, lo1 = mulhilo32(PHILOX_M1, c2)
    return hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Random123 Philox4x32 with ``rounds`` rounds: int64 ``[..., 4]`` counter, ``[..., 2]`` key.

    Values must be uint32 held in int64. Returns int64 ``[..., 4]`` of uint32 values; the two
    leading shapes broadcast against each other.
    """
    _check_blocks(counter, key, 2, rounds, "Philox4x32")
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for r in range(rounds):
        if r:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)


def _check_u32_tensor(name: str, t: torch.Tensor) -> None:
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > MASK32):
        raise ValueError(f"{name} must hold uint32 values in [0, 2^32), got range [{int(t.min())}, {int(t.max())}]")


def _check_blocks(counter: torch.Tensor, key: torch.Tensor, key_words: int, rounds: int, generator: str) -> None:
    """The arguments every counter-based generator here takes: int64 tensors of uint32 values, ``counter [..., 4]``,
    ``key [..., key_words]``, ``rounds`` a positive int (ValueError/TypeError naming the argument)."""
    check_tensor("counter", counter, dtype=torch.int64)
    check_tensor("key", key, dtype=torch.int64)
    if counter.shape[-1:] != (4,):
        raise ValueError(f"counter must have last dim 4, got shape {tuple(counter.shape)}")
    if key.shape[-1:] != (key_words,):
        raise ValueError(f"key must have last dim {key_words} ({generator}), got shape {tuple(key.shape)}")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    _check_u32_tensor("counter", counter)
    _check_u32_tensor("key", key)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK32


def threefry4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = 20) -> torch.Tensor:
    """Random123 Threefry4x32 with ``rounds`` rounds: int64 ``[..., 4]`` counter and ``[..., 4]`` key of uint32
    values; returns int64 ``[..., 4]`` (the two leading shapes broadcast). Add, rotate, xor only (no multiply):
    a key injection after every fourth round (``ks[4] = parity ^ k0 ^ k1 ^ k2 ^ k3``, word 3 also gets the
    injection's index), as in Random123's threefry.h."""
    _check_blocks(counter, key, 4, rounds, "Threefry4x32")
    k = list(key.unbind(-1))
    ks = k + [THREEFRY_PARITY32 ^ k[0] ^ k[1] ^ k[2] ^ k[3]]
    x = [(c + ks[i]) & MASK32 for i, c in enumerate(counter.unbind(-1))]
    for r in range(rounds):
        ra, rb = THREEFRY_R32X4[r % 8]
        if r % 2 == 0:  # mix (0, 1) and (2, 3)
            x[0] = (x[0] + x[1]) & MASK32
            x[1] = _rotl32(x[1], ra) ^ x[0]
            x[2] = (x[2] + x[3]) & MASK32
            x[3] = _rotl32(x[3], rb) ^ x[2]
        else:  # mix (0, 3) and (2, 1)
            x[0] = (x[0] + x[3]) & MASK32
            x[3] = _rotl32(x[3], ra) ^ x[0]
            x[2] = (x[2] + x[1]) & MASK32
            x[1] = _rotl32(x[1], rb) ^ x[2]
        if r % 4 == 3:  # key injection s = (r + 1) / 4
            s = (r + 1) // 4
            for i in range(4):
                x[i] = (x[i] + ks[(s + i) % 5] + (s if i == 3 else 0)) & MASK32
    return torch.stack(torch.broadcast_tensors(*x), dim=-1)


def generator_words(counter: torch.Tensor, key: torch.Tensor, generator: str = DEFAULT_GENERATOR) -> torch.Tensor:
    """The four words of ``generator`` (:data:`GENERATORS`) at int64 ``[..., 4]`` counters with the dither's
    64-bit key ``[..., 2]`` = ``(seed lo, seed hi)``; Threefry4x32 takes the 128-bit key ``(lo, hi, 0, 0)``."""
    family, rounds = GENERATORS[check_generator(generator)]
    if family == "philox":
        return philox4x32_10(counter, key, rounds=rounds)
    check_tensor("key", key, dtype=torch.int64)
    if key.shape[-1:] != (2,):
        raise ValueError(f"key must have last dim 2, got shape {tuple(key.shape)}")
    return threefry4x32(counter, torch.cat([key, torch.zeros_like(key)], dim=-1), rounds=rounds)


def seed_key(seed: int) -> tuple[int, int]:
    """Philox key ``(k0, k1)`` = (low, high) 32-bit halves of a 64-bit ``seed``."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must lie in [0, 2^64), got {seed}")
    return seed & MASK32, (seed >> 32) & MASK32


def _check_u32(name: str, v: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not 0 <= v <= MASK32:
        raise ValueError(f"{name} must lie in [0, 2^32), got {v}")
    return v


def dither_counter(
    slots: torch.Tensor, d: int, *, layer: int, kv_head: int, side: int = 0, layout: str = "w24"
) -> torch.Tensor:
    """Philox counters int64 ``[S, n, 4]`` = ``(slot, j, kv_head, (layer << 1) | side)``, ``j < n``.

    ``w24``: ``n = ceil(d/4)``, call ``j`` serves channels ``4j .. 4j+3``; ``h10``: ``n = d // 8``;
    ``h8``: ``n = d // 16`` (see the module docstring for their channel maps). The slot (not the
    sequence position) enters the counter so the stream survives paging and prefix sharing.
    """
    check_layout_d(layout, d)
    check_tensor("slots", slots, ndim=1, floating=False)
    if side not in (0, 1):
        raise ValueError(f"side must be 0 (keys) or 1 (values), got {side!r}")
    _check_u32("kv_head", kv_head)
    _check_u32("(layer << 1) | side", (_check_u32("layer", layer) << 1) | side)
    slots = slots.to(torch.int64)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) > MASK32):
        raise ValueError("slots must lie in [0, 2^32)")
    n4 = (d + 3) // 4 if layout == "w24" else d // CALL_CHANNELS[layout]
    grp = torch.arange(n4, dtype=torch.int64, device=slots.device)
    S = slots.shape[0]
    c0 = slots[:, None].expand(S, n4)
    c1 = grp[None, :].expand(S, n4)
    c2 = torch.full((S, n4), kv_head, dtype=torch.int64, device=slots.device)
    c3 = torch.full((S, n4), (layer << 1) | side, dtype=torch.int64, device=slots.device)
    return torch.stack([c0, c1, c2, c3], dim=-1)


def word_to_xi(w: torch.Tensor) -> torch.Tensor:
    """Dither ``xi = (w >> 8) 2^-24 + 2^-25 - 1/2`` in float32, exact, in [-1/2 + 2^-25, 1/2 - 2^-25]."""
    n = 2 * ((w.to(torch.int64) >> 8) & 0xFFFFFF) + 1 - (1 << XI_BITS)  # odd, |n| < 2^24: exact in fp32
    return n.to(torch.float32) * (2.0**-25)


def half_to_xi(v: torch.Tensor) -> torch.Tensor:
    """h10 dither of a 16-bit half ``v``: ``((v >> 6) + 1/2) 2^-10 - 1/2``, exact, in [-1/2 + 2^-11, 1/2 - 2^-11]."""
    n = 2 * ((v.to(torch.int64) >> 6) & 0x3FF) + 1 - (1 << 10)  # odd, |n| < 2^10
    return n.to(torch.float32) * (2.0**-11)


def byte_to_xi(b: torch.Tensor) -> torch.Tensor:
    """h8 dither of a byte ``b``: ``(b + 1/2) 2^-8 - 1/2``, exact, in [-1/2 + 2^-9, 1/2 - 2^-9]."""
    n = 2 * (b.to(torch.int64) & 0xFF) + 1 - (1 << 8)  # odd, |n| < 2^8
    return n.to(torch.float32) * (2.0**-9)


def h8_channel_map(d: int) -> torch.Tensor:
    """``[d // 16, 4, 4]`` int64: the channel served by call ``j``, word ``i``, byte ``k`` (h8 layout)."""
    j = torch.arange(d // 16)[:, None, None]
    i = torch.arange(4)[None, :, None]
    k = torch.arange(4)[None, None, :]
    return i * (d // 4) + 4 * j + k


def h10_channel_map(d: int) -> torch.Tensor:
    """``[d // 8, 4, 2]`` int64: the channel served by call ``j``, word ``i``, half ``h`` (h10 layout)."""
    j = torch.arange(d // 8)[:, None, None]
    i = torch.arange(4)[None, :, None]
    h = torch.arange(2)[None, None, :]
    return i * (d // 4) + 2 * j + h


def dither(
    slots: torch.Tensor, d: int, *, layer: int, kv_head: int, seed: int, side: int = 0, layout: str = "w24",
    generator: str = DEFAULT_GENERATOR,
) -> torch.Tensor:
    """The dither float32 ``[S, d]`` for one (layer, kv_head, side) at the given slots; ``generator`` names the
    counter-based generator of its words (:data:`GENERATORS`; the default is the paper's Philox4x32-10)."""
    ctr = dither_counter(slots, d, layer=layer, kv_head=kv_head, side=side, layout=layout)
    k0, k1 = seed_key(seed)
    key = torch.tensor([k0, k1], dtype=torch.int64, device=ctr.device)
    words = generator_words(ctr, key, generator)  # [S, n, 4]
    if layout == "w24":
        return word_to_xi(words.reshape(words.shape[0], -1)[:, :d])
    xi = torch.empty(words.shape[0], d, dtype=torch.float32, device=words.device)
    if layout == "h8":
        b = torch.stack([(words >> (8 * k)) & 0xFF for k in range(4)], dim=-1)  # [S, d/16, 4, 4]
        xi[:, h8_channel_map(d).reshape(-1).to(words.device)] = byte_to_xi(b.reshape(words.shape[0], -1))
        return xi
    halves = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], dim=-1)  # [S, d/8, 4, 2]
    xi[:, h10_channel_map(d).reshape(-1).to(words.device)] = half_to_xi(halves.reshape(words.shape[0], -1))
    return xi
