"""KV concentration: exact renewal-reward closed forms, rollout simulators, partial collection.

Reproduces KV4-RL Prop. 4.1 / Appendix C for discrete response-length laws: closed forms in
:mod:`~kvlib.rollout.theory`, vectorised simulators in :mod:`~kvlib.rollout.sim`, and a model of
quota-based partial collection under a KV page pool in :mod:`~kvlib.rollout.partial`.
"""

from kvlib.rollout.laws import (
    LengthLaw,
    PromptLengthLaw,
    bimodal_law,
    degenerate_law,
    geometric_law,
    lognormal_law,
    mixture_law,
    pareto_law,
    uniform_law,
)
from kvlib.rollout.partial import (
    CACHE_FORMATS,
    CacheFormat,
    CollectionResult,
    PagePool,
    make_pool,
    simulate_collection,
)
from kvlib.rollout.sim import Trace, batch_means_se, simulate_async, simulate_sync
from kvlib.rollout.theory import (
    Concentration,
    async_mean_context,
    async_mean_volume,
    concentration,
    concentration_factor,
    expected_max,
    length_biased,
    logical_work,
    max_law,
    slot_mean_context,
    sync_mean_context,
    sync_mean_volume,
    sync_occupancy,
)

__all__ = [
    "CACHE_FORMATS",
    "CacheFormat",
    "CollectionResult",
    "PagePool",
    "make_pool",
    "simulate_collection",
    "Concentration",
    "LengthLaw",
    "PromptLengthLaw",
    "Trace",
    "async_mean_context",
    "async_mean_volume",
    "batch_means_se",
    "bimodal_law",
    "concentration",
    "concentration_factor",
    "degenerate_law",
    "expected_max",
    "geometric_law",
    "length_biased",
    "logical_work",
    "lognormal_law",
    "max_law",
    "mixture_law",
    "pareto_law",
    "simulate_async",
    "simulate_sync",
    "slot_mean_context",
    "sync_mean_context",
    "sync_mean_volume",
    "sync_occupancy",
    "uniform_law",
]
