"""KV concentration: closed forms vs brute-force enumeration, simulators vs closed forms, input checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvlib.rollout import (
    LengthLaw,
    PromptLengthLaw,
    async_mean_context,
    batch_means_se,
    bimodal_law,
    concentration,
    concentration_factor,
    degenerate_law,
    expected_max,
    geometric_law,
    length_biased,
    logical_work,
    lognormal_law,
    max_law,
    pareto_law,
    simulate_async,
    simulate_sync,
    slot_mean_context,
    sync_mean_context,
    sync_mean_volume,
    sync_occupancy,
    uniform_law,
)
from kvlib.rollout.sim import trace_from_intervals

TINY_LAWS = [
    ([1, 2], [0.5, 0.5]),
    ([1, 3, 7], [0.2, 0.5, 0.3]),
    ([2, 5, 6, 11], [0.1, 0.4, 0.25, 0.25]),
    ([0, 4, 9], [0.3, 0.3, 0.4]),  # zero-length responses allowed when the mean is positive
]


def _enumerate(lengths, probs, B):
    """All B-tuples of a tiny law with their probabilities."""
    for combo in itertools.product(range(len(lengths)), repeat=B):
        yield np.array([lengths[i] for i in combo]), float(np.prod([probs[i] for i in combo]))


@pytest.mark.parametrize("lengths,probs", TINY_LAWS)
@pytest.mark.parametrize("B", [1, 2, 3, 4])
def test_closed_forms_match_enumeration(lengths, probs, B):
    P = 5
    e_max = e_mm1 = e_q = e_sum = 0.0
    for tup, w in _enumerate(lengths, probs, B):
        m = tup.max()
        e_max += w * m
        e_mm1 += w * m * (m - 1)
        e_q += w * sum(P * x + x * (x - 1) / 2 for x in tup)
        e_sum += w * tup.sum()
    mu = float(np.dot(lengths, probs))
    assert expected_max(lengths, probs, B) == pytest.approx(e_max, rel=1e-12)
    assert concentration_factor(lengths, probs, B) == pytest.approx(e_max / mu, rel=1e-12)
    assert sync_occupancy(lengths, probs, B) == pytest.approx(e_sum / e_max, rel=1e-12)
    assert sync_mean_volume(P, lengths, probs, B, kappa=3.0) == pytest.approx(3.0 * e_q / e_max, rel=1e-12)
    assert sync_mean_context(P, lengths, probs, B) == pytest.approx(P + e_mm1 / (2 * e_max), rel=1e-12)
    # C_KV = V_async / V_sync, the two volumes computed independently
    c = concentration(LengthLaw.from_arrays(lengths, probs), B, P=P, kappa=2.0)
    assert c.async_mean_volume / c.sync_mean_volume == pytest.approx(c.concentration_factor, rel=1e-12)


@pytest.mark.parametrize("lengths,probs", TINY_LAWS)
def test_async_context_forms_agree(lengths, probs):
    law = LengthLaw.from_arrays(lengths, probs)
    mu, s2 = law.mean, law.var
    direct = 7 + sum(p * l * (l - 1) for l, p in zip(lengths, probs)) / (2 * mu)  # noqa: E741
    assert async_mean_context(7, lengths, probs) == pytest.approx(direct, rel=1e-12)
    assert async_mean_context(7, lengths, probs) == pytest.approx(7 + (mu - 1) / 2 + s2 / (2 * mu), rel=1e-12)
    # inspection paradox: mean age under the length-biased law with uniform age is E[L(L-1)]/(2 mu)
    lb = length_biased(law)
    assert lb.probs.sum() == pytest.approx(1.0)
    assert np.dot(lb.probs, (lb.lengths - 1) / 2) == pytest.approx(async_mean_context(0, law), rel=1e-12)


def test_max_law_is_a_law_and_monotone_in_B():
    law = pareto_law(1.2, 5, 500)
    prev = law.mean
    for B in [1, 2, 4, 16, 256]:
        m = max_law(law, None, B)
        assert m.probs.sum() == pytest.approx(1.0) and np.all(m.probs >= 0)
        assert m.mean >= prev - 1e-9
        prev = m.mean
    assert max_law(law, None, 1).mean == pytest.approx(law.mean, rel=1e-12)


def test_slot_context_joint_law():
    prompts, lengths, probs = [10, 10, 300, 300], [5, 50, 5, 50], [0.4, 0.1, 0.1, 0.4]  # P and L correlated
    direct = sum(p * (P * L + L * (L - 1) / 2) for P, L, p in zip(prompts, lengths, probs))
    direct /= sum(p * L for L, p in zip(lengths, probs))
    assert slot_mean_context(prompts, lengths, probs) == pytest.approx(direct, rel=1e-12)
    # with a constant prompt it reduces to the async mean context
    law = LengthLaw.from_arrays(lengths[:2], [0.5, 0.5])
    assert slot_mean_context([42, 42], lengths[:2], [0.5, 0.5]) == pytest.approx(async_mean_context(42, law))
    assert logical_work(3, 4) == 3 * 4 + 6


def test_concentration_factor_bounds():
    assert concentration_factor([100], [1.0], 64) == pytest.approx(1.0)
    assert concentration_factor(degenerate_law(17), None, 5) == pytest.approx(1.0)
    for law in [geometric_law(30, 400), pareto_law(1.5, 2, 300), bimodal_law(20, 300, 0.2, 600), uniform_law(1, 2)]:
        assert concentration_factor(law, None, 1) == pytest.approx(1.0)
        cs = [concentration_factor(law, None, B) for B in (2, 4, 16, 64)]
        assert cs[0] > 1.0 and np.all(np.diff(cs) > 0)
        assert cs[-1] <= law.lengths.max() / law.mean + 1e-12
    # more spread at the same mean -> more concentration
    narrow, wide = lognormal_law(100, 0.2, 2000), lognormal_law(100, 0.8, 2000)
    assert concentration_factor(wide, None, 32) > concentration_factor(narrow, None, 32)


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: concentration_factor([1, 2], [0.5, 0.6], 2), "probs"),
        (lambda: concentration_factor([1, -2], [0.5, 0.5], 2), "lengths"),
        (lambda: concentration_factor([1, 2], [0.5, 0.5], 0), "B"),
        (lambda: concentration_factor([1, 2, 3], [0.5, 0.5], 2), "probs"),
        (lambda: concentration_factor([[1, 2]], [[0.5, 0.5]], 2), "lengths"),
        (lambda: concentration_factor([1.5, 2], [0.5, 0.5], 2), "lengths"),
        (lambda: concentration_factor([1, 2], [1.5, -0.5], 2), "probs"),
        (lambda: concentration_factor([0], [1.0], 2), "lengths"),
        (lambda: async_mean_context(-1, [1, 2], [0.5, 0.5]), "P"),
        (lambda: async_mean_context(1, [1, 2], [0.3, 0.3]), "probs"),
        (lambda: slot_mean_context([1], [1, 2], [0.5, 0.5]), "prompts"),
        (lambda: simulate_async(geometric_law(5, 50), 0, 10), "B"),
        (lambda: simulate_sync(geometric_law(5, 50), 2, 0), "n_steps"),
    ],
)
def test_bad_inputs_raise_naming_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def test_wrong_types_raise():
    with pytest.raises(TypeError, match="B"):
        concentration_factor([1, 2], [0.5, 0.5], 2.0)
    with pytest.raises(TypeError, match="probs"):
        async_mean_context(0, [1, 2], None)
    with pytest.raises(TypeError, match="law"):
        simulate_async([1, 2], 2, 10)


def _naive_trace(starts, lengths, prompts, n):
    batch = np.zeros(n, dtype=np.int64)
    ctx = np.zeros(n)
    for s, L, P in zip(starts, lengths, prompts):
        for g in range(L):
            if s + g < n:
                batch[s + g] += 1
                ctx[s + g] += P + g
    return batch, ctx


def test_event_trace_matches_per_token_loop():
    rng = np.random.default_rng(3)
    starts = rng.integers(0, 60, 40)
    lengths = rng.integers(0, 25, 40)
    prompts = rng.integers(0, 9, 40)
    tr = trace_from_intervals(starts, lengths, prompts, 50, B=4, kind="test")
    b, c = _naive_trace(starts, lengths, prompts, 50)
    np.testing.assert_array_equal(tr.batch, b)
    np.testing.assert_allclose(tr.context_sum, c)


def test_schedulers_respect_structure():
    law = bimodal_law(10, 120, 0.25, 300)
    a = simulate_async(law, 8, 5000, P=3, seed=1)
    s = simulate_sync(law, 8, 5000, P=3, seed=1)
    assert np.all(a.batch == 8)  # continuous refill keeps every slot busy
    assert s.batch.max() <= 8 and s.batch.min() >= 1
    # within a sync wave every active response has the same age, so mean context = P + t - wave start
    mc = s.mean_context
    assert np.allclose(mc - np.round(mc), 0)
    # work is conserved: total context over steps = sum of Q over the (clipped) responses
    done = a.starts + a.lengths <= a.n_steps
    assert a.context_sum.sum() >= logical_work(a.prompts[done], a.lengths[done]).sum()


LAWS = {
    "geometric": geometric_law(40, 600),
    "pareto": pareto_law(1.5, 5, 800),
    "bimodal": bimodal_law(15, 250, 0.3, 600),
}


@pytest.mark.parametrize("name", list(LAWS))
def test_simulators_converge_to_closed_forms(name):
    """Long-run step averages within 5 batch-means standard errors + 1% (start-up transient) of the limit."""
    law, B, P, n = LAWS[name], 16, 20, 400_000
    c = concentration(law, B, P=P)
    a = simulate_async(law, B, n, P=P, seed=11)
    s = simulate_sync(law, B, n, P=P, seed=12)

    def close(series, exact):
        est = float(np.nanmean(series))
        tol = 5 * batch_means_se(series, 40) + 0.01 * abs(exact)
        assert abs(est - exact) <= tol, (name, est, exact, tol)

    close(a.mean_context, c.async_mean_context)
    close(s.mean_context, c.sync_mean_context)
    close(s.batch.astype(float), c.sync_occupancy)
    close(s.context_sum, c.sync_mean_volume)
    ratio = a.step_means()["volume"] / s.step_means()["volume"]
    assert ratio == pytest.approx(c.concentration_factor, rel=0.05)


def test_inspection_paradox_in_simulation():
    law = LengthLaw.from_arrays([2, 10, 40], [0.6, 0.3, 0.1])
    a = simulate_async(law, 32, 200_000, seed=5)
    lens, counts = a.observed_length_counts()
    observed = counts / counts.sum()
    expected = length_biased(law).probs
    np.testing.assert_allclose(observed, expected, atol=0.01)
    assert observed[-1] > law.probs[-1] * 2  # long responses over-represented


def test_joint_law_simulation_matches_slot_context():
    joint = PromptLengthLaw.from_arrays([10, 10, 300, 300], [5, 50, 5, 50], [0.4, 0.1, 0.1, 0.4])
    a = simulate_async(joint, 16, 200_000, seed=2)
    exact = slot_mean_context(joint.prompts, joint.lengths, joint.probs)
    assert a.step_means()["slot_context"] == pytest.approx(exact, rel=0.01)
