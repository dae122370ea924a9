"""What every backend is: the pages of one kernel family, written, read and decoded (see :mod:`kvlib.backends`).

A backend holds ``n_layers`` layers of ``num_blocks * block_size`` slots for ``H_kv`` heads of dim ``d`` (vLLM's
pages: slot = ``block * block_size + offset``; the page tables are :mod:`kvlib.storage.blocks`'), all layers stacked
on a leading axis. No float copy of the cache is kept anywhere; :meth:`Backend.read` dequantises a layer
transiently for the torch reference path.

Writes (:meth:`Backend.write`): the INT8 and INT4 backends write through the fused Triton kernels of
:mod:`kvlib.kernels.write` on CUDA (and on CPU tensors when ``interpret`` is set, under TRITON_INTERPRET=1): one
launch per layer for K and V (and kv4rl's side buffer and crop stash in a decode step), with no host read, so a
decode step captures in a CUDA graph. The torch path beside them is the reference (the same bytes, bound bit for bit
in ``tests/test_write_kernels.py``) and the CPU path; ``write_backend`` picks ("auto", "triton", "torch") and
``write_path`` says which ran (with the reason where the fused write cannot take the shape).

Decode (:meth:`Backend.decode`): the kernel for a query's device, GQA ratio and dtype is chosen once, from the real
tensors, and the :class:`Step` says which path ran. Where no kernel takes the shape (:meth:`Backend.supports` says
why), the step is the torch reference's: the caller attends over :meth:`Backend.read` with the model's own
attention, or, for dithered INT8 keys, the backend's float reference computes the step with its certificate.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvlib.formats.base import KVFormat
from kvlib.storage.blocks import PageTable


class Step(NamedTuple):
    """One decode step of a layer: ``o [B, Hq, d]`` fp32 (None: no output here, the caller attends over
    :meth:`Backend.read` with the model's attention), the ``path`` that ran, and the TV ``certificate [B, Hq]``
    where the format has one (None otherwise)."""

    o: torch.Tensor | None
    path: str
    certificate: torch.Tensor | None = None


#: the torch reference path: no kernel output, no certificate
REFERENCE = Step(None, "torch-reference", None)


def nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def grow_tensor(t: torch.Tensor, n_slots: int) -> torch.Tensor:
    """``t [L, n, ...]`` with its slot axis grown to ``n_slots`` (old slots kept at their index)."""
    out = t.new_zeros((t.shape[0], n_slots, *t.shape[2:]))
    out[:, : t.shape[1]] = t
    return out


def triton_on(device: torch.device, interpret: bool) -> bool:
    """True when the Triton kernels run on ``device``: CUDA, or CPU tensors under TRITON_INTERPRET=1 when the
    backend's ``interpret`` is set."""
    if device.type == "cuda":
        return True
    if not interpret:
        return False
    from kvlib.kernels.backend import triton_available

    return triton_available(device)


def step_addresses(table: PageTable, backend: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's addressing (:meth:`PageTable.step_addresses`: ``rows, pos, slots, lens_after``): one Triton
    launch on CUDA (:mod:`kvlib.kernels.write.addressing`, instead of a dozen small torch ops per layer), the torch
    ops elsewhere; ``backend`` ``"triton"`` (CUDA, or CPU under TRITON_INTERPRET=1) or ``"torch"`` to pick. Reads
    nothing back to the host."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch" or (backend == "auto" and table.seq_lens.device.type != "cuda"):
        return table.step_addresses()
    from kvlib.kernels.backend import triton_available

    if not triton_available(table.seq_lens.device):
        raise RuntimeError("step_addresses(backend='triton') on CPU tensors needs TRITON_INTERPRET=1")
    from kvlib.kernels.write.addressing import launch_step_addresses

    return launch_step_addresses(table)


class Backend:
    """Base: the pages of ``n_layers`` layers for a (key, value) format pair, and the interface the HF adapter
    speaks to (allocate and :meth:`grow`; :meth:`write` and :meth:`append`; :meth:`read`, :meth:`copy_slots`,
    :meth:`select`, :meth:`crop`; :meth:`supports` and :meth:`decode`)."""

    #: the kernel family (a format's declared ``kernel``; "reference" for the torch path)
    family = "reference"
    #: run the Triton kernels on CPU tensors under TRITON_INTERPRET=1 (tests: the kernel path through a model)
    interpret = False
    #: True when a stored code depends on its slot (dithered: the Philox counter is the slot), so pages
    #: cannot be moved to other slots
    slot_bound = False
    #: False for a store without pages (stateful formats: one packed object per row and head)
    paged = True
    #: True when a decode step yields the format's TV certificate (dithered INT8 keys)
    certifies = False
    #: True when the keys are stored in a Hadamard-rotated basis (:meth:`read` can hand them over so, and the
    #: reference path rotates the query instead of every key)
    rotated_keys = False
    #: ``"auto"``: the fused Triton write (:mod:`kvlib.kernels.write`) on CUDA, and on CPU tensors when
    #: ``interpret`` is set (TRITON_INTERPRET=1), the torch path elsewhere; ``"triton"``: the fused write or an
    #: error; ``"torch"``: the torch path (the reference, bit for bit the same bytes)
    write_backend = "auto"
    #: the path the last write took, e.g. ``"int8-triton"``, ``"kv4-torch"``; ``"...-torch:<why>"`` when the
    #: fused write cannot take the shape (never a silent fallback). None before the first write.
    write_path: str | None = None

    @classmethod
    def takes(cls, key_format: KVFormat, value_format: KVFormat, outlier_table: Any = None) -> str | None:
        """Why this backend cannot hold the (key, value) pair with these options (None: it can). The format class
        names its backend (``kernel``); this says which of its options the backend's kernels read. A family's pages
        hold keys and values of one format."""
        if type(value_format) is not type(key_format):
            return f"keys and values in one format (got {key_format.name!r} and {value_format.name!r})"
        return None

    def __init__(self, n_layers: int, n_kv: int, d: int, block_size: int, num_blocks: int, device: torch.device,
                 key_format: KVFormat, value_format: KVFormat, *, batch: int, seed: int = 0,
                 outlier_table: torch.Tensor | None = None, outlier_sides: tuple[int, ...] = (0,),
                 crop_window: int = 32) -> None:
        self.crop_window = crop_window
        self.n_layers, self.n_kv, self.d, self.block_size = n_layers, n_kv, d, block_size
        self.num_blocks, self.device, self.batch, self.seed = num_blocks, device, batch, seed
        self.formats = (key_format, value_format)
        self.outlier_table, self.outlier_sides = outlier_table, tuple(outlier_sides)
        self._chosen: dict[tuple, str | None] = {}

    # -- allocate and grow ------------------------------------------------------------------------
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

    def nbytes(self) -> int:
        return nbytes(*self._tensors())

    def bytes_per_position(self) -> float:
        """K + V bytes per position per KV head, from the formats' layout formulas."""
        return float(self.formats[0].bytes_per_position(self.d) + self.formats[1].bytes_per_position(self.d))

    def fixed_bytes(self) -> int:
        """Bytes independent of the positions allocated (per-head constants, per-sequence side buffers)."""
        return 0

    # -- write ------------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
              pos: torch.Tensor, lens_after: torch.Tensor, one_per_row: bool = False) -> None:
        """Store ``k, v [N, H, d]`` at ``slots [N]`` (tokens at positions ``pos`` of rows ``rows``; ``lens_after``
        ``[B]`` the rows' lengths after the write; ``one_per_row``: a decode step, one token per row)."""
        raise NotImplementedError

    def append(self, layer: int, table: PageTable, k: torch.Tensor, v: torch.Tensor,
               keep: torch.Tensor | None = None, record: bool = False):
        """Store ``k, v [B, H, s, d]`` after each row's tokens (``keep [B, s]`` bool: the tokens to keep, None: all)
        and advance ``table``. With ``record``: what was stored, ``(k [N, H, d], v, rows, pos, slots)`` (for a cache
        hook, :class:`kvlib.hf.cache.CacheHook`); else None."""
        b, h, s, d = k.shape
        if keep is None and s == 1:
            table.reserve([1] * b)
            rows, pos, slots, lens_after = step_addresses(table)  # one launch on CUDA
            kt, vt = k[:, :, 0], v[:, :, 0]
            self.write(layer, kt, vt, slots, rows, pos, lens_after, one_per_row=True)
            table.advance([1] * b)
            return (kt, vt, rows, pos, slots) if record else None
        keep = torch.ones(b, s, dtype=torch.bool, device=k.device) if keep is None else keep
        counts = keep.sum(1)
        n_new = counts.tolist()  # prefill / chunk: one host sync is fine here
        table.reserve(n_new)
        rows, cols = keep.nonzero(as_tuple=True)
        base = torch.tensor(table.lens, dtype=torch.int64, device=k.device)
        offs = (keep.cumsum(1) - 1)[rows, cols]
        pos = base[rows] + offs
        slots = table.write_slots(rows, pos, offs)
        kt, vt = k.permute(0, 2, 1, 3)[rows, cols], v.permute(0, 2, 1, 3)[rows, cols]  # [N, H, d]
        self.write(layer, kt, vt, slots, rows, pos, base + counts)
        table.advance(n_new, counts)
        return (kt, vt, rows, pos, slots) if record else None

    def as_attended(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a float prefill's attention sees of the new tokens: the float K/V themselves, unless the pages
        hold them in another float dtype (:class:`kvlib.backends.plain.PlainBackend`: the values as stored)."""
        return k, v

    def _fused_unsupported(self) -> str | None:
        """Why the fused write cannot take this backend's shapes (None: it can)."""
        return "no fused write for this backend"

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

    # -- read, copy, select, crop ------------------------------------------------------------------
    def gather(self, layer: int, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K, V ``[B, H, n, d]`` of layer ``layer`` at the slots ``st [B, n]``."""
        raise NotImplementedError

    def read(self, layer: int, table: PageTable, n: int, rotated: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K, V ``[B, H, n, d]`` of every row's first ``n`` positions (the reference path's transient view;
        past a row's length: whatever the slots hold). ``rotated``: keys left in their stored basis where
        :attr:`rotated_keys`."""
        return self.gather(layer, table.slot_table()[:, :n])

    def packed_heads(self, layer: int, slots: torch.Tensor, row: int, side: int) -> list[Any]:
        """The format's packed object of each KV head of row ``row`` at ``slots [n]`` (its positions in order), for
        inspection and the gate's radii; not what the kernels read."""
        raise NotImplementedError(f"packed views exist for INT8 pools, format pages and stateful objects, not for "
                                  f"{type(self).__name__}")

    def copy_slots(self, layer: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy layer ``layer``'s contents of slots ``src`` to slots ``dst`` (slot-independent formats)."""
        for t in self._tensors():
            t[layer, dst] = t[layer, src].clone()

    def gather_rows(self, layer: int, st: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor | None = None,
                    rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K, V ``[B, H, n, d]`` at the slots ``st [B, n]`` of rows of lengths ``lens [B]`` as the decode
        step sees them (per-sequence state included where a backend keeps one); ``rows [B]``: the rows whose
        per-sequence state applies (default: ``0..B-1``). Keys in the original basis unless ``rotated``."""
        return self.gather(layer, st)

    def clear_row(self, row: int) -> None:
        """Row ``row`` is emptied (its pages are freed by the caller): per-sequence state is reset; none by
        default."""

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s per-sequence state moves to row ``dst`` in place (a captured step keeps reading the same
        tensors); none by default."""

    def select_rows(self, layer: int, idx: torch.Tensor) -> None:
        """Per-sequence state (side buffers) follows a batch selection; none by default."""

    def select(self, layer: int, table: PageTable, idx: torch.Tensor, filled: bool) -> None:
        """Rows ``idx`` (int64, CPU) of the batch become the new batch (beam search, repeats): slot-bound codes
        never move (the table's token-slot mode: repeats share the prefix and write fresh pages); slot-independent
        codes of a ``filled`` layer are copied row by row, into fresh pages or, for static pools, over the rows'
        own pages (gathered first); per-sequence state follows (:meth:`select_rows`)."""
        rows = idx.tolist()
        t = table
        if t.token_slots:
            t.select_tokens(rows)
        elif self.paged and filled:
            t.uniform()
            width, bs = t.block_table.shape[1], t.block_size
            src = t.block_table[idx.to(t.block_table.device)].long()
            if t.static:
                if len(rows) != t.batch:
                    raise ValueError(f"static pools hold batch_size={t.batch} rows; a selection of {len(rows)} "
                                     "rows needs make_cache without batch_size/max_len")
                new_blocks = [list(b) for b in t.blocks]
            else:
                new_blocks = [t._take(width) for _ in rows]
            dst = torch.tensor(new_blocks, dtype=torch.int64).reshape(len(rows), width).to(src.device)
            ar = torch.arange(bs, device=src.device)
            self.copy_slots(layer, (dst[..., None] * bs + ar).reshape(-1), (src[..., None] * bs + ar).reshape(-1))
            if t.static:
                t.set_lens([t.lens[r] for r in rows])
            else:
                t.select(rows, new_blocks)
        else:
            t.select(rows)
        self.select_rows(layer, idx.to(self.device))

    @property
    def croppable(self) -> bool:
        return True

    def crop(self, layer: int, old_lens: list[int], new_lens: list[int]) -> None:
        """Per-sequence state follows a crop (the page table shortens the rows); none by default."""

    # -- decode -----------------------------------------------------------------------------------
    def supports(self, shape: tuple[int, ...], device: torch.device) -> str | None:
        """Why no decode kernel of this backend takes a query of ``shape [B, Hq, d]`` on ``device`` (None: one
        does)."""
        return f"no decode kernel reads {self.formats[0].name!r} pages (the format declares kernel=None)"

    def _kernel(self, q: torch.Tensor, choose) -> str | None:
        """The kernel ``choose()`` picks for ``q``'s device, GQA ratio and dtype, decided once (no work inside a
        captured step), or None where :meth:`supports` refuses the shape."""
        key = (q.device, q.shape[1] // self.n_kv, q.dtype, self.interpret)
        if key not in self._chosen:
            self._chosen[key] = None if self.supports(tuple(q.shape), q.device) else choose()
        return self._chosen[key]

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float, *, certify: bool = True,
               masked: bool = False) -> Step:
        """One decode step of ``q [B, Hq, d]`` over layer ``layer``'s rows as ``table`` addresses them
        (``block_table``, ``seq_lens``, ``slot_table()``): the kernel's :class:`Step`, or the reference's.
        ``masked``: the model's mask must be honoured (a sliding window), which no kernel takes; ``certify``:
        compute the certificate where only the reference can (the CPU path's stride)."""
        return REFERENCE
