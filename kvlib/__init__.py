"""kvlib: low-bit KV caches (dithered INT8 with a runtime certificate; INT4 with protected positions)
and the analyses of the WitCert and KV4-RL papers.

The stable public names (the book's API page, ``book/api.md``) are importable from here. They load lazily so that
``import kvlib`` stays cheap and a notebook that needs only the rollout theory never imports Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "philox4x32_10": "kvlib.core.philox",
    "dither_quantize": "kvlib.formats.dither_int8",
    "dither_dequantize": "kvlib.formats.dither_int8",
    "score_radius": "kvlib.certify.bound",
    "certificate": "kvlib.certify.bound",
    "merge_states": "kvlib.core.merge",
    "hadamard": "kvlib.core.hadamard",
    "int4_quantize": "kvlib.formats.kv4",
    "int4_dequantize": "kvlib.formats.kv4",
    "available_formats": "kvlib.formats.base",
    "get_format": "kvlib.formats.base",
    "load_model": "kvlib.hf.model",
    "make_cache": "kvlib.hf.cache",
    "kernel_formats": "kvlib.hf.cache",
    "make_gated_cache": "kvlib.gate",
}
_SUBMODULES = {
    # subpackages by concern; see the package map in README.md
    "core", "formats", "storage", "certify", "kernels", "backends", "hf", "gate", "analysis", "rollout", "bench",
    "publish",
    # the API page's public module path (kvlib.stats.paired_bootstrap_ci, kvlib.stats.mcnemar)
    "stats",
}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"kvlib.{name}")
    raise AttributeError(f"module 'kvlib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
