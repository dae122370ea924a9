"""The kernel page's helpers over the curated H200 records (``witcert_kernel_anatomy``), and the curation itself:
its values are those of the development records it names, with their provenance copied verbatim."""

import json
import math

import pytest

from kvlib.bench import witcert_report as wr
from kvlib.publish.provenance import load_result, repo_root

curate_mod = pytest.importorskip("dev.curate_kernel_anatomy")  # dev/ is not installed; present in a checkout


@pytest.fixture(scope="module")
def fresh():
    if not (repo_root() / "dev" / "results" / "h10_probe4.json").exists():
        pytest.skip("development records absent")
    return curate_mod.curate()


def test_curation_copies_each_source_provenance_verbatim(fresh):
    for key, (stem, _what, _fn) in curate_mod.SOURCES.items():
        raw = json.loads((repo_root() / "dev" / "results" / f"{stem}.json").read_text())
        s = fresh["results"]["sources"][key]
        assert s["provenance"] == raw["provenance"]
        assert s["record"] == f"dev/results/{stem}.json"
    pv = fresh["provenance"]
    assert pv["device"]["device"] == curate_mod.DEVICE
    assert pv["params"]["sources"] == sorted(f"dev/results/{s}.json" for s, _, _ in curate_mod.SOURCES.values())


def test_curation_gives_every_value_the_page_reads(fresh):
    v = wr.anatomy_values(fresh)
    for keys in wr.ANATOMY_KEYS.values():
        for k in keys:
            assert k in v
            assert isinstance(v[k], str) or math.isfinite(v[k]), k
    # properties of the measurements themselves, not of the copying
    assert v["abl_floor_ms"] < min(v["abl_no_pv_ms"], v["abl_no_qk_ms"], v["abl_nophilox_ms"]) < v["abl_cert_ms"]
    assert v["p8_cost_dot_8_32k"] < v["p8_cost_fma_8_32k"]
    assert all(v[f"p12_{lay}_{g}_lo"] <= v[f"p12_{lay}_{g}_hi"] for lay in ("h10", "h8") for g in ("gqa4", "gqa7"))
    assert 0 < v["pp_probe_gap"] < 1


def test_committed_anatomy_matches_a_fresh_curation(fresh):
    committed = load_result("witcert_kernel_anatomy", "gpu")
    if committed is None:
        pytest.skip("data/results/gpu/witcert_kernel_anatomy.json absent")
    assert json.loads(json.dumps(committed["results"])) == json.loads(json.dumps(fresh["results"]))


def test_recorded_state_reads_dirty_and_uncommitted_notes():
    head = curate_mod.parse_commit("HEAD")  # any commit of this repository
    sha = head[0]
    if sha is None:
        pytest.skip("not a git checkout")
    assert curate_mod.recorded_state({"commit": sha})["ran_uncommitted_code"] is False
    assert curate_mod.recorded_state({"commit": sha + "+dirty"})["ran_uncommitted_code"] is True
    assert curate_mod.recorded_state({"commit": sha, "params": {"command": "an uncommitted script"}})[
        "ran_uncommitted_code"] is True
    assert curate_mod.recorded_state({"commit": "0" * 40})["commit_resolves"] is False


def test_helpers_without_the_file_give_nan_and_none():
    v = wr.anatomy_values(None)
    assert math.isnan(v["abl_cert_ms"]) and math.isnan(v["pp_probe_gap"]) and isinstance(v["pp_throttle"], str)
    assert wr.ablation_parts(None) is None and wr.ncu_stalls(None) is None
    assert len(wr.anatomy_sources(None)) == 0


def test_stalls_and_sources_tables(fresh):
    st = wr.ncu_stalls(fresh)
    for kernel, g in st.groupby("kernel"):
        assert g["share"].sum() == pytest.approx(1.0, abs=1e-6), kernel
    parts, sdpa = wr.ablation_parts(fresh)
    assert parts["whole step"] == wr.anatomy_values(fresh)["abl_cert_ms"] and sdpa > 0
    tab = wr.anatomy_sources(fresh)
    assert len(tab) == len(curate_mod.SOURCES)
    assert set(tab["code committed"]) <= {"yes", "no"}
    assert not tab["measurement"].str.contains("dev/").any()
