"""Benchmarks: one timing harness (:mod:`kvlib.bench.timing`), one module per topic.

A topic is a module with ``run(profile) -> dict`` whose result ``python -m kvlib.bench`` saves as
``data/results/<profile>/<topic>.json``. :data:`TOPICS` lists them all, by name; any other module here
is shared code (``timing``: the harness) and has no ``run``. Development probes and sweeps live in the
top-level ``dev/`` (``python -m dev.<name>``), outside the package.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: topic name -> the module whose ``run(profile)`` produces it; the name is the result file's stem.
TOPICS: dict[str, str] = {
    "decode_grid": "kvlib.bench.decode_grid",
    "e2e": "kvlib.bench.e2e",
    "kv4": "kvlib.bench.kv4",
    "kv_vs_weight": "kvlib.bench.kv_vs_weight",
    "peers": "kvlib.bench.peers",
    "peers_hf": "kvlib.bench.peers_hf",
    "replay": "kvlib.bench.replay",
    "sass_count": "kvlib.bench.sass_count",
    "witcert_decode": "kvlib.bench.witcert_decode",
    "witcert_write": "kvlib.bench.witcert_write",
    "wspec_decode": "kvlib.bench.wspec_decode",
}


def topic_module(name: str) -> ModuleType:
    """The module of topic ``name`` (imported on demand: topics pull in kernels and transformers)."""
    if name not in TOPICS:
        raise ValueError(f"topic must be one of {sorted(TOPICS)}, got {name!r}")
    return importlib.import_module(TOPICS[name])
