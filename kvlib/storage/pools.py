"""Device-resident paged pools of every layer of a model, one class per kernel family.

Shared by the formats (bit-exact writes), the write kernels, the decode kernels and the HF cache
(:mod:`kvlib.hf.cache`). Pages follow vLLM: a layer's pool is ``[num_blocks * block_size, H_kv, ...]``
(slot = ``block * block_size + offset``, see :mod:`kvlib.storage.blocks`), all layers stacked on a
leading axis. No float copy of the cache is kept anywhere; :meth:`Store.gather` dequantises a layer
transiently for the torch reference path.

* :class:`Int8Store` (dither-int8 in each dither layout, with outlier channels; rtn-int8): the
  :class:`kvlib.storage.paged.PagedPool` layout (int8 codes, fp16 group scales, fp16 outliers). Dithered
  keys are written by :func:`kvlib.kernels.int8.write.write_int8` (the Philox counter is the slot, so dithered
  pages are bound to their slots); values RTN in the same layout (``dithered=False``, what the decode kernel
  reads). rtn-int8: the same kernel with ``rule="rtn"``, or its format's ``write`` on the torch path.
* :class:`Int4Store` (kv4; kv4rl): codes uint8 ``[NB, bs, H, d//2]``, scale/offset fp16 ``[NB, bs, H]``,
  keys Hadamard-rotated; kv4rl adds the per-sequence INT8 side buffer ``[B, H, C, d]`` + fp16 scales of
  :class:`kvlib.kernels.int4.decode.SideBuffer` (sinks in slots ``0..s-1``, recent positions in the ring).
* :class:`PlainStore` (bf16/fp16/fp32 passthrough pages).

* :class:`FormatStore` (any other stateless format): each per-token field of the format's packed
  dataclass gets its own pages; reads rebuild the dataclass and call the format's ``read``.
* :class:`ObjectStore` (stateful formats without pages, e.g. kivi2): the format's own packed object per
  (layer, row, head), re-read whole each step (the reference path).

Writes (``Store.write``): the INT8 and INT4 stores write through the fused Triton kernels of
:mod:`kvlib.kernels.write` on CUDA (and on CPU tensors when ``interpret`` is set, under TRITON_INTERPRET=1):
one launch per layer for K and V (and kv4rl's side buffer and crop stash in a decode step), with no host read,
so a decode step captures in a CUDA graph. The torch path beside them is the reference (the same bytes, bound
bit for bit in ``tests/test_write_kernels.py``) and the CPU path; ``write_backend`` picks ("auto", "triton",
"torch") and ``write_path`` says which ran (with the reason where the fused write cannot take the shape).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from kvlib.core.hadamard import hadamard
from kvlib.formats.base import KVFormat
from kvlib.formats.kv4 import int4_quantize_unchecked
from kvlib.formats.kv4rl import (
    int8_quantize_unchecked,
    is_protected,
    main_range,
    ring_slot,
    side_count,
    side_positions,
)
from kvlib.storage.paged import PagedPool


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _grow_tensor(t: torch.Tensor, n_slots: int) -> torch.Tensor:
    """``t [L, n, ...]`` with its slot axis grown to ``n_slots`` (old slots kept at their index)."""
    out = t.new_zeros((t.shape[0], n_slots, *t.shape[2:]))
    out[:, : t.shape[1]] = t
    return out


class Store:
    """Base: ``n_layers`` layers of ``num_blocks * block_size`` slots for ``H_kv`` heads of dim ``d``."""

    family = "reference"
    #: run the decode kernels on CPU tensors under TRITON_INTERPRET=1 (tests: the kernel path through a model)
    interpret = False
    #: True when a stored code depends on its slot (dithered: the Philox counter is the slot), so pages
    #: cannot be moved to other slots
    slot_bound = False
    paged = True
    #: ``"auto"``: the fused Triton write (:mod:`kvlib.kernels.write`) on CUDA, and on CPU tensors when
    #: ``interpret`` is set (TRITON_INTERPRET=1), the torch path elsewhere; ``"triton"``: the fused write or an
    #: error; ``"torch"``: the torch path (the reference, bit for bit the same bytes)
    write_backend = "auto"
    #: the path the last write took, e.g. ``"int8-triton"``, ``"kv4-torch"``; ``"...-torch:<why>"`` when the
    #: fused write cannot take the shape (never a silent fallback). None before the first write.
    write_path: str | None = None

    def __init__(self, n_layers: int, n_kv: int, d: int, block_size: int, num_blocks: int, device: torch.device,
                 key_format: KVFormat, value_format: KVFormat, *, batch: int, seed: int = 0,
                 outlier_table: torch.Tensor | None = None, outlier_sides: tuple[int, ...] = (0,),
                 crop_window: int = 32) -> None:
        self.crop_window = crop_window
        self.n_layers, self.n_kv, self.d, self.block_size = n_layers, n_kv, d, block_size
        self.num_blocks, self.device, self.batch, self.seed = num_blocks, device, batch, seed
        self.formats = (key_format, value_format)
        self.outlier_table, self.outlier_sides = outlier_table, tuple(outlier_sides)

    @property
    def n_slots(self) -> int:
        return self.num_blocks * self.block_size

    def grow(self, min_blocks: int) -> int:
        # grow to what is asked plus 1/8 (a page table's next few blocks), not by doubling: kv_nbytes stays the
        # positions in use to within a few pages (make_cache with max_len allocates once instead)
        nb = max(min_blocks, self.num_blocks + -(-self.num_blocks // 8))
        self._resize(nb * self.block_size)
        self.num_blocks = nb
        return nb

    # subclasses: _tensors() (slot-axis tensors [L, n_slots, ...]), _resize, write, gather
    def _tensors(self) -> list[torch.Tensor]:
        return []

    def _resize(self, n_slots: int) -> None:
        raise NotImplementedError

    def copy_slots(self, layer: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy layer ``layer``'s contents of slots ``src`` to slots ``dst`` (slot-independent formats)."""
        for t in self._tensors():
            t[layer, dst] = t[layer, src].clone()

    def select_rows(self, layer: int, idx: torch.Tensor) -> None:
        """Per-sequence state (side buffers) follows a batch selection; none by default."""

    def crop(self, layer: int, old_lens: list[int], new_lens: list[int]) -> None:
        """Per-sequence state follows a crop; none by default."""

    def nbytes(self) -> int:
        return _nbytes(*self._tensors())

    def bytes_per_position(self) -> float:
        """K + V bytes per position per KV head, from the formats' layout formulas."""
        return float(self.formats[0].bytes_per_position(self.d) + self.formats[1].bytes_per_position(self.d))

    def fixed_bytes(self) -> int:
        """Bytes independent of the positions allocated (per-head constants, per-sequence side buffers)."""
        return 0

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float):
        """``(o [B, Hq, d] fp32, path, certificate [B, Hq] or None)`` from a decode kernel, or None when
        this store has no kernel for ``q``'s device and shape (the caller takes the reference path)."""
        return None

    def _fused_unsupported(self) -> str | None:
        """Why the fused write cannot take this store's shapes (None: it can)."""
        return "no fused write for this store"

    def _write_route(self, x: torch.Tensor) -> bool:
        """True for the fused write, False for the torch path (``write_backend``); sets ``write_path``'s suffix.
        Decided from attributes and the device type only: nothing is read back from the device."""
        b = self.write_backend
        if b not in ("auto", "triton", "torch"):
            raise ValueError(f"write_backend must be 'auto', 'triton' or 'torch', got {b!r}")
        self._route = "torch"
        if b == "torch":
            return False
        from kvlib.kernels.backend import triton_available

        why = self._fused_unsupported()
        on = x.is_cuda or ((b == "triton" or self.interpret) and triton_available(x.device))
        if b == "triton":
            if why:
                raise ValueError(f"write_backend='triton': {why}")
            if not on:
                raise RuntimeError("write_backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                                   "triton is imported")
        elif why or not on:
            self._route = f"torch:{why}" if why and on else "torch"
            return False
        self._route = "triton"
        return True


class Int8Store(Store):
    family = "int8"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        kf = self.formats[0]
        self.dithered = kf.name == "dither-int8"
        self.slot_bound = self.dithered
        self.group = kf.group
        layout = getattr(kf, "dither_layout", "w24")
        n_out_k = 0 if self.outlier_table is None or 0 not in self.outlier_sides else self.outlier_table.shape[-1]
        n_out_v = 0 if self.outlier_table is None or 1 not in self.outlier_sides else self.outlier_table.shape[-1]
        if self.dithered and kf.outlier_channels is not None and self.outlier_table is None:
            oc = torch.as_tensor(kf.outlier_channels).to(torch.int64)
            self.outlier_table = oc.expand(self.n_layers, self.n_kv, oc.numel())
            n_out_k = oc.numel()
        common = dict(n_layers=self.n_layers, n_slots=self.n_slots, n_kv_heads=self.n_kv, d=self.d, group=self.group,
                      seed=self.seed, device=self.device, dither_layout=layout,
                      include_outliers_in_amax=getattr(kf, "include_outliers_in_amax", False))
        self.k = PagedPool(side=0, n_out=n_out_k, dithered=self.dithered, **common)
        self.v = PagedPool(side=1, n_out=n_out_v, dithered=False, **common)
        for pool in (self.k, self.v):
            if pool.n_out:
                for layer in range(self.n_layers):
                    pool.set_outlier_channels(layer, self.outlier_table[layer].to(torch.int64))

    def _tensors(self) -> list[torch.Tensor]:
        return [self.k.codes, self.k.scales, self.k.outliers, self.v.codes, self.v.scales, self.v.outliers]

    def _resize(self, n_slots: int) -> None:
        for p in (self.k, self.v):
            p.codes, p.scales, p.outliers = (_grow_tensor(t, n_slots) for t in (p.codes, p.scales, p.outliers))
            p.n_slots = n_slots

    def nbytes(self) -> int:
        # the outlier channel index set is a per-(layer, head) constant of the pool, counted once
        return super().nbytes() + self.fixed_bytes()

    def bytes_per_position(self) -> float:
        # the pool's layout formula: int8 codes + fp16 group scales + fp16 outliers, per side
        return float(self.k.bytes_per_token_head() + self.v.bytes_per_token_head())

    def fixed_bytes(self) -> int:
        return _nbytes(self.k.outlier_channels if self.k.n_out else None,
                       self.v.outlier_channels if self.v.n_out else None)

    def _fused_unsupported(self) -> str | None:
        d, g = self.d, self.group
        if d & (d - 1) or d % 4 or (d // g) & (d // g - 1):
            return f"the fused INT8 write takes d and d // group powers of two, got d={d}, group={g}"
        return None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
              pos: torch.Tensor, lens_after: torch.Tensor, one_per_row: bool = False) -> None:
        from kvlib.kernels.int8.write import write_int8, write_int8_kv

        fused = self._write_route(k)
        self.write_path = f"int8-{self._route}"
        if fused:  # K and V in one launch, no host read (the checks that sync are the torch path's)
            write_int8_kv(self.k, self.v, layer, k, v, slots, rule="witcert" if self.dithered else "rtn")
            return
        if self.dithered:
            if k.device.type == "cpu":  # the page table's slots: distinct and in range, no re-check needed
                from kvlib.kernels.int8.write import _write_int8_heads

                _write_int8_heads(self.k, layer, k, slots.to(torch.int64))
                _write_int8_heads(self.v, layer, v, slots.to(torch.int64))
                return
            write_int8(self.k, layer, k.contiguous(), slots, backend="torch")
            write_int8(self.v, layer, v.contiguous(), slots, backend="torch")
            return
        n, h, d = k.shape
        for pool, x, fmt in ((self.k, k, self.formats[0]), (self.v, v, self.formats[1])):
            p = fmt.write(x.reshape(n * h, d).float())  # rtn-int8: per-token, per-group, so batched = per stream
            pool.codes[layer, slots] = p.codes.reshape(n, h, d)
            pool.scales[layer, slots] = p.scales.reshape(n, h, -1)

    def gather(self, layer: int, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = st.shape
        flat = st.reshape(-1).long()
        out = []
        for pool in (self.k, self.v):
            x = pool.read(layer, flat) if pool.dithered else self._read_rtn(pool, layer, flat)
            out.append(x.reshape(b, n, self.n_kv, self.d).transpose(1, 2))
        return out[0], out[1]

    def _read_rtn(self, pool: PagedPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
        c = pool.codes[layer, slots].float()  # s * c per group, without expanding the scales
        x = (c.unflatten(-1, (-1, self.group)) * pool.scales[layer, slots].float().unsqueeze(-1)).flatten(-2)
        if pool.n_out:
            oc = pool.outlier_channels[layer]
            x.scatter_(-1, oc.unsqueeze(0).expand(x.shape[0], -1, -1), pool.outliers[layer, slots].float())
        return x

    def kernel_impl(self, device: torch.device, gqa: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
        """The INT8 decode kernel this store's layer would take on ``device`` (None: reference path)."""
        from kvlib.kernels.backend import triton_available
        from kvlib.kernels.int8.decode import resolve_impl

        on = device.type == "cuda" or (self.interpret and triton_available(device))
        if not on:
            return None
        d4 = self.d // 4
        if self.d % 4 or d4 & (d4 - 1) or self.group % 4:
            return None
        try:
            impl = resolve_impl("auto", self.d, self.group, False, self.k.dither_layout)
        except ValueError:
            return None
        # RTN keys (rtn-int8): the kernels' RTN-key mode (no dither, no certificate); the Gluon kernel reads them
        # whatever the pool's layout label, and is the fastest where it applies
        if (self.k.dither_layout == "h8" or not self.dithered) and device.type == "cuda":
            from kvlib.kernels.int8.gluon import gluon_unsupported

            probe = torch.empty(1, gqa * self.n_kv, self.d, device=device, dtype=dtype)  # the Gluon kernel: fp16/bf16
            if not gluon_unsupported(probe, self._side(self.k, 0), self._side(self.v, 0), False):
                impl = "gluon"
            # the warp-specialised kernels (Hopper, vLLM pages) where they take the pool: faster than the Gluon
            # kernel at every timed shape (kvlib.kernels.int8.decode.WSPEC_CERT_CONFIGS says where and by how much)
            from kvlib.kernels.int8.decode import wspec_unsupported

            if not wspec_unsupported(probe, self._side(self.k, 0), self._side(self.v, 0), v_dither=False,
                                     block_table=torch.empty(1, 1, dtype=torch.int32, device=device),
                                     block_size=self.block_size):
                impl = "wspec"
        return impl

    def _side(self, pool: PagedPool, layer: int):
        from kvlib.kernels.int8.decode import as_side

        return as_side(pool.layer(layer), "pool")

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float):
        key = (q.device, q.shape[1] // self.n_kv, q.dtype)
        cache = self.__dict__.setdefault("_impl", {})
        if key not in cache:  # decided once per device and GQA ratio (no work inside a captured step)
            cache[key] = self.kernel_impl(*key)
        impl = cache[key]
        if impl is None:
            return None
        from kvlib.kernels.int8.decode import decode_int8

        # the warp-specialised kernels read the pages through the block table (TMA boxes inside one page)
        addr = (dict(slots=None, block_table=table.block_table, block_size=self.block_size) if impl == "wspec"
                else dict(slots=table.slot_table()))
        out = decode_int8(q, self.k.layer(layer), self.v.layer(layer), seq_lens=table.seq_lens, layer=layer,
                          seed=self.seed, sm_scale=sm, delta=delta, v_dither=False, impl=impl, cert=self.dithered,
                          fallback_to_reference=False, **addr)
        ran = getattr(out, "path", None)  # the kernel's own record of what ran, where it keeps one
        label = f"int8-{impl}" if not ran else ran if ran.startswith("int8") else f"int8-{ran}"
        return out.o, label, out.tv_bound_one

    def reference_certificates(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float):
        """CPU, dithered keys: the fp32 kernel's arithmetic in torch, every row and head in one batch, with the
        certificate of its rounding model (``impl="fma"``; :func:`kvlib.kernels.int8.reference.
        decode_reference_batched` with ``precision="float32"``: the certificate bounds the attention computed)."""
        from kvlib.kernels.int8.reference import decode_reference_batched

        return decode_reference_batched(q, self.k.layer(layer), self.v.layer(layer), table.slot_table(),
                                        table.seq_lens, layer=layer, seed=self.seed, sm_scale=sm, delta=delta,
                                        impl="fma", precision="float32")


_NIBBLES: dict[torch.device, torch.Tensor] = {}


def _nibble_values(device: torch.device) -> torch.Tensor:
    """float32 ``[256, 2]``: the low and high nibble of every byte (as :func:`kvlib.formats.kv4.unpack_nibbles`)."""
    t = _NIBBLES.get(device)
    if t is None:
        b = torch.arange(256, dtype=torch.int32)
        t = _NIBBLES[device] = torch.stack((b & 15, b >> 4), -1).to(device=device, dtype=torch.float32)
    return t


class Int4Store(Store):
    family = "int4"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        kf = self.formats[0]
        self.rl = kf.name == "kv4rl"
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
        return super().nbytes() + _nbytes(*side)

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
            lst[:] = [_grow_tensor(t, n_slots) for t in lst]

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

    def gather_rows(self, layer: int, st: torch.Tensor, lens: torch.Tensor, rotated: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Effective float K, V ``[B, H, n, d]`` in the original basis (side-buffer values where protected);
        ``rotated``: keys in the stored (Hadamard-rotated) basis, for a caller that rotates its query instead
        (one vector instead of every position: scores are the same, H being orthonormal)."""
        k, v = self.gather(layer, st)
        if self.rl:
            pos = side_positions(lens.to(k.device), self.sink, self.recent)  # [B, C]
            for side, x in enumerate((k, v)):
                vals = self.side8[side][layer].float() * self.side_scale[side][layer].float().unsqueeze(-1)
                ok = pos >= 0
                bi, ci = ok.nonzero(as_tuple=True)
                x[bi, :, pos[bi, ci]] = vals[bi, :, ci]
        return (k if rotated else hadamard(k)), v

    def select_rows(self, layer: int, idx: torch.Tensor) -> None:
        if self.rl:
            for grp in (self.side8, self.side_scale, self.stash8, self.stash_scale):
                for side in (0, 1):
                    grp[side][layer] = grp[side][layer][idx].clone()
            self.valid[layer] = [self.valid[layer][i] for i in idx.tolist()]

    def fixed_rows(self) -> int:
        return self.side8[0][0].shape[0] if self.rl else 0

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float):
        import kvlib.kernels.int4.decode as k4
        from kvlib.kernels.backend import triton_available

        paged = getattr(k4, "kv4_paged_decode", None)
        on = q.device.type == "cuda" or (self.interpret and triton_available(q.device))
        if paged is None or not on or (q.is_cuda and self.d < 64) or q.shape[1] // self.n_kv > 16:
            return None  # the paged KV4 kernel has not landed (or cannot take this shape): reference path
        qp = k4.prepare_query(q, rotate=True)
        start, end = self.main_range(table.seq_lens)
        kc, ks, ko = self.pages(layer, 0)
        vc, vs, vo = self.pages(layer, 1)
        side = self.side_buffer(layer, table.seq_lens) if self.rl else None
        o, _ = paged(qp, kc, ks, ko, vc, vs, vo, table.block_table, start, end, block_size=self.block_size,
                     side=side, sm_scale=sm)
        if self.rl:
            return o, "kv4rl-triton", None
        from kvlib.kernels.int4.wspec import wspec4_unsupported  # the rule kv4_paged_decode's "auto" applied

        ws = wspec4_unsupported(qp, kc, table.block_table, block_size=self.block_size) is None
        return o, "kv4-wspec" if ws else "kv4-triton", None


class PlainStore(Store):
    family = "bf16"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.dtype = self.formats[0].dtype
        self.kv = [torch.zeros(self.n_layers, self.n_slots, self.n_kv, self.d, dtype=self.dtype, device=self.device)
                   for _ in range(2)]

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.kv)

    def _resize(self, n_slots: int) -> None:
        self.kv = [_grow_tensor(t, n_slots) for t in self.kv]

    def write(self, layer, k, v, slots, rows, pos, lens_after, one_per_row=False) -> None:
        self.write_path = "plain-torch"  # a cast and a scatter per side: nothing to fuse
        self.kv[0][layer, slots] = k.to(self.dtype)
        self.kv[1][layer, slots] = v.to(self.dtype)

    def gather(self, layer: int, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = st.shape
        flat = st.reshape(-1).long()
        return tuple(t[layer, flat].reshape(b, n, self.n_kv, self.d).transpose(1, 2) for t in self.kv)

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float):
        from kvlib.kernels.backend import triton_available

        on = q.device.type == "cuda" or (self.interpret and triton_available(q.device))
        if not on or self.formats[0].kernel != "bf16" or self.d & (self.d - 1):
            return None
        from kvlib.kernels.bf16.decode import decode_bf16

        out = decode_bf16(q, self.kv[0][layer], self.kv[1][layer], table.slot_table(), table.seq_lens, sm_scale=sm)
        return out.o, "bf16-triton", None


class FormatStore(Store):
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
                    f[k] = _grow_tensor(f[k], n_slots)

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


class ObjectStore(Store):
    """Stateful formats without pages: the format's packed object per (side, layer, row, head)."""

    paged = False
    slot_bound = True

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


def store_class(key_format: KVFormat, value_format: KVFormat, *, outlier_table: Any = None) -> type[Store]:
    """The store for a (key, value) format pair: a kernel family where both sides are its natural pair."""
    kn, vn = key_format.name, value_format.name
    if kn in ("dither-int8", "rtn-int8") and vn == kn and (kn == "dither-int8" or outlier_table is None):
        if not (kn == "rtn-int8" and key_format.group != value_format.group):
            return Int8Store
    if kn in ("kv4", "kv4rl") and vn == kn:
        ok = key_format.rotate == "k" and (kn == "kv4rl" or key_format.group is None)
        if kn == "kv4rl":
            ok = ok and key_format.main.group is None and key_format.protect == "int8" and (
                key_format.capacity == key_format.sink + key_format.recent)
        if ok:
            return Int4Store
    if kn in ("bf16", "fp16", "fp32") and vn == kn:
        return PlainStore
    if key_format.stateful or value_format.stateful:
        return ObjectStore
    return FormatStore
