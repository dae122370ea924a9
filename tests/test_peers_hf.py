"""HF transformers' quantized KV cache as a peer (:mod:`kvlib.bench.peers_hf`): quanto's dequantised keys
lie within one quantisation step of the originals, the byte account of what the cache holds, the
whole-cache dequantise / re-quantise path, and the ``run("ci")`` wiring (including peers that cannot
import). Tests needing quanto or HQQ skip when their wheels are absent (``.whl/`` is not in git)."""

from __future__ import annotations

import pytest
import torch

from kvlib.bench import peers_hf as ph


@pytest.fixture(scope="module")
def packages() -> dict[str, str | None]:
    return ph.ensure_peer_packages()


def _need(packages: dict, backend: str) -> None:
    if packages.get(backend) is not None:
        pytest.skip(f"{backend} cannot import here: {packages[backend]}")


def _kv(b: int, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (b, ph.GQA[1], s, ph.D)
    k = torch.randn(shape, generator=g) * (1 + torch.rand(shape, generator=g) * 3)  # uneven group ranges
    return k.to(torch.bfloat16), torch.randn(shape, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("bits", [2, 4])
def test_unpack_bits_torch_inverts_quanto_packing(packages, bits):
    _need(packages, "quanto")
    from optimum.quanto.tensor.packed import PackedTensor

    g = torch.Generator().manual_seed(bits)
    for rows in (8, 13):  # a multiple of 8 // bits and not: PackedTensor pads, unpack trims
        t = torch.randint(0, 2**bits, (rows, 64), generator=g, dtype=torch.uint8)
        packed = PackedTensor.pack(t, bits=bits)
        with ph.quanto_unpack("torch"):
            assert torch.equal(packed.unpack(), t)


@pytest.mark.parametrize("nbits", [4, 2])
def test_quanto_dequantised_keys_within_one_step(packages, nbits):
    """Keys read back through HF's QuantizedCache (quanto, axis 0: groups of 64 along d) differ from the
    originals by at most one quantisation step of their group, (max - min) / (2**nbits - 1); the
    bf16 residual and the new token come back exactly."""
    _need(packages, "quanto")
    s, r = 128, 5
    k, v = _kv(2, s + r + 1, seed=nbits)
    cache = ph.make_quantized_cache("quanto", nbits, residual_length=64)
    with ph.quanto_unpack("torch"):
        cache.update(k[:, :, :s], v[:, :, :s], 0)
        cache.update(k[:, :, s:s + r], v[:, :, s:s + r], 0)  # goes to the bf16 residual
        kk, vv = cache.update(k[:, :, s + r:], v[:, :, s + r:], 0)
    assert kk.shape == k.shape and kk.dtype == torch.bfloat16
    assert torch.equal(kk[:, :, s:], k[:, :, s:]) and torch.equal(vv[:, :, s:], v[:, :, s:])
    for got, ref in ((kk, k), (vv, v)):
        groups = ref[:, :, :s].float().reshape(-1, ph.Q_GROUP)
        err = (got[:, :, :s].float().reshape(-1, ph.Q_GROUP) - groups).abs()
        step = (groups.amax(1, keepdim=True) - groups.amin(1, keepdim=True)) / (2**nbits - 1)
        assert bool((err <= step * 1.001 + 1e-6).all())
        assert float((err / step).mean()) < 0.35  # round-to-nearest: about a quarter step on average


def test_int2_coarser_than_int4(packages):
    _need(packages, "quanto")
    k, v = _kv(1, 129, seed=7)
    errs = {}
    for nbits in (4, 2):
        cache = ph.make_quantized_cache("quanto", nbits)
        with ph.quanto_unpack("torch"):
            cache.update(k[:, :, :128], v[:, :, :128], 0)
            kk, _ = cache.update(k[:, :, 128:], v[:, :, 128:], 0)
        errs[nbits] = float((kk[:, :, :128].float() - k[:, :, :128].float()).abs().mean())
    assert 0 < errs[4] < errs[2]


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
@pytest.mark.parametrize("nbits", [4, 2])
def test_held_bytes_is_codes_plus_group_scale_and_zero(packages, backend, nbits):
    """Both backends store nbits codes plus a bf16 scale and a bf16 zero per group of 64 values:
    nbits + 32 / 64 bits per value, measured from the cache's own tensors."""
    _need(packages, backend)
    k, v = _kv(1, 64, seed=1)
    cache = ph.make_quantized_cache(backend, nbits)
    with ph.quanto_unpack("torch") if backend == "quanto" else torch.no_grad():
        cache.update(k, v, 0)
    sizes = ph.layer_bytes(cache.layers[0])
    n_values = 2 * k.numel()
    assert sizes["residual_bytes"] == 0
    assert sizes["quantized_bytes"] * 8 / n_values == pytest.approx(nbits + 32 / ph.Q_GROUP)
    assert ph.held_bytes({"a": [torch.zeros(3, dtype=torch.float32)], "b": (torch.zeros(2, dtype=torch.uint8),)}) == 14


def test_update_dequantises_whole_cache_and_requantises_it_at_flush(packages):
    _need(packages, "quanto")
    s, r = 64, 8
    k, v = _kv(1, s + r, seed=3)
    cache = ph.make_quantized_cache("quanto", 4, residual_length=r)
    with ph.quanto_unpack("torch"):
        cache.update(k[:, :, :s], v[:, :, :s], 0)
        seen = [ph.probe_update_path(cache, k[:, :, s + i:s + i + 1], v[:, :, s + i:s + i + 1]) for i in range(r)]
    # every step dequantises all s quantised tokens (keys and values); only the r-th step re-quantises,
    # and then the whole cache (s + r tokens), not the residual alone
    assert all(x["dequantize_tokens"] == [s, s] for x in seen)
    assert [x["quantize_tokens"] for x in seen] == [[]] * (r - 1) + [[s + r, s + r]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        ph.make_quantized_cache("nope", 4)
    with pytest.raises(ValueError, match="nbits"):
        ph.make_quantized_cache("quanto", 3)
    with pytest.raises(ValueError, match="bits"):
        ph.unpack_bits_torch(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="packed"):
        ph.unpack_bits_torch(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="backends"):
        ph.run("ci", backends=("nope",))
    with pytest.raises(ValueError, match="profile"):
        ph.run("fast")


def test_run_records_peers_that_cannot_import(monkeypatch):
    """A backend that cannot import is recorded with its reason; the baselines still run."""
    monkeypatch.setattr(ph, "ensure_peer_packages", lambda: {"quanto": "ImportError: x", "hqq": "ImportError: y"})
    res = ph.run("ci")
    assert {c["peer"] for c in res["could_not_run"]} == {"hf-quanto", "hf-hqq"}
    assert all("ImportError" in c["could_not_run"] for c in res["could_not_run"])
    assert {r["peer"] for r in res["rows"]} == {"sdpa_bf16", "hf_dynamic_bf16"}


def test_run_ci_structure(packages):
    _need(packages, "quanto")
    res = ph.run("ci")
    assert res["device"] == "cpu" and res["speed_claim"] is False
    peers = {r["peer"] for r in res["rows"]}
    expected = {"sdpa_bf16", "hf_dynamic_bf16", "hf-quanto-int4", "hf-quanto-int2"}
    if packages.get("hqq") is None:
        expected |= {"hf-hqq-int4", "hf-hqq-int2"}
    assert expected <= peers, res["could_not_run"]
    for c in res["could_not_run"]:
        assert isinstance(c["peer"], str) and isinstance(c["could_not_run"], str)
    for row in res["rows"]:
        if row["peer"] == "sdpa_bf16":
            assert row["speedup_vs_sdpa"] == 1.0
            continue
        if not row["peer"].startswith("hf-"):
            continue
        assert row["step_q25_ms"] <= row["step_ms"] <= row["step_q75_ms"]
        r = res["config"]["residual_length"]
        assert row["amortized_ms"] == pytest.approx(((r - 1) * row["step_ms"] + row["flush_ms"]) / r)
        assert row["speedup_vs_sdpa"] == pytest.approx(row["sdpa_bf16_ms"] / row["amortized_ms"])
        assert row["quantized_bytes"] + row["residual_bytes"] == row["held_bytes"] < row["bf16_bytes"]
        assert row["whole_cache_dequantised_each_step"] and row["whole_cache_requantised_at_flush"]
        assert 0 < row["key_max_abs_err"] <= row["key_range"]
    assert set(res["summary"]) == peers
    assert res["summary"]["sdpa_bf16"]["speedup_vs_sdpa_max"] == 1.0
