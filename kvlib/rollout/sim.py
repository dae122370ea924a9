"""Discrete-event simulators of synchronous waves and continuous-refill asynchronous decoding.

Both are event based: each response is an interval ``[start, start + L)`` of decode steps in
which it attends over ``P + (t - start)`` positions. Per-step batch and context sums follow from
difference arrays (``np.bincount`` at starts and ends), so a run costs O(steps + responses) numpy
work and no Python loop over tokens: 10^6 steps with B = 64 take well under a second.

* async: ``B`` slots, each refilled the step after its response ends (ordinary renewal start:
  every slot begins with a fresh response at ``t = 0``).
* sync: waves of ``B`` responses start together; the next wave starts when the longest ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvlib.rollout.laws import LengthLaw, PromptLengthLaw, check_block, check_prompt


@dataclass(frozen=True, eq=False)
class Trace:
    """Per-decode-step record of one simulated run (steps ``0..n_steps-1``).

    ``batch[t]``: active responses; ``context_sum[t]``: sum of their contexts (resident
    positions). ``starts/lengths/prompts``: every response that started inside the window.
    """

    batch: np.ndarray
    context_sum: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    prompts: np.ndarray
    B: int
    kind: str

    @property
    def n_steps(self) -> int:
        return int(self.batch.size)

    @property
    def mean_context(self) -> np.ndarray:
        """Per-step mean active context ``l_t = context_sum / batch`` (nan on idle steps)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.batch > 0, self.context_sum / np.maximum(self.batch, 1), np.nan)

    def volume(self, kappa: float = 1.0) -> np.ndarray:
        """Per-step resident volume ``V_t = kappa * sum_i l_i(t)`` (positions if ``kappa = 1``)."""
        return float(kappa) * self.context_sum

    # ---- long-run averages over decode steps (idle steps excluded, as in the paper) --------
    def step_means(self, n: int | None = None) -> dict[str, float]:
        """Averages over the first ``n`` steps: ``B_bar``, ``l_bar``, ``V_bar`` (kappa = 1), ``l_slot``."""
        b = self.batch[:n]
        c = self.context_sum[:n]
        busy = b > 0
        return {
            "batch": float(b[busy].mean()),
            "mean_context": float((c[busy] / b[busy]).mean()),
            "volume": float(c[busy].mean()),
            "slot_context": float(c.sum() / b.sum()),
        }

    def running_means(self, checkpoints: np.ndarray) -> dict[str, np.ndarray]:
        """Same averages as :meth:`step_means` evaluated at every ``n`` in ``checkpoints`` (cumulative)."""
        idx = np.asarray(checkpoints, dtype=np.int64) - 1
        busy = self.batch > 0
        nb = np.cumsum(busy)[idx]
        ctx = np.where(busy, self.context_sum / np.maximum(self.batch, 1), 0.0)
        return {
            "batch": np.cumsum(self.batch)[idx] / nb,
            "mean_context": np.cumsum(ctx)[idx] / nb,
            "volume": np.cumsum(self.context_sum)[idx] / nb,
            "slot_context": np.cumsum(self.context_sum)[idx] / np.cumsum(self.batch)[idx],
        }

    def observed_length_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Slot-steps spent by responses of each length inside the window: ``(lengths, counts)``.

        Normalised, this is the length law seen at a random occupied slot-step (inspection paradox).
        """
        seen = np.minimum(self.starts + self.lengths, self.n_steps) - self.starts
        uniq, inv = np.unique(self.lengths, return_inverse=True)
        return uniq, np.bincount(inv, weights=seen, minlength=uniq.size)


def _draw(law: LengthLaw | PromptLengthLaw, P: float, size: tuple[int, int], rng: np.random.Generator):
    if isinstance(law, PromptLengthLaw):
        return law.sample(size, rng)
    if not isinstance(law, LengthLaw):
        raise TypeError(f"law must be a LengthLaw or PromptLengthLaw, got {type(law).__name__}")
    return np.full(size, P, dtype=np.float64), law.sample(size, rng)


def _draw_until(law: LengthLaw | PromptLengthLaw, P: float, size: tuple[int, int], rng: np.random.Generator,
                axis: int, enough: Callable[[np.ndarray], bool]) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``(prompts, lengths)`` of ``size``, appending further draws along ``axis`` until ``enough(lengths)``."""
    prompts, lengths = _draw(law, P, size, rng)
    while not enough(lengths):
        p2, l2 = _draw(law, P, size, rng)
        prompts = np.concatenate([prompts, p2], axis=axis)
        lengths = np.concatenate([lengths, l2], axis=axis)
    return prompts, lengths


def _mean_length(law: LengthLaw | PromptLengthLaw) -> tuple[float, float]:
    if not isinstance(law, (LengthLaw, PromptLengthLaw)):
        raise TypeError(f"law must be a LengthLaw or PromptLengthLaw, got {type(law).__name__}")
    lens, p = law.lengths, law.probs
    mu = float(np.dot(lens, p))
    return mu, float(np.sqrt(np.dot((lens - mu) ** 2, p)))


def trace_from_intervals(
    starts: np.ndarray, lengths: np.ndarray, prompts: np.ndarray, n_steps: int, B: int, kind: str
) -> Trace:
    """Per-step batch and context sums of responses active on ``[start, start + L)``, clipped to the window."""
    keep = (starts < n_steps) & (lengths > 0)
    s = starts[keep].astype(np.int64)
    L = lengths[keep].astype(np.int64)
    P = prompts[keep].astype(np.float64)
    e = np.minimum(s + L, n_steps)
    n1 = n_steps + 1
    count = np.cumsum(np.bincount(s, minlength=n1) - np.bincount(e, minlength=n1))[:n_steps]
    w = P - s  # context at step t of an active response: P + t - s
    off = np.cumsum(np.bincount(s, weights=w, minlength=n1) - np.bincount(e, weights=w, minlength=n1))[:n_steps]
    ctx = off + np.arange(n_steps, dtype=np.float64) * count
    order = np.argsort(s, kind="stable")
    return Trace(
        batch=count.astype(np.int64),
        context_sum=np.rint(ctx) if np.all(P == np.round(P)) else ctx,
        starts=s[order],
        lengths=L[order],
        prompts=P[order],
        B=B,
        kind=kind,
    )


def _check_steps(n_steps: object) -> int:
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)):
        raise TypeError(f"n_steps must be an int, got {type(n_steps).__name__}")
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    return int(n_steps)


def simulate_async(
    law: LengthLaw | PromptLengthLaw, B: int, n_steps: int, *, P: float = 0.0, seed: int | None = 0
) -> Trace:
    """Continuous refill: ``B`` slots, each runs i.i.d. responses back to back for ``n_steps`` steps."""
    B = check_block("B", B)
    n_steps = _check_steps(n_steps)
    P = check_prompt("P", P)
    rng = np.random.default_rng(seed)
    mu, sd = _mean_length(law)
    k = int(np.ceil(n_steps / mu + 6.0 * sd / mu * np.sqrt(n_steps / mu) + 8))
    # rare: extend every slot by another chunk
    prompts, lengths = _draw_until(law, P, (B, k), rng, 1, lambda L: np.cumsum(L, axis=1)[:, -1].min() >= n_steps)
    ends = np.cumsum(lengths, axis=1)
    starts = ends - lengths
    return trace_from_intervals(starts.ravel(), lengths.ravel(), prompts.ravel(), n_steps, B, "async")


def simulate_sync(
    law: LengthLaw | PromptLengthLaw, B: int, n_steps: int, *, P: float = 0.0, seed: int | None = 0
) -> Trace:
    """Synchronous waves of ``B`` responses; a wave lasts ``M_B = max L_i`` decode steps."""
    B = check_block("B", B)
    n_steps = _check_steps(n_steps)
    P = check_prompt("P", P)
    rng = np.random.default_rng(seed)
    mu, _ = _mean_length(law)
    k = int(np.ceil(n_steps / mu)) + 8  # E[M_B] >= mu, so this many waves nearly always suffice
    prompts, lengths = _draw_until(law, P, (k, B), rng, 0, lambda L: L.max(axis=1).sum() >= n_steps)
    durations = lengths.max(axis=1)
    wave_start = np.cumsum(durations) - durations
    starts = np.repeat(wave_start, B)
    return trace_from_intervals(starts, lengths.ravel(), prompts.ravel(), n_steps, B, "sync")


def batch_means_se(x: np.ndarray, n_batches: int = 50) -> float:
    """Standard error of the mean of a correlated series by non-overlapping batch means."""
    x = np.asarray(x, dtype=np.float64)
    if n_batches < 2 or x.size < 2 * n_batches:
        raise ValueError(f"n_batches must be >= 2 and x must hold at least 2*n_batches values, got {x.size}")
    m = x[: x.size - x.size % n_batches].reshape(n_batches, -1).mean(axis=1)
    return float(m.std(ddof=1) / np.sqrt(n_batches))
