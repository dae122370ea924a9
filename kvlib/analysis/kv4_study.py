"""The synthetic checks of the kv4rl_representation notebook: the split-and-merge exactness of attention
over random regions, and the bits and key / score error of each 4-bit format on the same keys."""

from __future__ import annotations

from typing import Any

import torch

from kvlib.core.merge import merge_states
from kvlib.formats import get_format
from kvlib.kernels.int4.decode import region_attention_ref

# (format, options): each 4-bit format with and without the K rotation, and KIVI-2
FORMAT_CONFIGS = (
    ("kv4", dict(rotate="none")), ("kv4", dict(rotate="k")),
    ("kv4-g32", dict(rotate="none")), ("kv4-g32", dict(rotate="k")),
    ("kv4-g16", dict(rotate="none")), ("kv4-g16", dict(rotate="k")),
    ("nvfp4", dict(rotate="none")), ("nvfp4", dict(rotate="k")),
    ("mxfp4", dict(rotate="none")), ("mxfp4", dict(rotate="k")),
    ("kivi2", dict()),
)


def split_merge_error(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, valid: torch.Tensor, n_splits: int,
                      generator: torch.Generator) -> tuple[float, float]:
    """Attention over the ``valid`` positions in one pass against the ``merge_states`` of two passes over a
    random region and its complement, ``n_splits`` times (each batch row keeps a random fraction): the
    largest |Δo| and |Δlse|."""
    B, N, d = kb.shape[0], kb.shape[2], kb.shape[3]
    o_ref, lse_ref = region_attention_ref(qb, kb, vb, valid, d ** -0.5)
    worst_o = worst_lse = 0.0
    for _ in range(n_splits):
        frac = torch.rand(B, 1, generator=generator)
        region = torch.rand(B, N, generator=generator) < frac
        o_a, l_a = region_attention_ref(qb, kb, vb, valid & region, d ** -0.5)
        o_b, l_b = region_attention_ref(qb, kb, vb, valid & ~region, d ** -0.5)
        o, lse = merge_states(o_a, l_a, o_b, l_b)
        worst_o = max(worst_o, (o - o_ref).abs().max().item())
        worst_lse = max(worst_lse, (lse - lse_ref).abs().max().item())
    return worst_o, worst_lse


def format_rows(keys: torch.Tensor, queries: torch.Tensor, configs=FORMAT_CONFIGS) -> list[dict[str, Any]]:
    """Each format's bits per element from its layout and from the bytes it allocates (KIVI: of its quantised
    part), the keys' relative MSE and the RMS error of the scores q·k / √d."""
    d = keys.shape[-1]
    k32 = keys.float()
    s_true = (queries.float() @ k32.T) / d ** 0.5
    rows = []
    for name, opt in configs:
        f = get_format(name, **opt)
        packed = f.write(k32, side=0)
        k_hat = f.read(packed)
        s_hat = (queries.float() @ k_hat.T) / d ** 0.5
        n_q = k32.shape[0] if name != "kivi2" else packed.codes.shape[0]  # KIVI: bits of the quantised part
        rows.append(dict(
            format=name, rotation=opt.get("rotate", "none"),
            bits_layout=f.bytes_per_position(d) * 8 / d,
            bits_measured=(f.nbytes(packed) - (packed.residual.numel() * 2 if name == "kivi2" else 0)) * 8 / (n_q * d),
            key_rel_mse=((k_hat - k32).pow(2).mean() / k32.pow(2).mean()).item(),
            score_rmse=(s_hat - s_true).pow(2).mean().sqrt().item(),
        ))
    return rows
