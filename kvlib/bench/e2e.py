"""kvlib inside a model: HF decode steps of a Qwen2.5-7B-shaped decoder through each KV cache, end to end.

The model is ``transformers.Qwen2ForCausalLM`` built from a config with Qwen2.5-7B's shapes (28 layers,
hidden 3584, MLP 18944, 28 query / 4 KV heads, d = 128, vocab 152064) and **random bf16 weights**,
allocated directly on the device (speed does not depend on weight values; the result says so). Each
cache is filled to S positions with synthetic K/V through ``cache.update`` in chunks (no prefill: one
random chunk is reused for every chunk and layer, since values do not change speed either), then one
decode step ``model(input_ids=..., past_key_values=cache, cache_position=[S])`` is timed.

Methods (:data:`METHODS`). Peers: ``dynamic-sdpa`` (HF ``DynamicCache`` + SDPA, eager; the issue's reference:
goals are judged against it where it ran, else against the graph peer, and say which), ``static-sdpa`` (HF
``StaticCache`` + SDPA in a CUDA graph: the bf16 graph peer, whose ratio every goal shows beside),
``hf-quanto-int4`` / ``hf-hqq-int4`` (HF ``QuantizedCache``, eager, packages from ``.whl`` via
:func:`kvlib.bench.peers_hf.ensure_peer_packages`). Ours, by name through ``kvlib.make_cache(fmt, config,
batch_size=B, max_len=S+1, device=, dtype=)``: ``dither-int8`` (h8 dither layout, certified), ``rtn-int8``,
``kv4``, ``kv4rl``, and the slot ``dither-int8-gated`` (``kvlib.make_gated_cache`` on the same cache; it
records why not while the gate does not support the kernel cache). Our caches must offer ``kv_nbytes()``
and ``kernel_path(layer)``; a cache without them is a recorded error naming the method, never skipped.

Order and time (:meth:`Profile.plan`): the goal cell (B=64, S=32k) and the 32k fixed-budget cell first, then B=8,
S=16k (the HF peers' cell) and the 16k budget, then the rest of the grid smallest first; a memory group not started
within the time budget is recorded as skipped for time. Memory: each group's steppers, graphs and caches are dropped,
cycles collected and torch's cache emptied before the next; ``memory_log`` has the device memory before each group
and what it did not give back.

Timing: a cache with static shapes (StaticCache and every kvlib cache) is captured in a CUDA graph (its capture
failing is recorded in ``capture_errors`` and the cell is timed eager, with ``graphed: false``; ``write_path`` is
the one-token write path a kvlib cache reports, where it reports one); the others run eager. A step slower than
:data:`SLOW_STEP_MS` is timed once per round (``steps_per_round``). The methods of a cell whose caches
fit in memory together are timed in interleaved rounds (:func:`kvlib.bench.timing.interleaved`), each
round a few steps (the profile's ``steps``); the median over rounds is reported. Where they do not fit
together, the cell is timed group by group (``group`` in each row). Time split: the same step with the
attention function replaced by a no-op that returns zeros of the output's shape (the cache write, e.g.
DynamicCache's torch.cat of the layer, projections, MLP, norms and logits unchanged; registered with
transformers' ``AttentionInterface``), so ``attention_ms = step_ms - noattn_ms``. Bytes: ``kv_bytes``
measured from the cache's tensors (kvlib's: ``kv_nbytes()``, every allocated page slot plus the page tables, equal
to :func:`paged_kv_bytes`; pages of 16 positions for the INT8 formats, 256 for kv4/kv4rl so that the INT4 kernel
reads whole tiles per page, ``block_size`` in each row); ``weight_bytes_read`` is every parameter except the
embedding table (a step reads B of its rows); ``kv_share`` = kv_bytes / (kv_bytes + weight_bytes_read) is
attention's share of the bytes a step reads, which bounds the end-to-end ratio at equal batch.
``peak_bytes``: weights + this cache + the step's measured transient. The time-split probe on a kvlib cache keeps
"kvlib" active and swaps its registered function for the no-op (any other active implementation would be handed
the whole pool dequantised by the cache, kvlib's observing path, and time that instead).

Fixed KV budget (``kv_budget_bytes``, default 100 GB): per method of ``Profile.budget_methods`` the largest batch
whose KV at S fits, from its measured bytes per token; tokens/s measured at that batch, each in a memory group of
its own, and the ratio against each bf16 peer at its own largest batch. The kv4rl fill writes its side buffer only
where its final content comes from (:func:`_fill_kv4rl`; same bits as a chunked ``update``).

On CPU (profile ci) a tiny config (2 layers, hidden 64) runs the same wiring on 3 shapes: never a speed claim.
Run it as a topic, ``python -m kvlib.bench e2e --profile gpu``; the book's tables, figure, goals and claims are
:mod:`kvlib.bench.e2e_report`.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvlib.bench.timing import allocator_state, interleaved, profile_device

REFERENCE = "dynamic-sdpa"
GRAPH_PEER = "static-sdpa"
PEERS = ("dynamic-sdpa", "static-sdpa", "hf-quanto-int4", "hf-hqq-int4")
OURS = ("dither-int8", "rtn-int8", "kv4", "kv4rl", "dither-int8-gated")
METHODS = PEERS + OURS
#: kvlib format and make_cache options of each of our methods
OUR_FORMAT = {"dither-int8": ("dither-int8", {"dither_layout": "h8"}), "rtn-int8": ("rtn-int8", {}),
              "kv4": ("kv4", {}), "kv4rl": ("kv4rl", {}), "dither-int8-gated": ("dither-int8", {"dither_layout": "h8"})}
#: the gate's own options: a fixed repair budget per layer and step, so that the gated step captures in a graph
GATE_OPTIONS = {"max_repairs_per_step": 8}
#: page size of each of our methods' pools: the INT4 kernel reads whole pages ("paged-tiles") only when a page is a
#: multiple of its block_n = 256 (else "paged-rows"); the INT8 kernels gather per token, so 16 (make_cache's default)
BLOCK_SIZE = {"kv4": 256, "kv4rl": 256}
DEFAULT_BLOCK = 16
#: our methods whose decode step takes the torch reference on CUDA (planned with the transient of one dequantised
#: layer; kernel_path says what ran). Empty: rtn-int8 decodes through the INT8 kernels' RTN-key mode ("int8-gluon"
#: in data/results/gpu/e2e.json); a method whose estimate is short runs again alone after an out-of-memory
REFERENCE_STEP: tuple[str, ...] = ()
#: our methods that keep a shadow of every stored K/V beside the pools (kvlib.gate, fp16 on the device)
SHADOWED = ("dither-int8-gated",)
HF_QUANT = {"hf-quanto-int4": ("quanto", 0), "hf-hqq-int4": ("hqq", 1)}  # backend, HF's axis for it
NOOP_ATTN = "kvlib_e2e_noop"
#: a decode step slower than this (ms, measured once after the warm-up) is timed once per round instead of
#: Profile.steps times (see Stepper.timer); each row says how many steps its rounds took (steps_per_round)
SLOW_STEP_MS = 250.0
#: extra positions a kvlib cache is sized for: each replayed step may append one position (if the cache keeps its own
#: length counter), so a timed step reads between S and S + HEADROOM positions (<= 1.6% more at S = 4k)
HEADROOM = 64
#: one query token over fully valid positions needs no mask (HF's eager decode passes none too). Given as the
#: per-layer-type mask mapping so that CUDA-graph capture takes the eager path: while capturing, HF's
#: create_causal_mask builds a full boolean mask, which turns SDPA's GQA path off (repeat_kv of the whole layer)
NO_MASK = {"full_attention": None, "sliding_attention": None}

QWEN25_7B = dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, head_dim=128, vocab_size=152064, max_position_embeddings=32768 + 1024,
                 rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e4,
            tie_word_embeddings=False)


@dataclass
class Profile:
    """The grid and the knobs of one profile."""

    model: dict
    batches: tuple[int, ...]
    ctxs: tuple[int, ...]
    #: what runs first, in this order: ("grid", (B, S)) cells and ("budget", S) fixed-budget cells; the rest of
    #: the grid follows, smallest B * S first
    head: tuple[tuple[str, Any], ...]
    budget_ctxs: tuple[int, ...]
    kv_budget_bytes: float
    rounds: int
    chunk: int
    time_budget_s: float
    hf_quant_max_tokens: int  # HF QuantizedCache only at B * S <= this (its eager dequantising step is slow)
    goal_cell: tuple[int, int]
    steps: int = 4  # decode steps per round
    #: methods timed at the fixed KV budget, in this order (the goal's first). Not there: the gated cache (its fp16
    #: shadow of every position doubles its memory: at the budget it does not fit beside the pools) and HF's
    #: QuantizedCache (its eager step at a few hundred sequences would take the time of the whole run)
    budget_methods: tuple[str, ...] = ("kv4rl", "static-sdpa", "dynamic-sdpa", "dither-int8", "kv4", "rtn-int8")

    @property
    def priority(self) -> tuple[tuple[int, int], ...]:
        return tuple(c for kind, c in self.head if kind == "grid")

    def cells(self) -> list[tuple[int, int]]:
        rest = sorted(((b, s) for b in self.batches for s in self.ctxs), key=lambda c: (c[0] * c[1], c))
        out = list(self.priority)
        out += [c for c in rest if c not in out]
        return out

    def plan(self) -> list[tuple[str, Any]]:
        """Everything the run does, in order: :attr:`head`, the budget cells it did not name, the rest of the grid."""
        out = list(self.head)
        out += [("budget", s) for s in self.budget_ctxs if ("budget", s) not in out]
        out += [("grid", c) for c in self.cells() if ("grid", c) not in out]
        return out


PROFILES = {
    # the goal cell (B=64, S=32k) and the 32k budget first, then the HF peer's cell (B=8, S=16k) and the 16k budget
    "gpu": Profile(QWEN25_7B, (1, 8, 32, 64), (4096, 16384, 32768),
                   head=(("grid", (64, 32768)), ("budget", 32768), ("grid", (8, 16384)), ("budget", 16384)),
                   budget_ctxs=(16384, 32768), kv_budget_bytes=100e9, rounds=5, chunk=4096, time_budget_s=420.0,
                   hf_quant_max_tokens=8 * 16384, goal_cell=(64, 32768)),
    "ci": Profile(TINY, (1, 2), (32,), head=(("grid", (2, 64)), ("budget", 64)), budget_ctxs=(64,),
                  kv_budget_bytes=40e3, rounds=2, chunk=16, time_budget_s=120.0, hf_quant_max_tokens=2 * 32,
                  goal_cell=(2, 64), steps=2),
}
PROFILES["cpu"] = PROFILES["ci"]

GOALS = (  # (name, method, kind, target); kind picks how the measured ratio is formed, see goals()
    ("KV bytes <= 0.55x bf16", "dither-int8", "bytes", 0.55), ("KV bytes <= 0.55x bf16", "rtn-int8", "bytes", 0.55),
    ("KV bytes <= 0.30x bf16", "kv4", "bytes", 0.30), ("KV bytes <= 0.30x bf16", "kv4rl", "bytes", 0.30),
    ("tokens/s >= 1.0x at the goal cell", "dither-int8", "speed", 1.0),
    ("tokens/s >= 2.0x at the goal cell", "kv4rl", "speed", 2.0),
    ("throughput >= 2.5x at the fixed KV budget, longest S", "kv4rl", "budget", 2.5),
    ("throughput about 1.4x at the fixed KV budget, longest S (with the 1.5x INT8 kernel)", "dither-int8", "budget",
     1.4),
    ("HF QuantizedCache beaten by >= 10x (kv4 over each peer, worst cell)", "kv4", "hf", 10.0),
)


class MethodUnavailable(RuntimeError):
    """A method cannot run here (missing package, missing cache API); the reason is recorded."""


# ------------------------------------------------------------------------------------------------ model
def model_config(shapes: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**shapes, attn_implementation="sdpa", use_cache=True)


def build_model(shapes: dict, device: str, dtype: torch.dtype = torch.bfloat16):
    """``Qwen2ForCausalLM`` with random weights allocated directly on ``device`` (no CPU init)."""
    from transformers import Qwen2ForCausalLM

    cfg = model_config(shapes)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    # the constructor leaves the init to from_pretrained in transformers 5: fill every parameter explicitly (no
    # uninitialised memory, reproducible); values do not change speed
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    _register_noop_attention()
    return model


def _register_noop_attention() -> None:
    """The time-split probe: attention replaced by zeros of its output's shape, the mask built as for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def noop(module, query, key, value, attention_mask, **kwargs):
        # standing in for kvlib's attention on purpose: take the cache's tag as kvlib's attention would, or the
        # cache's next update reads the step as a model that attended around kvlib (and refuses to go on)
        tag = getattr(key, "_kvlib", None)
        if tag is not None:
            key._kvlib, tag.consumed = None, True
        b, h, q, d = query.shape
        return query.new_zeros(b, q, h, value.shape[-1]), None

    AttentionInterface.register(NOOP_ATTN, noop)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NOOP_ATTN, sdpa_mask)


def weight_bytes(model) -> dict[str, int]:
    """Parameter bytes: all, and what one decode step reads (all but the embedding table)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    return {"total": total, "embedding": emb.numel() * emb.element_size(), "read_per_step": total - emb.numel()
            * emb.element_size()}


# ------------------------------------------------------------------------------------------------ bytes
def format_kv_bytes(fmt: str, *, layers: int, batch: int, kv_heads: int, ctx: int, d: int,
                    options: dict | None = None) -> float:
    """K+V bytes of ``batch`` sequences of ``ctx`` positions from the format's byte account (no page table)."""
    from kvlib.formats.base import get_format

    f = get_format(fmt, **(options or {}))
    fixed = f.fixed_bytes(d) if hasattr(f, "fixed_bytes") else 0
    return 2.0 * layers * batch * kv_heads * (ctx * f.bytes_per_position(d) + fixed)


def _format_options(opts: dict) -> dict:
    """make_cache options that are format constructor options too (the dither layout does not change bytes)."""
    return {k: v for k, v in opts.items() if k != "dither_layout"}


def block_size(method: str) -> int:
    """Page size our ``method``'s pools are made with (:data:`BLOCK_SIZE`)."""
    return BLOCK_SIZE.get(method, DEFAULT_BLOCK)


def paged_kv_bytes(fmt: str, *, layers: int, batch: int, kv_heads: int, max_len: int, d: int, block: int,
                   options: dict | None = None, crop_window: int = 32) -> int:
    """Bytes kvlib's static paged pools hold for ``batch`` rows of ``max_len`` positions: the format's bytes for
    every page slot (``max_len`` rounded up to whole pages), its per-row constants (kv4rl: side buffer and the
    crop stash of ``crop_window`` INT8 entries per side), and the int32 page tables (block table and lengths, plus
    per-token slot tables and write indices where codes are bound to their slot: dithered INT8). The account of
    :mod:`kvlib.backends` / ``tests/test_pools.py``, written from the formats and the page geometry."""
    from kvlib.formats.base import get_format

    f = get_format(fmt, **(options or {}))
    width = -(-max_len // block)
    slots = batch * width * block  # per layer and head
    out = 2 * layers * kv_heads * slots * f.bytes_per_position(d)
    if fmt == "kv4rl":
        out += 2 * layers * kv_heads * batch * (f.fixed_bytes(d) + crop_window * (d + 2))
    tables = batch * width + batch + (batch * max_len + batch if fmt == "dither-int8" else 0)
    return int(out + layers * 4 * tables)


def cache_bytes(cache) -> int:
    """KV bytes measured from the cache's tensors: ``kv_nbytes()`` for kvlib's; for HF's, each layer's K/V
    tensors (``QuantizedCache``: packed codes, scales and zero points plus the bf16 residual)."""
    if getattr(cache, "_kvlib", False):  # the pools and tables; a gated cache's shadow is reported beside them
        parts = getattr(cache, "nbytes_breakdown", None)
        if parts is None:
            return int(cache.kv_nbytes())
        b = parts()
        return int(b["pools"] + b["page_tables"])
    from kvlib.bench.peers_hf import held_bytes, layer_bytes

    total = 0
    for layer in cache.layers:
        if hasattr(layer, "_quantized_keys"):
            total += layer_bytes(layer)["held_bytes"]
        else:
            total += held_bytes([layer.keys, layer.values])
    return int(total)


# ------------------------------------------------------------------------------------------------ caches
def _require(cache, names: tuple[str, ...], method: str) -> None:
    missing = [n for n in names if not callable(getattr(cache, n, None))]
    if missing:
        raise MethodUnavailable(f"{method}: the kvlib cache ({type(cache).__name__}) lacks {missing} of the "
                                "kernel-cache API (kv_nbytes, kernel_path); cannot measure it")


def alloc_positions(method: str, ctx: int) -> int:
    """Positions per sequence the cache of ``method`` holds at the timed step (what its bytes are set against)."""
    if method in OUR_FORMAT:
        return ctx + HEADROOM
    if method == GRAPH_PEER:
        return ctx + 1
    return ctx  # DynamicCache is cropped back to ctx after each step; QuantizedCache grows a few tokens per round


def make_method_cache(method: str, config, *, batch: int, ctx: int, device: str, dtype: torch.dtype):
    """An empty cache for ``method`` sized for ``batch`` sequences of :func:`alloc_positions` positions;
    raises MethodUnavailable."""
    import kvlib

    if method == "dynamic-sdpa":
        from transformers import DynamicCache

        return DynamicCache(config=config)
    if method == "static-sdpa":
        from transformers import StaticCache

        cache = StaticCache(config=config, max_cache_len=ctx + 1)
        # early_initialization allocates the static tensors now (capturable; no lazy init inside the graph)
        if hasattr(cache, "early_initialization"):
            cache.early_initialization(batch, config.num_key_value_heads, config.head_dim, dtype, device)
        return cache
    if method in HF_QUANT:
        from transformers.cache_utils import QuantizedCache

        from kvlib.bench.peers_hf import ensure_peer_packages

        backend, axis = HF_QUANT[method]
        why = ensure_peer_packages().get(backend)
        if why is not None:
            raise MethodUnavailable(f"{method}: cannot import {backend}: {why}")
        return QuantizedCache(backend, config, nbits=4, axis_key=axis, axis_value=axis, q_group_size=64,
                              residual_length=128)
    if method in OUR_FORMAT:
        fmt, opts = OUR_FORMAT[method]
        build = kvlib.make_cache
        gated = method == "dither-int8-gated"
        if gated:
            # make_gated_cache's own block_size is the gate's repair block, not the page size: pools keep 16
            build = kvlib.make_gated_cache
            opts = {**opts, **GATE_OPTIONS}
        elif "batch_size" not in inspect.signature(build).parameters:
            raise MethodUnavailable(f"{method}: kvlib.make_cache{inspect.signature(build)} has no batch_size / "
                                    "max_len: the kernel-backed cache API is not in this kvlib")
        else:
            opts = {**opts, "block_size": block_size(method)}
        try:
            cache = build(fmt, config, batch_size=batch, max_len=ctx + HEADROOM, device=device, dtype=dtype, **opts)
        except Exception as e:  # noqa: BLE001 - any failure to build is this method's recorded reason
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise MethodUnavailable(f"{method}: {build.__name__}({fmt!r}, config, batch_size=, max_len=, device=, "
                                    f"dtype=, {opts}) failed: {type(e).__name__}: {first}") from e
        _require(cache, ("kv_nbytes", "kernel_path"), method)
        cache._kvlib = True
        return cache
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def fill(cache, config, *, batch: int, ctx: int, chunk: int, device: str, dtype: torch.dtype, seed: int = 0) -> None:
    """Write ``ctx`` synthetic K/V positions into every layer through ``cache.update`` in chunks of ``chunk``.

    HF's ``QuantizedCache`` gets the ``ctx`` positions in one update per layer (its prefill path: the first
    update quantises all it is given), since each later chunk would re-quantise the whole cache: a cost of
    filling, not of decoding.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, config.num_key_value_heads, min(chunk, ctx), config.head_dim)
    k = torch.randn(shape, generator=g, device=device, dtype=dtype)
    v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    if type(cache).__name__ == "QuantizedCache":
        reps = math.ceil(ctx / k.shape[2])
        kk, vv = (t.repeat(1, 1, reps, 1)[:, :, :ctx] for t in (k, v))
        for layer in range(config.num_hidden_layers):
            cache.update(kk, vv, layer, {"cache_position": torch.arange(ctx, device=device)})
        return
    if _rowwise_fill(cache):
        _fill_kv4rl(cache, config, k, v, ctx=ctx, chunk=chunk)
        return
    for start in range(0, ctx, chunk):
        n = min(chunk, ctx - start)
        pos = torch.arange(start, start + n, device=device)
        for layer in range(config.num_hidden_layers):
            cache.update(k[:, :, :n], v[:, :, :n], layer, {"cache_position": pos})


def _rowwise_fill(cache) -> bool:
    """kv4rl pools: a multi-token write keeps its side buffer and crop stash with a host loop over the tokens
    of every row it writes (``Int4Backend.write``'s chunk path), O(B^2 S) per layer over a fill (hours at B = 64,
    S = 32k), and O(B S) (95 s at B = 64, S = 32k) when written one row per call; :func:`_fill_kv4rl`."""
    backend = getattr(cache, "backend", None)
    return bool(getattr(cache, "_kvlib", False)) and getattr(backend, "family", None) == "int4" and bool(
        getattr(backend, "rl", False))


#: rows per call of the kv4rl side-buffer writes (the host loop costs rows x tokens per call)
RL_ROW_GROUP = 8


def kv4rl_segments(ctx: int, chunk: int, sink: int, tail: int) -> list[tuple[int, int, bool]]:
    """``(start, stop, side)`` pieces of a fill of ``ctx`` positions in chunks of ``chunk``: ``side`` where the
    kv4rl side buffer must be written (positions below ``sink``, and the last ``tail`` = recent + crop window
    positions), the codes only elsewhere. Pieces never cross a chunk boundary (position p holds chunk row p %
    chunk, as a chunked fill writes it)."""
    cuts = sorted({0, ctx, min(sink, ctx), max(ctx - tail, 0), *range(0, ctx, chunk)})
    out = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        if hi > lo:
            out.append((lo, hi, lo < sink or hi > ctx - tail))
    return out


def _fill_kv4rl(cache, config, k: torch.Tensor, v: torch.Tensor, *, ctx: int, chunk: int) -> None:
    """The kv4rl fill in O(B (sink + recent + crop window)) host work instead of O(B S): the INT4 codes of every
    position are written by the backend's vectorised path with its side buffer off (``backend.rl`` False for that
    call), and the side buffer (sinks, ring, crop stash) only where its final content comes from: the first
    ``sink`` and the last ``recent + crop_window`` positions, a few rows per call. What a position in between
    writes to the ring or the stash is overwritten by those last positions, so the pools hold the same bits as a
    chunked ``cache.update`` (tests/test_bench_e2e.py::test_kv4rl_fill_stores_what_update_stores)."""
    store = cache.backend
    tail = int(store.recent) + int(getattr(store, "undo", 0))
    for lo, hi, side in kv4rl_segments(ctx, chunk, int(store.sink), tail):
        a = lo % chunk
        kk, vv = k[:, :, a:a + hi - lo], v[:, :, a:a + hi - lo]
        for layer in range(config.num_hidden_layers):
            if side:
                _write_rows(cache, layer, kk, vv)
                continue
            store.rl = False
            try:
                cache.update(kk, vv, layer, {"cache_position": torch.arange(lo, hi, device=k.device)})
            finally:
                store.rl = True


def _write_rows(cache, layer: int, k: torch.Tensor, v: torch.Tensor, group: int = RL_ROW_GROUP) -> None:
    """``cache.update(k, v, layer)`` of a kvlib cache, ``group`` rows per call (the same layer write with a row
    mask, as the left-padded prefill does)."""
    la = cache.layers[layer]
    cache._check_states(k, v, layer)
    if not la.is_initialized:
        la.lazy_initialization(k, v)
    b, _, s, _ = k.shape
    for row in range(0, b, group):
        keep = torch.zeros(b, s, dtype=torch.bool, device=k.device)
        keep[row:row + group] = True
        la._write(k, v, keep)
    la.columns += s


# ------------------------------------------------------------------------------------------------ timing
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_KVLIB_ATTN = "kvlib"  # kvlib.hf.attention.NAME


@contextlib.contextmanager
def _attention_swapped(name: str, by: str):
    """transformers' attention function registered as ``name`` temporarily replaced by the one of ``by``."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    old = ALL_ATTENTION_FUNCTIONS[name]
    AttentionInterface.register(name, ALL_ATTENTION_FUNCTIONS[by])
    try:
        yield
    finally:
        AttentionInterface.register(name, old)


class Stepper:
    """One method at one cell: the decode step (graphed or eager), with and without attention."""

    def __init__(self, method: str, model, cache, *, batch: int, ctx: int, device: str, steps: int) -> None:
        self.method, self.model, self.cache, self.ctx, self.device = method, model, cache, ctx, device
        self.steps = steps
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.tensor([ctx], device=device)
        self.pos_ids = self.pos.view(1, 1).expand(batch, 1)
        self.static = method == GRAPH_PEER or getattr(cache, "_kvlib", False)
        self.kvlib = getattr(cache, "_kvlib", False)
        # make_cache makes "kvlib" the config's implementation (it delegates untagged K/V to the previous one);
        # HF's caches are timed with plain SDPA, the implementation the model was built with
        self.attn = _KVLIB_ATTN if self.kvlib and model.config._attn_implementation == _KVLIB_ATTN else "sdpa"
        self.graphs: dict[str, Any] = {}
        self.notes: list[str] = []
        self.capture_errors: list[str] = []
        self.steps_used: dict[str, int] = {}

    def _rewind(self) -> None:
        # StaticCache (transformers 5.17) writes at its own device-side counter, not at cache_position: set it back
        # to ctx so every replayed step writes position ctx (a memset per layer, inside the graph)
        if type(self.cache).__name__ == "StaticCache":
            for layer in self.cache.layers:
                if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    raise RuntimeError("StaticCache layer has no tensor cumulative_length to rewind (transformers "
                                       "changed); cannot keep the cache at S positions")
                layer.cumulative_length.fill_(self.ctx)

    def _forward(self, attn: str):
        self._rewind()
        cfg = self.model.config
        old = cfg._attn_implementation
        swap = contextlib.nullcontext()
        if self.attn == _KVLIB_ATTN and attn == NOOP_ATTN:
            # a kvlib cache hands any other active implementation the whole pool dequantised (its observing
            # path): the probe keeps "kvlib" active and swaps its function for the no-op, so the cache write
            # stays the decode step's own and only the attention goes
            swap, attn = _attention_swapped(_KVLIB_ATTN, NOOP_ATTN), _KVLIB_ATTN
        cfg._attn_implementation = attn
        try:
            with swap, torch.no_grad():
                out = self.model(input_ids=self.ids, past_key_values=self.cache, cache_position=self.pos,
                                 position_ids=self.pos_ids, attention_mask=NO_MASK, use_cache=True, logits_to_keep=1)
        finally:
            cfg._attn_implementation = old
        if not self.static:  # keep the cache at ctx positions: every step appends one (DynamicCache: a torch.cat)
            if type(self.cache).__name__ == "DynamicCache":
                self.cache.crop(-1)
        return out.logits

    def step_fn(self, attn: str) -> Callable[[], object]:
        """The step as a callable: a CUDA-graph replay for static caches on CUDA (capture failure recorded)."""
        if not (self.static and self.device == "cuda"):
            return lambda: self._forward(attn)
        if attn not in self.graphs:
            from kvlib.bench.timing import capture_graph

            try:
                graph, _ = capture_graph(lambda: self._forward(attn), warmup_iters=2)
                self.graphs[attn] = graph.replay
            except Exception as e:  # noqa: BLE001 - recorded; the cell says graphed: false
                # only the message is kept: the exception's traceback holds the frames of the step (the cache, the
                # group's steppers), and capture_graph has already released the failed capture's pool
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                del e
                torch.cuda.synchronize()
                what = "step" if attn != NOOP_ATTN else "no-attention probe"
                self.capture_errors.append(f"{what}: {why}")
                self.notes.append(f"CUDA-graph capture of the {what} failed ({why}); timed eager")
                self.graphs[attn] = lambda: self._forward(attn)
        return self.graphs[attn]

    @property
    def graphed(self) -> bool:
        """Whether the timed step replayed a CUDA graph (every kvlib cache and StaticCache is tried on CUDA)."""
        return self.static and self.device == "cuda" and not self.capture_errors

    def close(self) -> None:
        """Drop the graphs (their private pools live as long as they do) and the cache."""
        self.graphs.clear()
        self.cache = None
        self.model = None

    def timer(self, attn: str) -> Callable[[], float]:
        fn = self.step_fn(attn)
        fn()  # warm-up (compilation, autotuning, allocator)
        _sync(self.device)
        t0 = time.perf_counter()
        fn()
        _sync(self.device)
        # a step slower than SLOW_STEP_MS (an eager fallback at a large batch) is timed once per round, not
        # ``steps`` times: its launch overhead is negligible beside it, and the run's time budget is not
        steps = self.steps if (time.perf_counter() - t0) * 1e3 < SLOW_STEP_MS else 1
        self.steps_used[attn] = steps

        def t() -> float:
            if self.device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(steps):
                    fn()
                b.record()
                b.synchronize()
                return a.elapsed_time(b) / steps
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / steps

        return t


# ------------------------------------------------------------------------------------------------ the grid
def _free(device: str) -> int:
    if device != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info()
    return int(free)


def _cleanup(device: str) -> None:
    """Return every freed block to the device: collect cycles (steppers, graphs, cache layers point back at their
    cache), wait for the stream, empty torch's caching allocator."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def write_path(cache) -> str | None:
    """The one-token write path a kvlib cache reports, if it reports one (``write_path`` attribute or method on
    the cache or its backend; None before the caches expose it)."""
    for obj in (cache, getattr(cache, "backend", None)):
        w = getattr(obj, "write_path", None) if obj is not None else None
        if w is None:
            continue
        if callable(w):
            try:
                w = w(0)
            except TypeError:
                w = w()
        return None if w is None else str(w)
    return None


def estimate_kv_bytes(method: str, cfg, batch: int, ctx: int) -> float:
    """Bytes a method's cache needs at (batch, ctx), for planning (measured bytes are what is reported)."""
    kw = dict(layers=cfg.num_hidden_layers, batch=batch, kv_heads=cfg.num_key_value_heads,
              ctx=alloc_positions(method, ctx), d=cfg.head_dim)
    if method in OUR_FORMAT:  # the pools' own account (pages, tables) plus 2% for the allocator's rounding
        fmt, opts = OUR_FORMAT[method]
        extra = 0.0
        if method in REFERENCE_STEP:  # the step dequantises one layer: fp32 codes, scales, product, bf16 K/V, mask
            extra = 6 * format_kv_bytes("bf16", **kw) * 2 / cfg.num_hidden_layers
        if fmt == "dither-int8":  # the certificates the step keeps on the device: fp32 [B, Hq, max_len] per layer
            extra += cert_buffer_estimate(cfg, batch, ctx)
        if method in SHADOWED:  # make_gated_cache's default shadow: fp16 K/V of every page slot
            extra += paged_kv_bytes("bf16", layers=kw["layers"], batch=batch, kv_heads=kw["kv_heads"],
                                    max_len=ctx + HEADROOM, d=kw["d"], block=block_size(method))
        return extra + 1.02 * paged_kv_bytes(fmt, layers=kw["layers"], batch=batch, kv_heads=kw["kv_heads"],
                                     max_len=ctx + HEADROOM, d=kw["d"], block=block_size(method),
                                     options=_format_options(opts))
    if method in HF_QUANT:  # the packed cache plus the bf16 copy each step dequantises (one layer)
        return format_kv_bytes("bf16", **kw) * (0.3 + 2.0 / cfg.num_hidden_layers)
    extra = 1.0 / cfg.num_hidden_layers if method == REFERENCE else 0.0  # DynamicCache's torch.cat copy of a layer
    return format_kv_bytes("bf16", **kw) * (1.0 + extra)


def cert_buffer_estimate(cfg, batch: int, ctx: int) -> float:
    """Bytes of the certificates a dithered cache keeps on the device once it decodes (kvlib.hf.cache records them
    in an fp32 buffer [B, Hq, max_len] per layer): about a tenth of the INT8 pools at these shapes."""
    return 4.0 * cfg.num_hidden_layers * batch * cfg.num_attention_heads * (ctx + HEADROOM)


def cert_buffer_bytes(cache) -> int | None:
    """Bytes of a kvlib cache's on-device certificate buffers, measured from its layers (None: it keeps none)."""
    bufs = [getattr(la, "_cert_buf", None) for la in getattr(cache, "layers", [])]
    bufs = [b for b in bufs if isinstance(b, torch.Tensor)]
    return sum(b.numel() * b.element_size() for b in bufs) if bufs else None


def _work_bytes(cfg, batch: int) -> float:
    """Step transient (activations, fp32 logits of one token) plus the fill chunk and a safety margin."""
    return 4 * batch * (cfg.vocab_size + 8 * cfg.intermediate_size) + 2e9 * (cfg.hidden_size > 1024)


def run_cell(model, cfg, methods: list[str], *, batch: int, ctx: int, prof: Profile, device: str,
             dtype: torch.dtype, label: str = "grid", deadline: float | None = None,
             memlog: list | None = None) -> list[dict]:
    """Time ``methods`` at (batch, ctx): interleaved within groups that fit in memory together. A method whose
    group has not started by ``deadline`` (``time.perf_counter()``) is recorded as skipped for time. Each group's
    device memory before it starts and after it is released goes to ``memlog`` (and ``mem_before_group`` of its
    rows), so that memory a group did not give back shows in the result."""
    rows: dict[str, dict] = {}
    todo = []
    _cleanup(device)
    for m in methods:
        rows[m] = {"method": m, "batch": batch, "ctx": ctx, "cell": label}
        if m in HF_QUANT and batch * ctx > prof.hf_quant_max_tokens:
            rows[m].update(status="skipped", reason=f"HF QuantizedCache run only at B*S <= {prof.hf_quant_max_tokens} "
                           "(its eager step dequantises the whole cache; time budget)")
            continue
        need = estimate_kv_bytes(m, cfg, batch, ctx) + _work_bytes(cfg, batch)
        if need > _free(device):
            extra = " (with the gate's fp16 shadow of every position)" if m in SHADOWED else ""
            rows[m].update(status="skipped", reason=f"does not fit: needs ~{need / 1e9:.1f} GB{extra}, "
                           f"{_free(device) / 1e9:.1f} GB free beside the weights")
            continue
        todo.append((m, need))
    group = 0
    while todo:
        group += 1
        live: dict[str, Stepper] = {}
        _cleanup(device)
        free = _free(device)
        mem = {"cell": label, "batch": batch, "ctx": ctx, "group": group, "before": allocator_state(), "methods": []}
        for m, need in list(todo):
            if live and need > free:
                continue
            todo.remove((m, need))
            row = rows[m]
            if deadline is not None and not live and time.perf_counter() >= deadline:
                row.update(status="skipped", reason="time budget spent before its memory group started")
                continue
            row["group"] = group
            row["mem_before_group"] = mem["before"]
            mem["methods"].append(m)
            try:
                if device == "cuda":
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                cache = make_method_cache(m, cfg, batch=batch, ctx=ctx, device=device, dtype=dtype)
                t0 = time.perf_counter()
                ctx_mgr = _quanto_torch_unpack() if m == "hf-quanto-int4" else contextlib.nullcontext()
                with ctx_mgr:
                    fill(cache, cfg, batch=batch, ctx=ctx, chunk=prof.chunk, device=device, dtype=dtype)
                _sync(device)
                row["fill_s"] = time.perf_counter() - t0
                row["kv_bytes"] = cache_bytes(cache)
                if m in SHADOWED and callable(getattr(cache, "shadow_nbytes", None)):
                    row["shadow_bytes"] = int(cache.shadow_nbytes())
                if device == "cuda":  # the fill's transient above the cache it leaves (chunks, not float layers)
                    row["fill_transient_bytes"] = int(torch.cuda.max_memory_allocated() - base - row["kv_bytes"]
                                                      - row.get("shadow_bytes", 0))
                    row["layer_bf16_bytes"] = int(format_kv_bytes("bf16", layers=1, batch=batch,
                                                                  kv_heads=cfg.num_key_value_heads, ctx=ctx,
                                                                  d=cfg.head_dim))
                live[m] = Stepper(m, model, cache, batch=batch, ctx=ctx, device=device, steps=prof.steps)
                cache = None  # held by its Stepper only, so the group's memory goes when the group does
                free -= need
            except MethodUnavailable as e:
                row.update(status="unavailable", reason=str(e))
            except torch.cuda.OutOfMemoryError as e:
                msg = str(e)[:160]
                cache = e = None  # the traceback holds the fill's frames (the partial cache): drop it before cleanup
                if live:  # the estimate was short: try it again first in a group of its own
                    row.pop("group", None)
                    mem["methods"].remove(m)
                    todo.append((m, need))
                    continue
                row.update(status="oom", reason=f"out of memory while filling: {msg}")
            except Exception as e:  # noqa: BLE001 - one method failing must not stop the grid
                first = str(e).splitlines()[0][:240] if str(e) else ""
                row.update(status=_failed_status(m), reason=f"{m}: filling the cache failed: {type(e).__name__}: "
                           f"{first}")
                cache = e = None
        _cleanup(device)  # a failed fill's partial cache goes before the group is timed
        if live:
            _time_group(live, rows, model, prof, device)
        for st in live.values():
            st.close()
        live.clear()
        _cleanup(device)
        mem["after"] = allocator_state()
        if mem["before"] and mem["after"]:
            # what the group left behind: reserved bytes the allocator could not return
            mem["not_returned"] = mem["after"]["reserved"] - mem["before"]["reserved"]
        if memlog is not None and mem["methods"]:
            memlog.append(mem)
    return list(rows.values())


def _failed_status(method: str) -> str:
    """A gated slot that fails to fill reads "unavailable" (the gate refused this configuration, e.g. a shape its
    fixed repair budget cannot take, and said why in the reason); any other method's failure is an error."""
    return "unavailable" if method == "dither-int8-gated" else "error"


@contextlib.contextmanager
def _quanto_torch_unpack():
    from kvlib.bench.peers_hf import quanto_unpack

    with quanto_unpack("torch"):
        yield


def _time_group(live: dict[str, Stepper], rows: dict[str, dict], model, prof: Profile, device: str) -> None:
    timers: dict[str, Callable[[], float]] = {}
    for m, st in live.items():
        try:
            base = torch.cuda.memory_allocated() if device == "cuda" else 0
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with _quanto_torch_unpack() if m == "hf-quanto-int4" else contextlib.nullcontext():
                timers[m] = st.timer(st.attn)
                if st.kvlib:  # the decode path the step took (set while the step ran or was captured)
                    rows[m]["kernel_path"] = str(st.cache.kernel_path(0))
                timers[m + "|noattn"] = st.timer(NOOP_ATTN)
            if device == "cuda":
                rows[m]["step_transient_bytes"] = int(torch.cuda.max_memory_allocated() - base)
        except Exception as e:  # noqa: BLE001
            first = str(e).splitlines()[0][:240] if str(e) else ""
            rows[m].update(status=_failed_status(m), reason=f"{m}: decode step failed: {type(e).__name__}: {first}")
            e = None  # noqa: F841 - its traceback holds the group's frames
            timers.pop(m, None)
            timers.pop(m + "|noattn", None)
    # quanto's torch unpack patch must be active whenever its step runs inside the rounds
    wrapped = {k: (_with_quanto(f) if k.startswith("hf-quanto") else f) for k, f in timers.items()}
    res = interleaved(wrapped, prof.rounds)
    for m, st in live.items():
        if m not in timers:
            continue
        ms, per_round = res[m]
        na, _ = res[m + "|noattn"]
        row = rows[m]
        if ms is None:
            row.update(status="error", reason="every timed round failed")
            continue
        if st.kvlib and st.cache.kernel_path(0) != row.get("kernel_path"):  # a later step took another path
            row["kernel_path_changed_to"] = str(st.cache.kernel_path(0))
        row.update(status="ok", step_ms=ms, ms_per_token=ms, tokens_per_s=row["batch"] / (ms * 1e-3),
                   step_ms_rounds=per_round, noattn_ms=na, attention_ms=(ms - na) if na is not None else None,
                   graphed=st.graphed, graph_tried=st.static and device == "cuda",
                   steps_per_round=st.steps_used.get(st.attn), noattn_steps_per_round=st.steps_used.get(NOOP_ATTN),
                   capture_errors=list(st.capture_errors), attn_implementation=st.attn, notes=list(st.notes),
                   interleaved_with=sorted(x for x in live if x != m))
        if st.kvlib:
            row["write_path"] = write_path(st.cache)
            row["cert_buffer_bytes"] = cert_buffer_bytes(st.cache)  # telemetry beside the KV bytes, not in them


def _with_quanto(f: Callable[[], float]) -> Callable[[], float]:
    def g() -> float:
        with _quanto_torch_unpack():
            return f()
    return g


# ------------------------------------------------------------------------------------------------ derived
def annotate(rows: list[dict], cfg, wbytes: dict) -> None:
    """Ratios against the reference (and the graph peer) of the same cell, bytes shares, formula bytes."""
    by_cell: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_cell.setdefault((r["cell"], r["batch"], r["ctx"]), {})[r["method"]] = r
    for (_, b, s), ms in by_cell.items():
        if not b:  # a budget row that never got a batch
            continue
        ref, gp = ms.get(REFERENCE, {}), ms.get(GRAPH_PEER, {})
        for m, r in ms.items():
            n = r["positions"] = alloc_positions(m, s)
            shape = dict(layers=cfg.num_hidden_layers, batch=b, kv_heads=cfg.num_key_value_heads, ctx=n, d=cfg.head_dim)
            r["kv_bytes_bf16_formula"] = bf16 = format_kv_bytes("bf16", **shape)
            fmt, opts = OUR_FORMAT.get(m, ("bf16", {}))
            if m in OUR_FORMAT:  # what the static paged pools hold (pages, tables), see paged_kv_bytes
                r["block_size"] = block_size(m)
                r["kv_bytes_formula"] = paged_kv_bytes(fmt, layers=shape["layers"], batch=b,
                                                       kv_heads=shape["kv_heads"], max_len=s + HEADROOM,
                                                       d=shape["d"], block=block_size(m),
                                                       options=_format_options(opts))
            elif m not in HF_QUANT:
                r["kv_bytes_formula"] = format_kv_bytes(fmt, **shape, options=_format_options(opts))
            if r.get("status") != "ok":
                continue
            r["weight_bytes_read"] = wbytes["read_per_step"]
            r["kv_share"] = r["kv_bytes"] / (r["kv_bytes"] + wbytes["read_per_step"])
            r["kv_bytes_vs_bf16"] = r["kv_bytes"] / bf16
            r["peak_bytes"] = wbytes["total"] + r["kv_bytes"] + r.get("step_transient_bytes", 0)
            r["attention_frac"] = (r["attention_ms"] / r["step_ms"]) if r.get("attention_ms") is not None else None
        for r in ms.values():  # ratios once every row of the cell has its shares (rows come in any order)
            if r.get("status") != "ok":
                continue
            if ref.get("status") == "ok":
                r["speedup_vs_dynamic"] = r["tokens_per_s"] / ref["tokens_per_s"]
                r["ref_kv_share"] = ref["kv_share"]
            if gp.get("status") == "ok":
                r["speedup_vs_static_graph"] = r["tokens_per_s"] / gp["tokens_per_s"]


def bytes_per_token(rows: list[dict]) -> dict[str, float]:
    """Measured KV bytes per cached token (all layers, K+V), per method, from the largest cell it ran."""
    out: dict[str, tuple[int, float]] = {}
    for r in rows:
        if r.get("status") == "ok" and r["cell"] == "grid":
            n = r["batch"] * alloc_positions(r["method"], r["ctx"])
            if n > out.get(r["method"], (0, 0.0))[0]:
                out[r["method"]] = (n, r["kv_bytes"] / n)
    return {m: v for m, (_, v) in out.items()}


REF_LABEL = {REFERENCE: "DynamicCache + SDPA, eager (the reference peer)",
             GRAPH_PEER: "StaticCache + SDPA in a CUDA graph (the like-for-like bf16 peer)"}


def _find(rows: list[dict], method: str, cell: str, batch: int | None = None, ctx: int | None = None) -> dict:
    return next((r for r in rows if r["method"] == method and r["cell"] == cell
                 and (batch is None or r["batch"] == batch) and (ctx is None or r["ctx"] == ctx)), {})


def _why(row: dict, method: str, where: str) -> str:
    if not row:
        return f"{method} has no row {where}"
    return f"{method} {where}: {row.get('status')}: {row.get('reason', 'no timing')}"


def _split(row: dict) -> dict:
    """The time split and byte share of one timed row (None where not measured)."""
    return {"step_ms": row.get("step_ms"), "attention_ms": row.get("attention_ms"), "rest_ms": row.get("noattn_ms"),
            "kv_share": row.get("kv_share"), "batch": row.get("batch")}


def _where_time_went(g: dict) -> str:
    """For a missed speed goal: which part of the step (attention kernels or the rest) holds the gap."""
    o, r = g.get("ours") or {}, g.get("ref") or {}
    need = ("attention_ms", "rest_ms", "batch")
    if any(o.get(k) is None for k in need) or any(r.get(k) is None for k in need):
        return "no time split measured"
    # per sequence (tokens/s compares sequences per second): ms per step per sequence of each part
    oa, orr = o["attention_ms"] / o["batch"], o["rest_ms"] / o["batch"]
    ra, rr = r["attention_ms"] / r["batch"], r["rest_ms"] / r["batch"]
    target_total = (ra + rr) / g["target"]
    part = "attention kernels" if (oa - ra / g["target"]) >= (orr - rr / g["target"]) else "the rest of the step"
    return (f"per sequence and step: ours {oa:.3f} ms attention + {orr:.3f} ms rest = {oa + orr:.3f} ms; the reference "
            f"{ra:.3f} + {rr:.3f} ms; the goal needs <= {target_total:.3f} ms; the larger excess is in {part}")


def goals(result: dict) -> list[dict]:
    """Each goal with its measured ratio and met / missed (``None`` where not measured, with ``why_not_measured``).

    Speed and budget goals are judged against DynamicCache + SDPA (eager; the issue's reference) where it ran, else
    against the StaticCache CUDA-graph peer, and ``reference`` says which; the ratio against the graph peer and its
    verdict are given beside (``vs_static_graph``, ``met_vs_static_graph``), with the time split (attention kernels
    vs the rest) and the KV share of the bytes a step reads, of ours and of the reference."""
    rows = result["rows"]
    gb, gs = result["goal_cell"]
    bud = result["budget"]
    out = []
    for name, m, kind, target in GOALS:
        g: dict[str, Any] = {"goal": name, "method": m, "kind": kind, "target": target, "measured": None,
                             "met": None, "reference": None}
        if kind == "bytes":
            # judged at the goal cell (else the largest cell that ran): at real shapes page rounding and page tables
            # are well under 1%; at tiny shapes (ci) they are not, so the max over cells is reported beside it
            ok = [r for r in rows if r["method"] == m and r.get("status") == "ok" and r["cell"] == "grid"]
            if ok:
                at = next((r for r in ok if (r["batch"], r["ctx"]) == (gb, gs)), None) or max(
                    ok, key=lambda r: (r["batch"] * r["ctx"], r["ctx"]))
                g["measured"] = at["kv_bytes_vs_bf16"]
                g["where"] = f"B={at['batch']}, S={at['ctx']}"
                g["max_over_cells"] = max(r["kv_bytes_vs_bf16"] for r in ok)
                g["reference"] = "bf16 K/V bytes of the same positions"
                g["ours"] = _split(at)
            else:
                g["why_not_measured"] = _why(_find(rows, m, "grid", gb, gs), m, f"at B={gb}, S={gs}")
        elif kind in ("speed", "budget"):
            if kind == "speed":
                cell, b_, s_ = "grid", gb, gs
                g["where"] = f"B={gb}, S={gs} (equal batch)"
            else:
                s_ = max(bud["ctxs"]) if bud["ctxs"] else None
                cell, b_ = "budget", None
                g["where"] = (f"KV budget {bud['kv_budget_bytes'] / 1e9:g} GB, S={s_}, each method at its own "
                              "largest batch")
            ours = _find(rows + bud["rows"], m, cell, b_, s_)
            dyn = _find(rows + bud["rows"], REFERENCE, cell, b_, s_)
            stat = _find(rows + bud["rows"], GRAPH_PEER, cell, b_, s_)
            ok = [x for x in (dyn, stat) if x.get("status") == "ok"]
            if ours.get("status") != "ok":
                g["why_not_measured"] = _why(ours, m, g["where"])
            elif not ok:
                g["why_not_measured"] = "; ".join(_why(x, n, g["where"]) for x, n in ((dyn, REFERENCE),
                                                                                     (stat, GRAPH_PEER)))
            else:
                ref = ok[0]
                g["reference"] = ref["method"]
                g["reference_label"] = REF_LABEL[ref["method"]]
                if ref["method"] != REFERENCE:
                    g["reference_note"] = ("DynamicCache did not run here (" + _why(dyn, REFERENCE, g["where"])
                                           + "): judged against the StaticCache graph peer")
                g["measured"] = ours["tokens_per_s"] / ref["tokens_per_s"]
                g["ours"], g["ref"] = _split(ours), _split(ref)
                if dyn.get("status") == "ok":
                    g["vs_dynamic"] = ours["tokens_per_s"] / dyn["tokens_per_s"]
                if stat.get("status") == "ok":
                    g["vs_static_graph"] = ours["tokens_per_s"] / stat["tokens_per_s"]
                    g["met_vs_static_graph"] = g["vs_static_graph"] >= target
                    g["static"] = _split(stat)
                g["kv_share"] = ref.get("kv_share")  # the reference's share of the bytes a step reads
        elif kind == "hf":
            worst = None
            for r in rows:
                if r["method"] in HF_QUANT and r.get("status") == "ok":
                    same = (r["cell"], r["batch"], r["ctx"])
                    mine = next((x for x in rows if x["method"] == m and (x["cell"], x["batch"], x["ctx"]) == same
                                 and x.get("status") == "ok"), None)
                    if mine:
                        ratio = mine["tokens_per_s"] / r["tokens_per_s"]
                        if worst is None or ratio < worst[0]:
                            worst = (ratio, r, mine)
            g["where"] = "min over HF peers and cells where both ran"
            if worst is None:
                g["why_not_measured"] = "; ".join(
                    sorted({_why(r, r["method"], f"at B={r['batch']}, S={r['ctx']}") for r in rows
                            if r["method"] in HF_QUANT and r.get("status") != "ok"})[:2]) or "no HF peer ran"
            else:
                g["measured"], peer, mine = worst
                g["reference"] = peer["method"]
                g["where"] = f"B={peer['batch']}, S={peer['ctx']} (the worst cell where both ran)"
                g["ours"], g["ref"] = _split(mine), _split(peer)
                g["kv_share"] = peer.get("kv_share")
        if g["measured"] is not None:
            g["met"] = g["measured"] <= target if kind == "bytes" else g["measured"] >= target
            if g["met"] is False and kind != "bytes":
                g["where_time_went"] = _where_time_went(g)
        out.append(g)
    return out


# ------------------------------------------------------------------------------------------------ run
def run(profile: str, *, time_budget_s: float | None = None, kv_budget_bytes: float | None = None,
        methods: tuple[str, ...] = METHODS, progress: bool = True) -> dict:
    """The end-to-end decode benchmark; JSON-able result (see the module docstring).

    ``time_budget_s`` (env ``KVLIB_E2E_TIME_BUDGET_S``): cells not started by then are recorded as skipped;
    ``kv_budget_bytes`` (env ``KVLIB_E2E_KV_BUDGET_GB``): the fixed KV memory budget.
    """
    device = profile_device(profile)
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    unknown = set(methods) - set(METHODS)
    if unknown or REFERENCE not in methods:
        raise ValueError(f"methods must be among {METHODS} and include {REFERENCE!r}, got {methods!r}")
    prof = PROFILES[profile]
    # `python -m kvlib.bench e2e` passes only the profile: the budgets can come from the environment
    if time_budget_s is None:
        time_budget_s = float(os.environ.get("KVLIB_E2E_TIME_BUDGET_S") or prof.time_budget_s)
    if kv_budget_bytes is None:
        gb = os.environ.get("KVLIB_E2E_KV_BUDGET_GB")
        kv_budget_bytes = float(gb) * 1e9 if gb else prof.kv_budget_bytes
    budget_s, kv_budget = float(time_budget_s), float(kv_budget_bytes)
    if budget_s <= 0 or kv_budget <= 0:
        raise ValueError(f"time_budget_s and kv_budget_bytes must be positive, got {budget_s!r}, {kv_budget!r}")
    t_start = time.perf_counter()
    dtype = torch.bfloat16
    model = build_model(prof.model, device, dtype)
    cfg = model.config
    wbytes = weight_bytes(model)
    methods = list(methods)

    from tqdm.auto import tqdm

    rows: list[dict] = []
    memlog: list[dict] = []
    plan = prof.plan()
    budget_res: dict = {"kv_budget_bytes": kv_budget, "ctxs": list(prof.budget_ctxs), "max_batch": {},
                        "throughput_ratio": {}, "throughput_ratio_vs_static": {}, "bytes_per_token_source": {},
                        "methods": [m for m in prof.budget_methods if m in methods], "rows": []}
    bar = tqdm(plan, desc="e2e", disable=not progress)
    for kind, what in bar:
        left = budget_s - (time.perf_counter() - t_start)
        if kind == "grid":
            b, s = what
            bar.set_postfix_str(f"B={b} S={s}")
            if left <= 0:
                rows += [{"method": m, "batch": b, "ctx": s, "cell": "grid", "status": "skipped",
                          "reason": f"time budget of {budget_s:.0f} s spent"} for m in methods]
                continue
            rows += run_cell(model, cfg, methods, batch=b, ctx=s, prof=prof, device=device, dtype=dtype,
                             deadline=t_start + budget_s, memlog=memlog)
        else:
            bar.set_postfix_str(f"budget S={what}")
            budget_res["rows"] += _budget_cell(model, cfg, rows, what, kv_budget, methods, prof, device, dtype,
                                               t_start + budget_s, budget_res, memlog)
        _save_partial(rows, budget_res, memlog)
    annotate(rows + budget_res["rows"], cfg, wbytes)
    _budget_ratios(budget_res)
    result = {
        "device": device, "profile": profile, "speed_claim": device == "cuda",
        "weights": "random bf16 (speed does not depend on weight values); built directly on the device",
        "model": {"class": "Qwen2ForCausalLM", **prof.model}, "weight_bytes": wbytes,
        "methods": methods, "reference": REFERENCE, "graph_peer": GRAPH_PEER, "goal_cell": list(prof.goal_cell),
        "timing": (f"CUDA graph for static caches ({GRAPH_PEER} and kvlib's), eager otherwise; {prof.steps} steps per "
                   f"round, {prof.rounds} interleaved rounds within each memory group, median of rounds; HF "
                   "QuantizedCache steps grow its bf16 residual and never reach its 128-step re-quantisation "
                   "(kvlib.bench.peers_hf measures that flush)"),
        "time_split": f"attention_ms = step_ms - noattn_ms; noattn: the attention function replaced by {NOOP_ATTN!r} "
                      "(zeros of the output's shape; cache write and everything else unchanged)",
        "fill": "synthetic K/V through cache.update in chunks (one random chunk reused), no prefill",
        "mask": "none: one query token over fully valid positions (passed as the per-layer-type mapping, so the "
                "captured step takes the same SDPA path as the eager one)",
        "plan": [[k, list(w) if isinstance(w, tuple) else w] for k, w in plan],
        "memory_log": memlog,
        "memory_note": "memory_log: per memory group, the device memory before it (after the previous group was "
                       "released: gc.collect, synchronize, empty_cache) and after its own release; not_returned = "
                       "reserved bytes after minus before (0 when a group gives everything back)",
        "rows": rows, "budget": budget_res, "bytes_per_token": bytes_per_token(rows),
        "time_budget_s": budget_s, "wall_s": time.perf_counter() - t_start,
    }
    result["goals"] = goals(result)
    del model
    _cleanup(device)
    return result


def _save_partial(rows: list[dict], budget_res: dict, memlog: list | None = None) -> None:
    """Rows so far to ``$KVLIB_E2E_PARTIAL`` (if set) after each cell: a run killed by its caller's time limit
    still leaves what it measured (raw rows, no ratios)."""
    path = os.environ.get("KVLIB_E2E_PARTIAL")
    if path:
        import json

        with open(path, "w") as fh:
            json.dump({"partial": True, "rows": rows, "budget": budget_res, "memory_log": memlog or []}, fh,
                      default=str)


def _budget_cell(model, cfg, rows, ctx, kv_budget, methods, prof, device, dtype, deadline, res,
                 memlog=None) -> list[dict]:
    """Largest batch per method whose KV at ``ctx`` fits ``kv_budget`` (measured bytes/token); time it there, each
    method in a memory group of its own (its cache is about the budget)."""
    bpt = bytes_per_token(rows)
    for m in (REFERENCE, GRAPH_PEER):  # the bf16 peers hold exactly the bf16 bytes (a fallback if neither ran)
        if m not in bpt and any(x in bpt for x in (REFERENCE, GRAPH_PEER)):
            bpt[m] = next(bpt[x] for x in (REFERENCE, GRAPH_PEER) if x in bpt)
            res["bytes_per_token_source"][m] = "the other bf16 peer's measured bytes"
    out = []
    for m in methods:
        if m not in res["methods"]:
            out.append({"method": m, "batch": None, "ctx": ctx, "cell": "budget", "status": "skipped",
                        "reason": "not timed at the budget (Profile.budget_methods: the gated cache's fp16 shadow "
                                  "does not fit beside its pools there; HF QuantizedCache's eager step at hundreds "
                                  "of sequences would take the whole run's time)"})
    for m in res["methods"]:
        if m not in bpt:
            out.append({"method": m, "batch": None, "ctx": ctx, "cell": "budget", "status": "skipped",
                        "reason": "no measured bytes per token (did not run in the grid)"})
            continue
        res["bytes_per_token_source"].setdefault(m, "measured")
        bmax = int(kv_budget // (bpt[m] * ctx))
        res["max_batch"][f"{m}@{ctx}"] = bmax
        if bmax < 1:
            out.append({"method": m, "batch": 0, "ctx": ctx, "cell": "budget", "status": "skipped",
                        "reason": "not one sequence fits the KV budget"})
            continue
        if time.perf_counter() >= deadline:
            out.append({"method": m, "batch": bmax, "ctx": ctx, "cell": "budget", "status": "skipped",
                        "reason": "time budget spent"})
            continue
        out += run_cell(model, cfg, [m], batch=bmax, ctx=ctx, prof=prof, device=device, dtype=dtype, label="budget",
                        deadline=deadline, memlog=memlog)
    return out


def _budget_ratios(res: dict) -> None:
    """tokens/s of each method at its largest batch over the bf16 peers' at theirs (same S)."""
    by = {(r["method"], r["ctx"]): r for r in res["rows"] if r.get("status") == "ok"}
    for (m, s), r in by.items():
        for ref, key in ((REFERENCE, "throughput_ratio"), (GRAPH_PEER, "throughput_ratio_vs_static")):
            if (ref, s) in by:
                res[key][f"{m}@{s}"] = r["tokens_per_s"] / by[(ref, s)]["tokens_per_s"]
