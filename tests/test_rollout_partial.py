"""Quota-based partial collection model: pool arithmetic, invariants, and the kappa-concurrency effect."""

from __future__ import annotations

import numpy as np
import pytest

from kvlib.rollout import lognormal_law
from kvlib.rollout.partial import CACHE_FORMATS, KAPPA_BF16, PagePool, make_pool, simulate_collection


def test_pool_arithmetic_matches_paper_definitions():
    # App. B: 83,022 / 79,639 BF16 pages of 16 positions; kappa = 73,728 B per position per GPU
    assert make_pool("bf16", model="4B").positions == 83_022 * 16
    assert make_pool("bf16", model="8B").positions == 79_639 * 16
    assert CACHE_FORMATS["int4"].kappa() == pytest.approx(KAPPA_BF16 * 4.25 / 16)
    pools = [make_pool(f) for f in ("bf16", "int8", "int4", "int4+side")]
    assert [p.positions for p in pools][:3] == sorted(p.positions for p in pools[:3])  # smaller kappa, more room
    assert pools[3].positions < pools[2].positions  # the side buffer is reserved out of the same HBM
    for p in pools:
        assert p.positions * p.kappa + p.max_requests * p.fmt.side_bytes_per_request() <= p.budget_bytes
    with pytest.raises(ValueError, match="fmt"):
        make_pool("fp3")


def _small(fmt: str, **kw):
    law = lognormal_law(300, 0.7, 3000)
    pool = PagePool(CACHE_FORMATS[fmt], pages_bf16=450, max_requests=96)
    return simulate_collection(law, pool=pool, P=64, T=8, G=4, updates=6, warmup=2, seed=3, **kw)


@pytest.mark.parametrize("synchronous", [False, True])
def test_invariants(synchronous):
    r = _small("bf16", synchronous=synchronous, eta=2)
    assert np.all(r.trace["pages"] <= r.pool.pages)
    assert np.all(r.trace["batch"] <= r.pool.max_requests) and np.all(r.trace["batch"] >= 1)
    assert np.all(r.updates["max_unfinished_age"] < 2)  # eta: no group that old is left unfinished
    if synchronous:
        assert np.all(r.updates["carried_requests"] == 0)
        # without a quota boundary to cross, recompute comes only from preemption
        assert np.all(r.updates["reprefill_tokens"][r.updates["preemptions"] == 0] == 0)
        assert np.all(r.updates["new_groups"] == 8)
    s = r.summary()
    assert 0 < s["pool_fill"] <= 1 and 0 <= s["carried_fraction"] < 1


def test_smaller_kappa_admits_more_near_capacity():
    bf16, int4 = _small("bf16").summary(), _small("int4").summary()
    assert bf16["page_limited_fraction"] > 0.05  # this toy pool binds at BF16
    assert int4["mean_batch"] > bf16["mean_batch"]
    assert int4["preemptions_per_update"] <= bf16["preemptions_per_update"]


def test_partial_collection_beats_sync_on_concurrency():
    assert _small("bf16").summary()["mean_batch"] > _small("bf16", synchronous=True).summary()["mean_batch"]


def test_bad_arguments():
    law = lognormal_law(300, 0.7, 3000)
    with pytest.raises(ValueError, match="beta"):
        simulate_collection(law, beta=-1)
    with pytest.raises(ValueError, match="T"):
        simulate_collection(law, T=0)
    with pytest.raises(ValueError, match="warmup"):
        simulate_collection(law, updates=2, warmup=2)
    with pytest.raises(TypeError, match="law"):
        simulate_collection([1, 2])
    with pytest.raises(ValueError, match="pool"):
        simulate_collection(law, pool=PagePool(CACHE_FORMATS["bf16"], pages_bf16=10))
