"""Hadamard rotation: orthonormal, involutive, and score-preserving for rotated q and k."""

import pytest
import torch

from kvlib.core.hadamard import hadamard, hadamard_matrix


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_orthonormal_and_symmetric(d):
    h = hadamard_matrix(d)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=h.dtype), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, d**-0.5))


def test_matches_matrix_and_is_involution():
    x = torch.randn(4, 3, 128, dtype=torch.float64)
    h = hadamard_matrix(128)
    assert torch.allclose(hadamard(x), x @ h.T, atol=1e-12)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-12)


def test_scores_unchanged_by_rotating_q_and_k():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 64, generator=g), torch.randn(50, 64, generator=g)
    k[:, 3] *= 40  # an outlier channel
    s, s_rot = q @ k.T, hadamard(q) @ hadamard(k).T
    assert torch.allclose(s, s_rot, rtol=1e-5, atol=1e-4 * s.abs().max().item())


def test_dtype_kept():
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert hadamard(x).dtype == torch.bfloat16


@pytest.mark.parametrize("d", [3, 12, 96])
def test_non_power_of_two_raises(d):
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.randn(2, d))


def test_bad_type_raises():
    with pytest.raises(TypeError):
        hadamard([1.0, 2.0])
    with pytest.raises(TypeError):
        hadamard(torch.ones(4, dtype=torch.int32))
