"""Paged addressing in vLLM's conventions: a block allocator (free list) and one page table per layer.

A sequence's positions live in fixed-size blocks of ``block_size`` slots; ``block_table`` int32
``[B, max_blocks]`` names the blocks of each row in order and ``seq_lens`` int32 ``[B]`` its length, both
on the device. Position ``p`` of row ``b`` is slot ``block_table[b, p // block_size] * block_size +
p % block_size`` of the layer's pool, so pages of one sequence need not be contiguous (a block manager
may hand them out in any order, as :class:`BlockAllocator` with ``shuffle`` does in the tests).

Host mirrors (``lens``, ``blocks``) are kept beside the device tensors so that allocation never reads the
device. With ``max_len`` every row gets all of its blocks at construction: a decode step then only
reads and advances ``seq_lens`` on the device (no host sync, no shape change: CUDA-graph capturable).

Token-slot mode (``token_slots=True``, for pools whose codes are bound to their slot, as dithered INT8
is: the Philox counter is the slot, so pages can never be copied elsewhere): each row *writes* append-only
into its own blocks at a write index ``wpos`` and a per-token slot table ``tok [B, cap]`` records where each
logical position lives. A batch selection with repeats (beam search) then shares the prefix slots
read-only and gives each repeated row fresh blocks for what it writes next; a crop shortens ``seq_lens``
and leaves the cropped slots unused (a slot, hence a dither, is never reused inside a cache's life).
Blocks of rows dropped by a selection are kept (other rows may still read them) until ``reset``.
"""

from __future__ import annotations

import random

import torch

from kvlib.core.checks import check_positive_int


class BlockAllocator:
    """Free list of block ids ``0..num_blocks-1``; ``grow`` extends it when the pool is enlarged."""

    def __init__(self, num_blocks: int, *, shuffle: int | None = None) -> None:
        check_positive_int("num_blocks", num_blocks, minimum=0)
        self.num_blocks = 0
        self.free: list[int] = []
        self._rng = random.Random(shuffle) if shuffle is not None else None
        self.grow(num_blocks)

    def grow(self, num_blocks: int) -> None:
        new = list(range(self.num_blocks, num_blocks))
        if self._rng is not None:
            self._rng.shuffle(new)
        self.free = new[::-1] + self.free if self._rng is None else new + self.free
        self.num_blocks = max(self.num_blocks, num_blocks)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free blocks, or None when fewer are free (the caller grows the pool and retries)."""
        if n > len(self.free):
            return None
        out = [self.free.pop() for _ in range(n)]
        return out

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)


class PageTable:
    """Block table, lengths and allocator of one layer (see the module docstring)."""

    def __init__(self, batch: int, block_size: int, device: torch.device, allocator: BlockAllocator,
                 grow_pool, *, max_len: int | None = None, token_slots: bool = False) -> None:
        self.batch, self.block_size, self.device = batch, block_size, device
        self.token_slots = token_slots
        self.owned: list[int] = []  # every block this table took (released by reset)
        self.shared = [False] * batch  # token-slot mode: the row's prefix slots are shared with another row
        self.wlens = [0] * batch  # write index per row (== lens unless token_slots)
        self.wpos = torch.zeros(batch, dtype=torch.int32, device=device)
        self.tok = torch.zeros(batch, max_len or 0, dtype=torch.int32, device=device)
        self.allocator = allocator
        self._grow_pool = grow_pool  # callable(min_blocks) -> new num_blocks of the pool
        self.blocks: list[list[int]] = [[] for _ in range(batch)]
        self.lens = [0] * batch
        width = 0 if max_len is None else -(-max_len // block_size)
        self.block_table = torch.zeros(batch, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.static = max_len is not None
        self.max_len = max_len
        if self.static:
            self._alloc_rows(list(range(batch)), width)

    # -- allocation -----------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        got = self.allocator.alloc(n)
        if got is None:
            self.allocator.grow(self._grow_pool(self.allocator.used + n))
            got = self.allocator.alloc(n)
            assert got is not None
        self.owned.extend(got)
        return got

    def _alloc_rows(self, rows: list[int], width: int) -> None:
        changed = False
        for b in rows:
            need = width - len(self.blocks[b])
            if need > 0:
                self.blocks[b] += self._take(need)
                changed = True
        if changed or self.block_table.shape[1] < width:
            self._upload(max(width, self.block_table.shape[1]))

    def _upload(self, width: int) -> None:
        # unallocated entries point at block 0; they are never read (positions >= seq_lens are masked)
        tab = [bl + [0] * (width - len(bl)) for bl in self.blocks]
        self.block_table = torch.tensor(tab, dtype=torch.int32).reshape(self.batch, width).to(self.device)

    def reserve(self, n_new: list[int]) -> None:
        """Make row ``b`` able to take ``n_new[b]`` more tokens (host only, unless a block is added)."""
        if self.token_slots:
            want = max(a + n for a, n in zip(self.lens, n_new)) if self.batch else 0
            if want > self.tok.shape[1]:
                if self.static:
                    raise ValueError(f"max_len={self.max_len} exceeded: a row would hold {want} positions")
                grown = torch.zeros(self.batch, max(want, 2 * self.tok.shape[1], 16), dtype=torch.int32,
                                    device=self.device)
                grown[:, : self.tok.shape[1]] = self.tok
                self.tok = grown
        new_lens = [a + n for a, n in zip(self.wlens, n_new)]
        if self.static:
            over = [n for n in new_lens if n > self.max_len]
            if over:
                raise ValueError(f"max_len={self.max_len} exceeded: a row would hold {max(over)} positions "
                                 "(static pools: a repeated row's fresh pages do not fit either)")
            return
        need = [b for b in range(self.batch) if -(-new_lens[b] // self.block_size) > len(self.blocks[b])]
        # (in token-slot mode new_lens are write indices: each row's own append-only pages)
        if need:
            width = max(-(-n // self.block_size) for n in new_lens)
            for b in need:
                self.blocks[b] += self._take(-(-new_lens[b] // self.block_size) - len(self.blocks[b]))
            self._upload(max(width, self.block_table.shape[1]))

    def uniform(self) -> None:
        """Give every row as many blocks as the table is wide (so rows can be gathered as whole tables)."""
        self._alloc_rows(list(range(self.batch)), self.block_table.shape[1])

    # -- addressing -----------------------------------------------------------------------------
    def slots(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """int64 slots of positions ``pos`` of rows ``rows`` (device tensors of one shape)."""
        bs = self.block_size
        return self.block_table[rows, torch.div(pos, bs, rounding_mode="floor")].long() * bs + pos % bs

    def write_slots(self, rows: torch.Tensor, pos: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
        """Slots for new tokens of ``rows`` at logical positions ``pos`` (``offs``: each token's index among its
        row's new tokens); in token-slot mode they are recorded in ``tok``."""
        if not self.token_slots:
            return self.slots(rows, pos)
        w = self.wpos.long()[rows] + (0 if offs is None else offs)
        sl = self.slots(rows, w)
        self.tok[rows, pos] = sl.to(torch.int32)
        return sl

    def step_addresses(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's addressing (one new token per row), without advancing: int64 ``(rows, pos, slots,
        lens_after)`` ``[B]`` with ``rows = arange(B)``, ``pos = seq_lens``, ``slots = write_slots(rows, pos)``
        (recorded in ``tok`` in token-slot mode) and ``lens_after = pos + 1``. Reads nothing back to the host. This is
        the torch reference; :func:`kvlib.backends.base.step_addresses` launches one Triton kernel instead on CUDA."""
        rows = torch.arange(self.batch, device=self.seq_lens.device)
        pos = self.seq_lens.long()
        return rows, pos, self.write_slots(rows, pos), pos + 1

    def slot_table(self) -> torch.Tensor:
        """int32 ``[B, width * block_size]``: the slot of every position a row may hold (the INT8/bf16
        kernels' per-token slot table, computed from the block table on the device)."""
        if self.token_slots:
            return self.tok
        bs = self.block_size
        ar = torch.arange(bs, dtype=torch.int32, device=self.block_table.device)
        return (self.block_table[:, :, None] * bs + ar).reshape(self.batch, -1)

    def advance(self, n: list[int], n_dev: torch.Tensor | None = None) -> None:
        self.lens = [a + b for a, b in zip(self.lens, n)]
        self.wlens = [a + b for a, b in zip(self.wlens, n)]
        if n_dev is None and all(x == 1 for x in n):
            self.seq_lens.add_(1)
            self.wpos.add_(1)
            return
        inc = (torch.tensor(n, dtype=torch.int32).to(self.device) if n_dev is None else n_dev.to(torch.int32))
        self.seq_lens.add_(inc)
        self.wpos.add_(inc)

    def set_lens(self, lens: list[int]) -> None:
        """Shorten rows (crop). A row whose slots are its own rewinds its write index (the cropped slots are
        written again); in token-slot mode a row sharing slots with another keeps it (they are not reused)."""
        self.lens = list(lens)
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        self.wlens = [w if self.token_slots and sh else n for w, n, sh in zip(self.wlens, lens, self.shared)]
        self.wpos.copy_(torch.tensor(self.wlens, dtype=torch.int32))

    def reset(self) -> None:
        """Empty every row; dynamic tables give all their blocks back (static ones keep their pages)."""
        if not self.static:
            self.allocator.release(self.owned)
            self.owned, self.blocks = [], [[] for _ in range(self.batch)]
            self._upload(0)
            if self.token_slots:
                self.tok = self.tok[:, :0]
        self.lens = [0] * self.batch
        self.wlens = [0] * self.batch
        self.shared = [False] * self.batch
        self.seq_lens.zero_()
        self.wpos.zero_()

    def select(self, rows: list[int], new_blocks: list[list[int]] | None = None) -> None:
        """Rows ``rows`` of the table become the new batch (``new_blocks``: their fresh block lists)."""
        keep = set(rows) if new_blocks is None else set()
        for b in range(self.batch):
            if b not in keep:
                self.allocator.release(self.blocks[b])
                gone = set(self.blocks[b])
                self.owned = [x for x in self.owned if x not in gone]
        self.blocks = [list(self.blocks[r]) for r in rows] if new_blocks is None else new_blocks
        self.lens = [self.lens[r] for r in rows]
        self.wlens = list(self.lens)
        self.shared = [False] * len(rows)
        self.batch = len(rows)
        self._upload(self.block_table.shape[1])
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32).to(self.device)
        self.wpos = self.seq_lens.clone()

    def select_tokens(self, rows: list[int]) -> None:
        """Token-slot mode: rows ``rows`` become the batch; a row's first copy keeps its blocks and write index,
        a repeat shares the prefix slots read-only and writes into fresh blocks."""
        seen: set[int] = set()
        blocks, wlens = [], []
        dup = {r for r in rows if rows.count(r) > 1}
        shared = [self.shared[r] or r in dup for r in rows]
        for r in rows:
            if r in seen:
                blocks.append([])
                wlens.append(0)
            else:
                blocks.append(self.blocks[r])
                wlens.append(self.wlens[r])
            seen.add(r)
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.tok = self.tok[idx].clone()
        self.blocks, self.wlens, self.shared = blocks, wlens, shared
        self.lens = [self.lens[r] for r in rows]
        self.batch = len(rows)
        if self.static:
            self._alloc_rows(list(range(self.batch)), self.block_table.shape[1])
        self._upload(max(self.block_table.shape[1], max((len(b) for b in blocks), default=0)))
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32).to(self.device)
        self.wpos = torch.tensor(self.wlens, dtype=torch.int32).to(self.device)

    def nbytes(self) -> int:
        """Bytes of the page table itself (block table + lengths)."""
        ts = (self.block_table, self.seq_lens) + ((self.tok, self.wpos) if self.token_slots else ())
        return sum(t.numel() * t.element_size() for t in ts)
