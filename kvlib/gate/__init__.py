"""The certificate gate: a KV cache that checks every decode step's certificate and repairs the rows over ``tau``
in the same step from an opt-in shadow (:mod:`kvlib.gate.cache`). It plugs into :mod:`kvlib.hf.cache` through the
cache's explicit hook (:class:`kvlib.hf.cache.CacheHook`), and sits above it."""

from kvlib.gate.cache import GATE_LEVELS, SHADOWS, GatedCache, gate_kind, gateable_formats, make_gated_cache

__all__ = ["GATE_LEVELS", "SHADOWS", "GatedCache", "gate_kind", "gateable_formats", "make_gated_cache"]
