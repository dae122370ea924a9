"""Batched KV4-RL storage probe: the fidelity probe of ``kv4rl-math.md`` at a cost a CPU can afford.

:func:`kvlib.analysis.fidelity.fidelity_probe` forces one path at a time and re-prefills the prompt for every
configuration; the general cache adapter (:mod:`kvlib.hf.cache`) writes each (batch row, kv head)
stream separately and re-reads a stateful format (the KV4-RL side buffer) in full at every decode
step. This module runs the same probe on a batch of equal-length paths, following the paper's
storage probe (App. D.4): the context (prompt minus its last token) is prefilled once in full
precision and shared by every configuration; its K/V are *stored* in each format; the forced
continuation (last prompt token + response) runs through the quantised cache.

:class:`StorageCache` is an exact, vectorised view of a storage format for this: every update
quantises and reconstructs all (batch, head, position) vectors of a layer in one call, and keeps
float reconstructions. With protection (``sink``/``recent`` > 0, :class:`ProtectedCache`) it also
keeps each position's protected (INT8 or bf16) reconstruction. A decode step of length ``n`` sees
the protected copy exactly at ``{p < sink} ∪ {p >= max(sink, n - recent)}`` (what
``KV4RLFormat.read`` returns). A *chunk* of forced tokens is exact too: under
:func:`probe_attention`, the query at position ``t`` attends to the two disjoint regions (INT4 and
protected, as the step of length ``t + 1`` would see them) through one masked softmax (the paper's
exact regional merge, written as one softmax over both regions). So no configuration needs a
token-by-token loop, and the cost of a row is one chunked forward pass over the response.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from kvlib.analysis.fidelity import CacheSpec, ProbeResult, _is_chunkable, build_cache, compare_logits, probe_positions
from kvlib.core.hadamard import hadamard
from kvlib.formats.base import KVFormat, formats_where, get_format
from kvlib.formats.kv4 import check_rotate, rotates
from kvlib.formats.kv4rl import KV4RLFormat, int8_dequantize, int8_quantize, is_protected

__all__ = ["StorageCache", "ProtectedCache", "storage_view", "kv4rl_view", "protected_region", "probe_attention",
           "corpus_prompts", "prefill_context", "sample_responses", "batched_probe", "view_formats"]


def view_formats() -> list[str]:
    """Formats with an exact storage view: stateless (an old position never changes, so one write of every
    vector equals the cache's appends) and deterministic (``write`` depends on the vector alone, not on
    positions, slots or seed, so it can run over all (batch, head) streams at once)."""
    return formats_where(stateful=False, deterministic=True)
#: name under which :func:`probe_attention` registers the regional attention with transformers
REGIONAL_ATTN = "kvlib_probe_regional"


def protected_region(q_pos: torch.Tensor, n: int, sink: int, recent: int) -> torch.Tensor:
    """Bool ``[len(q_pos), n]``: ``M[i, p]`` is True when position ``p`` is protected at the step whose
    stream length is ``q_pos[i] + 1`` (``p < sink`` or ``p >= max(sink, q_pos[i] + 1 - recent)``)."""
    return is_protected(torch.arange(n, device=q_pos.device)[None], q_pos[:, None] + 1, sink, recent)


#: within :func:`_shared_encodings`: ``{key: (x, reconstruction)}`` of the shared context's K/V, so that the specs of
#: one batch that store the context in the same main format (KV4 and the KV4-RL views over it) or protect it alike
#: quantise it once. Formats of a view are deterministic (``write`` reads the vector alone): same input, same bits.
_ENCODINGS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
_SHAREABLE: set[int] = set()


@contextlib.contextmanager
def _shared_encodings(context: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Reuse the reconstructions of ``context``'s tensors (alive for the block) across the caches filled inside."""
    global _ENCODINGS, _SHAREABLE
    prev = _ENCODINGS, _SHAREABLE
    _ENCODINGS, _SHAREABLE = {}, {id(t) for kv in context for t in kv}
    try:
        yield
    finally:
        _ENCODINGS, _SHAREABLE = prev


def _format_key(fmt: KVFormat) -> tuple:
    return (type(fmt), *(repr(getattr(fmt, o, None)) for o in type(fmt).options))


def _memo(key: tuple | None, x: torch.Tensor, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    if key is None or _ENCODINGS is None:
        return fn()
    key = (*key, id(x))  # x is alive (the shared context), so its id names it; the entry keeps x to check
    hit = _ENCODINGS.get(key)
    if hit is not None and hit[0] is x:
        return hit[1]
    out = _ENCODINGS[key] = (x, fn())
    return out[1]


class _ViewLayer(CacheLayerMixin):
    """One layer: float reconstructions of every position (main format, and protected copies)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, main: KVFormat | None, sink: int, recent: int, protect: str, rotate: str) -> None:
        super().__init__()
        self.main, self.sink, self.recent, self.protect, self.rotate = main, sink, recent, protect, rotate
        self.protects = sink + recent > 0
        self.n = 0
        self.last = (0, 0)  # positions [start, stop) written by the last update (the queries of a chunk)
        self._bufs: dict[str, list[torch.Tensor | None]] = {"main": [None, None], "prot": [None, None],
                                                            "eff": [None, None]}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _encode(self, side: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Main-format and protected reconstructions of ``x [B, H, s, d]``, all vectors in one call each."""
        d = x.shape[-1]
        flat = x.float().reshape(-1, d)
        shared = id(x) in _SHAREABLE and x.dtype == self.dtype  # the shared context: encoded once per batch
        main = flat if self.main is None else _memo(
            ("main", _format_key(self.main), side) if shared else None, x,
            lambda: self.main.read(self.main.write(flat, side=side)))
        prot = None
        if self.protects:
            rot = rotates(self.rotate, side)

            def protected() -> torch.Tensor:
                xr = hadamard(flat) if rot else flat
                p = int8_dequantize(*int8_quantize(xr)) if self.protect == "int8" else xr.to(torch.bfloat16).float()
                if rot:
                    p = hadamard(p)
                return p.reshape(x.shape).to(self.dtype)

            prot = _memo(("prot", self.protect, rot, side) if shared else None, x, protected)
        return main.reshape(x.shape).to(self.dtype), prot

    def _buf(self, kind: str, side: int, n_new: int, like: torch.Tensor) -> torch.Tensor:
        store = self._bufs[kind]
        buf = store[side]
        if buf is None or buf.shape[-2] < n_new:
            # exact size for a chunk (the probe writes two chunks: context, forced tokens); doubling for steps
            step = like.shape[-2] == 1
            cap = max(n_new, 2 * (0 if buf is None else buf.shape[-2]), 64) if step else n_new
            grown = like.new_empty((*like.shape[:2], cap, like.shape[-1]))
            if buf is not None:
                grown[:, :, : self.n] = buf[:, :, : self.n]
            store[side] = buf = grown
        return buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s, w = self.sink, self.recent
        n_old, n_new = self.n, self.n + key_states.shape[-2]
        out = []
        for side, x in enumerate((key_states, value_states)):
            main, prot = self._encode(side, x)
            m = self._buf("main", side, n_new, main)
            m[:, :, n_old:n_new] = main
            if prot is None:
                out.append(m[:, :, :n_new])
                continue
            p = self._buf("prot", side, n_new, main)
            p[:, :, n_old:n_new] = prot
            e = self._buf("eff", side, n_new, main)
            # positions that leave the recent window fall back to their main-format reconstruction
            lo, hi = max(s, n_old - w), min(max(s, n_new - w), n_old)
            if hi > lo:
                e[:, :, lo:hi] = m[:, :, lo:hi]
            pos = torch.arange(n_old, n_new, device=x.device)
            keep = ((pos < s) | (pos >= max(s, n_new - w))).view(1, 1, -1, 1)
            e[:, :, n_old:n_new] = torch.where(keep, prot, main)
            out.append(e[:, :, :n_new])
        self.n, self.last = n_new, (n_old, n_new)
        return out[0], out[1]

    def regional(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of the last chunk's queries ``[B, Hq, q, d]``, each query seeing the protected set of
        its own step; returns ``[B, q, Hq, d]`` (the HF attention layout).

        Keys are the effective K/V at the chunk's final length plus protected copies of the band
        ``[a, b)`` of positions whose region depends on the query (protected for late queries, INT4
        for early ones); a boolean mask picks, per query, exactly one copy of each visible position.
        Positions below ``a`` (and not sinks) are INT4 for every query, positions from ``b`` on are
        protected for every query that sees them.
        """
        n_old, n = self.last
        dev = query.device
        q_pos = torch.arange(n_old, n, device=dev)
        causal = torch.arange(n, device=dev)[None] <= q_pos[:, None]
        kind = "eff" if self.protects else "main"
        k, v = self._bufs[kind][0][:, :, :n], self._bufs[kind][1][:, :, :n]
        mask = causal
        if self.protects:
            s, w = self.sink, self.recent
            a, b = max(s, n_old + 1 - w), max(s, n - w)
            if b > a:
                band = protected_region(q_pos, n, s, w)[:, a:b] & causal[:, a:b]
                mask = causal.clone()
                mask[:, a:b] &= ~band
                mask = torch.cat([mask, band], -1)
                k = torch.cat([k, self._bufs["prot"][0][:, :, a:b]], -2)
                v = torch.cat([v, self._bufs["prot"][1][:, :, a:b]], -2)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=mask[None, None], scale=scaling, enable_gqa=query.shape[1] != k.shape[1])
        return out.transpose(1, 2).contiguous()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n, self.last = 0, (0, 0)
        self._bufs = {"main": [None, None], "prot": [None, None], "eff": [None, None]}
        self.is_initialized = False


def _n_layers(config: Any) -> int:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


class StorageCache(Cache):
    """A transformers ``Cache`` holding float reconstructions of K/V stored in ``main`` (``None`` =
    full precision), optionally with ``sink`` + ``recent`` protected positions (INT8 or bf16, rotated
    like the keys of ``rotate``). What attention sees equals ``make_cache`` of the same format
    (tested); filling is one vectorised quantisation per layer and side.

    ``main`` must be one of :func:`view_formats` (formats that ignore positions and seeds).
    """

    def __init__(self, config: Any, main: KVFormat | None = None, *, sink: int = 0, recent: int = 0,
                 protect: str = "int8", rotate: str = "k") -> None:
        if main is not None:
            if not isinstance(main, KVFormat):
                raise TypeError(f"main must be a KVFormat or None, got {type(main).__name__}")
            if main.name not in view_formats():
                raise ValueError(f"main: format {main.name!r} has no exact storage view; "
                                 f"use one of {view_formats()}")
        KV4RLFormat(sink=sink, recent=recent, protect=protect, rotate=rotate)  # validates the protection options
        self.main_format, self.sink, self.recent, self.protect = main, sink, recent, protect
        self.rotate = check_rotate(rotate)
        super().__init__(layers=[_ViewLayer(main, sink, recent, protect, rotate) for _ in range(_n_layers(config))])


class ProtectedCache(StorageCache):
    """A transformers ``Cache`` equal to ``make_cache("kv4rl", config, **options)`` in what attention sees.

    Fast because nothing is re-read: see the module docstring. Options are those of ``KV4RLFormat``.
    """

    def __init__(self, config: Any, **options: Any) -> None:
        self.format = f = KV4RLFormat(**options)
        super().__init__(config, f.main, sink=f.sink, recent=f.recent, protect=f.protect, rotate=f.rotate)


def storage_view(fmt: str | None = None, **options: Any) -> Callable[[Any], StorageCache]:
    """A cache spec (``config -> Cache``) for :class:`StorageCache` of format ``fmt`` (``None``: full
    precision) with that format's ``options``; ``"kv4rl"`` gives :class:`ProtectedCache`."""
    if fmt == "kv4rl":
        return kv4rl_view(**options)
    main = None if fmt is None else get_format(fmt, **options)
    if main is not None and main.name not in view_formats():
        raise ValueError(f"fmt: format {fmt!r} has no exact storage view; use one of {view_formats()}")
    return lambda config: StorageCache(config, main)


def kv4rl_view(**options: Any) -> Callable[[Any], ProtectedCache]:
    """A cache spec (``config -> Cache``) for :class:`ProtectedCache` with ``KV4RLFormat`` options."""
    KV4RLFormat(**options)  # validate now, not inside the probe
    return lambda config: ProtectedCache(config, **options)


def _as_view(spec: CacheSpec) -> CacheSpec:
    """The storage view of a named spec when one exists (same K/V, vectorised); other specs unchanged."""
    if spec is None:
        return storage_view(None)
    name, opts = (spec, {}) if isinstance(spec, str) else spec if isinstance(spec, tuple) else (None, None)
    if name == "kv4rl" or name in view_formats():
        return storage_view(name, **dict(opts))
    return spec


def _probe_attention_fn(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = getattr(module, "_kvlib_cache", None)
    if isinstance(cache, StorageCache) and query.shape[2] > 1:
        return cache.layers[module.layer_idx].regional(query, kwargs.get("scaling")), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def probe_attention(model: Any) -> Iterator[Any]:
    """Within the block, a chunk of queries over a :class:`StorageCache` attends through
    :meth:`_ViewLayer.regional` (exact for protected views; GQA without copying K/V); single-token
    steps and other caches use transformers' SDPA as before. Restores the model's attention
    implementation on exit."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kvlib.hf.model import instrument

    AttentionInterface.register(REGIONAL_ATTN, _probe_attention_fn)
    AttentionMaskInterface.register(REGIONAL_ATTN, sdpa_mask)
    instrument(model)  # parks the cache on each attention module (forward pre-hook)
    previous = model.config._attn_implementation
    model.set_attn_implementation(REGIONAL_ATTN)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def corpus_prompts(tokenizer: Any, n: int, length: int) -> torch.Tensor:
    """``[n, length]`` token ids: consecutive non-overlapping windows of the corpus documents, taken
    round-robin over documents (window 0 of every document, then window 1, ...)."""
    from kvlib.analysis import corpus

    if not isinstance(n, int) or n < 1 or not isinstance(length, int) or length < 2:
        raise ValueError(f"n must be a positive int and length an int >= 2, got n={n!r}, length={length!r}")
    docs = [corpus.token_ids(d, tokenizer, max_len=10**7) for d in corpus.documents()]
    out, k = [], 0
    while len(out) < n:
        fresh = False
        for ids in docs:
            if ids.numel() >= (k + 1) * length and len(out) < n:
                out.append(ids[k * length:(k + 1) * length])
                fresh = True
        if not fresh:
            raise ValueError(f"the corpus has fewer than n={n} windows of {length} tokens")
        k += 1
    return torch.stack(out)


@torch.no_grad()
def prefill_context(model: Any, prompts: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Full-precision prefill of ``prompts[:, :-1]``; per layer ``(keys, values)`` ``[B, Hkv, P-1, d]``.
    Only the last position's logits are computed (the others are never used). The model's own K/V of these exact
    tokens are kept in the on-disk store of model computations (:mod:`kvlib.hf.memo`) and read back, bit for bit,
    when the same prefill was computed before."""
    from kvlib.hf.memo import memoized

    def compute() -> dict[str, torch.Tensor]:
        cache = DynamicCache()
        with torch.no_grad():
            model(prompts[:, :-1].to(model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return {f"{i}.{side}": t for i, la in enumerate(cache.layers) for side, t in (("k", la.keys), ("v", la.values))}

    out, _, _ = memoized("prefill_context", model, {"ids": prompts}, (compute,), compute)
    return [(out[f"{i}.k"].to(model.device), out[f"{i}.v"].to(model.device)) for i in range(len(out) // 2)]


def _filled(spec: CacheSpec, model: Any, context: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    cache = build_cache(spec, model.config)
    for i, (k, v) in enumerate(context):
        # a StorageCache copies what it stores; other caches may keep the tensors they are given
        cache.update(k, v, i) if isinstance(cache, StorageCache) else cache.update(k.clone(), v.clone(), i)
    return cache


class _AppendLayer(DynamicLayer):
    """A :class:`DynamicLayer` that writes appended K/V into a buffer of ``capacity`` positions and returns views of
    its filled part (the values of the growing ``torch.cat`` of ``DynamicLayer``, without re-copying every step)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self._n = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = key_states.new_empty((*key_states.shape[:-2], self.capacity, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:-2], self.capacity, value_states.shape[-1]))
        self.keys, self.values = self._k[..., :0, :], self._v[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self._n, key_states.shape[-2]
        if n + m > self.capacity:
            raise ValueError(f"_AppendLayer: {n + m} positions exceed the capacity {self.capacity}")
        self._k[..., n:n + m, :] = key_states
        self._v[..., n:n + m, :] = value_states
        self._n = n + m
        self.keys, self.values = self._k[..., :n + m, :], self._v[..., :n + m, :]
        return self.keys, self.values


@torch.no_grad()
def sample_responses(model: Any, prompts: torch.Tensor, context: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     length: int, *, temperature: float = 1.0, seed: int = 0) -> torch.Tensor:
    """``[B, length]`` responses sampled at ``temperature`` (full vocabulary) with the full-precision cache,
    continuing ``context`` (the prefill of ``prompts[:, :-1]``); seeded, fixed length (no stop token)."""
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an int >= 2, got {length!r}")
    g = torch.Generator().manual_seed(seed)
    # full precision, without the per-stream loop of the fp32 format cache; the layers append into room for the whole
    # response (a DynamicCache re-copies every layer's K/V with torch.cat at each step: half the sampling time)
    cap = context[0][0].shape[-2] + length
    cache = Cache(layers=[_AppendLayer(cap) for _ in context])
    for i, (k, v) in enumerate(context):
        cache.update(k, v, i)  # copied into the layer's buffer
    tok = prompts[:, -1:].to(model.device)
    out = []
    for _ in range(length):
        logits = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].double()
        p = torch.softmax(logits / temperature, -1).cpu()
        tok = torch.multinomial(p, 1, generator=g).to(model.device)
        out.append(tok)
    return torch.cat(out, 1).cpu()


@torch.no_grad()
def _forced(model: Any, prompts: torch.Tensor, responses: torch.Tensor, context: Any, spec: CacheSpec,
            pos: list[int], mode: str) -> torch.Tensor:
    """Logits ``[B, len(pos), V]`` (float32) predicting response tokens ``pos``."""
    cache = _filled(spec, model, context)
    forced = torch.cat([prompts[:, -1:], responses[:, :-1]], 1).to(model.device)
    if mode == "auto":
        mode = "chunk" if isinstance(cache, StorageCache) or _is_chunkable(cache) else "decode"
    with probe_attention(model):
        if mode == "chunk":
            keep = torch.tensor(pos, device=model.device)
            return model(forced, past_key_values=cache, use_cache=True, logits_to_keep=keep).logits.float().cpu()
        want, rows = set(pos), []
        for r in range(forced.shape[1]):
            lg = model(forced[:, r:r + 1], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            if r in want:
                rows.append(lg.float().cpu())
            if r >= max(pos):
                break
    return torch.stack(rows, 1)


def batched_probe(model: Any, prompts: torch.Tensor, responses: torch.Tensor, specs: dict[str, CacheSpec], *,
                  reference: CacheSpec = None, n_positions: int = 8, batch: int = 8, mode: str = "auto",
                  contexts: Sequence[Any] | None = None,
                  progress: Callable[[str], None] | None = None) -> list[ProbeResult]:
    """The KV4-RL probe over equal-length paths ``prompts [N, P]`` + ``responses [N, L]``.

    Every spec is forced along each path; ``KL(p_ref || q)`` at the ``n_positions`` states
    ``round(j (L-1)/(n-1))``. Paths run ``batch`` at a time; ``contexts`` (optional) are the
    :func:`prefill_context` results of those batches, reused instead of prefilling again. Named
    specs of :func:`view_formats`, ``"kv4rl"`` and ``None`` run through their :class:`StorageCache`
    view (chunked, exact). ``extra["seconds"]`` is each spec's wall time. Include
    ``{"repeat": None}`` to check that a same-process repeat gives zero KL.
    """
    if prompts.ndim != 2 or responses.ndim != 2 or prompts.shape[0] != responses.shape[0]:
        raise ValueError(f"prompts [N, P] and responses [N, L] must share N, got {tuple(prompts.shape)} "
                         f"and {tuple(responses.shape)}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if mode not in ("auto", "decode", "chunk"):
        raise ValueError(f"mode must be 'auto', 'decode' or 'chunk', got {mode!r}")
    starts = range(0, prompts.shape[0], batch)
    if contexts is not None and len(contexts) != len(starts):
        raise ValueError(f"contexts must hold one prefill per batch of {batch} paths ({len(starts)}), "
                         f"got {len(contexts)}")
    pos = probe_positions(int(responses.shape[1]), n_positions)
    ref_spec = _as_view(reference)
    views = {name: _as_view(spec) for name, spec in specs.items()}
    res = {name: {"kl": [], "top1": [], "path": [], "seconds": 0.0} for name in specs}
    for bi, b0 in enumerate(starts):
        pr, rs = prompts[b0:b0 + batch], responses[b0:b0 + batch]
        context = prefill_context(model, pr) if contexts is None else contexts[bi]
        ref = _forced(model, pr, rs, context, ref_spec, pos, mode)
        with _shared_encodings(context):  # a spec's seconds exclude encodings an earlier spec shared
            for name, spec in views.items():
                t0 = time.perf_counter()
                test = _forced(model, pr, rs, context, spec, pos, mode)
                res[name]["seconds"] += time.perf_counter() - t0
                m = compare_logits(ref.reshape(-1, ref.shape[-1]), test.reshape(-1, test.shape[-1]))
                res[name]["kl"].append(m["kl"])
                res[name]["top1"].append(m["top1"])
                res[name]["path"].append(np.repeat(np.arange(b0, b0 + pr.shape[0]), len(pos)))
        if progress is not None:
            progress(f"paths {b0 + pr.shape[0]}/{prompts.shape[0]}")
    return [ProbeResult(name, np.concatenate(r["kl"]), np.concatenate(r["top1"]), np.concatenate(r["path"]),
                        {"seconds": r["seconds"]}) for name, r in res.items()]
