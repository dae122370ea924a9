"""Teacher-forcing fidelity: force a reference token sequence through a quantised cache, compare logits.

Free greedy decoding is a poor quality metric (one diverging step separates the trajectories for
good), so every configuration is driven along the *same* token history and its next-token
distribution is compared with the reference one at each step: KL in float64 over the full
vocabulary, top-1 agreement and top-5 overlap (WitCert, real generation section).

The KV4-RL fidelity probe (``../shared/spec/kv4rl-math.md``) is :func:`fidelity_probe`: reference
responses sampled at temperature 1 with the full-precision cache, eight states per response at
``round(j (L-1) / 7)``, mean KL with a 95% bootstrap CI over response paths.

Cache construction is a ``spec``: a format name (``"kv4"``), a ``(format, options)`` pair, or a
callable ``config -> Cache``. ``None`` is the full-precision reference (``fp32`` passthrough).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvlib.hf.cache import KVFormatLayer, make_cache

CacheSpec = None | str | tuple[str, dict[str, Any]] | Callable[[Any], Any]


def build_cache(spec: CacheSpec, config: Any) -> Any:
    """A fresh cache for ``spec`` (see module docstring)."""
    # prefill="stored": the prompt's attention sees the stored K/V too (the analyses' semantics)
    if spec is None:
        return make_cache("fp32", config, prefill="stored")
    if isinstance(spec, str):
        return make_cache(spec, config, prefill="stored")
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
        return make_cache(spec[0], config, **{"prefill": "stored", **dict(spec[1])})
    if callable(spec):
        return spec(config)
    raise TypeError(f"spec must be None, a format name, (format, options) or a callable, got {spec!r}")


def cache_formats(names: Sequence[str], config: Any) -> tuple[list[str], list[str]]:
    """``(usable, offline)``: the formats of ``names`` that can back a cache, and the offline ones that
    cannot append token by token (make_cache refuses them with a ValueError saying so)."""
    ok, off = [], []
    for name in names:
        try:
            make_cache(name, config)
        except ValueError as e:
            if "cannot back a cache" not in str(e):
                raise
            off.append(name)
        else:
            ok.append(name)
    return ok, off


def _is_chunkable(cache: Any) -> bool:
    # Stateless formats give the same stored K/V whether tokens arrive one by one or in a chunk.
    from kvlib.hf.cache import _is_stateful

    layers = getattr(cache, "layers", [])
    return bool(layers) and all(
        isinstance(la, KVFormatLayer) and not any(_is_stateful(f) for f in la.formats) for la in layers
    )


@torch.no_grad()
def forced_logits(model: Any, ids: torch.Tensor, prompt_len: int, spec: CacheSpec = None, *,
                  mode: str = "auto", return_cache: bool = False, timings: dict[str, float] | None = None) -> Any:
    """Logits ``[N - P, V]`` (float32) predicting tokens ``P..N-1`` of ``ids [1, N]`` (``P = prompt_len``).

    The prompt is prefilled in one chunk; the continuation is fed one token per forward call
    (``mode="decode"``, what serving does) or in one chunk (``mode="chunk"``: same stored K/V for
    stateless formats, much faster). ``"auto"``: chunk when every format of the cache is stateless.
    ``timings``: a dict that receives ``prefill_s`` and ``continuation_s`` (wall seconds), and
    ``prefill_cpu_s`` / ``continuation_cpu_s`` (this process's CPU seconds: on a shared machine the wall time
    also counts the other processes' load, the CPU time only this work).
    """
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must have shape [1, N], got {tuple(ids.shape)}")
    out = forced_logits_batch(model, ids, prompt_len, spec, mode=mode, return_cache=return_cache, timings=timings)
    return (out[0][0], out[1]) if return_cache else out[0]


@torch.no_grad()
def forced_logits_batch(model: Any, ids: torch.Tensor, prompt_len: int, spec: CacheSpec = None, *,
                        mode: str = "auto", return_cache: bool = False,
                        timings: dict[str, float] | None = None) -> Any:
    """:func:`forced_logits` for a batch ``ids [B, N]`` of equal-length sequences (no padding): logits
    ``[B, N - P, V]``, every row forced through one batched cache (one forward per step for all rows)."""
    import time

    if ids.ndim != 2 or ids.shape[0] < 1:
        raise ValueError(f"ids must have shape [B, N], got {tuple(ids.shape)}")
    n = ids.shape[1]
    if not isinstance(prompt_len, int) or not 1 <= prompt_len < n:
        raise ValueError(f"prompt_len must be an int in [1, {n - 1}], got {prompt_len!r}")
    if mode not in ("auto", "decode", "chunk"):
        raise ValueError(f"mode must be 'auto', 'decode' or 'chunk', got {mode!r}")
    ids = ids.to(model.device)
    cache = build_cache(spec, model.config)
    if mode == "auto":
        mode = "chunk" if _is_chunkable(cache) else "decode"
    t0, c0 = time.perf_counter(), time.process_time()
    # logits_to_keep=1: the prompt's last row only (the full [B, P, V] logits would be gigabytes at P = 2k)
    rows = [model(ids[:, :prompt_len], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:]]
    t1, c1 = time.perf_counter(), time.process_time()
    if mode == "chunk":
        if n - 1 > prompt_len:
            rows.append(model(ids[:, prompt_len:n - 1], past_key_values=cache, use_cache=True).logits)
    else:
        for i in range(prompt_len, n - 1):
            rows.append(model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits)
    out = torch.cat(rows, 1).float()
    if timings is not None:
        timings.update(prefill_s=t1 - t0, continuation_s=time.perf_counter() - t1, prefill_cpu_s=c1 - c0,
                       continuation_cpu_s=time.process_time() - c1)
    return (out, cache) if return_cache else out


def compare_logits(ref: torch.Tensor, test: torch.Tensor, k: int = 5) -> dict[str, np.ndarray]:
    """Per-row ``kl`` = D_KL(p_ref || p_test) (float64, full vocabulary), ``top1`` agreement (0/1)
    and ``topk`` overlap ``|top-k(ref) ∩ top-k(test)| / k``."""
    if ref.shape != test.shape or ref.ndim != 2:
        raise ValueError(f"ref and test must be [T, V] of one shape, got {tuple(ref.shape)} and {tuple(test.shape)}")
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(test.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    top1 = (ref.argmax(-1) == test.argmax(-1)).double()
    tr = ref.topk(k, -1).indices
    tt = test.topk(k, -1).indices
    overlap = (tr.unsqueeze(-1) == tt.unsqueeze(-2)).any(-1).double().sum(-1) / k
    return {"kl": kl.cpu().numpy(), "top1": top1.cpu().numpy(), f"top{k}": overlap.cpu().numpy()}


@dataclass
class ForcingResult:
    """Per-step fidelity of one configuration against the reference along one forced sequence."""

    name: str
    kl: np.ndarray
    top1: np.ndarray
    top5: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "steps": int(self.kl.size), "kl_mean": float(self.kl.mean()),
                "kl_max": float(self.kl.max()), "top1": float(self.top1.mean()),
                "top5": float(self.top5.mean()), **self.extra}


def teacher_forcing(model: Any, ids: torch.Tensor, prompt_len: int, specs: dict[str, CacheSpec], *,
                    reference: CacheSpec = None, mode: str = "auto") -> list[ForcingResult]:
    """Force ``ids`` through each cache in ``specs`` and compare with ``reference`` step by step."""
    ref = forced_logits(model, ids, prompt_len, reference, mode="decode" if mode == "decode" else "chunk")
    out = []
    for name, spec in specs.items():
        test, cache = forced_logits(model, ids, prompt_len, spec, mode=mode, return_cache=True)
        m = compare_logits(ref, test)
        extra = {}
        if hasattr(cache, "kv_nbytes"):
            extra["packed_bytes"] = cache.kv_nbytes()
        out.append(ForcingResult(name, m["kl"], m["top1"], m["top5"], extra))
    return out


# ----------------------------------------------------------------------------- KV4-RL probe
def probe_positions(length: int, n: int = 8) -> list[int]:
    """The ``n`` states ``round(j (L-1) / (n-1))``, ``j = 0..n-1``, of a response of length ``L``."""
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if n == 1:
        return [0]
    # round half to even, like Python's round and numpy's
    return [int(round(j * (length - 1) / (n - 1))) for j in range(n)]


@dataclass
class Path:
    """One reference response: prompt ids and the sampled response ids (1-D)."""

    prompt: torch.Tensor
    response: torch.Tensor

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.prompt, self.response])[None]


@torch.no_grad()
def reference_responses(model: Any, prompts: Sequence[torch.Tensor], *, max_new_tokens: int = 64,
                        temperature: float = 1.0, seed: int = 0, min_new_tokens: int = 2) -> list[Path]:
    """Sample one response per prompt at ``temperature`` with the full-precision sampler (seeded)."""
    paths = []
    for i, p in enumerate(prompts):
        p = torch.as_tensor(p).reshape(-1)
        torch.manual_seed(seed + i)
        g = model.generate(p[None].to(model.device), do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                           max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                           past_key_values=make_cache("fp32", model.config))
        paths.append(Path(p.cpu(), g[0, p.numel():].cpu()))
    return paths


@dataclass
class ProbeResult:
    """Full-vocabulary KL at the probe states of every path, for one configuration."""

    name: str
    kl: np.ndarray  # [n_paths * 8]
    top1: np.ndarray
    path: np.ndarray  # path index of each state (bootstrap clusters)
    extra: dict[str, Any] = field(default_factory=dict)

    def ci(self, n_resamples: int = 10000, seed: int = 0) -> tuple[float, float, float]:
        """Mean KL and its 95% CI, bootstrapping whole paths (a path's eight states stay together)."""
        from kvlib.analysis.stats import cluster_bootstrap_mean_ci

        if np.unique(self.path).size < 2:
            m = float(self.kl.mean())
            return m, m, m
        return cluster_bootstrap_mean_ci(self.kl, self.path, n_resamples=n_resamples, seed=seed)

    def summary(self, n_resamples: int = 10000, seed: int = 0) -> dict[str, Any]:
        mean, lo, hi = self.ci(n_resamples, seed)
        return {"name": self.name, "states": int(self.kl.size), "kl_mean": mean, "kl_low": lo, "kl_high": hi,
                "top1": float(self.top1.mean()), **self.extra}


def fidelity_probe(model: Any, paths: Sequence[Path], specs: dict[str, CacheSpec], *,
                   reference: CacheSpec = None, n_positions: int = 8, mode: str = "auto") -> list[ProbeResult]:
    """KV4-RL probe: every spec forced along each path; KL(p_ref || q) at ``n_positions`` states per path.

    ``specs`` may include the reference itself (e.g. ``{"repeat": None}``): a same-process repeat
    must give exactly zero KL.
    """
    results = {name: {"kl": [], "top1": [], "path": []} for name in specs}
    for pi, path in enumerate(paths):
        ids = path.ids
        P, L = path.prompt.numel(), path.response.numel()
        pos = probe_positions(L, n_positions)
        ref = forced_logits(model, ids, P, reference, mode=mode)[pos]
        for name, spec in specs.items():
            test = forced_logits(model, ids, P, spec, mode=mode)[pos]
            m = compare_logits(ref, test)
            results[name]["kl"].append(m["kl"])
            results[name]["top1"].append(m["top1"])
            results[name]["path"].append(np.full(len(pos), pi))
    return [ProbeResult(name, np.concatenate(r["kl"]), np.concatenate(r["top1"]), np.concatenate(r["path"]))
            for name, r in results.items()]


def geometric_kl_ratio(a: ProbeResult, b: ProbeResult, n_resamples: int = 10000,
                       seed: int = 0, floor: float = 1e-12) -> tuple[float, float, float]:
    """Paired geometric mean ratio ``exp(mean(log KL_a - log KL_b))`` over states, with a path-bootstrap CI."""
    from kvlib.analysis.stats import paired_bootstrap_ci

    if not np.array_equal(a.path, b.path):
        raise ValueError("a and b must come from the same paths and positions")
    la, lb = np.log(np.maximum(a.kl, floor)), np.log(np.maximum(b.kl, floor))
    d, lo, hi = paired_bootstrap_ci(la, lb, n_resamples=n_resamples, seed=seed, groups=a.path)
    return float(np.exp(d)), float(np.exp(lo)), float(np.exp(hi))


def kl_mean_ratio(a: ProbeResult, b: ProbeResult, n_resamples: int = 10000,
                  seed: int = 0) -> tuple[float, float, float]:
    """Ratio of mean KLs ``mean(KL_a) / mean(KL_b)`` (the paper's "cuts mean KL 7.0x" is KV4 over KV4-RL)
    and its 95% percentile CI from a bootstrap over paths: a path's states stay together and both
    rows are resampled alike (paired)."""
    from scipy.stats import bootstrap

    if not np.array_equal(a.path, b.path):
        raise ValueError("a and b must come from the same paths and positions")
    paths, inv = np.unique(a.path, return_inverse=True)
    sa = np.bincount(inv, weights=a.kl)
    sb = np.bincount(inv, weights=b.kl)
    if sb.sum() <= 0:
        raise ValueError("b: mean KL is zero, the ratio is undefined")
    ratio = float(sa.sum() / sb.sum())
    if paths.size < 2:
        return ratio, ratio, ratio
    res = bootstrap((sa, sb), lambda x, y, axis=-1: x.sum(axis) / y.sum(axis), paired=True, vectorized=True,
                    n_resamples=n_resamples, method="percentile", random_state=np.random.default_rng(seed))
    return ratio, float(res.confidence_interval.low), float(res.confidence_interval.high)
