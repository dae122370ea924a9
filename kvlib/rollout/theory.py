"""Exact closed forms of KV concentration (KV4-RL Prop. 4.1 and Appendix C) for discrete laws.

Notation: prompt length ``P``, response length ``L`` with ``mu = E[L]``, ``sigma^2 = Var L``,
``M_B = max_{i<=B} L_i``, bytes per context position ``kappa``. A response at age ``g``
(``g = 0..L-1``) attends over ``P + g`` positions, so it touches ``Q(P, L) = P L + L(L-1)/2``
logical KV positions in total. All expectations are exact finite sums over the support; ``E[M_B]``
comes from the CDF, ``P(M_B = l) = F(l)^B - F(l-1)^B``, never from sampling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvlib.rollout.laws import LengthLaw, PromptLengthLaw, as_law, check_block, check_prompt


def logical_work(P: np.ndarray | float, L: np.ndarray | int) -> np.ndarray | float:
    """``Q(P, L) = sum_{g<L} (P + g) = P L + L(L-1)/2``: logical KV positions one response touches."""
    P = np.asarray(P)
    L = np.asarray(L)
    out = P * L + L * (L - 1) / 2
    return out if out.ndim else out.item()


def max_law(lengths: object, probs: object = None, B: int = 1) -> LengthLaw:
    """Law of ``M_B = max of B i.i.d. lengths``: ``P(M_B = l) = F(l)^B - F(l-1)^B``."""
    law = as_law(lengths, probs)
    B = check_block("B", B)
    F = law._cdf
    F_prev = np.concatenate([[0.0], F[:-1]])
    p = np.clip(F**B - F_prev**B, 0.0, None)
    return LengthLaw(law.lengths, p / p.sum(), f"max_{B}({law.name})")


def expected_max(lengths: object, probs: object = None, B: int = 1) -> float:
    """``E[M_B] = sum_l l (F(l)^B - F(l-1)^B)``, exact."""
    return max_law(lengths, probs, B).mean


def length_biased(lengths: object, probs: object = None) -> LengthLaw:
    """Inspection paradox: law of the length seen at a random occupied slot-step, ``l P(L=l) / mu``."""
    law = as_law(lengths, probs)
    w = law.lengths * law.probs
    return LengthLaw(law.lengths, w / w.sum(), f"length-biased({law.name})")


def async_mean_context(P: float, lengths: object, probs: object = None) -> float:
    """``l_async = P + E[L(L-1)] / (2 mu) = P + (mu-1)/2 + sigma^2/(2 mu)`` (continuous refill)."""
    P = check_prompt("P", P)
    law = as_law(lengths, probs)
    return P + law.moment(lambda x: x * (x - 1)) / (2.0 * law.mean)


def async_mean_volume(P: float, lengths: object, probs: object = None, B: int = 1, kappa: float = 1.0) -> float:
    """``V_async = kappa B l_async`` (B slots always occupied)."""
    B = check_block("B", B)
    return float(kappa) * B * async_mean_context(P, lengths, probs)


def sync_mean_volume(P: float, lengths: object, probs: object = None, B: int = 1, kappa: float = 1.0) -> float:
    """``V_sync = kappa B E[Q(P, L)] / E[M_B]`` (waves of B, a wave lasts ``M_B`` steps)."""
    P = check_prompt("P", P)
    law = as_law(lengths, probs)
    B = check_block("B", B)
    q = law.moment(lambda x: logical_work(P, x))
    return float(kappa) * B * q / expected_max(law, None, B)


def sync_occupancy(lengths: object, probs: object = None, B: int = 1) -> float:
    """``B_sync = B mu / E[M_B]``: step-averaged active batch of synchronous waves."""
    law = as_law(lengths, probs)
    B = check_block("B", B)
    return B * law.mean / expected_max(law, None, B)


def sync_mean_context(P: float, lengths: object, probs: object = None, B: int = 1) -> float:
    """``l_sync = P + E[M_B (M_B - 1)] / (2 E[M_B])``: step-averaged mean context of waves."""
    P = check_prompt("P", P)
    m = max_law(lengths, probs, check_block("B", B))
    return P + m.moment(lambda x: x * (x - 1)) / (2.0 * m.mean)


def concentration_factor(lengths: object, probs: object = None, B: int = 1) -> float:
    """``C_KV = V_async / V_sync = E[M_B] / E[L] >= 1`` (strict for B >= 2, non-degenerate law)."""
    law = as_law(lengths, probs)
    return expected_max(law, None, check_block("B", B)) / law.mean


def slot_mean_context(prompts: object, lengths: object, probs: object) -> float:
    """``l^slot = E[P L + L(L-1)/2] / E[L]`` for i.i.d. ``(P, L)`` pairs with joint support points.

    The mean context of a random occupied slot-step; equals the async mean context per slot.
    """
    law = PromptLengthLaw.from_arrays(prompts, lengths, probs)
    q = np.dot(logical_work(law.prompts.astype(np.float64), law.lengths.astype(np.float64)), law.probs)
    return float(q / np.dot(law.lengths, law.probs))


@dataclass(frozen=True)
class Concentration:
    """All Prop. 4.1 quantities for one law, one ``B``, one ``P`` (volumes in bytes if ``kappa`` is)."""

    B: int
    P: float
    mu: float
    sigma2: float
    expected_max: float
    async_mean_context: float
    async_mean_volume: float
    sync_mean_volume: float
    sync_occupancy: float
    sync_mean_context: float
    slot_mean_context: float
    concentration_factor: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def concentration(law: LengthLaw, B: int, P: float = 0.0, kappa: float = 1.0) -> Concentration:
    """Evaluate every closed form of Prop. 4.1 for ``law`` at batch ``B`` and prompt length ``P``."""
    B = check_block("B", B)
    P = check_prompt("P", P)
    em = expected_max(law, None, B)
    la = async_mean_context(P, law)
    return Concentration(
        B=B,
        P=P,
        mu=law.mean,
        sigma2=law.var,
        expected_max=em,
        async_mean_context=la,
        async_mean_volume=float(kappa) * B * la,
        sync_mean_volume=sync_mean_volume(P, law, None, B, kappa),
        sync_occupancy=B * law.mean / em,
        sync_mean_context=sync_mean_context(P, law, None, B),
        slot_mean_context=la,
        concentration_factor=em / law.mean,
    )
