"""The KV4 latency page's curated H200 records (``kv4_kernel_anatomy``, written by ``dev.curate_kv4_anatomy``):
every value is a field of the development record it names, copied as recorded, beside that record's provenance;
the committed file is what the curation gives; a missing record fails loudly; the page's helpers read it."""

import json
import math
import shutil

import pandas as pd
import pytest

from kvlib.bench import kv4_report as kr
from kvlib.publish.provenance import load_result, repo_root

curate_mod = pytest.importorskip("dev.curate_kv4_anatomy")  # dev/ is not installed; present in a checkout


def _raw(stem):
    return json.loads((repo_root() / "dev" / "results" / f"{stem}.json").read_text())


@pytest.fixture(scope="module")
def fresh():
    if not all((repo_root() / "dev" / "results" / f"{s}.json").exists() for s, _, _ in curate_mod.SOURCES.values()):
        pytest.skip("development records absent")
    return curate_mod.curate()


def _leaves(x, keys=False):
    """The numbers and strings of a JSON value; with ``keys``, its dict keys too."""
    if isinstance(x, dict):
        for k, v in x.items():
            if keys:
                yield k
            yield from _leaves(v, keys)
    elif isinstance(x, list):
        for v in x:
            yield from _leaves(v, keys)
    elif not isinstance(x, bool) and x is not None:
        yield x


def test_each_source_keeps_its_record_and_provenance_verbatim(fresh):
    for key, (stem, _what, _fn) in curate_mod.SOURCES.items():
        s = fresh["results"]["sources"][key]
        assert s["record"] == f"dev/results/{stem}.json"
        assert s["provenance"] == _raw(stem)["provenance"]
    pv = fresh["provenance"]
    assert pv["device"]["device"] == curate_mod.DEVICE
    assert pv["params"]["sources"] == sorted(f"dev/results/{s}.json" for s, _, _ in curate_mod.SOURCES.values())


def test_every_value_is_a_field_of_its_record(fresh):
    """Nothing is computed or converted at curation: each number occurs in the record it is copied from, and each
    string (a shape or variant label) names a field there."""
    for key, (stem, _what, _fn) in curate_mod.SOURCES.items():
        record = set(_leaves(_raw(stem)["results"], keys=True))
        for leaf in _leaves(fresh["results"]["sources"][key]["values"]):
            assert leaf in record, f"{key}: {leaf!r} is not in dev/results/{stem}.json"


def test_values_equal_their_sources_field_by_field(fresh):
    src = fresh["results"]["sources"]
    raw = _raw("kv4rl_decompose_pipe")["results"]
    assert [r["structure_ms"] for r in src["decompose"]["values"]["rows"]] == [r["structure_ms"] for r in raw]
    sweep = _raw("kv4_sweep_packed2")["results"]["shapes"]["b32_s16k"]["kv4rl"]
    assert src["packed"]["values"]["it_ms"] == sweep["packed_fused"]["ms"]
    assert src["packed"]["values"]["default_ms"] == sweep["default_fused"]["ms"]
    row = next(r for r in _raw("kv4rl_side_r64_c100")["results"] if r.get("batch") == 8 and r.get("ctx") == 32768)
    assert src["side_launch"]["values"]["b8_32k"]["kv4_fused_ms"] == row["kv4_fused_ms"]
    pdl = _raw("kv4_sweep_pdl")["results"]["shapes"]
    assert src["pdl"]["values"]["shapes"]["b32_s1k"]["pdl_ms"] == pdl["b32_s1k"]["kv4"]["pdl"]["ms"]
    assert len(src["pdl"]["values"]["shapes"]) == len(pdl)
    assert src["rerun"]["values"]["fixed"] == [{k: r[k] for k in ("batch", "ctx_max", "kv4_ms", "kv4rl_ms",
                                                                   "kv4rl_frac_of_kv4")}
                                                for r in _raw("kv4_rerun")["results"]["fixed"]]


def test_committed_file_is_a_fresh_curation(fresh):
    committed = load_result("kv4_kernel_anatomy", "gpu")
    if committed is None:
        pytest.skip("data/results/gpu/kv4_kernel_anatomy.json absent")
    assert committed["results"] == json.loads(json.dumps(fresh["results"]))


def test_a_missing_record_or_row_fails_loudly(monkeypatch, tmp_path, fresh):
    (tmp_path / "dev" / "results").mkdir(parents=True)
    monkeypatch.setattr(curate_mod, "repo_root", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match="kv4rl_decompose_pipe"):
        curate_mod.curate()
    for stem, _, _ in curate_mod.SOURCES.values():
        shutil.copy(repo_root() / "dev" / "results" / f"{stem}.json", tmp_path / "dev" / "results")
    doc = _raw("kv4rl_fold")
    doc["results"] = [r for r in doc["results"] if r.get("batch") != 32]
    (tmp_path / "dev" / "results" / "kv4rl_fold.json").write_text(json.dumps(doc))
    with pytest.raises(KeyError, match="no row"):
        curate_mod.curate()


def test_page_values_derive_from_the_curated_fields(fresh):
    v = kr.anatomy_values(fresh)
    assert v and all(math.isfinite(x) for x in v.values()), [k for k, x in v.items() if not math.isfinite(x)]
    rows = fresh["results"]["sources"]["decompose"]["values"]["rows"]
    b32 = next(r for r in rows if (r["batch"], r["ctx"]) == (32, 16384))
    assert v["dec_structure_us"] == b32["structure_ms"] * 1e3
    st = fresh["results"]["sources"]["structure"]["values"]["b32_16k"]
    assert v["struct_merge_us"] == pytest.approx((st["kv4rl_empty_side_ms"] - st["kv4rl_empty_side_no_merge_ms"]) * 1e3)
    # properties of the measurements, not of the copying: the decomposition adds up, ratios are ratios
    for r in rows:
        assert r["kv4_ms"] + r["structure_ms"] + r["protected_work_ms"] == pytest.approx(r["kv4rl_ms"], rel=1e-6)
    assert 0 < v["pdl_mean_ratio"] < 1.1 and v["pdl_n_shapes"] >= 1
    assert v["prep_mismatch_mma"] <= v["prep_mismatch_ieee"]
    tab = kr.decomposition_table(fresh)
    assert list(tab.index.names) == ["B", "S"] and len(tab) == len(rows)
    assert not kr.anatomy_sources(fresh)["measurement"].str.contains("dev/").any()


def test_rerun_rows_read_the_curated_second_run(fresh):
    fixed = pd.DataFrame(fresh["results"]["sources"]["rerun"]["values"]["fixed"])  # a run beside itself
    rr, commit = kr.rerun_rows(fixed, fresh)
    assert commit == fresh["results"]["sources"]["rerun"]["provenance"]["commit"]
    assert (rr.ctx_max >= 16384).all() and len(rr) == (fixed.ctx_max >= 16384).sum()
    assert (rr.kv4rl_frac_of_kv4 == rr.kv4rl_frac_of_kv4_rerun).all()


def test_helpers_without_the_file_give_nan_and_none():
    v = kr.anatomy_values(None)
    assert v and all(math.isnan(x) for x in v.values())
    assert kr.decomposition_table(None) is None and kr.rerun_rows(pd.DataFrame(), None) == (None, None)
    assert len(kr.anatomy_sources(None)) == 0
