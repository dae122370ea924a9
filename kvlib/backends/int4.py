"""The INT4 backend: kv4 and kv4rl over INT4 pages, the KV4-RL side buffer beside them.

Pages: codes uint8 ``[NB, bs, H, d//2]``, scale/offset fp16 ``[NB, bs, H]`` per side, keys Hadamard-rotated (the
format's ``rotate="k"``); kv4rl adds the per-sequence INT8 side buffer ``[B, H, C, d]`` + fp16 scales of
:class:`kvlib.kernels.int4.decode.SideBuffer` (sinks in slots ``0..s-1``, recent positions in the ring slot of
:func:`kvlib.formats.kv4rl.ring_slot`), and a crop stash of the last ``crop_window`` ring evictions.

Writes: :func:`kvlib.kernels.write.int4.write_int4` (the format's quantisers in one launch, the side buffer too in a
decode step) or the torch path with the format's own quantisers. Decode:
:func:`kvlib.kernels.int4.decode.kv4_paged_decode`, the warp-specialised kernel (KV4 on Hopper) or the Triton paged
kernel, chosen here once per device, GQA ratio and dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlib.backends.base import REFERENCE, Backend, Step, grow_tensor, nbytes, triton_on
from kvlib.core.hadamard import hadamard
from kvlib.formats.base import KVFormat
from kvlib.formats.kv4 import KV4Format, int4_quantize_unchecked
from kvlib.formats.kv4rl import (
    KV4RLFormat,
    int8_quantize_unchecked,
    is_protected,
    main_range,
    ring_slot,
    side_count,
    side_positions,
)

_NIBBLES: dict[torch.device, torch.Tensor] = {}


def _nibble_values(device: torch.device) -> torch.Tensor:
    """float32 ``[256, 2]``: the low and high nibble of every byte (as :func:`kvlib.formats.kv4.unpack_nibbles`)."""
    t = _NIBBLES.get(device)
    if t is None:
        b = torch.arange(256, dtype=torch.int32)
        t = _NIBBLES[device] = torch.stack((b & 15, b >> 4), -1).to(device=device, dtype=torch.float32)
    return t


class Int4Backend(Backend):
    family = "int4"
    rotated_keys = True

    @classmethod
    def takes(cls, key_format: KVFormat, value_format: KVFormat, outlier_table: Any = None) -> str | None:
        kf = key_format
        why = super().takes(kf, value_format, outlier_table)
        if why:
            return why
        main = kf.main if isinstance(kf, KV4RLFormat) else kf
        if not isinstance(main, KV4Format) or kf.rotate != "k" or main.group is not None:
            return "one affine group per (token, head) with rotated keys (rotate='k', group=None): the pages' layout"
        if isinstance(kf, KV4RLFormat) and (kf.protect != "int8" or kf.capacity != kf.sink + kf.recent):
            return "an INT8 side buffer of sink + recent positions (protect='int8')"
        return None

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        kf = self.formats[0]
        self.rl = isinstance(kf, KV4RLFormat)
        L, N, H, d = self.n_layers, self.n_slots, self.n_kv, self.d
        dev = self.device
        self.codes = [torch.zeros(L, N, H, d // 2, dtype=torch.uint8, device=dev) for _ in range(2)]
        self.scale = [torch.zeros(L, N, H, dtype=torch.float16, device=dev) for _ in range(2)]
        self.off = [torch.zeros(L, N, H, dtype=torch.float16, device=dev) for _ in range(2)]
        self.sink = self.recent = self.capacity = 0
        if self.rl:
            self.sink, self.recent, self.capacity = kf.sink, kf.recent, kf.capacity
            c = self.capacity
            # per side, per layer: [B, H, C, d] int8 and [B, H, C] fp16 (SideBuffer's layout)
            self.side8 = [[torch.zeros(self.batch, H, c, d, dtype=torch.int8, device=dev) for _ in range(L)]
                          for _ in range(2)]
            self.side_scale = [[torch.ones(self.batch, H, c, dtype=torch.float16, device=dev) for _ in range(L)]
                               for _ in range(2)]
            # crop support: the INT8 entries of the last ``crop_window`` positions evicted from the ring, by
            # position mod U, so that a crop of up to U tokens restores the side buffer exactly
            u = self.undo = max(int(getattr(self, "crop_window", 32)), 1)
            self.stash8 = [[torch.zeros(self.batch, H, u, d, dtype=torch.int8, device=dev) for _ in range(L)]
                           for _ in range(2)]
            self.stash_scale = [[torch.ones(self.batch, H, u, dtype=torch.float16, device=dev) for _ in range(L)]
                                for _ in range(2)]
            self.valid = [[0] * self.batch for _ in range(L)]  # stash entries valid per (layer, row)

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.codes, *self.scale, *self.off]

    def nbytes(self) -> int:
        side = [t for grp in (self.side8, self.side_scale, self.stash8, self.stash_scale) for lay in grp for t in lay
                ] if self.rl else []
        return super().nbytes() + nbytes(*side)

    def bytes_per_position(self) -> float:
        return float(self.formats[0].main.bytes_per_position(self.d) * 2 if self.rl
                     else self.formats[0].bytes_per_position(self.d) * 2)

    def fixed_bytes(self) -> int:
        # kv4rl's side buffer: fixed_bytes per (layer, kv head, side, sequence)
        if not self.rl:
            return 0
        per = self.formats[0].fixed_bytes(self.d) + self.undo * (self.d + 2)  # side buffer + crop stash
        return 2 * self.n_layers * self.n_kv * self.fixed_rows() * per

    def _resize(self, n_slots: int) -> None:
        for lst in (self.codes, self.scale, self.off):
            lst[:] = [grow_tensor(t, n_slots) for t in lst]

    def pages(self, layer: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes [NB, bs, H, d//2], scale [NB, bs, H], offset [NB, bs, H])`` views of one layer and side."""
        nb, bs, h = self.num_blocks, self.block_size, self.n_kv
        return (self.codes[side][layer].view(nb, bs, h, -1), self.scale[side][layer].view(nb, bs, h),
                self.off[side][layer].view(nb, bs, h))

    def _fused_unsupported(self) -> str | None:
        if self.d < 2 or self.d > 512 or self.d & (self.d - 1):
            return f"the fused kv4 write takes a power-of-two head_dim <= 512, got d={self.d}"
        return None

    def _side_write(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, lens_after: torch.Tensor):
        from kvlib.kernels.write.int4 import SideWrite

        return SideWrite(rows, pos, lens_after, self.sink, self.recent,
                         (self.side8[0][layer], self.side8[1][layer]),
                         (self.side_scale[0][layer], self.side_scale[1][layer]),
                         (self.stash8[0][layer], self.stash8[1][layer]),
                         (self.stash_scale[0][layer], self.stash_scale[1][layer]))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
              pos: torch.Tensor, lens_after: torch.Tensor, one_per_row: bool = False) -> None:
        name = "kv4rl" if self.rl else "kv4"
        if self._write_route(k):
            from kvlib.kernels.write.int4 import write_int4

            # a decode step (one token per row) writes kv4rl's side buffer in the same launch
            side = self._side_write(layer, rows, pos, lens_after) if self.rl and one_per_row else None
            pages = [(self.codes[i][layer], self.scale[i][layer], self.off[i][layer]) for i in (0, 1)]
            write_int4(k, v, slots, pages[0], pages[1], side=side)
            self.write_path = f"{name}-triton"
            if not self.rl:
                return
            if one_per_row:
                self.valid[layer] = [min(self.undo, a + 1) for a in self.valid[layer]]
                return
            self.write_path = f"{name}-triton+side-torch"  # a prefill / chunk: the side buffer by the torch path
            self._write_side(layer, (hadamard(k.float()), v.float()), rows, pos, lens_after, one_per_row)
            return
        self.write_path = f"{name}-{self._route}"
        xs = (hadamard(k.float()), v.float())  # keys rotated (rotate="k", the kernel's layout)
        for side, x in enumerate(xs):
            codes, scale, off = int4_quantize_unchecked(x)  # one affine group per (token, head): batched = per stream
            self.codes[side][layer, slots] = codes
            self.scale[side][layer, slots] = scale
            self.off[side][layer, slots] = off
        if self.rl:
            self._write_side(layer, xs, rows, pos, lens_after, one_per_row)

    def _write_side(self, layer: int, xs: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, pos: torch.Tensor,
                    lens_after: torch.Tensor, one_per_row: bool) -> None:
        """kv4rl's side buffer (and crop stash) by the torch path."""
        s, w = self.sink, self.recent
        keep = is_protected(pos, lens_after[rows], s, w)
        ring = ring_slot(pos, s, w)
        ring = torch.where(keep, ring, torch.zeros_like(ring))  # a position not kept touches no slot (masked below)
        u = self.undo
        if one_per_row:
            # one token per row (a decode step): distinct ring slots, masked writes without a host sync.
            # The entry leaving the ring (position pos - recent, in the same ring slot) goes to the crop stash.
            ev = pos - w
            ev_ok = (ev >= s) & (w > 0)
            for side, x in enumerate(xs):
                c8, s8 = int8_quantize_unchecked(x)
                old = self.side8[side][layer][rows, :, ring]
                olds = self.side_scale[side][layer][rows, :, ring]
                st8, sts = self.stash8[side][layer], self.stash_scale[side][layer]
                j = ev % u
                st8[rows, :, j] = torch.where(ev_ok[:, None, None], old, st8[rows, :, j])
                sts[rows, :, j] = torch.where(ev_ok[:, None], olds, sts[rows, :, j])
                self.side8[side][layer][rows, :, ring] = torch.where(keep[:, None, None], c8, old)
                self.side_scale[side][layer][rows, :, ring] = torch.where(keep[:, None], s8, olds)
            self.valid[layer] = [min(u, a + 1) for a in self.valid[layer]]
            return
        # prefill / chunk (host syncs are fine here): stash the last U evictions, then write the ring. Per row only
        # O(1) host work and the old ring entries; the chunk's own entries are stashed in one masked write (a
        # per-row scan of the chunk's tokens cost O(B x tokens) in Python per layer: 17-21 s for a 64-row prefill)
        c8s = [int8_quantize_unchecked(x) for x in xs]
        cnt_t = torch.bincount(rows, minlength=self.batch)
        cnt_h, la_h = cnt_t.tolist(), lens_after.tolist()
        for b in sorted(set(rows.tolist())):
            n1 = la_h[b]
            n0 = n1 - cnt_h[b]
            lo, hi = max(s, n1 - w - u), n1 - w
            if w == 0 or hi <= lo:
                continue
            a0, a1 = max(lo, n0 - w), min(hi, n0)
            olds = torch.arange(a0, max(a0, a1), device=pos.device)  # were in the ring before this write
            if olds.numel():
                og = ring_slot(olds, s, w)
                for side in (0, 1):
                    self.stash8[side][layer][b, :, olds % u] = self.side8[side][layer][b, :, og]
                    self.stash_scale[side][layer][b, :, olds % u] = self.side_scale[side][layer][b, :, og]
            self.valid[layer][b] = min(u, self.valid[layer][b] + (n1 - n0))
        if w > 0:
            # the chunk's positions in [max(lo, n0), hi) of their row go to the stash (distinct slots mod u)
            n1_t = lens_after[rows]
            n0_t = n1_t - cnt_t[rows]
            lo_t = torch.clamp(n1_t - w - u, min=s)
            hi_t = n1_t - w
            mine = ((hi_t > lo_t) & (pos >= torch.maximum(lo_t, n0_t)) & (pos < hi_t)).nonzero().squeeze(-1)
            if mine.numel():
                rr, jj = rows[mine], pos[mine] % u
                for side in (0, 1):
                    self.stash8[side][layer][rr, :, jj] = c8s[side][0][mine]
                    self.stash_scale[side][layer][rr, :, jj] = c8s[side][1][mine]
        sel = keep.nonzero().squeeze(-1)  # kept positions have distinct slots
        r, g = rows[sel], ring[sel]
        for side in (0, 1):
            self.side8[side][layer][r, :, g] = c8s[side][0][sel]
            self.side_scale[side][layer][r, :, g] = c8s[side][1][sel]

    def crop(self, layer: int, old_lens: list[int], new_lens: list[int]) -> None:
        """Restore the side buffer to what it held at ``new_lens`` (positions that re-enter the recent window
        come back from the crop stash); error when the stash does not reach that far."""
        if not self.rl:
            return
        s, w, u = self.sink, self.recent, self.undo
        for b, (n, m) in enumerate(zip(old_lens, new_lens)):
            a0 = max(s, m - w)
            back = torch.arange(a0, max(a0, min(n - w, m)), device=self.device)
            if not back.numel():
                continue
            if n - m > self.valid[layer][b]:
                raise NotImplementedError(
                    f"kv4rl: crop of {n - m} tokens reaches past the side buffer's crop stash "
                    f"({self.valid[layer][b]} evicted entries kept; make_cache(..., crop_window=N) keeps more)")
            ring = ring_slot(back, s, w)
            for side in (0, 1):
                self.side8[side][layer][b, :, ring] = self.stash8[side][layer][b, :, back % u]
                self.side_scale[side][layer][b, :, ring] = self.stash_scale[side][layer][b, :, back % u]
            self.valid[layer][b] -= n - m

    def side_count(self, lens: torch.Tensor) -> torch.Tensor:
        return side_count(lens.long(), self.sink, self.recent).to(torch.int32)

    def side_buffer(self, layer: int, lens: torch.Tensor):
        from kvlib.kernels.int4.decode import SideBuffer

        n = lens.shape[0]  # the first n rows: a bucketed decode step over a larger pool (kvlib.rl.continuous)
        return SideBuffer(self.side8[0][layer][:n], self.side_scale[0][layer][:n], self.side8[1][layer][:n],
                          self.side_scale[1][layer][:n], self.side_count(lens))

    def main_range(self, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = lens.to(torch.int32)
        if not self.rl:
            return torch.zeros_like(n), n
        return main_range(n, self.sink, self.recent)

    def gather(self, layer: int, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = st.shape
        idx = (st.long()[:, None, :], torch.arange(self.n_kv, device=st.device)[None, :, None])  # -> [B, H, n]
        table = _nibble_values(st.device)
        out = []
        for side in (0, 1):
            packed = self.codes[side][layer][idx]  # [B, H, n, d // 2] uint8
            # both nibbles of every byte as float32 from a 256-row table (unpack_nibbles(p).float() in one gather)
            c = table.index_select(0, packed.reshape(-1).to(torch.int32)).view(b, self.n_kv, n, self.d)
            sc, off = self.scale[side][layer][idx].float(), self.off[side][layer][idx].float()
            out.append(c * sc.unsqueeze(-1) + off.unsqueeze(-1))
        return out[0], out[1]  # keys still rotated; see gather_rows

    def gather_rows(self, layer: int, st: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor | None = None,
                    rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Effective float K, V ``[B, H, n, d]`` in the original basis (side-buffer values where protected: row
        ``rows[b]``'s side buffer for the slots ``st[b]``, default ``rows[b] = b``); ``rotated``: keys in the stored
        (Hadamard-rotated) basis, for a caller that rotates its query instead (one vector instead of every position:
        scores are the same, H being orthonormal)."""
        k, v = self.gather(layer, st)
        if self.rl:
            pos = side_positions(lens.to(k.device), self.sink, self.recent)  # [B, C]
            ok = (pos >= 0) & (pos < st.shape[1])
            bi, ci = ok.nonzero(as_tuple=True)
            ri = bi if rows is None else rows.to(bi.device)[bi]
            for side, x in enumerate((k, v)):
                vals = self.side8[side][layer][ri, :, ci].float() * self.side_scale[side][layer][ri, :, ci].float(
                    ).unsqueeze(-1)
                x[bi, :, pos[bi, ci]] = vals
        return (k if rotated else hadamard(k)), v

    def clear_row(self, row: int) -> None:
        if self.rl:
            for layer in range(self.n_layers):
                self.valid[layer][row] = 0

    def move_row(self, src: int, dst: int) -> None:
        if self.rl:
            for grp in (self.side8, self.side_scale, self.stash8, self.stash_scale):
                for side in (0, 1):
                    for t in grp[side]:
                        t[dst].copy_(t[src])  # in place: a captured decode step keeps reading these tensors
            for layer in range(self.n_layers):
                self.valid[layer][dst], self.valid[layer][src] = self.valid[layer][src], 0

    def select_rows(self, layer: int, idx: torch.Tensor) -> None:
        if self.rl:
            for grp in (self.side8, self.side_scale, self.stash8, self.stash_scale):
                for side in (0, 1):
                    grp[side][layer] = grp[side][layer][idx].clone()
            self.valid[layer] = [self.valid[layer][i] for i in idx.tolist()]

    def fixed_rows(self) -> int:
        return self.side8[0][0].shape[0] if self.rl else 0

    def read(self, layer: int, table: Any, n: int, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gather_rows(layer, table.slot_table()[:, :n], table.seq_lens, rotated=rotated)

    # -- decode -----------------------------------------------------------------------------------
    def supports(self, shape: tuple[int, ...], device: torch.device) -> str | None:
        if not triton_on(device, self.interpret):
            return f"no Triton backend on {device.type} (CUDA, or the interpreter with interpret=True)"
        if device.type == "cuda" and self.d < 64:
            return f"the paged KV4 kernels on a GPU take head_dim >= 64, got {self.d}"
        if shape[1] // self.n_kv > 16:
            return f"the paged KV4 kernels take at most 16 query heads per KV head, got {shape[1] // self.n_kv}"
        return None

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float, *, certify: bool = True,
               masked: bool = False) -> Step:
        impl = None if masked else self._kernel(q, lambda: self._choose(q, layer, table.block_table))
        if impl is None:
            return REFERENCE
        from kvlib.kernels.int4.decode import kv4_paged_decode, prepare_query

        qp = prepare_query(q, rotate=True)
        start, end = self.main_range(table.seq_lens)
        kc, ks, ko = self.pages(layer, 0)
        vc, vs, vo = self.pages(layer, 1)
        side = self.side_buffer(layer, table.seq_lens) if self.rl else None
        o, _ = kv4_paged_decode(qp, kc, ks, ko, vc, vs, vo, table.block_table, start, end, block_size=self.block_size,
                                side=side, sm_scale=sm, backend=impl)
        return Step(o, f"{'kv4rl' if self.rl else 'kv4'}-{impl}", None)

    def _choose(self, q: torch.Tensor, layer: int, block_table: torch.Tensor) -> str:
        """``"wspec"`` where the warp-specialised kernel takes the pages (KV4 on a Hopper GPU, and KV4-RL only where
        :data:`kvlib.kernels.int4.wspec.DISPATCH_CONFIG_RL` opts in:
        :func:`kvlib.kernels.int4.wspec.wspec4_unsupported`, asked with this step's prepared query), else
        ``"triton"`` (the paged Triton kernel, which also runs KV4-RL's side buffer in the same launch)."""
        from kvlib.kernels.int4.decode import prepare_query
        from kvlib.kernels.int4.wspec import wspec4_unsupported

        why = wspec4_unsupported(prepare_query(q, rotate=True), self.pages(layer, 0)[0], block_table,
                                 block_size=self.block_size, rl=self.rl)
        return "wspec" if why is None else "triton"
