"""Curate the H200 development records the KV4 latency page quotes into one book-readable result file.

The book does not read ``dev/results/``. The KV4 page's account of what the KV4 / KV4-RL kernels do and where
KV4-RL's extra time goes (the decomposition into structure and protected work, the split merge, the edge blocks,
programmatic dependent launch, the query preparation, the layouts that lost, a second run of the benchmark) rests
on probe files there; this script reads exactly those, copies the fields the page uses, and writes
``data/results/gpu/kv4_kernel_anatomy.json`` with each source's values beside its original provenance, verbatim,
and a provenance of the curation itself. Nothing is re-measured and nothing is converted: every value is a field
of its record as recorded (ms, as the probes wrote them; a maximum is one of the record's values), and the page's
helpers (``kvlib.bench.kv4_report``) derive µs, ratios and differences. A missing record or field raises.
Run from the repo root: ``python -m dev.curate_kv4_anatomy``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dev.curate_kernel_anatomy import DEVICE, curate_sources, load_record, write_curated  # noqa: F401 (DEVICE: re-exported)
from kvlib.publish.provenance import repo_root

NAME = "kv4_kernel_anatomy"


def _load(stem: str) -> dict[str, Any]:
    return load_record(repo_root(), stem)


def _row(doc: dict[str, Any], **match) -> dict[str, Any]:
    """The first row of a probe's result list matching ``match`` (the page's choice since these notes began)."""
    rows = doc["results"]["rows"] if isinstance(doc["results"], dict) else doc["results"]
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no row with {match} in record {doc.get('name')!r}")


def _pick(row: dict[str, Any], *fields: str) -> dict[str, Any]:
    return {f: row[f] for f in fields}  # KeyError when the record lacks a field: fail loudly


def _rows(*fields: str, **shapes: dict[str, Any]) -> Callable[[dict], dict[str, Any]]:
    """Extractor: the named ``fields`` of the row of each shape (label -> match)."""
    return lambda doc: {label: _pick(_row(doc, **m), *fields) for label, m in shapes.items()}


B32_16K = dict(batch=32, ctx=16384)


def sweep_variant(shape: str, variant: str) -> Callable[[dict], dict[str, Any]]:
    """Extractor: KV4-RL's time with ``variant`` and with the sweep's own default at one shape of a sweep."""
    def fn(doc):
        rl = doc["results"]["shapes"][shape]["kv4rl"]
        return {"shape": shape, "variant": variant, "it_ms": rl[variant]["ms"], "default_ms": rl["default_fused"]["ms"]}
    return fn


def query_prep(doc) -> dict[str, Any]:
    rows = doc["results"]["rows"]
    return {"b32_1k": _pick(_row(doc, batch=32, ctx=1024), "kv4_ms", "kv4_ieee_ms"),
            "code_mismatch_mma_max": max(r["code_mismatch_mma"] for r in rows),
            "code_mismatch_ieee_max": max(r["code_mismatch_ieee"] for r in rows)}


def pdl(doc) -> dict[str, Any]:
    """KV4's time with and without programmatic dependent launch at every shape (the sweep ran with it off by
    default: its ``pdl`` variant against its ``default``)."""
    return {"shapes": {k: {"pdl_ms": s["kv4"]["pdl"]["ms"], "default_ms": s["kv4"]["default"]["ms"]}
                       for k, s in doc["results"]["shapes"].items()}}


def decompose(doc) -> dict[str, Any]:
    return {"rows": [_pick(r, "batch", "ctx", "kv4_ms", "kv4rl_empty_side_ms", "kv4rl_ms", "structure_ms",
                           "protected_work_ms", "frac") for r in doc["results"]]}


def pipe_edges(doc) -> dict[str, Any]:
    rows = [r for r in doc["results"] if "batch" in r]  # the last entry is the run's agreement check
    out = _rows("kv4_ms", "kv4_pipe_edges_ms", "kv4rl_ms", "kv4rl_pipe_edges_ms", "frac", "frac_pipe_edges",
                b32_16k=B32_16K, b512_4k=dict(batch=512, ctx=4096), ragged=dict(batch=320, ctx=16384))(doc)
    out["max_do"] = max(max(r["kv4_max_do"], r["kv4rl_max_do"]) for r in rows)  # largest output change, any shape
    return out


def rerun(doc) -> dict[str, Any]:
    """The fixed-length rows of the ``kv4`` benchmark run a second time (how far its ratios move between runs)."""
    return {"fixed": [_pick(r, "batch", "ctx_max", "kv4_ms", "kv4rl_ms", "kv4rl_frac_of_kv4")
                      for r in doc["results"]["fixed"]]}


#: source -> (record under dev/results/, what it measured, extractor)
SOURCES: dict[str, tuple[str, str, Callable[[dict], dict[str, Any]]]] = {
    "decompose": ("kv4rl_decompose_pipe", "KV4-RL's extra time over KV4 split into structure (the same launch with an "
                  "empty side buffer) and protected work, edge blocks pipelined", decompose),
    "decompose_peeled": ("kv4rl_decompose_rows8", "the same decomposition before the edge blocks were pipelined",
                         _rows("structure_ms", b32_16k=B32_16K)),
    "structure": ("kv4rl_structure", "KV4-RL with an empty side buffer, with and without the merge launch",
                  _rows("kv4_ms", "kv4rl_empty_side_ms", "kv4rl_empty_side_no_merge_ms",
                        b32_16k=dict(batch=32), b128_16k=dict(batch=128))),
    "pipe_edges": ("kv4rl_edges_run1", "the main region's partial edge blocks inside the pipelined loop against "
                   "peeled before and after it", pipe_edges),
    "side_launch": ("kv4rl_side_r64_c100", "a second kernel for the side slots and edge blocks, and the merge inside "
                    "the decode launch", _rows("kv4rl_side_ms", "kv4rl_side_r64_sb32_c100_ms", "kv4rl_ms",
                                               "kv4rl_fused_ms", "kv4_ms", "kv4_fused_ms", b32_16k=B32_16K,
                                               b8_32k=dict(batch=8, ctx=32768))),
    "last_split": ("kv4_sweep_plans2", "the last INT4 split running the side slots after its blocks",
                   sweep_variant("b32_s16k", "last_fused")),
    "fold": ("kv4rl_fold", "the first split running the side slots before its blocks",
             _rows("kv4rl_fold_ms", "kv4rl_pipe_edges_ms", b32_16k=B32_16K)),
    "side_merge": ("kv4rl_side_merge", "a persistent merge launch attending over the side slots",
                   _rows("kv4rl_side_merge2_ms", "kv4rl_pipe_edges_ms", b32_16k=B32_16K)),
    "edge_program": ("kv4rl_edge", "the partial edge blocks in one more program per pair",
                     _rows("kv4rl_edge_ms", "kv4rl_ms", b32_16k=B32_16K)),
    "edge_bias": ("kv4rl_bias", "the edge mask as a -inf bias, set by a branch or read from a table",
                  _rows("kv4rl_bias_branch_ms", "kv4rl_bias_table_ms", "kv4rl_ms", b32_16k=B32_16K)),
    "two_splits": ("kv4rl_s2", "two INT4 splits instead of the plan's one",
                   _rows("kv4rl_s2_ms", "kv4rl_ms", b32_16k=B32_16K)),
    "three_ctas": ("kv4rl_edges", "a third CTA per SM for the protected programs (registers capped at 168)",
                   _rows("kv4rl_pe_cap168_ctas3_ms", "kv4rl_pipe_edges_ms", b32_16k=B32_16K)),
    "packed": ("kv4_sweep_packed2", "several protected pairs packed per program",
               sweep_variant("b32_s16k", "packed_fused")),
    "order": ("kv4_sweep_order", "the grid ordered so each protected program starts beside its INT4 program",
              sweep_variant("b512_s4k", "interleave_fused")),
    "prot_prefetch": ("kv4_sweep_prot", "the protected program's side steps loaded one step ahead",
                      sweep_variant("b512_s4k", "prot_prefetch_fused")),
    "pdl": ("kv4_sweep_pdl", "programmatic dependent launch against none, KV4, every shape of the sweep", pdl),
    "query_prep": ("kv4_prep_probe_mma", "the query's rotation as exact bf16 pieces on tensor cores against an fp32 "
                   "FMA dot", query_prep),
    "rerun": ("kv4_rerun", "the kv4 latency benchmark run a second time", rerun),
}


def curate() -> dict[str, Any]:
    return curate_sources(SOURCES, NAME, "python -m dev.curate_kv4_anatomy", load=_load)


def main() -> Path:
    return write_curated(curate())


if __name__ == "__main__":
    main()
