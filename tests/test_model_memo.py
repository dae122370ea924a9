"""The on-disk store of model computations (kvlib.hf.memo): a hit returns the first computation bit for bit, and
every input of the key (weights, inputs, code) makes a new entry when it changes."""

import pytest
import torch

from kvlib.hf import memo


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_MODEL_CACHE", str(tmp_path / "store"))
    return tmp_path / "store"


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4)


def _forward(model, x):
    calls = []

    def compute():
        calls.append(1)
        with torch.no_grad():
            return {"y": model(x), "y2": model(x) * 2}

    return compute, calls


def test_a_second_identical_computation_is_read_back_bit_for_bit(store):
    model, x = _model(), torch.randn(3, 8)
    compute, calls = _forward(model, x)
    first, s1, hit1 = memo.memoized("demo", model, {"x": x}, (_forward,), compute)
    again, s2, hit2 = memo.memoized("demo", model, {"x": x}, (_forward,), compute)
    assert (hit1, hit2) == (False, True) and len(calls) == 1
    assert s2 == s1  # the seconds of the computation, not of the read
    for k in first:
        assert torch.equal(first[k], again[k]) and first[k].dtype == again[k].dtype
    assert len(list(store.rglob("*.safetensors"))) == 1


def test_weights_inputs_and_code_each_make_a_new_entry(store):
    model, x = _model(), torch.randn(3, 8)
    compute, calls = _forward(model, x)
    memo.memoized("demo", model, {"x": x}, (_forward,), compute)
    memo.memoized("demo", _model(seed=1), {"x": x}, (_forward,), compute)  # other weights
    memo.memoized("demo", model, {"x": x + 1e-7}, (_forward,), compute)  # other input bytes
    memo.memoized("demo", model, {"x": x}, (_model,), compute)  # other code
    memo.memoized("demo", model, {"x": x.to(torch.float64)}, (_forward,), compute)  # other dtype
    assert len(calls) == 5


def test_off_computes_every_time_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_MODEL_CACHE", "off")
    model, x = _model(), torch.randn(3, 8)
    compute, calls = _forward(model, x)
    for _ in range(2):
        _, _, hit = memo.memoized("demo", model, {"x": x}, (_forward,), compute)
        assert not hit
    assert len(calls) == 2


def test_bad_arguments_are_refused(store):
    model = _model()
    with pytest.raises(ValueError, match="kind"):
        memo.memoized("a/b", model, {}, (), lambda: {})
    with pytest.raises(TypeError, match="model"):
        memo.weights_digest(object())
    with pytest.raises(TypeError, match="cannot key"):
        memo.key_of("demo", model, {"x": object()}, ())
    with pytest.raises(TypeError, match="dict of tensors"):
        memo.memoized("demo", model, {}, (), lambda: {"x": 1})


def test_real_capture_from_the_store_equals_a_fresh_capture(smol, store):
    from kvlib.analysis import real_activations as ra

    model, tok = smol
    ids = tok("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids
    first = ra.capture(model, ids, [0, 3], keep=("k", "q"))
    again = ra.capture(model, ids, [0, 3], keep=("k", "q"))
    assert memo.STATS["capture_qkv"]["hits"] >= 1
    for layer in (0, 3):
        assert set(again[layer]) == {"q", "k"}
        for t in ("q", "k"):
            assert torch.equal(first[layer][t], again[layer][t])
    import os

    os.environ["KVLIB_MODEL_CACHE"] = "off"
    try:
        fresh = ra.capture(model, ids, [0, 3], keep=("k",))
    finally:
        os.environ["KVLIB_MODEL_CACHE"] = str(store)
    assert torch.equal(fresh[3]["k"], first[3]["k"])
    with pytest.raises(ValueError, match="keep"):
        ra.capture(model, ids, [0], keep=("x",))
