"""The certificate gate (kvlib.gate): repair semantics, exactness, byte account, deterministic bounds."""

from __future__ import annotations

import pytest
import torch

from kvlib import model as kvmodel
from kvlib.formats.base import get_format
from kvlib.gate import DETERMINISTIC_FORMATS, GatedCache, gate_kind, key_error_bound, make_gated_cache
from kvlib.hf_cache import make_cache

PROMPT = "The river ran past the old mill, and the miller's daughter counted the boats."
GATED = ("dither-int8", "fp8-e4m3", "kivi2")


@pytest.fixture(scope="module")
def small(smol):
    return kvmodel.truncated_model(smol[0], 3)


@pytest.fixture(scope="module")
def ids(smol):
    return smol[1](PROMPT, return_tensors="pt").input_ids[:, :10]


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, cache, steps: int = 3) -> torch.Tensor:
    """Logits ``[steps + 1, vocab]``: prefill, then ``steps`` decode steps feeding fixed tokens."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    for t in range(steps):
        tok = torch.tensor([[100 + 7 * t]])
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("fmt", GATED)
def test_tau_one_never_repairs_and_equals_raw(small, ids, fmt) -> None:
    gated = make_gated_cache(fmt, small.config, tau=1.0)
    got = teacher_forced(small, ids, gated)
    want = teacher_forced(small, ids, make_cache(fmt, small.config))
    s = gated.gate_summary()
    assert s["heads_repaired"] == 0 and s["bytes_moved"] == 0 and s["flagged"] == 0
    assert s["n_certs"] == 4 * small.config.num_hidden_layers * small.config.num_attention_heads
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", GATED)
def test_tau_zero_repairs_every_head_and_equals_exact(small, ids, fmt) -> None:
    gated = make_gated_cache(fmt, small.config, tau=0.0)
    got = teacher_forced(small, ids, gated)
    want = teacher_forced(small, ids, make_cache("fp32", small.config))
    s = gated.gate_summary()
    assert s["heads_repaired"] == s["heads_total"] == small.config.num_hidden_layers * small.config.num_key_value_heads
    assert s["flagged"] == 1
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["dither-int8", "kivi2"])  # stateless and stateful float stores
def test_repairs_written_back_once(small, ids, fmt) -> None:
    gated = make_gated_cache(fmt, small.config, tau=0.0)
    teacher_forced(small, ids, gated, steps=1)
    bytes_after_prefill = gated.bytes_moved
    teacher_forced_more = [torch.tensor([[42]]), torch.tensor([[43]])]
    with torch.no_grad():
        for tok in teacher_forced_more:
            small(input_ids=tok, past_key_values=gated, use_cache=True)
    keys = [(e["layer"], e["row"], e["kv_head"]) for e in gated.events]
    assert len(keys) == len(set(keys))  # each head paged in once
    assert all(e["step"] == 1 for e in gated.events)  # all at prefill (tau = 0)
    assert gated.bytes_moved == bytes_after_prefill  # later steps move nothing
    for i, layer in enumerate(gated.layers):  # the attention's store holds the exact copy
        n = layer.cumulative_length
        assert torch.equal(layer.keys[:, :, :n], gated._exact[i][0][:, :, :n].to(layer.keys.dtype))
        assert torch.equal(layer.values[:, :, :n], gated._exact[i][1][:, :, :n].to(layer.values.dtype))


def test_bytes_moved_counted_from_tensors(small, ids) -> None:
    cfg = small.config
    d = cfg.hidden_size // cfg.num_attention_heads
    for dtype, size in ((None, 4), (torch.float16, 2)):
        gated = make_gated_cache("dither-int8", cfg, tau=0.0, backup_dtype=dtype)
        teacher_forced(small, ids, gated, steps=1)
        n = ids.shape[1]
        expect = cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * n * d * size
        assert gated.bytes_moved == expect == sum(e["bytes"] for e in gated.events)
        assert all(e["tokens"] == n for e in gated.events)


def test_partial_gate_repairs_only_flagged_heads(small, ids) -> None:
    gated = make_gated_cache("dither-int8", small.config, tau=0.2)
    teacher_forced(small, ids, gated, steps=2)
    s = gated.gate_summary()
    assert all(e["cert"] > 0.2 for e in gated.events)
    assert s["heads_repaired"] == len(gated.events) <= s["heads_total"]
    assert (s["flagged"] == 1) == (s["n_over"] > 0) == (s["heads_repaired"] > 0)


def test_flag_only_mode_equals_raw(small, ids) -> None:
    gated = make_gated_cache("dither-int8", small.config, tau=0.0, gate=False)
    got = teacher_forced(small, ids, gated, steps=1)
    assert torch.equal(got, teacher_forced(small, ids, make_cache("dither-int8", small.config), steps=1))
    s = gated.gate_summary()
    assert s["flagged"] == 1 and s["heads_repaired"] == 0 and s["bytes_moved"] == 0


@pytest.mark.parametrize("fmt", DETERMINISTIC_FORMATS)
def test_deterministic_error_bound_holds(fmt) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) * torch.logspace(-3, 2, 64)  # channel magnitudes over 5 decades
    x[::17] *= 30.0
    f = get_format(fmt)
    packed = f.write(x, side=0) if fmt == "kivi2" else f.write(x)
    k_hat = f.read(packed)
    err = key_error_bound(fmt, packed, k_hat)
    assert err.shape == x.shape
    assert bool(((k_hat.double() - x.double()).abs() <= err).all())


def test_bad_arguments(small) -> None:
    with pytest.raises(ValueError, match="gateable"):
        gate_kind("kv4")
    with pytest.raises(ValueError, match="tau"):
        make_gated_cache("dither-int8", small.config, tau=-1.0)
    with pytest.raises(ValueError, match="telemetry"):
        make_gated_cache("dither-int8", small.config, telemetry=True)
    with pytest.raises(TypeError, match="backup_dtype"):
        make_gated_cache("dither-int8", small.config, backup_dtype="fp16")
    with pytest.raises(TypeError, match="cache_class"):
        make_cache("fp32", small.config, cache_class=3)
    assert isinstance(make_gated_cache("fp8-e4m3", small.config), GatedCache)
