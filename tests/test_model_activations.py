"""Real-activation analyses (outlier-pair stability, coverage vs budget) on planted and real keys."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from kvlib.analysis import real_activations as ra
from kvlib.hf import model as kvmodel


def planted_acts(S: int = 64, d: int = 64, n_kv: int = 2, g: int = 2, seed: int = 0) -> dict:
    """Two layers of random q/k with massive pairs planted at fixed channels (3 and 3 + d/2)."""
    gen = torch.Generator().manual_seed(seed)
    acts = {}
    for layer in (0, 1):
        k = torch.randn(1, n_kv, S, d, generator=gen)
        k[..., [3, 3 + d // 2]] *= 40.0
        q = torch.randn(1, n_kv * g, S, d, generator=gen)
        acts[layer] = {"q": q, "k": k, "v": torch.randn_like(k)}
    return acts


def test_small_helpers() -> None:
    assert ra.pair_ids(torch.tensor([3, 35, 7, 39]), 64) == {3, 7}
    assert ra.jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3)
    assert ra.jaccard(set(), set()) == 1.0
    pos = ra.query_positions(100, 5)
    assert pos[0] == 50 and pos[-1] == 99 and len(pos) == 5


def test_planted_pair_is_stable() -> None:
    jac = ra.pair_stability(planted_acts(), m=1)
    assert len(jac) == 4 and (jac.jaccard == 1.0).all()


def test_certify_budget_sound_and_bypass_helps() -> None:
    certs = ra.certify_budget(planted_acts(), [0, 1], n_layers=2, n_queries=4, delta_req=0.01, steps=4)
    assert set(certs.m) == {0, 1} and len(certs) == 2 * 2 * 4 * 4  # m x layers x q heads x positions
    tab = ra.budget_table(certs, tau=0.2, d=64)
    assert tab.loc[0, "violations"] == 0 and tab.loc[1, "violations"] == 0
    assert tab.loc[1, "max_cert"] < tab.loc[0, "max_cert"]  # bypassing the massive pair shrinks the scale
    assert tab.loc[1, "key_bytes"] == tab.loc[0, "key_bytes"] + 4  # one pair = 2 fp16 values
    assert 0.0 <= tab.loc[0, "fallback"] <= 1.0
    assert np.isfinite(tab["max_A"]).all() and (tab["max_A"] >= 1.0).all()


@pytest.mark.skipif(not kvmodel.model_available(), reason=f"SmolLM2 GGUF absent; {kvmodel.install_command()}")
def test_outlier_table_feeds_the_cache() -> None:
    from kvlib.hf.cache import make_cache

    model, tok = kvmodel.load_model()
    small = kvmodel.truncated_model(model, 2)
    ids = tok("The quick brown fox jumps over the lazy dog again and again.", return_tensors="pt").input_ids
    table = ra.outlier_table(small, ids, 4)
    assert table.shape == (2, 3, 8) and table.dtype == torch.int64
    cache = make_cache("dither-int8", small.config, outlier_table=table)
    with torch.no_grad():
        small(ids, past_key_values=cache)
    p = cache.layers[1].packed[0][0][2]
    assert torch.equal(p.outlier_channels, table[1, 2]) and p.outliers.shape == (ids.shape[1], 8)
    assert cache.layers[1].packed[1][0][2].outliers is None  # values: no bypass by default


def test_ablation_errors_match_certify_budget_and_bypass_helps() -> None:
    acts = planted_acts()
    for a in acts.values():  # a massive value channel too, so the V bypass has something to remove
        a["v"][..., [5, 5 + 32]] *= 40.0
    errs = ra.ablation_errors(acts, m=1, n_layers=2, n_queries=4, delta_req=0.01, steps=4)
    assert len(errs) == 2 * 2 * 2 * 4 * 4  # quantizers x budgets x layers x q heads x positions
    assert (errs.rel_err > 0).all() and np.isfinite(errs.rel_err).all()
    assert errs.loc[errs.quantizer == "rtn", "cert"].isna().all()
    # the vectorised (causally masked) certificate equals the per-position reference of certify_budget
    ref = ra.certify_budget(acts, [0, 1], n_layers=2, n_queries=4, delta_req=0.01, steps=4)
    mine = errs[errs.quantizer == "dither"].merge(ref, on=["m", "layer", "q_head", "t"], suffixes=("", "_ref"))
    assert len(mine) == len(ref)
    np.testing.assert_allclose(mine["cert"], mine["cert_ref"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mine["tv_true"], mine["tv_true_ref"], rtol=1e-9, atol=1e-15)
    tab = ra.ablation_table(errs, tau=0.2, d=64)
    assert tab.loc[("dither", 0), "violations"] == 0 and tab.loc[("dither", 1), "violations"] == 0
    assert tab.loc[("rtn", 0), "violations"] == -1 and np.isnan(tab.loc[("rtn", 1), "coverage"])
    for qn in ra.QUANTIZERS:  # bypassing the planted pairs lowers the output error
        assert tab.loc[(qn, 1), "err_mean"] < tab.loc[(qn, 0), "err_mean"]
    assert tab.loc[("dither", 1), "bytes_kv"] == ra.kv_bytes(64, 1) == 2 * (64 + 4 + 4)
    with pytest.raises(ValueError, match="quantizers"):
        ra.ablation_errors(acts, m=1, n_layers=2, quantizers=("sr",))


def test_ablation_exact_when_every_channel_is_bypassed() -> None:
    """fp16-representable activations with all d/2 pairs bypassed are stored exactly: zero error."""
    acts = {i: {n: t.half().float() for n, t in a.items()} for i, a in planted_acts(d=64).items()}
    errs = ra.ablation_errors(acts, m=32, n_layers=2, n_queries=2, steps=2)
    full = errs[errs.m == 32]
    assert (full.rel_err == 0).all() and (full.tv_true == 0).all()
    assert (errs[errs.m == 0].rel_err > 0).all()


@pytest.mark.skipif(not kvmodel.model_available(), reason=f"SmolLM2 GGUF absent; {kvmodel.install_command()}")
def test_truncated_capture_equals_full_capture() -> None:
    """The ablation notebook captures through a truncated model: the kept layers must be unchanged."""
    model, tok = kvmodel.load_model()
    ids = tok("def f(x):\n    return x * 2  # double it", return_tensors="pt").input_ids
    full = ra.capture(model, ids, [0, 2])
    part = ra.capture(kvmodel.truncated_model(model, 3), ids, [0, 2])
    for i in (0, 2):
        for n in ("q", "k", "v"):
            assert torch.equal(full[i][n], part[i][n])
    errs = ra.ablation_errors(part, m=4, n_layers=30, n_queries=2, steps=2)
    assert set(errs.quantizer) == {"dither", "rtn"} and (errs.rel_err >= 0).all()


def test_dither_keys_equals_quantize_then_dequantize() -> None:
    """The budget sweep's one-Philox-draw write/read gives bit for bit the format's numbers."""
    from kvlib.core.philox import dither
    from kvlib.formats.dither_int8 import dither_dequantize, dither_quantize

    k = planted_acts(S=48)[0]["k"][0, 1]
    xi = dither(torch.arange(48), 64, layer=3, kv_head=1, seed=7)
    for oc in (None, torch.tensor([3, 10, 35, 42])):
        qt = dither_quantize(k, layer=3, kv_head=1, slots=torch.arange(48), seed=7, outlier_channels=oc)
        k_hat, scales, outliers = ra.dither_keys(k, xi, oc)
        assert torch.equal(k_hat, dither_dequantize(qt)) and torch.equal(scales, qt.scales)
        assert (outliers is None) == (qt.outliers is None)
        if outliers is not None:
            assert torch.equal(outliers, qt.outliers)
    with pytest.raises(ValueError, match="fp16 scale"):
        ra.dither_keys(k * 1e9, xi)


def _certs_frame(over: np.ndarray, g: int = 3) -> pd.DataFrame:
    """Rows (m=0, layer 0, q_head j, t) with cert 1.0 where ``over[t, j]`` else 0.0."""

    T, H = over.shape
    return pd.DataFrame([{"m": 0, "layer": 0, "kv_head": j // g, "q_head": j, "t": t,
                          "cert": 1.0 if over[t, j] else 0.0} for t in range(T) for j in range(H)])


def test_group_exceedance_known_answers() -> None:
    rng = np.random.default_rng(0)
    T = 400
    shared = rng.random((T, 2)) < 0.3  # one exceedance event per KV group, shared by its 3 heads
    together = np.repeat(shared, 3, axis=1)
    r = ra.group_exceedance(_certs_frame(together), tau=0.2).loc[0]
    assert r.phi_within == pytest.approx(1.0)
    assert abs(r.phi_across) < 0.2 and r.pairs_within == 6 and r.pairs_across == 9
    assert r.fallback == pytest.approx(shared.mean())
    assert r.fallback < r.fallback_if_independent_heads <= 1.0
    alone = rng.random((T, 6)) < 0.3
    r2 = ra.group_exceedance(_certs_frame(alone), tau=0.2).loc[0]
    assert abs(r2.phi_within) < 0.15
    assert r2.fallback == pytest.approx(r2.fallback_if_independent_heads, abs=0.06)
    never = ra.group_exceedance(_certs_frame(np.zeros((10, 6), bool)), tau=0.2).loc[0]
    assert np.isnan(never.phi_within) and never.fallback == 0.0


def test_head_max_orders_massive_heads_first() -> None:
    certs = ra.certify_budget(planted_acts(), [0, 1], n_layers=2, n_queries=4, delta_req=0.01, steps=4)
    mx = ra.head_max(certs)
    assert list(mx.columns) == [0, 1] and len(mx) == 2 * 4
    assert (np.diff(mx[0].to_numpy()) <= 0).all()
    assert mx[0].iloc[0] == certs.loc[certs.m == 0, "cert"].max()


def test_pair_stability_calibration_prefix() -> None:
    acts = planted_acts(S=64)
    jac = ra.pair_stability(acts, m=1, calib=8)
    assert (jac.jaccard == 1.0).all()
    with pytest.raises(ValueError, match="calib"):
        ra.pair_stability(acts, m=1, calib=33)


@pytest.mark.skipif(not kvmodel.model_available(), reason=f"SmolLM2 GGUF absent; {kvmodel.install_command()}")
def test_capture_skips_head_and_later_layers_without_changing_activations() -> None:
    model, tok = kvmodel.load_model()
    ids = tok("Once upon a time there was a key cache.", return_tensors="pt").input_ids
    ref = kvmodel.prefill_activations(model, ids, [1, 4])
    mine = ra.capture(model, ids[0], [4, 1])
    assert sorted(mine) == [1, 4]
    for i in (1, 4):
        for n in ("q", "k", "v"):
            assert torch.equal(ref[i][n], mine[i][n])
    with pytest.raises(ValueError, match="layers"):
        ra.capture(model, ids, [model.config.num_hidden_layers])
