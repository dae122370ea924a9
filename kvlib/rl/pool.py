"""The continuous-batching engine's KV memory: a fixed byte budget cut into pages of one format.

KV4-RL App. B: "the allocator first reserves model state, execution workspace, quantization metadata, and any
protected side-cache storage, then converts the remaining HBM capacity into pages of the corresponding KV format.
Request admission requires both an available request slot and sufficient free KV pages." :func:`plan_pool` does
that arithmetic for a budget given in bytes (the model state and workspace are :mod:`kvlib.rl.memory`'s part):

* the per-row state of the format (kv4rl's INT8 side buffer of ``sink + recent`` positions per layer, KV head and
  side, plus a one-entry crop stash the backend always keeps) is reserved first for every row;
* the block table and lengths of every row next;
* the rest becomes whole pages of ``block_size`` positions across all layers (K and V), one of them the *null page*
  that padding rows of a bucketed decode step write into and read from (never handed to a request).

Bytes are measured from the tensors the format's backend (:mod:`kvlib.backends`) allocates (backends of one and
two pages, one and two rows, differenced), not from a formula, so the plan is what :class:`PagedKV` then allocates
(checked at construction). A lower-bit format has smaller pages, so the same budget holds more of them.

Rows: ``slots`` decode rows ``[0, slots)`` (the requests in flight; a decode step at bucket ``B`` reads rows
``[0, B)``) and ``staging`` prefill rows ``[slots, slots + staging)`` where arrivals are prefilled before they move
into the decode region. Pages are never moved: a row's pages are named by its block-table row, so moving a request
between rows copies its table row, its length and (kv4rl) its side buffer, never a page (dithered INT8 codes are
bound to their slot).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvlib.backends import Backend, Int4Backend, Int8Backend, PlainBackend, backend_class
from kvlib.core.checks import check_positive_int
from kvlib.formats.base import get_format
from kvlib.storage.blocks import BlockAllocator

#: the backends the engine drives (the kernel families: paged pools with decode kernels on CUDA)
ENGINE_BACKENDS = (Int8Backend, Int4Backend, PlainBackend)
#: the INT4 decode kernels read whole pages of 256 positions (kvlib.rl.engine.BLOCK_SIZE); the others gather per token
DEFAULT_BLOCK_SIZE = {"kv4": 256, "kv4rl": 256}
NULL_PAGE = 0


def model_shape(config: Any) -> tuple[int, int, int, int]:
    """``(layers, kv heads, head dim, query heads)`` of a transformers config (its text part)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_heads = int(text.num_attention_heads)
    n_kv = int(getattr(text, "num_key_value_heads", None) or n_heads)
    d = int(getattr(text, "head_dim", None) or text.hidden_size // n_heads)
    return int(text.num_hidden_layers), n_kv, d, n_heads


def _formats(fmt: str, options: dict[str, Any]):
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a str (a kvlib format name), got {type(fmt).__name__}")
    kf, vf = get_format(fmt, **options), get_format(fmt, **options)
    cls = backend_class(kf, vf)
    if cls not in ENGINE_BACKENDS:
        raise ValueError(f"fmt={fmt!r} (options {options}) has no paged kernel backend ({cls.__name__}); the engine "
                         f"drives {', '.join(c.__name__ for c in ENGINE_BACKENDS)}: bf16/fp16/fp32, dither-int8, "
                         "rtn-int8, kv4, kv4rl")
    return kf, vf, cls


def _backend(cls: type[Backend], kf, vf, shape: tuple[int, int, int], block_size: int, pages: int, rows: int,
           device: torch.device, seed: int = 0) -> Backend:
    L, n_kv, d = shape
    # crop_window=1: the engine never crops, and kv4rl's backend always keeps a stash of at least one entry
    return cls(L, n_kv, d, block_size, pages, device, kf, vf, batch=rows, seed=seed, crop_window=1)


@dataclass(frozen=True)
class PoolPlan:
    """How a byte budget is cut for one format (see the module docstring). All byte counts are measured."""

    fmt: str
    format_options: dict[str, Any]
    n_layers: int
    n_kv: int
    head_dim: int
    block_size: int
    slots: int
    staging: int
    max_blocks: int  # block-table width: pages a request may hold (its longest context)
    budget_bytes: int
    page_bytes: int  # one page: block_size positions x all layers x K and V (codes + scales)
    row_bytes: int  # per-row state reserved first (kv4rl side buffer + crop stash); 0 for other formats
    fixed_bytes: int  # per-backend constants (e.g. outlier channel tables)
    table_bytes: int  # block tables + lengths of every row
    pages: int  # pages handed to requests (the null page excluded)
    side_positions: int = field(default=0)  # kv4rl: sink + recent positions held per row in the side buffer

    @property
    def rows(self) -> int:
        return self.slots + self.staging

    @property
    def positions(self) -> int:
        """Context positions the pages hold."""
        return self.pages * self.block_size

    @property
    def kappa(self) -> float:
        """Bytes per context position (all layers, K and V) of the pages: the format's ``kappa``."""
        return self.page_bytes / self.block_size

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    @property
    def allocated_bytes(self) -> int:
        """What :class:`PagedKV` allocates: the pages plus the null page, the row state, constants and tables."""
        return (self.pages + 1) * self.page_bytes + self.rows * self.row_bytes + self.fixed_bytes + self.table_bytes

    def requests_at(self, context: int) -> int:
        """Requests of ``context`` positions each that the pages hold at once (before the slot limit)."""
        check_positive_int("context", context)
        return self.pages // -(-context // self.block_size)

    def concurrency_at(self, context: int) -> int:
        """Requests in flight at ``context`` positions each: the smaller of the slot and page limits."""
        return min(self.slots, self.requests_at(context))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"positions": self.positions, "kappa": self.kappa, "rows": self.rows,
                               "allocated_bytes": self.allocated_bytes}

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.fmt}: budget {self.budget_bytes / gib:.3f} GiB = row state {self.rows} x "
                f"{self.row_bytes:,} B + tables {self.table_bytes:,} B + {self.pages + 1:,} pages x "
                f"{self.page_bytes:,} B ({self.block_size} positions, kappa {self.kappa:,.1f} B/position; one null "
                f"page); {self.positions:,} positions for {self.slots} slots + {self.staging} staging rows, "
                f"{self.max_context:,} positions per request at most")


def plan_pool(fmt: str, config: Any, *, budget_bytes: int, slots: int, max_context: int, staging: int = 8,
              block_size: int | None = None, **format_options: Any) -> PoolPlan:
    """Cut ``budget_bytes`` into pages of ``fmt`` after reserving per-row state and tables (module docstring).

    ``slots``: requests in flight at most (decode rows); ``staging``: arrivals prefilled at once; ``max_context``:
    the longest context a request may reach (prompt + response), which sets the block-table width. Raises
    ValueError when the budget cannot hold the reserved state plus one longest request.
    """
    check_positive_int("slots", slots)
    check_positive_int("staging", staging)
    check_positive_int("max_context", max_context)
    check_positive_int("budget_bytes", budget_bytes)
    kf, vf, cls = _formats(fmt, format_options)
    bs = DEFAULT_BLOCK_SIZE.get(fmt, 16) if block_size is None else check_positive_int("block_size", block_size)
    L, n_kv, d, _ = model_shape(config)
    shape = (L, n_kv, d)
    cpu = torch.device("cpu")
    # measured: backends of (1 page, 1 row), (2 pages, 1 row), (1 page, 2 rows), differenced
    base = _backend(cls, kf, vf, shape, bs, 1, 1, cpu).nbytes()
    page_bytes = _backend(cls, kf, vf, shape, bs, 2, 1, cpu).nbytes() - base
    row_bytes = _backend(cls, kf, vf, shape, bs, 1, 2, cpu).nbytes() - base
    fixed = base - page_bytes - row_bytes
    width = -(-max_context // bs)
    rows = slots + staging
    # int32 block table [rows, width] and lengths [rows]; the decode step's live mask (bool) and position buffer
    table_bytes = rows * width * 4 + rows * 4 + rows * 1 + rows * 8
    free = budget_bytes - rows * row_bytes - fixed - table_bytes
    pages = free // page_bytes - 1  # one null page
    if pages < width:
        raise ValueError(f"budget_bytes={budget_bytes:,} holds {max(pages, 0)} pages of {fmt} ({page_bytes:,} B each) "
                         f"after {rows} rows x {row_bytes:,} B of row state: fewer than the {width} pages of one "
                         f"request of max_context={max_context}")
    side = int(getattr(kf, "capacity", 0) or 0) if cls is Int4Backend and kf.name == "kv4rl" else 0
    return PoolPlan(fmt=fmt, format_options=dict(format_options), n_layers=L, n_kv=n_kv, head_dim=d, block_size=bs,
                    slots=slots, staging=staging, max_blocks=width, budget_bytes=int(budget_bytes),
                    page_bytes=int(page_bytes), row_bytes=int(row_bytes), fixed_bytes=int(fixed),
                    table_bytes=int(table_bytes), pages=int(pages), side_positions=side)


class PagedKV:
    """The pages, rows and block tables of a :class:`PoolPlan` on a device (module docstring).

    Host mirrors (``blocks``, ``lens``) beside the device ``block_table [rows, max_blocks]`` and ``seq_lens [rows]``
    (int32): allocation never reads the device. Rows without a request point every table entry at the null page.
    """

    def __init__(self, plan: PoolPlan, device: Any, *, seed: int = 0, interpret: bool = False) -> None:
        if not isinstance(plan, PoolPlan):
            raise TypeError(f"plan must be a PoolPlan, got {type(plan).__name__}")
        self.plan = plan
        self.device = torch.device(device)
        kf, vf, cls = _formats(plan.fmt, plan.format_options)
        self.backend = _backend(cls, kf, vf, (plan.n_layers, plan.n_kv, plan.head_dim), plan.block_size, plan.pages + 1,
                            plan.rows, self.device, seed)
        self.backend.interpret = bool(interpret)
        rows, width = plan.rows, plan.max_blocks
        self.block_table = torch.full((rows, width), NULL_PAGE, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        got = self.backend.nbytes() + plan.table_bytes
        if got != plan.allocated_bytes or got > plan.budget_bytes:
            raise RuntimeError(f"the backend allocated {got:,} B against the plan's {plan.allocated_bytes:,} B "
                               f"(budget {plan.budget_bytes:,} B)")
        self.allocator = BlockAllocator(plan.pages + 1)
        taken = self.allocator.alloc(plan.pages + 1)
        self.allocator.release([b for b in taken if b != NULL_PAGE])  # the null page is never handed out
        self.blocks: list[list[int]] = [[] for _ in range(rows)]
        self.lens = [0] * rows

    # -- pages ------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self.allocator.free)

    @property
    def used_pages(self) -> int:
        return sum(len(b) for b in self.blocks)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.plan.block_size)

    def ensure(self, row: int, positions: int) -> bool:
        """Give ``row`` pages for ``positions`` positions (host bookkeeping + one table write per new page);
        False, with nothing taken, when too few pages are free."""
        if positions > self.plan.max_context:
            raise ValueError(f"positions={positions} exceeds the plan's max_context={self.plan.max_context}")
        need = self.pages_for(positions) - len(self.blocks[row])
        if need <= 0:
            return True
        got = self.allocator.alloc(need)
        if got is None:
            return False
        j0 = len(self.blocks[row])
        self.blocks[row] += got
        self.block_table[row, j0:j0 + need] = torch.tensor(got, dtype=torch.int32).to(self.device)
        return True

    def release(self, row: int) -> int:
        """Free ``row``'s pages and point its table at the null page; returns the pages freed."""
        n = len(self.blocks[row])
        if n:
            self.allocator.release(self.blocks[row])
            self.block_table[row, :n] = NULL_PAGE
        self.blocks[row] = []
        self.lens[row] = 0
        self.seq_lens[row] = 0
        self.backend.clear_row(row)
        return n

    def move(self, src: int, dst: int) -> None:
        """Move the request of row ``src`` into the empty row ``dst``: its table row, length and per-row state
        (kv4rl's side buffer and crop stash); ``src`` is left empty. Pages stay where they are."""
        if self.blocks[dst]:
            raise ValueError(f"row {dst} is not empty")
        self.block_table[dst].copy_(self.block_table[src])
        self.block_table[src] = NULL_PAGE
        self.seq_lens[dst] = self.seq_lens[src]
        self.seq_lens[src] = 0
        self.blocks[dst], self.blocks[src] = self.blocks[src], []
        self.lens[dst], self.lens[src] = self.lens[src], 0
        self.backend.move_row(src, dst)  # in place: a captured decode step keeps reading the same tensors

    def check(self) -> None:
        """Raise AssertionError on a page leak or a corrupt table (tests; a host read of the table)."""
        held = [b for bl in self.blocks for b in bl]
        free = list(self.allocator.free)
        assert NULL_PAGE not in held and NULL_PAGE not in free, "the null page was handed out"
        assert len(set(held)) == len(held), "a page is held by two rows"
        assert not set(held) & set(free), "a page is both held and free"
        assert len(held) + len(free) == self.plan.pages, f"page leak: {len(held)} held + {len(free)} free != " \
                                                         f"{self.plan.pages}"
        tab = self.block_table.cpu()
        for r, bl in enumerate(self.blocks):
            assert tab[r, :len(bl)].tolist() == bl, f"row {r}: block table differs from its pages"
            assert (tab[r, len(bl):] == NULL_PAGE).all(), f"row {r}: stale table entries"
            assert self.lens[r] <= len(bl) * self.plan.block_size, f"row {r}: length past its pages"
        dev = self.seq_lens.cpu().tolist()
        for r, bl in enumerate(self.blocks):  # free rows' device lengths are scratch (padding rows of a step)
            assert not bl or dev[r] == self.lens[r], f"row {r}: device length {dev[r]} != host {self.lens[r]}"
