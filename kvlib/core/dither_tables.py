"""The dither of a stream kept as a table indexed by slot (CPU): regenerating it (Philox in int64 torch ops) at
every read and write was most of a CPU decode step.

The dither is a pure function of (slot, d, layer, kv_head, seed, side, layout), so each stream's dither is kept as
a table indexed by slot, extended (never recomputed) as slots grow; rows are bit-identical to ``dither(slots, ...)``
since each slot's counters depend on that slot alone. Used by the INT8 reference decode and CPU writes
(:mod:`kvlib.kernels.int8`), the pools' reads (:mod:`kvlib.storage.paged`) and stochastic rounding
(:mod:`kvlib.formats.sr_int8`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from kvlib.core.philox import dither, seed_key

_XI_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
#: bytes of dither tables kept (least recently used streams are dropped beyond it)
XI_CACHE_BYTES = 1 << 30
#: slots at or beyond this are computed directly (a table would be mostly unused rows)
XI_TABLE_MAX_SLOTS = 1 << 20
_XI_GROW = 512  # a table grows by whole chunks of slots, not at every decode step
_xi_bytes = 0


def cached_dither(slots: torch.Tensor, d: int, *, layer: int, kv_head: int, seed: int, side: int = 0,
                  layout: str = "w24", **options: Any) -> torch.Tensor:
    """``dither(slots, d, ...)`` (float32 ``[S, d]``) from a per-stream table indexed by slot, for CPU slots;
    slots on another device get ``dither`` there (no host round trip). ``options``: any further keyword of
    ``dither`` (part of the stream's key, passed through)."""
    global _xi_bytes
    kw = dict(layer=layer, kv_head=kv_head, seed=seed, side=side, layout=layout, **options)
    if slots.device.type != "cpu":
        return dither(slots, d, **kw)
    slots = slots.to(torch.int64)
    if slots.ndim != 1 or slots.numel() == 0 or int(slots.min()) < 0 or int(slots.max()) >= XI_TABLE_MAX_SLOTS:
        return dither(slots, d, **kw)
    key = (d, layer, kv_head, seed_key(seed), side, layout, *sorted((k, repr(v)) for k, v in options.items()))
    tab = _XI_TABLES.get(key)
    n = 0 if tab is None else tab.shape[0]
    hi = int(slots.max())
    if hi >= n:
        stop = min(-(-(hi + 1) // _XI_GROW) * _XI_GROW, XI_TABLE_MAX_SLOTS)
        ext = dither(torch.arange(n, stop, dtype=torch.int64), d, **kw).cpu()
        tab = ext if tab is None else torch.cat([tab, ext])
        _xi_bytes += ext.numel() * ext.element_size()
        _XI_TABLES[key] = tab
        while _xi_bytes > XI_CACHE_BYTES and len(_XI_TABLES) > 1:
            old_key, old = next(iter(_XI_TABLES.items()))
            if old_key == key:
                _XI_TABLES.move_to_end(key)
                continue
            del _XI_TABLES[old_key]
            _xi_bytes -= old.numel() * old.element_size()
    _XI_TABLES.move_to_end(key)
    return tab[slots]


def clear_dither_cache() -> None:
    """Drop every kept dither table (:func:`cached_dither`)."""
    global _xi_bytes
    _XI_TABLES.clear()
    _xi_bytes = 0


