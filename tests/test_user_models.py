"""What a user's model, inputs and environment can do to kvlib's caches (issue 37): each is handled, or refused
at the call that takes it with an error naming the argument."""

from __future__ import annotations

import math

import pytest
import torch
from hf_helpers import prompt, tiny_model

import kvlib
from kvlib.hf.gate import make_gated_cache

torch.set_num_threads(1)


# -- item 8: validation names the argument -----------------------------------------------------------

@pytest.mark.parametrize("fmt,opts,exc,match", [
    ("fp32", dict(tau=-1), ValueError, "tau"),
    ("fp32", dict(tau=math.nan), ValueError, "tau"),
    ("fp32", dict(tau="0.2"), TypeError, "tau"),
    ("fp32", dict(tau="abc"), TypeError, "tau"),
    ("fp32", dict(tau=True), TypeError, "tau"),
    ("fp32", dict(key_options=5), TypeError, "key_options"),
    ("fp32", dict(value_options=[1]), TypeError, "value_options"),
    ("fp32", dict(dtype="float32"), TypeError, "dtype"),
    ("fp32", dict(outlier_sides=(3,)), ValueError, "outlier_sides"),
    ("kv4", dict(group=0), ValueError, "group must be >= 1"),
    ("kivi2", dict(group=48), ValueError, "group=48, residual=128"),
    ("dither-int8", dict(outlier_table=torch.zeros(2, 2, 2)), TypeError, "outlier_table.*integer"),
    ("dither-int8", dict(outlier_table=torch.ones(2, 2, 2, dtype=torch.int64)), ValueError, "outlier_table.*repeat"),
    ("dither-int8", dict(outlier_table=torch.full((2, 2, 2), 40)), ValueError, "outlier_table.*head_dim"),
])
def test_make_cache_names_the_argument(fmt, opts, exc, match):
    with pytest.raises(exc, match=match):
        kvlib.make_cache(fmt, tiny_model().config, **opts)


@pytest.mark.parametrize("opts,exc,match", [
    (dict(tau=True), TypeError, "tau"), (dict(tau="0.2"), TypeError, "tau"), (dict(gate="no"), TypeError, "gate"),
    (dict(gate=0), TypeError, "gate"),
])
def test_make_gated_cache_names_the_argument(opts, exc, match):
    with pytest.raises(exc, match=match):
        make_gated_cache("dither-int8", tiny_model().config, **opts)


def test_tau_inf_is_a_threshold():
    assert kvlib.make_cache("fp32", tiny_model().config, tau=math.inf).tau == math.inf


# -- item 7: devices ----------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("static", [False, True])
def test_missing_device_refused(device, static):
    kw = dict(batch_size=1, max_len=32) if static else {}
    with pytest.raises(ValueError, match=r"device='cuda(:0)?'"):
        kvlib.make_cache("fp32", tiny_model().config, device=device, **kw)


def test_device_honoured_without_batch_size():
    """device= without batch_size is checked against where the model's K/V arrive (not silently ignored)."""
    model = tiny_model()
    cache = kvlib.make_cache("fp32", model.config, device="meta")
    with pytest.raises(ValueError, match="device=meta"):
        model(prompt(1, 4), past_key_values=cache, use_cache=True)
