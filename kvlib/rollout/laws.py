"""Discrete response-length laws (and joint prompt/length laws) for the KV-concentration theory.

A law is a finite support of non-negative integer lengths with probabilities summing to one.
Everything in :mod:`kvlib.rollout` is exact for such laws: expectations are finite sums, and the
simulators draw from the same law, so closed forms and simulations can be compared directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

PROB_ATOL = 1e-9  # tolerance on sum(probs) == 1 before renormalising exactly


def _as_int_array(name: str, x: object) -> np.ndarray:
    """1-D int64 array of non-negative integers; floats are accepted only if integral."""
    arr = np.asarray(x)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold whole numbers, got non-integer values")
    arr = arr.astype(np.int64)
    if np.any(arr < 0):
        raise ValueError(f"{name} must be non-negative, got minimum {arr.min()}")
    return arr


def _as_probs(name: str, p: object, size: int, shape_of: str) -> np.ndarray:
    arr = np.asarray(p, dtype=np.float64)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.shape != (size,):
        raise ValueError(f"{name} must have the same shape as {shape_of} ({size},), got {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and non-negative")
    total = float(arr.sum())
    if abs(total - 1.0) > PROB_ATOL:
        raise ValueError(f"{name} must sum to 1 (within {PROB_ATOL:g}), got {total!r}")
    return arr / total


def check_block(name: str, B: object) -> int:
    """A batch / slot count must be an integer >= 1."""
    if isinstance(B, bool) or not isinstance(B, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(B).__name__}")
    if B < 1:
        raise ValueError(f"{name} must be >= 1, got {B}")
    return int(B)


def check_prompt(name: str, P: object) -> float:
    """A prompt length is a finite real number >= 0 (usually an integer)."""
    if isinstance(P, bool):
        raise TypeError(f"{name} must be a number, got bool")
    try:
        v = float(P)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(P).__name__}") from None
    if not np.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {P!r}")
    return v


@dataclass(frozen=True, eq=False)
class LengthLaw:
    """A discrete law of response lengths ``L`` (decode steps of one response).

    ``lengths`` are distinct non-negative integers in increasing order, ``probs`` their
    probabilities (sum 1). Build one with :meth:`from_arrays` (validates, merges duplicates) or
    with the constructors below (:func:`geometric_law`, :func:`pareto_law`, ...).
    """

    lengths: np.ndarray
    probs: np.ndarray
    name: str = ""
    _cdf: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cdf", np.cumsum(self.probs))

    @classmethod
    def from_arrays(cls, lengths: object, probs: object, name: str = "") -> LengthLaw:
        """Validate ``lengths``/``probs`` (ValueError naming the argument) and build the law."""
        lens = _as_int_array("lengths", lengths)
        p = _as_probs("probs", probs, lens.size, "lengths")
        uniq, inv = np.unique(lens, return_inverse=True)
        merged = np.bincount(inv, weights=p, minlength=uniq.size)
        if float(np.dot(uniq, merged)) <= 0:
            raise ValueError("lengths: the law must have a positive mean (some length >= 1 with probability > 0)")
        return cls(uniq, merged, name)

    # ---- moments --------------------------------------------------------------------------
    @property
    def mean(self) -> float:
        """``mu = E[L]``."""
        return float(np.dot(self.lengths, self.probs))

    @property
    def var(self) -> float:
        """``sigma^2 = Var L``."""
        m = self.mean
        return float(np.dot((self.lengths - m) ** 2, self.probs))

    def moment(self, fn) -> float:  # noqa: ANN001 - any ufunc-like callable
        """``E[fn(L)]`` as an exact finite sum."""
        return float(np.dot(fn(self.lengths.astype(np.float64)), self.probs))

    def cdf(self, l: np.ndarray | int) -> np.ndarray:  # noqa: E741
        """``F(l) = P(L <= l)`` for integer ``l`` (any shape)."""
        idx = np.searchsorted(self.lengths, np.asarray(l), side="right")
        return np.concatenate([[0.0], self._cdf])[idx]

    @property
    def is_degenerate(self) -> bool:
        return int(np.count_nonzero(self.probs > 0)) <= 1

    # ---- sampling -------------------------------------------------------------------------
    def sample(self, size: int | tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        """Draw i.i.d. lengths (int64) by inverse CDF."""
        u = rng.random(size)
        idx = np.searchsorted(self._cdf, u, side="right")
        return self.lengths[np.minimum(idx, self.lengths.size - 1)]

    def __len__(self) -> int:
        return int(self.lengths.size)


@dataclass(frozen=True, eq=False)
class PromptLengthLaw:
    """A joint discrete law of ``(P, L)`` pairs (prompt length, response length).

    Support points ``(prompts[k], lengths[k])`` with probability ``probs[k]``.
    """

    prompts: np.ndarray
    lengths: np.ndarray
    probs: np.ndarray
    name: str = ""

    @classmethod
    def from_arrays(cls, prompts: object, lengths: object, probs: object, name: str = "") -> PromptLengthLaw:
        pr = _as_int_array("prompts", prompts)
        lens = _as_int_array("lengths", lengths)
        if pr.shape != lens.shape:
            raise ValueError(f"prompts and lengths must have the same shape, got {pr.shape} and {lens.shape}")
        p = _as_probs("probs", probs, lens.size, "lengths")
        if float(np.dot(lens, p)) <= 0:
            raise ValueError("lengths: the law must have a positive mean length")
        return cls(pr, lens, p, name)

    @classmethod
    def independent(cls, prompts: LengthLaw, lengths: LengthLaw, name: str = "") -> PromptLengthLaw:
        """Product law: ``P`` and ``L`` independent."""
        pp, ll = np.meshgrid(prompts.lengths, lengths.lengths, indexing="ij")
        w = np.outer(prompts.probs, lengths.probs)
        return cls(pp.ravel(), ll.ravel(), w.ravel() / w.sum(), name)

    @property
    def length_law(self) -> LengthLaw:
        """Marginal law of ``L``."""
        return LengthLaw.from_arrays(self.lengths, self.probs, self.name)

    def sample(self, size: int | tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Draw i.i.d. ``(P, L)`` pairs."""
        cdf = np.cumsum(self.probs)
        idx = np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), self.probs.size - 1)
        return self.prompts[idx], self.lengths[idx]


# ---- constructors -------------------------------------------------------------------------


def _check_range(min_len: int, max_len: int) -> tuple[int, int]:
    lo = int(min_len)
    hi = int(max_len)
    if lo < 0:
        raise ValueError(f"min_len must be >= 0, got {min_len}")
    if hi < max(lo, 1):
        raise ValueError(f"max_len must be >= max(min_len, 1), got {max_len}")
    return lo, hi


def _from_weights(support: np.ndarray, w: np.ndarray, name: str) -> LengthLaw:
    w = np.asarray(w, dtype=np.float64)
    keep = w > 0
    if not keep.any():
        raise ValueError(f"{name}: the truncation window carries no probability mass")
    return LengthLaw.from_arrays(support[keep], w[keep] / w[keep].sum(), name)


def degenerate_law(length: int) -> LengthLaw:
    """Every response has the same length (``C_KV = 1``)."""
    return LengthLaw.from_arrays([length], [1.0], f"degenerate({length})")


def uniform_law(min_len: int, max_len: int) -> LengthLaw:
    """Uniform on ``min_len..max_len``."""
    lo, hi = _check_range(min_len, max_len)
    support = np.arange(lo, hi + 1)
    return _from_weights(support, np.ones(support.size), f"uniform({lo},{hi})")


def geometric_law(mean: float, max_len: int, min_len: int = 1) -> LengthLaw:
    """Geometric on ``min_len, min_len+1, ...`` with untruncated mean ``mean``, truncated at ``max_len``.

    Memoryless stopping (a constant per-token end probability); truncation lowers the mean a little.
    """
    lo, hi = _check_range(min_len, max_len)
    if not mean > lo:
        raise ValueError(f"mean must exceed min_len={lo}, got {mean}")
    p = 1.0 / (mean - lo + 1.0)
    support = np.arange(lo, hi + 1)
    return _from_weights(support, stats.geom.pmf(support - lo + 1, p), f"geometric(mean={mean:g})")


def pareto_law(alpha: float, min_len: int, max_len: int) -> LengthLaw:
    """Discretised truncated Pareto: ``P(L = l) ∝ l^-(alpha+1)`` on ``min_len..max_len`` (heavy tail)."""
    lo, hi = _check_range(max(int(min_len), 1), max_len)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    support = np.arange(lo, hi + 1)
    return _from_weights(support, support.astype(np.float64) ** (-(alpha + 1.0)), f"pareto(alpha={alpha:g})")


def lognormal_law(median: float, sigma: float, max_len: int, min_len: int = 1) -> LengthLaw:
    """Discretised truncated lognormal: mass of ``[l - 1/2, l + 1/2)`` for ``l`` in ``min_len..max_len``."""
    lo, hi = _check_range(min_len, max_len)
    if not median > 0 or not sigma > 0:
        raise ValueError(f"median and sigma must be > 0, got median={median}, sigma={sigma}")
    support = np.arange(lo, hi + 1)
    dist = stats.lognorm(s=sigma, scale=median)
    w = dist.cdf(support + 0.5) - dist.cdf(np.maximum(support - 0.5, 0.0))
    return _from_weights(support, w, f"lognormal(median={median:g}, sigma={sigma:g})")


def mixture_law(laws: Sequence[LengthLaw], weights: Sequence[float], name: str = "") -> LengthLaw:
    """Mixture ``sum_k w_k law_k``."""
    if len(laws) != len(weights) or not laws:
        raise ValueError("laws and weights must be non-empty and of the same length")
    w = _as_probs("weights", weights, len(laws), "laws")
    lens = np.concatenate([law.lengths for law in laws])
    p = np.concatenate([wk * law.probs for wk, law in zip(w, laws)])
    return LengthLaw.from_arrays(lens, p / p.sum(), name or "mixture")


def bimodal_law(
    short_median: float, long_median: float, p_long: float, max_len: int, sigma: float = 0.3, min_len: int = 1
) -> LengthLaw:
    """Short answers vs long chains of thought: a two-component lognormal mixture, truncated."""
    if not 0.0 <= p_long <= 1.0:
        raise ValueError(f"p_long must lie in [0, 1], got {p_long}")
    short = lognormal_law(short_median, sigma, max_len, min_len)
    long = lognormal_law(long_median, sigma, max_len, min_len)
    return mixture_law(
        [short, long], [1.0 - p_long, p_long], f"bimodal({short_median:g}/{long_median:g}, p_long={p_long:g})"
    )


def as_law(lengths: object, probs: object) -> LengthLaw:
    """Validate raw arrays into a :class:`LengthLaw` (or pass a law through when ``probs is None``)."""
    if isinstance(lengths, LengthLaw):
        if probs is not None:
            raise TypeError("probs must be None when lengths is a LengthLaw")
        return lengths
    if probs is None:
        raise TypeError("probs is required when lengths is an array (or pass a LengthLaw)")
    return LengthLaw.from_arrays(lengths, probs)
