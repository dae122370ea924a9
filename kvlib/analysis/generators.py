"""Evidence for the dither's generator (issue 28): the certificate's soundness and the statistical quality of the
dither stream, for each counter-based generator of :data:`kvlib.core.philox.GENERATORS`.

Three checks make a generator other than Philox4x32-10 an option (the third and second here, the first in
``tests/test_philox_generators.py``: Random123 known answers, and Triton = torch at the same rounds):

* :func:`soundness` -- the certificate's violation rate ``P(TV > cert)`` and the failure rate of its concentration
  event (some ``|z_hat - z| > u``) on the chapter's key laws (Gaussian, heavy-tailed Student t, massive RoPE
  channels), keys written with the generator's dither, exact Clopper-Pearson 95% upper limits against ``delta``.
  The same trial loop as :func:`kvlib.certify.bound.certify_trials` (equal to it for Philox4x32-10, tested) with
  the generator as a parameter.
* :func:`stream_tests` -- uniformity and independence of the dither words at the dither contract's counters
  ``(slot, j, kv_head, (layer << 1) | side)``: chi-square of the h8 dither bytes, Kolmogorov-Smirnov of the words,
  channel-by-byte independence, serial correlations (adjacent slots, adjacent channels, words of one call, layers,
  sides), the avalanche of every low counter bit, and a birthday-spacings test. :func:`stream_verdict` applies
  the multiple-testing rule (Bonferroni over the battery at family level ``alpha``).

The stream tests see the words the kernels read, at the counters they use; they are a screen, not TestU01 (the
Random123 paper's BigCrush results are the statement about the generators themselves).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvlib.core.philox import (
    GENERATORS,
    check_generator,
    check_layout_d,
    dither,
    dither_counter,
    philox4x32_10,
    seed_key,
    threefry4x32,
)

#: the battery's family-level significance (Bonferroni-divided over the tests of one generator)
ALPHA = 0.01


def family_words(counter: torch.Tensor, key: torch.Tensor, family: str, rounds: int) -> torch.Tensor:
    """Four words of ``family`` (``"philox"``/``"threefry"``) at any round count (the named generators and the
    weak controls the battery must reject)."""
    if family == "philox":
        return philox4x32_10(counter, key, rounds=rounds)
    if family == "threefry":
        return threefry4x32(counter, torch.cat([key, torch.zeros_like(key)], -1), rounds=rounds)
    raise ValueError(f"family must be 'philox' or 'threefry', got {family!r}")


# ---------------------------------------------------------------------------------------------------------------
# writing and reading keys with a generator's dither
def quantize_keys(x: torch.Tensor, *, generator: str, seed: int, layer: int = 0, kv_head: int = 0,
                  slots: torch.Tensor | None = None, group: int = 32, layout: str = "h8") -> dict[str, torch.Tensor]:
    """The write path (:func:`kvlib.formats.dither_int8.dither_quantize`'s scales and codes) with ``generator``'s
    dither: ``{"codes", "scales", "xi"}`` for ``x [S, d]`` (no outlier bypass)."""
    from kvlib.formats.dither_int8 import check_x, group_scales, quantize_codes

    check_x(x)
    S, d = x.shape
    check_layout_d(layout, d)
    slots = torch.arange(S) if slots is None else slots.to(torch.int64)
    x32 = x.to(torch.float32)
    s16 = group_scales(x32, group)
    xi = dither(slots, d, layer=layer, kv_head=kv_head, seed=seed, side=0, layout=layout, generator=generator)
    return {"codes": quantize_codes(x32, s16, xi, group), "scales": s16, "xi": xi}


def soundness_trials(k: torch.Tensor, q: torch.Tensor, *, generator: str, trials: int, deltas: tuple[float, ...],
                     seed0: int, group: int = 32, layout: str = "h8") -> dict[str, torch.Tensor]:
    """:func:`kvlib.certify.bound.certify_trials` (scheme ``"dither"``, no bypass) with the keys written with
    ``generator``'s dither: ``tv [trials, rows]``, ``cert``/``event`` ``[len(deltas), trials, rows]``."""
    from kvlib.certify.bound import certificate_from_scores, radius_multiplier, tv_distance, variance_proxy

    check_generator(generator)
    S, d = k.shape
    sm = 1.0 / math.sqrt(d)
    q64 = q.to(torch.float64)
    z = sm * q64 @ k.to(torch.float64).T
    p = torch.softmax(z, -1)
    tv, cert, event = [], [], []
    for i in range(trials):
        w = quantize_keys(k, generator=generator, seed=seed0 + i, group=group, layout=layout)
        s = w["scales"].to(torch.float32).repeat_interleave(group, -1)
        k_hat = (s * (w["codes"].to(torch.float32) - w["xi"])).to(torch.float64)  # dequantize_codes, fp32
        z_hat = sm * q64 @ k_hat.T
        tv.append(tv_distance(p, torch.softmax(z_hat, -1)))
        sd = variance_proxy(q64, w["scales"], sm_scale=sm, group=group, proxy="dither").sqrt()
        err = (z_hat - z).abs()
        c_i, e_i = [], []
        for delta in deltas:
            u = sd * radius_multiplier(S, delta, d, layout=layout)
            c_i.append(certificate_from_scores(z_hat, u).tv_bound)
            e_i.append((err > u).any(-1).to(torch.float64))
        cert.append(torch.stack(c_i))
        event.append(torch.stack(e_i))
    return {"tv": torch.stack(tv), "cert": torch.stack(cert, 1), "event": torch.stack(event, 1)}


def soundness(generator: str, *, families=("gaussian", "heavy", "massive"), S: int = 256, d: int = 128,
              rows: int = 500, trials: int = 200, q_scale: float = 3.0, deltas=(0.5, 0.1, 0.01, 0.001),
              seed: int = 0, layout: str = "h8") -> list[dict[str, Any]]:
    """One row per (key family, delta): violations ``TV > cert`` and event failures over ``rows x trials`` pairs,
    each with its exact 95% upper limit; ``sound`` = the violation limit is at most ``delta`` (the certificate's
    promise) -- or, where the pair count cannot resolve ``delta``, no violation at all."""
    from scipy.stats import binomtest

    from kvlib.certify.bound import synthetic_keys

    out = []
    for fi, fam in enumerate(families):
        g = torch.Generator().manual_seed(seed * 100 + fi)
        k = synthetic_keys(fam, S, d, generator=g)
        q = q_scale * torch.randn(rows, d, generator=g)
        r = soundness_trials(k, q, generator=generator, trials=trials, deltas=tuple(deltas),
                             seed0=seed * 1000 + 1, layout=layout)
        n = r["tv"].numel()
        for i, dl in enumerate(deltas):
            viol = int((r["tv"] > r["cert"][i]).sum())
            ev = int(r["event"][i].sum())
            hi_v = binomtest(viol, n).proportion_ci(method="exact").high
            hi_e = binomtest(ev, n).proportion_ci(method="exact").high
            out.append({"generator": generator, "keys": fam, "delta": dl, "pairs": n, "TV > cert": viol,
                        "rate 95% hi": hi_v, "event fails": ev, "event rate": ev / n, "event 95% hi": hi_e,
                        "median cert": float(r["cert"][i].median()), "sound": hi_v <= dl or viol == 0})
    return out


# ---------------------------------------------------------------------------------------------------------------
# the dither stream
def _stream(family: str, rounds: int, n_slots: int, *, d: int = 128, layer: int = 0, kv_head: int = 0, side: int = 0,
            seed: int = 0x5EED, slot0: int = 0) -> torch.Tensor:
    """int64 words ``[n_slots, d // 16, 4]`` at the h8 dither counters of slots ``slot0 ..``."""
    ctr = dither_counter(torch.arange(slot0, slot0 + n_slots), d, layer=layer, kv_head=kv_head, side=side,
                         layout="h8")
    return family_words(ctr, torch.tensor(seed_key(seed), dtype=torch.int64), family, rounds)


def _h8_bytes(words: torch.Tensor) -> torch.Tensor:
    """``[S, d // 16, 4]`` words -> the h8 dither bytes per channel ``[S, d]`` (the layout's channel map)."""
    from kvlib.core.philox import h8_channel_map

    S, calls, _ = words.shape
    d = 16 * calls
    b = torch.stack([(words >> (8 * k)) & 0xFF for k in range(4)], -1)  # [S, calls, word i, byte k]
    out = torch.empty(S, d, dtype=torch.int64)
    out[:, h8_channel_map(d).reshape(-1)] = b.reshape(S, -1)
    return out


def _corr_p(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Pearson ``r`` of paired samples and its two-sided p-value under independence (``sqrt(N) r ~ N(0, 1)``)."""
    from scipy.stats import norm

    x = x.astype(np.float64).ravel()
    y = y.astype(np.float64).ravel()
    r = float(np.corrcoef(x, y)[0, 1])
    return r, float(2 * norm.sf(abs(r) * math.sqrt(x.size)))


def _spacing_repeats(vals: np.ndarray, m: int) -> tuple[int, int]:
    """``(repeats, blocks)``: over blocks of ``m`` values, the count of repeated spacings between sorted values
    (Marsaglia's birthday spacings statistic, summed over the blocks)."""
    blocks = vals.size // m
    v = np.sort(vals[: blocks * m].reshape(blocks, m), axis=1)
    sp = np.sort(np.diff(v, axis=1), axis=1)
    return int((sp[:, 1:] == sp[:, :-1]).sum()), blocks


def _birthday_spacings(vals: np.ndarray, m: int, bits: int, *, seed: int = 0, ref_factor: int = 4
                       ) -> tuple[int, float, float]:
    """Birthday spacings (DIEHARD's ``m = 512`` values of ``bits = 24`` bits per block) as a two-sample test: the
    repeats ``R`` of ``vals`` against ``R_ref`` of ``ref_factor`` times as many values from numpy's PCG64, so the
    finite-``m`` error of the Poisson mean ``m^3 / (4 2^bits)`` (a few percent at these sizes) cancels: given
    ``R + R_ref``, ``R`` is binomial with ``p = 1 / (1 + ref_factor)`` under equal rates. Returns
    ``(R, expected R, two-sided p)``."""
    from scipy.stats import binomtest

    r, blocks = _spacing_repeats(vals, m)
    ref = np.random.default_rng(seed).integers(0, 2**bits, blocks * m * ref_factor)
    r_ref, _ = _spacing_repeats(ref, m)
    tot = r + r_ref
    p = binomtest(r, tot, 1.0 / (1 + ref_factor)).pvalue if tot else 1.0
    return r, tot / (1 + ref_factor), float(p)


def stream_tests(family: str, rounds: int, *, n_slots: int = 1 << 15, d: int = 128, seed: int = 0x5EED,
                 avalanche_n: int = 1 << 13) -> list[dict[str, Any]]:
    """The battery on one generator (``family``, ``rounds``): one row per test with its sample size ``N``, statistic
    and p-value. Counters are the dither contract's (h8 layout, ``d = 128``: eight calls per slot)."""
    from scipy.stats import chi2, chi2_contingency, kstest

    rows = []

    def add(test: str, N: int, stat: float, p: float, **extra) -> None:
        rows.append({"test": test, "N": int(N), "stat": float(stat), "p": float(p)} | extra)

    w = _stream(family, rounds, n_slots, d=d, seed=seed)
    by = _h8_bytes(w)  # [S, d] the dither bytes
    xi = by.numpy().astype(np.float64)
    # 1. uniformity of the dither bytes (256 bins)
    cnt = np.bincount(by.numpy().ravel(), minlength=256)
    e = cnt.sum() / 256
    add("bytes chi2 (256 bins)", cnt.sum(), ((cnt - e) ** 2 / e).sum(), chi2.sf(((cnt - e) ** 2 / e).sum(), 255))
    # 2. the 32-bit words, Kolmogorov-Smirnov against U(0, 1)
    u = (w.reshape(-1).numpy().astype(np.float64) + 0.5) / 2.0**32
    ks = kstest(u, "uniform")
    add("words KS", u.size, ks.statistic, ks.pvalue)
    # 3. top bits of the words (the 24-bit w24 dither and the h10 halves read them): 16 bins of the top nibble
    top = (w.reshape(-1).numpy() >> 28).astype(np.int64)
    c16 = np.bincount(top, minlength=16)
    e16 = c16.sum() / 16
    add("words top-nibble chi2", c16.sum(), ((c16 - e16) ** 2 / e16).sum(),
        chi2.sf(((c16 - e16) ** 2 / e16).sum(), 15))
    # 4. channel x byte independence (does the byte law depend on the channel?), 16 byte bins per channel
    tab = np.stack([np.bincount((by[:, c].numpy() >> 4), minlength=16) for c in range(d)])
    st, p, dof, _ = chi2_contingency(tab)
    add("channel x byte-bin contingency", by.numel(), st, p, dof=int(dof))
    # 5-7. serial correlations: adjacent slots, adjacent channels, words of one call (channels c, c + d/4)
    r, p = _corr_p(xi[1:], xi[:-1])
    add("corr adjacent slots", xi[1:].size, r, p)
    r, p = _corr_p(xi[:, 1:], xi[:, :-1])
    add("corr adjacent channels", xi[:, 1:].size, r, p)
    r, p = _corr_p(xi[:, d // 4:], xi[:, : -(d // 4)])
    add("corr words of one call", xi[:, d // 4:].size, r, p)
    # 8-10. across layers (c3 high bits), sides (c3 low bit) and KV heads (c2)
    n2 = n_slots // 4
    base = xi[:n2]
    for name, kw in (("layer 0 vs 1", dict(layer=1)), ("keys vs values", dict(side=1)), ("head 0 vs 1",
                                                                                        dict(kv_head=1))):
        other = _h8_bytes(_stream(family, rounds, n2, d=d, seed=seed, **kw)).numpy()
        r, p = _corr_p(base, other)
        add(f"corr {name}", base.size, r, p)
    # 11. avalanche: flipping one counter bit (slot bits 0-15, call bits 0-2, head bit 0, c3 bits 0-1) flips each of
    # the 128 output bits with probability 1/2: chi-square over the output bits per input bit (128 dof)
    rng = np.random.default_rng(seed)
    ctr = torch.from_numpy(rng.integers(0, 2**16, size=(avalanche_n, 4), dtype=np.int64))
    ctr[:, 1] %= d // 16
    key = torch.tensor(seed_key(seed), dtype=torch.int64)
    w0 = family_words(ctr, key, family, rounds)
    bitpos = torch.arange(32, dtype=torch.int64)
    for word, bits in ((0, range(16)), (1, range(3)), (2, range(1)), (3, range(2))):
        for bit in bits:
            c2 = ctr.clone()
            c2[:, word] ^= 1 << bit
            diff = family_words(c2, key, family, rounds) ^ w0  # [N, 4]
            flips = ((diff[..., None] >> bitpos) & 1).sum(0).reshape(-1).numpy().astype(np.float64)  # [128]
            st = ((flips - avalanche_n / 2) ** 2 / (avalanche_n / 4)).sum()
            add(f"avalanche counter word {word} bit {bit}", avalanche_n, st, chi2.sf(st, 128),
                max_bias=float(np.abs(flips / avalanche_n - 0.5).max()))
    # 12. birthday spacings on the top 24 bits of the words (blocks of 512, against numpy's PCG64)
    reps, lam, p = _birthday_spacings((w.reshape(-1).numpy() >> 8).astype(np.int64), 512, 24, seed=seed)
    add("birthday spacings (24 bits, m = 512, vs PCG64)", (w.numel() // 512) * 512, reps, p, expected=lam)
    return rows


def stream_verdict(rows: list[dict[str, Any]], alpha: float = ALPHA) -> dict[str, Any]:
    """Bonferroni over the battery: a generator passes when every p-value exceeds ``alpha / len(rows)`` (and, for
    the record, Holm's step-down rejections at the same family level)."""
    ps = sorted(r["p"] for r in rows)
    m = len(ps)
    holm = 0
    for i, p in enumerate(ps):
        if p > alpha / (m - i):
            break
        holm += 1
    return {"tests": m, "alpha": alpha, "threshold": alpha / m, "min_p": ps[0] if ps else None,
            "failed": [r["test"] for r in rows if r["p"] <= alpha / m], "holm_rejections": holm,
            "pass": all(r["p"] > alpha / m for r in rows)}


def event_homogeneity(sound: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (key law, delta): do the generators' concentration-event failure counts differ? A chi-square test of the
    ``generators x {fail, hold}`` table (rows of :func:`soundness` per generator); a generator whose dither were off
    would move its count. Cells with no failure anywhere are reported with ``p = 1``."""
    from scipy.stats import chi2_contingency

    names = list(sound)
    out = []
    for i, r0 in enumerate(sound[names[0]]):
        fails = [sound[n][i]["event fails"] for n in names]
        pairs = [sound[n][i]["pairs"] for n in names]
        row = {"keys": r0["keys"], "delta": r0["delta"], "event fails": dict(zip(names, fails, strict=True))}
        if sum(fails) == 0:
            row |= {"chi2": 0.0, "p": 1.0}
        else:
            st, p, _, _ = chi2_contingency([[f, n - f] for f, n in zip(fails, pairs, strict=True)])
            row |= {"chi2": float(st), "p": float(p)}
        out.append(row)
    return out


def generator_family_rounds(name: str) -> tuple[str, int]:
    """``(family, rounds)`` of a generator name of :data:`kvlib.core.philox.GENERATORS`."""
    return GENERATORS[check_generator(name)]
