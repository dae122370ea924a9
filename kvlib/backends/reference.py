"""The reference backend: every other format, read by the torch reference path (no decode kernel).

* :class:`ReferenceBackend` (any stateless format): each per-token field of the format's packed dataclass gets its
  own pages; writes call the format's ``write`` (every head of a token in one batch where the format declares
  ``batch_heads``), reads rebuild the dataclass and call the format's ``read``.
* :class:`ObjectBackend` (stateful formats, e.g. kivi2: an old position's representation changes as tokens are
  appended): the format's own packed object per (layer, row, head), re-read whole each step; no pages.

A step over either is the model's own attention over :meth:`Backend.read` (``kernel_path`` says
``"torch-reference"``): a format without a kernel runs unchanged, only slower.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from kvlib.backends.base import Backend, grow_tensor
from kvlib.storage.blocks import PageTable


class ReferenceBackend(Backend):
    """Pages for each per-token field of any stateless format's packed dataclass (torch reference path)."""

    family = "reference"
    slot_bound = True  # a format may use the slot as a counter (dither, stochastic rounding): never move

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.fields: list[dict[str, torch.Tensor] | None] = [None, None]
        self.meta: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.cls: list[type | None] = [None, None]

    def _tensors(self) -> list[torch.Tensor]:
        return [t for f in self.fields if f for t in f.values()]

    def _resize(self, n_slots: int) -> None:
        for f in self.fields:
            if f:
                for k in list(f):
                    f[k] = grow_tensor(f[k], n_slots)

    def _ctx(self, layer: int, h: int, side: int, slots: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        ctx = dict(layer=layer, kv_head=h, side=side, slots=slots, positions=pos, seed=self.seed)
        if self.outlier_table is not None and side in self.outlier_sides:
            ctx["outlier_channels"] = self.outlier_table[layer, h].to(torch.int64)
        return ctx

    def _batched(self, side: int) -> bool:
        """Every head of a token in one write/read (the format's ``batch_heads``, no per-head outlier channels)."""
        return type(self.formats[side]).batch_heads and not (self.outlier_table is not None
                                                            and side in self.outlier_sides)

    def write(self, layer, k, v, slots, rows, pos, lens_after, one_per_row=False) -> None:
        self.write_path = "reference-torch"  # the format's own write per head (no kernel)
        for side, x in enumerate((k, v)):
            fmt = self.formats[side]
            if self._batched(side) and self.fields[side] is not None:
                n = x.shape[0]
                p = fmt.write(x.reshape(n * self.n_kv, self.d).float(), side=side)
                for name, t in self.fields[side].items():
                    f = getattr(p, name)
                    t[layer, slots] = f.reshape(n, self.n_kv, *f.shape[1:]).to(t.device)
                meta = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
                        if not f.metadata.get("per_token", False)}
                for h in range(self.n_kv):
                    self.meta.setdefault((side, layer, h), meta)
                continue
            for h in range(self.n_kv):
                p = fmt.write(x[:, h].float(), **self._ctx(layer, h, side, slots, pos))
                per = {f.name for f in dataclasses.fields(p) if f.metadata.get("per_token", False)}
                if self.fields[side] is None:
                    self.cls[side] = type(p)
                    self.fields[side] = {
                        n: torch.zeros(self.n_layers, self.n_slots, self.n_kv, *getattr(p, n).shape[1:],
                                       dtype=getattr(p, n).dtype, device=self.device)
                        for n in per if getattr(p, n) is not None}
                self.meta.setdefault((side, layer, h), {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
                                                        if f.name not in per})
                for n, t in self.fields[side].items():
                    t[layer, slots, h] = getattr(p, n).to(t.device)

    def packed_heads(self, layer: int, slots: torch.Tensor, row: int, side: int) -> list[Any]:
        cls = self.cls[side]
        per = {f.name for f in dataclasses.fields(cls) if f.metadata.get("per_token", False)}
        out = []
        for h in range(self.n_kv):  # each head's dataclass rebuilt from its pages
            vals = {n: t[layer, slots, h] for n, t in self.fields[side].items()}
            vals.update({n: None for n in per if n not in vals})
            out.append(cls(**vals, **self.meta[(side, layer, h)]))
        return out

    def gather(self, layer: int, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = st.shape
        flat = st.reshape(-1).long()
        out = []
        for side in (0, 1):
            fmt, heads = self.formats[side], []
            meta = self.meta.get((side, layer, 0))
            if self._batched(side) and meta is not None:
                vals = {name: t[layer, flat].reshape(flat.numel() * self.n_kv, *t.shape[3:])
                        for name, t in self.fields[side].items()}
                per = {f.name for f in dataclasses.fields(self.cls[side]) if f.metadata.get("per_token", False)}
                vals.update({name: None for name in per if name not in vals})
                x = fmt.read(self.cls[side](**vals, **meta)).float()
                out.append(x.reshape(b, n, self.n_kv, self.d).transpose(1, 2))
                continue
            for h in range(self.n_kv):
                meta = self.meta.get((side, layer, h))
                if meta is None:
                    heads.append(torch.zeros(flat.numel(), self.d, device=self.device))
                    continue
                vals = {name: t[layer, flat, h] for name, t in self.fields[side].items()}
                per = {f.name for f in dataclasses.fields(self.cls[side]) if f.metadata.get("per_token", False)}
                vals.update({name: None for name in per if name not in vals})
                heads.append(fmt.read(self.cls[side](**vals, **meta)).float())
            out.append(torch.stack(heads, 1).reshape(b, n, self.n_kv, self.d).transpose(1, 2))
        return out[0], out[1]



class ObjectBackend(Backend):
    """Stateful formats without pages: the format's packed object per (side, layer, row, head)."""

    paged = False
    slot_bound = True
    croppable = False

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.objs = [[[[None] * self.n_kv for _ in range(self.batch)] for _ in range(self.n_layers)] for _ in (0, 1)]

    def _resize(self, n_slots: int) -> None:
        pass

    def nbytes(self) -> int:
        return sum(self.formats[s].nbytes(p) for s in (0, 1) for lay in self.objs[s] for row in lay for p in row
                   if p is not None)

    def write_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: list[int],
                   keep: list[torch.Tensor | None]) -> None:
        """Append row ``b``'s tokens of ``k, v [B, H, s, d]`` (those of the bool mask ``keep[b]``, or all) at
        positions ``start[b]..``."""
        self.write_path = "reference-torch"  # the format's own append per (row, head)
        for side, x in enumerate((k, v)):
            fmt = self.formats[side]
            for b in range(x.shape[0]):
                xb = x[b] if keep[b] is None else x[b][:, keep[b]]
                s_new = xb.shape[1]
                pos = torch.arange(start[b], start[b] + s_new, dtype=torch.int64, device=x.device)
                for h in range(self.n_kv):
                    ctx = dict(layer=layer, kv_head=h, side=side, positions=pos, slots=pos + b * (1 << 20),
                               seed=self.seed)
                    if self.outlier_table is not None and side in self.outlier_sides:
                        ctx["outlier_channels"] = self.outlier_table[layer, h].to(torch.int64)
                    self.objs[side][layer][b][h] = fmt.append(self.objs[side][layer][b][h], xb[h].float(), **ctx)

    def read_rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for side in (0, 1):
            fmt = self.formats[side]
            rows = []
            for row in self.objs[side][layer]:
                heads = [fmt.read(p) if p is not None else torch.zeros(0, self.d) for p in row]
                rows.append(torch.stack([torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[0])) for t in heads]))
            out.append(torch.stack(rows))
        return out[0], out[1]

    def append(self, layer: int, table: PageTable, k: torch.Tensor, v: torch.Tensor,
               keep: torch.Tensor | None = None, record: bool = False):
        # no pages: each row's tokens go to its objects at the row's next positions (the table keeps the lengths)
        b, h, s, d = k.shape
        keep_l = [None] * b if keep is None else list(keep)
        self.write_rows(layer, k, v, table.lens, keep_l)
        out = None
        if record:  # the same tokens, by row and position (no slots)
            m = torch.ones(b, s, dtype=torch.bool, device=k.device) if keep is None else keep
            r, c = m.nonzero(as_tuple=True)
            pos = torch.tensor(table.lens, dtype=torch.int64, device=k.device)[r] + (m.cumsum(1) - 1)[r, c]
            out = (k.permute(0, 2, 1, 3)[r, c], v.permute(0, 2, 1, 3)[r, c], r, pos, None)
        table.lens = [n + (s if m is None else int(m.sum())) for n, m in zip(table.lens, keep_l)]
        return out

    def read(self, layer: int, table: PageTable, n: int, rotated: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_rows(layer, n)

    def packed_heads(self, layer: int, slots: torch.Tensor, row: int, side: int) -> list[Any]:
        return list(self.objs[side][layer][row])

    def crop(self, layer: int, old_lens: list[int], new_lens: list[int]) -> None:
        raise NotImplementedError(
            f"format {self.formats[0].name!r} is stateful (a residual window overwritten by the tokens to remove): "
            "crop cannot restore it")

    def select_rows(self, layer: int, idx: torch.Tensor) -> None:
        rows = idx.tolist()
        for side in (0, 1):
            old = self.objs[side][layer]
            seen: set[int] = set()
            new = []
            for r in rows:
                new.append(old[r] if r not in seen else copy.deepcopy(old[r]))
                seen.add(r)
            self.objs[side][layer] = new
        self.batch = len(rows)
