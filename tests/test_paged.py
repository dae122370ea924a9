"""Byte account of the paged WitCert pool: from the layout and from the allocated tensors."""

from __future__ import annotations

import pytest
import torch

from kvlib.storage.paged import PagedKV, PagedPool, bytes_per_token_head


def test_paper_136_bytes_at_d128():
    # the paper: "measured memory 136 B/tok/head per side (K+V total 272 B)", G_c = 32, no bypass
    assert bytes_per_token_head(128, 32, 0) == 136
    assert bytes_per_token_head(128, 32, 8) == 152  # m = 4 pairs: + 2m fp16 = 16 B
    assert bytes_per_token_head(64, 32, 0) == 68


@pytest.mark.parametrize("d,group,n_out", [(64, 32, 0), (128, 32, 0), (128, 32, 8), (128, 16, 4)])
def test_layout_equals_allocation(d, group, n_out):
    p = PagedPool(n_layers=3, n_slots=40, n_kv_heads=2, d=d, group=group, n_out=n_out)
    assert p.measured_bytes_per_token_head() == p.bytes_per_token_head() == bytes_per_token_head(d, group, n_out)
    assert p.constant_bytes_per_layer_head() == 8 * n_out
    v = p.layer(2)
    assert v.codes.is_contiguous() and v.codes.shape == (40, 2, d) and v.codes.dtype == torch.int8
    assert v.scales.shape == (40, 2, d // group) and v.scales.dtype == torch.float16
    assert v.outliers.shape == (40, 2, n_out) and v.outlier_channels.shape == (2, n_out)


def test_kv_pair_total():
    kv = PagedKV(n_layers=1, n_slots=8, n_kv_heads=1, d=128, n_out_k=8, n_out_v=0)
    assert kv.bytes_per_token_head() == 152 + 136
    assert kv.pool(1).side == 1


@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(group=48), ValueError),
        (dict(n_out=3), ValueError),
        (dict(side=2), ValueError),
        (dict(n_slots=0), ValueError),
    ],
)
def test_bad_pool_args(kw, exc):
    with pytest.raises(exc):
        PagedPool(**(dict(n_layers=1, n_slots=4, n_kv_heads=1, d=64) | kw))


def test_set_outlier_channels_checks():
    p = PagedPool(n_layers=1, n_slots=4, n_kv_heads=2, d=64, n_out=2)
    p.set_outlier_channels(0, torch.tensor([[40, 8], [1, 33]]))
    assert p.outlier_channels[0].tolist() == [[8, 40], [1, 33]]
    with pytest.raises(ValueError):
        p.set_outlier_channels(0, torch.tensor([[1, 1], [2, 3]]))
    with pytest.raises(ValueError):
        p.set_outlier_channels(0, torch.tensor([[1, 64], [2, 3]]))
