"""Synthetic key sets of the WitCert notebooks: keys with attention-sink tokens on one massive channel, and
keys whose leading RoPE pairs carry geometrically graded massive activations. Every draw comes from the
caller's generator, so a notebook's sequence of draws (and its numbers) is fixed by its seed."""

from __future__ import annotations

import torch

from kvlib.core.outliers import rope_pairs


def sink_keys(n: int, heads: int, seq_len: int, d: int, *, generator: torch.Generator, n_sink: int,
              sink_frac: float, sink_mag: float, channel: int = 3) -> torch.Tensor:
    """``[n, heads, d]`` Gaussian keys; the first ``n_sink`` tokens of each sequence of ``seq_len`` (and a
    ``sink_frac`` of the rest) carry a massive ``channel``, like the attention sinks / massive activations of
    real models. Only KV head 0 has them (a "sink head")."""
    if n <= 0 or heads <= 0 or seq_len <= 0 or d <= channel:
        raise ValueError(f"sink_keys: n, heads, seq_len must be positive and d > channel (got n={n}, "
                         f"heads={heads}, seq_len={seq_len}, d={d}, channel={channel})")
    k = torch.randn(n, heads, d, generator=generator)
    sink = torch.rand(n, heads, generator=generator) < sink_frac
    sink |= (torch.arange(n) % seq_len < n_sink)[:, None]
    sink[:, 1:] = False
    k[..., channel] += sink * sink_mag * (1 + torch.rand(n, heads, generator=generator))
    return k


def graded_keys(n: int, d: int, *, generator: torch.Generator, massive: float, n_pairs: int = 16,
                decay: float = 0.85) -> torch.Tensor:
    """``[n, d]`` Gaussian keys whose first ``n_pairs`` RoPE pairs are scaled by ``massive * decay**i``: a
    graded set of outlier pairs, so an outlier budget of m pairs removes the m largest."""
    if n <= 0 or d <= 0 or d % 2:
        raise ValueError(f"graded_keys: n must be positive and d positive and even (got n={n}, d={d})")
    k = torch.randn(n, d, generator=generator)
    for i, (a, b) in enumerate(rope_pairs(d)[:n_pairs].tolist()):
        k[:, [a, b]] *= massive * decay**i
    return k
