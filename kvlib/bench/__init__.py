"""Benchmarks: one timing harness (:mod:`kvlib.bench.timing`), one module per topic."""
