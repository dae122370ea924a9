"""Batched KV4-RL storage probe: the fidelity probe of ``kv4rl-math.md`` at a cost a CPU can afford.

:func:`kvlib.fidelity.fidelity_probe` forces one path at a time and re-prefills the prompt for every
configuration; a stateful format (the KV4-RL side buffer) is re-read in full at every decode step.
This module runs the same probe on a batch of equal-length paths, following the paper's storage
probe (App. D.4): the context (prompt minus its last token) is prefilled once in full precision,
its K/V are *stored* in each format, and the forced continuation (last prompt token + response)
runs through the quantised cache. :class:`ProtectedCache` is an exact, fast view of the
``"kv4rl"`` format for this: each position's INT4 and protected (INT8 or bf16) reconstructions are
computed once when written, and a step's effective K/V takes the protected copy exactly at the
positions ``{p < sink} ∪ {p >= n - recent}`` of the current length ``n`` (what
``KV4RLFormat.read`` returns), so decode steps cost no re-read of the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from kvlib.fidelity import CacheSpec, ProbeResult, _is_chunkable, build_cache, compare_logits, probe_positions
from kvlib.formats.kv4 import rotates
from kvlib.formats.kv4rl import KV4RLFormat, int8_dequantize, int8_quantize
from kvlib.hadamard import hadamard

__all__ = ["ProtectedCache", "kv4rl_view", "corpus_prompts", "prefill_context", "sample_responses",
           "batched_probe"]


class _ProtectedLayer(CacheLayerMixin):
    """One layer: float INT4 reconstructions of all positions and the effective K/V handed to attention."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, fmt: KV4RLFormat) -> None:
        super().__init__()
        self.fmt = fmt
        self.n = 0
        self._main: list[torch.Tensor | None] = [None, None]  # [B, H, cap, d] INT4 reconstructions
        self._eff: list[torch.Tensor | None] = [None, None]  # effective values (protected where protected)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _encode(self, side: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f, d = self.fmt, x.shape[-1]
        flat = x.float().reshape(-1, d)
        main = f.main.read(f.main.write(flat, side=side))
        rot = rotates(f.rotate, side)
        xr = hadamard(flat) if rot else flat
        prot = int8_dequantize(*int8_quantize(xr)) if f.protect == "int8" else xr.to(torch.bfloat16).float()
        if rot:
            prot = hadamard(prot)
        return main.reshape(x.shape).to(self.dtype), prot.reshape(x.shape).to(self.dtype)

    def _grow(self, side: int, n_new: int, like: torch.Tensor) -> None:
        buf = self._main[side]
        if buf is None or buf.shape[-2] < n_new:
            cap = max(n_new, 2 * (0 if buf is None else buf.shape[-2]), 64)
            for store in (self._main, self._eff):
                grown = like.new_empty((*like.shape[:2], cap, like.shape[-1]))
                if store[side] is not None:
                    grown[:, :, : self.n] = store[side][:, :, : self.n]
                store[side] = grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s, w = self.fmt.sink, self.fmt.recent
        n_old, n_new = self.n, self.n + key_states.shape[-2]
        out = []
        for side, x in enumerate((key_states, value_states)):
            self._grow(side, n_new, x)
            main, prot = self._encode(side, x)
            m, e = self._main[side], self._eff[side]
            m[:, :, n_old:n_new] = main
            # positions that leave the recent window fall back to their INT4 reconstruction
            lo, hi = max(s, n_old - w), max(s, n_new - w)
            hi = min(hi, n_old)
            if hi > lo:
                e[:, :, lo:hi] = m[:, :, lo:hi]
            pos = torch.arange(n_old, n_new, device=x.device)
            keep = ((pos < s) | (pos >= max(s, n_new - w))).view(1, 1, -1, 1)
            e[:, :, n_old:n_new] = torch.where(keep, prot, main)
            out.append(e[:, :, :n_new])
        self.n = n_new
        return out[0], out[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n = 0
        self._main, self._eff = [None, None], [None, None]
        self.is_initialized = False


class ProtectedCache(Cache):
    """A transformers ``Cache`` equal to ``make_cache("kv4rl", config, **options)`` in what attention sees.

    Fast because nothing is re-read: see the module docstring. Options are those of ``KV4RLFormat``.
    """

    def __init__(self, config: Any, **options: Any) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.format = KV4RLFormat(**options)
        super().__init__(layers=[_ProtectedLayer(self.format) for _ in range(int(text.num_hidden_layers))])


def kv4rl_view(**options: Any) -> Callable[[Any], ProtectedCache]:
    """A cache spec (``config -> Cache``) for :class:`ProtectedCache` with ``KV4RLFormat`` options."""
    KV4RLFormat(**options)  # validate now, not inside the probe
    return lambda config: ProtectedCache(config, **options)


def corpus_prompts(tokenizer: Any, n: int, length: int) -> torch.Tensor:
    """``[n, length]`` token ids: consecutive non-overlapping windows of the corpus documents, taken
    round-robin over documents (window 0 of every document, then window 1, ...)."""
    from kvlib import corpus

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
    """Full-precision prefill of ``prompts[:, :-1]``; per layer ``(keys, values)`` ``[B, Hkv, P-1, d]``."""
    cache = DynamicCache()
    model(prompts[:, :-1].to(model.device), past_key_values=cache, use_cache=True)
    return [(la.keys, la.values) for la in cache.layers]


def _filled(spec: CacheSpec, model: Any, context: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    cache = build_cache(spec, model.config)
    for i, (k, v) in enumerate(context):
        cache.update(k.clone(), v.clone(), i)
    return cache


@torch.no_grad()
def sample_responses(model: Any, prompts: torch.Tensor, context: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     length: int, *, temperature: float = 1.0, seed: int = 0) -> torch.Tensor:
    """``[B, length]`` responses sampled at ``temperature`` (full vocabulary) with the full-precision cache,
    continuing ``context`` (the prefill of ``prompts[:, :-1]``); seeded, fixed length (no stop token)."""
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an int >= 2, got {length!r}")
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()  # full precision, without the per-stream loop of the fp32 format cache
    for i, (k, v) in enumerate(context):
        cache.update(k.clone(), v.clone(), i)
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
        mode = "chunk" if _is_chunkable(cache) else "decode"
    if mode == "chunk":
        return model(forced, past_key_values=cache, use_cache=True).logits[:, pos].float().cpu()
    want, rows = set(pos), []
    for r in range(forced.shape[1]):
        lg = model(forced[:, r:r + 1], past_key_values=cache, use_cache=True).logits[:, -1]
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
    :func:`prefill_context` results of those batches, reused instead of prefilling again.
    ``extra["seconds"]`` is each spec's wall time. Include ``{"repeat": None}`` to check that a
    same-process repeat gives zero KL.
    """
    if prompts.ndim != 2 or responses.ndim != 2 or prompts.shape[0] != responses.shape[0]:
        raise ValueError(f"prompts [N, P] and responses [N, L] must share N, got {tuple(prompts.shape)} "
                         f"and {tuple(responses.shape)}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    starts = range(0, prompts.shape[0], batch)
    if contexts is not None and len(contexts) != len(starts):
        raise ValueError(f"contexts must hold one prefill per batch of {batch} paths ({len(starts)}), "
                         f"got {len(contexts)}")
    pos = probe_positions(int(responses.shape[1]), n_positions)
    res = {name: {"kl": [], "top1": [], "path": [], "seconds": 0.0} for name in specs}
    for bi, b0 in enumerate(starts):
        pr, rs = prompts[b0:b0 + batch], responses[b0:b0 + batch]
        context = prefill_context(model, pr) if contexts is None else contexts[bi]
        ref = _forced(model, pr, rs, context, reference, pos, mode)
        for name, spec in specs.items():
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
