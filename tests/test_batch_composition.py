"""The batch-composition measure of issue 37, item 4 (kvlib.analysis.batch_composition)."""

import pytest
import torch
from hf_helpers import prompt, tiny_model

from kvlib.analysis.batch_composition import batch_spread

torch.set_num_threads(1)


def test_full_precision_spread_is_rounding_and_kv4_is_at_least_that():
    model = tiny_model()
    target = prompt(1, 30, seed=5)[0]
    res = batch_spread(model, target, 20, "kv4", sizes=(1, 3, 5))
    assert res["positions"] == 10
    # the model's own fp32 path differs between batch shapes by matmul rounding only: a few ulps of the logits
    assert res["max_std_fp32"] < 1e-4
    assert res["argmax_flips_fp32"] == 0.0
    # the same target and batches through the full-precision spec give exactly the fp32 measure
    same = batch_spread(model, target, 20, "fp32", sizes=(1, 3, 5))
    assert same["max_abs"] == same["max_abs_fp32"] and same["amplification"] == 1.0
    assert res["max_abs"] >= 0 and res["amplification"] >= 0


def test_alone_run_is_the_reference():
    model = tiny_model()
    target = prompt(1, 16, seed=6)[0]
    one = batch_spread(model, target, 10, "kv4", sizes=(1, 1))  # the same composition twice: deterministic
    assert one["max_abs"] == 0.0 and one["max_abs_fp32"] == 0.0


@pytest.mark.parametrize("bad", [dict(sizes=()), dict(sizes=(0, 2))])
def test_bad_sizes_refused(bad):
    with pytest.raises(ValueError, match="sizes"):
        batch_spread(tiny_model(), prompt(1, 8)[0], 4, "kv4", **bad)


def test_target_must_be_one_sequence():
    with pytest.raises(ValueError, match="target"):
        batch_spread(tiny_model(), prompt(2, 8), 4, "kv4")
