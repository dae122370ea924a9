"""Bytes per stored position, from each format's layout and from the tensors it actually allocates
(witcert_contract_bytes): the INT8 family, fp8, block-INT8 and the paged pool, against fp16."""

from __future__ import annotations

from typing import Any

import torch

from kvlib.formats import get_format
from kvlib.storage.paged import PagedPool


def byte_account(n_tokens: int, dims=(64, 128)) -> list[dict[str, Any]]:
    """One row per (head dim d, configuration): bytes per position from the layout and measured on a write of
    ``n_tokens`` random positions (for the paged pool: per token and KV head), and the share saved against
    fp16. Outlier bypass uses m = 4 rotate-half pairs."""
    if n_tokens <= 0:
        raise ValueError(f"byte_account: n_tokens must be positive, got {n_tokens}")
    rows = []
    for d in dims:
        x = torch.randn(n_tokens, d)
        slots = torch.arange(n_tokens)
        pairs = torch.tensor([0, d // 2, 1, d // 2 + 1, 2, d // 2 + 2, 3, d // 2 + 3])  # m = 4 rotate-half pairs
        configs = [
            ("fp16 (baseline)", None, {}),
            ("dither-int8, G=32", "dither-int8", {}),
            ("dither-int8, G=32, m=4 pairs", "dither-int8", {"outlier_channels": pairs}),
            ("rtn-int8, G=32", "rtn-int8", {}),
            ("sr-int8, G=32", "sr-int8", {}),
            ("fp8-e4m3, G=32", "fp8-e4m3", {}),
            ("block-int8, BLK=256", "block-int8", {}),
        ]
        for label, name, opts in configs:
            if name is None:
                layout, measured = 2.0 * d, x.half().numel() * 2 / n_tokens
            else:
                f = get_format(name, **opts)
                layout, measured = f.bytes_per_position(d), f.nbytes(f.write(x, slots=slots)) / n_tokens
            rows.append({"d": d, "format": label, "layout B": layout, "measured B": measured,
                         "saved vs fp16": 1 - layout / (2 * d)})
        for m in (0, 4):
            pool = PagedPool(n_layers=2, n_slots=n_tokens, n_kv_heads=4, d=d, n_out=2 * m)
            rows.append({"d": d, "format": f"paged pool, G=32, m={m}", "layout B": pool.bytes_per_token_head(),
                         "measured B": pool.measured_bytes_per_token_head(),
                         "saved vs fp16": 1 - pool.bytes_per_token_head() / (2 * d)})
    return rows
